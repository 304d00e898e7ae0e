//! The sysfs entries libfabric's EFA provider reads before it offers a device:
//! `class/infiniband_verbs/abi_version`, and `class/infiniband/<dev>/device` resolving to a
//! PCI function whose `driver` link resolves. They live in a directory of their own, named by
//! `SYSFS_PATH` (which the launcher `efa-emu run` sets); without it, in a directory private to
//! the user ([`default_root`]: `$TMPDIR/efa-emu-sysfs-<uid>` when that is a real directory of
//! this user that nobody else may write, else a fresh one), and `SYSFS_PATH` is set when the
//! library loads into a process that has one thread (setting the environment beside other
//! threads is not safe: under `dlopen` in a threaded program, set `SYSFS_PATH` or use the
//! launcher).
//!
//! With several devices (`EFA_EMU_DEVICES` = N > 1) the tree is a small multi-NIC host, in a
//! root of its own (`<default root>/<N>-devices`, so trees of different N never mix): device
//! `efa_i` sits under PCI switch `i / 2` beside that switch's fake GPU (an NVIDIA H100's ids,
//! class 0x0302), each switch under its own root complex; the first half of the switches is on
//! NUMA node 0, the rest on node 1, and the nodes share this process's CPUs (the first half on
//! node 0). So a topology reader finds, for each GPU, two NICs under its switch (PIX), those
//! of the other switches of its node (NODE) and those of the other node (SYS). With one device
//! the tree is as it always was: `efa_0` at 0000:00:06.0 right on the root complex, no NUMA
//! node.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::config::EmuConfig;

/// The emulated PCI function (of the one device).
pub const PCI_ADDR: &str = "0000:00:06.0";

/// NICs under each fake PCI switch when there are several devices.
pub const NICS_PER_SWITCH: usize = 2;

/// `EFA_EMU_DEVICES` as the environment says (1 when unset or not a number: the library
/// reports a bad value when it opens the NICs).
fn env_devices() -> usize {
    std::env::var("EFA_EMU_DEVICES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(1)
}

/// The sysfs root this process uses.
pub fn root() -> String {
    std::env::var("SYSFS_PATH")
        .ok()
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('/').to_string())
        .unwrap_or_else(|| {
            default_root_for(env_devices())
                .to_string_lossy()
                .into_owned()
        })
}

/// The default root of a process with `devices` devices: [`default_root`] for one, a
/// directory of its own inside it for more.
pub fn default_root_for(devices: usize) -> PathBuf {
    if devices <= 1 {
        default_root()
    } else {
        default_root().join(format!("{devices}-devices"))
    }
}

pub fn root_cstr() -> &'static CString {
    static R: OnceLock<CString> = OnceLock::new();
    R.get_or_init(|| CString::new(root()).unwrap_or_default())
}

/// This user's private sysfs root, chosen once per process ([`private_root_in`] of `$TMPDIR`).
pub fn default_root() -> PathBuf {
    static R: OnceLock<PathBuf> = OnceLock::new();
    R.get_or_init(|| {
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        let base = std::env::temp_dir();
        private_root_in(&base, uid).unwrap_or_else(|_| base.join(format!("efa-emu-sysfs-{uid}")))
    })
    .clone()
}

/// A directory under `base` only `uid` can write: `efa-emu-sysfs-<uid>` when it is created now
/// (mode 0700) or is already a real directory (not a symbolic link) owned by `uid` that neither
/// group nor others may write; otherwise a fresh `efa-emu-sysfs-<uid>-XXXXXX` (`mkdtemp`). In a
/// shared `/tmp`, another user could otherwise make the predictable name first, with symbolic
/// links inside that turn this user's writes of the tree into writes of their own files.
pub fn private_root_in(base: &Path, uid: u32) -> Result<PathBuf, String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let p = base.join(format!("efa-emu-sysfs-{uid}"));
    match std::fs::DirBuilder::new().mode(0o700).create(&p) {
        Ok(()) => return Ok(p),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            if let Ok(m) = std::fs::symlink_metadata(&p)
                && m.file_type().is_dir()
                && m.uid() == uid
                && m.mode() & 0o022 == 0
            {
                return Ok(p);
            }
        }
        Err(_) => {}
    }
    let template = base.join(format!("efa-emu-sysfs-{uid}-XXXXXX"));
    let mut t = CString::new(template.as_os_str().as_encoded_bytes())
        .map_err(|e| e.to_string())?
        .into_bytes_with_nul();
    // SAFETY: a NUL-terminated template ending in six X, which mkdtemp rewrites in place.
    let r = unsafe { libc::mkdtemp(t.as_mut_ptr().cast()) };
    if r.is_null() {
        return Err(format!(
            "mkdtemp {}: {}",
            template.display(),
            std::io::Error::last_os_error()
        ));
    }
    t.pop();
    Ok(PathBuf::from(std::ffi::OsString::from(
        String::from_utf8_lossy(&t).into_owned(),
    )))
}

