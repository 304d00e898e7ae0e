//! Message channels: the shared-memory rings of the same-host path (`crate::local`), the
//! counterpart of libfabric's shm provider under the EFA provider.
//!
//! Every RDM endpoint that can reach peers on this host owns one channel: a file
//! `efa-chan-<uid>-<gid hex>-<qpn>-<qkey hex>` in the shm directory, named after the endpoint's
//! raw address, so a sender finds it from the address alone. It holds a header and a ring of
//! fixed slots (multi-producer, single consumer: Dmitry Vyukov's bounded queue, as the shm
//! device's rings). A slot carries one chunk of a message (or a control record) with a 64-byte
//! header; the consumer copies the chunk straight into the receive buffer the endpoint's
//! matching picks and frees the slot. There are no acknowledgements: the ring is in order and
//! loses nothing, so a message is delivered once its chunks are in the ring.
//!
//! Like every shm structure, the channel trusts nothing it reads: all accesses are bounds
//! checked through [`Mapping`], lengths are checked against the owner's own geometry, and a
//! malformed slot is dropped and counted. Liveness is the shm device's: the owner holds a
//! shared `flock` on the file for the channel's life.
//!
//! Layout (little-endian words, each read and written atomically):
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic `"EFA-CHN\0"` (written last, `Release`) |
//! | 8 | version (1), 12 header size (256) |
//! | 16 | total size |
//! | 24 | owner pid, 28 owner uid |
//! | 32 | slots (power of two), 36 slot stride (`64 + chunk`) |
//! | 40 | network namespace hash (FNV-1a of `/proc/self/ns/net`) |
//! | 48 | the owner's raw address: qkey (4), qpn (4), GID (16) |
//! | 72 | the owner's wake pipe: descriptor number (`u32::MAX`: none), 80 its device, 88 its inode |
//! | 128 | closed flag, 132 sleepers, 136 doorbell (futex word), 140 descriptor sleeper |
//! | 192 | ring tail (its own cache line) |
//! | 256 | slots |
//!
//! The wake pipe is how a sender wakes an owner whose application sleeps on a completion
//! queue's descriptor: the pipe's read end is in that queue's epoll set, and a sender that
//! finds the descriptor-sleeper word set (`shmem::file::Doorbell`) writes a byte to the pipe,
//! opened once through `/proc/<owner pid>/fd/<n>` and checked to be that pipe (device and
//! inode). The owner's waiter thread is not woken: one wake-up instead of two.
//!
//! Slot header: 0 sequence (u64), 8 kind (low byte) and flags (second byte: tagged 1, CQ data 2,
//! delivery complete 4, unwatched 8 — an inject, whose consumption its sender need not hear
//! of), 12 chunk length,
//! 16 tag, 24 message length (first chunk) or offset (further chunks), 32 CQ data, 36
//! delivery-complete token, 40 the sender's raw address (24 bytes, as above); data at 64.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::BytesMut;

use crate::addr::RawAddr;
use crate::shmem::file::{
    self, Doorbell, H_CLOSED, H_HDR_SIZE, H_MAGIC, H_PID as H_OWNER_PID, H_PID, H_TOTAL, H_VERSION,
    HDR_SIZE, MAX_SLOTS, Rung, SLOT_HDR,
};
use crate::shmem::map::{self, Mapping, WakePipe, remove_if_same};
use crate::shmem::sync::AtomicU64;

use crate::shmem::dir::CHANNEL;

use super::ring::{ADDR_LEN, Head, Liveness, OpenError, SlotHdr, decode_addr, encode_addr};
const MAGIC: u64 = u64::from_le_bytes(*b"EFA-CHN\0");
const VERSION: u32 = 1;
/// Largest chunk a peer's header may declare.
const MAX_CHUNK: u32 = 1 << 20;

// Header offsets beyond the common ones of `file`.
const H_UID: usize = 28;
const H_SLOTS: usize = 32;
const H_STRIDE: usize = 36;
const H_NETNS: usize = 40;
const H_ADDR: usize = 48;
const H_WAKE_FD: usize = 72;
const H_WAKE_DEV: usize = 80;
const H_WAKE_INO: usize = 88;

const S_SEQ: usize = 0;
const S_KIND: usize = 8;
const S_LEN: usize = 12;
const S_TAG: usize = 16;
const S_WORD: usize = 24;
const S_DATA: usize = 32;
const S_TOKEN: usize = 36;
const S_SRC: usize = 40;

/// FNV-1a of a string (the network namespace's identity).
pub(crate) fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// The file name of the channel of the endpoint at `a`.
pub(crate) fn chan_name(uid: u32, a: &RawAddr) -> String {
    let gid: String = a.gid.0.iter().map(|b| format!("{b:02x}")).collect();
    CHANNEL.name(uid, format_args!("{gid}-{}-{:08x}", a.qpn, a.qkey))
}

