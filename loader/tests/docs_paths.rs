//! The docs cite files that exist: every path under the repository's top-level directories named
//! in `README.md` and `docs/*.md` (`loader/src/...`, `configs/...`, `.ci/...`) is a file or a
//! directory of the tree. `docs/decisions.md` and `docs/benchmarks.md` are dated logs: a path there
//! may name what a file was on its date, so they are left out.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::Path;

const TOPS: [&str; 8] = [
    "ub/", "nvme/", "net/", "loader/", "bench/", "python/", "configs/", "docs/",
];

fn cited(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = text.as_bytes();
    let is_path = |c: u8| c.is_ascii_alphanumeric() || b"_./-".contains(&c);
    let mut i = 0;
    while i < b.len() {
        let rest = &b[i..];
        let starts = (i == 0 || !is_path(b[i - 1]))
            && (TOPS.iter().any(|t| rest.starts_with(t.as_bytes())) || rest.starts_with(b".ci/"));
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < b.len() && is_path(b[j]) {
            j += 1;
        }
        let p = text[i..j].trim_end_matches(['.', '-', '/']);
        if !p.contains('*') {
            out.push(p.to_string());
        }
        i = j;
    }
    out
}

/// README and the docs, the dated logs (`decisions.md`, `benchmarks.md`) aside.
fn docs(root: &Path) -> Vec<std::path::PathBuf> {
    let mut docs = vec![root.join("README.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".md") && name != "decisions.md" && name != "benchmarks.md" {
            docs.push(p);
        }
    }
    docs
}

#[test]
fn every_path_the_docs_cite_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let docs = docs(&root);
    let mut missing = Vec::new();
    for d in &docs {
        let text = std::fs::read_to_string(d).unwrap();
        for (n, line) in text.lines().enumerate() {
            for p in cited(line) {
                if !root.join(&p).exists() {
                    missing.push(format!("{}:{}: {p}", d.display(), n + 1));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "paths the docs cite that do not exist:\n{}",
        missing.join("\n")
    );
}

/// The module a `::` path's segments name under crate root `root` (a directory of `.rs` files):
/// the file of the deepest module reached and how many segments it took.
fn module_file(root: &Path, segs: &[&str]) -> (std::path::PathBuf, usize) {
    let (mut dir, mut file) = (root.to_path_buf(), root.join("lib.rs"));
    for (i, s) in segs.iter().enumerate() {
        let (m, f) = (dir.join(s).join("mod.rs"), dir.join(format!("{s}.rs")));
        if m.exists() {
            (dir, file) = (dir.join(s), m);
        } else if f.exists() {
            (dir, file) = (dir.join(s), f);
        } else {
            return (file, i);
        }
    }
    (file, segs.len())
}

/// Whether `name` is named in `file` as a word (an item, a re-export, a field or a variant).
fn names(file: &Path, name: &str) -> bool {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    text.match_indices(name).any(|(i, _)| {
        let ok = |c: Option<char>| !c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        ok(text[..i].chars().next_back()) && ok(text[i + name.len()..].chars().next())
    })
}

/// Module paths the docs cite in backticks (`formats::seal`, `ubdirect_ub::NewFile`,
/// `gpt::cache::read`) name modules of the crates, and their last segment an item named there.
#[test]
fn every_module_path_the_docs_cite_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let crates = [
        ("ub", "ub/src"),
        ("nvme", "nvme/src"),
        ("net", "net/src"),
        ("loader", "loader/src"),
    ];
    let alias = |s: &str| match s {
        "ubdirect_ub" => Some("ub"),
        "ubdirect_nvme" => Some("nvme"),
        "ubdirect_net" => Some("net"),
        "ubdirect_loader" => Some("loader"),
        _ => None,
    };
    let docs = docs(&root);
    let mut missing = Vec::new();
    for d in &docs {
        let text = std::fs::read_to_string(d).unwrap();
        for (n, line) in text.lines().enumerate() {
            for cell in line.split('`').skip(1).step_by(2) {
                let path: String = cell
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                let segs: Vec<&str> = path.split("::").collect();
                if segs.len() < 2 || segs.iter().any(|s| s.is_empty()) {
                    continue;
                }
                // A crate's name, or a top-level module of one of the crates; anything else
                // (std, tokio, other crates' paths, types' methods) is not ours to check.
                let roots: Vec<(std::path::PathBuf, &[&str])> = match alias(segs[0]) {
                    Some(c) => crates
                        .iter()
                        .filter(|(k, _)| *k == c)
                        .map(|(_, r)| (root.join(r), &segs[1..]))
                        .collect(),
                    None => crates
                        .iter()
                        .map(|(_, r)| root.join(r))
                        .filter(|r| module_file(r, &segs[..1]).1 == 1)
                        .map(|r| (r, &segs[..]))
                        .collect(),
                };
                if roots.is_empty() {
                    continue;
                }
                let found = roots.iter().any(|(r, ss)| {
                    let (file, took) = module_file(r, ss);
                    took == ss.len() || names(&file, ss[took])
                });
                if !found {
                    missing.push(format!("{}:{}: {path}", d.display(), n + 1));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "module paths the docs cite that do not exist:\n{}",
        missing.join("\n")
    );
}
