//! An on-disk cache of Megatron-order GPT indices (`dataset.gpt_index_cache`), as Megatron keeps its
//! `.npy` index files: built once, then mapped (not read, not rebuilt) at the next start.
//!
//! A cache file lives beside the local `.idx` it was built from, named
//! `PREFIX.idx.ubdirect-gpt-<key hash>`. Its key — stored whole in the file and compared byte for
//! byte — is the `.idx`'s identity (device, inode, size, modification time, read from the very
//! descriptor that was mapped), a CRC-32 of its `sequence_lengths` (what the indices are built
//! from), and every setting that shapes the indices (seed, sequence length, extra token, samples,
//! split and part). A dataset of several shards (a `dataset.dir` of `.bin`/`.idx` pairs, read as
//! one dataset) has one cache file, beside its *first* shard's `.idx`, keyed by every shard's
//! identity and lengths' CRC-32 in order ([`build_cached_files`]). A dataset rewritten in place or
//! replaced by a rename — any of its shards — gets a new key, so its old cache is never used. A cache file that does not check out (its CRC-32, its array sizes
//! against its length, every document id below the dataset's sequences, every shuffled sample below
//! the samples) is a recorded fallback and is rebuilt; a directory that cannot be written is a
//! recorded fallback too (the indices are then built at every start).
//!
//! ```text
//! "UBDGPT01"  u64 key_len  key[key_len] (padded to 8)
//! u32 epochs  u32 shuffle_width (4 | 8)  u64 documents  u64 sample_entries  u64 shuffled
//! u32 crc32(the five fields above, body)  u32 0
//! body: u32 document_index[documents] (padded to 8)  u32 sample_index[sample_entries][2]
//!       shuffle_index[shuffled] (u32 or u64)
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::megatron::{
    self, DocumentIndex, GptIndices, MappedInts, MegatronGptConfig, SampleIndex, ShuffleIndex,
};
use super::{GptError, TokenSizes};
use crate::formats::megatron::MegatronIdx;
use crate::formats::sys::ReadOnlyMap;

const MAGIC: &[u8; 8] = b"UBDGPT01";
/// Bytes of the fixed header after the key.
const FIXED: usize = 40;

/// What the cache did for one dataset's indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheUse {
    /// Not used: turned off, block order, or token sizes not from a local mapped `.idx`.
    #[default]
    Off,
    /// Mapped from a cache file written by an earlier start.
    Hit,
    /// Built, and written for the next start.
    Stored,
    /// Built; no cache file could be written (a recorded fallback).
    Unwritten,
}

/// The cache key of the indices `cfg` makes over the sequences of `files` (in order), or `None`
/// when one of them is not a mapped local file. One file's key is that file's alone; several
/// files' keys start with their count.
fn key(files: &[Arc<MegatronIdx>], cfg: &MegatronGptConfig) -> Option<Vec<u8>> {
    let mut k = Vec::with_capacity(16 + 52 * files.len() + 28 + cfg.split.len());
    if files.len() > 1 {
        k.extend_from_slice(b"SHARDS\0\0");
        k.extend_from_slice(&(files.len() as u64).to_le_bytes());
    }
    for m in files {
        for v in m.identity()? {
            k.extend_from_slice(&v.to_le_bytes());
        }
        k.extend_from_slice(&(m.sequences() as u64).to_le_bytes());
        k.extend_from_slice(&crc32fast::hash(m.length_bytes()).to_le_bytes());
    }
    k.extend_from_slice(&cfg.seed.to_le_bytes());
    k.extend_from_slice(&cfg.sequence_length.to_le_bytes());
    k.extend_from_slice(&[
        cfg.add_extra_token as u8,
        cfg.part as u8,
        cfg.num_samples.is_some() as u8,
    ]);
    k.extend_from_slice(&cfg.num_samples.unwrap_or(0).to_le_bytes());
    k.extend_from_slice(cfg.split.as_bytes());
    Some(k)
}

/// `IDX.ubdirect-gpt-<hash of key>`.
pub fn cache_path(idx: &Path, key: &[u8]) -> PathBuf {
    let mut h = crate::planner::Fnv::new();
    h.write(key);
    let mut s = idx.as_os_str().to_owned();
    s.push(format!(".ubdirect-gpt-{:016x}", h.finish()));
    PathBuf::from(s)
}

