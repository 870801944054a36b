//! `ubdirect run`: epochs through the loader, with progress, sample dumps and a summary.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::Serialize;

use ubdirect_loader::RunConfig;
use ubdirect_loader::objstore::StatsSnapshot;
use ubdirect_loader::pipeline::{HIST_BUCKETS, LoadError, Loader};

use super::dump::Sinks;

/// Options of a run beyond the config.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Override `loader.epochs`.
    pub epochs: Option<u64>,
    /// Stop each epoch after this many batches.
    pub max_batches: Option<u64>,
    /// Write one JSON line per delivered sample here.
    pub dump_samples: Option<PathBuf>,
    /// Write one Arrow IPC record batch per step here (`FILE.rank{R}` with several ranks).
    pub record: Option<PathBuf>,
    /// Show a progress bar (on a terminal).
    pub progress: bool,
}

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

/// What a run did and how fast.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// A synthetic dataset this run wrote (`dataset.generate`): not the user's data.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generated: Option<ubdirect_loader::dataset::Generated>,
    /// Dataset format.
    pub format: String,
    /// Shards.
    pub shards: usize,
    /// Samples in the dataset.
    pub dataset_samples: usize,
    /// Rank and world size.
    pub rank: usize,
    /// World size.
    pub world_size: usize,
    /// Device used.
    pub device: String,
    /// Why that device.
    pub device_reason: String,
    /// Where batches landed.
    pub delivered_to: String,
    /// The I/O path reads took.
    pub io_path: String,
    /// io_uring rings × queue depth, SQPOLL.
    pub engine: String,
    /// Epochs run.
    pub epochs: u64,
    /// Batches delivered.
    pub batches: u64,
    /// Samples delivered.
    pub samples: u64,
    /// Sample bytes delivered.
    pub sample_bytes: u64,
    /// Bytes read from storage.
    pub read_bytes: u64,
    /// Bytes read for the delivered batches that were not their samples (merge gaps, alignment,
    /// widening).
    pub wasted_bytes: u64,
    /// Bytes read ahead for batches never delivered (prefetch past `--max-batches`), apart from the
    /// waste.
    pub prefetched_unused_bytes: u64,
    /// Reads issued.
    pub reads: u64,
    /// Mean read size.
    pub mean_read_bytes: u64,
    /// Wall seconds.
    pub seconds: f64,
    /// Samples per second.
    pub samples_per_s: f64,
    /// Delivered sample GB/s (10^9 bytes).
    pub gb_per_s: f64,
    /// Storage read GB/s.
    pub read_gb_per_s: f64,
    /// Seconds from the start (config read; loader built, pools and page cache registered) to the
    /// first batch.
    pub time_to_first_batch_s: f64,
    /// Where the time to the first batch went: the loader's start by phase (`device`, `engine`,
    /// `dataset`, `pools`, `page_cache`), then `first_plan` (planning epoch 0) and `first_batch`
    /// (its first batch's reads and copies), in seconds.
    pub startup_s: Vec<(String, f64)>,
    /// The pools' `0 = auto` keys as the loader resolved them at open, each with its reason.
    pub resolved: Vec<ubdirect_loader::pipeline::resolve::Resolved>,
    /// Seconds the loader took to shut down after the last batch (its threads joined, pools
    /// unregistered and freed, the device context released).
    pub teardown_s: f64,
    /// Delivered GB/s over the whole run, start-up and registration included.
    pub wall_gb_per_s: f64,
    /// Delivered GB/s of the last epoch alone (the steady state: warm, mapped).
    pub last_epoch_gb_per_s: f64,
    /// Delivered GB/s of each epoch (the first pass beside the steady state).
    pub epoch_gb_per_s: Vec<f64>,
    /// Seconds each epoch spent starting, inside its time above: from asking for the epoch to its
    /// iterator (plan checks, mappings checked and made, the page cache prepared, a cache's
    /// schedule), before any read is issued.
    pub epoch_start_s: Vec<f64>,
    /// The registered page cache: mapped shards, pinned bytes, budget, registrations, seconds
    /// registering, and why the budget is what it is. `None` when off.
    pub page_cache: Option<PageCacheRow>,
    /// Process CPU seconds per delivered GB.
    pub cpu_s_per_gb: f64,
    /// Threads copying warm ranges into staging (0: not used).
    pub copy_threads: usize,
    /// Staging blocks (each `pool.staging_block_size`).
    pub staging_blocks: usize,
    /// Staging blocks an epoch of mostly cold O_DIRECT reads cycles through
    /// (`pool.cold_staging_blocks`).
    pub cold_staging_blocks: usize,
    /// Epochs read mostly cold with O_DIRECT, which cycled through `cold_staging_blocks`.
    pub cold_staging_epochs: u64,
    /// Local devices the reads were balanced over (`engine.balance_devices`; 0: plan order).
    pub read_devices: usize,
    /// Reads given a staging block ahead of an earlier one of the plan, to a less busy device.
    pub reads_ahead: u64,
    /// Where host pools are bound and loader threads run (NUMA): `None` when left to the kernel.
    pub numa_placement: Option<String>,
    /// GPT mode: sample shape, order, and samples per blended dataset. `None` for whole samples.
    pub gpt: Option<GptRow>,
    /// Read-size histogram.
    pub read_sizes: Vec<HistRow>,
    /// Bytes moved from storage per read path (`direct`, `buffered`, `nvme`, `remote_tcp`, …).
    pub bytes_per_path: Vec<PathRow>,
    /// The same, epoch by epoch: which path the first pass took beside the steady state (how much
    /// of each epoch came out of mapped, registered page cache, and from when).
    pub epoch_bytes_per_path: Vec<Vec<PathRow>>,
    /// Short reads completed by resubmission.
    pub short_reads: u64,
    /// EINTR/EAGAIN retries.
    pub retries: u64,
    /// Registrations of every pool (all made at creation).
    pub registrations: u64,
    /// Who the pools are registered with.
    pub registered_with: Vec<String>,
    /// Samples checked against CRC sidecars.
    pub crc_checked: u64,
    /// Samples padded per epoch (all ranks).
    pub padded_per_epoch: u64,
    /// Samples dropped per epoch (all ranks).
    pub dropped_per_epoch: u64,
    /// Every fallback taken in this process.
    pub fallbacks: Vec<FallbackRow>,
    /// Object-store requests, bytes from the store and from the cache, retries, throttling (when
    /// the dataset is `s3://`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub object_store: Option<StatsSnapshot>,
    /// Bytes from the store ÷ sample bytes delivered (when the dataset is in an object store).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store_per_delivered: Option<f64>,
    /// Without a cache, after many small GETs: that a cache would help.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store_hint: Option<String>,
}

