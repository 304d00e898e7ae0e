//! The shared-memory directory (`/dev/shm`, or the one a configuration names): the one place
//! that knows every kind of file the crate keeps there, how each is named and how a stale one
//! (its owner died without removing it) is found and removed.
//!
//! What a file holds belongs to the module that writes it: the shm device's segments
//! (`device::shm`), the same-host path's message channels (`local::chan`), the routing
//! device's entries (`device::route::dir`). None of them names or sweeps another's files: a
//! sweep of the directory is [`sweep_all`].
//!
//! Every file is `<prefix><uid>-<rest>`; a file being created is `<prefix><uid>-tmp-<pid>-<n>`
//! until it is renamed into place. Its owner holds an `flock` on it for its life, so a file
//! whose lock is free has no owner. A sweep removes only this user's regular files (no
//! symlink is followed, nothing another user planted is touched), and only if the name still
//! names the file it checked.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use super::map::{self, lock_free, open_existing, remove_if_same};

/// One kind of file in the directory.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Kind {
    /// Every name of this kind starts with it (then the user id and a dash).
    pub prefix: &'static str,
    /// When a half-created file of this kind is stale.
    tmp: Tmp,
    /// Whether `rest` (the name after `<prefix><uid>-`) can name a file of this kind.
    name_ok: fn(&str) -> bool,
    /// What the debug log calls it.
    what: &'static str,
}

/// When a temporary (half-created) file is stale.
#[derive(Clone, Copy, Debug)]
enum Tmp {
    /// Its creating process no longer exists.
    DeadCreator,
    /// Nobody holds its lock and it is at least this old (the creator locks it first).
    FreeAndOlderThan(Duration),
}

/// The shm device's segments: `efa-shm-<uid>-<qpn>`.
pub(crate) const SEGMENT: Kind = Kind {
    prefix: "efa-shm-",
    tmp: Tmp::DeadCreator,
    name_ok: |rest| rest.parse::<u16>().is_ok(),
    what: "segment",
};

/// The same-host path's message channels: `efa-chan-<uid>-<gid>-<qpn>-<qkey>`.
pub(crate) const CHANNEL: Kind = Kind {
    prefix: "efa-chan-",
    tmp: Tmp::DeadCreator,
    name_ok: |_| true,
    what: "channel",
};

/// The routing device's entries: `efa-route-<uid>-<gid>-<qpn>-<qkey>`.
pub(crate) const ROUTE_ENTRY: Kind = Kind {
    prefix: "efa-route-",
    tmp: Tmp::FreeAndOlderThan(Duration::from_secs(10)),
    name_ok: |_| true,
    what: "routing entry",
};

/// Every kind, for [`sweep_all`].
pub(crate) const KINDS: [Kind; 3] = [SEGMENT, CHANNEL, ROUTE_ENTRY];

impl Kind {
    /// The name of a file of this kind of user `uid`: `<prefix><uid>-<rest>`.
    pub(crate) fn name(&self, uid: u32, rest: std::fmt::Arguments<'_>) -> String {
        format!("{}{uid}-{rest}", self.prefix)
    }

    /// The temporary name a file of this kind is created under by process `pid` (its `n`-th).
    pub(crate) fn tmp_name(&self, uid: u32, pid: u32, n: u64) -> String {
        format!("{}{uid}-tmp-{pid}-{n}", self.prefix)
    }

    /// Removes user `uid`'s stale files of this kind from `dir`; returns how many.
    pub(crate) fn sweep(&self, dir: &Path, uid: u32) -> usize {
        map::sweep_dir(dir, &format!("{}{uid}-", self.prefix), |path, rest| {
            let gone = if let Some(tmp) = rest.strip_prefix("tmp-") {
                self.tmp_stale(path, tmp, uid)
            } else {
                (self.name_ok)(rest) && remove_unowned(path, uid, None)
            };
            if gone {
                tracing::debug!(path = %path.display(), "shm directory: swept a stale {}", self.what);
            }
            gone
        })
    }

