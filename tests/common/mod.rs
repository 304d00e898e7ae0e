//! Shared by the RDM integration tests: endpoints on every software device, a seeded message
//! mix, and the checks that it arrived exactly once, intact and in order.
#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::device::loopback::{LoopbackConfig, LoopbackDevice, LoopbackNetwork};
use efa::device::route::RoutedDevice;
use efa::device::shm::{ShmConfig, ShmDevice};
use efa::device::udp::{UdpConfig, UdpDevice};
use efa::fault::{FaultConfig, Rng};
use efa::{
    AddressVector, Completion, CompletionFlags, CompletionQueue, Config, Domain, Endpoint,
    ErrorKind, PeerId, RawAddr, Rdm, RecvOptions, SendOptions,
};

/// Generous deadline: tests fail instead of hanging.
pub const DEADLINE: Duration = Duration::from_secs(120);

/// A domain on a udp device bound to `ip`, with `faults` (see [`net_device`]).
pub fn udp_domain(ip: IpAddr, faults: FaultConfig) -> Domain {
    Domain::with_device(net_device(ip, faults), Config::default())
}

/// True when the network tests run on the `efa` device (`EFA_TEST_DEVICE=efa`, under the
/// emulated NIC: `efa-emu run -- cargo test --features efa ...`).
pub fn on_efa() -> bool {
    std::env::var("EFA_TEST_DEVICE").is_ok_and(|v| v == "efa")
}

/// The device the network tests run on: a udp device bound to `ip` with `faults`, or with
/// `EFA_TEST_DEVICE=efa` the first `efa` device (the emulated NIC's faults come from
/// `EFA_EMU_FAULTS` instead).
pub fn net_device(ip: IpAddr, faults: FaultConfig) -> Arc<dyn efa::device::Device> {
    if on_efa() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        return efa_device();
    }
    UdpDevice::open(UdpConfig::default().with_bind(ip).with_faults(faults)).expect("udp device")
}

#[cfg(feature = "efa")]
fn efa_device() -> Arc<dyn efa::device::Device> {
    let mut all = efa::device::efa::EfaDevice::open_all(&Config::default()).expect("efa device");
    assert!(
        !all.is_empty(),
        "EFA_TEST_DEVICE=efa but no EFA device (run under `efa-emu run --`)"
    );
    all.swap_remove(0)
}

#[cfg(not(feature = "efa"))]
fn efa_device() -> Arc<dyn efa::device::Device> {
    panic!("EFA_TEST_DEVICE=efa needs `--features efa`")
}

/// A private directory for one test's shm files, in `/dev/shm` when there is one.
pub fn shm_test_dir(prefix: &str) -> tempfile::TempDir {
    let base = std::path::Path::new("/dev/shm");
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(if base.is_dir() {
            base.to_path_buf()
        } else {
            std::env::temp_dir()
        })
        .expect("create a temporary directory")
}

/// A domain on an shm device in `dir`, and the device.
pub fn shm_domain(dir: &std::path::Path) -> (Domain, Arc<ShmDevice>) {
    let dev = ShmDevice::open(ShmConfig::in_dir(dir)).expect("shm device");
    (Domain::with_device(dev.clone(), Config::default()), dev)
}

/// A udp device on `udp.bind` routed over shm in `dir`.
pub fn routed_with(dir: &std::path::Path, udp: UdpConfig) -> Arc<RoutedDevice> {
    let udp = UdpDevice::open(udp).expect("udp device");
    RoutedDevice::open(udp, ShmConfig::in_dir(dir)).expect("routed device")
}

/// A domain on a udp device on 127.0.0.1 routed over shm in `dir`, and the device.
pub fn routed_domain(dir: &std::path::Path) -> (Domain, Arc<RoutedDevice>) {
    let dev = routed_with(dir, UdpConfig::default());
    (Domain::with_device(dev.clone(), Config::default()), dev)
}

/// A domain on a loopback device on `net`.
pub fn loopback_domain(net: &LoopbackNetwork) -> Domain {
    Domain::with_device(
        LoopbackDevice::open(net, LoopbackConfig::default()).expect("loopback"),
        Config::default(),
    )
}

/// One RDM endpoint with its queue and address vector.
pub struct Node {
    pub cq: CompletionQueue,
    pub av: AddressVector,
    pub ep: Endpoint<Rdm>,
}

impl Node {
    pub fn new(d: &Domain) -> Node {
        Node::with_local_path(d, true)
    }

