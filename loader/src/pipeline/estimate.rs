//! The object store's cost: the default cache that keeps Megatron order from a GET per window, the
//! warning where there is none, and the cost predicted before each epoch and set beside what it
//! cost (since
//! 2026-12-07, issue 47): each epoch's (or segment's) planned reads of this process are replayed
//! through the cache's decisions ([`objstore::Replay`]) on a thread of their own, in epoch order —
//! an epoch of 10⁸ windows replays its first 2²⁰ reads, and the first batch waits for none of it —
//! and summed for the run report beside the counters since the first epoch began.

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::RunConfig;
use crate::objstore::{self, CacheModel, CostReport, Estimate, StatsSnapshot};
use crate::planner::EpochPlan;

/// Predicts each epoch's cost as it starts ([`Estimator::epoch`]).
pub(super) struct Estimator {
    tx: Mutex<Option<mpsc::Sender<Arc<EpochPlan>>>>,
    shared: Arc<Shared>,
    prices: Prices,
    in_flight: usize,
}

#[derive(Debug, Clone, Copy)]
struct Prices {
    request_ms: f64,
    gbps: f64,
    per_1k: f64,
    per_gb: f64,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    replayed: Condvar,
}

#[derive(Default)]
struct State {
    sent: u64,
    replayed: u64,
    predicted: Estimate,
    /// The counters when the first epoch began (the opening's HEADs and listings are not an
    /// epoch's).
    first: Option<StatsSnapshot>,
}

impl Estimator {
    /// An estimator of a dataset of shards `sizes` (`objects`: whether each is in an object store)
    /// read through `model` with `in_flight` reads at once; `None` when no shard is in a store (or
    /// without the `object-store` feature).
    pub(super) fn new(
        cfg: &RunConfig,
        model: Option<CacheModel>,
        sizes: Vec<u64>,
        objects: Vec<bool>,
        in_flight: usize,
    ) -> Option<Self> {
        let model = model.filter(|_| objects.iter().any(|&o| o))?;
        let shared = Arc::new(Shared::default());
        let tx = spawn(model, sizes, objects, shared.clone())?;
        let o = &cfg.object_store;
        let bound = if o.max_in_flight > 0 {
            o.max_in_flight
        } else {
            usize::MAX
        };
        Some(Self {
            tx: Mutex::new(Some(tx)),
            shared,
            prices: Prices {
                request_ms: o.estimate_request_ms,
                gbps: o.estimate_gbps,
                per_1k: o.price_per_1k_requests,
                per_gb: o.price_per_gb,
            },
            in_flight: in_flight.clamp(1, bound),
        })
    }

    /// An epoch (or the next segment of one) starts with `plan`: replayed in the background.
    pub(super) fn epoch(&self, plan: &Arc<EpochPlan>) {
        let mut s = lock(&self.shared.state);
        s.first.get_or_insert_with(objstore::stats);
        let tx = lock(&self.tx);
        if let Some(tx) = tx.as_ref()
            && tx.send(plan.clone()).is_ok()
        {
            s.sent += 1;
        }
    }

