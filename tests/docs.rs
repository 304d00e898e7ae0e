//! The guides cannot name what no longer exists (issue 31 point 5).
//!
//! The guides in `docs/` are compiled as rustdoc modules (`efa::guide`), so their Rust examples
//! build under `cargo test --doc` and their intra-doc links resolve under `cargo doc` with
//! warnings denied. What rustdoc does not see is the prose: a name in backticks, which stays
//! readable on GitHub too, is not a link. This test reads every guide (and the README) and checks,
//! against the sources of the crate and of the emulated NIC, each such name:
//!
//! * a path of the crate, `efa::a::b::Item` or a relative `a::b::Item` (`cma::probe`), where
//!   every module segment must be a module (a file, a folder or an inline `mod`) below the one
//!   before, and the item a definition (or a re-export) in that module's files;
//! * `Type::member` (a method, field, variant or associated constant): `Type` must be defined
//!   somewhere, and `member` defined in a file that names `Type`;
//! * a path of the repository in backticks (`src/proto/engine/rma.rs`, `tests/rdm.rs`), which
//!   must exist.
//!
//! Names of other crates (`std::`, `tokio::`, `Bytes::`, ...) are not checked. The checks read
//! text, not the compiled crate, so they can be fooled by a name defined twice; they cannot miss
//! a name defined nowhere, which is what a rename or a removal leaves behind.

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};

/// First segments of names that belong to other crates or the language.
const FOREIGN: &[&str] = &[
    "std",
    "core",
    "alloc",
    "tokio",
    "parking_lot",
    "bytes",
    "libc",
    "serde",
    "mio",
    "nix",
    "socket2",
    "Bytes",
    "BytesMut",
    "Instant",
    "Duration",
    "Vec",
    "String",
    "Option",
    "Box",
    "Arc",
    "u8",
    "u16",
    "u32",
    "u64",
    "u128",
    "usize",
    "i8",
    "i16",
    "i32",
    "i64",
    "isize",
    "f32",
    "f64",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rs_files(p: &Path, out: &mut Vec<SrcFile>) {
    if p.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for e in entries {
            rs_files(&e, out);
        }
    } else if p.extension().is_some_and(|x| x == "rs") {
        let text = std::fs::read_to_string(p).unwrap();
        out.push(SrcFile::new(p.to_path_buf(), &text));
    }
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// A source file: its path, text, the names it defines (or re-exports) and the words in it.
struct SrcFile {
    path: PathBuf,
    defs: HashSet<String>,
    words: HashSet<String>,
    /// Modules written inline (`mod name {`).
    inline_mods: HashSet<String>,
}

impl SrcFile {
    fn new(path: PathBuf, text: &str) -> SrcFile {
        let words = text
            .split(|c: char| !is_ident_char(c))
            .filter(|w| !w.is_empty())
            .map(str::to_string)
            .collect();
        let defs = text.lines().flat_map(line_defs).collect();
        let inline_mods = text
            .lines()
            .filter_map(|l| {
                let (_, rest) = l.split_once("mod ")?;
                let name = rest.strip_suffix(" {")?;
                name.chars().all(is_ident_char).then(|| name.to_string())
            })
            .collect();
        SrcFile {
            path,
            defs,
            words,
            inline_mods,
        }
    }

    /// Does the file define (or re-export) `name`?
    fn defines(&self, name: &str) -> bool {
        self.defs.contains(name)
    }

    /// Does the file name `word`?
    fn names(&self, word: &str) -> bool {
        self.words.contains(word)
    }
}

/// What a line defines or re-exports: an item, a field, an enum variant, an associated constant,
/// a bitflags constant.
fn line_defs(line: &str) -> Vec<String> {
    const KEYWORDS: &[&str] = &[
        "fn",
        "struct",
        "enum",
        "trait",
        "type",
        "union",
        "mod",
        "const",
        "static",
        "macro_rules!",
    ];
    let l = line.trim_start();
    if l.starts_with("//") {
        return Vec::new();
    }
    let words: Vec<&str> = l
        .split(|c: char| !(is_ident_char(c) || c == '!'))
        .filter(|w| !w.is_empty())
        .collect();
    // A re-export: `pub use a::{Name, ..}`, `use x as Name`: every name on the line.
    if l.starts_with("pub use ") || l.starts_with("pub(crate) use ") || l.starts_with("use ") {
        return words.iter().map(|w| w.to_string()).collect();
    }
    // `pub(crate) fn name(`, `struct Name<`, `const NAME:`, ...
    let mut out: Vec<String> = words
        .windows(2)
        .filter(|w| KEYWORDS.contains(&w[0]))
        .map(|w| w[1].to_string())
        .collect();
    // A field (`pub name: T`, `name: T,`) or a variant (`Name,` `Name(..)` `Name { .. }`).
    let l = l
        .strip_prefix("pub(crate) ")
        .or_else(|| l.strip_prefix("pub(super) "))
        .or_else(|| l.strip_prefix("pub "))
        .unwrap_or(l);
    let name: String = l.chars().take_while(|c| is_ident_char(*c)).collect();
    let rest = l[name.len()..].trim_start();
    if !name.is_empty()
        && (rest.is_empty()
            || rest.starts_with(':') && !rest.starts_with("::")
            || rest.starts_with(',')
            || rest.starts_with('(')
            || rest.starts_with('{')
            || rest.starts_with('='))
    {
        out.push(name);
    }
    out
}

/// The names in backticks of a guide, outside code blocks, with their line numbers.
fn backticked(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let parts: Vec<&str> = line.split('`').collect();
        for (i, p) in parts.iter().enumerate() {
            if i % 2 == 1 && i + 1 < parts.len() {
                out.push((n + 1, p.to_string()));
            }
        }
    }
    out
}

