//! The on-disk cache of Megatron-order GPT indices (`dataset.gpt_index_cache`): the first start
//! stores them beside the `.idx`, the next maps them and delivers the same samples (Megatron-Core's,
//! from `fixtures/gpt/`); other settings get their own file; a dataset rewritten in place (same size,
//! same inode) or a damaged cache file is never used — the indices are built again and the samples
//! are those of the data as it is now.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::{Path, PathBuf};

use ubdirect_loader::gpt::cache::{CacheUse, cache_files};
use ubdirect_loader::gpt::{BlendEntry, Order};
use ubdirect_loader::{Loader, RunConfig};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gpt")
        .join(name)
}

/// `NAME.tokens.npy` (int32, C order), flattened.
fn expected(case: &str) -> Vec<i64> {
    let b = std::fs::read(fixture(&format!("{case}.tokens.npy"))).unwrap();
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    b[10 + hlen..]
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)
        .collect()
}

/// A fresh directory holding copies of the fixture datasets `names`.
fn copies(test: &str, names: &[&str]) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(test);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for n in names {
        for ext in ["bin", "idx"] {
            std::fs::copy(fixture(&format!("{n}.{ext}")), d.join(format!("{n}.{ext}"))).unwrap();
        }
    }
    d
}

fn config(prefix: &Path, seq: u32, seed: u64) -> RunConfig {
    let mut c = RunConfig::default();
    c.dataset.format = "megatron".parse().unwrap();
    c.dataset.paths = vec![prefix.to_path_buf()];
    c.dataset.generate = false;
    c.dataset.sequence_length = seq;
    c.device.select = ubdirect_ub::DeviceSelection::Host;
    c.loader.order = Order::Megatron;
    c.loader.seed = seed;
    c.loader.batch_size = 8;
    c.pool.staging_blocks = 16;
    c
}

/// One epoch's u16 tokens, flattened, and what the cache did for each dataset.
fn epoch(cfg: &RunConfig) -> (Vec<i64>, Vec<CacheUse>) {
    let l = Loader::from_config(cfg).unwrap();
    let used = l.gpt().unwrap().parts.iter().map(|p| p.cache).collect();
    let mut out = Vec::new();
    for b in l.epoch(0).unwrap() {
        let b = b.unwrap();
        for i in 0..b.len() {
            let v = b.sample_to_vec(i).unwrap();
            out.extend(
                v.chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as i64),
            );
        }
    }
    (out, used)
}

#[test]
fn stored_then_mapped_and_keyed_by_settings() {
    let d = copies("gpt-cache-hit", &["u16a"]);
    let idx = d.join("u16a.idx");
    let cfg = config(&d.join("u16a"), 32, 1234);
    let want = expected("one_epoch_s1234_n32");
    let (first, used) = epoch(&cfg);
    assert_eq!(used, [CacheUse::Stored]);
    assert_eq!(first[..], want[..first.len()]);
    assert_eq!(first.len(), want.len() / (8 * 33) * 8 * 33);
    assert_eq!(cache_files(&idx).len(), 1);
    let (second, used) = epoch(&cfg);
    assert_eq!(used, [CacheUse::Hit]);
    assert_eq!(second, first, "samples from the mapped cache differ");
    // The indices themselves: mapped equals built.
    let built = ubdirect_loader::Loader::from_config(&{
        let mut c = cfg.clone();
        c.dataset.gpt_index_cache = false;
        c
    })
    .unwrap();
    let mapped = Loader::from_config(&cfg).unwrap();
    let (b, m) = (built.gpt().unwrap(), mapped.gpt().unwrap());
    assert_eq!(b.parts[0].cache, CacheUse::Off);
    assert_eq!(m.parts[0].cache, CacheUse::Hit);
    assert_eq!(
        b.parts[0].indices.document_index.iter().collect::<Vec<_>>(),
        m.parts[0].indices.document_index.iter().collect::<Vec<_>>()
    );
    assert_eq!(
        b.parts[0].indices.sample_index,
        m.parts[0].indices.sample_index
    );
    assert_eq!(
        b.order.as_ref().unwrap().to_vec(),
        m.order.as_ref().unwrap().to_vec()
    );
    // Other settings (seed, length, samples over several epochs) are other keys.
    let mut other = config(&d.join("u16a"), 7, 0);
    assert_eq!(epoch(&other).1, [CacheUse::Stored]);
    other.dataset.num_samples = 5000;
    let (multi, used) = epoch(&other);
    assert_eq!(used, [CacheUse::Stored]);
    assert_eq!(epoch(&other), (multi, vec![CacheUse::Hit]));
    assert_eq!(cache_files(&idx).len(), 3);
    assert_eq!(epoch(&cfg), (first, vec![CacheUse::Hit]));
}

