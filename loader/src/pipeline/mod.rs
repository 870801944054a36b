//! The loader: plan → acquire staging lease → read through the shard's [`Source`] → (GPU) copy into
//! the batch's device lease, event → batch. An iterator (blocking, or an async stream) over batches
//! with exact mid-epoch resumption.
//!
//! Split by job: [`crate::shards`] (below) opens shards and indexes them; `chunk` reads a
//! chunk of batches; [`iter`] hands batches to the consumer; `batch` is what it gets.

mod advise;
mod batch;
mod chunk;
mod estimate;
mod fit;
pub mod iter;
mod open;
mod pagecache;
pub mod record;
mod report;
pub mod resolve;
mod segments;
mod shardmap;
mod start;

pub use batch::{Batch, BlockRef, Provenance, SampleEntry, TokenArray};
pub use iter::{EpochIter, EpochStream, Next};
pub use open::NumaPlacement;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use ubdirect_nvme::Engine;
use ubdirect_ub::{Device, ReadPath, Source, UbError, UbPool};

use crate::RunConfig;
pub use crate::error::LoadError;
use crate::formats::index::DatasetIndex;
use crate::planner::PLAN_VERSION;
use crate::planner::{EpochPlan, PlanConfig, SampleSpace};
use segments::{first_segment_batches, plan_of};

/// How long the producer may wait for a block the consumer holds, while the consumer waits for the
/// batch that block is for, before that is [`LoadError::BlocksHeld`] (and not a wait of
/// `pool.acquire_timeout_ms`).
pub const STALL_GRACE: Duration = Duration::from_millis(500);

/// [`STALL_GRACE`], or `UBDIRECT_STALL_GRACE_MS` from the environment: for a program that holds
/// every block on purpose while something else ends the wait (a test of Ctrl-C). Read when a wait
/// is checked (every 100 ms of waiting at most), never on the batch path.
pub(crate) fn stall_grace() -> Duration {
    std::env::var("UBDIRECT_STALL_GRACE_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(STALL_GRACE, Duration::from_millis)
}

/// Which pool the producer waits for, and since when (the iterator's stall check).
#[derive(Debug, Default)]
pub(crate) struct Starved(Mutex<Option<(StarvedOn, std::time::Instant)>>);

/// The pool a producer waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StarvedOn {
    /// The batch pool (before the chunk is handed to the iterator).
    Batch,
    /// The staging pool (host zero-copy batches hold staging blocks).
    Staging,
}

impl Starved {
    /// Acquires a block of `pool`, noting the wait while it lasts.
    pub(crate) async fn acquire(
        &self,
        pool: &UbPool,
        on: StarvedOn,
        deadline: Duration,
    ) -> Result<ubdirect_ub::Lease, UbError> {
        if let Some(l) = pool.try_acquire() {
            return Ok(l);
        }
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some((on, std::time::Instant::now()));
        let r = pool.acquire(deadline).await;
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
        r
    }

    /// The pool waited for, if the wait began at least `grace` ago.
    pub(crate) fn since(&self, grace: Duration) -> Option<StarvedOn> {
        let g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        g.filter(|(_, t)| t.elapsed() >= grace).map(|(on, _)| on)
    }
}

/// Where a loader stands: enough to continue exactly where it stopped — at this or any other world
/// size (the position is global: samples every rank together consumed in the epoch's order).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// Epoch.
    pub epoch: u64,
    /// Next batch to deliver in that epoch (this rank's count at this world size).
    pub next_batch: u64,
    /// Global position in the epoch's order: the samples all ranks delivered before the next batch.
    /// A state saved before this field existed has `None`: `next_batch × world_size × batch_size`.
    #[serde(default)]
    pub position: Option<u64>,
    /// Rank.
    pub rank: usize,
    /// World size.
    pub world_size: usize,
    /// Fingerprint of the planner settings.
    pub plan_fingerprint: u64,
    /// Fingerprint of the dataset index.
    pub index_fingerprint: u64,
    /// The settings the plan fingerprint covers, by config key (`loader.batch_size` → `"64"`): a
    /// refused state names the ones that differ. Empty in a state saved before this field existed.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub settings: std::collections::BTreeMap<String, String>,
}