/// Ring shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub slots: u32,
    pub stride: u32,
    pub total: usize,
}

impl Geometry {
    /// `slots` (a power of two) slots of `chunk` bytes (a multiple of 64).
    pub(crate) fn new(slots: u32, chunk: u32) -> Option<Geometry> {
        if !slots.is_power_of_two()
            || slots > MAX_SLOTS
            || chunk > MAX_CHUNK
            || !chunk.is_multiple_of(64)
        {
            return None;
        }
        let stride = chunk + SLOT_HDR as u32;
        let total = HDR_SIZE.checked_add((slots as usize).checked_mul(stride as usize)?)?;
        Some(Geometry {
            slots,
            stride,
            total,
        })
    }

    /// Largest chunk a slot holds.
    pub(crate) fn chunk(&self) -> usize {
        self.stride as usize - SLOT_HDR
    }

    fn slot(&self, pos: u64) -> usize {
        HDR_SIZE + (pos & u64::from(self.slots - 1)) as usize * self.stride as usize
    }
}

/// The state of the owner's ring the endpoint and its waiter thread share.
pub(crate) struct OwnRing {
    map: Mapping,
    geo: Geometry,
    /// The next position to consume (written by the consumer only).
    head: AtomicU64,
    /// The descriptor doorbell (`None`: the system gave no pipe; senders ring the futex).
    pipe: Option<WakePipe>,
}

impl OwnRing {
    fn word(&self, off: usize) -> Option<&AtomicU64> {
        self.map.u64(off)
    }

    /// True when the head slot is published (the waiter thread's check; no side effects).
    pub(crate) fn ready(&self) -> bool {
        let head = self.head.load(Ordering::Relaxed);
        file::published(&self.map, self.geo.slot(head) + S_SEQ, head)
    }

    /// The head position when a producer reserved it and has not published it (the waiter's
    /// occasional check; reads the producers' tail line).
    pub(crate) fn stuck(&self) -> Option<u64> {
        let head = self.head.load(Ordering::Relaxed);
        file::reserved_unpublished(&self.map, self.geo.slot(head) + S_SEQ, head).then_some(head)
    }

    /// The owner's doorbell (its waiter thread sleeps on it).
    pub(crate) fn bell(&self) -> Option<Doorbell<'_>> {
        Doorbell::of(&self.map)
    }

    /// The read end of the wake pipe, for the completion queues' epoll sets.
    pub(crate) fn wake_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.pipe.as_ref().map(WakePipe::read_end)
    }

    /// The application is about to sleep on a descriptor that watches the wake pipe: empties
    /// the pipe and asks senders to write it instead of ringing the futex. True when a slot is
    /// ready already (do not sleep: poll). Without a pipe nothing is asked (senders ring the
    /// futex and the waiter thread wakes the queues).
    pub(crate) fn arm_fd_wait(&self) -> bool {
        if let (Some(p), Some(d)) = (&self.pipe, self.bell()) {
            p.drain();
            d.arm_fd();
        }
        self.ready()
    }

    /// The application waits another way (or polls): senders ring the futex again. True when a
    /// slot is ready (a sender may have written the pipe instead of waking the waiter thread).
    pub(crate) fn disarm_fd_wait(&self) -> bool {
        if let Some(d) = self.bell() {
            d.disarm_fd();
        }
        self.ready()
    }
}

/// The owner's side of a channel.
pub(crate) struct OwnChan {
    ring: Arc<OwnRing>,
    /// Holds the shared lock (the mark of life); `None` once closed.
    file: Option<File>,
    path: PathBuf,
    ino: u64,
}

impl OwnChan {
    /// Creates the channel of the endpoint at `addr` in `dir`: under a temporary name it is
    /// sized, allocated, locked and initialised, then hard-linked to its name. `Ok(None)` when a
    /// live owner holds the name already (the same address in another network namespace): the
    /// endpoint then runs without a local path.
    pub(crate) fn create(
        dir: &Path,
        uid: u32,
        netns: u64,
        addr: &RawAddr,
        geo: Geometry,
    ) -> io::Result<Option<OwnChan>> {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let pid = std::process::id();
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(CHANNEL.tmp_name(uid, pid, n));
        let res = Self::create_at(dir, &tmp, uid, netns, addr, geo);
        let _ = std::fs::remove_file(&tmp);
        res
    }