#[test]
fn a_dataset_rewritten_in_place_is_not_served_from_the_old_cache() {
    let d = copies("gpt-cache-rewrite", &["u16a"]);
    let prefix = d.join("u16a");
    let cfg = config(&prefix, 32, 1234);
    assert_eq!(epoch(&cfg).1, [CacheUse::Stored]);
    assert_eq!(epoch(&cfg).1, [CacheUse::Hit]);
    // The same sequences in reverse order, written over the same files (the `.idx`'s lengths and
    // pointers arrays rewritten in its own bytes): same sizes, same inodes.
    let ino = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
    let (i0, b0) = (ino(&d.join("u16a.idx")), ino(&d.join("u16a.bin")));
    let size0 = std::fs::metadata(d.join("u16a.idx")).unwrap().len();
    let mut idx = std::fs::read(d.join("u16a.idx")).unwrap();
    let bin = std::fs::read(d.join("u16a.bin")).unwrap();
    let n = u64::from_le_bytes(idx[18..26].try_into().unwrap()) as usize;
    let at = |i: usize| 34 + 4 * i;
    let pt = |i: usize| 34 + 4 * n + 8 * i;
    let seqs: Vec<(i32, Vec<u8>)> = (0..n)
        .rev()
        .map(|i| {
            let l = i32::from_le_bytes(idx[at(i)..at(i) + 4].try_into().unwrap());
            let p = i64::from_le_bytes(idx[pt(i)..pt(i) + 8].try_into().unwrap()) as usize;
            (l, bin[p..p + 2 * l as usize].to_vec())
        })
        .collect();
    let mut new_bin = Vec::with_capacity(bin.len());
    for (i, (l, bytes)) in seqs.iter().enumerate() {
        idx[at(i)..at(i) + 4].copy_from_slice(&l.to_le_bytes());
        idx[pt(i)..pt(i) + 8].copy_from_slice(&(new_bin.len() as i64).to_le_bytes());
        new_bin.extend_from_slice(bytes);
    }
    assert_eq!(new_bin.len(), bin.len());
    std::fs::write(d.join("u16a.bin"), &new_bin).unwrap();
    std::fs::write(d.join("u16a.idx"), &idx).unwrap();
    assert_eq!(
        (ino(&d.join("u16a.idx")), ino(&d.join("u16a.bin"))),
        (i0, b0)
    );
    assert_eq!(std::fs::metadata(d.join("u16a.idx")).unwrap().len(), size0);
    let (now, used) = epoch(&cfg);
    assert_eq!(used, [CacheUse::Stored], "the old cache was used");
    let mut fresh = cfg.clone();
    fresh.dataset.gpt_index_cache = false;
    let (want, _) = epoch(&fresh);
    assert_eq!(
        now, want,
        "samples differ from a fresh build over the new data"
    );
    assert_ne!(
        now[..want.len()],
        expected("one_epoch_s1234_n32")[..want.len()]
    );
}

