//! Helpers for tests at the device seam (`Device` / `QueuePair`): work requests, queue pair
//! attributes, and polling several queue pairs until a condition holds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use efa::RawAddr;
use efa::device::{DeviceCompletion, QpAttr, QpType, QueuePair, SendWr};
use efa::notify::Notifier;

/// A queue pair behind the seam.
pub type Qp = Box<dyn QueuePair>;

/// Overall deadline of one wait: generous, only there to fail instead of hanging.
pub const SEAM_DEADLINE: Duration = Duration::from_secs(60);

/// A send work request of `hdr` and `payload` (copied).
pub fn wr(wr_id: u64, dest: RawAddr, hdr: &[u8], payload: &[u8], imm: Option<u32>) -> SendWr {
    SendWr {
        wr_id,
        dest,
        hdr: Bytes::copy_from_slice(hdr),
        payload: Bytes::copy_from_slice(payload),
        imm,
    }
}

/// Default attributes of a `ty` queue pair that signals `n`.
pub fn attr(ty: QpType, n: &Arc<Notifier>) -> QpAttr {
    let mut a = QpAttr::new(ty);
    a.notifier = n.clone();
    a
}

/// One pass over `qps` (after `pump`): completions tagged with the index of their queue pair.
/// Returns how many came.
pub fn poll_once(
    qps: &mut [&mut Qp],
    pump: &dyn Fn(),
    out: &mut Vec<(usize, DeviceCompletion)>,
) -> usize {
    pump();
    let mut got = 0;
    let mut buf = Vec::new();
    for (i, q) in qps.iter_mut().enumerate() {
        got += q.poll(&mut buf, 64);
        out.extend(buf.drain(..).map(|c| (i, c)));
    }
    got
}

/// Polls every queue pair until `done` says so, sleeping on the shared notifier in between
/// (a loopback network is pumped by `pump`).
pub fn poll_until_with(
    qps: &mut [&mut Qp],
    n: &Notifier,
    pump: &dyn Fn(),
    what: &str,
    mut done: impl FnMut(&[(usize, DeviceCompletion)]) -> bool,
) -> Vec<(usize, DeviceCompletion)> {
    let deadline = Instant::now() + SEAM_DEADLINE;
    let mut all = Vec::new();
    loop {
        let seen = n.generation();
        let got = poll_once(qps, pump, &mut all);
        if done(&all) {
            return all;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: got {all:?}"
        );
        if got == 0 {
            n.wait_until(seen, Some(Instant::now() + Duration::from_millis(5)));
        }
    }
}

/// [`poll_until_with`] for devices that progress on their own.
pub fn poll_until(
    qps: &mut [&mut Qp],
    n: &Notifier,
    what: &str,
    done: impl FnMut(&[(usize, DeviceCompletion)]) -> bool,
) -> Vec<(usize, DeviceCompletion)> {
    poll_until_with(qps, n, &|| {}, what, done)
}

/// Polls for `d` (after `pump` each pass) and returns whatever completes.
pub fn poll_for_with(
    qps: &mut [&mut Qp],
    pump: &dyn Fn(),
    d: Duration,
) -> Vec<(usize, DeviceCompletion)> {
    let end = Instant::now() + d;
    let mut out = Vec::new();
    while Instant::now() < end {
        poll_once(qps, pump, &mut out);
        std::thread::sleep(Duration::from_millis(1));
    }
    out
}

/// [`poll_for_with`] for devices that progress on their own.
pub fn poll_for(qps: &mut [&mut Qp], d: Duration) -> Vec<(usize, DeviceCompletion)> {
    poll_for_with(qps, &|| {}, d)
}
