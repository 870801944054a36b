//! An on-disk cache of Megatron-order GPT indices (`dataset.gpt_index_cache`), as Megatron keeps its
//! `.npy` index files: built once, then read back (not rebuilt) at the next start.
//!
//! A cache file lives beside the local `.idx` it was built from, named
//! `PREFIX.idx.ubdirect-gpt-<key hash>`. Its key — stored whole in the file and compared byte for
//! byte — is the `.idx`'s identity (device, inode, size, modification time, read from the very
//! descriptor that was mapped), a CRC-32 of its `sequence_lengths` (what the indices are built
//! from), and every setting that shapes the indices (seed, sequence length, extra token, samples,
//! split and part). A dataset of several shards (a `dataset.dir` of `.bin`/`.idx` pairs, read as
//! one dataset) has one cache file, beside its *first* shard's `.idx`, keyed by every shard's
//! identity and lengths' CRC-32 in order ([`build_cached_files`]). A dataset rewritten in place or
//! replaced by a rename — any of its shards — gets a new key, so its old cache is never used. A cache file is untrusted input (anyone who can write the dataset's
//! directory can write one, with a valid CRC): one that does not check out — its CRC-32, its array
//! sizes against its length, and its contents against the dataset and settings (every document id
//! in the split, every window whole and in order, the shuffle index a permutation:
//! [`super::check::check_indices`]) — is a recorded fallback and is rebuilt; a directory that cannot be
//! written is a recorded fallback too (the indices are then built at every start). It is written
//! through [`ubdirect_ub::NewFile`] (never through a planted link, never into a FIFO) and mapped
//! when read: its arrays are read in place ([`crate::formats::mapped`]), never copied (since 2026-12-05;
//! until then they were read into vectors with `pread`, 12 B per window of memory and most of a
//! cached start).
//!
//! ```text
//! "UBDGPT04"  u64 key_len  key[key_len] (padded to 8)
//! u32 epochs  u32 shuffle_width (4 | 8)  u64 documents  u64 sample_entries  u64 shuffled
//! u32 crc32(the five fields above, body)  u32 0
//! body: u32 document_index[documents] (padded to 8)
//!       u64 prefix[documents / 16 rounded up, + 1] (tokens before every 16th document)
//!       shuffle_index[shuffled] (u32 or u64)
//! seal[32] (formats::seal: a keyed BLAKE3 of every byte before it; zeros when unsealed)
//! ```
//!
//! Since 2026-12-05 the file is sealed under this user's key and a start that verifies the seal
//! uses it as written, with no structural check (ubdirect checked what it wrote): the seal refuses
//! what the structure cannot see — a reversed or identity shuffle, a file cut short and resealed.
//! Without a key the file is unsealed and the CRC and the structural checks decide. The sample index
//! is not stored (since `UBDGPT03`): it is computed by position through the document index
//! ([`super::windows`], 8 bytes per 64 documents), as block order's is, and `sample_entries` must
//! equal the windows the documents make; the file is 0.44 GB at 10⁸ windows where it was 1.24 GB.
//! Since `UBDGPT04` the windows' prefix of token counts (8 bytes per 16 documents) is stored too: a
//! sealed file's is read in place, so a cached start makes no pass over the documents (that pass,
//! a random read of a length per document, was a third of a cached start at 10⁸ windows); an
//! unsealed file's is computed and must equal the stored one.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::megatron::{
    self, DocumentIndex, GptIndices, MegatronGptConfig, SampleIndex, ShuffleIndex,
};
use super::windows::{InOrderWindows, SHUFFLED_STRIDE};
use super::{GptError, TokenSizes};
use crate::formats::mapped::{CacheBytes, Ints};
use crate::formats::megatron::MegatronIdx;
use crate::formats::seal;

