//! The run configuration: one struct is the truth; TOML sets it (docs/configuration.md lists every
//! key and default, and a test checks the two agree).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The embedded default (`configs/default.toml`).
pub const DEFAULT_CONFIG: &str = include_str!("../../configs/default.toml");

/// Errors reading a config.
/// The longest `dataset.sequence_length`: a sample of `sequence_length + 1` tokens of up to 8 bytes
/// is one read, and reads are at most 1 GiB (`loader.max_read`).
pub const MAX_SEQUENCE_LENGTH: u32 = (1 << 27) - 1;
/// The most `dataset.num_samples` (2⁴⁰): Megatron's indices count tokens in `int64`.
pub const MAX_NUM_SAMPLES: u64 = 1 << 40;
/// The largest `dataset.blend[].weight` (weights are summed before they are normalized).
pub const MAX_BLEND_WEIGHT: f64 = 1e15;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The TOML is malformed or has unknown or mistyped keys.
    #[error("config {origin}: {source}")]
    Parse {
        /// The file, or `<embedded default>`.
        origin: String,
        /// The parser's error (with line and column).
        #[source]
        source: Box<toml::de::Error>,
    },
    /// A JSON config has a bad value.
    #[error("config {origin}: {path}: {source}")]
    Json {
        /// Where it came from.
        origin: String,
        /// The key path (`dataset.format`).
        path: String,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// A token or key file could not be read.
    #[error("{key} {}: {source}", path.display())]
    TokenFile {
        /// The key naming the file (`remote.token_file`).
        key: String,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A value is out of range.
    #[error("config {origin}: {key}: {reason}")]
    Invalid {
        /// The file, or `<embedded default>`.
        origin: String,
        /// The key.
        key: &'static str,
        /// Why.
        reason: String,
    },
}

/// A byte size: an integer, or a string with a unit (`"256KiB"`, `"4MiB"`, `"1GiB"`, `"512"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "SizeRepr")]
pub struct ByteSize(pub u64);

impl std::fmt::Display for ByteSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0;
        for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
            if n >= 1 << shift && n.is_multiple_of(1 << shift) {
                return write!(f, "{}{unit}", n >> shift);
            }
        }
        if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
            return write!(f, "{}KiB", n >> 10);
        }
        write!(f, "{n}")
    }
}

impl Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SizeRepr {
    Int(u64),
    Str(String),
}

impl TryFrom<SizeRepr> for ByteSize {
    type Error = String;
    fn try_from(v: SizeRepr) -> Result<Self, String> {
        match v {
            SizeRepr::Int(n) => Ok(ByteSize(n)),
            SizeRepr::Str(s) => parse_size(&s).map(ByteSize),
        }
    }
}

/// Parses `"4MiB"`-style sizes (KiB, MiB, GiB, TiB, or plain bytes; `K`/`M`/`G` also mean binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected e.g. 4096, \"256KiB\", \"4MiB\""))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" | "k" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        u => {
            return Err(format!(
                "invalid size unit {u:?} in {s:?}: use B, KiB, MiB, GiB or TiB"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} overflows"))
}

