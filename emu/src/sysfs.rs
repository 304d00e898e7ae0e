//! The sysfs entries libfabric's EFA provider reads before it offers a device:
//! `class/infiniband_verbs/abi_version`, and `class/infiniband/<dev>/device` resolving to a
//! PCI function whose `driver` link resolves. They live in a directory of their own, named by
//! `SYSFS_PATH` (which the launcher `efa-emu run` sets); without it, in a directory private to
//! the user ([`default_root`]: `$TMPDIR/efa-emu-sysfs-<uid>` when that is a real directory of
//! this user that nobody else may write, else a fresh one), and `SYSFS_PATH` is set when the
//! library loads into a process that has one thread (setting the environment beside other
//! threads is not safe: under `dlopen` in a threaded program, set `SYSFS_PATH` or use the
//! launcher).

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

/// Runs when the library is loaded: without `SYSFS_PATH`, point it at the default root
/// (libfabric reads the variable itself), but only in a process with one thread: loaded before
/// `main` that is always so; loaded by `dlopen` in a threaded program, another thread could read
/// the environment meanwhile, so it is left alone (the launcher sets the variable).
extern "C" fn on_load() {
    if std::env::var_os("SYSFS_PATH").is_none() && threads() == Some(1) {
        let r = default_root();
        // SAFETY: this process has one thread (this one): nothing reads the environment at once.
        unsafe { std::env::set_var("SYSFS_PATH", &r) };
    }
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
        make(&r, "efa_0").unwrap();
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
}