/// The settings that shape an epoch's plan, by config key (what [`LoaderState::settings`] holds).
fn plan_settings(
    p: &PlanConfig,
    gpt: Option<&crate::gpt::GptSettings>,
) -> std::collections::BTreeMap<String, String> {
    let size = |b: u64| crate::config::ByteSize(b).to_string();
    let mut m: std::collections::BTreeMap<String, String> = [
        ("loader.batch_size", p.batch_size.to_string()),
        ("loader.seed", p.seed.to_string()),
        ("loader.shuffle", p.shuffle.to_string()),
        ("loader.shuffle_block", size(p.shuffle_block)),
        ("loader.window", p.window.to_string()),
        (
            "loader.remainder",
            format!("{:?}", p.remainder).to_lowercase(),
        ),
        ("loader.min_read", size(p.min_read)),
        ("loader.max_gap", size(p.max_gap)),
        ("loader.max_read", size(p.max_read)),
        ("loader.max_chunk_batches", p.max_chunk_batches.to_string()),
        ("align", p.align.to_string()),
        // The order's version (`planner::PLAN_VERSION`): a state of another version names other
        // samples at its positions.
        ("plan.version", crate::planner::PLAN_VERSION.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if let Some(g) = gpt {
        for (k, v) in [
            ("dataset.sequence_length", g.sequence_length.to_string()),
            ("dataset.add_extra_token", g.add_extra_token.to_string()),
            ("dataset.num_samples", g.num_samples.to_string()),
            ("dataset.split", g.split.clone()),
            ("dataset.split_part", format!("{:?}", g.part).to_lowercase()),
            ("loader.order", format!("{:?}", g.order).to_lowercase()),
            ("dataset.blend", format!("{:?}", g.blend)),
        ] {
            m.insert(k.to_string(), v);
        }
    }
    m
}

/// The settings of `saved` that differ from `mine`, as `key saved → mine`.
fn differing(
    saved: &std::collections::BTreeMap<String, String>,
    mine: &std::collections::BTreeMap<String, String>,
) -> Vec<String> {
    let none = String::from("unset");
    let keys: std::collections::BTreeSet<&String> = saved.keys().chain(mine.keys()).collect();
    keys.into_iter()
        .filter_map(|k| {
            let (a, b) = (saved.get(k).unwrap_or(&none), mine.get(k).unwrap_or(&none));
            (a != b).then(|| format!("{k} {a} (state) vs {b} (this loader)"))
        })
        .collect()
}

/// Read-size histogram buckets: `< 4 KiB`, then powers of two up to `>= 64 MiB`.
pub const HIST_BUCKETS: usize = 16;

/// Counters of a loader's life.
#[derive(Debug, Default)]
pub struct LoaderStats {
    /// Batches delivered.
    pub batches: AtomicU64,
    /// Samples delivered.
    pub samples: AtomicU64,
    /// Sample bytes delivered.
    pub sample_bytes: AtomicU64,
    /// Reads issued.
    pub reads: AtomicU64,
    /// Bytes read.
    pub read_bytes: AtomicU64,
    /// Bytes read for the batches delivered (the rest of `read_bytes` was read ahead for batches
    /// never delivered: a stop before the epoch's end, an iterator dropped early).
    pub delivered_read_bytes: AtomicU64,
    /// Samples checked against CRC sidecars.
    pub crc_checked: AtomicU64,
    /// Read sizes, bucket `i` counts reads of `[2^(11+i), 2^(12+i))` bytes (first and last open).
    pub read_hist: [AtomicU64; HIST_BUCKETS],
    /// Epochs that cycled through `pool.cold_staging_blocks` staging blocks (most of their bytes
    /// cold and read with O_DIRECT).
    pub cold_staging_epochs: AtomicU64,
    /// Reads given a staging block ahead of an earlier one of the plan, to a less busy device
    /// (`engine.balance_devices`).
    pub reads_ahead: AtomicU64,
    /// Bytes moved from storage per [`ReadPath`] (index: [`ReadPath::index`]).
    pub path_bytes: [AtomicU64; ReadPath::ALL.len()],
    /// Microseconds the consumer waited inside `next` for a batch that was not ready yet (the data
    /// stall a training loop sees; prefetched batches count 0).
    pub wait_us: AtomicU64,
}

impl LoaderStats {
    /// Bytes per read path that moved any, in summary order.
    pub fn bytes_per_path(&self) -> Vec<(ReadPath, u64)> {
        ReadPath::ALL
            .iter()
            .map(|p| (*p, self.path_bytes[p.index()].load(Ordering::Relaxed)))
            .filter(|(_, b)| *b > 0)
            .collect()
    }
}

/// Histogram bucket of a read size.
pub fn hist_bucket(len: u64) -> usize {
    let b = 64 - len.max(1).leading_zeros() as usize; // bits
    b.saturating_sub(12).min(HIST_BUCKETS - 1)
}

struct Inner {
    cfg: RunConfig,
    index: Arc<DatasetIndex>,
    plan_cfg: PlanConfig,
    /// What sample ids mean: the dataset's fingerprint and, in GPT mode, its windows' settings.
    samples_fingerprint: u64,
    /// Where host pools and threads were placed.
    numa: Option<open::NumaPlacement>,
    rank: usize,
    world: usize,
    engine: Engine,
    device: Arc<dyn Device>,
    device_reason: String,
    staging: UbPool,
    /// Staging blocks an epoch holds back when most of its bytes are cold O_DIRECT reads (GPU
    /// batches; 0: none), so that it cycles through `pool.cold_staging_blocks`.
    cold_hold_back: usize,
    /// The pools' `0 = auto` keys as resolved at open ([`resolve`]).
    resolved: Vec<resolve::Resolved>,
    /// The blocks held back now, shared by the epochs alive at once (two cold epochs' iterators
    /// alive together hold back one set, never two).
    held_back: Mutex<std::sync::Weak<ubdirect_ub::HeldBack>>,
    batch_pool: Option<UbPool>,
    /// GPU batches packed from pieces (GPT windows, several-column samples): pinned blocks of the
    /// batch block's size where a chunk is assembled on the host, then copied to the GPU in one
    /// transfer (a copy per piece — 2 KiB windows — cost a driver call each).
    pack_pool: Option<UbPool>,
    /// One source per shard: the only way the pipeline reads.
    sources: Vec<Arc<dyn Source>>,
    /// The object store's cost of each epoch, predicted as it starts (object-store datasets).
    estimator: Option<estimate::Estimator>,
    /// Deadline of one read.
    read_deadline: Duration,
    /// Bytes of planned reads advised to the sources ahead of the reads issued (their largest
    /// [`Source::advise_window`]); 0: no advice.
    advise_window: u64,
    /// Chunks kept ahead of the consumer: `loader.prefetch`, or more where the sources ask
    /// ([`Opened::read_ahead`](crate::shards::Opened): object stores without a cache).
    read_ahead: usize,
    /// The planner's `min_read` when the sources raised it above `loader.min_read`.
    raised_min_read: Option<u64>,
    /// The registered page cache (GPU or contiguous host batches, `pool.page_cache_budget` > 0).
    page_cache: Option<pagecache::PageCache>,
    /// Local shards read through the engine, with their identity when opened: checked at every
    /// epoch's start (a shard rewritten in place, even with its mtime put back, is an error).
    shard_idents: Vec<(Arc<ubdirect_nvme::FileSource>, ubdirect_ub::FileIdent)>,
    /// Per shard, the local device its reads are balanced on (`engine.balance_devices`): `Some`
    /// when the local shards lie on two devices or more and staging blocks are free again once
    /// copied (batches in a batch block), so reads may be given blocks across chunks.
    read_devices: Option<ReadDevices>,
    /// Chunks' working lists, kept from one chunk to the next.
    spare: chunk::Spare,
    crcs: Option<Arc<Vec<u32>>>,
    /// GPT mode: the samples (windows across sequences) the planner orders.
    gpt: Option<Arc<crate::gpt::GptSamples>>,
    /// `dataset.columns`: the other columns' locations, row for row.
    columns: Option<Vec<Vec<crate::formats::index::SampleLoc>>>,
    /// What one sample is, where the format says (`Err`: why not), for typed host tensors.
    sample_type: Result<crate::formats::sample_type::SampleType, String>,
    /// GPT mode, `[dataset.tensors]`: Megatron's per-sample tensors made in each batch's block.
    tensors: Option<crate::gpt::masks::TensorSpec>,
    /// Seconds each phase of the start took (device, engine, dataset, pools, page cache).
    startup: Vec<(&'static str, f64)>,
    stats: LoaderStats,
    state: Mutex<LoaderState>,
    /// The last few epoch plans, by (epoch, position).
    plans: Mutex<PlanCache>,
    /// Plans being made in the background (their keys), and its signal: a caller that needs one of
    /// them waits for it instead of planning the same epoch a second time.
    planning: (Mutex<Vec<(u64, u64)>>, std::sync::Condvar),
    /// The samples' shuffle blocks, cut once (they depend on the dataset and `shuffle_block`, not
    /// on the epoch): O(blocks), arithmetic for fixed-size records.
    blocks: std::sync::OnceLock<Arc<crate::planner::Blocks>>,
    /// The node's ranks' plans of one (epoch, position) for the object cache's schedule
    /// ([`advise::node_plans`]): those of the next epoch are made in the background during this one.
    node_plans: Mutex<Option<advise::NodePlans>>,
    acquire_timeout: Duration,
    /// A synthetic dataset written at open (`dataset.generate`).
    generated: Option<crate::shards::dataset::Generated>,
}

/// The devices (file systems) of the local shards, for balancing reads over them.
#[derive(Debug, Clone)]
pub(crate) struct ReadDevices {
    /// Per shard: its device's index; 0 for a shard not on a local device.
    pub shard: Arc<Vec<u32>>,
    /// Indices in use (the local devices, plus index 0).
    pub count: usize,
}

/// `pool.staging_blocks = 0` (the default) with GPU batches.
pub const STAGING_BLOCKS_GPU: usize = 24;
/// `pool.staging_blocks = 0` (the default) with host batches, which hold their blocks.
pub const STAGING_BLOCKS_HOST: usize = 64;
/// `pool.cold_staging_blocks = 0` with the default staging depth and GPU batches: the blocks an
/// epoch of cold O_DIRECT reads cycles through (docs/decisions.md, "Cold staging depth").
pub const COLD_STAGING_BLOCKS_GPU: usize = 12;

/// Chunks assembled on the host at once for packed GPU batches (each a pinned block of
/// `pool.batch_block_size`): assembly is a few memcpys, so a few blocks keep up with the prefetch.
const PACK_BLOCKS: usize = 4;

/// The dataset iterator. Owns its runtime, engine, pools and device.
pub struct Loader {
    inner: Arc<Inner>,
    rt: Arc<LoaderRuntime>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("rank", &self.inner.rank)
            .field("world", &self.inner.world)
            .field("samples", &self.inner.index.samples.len())
            .finish()
    }
}

/// The loader's own runtime. Dropped from inside another runtime's task (a Rust user's async code),
/// it shuts down in the background instead of blocking, which tokio forbids there.
pub(crate) struct LoaderRuntime(Option<tokio::runtime::Runtime>);

impl std::ops::Deref for LoaderRuntime {
    type Target = tokio::runtime::Runtime;
    fn deref(&self) -> &tokio::runtime::Runtime {
        // Only `drop` takes the runtime out.
        self.0
            .as_ref()
            .unwrap_or_else(|| unreachable!("runtime used after drop"))
    }
}

impl Drop for LoaderRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            if tokio::runtime::Handle::try_current().is_ok() {
                rt.shutdown_background();
            } else {
                drop(rt);
            }
        }
    }
}