/// `[dataset]`
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DatasetSection {
    /// `raw | megatron | npy | arrow`.
    pub format: crate::formats::Format,
    /// Directory holding the shards (all files of the format's extension, sorted). `~/` is expanded.
    pub dir: Option<PathBuf>,
    /// Shard files (Megatron: prefixes or `.bin`/`.idx` paths); overrides `dir`.
    pub paths: Vec<PathBuf>,
    /// Element type (`raw`).
    pub dtype: crate::formats::Dtype,
    /// Elements per record (`raw`).
    pub record_len: u64,
    /// Column (`arrow`).
    pub column: String,
    /// Check every delivered sample against the CRC sidecars written by `ubdirect index`.
    pub verify_crc: bool,
    /// Generate a synthetic dataset in `dir` if it holds no shards. Off by default: a `dir` without
    /// shards is then an error naming it (the embedded default config and the sample configs ask).
    pub generate: bool,
    /// Samples of the generated dataset.
    pub generate_samples: u64,
    /// Shards of the generated dataset.
    pub generate_shards: u32,
    /// GPT mode when at least 1: every sample is `sequence_length + 1` tokens packed across the
    /// dataset's sequences (Megatron `GPTDataset` windows); 0 delivers whole samples.
    pub sequence_length: u32,
    /// GPT mode: samples carry one extra token (Megatron's `add_extra_token_to_sequence`).
    pub add_extra_token: bool,
    /// GPT mode, `loader.order = "megatron"`: samples to build (Megatron's train samples; more
    /// than one epoch of documents makes several). 0 = one epoch. Whole epochs of documents are
    /// built and delivered, as Megatron does: the run summary explains an epoch larger than this.
    pub num_samples: u64,
    /// GPT mode: Megatron's split string (`"969,30,1"`): train, valid and test documents.
    pub split: String,
    /// GPT mode: the part of `split` to read: `train | valid | test`.
    pub split_part: crate::gpt::SplitPart,
    /// GPT mode, `loader.order = "megatron"`: keep the built indices of a local Megatron dataset in
    /// a file beside its (first shard's) `.idx` and map them at the next start (rebuilt when any
    /// shard or the settings change; a dataset it cannot key is a recorded fallback).
    pub gpt_index_cache: bool,
    /// GPT mode: a weighted blend of datasets (`[[dataset.blend]]` entries); replaces `paths`/`dir`.
    pub blend: Vec<crate::gpt::BlendEntry>,
    /// Arrow: several columns of one row as one sample's parts (`["input_ids", "labels"]`), copied
    /// back to back (each part 8-byte aligned); replaces `column`. Empty: `column` alone.
    pub columns: Vec<String>,
}

impl Default for DatasetSection {
    fn default() -> Self {
        Self {
            format: crate::formats::Format::Raw,
            dir: Some(PathBuf::from("~/.cache/ubdirect/default-raw")),
            paths: Vec::new(),
            dtype: crate::formats::Dtype::U16,
            record_len: 2048,
            column: "payload".into(),
            verify_crc: false,
            generate: false,
            generate_samples: 16384,
            generate_shards: 4,
            sequence_length: 0,
            add_extra_token: true,
            num_samples: 0,
            split: "100,0,0".into(),
            split_part: crate::gpt::SplitPart::Train,
            gpt_index_cache: true,
            blend: Vec::new(),
            columns: Vec::new(),
        }
    }
}

/// `[loader]`
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LoaderSection {
    /// Samples per batch.
    pub batch_size: usize,
    /// Base seed of the shuffles.
    pub seed: u64,
    /// Shuffle (block-level plus in-window).
    pub shuffle: bool,
    /// Bytes of consecutive samples shuffled as one block.
    pub shuffle_block: ByteSize,
    /// Samples per in-window shuffle (0 = one batch).
    pub window: usize,
    /// `drop | pad`: what happens to samples that do not fill a batch on every rank.
    pub remainder: crate::planner::Remainder,
    /// Reads are widened to at least this (0 disables).
    pub min_read: ByteSize,
    /// Largest gap bridged when merging samples into one read.
    pub max_gap: ByteSize,
    /// Largest read.
    pub max_read: ByteSize,
    /// Most consecutive batches that share one set of reads (so small batches still read big blocks).
    pub max_chunk_batches: usize,
    /// Batches are grouped into a chunk until it holds this many bytes (and `min_read`), at most
    /// `max_chunk_batches`: small samples still travel in large chunks.
    pub chunk_bytes: ByteSize,
    /// Chunks of batches prepared ahead of the consumer.
    pub prefetch: usize,
    /// Threads of the loader's async runtime (reads, checks and copies are driven from them).
    pub threads: usize,
    /// Host device: copy each chunk's reads into one host block so every batch is one buffer (what
    /// DLPack consumers need). Costs one memcpy; GPU batches are always one block.
    pub contiguous_batches: bool,
    /// Epochs `ubdirect run` runs.
    pub epochs: u64,
    /// This process's rank (else `RANK`, else 0).
    pub rank: Option<usize>,
    /// World size (else `WORLD_SIZE`, else 1).
    pub world_size: Option<usize>,
    /// Deadline for the next batch, in milliseconds.
    pub batch_timeout_ms: u64,
    /// `block | megatron`: ubdirect's block + window shuffle, or (GPT mode) Megatron-Core's order.
    pub order: crate::gpt::Order,
}

