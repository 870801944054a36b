//! An epoch's start, between epochs and never on the hot path: the plan's chunks, the shards and
//! the page cache's mappings checked, a cold epoch's staging held back, the chunk caches' schedule
//! handed over, and the tasks that produce the epoch's batches started.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use ubdirect_ub::{DeviceError, Source};

use super::chunk::ChunkHandle;
use super::pagecache::Mapped;
use super::segments::{check_chunks, produce_segments};
use super::{EpochIter, Inner, LoadError, Loader, Starved, advise, planned};
use crate::planner::EpochPlan;

/// The tasks of an epoch that has started, as its iterator holds them.
struct EpochTasks {
    rx: mpsc::Receiver<ChunkHandle>,
    producer: JoinHandle<()>,
    advisor: Option<JoinHandle<()>>,
    starved: Arc<Starved>,
}

impl Loader {
    /// Runs `plan`; `track`: the resume state follows it (not for replays).
    pub(super) fn run_plan(
        &self,
        epoch: u64,
        plan: Arc<EpochPlan>,
        track: bool,
    ) -> Result<EpochIter, LoadError> {
        let inner = &self.inner;
        check_chunks(inner, &plan)?;
        // Batches are numbered from the plan's first global batch, so a resume at the same world
        // size continues the numbering.
        let start = plan.first_batch;
        let total = start + plan.total_batches();
        start_tracking(inner, epoch, &plan, track);
        // Not on the hot path: shards and mappings are checked, made and registered here, between
        // epochs.
        let t0 = std::time::Instant::now();
        check_shards(&inner.shard_idents)?;
        let checked = t0.elapsed();
        let mapped = match &inner.page_cache {
            Some(pc) => pc.prepare()?,
            None => Arc::new(Vec::new()),
        };
        let prepared = t0.elapsed();
        let held_back = cold_staging(inner);
        let sampled = t0.elapsed();
        let schedule = self.schedule_epoch(epoch, &plan);
        tracing::debug!(target: "ubdirect_loader::epoch", epoch,
            shards_checked_s = checked.as_secs_f64(), page_cache_s = (prepared - checked).as_secs_f64(),
            cold_sample_s = (sampled - prepared).as_secs_f64(), schedule_s = (t0.elapsed() - sampled).as_secs_f64(),
            "epoch start");
        let tasks = self.start_tasks(epoch, &plan, mapped, schedule);
        Ok(EpochIter {
            inner: inner.clone(),
            rt: self.rt.clone(),
            rx: tasks.rx,
            ready: std::collections::VecDeque::new(),
            pending: None,
            waiting_since: None,
            producer: tasks.producer,
            advisor: tasks.advisor,
            starved: tasks.starved,
            epoch,
            next: start,
            total,
            plan_start: plan.start,
            step: plan.step,
            timeout: Duration::from_millis(inner.cfg.loader.batch_timeout_ms),
            done: false,
            track,
            _held_back: held_back,
        })
    }

    /// Hands the chunk caches that want it this epoch's reads (and the next epoch's, later);
    /// whether any source wants the schedule.
    fn schedule_epoch(&self, epoch: u64, plan: &Arc<EpochPlan>) -> bool {
        let inner = &self.inner;
        if let Some(e) = &inner.estimator {
            e.epoch(plan);
        }
        // A cache that knows the order: this epoch's reads of the node's ranks now, then — off the
        // epoch's start — the same schedule extended with the next epoch's, when the run reads it
        // (a plan made in the background: millions of small samples take a core seconds, which the
        // epoch's first batch must not wait for).
        let schedule = inner.sources.iter().any(|s| s.wants_schedule());
        if schedule {
            let generation = advise::new_generation();
            let (this, mine) = advise::node_plans(inner, plan.clone());
            advise::schedule_as(inner, std::slice::from_ref(&this), mine, generation);
            // The next epoch joins the schedule at once when this epoch is one segment; an epoch of
            // several segments schedules each as it is planned (produce_segments).
            if epoch + 1 < inner.cfg.loader.epochs && plan.later_batches == 0 {
                let inner = inner.clone();
                drop(self.rt.spawn_blocking(move || {
                    // Planned in the background since this epoch started (plan_next_in_background).
                    let Some(next) = planned(&inner, (epoch + 1, 0)) else {
                        return;
                    };
                    let epochs = [this, advise::node_plans(&inner, next).0];
                    advise::schedule_as(&inner, &epochs, mine, generation);
                }));
            }
        }
        schedule
    }