/// Makes `link` point at `target` unless it does already; a wrong link is replaced through a
/// rename (a private link renamed over it), so a reader never finds the name missing.
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    if std::fs::read_link(link).is_ok_and(|t| t == target) {
        return Ok(());
    }
    let tmp = temp_name(link);
    std::os::unix::fs::symlink(target, &tmp)?;
    std::fs::rename(&tmp, link).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// A name beside `path` no other writer uses (this process's id and a sequence number).
fn temp_name(path: &Path) -> PathBuf {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(
        ".{}.{}.{seq}",
        name.unwrap_or_default(),
        std::process::id()
    ))
}

/// Writes `text` to `path` unless it holds it already; through a rename, so that a reader
/// (another process starting on the same tree) never sees a half-written file.
fn write_file(path: &Path, text: &str) -> std::io::Result<()> {
    if std::fs::read_to_string(path).is_ok_and(|t| t == text) {
        return Ok(());
    }
    let tmp = temp_name(path);
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// Where one fake PCI function of a several-device tree sits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Root complex (`pci0000:10`).
    pub root_complex: String,
    /// Bridges from the root complex down, then the function itself.
    pub chain: Vec<String>,
    /// NUMA node.
    pub numa: u32,
}

impl Placement {
    /// The function's bus id.
    pub fn addr(&self) -> &str {
        self.chain.last().map_or("", String::as_str)
    }
}

fn bdf(bus: usize, dev: usize) -> String {
    format!("0000:{bus:02x}:{dev:02x}.0")
}

/// The fake PCI switches of a tree of `devices` devices.
pub fn switches(devices: usize) -> usize {
    devices.div_ceil(NICS_PER_SWITCH)
}

/// Slot `slot` of switch `s` of `n` switches: 0 the GPU, 1.. its NICs.
fn place(s: usize, n: usize, slot: usize) -> Placement {
    let rb = 0x10 + 0x0c * s;
    Placement {
        root_complex: format!("pci0000:{rb:02x}"),
        chain: vec![
            bdf(rb, 1),
            bdf(rb + 1, 0),
            bdf(rb + 2, slot),
            bdf(rb + 3 + slot, 0),
        ],
        numa: if n < 2 { 0 } else { (s * 2 / n) as u32 },
    }
}

/// Where NIC `i` of a several-device tree sits.
pub fn nic_placement(devices: usize, i: usize) -> Placement {
    place(
        i / NICS_PER_SWITCH,
        switches(devices),
        1 + i % NICS_PER_SWITCH,
    )
}

/// Where the GPU of switch `s` of a several-device tree sits.
pub fn gpu_placement(devices: usize, s: usize) -> Placement {
    place(s, switches(devices), 0)
}

/// The CPUs this process may run on (`sched_getaffinity`), ascending; CPU 0 if unknown.
fn my_cpus() -> Vec<usize> {
    // SAFETY: an all-zero cpu_set_t is an empty set; sched_getaffinity fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is this thread; the size is the set's.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    let cpus: Vec<usize> = if rc == 0 {
        // SAFETY: CPU_ISSET reads the set within its size.
        (0..libc::CPU_SETSIZE as usize)
            .filter(|c| unsafe { libc::CPU_ISSET(*c, &set) })
            .collect()
    } else {
        Vec::new()
    };
    if cpus.is_empty() { vec![0] } else { cpus }
}

