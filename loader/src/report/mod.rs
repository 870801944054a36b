//! One run report: what a loader ran and measured, made in one place ([`RunReport::new`]) for
//! every driver — `ubdirect run` prints it as text and `--json`, Python's `Loader.summary()`
//! returns it as a dict. A new figure is added here once.

use std::sync::atomic::Ordering;

use serde::Serialize;

mod meter;
mod rows;

pub use meter::RunMeter;
pub use rows::{BlendRow, FallbackRow, GptRow, HistRow, PageCacheRow, PathRow, per_gb};

use crate::objstore::StatsSnapshot;
use crate::pipeline::Loader;

/// What a run did and how fast.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// A synthetic dataset this run wrote (`dataset.generate`): not the user's data.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generated: Option<crate::dataset::Generated>,
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
    /// Seconds the consumer waited inside `next` for batches that were not ready (the data stall).
    pub data_wait_s: f64,
    /// `data_wait_s` ÷ `seconds`: the share of the epochs' time the loop waited for data.
    pub data_stall_fraction: f64,
    /// Seconds from the start (config read; loader built, pools and page cache registered) to the
    /// first batch.
    pub time_to_first_batch_s: f64,
    /// Where the time to the first batch went: the loader's start by phase (`device`, `engine`,
    /// `dataset`, `pools`, `page_cache`), then `first_plan` (planning epoch 0) and `first_batch`
    /// (its first batch's reads and copies), in seconds.
    pub startup_s: Vec<(String, f64)>,
    /// The pools' `0 = auto` keys as the loader resolved them at open, each with its reason.
    pub resolved: Vec<crate::pipeline::resolve::Resolved>,
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
    /// io_uring reads into a pool not registered with the engine (by address: the pools are
    /// pageable where RLIMIT_MEMLOCK is below them; the `pools_not_locked` fallback).
    pub unregistered_reads: u64,
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
    /// The object store's requests, bytes, time and price: predicted before each epoch, beside
    /// the realised ones.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub store_cost: Option<crate::objstore::CostReport>,
}

impl RunReport {
    /// The report of `loader` as driven so far, with what `meter` measured while driving it.
    /// `teardown_s` is 0: only whoever drops the loader can time that.
    pub fn new(loader: &Loader, meter: &RunMeter) -> Self {
        let cfg = loader.config();
        let stats = loader.stats();
        let (rank, world) = loader.rank_world();
        let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let [samples, sample_bytes, read_bytes, reads, delivered_read] = rows::totals(stats);
        let (staging, batch) = loader.pools();
        let (registered_with, registrations) = rows::registrations(staging, batch);
        let es = loader.engine().stats();
        let (dev, reason) = loader.device();
        let (object_store, store_per_delivered, store_hint) = rows::store_rows(sample_bytes);
        let (cold_staging_blocks, cold_staging_epochs) = loader.cold_staging();
        let (read_devices, reads_ahead) = loader.read_balance();
        let plan0 = loader.first_plan(0).ok();
        let (built, planned, first_batch) = meter.startup();
        let (seconds, wall) = (meter.seconds().max(1e-9), meter.wall().max(1e-9));
        let (last_bytes, last_secs) = meter.last_epoch;
        Self {
            generated: loader.generated().cloned(),
            format: loader.index().format.clone(),
            shards: loader.index().shards.len(),
            dataset_samples: loader.index().samples.len(),
            rank,
            world_size: world,
            device: dev.info().name.clone(),
            device_reason: reason.to_string(),
            delivered_to: rows::delivered_to(batch.is_some(), dev.batch_kind()),
            io_path: loader.io_path().to_string(),
            engine: rows::engine_row(&loader.engine().report()),
            epochs: meter.epochs,
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
            data_wait_s: ld(&stats.wait_us) as f64 / 1e6,
            data_stall_fraction: (ld(&stats.wait_us) as f64 / 1e6 / seconds).min(1.0),
            time_to_first_batch_s: first_batch.unwrap_or(wall),
            startup_s: rows::startup_rows(
                loader,
                planned - built,
                first_batch.unwrap_or(wall) - planned,
            ),
            resolved: loader.resolved().to_vec(),
            teardown_s: 0.0,
            wall_gb_per_s: sample_bytes as f64 / wall / 1e9,
            last_epoch_gb_per_s: last_bytes as f64 / last_secs.max(1e-9) / 1e9,
            epoch_gb_per_s: meter.epoch_gb_per_s.clone(),
            epoch_start_s: meter.epoch_start_s.clone(),
            page_cache: rows::page_cache_row(loader, cfg),
            cpu_s_per_gb: per_gb(meter.cpu(), sample_bytes),
            copy_threads: loader.engine().copy_threads(),
            staging_blocks: staging.block_count(),
            cold_staging_blocks,
            cold_staging_epochs,
            read_devices,
            reads_ahead,
            numa_placement: rows::placement_row(loader),
            gpt: rows::gpt_row(loader, cfg, plan0.as_deref(), world, &meter.per_dataset),
            read_sizes: rows::hist_rows(stats),
            bytes_per_path: rows::path_rows(&stats.bytes_per_path()),
            epoch_bytes_per_path: meter
                .epoch_paths
                .iter()
                .map(|p| rows::path_rows(p))
                .collect(),
            short_reads: ld(&es.short_reads),
            retries: ld(&es.retries),
            unregistered_reads: ld(&es.unregistered_reads),
            registrations,
            registered_with,
            crc_checked: ld(&stats.crc_checked),
            padded_per_epoch: plan0.as_ref().map_or(0, |p| p.stats.padded),
            dropped_per_epoch: plan0.as_ref().map_or(0, |p| p.stats.dropped),
            fallbacks: rows::fallback_rows(),
            object_store,
            store_per_delivered,
            store_hint,
            store_cost: loader.object_store_cost(),
        }
    }
}
