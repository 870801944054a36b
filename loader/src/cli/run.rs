//! `ubdirect run`: epochs through the loader, with progress, sample dumps and a summary (the
//! library's [`RunReport`], printed by `summary.rs` or as JSON).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

use ubdirect_loader::pipeline::{LoadError, Loader};
use ubdirect_loader::{RunConfig, RunMeter, RunReport};

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

/// Runs the configured epochs.
///
/// The loader is shut down before the report is returned, and `teardown_s` says how long that took.
pub fn run(cfg: &RunConfig, opts: &RunOptions) -> Result<RunReport, LoadError> {
    // The loader plans and registers for the epochs the run will read.
    let mut cfg = cfg.clone();
    cfg.loader.epochs = opts.epochs.unwrap_or(cfg.loader.epochs).max(1);
    let (mut report, loader) = run_epochs(&cfg, opts)?;
    let t = Instant::now();
    drop(loader);
    report.teardown_s = t.elapsed().as_secs_f64();
    Ok(report)
}

fn run_epochs(cfg: &RunConfig, opts: &RunOptions) -> Result<(RunReport, Loader), LoadError> {
    let mut meter = RunMeter::new();
    let loader = Loader::from_config(cfg)?;
    meter.built(&loader);
    let (rank, _) = loader.rank_world();
    let mut sinks = Sinks::open(
        opts.dump_samples.as_deref(),
        opts.record.as_deref(),
        &loader,
    )?;
    // The first segment of epoch 0's plan (what the iterator reads first; the epoch is planned a
    // segment at a time): its stats count the whole epoch's batches and samples.
    let per_epoch = loader.first_plan(0)?.total_batches();
    meter.planned();
    let epochs = cfg.loader.epochs;
    let total_batches = opts.max_batches.map_or(per_epoch, |m| m.min(per_epoch)) * epochs;
    let bar = progress_bar(opts.progress, total_batches);
    let t0 = Instant::now();
    for epoch in 0..epochs {
        meter.epoch_begin(&loader);
        let mut it = loader.epoch(epoch)?;
        meter.epoch_ready();
        let mut n = 0u64;
        while opts.max_batches.is_none_or(|m| n < m) {
            let Some(b) = it.next() else { break };
            let b = b?;
            meter.batch(&loader, &b);
            sinks.take(&loader, epoch, rank, &b)?;
            n += 1;
            if let Some(bar) = &bar {
                tick(bar, loader.stats(), t0);
            }
        }
        drop(it);
        loader.device().0.synchronize()?;
        meter.epoch_end(&loader);
    }
    sinks.finish()?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    Ok((RunReport::new(&loader, &meter), loader))
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
