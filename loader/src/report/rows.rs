//! The rows of a [`super::RunReport`] and how each is made from a loader.

use serde::Serialize;

use crate::RunConfig;
use crate::objstore::StatsSnapshot;
use crate::pipeline::{HIST_BUCKETS, Loader, LoaderStats};

/// One fallback taken, for the summary.
#[derive(Debug, Clone, Serialize)]
pub struct FallbackRow {
    /// Kind.
    pub kind: String,
    /// Times taken.
    pub count: u64,
    /// First occurrence.
    pub detail: String,
}

/// One histogram bucket.
#[derive(Debug, Clone, Serialize)]
pub struct HistRow {
    /// Bucket label (`256KiB..512KiB`).
    pub range: String,
    /// Reads in it.
    pub reads: u64,
}

/// The registered page cache, for the summary.
#[derive(Debug, Clone, Serialize)]
pub struct PageCacheRow {
    /// Shards mapped and registered.
    pub mapped_shards: usize,
    /// Bytes pinned (locked in RAM) by those registrations.
    pub pinned_bytes: u64,
    /// The budget.
    pub budget_bytes: u64,
    /// Registrations (all between epochs, never per read).
    pub registrations: u64,
    /// Seconds spent registering.
    pub register_s: f64,
    /// Why the budget is what it is.
    pub budget: String,
    /// `pool.page_cache_register`.
    pub policy: String,
    /// Registrations the background registrar made (while epochs ran).
    pub background_registrations: u64,
    /// Cold shards filled into the page cache by an epoch's reads (the run reads them again),
    /// summed over epochs.
    pub cold_filled: u64,
    /// Cold shards read with O_DIRECT and left out of the page cache (a single pass), summed over
    /// epochs.
    pub cold_direct: u64,
    /// Objects mapped from their cache's chunk files (cache hits copied out of the mapping).
    pub object_chunks_mapped: u64,
    /// Objects whose mapped chunks were evicted or replaced, read through the cache again.
    pub object_chunks_unmapped: u64,
    /// Objects whose cache hits were read by the copy threads straight out of their chunk files'
    /// mapping, not registered yet (a `pread` per read, not the cache's first touch of each chunk
    /// file), summed over epochs.
    pub object_chunks_staged: u64,
    /// Of those, the object-epochs that read the epoch before's staged mapping again (checked, not
    /// made anew).
    pub object_chunks_staged_kept: u64,
}

/// One blended dataset's share of a GPT run.
#[derive(Debug, Clone, Serialize)]
pub struct BlendRow {
    /// The dataset's shards.
    pub paths: Vec<String>,
    /// Its normalized weight.
    pub weight: f64,
    /// Samples delivered from it.
    pub samples: u64,
}

/// GPT mode, for the summary.
#[derive(Debug, Clone, Serialize)]
pub struct GptRow {
    /// Tokens per sample.
    pub tokens: u32,
    /// Token type.
    pub dtype: String,
    /// `block` or `megatron`.
    pub order: String,
    /// GPT samples per epoch (all ranks).
    pub samples: u64,
    /// `dataset.num_samples` as configured (0: one epoch of documents).
    pub num_samples: u64,
    /// Epochs of documents the Megatron indices span (per dataset; block order: 1 each).
    pub document_epochs: Vec<u32>,
    /// Why an epoch holds other than `num_samples` samples (Megatron's whole-epoch rule, a blend's
    /// rounding); absent when it holds exactly that many or `num_samples` is 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_samples_note: Option<String>,
    /// What `dataset.gpt_index_cache` did per dataset: `off`, `hit` (mapped), `stored` or
    /// `unwritten` (a recorded fallback).
    pub index_cache: Vec<String>,
    /// Blended datasets (empty when not blended).
    pub blend: Vec<BlendRow>,
}

/// Bytes one read path moved.
#[derive(Debug, Clone, Serialize)]
pub struct PathRow {
    /// The path (`direct`, `buffered`, `nvme`, `remote_tcp`, `remote_rdma`).
    pub path: String,
    /// Bytes moved from storage.
    pub bytes: u64,
}

