//! Dataset formats. Each module turns its files into a [`DatasetIndex`](index::DatasetIndex); none reads sample bytes.

pub mod arrow;
pub mod crc;
pub mod index;
pub mod mapped;
pub mod megatron;
pub mod megatron_idx;
pub mod npy;
pub mod raw;
pub mod sample_type;
pub mod samples_cache;
pub mod seal;
pub(crate) mod sys;
pub mod webdataset;

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
    /// `dataset.dir` holds no shards of the format (or does not exist), and the config does not ask
    /// for a synthetic dataset: a typo'd directory is an error, never synthetic data.
    #[error(
        "dataset.dir {}: {} (dataset.format = \"{format}\" reads *{ext} files): check the path, or name the shards in dataset.paths; dataset.generate = true writes a synthetic dataset there instead",
        dir.display(),
        if *exists { "holds no shards" } else { "does not exist" }
    )]
    NoShards {
        /// The directory, `~/` expanded.
        dir: PathBuf,
        /// The format's shard extension.
        ext: &'static str,
        /// The format's name.
        format: &'static str,
        /// Whether the directory exists.
        exists: bool,
    },
    /// `dataset.verify_crc = true` and a shard has no CRC sidecar.
    #[error(
        "{}: no CRC sidecar for shard {} (dataset.verify_crc = true): run `ubdirect index --config <this config>` to write the sidecars, or set dataset.verify_crc = false",
        sidecar.display(),
        shard.display()
    )]
    NoSidecar {
        /// The sidecar expected.
        sidecar: PathBuf,
        /// Its shard.
        shard: PathBuf,
    },
    /// `dataset.dir` names a place that cannot be listed (a `ub://` server): the shards must be named.
    #[error(
        "dataset.dir {url}: {why}; name each shard in dataset.paths instead (e.g. [\"{example}\"])"
    )]
    NotListable {
        /// The configured `dataset.dir`.
        url: String,
        /// Why it cannot be listed.
        why: &'static str,
        /// An example of a shard URL under it.
        example: String,
    },
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

/// Element types of raw and Megatron files. In configs: `u16`, `int32`, `float32`, `bf16`, …
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(try_from = "String", into = "String")]
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

    /// The canonical short name (`u16`, `bf16`, `f32`, …).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::U8 => "u8",
            Dtype::I8 => "i8",
            Dtype::U16 => "u16",
            Dtype::I16 => "i16",
            Dtype::U32 => "u32",
            Dtype::I32 => "i32",
            Dtype::U64 => "u64",
            Dtype::I64 => "i64",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
            Dtype::F64 => "f64",
        }
    }

    /// Parses `u16`, `int32`, `float32`, `bf16`, …
    pub fn parse(s: &str) -> Result<Self, FormatError> {
        Self::parse_name(s).map_err(FormatError::Config)
    }

    fn parse_name(s: &str) -> Result<Self, String> {
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

impl TryFrom<String> for Dtype {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Dtype::parse_name(&s)
    }
}

impl From<Dtype> for String {
    fn from(d: Dtype) -> String {
        d.name().to_string()
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
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(no_shards(dir, ext, false));
        }
        Err(e) => return Err(io_err(dir)(e)),
    };
    // The name first, then the type the directory entry carries (no `stat`: at 10⁵ shards the
    // sizes' `stat`s are the only ones); a link is followed to see whether it names a file.
    let mut v: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(ext))
        .filter(|e| match e.file_type() {
            Ok(t) if t.is_symlink() => e.path().is_file(),
            Ok(t) => t.is_file(),
            Err(_) => e.path().is_file(),
        })
        .map(|e| e.path())
        .collect();
    v.sort();
    if v.is_empty() {
        return Err(no_shards(dir, ext, true));
    }
    Ok(v)
}

fn no_shards(dir: &Path, ext: &str, exists: bool) -> FormatError {
    let format = Format::ALL
        .iter()
        .find(|f| f.extension() == ext)
        .copied()
        .unwrap_or(Format::Raw);
    FormatError::NoShards {
        dir: dir.to_path_buf(),
        ext: format.extension(),
        format: format.name(),
        exists,
    }
}

pub(crate) fn file_size(path: &Path) -> Result<u64, FormatError> {
    let m = std::fs::metadata(path).map_err(io_err(path))?;
    if !m.is_file() {
        return Err(corrupt(path, "not a regular file"));
    }
    Ok(m.len())
}

/// What every file ubdirect writes beside data or in a cache is keyed by (docs/security.md,
/// "Files ubdirect writes and trusts later"): the described file's device, inode, size, mtime
/// (seconds, nanoseconds) and ctime (seconds, nanoseconds). A file rewritten in place with its
/// mtime put back keeps its inode and size but not its ctime, which no user can set.
pub fn file_identity(m: &std::fs::Metadata) -> [u64; 7] {
    use std::os::unix::fs::MetadataExt;
    [
        m.dev(),
        m.ino(),
        m.len(),
        m.mtime() as u64,
        m.mtime_nsec() as u64,
        m.ctime() as u64,
        m.ctime_nsec() as u64,
    ]
}