/// `a::b::C` (with an optional trailing `()`) as its segments, if it is such a path.
fn path_segments(s: &str) -> Option<Vec<&str>> {
    let s = s.strip_suffix("()").unwrap_or(s);
    let segs: Vec<&str> = s.split("::").collect();
    (segs.len() >= 2
        && segs.iter().all(|g| {
            !g.is_empty()
                && g.chars().all(is_ident_char)
                && !g.starts_with(|c: char| c.is_ascii_digit())
        }))
    .then_some(segs)
}

/// A module of the sources: its own file and every file below it.
struct Module {
    file: PathBuf,
    dir: Option<PathBuf>,
}

impl Module {
    fn files<'a>(&self, all: &'a [SrcFile]) -> impl Iterator<Item = &'a SrcFile> + 'a {
        let (file, dir) = (self.file.clone(), self.dir.clone());
        all.iter()
            .filter(move |f| f.path == file || dir.as_ref().is_some_and(|d| f.path.starts_with(d)))
    }

    /// The submodule `name`: `name.rs` or `name/mod.rs` beside or below, or an inline `mod`.
    fn sub(&self, name: &str, all: &[SrcFile]) -> Option<Module> {
        let base = self
            .dir
            .clone()
            .unwrap_or_else(|| self.file.with_extension(""));
        let folder = base.join(name);
        if folder.join("mod.rs").is_file() {
            return Some(Module {
                file: folder.join("mod.rs"),
                dir: Some(folder),
            });
        }
        if base.join(format!("{name}.rs")).is_file() {
            return Some(Module {
                file: base.join(format!("{name}.rs")),
                dir: folder.is_dir().then_some(folder),
            });
        }
        let own = all.iter().find(|f| f.path == self.file)?;
        own.inline_mods.contains(name).then(|| Module {
            file: self.file.clone(),
            dir: None,
        })
    }
}

/// Every module of the sources called `name`.
fn modules_named(name: &str, all: &[SrcFile]) -> Vec<Module> {
    let mut out = Vec::new();
    for f in all {
        let p = &f.path;
        let stem = p.file_stem().unwrap().to_str().unwrap();
        let parent = p.parent().unwrap();
        if stem == name {
            out.push(Module {
                file: p.clone(),
                dir: Some(parent.join(name)).filter(|d| d.is_dir()),
            });
        } else if stem == "mod" && parent.file_name().is_some_and(|f| f == name) {
            out.push(Module {
                file: p.clone(),
                dir: Some(parent.to_path_buf()),
            });
        } else if f.inline_mods.contains(name) {
            out.push(Module {
                file: p.clone(),
                dir: None,
            });
        }
    }
    out
}

/// Does `Type::member` (and any further members) exist: the type defined somewhere, each member
/// defined in a file naming the type (or the member before)?
fn type_members(segs: &[&str], all: &[SrcFile]) -> bool {
    let ty = segs[0];
    if !all.iter().any(|f| f.defines(ty)) {
        return false;
    }
    let mut owner = ty;
    for m in &segs[1..] {
        if !all.iter().any(|f| f.names(owner) && f.defines(m)) {
            return false;
        }
        owner = m;
    }
    true
}

