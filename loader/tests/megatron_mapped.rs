//! Megatron `.idx` opened by mapping: nothing copied per sequence, every corruption a typed error
//! naming the file, the sequences read in place equal to what the file says.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::io::Write;
use std::path::{Path, PathBuf};

use ubdirect_loader::formats::{Dtype, FormatError, megatron};
use ubdirect_loader::index::{SampleLoc, Samples};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "ubdirect-megatron-mapped-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A dataset of `seqs` u16 sequences of `1 + i % 7` tokens.
fn small(dir: &Path, seqs: usize) -> PathBuf {
    let prefix = dir.join("m");
    let s: Vec<Vec<u8>> = (0..seqs)
        .map(|i| (0..2 * (1 + i % 7)).map(|b| (i + b) as u8).collect())
        .collect();
    megatron::write(&prefix, Dtype::U16, &s).unwrap();
    prefix
}

fn idx_of(prefix: &Path) -> PathBuf {
    megatron::idx_and_bin(prefix).0
}

/// The `Corrupt` or `Unsupported` error of opening `prefix`, which must name the `.idx`.
fn refused(prefix: &Path, what: &str) -> String {
    let e = megatron::open(&[prefix.to_path_buf()]).expect_err(what);
    let (path, reason) = match &e {
        FormatError::Corrupt { path, reason } | FormatError::Unsupported { path, reason } => {
            (path.clone(), reason.clone())
        }
        other => panic!("{what}: not a format error: {other:?}"),
    };
    assert_eq!(path, idx_of(prefix), "{what}: {e}");
    assert!(e.to_string().contains("m.idx"), "{what}: {e}");
    reason
}

#[test]
fn truncated_idx_at_every_section_is_a_typed_error() {
    let d = scratch("truncated");
    let prefix = small(&d, 10);
    let whole = std::fs::read(idx_of(&prefix)).unwrap();
    // Header 34 bytes, lengths 40, pointers 80, documents 88.
    assert_eq!(whole.len(), 34 + 40 + 80 + 88);
    for cut in [
        0,
        5,
        9,
        17,
        18,
        26,
        33,
        34,
        50,
        74,
        100,
        154,
        200,
        whole.len() - 1,
    ] {
        std::fs::write(idx_of(&prefix), &whole[..cut]).unwrap();
        let r = refused(&prefix, &format!("cut at {cut}"));
        assert!(
            r.contains("truncated") || r.contains("exceeds the file"),
            "cut at {cut}: {r}"
        );
    }
    std::fs::write(idx_of(&prefix), &whole).unwrap();
    assert_eq!(
        megatron::open(&[prefix]).unwrap().samples.len(),
        10,
        "the whole file opens"
    );
}

#[test]
fn corrupted_idx_fields_are_typed_errors() {
    let d = scratch("corrupt");
    let prefix = small(&d, 10);
    let whole = std::fs::read(idx_of(&prefix)).unwrap();
    let patch = |at: usize, bytes: &[u8]| {
        let mut b = whole.clone();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        std::fs::write(idx_of(&prefix), b).unwrap();
    };
    let (lens, ptrs, docs) = (34, 34 + 40, 34 + 120);
    for (what, at, bytes, expect) in [
        ("magic", 0, &b"XXIDIDX"[..], "bad magic"),
        ("version", 9, &2u64.to_le_bytes()[..], "version 2"),
        ("dtype", 17, &[99u8][..], "unknown dtype code 99"),
        ("count", 18, &u64::MAX.to_le_bytes()[..], "exceeds the file"),
        (
            "negative length",
            lens + 4 * 3,
            &(-1i32).to_le_bytes()[..],
            "sequence 3",
        ),
        (
            "pointer past .bin",
            ptrs + 8 * 9,
            &(1i64 << 40).to_le_bytes()[..],
            "past the end",
        ),
        ("overlap", ptrs + 8 * 4, &0i64.to_le_bytes()[..], "overlaps"),
        (
            "first document",
            docs,
            &1i64.to_le_bytes()[..],
            "start at 1",
        ),
        (
            "last document",
            docs + 8 * 10,
            &11i64.to_le_bytes()[..],
            "exceeds sequence_count",
        ),
    ] {
        patch(at, bytes);
        let r = refused(&prefix, what);
        assert!(r.contains(expect), "{what}: {r}");
    }
}

/// The process's resident memory (anonymous + file pages), KiB.
fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// Writes an `.idx` of `n` u16 sequences of `1 + i % 100` tokens and a sparse `.bin`, streamed.
fn large(dir: &Path, n: u64) -> PathBuf {
    let prefix = dir.join("m");
    let (idx, bin) = megatron::idx_and_bin(&prefix);
    let mut f = std::io::BufWriter::new(std::fs::File::create(&idx).unwrap());
    f.write_all(megatron::MAGIC).unwrap();
    f.write_all(&1u64.to_le_bytes()).unwrap();
    f.write_all(&[8]).unwrap();
    f.write_all(&n.to_le_bytes()).unwrap();
    f.write_all(&(n + 1).to_le_bytes()).unwrap();
    for i in 0..n {
        f.write_all(&(1 + (i % 100) as i32).to_le_bytes()).unwrap();
    }
    let mut off = 0i64;
    for i in 0..n {
        f.write_all(&off.to_le_bytes()).unwrap();
        off += 2 * (1 + (i % 100) as i64);
    }
    for d in 0..=n as i64 {
        f.write_all(&d.to_le_bytes()).unwrap();
    }
    f.flush().unwrap();
    std::fs::File::create(bin)
        .unwrap()
        .set_len(off as u64)
        .unwrap();
    prefix
}

