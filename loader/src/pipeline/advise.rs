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
        loop {
            let done = *issued.borrow_and_update();
            if before + r.len <= done {
                break; // the producer reads it already
            }
            if before < done + window {
                if src.advise_window() > 0 {
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

/// Generations of schedules handed out by this process (each replaces the last).
static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Hands the sources that want it (an object store's cache) their reads in `plans`, in order, with
/// their positions in the whole sequence of plans ([`ubdirect_ub::Source::schedule`]).
pub(super) fn schedule(inner: &Inner, plans: &[&EpochPlan]) {
    if !inner.sources.iter().any(|s| s.wants_schedule()) {
        return;
    }
    let mut per: Vec<Vec<(u64, u64, u64)>> = vec![Vec::new(); inner.sources.len()];
    let reads = plans
        .iter()
        .flat_map(|p| p.chunks.iter().flat_map(|c| c.reads.iter()));
    for (pos, r) in reads.enumerate() {
        if let Some(v) = per.get_mut(r.shard as usize) {
            v.push((pos as u64, r.offset, r.len));
        }
    }
    let generation = GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    for (s, reads) in inner.sources.iter().zip(&per) {
        if s.wants_schedule() {
            s.schedule(generation, reads);
        }
    }
}
