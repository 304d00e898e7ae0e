//! The module structure (issue 19): no import cycle between the crate's top-level modules.
//!
//! Reads the sources (not the compiled crate): for every top-level module (`src/x.rs` and
//! `src/x/**`), the top-level modules its non-test code names through `crate::` paths, including
//! `use crate::{a::B, c}` groups and names the crate root re-exports (`crate::Domain` is
//! `domain`'s). Comments and `#[cfg(test)] mod tests` blocks at the end of a file are left out.
//! Then the dependency graph must be acyclic; a cycle is printed with the edges that make it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rs_files(p: &Path, out: &mut Vec<PathBuf>) {
    if p.is_dir() {
        for e in std::fs::read_dir(p).unwrap() {
            rs_files(&e.unwrap().path(), out);
        }
    } else if p.extension().is_some_and(|x| x == "rs") {
        out.push(p.to_path_buf());
    }
}

/// The source without comment lines and without a trailing `#[cfg(test)] mod tests` block.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first path segments named after `crate::` (a `{..}` group gives each of its entries').
fn crate_refs(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let end = group
                .char_indices()
                .find(|&(_, c)| {
                    depth += i32::from(c == '{') - i32::from(c == '}');
                    depth == 0
                })
                .map_or(group.len(), |(k, _)| k);
            let mut d = 0;
            let mut start = 0;
            for (k, c) in group[..end].char_indices().chain([(end, ',')]) {
                match c {
                    '{' => d += 1,
                    '}' => d -= 1,
                    ',' if d == 0 => {
                        out.push(first_segment(&group[start..k]));
                        start = k + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(first_segment(rest));
        }
    }
    out
}

fn first_segment(s: &str) -> String {
    s.trim()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

#[test]
fn no_import_cycle_between_top_level_modules() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut modules: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        if name == "lib" {
            continue;
        }
        let mut files = Vec::new();
        rs_files(&p, &mut files);
        modules.entry(name).or_default().extend(files);
    }
    // Names the crate root re-exports, by the module they come from.
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let mut reexport: BTreeMap<String, String> = BTreeMap::new();
    for stmt in code(&lib).split(';') {
        let Some(path) = stmt.trim().strip_prefix("pub use ") else {
            continue;
        };
        let (module, names) = path.split_once("::").unwrap_or((path, ""));
        let names = names.trim_start_matches('{').trim_end_matches('}');
        for n in names.split(',') {
            let n = n.rsplit("::").next().unwrap_or("").trim();
            let n = n.rsplit(" as ").next().unwrap_or(n).trim();
            if !n.is_empty() {
                reexport.insert(n.to_string(), module.trim().to_string());
            }
        }
    }
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut why: BTreeMap<(String, String), String> = BTreeMap::new();
    for (m, files) in &modules {
        for f in files {
            let text = std::fs::read_to_string(f).unwrap();
            for r in crate_refs(&code(&text)) {
                let target = if modules.contains_key(&r) {
                    r
                } else if let Some(t) = reexport.get(&r) {
                    t.clone()
                } else {
                    continue;
                };
                if &target != m && modules.contains_key(&target) {
                    deps.entry(m.clone()).or_default().insert(target.clone());
                    why.entry((m.clone(), target))
                        .or_insert_with(|| f.strip_prefix(&src).unwrap().display().to_string());
                }
            }
        }
    }
    // Depth-first search for a back edge.
    fn visit(
        m: &str,
        deps: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(m.to_string(), 1);
        stack.push(m.to_string());
        for d in deps.get(m).into_iter().flatten() {
            match state.get(d.as_str()) {
                Some(1) => {
                    let i = stack.iter().position(|x| x == d).unwrap();
                    let mut cycle = stack[i..].to_vec();
                    cycle.push(d.clone());
                    return Some(cycle);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(d, deps, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(m.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for m in modules.keys() {
        if !state.contains_key(m.as_str()) {
            if let Some(cycle) = visit(m, &deps, &mut state, &mut Vec::new()) {
                let edges: Vec<String> = cycle
                    .windows(2)
                    .map(|w| {
                        format!(
                            "{} -> {} (e.g. {})",
                            w[0],
                            w[1],
                            why[&(w[0].clone(), w[1].clone())]
                        )
                    })
                    .collect();
                panic!(
                    "import cycle between top-level modules:\n  {}",
                    edges.join("\n  ")
                );
            }
        }
    }
    // The layering this check keeps (printed with --nocapture), and the one docs/architecture.md
    // draws: the same lines, so the drawing cannot go stale (issue 31).
    let lines: Vec<String> = deps
        .iter()
        .map(|(m, d)| format!("{m} -> {}", d.iter().cloned().collect::<Vec<_>>().join(" ")))
        .collect();
    for l in &lines {
        eprintln!("{l}");
    }
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architecture.md"))
            .unwrap();
    let drawn: Vec<String> = doc
        .split("**Layering.**")
        .nth(1)
        .and_then(|rest| rest.split("```").nth(1))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(" -> "))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    assert_eq!(
        drawn, lines,
        "docs/architecture.md's layering block differs from the code's imports: paste the lines \
         `cargo test --test architecture -- --nocapture` prints"
    );
}

/// The protocol engine never reads a clock (DESIGN's rule; time is passed in, so the simulator
/// drives it with virtual time): no `Instant::now` or `SystemTime::now` in `src/proto`'s
/// non-test code, the simulator (`proto/sim.rs`, which owns the virtual clock) aside.
#[test]
fn the_engine_reads_no_clock() {
    // The engine, and the same-host path it shares matching with: both take the time from
    // their caller (the simulator passes virtual time).
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    for m in ["proto", "local"] {
        let dir = src.join(m);
        rs_files(&dir, &mut files);
        if dir.with_extension("rs").exists() {
            rs_files(&dir.with_extension("rs"), &mut files);
        }
    }
    assert!(files.iter().any(|f| f.ends_with("local/recv.rs")));
    let mut found = Vec::new();
    for f in files {
        if f.ends_with("sim.rs") || f.to_string_lossy().contains("tests") {
            continue;
        }
        let c = code(&std::fs::read_to_string(&f).unwrap());
        for pat in ["Instant::now", "SystemTime::now"] {
            if c.contains(pat) {
                found.push(format!("{}: {pat}", f.display()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "the engine or the same-host path reads a clock: {found:?}"
    );
}

/// The udp device's protocol side is sans-I/O, as the engine is: `device/udp/link.rs` (the
/// queue pair's protocol state and its outbox), `srd.rs` (the SRD rules) and `wire.rs` (the
/// codec) read no clock and touch no socket, so the simulator (`device/udp/sim.rs`) drives
/// them with virtual time and a simulated network; `qp.rs` owns the socket and the clock.
#[test]
fn the_udp_protocol_side_is_sans_io() {
    let udp = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/device/udp");
    let mut found = Vec::new();
    for f in ["link.rs", "srd.rs", "wire.rs"] {
        let c = code(&std::fs::read_to_string(udp.join(f)).unwrap());
        for pat in [
            "Instant::now",
            "SystemTime::now",
            "UdpSocket",
            "send_to",
            "recv_from",
            "mio::",
            "socket2::",
            "libc::",
        ] {
            if c.contains(pat) {
                found.push(format!("{f}: {pat}"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "the udp protocol side does I/O: {found:?}"
    );
}

/// The emulated EFA NIC's hooks are not public API (issue 31, point 4): each public item that
/// exists for it is compiled only with the `emu-hooks` feature (which `emu/` turns on), or
/// hidden from the documentation without it, so `cargo doc` of the crate shows none of them.
#[test]
fn the_emulated_nics_hooks_need_their_feature() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let hooks = [
        ("device/mod.rs", "pub struct QpModify"),
        ("device/mod.rs", "fn modify(&mut self"),
        ("device/udp/mod.rs", "pub type RdmaAdmit"),
        ("device/udp/mod.rs", "pub fn set_rdma_admission"),
        ("device/udp/mod.rs", "pub fn register_mem_as"),
        ("mem.rs", "pub unsafe fn foreign"),
        ("mem.rs", "pub fn close_foreign"),
        ("notify.rs", "pub fn forwarding"),
    ];
    let mut open = Vec::new();
    for (file, item) in hooks {
        let text = std::fs::read_to_string(src.join(file)).unwrap();
        let at = text
            .find(item)
            .unwrap_or_else(|| panic!("{file}: `{item}` not found (renamed? update this list)"));
        // The attributes right above the item.
        let above: Vec<&str> = text[..at]
            .trim_end_matches([' ', '\t'])
            .lines()
            .rev()
            .take_while(|l| {
                let t = l.trim_start();
                t.starts_with("#[") || t.starts_with("///")
            })
            .collect();
        let gated = above.iter().any(|l| {
            l.contains("feature = \"emu-hooks\"")
                && (l.contains("cfg(") || l.contains("doc(hidden)"))
        });
        if !gated {
            open.push(format!("{file}: {item}"));
        }
    }
    assert!(
        open.is_empty(),
        "public hooks of the emulated NIC without the emu-hooks feature: {open:?}"
    );
}

/// The endpoint layer decides nothing by device kind (issue 31, point 3): a device declares its
/// policy (`DeviceAttr::policy`), and `getinfo` lists devices through the registry
/// (`device::registry`), so `src/ep` never names a `DeviceKind` and `src/info/` names no
/// device type.
#[test]
fn no_layer_above_the_devices_decides_by_kind() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src.join("ep"), &mut files);
    let mut found = Vec::new();
    for f in &files {
        let c = code(&std::fs::read_to_string(f).unwrap());
        if c.contains("DeviceKind") {
            found.push(f.display().to_string());
        }
    }
    let mut info_files = Vec::new();
    rs_files(&src.join("info"), &mut info_files);
    assert!(!info_files.is_empty(), "src/info/ moved: update this test");
    for f in &info_files {
        let info = code(&std::fs::read_to_string(f).unwrap());
        for ty in ["UdpDevice", "ShmDevice", "LoopbackDevice", "EfaDevice"] {
            if info.contains(ty) {
                found.push(format!("{}: {ty}", f.display()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "device kinds decided above the device layer: {found:?}"
    );
}
