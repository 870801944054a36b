//! The samples cache (Arrow and WebDataset indices kept beside the first shard and mapped at the
//! next start): the same samples and fingerprint from the file as from parsing, a new file when a
//! shard changes, and every damaged or forged file refused, counted, and built again.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::{Path, PathBuf};

use ubdirect_loader::formats::{self, Dtype, Format, LocalFiles, samples_cache, webdataset};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "ubdirect-samples-cache-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Three tars of samples `key.bin` (and a `key.txt` beside each) of 1..300 bytes.
fn tars(d: &Path) -> Vec<PathBuf> {
    (0..3)
        .map(|t| {
            let members: Vec<(String, Vec<u8>)> = (0..40)
                .flat_map(|i| {
                    let n = 1 + (i * 37 + t * 11) % 300;
                    [
                        (format!("s{t}-{i:03}.bin"), vec![(i + t) as u8; n]),
                        (format!("s{t}-{i:03}.txt"), b"caption".to_vec()),
                    ]
                })
                .collect();
            let p = d.join(format!("shard-{t}.tar"));
            webdataset::write(&p, &members).unwrap();
            p
        })
        .collect()
}

fn index(paths: &[PathBuf]) -> formats::index::DatasetIndex {
    formats::index(Format::WebDataset, paths, &LocalFiles, Dtype::U8, 0, "bin").unwrap()
}

fn cache_file(first: &Path) -> Vec<PathBuf> {
    let name = first.file_name().unwrap().to_string_lossy().to_string();
    let mut v: Vec<PathBuf> = std::fs::read_dir(first.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(&format!("{name}.ubdirect-samples-"))
        })
        .collect();
    v.sort();
    v
}

#[test]
fn the_second_start_maps_the_same_samples() {
    let d = scratch("same");
    let paths = tars(&d);
    let parsed = index(&paths);
    assert!(!parsed.samples.is_table(), "the first start parses");
    assert_eq!(parsed.samples.len(), 120);
    assert_eq!(cache_file(&paths[0]).len(), 1, "and keeps the table");
    let mapped = index(&paths);
    assert!(mapped.samples.is_table(), "the second start maps it");
    assert_eq!(mapped.samples.to_vec(), parsed.samples.to_vec());
    assert_eq!(mapped.shards, parsed.shards);
    assert_eq!(
        mapped.fingerprint(),
        parsed.fingerprint(),
        "a state saved over either names the other"
    );
    mapped.validate().unwrap();
    // A shard rewritten in place (same size): another key, parsed again, a second file.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let mut b = std::fs::read(&paths[1]).unwrap();
    let in_shard_1 = parsed.samples.loc(45);
    assert_eq!(in_shard_1.shard, 1);
    b[in_shard_1.offset as usize] ^= 1;
    std::fs::write(&paths[1], &b).unwrap();
    let again = index(&paths);
    assert!(!again.samples.is_table(), "a changed shard is parsed");
    assert_eq!(cache_file(&paths[0]).len(), 2);
}

