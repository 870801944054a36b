//! An epoch planned and produced a segment at a time: the plan of a segment from a global position
//! (in the epoch's order, over the loader's shuffle blocks), its check against the pools, and the
//! producer that runs segment after segment, planning the next on a blocking thread while one is
//! read (docs/decisions.md, "An epoch's order computed by position").

use std::sync::Arc;

use tokio::sync::mpsc;

use super::{Inner, LoadError, Starved, advise, chunk, pagecache, space};
use crate::planner::{EpochPlan, PlanConfig, SampleSpace};

/// This rank's plan of `epoch` from global position `start`, in the epoch's order (a function of
/// position over the loader's shuffle blocks, cut once).
pub(super) fn plan_of(
    inner: &Inner,
    epoch: u64,
    start: u64,
    max_batches: u64,
) -> Result<EpochPlan, LoadError> {
    let samples = space(inner);
    let cfg = &inner.plan_cfg;
    // Blocks only where the order is made of them: Megatron's order and a blend's need none (it
    // would be a scan of every window at 10⁸ windows).
    let explicit =
        matches!(samples, SampleSpace::Gpt(_, g) if g.order.is_some() || !g.weights.is_empty());
    let blocks = (!explicit && cfg.shuffle).then(|| {
        inner
            .blocks
            .get_or_init(|| Arc::new(crate::planner::Blocks::of(&samples, 0..samples.len(), cfg)))
            .clone()
    });
    let order = crate::planner::epoch_order(&samples, cfg, epoch, blocks);
    Ok(crate::planner::plan_segment(
        &samples,
        &order,
        cfg,
        epoch,
        inner.rank,
        inner.world,
        start,
        max_batches,
    )?)
}

/// Refuses a plan whose chunks cannot be read with the loader's pools (the errors name the keys).
pub(super) fn check_chunks(inner: &Inner, plan: &EpochPlan) -> Result<(), LoadError> {
    for (ci, c) in plan.chunks.iter().enumerate() {
        if inner.batch_pool.is_none() && c.reads.len() > inner.staging.block_count() {
            return Err(LoadError::Config(format!(
                "chunk {ci} (batches {:?}) needs {} reads but pool.staging_blocks is {}: host batches hold their reads; raise pool.staging_blocks, loader.max_gap or loader.shuffle_block",
                c.batch_range(),
                c.reads.len(),
                inner.staging.block_count()
            )));
        }
        if let Some(bp) = &inner.batch_pool {
            let need: u64 = if plan.packed_sample_bytes.is_some() || plan.packed_parts {
                chunk::packed::block_bytes(plan, c, inner.tensors.as_ref())
            } else {
                c.reads.iter().map(|r| r.len.div_ceil(4096) * 4096).sum()
            };
            if need > bp.block_size() as u64 {
                return Err(LoadError::Config(format!(
                    "chunk {ci} (batches {:?}) reads {need} bytes but pool.batch_block_size is {}: raise it, or lower loader.batch_size or loader.max_chunk_batches",
                    c.batch_range(),
                    bp.block_size()
                )));
            }
        }
    }
    Ok(())
}

/// Produces an epoch's chunks, segment after segment, into `tx`: `first`, then each next segment
/// of the plan, made on a blocking thread while the one before is read, checked, (for a cache that
/// knows the order) scheduled, and given a prefetch advisor of its own when the sources want advice
/// (the first segment's is the iterator's). A segment that cannot be planned is an error at its
/// place in the stream (the batches before it are delivered).
#[allow(clippy::too_many_arguments)] // the producer's parts, each moved into the task
pub(super) async fn produce_segments(
    inner: Arc<Inner>,
    epoch: u64,
    first: Arc<EpochPlan>,
    tx: mpsc::Sender<chunk::ChunkHandle>,
    mapped: pagecache::Mapped,
    issued: tokio::sync::watch::Sender<u64>,
    starved: Arc<Starved>,
    schedule: bool,
) {
    let mut plan = first;
    // The issued-bytes counter of the segment at hand: the first segment's is `issued` (its advisor
    // was started with the iterator); each later one has its own, and its advisor ends with it.
    let mut own: Option<tokio::sync::watch::Sender<u64>> = None;
    loop {
        let next = (plan.later_batches > 0).then(|| {
            let (inner, at) = (inner.clone(), plan.end());
            let batches = next_segment_batches(&inner.plan_cfg, plan.batches.len() as u64);
            tokio::task::spawn_blocking(move || plan_of(&inner, epoch, at, batches))
        });
        chunk::produce(
            inner.clone(),
            plan.clone(),
            0,
            tx.clone(),
            mapped.clone(),
            own.as_ref().unwrap_or(&issued),
            starved.clone(),
        )
        .await;
        let Some(next) = next else {
            return;
        };
        if tx.is_closed() {
            return; // the consumer is gone
        }
        let planned = match next.await {
            Ok(p) => p.and_then(|p| check_chunks(&inner, &p).map(|()| p)),
            Err(e) => Err(LoadError::Config(format!(
                "planning epoch {epoch} from position {}: {e}",
                plan.end()
            ))),
        };
        match planned {
            Ok(p) => plan = Arc::new(p),
            Err(e) => {
                let _ = tx.send(tokio::spawn(async move { Err(e) })).await;
                return;
            }
        }
        if let Some(e) = &inner.estimator {
            e.epoch(&plan);
        }
        if schedule {
            let (this, mine) = advise::node_plans(&inner, plan.clone());
            advise::schedule_as(
                &inner,
                std::slice::from_ref(&this),
                mine,
                advise::new_generation(),
            );
        }
        own = (inner.advise_window > 0).then(|| {
            let (tx, rx) = tokio::sync::watch::channel(0u64);
            drop(tokio::spawn(advise::advise(
                inner.clone(),
                plan.clone(),
                inner.advise_window,
                rx,
            )));
            tx
        });
    }
}

