//! The samples cache: the index of a dataset whose samples vary in size (Arrow, WebDataset), kept
//! beside its first shard and mapped at the next start, so a start neither parses every shard nor
//! holds 16 bytes a sample in memory (the table is read where it lies, [`Samples::table`]).
//!
//! A cache file is named `FIRST_SHARD.ubdirect-samples-<key hash>`. Its key — stored whole and
//! compared byte for byte — is the format, the column, and every shard's path and identity (size,
//! device, inode, mtime and ctime, from `stat`): a shard added, removed, replaced or rewritten in
//! place gives another key, so an old file is never used for new data. A cache file is untrusted
//! input (anyone who can write the directory can write one, with a valid CRC): it is sealed under
//! this user's key ([`super::seal`]) and used only when the seal verifies — a pass over the file on
//! every core, read with `pread` (so it leaves nothing resident). Without a key (none can be made)
//! the file is unsealed and checked whole instead — its CRC-32, every entry inside its shard and a
//! shard's entries in file order. One that fails is a recorded fallback (`samples_cache_invalid`)
//! and is built again. It is written through [`ubdirect_ub::NewFile`] (never through a planted link, never into
//! a FIFO); a directory that cannot be written is a recorded fallback (`samples_cache_unwritable`).
//!
//! ```text
//! "UBDSMP01"  u64 key_len  key[key_len] (padded to 8)
//! u64 shards  u64 samples  u32 crc32(the two counts, body)  u32 0
//! body: u64 starts[shards + 1] (each shard's first sample)
//!       entries[samples]: u64 offset  u32 length  u32 0
//! seal[32] (formats::seal: a keyed BLAKE3 of every byte before it; zeros when unsealed)
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::index::{DatasetIndex, SampleTable, Samples, body, digest};
use super::mapped::{CacheBytes, par_ranges};
use super::seal;
use super::{Format, FormatError, io_err};

pub(crate) const MAGIC: &[u8; 8] = b"UBDSMP01";
/// Bytes of the fixed header after the key.
const FIXED: usize = 24;
/// Bytes of one entry.
const ENTRY: usize = 16;

/// The key of `paths` (each with its `stat`) read as `format` with `column`, and the size of each.
pub fn key(
    format: Format,
    column: &str,
    paths: &[PathBuf],
) -> Result<(Vec<u8>, Vec<u64>), FormatError> {
    let mut k = Vec::with_capacity(64 + paths.len() * 96);
    for part in [format.name().as_bytes(), column.as_bytes()] {
        k.extend_from_slice(&(part.len() as u64).to_le_bytes());
        k.extend_from_slice(part);
    }
    let mut sizes = Vec::with_capacity(paths.len());
    for p in paths {
        let m = std::fs::metadata(p).map_err(io_err(p))?;
        let b = p.as_os_str().as_encoded_bytes();
        k.extend_from_slice(&(b.len() as u64).to_le_bytes());
        k.extend_from_slice(b);
        for v in super::file_identity(&m) {
            k.extend_from_slice(&v.to_le_bytes());
        }
        sizes.push(m.len());
    }
    Ok((k, sizes))
}

/// The cache file of a dataset whose first shard is `first`, under `key`.
pub fn cache_path(first: &Path, key: &[u8]) -> PathBuf {
    let mut h = crate::hash::Fnv::new();
    h.write(key);
    let mut s = first.as_os_str().to_owned();
    s.push(format!(".ubdirect-samples-{:016x}", h.finish()));
    PathBuf::from(s)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8).map_or(0, |s| {
        u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]])
    })
}

/// The samples in the cache file at `path` for `key` over shards of `sizes` (`Ok(None)`: there is
/// none); `Err` says why a file that exists is not used.
pub fn load(
    path: &Path,
    key: &[u8],
    sizes: &[u64],
    sealed: Option<&[u8; 32]>,
) -> Result<Option<Samples>, String> {
    let (f, size) = match super::open_regular(path) {
        Ok(x) => x,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("opening it: {e}")),
    };
    let bytes = CacheBytes::map(f, size).map_err(|e| format!("mapping it: {e}"))?;
    read(Arc::new(bytes), key, sizes, sealed).map(Some)
}