#[test]
fn a_damaged_cache_is_rebuilt_and_a_blend_caches_each_dataset() {
    let d = copies("gpt-cache-damaged", &["u16a", "u16b"]);
    let idx = d.join("u16a.idx");
    let cfg = config(&d.join("u16a"), 32, 1234);
    let (good, _) = epoch(&cfg);
    let file = cache_files(&idx).pop().unwrap();
    let bytes = std::fs::read(&file).unwrap();
    let before = ubdirect_ub::fallback::count("gpt_index_cache_invalid");
    // A flipped byte in the body, then a file cut short: each is refused, rebuilt and rewritten.
    for damaged in [
        {
            let mut b = bytes.clone();
            let at = b.len() - 3;
            b[at] ^= 0x40;
            b
        },
        bytes[..bytes.len() - 8].to_vec(),
        bytes[..20].to_vec(),
    ] {
        std::fs::write(&file, &damaged).unwrap();
        assert_eq!(epoch(&cfg), (good.clone(), vec![CacheUse::Stored]));
        assert_eq!(std::fs::read(&file).unwrap(), bytes, "rewritten as before");
    }
    assert_eq!(
        ubdirect_ub::fallback::count("gpt_index_cache_invalid"),
        before + 3
    );
    // A Megatron blend: each dataset's indices cached on their own, samples still Megatron-Core's.
    let mut blend = config(&d.join("u16a"), 24, 99);
    blend.dataset.paths = Vec::new();
    blend.dataset.num_samples = 400;
    blend.dataset.blend = vec![
        BlendEntry {
            paths: vec![d.join("u16a")],
            weight: 0.3,
        },
        BlendEntry {
            paths: vec![d.join("u16b")],
            weight: 0.7,
        },
    ];
    blend.loader.batch_size = 10;
    let want = expected("blend_s99_n24");
    assert_eq!(epoch(&blend), (want.clone(), vec![CacheUse::Stored; 2]));
    assert_eq!(epoch(&blend), (want, vec![CacheUse::Hit; 2]));
}

/// Recomputes the CRC of a cache file (`key_len` bytes of key), as anyone who can write the
/// dataset's directory can: the CRC proves a file whole, not right.
fn reseal(b: &mut [u8]) {
    let klen = u64::from_le_bytes(b[8..16].try_into().unwrap()) as usize;
    let h = 16 + klen.div_ceil(8) * 8;
    let mut c = crc32fast::Hasher::new();
    c.update(&b[h..h + 32]);
    c.update(&b[h + 40..]);
    let crc = c.finalize().to_le_bytes();
    b[h + 32..h + 36].copy_from_slice(&crc);
}

/// Issue 23: a cache file with a valid CRC and decreasing sample offsets was mapped and made a GPT
/// sample with no pieces: the chunk builder panicked (index out of bounds, `chunk.rs:124`). Before
/// this fix the forged file was a cache `Hit` and the epoch ended in "chunk task: … panicked"; now it
/// is refused (a recorded fallback), rebuilt, and the epoch is Megatron's.
#[test]
fn a_forged_cache_with_a_valid_crc_is_rebuilt_not_trusted() {
    let d = copies("gpt-cache-forged", &["u16a"]);
    let idx = d.join("u16a.idx");
    let cfg = config(&d.join("u16a"), 32, 1234);
    let (first, used) = epoch(&cfg);
    assert_eq!(used, [CacheUse::Stored]);
    let files = cache_files(&idx);
    assert_eq!(files.len(), 1);
    let good = std::fs::read(&files[0]).unwrap();
    let klen = u64::from_le_bytes(good[8..16].try_into().unwrap()) as usize;
    let h = 16 + klen.div_ceil(8) * 8;
    let docs = u64::from_le_bytes(good[h + 8..h + 16].try_into().unwrap()) as usize;
    let sample_at = h + 40 + (docs * 4).div_ceil(8) * 8;
    for (what, from, to) in [
        ("sample 3 starts where sample 2 does", 2, 3),
        ("sample 3 starts where sample 4 does (decreasing)", 4, 3),
    ] {
        let mut b = good.clone();
        let e = b[sample_at + 8 * from..sample_at + 8 * from + 8].to_vec();
        b[sample_at + 8 * to..sample_at + 8 * to + 8].copy_from_slice(&e);
        reseal(&mut b);
        std::fs::write(&files[0], &b).unwrap();
        let (again, used) = epoch(&cfg);
        assert_eq!(used, [CacheUse::Stored], "{what}: the forged file was used");
        assert_eq!(again, first, "{what}");
    }
}