impl Default for LoaderSection {
    fn default() -> Self {
        Self {
            batch_size: 64,
            seed: 0,
            shuffle: true,
            shuffle_block: ByteSize(4 << 20),
            window: 0,
            remainder: crate::planner::Remainder::Drop,
            min_read: ByteSize(1 << 20),
            max_gap: ByteSize(64 << 10),
            max_read: ByteSize(4 << 20),
            max_chunk_batches: 16,
            chunk_bytes: ByteSize(4 << 20),
            prefetch: 16,
            threads: 4,
            contiguous_batches: false,
            epochs: 1,
            rank: None,
            world_size: None,
            batch_timeout_ms: 60_000,
            order: crate::gpt::Order::Block,
        }
    }
}

/// `[device]`
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DeviceSection {
    /// `auto | cuda | host`.
    pub select: ubdirect_ub::DeviceSelection,
    /// CUDA ordinal (else `LOCAL_RANK`, else 0).
    pub ordinal: Option<usize>,
}

impl Default for DeviceSection {
    fn default() -> Self {
        Self {
            select: ubdirect_ub::DeviceSelection::Auto,
            ordinal: None,
        }
    }
}

/// `[engine]`
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    /// io_uring rings.
    pub rings: usize,
    /// Reads in flight per ring.
    pub queue_depth: u32,
    /// Kernel submission polling.
    pub sqpoll: bool,
    /// `auto | on | off`.
    pub direct: ubdirect_nvme::DirectMode,
    /// Deadline of one read in milliseconds.
    pub op_timeout_ms: u64,
    /// `file` (io_uring on the file), `nvme` (NVMe passthrough of the file's extents; an error for a
    /// file not on an NVMe namespace), `auto` (passthrough where possible, file path elsewhere).
    pub io: IoMode,
    /// Buffered reads run on io_uring's worker threads (several copies at once per ring).
    pub async_buffered: bool,
    /// Warm (page-cache) ranges are copied into staging by a pool of threads with `pread`
    /// (`false`: io_uring's buffered reads).
    pub thread_copies: bool,
    /// Threads of that pool; 0 = one per online CPU (at most 64).
    pub copy_threads: usize,
}

impl Default for EngineSection {
    fn default() -> Self {
        // One truth: the engine's own defaults.
        let e = ubdirect_nvme::EngineConfig::default();
        Self {
            rings: e.rings,
            queue_depth: e.queue_depth,
            sqpoll: e.sqpoll,
            direct: e.direct,
            op_timeout_ms: e.op_timeout.as_millis() as u64,
            io: IoMode::File,
            async_buffered: e.async_buffered,
            thread_copies: e.thread_copies,
            copy_threads: e.copy_threads,
        }
    }
}

/// `engine.io`: how local shards are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IoMode {
    /// io_uring on the file.
    #[default]
    File,
    /// NVMe passthrough of the file's extents; an error for a file not on an NVMe namespace.
    Nvme,
    /// Passthrough where possible, the file path elsewhere (counted as a fallback).
    Auto,
}

/// `remote.transport`: how `ub://` payloads travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// On the TCP stream, received straight into the lease.
    #[default]
    Tcp,
    /// One-sided RDMA WRITE into registered leases (build with `--features rdma`).
    Rdma,
}

