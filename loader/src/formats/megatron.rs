//! Megatron-LM indexed datasets (`PREFIX.bin` + `PREFIX.idx`), read as Megatron's builder writes them:
//!
//! ```text
//! "MMIDIDX\0\0"  u64 version (1)  u8 dtype code  u64 sequence_count  u64 document_count
//! i32 sequence_lengths[sequence_count]   (elements)
//! i64 sequence_pointers[sequence_count]  (bytes into .bin)
//! i64 document_indices[document_count]   (sequence index where each document starts; first is 0)
//! [i8 sequence_modes[sequence_count]]    (multimodal datasets only)
//! ```
//! Sample = one sequence.

use std::path::{Path, PathBuf};

use super::{Dtype, FormatError, corrupt, io_err};
use crate::index::{DatasetIndex, SampleLoc, Shard};

/// The `.idx` magic.
pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";

/// Megatron's dtype codes.
pub fn dtype_from_code(code: u8) -> Option<Dtype> {
    Some(match code {
        1 => Dtype::U8,
        2 => Dtype::I8,
        3 => Dtype::I16,
        4 => Dtype::I32,
        5 => Dtype::I64,
        6 => Dtype::F64,
        7 => Dtype::F32,
        8 => Dtype::U16,
        _ => return None,
    })
}

/// The code Megatron writes for `dtype`.
pub fn dtype_code(dtype: Dtype) -> Option<u8> {
    Some(match dtype {
        Dtype::U8 => 1,
        Dtype::I8 => 2,
        Dtype::I16 => 3,
        Dtype::I32 => 4,
        Dtype::I64 => 5,
        Dtype::F64 => 6,
        Dtype::F32 => 7,
        Dtype::U16 => 8,
        _ => return None,
    })
}

/// A parsed `.idx`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MegatronIndex {
    /// Element type.
    pub dtype: Dtype,
    /// Elements per sequence.
    pub lengths: Vec<i32>,
    /// Byte offsets of sequences in the `.bin`.
    pub pointers: Vec<i64>,
    /// Document start indices.
    pub documents: Vec<i64>,
}

/// `PREFIX`, `PREFIX.bin` or `PREFIX.idx` → `PREFIX`.
pub fn prefix_of(p: &Path) -> PathBuf {
    let s = p.to_string_lossy();
    match s.strip_suffix(".bin").or_else(|| s.strip_suffix(".idx")) {
        Some(stem) => PathBuf::from(stem),
        None => p.to_path_buf(),
    }
}

fn with_ext(prefix: &Path, ext: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(ext);
    PathBuf::from(s)
}

struct Cursor<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], FormatError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| {
                corrupt(
                    self.path,
                    format!(
                        "truncated: {what} needs {n} bytes at offset {}, file has {}",
                        self.pos,
                        self.buf.len()
                    ),
                )
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u64(&mut self, what: &str) -> Result<u64, FormatError> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    }
    fn count(&mut self, what: &str, elem: usize) -> Result<usize, FormatError> {
        let at = self.pos;
        let n = self.u64(what)?;
        let left = (self.buf.len() - self.pos) as u64;
        if n.checked_mul(elem as u64).is_none_or(|b| b > left) {
            return Err(corrupt(
                self.path,
                format!("{what} {n} at offset {at} exceeds the file ({left} bytes left)"),
            ));
        }
        Ok(n as usize)
    }
}

/// Parses a `.idx` file.
pub fn read_idx(path: &Path) -> Result<MegatronIndex, FormatError> {
    let buf = super::read_all(&super::LocalFiles, path, MAX_IDX_BYTES)?;
    parse_idx(path, &buf)
}

/// Parses `.idx` bytes (`path` names them in errors).
pub fn parse_idx(path: &Path, buf: &[u8]) -> Result<MegatronIndex, FormatError> {
    let mut c = Cursor { path, buf, pos: 0 };
    if c.take(9, "magic")? != MAGIC {
        return Err(corrupt(
            path,
            "bad magic at offset 0: not a Megatron MMIDIDX index",
        ));
    }
    let version = c.u64("version")?;
    if version != 1 {
        return Err(FormatError::Unsupported {
            path: path.to_path_buf(),
            reason: format!("index version {version} (only 1 exists)"),
        });
    }
    let code = c.take(1, "dtype code")?[0];
    let dtype = dtype_from_code(code)
        .ok_or_else(|| corrupt(path, format!("unknown dtype code {code} at offset 17")))?;
    let nseq = c.count("sequence_count", 4 + 8)?;
    let ndoc = c.count("document_count", 0)?;
    let lengths: Vec<i32> = c
        .take(nseq * 4, "sequence_lengths")?
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let rd64 = |b: &[u8]| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    let pointers: Vec<i64> = c
        .take(nseq * 8, "sequence_pointers")?
        .chunks_exact(8)
        .map(rd64)
        .collect();
    let documents: Vec<i64> = c
        .take(ndoc.saturating_mul(8), "document_indices")?
        .chunks_exact(8)
        .map(rd64)
        .collect();
    for (i, w) in documents.windows(2).enumerate() {
        if w[0] > w[1] {
            return Err(corrupt(
                path,
                format!("document_indices not ascending at document {}", i + 1),
            ));
        }
    }
    if let Some(&last) = documents.last()
        && (last < 0 || last as usize > nseq)
    {
        return Err(corrupt(
            path,
            format!("document index {last} exceeds sequence_count {nseq}"),
        ));
    }
    Ok(MegatronIndex {
        dtype,
        lengths,
        pointers,
        documents,
    })
}