/// Recent plans by (epoch, position).
type PlanCache = std::collections::VecDeque<((u64, u64), Arc<EpochPlan>)>;

/// What the planner orders for this loader.
fn space(inner: &Inner) -> SampleSpace<'_> {
    space_of(&inner.index, inner.gpt.as_deref(), inner.columns.as_deref())
}

/// The samples of `index`: GPT windows over it, several columns of its rows, or its samples.
fn space_of<'a>(
    index: &'a crate::formats::index::DatasetIndex,
    gpt: Option<&'a crate::gpt::GptSamples>,
    columns: Option<&'a [Vec<crate::formats::index::SampleLoc>]>,
) -> SampleSpace<'a> {
    match (gpt, columns) {
        (Some(g), _) => SampleSpace::Gpt(index, g),
        (None, Some(c)) => SampleSpace::Columns(index, c),
        (None, None) => SampleSpace::Plain(index),
    }
}

/// The plan of `key` once a background planning of it ends (`None`: none was made).
fn planned(inner: &Inner, key: (u64, u64)) -> Option<Arc<EpochPlan>> {
    {
        let (lock, cv) = &inner.planning;
        let g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let _g = cv
            .wait_timeout_while(g, Duration::from_secs(120), |k| k.contains(&key))
            .unwrap_or_else(|p| p.into_inner());
    }
    let c = inner.plans.lock().unwrap_or_else(|p| p.into_inner());
    c.iter().find(|(k, _)| *k == key).map(|(_, p)| p.clone())
}

