//! Dataset formats. Each module turns its files into a [`DatasetIndex`]; none reads sample bytes.

pub mod arrow;
pub mod crc;
pub mod megatron;
pub mod npy;
pub mod raw;

use std::path::{Path, PathBuf};

/// Errors opening a dataset: every one names the file and what is wrong, with the offset where known.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A file's contents are not what the format says.
    #[error("{path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong, with offsets.
        reason: String,
    },
    /// Valid data this loader does not read.
    #[error("{path}: unsupported: {reason}")]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// What and why.
        reason: String,
    },
    /// The dataset configuration is incomplete or inconsistent.
    #[error("dataset config: {0}")]
    Config(String),
}

pub(crate) fn io_err(path: &Path) -> impl Fn(std::io::Error) -> FormatError + '_ {
    move |source| FormatError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn corrupt(path: &Path, reason: impl Into<String>) -> FormatError {
    FormatError::Corrupt {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Element types of raw and Megatron files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    /// u8
    U8,
    /// i8
    I8,
    /// u16
    U16,
    /// i16
    I16,
    /// u32
    U32,
    /// i32
    I32,
    /// u64
    U64,
    /// i64
    I64,
    /// f16
    F16,
    /// bf16
    Bf16,
    /// f32
    F32,
    /// f64
    F64,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::U8 | Dtype::I8 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }

    /// Parses `u16`, `int32`, `float32`, `bf16`, …
    pub fn parse(s: &str) -> Result<Self, String> {
        Ok(match s {
            "u8" | "uint8" => Dtype::U8,
            "i8" | "int8" => Dtype::I8,
            "u16" | "uint16" => Dtype::U16,
            "i16" | "int16" => Dtype::I16,
            "u32" | "uint32" => Dtype::U32,
            "i32" | "int32" => Dtype::I32,
            "u64" | "uint64" => Dtype::U64,
            "i64" | "int64" => Dtype::I64,
            "f16" | "float16" => Dtype::F16,
            "bf16" | "bfloat16" => Dtype::Bf16,
            "f32" | "float32" => Dtype::F32,
            "f64" | "float64" => Dtype::F64,
            o => {
                return Err(format!(
                    "unknown dtype {o:?}: expected u8, i8, u16, i16, u32, i32, u64, i64, f16, bf16, f32 or f64"
                ));
            }
        })
    }
}

/// Lists the shard files of a dataset: the configured paths, or the files in `dir` ending in `ext`.
pub fn shard_paths(
    paths: &[PathBuf],
    dir: Option<&Path>,
    ext: &str,
) -> Result<Vec<PathBuf>, FormatError> {
    if !paths.is_empty() {
        return Ok(paths.to_vec());
    }
    let Some(dir) = dir else {
        return Err(FormatError::Config(
            "set dataset.paths or dataset.dir".into(),
        ));
    };
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.to_string_lossy().ends_with(ext))
        .collect();
    v.sort();
    if v.is_empty() {
        return Err(FormatError::Config(format!(
            "no *{ext} files in {}",
            dir.display()
        )));
    }
    Ok(v)
}

pub(crate) fn file_size(path: &Path) -> Result<u64, FormatError> {
    let m = std::fs::metadata(path).map_err(io_err(path))?;
    if !m.is_file() {
        return Err(corrupt(path, "not a regular file"));
    }
    Ok(m.len())
}
