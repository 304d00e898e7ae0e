//! The host-local directory of a routing device: one small file per routed queue pair, named after
//! its **primary** address, saying which shm queue pair reaches it.
//!
//! * Name: `efa-route-<uid>-<gid as 32 hex digits>-<qpn>-<qkey as 8 hex digits>` in the shm
//!   device's (canonical) directory, so a sender finds the entry of a destination from its raw
//!   address alone, and a stale address (another QKEY) finds nothing.
//! * Content (text, at most [`MAX_ENTRY`] bytes):
//!   `efa-route 1\npid <pid>\nnetns <id>\nprimary <raw addr>\nshm <raw addr>\n`.
//! * Liveness is the shm device's: the owner holds a shared `flock` on the file from before it
//!   gets its name until the queue pair is closed (the kernel drops it when the process dies).
//!   A lock that a prober can take exclusively is proof that the owner is gone; the prober then
//!   removes the file (only if the name still refers to the same inode).
//! * Creation: a temporary file `efa-route-<uid>-tmp-<pid>-<n>` (mode 0600) is locked, written
//!   and hard-linked to the final name; `link` fails on an existing name, so a peer never reads
//!   a half-written entry and two live owners never share one.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::addr::{Gid, RawAddr};
use crate::shmem::dir::ROUTE_ENTRY;
use crate::shmem::map::{self, lock_free, open_existing, remove_if_same, remove_if_stale};

/// Name prefix of every file of the routing directory.
pub const PREFIX: &str = ROUTE_ENTRY.prefix;
/// Largest entry file read, bytes.
pub const MAX_ENTRY: u64 = 1024;
/// First line of an entry.
const MAGIC: &str = "efa-route 1";

static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// The real user id of this process.
pub fn uid() -> u32 {
    map::uid()
}

pub use crate::shmem::netns;

/// The entry name of the queue pair whose primary address is `a`.
pub fn entry_name(uid: u32, a: &RawAddr) -> String {
    let gid: String = a.gid.0.iter().map(|b| format!("{b:02x}")).collect();
    ROUTE_ENTRY.name(uid, format_args!("{gid}-{}-{:08x}", a.qpn, a.qkey))
}

/// What an entry says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryInfo {
    /// Owner process.
    pub pid: u32,
    /// Owner's network namespace.
    pub netns: String,
    /// The primary address (the file name says the same).
    pub primary: RawAddr,
    /// The shm queue pair that reaches it.
    pub shm: RawAddr,
}

impl EntryInfo {
    fn render(&self) -> String {
        format!(
            "{MAGIC}\npid {}\nnetns {}\nprimary {}\nshm {}\n",
            self.pid, self.netns, self.primary, self.shm
        )
    }

    fn parse(s: &str) -> Option<EntryInfo> {
        let mut lines = s.lines();
        if lines.next()? != MAGIC {
            return None;
        }
        let mut field = |name: &str| -> Option<String> {
            let l = lines.next()?;
            let v = l.strip_prefix(name)?.strip_prefix(' ')?;
            Some(v.to_string())
        };
        let pid = field("pid")?.parse().ok()?;
        let netns = field("netns")?;
        let primary = field("primary")?.parse().ok()?;
        let shm = field("shm")?.parse().ok()?;
        Some(EntryInfo {
            pid,
            netns,
            primary,
            shm,
        })
    }
}

/// A published entry, owned by a routed queue pair: dropping it removes the file and releases
/// the lock.
#[derive(Debug)]
pub struct Entry {
    path: PathBuf,
    ino: u64,
    /// Holds the shared lock.
    _file: File,
}

impl Entry {
    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        remove_if_same(&self.path, self.ino);
    }
}

/// Publishes the entry `info` in `dir` (user `uid`). `Ok(None)` when a live owner already holds
/// the name (the same primary address published by another process, e.g. in another network
/// namespace): the queue pair then runs without a local path for receiving.
pub fn publish(dir: &Path, uid: u32, info: &EntryInfo) -> io::Result<Option<Entry>> {
    let name = entry_name(uid, &info.primary);
    let path = dir.join(&name);
    let n = TMP_SEQ.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(ROUTE_ENTRY.tmp_name(uid, info.pid, n));
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)?;
    let result = (|| -> io::Result<Option<u64>> {
        map::lock_shared(&file)?;
        file.write_all(info.render().as_bytes())?;
        let ino = file.metadata()?.ino();
        Ok(map::link_claim(&tmp, &path)?.then_some(ino))
    })();
    let _ = std::fs::remove_file(&tmp);
    match result? {
        Some(ino) => Ok(Some(Entry {
            path,
            ino,
            _file: file,
        })),
        None => Ok(None),
    }
}

/// What a lookup found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// A live owner in this namespace on this shm directory: its shm queue pair.
    Local(RawAddr),
    /// No usable entry (none, stale and removed, foreign, or unreadable).
    Remote,
}

