//! The sysfs entries libfabric's EFA provider reads before it offers a device:
//! `class/infiniband_verbs/abi_version`, and `class/infiniband/<dev>/device` resolving to a
//! PCI function whose `driver` link resolves. They live in a directory of their own, named by
//! `SYSFS_PATH` (which the launcher `efa-emu run` sets); without it, in
//! `$TMPDIR/efa-emu-sysfs-<uid>`, and `SYSFS_PATH` is set when the library loads.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The emulated PCI function.
pub const PCI_ADDR: &str = "0000:00:06.0";

/// The sysfs root this process uses.
pub fn root() -> String {
    std::env::var("SYSFS_PATH")
        .ok()
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('/').to_string())
        .unwrap_or_else(|| default_root().to_string_lossy().into_owned())
}

pub fn root_cstr() -> &'static CString {
    static R: OnceLock<CString> = OnceLock::new();
    R.get_or_init(|| CString::new(root()).unwrap_or_default())
}

/// `$TMPDIR/efa-emu-sysfs-<uid>`.
pub fn default_root() -> PathBuf {
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    std::env::temp_dir().join(format!("efa-emu-sysfs-{uid}"))
}

fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    match std::fs::read_link(link) {
        Ok(t) if t == target => return Ok(()),
        Ok(_) => std::fs::remove_file(link)?,
        Err(_) => {}
    }
    std::os::unix::fs::symlink(target, link).or_else(|e| {
        // Another process made it meanwhile.
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            Ok(())
        } else {
            Err(e)
        }
    })
}

/// Makes the entries for `device` under `root` (idempotent).
pub fn make(root: &Path, device: &str) -> Result<(), String> {
    let err = |what: &str, e: std::io::Error| format!("sysfs {}: {what}: {e}", root.display());
    let pci = root.join("devices/pci0000:00").join(PCI_ADDR);
    let driver = root.join("bus/pci/drivers/efa");
    let verbs = root.join("class/infiniband_verbs");
    let ibdev = root.join("class/infiniband").join(device);
    for d in [&pci, &driver, &verbs, &ibdev] {
        std::fs::create_dir_all(d).map_err(|e| err("mkdir", e))?;
    }
    std::fs::write(verbs.join("abi_version"), "6\n").map_err(|e| err("abi_version", e))?;
    std::fs::write(pci.join("numa_node"), "-1\n").map_err(|e| err("numa_node", e))?;
    symlink(&driver, &pci.join("driver")).map_err(|e| err("driver link", e))?;
    symlink(&pci, &ibdev.join("device")).map_err(|e| err("device link", e))?;
    Ok(())
}

/// Makes the entries under this process's root.
pub fn ensure(device: &str) -> Result<(), String> {
    make(Path::new(&root()), device)
}

/// Runs when the library is loaded, before `main`: without `SYSFS_PATH`, point it at the
/// default root (libfabric reads the variable itself). Nothing else runs yet, so setting the
/// environment is safe here.
extern "C" fn on_load() {
    if std::env::var_os("SYSFS_PATH").is_none() {
        let r = default_root();
        // SAFETY: called from the loader's init, single-threaded, before `main`.
        unsafe { std::env::set_var("SYSFS_PATH", &r) };
    }
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;