/// `[pool]`
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PoolSection {
    /// Bytes per staging block (reads land here): at least `loader.max_read` + 4 KiB.
    pub staging_block_size: ByteSize,
    /// Staging blocks.
    pub staging_blocks: usize,
    /// Bytes per batch block in device memory (a whole batch's reads land in one).
    pub batch_block_size: ByteSize,
    /// Device batch blocks (0 = `loader.prefetch` + 2).
    pub batch_blocks: usize,
    /// NUMA node to bind host blocks to.
    pub numa_node: Option<u32>,
    /// Deadline of one acquire in milliseconds.
    pub acquire_timeout_ms: u64,
    /// The page cache as a pool: shard files mapped read-only and registered (pinned) with the
    /// device, GPU copies straight out of them. `"auto"` = a quarter of RAM (capped by
    /// RLIMIT_MEMLOCK without CAP_IPC_LOCK), a size, or `0` (off).
    pub page_cache_budget: PageCacheBudget,
    /// When resident shards are registered: `auto` (in the background, paced, once the run reads
    /// them again; never before a first batch), `eager` (at the start of every epoch), `never`.
    pub page_cache_register: RegisterPolicy,
}

/// `pool.page_cache_register`: when the page cache's shards are registered with the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RegisterPolicy {
    /// In the background, one shard at a time and paced, once the run reads them again
    /// (`loader.epochs` > 1 or a second epoch); warm reads are copies until then.
    #[default]
    Auto,
    /// Every resident shard at the start of each epoch, before its first batch.
    Eager,
    /// Never: warm reads are copies.
    Never,
}

/// `pool.page_cache_budget`: `"auto"` or a size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "SizeRepr", into = "String")]
pub enum PageCacheBudget {
    /// A quarter of RAM, capped by RLIMIT_MEMLOCK when the process may not lock more.
    Auto,
    /// At most this many bytes (0: off).
    Bytes(u64),
}

impl TryFrom<SizeRepr> for PageCacheBudget {
    type Error = String;
    fn try_from(v: SizeRepr) -> Result<Self, String> {
        match v {
            SizeRepr::Str(s) if s == "auto" => Ok(PageCacheBudget::Auto),
            other => ByteSize::try_from(other).map(|b| PageCacheBudget::Bytes(b.0)),
        }
    }
}

impl From<PageCacheBudget> for String {
    fn from(b: PageCacheBudget) -> String {
        match b {
            PageCacheBudget::Auto => "auto".into(),
            PageCacheBudget::Bytes(n) => ByteSize(n).to_string(),
        }
    }
}

impl Default for PoolSection {
    fn default() -> Self {
        Self {
            staging_block_size: ByteSize((4 << 20) + (64 << 10)),
            staging_blocks: 0,
            batch_block_size: ByteSize(16 << 20),
            batch_blocks: 0,
            numa_node: None,
            acquire_timeout_ms: 30_000,
            page_cache_budget: PageCacheBudget::Auto,
            page_cache_register: RegisterPolicy::Auto,
        }
    }
}

/// Default `remote.connections` (docs/decisions.md: "Several connections per `ub://` client").
pub const DEFAULT_REMOTE_CONNECTIONS: usize = 2;

/// `[remote]`: how to reach `ub://` shards.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RemoteSection {
    /// The servers' token (prefer `token_file`).
    pub token: String,
    /// A file holding the token (first line).
    pub token_file: Option<PathBuf>,
    /// Deadline of one remote request, reconnects and retries included, in milliseconds.
    pub deadline_ms: u64,
    /// How payloads travel: `tcp`, or `rdma` (one-sided RDMA WRITE into the staging pool; needs a
    /// build with `--features rdma` and a server with `rdma_device`).
    pub transport: TransportKind,
    /// RDMA device (`rxe0`); the first device when empty.
    pub rdma_device: String,
    /// Connections to each server set, reads spread over them round robin (each its own stream
    /// and receiving task: one stream is received on one core at a time).
    pub connections: usize,
}