    fn create_at(
        dir: &Path,
        tmp: &Path,
        uid: u32,
        netns: u64,
        addr: &RawAddr,
        geo: Geometry,
    ) -> io::Result<Option<OwnChan>> {
        let (file, ino) = file::create_owned(tmp, geo.total)?;
        let m = Mapping::map_populated(&file, geo.total)?;
        for i in 0..u64::from(geo.slots) {
            m.store64(geo.slot(i) + S_SEQ, i);
        }
        m.store32(H_VERSION, VERSION);
        m.store32(H_HDR_SIZE, HDR_SIZE as u32);
        m.store64(H_TOTAL, geo.total as u64);
        m.store32(H_PID, std::process::id());
        m.store32(H_UID, uid);
        m.store32(H_SLOTS, geo.slots);
        m.store32(H_STRIDE, geo.stride);
        m.store64(H_NETNS, netns);
        m.write(H_ADDR, &encode_addr(addr));
        let pipe = WakePipe::new()
            .inspect_err(|e| tracing::debug!(error = %e, "local path: no wake pipe"))
            .ok();
        match &pipe {
            Some(p) => {
                use std::os::fd::AsRawFd;
                m.store32(H_WAKE_FD, p.read_end().as_raw_fd() as u32);
                m.store64(H_WAKE_DEV, p.id.0);
                m.store64(H_WAKE_INO, p.id.1);
            }
            None => m.store32(H_WAKE_FD, u32::MAX),
        }
        if let Some(w) = m.u64(H_MAGIC) {
            w.store(MAGIC, Ordering::Release);
        }
        let path = dir.join(chan_name(uid, addr));
        if !map::link_claim(tmp, &path)? {
            return Ok(None);
        }
        Ok(Some(OwnChan {
            ring: Arc::new(OwnRing {
                map: m,
                geo,
                head: AtomicU64::new(0),
                pipe,
            }),
            file: Some(file),
            path,
            ino,
        }))
    }

    /// The ring, shared with the endpoint's waiter thread.
    pub(crate) fn ring(&self) -> &Arc<OwnRing> {
        &self.ring
    }

    /// The published slot at the head, if any. Its fields are read once here; a slot whose
    /// length exceeds this ring's chunk size is reported with `src: None` (malformed).
    pub(crate) fn peek(&self) -> Option<Head> {
        let r = &*self.ring;
        let head = r.head.load(Ordering::Relaxed);
        let off = r.geo.slot(head);
        let seq = r.word(off + S_SEQ)?.load(Ordering::Acquire);
        if seq != head.wrapping_add(1) {
            return None;
        }
        let m = &r.map;
        // Start fetching the data's first line now (the copy comes after matching): its miss
        // then overlaps the header's processing instead of following it.
        if let Some(w) = m.u64(off + SLOT_HDR) {
            std::hint::black_box(w.load(Ordering::Relaxed));
        }
        let kf = m.load32(off + S_KIND).unwrap_or(0);
        let hdr = SlotHdr {
            kind: kf as u8,
            flags: (kf >> 8) as u8,
            len: m.load32(off + S_LEN).unwrap_or(0),
            tag: m.load64(off + S_TAG).unwrap_or(0),
            word: m.load64(off + S_WORD).unwrap_or(0),
            data: m.load32(off + S_DATA).unwrap_or(0),
            token: m.load32(off + S_TOKEN).unwrap_or(0),
        };
        let mut a = [0u8; ADDR_LEN];
        let src = if hdr.len as usize <= r.geo.chunk() && m.read_to(off + S_SRC, &mut a) {
            decode_addr(&a)
        } else {
            None
        };
        Some(Head {
            hdr,
            src,
            data_off: off + SLOT_HDR,
        })
    }

    /// Appends `n` bytes of the head slot's data to `buf` (which has the room).
    pub(crate) fn copy(&self, h: &Head, n: usize, buf: &mut BytesMut) -> bool {
        n <= h.hdr.len as usize && self.ring.map.read_into(h.data_off, n, buf)
    }

    /// Frees the head slot for the producers of the next lap.
    pub(crate) fn pop(&self) {
        let r = &*self.ring;
        let head = r.head.load(Ordering::Relaxed);
        file::release(&r.map, r.geo.slot(head) + S_SEQ, head, r.geo.slots);
        r.head.store(head.wrapping_add(1), Ordering::Relaxed);
    }

    /// The head position when a producer has reserved it (the tail is past it) but not
    /// published it yet; `None` when the head is published or the ring is empty. Reads the
    /// tail's cache line, which the producers write: for the occasional check of a stuck ring.
    pub(crate) fn reserved_head(&self) -> Option<u64> {
        self.ring.stuck()
    }

    /// Gives up on the reserved, never published head slot (its producer died between reserving
    /// and publishing) and moves on: the slot is freed for the next lap as if consumed. A
    /// producer that was only stopped and publishes later writes into a slot of the next lap,
    /// whose consumer sees a sequence of the wrong lap and waits: it is skipped in turn.
    pub(crate) fn skip_head(&self) {
        self.pop();
    }

