//! The table of files ubdirect writes and trusts later (`docs/security.md`, "Files ubdirect writes
//! and trusts later") is the list in `loader/src/written.rs`, row for row: every kind of file in the
//! code has a row naming what it begins with, and every row is a kind of file the code writes.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use ubdirect_loader::written::WRITTEN_FILES;

/// The `file` and `begins with` cells of the table's rows.
fn rows() -> Vec<(String, String)> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/security.md"))
        .unwrap();
    let section = doc
        .split("### Files ubdirect writes and trusts later")
        .nth(1)
        .expect("docs/security.md has the section");
    let section = section.split("\n### ").next().unwrap();
    section
        .lines()
        .filter(|l| l.starts_with("| `") || l.starts_with("| —"))
        .map(|l| {
            let cells: Vec<&str> = l.split(" | ").collect();
            let strip = |c: &str| {
                c.trim_start_matches("| ")
                    .trim()
                    .trim_matches('`')
                    .to_string()
            };
            (strip(cells[0]), strip(cells[1]))
        })
        .collect()
}

#[test]
fn the_docs_table_of_written_files_is_the_codes_list() {
    let rows = rows();
    assert!(!rows.is_empty(), "the table has rows");
    for w in WRITTEN_FILES {
        let row = rows
            .iter()
            .find(|(name, _)| name == w.name)
            .unwrap_or_else(|| panic!("{} ({}) has no row in docs/security.md", w.name, w.by));
        let begins = String::from_utf8_lossy(w.begins).replace('\0', "\\0");
        let want = if begins.is_empty() {
            "—".to_string()
        } else {
            begins
        };
        assert_eq!(row.1, want, "{}: what it begins with", w.name);
    }
    for (name, _) in &rows {
        assert!(
            WRITTEN_FILES.iter().any(|w| w.name == name),
            "docs/security.md lists {name}, which loader/src/written.rs does not"
        );
    }
    assert_eq!(rows.len(), WRITTEN_FILES.len());
}