    /// An endpoint whose same-host peers go through the device (`local_path(false)`), so that
    /// routing and device paths are what a test sees.
    pub fn device_path(d: &Domain) -> Node {
        Node::with_local_path(d, false)
    }

    pub fn with_local_path(d: &Domain, on: bool) -> Node {
        Node::build(d, |b| b.local_path(on)).unwrap()
    }

    /// A node whose endpoint builder `f` configures further (options, counters, ...) after its
    /// queue and address vector are set.
    pub fn build(
        d: &Domain,
        f: impl FnOnce(efa::EndpointBuilder<Rdm>) -> efa::EndpointBuilder<Rdm>,
    ) -> efa::Result<Node> {
        let cq = CompletionQueue::new(d, 4096)?;
        let av = AddressVector::new(d);
        let ep = f(Endpoint::<Rdm>::builder(d).cq(&cq).av(&av)).build()?;
        Ok(Node { cq, av, ep })
    }

    pub fn insert(&self, addr: RawAddr) -> PeerId {
        self.av.insert(addr).unwrap()
    }

    /// Whatever completions arrive within a few milliseconds; an error completion fails the test.
    pub fn collect_some(&self) -> Vec<Completion> {
        let mut out = Vec::new();
        match self.cq.wait(&mut out, 256, Some(Duration::from_millis(5))) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::TimedOut => {}
            Err(e) => panic!("{e}: {:?}", self.cq.read_err()),
        }
        out
    }

    /// One poll into `out`; an error completion fails the test (`ctx` says which run).
    pub fn poll_ok(&self, out: &mut Vec<Completion>, ctx: &dyn std::fmt::Display) {
        if let Err(e) = self.cq.poll(out, 64) {
            panic!("{ctx}: {e}: {:?}", self.cq.read_err());
        }
    }

    /// Polls until an error completion is ready and returns it; a successful completion, another
    /// error, or none within `within` fails the test (`what` names the operation expected to
    /// fail).
    pub fn expect_err(&self, within: Duration, what: &str) -> efa::CompletionError {
        let deadline = Instant::now() + within;
        let mut out = Vec::new();
        loop {
            match self.cq.poll(&mut out, 1) {
                Ok(0) => {}
                Ok(_) => panic!("{what} completed instead of failing: {:?}", out[0].len),
                Err(e) if e.kind() == ErrorKind::ErrorAvailable => {
                    return self.cq.read_err().unwrap();
                }
                Err(e) => panic!("{what}: {e}"),
            }
            assert!(
                Instant::now() < deadline,
                "{what}: no error completion within {within:?}"
            );
        }
    }

    /// Reads completions until `n` arrived; an error completion fails the test.
    pub fn collect(&self, n: usize, what: &str) -> Vec<Completion> {
        let deadline = Instant::now() + DEADLINE;
        let mut out = Vec::new();
        while out.len() < n {
            let want = n - out.len();
            match self
                .cq
                .wait(&mut out, want, Some(Duration::from_millis(50)))
            {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::TimedOut => {}
                Err(e) => panic!("{what}: {e}: {:?}", self.cq.read_err()),
            }
            assert!(
                Instant::now() < deadline,
                "{what}: only {} of {n} completions",
                out.len()
            );
        }
        out
    }
}

/// The bytes of message `i` of a mix seeded with `seed`.
pub fn payload(seed: u64, i: usize, len: usize) -> Bytes {
    let mut r = Rng::new(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut v = vec![0u8; len];
    let mut k = 0;
    while k < len {
        let w = r.next_u64().to_le_bytes();
        let n = (len - k).min(8);
        v[k..k + n].copy_from_slice(&w[..n]);
        k += n;
    }
    Bytes::from(v)
}

/// One message of a mix.
#[derive(Clone, Debug)]
pub struct Msg {
    pub len: usize,
    pub tag: Option<u64>,
    pub data: Option<u32>,
    pub dc: bool,
}

/// A seeded mix: mostly small, some medium and long-CTS sizes, a few up to `max` bytes.
pub fn mix(seed: u64, n: usize, max: usize) -> Vec<Msg> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|i| {
            let len = match r.below(100) {
                0..=59 => r.below(8193) as usize,
                60..=84 => r.below(65_537) as usize,
                85..=96 => r.below(262_145) as usize,
                _ => r.below(max as u64 + 1) as usize,
            };
            Msg {
                len,
                tag: r.chance(0.5).then_some(i as u64),
                data: r.chance(0.3).then_some(i as u32),
                dc: r.chance(0.2),
            }
        })
        .collect()
}

