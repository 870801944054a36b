//! WebDataset `.tar` shards end to end: every sample's parts equal the members written, locally and
//! over `ub://` (an in-process server on loopback), one part or several; the member list is kept
//! beside the shard and a changed shard is scanned again; a damaged tar is a typed error naming it.
//! (`python/tests/test_webdataset.py` checks the same against the `webdataset` package itself.)

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ubdirect_loader::formats::webdataset;
use ubdirect_loader::{Loader, RunConfig};

/// A sample: its key and its parts (extension, bytes).
type Sample = (String, Vec<(String, Vec<u8>)>);

/// Samples of shard `s`: jpg + cls, some with a long key (GNU long name)
/// and an extra `json` part, a metadata member and a directory between them.
fn samples(s: usize, n: usize) -> Vec<Sample> {
    (0..n)
        .map(|i| {
            let key = if i % 7 == 3 {
                format!("{}/s{s}-{i:05}", "long-dir".repeat(16))
            } else {
                format!("s{s}-{i:05}")
            };
            let jpg: Vec<u8> = (0..(i * 37 % 1500))
                .map(|k| (k * 31 + i + s) as u8)
                .collect();
            let mut parts = vec![
                ("jpg".to_string(), jpg),
                ("cls".to_string(), format!("{}", i % 10).into_bytes()),
            ];
            if i % 5 == 0 {
                parts.push(("json".to_string(), b"{\"a\": 1}".to_vec()));
            }
            (key, parts)
        })
        .collect()
}

fn write_shard(p: &Path, s: &[Sample]) {
    let mut members = vec![("__meta__".to_string(), b"skipped".to_vec())];
    for (k, parts) in s {
        for (e, b) in parts {
            members.push((format!("{k}.{e}"), b.clone()));
        }
    }
    webdataset::write(p, &members).unwrap();
}

/// A dataset of 3 shards in `d`; returns its paths and every sample's parts by sample id.
fn dataset(d: &Path) -> (Vec<PathBuf>, Vec<BTreeMap<String, Vec<u8>>>) {
    let mut paths = Vec::new();
    let mut want = Vec::new();
    for s in 0..3 {
        let v = samples(s, 50 + 20 * s);
        let p = d.join(format!("shard-{s:05}.tar"));
        write_shard(&p, &v);
        paths.push(p);
        want.extend(v.into_iter().map(|(_, parts)| parts.into_iter().collect()));
    }
    (paths, want)
}

fn config(paths: Vec<PathBuf>, columns: &[&str]) -> RunConfig {
    let mut c = RunConfig::default();
    c.dataset.format = "webdataset".parse().unwrap();
    c.dataset.paths = paths;
    c.dataset.generate = false;
    if columns.len() == 1 {
        c.dataset.column = columns[0].into();
    } else {
        c.dataset.columns = columns.iter().map(|s| s.to_string()).collect();
    }
    c.device.select = ubdirect_ub::DeviceSelection::Host;
    c.loader.batch_size = 8;
    c.loader.remainder = ubdirect_loader::planner::Remainder::Pad;
    c.pool.staging_blocks = 8;
    c
}

/// One epoch: every delivered sample's id and parts, in delivery order.
fn epoch(c: &RunConfig, columns: &[&str]) -> Vec<(u64, Vec<Vec<u8>>)> {
    let l = Loader::from_config(c).unwrap();
    let mut out = Vec::new();
    for b in l.epoch(0).unwrap() {
        let b = b.unwrap();
        for (i, s) in b.samples().iter().enumerate() {
            let bytes = b.sample_to_vec(i).unwrap();
            let parts = match b.parts(i) {
                Some(p) => p
                    .iter()
                    .map(|&(o, n)| bytes[o as usize..(o + n) as usize].to_vec())
                    .collect(),
                None => vec![bytes],
            };
            assert_eq!(parts.len(), columns.len());
            out.push((s.id, parts));
        }
    }
    out
}

fn check(got: &[(u64, Vec<Vec<u8>>)], want: &[BTreeMap<String, Vec<u8>>], columns: &[&str]) {
    let mut seen = vec![false; want.len()];
    for (id, parts) in got {
        let w = &want[*id as usize];
        for (k, c) in columns.iter().enumerate() {
            assert_eq!(&parts[k], &w[*c], "sample {id} part {c}");
        }
        seen[*id as usize] = true;
    }
    assert!(seen.iter().all(|s| *s), "every sample delivered");
}

