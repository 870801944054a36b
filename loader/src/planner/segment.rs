//! One segment of an epoch's plan ([`plan_segment`]): this rank's samples from a global position,
//! cut into batches and chunks, each chunk's reads planned.

use super::reads::{Planned, plan_chunks};
use super::{
    BatchPlan, ChunkPlan, EpochOrder, EpochPlan, MAX_WORLD_SIZE, PlanConfig, PlanError, PlanStats,
    PlannedSample, SampleSpace, Shared, batches_per_rank, chunk_bounds,
};

/// One segment of the epoch from global position `start`: at most `max_batches` of this rank's
/// batches ([`EpochPlan::later_batches`] says how many follow). Segments chunk their batches on
/// their own; the samples, their order and their positions are the epoch's.
#[allow(clippy::too_many_arguments)] // the planner's inputs, each a fact of the epoch
pub fn plan_segment(
    space: &SampleSpace<'_>,
    order: &EpochOrder<'_>,
    cfg: &PlanConfig,
    epoch: u64,
    rank: usize,
    world: usize,
    start: u64,
    max_batches: u64,
) -> Result<EpochPlan, PlanError> {
    check_inputs(cfg, rank, world)?;
    let n = order.len();
    let bs = cfg.batch_size as u64;
    let step = world as u64 * bs;
    // Global batches from `start`; rank `rank` takes its slice of each.
    let left = n.saturating_sub(start);
    let all = batches_per_rank(left, world, cfg);
    let total = all * step;
    let nb = all.min(max_batches.max(1));
    let (padded, dropped) = if total >= left {
        (total - left, 0)
    } else {
        (0, left - total)
    };
    check_plan_memory(nb * bs)?;
    let mine = rank_samples(order, start, nb, step, rank as u64 * bs, bs);
    let mut stats = PlanStats {
        dataset_samples: space.len(),
        samples: all * bs,
        padded,
        dropped,
        ..PlanStats::default()
    };
    if let SampleSpace::Gpt(_, g) = space
        && !g.weights.is_empty()
    {
        stats.per_dataset = g.count_parts(mine.iter().map(|m| m.0));
    }
    let (batches, chunks) = batches_and_chunks(space, cfg, &mine, &mut stats)?;
    Ok(EpochPlan {
        epoch,
        rank,
        world,
        start,
        first_batch: start / step.max(1),
        step,
        packed_sample_bytes: match space {
            SampleSpace::Gpt(_, g) => Some(g.sample_bytes()),
            _ => None,
        },
        packed_parts: matches!(space, SampleSpace::Columns(..)),
        later_batches: all - nb,
        batches,
        chunks,
        stats,
    })
}

/// Refuses an invalid config, a rank outside the world, and a world past [`MAX_WORLD_SIZE`].
fn check_inputs(cfg: &PlanConfig, rank: usize, world: usize) -> Result<(), PlanError> {
    cfg.validate()?;
    if world == 0 || rank >= world {
        return Err(PlanError::Rank { rank, world });
    }
    if world > MAX_WORLD_SIZE {
        return Err(PlanError::Config(format!(
            "world size {world} (expected 1..={MAX_WORLD_SIZE})"
        )));
    }
    Ok(())
}

/// Refuses a plan of `samples` samples that would not fit in a quarter of the machine's memory.
fn check_plan_memory(samples: u64) -> Result<(), PlanError> {
    // The plan holds this rank's samples (its ids and positions, then a planned sample each):
    // refused with a typed error when that exceeds a quarter of the machine's memory, never an
    // allocation abort (a sparse file of 2^40 records indexes in O(shards) and must not abort here).
    let per_sample =
        (std::mem::size_of::<(u64, u64)>() + std::mem::size_of::<PlannedSample>()) as u64;
    let need = samples.saturating_mul(per_sample);
    let limit = crate::formats::memory_total() / 4;
    if need > limit {
        return Err(PlanError::Config(format!(
            "an epoch plan of {samples} samples per rank needs about {need} bytes, more than a quarter of this machine's memory ({limit} bytes): plan fewer samples (dataset.num_samples, more ranks) or a machine with more memory"
        )));
    }
    Ok(())
}