fn bucket_label(i: usize) -> String {
    let fmt = |b: u64| crate::config::ByteSize(b).to_string();
    match i {
        0 => "<8KiB".into(),
        i if i == HIST_BUCKETS - 1 => format!(">={}", fmt(1 << (11 + i))),
        i => format!("{}..{}", fmt(1 << (11 + i)), fmt(1 << (12 + i))),
    }
}

/// The placement row: where host pools and threads went.
pub(super) fn placement_row(loader: &Loader) -> Option<String> {
    loader.numa_placement().map(|p| {
        format!(
            "NUMA node {} ({}): host pools placed there{}",
            p.node,
            p.reason,
            if p.cpus.is_empty() {
                String::new()
            } else {
                format!(
                    ", loader threads on CPUs {}",
                    ubdirect_ub::topology::format_cpulist(&p.cpus)
                )
            }
        )
    })
}

/// Samples, sample bytes, bytes read, reads, and the bytes read for delivered batches (chunks are
/// read whole; a batch carries its share of its chunk's reads).
pub(super) fn totals(stats: &LoaderStats) -> [u64; 5] {
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let read_bytes = ld(&stats.read_bytes);
    [
        ld(&stats.samples),
        ld(&stats.sample_bytes),
        read_bytes,
        ld(&stats.reads),
        ld(&stats.delivered_read_bytes).min(read_bytes),
    ]
}

/// The loader's start by phase, then planning epoch 0 and its first batch (`startup_s`).
pub(super) fn startup_rows(
    loader: &Loader,
    first_plan: f64,
    first_batch: f64,
) -> Vec<(String, f64)> {
    loader
        .startup_phases()
        .iter()
        .map(|(n, t)| (n.to_string(), *t))
        .chain([
            ("first_plan".to_string(), first_plan),
            ("first_batch".to_string(), first_batch),
        ])
        .collect()
}

/// The object store's rows: its counters, bytes from the store per delivered byte, and the cache
/// hint (all `None` without object-store shards).
pub(super) fn store_rows(
    sample_bytes: u64,
) -> (Option<StatsSnapshot>, Option<f64>, Option<String>) {
    let o = Some(crate::objstore::stats()).filter(|o| !o.is_empty());
    let per = o
        .as_ref()
        .filter(|_| sample_bytes > 0)
        .map(|o| o.bytes_from_store as f64 / sample_bytes as f64);
    let hint = o.as_ref().and_then(cache_hint);
    (o, per, hint)
}

/// The engine's row: rings, queue depth, SQPOLL.
pub(super) fn engine_row(rep: &ubdirect_nvme::EngineReport) -> String {
    format!(
        "{} ring(s) × queue depth {}, sqpoll {}",
        rep.rings,
        rep.queue_depth,
        if rep.sqpoll_active { "on" } else { "off" }
    )
}

/// The read-size histogram's rows (buckets that saw a read).
pub(super) fn hist_rows(stats: &LoaderStats) -> Vec<HistRow> {
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    (0..HIST_BUCKETS)
        .filter(|&i| ld(&stats.read_hist[i]) > 0)
        .map(|i| HistRow {
            range: bucket_label(i),
            reads: ld(&stats.read_hist[i]),
        })
        .collect()
}

/// Bytes per read path as rows.
pub(super) fn path_rows(paths: &[(ubdirect_ub::ReadPath, u64)]) -> Vec<PathRow> {
    paths
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|(p, bytes)| PathRow {
            path: p.name().to_string(),
            bytes: *bytes,
        })
        .collect()
}

/// The consumers the pools were registered with, and how many registrations that took.
pub(super) fn registrations(
    staging: &ubdirect_ub::UbPool,
    batch: Option<&ubdirect_ub::UbPool>,
) -> (Vec<String>, u64) {
    let mut registered_with = staging.consumers().to_vec();
    let mut registrations = staging.stats().registrations;
    if let Some(b) = batch {
        registered_with.extend(b.consumers().iter().cloned());
        registrations += b.stats().registrations;
    }
    (registered_with, registrations)
}

