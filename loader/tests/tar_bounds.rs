//! Issue 43 (round 3 of the attacks), C: a WebDataset tar's memory is bounded by the tar. One pax
//! global header with a 1 MiB path followed by thousands of tiny `x` headers copied the global
//! path into each (a 3.1 MB tar: 15 s and 4.0 GiB; an 11 MB one aborted). The global path is now
//! held once. Alone in its test binary: it reads the process's peak RSS.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::PathBuf;

fn header(name: &[u8], size: u64, kind: u8) -> [u8; 512] {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name);
    let mut octal = |at: usize, width: usize, v: u64| {
        let s = format!("{v:0w$o}\0", w = width - 1);
        h[at..at + width].copy_from_slice(&s.as_bytes()[s.len() - width..]);
    };
    octal(100, 8, 0o644);
    octal(108, 8, 0);
    octal(116, 8, 0);
    octal(124, 12, size);
    octal(136, 12, 0);
    h[156] = kind;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].fill(b' ');
    let sum: u64 = h.iter().map(|&b| b as u64).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    h
}

/// A pax record `"%d key=value\n"`.
fn record(key: &str, value: &[u8]) -> Vec<u8> {
    let body = [key.as_bytes(), b"=", value, b"\n"].concat();
    let mut n = body.len() + 2;
    while format!("{n} ").len() + body.len() != n {
        n += 1;
    }
    [format!("{n} ").as_bytes(), &body].concat()
}

fn push(t: &mut Vec<u8>, kind: u8, data: &[u8]) {
    t.extend_from_slice(&header(b"PaxHeaders/x", data.len() as u64, kind));
    t.extend_from_slice(data);
    t.resize(t.len().div_ceil(512) * 512, 0);
}

fn peak_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

#[test]
fn a_pax_global_path_is_held_once() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tar-bounds");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A global path of 1 MiB − 64 bytes, then 2,000 `x` headers that set nothing the loader reads,
    // then one member with an `x` header of its own: 3.1 MB. As `tarfile` reads it, each `x` header
    // carries the global path and the first one read is applied last, so the member is named by the
    // 1 MiB global path: refused (names are at most 4 KiB), after a scan bounded by the tar.
    let mut t = Vec::new();
    push(&mut t, b'g', &record("path", &vec![b'd'; (1 << 20) - 64]));
    for _ in 0..2000 {
        push(&mut t, b'x', &record("comment", b"c"));
    }
    push(&mut t, b'x', &record("path", b"k0.jpg"));
    t.extend_from_slice(&header(b"k0.jpg", 3, b'0'));
    t.extend_from_slice(b"abc");
    t.resize(t.len().div_ceil(512) * 512 + 1024, 0);
    assert!(t.len() > 3_000_000, "{} bytes", t.len());
    let p = dir.join("g.tar");
    std::fs::write(&p, &t).unwrap();
    let before = peak_rss();
    let t0 = std::time::Instant::now();
    let mut f = std::fs::File::open(&p).unwrap();
    let got = ubdirect_loader::formats::webdataset::open_readers(
        &mut [(p.clone(), t.len() as u64, &mut f)],
        "jpg",
    );
    let took = t0.elapsed();
    let grew = peak_rss().saturating_sub(before);
    eprintln!(
        "3.1 MB pax-global tar: {:?} in {:.3} s, peak RSS +{} MB",
        got.as_ref().map(|i| i.samples.len()),
        took.as_secs_f64(),
        grew >> 20
    );
    match got {
        Err(ubdirect_loader::formats::FormatError::Unsupported { reason, .. }) => {
            assert!(reason.contains("a name of 1048512 bytes"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // Bounded by the tar (3.1 MB, read whole by the scan's reader), not by headers × global path
    // (2,000 × 1 MiB = 2 GiB before).
    assert!(grew < 100 << 20, "peak RSS grew by {grew} bytes");
    assert!(
        took < std::time::Duration::from_secs(30),
        "a hang: {took:?}"
    );
}

/// Issue 43, C: a global path of 4,095 `/` and an `x` header per member: every member's name is
/// the slashes, and splitting each into key and extension rescanned from every `/` (a 1 MB tar:
/// 10.4 s, and again at every start). One pass now: the members are skipped (no extension) at once.
#[test]
fn a_name_of_slashes_splits_in_one_pass() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tar-slashes");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut t = Vec::new();
    push(&mut t, b'g', &record("path", &[b'/'; 4095]));
    while t.len() < 1 << 20 {
        push(&mut t, b'x', &record("comment", b"c"));
        t.extend_from_slice(&header(b"m", 1, b'0'));
        t.extend_from_slice(&[b'z'; 512]);
    }
    t.resize(t.len() + 1024, 0);
    let p = dir.join("s.tar");
    std::fs::write(&p, &t).unwrap();
    let t0 = std::time::Instant::now();
    let mut f = std::fs::File::open(&p).unwrap();
    let got = ubdirect_loader::formats::webdataset::open_readers(
        &mut [(p.clone(), t.len() as u64, &mut f)],
        "jpg",
    );
    let took = t0.elapsed();
    eprintln!(
        "1 MB tar of slash names: {:?} in {:.3} s",
        got.as_ref().map(|i| i.samples.len()),
        took.as_secs_f64()
    );
    assert!(got.is_ok_and(|i| i.samples.is_empty()));
    assert!(
        took < std::time::Duration::from_secs(30),
        "a hang: {took:?}"
    );
}