/// Keeps a plan for reuse (at most 3: this epoch, the next, one more).
fn remember(inner: &Inner, key: (u64, u64), plan: Arc<EpochPlan>) {
    let mut c = inner.plans.lock().unwrap_or_else(|p| p.into_inner());
    if !c.iter().any(|(k, _)| *k == key) {
        c.push_back((key, plan));
        while c.len() > 3 {
            c.pop_front();
        }
    }
}

impl Loader {
    /// This rank's whole plan for an epoch, in one piece: O(samples) of memory and time, for tools
    /// and tests. The iterator plans an epoch a segment at a time ([`Loader::first_plan`]); for
    /// an epoch shorter than a segment the two are the same.
    pub fn plan(&self, epoch: u64) -> Result<Arc<EpochPlan>, LoadError> {
        Ok(Arc::new(plan_of(&self.inner, epoch, 0, u64::MAX)?))
    }

    /// The first segment of this rank's plan for an epoch: what its iterator reads first (made
    /// once; [`EpochPlan::total_batches`] counts the whole epoch).
    pub fn first_plan(&self, epoch: u64) -> Result<Arc<EpochPlan>, LoadError> {
        self.cached_plan(epoch, 0)
    }

    /// This rank's batches in an epoch (from its first segment's plan: no epoch is planned whole).
    pub fn batches_in_epoch(&self, epoch: u64) -> Result<u64, LoadError> {
        Ok(self.cached_plan(epoch, 0)?.total_batches())
    }

