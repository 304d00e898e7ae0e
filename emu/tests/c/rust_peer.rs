//! The efa crate's side of `c_interop`: the mirror image of `peer.c`'s phases, on the crate's
//! `udp` device (the same SRD over UDP as the emulated NIC, MTU 8928). It runs inside the test
//! binary (the harness starts the binary again with `C_INTEROP_PEER` set) and speaks to the C
//! program through the harness: its `@` lines on stdout go to the C side's stdin and back.

use std::io::BufRead;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::device::udp::{UdpConfig, UdpDevice};
use efa::{
    Access, AddressVector, AtomicOp, AtomicRequest, AtomicType, Completion, CompletionFlags,
    CompletionQueue, Config, Domain, Endpoint, ErrorKind, MemoryRegion, PeerId, PostError, RawAddr,
    Rdm, RmaAddr, SendOptions,
};

pub const GROUPS: usize = 3;
pub const TAG_BASE: u64 = 0x7a00_0000_0000_0000;
/// The tag of `peer.c`'s messages to the old incarnation.
pub const STALE_TAG: u64 = 0x5ea1_e000_0000_0000;
const NATOM: usize = 8;

type Res<T> = Result<T, String>;

/// The generator both sides share (splitmix64), keyed by the seed.
#[derive(Clone, Copy)]
pub struct Gen {
    pub seed: u64,
}