/// Issue 23: a `.idx` whose sequence lengths are zeroed in place during a GPT run (the lengths are
/// read in place from the mapping) made samples with no pieces and the same panic, in 6 of 6 runs.
/// Now the next epoch's plan refuses the windows that are no longer whole: a typed error naming
/// the sample.
#[test]
fn sequence_lengths_zeroed_in_place_during_a_run_are_a_typed_error() {
    use std::os::unix::fs::FileExt;
    use ubdirect_loader::LoadError;
    use ubdirect_loader::planner::PlanError;
    let d = copies("gpt-idx-zeroed", &["u16a"]);
    let mut cfg = config(&d.join("u16a"), 32, 1234);
    cfg.dataset.gpt_index_cache = false;
    let l = Loader::from_config(&cfg).unwrap();
    let mut n = 0;
    for b in l.epoch(0).unwrap() {
        b.unwrap();
        n += 1;
    }
    assert!(n > 0);
    let idx = d.join("u16a.idx");
    let head = std::fs::read(&idx).unwrap();
    let seqs = u64::from_le_bytes(head[18..26].try_into().unwrap()) as usize;
    let f = std::fs::OpenOptions::new().write(true).open(&idx).unwrap();
    f.write_all_at(&vec![0u8; 4 * seqs], 34).unwrap();
    drop(f);
    let err = (1..3)
        .find_map(|e| match l.epoch(e) {
            Err(e) => Some(e),
            Ok(it) => it.into_iter().find_map(|b| b.err()),
        })
        .expect("epochs over zeroed sequence lengths delivered every batch");
    assert!(
        matches!(err, LoadError::Plan(PlanError::GptSample { bytes: 0, .. })),
        "{err:?}"
    );
}

/// Reverses the sequences of Megatron dataset `name` in `d` in place — same sizes, same inodes, the
/// modification times put back — so only the `.idx`'s lengths (their CRC-32) tell it changed.
fn reverse_in_place_keeping_times(d: &Path, name: &str) {
    let (idx_path, bin_path) = (d.join(format!("{name}.idx")), d.join(format!("{name}.bin")));
    let times = |p: &Path| std::fs::metadata(p).unwrap().modified().unwrap();
    let (ti, tb) = (times(&idx_path), times(&bin_path));
    let mut idx = std::fs::read(&idx_path).unwrap();
    let bin = std::fs::read(&bin_path).unwrap();
    let n = u64::from_le_bytes(idx[18..26].try_into().unwrap()) as usize;
    let at = |i: usize| 34 + 4 * i;
    let pt = |i: usize| 34 + 4 * n + 8 * i;
    let seqs: Vec<(i32, Vec<u8>)> = (0..n)
        .rev()
        .map(|i| {
            let l = i32::from_le_bytes(idx[at(i)..at(i) + 4].try_into().unwrap());
            let p = i64::from_le_bytes(idx[pt(i)..pt(i) + 8].try_into().unwrap()) as usize;
            (l, bin[p..p + 2 * l as usize].to_vec())
        })
        .collect();
    let mut new_bin = Vec::with_capacity(bin.len());
    for (i, (l, bytes)) in seqs.iter().enumerate() {
        idx[at(i)..at(i) + 4].copy_from_slice(&l.to_le_bytes());
        idx[pt(i)..pt(i) + 8].copy_from_slice(&(new_bin.len() as i64).to_le_bytes());
        new_bin.extend_from_slice(bytes);
    }
    assert_ne!(idx, std::fs::read(&idx_path).unwrap(), "a palindrome");
    std::fs::write(&bin_path, &new_bin).unwrap();
    std::fs::write(&idx_path, &idx).unwrap();
    for (p, t) in [(&idx_path, ti), (&bin_path, tb)] {
        let f = std::fs::File::options().write(true).open(p).unwrap();
        f.set_modified(t).unwrap();
    }
    assert_eq!(times(&idx_path), ti);
}

