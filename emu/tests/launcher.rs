//! The launcher's choice of sysfs root, and launchers of different device counts started at
//! once: none may find another's tree under its own, or a link of its tree missing.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use common::EMU;

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
    let tmp = tempfile::tempdir().expect("temporary directory");
    let one = sysfs_of(tmp.path(), &[], None);
    let four = sysfs_of(tmp.path(), &["--devices", "4"], None);
    assert!(one.starts_with(&*tmp.path().to_string_lossy()), "{one}");
    assert_eq!(four, format!("{one}/4-devices"));
    let given = tmp.path().join("given").display().to_string();
    assert_eq!(
        sysfs_of(tmp.path(), &["--devices", "4"], Some(&given)),
        given
    );
}

#[test]
fn launchers_of_one_and_of_four_devices_at_once_never_see_a_link_missing() {
    let tmp = tempfile::tempdir().expect("temporary directory");
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
                .env("TMPDIR", tmp.path())
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