/// The samples in cache file bytes `bytes`, unsealed (tests, fuzzing: the structural checks a
/// mapped file gets without a sealing key).
pub fn parse(bytes: &[u8], key: &[u8], sizes: &[u64]) -> Result<Samples, String> {
    read(
        Arc::new(CacheBytes::Owned(bytes.to_vec())),
        key,
        sizes,
        None,
    )
}

/// The samples in `b` under `key`: with a sealing key, a file whose seal verifies is used as
/// written and one whose seal does not is refused; without one, the CRC and the entry checks decide.
fn read(
    b: Arc<CacheBytes>,
    key: &[u8],
    sizes: &[u64],
    sealed: Option<&[u8; 32]>,
) -> Result<Samples, String> {
    let len = b.len();
    let mut head = [0u8; 16];
    if !b.read(0, &mut head) || &head[..8] != MAGIC {
        return Err("not a ubdirect samples cache".into());
    }
    if u64_at(&head, 8) != key.len() as u64 {
        return Err("made for other shards or settings".into());
    }
    let h = 16 + key.len().div_ceil(8) * 8;
    let mut hb = vec![0u8; h + FIXED];
    if !b.read(0, &mut hb) {
        return Err(format!("truncated header ({len} bytes)"));
    }
    if hb[16..16 + key.len()] != *key {
        return Err("made for other shards or settings".into());
    }
    let (shards, samples) = (u64_at(&hb, h), u64_at(&hb, h + 8));
    let crc = u32::from_le_bytes([hb[h + 16], hb[h + 17], hb[h + 18], hb[h + 19]]);
    if shards != sizes.len() as u64 {
        return Err(format!("{shards} shards, the dataset has {}", sizes.len()));
    }
    let body = h + FIXED;
    let entries_at = (shards as usize + 1)
        .checked_mul(8)
        .and_then(|s| s.checked_add(body));
    let end = usize::try_from(samples)
        .ok()
        .and_then(|n| n.checked_mul(ENTRY))
        .zip(entries_at)
        .and_then(|(e, a)| e.checked_add(a));
    let (Some(entries_at), Some(end)) = (entries_at, end) else {
        return Err("array sizes overflow".into());
    };
    if end + seal::SEAL != len {
        return Err(format!("array sizes do not match the file ({len} bytes)"));
    }
    if let Some(k) = sealed {
        if !seal::verify(k, &b) {
            return Err(
                "its seal does not verify under this user's key (written elsewhere, or changed)"
                    .into(),
            );
        }
    } else {
        let mut c = crc32fast::Hasher::new();
        c.update(&hb[h..h + 16]);
        c.combine(&super::mapped::crc32_of(&b, body..end).ok_or("cut short while read")?);
        if c.finalize() != crc {
            return Err(format!(
                "its CRC-32 does not match (a damaged file of {len} bytes)"
            ));
        }
    }
    let mut sb = vec![0u8; entries_at - body];
    if !b.read(body, &mut sb) {
        return Err("cut short while read".into());
    }
    let starts: Vec<u64> = sb.chunks_exact(8).map(|c| u64_at(c, 0)).collect();
    if starts.first() != Some(&0)
        || starts.last() != Some(&samples)
        || starts.windows(2).any(|w| w[0] > w[1])
    {
        return Err("shard starts not in order from 0 to the samples".into());
    }
    if sealed.is_none() {
        check_entries(&b, entries_at, &starts, sizes)?;
    }
    Ok(Samples::table(SampleTable {
        bytes: b,
        at: entries_at,
        starts,
        sizes: sizes.to_vec(),
        crc,
    }))
}

