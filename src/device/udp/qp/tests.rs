//! Unit tests of the queue pair's send path: errors the kernel returns on a send.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use super::*;
use crate::device::{DeviceCompletion, QpAttr, QpType, QueuePair, SendWr, Status};
use crate::fault::{Rng, test_seed};

fn srd_qp(inject: Option<(i32, u64)>) -> UdpQp {
    let mut cfg = UdpConfig::default();
    cfg.mtu = cfg.effective_mtu();
    let cfg = Arc::new(cfg);
    let qp = UdpQp::create(
        cfg,
        Arc::new(DeviceCounters::default()),
        QpAttr::new(QpType::Srd),
        None,
    )
    .expect("create qp");
    qp.shared.state.lock().sender.inject = inject.map(|(e, n)| (e, n, 0));
    qp
}

fn poll_all(qp: &mut UdpQp, out: &mut Vec<DeviceCompletion>) {
    qp.poll(out, 64);
}

/// Sends `n` datagrams a → b while a's sends fail with `errno` every `every`-th time (and b's
/// acknowledgements every fifth time with `ENOBUFS`); returns a's send and b's receive
/// completions once all arrived (or the deadline passed).
fn exchange(
    errno: i32,
    every: u64,
    n: usize,
    seed: u64,
) -> (Vec<DeviceCompletion>, Vec<DeviceCompletion>) {
    let mut a = srd_qp(Some((errno, every)));
    let mut b = srd_qp(Some((libc::ENOBUFS, 5)));
    let mut rng = Rng::new(seed);
    for i in 0..n {
        b.post_recv(i as u64, BytesMut::with_capacity(4096))
            .unwrap();
    }
    for i in 0..n {
        let len = rng.below(4000) as usize + 1;
        let payload: Vec<u8> = (0..len).map(|k| (i + k) as u8).collect();
        a.post_send(SendWr {
            wr_id: i as u64,
            dest: b.addr(),
            hdr: Bytes::copy_from_slice(&(i as u32).to_le_bytes()),
            payload: Bytes::from(payload),
            imm: None,
        })
        .unwrap();
    }
    let (mut sent, mut got) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(30);
    let failed = |sent: &Vec<DeviceCompletion>| sent.iter().any(|c| !c.status.is_ok());
    while (sent.len() < n || (got.len() < n && !failed(&sent))) && Instant::now() < deadline {
        poll_all(&mut a, &mut sent);
        poll_all(&mut b, &mut got);
    }
    (sent, got)
}

/// Defect 3 of issue 17: a send the kernel refuses for a moment (`EPERM` from a firewall,
/// `ENOBUFS`, `EAGAIN`, `ECONNREFUSED` from an ICMP error, an unreachable route) is a loss that
/// SRD recovers by retransmission; every message arrives exactly once, intact, and every send
/// completes `Success`.
#[test]
fn transient_send_errors_are_losses_srd_recovers() {
    let seed = test_seed();
    for errno in [
        libc::EPERM,
        libc::ENOBUFS,
        libc::EAGAIN,
        libc::ECONNREFUSED,
        libc::EHOSTUNREACH,
    ] {
        let n = 200;
        let (sent, got) = exchange(errno, 3, n, seed);
        assert_eq!(
            sent.len(),
            n,
            "seed {seed}, errno {errno}: send completions"
        );
        assert_eq!(
            got.len(),
            n,
            "seed {seed}, errno {errno}: receive completions"
        );
        for c in &sent {
            assert_eq!(
                c.status,
                Status::Success,
                "seed {seed}, errno {errno}: {c:?}"
            );
        }
        let mut seen = HashSet::new();
        for c in &got {
            assert_eq!(c.status, Status::Success, "seed {seed}, errno {errno}");
            let buf = c.buf.as_ref().unwrap();
            let i = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
            assert!(
                seen.insert(i),
                "seed {seed}, errno {errno}: message {i} twice"
            );
            assert!(
                buf[4..]
                    .iter()
                    .enumerate()
                    .all(|(k, b)| *b == (i + k) as u8),
                "seed {seed}, errno {errno}: message {i} corrupted"
            );
        }
    }
}

/// A permanent refusal (`EACCES`: a broadcast address without `SO_BROADCAST`) still fails the
/// send, at once, with `UnreachableRemote`.
#[test]
fn permanent_send_errors_fail_the_send() {
    let (sent, _) = exchange(libc::EACCES, 1, 3, test_seed());
    assert_eq!(sent.len(), 3);
    for c in &sent {
        assert_eq!(c.status, Status::UnreachableRemote, "{c:?}");
    }
}

#[test]
fn transient_classification() {
    for e in [
        libc::EPERM,
        libc::ENOBUFS,
        libc::EAGAIN,
        libc::ENOMEM,
        libc::ECONNREFUSED,
        libc::EHOSTUNREACH,
        libc::ENETUNREACH,
        libc::EINTR,
    ] {
        assert!(transient(&io::Error::from_raw_os_error(e)), "errno {e}");
    }
    for e in [
        libc::EACCES,
        libc::EAFNOSUPPORT,
        libc::EINVAL,
        libc::EMSGSIZE,
    ] {
        assert!(!transient(&io::Error::from_raw_os_error(e)), "errno {e}");
    }
}