/// Indexes Megatron datasets given by prefix (or `.bin`/`.idx` path).
pub fn open(paths: &[PathBuf]) -> Result<DatasetIndex, FormatError> {
    open_with(paths, &super::LocalFiles)
}

/// The largest `.idx` read into memory (a larger one is refused, not read until memory runs out).
pub const MAX_IDX_BYTES: u64 = 64 << 30;

/// Indexes Megatron datasets whose files `opener` reads (local or `ub://`).
pub fn open_with(
    paths: &[PathBuf],
    opener: &dyn super::Opener,
) -> Result<DatasetIndex, FormatError> {
    let mut idx = DatasetIndex {
        format: "megatron".into(),
        ..Default::default()
    };
    for (si, p) in paths.iter().enumerate() {
        let prefix = prefix_of(p);
        let (idx_path, bin_path) = (with_ext(&prefix, ".idx"), with_ext(&prefix, ".bin"));
        let bytes = super::read_all(opener, &idx_path, MAX_IDX_BYTES)?;
        let m = parse_idx(&idx_path, &bytes)?;
        let size = opener.size(&bin_path)?;
        add_shard(&mut idx, si as u32, &m, &idx_path, &bin_path, size)?;
    }
    Ok(idx)
}

/// `PREFIX.idx` and `PREFIX.bin` of a prefix (also for `ub://` prefixes).
pub fn idx_and_bin(prefix: &Path) -> (PathBuf, PathBuf) {
    (with_ext(prefix, ".idx"), with_ext(prefix, ".bin"))
}

/// Adds one shard's sequences (checked against the `.bin` size) to `idx`.
pub fn add_shard(
    idx: &mut DatasetIndex,
    si: u32,
    m: &MegatronIndex,
    idx_path: &Path,
    bin_path: &Path,
    size: u64,
) -> Result<(), FormatError> {
    let es = m.dtype.size() as u64;
    let mut prev_end = 0u64;
    for (i, (&len, &ptr)) in m.lengths.iter().zip(&m.pointers).enumerate() {
        if len < 0 || ptr < 0 {
            return Err(corrupt(
                idx_path,
                format!("sequence {i}: negative length {len} or pointer {ptr}"),
            ));
        }
        let bytes = len as u64 * es;
        let end = (ptr as u64).saturating_add(bytes);
        if end > size {
            return Err(corrupt(
                idx_path,
                format!(
                    "sequence {i} at {ptr}+{bytes} points past the end of {} ({size} bytes)",
                    bin_path.display()
                ),
            ));
        }
        if (ptr as u64) < prev_end || bytes > u32::MAX as u64 {
            return Err(corrupt(
                idx_path,
                format!("sequence {i} at {ptr}+{bytes} overlaps the previous one or is too large"),
            ));
        }
        prev_end = end;
        idx.samples.push(SampleLoc {
            shard: si,
            offset: ptr as u64,
            len: bytes as u32,
        });
    }
    idx.shards.push(Shard {
        path: bin_path.to_path_buf(),
        size,
    });
    Ok(())
}

/// Writes a Megatron dataset (`PREFIX.bin`, `PREFIX.idx`) from sequences of `dtype` elements, one
/// document per sequence — the layout Megatron's `IndexedDatasetBuilder` produces.
pub fn write(prefix: &Path, dtype: Dtype, sequences: &[Vec<u8>]) -> Result<(), FormatError> {
    use std::io::Write;
    let code = dtype_code(dtype)
        .ok_or_else(|| FormatError::Config(format!("Megatron has no code for {dtype:?}")))?;
    let bin = with_ext(prefix, ".bin");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&bin).map_err(io_err(&bin))?);
    let mut pointers = Vec::with_capacity(sequences.len());
    let mut lengths = Vec::with_capacity(sequences.len());
    let mut off = 0i64;
    for s in sequences {
        if s.len() % dtype.size() != 0 {
            return Err(FormatError::Config(
                "sequence length not a multiple of the element size".into(),
            ));
        }
        f.write_all(s).map_err(io_err(&bin))?;
        pointers.push(off);
        lengths.push((s.len() / dtype.size()) as i32);
        off += s.len() as i64;
    }
    f.flush().map_err(io_err(&bin))?;
    let idxp = with_ext(prefix, ".idx");
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&1u64.to_le_bytes());
    out.push(code);
    out.extend_from_slice(&(sequences.len() as u64).to_le_bytes());
    out.extend_from_slice(&(sequences.len() as u64 + 1).to_le_bytes());
    for l in &lengths {
        out.extend_from_slice(&l.to_le_bytes());
    }
    for p in &pointers {
        out.extend_from_slice(&p.to_le_bytes());
    }
    for d in 0..=sequences.len() as i64 {
        out.extend_from_slice(&d.to_le_bytes());
    }
    std::fs::write(&idxp, out).map_err(io_err(&idxp))
}
