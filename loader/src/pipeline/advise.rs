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