/// Sends the mix to `peer`, retrying on `Again`.
pub fn send_mix(node: &Node, peer: PeerId, seed: u64, msgs: &[Msg]) {
    let deadline = Instant::now() + DEADLINE;
    for (i, m) in msgs.iter().enumerate() {
        let mut o = SendOptions::default().with_delivery_complete(m.dc);
        o.tag = m.tag;
        o.data = m.data;
        let mut buf = payload(seed, i, m.len);
        loop {
            match node.ep.send_with(peer, buf, o, i as u64) {
                Ok(()) => break,
                Err(e) if e.kind() == ErrorKind::Again => {
                    buf = e.into_buffer().as_send().cloned().unwrap();
                    let _ = node.cq.poll(&mut Vec::new(), 0);
                    node.ep.progress();
                    assert!(
                        Instant::now() < deadline,
                        "seed {seed}: send {i} kept getting Again"
                    );
                }
                Err(e) => panic!("seed {seed}: send {i}: {e}"),
            }
        }
    }
}

/// Posts one receive per message of the mix, in order, from `from`.
pub fn post_mix(node: &Node, from: Option<PeerId>, seed: u64, msgs: &[Msg], ctx_base: u64) {
    for (i, m) in msgs.iter().enumerate() {
        let mut o = RecvOptions::default();
        o.tag = m.tag.map(|t| (t, 0));
        o.from = from;
        let mut buf = BytesMut::with_capacity(m.len.max(1));
        loop {
            match node.ep.recv_with(buf, o, ctx_base + i as u64) {
                Ok(()) => break,
                Err(e) if e.kind() == ErrorKind::Again => {
                    buf = e.into_buffer().into_recv().unwrap();
                    node.ep.progress();
                }
                Err(e) => panic!("seed {seed}: recv {i}: {e}"),
            }
        }
    }
}

/// Checks the receive completions of a mix: each message once, intact, with its tag and data.
pub fn check_mix(done: &[Completion], seed: u64, msgs: &[Msg], ctx_base: u64, src: Option<PeerId>) {
    let mut seen = vec![false; msgs.len()];
    for c in done
        .iter()
        .filter(|c| c.flags.contains(CompletionFlags::RECV))
    {
        let i = (c.context - ctx_base) as usize;
        let m = &msgs[i];
        assert!(!seen[i], "seed {seed}: message {i} completed twice");
        seen[i] = true;
        assert_eq!(c.len, m.len, "seed {seed}: length of message {i}");
        let got = c.buf.as_recv().unwrap();
        assert!(
            got[..] == payload(seed, i, m.len)[..],
            "seed {seed}: data of message {i}"
        );
        assert_eq!(c.tag, m.tag.unwrap_or(0), "seed {seed}: tag of message {i}");
        assert_eq!(c.data, m.data, "seed {seed}: cq data of message {i}");
        assert_eq!(
            c.flags.contains(CompletionFlags::TAGGED),
            m.tag.is_some(),
            "seed {seed}: {i}"
        );
        if src.is_some() {
            assert_eq!(c.source, src, "seed {seed}: FI_SOURCE of message {i}");
        }
    }
    assert!(
        seen.iter().all(|&s| s),
        "seed {seed}: some messages never completed"
    );
}

/// Loopback address of the machine.
pub const LOCAL4: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// A fresh loopback network with SRD-style faults.
pub fn faulty_net(seed: u64) -> LoopbackNetwork {
    LoopbackNetwork::new(
        FaultConfig::seeded(seed)
            .drop(0.1)
            .duplicate(0.1)
            .reorder(0.1),
    )
}

/// Keeps `Arc` in scope for callers that share nodes between threads.
pub type Shared<T> = Arc<T>;