fn sm(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Gen {
    pub fn mix(&self, a: u64, b: u64) -> u64 {
        let mut x = self.seed
            ^ a.wrapping_mul(0xD6E8_FEB8_6659_FD93)
            ^ b.wrapping_mul(0xA076_1D64_78BD_642F);
        sm(&mut x)
    }

    pub fn fill(buf: &mut [u8], s: u64) {
        let mut x = s;
        for chunk in buf.chunks_mut(8) {
            let v = sm(&mut x).to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    pub fn bytes(len: usize, s: u64) -> Vec<u8> {
        let mut v = vec![0u8; len];
        Gen::fill(&mut v, s);
        v
    }

    /// First differing byte.
    pub fn check(buf: &[u8], s: u64) -> Option<usize> {
        let want = Gen::bytes(buf.len(), s);
        buf.iter().zip(&want).position(|(a, b)| a != b)
    }
}

pub struct Msg {
    pub size: usize,
    pub tag: u64,
    pub ignore: u64,
    pub content: u64,
}

/// The messages of a tagged phase, as `peer.c`'s `tagged_msgs`.
pub fn tagged_msgs(g: Gen, phase: u64, sizes: &[usize]) -> Vec<Msg> {
    let mut m = Vec::new();
    for &size in sizes {
        for grp in 0..GROUPS as u64 {
            let n = m.len() as u64;
            m.push(Msg {
                size,
                tag: TAG_BASE | (phase << 16) | (grp << 8) | (g.mix(phase, 1000 + n) & 0xff),
                ignore: 0xff,
                content: g.mix(phase, n),
            });
        }
    }
    m
}

struct Peer {
    g: Gen,
    sizes: Vec<usize>,
    max: usize,
    domain: Domain,
    cq: CompletionQueue,
    av: AddressVector,
    ep: Endpoint<Rdm>,
    peer: Option<PeerId>,
    done: Vec<Completion>,
    lines: Receiver<String>,
    bytes: u64,
}

fn say(line: &str) {
    println!("@{line}");
}

impl Peer {
    fn peer(&self) -> Res<PeerId> {
        self.peer.ok_or_else(|| "no peer".to_string())
    }

    fn progress(&mut self) -> Res<()> {
        match self.cq.poll(&mut self.done, 64) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == ErrorKind::ErrorAvailable => {
                let err = self
                    .cq
                    .read_err()
                    .ok_or("error completion without an entry")?;
                Err(format!(
                    "error completion: context {} flags {:?} {} (status {:?})",
                    err.context, err.flags, err.error, err.status
                ))
            }
            Err(e) => Err(e.to_string()),
        }
    }

    fn take_where(&mut self, what: &str, pred: impl Fn(&Completion) -> bool) -> Res<Completion> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.progress()?;
            if let Some(i) = self.done.iter().position(&pred) {
                return Ok(self.done.remove(i));
            }
            if Instant::now() > deadline {
                return Err(format!("no completion for {what} within 60 s"));
            }
            std::thread::yield_now();
        }
    }

    fn take(&mut self, ctx: u64, what: &str) -> Res<Completion> {
        self.take_where(what, |c| {
            c.context == ctx && !c.flags.contains(CompletionFlags::REMOTE_WRITE)
        })
    }

    /// The next line from the C side, which must start with `prefix`; the rest of it.
    fn expect_line(&mut self, prefix: &str) -> Res<String> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            self.progress()?;
            match self.lines.recv_timeout(Duration::from_micros(50)) {
                Ok(l) => {
                    return l
                        .strip_prefix(prefix)
                        .map(str::to_string)
                        .ok_or_else(|| format!("expected a line {prefix:?}..., got {l:?}"));
                }
                Err(RecvTimeoutError::Disconnected) => return Err("stdin closed".into()),
                Err(RecvTimeoutError::Timeout) => {}
            }
            if Instant::now() > deadline {
                return Err(format!("no line {prefix:?} within 120 s"));
            }
        }
    }

    /// Posts with `f`, retrying (and progressing) while the endpoint says `Again`.
    fn post<B: Clone>(
        &mut self,
        what: &str,
        b: B,
        mut f: impl FnMut(&Self, B) -> Result<(), PostError>,
    ) -> Res<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match f(self, b.clone()) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Again => {
                    drop(e);
                    self.progress()?;
                    if Instant::now() > deadline {
                        return Err(format!("{what}: Again for 60 s"));
                    }
                }
                Err(e) => return Err(format!("{what}: {e}")),
            }
        }
    }

    fn send_addr(&self) {
        let hex: String = self
            .ep
            .addr()
            .to_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        say(&format!("ADDR {hex}"));
    }

    fn recv_addr(&mut self) -> Res<()> {
        let hex = self.expect_line("ADDR ")?;
        let bytes: Vec<u8> = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("address {hex}: {e}"))?;
        let a = RawAddr::from_bytes(&bytes).map_err(|e| e.to_string())?;
        println!("# libfabric peer at {a}");
        self.peer = Some(self.av.insert(a).map_err(|e| e.to_string())?);
        Ok(())
    }

    fn region(&self, bytes: Vec<u8>, access: Access) -> Res<MemoryRegion> {
        self.domain
            .register(bytes, access)
            .map_err(|e| e.to_string())
    }

    /// Tagged sends of a phase, in order; groups 1 and 2 send their messages of 1 MiB and more
    /// from registered regions the receiver may read (long-read where device RDMA read is on).
    fn tagged_send(&mut self, phase: u64) -> Res<()> {
        let msgs = tagged_msgs(self.g, phase, &self.sizes);
        let peer = self.peer()?;
        self.expect_line("POSTED ")?;
        for (i, m) in msgs.iter().enumerate() {
            let data = Gen::bytes(m.size, m.content);
            let ctx = 2000 + i as u64;
            if m.size >= 1 << 20 && (i % GROUPS) != 0 {
                let mut r = Some(self.region(data, Access::LOCAL | Access::REMOTE_READ)?);
                // A region is not Clone: post once, retrying by hand.
                let deadline = Instant::now() + Duration::from_secs(60);
                while let Some(reg) = r.take() {
                    match self.ep.tsend(peer, reg, m.tag, ctx) {
                        Ok(()) => {}
                        Err(e) if e.kind() == ErrorKind::Again => {
                            r = e.into_buffer().into_region();
                            self.progress()?;
                            if Instant::now() > deadline || r.is_none() {
                                return Err("tsend from a region: Again for 60 s".into());
                            }
                        }
                        Err(e) => return Err(format!("tsend from a region: {e}")),
                    }
                }
            } else {
                let data = Bytes::from(data);
                self.post("tsend", data, |p, d| p.ep.tsend(peer, d, m.tag, ctx))?;
            }
        }
        for i in 0..msgs.len() {
            let c = self.take(2000 + i as u64, "tagged send")?;
            if !c.flags.contains(CompletionFlags::SEND) {
                return Err(format!("send {i}: flags {:?}", c.flags));
            }
        }
        self.expect_line("RECVD ")?;
        println!("RESULT phase={phase} tagged_send count={}", msgs.len());
        Ok(())
    }

    fn check_tagged(&self, phase: u64, i: usize, c: &Completion, m: &Msg) -> Res<()> {
        let got = c.buf.as_recv().unwrap_or_default();
        if c.len != m.size || got.len() != m.size || c.tag != m.tag {
            return Err(format!(
                "phase {phase}: receive {i}: len {} tag {:#x} flags {:?}, expected len {} tag {:#x}",
                c.len, c.tag, c.flags, m.size, m.tag
            ));
        }
        if !c
            .flags
            .contains(CompletionFlags::TAGGED | CompletionFlags::RECV)
        {
            return Err(format!("phase {phase}: receive {i}: flags {:?}", c.flags));
        }
        if let Some(at) = Gen::check(got, m.content) {
            return Err(format!(
                "phase {phase}: message {i} ({} bytes, tag {:#x}) differs at byte {at}",
                m.size, m.tag
            ));
        }
        Ok(())
    }

    /// Tagged receives of a phase: half posted before the sender starts, half after.
    fn tagged_recv(&mut self, phase: u64) -> Res<()> {
        let msgs = tagged_msgs(self.g, phase, &self.sizes);
        let first = msgs.len() / 2;
        let post = |p: &mut Peer, i: usize| {
            let m = &msgs[i];
            let ctx = 1000 + i as u64;
            p.post("trecv", (), |p, ()| {
                p.ep.trecv(
                    BytesMut::with_capacity(m.size),
                    m.tag & !m.ignore,
                    m.ignore,
                    ctx,
                )
            })
        };
        for i in 0..first {
            post(self, i)?;
        }
        say(&format!("POSTED {phase}"));
        for i in 0..msgs.len() {
            if i == first {
                for j in first..msgs.len() {
                    post(self, j)?;
                }
            }
            let c = self.take(1000 + i as u64, "tagged receive")?;
            self.check_tagged(phase, i, &c, &msgs[i])?;
            self.bytes += msgs[i].size as u64;
        }
        say(&format!("RECVD {phase}"));
        println!("RESULT phase={phase} tagged_recv count={}", msgs.len());
        Ok(())
    }

    /// Untagged delivery-complete sends with remote CQ data, one per size.
    fn dc_send(&mut self, phase: u64) -> Res<()> {
        let peer = self.peer()?;
        self.expect_line("POSTED ")?;
        for k in 0..self.sizes.len() {
            let data = Bytes::from(Gen::bytes(self.sizes[k], self.g.mix(phase, k as u64)));
            let o = SendOptions::default()
                .with_data((phase << 16 | k as u64) as u32)
                .with_delivery_complete(true);
            let ctx = 4000 + k as u64;
            self.post("send_with", data, |p, d| p.ep.send_with(peer, d, o, ctx))?;
        }
        for k in 0..self.sizes.len() {
            self.take(4000 + k as u64, "dc send")?;
        }
        self.expect_line("RECVD ")?;
        println!("RESULT phase={phase} dc_send count={}", self.sizes.len());
        Ok(())
    }

    fn dc_recv(&mut self, phase: u64) -> Res<()> {
        for k in 0..self.sizes.len() {
            let size = self.sizes[k];
            let ctx = 3000 + k as u64;
            self.post("recv", (), |p, ()| {
                p.ep.recv(BytesMut::with_capacity(size), ctx)
            })?;
        }
        say(&format!("POSTED {phase}"));
        for k in 0..self.sizes.len() {
            let c = self.take(3000 + k as u64, "dc receive")?;
            let want =
                CompletionFlags::MSG | CompletionFlags::RECV | CompletionFlags::REMOTE_CQ_DATA;
            let data = (phase << 16 | k as u64) as u32;
            if c.len != self.sizes[k] || !c.flags.contains(want) || c.data != Some(data) {
                return Err(format!(
                    "phase {phase}: receive {k}: len {} flags {:?} data {:?}",
                    c.len, c.flags, c.data
                ));
            }
            if let Some(at) = Gen::check(
                c.buf.as_recv().unwrap_or_default(),
                self.g.mix(phase, k as u64),
            ) {
                return Err(format!("phase {phase}: message {k} differs at byte {at}"));
            }
            self.bytes += c.len as u64;
        }
        say(&format!("RECVD {phase}"));
        println!("RESULT phase={phase} dc_recv count={}", self.sizes.len());
        Ok(())
    }

    /// The C side writes, reads and writes with data into our region.
    fn rma_target(&mut self, phase: u64, region: &MemoryRegion) -> Res<()> {
        let rk = region.remote_key().map_err(|e| e.to_string())?;
        say(&format!("RKEY {:x} {:x} {:x}", rk.addr, rk.key, rk.len));
        for k in 0..self.sizes.len() {
            let s = self.sizes[k];
            self.expect_line("WROTE ")?;
            let data = (phase << 16 | k as u64) as u32;
            let c = self.take_where("remote write with data", |c| {
                c.flags.contains(CompletionFlags::REMOTE_WRITE)
            })?;
            let want = CompletionFlags::RMA
                | CompletionFlags::REMOTE_WRITE
                | CompletionFlags::REMOTE_CQ_DATA;
            if !c.flags.contains(want) || c.data != Some(data) || c.len != s {
                return Err(format!(
                    "phase {phase}: remote write completion flags {:?} data {:?} len {}, expected data {data:#x} len {s}",
                    c.flags, c.data, c.len
                ));
            }
            let mem = region.read();
            if let Some(at) = Gen::check(&mem[..s], self.g.mix(phase, k as u64)) {
                return Err(format!(
                    "phase {phase}: fi_write of {s} bytes differs at byte {at}"
                ));
            }
            if let Some(at) = Gen::check(
                &mem[self.max..self.max + s],
                self.g.mix(phase, 100 + k as u64),
            ) {
                return Err(format!(
                    "phase {phase}: fi_writedata of {s} bytes differs at byte {at}"
                ));
            }
            drop(mem);
            say(&format!("CHECKED {k}"));
            self.bytes += 3 * s as u64;
        }
        println!("RESULT phase={phase} rma_target sizes={}", self.sizes.len());
        Ok(())
    }

    fn remote(&mut self, prefix: &str) -> Res<(u64, u64, u64)> {
        let l = self.expect_line(prefix)?;
        let v: Vec<u64> = l
            .split_whitespace()
            .map(|w| u64::from_str_radix(w, 16))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{prefix}{l}: {e}"))?;
        match v[..] {
            [a, k, n] => Ok((a, k, n)),
            _ => Err(format!("{prefix}{l}: three numbers expected")),
        }
    }

    /// We write (from a region the target may read, for 1 MiB and more), read back and write
    /// with data into the C side's fi_mr_reg region.
    fn rma_initiator(&mut self, phase: u64) -> Res<()> {
        let (addr, key, len) = self.remote("CKEY ")?;
        if len < 2 * self.max as u64 {
            return Err(format!("remote region of {len} bytes is too small"));
        }
        let peer = self.peer()?;
        for k in 0..self.sizes.len() {
            let s = self.sizes[k];
            let to = RmaAddr { addr, key };
            let data = Gen::bytes(s, self.g.mix(phase, k as u64));
            if s >= 1 << 20 {
                let mut r = Some(self.region(data, Access::LOCAL | Access::REMOTE_READ)?);
                while let Some(reg) = r.take() {
                    match self.ep.write(peer, reg, to, 5000) {
                        Ok(()) => {}
                        Err(e) if e.kind() == ErrorKind::Again => {
                            r = e.into_buffer().into_region();
                            self.progress()?;
                        }
                        Err(e) => return Err(format!("write from a region: {e}")),
                    }
                }
            } else {
                let data = Bytes::from(data);
                self.post("write", data, |p, d| p.ep.write(peer, d, to, 5000))?;
            }
            self.take(5000, "write")?;
            self.post("read", (), |p, ()| {
                p.ep.read(peer, BytesMut::new(), s, to, 5001)
            })?;
            let c = self.take(5001, "read")?;
            let got = c.buf.as_recv().unwrap_or_default();
            if got.len() != s {
                return Err(format!(
                    "phase {phase}: read {} bytes, expected {s}",
                    got.len()
                ));
            }
            if let Some(at) = Gen::check(got, self.g.mix(phase, k as u64)) {
                return Err(format!(
                    "phase {phase}: read of {s} bytes differs at byte {at}"
                ));
            }
            let data = Bytes::from(Gen::bytes(s, self.g.mix(phase, 100 + k as u64)));
            let imm = (phase << 16 | k as u64) as u32;
            let to2 = RmaAddr {
                addr: addr + self.max as u64,
                key,
            };
            self.post("write_data", data, |p, d| {
                p.ep.write_data(peer, d, to2, imm, 5002)
            })?;
            self.take(5002, "write_data")?;
            say(&format!("WROTE {k}"));
            self.expect_line("CHECKED ")?;
            self.bytes += 3 * s as u64;
        }
        println!(
            "RESULT phase={phase} rma_initiator sizes={}",
            self.sizes.len()
        );
        Ok(())
    }

    /// The counters the harness reads: packets the engine dropped (a wire difference shows
    /// there first), unexpected messages, the device's RDMA.
    fn print_stats(&self) {
        let s = self.ep.stats();
        let d = self.domain.device().stats();
        println!(
            "STATS dropped_pkts={} unexpected_msgs={} rnr={} retransmits={} errors={} rdma_ops={} rdma_bytes={} stale_dropped={} malformed_dropped={}",
            s.dropped_pkts,
            s.unexpected_msgs,
            s.rnr,
            s.retransmits,
            s.errors,
            d.rdma_ops,
            d.rdma_bytes,
            d.stale_dropped,
            d.malformed_dropped
        );
    }

    fn atom_init(&self, phase: u64, j: usize) -> u64 {
        self.g.mix(phase, 200 + j as u64) >> 8
    }

    fn atomic_target(&mut self, phase: u64, region: &mut MemoryRegion) -> Res<()> {
        {
            let mut w = region.write();
            for j in 0..NATOM {
                w[8 * j..8 * j + 8].copy_from_slice(&self.atom_init(phase, j).to_le_bytes());
            }
        }
        let rk = region.remote_key().map_err(|e| e.to_string())?;
        say(&format!("ATOM {:x} {:x} {:x}", rk.addr, rk.key, rk.len));
        let l = self.expect_line("ATOMIC_DONE ")?;
        let mem = region.read();
        for j in 0..NATOM {
            let want = u64::from_str_radix(l.get(16 * j..16 * j + 16).unwrap_or(""), 16)
                .map_err(|e| format!("ATOMIC_DONE {l}: {e}"))?;
            let got = u64::from_le_bytes(mem[8 * j..8 * j + 8].try_into().unwrap_or_default());
            if got != want {
                return Err(format!(
                    "phase {phase}: element {j} is {got:#x} after the C side's atomics, expected {want:#x}"
                ));
            }
        }
        drop(mem);
        say("ATOMIC_CHECKED");
        println!("RESULT phase={phase} atomic_target elements={NATOM}");
        Ok(())
    }

    fn fetch(&mut self, what: &str, req: AtomicRequest, to: RmaAddr, ctx: u64) -> Res<Vec<u64>> {
        let peer = self.peer()?;
        self.post(what, req, |p, r| {
            p.ep.fetch_atomic(peer, r, BytesMut::with_capacity(8 * NATOM), to, ctx)
        })?;
        let c = self.take(ctx, what)?;
        let got = c.buf.as_recv().unwrap_or_default();
        if got.len() != 8 * NATOM {
            return Err(format!("{what}: fetched {} bytes", got.len()));
        }
        Ok(got
            .chunks(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
            .collect())
    }

    fn atomic_initiator(&mut self, phase: u64) -> Res<()> {
        let (addr, key, _) = self.remote("ATOM ")?;
        let to = RmaAddr { addr, key };
        let peer = self.peer()?;
        let le =
            |v: &[u64]| Bytes::from(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
        let mut v: Vec<u64> = (0..NATOM).map(|j| self.atom_init(phase, j)).collect();
        let op: Vec<u64> = (0..NATOM as u64).map(|j| j + 1).collect();
        let req = AtomicRequest {
            op: AtomicOp::Sum,
            datatype: AtomicType::U64,
            operand: le(&op),
            compare: None,
        };
        self.post("atomic", req, |p, r| p.ep.atomic(peer, r, to, 6000))?;
        self.take(6000, "atomic")?;
        for j in 0..NATOM {
            v[j] = v[j].wrapping_add(op[j]);
        }
        let op: Vec<u64> = (0..NATOM as u64).map(|j| 100 + j).collect();
        let req = AtomicRequest {
            op: AtomicOp::Sum,
            datatype: AtomicType::U64,
            operand: le(&op),
            compare: None,
        };
        let got = self.fetch("fetch_atomic", req, to, 6001)?;
        if got != v {
            return Err(format!("fetch_atomic fetched {got:x?}, expected {v:x?}"));
        }
        for j in 0..NATOM {
            v[j] = v[j].wrapping_add(op[j]);
        }
        let cmp: Vec<u64> = (0..NATOM)
            .map(|j| if j < 4 { v[j] } else { v[j] + 1 })
            .collect();
        let swap: Vec<u64> = (0..NATOM as u64)
            .map(|j| self.g.mix(phase, 300 + j))
            .collect();
        let req = AtomicRequest {
            op: AtomicOp::Cswap,
            datatype: AtomicType::U64,
            operand: le(&swap),
            compare: Some(le(&cmp)),
        };
        let got = self.fetch("compare_atomic", req, to, 6002)?;
        if got != v {
            return Err(format!("compare atomic fetched {got:x?}, expected {v:x?}"));
        }
        v[..4].copy_from_slice(&swap[..4]);
        let line: String = v.iter().map(|x| format!("{x:016x}")).collect();
        say(&format!("ATOMIC_DONE {line}"));
        self.expect_line("ATOMIC_CHECKED")?;
        println!("RESULT phase={phase} atomic_initiator ops=3");
        Ok(())
    }

    /// The new incarnation: wildcard tagged receives take the C side's messages in the order
    /// it sent them, and nothing else (nothing it sent to the old incarnation).
    fn fresh_recv(&mut self, phase: u64) -> Res<()> {
        let msgs = tagged_msgs(self.g, phase, &self.sizes);
        for (i, m) in msgs.iter().enumerate() {
            let ctx = 1000 + i as u64;
            let size = m.size;
            self.post("trecv", (), |p, ()| {
                p.ep.trecv(BytesMut::with_capacity(size), 0, !0, ctx)
            })?;
        }
        // One more, which must stay empty.
        self.post("trecv", (), |p, ()| {
            p.ep.trecv(BytesMut::with_capacity(1 << 16), 0, !0, 1999)
        })?;
        say(&format!("POSTED {phase}"));
        for (i, m) in msgs.iter().enumerate() {
            let c = self.take(1000 + i as u64, "wildcard receive")?;
            self.check_tagged(phase, i, &c, m)?;
            self.bytes += m.size as u64;
        }
        let until = Instant::now() + Duration::from_millis(300);
        while Instant::now() < until {
            self.progress()?;
            if let Some(c) = self.done.iter().find(|c| c.context == 1999) {
                if c.tag & !0xffff == STALE_TAG {
                    return Err(format!(
                        "the new incarnation received a message sent to the old one: tag {:#x}",
                        c.tag
                    ));
                }
                return Err(format!(
                    "the new incarnation received a message it was not sent: tag {:#x}, {} bytes",
                    c.tag, c.len
                ));
            }
        }
        self.ep.cancel(1999).map_err(|e| format!("cancel: {e}"))?;
        // The cancelled receive completes once, with `Canceled`.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.cq.poll(&mut self.done, 64) {
                Err(e) if e.kind() == ErrorKind::ErrorAvailable => {
                    let err = self
                        .cq
                        .read_err()
                        .ok_or("error completion without an entry")?;
                    if err.context != 1999 || err.error.kind() != ErrorKind::Canceled {
                        return Err(format!("error completion: {} {}", err.context, err.error));
                    }
                    break;
                }
                Err(e) => return Err(e.to_string()),
                Ok(_) if Instant::now() > deadline => {
                    return Err("the cancelled receive did not complete".into());
                }
                Ok(_) => {}
            }
        }
        say(&format!("RECVD {phase}"));
        println!("RESULT phase={phase} fresh_recv count={}", msgs.len());
        Ok(())
    }
}

