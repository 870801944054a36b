//! Megatron-LM indexed datasets (`PREFIX.bin` + `PREFIX.idx`), read as Megatron's builder writes them:
//!
//! ```text
//! "MMIDIDX\0\0"  u64 version (1)  u8 dtype code  u64 sequence_count  u64 document_count
//! i32 sequence_lengths[sequence_count]   (elements)
//! i64 sequence_pointers[sequence_count]  (bytes into .bin)
//! i64 document_indices[document_count]   (sequence index where each document starts; first is 0)
//! [i8 sequence_modes[sequence_count]]    (multimodal datasets only)
//! ```
//! Sample = one sequence. The `.idx` is mapped and read in place ([`MegatronIdx`]): opening a
//! dataset of 10⁸ sequences copies nothing per sequence (`docs/decisions.md`).

use std::path::{Path, PathBuf};

use super::index::{DatasetIndex, Samples, Shard};
use super::megatron_idx::with_ext;
pub use super::megatron_idx::{
    IdxBytes, MAGIC, MAX_IDX_BYTES, MappedFile, MegatronIdx, dtype_code, dtype_from_code, prefix_of,
};
use super::{Dtype, FormatError, io_err};

/// Maps and checks a local `.idx` file (its header; [`MegatronIdx::check`] checks the sequences).
pub fn read_idx(path: &Path) -> Result<MegatronIdx, FormatError> {
    MegatronIdx::map(path)
}

/// Parses `.idx` bytes (`path` names them in errors): the header, as [`MegatronIdx::parse`].
pub fn parse_idx(path: &Path, buf: &[u8]) -> Result<MegatronIdx, FormatError> {
    MegatronIdx::parse(path, IdxBytes::Owned(buf.to_vec()))
}

/// Indexes Megatron datasets given by prefix (or `.bin`/`.idx` path).
pub fn open(paths: &[PathBuf]) -> Result<DatasetIndex, FormatError> {
    open_with(paths, &super::LocalFiles)
}

/// Indexes Megatron datasets whose files `opener` reads (local or `ub://`). Local `.idx` files are
/// mapped, others read; either way the index reads sequences from the `.idx` bytes in place.
pub fn open_with(
    paths: &[PathBuf],
    opener: &dyn super::Opener,
) -> Result<DatasetIndex, FormatError> {
    let mut opened = Vec::with_capacity(paths.len());
    for p in paths {
        let prefix = prefix_of(p);
        let (idx_path, bin_path) = (with_ext(&prefix, ".idx"), with_ext(&prefix, ".bin"));
        let m = if opener.is_local() {
            MegatronIdx::map(&idx_path)?
        } else {
            MegatronIdx::parse(
                &idx_path,
                IdxBytes::Owned(super::read_all(opener, &idx_path, MAX_IDX_BYTES)?),
            )?
        };
        let size = opener.size(&bin_path)?;
        opened.push((m, bin_path, size));
    }
    index_of(opened)
}

/// The index of opened `.idx` files, each with its `.bin` and the `.bin`'s size: every sequence is
/// checked against it ([`MegatronIdx::check`]).
pub fn index_of(opened: Vec<(MegatronIdx, PathBuf, u64)>) -> Result<DatasetIndex, FormatError> {
    let mut shards = Vec::with_capacity(opened.len());
    let mut files = Vec::with_capacity(opened.len());
    for (m, bin_path, size) in opened {
        m.check(&bin_path, size)?;
        files.push(std::sync::Arc::new(m));
        shards.push(Shard {
            path: bin_path,
            size,
        });
    }
    Ok(DatasetIndex {
        format: "megatron".into(),
        shards,
        samples: Samples::megatron(files),
    })
}

/// `PREFIX.idx` and `PREFIX.bin` of a prefix (also for `ub://` prefixes).
pub fn idx_and_bin(prefix: &Path) -> (PathBuf, PathBuf) {
    (with_ext(prefix, ".idx"), with_ext(prefix, ".bin"))
}

/// Writes a Megatron dataset (`PREFIX.bin`, `PREFIX.idx`) from sequences of `dtype` elements, one
/// document per sequence — the layout Megatron's `IndexedDatasetBuilder` produces.
pub fn write(prefix: &Path, dtype: Dtype, sequences: &[Vec<u8>]) -> Result<(), FormatError> {
    use std::io::Write;
    let code = dtype_code(dtype)
        .ok_or_else(|| FormatError::Config(format!("Megatron has no code for {dtype:?}")))?;
    let bin = with_ext(prefix, ".bin");
    let mut f = std::io::BufWriter::new(ubdirect_ub::NewFile::create(&bin).map_err(io_err(&bin))?);
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
    f.into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.commit())
        .map_err(io_err(&bin))?;
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
    ubdirect_ub::write_new(&idxp, &out).map_err(io_err(&idxp))
}

/// The token type of a Megatron dataset, from its `.idx` header.
pub fn megatron_dtype(prefix: &Path) -> Result<Dtype, FormatError> {
    use std::io::Read;
    let (idx, _) = idx_and_bin(&prefix_of(prefix));
    let mut head = [0u8; 18];
    std::fs::File::open(&idx)
        .and_then(|mut f| f.read_exact(&mut head))
        .map_err(|source| FormatError::Io {
            path: idx.clone(),
            source,
        })?;
    if &head[..9] != MAGIC {
        return Err(FormatError::Corrupt {
            path: idx,
            reason: "bad magic at offset 0: not a Megatron MMIDIDX index".into(),
        });
    }
    dtype_from_code(head[17]).ok_or_else(|| FormatError::Corrupt {
        path: idx,
        reason: format!("unknown dtype code {} at offset 17", head[17]),
    })
}