/// This rank's batches in one segment of an epoch's plan: about 2^16 samples (and at least four
/// chunks' worth), so a plan in memory is a few MB whatever the dataset, and planning it takes
/// milliseconds. The iterator plans the next segment while this one is read.
pub(super) fn segment_batches(cfg: &PlanConfig) -> u64 {
    const SEGMENT_SAMPLES: u64 = 1 << 16;
    batches_of(cfg, SEGMENT_SAMPLES)
}

/// The batches of the first segment an iterator reads: about 2^12 samples, so the first batch
/// waits on planning a sixteenth of a segment (since 2026-12-05: at 10⁸ Megatron-order windows the
/// first plan of 2^16 samples was a third of a cached start). Each next segment is twice the one
/// before, up to [`segment_batches`], planned while the one before is read. Not where a cache
/// schedules by the known order (an object store's): its horizon is the segment, and a short first
/// one made its first decisions with less of the future (two ranks sharing a cache in step fetched
/// 1.23× Belady's bytes instead of 1.01–1.06×, `loader/tests/object_store_plan.rs`).
pub(super) fn first_segment_batches(inner: &Inner) -> u64 {
    let cfg = &inner.plan_cfg;
    if inner.sources.iter().any(|s| s.wants_schedule()) {
        return segment_batches(cfg);
    }
    least_segment_batches(cfg)
}

fn least_segment_batches(cfg: &PlanConfig) -> u64 {
    const FIRST_SEGMENT_SAMPLES: u64 = 1 << 12;
    batches_of(cfg, FIRST_SEGMENT_SAMPLES).min(segment_batches(cfg))
}

/// The segment after one of `batches` batches.
fn next_segment_batches(cfg: &PlanConfig, batches: u64) -> u64 {
    batches
        .saturating_mul(2)
        .clamp(least_segment_batches(cfg), segment_batches(cfg))
}

fn batches_of(cfg: &PlanConfig, samples: u64) -> u64 {
    samples
        .div_ceil(cfg.batch_size.max(1) as u64)
        .max(4 * cfg.max_chunk_batches as u64)
}

impl super::Loader {
    /// An epoch of no batches, said as an error with its cause (a loop over epochs of nothing ran
    /// forever): the samples there are against a step's, or the windows a GPT sequence length
    /// makes of the dataset's tokens.
    pub(super) fn no_batches(&self) -> LoadError {
        let (n, world) = (self.samples().len(), self.inner.world);
        let cfg = &self.inner.plan_cfg;
        let step = cfg.batch_size as u64 * world as u64;
        let why = match self.gpt() {
            Some(_) if n == 0 => format!(
                "dataset.sequence_length = {} makes no whole window of the dataset's tokens",
                self.inner.cfg.dataset.sequence_length
            ),
            _ if n == 0 => "the dataset has no samples".to_string(),
            _ => format!(
                "{n} samples, fewer than a step of loader.batch_size {} × {world} rank(s) = {step} with loader.remainder = \"drop\"",
                cfg.batch_size
            ),
        };
        LoadError::Config(format!(
            "an epoch of 0 batches: {why}; lower loader.batch_size (or dataset.sequence_length), or set loader.remainder = \"pad\""
        ))
    }
}