/// The cache files of `idx` (any settings), for tests and clean-up.
pub fn cache_files(idx: &Path) -> Vec<PathBuf> {
    let (Some(dir), Some(name)) = (idx.parent(), idx.file_name()) else {
        return Vec::new();
    };
    let mut prefix = name.to_owned();
    prefix.push(".ubdirect-gpt-");
    let prefix = prefix.to_string_lossy().into_owned();
    let mut v: Vec<PathBuf> = std::fs::read_dir(if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    })
    .map(|rd| {
        rd.filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .map(|e| e.path())
            .collect()
    })
    .unwrap_or_default();
    v.sort();
    v
}

/// Megatron-Core's indices over `sizes` for `cfg`: mapped from the cache when a valid one exists,
/// else built (and stored when `enabled`).
pub fn build_cached(
    sizes: &TokenSizes,
    cfg: &MegatronGptConfig,
    enabled: bool,
) -> Result<(GptIndices, CacheUse), GptError> {
    let files = match sizes {
        TokenSizes::Mapped(m) => std::slice::from_ref(m),
        TokenSizes::Owned(_) => &[],
    };
    build_cached_files(sizes, files, cfg, enabled)
}

/// [`build_cached`] for a dataset whose `sizes` are the sequences of the local Megatron shards
/// `files`, in order (a `dataset.dir` of several shards): one cache file beside the first `.idx`,
/// keyed by all of them. `files` empty (or one not mapped): not cached ([`CacheUse::Off`]).
pub fn build_cached_files(
    sizes: &TokenSizes,
    files: &[Arc<MegatronIdx>],
    cfg: &MegatronGptConfig,
    enabled: bool,
) -> Result<(GptIndices, CacheUse), GptError> {
    let found = match files.first() {
        Some(m) if enabled => key(files, cfg).map(|k| (m, k)),
        _ => None,
    };
    let Some((m, key)) = found else {
        return Ok((megatron::build(sizes, cfg)?, CacheUse::Off));
    };
    let path = cache_path(m.path(), &key);
    match load(&path, &key, megatron::Sizes::count(sizes)) {
        Ok(Some(ix)) => return Ok((ix, CacheUse::Hit)),
        Ok(None) => {}
        Err(why) => ubdirect_ub::fallback::record(
            "gpt_index_cache_invalid",
            format!("{}: {why}; rebuilding it", path.display()),
        ),
    }
    let ix = megatron::build(sizes, cfg)?;
    match store(&path, &key, &ix) {
        Ok(()) => Ok((ix, CacheUse::Stored)),
        Err(e) => {
            ubdirect_ub::fallback::record(
                "gpt_index_cache_unwritable",
                format!(
                    "{}: {e}; the GPT indices are built at every start",
                    path.display()
                ),
            );
            Ok((ix, CacheUse::Unwritten))
        }
    }
}

fn pad8(n: usize) -> Option<usize> {
    n.checked_add(7).map(|x| x / 8 * 8)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8).map_or(0, |s| {
        u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]])
    })
}