    /// Marks the channel closed and removes its name and lock: peers see it gone. The mapping
    /// lives on while the ring is shared.
    pub(crate) fn close(&mut self) {
        if let Some(w) = self.ring.map.u32(H_CLOSED) {
            w.store(1, Ordering::Release);
        }
        if self.file.take().is_some() {
            remove_if_same(&self.path, self.ino);
        }
    }
}

impl Drop for OwnChan {
    fn drop(&mut self) {
        self.close();
    }
}

/// A peer's channel, mapped for sending.
pub(crate) struct PeerChan {
    map: Mapping,
    geo: Geometry,
    file: File,
    path: PathBuf,
    ino: u64,
    /// The owner's wake pipe as its header names it: pid, descriptor, (device, inode).
    wake: Option<(u32, u32, (u64, u64))>,
    /// That pipe, opened for writing the first time it is needed (`None`: it could not be).
    wake_file: std::sync::OnceLock<Option<File>>,
}

impl PeerChan {
    /// Opens the channel of the endpoint at `dest` in `dir`: a regular file of user `uid`, whose
    /// owner is alive (holds the lock), whose header is well formed, sized as the file is, and
    /// names `dest` and network namespace `netns`.
    pub(crate) fn open(
        dir: &Path,
        uid: u32,
        netns: u64,
        dest: &RawAddr,
    ) -> Result<PeerChan, OpenError> {
        let path = dir.join(chan_name(uid, dest));
        let file = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(OpenError::Absent),
            Err(_) => return Err(OpenError::Unusable("cannot open")),
        };
        let meta = file
            .metadata()
            .map_err(|_| OpenError::Unusable("no metadata"))?;
        if !meta.is_file() || meta.uid() != uid {
            return Err(OpenError::Unusable("not a regular file of this user"));
        }
        let size = usize::try_from(meta.len()).unwrap_or(usize::MAX);
        if size < HDR_SIZE {
            return Err(OpenError::Unusable("shorter than a header"));
        }
        if matches!(map::try_lock_exclusive(&file), Ok(true)) {
            remove_if_same(&path, meta.ino());
            return Err(OpenError::Unusable("owner gone"));
        }
        let head = Mapping::map(&file, HDR_SIZE).map_err(|_| OpenError::Unusable("cannot map"))?;
        let geo = read_header(&head, size, netns, dest)?;
        drop(head);
        let m = Mapping::map_populated(&file, geo.total)
            .map_err(|_| OpenError::Unusable("cannot map"))?;
        if read_header(&m, geo.total, netns, dest)? != geo {
            return Err(OpenError::Unusable("header changed while opening"));
        }
        let wake = match (m.load32(H_OWNER_PID), m.load32(H_WAKE_FD)) {
            (Some(pid), Some(fd)) if fd != u32::MAX => Some((
                pid,
                fd,
                (
                    m.load64(H_WAKE_DEV).unwrap_or(0),
                    m.load64(H_WAKE_INO).unwrap_or(0),
                ),
            )),
            _ => None,
        };
        Ok(PeerChan {
            map: m,
            geo,
            file,
            path,
            ino: meta.ino(),
            wake,
            wake_file: std::sync::OnceLock::new(),
        })
    }

    /// Largest chunk one slot of this peer holds.
    pub(crate) fn chunk(&self) -> usize {
        self.geo.chunk()
    }

    /// Reserves, writes and publishes one slot: `hdr`, the sender's encoded address `src` and
    /// `data` (at most [`Self::chunk`] bytes). Returns the slot's ring position; `None` when the
    /// ring is full (nothing written).
    pub(crate) fn push(&self, hdr: &SlotHdr, src: &[u8; ADDR_LEN], data: &[u8]) -> Option<u64> {
        if data.len() > self.geo.chunk() {
            return None;
        }
        let pos = file::reserve(&self.map, |p| self.geo.slot(p) + S_SEQ)?;
        let off = self.geo.slot(pos);
        let m = &self.map;
        m.store32(
            off + S_KIND,
            u32::from(hdr.kind) | u32::from(hdr.flags) << 8,
        );
        m.store32(off + S_LEN, data.len() as u32);
        m.store64(off + S_TAG, hdr.tag);
        m.store64(off + S_WORD, hdr.word);
        m.store32(off + S_DATA, hdr.data);
        m.store32(off + S_TOKEN, hdr.token);
        m.write(off + S_SRC, src);
        m.write(off + SLOT_HDR, data);
        if let Some(w) = m.u64(off + S_SEQ) {
            w.store(pos.wrapping_add(1), Ordering::Release);
        }
        Some(pos)
    }

    /// True once the owner consumed the slot this side published at `pos` (its sequence moved
    /// past "published"). Garbage in the word can only make this early or late, never unsafe.
    pub(crate) fn consumed(&self, pos: u64) -> bool {
        let off = self.geo.slot(pos) + S_SEQ;
        self.map
            .u64(off)
            .is_none_or(|w| w.load(Ordering::Acquire).wrapping_sub(pos.wrapping_add(1)) as i64 > 0)
    }

    /// Wakes the owner if it sleeps (after one or more [`Self::push`]es): its application,
    /// through the wake pipe, when it sleeps on a completion queue's descriptor; else its
    /// waiter thread, through the futex (also when the pipe cannot be written).
    pub(crate) fn ring_bell_if_asleep(&self) {
        if let Some(d) = Doorbell::of(&self.map) {
            if d.ring_if_asleep() == Rung::Fd && !self.write_wake_pipe() {
                d.ring();
            }
        }
    }

    /// Writes the owner's wake pipe (opened the first time); false when there is none to write.
    fn write_wake_pipe(&self) -> bool {
        let f = self.wake_file.get_or_init(|| {
            let (pid, fd, id) = self.wake?;
            let f = map::open_wake_pipe(pid, fd, id);
            if f.is_none() {
                tracing::debug!(
                    pid,
                    fd,
                    "local path: cannot open a peer's wake pipe; ringing its futex"
                );
            }
            f
        });
        f.as_ref().is_some_and(map::write_wake_pipe)
    }

    /// Wakes the owner's waiter thread if it is seen asleep, without a fence: for news the
    /// owner also finds by itself within a millisecond (its waiter naps that long while it waits
    /// for its sends to be consumed), so a missed wake-up costs at most that.
    pub(crate) fn ring_bell_if_seen_asleep(&self) {
        if let Some(d) = Doorbell::of(&self.map) {
            d.ring_if_seen_asleep();
        }
    }

    /// Reserves a slot and never publishes it (what a producer that dies at the wrong moment
    /// leaves behind).
    #[cfg(test)]
    fn reserve_only(&self) -> Option<u64> {
        let tail = self.map.u64(file::H_TAIL)?;
        let pos = tail.load(Ordering::Relaxed);
        tail.compare_exchange(pos, pos + 1, Ordering::Relaxed, Ordering::Relaxed)
            .ok()
    }

    /// True when the owner closed its endpoint (a plain load: no system call).
    pub(crate) fn closed(&self) -> bool {
        file::closed(&self.map)
    }

    /// The closed flag, then the owner's lock.
    pub(crate) fn liveness(&self) -> Liveness {
        file::liveness(&self.map, &self.file, &self.path, self.ino)
    }
}