pub(crate) const MAGIC: &[u8; 8] = b"UBDGPT04";
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
        k.extend_from_slice(&m.lengths_crc32().to_le_bytes());
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
    let mut h = crate::hash::Fnv::new();
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
        return Ok((megatron::build_computed(sizes, cfg)?, CacheUse::Off));
    };
    let path = cache_path(m.path(), &key);
    let sealing = seal::key();
    match load(&path, &key, sizes, cfg, sealing.as_ref()) {
        Ok(Some(ix)) => return Ok((ix, CacheUse::Hit)),
        Ok(None) => {}
        Err(why) => ubdirect_ub::fallback::record(
            "gpt_index_cache_invalid",
            format!("{}: {why}; rebuilding it", path.display()),
        ),
    }
    let ix = megatron::build_computed(sizes, cfg)?;
    match store(&path, &key, &ix, sizes, sealing) {
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

/// Why a cache file that exists is not used (it is then rebuilt: a recorded fallback).
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// It could not be opened or read (a FIFO, a device, cut short while read).
    #[error("reading it at offset {offset}")]
    Io {
        /// Where the read was.
        offset: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Its header or array sizes do not describe its bytes.
    #[error("{why} ({size} bytes)")]
    Layout {
        /// What.
        why: &'static str,
        /// The file's size.
        size: u64,
    },
    /// Its seal does not verify under this user's key: written by someone else (or unsealed), or
    /// changed since (`formats::seal`).
    #[error(
        "its seal does not verify under this user's key (written elsewhere, or changed; {size} bytes)"
    )]
    Seal {
        /// The file's size.
        size: u64,
    },
    /// Its CRC-32 does not match: a damaged file.
    #[error("its CRC-32 does not match (a damaged file of {size} bytes)")]
    Crc {
        /// The file's size.
        size: u64,
    },
    /// Its contents are whole (the CRC matches) but not indices these settings make over this
    /// dataset: a forged or inconsistent file.
    #[error("inconsistent indices at offset {offset}: {source}")]
    Inconsistent {
        /// Byte offset of the entry in the file.
        offset: u64,
        /// Which entry and why.
        #[source]
        source: super::check::IndexCheckError,
    },
}

/// The cached indices at `path` if the file exists (`Ok(None)`: it does not); `Err` says why a file
/// that exists is not used.
///
/// The file is mapped and its arrays read in place (nothing copied: a cached start at 10⁸ windows
/// maps 1.2 GB and holds none of it). Everything in it is untrusted — a CRC proves a file whole, not
/// right — so after the CRC the indices are checked against the sequences and settings they claim
/// to be made from ([`super::check::check_indices`]), both passes on every core and read with `pread`
/// (nothing of the file stays resident; the mapping, advised random, serves the entries the plan
/// reads later). A mapped file truncated by another process afterwards can raise `SIGBUS` when
/// touched, the contract numpy's `memmap` (Megatron-Core's reader of its own index files) and the
/// `.idx` mapping have too (`formats/sys.rs`); ubdirect never truncates a cache file, it replaces it.
fn load<S: megatron::Sizes + Sync + ?Sized>(
    path: &Path,
    key: &[u8],
    sizes: &S,
    cfg: &MegatronGptConfig,
    sealed: Option<&[u8; 32]>,
) -> Result<Option<GptIndices>, CacheError> {
    let (f, size) = match crate::formats::open_regular(path) {
        Ok(x) => x,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(CacheError::Io { offset: 0, source }),
    };
    let bytes = CacheBytes::map(f, size).map_err(|source| CacheError::Io { offset: 0, source })?;
    read(Arc::new(bytes), key, sizes, cfg, sealed).map(Some)
}

/// The indices in the cache file `bytes`, checked as a cache file is checked (for tests and
/// fuzzing: the same code reads mapped files).
pub fn parse<S: megatron::Sizes + Sync + ?Sized>(
    bytes: &[u8],
    key: &[u8],
    sizes: &S,
    cfg: &MegatronGptConfig,
) -> Result<GptIndices, CacheError> {
    read(
        Arc::new(CacheBytes::Owned(bytes.to_vec())),
        key,
        sizes,
        cfg,
        None,
    )
}

/// The bytes of the cache file of `ix` over `sizes` under `key` (what [`build_cached`] stores).
pub fn to_bytes<S: megatron::Sizes + ?Sized>(
    key: &[u8],
    ix: &GptIndices,
    sizes: &S,
) -> std::io::Result<Vec<u8>> {
    let mut v = seal::SealingWriter::new(Vec::new(), None);
    write_to(&mut v, key, ix, &prefix_of(ix, sizes)?)?;
    v.finish()
}