#[test]
fn every_samples_parts_equal_the_members_written() {
    let d = support::tmp("wds-local");
    let (paths, want) = dataset(&d);
    for columns in [&["jpg", "cls"][..], &["cls"], &["jpg"]] {
        let got = epoch(&config(paths.clone(), columns), columns);
        check(&got, &want, columns);
    }
    // Shuffle off: file order.
    let mut c = config(paths.clone(), &["jpg", "cls"]);
    c.loader.shuffle = false;
    let ids: Vec<u64> = epoch(&c, &["jpg", "cls"]).iter().map(|s| s.0).collect();
    let n = want.len() as u64;
    assert_eq!(
        ids[..n as usize],
        (0..n).collect::<Vec<_>>()[..],
        "file order"
    );
    // Not every sample has a json part: a typed error naming the sample.
    let e = Loader::from_config(&config(paths, &["jpg", "json"])).unwrap_err();
    assert!(e.to_string().contains("no part \"json\""), "{e}");
}

/// The bytes between a sample's parts (each part 8-byte aligned) are zeros, also in batch blocks
/// reused from earlier chunks (they once held another chunk's bytes there): a sample's bytes do not
/// depend on what its block held before.
#[test]
fn padding_between_parts_is_zero_in_reused_blocks() {
    let d = support::tmp("wds-padding");
    let (paths, _) = dataset(&d);
    let mut c = config(paths, &["jpg", "cls"]);
    c.loader.max_chunk_batches = 1;
    c.pool.batch_blocks = 2;
    c.pool.page_cache_budget = ubdirect_loader::config::PageCacheBudget::Bytes(0);
    let l = Loader::from_config(&c).unwrap();
    let mut checked = 0;
    for epoch in 0..2 {
        for b in l.epoch(epoch).unwrap() {
            let b = b.unwrap();
            for i in 0..b.len() {
                let bytes = b.sample_to_vec(i).unwrap();
                let parts = b.parts(i).unwrap();
                for (k, &(o, n)) in parts.iter().enumerate() {
                    let next = parts.get(k + 1).map_or(bytes.len(), |p| p.0 as usize);
                    let pad = &bytes[(o + n) as usize..next];
                    assert!(
                        pad.iter().all(|&x| x == 0),
                        "epoch {epoch} sample {i} part {k}: {pad:?}"
                    );
                    checked += pad.len();
                }
            }
        }
    }
    assert!(checked > 100, "{checked} padding bytes checked");
}

#[test]
fn over_ub_equals_local() {
    let d = support::tmp("wds-ub");
    let (paths, want) = dataset(&d);
    let port = support::free_port();
    let token = "webdataset-remote-token";
    let (stop, thread) = support::ub::start(support::ub::loopback(
        port,
        token.as_bytes(),
        vec![("ds".into(), d.clone())],
        1 << 20,
    ));
    let columns = ["jpg", "cls"];
    let urls: Vec<PathBuf> = paths
        .iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            PathBuf::from(format!("ub://127.0.0.1:{port}/ds/{name}"))
        })
        .collect();
    let mut c = config(urls, &columns);
    c.remote.token = token.into();
    c.remote.deadline_ms = 10_000;
    let remote = epoch(&c, &columns);
    check(&remote, &want, &columns);
    assert_eq!(remote, epoch(&config(paths, &columns), &columns));
    let _ = stop.send(());
    thread.join().unwrap();
}