    /// This rank's plan for the rest of an epoch from global position `start`, whole.
    pub fn plan_from(&self, epoch: u64, start: u64) -> Result<EpochPlan, LoadError> {
        plan_of(&self.inner, epoch, start, u64::MAX)
    }

    /// The plan of (`epoch`, `position`), from the cache when an earlier call (or the background
    /// planning of the next epoch, started here) made it. Plans of a million samples take tens of
    /// milliseconds: kept off the path between epochs.
    fn cached_plan(&self, epoch: u64, position: u64) -> Result<Arc<EpochPlan>, LoadError> {
        let key = (epoch, position);
        // A plan of this key being made in the background: wait for it (planning millions of
        // samples twice would put seconds before this epoch's first batch).
        {
            let (lock, cv) = &self.inner.planning;
            let g = lock.lock().unwrap_or_else(|p| p.into_inner());
            let _g = cv
                .wait_timeout_while(g, Duration::from_secs(120), |k| k.contains(&key))
                .unwrap_or_else(|p| p.into_inner());
        }
        let hit = {
            let c = self.inner.plans.lock().unwrap_or_else(|p| p.into_inner());
            c.iter().find(|(k, _)| *k == key).map(|(_, p)| p.clone())
        };
        let plan = match hit {
            Some(p) => p,
            None => {
                let p = Arc::new(plan_of(
                    &self.inner,
                    epoch,
                    position,
                    first_segment_batches(&self.inner),
                )?);
                remember(&self.inner, key, p.clone());
                p
            }
        };
        Ok(plan)
    }