/// The indices in `b` under `key`. With a sealing key (`sealed`), a file whose seal verifies is
/// used as written (ubdirect checked what it wrote) and one whose seal does not is refused; without
/// one, the CRC and the structural checks decide.
fn read<S: megatron::Sizes + Sync + ?Sized>(
    b: Arc<CacheBytes>,
    key: &[u8],
    sizes: &S,
    cfg: &MegatronGptConfig,
    sealed: Option<&[u8; 32]>,
) -> Result<GptIndices, CacheError> {
    let size = b.len() as u64;
    let bad = |why| Err(CacheError::Layout { why, size });
    let l = Layout::of(&b, key)?;
    if let Some(k) = sealed {
        if !seal::verify(k, &b) {
            return Err(CacheError::Seal { size });
        }
    } else {
        let mut c = crc32fast::Hasher::new();
        c.update(&l.counts);
        c.combine(&crate::formats::mapped::crc32_of(&b, l.body..l.end).ok_or(
            CacheError::Layout {
                why: "arrays past the end of the file",
                size,
            },
        )?);
        if c.finalize() != l.crc {
            return Err(CacheError::Crc { size });
        }
    }
    let ints = |at, n, w| {
        Ints::new(b.clone(), at, n, w).ok_or(CacheError::Layout {
            why: "arrays past the end of the file",
            size,
        })
    };
    let document_index = DocumentIndex::Mapped(ints(l.body, l.docs, 4)?);
    let prefix = ints(l.prefix_at, l.prefixes, 8)?;
    let windows = windows_of(
        &sizes.shared(),
        &document_index,
        prefix,
        cfg,
        sealed.is_some(),
    )
    .map_err(|why| CacheError::Layout { why, size })?;
    if windows.len() != l.entries {
        return bad("not as many windows as the documents make");
    }
    let ix = GptIndices {
        document_index,
        sample_index: SampleIndex::InOrder(Arc::new(windows)),
        shuffle_index: Some(ShuffleIndex::Mapped(ints(
            l.shuffle_at,
            l.shuffled,
            l.width,
        )?)),
        epochs: l.epochs,
    };
    if sealed.is_some() {
        return Ok(ix);
    }
    super::check::check_indices(&ix, sizes, cfg).map_err(|source| {
        let (at, w) = match source.array {
            "document_index" => (l.body, 4),
            "sample_index" => (l.shuffle_at, 0),
            _ => (l.shuffle_at, l.width),
        };
        CacheError::Inconsistent {
            offset: (at as u64).saturating_add(source.entry.saturating_mul(w as u64)),
            source,
        }
    })?;
    Ok(ix)
}

/// Where a cache file's arrays lie, from its header (its key compared with ours first).
struct Layout {
    /// The counts' bytes (the first 32 of the fixed fields), which the CRC covers.
    counts: [u8; 32],
    epochs: u32,
    width: usize,
    docs: usize,
    entries: usize,
    shuffled: usize,
    crc: u32,
    body: usize,
    prefix_at: usize,
    prefixes: usize,
    shuffle_at: usize,
    end: usize,
}

impl Layout {
    fn of(b: &CacheBytes, key: &[u8]) -> Result<Self, CacheError> {
        let size = b.len() as u64;
        let bad = |why| Err(CacheError::Layout { why, size });
        let mut head = [0u8; 16];
        if !b.read(0, &mut head) || &head[..8] != MAGIC {
            return bad("not a ubdirect GPT index cache");
        }
        let klen = usize::try_from(u64_at(&head, 8)).unwrap_or(usize::MAX);
        let h = match pad8(klen).and_then(|k| k.checked_add(16)) {
            Some(h) if (h.saturating_add(FIXED) as u64) <= size => h,
            _ => return bad("truncated header"),
        };
        // The key and the fixed fields: small (the key is bounded by the file's size, checked
        // above, and compared with ours before anything else is read).
        if klen != key.len() {
            return bad("made for another dataset or other settings");
        }
        let mut hb = vec![0u8; h + FIXED];
        if !b.read(0, &mut hb) {
            return bad("truncated header");
        }
        if hb.get(16..16 + klen) != Some(key) {
            return bad("made for another dataset or other settings");
        }
        let count = |at: usize| usize::try_from(u64_at(&hb, at)).unwrap_or(usize::MAX);
        let (docs, entries, shuffled) = (count(h + 8), count(h + 16), count(h + 24));
        let width = u32_at(&hb, h + 4) as usize;
        let body = h + FIXED;
        let prefix_at = docs
            .checked_mul(4)
            .and_then(pad8)
            .and_then(|d| d.checked_add(body));
        let prefixes = docs.div_ceil(SHUFFLED_STRIDE) + 1;
        let shuffle_at = prefix_at.and_then(|p| p.checked_add(prefixes.checked_mul(8)?));
        let end = shuffle_at.and_then(|s| shuffled.checked_mul(width)?.checked_add(s));
        let (Some(prefix_at), Some(shuffle_at), Some(end)) = (prefix_at, shuffle_at, end) else {
            return bad("array sizes overflow");
        };
        if !matches!(width, 4 | 8) || end as u64 + seal::SEAL as u64 != size || entries == 0 {
            return bad("array sizes do not match the file");
        }
        if shuffled != entries - 1 {
            return bad("the shuffle index does not cover the samples");
        }
        let mut counts = [0u8; 32];
        counts.copy_from_slice(&hb[h..h + 32]);
        Ok(Layout {
            counts,
            epochs: u32_at(&hb, h),
            width,
            docs,
            entries,
            shuffled,
            crc: u32_at(&hb, h + 32),
            body,
            prefix_at,
            prefixes,
            shuffle_at,
            end,
        })
    }
}

