//! What a driver of epochs measures as it goes (the CLI's loop, Python's iterators): when the run
//! began, its first plan and batch, each epoch's time, bytes and paths, a blend's samples per
//! dataset. [`super::RunReport::new`] reads it beside the loader's own counters.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::pipeline::{Batch, Loader};

/// An epoch in progress.
#[derive(Debug, Clone)]
struct OpenEpoch {
    began: Instant,
    bytes0: u64,
    paths0: Vec<(ubdirect_ub::ReadPath, u64)>,
}

/// The run's clock and per-epoch figures, fed by whoever iterates the loader.
#[derive(Debug, Clone)]
pub struct RunMeter {
    start: Instant,
    cpu0: Duration,
    built: Option<f64>,
    planned: Option<f64>,
    first_batch: Option<f64>,
    first_epoch: Option<Instant>,
    last: Option<Instant>,
    open: Option<OpenEpoch>,
    pub(super) epochs: u64,
    pub(super) epoch_gb_per_s: Vec<f64>,
    pub(super) epoch_start_s: Vec<f64>,
    pub(super) epoch_paths: Vec<Vec<(ubdirect_ub::ReadPath, u64)>>,
    pub(super) last_epoch: (u64, f64),
    pub(super) per_dataset: Vec<u64>,
}

impl Default for RunMeter {
    fn default() -> Self {
        Self::new()
    }
}

impl RunMeter {
    /// A meter whose run starts now (before the loader is built: its start-up counts).
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            cpu0: cpu_time(),
            built: None,
            planned: None,
            first_batch: None,
            first_epoch: None,
            last: None,
            open: None,
            epochs: 0,
            epoch_gb_per_s: Vec::new(),
            epoch_start_s: Vec::new(),
            epoch_paths: Vec::new(),
            last_epoch: (0, 0.0),
            per_dataset: Vec::new(),
        }
    }

    /// The loader is built.
    pub fn built(&mut self, loader: &Loader) {
        self.built.get_or_insert(self.start.elapsed().as_secs_f64());
        self.per_dataset = vec![0; loader.gpt().map_or(0, |g| g.weights.len())];
    }

    /// Epoch 0's first plan is made (the CLI plans it before the first epoch; an iterator that
    /// plans inside its epoch counts its plan in the epoch's start).
    pub fn planned(&mut self) {
        self.planned
            .get_or_insert(self.start.elapsed().as_secs_f64());
    }

    /// An epoch is asked for (an epoch still open ends first).
    pub fn epoch_begin(&mut self, loader: &Loader) {
        self.epoch_end(loader);
        let now = Instant::now();
        if self.first_epoch.is_none() {
            // CPU per delivered GB counts the epochs, not the start-up (generation, index builds).
            self.first_epoch = Some(now);
            self.cpu0 = cpu_time();
        }
        let stats = loader.stats();
        self.open = Some(OpenEpoch {
            began: now,
            bytes0: stats.sample_bytes.load(Ordering::Relaxed),
            paths0: stats.bytes_per_path(),
        });
        self.epochs += 1;
    }

    /// The epoch's iterator is ready (its plan checked, the page cache prepared): the epoch's start.
    pub fn epoch_ready(&mut self) {
        if let Some(o) = &self.open {
            self.epoch_start_s.push(o.began.elapsed().as_secs_f64());
            if self.epochs == 1 {
                self.planned();
            }
        }
    }

    /// A batch was delivered.
    pub fn batch(&mut self, loader: &Loader, b: &Batch) {
        let now = Instant::now();
        self.first_batch
            .get_or_insert(now.duration_since(self.start).as_secs_f64());
        self.last = Some(now);
        if let Some(g) = loader.gpt().filter(|g| !g.weights.is_empty()) {
            for s in b.samples() {
                if let Some(n) = self.per_dataset.get_mut(g.part_of(s.id)) {
                    *n += 1;
                }
            }
        }
    }

    /// The open epoch is over (delivered whole, stopped, or dropped); nothing when none is open.
    pub fn epoch_end(&mut self, loader: &Loader) {
        let Some(o) = self.open.take() else { return };
        let now = Instant::now();
        self.last = Some(now);
        let stats = loader.stats();
        let bytes = stats
            .sample_bytes
            .load(Ordering::Relaxed)
            .saturating_sub(o.bytes0);
        let secs = now.duration_since(o.began).as_secs_f64();
        self.last_epoch = (bytes, secs);
        self.epoch_gb_per_s
            .push(bytes as f64 / secs.max(1e-9) / 1e9);
        self.epoch_paths
            .push(since(&stats.bytes_per_path(), &o.paths0));
    }

    /// Seconds from the start to the loader built, to epoch 0's first plan, to the first batch.
    pub(super) fn startup(&self) -> (f64, f64, Option<f64>) {
        let built = self.built.unwrap_or(0.0);
        (built, self.planned.unwrap_or(built), self.first_batch)
    }

    /// Seconds from the first epoch's start to the last batch or epoch end (0 before any).
    pub(super) fn seconds(&self) -> f64 {
        match (self.first_epoch, self.last) {
            (Some(a), Some(b)) => b.saturating_duration_since(a).as_secs_f64(),
            _ => 0.0,
        }
    }

    /// Seconds from the run's start to the last batch or epoch end (or now, before any).
    pub(super) fn wall(&self) -> f64 {
        self.last
            .unwrap_or_else(Instant::now)
            .saturating_duration_since(self.start)
            .as_secs_f64()
    }

    /// Process CPU seconds since the first epoch began.
    pub(super) fn cpu(&self) -> f64 {
        cpu_time().saturating_sub(self.cpu0).as_secs_f64()
    }
}

/// Bytes per read path moved since `before` (paths that moved none left out).
pub(super) fn since(
    now: &[(ubdirect_ub::ReadPath, u64)],
    before: &[(ubdirect_ub::ReadPath, u64)],
) -> Vec<(ubdirect_ub::ReadPath, u64)> {
    now.iter()
        .filter_map(|&(p, bytes)| {
            let was = before.iter().find(|(q, _)| *q == p).map_or(0, |(_, b)| *b);
            let bytes = bytes.saturating_sub(was);
            (bytes > 0).then_some((p, bytes))
        })
        .collect()
}

/// User + system CPU time of this process so far (0 where the kernel does not say).
fn cpu_time() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    getrusage(UsageWho::RUSAGE_SELF).map_or(Duration::ZERO, |u| {
        let tv = |t: nix::sys::time::TimeVal| {
            Duration::new(t.tv_sec().max(0) as u64, (t.tv_usec().max(0) as u32) * 1000)
        };
        tv(u.user_time()) + tv(u.system_time())
    })
}