/// Opens `path` for reading if it is a regular file, checked on the descriptor: opened with
/// `O_NONBLOCK` (opening a FIFO does not wait for a writer) and then `fstat`ed, so a file swapped
/// for a FIFO or a device after a path check is refused too. Returns the file and its size.
pub fn open_regular(path: &Path) -> std::io::Result<(std::fs::File, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let m = f.metadata()?;
    if !m.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok((f, m.len()))
}

/// Reads a whole regular file of at most `max` bytes (FIFOs, devices, directories and larger files
/// are refused before anything is read or allocated).
pub fn read_regular(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let (f, size) = open_regular(path)?;
    if size > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{size} bytes, more than the {max}-byte limit"),
        ));
    }
    let mut buf = Vec::new();
    buf.try_reserve_exact(size as usize)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::OutOfMemory, e))?;
    // The file may grow after fstat: never read past the limit.
    f.take(max).read_to_end(&mut buf)?;
    Ok(buf)
}

/// Memory this machine has (`MemTotal`), or `u64::MAX` when it cannot be read.
pub fn memory_total() -> u64 {
    meminfo_bytes("MemTotal:")
}

/// A `/proc/meminfo` field (`"MemTotal:"`, `"MemAvailable:"`) in bytes; `u64::MAX` when it cannot be
/// read (no bound is then imposed).
pub(crate) fn meminfo_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(u64::MAX, |kb| kb.saturating_mul(1024))
}

/// Refuses to allocate `bytes` of memory for `what` of `path` when that exceeds a quarter of this
/// machine's memory (an index, an index file read whole): a typed error instead of an allocation
/// failure that aborts the process.
pub(crate) fn check_memory(path: &Path, what: &str, bytes: u64) -> Result<(), FormatError> {
    let limit = memory_total() / 4;
    if bytes > limit {
        return Err(FormatError::Unsupported {
            path: path.to_path_buf(),
            reason: format!(
                "{what} needs {bytes} bytes of memory, more than a quarter of this machine's ({limit} bytes)"
            ),
        });
    }
    Ok(())
}

/// Makes room for `n` more entries of an index being built from `path`, checked against memory first
/// (a count read from a file is bounded by the file, not by memory).
pub(crate) fn reserve_index<T>(v: &mut Vec<T>, path: &Path, n: u64) -> Result<(), FormatError> {
    let total = (v.len() as u64)
        .saturating_add(n)
        .saturating_mul(std::mem::size_of::<T>() as u64);
    check_memory(path, &format!("an index of {n} entries"), total)?;
    v.try_reserve(n as usize)
        .map_err(|e| FormatError::Unsupported {
            path: path.to_path_buf(),
            reason: format!("an index of {n} entries: {e}"),
        })
}

/// Makes room for `n` more samples of `path` in `idx`, checked against memory first.
pub(crate) fn reserve_samples(
    idx: &mut index::DatasetIndex,
    path: &Path,
    n: u64,
) -> Result<(), FormatError> {
    let each = std::mem::size_of::<index::SampleLoc>() as u64;
    let total = (idx.samples.len() as u64)
        .saturating_add(n)
        .saturating_mul(each);
    check_memory(path, &format!("an index of {n} samples"), total)?;
    idx.samples
        .try_reserve(n as usize)
        .map_err(|e| FormatError::Unsupported {
            path: path.to_path_buf(),
            reason: format!("an index of {n} samples: {e}"),
        })
}

/// A shard file opened for indexing: random access plus its size. Local files and `ub://` files
/// (read through their [`Source`](ubdirect_ub::Source)) both are one.
pub trait ShardFile: std::io::Read + std::io::Seek {
    /// Size in bytes when opened.
    fn size(&self) -> u64;
}

/// Opens the files a format's index is built from (`.npy`, Arrow files, Megatron `.idx`/`.bin`).
pub trait Opener {
    /// Opens `path` for reading.
    fn open(&self, path: &Path) -> Result<Box<dyn ShardFile + '_>, FormatError>;
    /// The size of `path` without reading it (raw shards, Megatron `.bin`).
    fn size(&self, path: &Path) -> Result<u64, FormatError> {
        Ok(self.open(path)?.size())
    }
    /// Whether paths are local files that can be mapped (Megatron `.idx`); others are read.
    fn is_local(&self) -> bool {
        false
    }
}

/// Local files, through the file system.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalFiles;

struct LocalFile(std::fs::File, u64);

impl std::io::Read for LocalFile {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl std::io::Seek for LocalFile {
    fn seek(&mut self, pos: std::io::SeekFrom) -> std::io::Result<u64> {
        self.0.seek(pos)
    }
}

impl ShardFile for LocalFile {
    fn size(&self) -> u64 {
        self.1
    }
}

impl Opener for LocalFiles {
    fn open(&self, path: &Path) -> Result<Box<dyn ShardFile + '_>, FormatError> {
        // Checked on the descriptor: a FIFO or device would block or never end.
        let (f, size) = open_regular(path).map_err(io_err(path))?;
        Ok(Box::new(LocalFile(f, size)))
    }