/// The windows over the cached documents, by position. Sealed: from the stored prefix, in place.
/// Unsealed: from a prefix computed over the documents (a document id past the sequences is
/// refused here), which must equal the stored one.
fn windows_of(
    sizes: &TokenSizes,
    documents: &DocumentIndex,
    prefix: Ints,
    cfg: &MegatronGptConfig,
    sealed: bool,
) -> Result<InOrderWindows, &'static str> {
    let (seq, extra) = (cfg.sequence_length, cfg.add_extra_token);
    let no_window = |_| "documents past the sequences, or no whole window";
    if sealed {
        return InOrderWindows::mapped(sizes, documents.clone(), prefix, seq, extra)
            .map_err(no_window);
    }
    let w = InOrderWindows::over(sizes, documents.clone(), seq, extra).map_err(no_window)?;
    let same = w.stride() == SHUFFLED_STRIDE
        && w.prefix().count() == prefix.len()
        && w.prefix()
            .enumerate()
            .all(|(k, p)| prefix.get(k) == Some(p));
    if !same {
        return Err("the stored prefix is not the documents' token counts");
    }
    Ok(w)
}

/// Feeds the body's bytes to `out` in pieces.
fn body(
    ix: &GptIndices,
    prefix: &[u64],
    out: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
) -> std::io::Result<()> {
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
    for p in prefix {
        buf.extend_from_slice(&p.to_le_bytes());
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

/// Writes `ix` over `sizes` to `path` under `key` ([`ubdirect_ub::NewFile`]): a reader never sees
/// part of one.
fn store<S: megatron::Sizes + ?Sized>(
    path: &Path,
    key: &[u8],
    ix: &GptIndices,
    sizes: &S,
    sealed: Option<[u8; 32]>,
) -> std::io::Result<()> {
    let prefix = prefix_of(ix, sizes)?;
    // An unnamed (or random, O_EXCL) file in the directory, renamed over `path` when whole: never a
    // name someone planted (a symlink, a FIFO), and two loaders building the same indices never
    // share a file.
    let f = std::io::BufWriter::with_capacity(1 << 20, ubdirect_ub::NewFile::create(path)?);
    let mut f = seal::SealingWriter::new(f, sealed);
    write_to(&mut f, key, ix, &prefix)?;
    // Not synced: a file cut short by a crash fails its size or seal check and is rebuilt.
    f.finish()?
        .into_inner()
        .map_err(|e| e.into_error())?
        .commit()
}

/// The windows' prefix of `ix` over `sizes` as the file stores it: the one its computed sample
/// index holds, or one pass over its documents.
fn prefix_of<S: megatron::Sizes + ?Sized>(ix: &GptIndices, sizes: &S) -> std::io::Result<Vec<u64>> {
    if let (SampleIndex::InOrder(w), DocumentIndex::Shuffled(d)) =
        (&ix.sample_index, &ix.document_index)
        && matches!(w.order(), DocumentIndex::Shuffled(o) if Arc::ptr_eq(o, d))
        && w.stride() == SHUFFLED_STRIDE
    {
        return Ok(w.prefix().collect());
    }
    super::windows::prefix_sums(&sizes.shared(), &ix.document_index, SHUFFLED_STRIDE)
        .map_err(|e| std::io::Error::other(e.to_string()))
}

/// Writes the cache file of `ix` (with the windows' `prefix`) under `key` to `f`.
fn write_to(
    f: &mut impl Write,
    key: &[u8],
    ix: &GptIndices,
    prefix: &[u64],
) -> std::io::Result<()> {
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
    body(ix, prefix, &mut |b| {
        crc.update(b);
        Ok(())
    })?;
    head.extend_from_slice(&crc.finalize().to_le_bytes());
    head.extend_from_slice(&[0; 4]);
    f.write_all(&head)?;
    body(ix, prefix, &mut |b| f.write_all(b))
}

#[cfg(test)]
mod tests;