/// This rank's `(id, position)` of each of its `nb` batches of `bs` samples from `start`, the
/// rank's slice starting `offset` into each global batch of `step` samples.
fn rank_samples(
    order: &EpochOrder<'_>,
    start: u64,
    nb: u64,
    step: u64,
    offset: u64,
    bs: u64,
) -> Vec<(u64, u64)> {
    let n = order.len();
    let mut mine: Vec<(u64, u64)> = Vec::with_capacity((nb * bs) as usize);
    let mut ids = Vec::with_capacity(bs as usize);
    for g in 0..nb {
        let first = start + g * step + offset;
        // Positions past the order's end (padding) wrap around to its start.
        ids.clear();
        let mut p = first;
        while p < first + bs {
            let q = p % n.max(1);
            let take = (first + bs - p).min(n.max(1) - q);
            order.fill(q..q + take, &mut ids);
            p += take;
        }
        mine.extend(ids.iter().zip(first..first + bs).map(|(&id, p)| (id, p)));
    }
    mine
}

/// The batches of samples `mine` and the chunks that read them, counted in `stats`.
fn batches_and_chunks(
    space: &SampleSpace<'_>,
    cfg: &PlanConfig,
    mine: &[(u64, u64)],
    stats: &mut PlanStats,
) -> Result<(Vec<BatchPlan>, Vec<ChunkPlan>), PlanError> {
    let batch_ids: Vec<&[(u64, u64)]> = mine.chunks(cfg.batch_size).collect();
    let mut batches = Vec::with_capacity(batch_ids.len());
    let mut chunks = Vec::new();
    // Chunk boundaries first (a cheap pass over sizes), then each chunk's reads.
    let bounds = chunk_bounds(space, cfg, &batch_ids);
    let Planned {
        reads,
        mut samples,
        pieces,
        ends,
    } = plan_chunks(space, cfg, &batch_ids, &bounds, mine.len())?;
    stats.reads += reads.len() as u64;
    stats.read_bytes += reads.iter().map(|r| r.len).sum::<u64>();
    stats.sample_bytes += samples.iter().map(|s| s.len as u64).sum::<u64>();
    // Every batch a part of the segment's samples and pieces, every chunk a part of its reads: a
    // sample's `first_piece` counts from its batch's first piece (from its chunk's, as planned).
    let bs = cfg.batch_size.max(1);
    let mut batch_pieces = Vec::with_capacity(batch_ids.len());
    let (mut s0, mut p0) = (0, 0);
    for &(_, s1, p1) in &ends {
        for part in samples[s0..s1].chunks_mut(bs) {
            let base = part.first().map_or(0, |s| s.first_piece);
            let end = part.last().map_or(0, |s| s.first_piece + s.pieces);
            for s in part.iter_mut() {
                s.first_piece -= base;
            }
            let from = (p0 + base as usize).min(p1);
            batch_pieces.push(from..(p0 + end as usize).clamp(from, p1));
        }
        (s0, p0) = (s1, p1);
    }
    let samples: std::sync::Arc<[PlannedSample]> = samples.into();
    let pieces: std::sync::Arc<[_]> = pieces.into();
    let reads: std::sync::Arc<[_]> = reads.into();
    let (mut r0, mut s0, mut bi) = (0, 0, 0);
    for (ci, (&(first, b), &(r1, s1, _))) in bounds.iter().zip(&ends).enumerate() {
        for from in (s0..s1).step_by(bs) {
            batches.push(BatchPlan {
                chunk: ci as u32,
                samples: Shared::part(&samples, from..(from + bs).min(s1)),
                pieces: Shared::part(&pieces, batch_pieces[bi].clone()),
            });
            bi += 1;
        }
        chunks.push(ChunkPlan {
            first_batch: first as u32,
            batches: (b - first) as u32,
            reads: Shared::part(&reads, r0..r1),
        });
        (r0, s0) = (r1, s1);
    }
    Ok((batches, chunks))
}