#[test]
fn the_member_list_is_kept_beside_the_shard_until_it_changes() {
    let d = support::tmp("wds-sidecar");
    let p = d.join("a.tar");
    let v = samples(0, 30);
    write_shard(&p, &v);
    let side = d.join("a.tar.ubdirect-index");
    // The shard's own index (its sidecar or a scan), not the dataset's samples cache in front of it.
    let open = |p: &Path| {
        let size = std::fs::metadata(p).unwrap().len();
        let mut f = std::fs::File::open(p).unwrap();
        let idx = webdataset::open_readers(&mut [(p.to_path_buf(), size, &mut f)], "jpg").unwrap();
        idx.samples.to_vec()
    };
    let first = open(&p);
    assert!(side.exists(), "sidecar written");
    assert_eq!(open(&p), first, "read back from the sidecar");
    // A damaged sidecar is ignored (and the shard scanned again).
    let mut b = std::fs::read(&side).unwrap();
    let n = b.len();
    b[n - 60..].fill(0xAB);
    std::fs::write(&side, &b).unwrap();
    assert_eq!(open(&p), first);
    // Issue 43 (round 3 of the attacks), A: a sidecar forged with a valid CRC and the shard's
    // identity — no members (was 0 samples), or members drawn across headers (was samples holding
    // tar headers) — is refused by its seal, and the shard scanned again.
    let good = std::fs::read(&side).unwrap();
    let body = good.len() - 4 - 32;
    let reseal = |mut b: Vec<u8>| {
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b.extend_from_slice(&[0; 32]);
        b
    };
    let mut none = good[..72].to_vec();
    none[64..72].fill(0);
    let mut across = good[..body].to_vec();
    across[72 + 8..72 + 16].copy_from_slice(&512u64.to_le_bytes()); // member 0's bytes from its header
    for forged in [reseal(none), reseal(across)] {
        std::fs::write(&side, &forged).unwrap();
        let before = ubdirect_ub::fallback::count("tar_sidecar_invalid");
        assert_eq!(open(&p), first);
        assert!(
            ubdirect_ub::fallback::count("tar_sidecar_invalid") > before,
            "counted"
        );
        assert!(
            std::fs::read(&side).unwrap() == good,
            "scanned and written again"
        );
    }
    // The shard rewritten in place, same size, its mtime put back (was: the old sidecar used, the
    // new bytes read at the old offsets): its ctime moved, so it is scanned again.
    let mtime = std::fs::metadata(&p).unwrap().modified().unwrap();
    let mut v3 = samples(0, 30);
    // Sample 1's jpg grows from 37 to 100 bytes: within its 512-byte block, so the tar keeps its size.
    assert_eq!(v3[1].1[0].0, "jpg");
    assert_eq!(v3[1].1[0].1.len(), 37);
    v3[1].1[0].1 = vec![9u8; 100];
    let before = std::fs::read(&p).unwrap();
    let mut t3 = {
        let tmp = d.join("t3.tar");
        write_shard(&tmp, &v3);
        std::fs::read(&tmp).unwrap()
    };
    assert_eq!(t3.len(), before.len());
    {
        use std::io::Write;
        let mut f = std::fs::File::options().write(true).open(&p).unwrap();
        f.write_all(&t3).unwrap();
        f.set_modified(mtime).unwrap();
    }
    assert_eq!(std::fs::metadata(&p).unwrap().modified().unwrap(), mtime);
    std::thread::sleep(std::time::Duration::from_millis(20));
    let rewritten = open(&p);
    assert_eq!(rewritten.len(), 30);
    assert_eq!((first[1].len, rewritten[1].len), (37, 100));
    t3.clear();
    // The shard changes: scanned again, the new parts are read.
    let mut v2 = samples(0, 30);
    v2[0].1[0].1 = vec![1u8; 3000];
    std::thread::sleep(std::time::Duration::from_millis(20));
    write_shard(&p, &v2);
    let again = open(&p);
    assert_eq!(again.len(), 30);
    assert_eq!(again[0].len, 3000);
}

#[test]
fn damaged_tars_are_typed_errors_naming_the_shard() {
    let d = support::tmp("wds-bad");
    let p = d.join("bad.tar");
    write_shard(&p, &samples(0, 10));
    let good = std::fs::read(&p).unwrap();
    // A flipped header byte (bad checksum), a cut shard, a gzip shard.
    let mut flipped = good.clone();
    flipped[1024 + 3] ^= 1;
    let cut = good[..good.len() - 1024 - 700].to_vec();
    let mut gz = vec![0x1f, 0x8b, 8, 0];
    gz.extend_from_slice(&good[..600]);
    for (bytes, what) in [(flipped, "bad checksum"), (cut, "offset"), (gz, "gzip")] {
        std::fs::write(&p, &bytes).unwrap();
        let _ = std::fs::remove_file(d.join("bad.tar.ubdirect-index"));
        let e = Loader::from_config(&config(vec![p.clone()], &["jpg", "cls"]))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(what) && e.contains("bad.tar"), "{what}: {e}");
    }
}

#[test]
fn gen_writes_a_dataset_the_config_reads() {
    let d = support::tmp("wds-gen");
    let mut c = config(Vec::new(), &["jpg", "cls"]);
    c.dataset.dir = Some(d.clone());
    c.dataset.generate = true;
    c.dataset.generate_samples = 100;
    c.dataset.generate_shards = 2;
    let got = epoch(&c, &["jpg", "cls"]);
    assert_eq!(got.len(), 104, "100 samples padded to batches of 8");
    for (_, parts) in &got {
        assert!((512..=1536).contains(&parts[0].len()));
        assert!(
            std::str::from_utf8(&parts[1])
                .unwrap()
                .parse::<u32>()
                .unwrap()
                < 1000
        );
    }
}