/// Is the path `segs` (a module path ending in items and members) in the sources?
fn resolves(segs: &[&str], all: &[SrcFile], src: &Path) -> bool {
    let (start, rest): (Vec<Module>, &[&str]) = if segs[0] == "efa" || segs[0] == "crate" {
        (
            vec![Module {
                file: src.join("lib.rs"),
                dir: Some(src.to_path_buf()),
            }],
            &segs[1..],
        )
    } else if segs[0].starts_with(|c: char| c.is_ascii_uppercase()) {
        return type_members(segs, all);
    } else {
        (modules_named(segs[0], all), &segs[1..])
    };
    start.into_iter().any(|m| resolves_in(m, rest, all))
}

fn resolves_in(m: Module, rest: &[&str], all: &[SrcFile]) -> bool {
    let Some((first, more)) = rest.split_first() else {
        return true;
    };
    if let Some(sub) = m.sub(first, all) {
        if resolves_in(sub, more, all) {
            return true;
        }
    }
    // An item of the module (defined or re-exported in its files), then its members.
    if m.files(all).any(|f| f.defines(first)) {
        return more.is_empty() || type_members(rest, all);
    }
    false
}

#[test]
fn guides_name_only_what_exists() {
    let root = root();
    let mut all = Vec::new();
    rs_files(&root.join("src"), &mut all);
    rs_files(&root.join("emu/src"), &mut all);
    let src = root.join("src");
    let mut guides: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    guides.sort();
    guides.push(root.join("README.md"));
    let mut missing = BTreeSet::new();
    let mut checked = 0;
    for g in &guides {
        let text = std::fs::read_to_string(g).unwrap();
        let name = g.strip_prefix(&root).unwrap().display().to_string();
        for (line, s) in backticked(&text) {
            let s = s.trim();
            let first = s.split("::").next().unwrap_or("");
            if let Some(segs) = path_segments(s) {
                if FOREIGN.contains(&first) {
                    continue;
                }
                checked += 1;
                if !resolves(&segs, &all, &src) {
                    missing.insert(format!("{name}:{line}: `{s}`"));
                }
            } else if [
                "src/",
                "tests/",
                "examples/",
                "benches/",
                "emu/",
                "scripts/",
                "docs/",
                ".ci/",
            ]
            .iter()
            .any(|p| s.starts_with(p))
                && !s.contains(['*', '<', ' ', '{'])
            {
                checked += 1;
                let path = root.join(s.split(':').next().unwrap_or(s));
                // `examples/ping-pong` is the example of that name.
                let example = path.with_extension("rs").exists() && s.starts_with("examples/");
                if !path.exists() && !example {
                    missing.insert(format!("{name}:{line}: `{s}` (no such file)"));
                }
            }
        }
    }
    println!(
        "{checked} names and paths checked in {} guides",
        guides.len()
    );
    assert!(
        checked > 200,
        "the guides name more than that: is the parser broken?"
    );
    assert!(
        missing.is_empty(),
        "the guides name what the sources do not have (rename or remove the mention):\n{}",
        missing.into_iter().collect::<Vec<_>>().join("\n")
    );
}

/// The checks themselves: a name that exists passes, a made-up one fails.
#[test]
fn the_name_check_tells_existing_from_made_up() {
    let root = root();
    let mut all = Vec::new();
    rs_files(&root.join("src"), &mut all);
    let src = root.join("src");
    let ok = |s: &str| resolves(&path_segments(s).unwrap(), &all, &src);
    for s in [
        "efa::proto::engine::Engine",
        "efa::device::shm::cma",
        "Endpoint::send",
        "CompletionQueue::wait_fd",
        "Access::REMOTE_READ",
        "Status::RnrRetryExceeded",
        "cma::probe",
        "efa::bytes",
        "device::random_qkey()",
        "Config::default()",
    ] {
        assert!(ok(s), "{s} exists");
    }
    for s in [
        "efa::proto::engine::Engin",
        "efa::device::tcp",
        "Endpoint::sendd",
        "CompletionQueue::wait_forever",
        "Status::RnrRetryExceded",
        "cma::probe_all",
        "NoSuchType::new",
    ] {
        assert!(!ok(s), "{s} does not exist");
    }
}