    /// The run's cost so far, waiting up to `wait` for epochs still being replayed.
    pub(super) fn report(&self, wait: Duration) -> Option<CostReport> {
        let until = Instant::now() + wait;
        let mut s = lock(&self.shared.state);
        while s.replayed < s.sent {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self
                .shared
                .replayed
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let first = s.first?;
        let now = objstore::stats();
        let p = self.prices;
        let realised = Estimate {
            requests: now.requests.saturating_sub(first.requests),
            bytes: now.bytes_from_store.saturating_sub(first.bytes_from_store),
            ..Estimate::default()
        };
        Some(CostReport {
            predicted: s.predicted,
            epochs: s.replayed,
            pending: s.sent - s.replayed,
            realised_requests: realised.requests,
            realised_bytes: realised.bytes,
            request_ms: p.request_ms,
            gbps: p.gbps,
            in_flight: self.in_flight,
            predicted_s: s
                .predicted
                .seconds(p.request_ms / 1e3, self.in_flight, p.gbps * 1e9),
            predicted_usd: s.predicted.usd(p.per_1k, p.per_gb),
            realised_usd: realised.usd(p.per_1k, p.per_gb),
        })
    }
}

impl Drop for Estimator {
    fn drop(&mut self) {
        // The thread ends with its channel.
        lock(&self.tx).take();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The replaying thread: plans in, in order; each epoch's estimate added to `shared`.
#[cfg(feature = "object-store")]
fn spawn(
    model: CacheModel,
    sizes: Vec<u64>,
    objects: Vec<bool>,
    shared: Arc<Shared>,
) -> Option<mpsc::Sender<Arc<EpochPlan>>> {
    let (tx, rx) = mpsc::channel::<Arc<EpochPlan>>();
    let mut replay = objstore::Replay::new(model);
    let run = move || {
        for plan in rx {
            // The first reads alone (in plan order, the cache's schedule's), however large the
            // epoch: an epoch of 10⁸ windows collects 2²⁰, not 10⁸.
            let object = |r: &&crate::planner::ReadPlan| {
                objects.get(r.shard as usize).copied().unwrap_or(false)
            };
            let reads = || plan.chunks.iter().flat_map(|c| c.reads.iter());
            let total = reads().filter(object).count() as u64;
            let mut per: Vec<Vec<(u64, u64, u64)>> = vec![Vec::new(); sizes.len()];
            let first = reads().enumerate().filter(|(_, r)| object(r));
            for (pos, r) in first.take(objstore::REPLAYED) {
                per[r.shard as usize].push((pos as u64, r.offset, r.len));
            }
            let refs: Vec<&[(u64, u64, u64)]> = per.iter().map(|v| v.as_slice()).collect();
            let e = replay.epoch(&refs, &sizes, total);
            let mut s = lock(&shared.state);
            s.predicted.add(&e);
            s.replayed += 1;
            shared.replayed.notify_all();
        }
    };
    match std::thread::Builder::new()
        .name("ubdirect-estimate".into())
        .spawn(run)
    {
        Ok(_) => Some(tx),
        Err(e) => {
            ubdirect_ub::fallback::record(
                "object_store_estimate",
                format!("no cost estimate: its thread did not start ({e})"),
            );
            None
        }
    }
}

#[cfg(not(feature = "object-store"))]
fn spawn(
    _: CacheModel,
    _: Vec<u64>,
    _: Vec<bool>,
    _: Arc<Shared>,
) -> Option<mpsc::Sender<Arc<EpochPlan>>> {
    None
}

/// The cost estimate of a dataset in an object store (`None` otherwise).
pub(super) fn for_dataset(
    cfg: &RunConfig,
    cost: crate::objstore::CacheModel,
    index: &crate::formats::index::DatasetIndex,
    sources: &[Arc<dyn ubdirect_ub::Source>],
    in_flight: usize,
) -> Option<Estimator> {
    let kind = |p: &std::path::Path| {
        crate::shards::ShardUrl::kind_of(p) == crate::shards::ShardKind::Object
    };
    let objects = index.shards.iter().map(|s| kind(&s.path)).collect();
    let sizes = sources.iter().map(|s| s.size()).collect();
    Estimator::new(cfg, Some(cost), sizes, objects, in_flight)
}

/// The cache an object-store dataset is read through, as the estimate models it: `cache` as
/// resolved at open (its default directory, its window fraction), `max_request` of a GET.
pub(super) fn model_of(cache: &crate::config::CacheSection, max_request: u64) -> CacheModel {
    let cached = cache
        .dir
        .as_ref()
        .is_some_and(|d| !d.as_os_str().is_empty());
    let total = cache.max_bytes.0;
    let windows = (total as f64 * cache.window_fraction.unwrap_or(0.0).clamp(0.0, 1.0)) as u64;
    CacheModel {
        cached,
        chunk_size: cache.chunk_size.0,
        max_bytes: total - windows,
        window_bytes: windows,
        max_request,
    }
}

/// Whether the dataset is GPT in Megatron order from an object store, and the default cache such a
/// run gets without `cache.dir` (`resolve::object_cache`), set in `cache`.
pub(super) fn default_object_cache(
    cfg: &RunConfig,
    dataset: &crate::config::DatasetSection,
    gpt_settings: Option<&crate::gpt::GptSettings>,
    cache: &mut crate::config::CacheSection,
    memory: u64,
) -> (bool, Option<super::resolve::Resolved>) {
    let objects = dataset
        .dir
        .iter()
        .chain(&dataset.paths)
        .any(|p| crate::shards::ShardUrl::kind_of(p) == crate::shards::ShardKind::Object);
    let megatron = cfg.loader.order == crate::gpt::Order::Megatron && gpt_settings.is_some();
    (
        objects && megatron,
        super::resolve::object_cache(cache, objects, megatron, memory, |dir| {
            std::fs::create_dir_all(dir)?;
            Ok(crate::formats::sys::free_bytes(dir).ok())
        }),
    )
}

/// Megatron order from an object store without a cache: said once, before the first batch, with
/// the GETs an epoch costs (one per window).
pub(super) fn warn_without_cache(gpt: Option<&crate::gpt::GptSamples>) {
    let windows = gpt.map_or(0, |g| g.epoch_samples().unwrap_or(g.len()));
    ubdirect_ub::fallback::record(
        "object_store_megatron_without_cache",
        format!(
            "Megatron order from an object store without a cache: about {windows} GETs an epoch (one per window); set cache.dir (or leave it unset for {})",
            super::resolve::DEFAULT_OBJECT_CACHE
        ),
    );
}