/// Where batches are delivered.
pub(super) fn delivered_to(batch_pool: bool, kind: ubdirect_ub::MemoryKind) -> String {
    match batch_pool {
        true if kind == ubdirect_ub::MemoryKind::Device => "device memory".into(),
        true => "host memory (one block per chunk of batches)".into(),
        false => "host memory (zero copy)".into(),
    }
}

/// The page cache's row, where the loader maps one.
pub(super) fn page_cache_row(loader: &Loader, cfg: &RunConfig) -> Option<PageCacheRow> {
    loader
        .page_cache()
        .map(|(m, p, b, r, t, why)| PageCacheRow {
            mapped_shards: m,
            pinned_bytes: p,
            budget_bytes: b,
            registrations: r,
            register_s: t,
            budget: why,
            policy: format!("{:?}", cfg.pool.page_cache_register).to_lowercase(),
            background_registrations: loader.page_cache_background_registrations(),
            cold_filled: loader.page_cache_cold_paths().0,
            cold_direct: loader.page_cache_cold_paths().1,
            object_chunks_mapped: loader.page_cache_chunk_maps().0,
            object_chunks_unmapped: loader.page_cache_chunk_maps().1,
            object_chunks_staged: loader.page_cache_chunks_staged(),
            object_chunks_staged_kept: loader.page_cache_chunks_staged_kept(),
        })
}

/// GPT mode's row.
pub(super) fn gpt_row(
    loader: &Loader,
    cfg: &RunConfig,
    plan0: Option<&crate::planner::EpochPlan>,
    world: usize,
    per_dataset: &[u64],
) -> Option<GptRow> {
    let epoch_samples = |p: &crate::planner::EpochPlan| {
        // The epoch's order (a block-order blend ends when its first dataset runs out).
        (p.stats.samples * world as u64 + p.stats.dropped).saturating_sub(p.stats.padded)
    };
    loader.gpt().map(|g| GptRow {
        tokens: g.tokens,
        dtype: g.dtype.name().into(),
        order: match cfg.loader.order {
            crate::gpt::Order::Block => "block".into(),
            crate::gpt::Order::Megatron => "megatron".into(),
        },
        samples: plan0.map_or(0, epoch_samples),
        num_samples: cfg.dataset.num_samples,
        document_epochs: g.parts.iter().map(|p| p.indices.epochs).collect(),
        num_samples_note: g.num_samples_note(cfg.dataset.num_samples),
        index_cache: g
            .parts
            .iter()
            .map(|p| format!("{:?}", p.cache).to_lowercase())
            .collect(),
        blend: cfg
            .dataset
            .blend
            .iter()
            .zip(&g.weights)
            .zip(per_dataset)
            .map(|((b, &weight), &samples)| BlendRow {
                paths: b.paths.iter().map(|p| p.display().to_string()).collect(),
                weight,
                samples,
            })
            .collect(),
    })
}

/// Every fallback taken in this process.
pub(super) fn fallback_rows() -> Vec<FallbackRow> {
    ubdirect_ub::fallback::snapshot()
        .into_iter()
        .map(|f| FallbackRow {
            kind: f.kind.to_string(),
            count: f.count,
            detail: f.first_detail,
        })
        .collect()
}

/// Where no cache ran and many small GETs were made: that a cache would help.
fn cache_hint(o: &StatsSnapshot) -> Option<String> {
    let mean = o.bytes_from_store / o.requests.max(1);
    let cached = o.bytes_from_cache > 0 || o.chunks_fetched > 0;
    (!cached && mean < (256 << 10) && o.requests > 1000).then(|| {
        format!(
            "{} GETs of {mean} bytes on average: a cache (cache.dir, cache.max_bytes up to the dataset) would fetch chunks once and serve repeated reads locally",
            o.requests
        )
    })
}

/// `secs` per GB of `bytes` (0 when nothing was delivered).
pub fn per_gb(secs: f64, bytes: u64) -> f64 {
    if bytes > 0 {
        secs / (bytes as f64 / 1e9)
    } else {
        0.0
    }
}
