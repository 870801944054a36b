//! The epoch planner: a pure function of (samples, config, epoch, start position, rank, world size)
//! → the rank's reads and batches. Identical inputs give identical plans, on every machine and build
//! (the shuffles use our own SplitMix64, not a library RNG whose stream may change between versions).
//!
//! 1. **Global order** (independent of the world size), a function of position ([`order`]): samples
//!    in file order are cut into shuffle blocks (consecutive samples of one shard, about
//!    `shuffle_block` bytes); the blocks are shuffled, then samples are shuffled within windows of
//!    `window` samples, each window seeded by its number. This keeps reads large, and no vector of
//!    every sample is made. GPT samples in `order = "megatron"` take Megatron's order instead (see
//!    [`crate::gpt`]), read in place.
//! 2. **Ranks**: the order is cut into global batches of `world × batch_size` samples; rank `r` takes
//!    the `r`-th `batch_size` samples of each. A plan starts at a global position (0, or where a
//!    resumed run stopped — at any world size); the samples left are a whole number of global
//!    batches: the remainder is dropped (`remainder = "drop"`) or padded by wrapping around to the
//!    order's start (`"pad"`). Every rank gets the same number of batches.
//! 3. **Chunks**: consecutive batches are grouped until their samples hold at least `min_read` bytes
//!    (at most `max_chunk_batches` batches), so small batches still make large reads without reading
//!    bytes nobody uses.
//! 4. **Reads**: each chunk's samples (GPT samples: their pieces) are sorted by (shard, offset) and
//!    merged into reads when the gap between them is at most `max_gap` and the aligned read stays
//!    within `max_read`; reads are aligned to `align` and widened to at least `min_read` (unless the
//!    shard is smaller, or the read holds less than a quarter of it: a lone small read is not
//!    widened into mostly waste).

use crate::gpt::GptSamples;
pub use crate::hash::Fnv;

use crate::formats::index::{DatasetIndex, SampleLoc};

pub mod order;
mod reads;
mod segment;
mod types;
pub use order::{Blocks, EpochOrder, PLAN_VERSION};
pub use segment::plan_segment;
pub use types::*;

/// SplitMix64: a tiny, fixed PRNG so plans never change with a dependency's version.
struct SplitMix(u64);