/// The CPUs of fake NUMA node `node` (of 2): the first half of this process's CPUs, or the
/// rest (all of them on a one-CPU machine), as a Linux CPU list.
fn node_cpus(node: u32, nodes: u32) -> String {
    let all = my_cpus();
    let half = all.len().div_ceil(2);
    let mine: &[usize] = match (nodes, node) {
        (1, _) => &all,
        (_, 0) => &all[..half],
        _ if half < all.len() => &all[half..],
        _ => &all,
    };
    mine.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Makes the tree of the devices `cfg` describes under `root` (idempotent): every device's
/// `class/infiniband` entry and PCI function, and with several devices the fake GPUs, bridges,
/// `bus/pci/devices` links and NUMA nodes.
pub fn make(root: &Path, cfg: &EmuConfig) -> Result<(), String> {
    let err = |what: &str, e: std::io::Error| format!("sysfs {}: {what}: {e}", root.display());
    let driver = root.join("bus/pci/drivers/efa");
    let verbs = root.join("class/infiniband_verbs");
    for d in [&driver, &verbs] {
        std::fs::create_dir_all(d).map_err(|e| err("mkdir", e))?;
    }
    write_file(&verbs.join("abi_version"), "6\n").map_err(|e| err("abi_version", e))?;
    let devices = cfg.all_devices();
    if devices.len() == 1 {
        let pci = root.join("devices/pci0000:00").join(PCI_ADDR);
        let ibdev = root.join("class/infiniband").join(&devices[0].device);
        for d in [&pci, &ibdev] {
            std::fs::create_dir_all(d).map_err(|e| err("mkdir", e))?;
        }
        write_file(&pci.join("numa_node"), "-1\n").map_err(|e| err("numa_node", e))?;
        symlink(&driver, &pci.join("driver")).map_err(|e| err("driver link", e))?;
        symlink(&pci, &ibdev.join("device")).map_err(|e| err("device link", e))?;
        return Ok(());
    }
    let n = devices.len();
    let nodes = if switches(n) < 2 { 1 } else { 2 };
    for node in 0..nodes {
        let dir = root.join(format!("devices/system/node/node{node}"));
        std::fs::create_dir_all(&dir).map_err(|e| err("mkdir", e))?;
        write_file(
            &dir.join("cpulist"),
            &format!("{}\n", node_cpus(node, nodes)),
        )
        .map_err(|e| err("cpulist", e))?;
    }
    // Makes a function at `p` (and its bridges) with its files; its directory.
    let function =
        |p: &Placement, class: u32, vendor: u16, device: u32| -> Result<PathBuf, String> {
            let mut dir = root.join("devices").join(&p.root_complex);
            let devs = root.join("bus/pci/devices");
            std::fs::create_dir_all(&devs).map_err(|e| err("mkdir", e))?;
            for (i, a) in p.chain.iter().enumerate() {
                dir.push(a);
                std::fs::create_dir_all(&dir).map_err(|e| err("mkdir", e))?;
                symlink(&dir, &devs.join(a)).map_err(|e| err("bus link", e))?;
                let bridge = i + 1 < p.chain.len();
                let (c, v, d) = if bridge {
                    (0x060400, 0x1000, 0xc030)
                } else {
                    (class, vendor, device)
                };
                let cpus = format!("{}\n", node_cpus(p.numa.min(nodes - 1), nodes));
                for (name, text) in [
                    ("class", format!("{c:#08x}\n")),
                    ("vendor", format!("{v:#06x}\n")),
                    ("device", format!("{d:#06x}\n")),
                    ("numa_node", format!("{}\n", p.numa)),
                    ("local_cpulist", cpus),
                ] {
                    write_file(&dir.join(name), &text).map_err(|e| err(name, e))?;
                }
            }
            Ok(dir)
        };
    for s in 0..switches(n) {
        function(&gpu_placement(n, s), 0x030200, 0x10de, 0x2330)?;
    }
    for (i, d) in devices.iter().enumerate() {
        let dir = function(&nic_placement(n, i), 0x020000, 0x1d0f, d.vendor_part_id)?;
        symlink(&driver, &dir.join("driver")).map_err(|e| err("driver link", e))?;
        let ibdev = root.join("class/infiniband").join(&d.device);
        std::fs::create_dir_all(&ibdev).map_err(|e| err("mkdir", e))?;
        symlink(&dir, &ibdev.join("device")).map_err(|e| err("device link", e))?;
    }
    Ok(())
}

/// Makes the entries under this process's root.
pub fn ensure(cfg: &EmuConfig) -> Result<(), String> {
    make(Path::new(&root()), cfg)
}

/// Runs when the library is loaded: without `SYSFS_PATH`, point it at the default root
/// (libfabric reads the variable itself), but only in a process with one thread: loaded before
/// `main` that is always so; loaded by `dlopen` in a threaded program, another thread could read
/// the environment meanwhile, so it is left alone (the launcher sets the variable).
extern "C" fn on_load() {
    if std::env::var_os("SYSFS_PATH").is_none() && threads() == Some(1) {
        let r = default_root_for(env_devices());
        SET_ON_LOAD.store(true, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: this process has one thread (this one): nothing reads the environment at once.
        unsafe { std::env::set_var("SYSFS_PATH", &r) };
    }
}

/// Whether `on_load` set `SYSFS_PATH` (the environment did not name a root).
static SET_ON_LOAD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `SYSFS_PATH` as this process's environment gave it, not as the library set it while
/// loading. The launcher links this crate, so the load hook runs in it too, with the root of
/// `EFA_EMU_DEVICES` from the environment; the launcher's `--devices` may name another count,
/// whose root is another ([`default_root_for`]). Reading the variable back would put a
/// several-device tree into the one-device root, where it and one-device launchers started at
/// the same time would rewrite each other's `efa_0/device` link under a starting libfabric.
pub fn given_root() -> Option<PathBuf> {
    if SET_ON_LOAD.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    std::env::var_os("SYSFS_PATH")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
}

/// The number of threads of this process (`/proc/self/status`).
fn threads() -> Option<usize> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))?
        .trim()
        .parse()
        .ok()
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn base() -> PathBuf {
        let b = std::env::temp_dir().join(format!(
            "efa-emu-sysfs-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&b);
        std::fs::create_dir_all(&b).unwrap();
        b
    }

    /// The predictable name is used only when it is this user's own directory that nobody else
    /// may write (issue 30, point 13).
    #[test]
    fn the_root_is_private_or_fresh() {
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        let b = base();
        let want = b.join(format!("efa-emu-sysfs-{uid}"));
        // Made now: 0700.
        let r = private_root_in(&b, uid).unwrap();
        assert_eq!(r, want);
        assert_eq!(std::fs::metadata(&r).unwrap().mode() & 0o777, 0o700);
        // Reused as it is.
        assert_eq!(private_root_in(&b, uid).unwrap(), want);
        // Writable by others: not used.
        std::fs::set_permissions(&want, std::fs::Permissions::from_mode(0o777)).unwrap();
        let r = private_root_in(&b, uid).unwrap();
        assert_ne!(r, want);
        assert!(
            r.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with(&format!("efa-emu-sysfs-{uid}-"))
        );
        assert_eq!(std::fs::metadata(&r).unwrap().mode() & 0o777, 0o700);
        // A symbolic link planted under the name (to a directory of the planter's choosing):
        // not used, and nothing is written through it.
        std::fs::remove_dir_all(&want).unwrap();
        let victim = b.join("victim");
        std::fs::create_dir(&victim).unwrap();
        std::os::unix::fs::symlink(&victim, &want).unwrap();
        let r = private_root_in(&b, uid).unwrap();
        assert_ne!(r, want);
        make(&r, &EmuConfig::from_lookup(|_| None).unwrap()).unwrap();
        assert_eq!(std::fs::read_dir(&victim).unwrap().count(), 0);
        // Someone else's directory: not used (the test runs as any user; a uid that is not ours).
        std::fs::remove_file(&want).unwrap();
        std::fs::create_dir(&want).unwrap();
        let other = uid.wrapping_add(1);
        let theirs = b.join(format!("efa-emu-sysfs-{other}"));
        std::fs::create_dir(&theirs).unwrap();
        assert_ne!(
            private_root_in(&b, other).unwrap(),
            theirs,
            "owned by {uid}, not {other}"
        );
        std::fs::remove_dir_all(&b).unwrap();
    }

    /// The tree of 4 devices, as the efa crate's topology reads it: 4 NICs with their own
    /// PCI functions and NUMA nodes, 2 GPUs each under the switch of 2 NICs.
    #[test]
    fn four_devices_make_a_multi_nic_host() {
        use efa::topo::{Distance, Near, NumaNode, Topology};
        let b = base();
        let cfg = EmuConfig::from_lookup(|k| (k == "EFA_EMU_DEVICES").then(|| "4".into())).unwrap();
        make(&b, &cfg).unwrap();
        make(&b, &cfg).unwrap(); // idempotent
        let topo = Topology::from_root(&b).unwrap();
        let names: Vec<&str> = topo
            .nics()
            .iter()
            .filter_map(|n| n.name.as_deref())
            .collect();
        assert_eq!(names, ["efa_0", "efa_1", "efa_2", "efa_3"]);
        assert_eq!(topo.gpus().len(), 2);
        for (i, n) in topo.nics().iter().enumerate() {
            assert_eq!(n.addr.to_string(), nic_placement(4, i).addr());
            assert_eq!(n.numa, Some(NumaNode((i / 2) as u32)));
            assert_eq!(n.driver.as_deref(), Some("efa"));
            assert!(n.cpus.as_ref().is_some_and(|c| !c.is_empty()));
        }
        assert_eq!(topo.numa_nodes().count(), 2);
        let g1 = &topo.gpus()[1];
        assert_eq!(g1.addr.to_string(), gpu_placement(4, 1).addr());
        let near = topo.nics_near(&Near::Device(g1.addr)).unwrap();
        let got: Vec<(&str, Distance)> = near
            .iter()
            .map(|(n, d)| (n.name.as_deref().unwrap(), *d))
            .collect();
        assert_eq!(
            got,
            [
                ("efa_2", Distance::Pix),
                ("efa_3", Distance::Pix),
                ("efa_0", Distance::Sys),
                ("efa_1", Distance::Sys)
            ]
        );
        // One device: the tree as it always was.
        let one = base().join("one");
        make(&one, &EmuConfig::from_lookup(|_| None).unwrap()).unwrap();
        let topo = Topology::from_root(&one).unwrap();
        let [nic] = topo.nics() else {
            panic!("{:?}", topo.nics())
        };
        assert_eq!(nic.addr.to_string(), PCI_ADDR);
        assert_eq!(nic.numa, None);
        assert!(topo.gpus().is_empty());
        std::fs::remove_dir_all(&b).unwrap();
    }
}
