//! Batched socket I/O: `sendmmsg` and `recvmmsg` behind safe functions, so that a post list or a
//! burst of acknowledgements leaves in one system call and a burst of datagrams is read in one.
//!
//! Only this module holds `unsafe` code in the udp device. The kernel reads the iovecs and
//! addresses it is given during the call and writes only inside the buffers it is given, whose
//! lengths come from the slices, so nothing outlives a call.

#![allow(unsafe_code)]

use std::io;
use std::mem;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsRawFd;

use socket2::SockAddr;

/// Most messages one call sends or receives.
pub(super) const MAX_BATCH: usize = 64;
/// Most datagrams one GSO message carries (the kernel's `UDP_MAX_SEGMENTS` is 64 or more).
pub(super) const GSO_MAX_SEGS: usize = 64;
/// Most bytes one GSO message carries (all its datagrams; one IP packet's limit).
pub(super) const GSO_MAX_BYTES: usize = 65_000;

/// `SOL_UDP` options (stable kernel ABI; not in every libc build).
const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;
/// Room for one control message holding an `int` (GSO size sent as `u16` fits too).
const CMSG_ROOM: usize = 32;

/// Asks the kernel to hand this socket coalesced datagrams (`UDP_GRO`): a GSO message from a
/// peer on this host arrives in one read, cut into its datagrams by [`recv_batch`]. False when
/// the kernel does not offer it.
pub(super) fn enable_gro(sock: &impl AsRawFd) -> bool {
    let on: libc::c_int = 1;
    // SAFETY: a plain `setsockopt` with a pointer to an `int` and its size.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_UDP,
            UDP_GRO,
            (&on as *const libc::c_int).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    r == 0
}

/// Reusable room for the kernel-facing arrays of [`SendBatch`]: message headers, iovecs and
/// control messages.
#[derive(Default)]
pub(super) struct SendScratch {
    hdrs: Vec<libc::mmsghdr>,
    iovs: Vec<libc::iovec>,
    /// Per message: first iovec, iovec count, GSO segment size (0: none), address.
    msgs: Vec<(usize, usize, u16, *const SockAddr)>,
    cmsgs: Vec<[u64; CMSG_ROOM / 8]>,
}

// SAFETY: the raw pointers in the scratch arrays are written by a `SendBatch` and used only
// during its `send` calls, while the borrows they came from are alive (the batch's lifetime);
// they are cleared when a batch starts, so no pointer is dereferenced after its borrow ended.
unsafe impl Send for SendScratch {}

impl SendScratch {
    /// Starts a batch of messages; parts pushed into it must outlive it.
    pub fn batch<'a>(&'a mut self) -> SendBatch<'a> {
        self.hdrs.clear();
        self.iovs.clear();
        self.msgs.clear();
        SendBatch {
            s: self,
            _parts: std::marker::PhantomData,
        }
    }
}

/// Messages for `sendmmsg`, each to one address, each one datagram or (with a GSO segment
/// size) several datagrams the kernel cuts every `seg` bytes.
pub(super) struct SendBatch<'a> {
    s: &'a mut SendScratch,
    _parts: std::marker::PhantomData<&'a [u8]>,
}

impl<'a> SendBatch<'a> {
    /// Starts a message to `dest`; `seg`: cut it into datagrams of this many bytes (GSO).
    pub fn message(&mut self, dest: &'a SockAddr, seg: Option<u16>) {
        let first = self.s.iovs.len();
        self.s
            .msgs
            .push((first, 0, seg.unwrap_or(0), dest as *const SockAddr));
    }

    /// Appends bytes to the current message (empty parts are skipped).
    pub fn part(&mut self, bytes: &'a [u8]) {
        if bytes.is_empty() {
            return;
        }
        if let Some(m) = self.s.msgs.last_mut() {
            self.s.iovs.push(libc::iovec {
                iov_base: bytes.as_ptr() as *mut libc::c_void,
                iov_len: bytes.len(),
            });
            m.1 += 1;
        }
    }

    /// Messages in the batch.
    pub fn len(&self) -> usize {
        self.s.msgs.len()
    }

