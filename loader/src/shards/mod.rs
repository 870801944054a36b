//! The shard layer, below the pipeline: a dataset's paths parsed once ([`ShardUrl`]), its shards
//! opened as [`Source`]s — local files on the engine (io_uring or NVMe passthrough), `ub://` files on
//! storage servers, objects in object stores — and indexed through the one format dispatch
//! ([`crate::formats::index()`]). One file per scheme; each gets the config sections it reads
//! (`ShardConfig`), never the whole run configuration.

pub mod dataset;
pub mod lazy;
mod local;
pub mod object;
mod reader;
mod remote;
mod url;

use std::sync::Arc;
use std::time::Duration;

use ubdirect_nvme::Engine;
use ubdirect_ub::{Registrar, Source};

pub(crate) use local::resolved_open_shards as max_open_shards;
pub(crate) use reader::SourceReader;
pub use url::{OBJECT_SCHEMES, ObjectUrl, Scheme, ShardKind, ShardUrl, UbUrl};

use crate::config::{
    CacheSection, DatasetSection, EngineSection, ObjectStoreSection, RemoteSection,
};
use crate::error::LoadError;
use crate::formats::Opener;
use crate::formats::index::DatasetIndex;

/// The sections of a run configuration that opening shards reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ShardConfig<'a> {
    /// `[dataset]` as the shards are opened (a blend's paths in order: `DatasetSection::for_opening`).
    pub dataset: &'a DatasetSection,
    /// `[engine]`: `io` and `op_timeout_ms` for local shards.
    pub engine: &'a EngineSection,
    /// `[remote]`: `ub://` servers, and the deadline of object-store requests.
    pub remote: &'a RemoteSection,
    /// `[object_store]`
    #[cfg_attr(not(feature = "object-store"), allow(dead_code))]
    pub object_store: &'a ObjectStoreSection,
    /// `[cache]`
    #[cfg_attr(not(feature = "object-store"), allow(dead_code))]
    pub cache: &'a CacheSection,
}

/// A dataset's index and one source per shard (same order as `index.shards`).
pub(crate) struct Opened {
    pub index: DatasetIndex,
    pub sources: Vec<Arc<dyn Source>>,
    /// What the staging pool must be registered with (deduplicated by consumer).
    pub registrars: Vec<Arc<dyn Registrar>>,
    /// Deadline of one read.
    pub deadline: Duration,
    /// Per shard: the io_uring file source, where that is the shard's source (page-cache mapping
    /// candidates).
    pub files: Vec<Option<Arc<ubdirect_nvme::FileSource>>>,
    /// Per shard: the local device (file system, `st_dev`) it is read from; `None` for a shard
    /// that is not a local file (remote, object store). Reads are balanced over these.
    pub devices: Vec<Option<u64>>,
    /// The smallest read these sources should be planned with (object stores:
    /// `object_store.min_read`); 0: `loader.min_read` alone.
    pub min_read: u64,
    /// Reads exact to the byte, within this factor of their samples' bytes (object stores: every
    /// byte fetched is paid for and nothing needs aligning); 0: aligned reads, `loader.max_gap`.
    pub max_amplification: u64,
    /// Chunks the pipeline keeps ahead at least (object stores without a cache: twice
    /// `object_store.max_in_flight`); 0: `loader.prefetch` alone.
    pub read_ahead: usize,
    /// A synthetic dataset written at open (`dataset.generate`), said in the summary.
    pub generated: Option<dataset::Generated>,
    /// `dataset.columns[1..]`, indexed at open with the first (remote shards: `ub://`, object
    /// stores); `None`: none, or indexed later through [`with_opener`] (local files, from their
    /// sidecars).
    pub columns: Option<Vec<Vec<crate::formats::index::SampleLoc>>>,
}

impl Opened {
    /// `index` read through `sources` within `deadline`: registered with what the sources need,
    /// no local files or devices, planned as `[loader]` says; the fields that differ by shard kind
    /// are set over this (`Opened { files, devices, ..Opened::new(…) }`).
    pub(crate) fn new(
        index: DatasetIndex,
        sources: Vec<Arc<dyn Source>>,
        deadline: Duration,
    ) -> Self {
        let n = index.shards.len();
        Self {
            registrars: dedupe(sources.iter().flat_map(|s| s.registrars()).collect()),
            files: vec![None; n],
            devices: vec![None; n],
            index,
            sources,
            deadline,
            min_read: 0,
            max_amplification: 0,
            read_ahead: 0,
            generated: None,
            columns: None,
        }
    }
}

/// Runs `f` to completion on `rt` from synchronous code — also when the caller is itself on a
/// multi-threaded tokio runtime (through `block_in_place`). On a current-thread runtime that would
/// stall the caller's own tasks, so it is a clear error instead of tokio's panic.
pub(crate) fn block_on<F: std::future::Future>(
    rt: &tokio::runtime::Runtime,
    f: F,
) -> Result<F::Output, LoadError> {
    match tokio::runtime::Handle::try_current() {
        Err(_) => Ok(rt.block_on(f)),
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            Ok(tokio::task::block_in_place(|| rt.block_on(f)))
        }
        Ok(_) => Err(LoadError::CurrentThreadRuntime),
    }
}

/// Opens the dataset of `c.dataset`: objects in their stores, `ub://` files on their servers, or
/// local shards on `engine`.
pub(crate) fn open(
    rt: &tokio::runtime::Runtime,
    c: &ShardConfig<'_>,
    engine: &Engine,
) -> Result<Opened, LoadError> {
    let ds = c.dataset;
    let kind = |p: &std::path::PathBuf| ShardUrl::kind_of(p);
    if ds.paths.iter().any(|p| kind(p) == ShardKind::Object)
        || (ds.paths.is_empty()
            && ds
                .dir
                .as_deref()
                .is_some_and(|d| ShardUrl::kind_of(d) == ShardKind::Object))
    {
        return object::open(rt, c, engine);
    }
    if ds.paths.iter().any(|p| kind(p) == ShardKind::Ub) {
        if let Some(p) = ds.paths.iter().find(|p| kind(p) != ShardKind::Ub) {
            return Err(LoadError::Config(format!(
                "dataset.paths mixes ub:// and local paths ({})",
                p.display()
            )));
        }
        return remote::open(rt, c);
    }
    local::open(c, engine)
}

/// The registrars of `rs`, one per consumer.
pub(crate) fn dedupe(rs: Vec<Arc<dyn Registrar>>) -> Vec<Arc<dyn Registrar>> {
    let mut seen = std::collections::HashSet::new();
    rs.into_iter()
        .filter(|r| seen.insert(r.consumer()))
        .collect()
}

/// Runs `f` with the opener of `index`'s shards — `ub://` files (on their servers, with the
/// `[remote]` settings) or local files — for what is read from the shards after indexing (an Arrow
/// schema's token type, the other columns of several-column samples).
pub(crate) fn with_opener<T>(
    rt: &tokio::runtime::Runtime,
    remote: &RemoteSection,
    index: &DatasetIndex,
    f: impl FnOnce(&dyn Opener) -> T,
) -> Result<T, LoadError> {
    if index
        .shards
        .iter()
        .any(|s| ShardUrl::kind_of(&s.path) == ShardKind::Ub)
    {
        let files = remote::remote_files(rt, remote)?;
        Ok(f(&files))
    } else {
        Ok(f(&crate::formats::LocalFiles))
    }
}
