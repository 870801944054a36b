//! Prefetch advice: the planner's reads, in the plan's order, handed to the sources that want them
//! ([`Source::advise`](ubdirect_ub::Source::advise)) a bounded window ahead of the reads the producer
//! has issued, so that a source with a cache (an object store's) fetches the next chunks while the
//! pipeline reads the current ones.

use std::sync::Arc;

use tokio::sync::watch;

use super::Inner;
use crate::planner::EpochPlan;

/// Advises `plan`'s reads in order, each once the bytes planned before it are within `window` of the
/// bytes `issued` (chunks whose reads the producer started; reads already issued are skipped). Ends
/// with the plan, or when the producer is gone.
pub(super) async fn advise(
    inner: Arc<Inner>,
    plan: Arc<EpochPlan>,
    window: u64,
    mut issued: watch::Receiver<u64>,
) {
    let mut before = 0u64; // bytes planned before the read at hand
    for r in plan.chunks.iter().flat_map(|c| c.reads.iter()) {
        let Some(src) = inner.sources.get(r.shard as usize) else {
            return;
        };
        // A shard the page-cache pool maps now is copied out of the mapping: advice would only
        // have its source fetch or open what no read of it will use.
        let mapped = || {
            inner.page_cache.as_ref().is_some_and(|pc| {
                pc.current()
                    .get(r.shard as usize)
                    .is_some_and(|m| m.is_some())
            })
        };
        loop {
            let done = *issued.borrow_and_update();
            if before + r.len <= done {
                break; // the producer reads it already
            }
            if before < done + window {
                if src.advise_window() > 0 && !mapped() {
                    src.advise(r.offset, r.len as usize);
                }
                break;
            }
            if issued.changed().await.is_err() {
                return; // every read is issued, or the epoch stopped
            }
        }
        before += r.len;
    }
}

/// The node's ranks' plans of one (epoch, start position), in local-rank order (see [`node_plans`]).
pub(super) struct NodePlans {
    key: (u64, u64),
    plans: Vec<Arc<EpochPlan>>,
    mine: usize,
}

/// The plans of the ranks of this node for the epoch of `mine` (this rank's plan), from the same
/// start, in local-rank order, and this rank's index among them: `loader.local_world_size` ranks from
/// `RANK - RANK mod LOCAL_WORLD_SIZE` (torchrun's numbering), within the world. Only `mine` when
/// `cache.node_plan` is off, the node has one rank, or another rank's plan fails (logged once).
///
/// Made once per (epoch, start): the other ranks' plans cost what this rank's does, once per rank
/// (seconds of a core for millions of small samples), so the next epoch's, made in the background
/// during this one, are kept for its start instead of being made again there.
pub(super) fn node_plans(inner: &Inner, mine: Arc<EpochPlan>) -> (Vec<Arc<EpochPlan>>, usize) {
    let local = super::open::local_world_size(&inner.cfg).unwrap_or(1);
    if !inner.cfg.cache.node_plan || local <= 1 || inner.world <= 1 {
        return (vec![mine], 0);
    }
    let key = (mine.epoch, mine.start);
    if let Some(n) = inner
        .node_plans
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .filter(|n| n.key == key)
    {
        let mut plans = n.plans.clone();
        plans[n.mine] = mine; // the same plan; this one is the iterator's
        return (plans, n.mine);
    }
    let base = inner.rank - inner.rank % local;
    let ranks = base..(base + local).min(inner.world);
    let space = super::space(inner);
    let order = crate::planner::epoch_order(
        &space,
        &inner.plan_cfg,
        mine.epoch,
        inner.blocks.get().cloned(),
    );
    let mut plans = Vec::with_capacity(ranks.len());
    for r in ranks {
        if r == inner.rank {
            plans.push(mine.clone());
            continue;
        }
        // The other ranks' plans of the same segment (as many batches as this rank's).
        match crate::planner::plan_segment(
            &space,
            &order,
            &inner.plan_cfg,
            mine.epoch,
            r,
            inner.world,
            mine.start,
            mine.batches.len() as u64,
        ) {
            Ok(p) => plans.push(Arc::new(p)),
            Err(e) => {
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| {
                    tracing::warn!(
                        "the cache decides with this rank's plan only: rank {r}'s plan failed ({e})"
                    );
                });
                return (vec![mine], 0);
            }
        }
    }
    let me = inner.rank - base;
    *inner.node_plans.lock().unwrap_or_else(|p| p.into_inner()) = Some(NodePlans {
        key,
        plans: plans.clone(),
        mine: me,
    });
    (plans, me)
}

/// Generations of schedules handed out by this process (each replaces the last).
static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A new schedule generation (see [`schedule_as`]).
pub(super) fn new_generation() -> u64 {
    GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Hands the sources that want it (an object store's cache) the reads of `epochs` (each the node's
/// plans of one epoch, [`node_plans`], this rank's at `mine`), in the node's order
/// ([`crate::planner::node_order`]), with their positions in the whole sequence
/// ([`ubdirect_ub::Source::schedule`]): this rank's reads, and the other ranks' as `others`.
/// Under `generation`: the same generation again extends the schedule in force (the positions it gave
/// keep their meaning), an older one is ignored.
pub(super) fn schedule_as(
    inner: &Inner,
    epochs: &[Vec<Arc<EpochPlan>>],
    mine: usize,
    generation: u64,
) {
    if !inner.sources.iter().any(|s| s.wants_schedule()) {
        return;
    }
    type Mine = Vec<(u64, u64, u64)>;
    type Others = Vec<(u32, u64, u64, u64)>;
    let mut per: Vec<(Mine, Others)> = vec![Default::default(); inner.sources.len()];
    let (mut pos, mut next_epoch_at) = (0u64, u64::MAX);
    for (e, plans) in epochs.iter().enumerate() {
        if e == 1 {
            next_epoch_at = pos;
        }
        let refs: Vec<&EpochPlan> = plans.iter().map(|p| p.as_ref()).collect();
        for (i, r) in crate::planner::node_order(&refs) {
            if let Some((m, o)) = per.get_mut(r.shard as usize) {
                if i == mine {
                    m.push((pos, r.offset, r.len));
                } else {
                    o.push((i as u32, pos, r.offset, r.len));
                }
            }
            pos += 1;
        }
    }
    let epoch = epochs
        .first()
        .and_then(|p| p.first())
        .map_or(0, |p| p.epoch);
    for (s, (reads, others)) in inner.sources.iter().zip(&per) {
        if s.wants_schedule() {
            s.schedule(&ubdirect_ub::PlannedReads {
                generation,
                reads,
                others,
                local_rank: mine as u32,
                epoch,
                next_epoch_at,
            });
        }
    }
}
