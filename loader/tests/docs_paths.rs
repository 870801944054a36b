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

#[test]
fn every_path_the_docs_cite_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut docs = vec![root.join("README.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".md") && name != "decisions.md" && name != "benchmarks.md" {
            docs.push(p);
        }
    }
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