/// The cached indices at `path` if the file exists (`Ok(None)`: it does not); `Err` says why a file
/// that exists is not used.
fn load(path: &Path, key: &[u8], sequences: usize) -> Result<Option<GptIndices>, String> {
    let (f, size) = match crate::formats::open_regular(path) {
        Ok(x) => x,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let map = Arc::new(ReadOnlyMap::map(&f, size).map_err(|e| e.to_string())?);
    let b = map.bytes();
    let bad = |why: &str| Err(format!("{why} ({size} bytes)"));
    if b.len() < 16 || &b[..8] != MAGIC {
        return bad("not a ubdirect GPT index cache");
    }
    let klen = usize::try_from(u64_at(b, 8)).unwrap_or(usize::MAX);
    let h = match pad8(klen).and_then(|k| k.checked_add(16)) {
        Some(h) if h.saturating_add(FIXED) <= b.len() => h,
        _ => return bad("truncated header"),
    };
    if b.get(16..16 + klen) != Some(key) {
        return bad("made for another dataset or other settings");
    }
    let epochs = u32_at(b, h);
    let width = u32_at(b, h + 4) as usize;
    let count = |at: usize| usize::try_from(u64_at(b, at)).unwrap_or(usize::MAX);
    let (docs, entries, shuffled) = (count(h + 8), count(h + 16), count(h + 24));
    let crc = u32_at(b, h + 32);
    let body = h + FIXED;
    let sample_at = docs
        .checked_mul(4)
        .and_then(pad8)
        .and_then(|d| d.checked_add(body));
    let shuffle_at = sample_at.and_then(|s| entries.checked_mul(8)?.checked_add(s));
    let end = shuffle_at.and_then(|s| shuffled.checked_mul(width)?.checked_add(s));
    let (Some(sample_at), Some(shuffle_at), Some(end)) = (sample_at, shuffle_at, end) else {
        return bad("array sizes overflow");
    };
    if !matches!(width, 4 | 8) || end != b.len() || entries == 0 {
        return bad("array sizes do not match the file");
    }
    let mut c = crc32fast::Hasher::new();
    c.update(&b[h..h + 32]);
    c.update(&b[body..]);
    if c.finalize() != crc {
        return bad("its CRC-32 does not match (a damaged file)");
    }
    let samples = entries - 1;
    if shuffled != samples {
        return bad("the shuffle index does not cover the samples");
    }
    // The values are ids the loader indexes with: checked once, so a damaged file is refused here.
    if b[body..body + 4 * docs]
        .chunks_exact(4)
        .any(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize >= sequences)
    {
        return bad("a document id past the dataset's sequences");
    }
    let past = |v: u64| v >= samples as u64;
    let shuffle_past = if width == 4 {
        b[shuffle_at..end]
            .chunks_exact(4)
            .any(|c| past(u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u64))
    } else {
        b[shuffle_at..end].chunks_exact(8).any(|c| {
            past(u64::from_le_bytes([
                c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7],
            ]))
        })
    };
    if shuffle_past {
        return bad("a shuffled sample id past the samples");
    }
    let ints = |at, len, w| {
        MappedInts::new(map.clone(), at, len, w).ok_or_else(|| "array out of the file".to_string())
    };
    Ok(Some(GptIndices {
        document_index: DocumentIndex::Mapped(ints(body, docs, 4)?),
        sample_index: SampleIndex::Mapped(ints(sample_at, entries * 2, 4)?),
        shuffle_index: Some(ShuffleIndex::Mapped(ints(shuffle_at, shuffled, width)?)),
        epochs,
    }))
}