    /// Sends messages `from..` (at most [`MAX_BATCH`]) with one `sendmmsg`. Returns how many
    /// the kernel took; an error is message `from`'s (the kernel reports an error only when it
    /// took none).
    pub fn send(&mut self, sock: &impl AsRawFd, from: usize) -> io::Result<usize> {
        let s = &mut *self.s;
        let n = s.msgs.len().saturating_sub(from).min(MAX_BATCH);
        if n == 0 {
            return Ok(0);
        }
        // SAFETY: an all-zero `mmsghdr` is a valid value (null pointers, zero lengths).
        s.hdrs.resize(n, unsafe { mem::zeroed() });
        s.cmsgs.resize(n.max(s.cmsgs.len()), [0; CMSG_ROOM / 8]);
        for (k, (h, m)) in s.hdrs.iter_mut().zip(&s.msgs[from..from + n]).enumerate() {
            let (first, count, seg, dest) = *m;
            // SAFETY: `dest` was borrowed for `'a`, which outlives this call.
            let dest = unsafe { &*dest };
            // SAFETY: as in `batch`, zero is valid; every field is set below.
            *h = unsafe { mem::zeroed() };
            h.msg_hdr.msg_name = dest.as_ptr() as *mut libc::c_void;
            h.msg_hdr.msg_namelen = dest.len();
            // SAFETY: `first + count <= iovs.len()` by construction (`part` counts what it
            // pushes), so the pointer stays inside the vector.
            h.msg_hdr.msg_iov = unsafe { s.iovs.as_mut_ptr().add(first) };
            h.msg_hdr.msg_iovlen = count as _;
            if seg != 0 {
                let room = &mut s.cmsgs[k];
                h.msg_hdr.msg_control = room.as_mut_ptr().cast();
                // SAFETY: CMSG_SPACE is a pure computation.
                let space = unsafe { libc::CMSG_SPACE(mem::size_of::<u16>() as u32) } as usize;
                h.msg_hdr.msg_controllen = space as _;
                // SAFETY: `msg_control` points at `CMSG_ROOM` bytes, more than `space`; the
                // first header is inside it, and its data holds a `u16`.
                unsafe {
                    let c = libc::CMSG_FIRSTHDR(&h.msg_hdr);
                    (*c).cmsg_level = libc::SOL_UDP;
                    (*c).cmsg_type = UDP_SEGMENT;
                    (*c).cmsg_len = libc::CMSG_LEN(mem::size_of::<u16>() as u32) as _;
                    std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), seg);
                }
            }
        }
        // SAFETY: every header points at an address and bytes borrowed for `'a` (alive), at
        // iovecs and control room in `s` (not touched during the call); the kernel reads them
        // and writes only `msg_len`.
        let r = unsafe {
            libc::sendmmsg(
                sock.as_raw_fd(),
                s.hdrs.as_mut_ptr(),
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
}

/// What one received read was: its length and its source.
#[derive(Clone, Copy, Debug)]
pub(super) struct InMsg {
    pub len: usize,
    pub src: Option<SocketAddr>,
    /// The datagram was longer than its buffer (cut off).
    pub truncated: bool,
    /// Coalesced datagrams (`UDP_GRO`): each this many bytes, the last one possibly shorter;
    /// 0 for a single datagram.
    pub seg: usize,
}

/// Receive buffers for [`recv_batch`]: `slots` buffers of `slot` bytes each, allocated once.
pub(super) struct RxBatch {
    buf: Vec<u8>,
    slot: usize,
    slots: usize,
    cmsgs: Vec<[u64; CMSG_ROOM / 8]>,
    /// The senders' addresses of the last read, one per slot (kept: zeroing them for every
    /// read was most of an empty read's cost).
    names: Vec<libc::sockaddr_storage>,
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
            cmsgs: vec![[0; CMSG_ROOM / 8]; slots],
            // SAFETY: an all-zero `sockaddr_storage` is a valid value.
            names: vec![unsafe { mem::zeroed() }; slots],
            got: Vec::with_capacity(slots),
        }
    }

    /// The bytes of read `i` of the last [`recv_batch`] (all its datagrams if coalesced).
    pub fn data(&self, i: usize) -> &[u8] {
        let Some(m) = self.got.get(i) else {
            return &[];
        };
        let start = i * self.slot;
        self.buf
            .get(start..start + m.len.min(self.slot))
            .unwrap_or_default()
    }

    /// The datagrams of read `i`: one, or the coalesced ones cut at their segment size.
    pub fn datagrams(&self, i: usize) -> std::slice::Chunks<'_, u8> {
        let d = self.data(i);
        let seg = self.got.get(i).map_or(0, |m| m.seg);
        d.chunks(if seg == 0 { d.len().max(1) } else { seg })
    }

    /// Reads one datagram into the first buffer with a plain `recvfrom`, as [`recv_batch`]
    /// with one slot does, for a socket without `UDP_GRO` (whose reads carry no control message).
    pub fn recv_plain(&mut self, sock: &mio::net::UdpSocket) -> io::Result<usize> {
        self.got.clear();
        let slot = self.buf.get_mut(..self.slot).unwrap_or_default();
        let (len, src) = sock.recv_from(slot)?;
        self.got.push(InMsg {
            len: len.min(self.slot),
            src: Some(src),
            // A buffer of 64 KiB holds any UDP datagram.
            truncated: self.slot < 65_536 && len >= self.slot,
            seg: 0,
        });
        Ok(1)
    }

    /// How many reads one call makes at most.
    pub fn slots(&self) -> usize {
        self.slots
    }
}

