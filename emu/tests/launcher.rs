//! The launcher's choice of sysfs root, and launchers of different device counts started at
//! once: none may find another's tree under its own, or a link of its tree missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const EMU: &str = env!("CARGO_BIN_EXE_efa-emu");

/// A temporary directory of this test's own, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("efa-emu-launcher-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("make a temporary directory");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `SYSFS_PATH` as `efa-emu env ARGS` prints it, with `TMPDIR` at `tmp`.
fn sysfs_of(tmp: &Path, args: &[&str], given: Option<&str>) -> String {
    let mut c = Command::new(EMU);
    c.arg("env")
        .args(args)
        .env("TMPDIR", tmp)
        .env_remove("EFA_EMU_DEVICES");
    match given {
        Some(g) => c.env("SYSFS_PATH", g),
        None => c.env_remove("SYSFS_PATH"),
    };
    let o = c.output().expect("run efa-emu env");
    assert!(o.status.success(), "{o:?}");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    out.lines()
        .find_map(|l| l.strip_prefix("export SYSFS_PATH='"))
        .and_then(|l| l.strip_suffix('\''))
        .unwrap_or_else(|| panic!("no SYSFS_PATH in {out}"))
        .to_string()
}

#[test]
fn each_device_count_has_its_own_root_unless_the_environment_names_one() {
    let tmp = TempDir::new("roots");
    let one = sysfs_of(&tmp.0, &[], None);
    let four = sysfs_of(&tmp.0, &["--devices", "4"], None);
    assert!(one.starts_with(&*tmp.0.to_string_lossy()), "{one}");
    assert_eq!(four, format!("{one}/4-devices"));
    let given = tmp.0.join("given").display().to_string();
    assert_eq!(sysfs_of(&tmp.0, &["--devices", "4"], Some(&given)), given);
}

#[test]
fn launchers_of_one_and_of_four_devices_at_once_never_see_a_link_missing() {
    let tmp = TempDir::new("race");
    // Each program resolves its first device's PCI function and driver link, as libfabric does
    // when it lists the device, many times while the other launchers make their trees.
    let check = r#"for i in $(seq 1 200); do
        test -e "$SYSFS_PATH/class/infiniband/efa_0/device/driver" || { echo "missing at $i"; exit 1; }
    done"#;
    let children: Vec<_> = (0..16)
        .map(|i| {
            let mut c = Command::new(EMU);
            c.arg("run");
            if i % 2 == 1 {
                c.args(["--devices", "4"]);
            }
            c.args(["--", "sh", "-c", check])
                .env("TMPDIR", &tmp.0)
                .env_remove("SYSFS_PATH")
                .env_remove("EFA_EMU_DEVICES")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start a launcher")
        })
        .collect();
    for (i, c) in children.into_iter().enumerate() {
        let o = c.wait_with_output().expect("wait for a launcher");
        assert!(
            o.status.success(),
            "launcher {i}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