/// Every entry inside its shard, a shard's entries in file order (offsets not decreasing): one
/// pass, on every core, in bulk reads.
fn check_entries(b: &CacheBytes, at: usize, starts: &[u64], sizes: &[u64]) -> Result<(), String> {
    const PIECE: usize = 1 << 14;
    let n = starts.last().copied().unwrap_or(0) as usize;
    let entry = |buf: &[u8], k: usize| (u64_at(buf, k * ENTRY), u64_at(buf, k * ENTRY + 8) as u32);
    par_ranges(n, |r| {
        let mut buf = vec![0u8; PIECE * ENTRY];
        let mut s = starts
            .partition_point(|&x| x <= r.start as u64)
            .saturating_sub(1);
        // The entry before the range, when it is in the same shard: the order check's start.
        let mut prev: Option<u64> = None;
        if r.start > 0 && starts[s] < r.start as u64 {
            let mut one = [0u8; ENTRY];
            if !b.read(at + (r.start - 1) * ENTRY, &mut one) {
                return Err("cut short while read".to_string());
            }
            prev = Some(entry(&one, 0).0);
        }
        let mut i = r.start;
        while i < r.end {
            let m = PIECE.min(r.end - i);
            if !b.read(at + i * ENTRY, &mut buf[..m * ENTRY]) {
                return Err("cut short while read".to_string());
            }
            for k in 0..m {
                let id = (i + k) as u64;
                while starts[s + 1] <= id {
                    s += 1;
                    prev = None;
                }
                let (offset, len) = entry(&buf, k);
                if offset.checked_add(len as u64).is_none_or(|e| e > sizes[s]) {
                    return Err(format!(
                        "sample {id} at {offset}+{len} past the end of shard {s} ({} bytes)",
                        sizes[s]
                    ));
                }
                if prev.is_some_and(|p| p > offset) {
                    return Err(format!("sample {id} out of file order"));
                }
                prev = Some(offset);
            }
            i += m;
        }
        Ok(())
    })?;
    Ok(())
}

/// Writes the cache file of `idx` (already validated: samples in shard order) under `key`.
pub fn store(
    path: &Path,
    key: &[u8],
    idx: &DatasetIndex,
    sealed: Option<[u8; 32]>,
) -> std::io::Result<()> {
    let (crc, starts) = digest(idx.shards.len(), &idx.samples)
        .ok_or_else(|| std::io::Error::other("samples name shards past the index"))?;
    let mut head = Vec::with_capacity(16 + key.len() + 8 + FIXED);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&(key.len() as u64).to_le_bytes());
    head.extend_from_slice(key);
    head.resize(16 + key.len().div_ceil(8) * 8, 0);
    head.extend_from_slice(&(idx.shards.len() as u64).to_le_bytes());
    head.extend_from_slice(&(idx.samples.len() as u64).to_le_bytes());
    head.extend_from_slice(&crc.to_le_bytes());
    head.extend_from_slice(&[0; 4]);
    let f = std::io::BufWriter::with_capacity(1 << 20, ubdirect_ub::NewFile::create(path)?);
    let mut f = seal::SealingWriter::new(f, sealed);
    f.write_all(&head)?;
    body(&starts, &idx.samples, &mut |b| f.write_all(b))?;
    // Not synced: a file cut short by a crash fails its size or seal check and is built again.
    f.finish()?
        .into_inner()
        .map_err(|e| e.into_error())?
        .commit()
}

/// The index of local `paths` as `format` with `column`: from the samples cache when a valid one
/// exists, else by `parse` (then stored for the next start).
pub fn cached(
    format: Format,
    column: &str,
    paths: &[PathBuf],
    parse: impl FnOnce() -> Result<DatasetIndex, FormatError>,
) -> Result<DatasetIndex, FormatError> {
    let Some(first) = paths.first() else {
        return parse();
    };
    let (key, sizes) = key(format, column, paths)?;
    let path = cache_path(first, &key);
    let sealing = seal::key();
    match load(&path, &key, &sizes, sealing.as_ref()) {
        Ok(Some(samples)) => {
            return Ok(DatasetIndex {
                format: format.name().into(),
                shards: paths
                    .iter()
                    .zip(&sizes)
                    .map(|(p, &size)| super::index::Shard {
                        path: p.clone(),
                        size,
                    })
                    .collect(),
                samples,
            });
        }
        Ok(None) => {}
        Err(why) => ubdirect_ub::fallback::record(
            "samples_cache_invalid",
            format!("{}: {why}; building it again", path.display()),
        ),
    }
    let idx = parse()?;
    idx.validate()?;
    if !idx.samples.is_empty()
        && let Err(e) = store(&path, &key, &idx, sealing)
    {
        ubdirect_ub::fallback::record(
            "samples_cache_unwritable",
            format!(
                "{}: {e}; the dataset's shards are indexed at every start",
                path.display()
            ),
        );
    }
    Ok(idx)
}