/// Opening 2·10⁶ sequences (a 40 MB `.idx`) leaves neither a copy of the file nor a location per
/// sequence (32 MB as `Vec<SampleLoc>`, what the copying reader kept) resident: the index reads the
/// mapping in place. The other tests of this binary allocate a few KiB.
#[test]
fn mapped_open_keeps_nothing_per_sequence_resident() {
    let d = scratch("rss");
    let n = 2_000_000u64;
    let prefix = large(&d, n);
    let before = rss_kib();
    let index = megatron::open(std::slice::from_ref(&prefix)).unwrap();
    let grown = rss_kib().saturating_sub(before);
    assert_eq!(index.samples.len() as u64, n);
    assert!(
        grown < 8 << 10,
        "opening {n} sequences grew the resident set by {grown} KiB"
    );
    let file = index.samples.megatron_file(0..n as usize).unwrap();
    assert!(file.is_mapped());
    // Read in place: the values are the file's.
    let mut off = 0u64;
    for i in 0..1000usize {
        let len = 2 * (1 + (i % 100) as u64);
        assert_eq!(
            index.samples.loc(i),
            SampleLoc {
                shard: 0,
                offset: off,
                len: len as u32
            }
        );
        off += len;
    }
    let last = index.samples.loc(n as usize - 1);
    assert_eq!(last.offset + last.len as u64, index.shards[0].size);
    assert_eq!(index.samples.get(n as usize), None);
}

#[test]
fn several_mapped_shards_read_like_the_vector_of_their_samples() {
    let (a, b) = (scratch("shard-a"), scratch("shard-b"));
    let (pa, pb) = (small(&a, 5), small(&b, 9));
    let index = megatron::open(&[pa, pb]).unwrap();
    assert_eq!(index.samples.len(), 14);
    let want: Vec<SampleLoc> = (0..14)
        .map(|i| {
            let (shard, k) = if i < 5 { (0, i) } else { (1, i - 5) };
            let offset: u64 = (0..k).map(|j| 2 * (1 + j as u64 % 7)).sum();
            SampleLoc {
                shard,
                offset,
                len: 2 * (1 + k as u32 % 7),
            }
        })
        .collect();
    assert_eq!(index.samples.to_vec(), want);
    assert_eq!(index.samples, Samples::from(want));
    index.validate().unwrap();
    assert!(index.samples.megatron_file(0..5).is_some());
    assert!(index.samples.megatron_file(5..14).is_some());
    assert!(index.samples.megatron_file(0..14).is_none());
}

/// The fingerprint (what a saved state names its dataset by) comes from digests of the `.idx`
/// arrays that the open's check takes: equal for the same arrays, different when one length or one
/// pointer differs, and equal to nothing the per-sequence fingerprint of the same samples gives.
#[test]
fn fingerprint_follows_every_length_and_pointer() {
    let d = scratch("fingerprint");
    let prefix = small(&d, 300);
    let open = |p: &Path| megatron::open(&[p.to_path_buf()]).unwrap();
    let base = open(&prefix).fingerprint();
    assert_eq!(
        open(&prefix).fingerprint(),
        base,
        "same files, same fingerprint"
    );
    let idx = std::fs::read(idx_of(&prefix)).unwrap();
    // Sequence 150's length 1 token shorter; sequence 151 a token shorter and 2 bytes further on
    // (a pointer moves only with a length, or sequences would overlap). Both still valid datasets.
    for (at, what) in [
        (34 + 4 * 150, "a length"),
        (34 + 4 * 300 + 8 * 151, "a pointer"),
    ] {
        let mut b = idx.clone();
        if what == "a length" {
            b[at] -= 1;
        } else {
            b[at] += 2;
            b[34 + 4 * 151] -= 1;
        }
        let other = d.join(format!("o{at}"));
        std::fs::write(idx_of(&other), &b).unwrap();
        std::fs::copy(
            megatron::idx_and_bin(&prefix).1,
            megatron::idx_and_bin(&other).1,
        )
        .unwrap();
        let o = open(&other);
        assert_ne!(o.fingerprint(), base, "{what} changed");
        let copy = ubdirect_loader::index::DatasetIndex {
            samples: Samples::from(o.samples.to_vec()),
            ..o.clone()
        };
        assert_ne!(
            copy.fingerprint(),
            o.fingerprint(),
            "{what}: digests, not locations"
        );
    }
}
