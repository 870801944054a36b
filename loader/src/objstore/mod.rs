//! Object storage: `s3://BUCKET/PREFIX/…` shards read through the `object_store` crate (cargo feature
//! `object-store`), optionally through a local chunk cache that is itself read by the io_uring file
//! source (docs/object-store.md).
//!
//! The configuration sections and the counters are always compiled, so a config is the same with or
//! without the feature and the run summary prints the counters; the source, the cache and the
//! opener are behind the feature.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::config::ByteSize;

#[cfg(feature = "object-store")]
mod cache;
#[cfg(feature = "object-store")]
mod open;
#[cfg(feature = "object-store")]
mod source;

#[cfg(feature = "object-store")]
pub use cache::ChunkCache;
/// The `object_store` crate this module is built on (for callers that talk to a store directly:
/// tests, benchmarks).
#[cfg(feature = "object-store")]
pub use object_store;
#[cfg(feature = "object-store")]
pub(crate) use open::open;
#[cfg(feature = "object-store")]
pub use source::{ObjectSource, kind_of};

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
}

impl Default for CacheSection {
    fn default() -> Self {
        Self {
            dir: None,
            max_bytes: ByteSize(64 << 30),
            chunk_size: ByteSize(8 << 20),
            prefetch: 16,
        }
    }
}

/// The URL schemes of object-store datasets.
pub const SCHEMES: [&str; 5] = ["s3://", "gs://", "az://", "https://", "http://"];

/// Whether a dataset path names an object (`s3://…`, `gs://…`, `az://…`, `https://…`, `http://…`).
pub fn is_object_url(p: &std::path::Path) -> bool {
    p.to_str()
        .is_some_and(|s| SCHEMES.iter().any(|x| s.starts_with(x)))
}

/// Object-store counters of this process, for the run summary and metrics.
#[derive(Debug, Default)]
pub struct Stats {
    /// GET requests issued (ranged reads and chunk fetches, listing and HEAD included).
    pub requests: AtomicU64,
    /// Bytes received from the store.
    pub bytes_from_store: AtomicU64,
    /// Bytes delivered from cached chunks.
    pub bytes_from_cache: AtomicU64,
    /// Requests issued again after a retryable failure.
    pub retries: AtomicU64,
    /// Failures that were throttling responses (HTTP 429, 503 SlowDown).
    pub throttled: AtomicU64,
    /// Chunks fetched from the store into the cache.
    pub chunks_fetched: AtomicU64,
    /// Chunks evicted from the cache to stay within `cache.max_bytes`.
    pub chunks_evicted: AtomicU64,
    /// Chunks read straight from the store because the cache could not take them in the bound.
    pub cache_bypassed: AtomicU64,
    /// Chunks fetched ahead of the planner's order (`cache.prefetch`), before any read asked.
    pub chunks_prefetched: AtomicU64,
    /// Bytes of those chunks.
    pub bytes_prefetched: AtomicU64,
    /// Reads of a prefetched chunk that found it fetched (or being fetched) by the prefetch.
    pub prefetch_hits: AtomicU64,
    /// Prefetches that failed (the read then fetches the chunk itself; logged once as a fallback).
    pub prefetch_failed: AtomicU64,
}

/// This process's counters.
pub static STATS: Stats = Stats {
    requests: AtomicU64::new(0),
    bytes_from_store: AtomicU64::new(0),
    bytes_from_cache: AtomicU64::new(0),
    retries: AtomicU64::new(0),
    throttled: AtomicU64::new(0),
    chunks_fetched: AtomicU64::new(0),
    chunks_evicted: AtomicU64::new(0),
    cache_bypassed: AtomicU64::new(0),
    chunks_prefetched: AtomicU64::new(0),
    bytes_prefetched: AtomicU64::new(0),
    prefetch_hits: AtomicU64::new(0),
    prefetch_failed: AtomicU64::new(0),
};

/// A copy of the counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StatsSnapshot {
    /// See [`Stats::requests`].
    pub requests: u64,
    /// See [`Stats::bytes_from_store`].
    pub bytes_from_store: u64,
    /// See [`Stats::bytes_from_cache`].
    pub bytes_from_cache: u64,
    /// See [`Stats::retries`].
    pub retries: u64,
    /// See [`Stats::throttled`].
    pub throttled: u64,
    /// See [`Stats::chunks_fetched`].
    pub chunks_fetched: u64,
    /// See [`Stats::chunks_evicted`].
    pub chunks_evicted: u64,
    /// See [`Stats::cache_bypassed`].
    pub cache_bypassed: u64,
    /// See [`Stats::chunks_prefetched`].
    pub chunks_prefetched: u64,
    /// See [`Stats::bytes_prefetched`].
    pub bytes_prefetched: u64,
    /// See [`Stats::prefetch_hits`].
    pub prefetch_hits: u64,
    /// See [`Stats::prefetch_failed`].
    pub prefetch_failed: u64,
}

impl StatsSnapshot {
    /// Whether anything touched an object store in this process.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// The counters now.
pub fn stats() -> StatsSnapshot {
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let s = &STATS;
    StatsSnapshot {
        requests: g(&s.requests),
        bytes_from_store: g(&s.bytes_from_store),
        bytes_from_cache: g(&s.bytes_from_cache),
        retries: g(&s.retries),
        throttled: g(&s.throttled),
        chunks_fetched: g(&s.chunks_fetched),
        chunks_evicted: g(&s.chunks_evicted),
        cache_bypassed: g(&s.cache_bypassed),
        chunks_prefetched: g(&s.chunks_prefetched),
        bytes_prefetched: g(&s.bytes_prefetched),
        prefetch_hits: g(&s.prefetch_hits),
        prefetch_failed: g(&s.prefetch_failed),
    }
}

#[cfg(feature = "object-store")]
pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Without the feature: a clear error naming it.
#[cfg(not(feature = "object-store"))]
pub(crate) fn open(
    _rt: &tokio::runtime::Runtime,
    _cfg: &crate::RunConfig,
    _engine: &ubdirect_nvme::Engine,
) -> Result<crate::pipeline::sources::Opened, crate::LoadError> {
    Err(crate::LoadError::Config(
        "s3://, gs://, az:// and https:// datasets need a build with --features object-store"
            .into(),
    ))
}
