//! Batched socket I/O: `sendmmsg` and `recvmmsg` behind safe functions, so that a post list or a
//! burst of acknowledgements leaves in one system call and a burst of datagrams is read in one.
//!
//! Only this module holds `unsafe` code in the udp device. The kernel reads the iovecs and
//! addresses it is given during the call and writes only inside the buffers it is given, whose
//! lengths come from the slices, so nothing outlives a call.

#![allow(unsafe_code)]

use std::io::{self, IoSlice};
use std::mem;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsRawFd;

use socket2::SockAddr;

/// Most datagrams one call sends or receives.
pub(super) const MAX_BATCH: usize = 64;

/// One datagram to send: up to three slices, gathered by the kernel, to `dest`.
pub(super) struct OutMsg<'a> {
    pub dest: &'a SockAddr,
    pub parts: [IoSlice<'a>; 3],
}

/// Sends the datagrams `msgs` yields (at most [`MAX_BATCH`] are taken) with one `sendmmsg`.
/// Returns how many the kernel took, from the front; an error is the first datagram's (the
/// kernel reports an error only when it took none).
pub(super) fn send_batch<'a>(
    sock: &impl AsRawFd,
    msgs: impl Iterator<Item = OutMsg<'a>>,
) -> io::Result<usize> {
    // SAFETY: all-zero `mmsghdr` and `iovec` are valid values (null pointers, zero lengths).
    let mut hdrs: [libc::mmsghdr; MAX_BATCH] = unsafe { mem::zeroed() };
    let mut iovs: [[libc::iovec; 3]; MAX_BATCH] = unsafe { mem::zeroed() };
    let mut n = 0;
    for ((h, iov), m) in hdrs.iter_mut().zip(iovs.iter_mut()).zip(msgs) {
        for (v, p) in iov.iter_mut().zip(m.parts.iter()) {
            v.iov_base = p.as_ptr() as *mut libc::c_void;
            v.iov_len = p.len();
        }
        h.msg_hdr.msg_name = m.dest.as_ptr() as *mut libc::c_void;
        h.msg_hdr.msg_namelen = m.dest.len();
        h.msg_hdr.msg_iov = iov.as_mut_ptr();
        h.msg_hdr.msg_iovlen = iov.len() as _;
        n += 1;
    }
    if n == 0 {
        return Ok(0);
    }
    // SAFETY: `hdrs[..n]` point at addresses and bytes borrowed from what `msgs` yielded (alive
    // for `'a`, beyond the call) and at `iovs`; the kernel only reads them, and writes `msg_len`
    // of each header.
    let r = unsafe {
        libc::sendmmsg(
            sock.as_raw_fd(),
            hdrs.as_mut_ptr(),
            n as libc::c_uint,
            libc::MSG_DONTWAIT,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// What one received datagram was: its length and its source.
#[derive(Clone, Copy, Debug)]
pub(super) struct InMsg {
    pub len: usize,
    pub src: Option<SocketAddr>,
    /// The datagram was longer than its buffer (cut off).
    pub truncated: bool,
}

/// Receive buffers for [`recv_batch`]: `slots` buffers of `slot` bytes each, allocated once.
pub(super) struct RxBatch {
    buf: Vec<u8>,
    slot: usize,
    slots: usize,
    pub got: Vec<InMsg>,
}

impl RxBatch {
    /// `slots` buffers (`1..=MAX_BATCH`) of `slot` bytes.
    pub fn new(slot: usize, slots: usize) -> RxBatch {
        let slots = slots.clamp(1, MAX_BATCH);
        RxBatch {
            buf: vec![0; slot * slots],
            slot,
            slots,
            got: Vec::with_capacity(slots),
        }
    }

    /// The bytes of received datagram `i` of the last [`recv_batch`].
    pub fn data(&self, i: usize) -> &[u8] {
        let Some(m) = self.got.get(i) else {
            return &[];
        };
        let start = i * self.slot;
        self.buf
            .get(start..start + m.len.min(self.slot))
            .unwrap_or_default()
    }

    /// How many datagrams one call reads at most.
    pub fn slots(&self) -> usize {
        self.slots
    }
}

/// Reads up to `max` waiting datagrams (at most the batch's slots) with one `recvmmsg`, without
/// blocking, into `rx` (`rx.got` lists them). `WouldBlock` when none waits.
pub(super) fn recv_batch(sock: &impl AsRawFd, rx: &mut RxBatch, max: usize) -> io::Result<usize> {
    rx.got.clear();
    let n = max.min(rx.slots);
    if n == 0 {
        return Ok(0);
    }
    // SAFETY: all-zero `mmsghdr`, `iovec` and `sockaddr_storage` are valid values.
    let mut hdrs: [libc::mmsghdr; MAX_BATCH] = unsafe { mem::zeroed() };
    let mut iovs: [libc::iovec; MAX_BATCH] = unsafe { mem::zeroed() };
    let mut names: [libc::sockaddr_storage; MAX_BATCH] = unsafe { mem::zeroed() };
    let base = rx.buf.as_mut_ptr();
    for i in 0..n {
        // SAFETY: `i * slot + slot <= buf.len()` since `i < slots`; the pointer stays inside it.
        iovs[i].iov_base = unsafe { base.add(i * rx.slot) } as *mut libc::c_void;
        iovs[i].iov_len = rx.slot;
        hdrs[i].msg_hdr.msg_name = (&mut names[i]) as *mut libc::sockaddr_storage as *mut _;
        hdrs[i].msg_hdr.msg_namelen = mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        hdrs[i].msg_hdr.msg_iov = &mut iovs[i];
        hdrs[i].msg_hdr.msg_iovlen = 1;
    }
    // SAFETY: every header points at its own slot of `rx.buf` (exclusively borrowed), its own
    // address storage and iovec, all alive for the call; the kernel writes within their lengths.
    let r = unsafe {
        libc::recvmmsg(
            sock.as_raw_fd(),
            hdrs.as_mut_ptr(),
            n as libc::c_uint,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let got = (r as usize).min(n);
    for (h, name) in hdrs.iter().zip(names.iter()).take(got) {
        rx.got.push(InMsg {
            len: (h.msg_len as usize).min(rx.slot),
            src: socket_addr(name, h.msg_hdr.msg_namelen),
            truncated: h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0,
        });
    }
    Ok(got)
}

/// The IP socket address in `ss` (`None` for any other family or a short length).
fn socket_addr(ss: &libc::sockaddr_storage, len: libc::socklen_t) -> Option<SocketAddr> {
    let len = len as usize;
    match ss.ss_family as libc::c_int {
        libc::AF_INET if len >= mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: the family says the storage holds a `sockaddr_in`, and it is large and
            // aligned enough for one.
            let a = unsafe { &*(ss as *const libc::sockaddr_storage as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Some(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 if len >= mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for `sockaddr_in6`.
            let a = unsafe { &*(ss as *const libc::sockaddr_storage as *const libc::sockaddr_in6) };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;

    #[test]
    fn a_batch_goes_out_in_one_call_and_comes_back_in_one() {
        let a = UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = UdpSocket::bind("127.0.0.1:0").unwrap();
        let dest = SockAddr::from(b.local_addr().unwrap());
        let bodies: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i; 10 + i as usize]).collect();
        let msgs: Vec<OutMsg<'_>> = bodies
            .iter()
            .map(|v| OutMsg {
                dest: &dest,
                parts: [
                    IoSlice::new(&v[..3]),
                    IoSlice::new(&v[3..]),
                    IoSlice::new(&[]),
                ],
            })
            .collect();
        assert_eq!(send_batch(&a, msgs.into_iter()).unwrap(), 10);
        let mut rx = RxBatch::new(64, 16);
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while got.len() < 10 && std::time::Instant::now() < deadline {
            match recv_batch(&b, &mut rx, 16) {
                Ok(n) => {
                    for i in 0..n {
                        assert_eq!(rx.got[i].src, Some(a.local_addr().unwrap()));
                        assert!(!rx.got[i].truncated);
                        got.push(rx.data(i).to_vec());
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(got, bodies);
        assert_eq!(
            recv_batch(&b, &mut rx, 16).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
    }

    #[test]
    fn a_datagram_longer_than_its_slot_is_marked_truncated() {
        let a = UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = UdpSocket::bind("[::1]:0").or_else(|_| UdpSocket::bind("127.0.0.1:0"));
        let b = b.unwrap();
        let a = if b.local_addr().unwrap().is_ipv6() {
            UdpSocket::bind("[::1]:0").unwrap()
        } else {
            a
        };
        a.send_to(&[7u8; 100], b.local_addr().unwrap()).unwrap();
        let mut rx = RxBatch::new(32, 4);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            match recv_batch(&b, &mut rx, 4) {
                Ok(1) => break,
                Ok(n) => panic!("{n} datagrams"),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    assert!(std::time::Instant::now() < deadline);
                    std::thread::yield_now();
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert!(rx.got[0].truncated);
        assert_eq!(rx.got[0].src, Some(a.local_addr().unwrap()));
        assert_eq!(rx.data(0), &[7u8; 32][..]);
    }
}
