//! Object storage: `s3://BUCKET/PREFIX/…` shards read through the `object_store` crate (cargo feature
//! `object-store`), optionally through a local chunk cache that is itself read by the io_uring file
//! source (docs/object-store.md).
//!
//! The configuration sections and the counters are always compiled, so a config is the same with or
//! without the feature and the run summary prints the counters; the source, the cache and the
//! opener are behind the feature.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

#[cfg(feature = "object-store")]
mod cache;
mod cost;
#[cfg(feature = "object-store")]
mod open;
#[cfg(feature = "object-store")]
mod plan;
#[cfg(feature = "object-store")]
mod source;

#[cfg(feature = "object-store")]
pub use cache::ChunkCache;
/// The cache's decisions replayed over a plan: an epoch's requests and bytes before it runs.
#[cfg(feature = "object-store")]
pub use cache::estimate::{REPLAYED, Replay};
pub use cost::{CacheModel, CostReport, Estimate};
/// The `object_store` crate this module is built on (for callers that talk to a store directly:
/// tests, benchmarks).
#[cfg(feature = "object-store")]
pub use object_store;
#[cfg(feature = "object-store")]
pub(crate) use open::open;
/// Belady's minimum computed offline (tests and benchmarks compare the cache with it).
#[cfg(feature = "object-store")]
pub use plan::belady_bytes;
#[cfg(feature = "object-store")]
pub use source::{ObjectSource, kind_of};

/// The sections this module is configured by (defined with the others in [`crate::config`]).
pub use crate::config::{CacheSection, ObjectStoreSection};

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
    /// Chunks not worth caching whole, fetched whole in one GET for the windows of the plan's near
    /// future they hold (`cache.window_fraction`).
    pub window_chunks: AtomicU64,
    /// Bytes delivered from those windows (no request of their own).
    pub bytes_from_windows: AtomicU64,
    /// Reads whose window the pipeline took at hand, with no staging block or task of their own
    /// (`Source::read_at_hand`; their bytes are in `bytes_from_windows`).
    pub reads_at_hand: AtomicU64,
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
    window_chunks: AtomicU64::new(0),
    bytes_from_windows: AtomicU64::new(0),
    reads_at_hand: AtomicU64::new(0),
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
    /// See [`Stats::window_chunks`].
    pub window_chunks: u64,
    /// See [`Stats::bytes_from_windows`].
    pub bytes_from_windows: u64,
    /// See [`Stats::reads_at_hand`].
    pub reads_at_hand: u64,
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
        window_chunks: g(&s.window_chunks),
        bytes_from_windows: g(&s.bytes_from_windows),
        reads_at_hand: g(&s.reads_at_hand),
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
    _c: &super::ShardConfig<'_>,
    _engine: &ubdirect_nvme::Engine,
) -> Result<super::Opened, crate::error::LoadError> {
    Err(crate::error::LoadError::Config(
        "s3://, gs://, az:// and https:// datasets need a build with --features object-store"
            .into(),
    ))
}