/// The same-host path over shared-memory files: the own channel, and peers' channels opened
/// by name from the shm directory.
pub(crate) struct ShmChannels {
    pub(super) own: OwnChan,
    pub(super) dir: PathBuf,
    pub(super) uid: u32,
    pub(super) netns: u64,
}

impl super::ring::Channels for ShmChannels {
    type Peer = PeerChan;

    #[inline]
    fn peek(&self) -> Option<Head> {
        self.own.peek()
    }

    #[inline]
    fn copy(&self, h: &Head, n: usize, buf: &mut BytesMut) -> bool {
        self.own.copy(h, n, buf)
    }

    #[inline]
    fn pop(&self) {
        self.own.pop()
    }

    fn ready(&self) -> bool {
        self.own.ring.ready()
    }

    fn reserved_head(&self) -> Option<u64> {
        self.own.reserved_head()
    }

    fn skip_head(&self) {
        self.own.skip_head()
    }

    fn close(&mut self) {
        self.own.close()
    }

    fn quiet(&self) {
        if let Some(d) = self.own.ring.bell() {
            d.sleepers.store(0, Ordering::Relaxed);
            d.fd_wait.store(0, Ordering::Relaxed);
        }
    }

    fn awake(&self) {
        if let Some(d) = self.own.ring.bell() {
            d.awake();
        }
    }

    fn open_peer(&mut self, dest: &RawAddr) -> Result<PeerChan, OpenError> {
        PeerChan::open(&self.dir, self.uid, self.netns, dest)
    }

    fn peer_died(&self) {
        crate::shmem::dir::sweep_all(&self.dir, self.uid);
    }
}

impl super::ring::PeerRing for PeerChan {
    #[inline]
    fn chunk(&self) -> usize {
        PeerChan::chunk(self)
    }

    #[inline]
    fn push(&self, hdr: &SlotHdr, src: &[u8; ADDR_LEN], data: &[u8]) -> Option<u64> {
        PeerChan::push(self, hdr, src, data)
    }

    #[inline]
    fn consumed(&self, pos: u64) -> bool {
        PeerChan::consumed(self, pos)
    }

    #[inline]
    fn wake(&self) {
        self.ring_bell_if_asleep()
    }

    #[inline]
    fn nudge(&self) {
        self.ring_bell_if_seen_asleep()
    }

    fn closed(&self) -> bool {
        PeerChan::closed(self)
    }

    fn liveness(&self) -> Liveness {
        PeerChan::liveness(self)
    }
}