    fn size(&self, path: &Path) -> Result<u64, FormatError> {
        file_size(path)
    }

    fn is_local(&self) -> bool {
        true
    }
}

/// Reads a whole (small) file through an opener, refusing more than `max` bytes.
pub fn read_all(opener: &dyn Opener, path: &Path, max: u64) -> Result<Vec<u8>, FormatError> {
    use std::io::Read;
    let mut f = opener.open(path)?;
    let size = f.size();
    if size > max {
        return Err(corrupt(
            path,
            format!("{size} bytes: larger than the {max}-byte limit for an index file"),
        ));
    }
    check_memory(path, "reading the index file", size)?;
    let mut buf = Vec::new();
    buf.try_reserve_exact(size as usize)
        .map_err(|e| corrupt(path, format!("{size} bytes: {e}")))?;
    f.as_mut()
        .take(size)
        .read_to_end(&mut buf)
        .map_err(io_err(path))?;
    if (buf.len() as u64) != size {
        return Err(corrupt(
            path,
            format!("ended after {} of {size} bytes", buf.len()),
        ));
    }
    Ok(buf)
}

/// The dataset formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// Fixed-size records.
    Raw,
    /// Megatron `.bin` + `.idx`.
    Megatron,
    /// NumPy `.npy`.
    Npy,
    /// Arrow IPC files.
    Arrow,
    /// WebDataset `.tar` shards.
    #[serde(rename = "webdataset")]
    WebDataset,
}

impl Format {
    /// Every format.
    pub const ALL: [Format; 5] = [
        Format::Raw,
        Format::Megatron,
        Format::Npy,
        Format::Arrow,
        Format::WebDataset,
    ];

    /// `raw`, `megatron`, `npy`, `arrow`, `webdataset`.
    pub fn name(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Megatron => "megatron",
            Format::Npy => "npy",
            Format::Arrow => "arrow",
            Format::WebDataset => "webdataset",
        }
    }

    /// The file extension its shards are found by in `dataset.dir`.
    pub fn extension(self) -> &'static str {
        match self {
            Format::Megatron => ".idx",
            Format::Npy => ".npy",
            Format::Arrow => ".arrow",
            Format::Raw => ".bin",
            Format::WebDataset => ".tar",
        }
    }
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "raw" => Format::Raw,
            "megatron" => Format::Megatron,
            "npy" => Format::Npy,
            "arrow" => Format::Arrow,
            "webdataset" => Format::WebDataset,
            o => {
                return Err(format!(
                    "unknown format {o:?}: expected raw, megatron, npy, arrow or webdataset"
                ));
            }
        })
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The one format dispatch: builds the index of `paths` (local or `ub://`, whatever `opener` reads).
pub fn index(
    format: Format,
    paths: &[PathBuf],
    opener: &dyn Opener,
    dtype: Dtype,
    record_len: u64,
    column: &str,
) -> Result<index::DatasetIndex, FormatError> {
    let idx = match format {
        Format::Raw => {
            let sized = paths
                .iter()
                .map(|p| Ok((p.clone(), opener.size(p)?)))
                .collect::<Result<Vec<_>, FormatError>>()?;
            raw::open_sized(&sized, dtype, record_len)?
        }
        Format::Megatron => megatron::open_with(paths, opener)?,
        Format::Npy => {
            let mut files = open_all(paths, opener)?;
            npy::open_readers(&mut files)?
        }
        // Local Arrow and WebDataset shards: the samples cache beside the first shard, mapped.
        Format::Arrow if opener.is_local() => samples_cache::cached(format, column, paths, || {
            arrow::open_readers(&mut open_all(paths, opener)?, column)
        })?,
        Format::WebDataset if opener.is_local() => {
            samples_cache::cached(format, column, paths, || {
                webdataset::open_readers(&mut open_all(paths, opener)?, column)
            })?
        }
        Format::Arrow => {
            let mut files = open_all(paths, opener)?;
            arrow::open_readers(&mut files, column)?
        }
        Format::WebDataset => {
            let mut files = open_all(paths, opener)?;
            webdataset::open_readers(&mut files, column)?
        }
    };
    idx.validate()?;
    Ok(idx)
}

pub(crate) type Opened<'a> = Vec<(PathBuf, u64, Box<dyn ShardFile + 'a>)>;

/// Opens every path through `opener`: (path, size, file).
pub(crate) fn open_all<'a>(
    paths: &[PathBuf],
    opener: &'a dyn Opener,
) -> Result<Opened<'a>, FormatError> {
    paths
        .iter()
        .map(|p| {
            let f = opener.open(p)?;
            Ok((p.clone(), f.size(), f))
        })
        .collect()
}