    fn tmp_stale(&self, path: &Path, tmp: &str, uid: u32) -> bool {
        match self.tmp {
            Tmp::DeadCreator => {
                let pid = tmp.split('-').next().and_then(|p| p.parse::<u32>().ok());
                pid.is_some_and(|p| !map::pid_exists(p)) && remove_unowned(path, uid, None)
            }
            Tmp::FreeAndOlderThan(grace) => remove_unowned(path, uid, Some(grace)),
        }
    }
}

/// Removes the file at `path` if it is a regular file of user `uid` whose lock nobody holds
/// (and, with `min_age`, that was last changed at least that long ago); true when removed.
fn remove_unowned(path: &Path, uid: u32, min_age: Option<Duration>) -> bool {
    let Ok(f) = open_existing(path) else {
        return false;
    };
    let Ok(m) = f.metadata() else {
        return false;
    };
    if !m.is_file() || m.uid() != uid || !lock_free(&f) {
        return false;
    }
    if let Some(grace) = min_age {
        let old = m
            .modified()
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_some_and(|age| age >= grace);
        if !old {
            return false;
        }
    }
    remove_if_same(path, m.ino())
}

/// Removes user `uid`'s stale files of every kind from `dir` (after a peer was found dead, so
/// that what it left goes at once, and when a device opens); returns how many.
pub(crate) fn sweep_all(dir: &Path, uid: u32) -> usize {
    KINDS.iter().map(|k| k.sweep(dir, uid)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::{File, OpenOptions};
    use std::os::unix::fs::OpenOptionsExt;

    fn create(dir: &Path, name: &str) -> File {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dir.join(name))
            .unwrap()
    }

    /// A sweep removes every kind's files whose owner is gone and half-created files of
    /// processes that no longer exist; it leaves files whose owner holds the lock, names
    /// another kind does not use, symlinks and other users' prefixes alone.
    #[test]
    fn a_sweep_removes_only_ownerless_files_of_every_kind() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        let uid = map::uid();
        let other = uid.wrapping_add(1);
        // Stale: one of each kind, and a segment being created by a process that died.
        for k in KINDS {
            create(dir, &k.name(uid, format_args!("{}", 7)));
        }
        let dead = u32::MAX - 1; // above pid_max: no such process
        create(dir, &SEGMENT.tmp_name(uid, dead, 0));
        // Alive: a channel whose owner holds its lock, a temporary file of this process.
        let held = create(dir, &CHANNEL.name(uid, format_args!("live")));
        assert!(map::try_lock_exclusive(&held).unwrap());
        create(dir, &CHANNEL.tmp_name(uid, std::process::id(), 0));
        // Not ours to judge: a segment name that is no queue pair number, another user's
        // prefix, a young routing temporary file, a symlink.
        create(dir, &SEGMENT.name(uid, format_args!("notaqpn")));
        create(dir, &ROUTE_ENTRY.name(other, format_args!("x")));
        create(dir, &ROUTE_ENTRY.tmp_name(uid, dead, 0));
        std::os::unix::fs::symlink(
            "/etc/passwd",
            dir.join(CHANNEL.name(uid, format_args!("l"))),
        )
        .unwrap();
        assert_eq!(sweep_all(dir, uid), 4);
        let mut left: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        let mut want = vec![
            CHANNEL.name(uid, format_args!("live")),
            CHANNEL.tmp_name(uid, std::process::id(), 0),
            SEGMENT.name(uid, format_args!("notaqpn")),
            ROUTE_ENTRY.name(other, format_args!("x")),
            ROUTE_ENTRY.tmp_name(uid, dead, 0),
            CHANNEL.name(uid, format_args!("l")),
        ];
        want.sort();
        assert_eq!(left, want);
        drop(held);
        assert_eq!(sweep_all(dir, uid), 1, "the channel's owner let go");
    }
}
