//! `docs/libfabric-map.md` against the source: every libfabric name the API carries as a
//! `#[doc(alias)]` is a row of the map with a counterpart, every row with a counterpart names
//! only calls that some item carries as an alias, and every row without one (`—`) names calls
//! no item claims (issue 28).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every `#[doc(alias = "...")]` under `src/`, with the files that carry it.
fn aliases() -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("read src") {
            let p = e.expect("dir entry").path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&p).expect("read a source file");
            const PAT: &str = "doc(alias = \"";
            for (i, _) in text.match_indices(PAT) {
                let rest = &text[i + PAT.len()..];
                if let Some(end) = rest.find('"') {
                    out.entry(rest[..end].to_string())
                        .or_default()
                        .insert(p.display().to_string());
                }
            }
        }
    }
    out
}

/// A row of the map: the libfabric names of its first column (backticked, starting `fi_` or
/// `FI_`) and whether it names a counterpart.
struct Row {
    line: usize,
    names: Vec<String>,
    offered: bool,
}

fn rows() -> Vec<Row> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/libfabric-map.md");
    let text = std::fs::read_to_string(path).expect("docs/libfabric-map.md");
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // "| a | b | c |" splits into ["", a, b, c, ""].
        if cells.len() < 5 || !cells[0].is_empty() || cells[1].starts_with("---") {
            continue;
        }
        let names: Vec<String> = cells[1]
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|n| n.starts_with("fi_") || n.starts_with("FI_"))
            .map(str::to_string)
            .collect();
        if names.is_empty() {
            continue;
        }
        let offered = cells[2] != "—";
        assert!(
            !offered || cells[2].starts_with('`'),
            "docs/libfabric-map.md:{}: the counterpart column names an item in backticks or is —",
            i + 1
        );
        out.push(Row {
            line: i + 1,
            names,
            offered,
        });
    }
    out
}

#[test]
fn the_libfabric_map_and_the_aliases_agree() {
    let aliases = aliases();
    let rows = rows();
    assert!(rows.len() > 50, "the map lists the calls an EFA user makes");
    let mut offered = BTreeSet::new();
    let mut problems = Vec::new();
    for r in &rows {
        for n in &r.names {
            match (r.offered, aliases.get(n)) {
                (true, None) => problems.push(format!(
                    "line {}: `{n}` has a counterpart in the map but no item carries #[doc(alias = \"{n}\")]",
                    r.line
                )),
                (false, Some(files)) => problems.push(format!(
                    "line {}: `{n}` is marked not offered, but {files:?} carry its alias",
                    r.line
                )),
                _ => {}
            }
            if r.offered {
                offered.insert(n.clone());
            }
        }
    }
    for (a, files) in &aliases {
        if !offered.contains(a) {
            problems.push(format!(
                "alias `{a}` (in {files:?}) is not a row with a counterpart in docs/libfabric-map.md"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