/// A channel of geometry `geo` in model memory, as its owner and one peer see it (the model
/// tests, `super::loom_tests`): the slots initialised as [`OwnChan::create`] does, no file.
#[cfg(all(test, loom))]
pub(super) fn model_pair(geo: Geometry) -> (OwnChan, PeerChan) {
    let m = Mapping::new(geo.total);
    for i in 0..u64::from(geo.slots) {
        m.store64(geo.slot(i) + S_SEQ, i);
    }
    let own = OwnChan {
        ring: Arc::new(OwnRing {
            map: m.clone(),
            geo,
            head: AtomicU64::new(0),
            pipe: None,
        }),
        file: None,
        path: PathBuf::new(),
        ino: 0,
    };
    let peer = PeerChan {
        map: m,
        geo,
        file: tempfile::tempfile().expect("a temporary file"),
        path: PathBuf::new(),
        ino: 0,
        wake: None,
        wake_file: std::sync::OnceLock::new(),
    };
    (own, peer)
}

fn read_header(
    m: &Mapping,
    size: usize,
    netns: u64,
    dest: &RawAddr,
) -> Result<Geometry, OpenError> {
    file::check_kind(m, MAGIC, VERSION).map_err(OpenError::Unusable)?;
    if m.load64(H_NETNS).unwrap_or(0) != netns {
        return Err(OpenError::Unusable("another network namespace"));
    }
    let mut a = [0u8; ADDR_LEN];
    if !m.read_to(H_ADDR, &mut a) || decode_addr(&a) != Some(*dest) {
        return Err(OpenError::Unusable("another address"));
    }
    let slots = m.load32(H_SLOTS).unwrap_or(0);
    let stride = m.load32(H_STRIDE).unwrap_or(0);
    let geo = stride
        .checked_sub(SLOT_HDR as u32)
        .and_then(|chunk| Geometry::new(slots, chunk))
        .ok_or(OpenError::Unusable("bad geometry"))?;
    if geo.stride != stride
        || m.load64(H_TOTAL).unwrap_or(0) != geo.total as u64
        || geo.total > size
    {
        return Err(OpenError::Unusable("size does not match the geometry"));
    }
    Ok(geo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::Gid;
    use crate::local::ring::{F_TAGGED, K_MSG};

    fn addr(qpn: u16) -> RawAddr {
        RawAddr {
            gid: Gid([7; 16]),
            qpn,
            qkey: 0x1234_5678,
        }
    }

    /// A channel of `slots` 64-byte slots owned by `me` (in network namespace `netns`), in a
    /// fresh directory.
    fn own_chan(slots: u32, netns: u64, me: &RawAddr) -> (tempfile::TempDir, OwnChan) {
        let dir = tempfile::tempdir().unwrap();
        let geo = Geometry::new(slots, 64).unwrap();
        let own = OwnChan::create(dir.path(), map::uid(), netns, me, geo)
            .unwrap()
            .unwrap();
        (dir, own)
    }

    #[test]
    fn messages_pass_in_order_and_a_full_ring_refuses() {
        let me = addr(9);
        let (dir, own) = own_chan(4, 5, &me);
        assert!(matches!(
            PeerChan::open(dir.path(), map::uid(), 6, &me),
            Err(OpenError::Unusable(_))
        ));
        assert!(matches!(
            PeerChan::open(dir.path(), map::uid(), 5, &addr(10)),
            Err(OpenError::Absent)
        ));
        let peer = PeerChan::open(dir.path(), map::uid(), 5, &me).unwrap();
        assert_eq!(peer.liveness(), Liveness::Alive);
        let src = encode_addr(&addr(3));
        let h = |i: u64| SlotHdr {
            kind: K_MSG,
            flags: F_TAGGED,
            len: 0,
            tag: i,
            word: 5,
            data: 0,
            token: 0,
        };
        for i in 0..4 {
            assert_eq!(peer.push(&h(i), &src, &[i as u8; 5]), Some(i));
        }
        assert!(!peer.consumed(0));
        assert_eq!(peer.push(&h(4), &src, b"full"), None, "a full ring refuses");
        assert_eq!(
            peer.push(&h(4), &src, &[0; 65]),
            None,
            "a chunk beyond the slot"
        );
        for i in 0..6u64 {
            if i == 4 {
                assert!(peer.consumed(0) && peer.consumed(3));
                assert_eq!(peer.push(&h(4), &src, b"late!"), Some(4));
                assert_eq!(peer.push(&h(5), &src, b"later"), Some(5));
                assert!(!peer.consumed(4));
            }
            let head = own.peek().unwrap();
            assert_eq!(
                (head.hdr.tag, head.hdr.len, head.src),
                (i, 5, Some(addr(3)))
            );
            let mut b = BytesMut::with_capacity(8);
            assert!(own.copy(&head, 5, &mut b));
            if i < 4 {
                assert_eq!(&b[..], &[i as u8; 5]);
            }
            own.pop();
        }
        assert!(own.peek().is_none());
    }

    #[test]
    fn a_slot_reserved_and_never_published_can_be_skipped() {
        let (dir, own) = own_chan(4, 1, &addr(1));
        let peer = PeerChan::open(dir.path(), map::uid(), 1, &addr(1)).unwrap();
        assert_eq!(own.reserved_head(), None, "empty ring");
        let h = SlotHdr {
            kind: K_MSG,
            flags: 0,
            len: 0,
            tag: 0,
            word: 3,
            data: 0,
            token: 0,
        };
        let src = encode_addr(&addr(2));
        assert_eq!(peer.reserve_only(), Some(0));
        assert_eq!(peer.push(&h, &src, b"abc"), Some(1));
        assert!(
            own.peek().is_none(),
            "the message waits behind the reserved slot"
        );
        assert_eq!(own.reserved_head(), Some(0));
        own.skip_head();
        assert_eq!(own.reserved_head(), None);
        let head = own.peek().expect("the message behind it");
        assert_eq!(head.hdr.word, 3);
        own.pop();
        // The skipped slot is free for the next lap.
        for _ in 0..4 {
            assert!(peer.push(&h, &src, b"abc").is_some());
            own.pop();
        }
    }

    #[test]
    fn a_closed_or_dead_channel_is_seen() {
        let (dir, mut own) = own_chan(2, 1, &addr(1));
        let peer = PeerChan::open(dir.path(), map::uid(), 1, &addr(1)).unwrap();
        own.close();
        assert_eq!(peer.liveness(), Liveness::Closed);
        assert!(matches!(
            PeerChan::open(dir.path(), map::uid(), 1, &addr(1)),
            Err(OpenError::Absent)
        ));
        // A name whose owner holds no lock is stale: opening removes it, a sweep too.
        let stale = dir.path().join(chan_name(map::uid(), &addr(2)));
        std::fs::write(&stale, [0u8; 300]).unwrap();
        assert!(matches!(
            PeerChan::open(dir.path(), map::uid(), 1, &addr(2)),
            Err(OpenError::Unusable(_))
        ));
        assert!(!stale.exists());
        std::fs::write(&stale, [0u8; 300]).unwrap();
        assert_eq!(CHANNEL.sweep(dir.path(), map::uid()), 1);
    }

    /// Whether the descriptor `fd` is readable now (a poll with no timeout) or within `ms`.
    fn readable(fd: std::os::fd::BorrowedFd<'_>, ms: i32) -> bool {
        use std::os::fd::AsRawFd;
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        #[allow(unsafe_code)]
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        n == 1 && p.revents & libc::POLLIN != 0
    }

    fn msg(i: u64) -> SlotHdr {
        SlotHdr {
            kind: K_MSG,
            flags: 0,
            len: 0,
            tag: i,
            word: 8,
            data: 0,
            token: 0,
        }
    }

    /// A completion queue's descriptor (a notifier's epoll set watching the wake pipe) becomes
    /// readable when a peer sends to an owner whose application sleeps on it, and the owner's
    /// futex (its waiter thread's) is not rung: one wake-up. Without the application asleep on
    /// the descriptor the futex is rung and the descriptor stays quiet. A header naming a pipe
    /// that is not there (a planted or stale one) makes the sender ring the futex instead.
    #[test]
    fn a_sleeping_application_is_woken_through_its_descriptor_not_the_futex() {
        let me = addr(21);
        let (dir, own) = own_chan(8, 5, &me);
        let n = crate::notify::Notifier::new();
        let fd = n.fd().expect("an epoll descriptor");
        n.watch(own.ring().wake_fd().expect("a wake pipe"));
        let peer = PeerChan::open(dir.path(), map::uid(), 5, &me).unwrap();
        let src = encode_addr(&addr(3));
        let d = own.ring().bell().unwrap();
        d.sleepers.store(1, Ordering::SeqCst); // the waiter thread sleeps on the futex
        let bell = || d.bell.load(Ordering::SeqCst);
        // `p` sends message `i` and rings the owner if it sleeps.
        let send = |p: &PeerChan, i: u64, body: &[u8]| {
            assert!(p.push(&msg(i), &src, body).is_some());
            p.ring_bell_if_asleep();
        };
        // A send from `p` rings the futex (`why`) and leaves the descriptor quiet.
        let rings_futex_only = |p: &PeerChan, i: u64, why: &str| {
            let b = bell();
            send(p, i, b"x");
            assert_ne!(bell(), b, "{why}");
            assert!(!readable(fd, 0));
        };

        // The application sleeps on the descriptor.
        assert!(!own.ring().arm_fd_wait(), "nothing is ready yet");
        assert!(!readable(fd, 0));
        let b0 = bell();
        send(&peer, 1, b"ping");
        assert!(readable(fd, 0), "the descriptor is readable at once");
        assert_eq!(bell(), b0, "the waiter's futex is not rung");
        // A second send finds the word taken: the application is waking, nobody is rung.
        send(&peer, 2, b"ping");
        assert_eq!(bell(), b0);
        assert!(readable(fd, 0));
        // Once the application polled, the futex rule holds again.
        d.awake();
        send(&peer, 6, b"ping");
        assert_ne!(bell(), b0, "the waiter's futex is rung");
        assert_eq!(own.peek().map(|h| h.hdr.tag), Some(1));
        own.pop();
        own.pop();
        own.pop();
        // Arming again empties the pipe.
        assert!(!own.ring().arm_fd_wait());
        assert!(!readable(fd, 0));
        // Arming with a slot there says so (poll instead of sleeping).
        assert!(peer.push(&msg(3), &src, b"x").is_some());
        assert!(own.ring().arm_fd_wait());
        own.pop();

        // The application waits another way: the futex is rung, the descriptor stays quiet.
        assert!(!own.ring().arm_fd_wait());
        assert!(!own.ring().disarm_fd_wait());
        rings_futex_only(&peer, 4, "the futex is rung");
        own.pop();

        // A header whose pipe identity is wrong: the sender cannot open it and rings the futex.
        own.ring().map.store64(H_WAKE_INO, 1);
        let fooled = PeerChan::open(dir.path(), map::uid(), 5, &me).unwrap();
        assert!(!own.ring().arm_fd_wait());
        rings_futex_only(&fooled, 5, "no pipe to write: the futex instead");
    }

    /// No lost wake-up: a consumer that sleeps only on the descriptor (no waiter thread, no
    /// timeout that would rescue it) and a producer that sends one message at a time, each after
    /// the consumer took the previous one, at random moments from a seed (so no later send can
    /// hide a lost wake-up: one lost hangs the consumer, and the test fails). The consumer also
    /// pauses at random between its last look at the ring and arming, so sends land unannounced
    /// there and arming must find them. Every message arrives once, in order.
    #[test]
    fn descriptor_wake_ups_are_never_lost() {
        use crate::fault::{Rng, test_seed};
        use std::time::{Duration, Instant};
        let seed = test_seed();
        println!("seed {seed}");
        let me = addr(22);
        let (dir, own) = own_chan(4, 5, &me);
        let n = crate::notify::Notifier::new();
        assert!(n.fd().is_some());
        n.watch(own.ring().wake_fd().unwrap());
        let peer = PeerChan::open(dir.path(), map::uid(), 5, &me).unwrap();
        const N: u64 = 2000;
        let taken = Arc::new(AtomicU64::new(0));
        let t = taken.clone();
        let producer = std::thread::spawn(move || {
            let mut rng = Rng::new(seed);
            let src = encode_addr(&addr(3));
            for i in 0..N {
                let limit = Instant::now() + Duration::from_secs(10);
                while t.load(Ordering::Acquire) < i {
                    assert!(
                        Instant::now() < limit,
                        "seed {seed}: message {i} never taken"
                    );
                    std::thread::yield_now();
                }
                match rng.below(4) {
                    0 => std::thread::sleep(Duration::from_micros(rng.below(100))),
                    1 => std::thread::yield_now(),
                    2 => (0..rng.below(2000)).for_each(|_| std::hint::spin_loop()),
                    _ => {}
                }
                assert!(peer.push(&msg(i), &src, &i.to_le_bytes()).is_some());
                peer.ring_bell_if_asleep();
            }
        });
        let (mut next, mut sleeps) = (0u64, 0u64);
        let mut rng = Rng::new(seed ^ 0xc0115);
        while next < N {
            while let Some(h) = own.peek() {
                assert_eq!(h.hdr.tag, next, "seed {seed}: in order, once");
                own.pop();
                next += 1;
                taken.store(next, Ordering::Release);
            }
            // Polled after a wake-up (as the endpoint's pass does).
            if let Some(d) = own.ring().bell() {
                d.awake();
            }
            match rng.below(4) {
                0 => std::thread::sleep(Duration::from_micros(rng.below(50))),
                1 => std::thread::yield_now(),
                2 => (0..rng.below(2000)).for_each(|_| std::hint::spin_loop()),
                _ => {}
            }
            if next == N || own.ring().arm_fd_wait() {
                continue;
            }
            sleeps += 1;
            let fd = n.fd().unwrap();
            assert!(
                readable(fd, 10_000),
                "seed {seed}: lost wake-up after {next} messages"
            );
        }
        producer.join().unwrap();
        assert!(sleeps > 0, "seed {seed}: the consumer never slept");
    }
}