impl SplitMix {
    fn new(parts: &[u64]) -> Self {
        let mut h = Fnv::new();
        for p in parts {
            h.write(&p.to_le_bytes());
        }
        SplitMix(h.finish())
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in 0..n (n > 0), by rejection (no modulo bias).
    fn below(&mut self, n: u64) -> u64 {
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let x = self.next();
            if x < zone {
                return x % n;
            }
        }
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// Number of batches every rank gets in an epoch.
pub fn batches_per_rank(samples: u64, world: usize, cfg: &PlanConfig) -> u64 {
    // Saturates: with more samples per step than a u64 holds, no rank gets a batch.
    let per = (world as u64).saturating_mul(cfg.batch_size as u64);
    if per == 0 {
        return 0;
    }
    match cfg.remainder {
        Remainder::Drop => samples / per,
        Remainder::Pad => samples.div_ceil(per),
    }
}

/// What the planner orders and reads: the index's samples, or GPT windows over its sequences.
#[derive(Debug, Clone, Copy)]
pub enum SampleSpace<'a> {
    /// One byte range per sample.
    Plain(&'a DatasetIndex),
    /// GPT samples (windows across sequences) of the index.
    Gpt(&'a DatasetIndex, &'a GptSamples),
    /// Several columns of one row per sample: the index's samples are the first column, these the
    /// others (same rows).
    Columns(&'a DatasetIndex, &'a [Vec<SampleLoc>]),
}

/// Alignment of each part of a several-column sample.
pub const PART_ALIGN: u64 = 8;

impl SampleSpace<'_> {
    /// The index holding the bytes.
    pub fn index(&self) -> &DatasetIndex {
        match self {
            SampleSpace::Plain(i) | SampleSpace::Gpt(i, _) | SampleSpace::Columns(i, _) => i,
        }
    }

    /// Number of samples.
    pub fn len(&self) -> u64 {
        match self {
            SampleSpace::Plain(i) | SampleSpace::Columns(i, _) => i.samples.len() as u64,
            SampleSpace::Gpt(_, g) => g.len(),
        }
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of sample `id`.
    pub fn bytes(&self, id: u64) -> u64 {
        match self {
            SampleSpace::Plain(i) => i.samples.loc(id as usize).len as u64,
            SampleSpace::Gpt(_, g) => g.sample_bytes(),
            SampleSpace::Columns(i, cols) => std::iter::once(i.samples.loc(id as usize).len as u64)
                .chain(cols.iter().map(|c| c[id as usize].len as u64))
                .map(|l| l.div_ceil(PART_ALIGN) * PART_ALIGN)
                .sum(),
        }
    }

    /// The byte ranges of sample `id`.
    pub fn pieces(&self, id: u64, out: &mut Vec<SampleLoc>) {
        match self {
            SampleSpace::Plain(i) => out.push(i.samples.loc(id as usize)),
            SampleSpace::Gpt(i, g) => g.pieces(i, id, out),
            SampleSpace::Columns(i, cols) => {
                out.push(i.samples.loc(id as usize));
                out.extend(cols.iter().map(|c| c[id as usize]));
            }
        }
    }

    /// Runs of equal-size samples that start in one shard, as (first id, count, bytes per sample):
    /// raw records (one run per shard) and GPT windows in file order (one run per shard their first
    /// bytes lie in). The shuffle blocks are then arithmetic. `None` for any other space.
    pub fn fixed_runs(&self) -> Option<Vec<(u64, u64, u64)>> {
        match self {
            SampleSpace::Plain(i) => i.samples.fixed_runs(),
            SampleSpace::Gpt(i, g) => crate::gpt::windows::shard_runs(g, i),
            SampleSpace::Columns(..) => None,
        }
    }

    fn first_shard(&self, id: u64, scratch: &mut Vec<SampleLoc>) -> u32 {
        match self {
            SampleSpace::Plain(i) | SampleSpace::Columns(i, _) => i.samples.loc(id as usize).shard,
            SampleSpace::Gpt(..) => {
                scratch.clear();
                self.pieces(id, scratch);
                scratch.first().map_or(0, |l| l.shard)
            }
        }
    }
}

/// Block shuffle of `ids` (consecutive in file order) into `order` (a blend's part: materialized,
/// as a blend's order is).
fn block_shuffle(
    space: &SampleSpace<'_>,
    ids: std::ops::Range<u64>,
    cfg: &PlanConfig,
    seed: &[u64],
    order: &mut Vec<u64>,
) {
    if ids.is_empty() {
        return;
    }
    let blocks = std::sync::Arc::new(Blocks::of(space, ids, cfg));
    let o = order::BlockOrder::new(blocks, seed, true);
    o.fill(0..o.len(), order);
}

/// The window a window shuffle uses (`loader.window`, one batch when 0).
fn window_of(cfg: &PlanConfig) -> u64 {
    if cfg.window == 0 {
        cfg.batch_size as u64
    } else {
        cfg.window as u64
    }
}

/// The epoch's global order, a function of position: the same at every world size. `blocks`: the
/// space's shuffle blocks when the caller keeps them between epochs (they depend on the dataset and
/// `shuffle_block` only); computed here otherwise.
pub fn epoch_order<'a>(
    space: &SampleSpace<'a>,
    cfg: &PlanConfig,
    epoch: u64,
    blocks: Option<std::sync::Arc<Blocks>>,
) -> EpochOrder<'a> {
    let n = space.len();
    if let SampleSpace::Gpt(_, g) = *space {
        if let Some(o) = &g.order {
            return EpochOrder::Megatron(o);
        }
        if !g.weights.is_empty() {
            // A blend in block order: each dataset's own block order, blended by weight (no window
            // shuffle, which would move samples across the weights' prefixes).
            let mut parts = Vec::with_capacity(g.parts.len());
            for p in 0..g.parts.len() {
                let ids = g.bases[p]..g.bases[p + 1];
                let mut o = Vec::with_capacity((ids.end - ids.start) as usize);
                if cfg.shuffle {
                    block_shuffle(
                        space,
                        ids,
                        cfg,
                        &[cfg.seed, epoch, 0xB10C, p as u64],
                        &mut o,
                    );
                } else {
                    o.extend(ids);
                }
                parts.push(o);
            }
            let avail: Vec<u64> = parts.iter().map(|o| o.len() as u64).collect();
            return EpochOrder::Ids(std::borrow::Cow::Owned(
                crate::gpt::blend::blending_indices_bounded(&g.weights, &avail)
                    .into_iter()
                    .map(|(d, k)| parts[d as usize][k as usize])
                    .collect(),
            ));
        }
    }
    let shuffle = cfg.shuffle && n > 0;
    let blocks = match blocks {
        Some(b) if shuffle => b,
        // Unshuffled: one block of everything (file order), nothing scanned.
        _ if !shuffle => std::sync::Arc::new(Blocks::whole(n)),
        _ => std::sync::Arc::new(Blocks::of(space, 0..n, cfg)),
    };
    EpochOrder::Blocks {
        order: order::BlockOrder::new(blocks, &[cfg.seed, epoch, 0xB10C], shuffle),
        window: if shuffle { window_of(cfg) } else { 0 },
        seed: cfg.seed,
        epoch,
    }
}