/// Feeds the body's bytes to `out` in pieces.
fn body(ix: &GptIndices, out: &mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()> {
    const CHUNK: usize = 1 << 16;
    let mut buf = Vec::with_capacity(CHUNK + 8);
    let flush = |buf: &mut Vec<u8>, out: &mut dyn FnMut(&[u8]) -> std::io::Result<()>| {
        let r = out(buf);
        buf.clear();
        r
    };
    let mut docs = 0usize;
    for d in ix.document_index.iter() {
        buf.extend_from_slice(&d.to_le_bytes());
        docs += 1;
        if buf.len() >= CHUNK {
            flush(&mut buf, out)?;
        }
    }
    if docs % 2 == 1 {
        buf.extend_from_slice(&[0; 4]);
    }
    for (a, o) in ix.sample_index.iter() {
        buf.extend_from_slice(&a.to_le_bytes());
        buf.extend_from_slice(&o.to_le_bytes());
        if buf.len() >= CHUNK {
            flush(&mut buf, out)?;
        }
    }
    match &ix.shuffle_index {
        Some(ShuffleIndex::U32(v)) => {
            for x in v {
                buf.extend_from_slice(&x.to_le_bytes());
                if buf.len() >= CHUNK {
                    flush(&mut buf, out)?;
                }
            }
        }
        Some(s) => {
            for x in s.iter() {
                buf.extend_from_slice(&x.to_le_bytes());
                if buf.len() >= CHUNK {
                    flush(&mut buf, out)?;
                }
            }
        }
        None => {}
    }
    flush(&mut buf, out)
}

/// Writes `ix` to `path` under `key`: whole under a temporary name, then renamed, so a reader never
/// sees part of one.
fn store(path: &Path, key: &[u8], ix: &GptIndices) -> std::io::Result<()> {
    let width: u32 = match &ix.shuffle_index {
        Some(ShuffleIndex::U32(_)) => 4,
        Some(ShuffleIndex::U64(_)) => 8,
        _ => {
            return Err(std::io::Error::other(
                "only freshly built indices with a shuffle index are stored",
            ));
        }
    };
    let mut head = Vec::with_capacity(16 + key.len() + 8 + FIXED);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&(key.len() as u64).to_le_bytes());
    head.extend_from_slice(key);
    head.resize(pad8(head.len()).unwrap_or(head.len()), 0);
    let fixed = head.len();
    head.extend_from_slice(&ix.epochs.to_le_bytes());
    head.extend_from_slice(&width.to_le_bytes());
    let shuffled = ix.shuffle_index.as_ref().map_or(0, |s| s.len());
    for n in [ix.document_index.len(), ix.sample_index.len(), shuffled] {
        head.extend_from_slice(&(n as u64).to_le_bytes());
    }
    // The CRC covers the counts and the body.
    let mut crc = crc32fast::Hasher::new();
    crc.update(&head[fixed..]);
    body(ix, &mut |b| {
        crc.update(b);
        Ok(())
    })?;
    head.extend_from_slice(&crc.finalize().to_le_bytes());
    head.extend_from_slice(&[0; 4]);
    let mut tmp = path.as_os_str().to_owned();
    // Unique per process and call: two loaders building the same indices write two files.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tmp.push(format!(".tmp{}-{call}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let written = (|| {
        let mut f = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&tmp)?);
        f.write_all(&head)?;
        body(ix, &mut |b| f.write_all(b))?;
        // Not synced: a file cut short by a crash fails its size or CRC check and is rebuilt.
        f.flush()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpt::SplitPart;

    fn built() -> GptIndices {
        let sizes: Vec<i32> = (0..60).map(|i| 5 + (i * 7919) % 61).collect();
        let cfg = MegatronGptConfig {
            seed: 3,
            sequence_length: 16,
            add_extra_token: true,
            num_samples: Some(300),
            split: "90,10".into(),
            part: SplitPart::Train,
        };
        megatron::build(&sizes[..], &cfg).unwrap_or_else(|e| panic!("{e}"))
    }

    fn same(a: &GptIndices, b: &GptIndices) -> bool {
        a.document_index.iter().eq(b.document_index.iter())
            && a.sample_index == b.sample_index
            && a.epochs == b.epochs
            && a.shuffle_index.as_ref().map(|s| s.to_vec())
                == b.shuffle_index.as_ref().map(|s| s.to_vec())
    }

    /// Every single-byte change of a cache file is refused or (padding only) loads the same
    /// indices — never a panic, never other indices.
    #[test]
    fn every_flipped_byte_is_refused_or_harmless() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("c");
        let ix = built();
        let key = b"a key of 13 b".to_vec();
        store(&path, &key, &ix).unwrap_or_else(|e| panic!("{e}"));
        let good = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
        let loaded = load(&path, &key, 60).unwrap_or_else(|e| panic!("{e}"));
        assert!(loaded.as_ref().is_some_and(|l| same(l, &ix)));
        assert!(load(&path, b"another key", 60).is_err());
        assert!(
            load(&path, &key, 10).is_err(),
            "document ids past the sequences"
        );
        let (mut refused, mut harmless) = (0, 0);
        for at in 0..good.len() {
            let mut b = good.clone();
            b[at] ^= 0x01;
            std::fs::write(&path, &b).unwrap_or_else(|e| panic!("{e}"));
            match load(&path, &key, 60) {
                Err(_) => refused += 1,
                Ok(Some(l)) if same(&l, &ix) => harmless += 1,
                Ok(other) => panic!("byte {at}: loaded {other:?}"),
            }
        }
        // The key's padding (3 bytes) and the word after the CRC (4 bytes) are not checked.
        assert_eq!(harmless, 7);
        assert_eq!(refused, good.len() - 7);
        for n in [0, 8, 15, 16, good.len() / 2, good.len() - 1] {
            std::fs::write(&path, &good[..n]).unwrap_or_else(|e| panic!("{e}"));
            assert!(load(&path, &key, 60).is_err(), "cut at {n}");
        }
        std::fs::remove_file(&path).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(load(&path, &key, 60), Ok(None)));
    }
}
