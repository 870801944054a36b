//! The loader's error type: one enum for every layer above the formats (shards, planning, the
//! pipeline), so that the shard layer below the pipeline returns it without importing the pipeline.

use std::path::PathBuf;
use std::time::Duration;

use ubdirect_nvme::IoError;
use ubdirect_ub::{DeviceError, SourceError, UbError};

use crate::config::ConfigError;
use crate::formats::FormatError;
use crate::gpt::GptError;
use crate::planner::PlanError;

/// Errors from the loader. Each names the shard, sample or key concerned.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The dataset could not be indexed.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The epoch could not be planned.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A pool could not be made, or a block was not free in time.
    #[error(transparent)]
    Pool(#[from] UbError),
    /// The device failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The engine could not start, or a shard could not be opened.
    #[error(transparent)]
    Io(#[from] IoError),
    /// A read failed (the source names the shard, offset and length; its cause is kept).
    #[error(transparent)]
    Read(#[from] SourceError),
    /// A delivered sample does not match its CRC sidecar.
    #[error(
        "CRC mismatch: sample {sample} of {shard} at offset {offset} ({len} bytes): delivered {got:08x}, sidecar says {expected:08x}"
    )]
    Crc {
        /// Shard path.
        shard: PathBuf,
        /// Sample id.
        sample: u64,
        /// Offset in the shard.
        offset: u64,
        /// Length.
        len: u32,
        /// CRC of the delivered bytes.
        got: u32,
        /// CRC in the sidecar.
        expected: u32,
    },
    /// A remote shard could not be opened (refused, or no server within the deadline); the client's
    /// error is the source.
    #[error("remote: {0}")]
    Remote(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// No batch within the deadline.
    #[error("no batch within {0:?} (loader.batch_timeout_ms)")]
    Timeout(Duration),
    /// The configuration cannot run.
    #[error("config: {0}")]
    Config(String),
    /// A step record could not be written or read.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// The configuration is invalid (a key out of range, keys that contradict each other).
    #[error("config: {0}")]
    Invalid(#[from] ConfigError),
    /// The GPT settings and the dataset do not make samples.
    #[error("config: {0}")]
    Gpt(#[from] GptError),
    /// A batch's Megatron tensors (`[dataset.tensors]`) could not be made.
    #[error(transparent)]
    Tensors(#[from] crate::gpt::masks::TensorError),
    /// The loader's runtime (its tokio threads) could not start.
    #[error("config: cannot start the loader runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The blocking API was called on a current-thread tokio runtime, where waiting would stall
    /// the caller's own tasks.
    #[error(
        "config: the blocking loader API was called on a current-thread tokio runtime, where waiting would stall the caller's own tasks: use the async API (`Loader::stream`, `EpochIter::next_async`) or a multi-threaded runtime"
    )]
    CurrentThreadRuntime,
    /// A shard could not be opened by the path `engine.io` asks for (NVMe passthrough).
    #[error("config: engine.io = \"nvme\": {}: {source}", path.display())]
    OpenNvme {
        /// The shard.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A shard's size differs between indexing and opening (it is being written or replaced).
    #[error("config: {} changed size while opening ({indexed} bytes when indexed, {now} now)", path.display())]
    ShardChanged {
        /// The shard.
        path: PathBuf,
        /// Bytes when the dataset was indexed.
        indexed: u64,
        /// Bytes now.
        now: u64,
    },
    /// A dataset URL could not be parsed (`ub://…`, `s3://…`, …); `why` says what is wrong and
    /// what was expected.
    #[error("config: {why}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong, and the expected form.
        why: String,
    },
    /// An object-store client could not be made for a store (`[object_store]` settings).
    #[error("config: [object_store] for {store}: {source}")]
    ObjectStore {
        /// The store (`s3://bucket`, …).
        store: String,
        /// The client's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A listing found no objects of the dataset's format.
    #[error("config: no *{ext} objects under {dir}")]
    NoObjects {
        /// The prefix listed.
        dir: String,
        /// The extension looked for.
        ext: String,
    },
    /// The object-store cache directory could not be used.
    #[error("config: cache.dir {}: {source}", dir.display())]
    CacheDir {
        /// `cache.dir`.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Writing `--dump-samples` failed.
    #[error("config: --dump-samples{}: {source}", path.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default())]
    DumpSamples {
        /// The file, where known.
        path: Option<PathBuf>,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A sample index past the batch's end.
    #[error("config: sample {index} of a batch of {len}")]
    NoSample {
        /// The index asked for.
        index: usize,
        /// Samples in the batch.
        len: usize,
    },
    /// Host bytes asked of a batch in device memory.
    #[error("config: sample(): the batch is in device memory; use sample_to_vec or device_ptr")]
    OnDevice,
    /// A resume state does not belong to this loader.
    #[error("resume: {0}")]
    Resume(String),
    /// The pipeline stopped.
    #[error("pipeline stopped: {0}")]
    Closed(String),
    /// An object store refused or could not be asked, and no credentials were given: the error
    /// names the variables (or keys) to set.
    #[error(
        "{url}: no credentials were given, so the store client asked a metadata service; set {vars}"
    )]
    Credentials {
        /// The object or prefix.
        url: String,
        /// What to set.
        vars: &'static str,
        /// The store's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The consumer waits for a batch whose block only the consumer can free: every block of the
    /// pool is held by batches still alive (or by another epoch's iterator still open).
    #[error(
        "pool \"{pool}\": all {blocks} blocks are held by batches still alive (or by another epoch's iterator still open) while the next batch waits for one, so nothing can free a block; drop batches sooner (one block serves a chunk of up to loader.max_chunk_batches batches and stays held while any of them lives), close the other iterator, or raise {key} (now {blocks})"
    )]
    BlocksHeld {
        /// The pool (`batch`, `staging`).
        pool: &'static str,
        /// The key that sizes it.
        key: &'static str,
        /// Its blocks.
        blocks: usize,
    },
}

/// Errors writing or reading step records; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The file could not be created, written or read.
    #[error("step record {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The Arrow IPC writer or reader failed (a truncated or foreign file).
    #[error("step record {}: {source}", path.display())]
    Arrow {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: arrow_schema::ArrowError,
    },
    /// The file is Arrow IPC but not a step record (columns, types, metadata).
    #[error("step record {}: {why}", path.display())]
    NotARecord {
        /// The file.
        path: PathBuf,
        /// What is missing.
        why: String,
    },
    /// No rows of the step asked for.
    #[error("step records {files}: no step {step}{}", epoch.map(|e| format!(" of epoch {e}")).unwrap_or_default())]
    NoStep {
        /// The files read.
        files: String,
        /// The step.
        step: u64,
        /// The epoch, when given.
        epoch: Option<u64>,
    },
    /// The step was recorded in several epochs: say which.
    #[error("step records {files}: step {step} was recorded in epochs {epochs:?}; name one")]
    AmbiguousEpoch {
        /// The files read.
        files: String,
        /// The step.
        step: u64,
        /// Epochs holding it.
        epochs: Vec<u64>,
    },
    /// Files of different runs (fingerprints differ).
    #[error("step records: {} and {} come from different runs (dataset or settings differ)", a.display(), b.display())]
    Mixed {
        /// One file.
        a: PathBuf,
        /// Another.
        b: PathBuf,
    },
}
