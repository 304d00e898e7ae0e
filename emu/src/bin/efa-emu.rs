//! `efa-emu`: runs a program on the emulated EFA NIC.
//!
//! ```text
//! efa-emu run [--addr IP] [--caps LIST] [--faults SPEC] [--devices N] [--bandwidth RATE] -- PROGRAM [ARGS...]
//! efa-emu env [--addr IP] ...        print the environment as shell `export` lines
//! ```
//!
//! It points `LD_LIBRARY_PATH` at a directory where `libibverbs.so.1` and `libefa.so.1` are the
//! emulator (`libefa_emu.so`, found next to this executable), makes the sysfs entries libfabric
//! checks and sets `SYSFS_PATH` to them, and passes the options on as `EFA_EMU_*` variables.

use std::path::{Path, PathBuf};
use std::process::Command;

fn usage() -> ! {
    eprintln!(
        "usage: efa-emu run [--addr IP] [--caps LIST] [--faults SPEC] [--device NAME] [--devices N] [--bandwidth RATE] -- PROGRAM [ARGS...]\n       efa-emu env [same options]\n\nLIST: comma-separated rdma_read,rdma_write,rnr_retry,unsolicited_write_recv,cq_with_sgid (or none)\nSPEC: seed=N,drop=P,dup=P,reorder=P,delay=P:MICROS\nN: devices efa_0..efa_<N-1> (1..=32), each on its own address, PCI function and NUMA node\nRATE: bytes per second each device sends at most (k, m, g: powers of 1000)\nOther EFA_EMU_* variables in the environment pass through (docs/emulator.md)."
    );
    std::process::exit(2)
}

/// The emulator library, next to this executable: cargo puts it in target/<profile>/ when it
/// builds the package, and only in target/<profile>/deps/ when it builds it for tests; the newer
/// one is the current one.
fn library() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("where am I: {e}"))?;
    let dir = exe.parent().ok_or("executable has no directory")?;
    let newest = [dir.join("libefa_emu.so"), dir.join("deps/libefa_emu.so")]
        .into_iter()
        .filter_map(|p| {
            let t = std::fs::metadata(&p).and_then(|m| m.modified()).ok()?;
            Some((t, p))
        })
        .max_by_key(|(t, _)| *t);
    match newest {
        Some((_, p)) => p.canonicalize().map_err(|e| e.to_string()),
        None => Err(format!(
            "libefa_emu.so not found next to {} (build it: cargo build -p efa-emu)",
            exe.display()
        )),
    }
}

/// A directory holding `libibverbs.so.1` and `libefa.so.1`, both the emulator.
fn lib_dir(lib: &Path) -> Result<PathBuf, String> {
    let dir = lib
        .parent()
        .ok_or("library has no directory")?
        .join("efa-emu-lib");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // Launchers started at once share the directory: a link that is right stays, a wrong one
    // is replaced atomically (a private link renamed over it), so no launcher fails on a link
    // another just made and no starting program finds the library missing.
    for name in ["libibverbs.so.1", "libefa.so.1"] {
        let link = dir.join(name);
        if std::fs::read_link(&link).is_ok_and(|t| t == lib) {
            continue;
        }
        let tmp = dir.join(format!(".{name}.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(lib, &tmp)
            .and_then(|()| std::fs::rename(&tmp, &link))
            .map_err(|e| format!("{}: {e}", link.display()))?;
    }
    Ok(dir)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let cmd = args.next().unwrap_or_else(|| usage());
    let mut env: Vec<(String, String)> = Vec::new();
    let mut program = Vec::new();
    while let Some(a) = args.next() {
        let mut val = |name: &str| {
            args.next()
                .unwrap_or_else(|| {
                    eprintln!("efa-emu: {a} needs a value");
                    std::process::exit(2)
                })
                .to_string()
                .pipe(|v| env.push((name.to_string(), v)))
        };
        match a.as_str() {
            "--addr" => val("EFA_EMU_ADDR"),
            "--caps" => val("EFA_EMU_CAPS"),
            "--faults" => val("EFA_EMU_FAULTS"),
            "--device" => val("EFA_EMU_DEVICE"),
            "--devices" => val("EFA_EMU_DEVICES"),
            "--bandwidth" => val("EFA_EMU_BANDWIDTH"),
            "--" => {
                program.extend(args.by_ref());
                break;
            }
            "-h" | "--help" => usage(),
            other => {
                eprintln!("efa-emu: unknown option {other}");
                usage()
            }
        }
    }
    // Check the configuration as the library will read it, so a typo fails here, clearly.
    let lookup = |k: &str| {
        env.iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .or_else(|| std::env::var(k).ok())
    };
    let cfg = match efa_emu::config::EmuConfig::from_lookup(lookup) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("efa-emu: {e}");
            std::process::exit(2)
        }
    };
    let run = || -> Result<(PathBuf, PathBuf), String> {
        let lib = library()?;
        let dir = lib_dir(&lib)?;
        let sysfs = efa_emu::sysfs::given_root()
            .unwrap_or_else(|| efa_emu::sysfs::default_root_for(cfg.devices));
        efa_emu::sysfs::make(&sysfs, &cfg)?;
        Ok((dir, sysfs))
    };
    let (dir, sysfs) = run().unwrap_or_else(|e| {
        eprintln!("efa-emu: {e}");
        std::process::exit(1)
    });
    let ld = match std::env::var("LD_LIBRARY_PATH") {
        Ok(old) if !old.is_empty() => format!("{}:{old}", dir.display()),
        _ => dir.display().to_string(),
    };
    env.push(("LD_LIBRARY_PATH".into(), ld));
    env.push(("SYSFS_PATH".into(), sysfs.display().to_string()));
    match cmd.as_str() {
        "env" => {
            for (k, v) in &env {
                println!("export {k}='{v}'");
            }
        }
        "run" => {
            let Some((prog, rest)) = program.split_first() else {
                usage()
            };
            let mut c = Command::new(prog);
            c.args(rest).envs(env.iter().map(|(k, v)| (k, v)));
            use std::os::unix::process::CommandExt;
            let e = c.exec();
            eprintln!("efa-emu: cannot run {prog}: {e}");
            std::process::exit(127)
        }
        _ => usage(),
    }
}

trait Pipe: Sized {
    fn pipe<R>(self, f: impl FnOnce(Self) -> R) -> R {
        f(self)
    }
}
impl<T> Pipe for T {}