/// Runs the peer; `incarnation` 1 does phases 1-9 and exits, 2 does 10-11.
pub fn run(incarnation: u32) -> Res<()> {
    let var = |k: &str| std::env::var(k).map_err(|_| format!("{k} is not set"));
    let g = Gen {
        seed: var("C_INTEROP_SEED")?
            .parse()
            .map_err(|e| format!("seed: {e}"))?,
    };
    let sizes: Vec<usize> = var("C_INTEROP_SIZES")?
        .split(',')
        .map(|s| s.parse().map_err(|e| format!("size {s}: {e}")))
        .collect::<Res<_>>()?;
    let max = sizes.iter().copied().max().unwrap_or(1);
    let rdma = var("C_INTEROP_RDMA")? == "1";
    let domain = if std::env::var("C_INTEROP_DEVICE").as_deref() == Ok("efa") {
        // The crate's efa device, on an emulated NIC of its own (`efa-emu run`); built with
        // the `efa` feature (examples/c-interop-peer.rs). FI_EFA_ENABLE_SHM_TRANSFER=0 keeps
        // it on the NIC.
        let hints = efa::Hints::new().provider("efa").ep_type(efa::EpType::Rdm);
        let info = efa::getinfo(&hints)
            .map_err(|e| format!("getinfo efa: {e}"))?
            .into_iter()
            .next()
            .ok_or("no efa device")?;
        Domain::open(&info).map_err(|e| e.to_string())?
    } else {
        let bind = var("C_INTEROP_BIND")?
            .parse()
            .map_err(|e| format!("bind: {e}"))?;
        let dev = UdpDevice::open(
            UdpConfig::default()
                .with_bind(bind)
                // The emulated NIC's MTU: both ends size packets to it.
                .with_mtu(8928)
                .with_rdma(rdma),
        )
        .map_err(|e| e.to_string())?;
        let config = Config::from_env().map_err(|e| e.to_string())?;
        Domain::with_device(dev as Arc<dyn efa::device::Device>, config)
    };
    let cq = CompletionQueue::new(&domain, 4096).map_err(|e| e.to_string())?;
    let av = AddressVector::new(&domain);
    let ep = Endpoint::<Rdm>::builder(&domain)
        .cq(&cq)
        .av(&av)
        .build()
        .map_err(|e| e.to_string())?;
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::stdin().lock().lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut p = Peer {
        g,
        sizes,
        max,
        domain,
        cq,
        av,
        ep,
        peer: None,
        done: Vec::new(),
        lines,
        bytes: 0,
    };
    println!(
        "# rust peer {incarnation} at {} on {} (device rdma read {})",
        p.ep.addr(),
        p.domain.attr().name,
        p.domain.attr().caps.rdma_read
    );
    if incarnation == 1 {
        p.send_addr();
        p.recv_addr()?;
        p.tagged_send(1)?;
        p.tagged_recv(2)?;
        p.dc_send(3)?;
        p.dc_recv(4)?;
        let mut region = p.region(vec![0u8; 2 * max], Access::LOCAL | Access::REMOTE)?;
        p.rma_target(5, &region)?;
        p.rma_initiator(6)?;
        p.atomic_target(7, &mut region)?;
        p.atomic_initiator(8)?;
        // Phase 9: the C side sends us messages we never receive, then we go.
        p.expect_line("STALE_SENT")?;
        let until = Instant::now() + Duration::from_millis(100);
        while Instant::now() < until {
            p.progress()?;
        }
        let e = p.ep.rma_emulation();
        let s = p.ep.stats();
        println!(
            "RESULT incarnation=1 bytes={} device_rma_bytes={} emulated_rma_bytes={} emulated_read={} emulated_write={}",
            p.bytes, s.device_rma_bytes, s.emulated_rma_bytes, e.read, e.write
        );
        p.print_stats();
        say("BYE");
    } else {
        p.send_addr();
        p.recv_addr()?;
        p.fresh_recv(10)?;
        p.tagged_send(11)?;
        println!("RESULT incarnation=2 bytes={}", p.bytes);
        p.print_stats();
    }
    Ok(())
}