/// The epoch's global order of sample ids, as a vector (O(samples): for tests and tools; the
/// planner evaluates [`epoch_order`] where it reads).
pub fn global_order(space: &SampleSpace<'_>, cfg: &PlanConfig, epoch: u64) -> Vec<u64> {
    epoch_order(space, cfg, epoch, None).to_vec()
}

/// The reads of the plans of several ranks of one epoch (a node's, in local-rank order) as the node
/// makes them: by chunk, the ranks' chunks of the same batch side by side (ranks move a batch at a
/// time together), each chunk's reads in its order. Items are (index into `plans`, read).
pub fn node_order<'a>(plans: &[&'a EpochPlan]) -> Vec<(usize, &'a ReadPlan)> {
    let mut chunks: Vec<(u32, usize, &'a ChunkPlan)> = plans
        .iter()
        .enumerate()
        .flat_map(|(i, p)| p.chunks.iter().map(move |c| (c.first_batch, i, c)))
        .collect();
    chunks.sort_by_key(|&(b, i, _)| (b, i));
    chunks
        .into_iter()
        .flat_map(|(_, i, c)| c.reads.iter().map(move |r| (i, r)))
        .collect()
}

/// Plans one epoch for one rank.
pub fn plan_epoch(
    index: &DatasetIndex,
    cfg: &PlanConfig,
    epoch: u64,
    rank: usize,
    world: usize,
) -> Result<EpochPlan, PlanError> {
    plan(&SampleSpace::Plain(index), cfg, epoch, rank, world, 0)
}

/// Plans the rest of an epoch for one rank, from global position `start` (0: the whole epoch).
pub fn plan(
    space: &SampleSpace<'_>,
    cfg: &PlanConfig,
    epoch: u64,
    rank: usize,
    world: usize,
    start: u64,
) -> Result<EpochPlan, PlanError> {
    let order = epoch_order(space, cfg, epoch, None);
    plan_in_order(space, &order, cfg, epoch, rank, world, start)
}

/// As [`plan`], in the order of the ids `order` (a replayed step's samples).
pub fn plan_with_order(
    space: &SampleSpace<'_>,
    order: &[u64],
    cfg: &PlanConfig,
    epoch: u64,
    rank: usize,
    world: usize,
    start: u64,
) -> Result<EpochPlan, PlanError> {
    let o = EpochOrder::Ids(std::borrow::Cow::Borrowed(order));
    plan_in_order(space, &o, cfg, epoch, rank, world, start)
}

/// As [`plan`], in the epoch order `order` (all ranks of one process may share it). Only this
/// rank's positions are evaluated.
pub fn plan_in_order(
    space: &SampleSpace<'_>,
    order: &EpochOrder<'_>,
    cfg: &PlanConfig,
    epoch: u64,
    rank: usize,
    world: usize,
    start: u64,
) -> Result<EpochPlan, PlanError> {
    plan_segment(space, order, cfg, epoch, rank, world, start, u64::MAX)
}

/// Chunk boundaries (batch ranges): consecutive batches until their samples hold `min_read` (or
/// `chunk_bytes`) bytes, at most `max_chunk_batches` of them.
fn chunk_bounds(
    space: &SampleSpace<'_>,
    cfg: &PlanConfig,
    batch_ids: &[&[(u64, u64)]],
) -> Vec<(usize, usize)> {
    let mut bounds: Vec<(usize, usize)> = Vec::new();
    let mut b = 0usize;
    while b < batch_ids.len() {
        let first = b;
        let mut bytes = 0u64;
        while b < batch_ids.len()
            && (b == first
                || (bytes < cfg.min_read.max(cfg.chunk_bytes) && b - first < cfg.max_chunk_batches))
        {
            bytes += batch_ids[b]
                .iter()
                .map(|&(id, _)| space.bytes(id))
                .sum::<u64>();
            b += 1;
        }
        bounds.push((first, b));
    }
    bounds
}