/// Looks up the entry of primary address `dest` in `dir` (user `uid`). It is used only if the
/// file is a regular file of this user, its owner is alive (holds the lock), it is well formed,
/// names exactly `dest`, was published from network namespace `netns`, and its shm address has
/// GID `shm_gid` (same kernel, user and directory as ours). A stale entry is removed.
pub fn lookup(dir: &Path, uid: u32, netns: &str, shm_gid: &Gid, dest: &RawAddr) -> Lookup {
    let path = dir.join(entry_name(uid, dest));
    let Ok(mut f) = open_existing(&path) else {
        return Lookup::Remote;
    };
    let Ok(m) = f.metadata() else {
        return Lookup::Remote;
    };
    if !m.is_file() || m.uid() != uid || m.len() > MAX_ENTRY {
        return Lookup::Remote;
    }
    if lock_free(&f) {
        if remove_if_same(&path, m.ino()) {
            tracing::debug!(path = %path.display(), "shm route: removed the stale entry of a dead process");
        }
        return Lookup::Remote;
    }
    let mut s = String::new();
    if (&mut f).take(MAX_ENTRY).read_to_string(&mut s).is_err() {
        return Lookup::Remote;
    }
    match EntryInfo::parse(&s) {
        Some(e) if e.primary == *dest && e.netns == netns && e.shm.gid == *shm_gid => {
            Lookup::Local(e.shm)
        }
        _ => Lookup::Remote,
    }
}

/// Removes the entry of `dest` if its owner is gone (after a send to it failed); true when it
/// did, which proves that the process owning `dest` died.
pub fn forget_if_stale(dir: &Path, uid: u32, dest: &RawAddr) -> bool {
    let path = dir.join(entry_name(uid, dest));
    if path.exists() && remove_if_stale(&path) {
        tracing::debug!(path = %path.display(), "shm route: removed the stale entry of a dead process");
        return true;
    }
    false
}

/// Removes this user's stale routing entries from `dir`: entries whose lock is free (owner
/// gone) and temporary files whose lock is free and that are older than a few seconds (the
/// rule of `shmem::dir`, which knows every kind of file there). Returns how many.
pub fn sweep(dir: &Path, uid: u32) -> usize {
    ROUTE_ENTRY.sweep(dir, uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(qpn: u16, qkey: u32) -> RawAddr {
        RawAddr::new(Gid::from_ip("127.0.0.1".parse().unwrap()), qpn, qkey)
    }

    #[test]
    fn entry_round_trip() {
        let e = EntryInfo {
            pid: 42,
            netns: "net:[4026531840]".into(),
            primary: addr(5000, 0x1234),
            shm: RawAddr::new(Gid([0xfd; 16]), 77, 0x1234),
        };
        assert_eq!(EntryInfo::parse(&e.render()), Some(e.clone()));
        assert_eq!(EntryInfo::parse("garbage"), None);
        assert_eq!(EntryInfo::parse(&e.render().replace("pid", "pod")), None);
    }

    #[test]
    fn names_are_distinct_per_qkey() {
        let a = entry_name(1000, &addr(5000, 1));
        let b = entry_name(1000, &addr(5000, 2));
        assert_ne!(a, b);
        assert!(a.starts_with("efa-route-1000-0000"));
        assert!(a.ends_with("-5000-00000001"), "{a}");
    }

    const SHM_GID: Gid = Gid([0xfd; 16]);

    /// A fresh directory, its owner's uid, and this process's entry for the primary address
    /// `addr(qpn, qkey)` whose shm queue pair is `shm_qpn`.
    fn fixture(qpn: u16, qkey: u32, shm_qpn: u16) -> (tempfile::TempDir, u32, EntryInfo) {
        let dir = tempfile::tempdir().unwrap();
        let uid = std::fs::metadata(dir.path()).unwrap().uid();
        let e = EntryInfo {
            pid: std::process::id(),
            netns: netns(),
            primary: addr(qpn, qkey),
            shm: RawAddr::new(SHM_GID, shm_qpn, qkey),
        };
        (dir, uid, e)
    }

    #[test]
    fn publish_lookup_remove() {
        let (dir, uid, e) = fixture(5000, 9, 77);
        let shm_gid = SHM_GID;
        let entry = publish(dir.path(), uid, &e).unwrap().unwrap();
        let ns = netns();
        assert_eq!(
            lookup(dir.path(), uid, &ns, &shm_gid, &e.primary),
            Lookup::Local(e.shm)
        );
        // Another QKEY, another namespace or another shm GID: not local.
        assert_eq!(
            lookup(dir.path(), uid, &ns, &shm_gid, &addr(5000, 10)),
            Lookup::Remote
        );
        assert_eq!(
            lookup(dir.path(), uid, "net:[1]", &shm_gid, &e.primary),
            Lookup::Remote
        );
        assert_eq!(
            lookup(dir.path(), uid, &ns, &Gid([0xfe; 16]), &e.primary),
            Lookup::Remote
        );
        // A second owner of the same name is refused while the first lives.
        assert!(publish(dir.path(), uid, &e).unwrap().is_none());
        let path = entry.path().to_path_buf();
        drop(entry);
        assert!(!path.exists());
        assert_eq!(
            lookup(dir.path(), uid, &ns, &shm_gid, &e.primary),
            Lookup::Remote
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn stale_entries_are_removed() {
        let (dir, uid, e) = fixture(6000, 3, 78);
        let shm_gid = SHM_GID;
        // An entry nobody holds a lock on: what a dead process leaves.
        let path = dir.path().join(entry_name(uid, &e.primary));
        std::fs::write(&path, e.render()).unwrap();
        assert_eq!(
            lookup(dir.path(), uid, &netns(), &shm_gid, &e.primary),
            Lookup::Remote
        );
        assert!(!path.exists());
        std::fs::write(&path, e.render()).unwrap();
        assert_eq!(sweep(dir.path(), uid), 1);
        assert!(!path.exists());
        // A live entry survives the sweep; a stale one in its place is replaced by publish.
        std::fs::write(&path, e.render()).unwrap();
        let live = publish(dir.path(), uid, &e).unwrap().unwrap();
        assert_eq!(sweep(dir.path(), uid), 0);
        assert!(live.path().exists());
    }
}