    /// Plans the epoch after `epoch` in the background when the run will read it: `loader.epochs`
    /// says so, or a second epoch has started (a loop over epochs). A single pass plans nothing it
    /// will not use (planning millions of small samples costs seconds of a core).
    fn plan_next_in_background(&self, epoch: u64) {
        let epochs = self.inner.cfg.loader.epochs;
        let looping = epochs <= 1 && epoch >= 1; // the caller loops past `loader.epochs`
        if epoch + 1 >= epochs && !looping {
            return;
        }
        let next = (epoch + 1, 0);
        let known = self
            .inner
            .plans
            .lock()
            .map(|c| c.iter().any(|(k, _)| *k == next))
            .unwrap_or(true);
        let started = !known && {
            let mut k = self
                .inner
                .planning
                .0
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let fresh = !k.contains(&next);
            if fresh {
                k.push(next);
            }
            fresh
        };
        if started {
            let inner = self.inner.clone();
            drop(self.rt.spawn_blocking(move || {
                if let Ok(p) = plan_of(&inner, next.0, 0, first_segment_batches(&inner)) {
                    remember(&inner, next, Arc::new(p));
                }
                // Done (or failed: the caller then plans and reports the error itself).
                let (lock, cv) = &inner.planning;
                lock.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .retain(|k| *k != next);
                cv.notify_all();
            }));
        }
    }

    /// What one whole sample is — element type and shape — where the format says (raw's keys, the
    /// first `.npy` header, an Arrow list column, Megatron's token type); else why not.
    pub fn sample_type(&self) -> Result<&crate::formats::sample_type::SampleType, &str> {
        self.inner.sample_type.as_ref().map_err(String::as_str)
    }