/// A `dataset.dir` of several Megatron shards (read as one dataset): the indices are stored once,
/// beside the first shard's `.idx`, then mapped at the next start; other settings are another file;
/// a change to any shard — also one that keeps its size, inode and modification time — is a new key,
/// so the indices are rebuilt over the data as it is now.
#[test]
fn a_dir_of_several_shards_is_stored_then_mapped_and_rebuilt_when_a_shard_changes() {
    let d = copies("gpt-cache-dir", &["u16a", "u16b"]);
    let mut cfg = config(&d.join("u16a"), 32, 1234);
    cfg.dataset.paths = Vec::new();
    cfg.dataset.dir = Some(d.clone());
    let uncached = |c: &RunConfig| {
        let mut c = c.clone();
        c.dataset.gpt_index_cache = false;
        let (v, used) = epoch(&c);
        assert_eq!(used, [CacheUse::Off]);
        v
    };
    let want = uncached(&cfg);
    assert!(!want.is_empty());
    assert_eq!(
        Loader::from_config(&cfg)
            .map(|l| l.index().shards.len())
            .unwrap(),
        2,
        "one dataset of two shards"
    );
    // That was the first start: stored. Now mapped, the same samples.
    let (a, b) = (d.join("u16a.idx"), d.join("u16b.idx"));
    assert_eq!(cache_files(&a).len(), 1);
    assert!(cache_files(&b).is_empty(), "beside the first shard only");
    assert_eq!(epoch(&cfg), (want.clone(), vec![CacheUse::Hit]));
    // Keyed by the settings: another seed, then more samples than an epoch.
    let mut other = cfg.clone();
    other.loader.seed = 7;
    let (o, used) = epoch(&other);
    assert_eq!(used, [CacheUse::Stored]);
    assert_ne!(o, want);
    assert_eq!(epoch(&other), (o, vec![CacheUse::Hit]));
    other.dataset.num_samples = 3000;
    assert_eq!(epoch(&other).1, [CacheUse::Stored]);
    assert_eq!(epoch(&other).1, [CacheUse::Hit]);
    assert_eq!(cache_files(&a).len(), 3);
    assert_eq!(epoch(&cfg).1, [CacheUse::Hit]);
    // The second shard changes (its lengths only: same size, inode and times): rebuilt, and the
    // samples are those of a fresh build over the new data.
    reverse_in_place_keeping_times(&d, "u16b");
    let now = uncached(&cfg);
    assert_ne!(now, want);
    assert_eq!(epoch(&cfg), (now.clone(), vec![CacheUse::Stored]));
    assert_eq!(epoch(&cfg), (now, vec![CacheUse::Hit]));
    // A shard replaced (a new file): rebuilt too.
    std::fs::remove_file(d.join("u16b.bin")).unwrap();
    std::fs::copy(fixture("u16b.bin"), d.join("u16b.bin")).unwrap();
    std::fs::remove_file(&b).unwrap();
    std::fs::copy(fixture("u16b.idx"), &b).unwrap();
    assert_eq!(epoch(&cfg), (want, vec![CacheUse::Stored]));
}

/// Where the cache cannot be kept (token sizes not from local Megatron `.idx` files), the indices are
/// built at every start and that is a recorded fallback naming the key — not silence.
#[test]
fn a_dataset_the_cache_cannot_key_is_a_recorded_fallback() {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gpt-cache-raw");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let tokens: Vec<u8> = (0..40_000u32)
        .flat_map(|i| ((i * 7) as u16).to_le_bytes())
        .collect();
    std::fs::write(d.join("tokens.bin"), &tokens).unwrap();
    let mut cfg = config(&d.join("tokens.bin"), 32, 1);
    cfg.dataset.format = "raw".parse().unwrap();
    cfg.dataset.record_len = 100;
    let before = ubdirect_ub::fallback::count("gpt_index_cache_unavailable");
    let (_, used) = epoch(&cfg);
    assert_eq!(used, [CacheUse::Off]);
    assert!(ubdirect_ub::fallback::count("gpt_index_cache_unavailable") > before);
    let detail = ubdirect_ub::fallback::snapshot()
        .into_iter()
        .find(|f| f.kind == "gpt_index_cache_unavailable")
        .unwrap()
        .first_detail;
    assert!(detail.contains("dataset.gpt_index_cache"), "{detail}");
    // Turned off, nothing is recorded.
    cfg.dataset.gpt_index_cache = false;
    let before = ubdirect_ub::fallback::count("gpt_index_cache_unavailable");
    epoch(&cfg);
    assert_eq!(
        ubdirect_ub::fallback::count("gpt_index_cache_unavailable"),
        before
    );
}