/// Floods `b` from `a` with 1200 tagged 64 KiB messages (75 MiB, above the engine's 64 MiB
/// default cap) before any receive is posted, the receiver only making progress, for two
/// seconds or until everything is sent: past the cap the sender must be held back (`Again`),
/// never served by dropping. Then posts the receives and checks that every message arrives
/// intact, nothing was dropped and nothing stays held. Returns what `b` held after the flood.
pub fn flood_then_receive(
    a: &Node,
    b: &Node,
    until_held: Option<usize>,
) -> efa::proto::engine::Resources {
    let pb = a.insert(b.ep.addr());
    let (n, size) = (1200usize, 64 << 10);
    let deadline = Instant::now() + DEADLINE;
    let mut sent = 0;
    let mut out = Vec::new();
    // Flood for 2 s, or with `until_held` until the receiver holds that much (at most 20 s): a
    // fixed time alone fills less on a loaded machine.
    let start = Instant::now();
    let phase = |held: usize| match until_held {
        None => start.elapsed() < Duration::from_secs(2),
        Some(h) => held < h && start.elapsed() < Duration::from_secs(20),
    };
    while sent < n && phase(b.ep.resources().buffered_bytes) {
        match a.ep.tsend(pb, payload(9, sent, size), 77, sent as u64) {
            Ok(()) => sent += 1,
            Err(e) if e.kind() == ErrorKind::Again => {}
            Err(e) => panic!("send {sent}: {e}"),
        }
        b.ep.progress();
        out.clear();
        a.cq.poll(&mut out, 256).unwrap();
    }
    let held = b.ep.resources();
    assert!(held.buffered_bytes <= 64 << 20, "{held:?}");
    for i in 0..n {
        b.ep.trecv(BytesMut::with_capacity(size), 77, 0, i as u64)
            .unwrap();
    }
    let mut got = Vec::new();
    while got.len() < n {
        while sent < n {
            match a.ep.tsend(pb, payload(9, sent, size), 77, sent as u64) {
                Ok(()) => sent += 1,
                Err(e) if e.kind() == ErrorKind::Again => break,
                Err(e) => panic!("send {sent}: {e}"),
            }
        }
        out.clear();
        let _ = a.cq.poll(&mut out, 256);
        got.extend(b.collect_some());
        assert!(
            Instant::now() < deadline,
            "{} of {n} arrived; {:?}",
            got.len(),
            b.ep.stats()
        );
    }
    assert_eq!(
        b.ep.stats().dropped_pkts,
        0,
        "nothing dropped for lack of memory"
    );
    for c in &got {
        let i = c.context as usize;
        assert!(
            c.buf.as_recv().unwrap()[..] == payload(9, i, size)[..],
            "message {i}"
        );
    }
    assert_eq!(b.ep.resources().buffered_bytes, 0);
    held
}

/// A child process running one ignored test of this test binary, its stdin and stdout piped.
pub struct Proc {
    pub child: std::process::Child,
    pub stdin: std::process::ChildStdin,
    pub lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

/// Runs the ignored test `test` of this test binary in a child process with `env` set.
pub fn spawn_test(test: &str, env: &[(&str, &std::ffi::OsStr)]) -> Proc {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            test,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let stdin = child.stdin.take().unwrap();
    let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    Proc {
        child,
        stdin,
        lines,
    }
}

/// The rest of the first line the child prints that starts with `tag`.
pub fn read_tagged(p: &mut Proc, tag: &str) -> String {
    for l in p.lines.by_ref() {
        let l = l.unwrap();
        if let Some(rest) = l.strip_prefix(tag) {
            return rest.trim().to_string();
        }
    }
    panic!("child exited before printing {tag}");
}

/// Every size of `sizes` twice (untagged, then tagged on every other message), with CQ data on
/// every third message and delivery complete on every `dc_every`-th.
pub fn each_size_twice(sizes: &[usize], dc_every: usize) -> Vec<Msg> {
    sizes
        .iter()
        .chain(sizes.iter())
        .enumerate()
        .map(|(i, &len)| Msg {
            len,
            tag: (i % 2 == 1).then_some(i as u64),
            data: (i % 3 == 0).then_some(i as u32),
            dc: i % dc_every == 0,
        })
        .collect()
}

/// The example `name` as `cargo test` builds it (beside this test binary's directory), or `None`
/// (with a note) when it is not built.
pub fn example_bin(name: &str) -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("examples").join(name);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipped: {} not built", p.display());
        None
    }
}