    /// What the planner orders: the index's samples, GPT windows, or several-column rows.
    pub fn samples(&self) -> SampleSpace<'_> {
        space(&self.inner)
    }

    /// GPT mode: the samples (their dtype, tokens per sample, blended datasets).
    pub fn gpt(&self) -> Option<&crate::gpt::GptSamples> {
        self.inner.gpt.as_deref()
    }

    /// Where the loader stands (after the last batch an iterator delivered).
    pub fn state(&self) -> LoaderState {
        self.inner
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Iterates the batches of `epoch` from its start.
    pub fn epoch(&self, epoch: u64) -> Result<EpochIter, LoadError> {
        self.epoch_from(epoch, 0)
    }

    /// The batches of `epoch` as an async stream (for callers on an async runtime; any executor).
    pub fn stream(&self, epoch: u64) -> Result<EpochStream, LoadError> {
        Ok(self.epoch(epoch)?.into_stream())
    }

    /// Continues exactly where `state` stood: from its global position, at this loader's world size
    /// and rank (which may differ from the state's: each rank of the new world takes its slice of
    /// each global batch from there, so nothing is skipped or repeated). A state taken at the end
    /// of an epoch continues at the start of the next, as torchdata's `StatefulDataLoader` does.
    /// Refused if the state belongs to another dataset or planner setting (the error names the
    /// settings that differ).
    pub fn resume(&self, state: &LoaderState) -> Result<EpochIter, LoadError> {
        let (epoch, position) = self.resume_point(state)?;
        self.epoch_from(epoch, position)
    }

    /// Checks `state` against this loader and returns where it continues: (epoch, global
    /// position), an epoch's end being the next epoch's start.
    pub fn resume_point(&self, state: &LoaderState) -> Result<(u64, u64), LoadError> {
        let mine = self.state();
        // Before the dataset and settings: a state of another plan version is refused by name
        // (version 1 states, saved before the field, carry settings without it).
        let version = PLAN_VERSION.to_string();
        let saved = state.settings.get("plan.version");
        if saved != Some(&version) {
            return Err(LoadError::Resume(format!(
                "the state was saved with plan order version {} and this build plans version {version}: {}; resume with the build that saved it, or start the epoch again",
                saved.map_or("1", |s| s.as_str()),
                crate::planner::order::changes_since(
                    saved
                        .map_or(Some(1), |s| s.parse().ok())
                        .unwrap_or(u64::MAX)
                )
            )));
        }
        if state.index_fingerprint != mine.index_fingerprint {
            return Err(LoadError::Resume(
                "the dataset differs from the one the state was saved with (shards, sizes or sample count)".into(),
            ));
        }
        if state.plan_fingerprint != mine.plan_fingerprint {
            let diff = differing(&state.settings, &mine.settings);
            return Err(LoadError::Resume(
                if state.settings.is_empty() || diff.is_empty() {
                    "loader settings (batch size, seed, shuffle, reads, GPT settings) differ from the saved state's (a state saved before states named their settings)".into()
                } else {
                    format!(
                        "settings differ from the saved state's: {}; set them as they were to resume",
                        diff.join(", ")
                    )
                },
            ));
        }
        let step = state.world_size as u64 * self.inner.plan_cfg.batch_size as u64;
        let position = match state.position {
            Some(p) => p,
            None => state.next_batch.checked_mul(step).ok_or_else(|| {
                LoadError::Resume(format!("next_batch {} overflows", state.next_batch))
            })?,
        };
        // At (or past) the epoch's end: the next epoch from its start.
        if self.cached_plan(state.epoch, position)?.batches.is_empty() {
            let next = state
                .epoch
                .checked_add(1)
                .ok_or_else(|| LoadError::Resume(format!("epoch {} overflows", state.epoch)))?;
            return Ok((next, 0));
        }
        Ok((state.epoch, position))
    }

    fn epoch_from(&self, epoch: u64, position: u64) -> Result<EpochIter, LoadError> {
        let plan = self.cached_plan(epoch, position)?;
        if position == 0 && plan.total_batches() == 0 {
            return Err(self.no_batches());
        }
        self.plan_next_in_background(epoch);
        self.run_plan(epoch, plan, true)
    }

    /// Where this rank's host pools are bound and its threads run: its GPU's NUMA node and CPUs on
    /// a host of several nodes, `pool.numa_node` when set; `None`: left to the kernel.
    pub fn numa_placement(&self) -> Option<&NumaPlacement> {
        self.inner.numa.as_ref()
    }

    /// What sample ids mean for this loader (its dataset and, in GPT mode, the windows' settings):
    /// equal fingerprints name the same samples by the same ids.
    pub fn samples_fingerprint(&self) -> u64 {
        self.inner.samples_fingerprint
    }
}