impl Default for RemoteSection {
    fn default() -> Self {
        Self {
            token: String::new(),
            token_file: None,
            deadline_ms: 30_000,
            transport: TransportKind::Tcp,
            rdma_device: String::new(),
            connections: DEFAULT_REMOTE_CONNECTIONS,
        }
    }
}

impl RemoteSection {
    /// The token, from `token_file` if set.
    pub fn token(&self) -> Result<String, ConfigError> {
        match &self.token_file {
            Some(p) => read_token_file(p, "remote.token_file"),
            None => Ok(self.token.clone()),
        }
    }
}

/// `[metrics]`
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSection {
    /// Serve Prometheus metrics on this address (e.g. `127.0.0.1:9100`); unset = off.
    pub listen: Option<String>,
}

/// A whole run configuration.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// `[dataset]`
    pub dataset: DatasetSection,
    /// `[loader]`
    pub loader: LoaderSection,
    /// `[device]`
    pub device: DeviceSection,
    /// `[engine]`
    pub engine: EngineSection,
    /// `[pool]`
    pub pool: PoolSection,
    /// `[metrics]`
    pub metrics: MetricsSection,
    /// `[remote]`
    pub remote: RemoteSection,
    /// `[object_store]` (`s3://` shards)
    pub object_store: crate::objstore::ObjectStoreSection,
    /// `[cache]` (local cache of object-store chunks)
    pub cache: crate::objstore::CacheSection,
}

/// The first line of a token file (`~/` expanded), trimmed. The error names the key and the file.
/// Only a regular file is read (a FIFO would block), and at most 64 KiB of it.
pub fn read_token_file(p: &std::path::Path, key: &str) -> Result<String, ConfigError> {
    use std::io::Read;
    let path = expand_home(p);
    let err = |source| ConfigError::TokenFile {
        key: key.to_string(),
        path: path.clone(),
        source,
    };
    // Checked on the descriptor (O_NONBLOCK, fstat), so a FIFO swapped in after a check cannot block.
    let (f, _) = crate::formats::open_regular(&path).map_err(err)?;
    let mut text = String::new();
    f.take(64 << 10).read_to_string(&mut text).map_err(err)?;
    Ok(text.lines().next().unwrap_or("").trim().to_string())
}

/// Expands a leading `~/` with `$HOME` (or `/tmp` when unset).
pub fn expand_home(p: &std::path::Path) -> PathBuf {
    match p.to_str().and_then(|s| s.strip_prefix("~/")) {
        Some(rest) => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into())).join(rest)
        }
        None => p.to_path_buf(),
    }
}

/// The largest config file read (a larger one is refused, not read).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// The largest `loader.prefetch` (batches decoded ahead; each holds a batch block).
pub const MAX_PREFETCH: usize = 1 << 16;
/// The largest `loader.max_read` (a staging block holds one read; io_uring registers ≤ 1 GiB).
pub const MAX_READ: u64 = 1 << 30;
/// The most blocks a pool may have.
pub const MAX_POOL_BLOCKS: usize = 1 << 20;