    /// Starts the epoch's producer (and the prefetch advisor, where a source wants advice).
    fn start_tasks(
        &self,
        epoch: u64,
        plan: &Arc<EpochPlan>,
        mapped: Mapped,
        schedule: bool,
    ) -> EpochTasks {
        let inner = &self.inner;
        let (tx, rx) = mpsc::channel(inner.read_ahead.max(1));
        let starved = Arc::new(Starved::default());
        let (issued_tx, issued_rx) = tokio::sync::watch::channel(0u64);
        let advisor = (inner.advise_window > 0).then(|| {
            self.rt.spawn(advise::advise(
                inner.clone(),
                plan.clone(),
                inner.advise_window,
                issued_rx,
            ))
        });
        let producer = self.rt.spawn(produce_segments(
            inner.clone(),
            epoch,
            plan.clone(),
            tx,
            mapped,
            issued_tx,
            starved.clone(),
            schedule,
        ));
        EpochTasks {
            rx,
            producer,
            advisor,
            starved,
        }
    }
}

/// Moves the resume state to `plan`'s start (where `track`) and starts the run's span.
fn start_tracking(inner: &Inner, epoch: u64, plan: &EpochPlan, track: bool) {
    if track {
        let mut st = inner.state.lock().unwrap_or_else(|p| p.into_inner());
        st.epoch = epoch;
        st.next_batch = plan.first_batch;
        st.position = Some(plan.start);
        st.rank = inner.rank;
        st.world_size = inner.world;
    }
}

/// Shards sampled at an epoch's start to tell a cold epoch (one `cachestat` each).
const COLD_SAMPLE: usize = 256;

/// At an epoch's start, with GPU batches: when most of the local shards' bytes (a sample of
/// [`COLD_SAMPLE`] shards) will be read with O_DIRECT — cold, not being filled into the page cache
/// — holds back staging blocks for the epoch, so that its reads cycle through
/// `pool.cold_staging_blocks` of them (docs/decisions.md, "Cold staging depth").
fn cold_staging(inner: &Inner) -> Option<Arc<ubdirect_ub::HeldBack>> {
    if inner.cold_hold_back == 0 || inner.shard_idents.is_empty() {
        return None;
    }
    let n = inner.shard_idents.len();
    let step = n.div_ceil(COLD_SAMPLE).max(1);
    let (mut cold, mut all) = (0u64, 0u64);
    for (f, _) in inner.shard_idents.iter().step_by(step) {
        all += f.size();
        if f.reads_cold_direct() {
            cold += f.size();
        }
    }
    if cold * 2 <= all {
        return None;
    }
    inner
        .stats
        .cold_staging_epochs
        .fetch_add(1, Ordering::Relaxed);
    let mut slot = inner.held_back.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(held) = slot.upgrade() {
        return Some(held);
    }
    let held = Arc::new(inner.staging.hold_back(inner.cold_hold_back));
    *slot = Arc::downgrade(&held);
    Some(held)
}

/// Checks that no shard changed since it was opened (size, inode, mtime, ctime: one `fstat` each).
fn check_shards(
    shards: &[(Arc<ubdirect_nvme::FileSource>, ubdirect_ub::FileIdent)],
) -> Result<(), LoadError> {
    for (f, was) in shards {
        let now = f.handle().ident().ok();
        if now.as_ref() != Some(was) {
            return Err(LoadError::Device(DeviceError::Mapped(Box::new(
                ubdirect_ub::MapError::Changed {
                    path: f.handle().path().to_path_buf(),
                    was: Box::new(*was),
                    now: now.map(Box::new),
                },
            ))));
        }
    }
    Ok(())
}