/// Damage and forgery: each file below is refused (a counted fallback), the dataset is parsed
/// again, and the samples are the parsed ones.
#[test]
fn damaged_and_forged_tables_are_refused() {
    let d = scratch("forged");
    let paths = tars(&d);
    let parsed = index(&paths);
    let file = cache_file(&paths[0]).pop().unwrap();
    let good = std::fs::read(&file).unwrap();
    let (key, sizes) = samples_cache::key(Format::WebDataset, "bin", &paths).unwrap();
    assert!(samples_cache::parse(&good, &key, &sizes).is_ok());
    let h = 16 + key.len().div_ceil(8) * 8;
    let body = h + 24;
    let entries = body + 8 * (paths.len() + 1);
    let reseal = |b: &mut Vec<u8>| {
        let mut c = crc32fast::Hasher::new();
        c.update(&b[h..h + 16]);
        c.update(&b[body..b.len() - 32]);
        let crc = c.finalize().to_le_bytes();
        b[h + 16..h + 20].copy_from_slice(&crc);
    };
    let put = |b: &mut Vec<u8>, at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    type Forge = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Forge, bool)> = vec![
        (
            "a flipped byte",
            Box::new(move |b: &mut Vec<u8>| b[entries + 40] ^= 4),
            false,
        ),
        (
            "cut short",
            Box::new(|b: &mut Vec<u8>| b.truncate(b.len() - 16)),
            false,
        ),
        (
            "a sample past its shard's end",
            Box::new(move |b: &mut Vec<u8>| put(b, entries + 16 * 50, 1 << 40)),
            true,
        ),
        (
            "samples out of file order",
            Box::new(move |b: &mut Vec<u8>| {
                let first = b[entries..entries + 16].to_vec();
                b.copy_within(entries + 16..entries + 32, entries);
                b[entries + 16..entries + 32].copy_from_slice(&first);
            }),
            true,
        ),
        (
            "shard starts moved (a sample given to the next shard)",
            Box::new(move |b: &mut Vec<u8>| put(b, body + 8, 39)),
            true,
        ),
        // Structurally whole (every count made to agree): only the seal refuses it.
        (
            "no samples at all (counts and starts made to agree)",
            Box::new(move |b: &mut Vec<u8>| {
                b.truncate(entries);
                put(b, h + 8, 0);
                for s in 0..=3 {
                    put(b, body + 8 * s, 0);
                }
                b.extend_from_slice(&[0; 32]);
            }),
            true,
        ),
    ];
    for (what, forge, seal) in cases {
        let mut b = good.clone();
        forge(&mut b);
        if seal {
            reseal(&mut b);
        }
        let structural = samples_cache::parse(&b, &key, &sizes);
        if what.starts_with("no samples") {
            assert!(
                structural.is_ok_and(|s| s.is_empty()),
                "{what}: structure alone accepts it"
            );
        } else {
            assert!(structural.is_err(), "{what}");
        }
        std::fs::write(&file, &b).unwrap();
        let before = ubdirect_ub::fallback::count("samples_cache_invalid");
        let idx = index(&paths);
        // At least this one (the counter is the process's: other tests here count too).
        assert!(
            ubdirect_ub::fallback::count("samples_cache_invalid") > before,
            "{what}: counted"
        );
        assert!(!idx.samples.is_table(), "{what}: parsed again");
        assert_eq!(idx.samples.to_vec(), parsed.samples.to_vec(), "{what}");
        // Built again: the next start maps a good file.
        assert!(index(&paths).samples.is_table(), "{what}: rebuilt");
    }
}

/// A FIFO or a link to `/dev/zero` planted at the cache file's name: neither waited on nor read
/// (a counted fallback, the shards parsed), and the file is put in place of the plant, never
/// written through it.
#[test]
fn planted_fifo_and_link_are_neither_read_nor_written_through() {
    let d = scratch("planted");
    let paths = tars(&d);
    let (key, _) = samples_cache::key(Format::WebDataset, "bin", &paths).unwrap();
    let at = samples_cache::cache_path(&paths[0], &key);
    for plant in ["fifo", "link"] {
        let _ = std::fs::remove_file(&at);
        if plant == "fifo" {
            let st = std::process::Command::new("mkfifo")
                .arg(&at)
                .status()
                .unwrap();
            assert!(st.success());
        } else {
            std::os::unix::fs::symlink("/dev/zero", &at).unwrap();
        }
        let p = paths.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(index(&p).samples.is_table()).unwrap());
        let mapped = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("{plant}: the open waited"));
        assert!(!mapped, "{plant}: parsed");
        let m = std::fs::symlink_metadata(&at).unwrap();
        assert!(
            m.file_type().is_file(),
            "{plant}: replaced by the cache file"
        );
        assert!(index(&paths).samples.is_table(), "{plant}: mapped next");
    }
}