/// Reads up to `max` waiting reads (at most the batch's slots) with one `recvmmsg`, without
/// blocking, into `rx` (`rx.got` lists them). `WouldBlock` when none waits.
pub(super) fn recv_batch(sock: &impl AsRawFd, rx: &mut RxBatch, max: usize) -> io::Result<usize> {
    rx.got.clear();
    let n = max.min(rx.slots);
    if n == 0 {
        return Ok(0);
    }
    // Only the `n` headers the call uses are set up (zeroing all `MAX_BATCH` headers, iovecs
    // and addresses, 13 KiB, was most of the cost of an empty read).
    let mut hdrs = [const { mem::MaybeUninit::<libc::mmsghdr>::uninit() }; MAX_BATCH];
    let mut iovs = [const { mem::MaybeUninit::<libc::iovec>::uninit() }; MAX_BATCH];
    let base = rx.buf.as_mut_ptr();
    for i in 0..n {
        let iov = iovs[i].write(libc::iovec {
            // SAFETY: `i * slot + slot <= buf.len()` since `i < slots`; the pointer stays
            // inside it.
            iov_base: unsafe { base.add(i * rx.slot) }.cast(),
            iov_len: rx.slot,
        });
        // SAFETY: an all-zero `mmsghdr` is a valid value.
        let mut h: libc::mmsghdr = unsafe { mem::zeroed() };
        h.msg_hdr.msg_name = (&mut rx.names[i]) as *mut libc::sockaddr_storage as *mut _;
        h.msg_hdr.msg_namelen = mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        h.msg_hdr.msg_iov = iov;
        h.msg_hdr.msg_iovlen = 1;
        h.msg_hdr.msg_control = rx.cmsgs[i].as_mut_ptr().cast();
        h.msg_hdr.msg_controllen = CMSG_ROOM as _;
        hdrs[i].write(h);
    }
    // SAFETY: the first `n` headers are initialized (above), each pointing at its own slot of
    // `rx.buf` (exclusively borrowed), its own address storage, iovec and control room, all
    // alive for the call; the kernel reads `n` headers and writes within their lengths.
    let r = unsafe {
        libc::recvmmsg(
            sock.as_raw_fd(),
            hdrs.as_mut_ptr().cast::<libc::mmsghdr>(),
            n as libc::c_uint,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let got = (r as usize).min(n);
    // SAFETY: the first `n` headers were initialized above (and `got <= n`).
    let hdrs = unsafe { std::slice::from_raw_parts(hdrs.as_ptr().cast::<libc::mmsghdr>(), got) };
    for (h, name) in hdrs.iter().zip(rx.names.iter()) {
        rx.got.push(InMsg {
            len: (h.msg_len as usize).min(rx.slot),
            src: socket_addr(name, h.msg_hdr.msg_namelen),
            truncated: h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0,
            seg: gro_segment(&h.msg_hdr),
        });
    }
    Ok(got)
}

/// The `UDP_GRO` segment size the kernel attached to a read, 0 when none.
// `msg_controllen` is `usize` with glibc and `socklen_t` with musl.
#[allow(clippy::unnecessary_cast)]
fn gro_segment(m: &libc::msghdr) -> usize {
    if m.msg_control.is_null() || (m.msg_controllen as usize) < mem::size_of::<libc::cmsghdr>() {
        return 0;
    }
    // SAFETY: the kernel wrote `msg_controllen` bytes of control messages into the room
    // `msg_control` points at; the CMSG macros walk them within that length.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(m);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP
                && (*c).cmsg_type == UDP_GRO
                && (*c).cmsg_len as usize
                    >= libc::CMSG_LEN(mem::size_of::<libc::c_int>() as u32) as usize
            {
                let v = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                return usize::try_from(v).unwrap_or(0);
            }
            c = libc::CMSG_NXTHDR(m, c);
        }
    }
    0
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
    use std::time::{Duration, Instant};

    /// Reads datagrams (cutting coalesced reads) until `n` came or a deadline passed.
    fn read(sock: &UdpSocket, rx: &mut RxBatch, n: usize) -> Vec<(Vec<u8>, SocketAddr)> {
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while got.len() < n && Instant::now() < deadline {
            match recv_batch(sock, rx, 16) {
                Ok(k) => {
                    for i in 0..k {
                        assert!(!rx.got[i].truncated);
                        let src = rx.got[i].src.unwrap();
                        got.extend(rx.datagrams(i).map(|d| (d.to_vec(), src)));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        got
    }

    #[test]
    fn a_batch_goes_out_in_one_call_and_comes_back_in_one() {
        let a = UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = UdpSocket::bind("127.0.0.1:0").unwrap();
        let dest = SockAddr::from(b.local_addr().unwrap());
        let bodies: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i; 10 + i as usize]).collect();
        let mut scratch = SendScratch::default();
        let mut batch = scratch.batch();
        for v in &bodies {
            batch.message(&dest, None);
            batch.part(&v[..3]);
            batch.part(&[]);
            batch.part(&v[3..]);
        }
        assert_eq!(batch.send(&a, 0).unwrap(), 10);
        let mut rx = RxBatch::new(64, 16);
        let got = read(&b, &mut rx, 10);
        let src = a.local_addr().unwrap();
        assert_eq!(
            got,
            bodies.into_iter().map(|v| (v, src)).collect::<Vec<_>>()
        );
        assert_eq!(
            recv_batch(&b, &mut rx, 16).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
    }

    /// One GSO message of 40-byte datagrams and a shorter last one arrives as the same
    /// datagrams, whether the receiver takes them coalesced (`UDP_GRO`) or one by one.
    #[test]
    fn a_gso_message_arrives_as_its_datagrams_with_and_without_gro() {
        for gro in [true, false] {
            let a = UdpSocket::bind("127.0.0.1:0").unwrap();
            let b = UdpSocket::bind("127.0.0.1:0").unwrap();
            if gro {
                assert!(enable_gro(&b), "this kernel has UDP_GRO");
            }
            let dest = SockAddr::from(b.local_addr().unwrap());
            let mut bodies: Vec<Vec<u8>> = (0..12u8).map(|i| vec![i; 40]).collect();
            bodies.push(vec![99; 17]);
            let mut scratch = SendScratch::default();
            let mut batch = scratch.batch();
            batch.message(&dest, Some(40));
            for v in &bodies {
                batch.part(&v[..1]);
                batch.part(&v[1..]);
            }
            assert_eq!(batch.send(&a, 0).unwrap(), 1, "gro {gro}");
            let mut rx = RxBatch::new(65_536, 4);
            let got = read(&b, &mut rx, bodies.len());
            let src = a.local_addr().unwrap();
            let want: Vec<_> = bodies.iter().map(|v| (v.clone(), src)).collect();
            assert_eq!(got, want, "gro {gro}");
        }
    }

    #[test]
    fn a_datagram_longer_than_its_slot_is_marked_truncated() {
        let a = UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = UdpSocket::bind("127.0.0.1:0").unwrap();
        a.send_to(&[7u8; 100], b.local_addr().unwrap()).unwrap();
        let mut rx = RxBatch::new(32, 4);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match recv_batch(&b, &mut rx, 4) {
                Ok(1) => break,
                Ok(n) => panic!("{n} datagrams"),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline);
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