fn bucket_label(i: usize) -> String {
    let fmt = |b: u64| ubdirect_loader::config::ByteSize(b).to_string();
    match i {
        0 => "<8KiB".into(),
        i if i == HIST_BUCKETS - 1 => format!(">={}", fmt(1 << (11 + i))),
        i => format!("{}..{}", fmt(1 << (11 + i)), fmt(1 << (12 + i))),
    }
}

/// The summary's placement row: where host pools and threads went.
fn placement_row(loader: &Loader) -> Option<String> {
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
fn totals(stats: &ubdirect_loader::pipeline::LoaderStats) -> [u64; 5] {
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
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
fn startup_rows(loader: &Loader, first_plan: f64, first_batch: f64) -> Vec<(String, f64)> {
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

/// Runs the configured epochs.
///
/// The loader is shut down before the summary is returned, and `teardown_s` says how long that took.
pub fn run(cfg: &RunConfig, opts: &RunOptions) -> Result<RunSummary, LoadError> {
    // The loader plans and registers for the epochs the run will read.
    let mut cfg = cfg.clone();
    cfg.loader.epochs = opts.epochs.unwrap_or(cfg.loader.epochs).max(1);
    let (mut summary, loader) = run_epochs(&cfg, opts)?;
    let t = Instant::now();
    drop(loader);
    summary.teardown_s = t.elapsed().as_secs_f64();
    Ok(summary)
}

/// The object store's rows of the summary: its counters, bytes from the store per delivered byte,
/// and the cache hint (all `None` without object-store shards).
fn store_rows(sample_bytes: u64) -> (Option<StatsSnapshot>, Option<f64>, Option<String>) {
    let o = Some(ubdirect_loader::objstore::stats()).filter(|o| !o.is_empty());
    let per = o
        .as_ref()
        .filter(|_| sample_bytes > 0)
        .map(|o| o.bytes_from_store as f64 / sample_bytes as f64);
    let hint = o.as_ref().and_then(cache_hint);
    (o, per, hint)
}

fn run_epochs(cfg: &RunConfig, opts: &RunOptions) -> Result<(RunSummary, Loader), LoadError> {
    let start = Instant::now();
    let epochs = cfg.loader.epochs;
    let loader = Loader::from_config(cfg)?;
    let (rank, world) = loader.rank_world();
    let mut sinks = Sinks::open(
        opts.dump_samples.as_deref(),
        opts.record.as_deref(),
        &loader,
    )?;
    let built = start.elapsed().as_secs_f64();
    // The first segment of epoch 0's plan (what the iterator reads first; the epoch is planned a
    // segment at a time): its stats count the whole epoch's batches and samples.
    let plan0 = loader.first_plan(0)?;
    let planned = start.elapsed().as_secs_f64();
    let per_epoch = plan0.total_batches();
    let total_batches = opts.max_batches.map_or(per_epoch, |m| m.min(per_epoch)) * epochs;
    let bar = progress_bar(opts.progress, total_batches);
    let cpu0 = super::sys::cpu_time();
    let t0 = Instant::now();
    let stats = loader.stats();
    let mut first_batch = None;
    let mut last_epoch = (0u64, 0f64);
    let (mut epoch_rates, mut epoch_starts, mut epoch_paths) = (Vec::new(), Vec::new(), Vec::new());
    let mut per_dataset = vec![0u64; loader.gpt().map_or(0, |g| g.weights.len())];
    for epoch in 0..epochs {
        let e0 = Instant::now();
        let bytes0 = stats.sample_bytes.load(Ordering::Relaxed);
        let paths0 = stats.bytes_per_path();
        let mut it = loader.epoch(epoch)?;
        epoch_starts.push(e0.elapsed().as_secs_f64());
        let mut n = 0u64;
        while opts.max_batches.is_none_or(|m| n < m) {
            let Some(b) = it.next() else { break };
            let b = b?;
            first_batch.get_or_insert_with(|| start.elapsed().as_secs_f64());
            count_parts(&loader, &b, &mut per_dataset);
            sinks.take(&loader, epoch, rank, &b)?;
            n += 1;
            if let Some(bar) = &bar {
                tick(bar, stats, t0);
            }
        }
        drop(it);
        loader.device().0.synchronize()?;
        let bytes = stats.sample_bytes.load(Ordering::Relaxed) - bytes0;
        last_epoch = (bytes, e0.elapsed().as_secs_f64());
        epoch_rates.push(bytes as f64 / last_epoch.1.max(1e-9) / 1e9);
        epoch_paths.push(path_rows_since(stats, &paths0));
    }
    sinks.finish()?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    loader.device().0.synchronize()?;
    let seconds = t0.elapsed().as_secs_f64().max(1e-9);
    let wall = start.elapsed().as_secs_f64().max(1e-9);
    let cpu = (super::sys::cpu_time() - cpu0).as_secs_f64();
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let [samples, sample_bytes, read_bytes, reads, delivered_read] = totals(stats);
    let (staging, batch) = loader.pools();
    let (registered_with, registrations) = registrations(staging, batch);
    let es = loader.engine().stats();
    let rep = loader.engine().report();
    let (dev, reason) = loader.device();
    let (object_store, store_per_delivered, store_hint) = store_rows(sample_bytes);
    let (cold_staging_blocks, cold_staging_epochs) = loader.cold_staging();
    let (read_devices, reads_ahead) = loader.read_balance();
    let summary = RunSummary {
        generated: loader.generated().cloned(),
        format: loader.index().format.clone(),
        shards: loader.index().shards.len(),
        dataset_samples: loader.index().samples.len(),
        rank,
        world_size: world,
        device: dev.info().name.clone(),
        device_reason: reason.to_string(),
        delivered_to: delivered_to(batch.is_some(), dev.batch_kind()),
        io_path: loader.io_path().to_string(),
        engine: engine_row(&rep),
        epochs,
        batches: ld(&stats.batches),
        samples,
        sample_bytes,
        read_bytes,
        wasted_bytes: delivered_read.saturating_sub(sample_bytes),
        prefetched_unused_bytes: read_bytes.saturating_sub(delivered_read),
        reads,
        mean_read_bytes: read_bytes.checked_div(reads).unwrap_or(0),
        seconds,
        samples_per_s: samples as f64 / seconds,
        gb_per_s: sample_bytes as f64 / seconds / 1e9,
        read_gb_per_s: read_bytes as f64 / seconds / 1e9,
        time_to_first_batch_s: first_batch.unwrap_or(wall),
        startup_s: startup_rows(
            &loader,
            planned - built,
            first_batch.unwrap_or(wall) - planned,
        ),
        resolved: loader.resolved().to_vec(),
        wall_gb_per_s: sample_bytes as f64 / wall / 1e9,
        last_epoch_gb_per_s: last_epoch.0 as f64 / last_epoch.1.max(1e-9) / 1e9,
        epoch_gb_per_s: epoch_rates,
        epoch_start_s: epoch_starts,
        page_cache: page_cache_row(&loader, cfg),
        copy_threads: loader.engine().copy_threads(),
        staging_blocks: staging.block_count(),
        cold_staging_blocks,
        cold_staging_epochs,
        read_devices,
        reads_ahead,
        numa_placement: placement_row(&loader),
        cpu_s_per_gb: per_gb(cpu, sample_bytes),
        gpt: gpt_row(&loader, cfg, &plan0, world, &per_dataset),
        read_sizes: hist_rows(stats),
        bytes_per_path: path_rows_since(stats, &[]),
        epoch_bytes_per_path: epoch_paths,
        short_reads: ld(&es.short_reads),
        retries: ld(&es.retries),
        registrations,
        registered_with,
        crc_checked: ld(&stats.crc_checked),
        padded_per_epoch: plan0.stats.padded,
        dropped_per_epoch: plan0.stats.dropped,
        fallbacks: fallback_rows(),
        object_store,
        store_per_delivered,
        store_hint,
        teardown_s: 0.0,
    };
    Ok((summary, loader))
}

fn tick(bar: &indicatif::ProgressBar, stats: &ubdirect_loader::pipeline::LoaderStats, t0: Instant) {
    bar.inc(1);
    let secs = t0.elapsed().as_secs_f64().max(1e-9);
    bar.set_message(format!(
        "{:.0} samples/s  {:.2} GB/s",
        stats.samples.load(Ordering::Relaxed) as f64 / secs,
        stats.sample_bytes.load(Ordering::Relaxed) as f64 / secs / 1e9
    ));
}

/// The engine's row: rings, queue depth, SQPOLL.
fn engine_row(rep: &ubdirect_nvme::EngineReport) -> String {
    format!(
        "{} ring(s) × queue depth {}, sqpoll {}",
        rep.rings,
        rep.queue_depth,
        if rep.sqpoll_active { "on" } else { "off" }
    )
}

/// The read-size histogram's rows (buckets that saw a read).
fn hist_rows(stats: &ubdirect_loader::pipeline::LoaderStats) -> Vec<HistRow> {
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    (0..HIST_BUCKETS)
        .filter(|&i| ld(&stats.read_hist[i]) > 0)
        .map(|i| HistRow {
            range: bucket_label(i),
            reads: ld(&stats.read_hist[i]),
        })
        .collect()
}

/// Bytes moved along each path.
/// Bytes per read path moved since `before` (an earlier [`LoaderStats::bytes_per_path`]; empty:
/// since the start).
///
/// [`LoaderStats::bytes_per_path`]: ubdirect_loader::pipeline::LoaderStats::bytes_per_path
fn path_rows_since(
    stats: &ubdirect_loader::pipeline::LoaderStats,
    before: &[(ubdirect_ub::ReadPath, u64)],
) -> Vec<PathRow> {
    stats
        .bytes_per_path()
        .into_iter()
        .filter_map(|(p, bytes)| {
            let was = before.iter().find(|(q, _)| *q == p).map_or(0, |(_, b)| *b);
            let bytes = bytes.saturating_sub(was);
            (bytes > 0).then(|| PathRow {
                path: p.name().to_string(),
                bytes,
            })
        })
        .collect()
}

/// The consumers the pools were registered with, and how many registrations that took.
fn registrations(
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
fn delivered_to(batch_pool: bool, kind: ubdirect_ub::MemoryKind) -> String {
    match batch_pool {
        true if kind == ubdirect_ub::MemoryKind::Device => "device memory".into(),
        true => "host memory (one block per chunk of batches)".into(),
        false => "host memory (zero copy)".into(),
    }
}

fn progress_bar(progress: bool, total_batches: u64) -> Option<indicatif::ProgressBar> {
    if progress {
        let b = indicatif::ProgressBar::with_draw_target(
            Some(total_batches),
            indicatif::ProgressDrawTarget::stderr(),
        );
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} batches  {msg}  ETA {eta}",
        ) {
            b.set_style(style);
        }
        Some(b)
    } else {
        None
    }
}

/// The page cache's row of the summary, where the loader maps one.
fn page_cache_row(loader: &Loader, cfg: &RunConfig) -> Option<PageCacheRow> {
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

/// GPT mode's row of the summary.
fn gpt_row(
    loader: &Loader,
    cfg: &RunConfig,
    plan0: &ubdirect_loader::planner::EpochPlan,
    world: usize,
    per_dataset: &[u64],
) -> Option<GptRow> {
    loader.gpt().map(|g| GptRow {
        tokens: g.tokens,
        dtype: g.dtype.name().into(),
        order: match cfg.loader.order {
            ubdirect_loader::gpt::Order::Block => "block".into(),
            ubdirect_loader::gpt::Order::Megatron => "megatron".into(),
        },
        // The epoch's order (a block-order blend ends when its first dataset runs out).
        samples: (plan0.stats.samples * world as u64 + plan0.stats.dropped)
            .saturating_sub(plan0.stats.padded),
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
fn fallback_rows() -> Vec<FallbackRow> {
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

/// Counts a blend's samples per dataset.
pub(super) fn count_parts(loader: &Loader, b: &ubdirect_loader::Batch, per_dataset: &mut [u64]) {
    if let Some(g) = loader.gpt().filter(|g| !g.weights.is_empty()) {
        for s in b.samples() {
            per_dataset[g.part_of(s.id)] += 1;
        }
    }
}

/// `secs` per GB of `bytes` (0 when nothing was delivered).
pub(super) fn per_gb(secs: f64, bytes: u64) -> f64 {
    if bytes > 0 {
        secs / (bytes as f64 / 1e9)
    } else {
        0.0
    }
}