/// A memfd of `len` bytes named `name` (the name shows in /proc/self/maps), made with
/// `MFD_CLOEXEC` and `flags`.
pub fn memfd(name: &str, len: u64, flags: libc::c_uint) -> std::fs::File {
    use std::os::fd::FromRawFd;
    let cname = std::ffi::CString::new(name).unwrap();
    // SAFETY: a valid C string; the descriptor is owned by the File below.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | flags) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor nobody else owns.
    let f = std::fs::File::from(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
    f.set_len(len).unwrap();
    f
}

/// A domain on each network device this run tests, with what keeps it alive: loopback, udp
/// (the efa device with `EFA_TEST_DEVICE=efa`, named so) and shm (in a fresh directory whose
/// name begins with `shm_prefix`).
pub fn device_domains(shm_prefix: &str) -> Vec<(&'static str, Domain, Box<dyn std::any::Any>)> {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let lo = loopback_domain(&net);
    let udp = udp_domain(IpAddr::V4(Ipv4Addr::LOCALHOST), FaultConfig::default());
    let name = if on_efa() { "efa" } else { "udp" };
    let dir = shm_test_dir(shm_prefix);
    let (shm, _) = shm_domain(dir.path());
    vec![
        ("loopback", lo, Box::new(net)),
        (name, udp, Box::new(())),
        ("shm", shm, Box::new(dir)),
    ]
}

/// Memory standing for a GPU's, for dmabuf regions (`Domain::register_dmabuf`): a real dma-buf
/// where the kernel exports one (`/dev/udmabuf`, made from a sealed memfd), else a **stand-in**,
/// a memfd named `efa-emu-dmabuf-stand-in-<name>`, which only the emulated NIC takes for a
/// dma-buf (a real NIC refuses it, like any memfd, and the crate then serves the region through
/// its CPU mapping; the software devices map either). The bytes are read and written through
/// the memfd; registrations take [`as_fd`](DeviceMemory::as_fd).
pub struct DeviceMemory {
    memfd: std::fs::File,
    dmabuf: Option<std::os::fd::OwnedFd>,
}

impl DeviceMemory {
    /// `len` bytes (a whole number of pages for a real dma-buf), zeroed.
    pub fn new(name: &str, len: u64) -> DeviceMemory {
        let memfd = Self::memfd(name, len);
        match udmabuf(&memfd, len) {
            Some(d) => DeviceMemory {
                memfd,
                dmabuf: Some(d),
            },
            None => DeviceMemory {
                memfd: Self::memfd(name, len),
                dmabuf: None,
            },
        }
    }

    /// Always the stand-in memfd (its name shows in `/proc/self/maps` while mapped).
    pub fn stand_in(name: &str, len: u64) -> DeviceMemory {
        DeviceMemory {
            memfd: Self::memfd(name, len),
            dmabuf: None,
        }
    }

    /// A memfd that allows sealing: the udmabuf driver seals it against shrinking, and the
    /// emulated NIC with `EFA_EMU_DMABUF=unmappable` seals a stand-in it registered against
    /// new writable mappings (GPU memory the program cannot map).
    fn memfd(name: &str, len: u64) -> std::fs::File {
        memfd(
            &format!("efa-emu-dmabuf-stand-in-{name}"),
            len,
            libc::MFD_ALLOW_SEALING,
        )
    }

    /// Whether this is a real dma-buf (else the stand-in).
    pub fn is_real(&self) -> bool {
        self.dmabuf.is_some()
    }

    /// The descriptor to register.
    pub fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        match &self.dmabuf {
            Some(d) => d.as_fd(),
            None => self.memfd.as_fd(),
        }
    }

    /// Another descriptor of the same memory.
    pub fn try_clone(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        self.as_fd().try_clone_to_owned()
    }

    pub fn read_exact_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.memfd, buf, off)
    }

    pub fn write_all_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.memfd, buf, off)
    }
}

/// A dma-buf of the first `len` bytes of `memfd` from the kernel's udmabuf driver, if it has
/// one (`/dev/udmabuf`): the memfd is sealed against shrinking, as the driver requires.
fn udmabuf(memfd: &std::fs::File, len: u64) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    #[repr(C)]
    struct UdmabufCreate {
        memfd: u32,
        flags: u32,
        offset: u64,
        size: u64,
    }
    // _IOW('u', 0x42, struct udmabuf_create)
    const UDMABUF_CREATE: libc::c_ulong = 0x4018_7542;
    const UDMABUF_FLAGS_CLOEXEC: u32 = 1;
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/udmabuf")
        .ok()?;
    // SAFETY: fcntl on our descriptor.
    if unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } != 0 {
        return None;
    }
    let arg = UdmabufCreate {
        memfd: memfd.as_raw_fd() as u32,
        flags: UDMABUF_FLAGS_CLOEXEC,
        offset: 0,
        size: len,
    };
    // SAFETY: the driver's ioctl with its argument struct; it returns a new descriptor.
    let fd = unsafe { libc::ioctl(dev.as_raw_fd(), UDMABUF_CREATE, &arg) };
    // SAFETY: a fresh descriptor nobody else owns.
    (fd >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}
