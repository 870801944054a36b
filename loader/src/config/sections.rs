//! The sections of a run configuration (`[dataset]`, `[loader]`, …, `[object_store]`, `[cache]`)
//! and the byte sizes they are written in.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{ConfigError, read_token_file};

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
    type Error = SizeError;
    fn try_from(v: SizeRepr) -> Result<Self, SizeError> {
        match v {
            SizeRepr::Int(n) => Ok(ByteSize(n)),
            SizeRepr::Str(s) => parse_size(&s).map(ByteSize),
        }
    }
}

/// A size string that is not one (`"4 parsecs"`), named as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// No number at the start.
    #[error("invalid size {0:?}: expected e.g. 4096, \"256KiB\", \"4MiB\"")]
    NotANumber(String),
    /// A unit other than B, KiB, MiB, GiB, TiB (or K, M, G, T).
    #[error("invalid size unit {unit:?} in {text:?}: use B, KiB, MiB, GiB or TiB")]
    Unit {
        /// The unit as written.
        unit: String,
        /// The whole size as written.
        text: String,
    },
    /// More bytes than 64 bits hold.
    #[error("size {0:?} overflows")]
    Overflow(String),
}

/// Parses `"4MiB"`-style sizes (KiB, MiB, GiB, TiB, or plain bytes; `K`/`M`/`G` also mean binary units).
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| SizeError::NotANumber(s.to_string()))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" | "k" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        u => {
            return Err(SizeError::Unit {
                unit: u.to_string(),
                text: s.to_string(),
            });
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| SizeError::Overflow(s.to_string()))
}