impl RunConfig {
    /// Parses and validates TOML; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let cfg: RunConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            origin: origin.to_string(),
            source: Box::new(e),
        })?;
        cfg.validate(origin)?;
        Ok(cfg)
    }

    /// Parses and validates JSON (the Python package's config dicts); errors name the key path
    /// (`dataset.format: unknown variant …`).
    pub fn from_json(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let mut de = serde_json::Deserializer::from_str(text);
        let cfg: RunConfig =
            serde_path_to_error::deserialize(&mut de).map_err(|e| ConfigError::Json {
                origin: origin.to_string(),
                path: e.path().to_string(),
                source: e.into_inner(),
            })?;
        cfg.validate(origin)?;
        Ok(cfg)
    }

    /// Reads a config file, or the embedded default when `path` is `None`.
    pub fn load(path: Option<&std::path::Path>) -> Result<Self, ConfigError> {
        match path {
            None => Self::from_toml(DEFAULT_CONFIG, "<embedded default>"),
            Some(p) => {
                let err = |source| ConfigError::Read {
                    path: p.to_path_buf(),
                    source,
                };
                // A regular file only (a FIFO would block, a device never end), of bounded size.
                let bytes = crate::formats::read_regular(p, MAX_CONFIG_BYTES).map_err(err)?;
                let text = String::from_utf8(bytes)
                    .map_err(|e| err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
                Self::from_toml(&text, &p.display().to_string())
            }
        }
    }

    /// Checks every value that can be checked without touching files.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let bad = |key, reason: String| {
            Err(ConfigError::Invalid {
                origin: origin.to_string(),
                key,
                reason,
            })
        };
        if self.dataset.format == crate::formats::Format::Raw && self.dataset.record_len == 0 {
            return bad("dataset.record_len", "must be at least 1".into());
        }
        if self.dataset.dir.is_none() && self.dataset.paths.is_empty() {
            return bad("dataset.dir", "set dataset.dir or dataset.paths".into());
        }
        if self.loader.batch_size == 0 || self.loader.batch_size > crate::planner::MAX_BATCH_SIZE {
            return bad(
                "loader.batch_size",
                format!(
                    "{} (expected 1..={})",
                    self.loader.batch_size,
                    crate::planner::MAX_BATCH_SIZE
                ),
            );
        }
        if let Some(w) = self.loader.world_size
            && (w == 0 || w > crate::planner::MAX_WORLD_SIZE)
        {
            return bad(
                "loader.world_size",
                format!("{w} (expected 1..={})", crate::planner::MAX_WORLD_SIZE),
            );
        }
        if self.loader.max_chunk_batches == 0 {
            return bad("loader.max_chunk_batches", "must be at least 1".into());
        }
        if self.remote.connections == 0 || self.remote.connections > 64 {
            return bad(
                "remote.connections",
                format!("{} (expected 1..=64)", self.remote.connections),
            );
        }
        if self.loader.threads == 0 || self.loader.threads > 256 {
            return bad(
                "loader.threads",
                format!("{} (expected 1..=256)", self.loader.threads),
            );
        }
        if self.loader.prefetch == 0 || self.loader.prefetch > MAX_PREFETCH {
            return bad(
                "loader.prefetch",
                format!("{} (expected 1..={MAX_PREFETCH})", self.loader.prefetch),
            );
        }
        if self.loader.min_read.0 > self.loader.max_read.0
            || self.loader.max_read.0 < 4096
            || self.loader.max_read.0 > MAX_READ
        {
            return bad(
                "loader.max_read",
                format!(
                    "{} must be in 4096..={MAX_READ} and >= loader.min_read ({})",
                    self.loader.max_read.0, self.loader.min_read.0
                ),
            );
        }
        if self.pool.staging_block_size.0 < self.loader.max_read.0 + 4096 {
            return bad(
                "pool.staging_block_size",
                format!(
                    "{} must hold loader.max_read ({}) plus 4 KiB of alignment",
                    self.pool.staging_block_size.0, self.loader.max_read.0
                ),
            );
        }
        let staging =
            (self.pool.staging_blocks.max(64) as u64).checked_mul(self.pool.staging_block_size.0);
        let memory = crate::formats::memory_total();
        if staging.is_none_or(|b| b > memory) {
            return bad(
                "pool.staging_blocks",
                format!(
                    "{} × pool.staging_block_size {} is more than this machine's memory ({memory} bytes)",
                    self.pool.staging_blocks, self.pool.staging_block_size.0
                ),
            );
        }
        if self.pool.batch_blocks > MAX_POOL_BLOCKS {
            return bad(
                "pool.batch_blocks",
                format!(
                    "{} (expected 0..={MAX_POOL_BLOCKS})",
                    self.pool.batch_blocks
                ),
            );
        }
        if let (Some(r), Some(w)) = (self.loader.rank, self.loader.world_size)
            && r >= w
        {
            return bad(
                "loader.rank",
                format!("{r} is not below loader.world_size {w}"),
            );
        }
        if self.pool.acquire_timeout_ms == 0
            || self.engine.op_timeout_ms == 0
            || self.loader.batch_timeout_ms == 0
        {
            return bad("*_timeout_ms", "deadlines must be positive".into());
        }
        // GPT sizes multiply (tokens × bytes per token, samples × tokens, weights summed): each is
        // bounded where the product still fits, so nothing wraps into an empty or wrong dataset.
        if self.dataset.sequence_length > MAX_SEQUENCE_LENGTH {
            return bad(
                "dataset.sequence_length",
                format!(
                    "{} (expected 0..={MAX_SEQUENCE_LENGTH}: a sample of sequence_length + 1 tokens of up to 8 bytes is one read of at most 1 GiB)",
                    self.dataset.sequence_length
                ),
            );
        }
        if self.dataset.num_samples > MAX_NUM_SAMPLES {
            return bad(
                "dataset.num_samples",
                format!(
                    "{} (expected 0..={MAX_NUM_SAMPLES}; 0: one epoch)",
                    self.dataset.num_samples
                ),
            );
        }
        for (i, b) in self.dataset.blend.iter().enumerate() {
            if !(b.weight.is_finite() && b.weight > 0.0 && b.weight <= MAX_BLEND_WEIGHT) {
                return Err(ConfigError::Invalid {
                    origin: origin.to_string(),
                    key: "dataset.blend.weight",
                    reason: format!(
                        "dataset.blend[{i}].weight = {} (expected a number in (0, {MAX_BLEND_WEIGHT:e}]; weights are normalized over the entries)",
                        b.weight
                    ),
                });
            }
        }
        if let Some(l) = &self.metrics.listen
            && l.parse::<std::net::SocketAddr>().is_err()
        {
            return bad(
                "metrics.listen",
                format!("{l:?} is not an address like 127.0.0.1:9100"),
            );
        }
        Ok(())
    }

    /// The engine configuration this run asks for.
    pub fn engine_config(&self) -> ubdirect_nvme::EngineConfig {
        ubdirect_nvme::EngineConfig {
            rings: self.engine.rings,
            queue_depth: self.engine.queue_depth,
            sqpoll: self.engine.sqpoll,
            direct: self.engine.direct,
            op_timeout: Duration::from_millis(self.engine.op_timeout_ms),
            async_buffered: self.engine.async_buffered,
            thread_copies: self.engine.thread_copies,
            copy_threads: self.engine.copy_threads,
            ..ubdirect_nvme::EngineConfig::default()
        }
    }

    /// The planner configuration.
    pub fn plan_config(&self) -> crate::planner::PlanConfig {
        let l = &self.loader;
        crate::planner::PlanConfig {
            batch_size: l.batch_size,
            seed: l.seed,
            shuffle: l.shuffle,
            shuffle_block: l.shuffle_block.0,
            window: l.window,
            remainder: l.remainder,
            min_read: l.min_read.0,
            max_gap: l.max_gap.0,
            max_read: l.max_read.0,
            align: 4096,
            max_chunk_batches: l.max_chunk_batches,
            chunk_bytes: l.chunk_bytes.0,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn embedded_default_equals_struct_defaults() {
        let mut parsed = RunConfig::from_toml(DEFAULT_CONFIG, "default").expect("default parses");
        // The one deliberate difference: the embedded default asks for its synthetic dataset; the
        // library default does not (a typo'd dataset.dir is an error, never synthetic data).
        assert!(
            parsed.dataset.generate,
            "configs/default.toml asks for generation"
        );
        assert!(!RunConfig::default().dataset.generate);
        parsed.dataset.generate = false;
        assert_eq!(
            parsed,
            RunConfig::default(),
            "configs/default.toml and the Default impls disagree"
        );
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("256KiB"), Ok(256 << 10));
        assert_eq!(parse_size("512"), Ok(512));
        assert!(parse_size("4 parsecs").is_err());
        assert!(parse_size("99999999999TiB").is_err());
    }

    #[test]
    fn unknown_keys_and_bad_values_are_clear_errors() {
        let e = RunConfig::from_toml("[engine]\nqueue_dept = 3\n", "t").unwrap_err();
        assert!(e.to_string().contains("queue_dept"), "{e}");
        // Enums are checked by serde: the error points at the line and lists what is allowed.
        let e = RunConfig::from_toml("[device]\nselect = \"tpu\"\n", "t").unwrap_err();
        assert!(e.to_string().contains("select = \"tpu\""), "{e}");
        assert!(e.to_string().contains("`auto`, `cuda`"), "{e}");
        let e = RunConfig::from_toml("[loader]\nmax_read = \"8MiB\"\n", "t").unwrap_err();
        assert!(e.to_string().contains("pool.staging_block_size"), "{e}");
        let e = RunConfig::from_toml("[dataset]\nformat = \"parquet\"\n", "t").unwrap_err();
        assert!(e.to_string().contains("format = \"parquet\""), "{e}");
        assert!(e.to_string().contains("`megatron`"), "{e}");
        let e = RunConfig::from_toml("[dataset]\ndtype = \"u17\"\n", "t").unwrap_err();
        assert!(e.to_string().contains("unknown dtype \"u17\""), "{e}");
        let e = RunConfig::from_toml("[loader]\nbatch_size = -1\n", "t").unwrap_err();
        assert!(e.to_string().contains("batch_size"), "{e}");
        let e = RunConfig::from_toml("[loader]\nrank = 3\nworld_size = 2\n", "t").unwrap_err();
        assert!(e.to_string().contains("loader.rank"), "{e}");
    }

    #[test]
    fn json_errors_name_the_key_path() {
        let e = RunConfig::from_json(r#"{"dataset": {"format": "parquet"}}"#, "t").unwrap_err();
        assert!(e.to_string().contains("dataset.format"), "{e}");
        let e = RunConfig::from_json(r#"{"engine": {"queue_dept": 3}}"#, "t").unwrap_err();
        assert!(e.to_string().contains("queue_dept"), "{e}");
        let c = RunConfig::from_json(r#"{"engine": {"io": "auto"}}"#, "t").unwrap();
        assert_eq!(c.engine.io, IoMode::Auto);
    }

    #[test]
    fn docs_list_every_key_with_its_default() {
        let doc = include_str!("../../docs/configuration.md");
        // Every key of the struct, with its default as written in the docs' table.
        let d = RunConfig::default();
        let v = toml::Value::try_from(&d).expect("serializable");
        let mut rows = Vec::new();
        if let toml::Value::Table(sections) = v {
            for (sec, t) in sections {
                if let toml::Value::Table(t) = t {
                    for (k, val) in t {
                        rows.push((format!("{sec}.{k}"), val.to_string()));
                    }
                }
            }
        }
        // Keys whose default is "unset" do not serialize.
        for key in [
            "device.ordinal",
            "loader.rank",
            "loader.world_size",
            "pool.numa_node",
            "metrics.listen",
            "cache.dir",
        ] {
            rows.push((key.to_string(), "unset".to_string()));
        }
        assert!(rows.len() >= 38, "only {} keys found", rows.len());
        for (key, default) in rows {
            let row = format!("| `{key}` | `{default}` |");
            assert!(
                doc.contains(&row),
                "docs/configuration.md lacks the row {row}"
            );
        }
    }
}