/// `[dataset]`
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DatasetSection {
    /// `raw | megatron | npy | arrow | webdataset`.
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
    /// GPT mode: Megatron's per-sample tensors made with each batch (`[dataset.tensors]`).
    pub tensors: Option<crate::gpt::masks::TensorsConfig>,
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
            tensors: None,
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
    /// Ranks of this node (else `LOCAL_WORLD_SIZE`, else 1): they share `pool.page_cache_budget`,
    /// each pinning its share of the shards (docs/multi-gpu.md).
    pub local_world_size: Option<usize>,
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
            local_world_size: None,
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
    /// Shards on several devices (file systems): each free staging block goes to a read of the
    /// device with the fewest in flight, across the chunks ahead (`false`: plan order).
    pub balance_devices: bool,
    /// Local shards kept open at once (`engine.io = "file"`): with more shards than this, each is
    /// opened at its first read and the least recently used are closed; 0 = from the descriptor
    /// limit (a quarter of `RLIMIT_NOFILE` less 256, at most 16,384).
    pub max_open_shards: usize,
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
            balance_devices: true,
            max_open_shards: 0,
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
    /// Staging blocks (0 = 24 with GPU batches, or 64 / `LOCAL_WORLD_SIZE` between 8 and 24 for
    /// one of several ranks of a node; 64 with host batches).
    pub staging_blocks: usize,
    /// GPU batches: staging blocks an epoch cycles through when most of its bytes are cold and
    /// read with O_DIRECT (the rest stay free, held back, for that epoch). 0 = 12 when
    /// `staging_blocks` is left at 0, else all of them (docs/decisions.md, "Cold staging depth").
    pub cold_staging_blocks: usize,
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
    type Error = SizeError;
    fn try_from(v: SizeRepr) -> Result<Self, SizeError> {
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
            cold_staging_blocks: 0,
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

/// `[object_store]`: how to reach `s3://`, `gs://`, `az://` and `https://` shards. Empty strings
/// leave a value to the usual environment of the store (`AWS_*`, `GOOGLE_*`, `AZURE_*`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ObjectStoreSection {
    /// Endpoint URL of an S3-compatible store (`http://127.0.0.1:9000`) or of Azure's blob service
    /// (`http://127.0.0.1:10000/devstoreaccount1`); empty: the cloud's own.
    pub endpoint: String,
    /// Region; empty: `AWS_REGION` / `AWS_DEFAULT_REGION`, else `us-east-1`.
    pub region: String,
    /// Allow `http://` endpoints (a local or loopback store).
    pub allow_http: bool,
    /// Access key id; empty: from the environment.
    pub access_key_id: String,
    /// Secret access key; empty: from the environment.
    pub secret_access_key: String,
    /// Largest ranged GET; a read larger than this is split into GETs issued at once.
    pub max_request: ByteSize,
    /// `gs://`: path of a service-account JSON file; empty: `GOOGLE_SERVICE_ACCOUNT` /
    /// `GOOGLE_APPLICATION_CREDENTIALS` (its `gcs_base_url` names another endpoint, an emulator's).
    pub google_service_account: String,
    /// `az://`: the storage account; empty: `AZURE_STORAGE_ACCOUNT_NAME`.
    pub azure_account: String,
    /// `az://`: the account's access key; empty: `AZURE_STORAGE_ACCOUNT_KEY` (or another credential
    /// of the environment).
    pub azure_key: String,
    /// Smallest planned read of an object dataset: the planner's `min_read` is the larger of this and
    /// `loader.min_read` (capped at `loader.max_read`), so an object store gets few large ranged GETs
    /// without the user raising `loader.min_read`; 0 leaves `loader.min_read` alone.
    pub min_read: ByteSize,
    /// Most ranged GETs in flight at once without a cache (0: no bound); the pipeline then keeps
    /// twice as many chunks ahead (at least `loader.prefetch`), so that reads finished out of order
    /// do not leave GETs unissued while they wait for the chunk before them.
    pub max_in_flight: usize,
    /// The cost estimate's latency of one request, in ms (docs/object-store.md, "What an epoch
    /// will cost"): the summary's predicted time is requests × this ÷ the GETs in flight.
    pub estimate_request_ms: f64,
    /// The cost estimate's bandwidth from the store, in GB/s.
    pub estimate_gbps: f64,
    /// Price of 1,000 GET requests, in dollars, for the summary's predicted and realised cost
    /// (S3 Standard's in 2026: 0.0004).
    pub price_per_1k_requests: f64,
    /// Price of a GB (10⁹ bytes) from the store, in dollars (0: in-region, no transfer charge).
    pub price_per_gb: f64,
}

impl Default for ObjectStoreSection {
    fn default() -> Self {
        Self {
            endpoint: String::new(),
            region: String::new(),
            allow_http: false,
            access_key_id: String::new(),
            secret_access_key: String::new(),
            max_request: ByteSize(4 << 20),
            google_service_account: String::new(),
            azure_account: String::new(),
            azure_key: String::new(),
            min_read: ByteSize(4 << 20),
            max_in_flight: 32,
            estimate_request_ms: 20.0,
            estimate_gbps: 1.0,
            price_per_1k_requests: 0.0004,
            price_per_gb: 0.0,
        }
    }
}

/// `[cache]`: a local cache of object-store chunks, read back through the io_uring file source.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CacheSection {
    /// Directory of the cache (`~/` expanded); unset: no cache, every read is a ranged GET.
    pub dir: Option<PathBuf>,
    /// Bound of the cache's bytes (chunks, sidecars and files being written); least recently used
    /// chunks are evicted to stay within it.
    pub max_bytes: ByteSize,
    /// Size of a cached chunk (aligned ranges of an object, fetched and written whole).
    pub chunk_size: ByteSize,
    /// Chunks fetched ahead of the planner's order (beyond the reads in flight), at most half of
    /// `max_bytes`; 0: no prefetch.
    pub prefetch: usize,
    /// Decide with the plans of every rank of the node (`loader.local_world_size` ranks sharing this
    /// directory), not this rank's alone: a chunk another rank reads next is kept and fetched whole.
    pub node_plan: bool,
    /// Check a chunk's CRC again the first time each process reads it, even when its sidecar names
    /// the very file the writer checked (false: only chunks whose sidecar does not name them).
    pub recheck_chunks: bool,
    /// Share of `max_bytes` held in memory as windows of the plan's near future: a chunk not worth
    /// caching whole is fetched whole once and the parts this process reads next are kept (0: off;
    /// the chunk files get the rest). Unset: 1 in Megatron order (random over the dataset: chunk
    /// files are rarely read again soon), 0 otherwise (chunks read through, shared by the node).
    pub window_fraction: Option<f64>,
}

impl Default for CacheSection {
    fn default() -> Self {
        Self {
            dir: None,
            max_bytes: ByteSize(64 << 30),
            chunk_size: ByteSize(8 << 20),
            prefetch: 16,
            node_plan: true,
            recheck_chunks: false,
            window_fraction: None,
        }
    }
}
