//! The epoch's global order as a function of position (`position → sample id`), never a vector of
//! every sample:
//!
//! - **Block order** (the default): the dataset in file order is cut into shuffle blocks (runs of
//!   one shard, about `shuffle_block` bytes). The cut is made once per loader ([`Blocks`]: one `u64`
//!   per block; for fixed-size samples per shard it is arithmetic, not a scan). Each epoch shuffles
//!   the block numbers (Fisher–Yates, seeded by (seed, epoch): the same permutation as before the
//!   order became a function) and keeps the prefix sums of the shuffled blocks' lengths, so a
//!   position is found by one binary search: O(blocks) memory, O(log blocks) per lookup.
//! - **Window shuffle**: positions are shuffled within windows of `window` samples (a batch by
//!   default), each window with its own seed (seed, epoch, window number). Since plan version 2
//!   (2026-12-04) the windows do not share one random stream: window `w` is computed from its
//!   number alone, so a rank plans only its own share and a resume at any position plans only what
//!   it reads. Version 1's stream made window `w` depend on every draw before it (O(samples) to
//!   reach); states and records of version 1 are refused by name ([`PLAN_VERSION`]).
//! - **Explicit orders**: Megatron's shuffle index (read in place, not copied), a blend's order,
//!   or a replayed step's samples.

use super::{PlanConfig, SampleSpace, SplitMix};
use crate::gpt::megatron::ShuffleIndex;

/// The version of the order the planner makes. States, records and fingerprints carry it: a state
/// of another version is refused with the reason (its positions name other samples).
///
/// - 1: one random stream for every window of an epoch (until 2026-12-04).
/// - 2: each window seeded by its number (an order that is a function of position).
/// - 3: a Megatron dataset's fingerprint made from digests of its `.idx` arrays, taken by the
///   check that reads them anyway, an `.npy` dataset's from its row runs (one per file), Arrow's
///   and WebDataset's from a CRC-32 of their sample table (the samples cache file's), not from
///   every sample's location (2026-12-05).
pub const PLAN_VERSION: u64 = 3;

/// What changed after plan version `saved`, for the error refusing a state of that version.
pub fn changes_since(saved: u64) -> String {
    let mut why = Vec::new();
    if saved < 2 {
        why.push("since 2026-12-04 each window shuffle is seeded by its window (an order computed by position), so the saved positions name other samples");
    }
    if saved < 3 {
        why.push("since 2026-12-05 a Megatron dataset is fingerprinted from digests of its .idx arrays, an .npy dataset from its files' row runs and an Arrow or WebDataset dataset from a CRC-32 of its sample table, so the saved dataset fingerprint cannot be compared");
    }
    if why.is_empty() {
        why.push("a later order than this build knows");
    }
    why.join("; ")
}

/// Shuffle blocks of a range of sample ids in file order: `starts[k]` is block `k`'s first id;
/// the last entry is the range's end.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Blocks {
    starts: Vec<u64>,
}

impl Blocks {
    /// The blocks of ids `ids` of `space`: a new block at every shard change and once a block holds
    /// `shuffle_block` bytes (each sample counts at least one byte). Runs of equal-size samples in
    /// one shard (raw records, GPT windows) are cut arithmetically.
    pub fn of(space: &SampleSpace<'_>, ids: std::ops::Range<u64>, cfg: &PlanConfig) -> Self {
        let mut starts = Vec::new();
        if ids.is_empty() {
            return Blocks {
                starts: vec![ids.start],
            };
        }
        if let Some(runs) = space.fixed_runs() {
            // (first id, count, bytes per sample) per shard, in id order.
            for (first, count, len) in runs {
                let (a, b) = (first.max(ids.start), (first + count).min(ids.end));
                if a >= b {
                    continue;
                }
                // A block takes samples until it holds `shuffle_block` bytes: ceil(block / len).
                let per = cfg.shuffle_block.div_ceil(len.max(1)).max(1);
                let mut s = a;
                while s < b {
                    starts.push(s);
                    s = (s + per).min(b);
                }
            }
            starts.push(ids.end);
            return Blocks { starts };
        }
        let mut scratch = Vec::new();
        let (mut start, mut bytes) = (ids.start, 0u64);
        let mut prev_shard = space.first_shard(ids.start, &mut scratch);
        starts.push(start);
        for i in ids.clone() {
            let shard = space.first_shard(i, &mut scratch);
            if i > start && (prev_shard != shard || bytes >= cfg.shuffle_block) {
                starts.push(i);
                start = i;
                bytes = 0;
            }
            prev_shard = shard;
            bytes += space.bytes(i).max(1);
        }
        starts.push(ids.end);
        Blocks { starts }
    }

    /// One block of ids `0..n` (file order: nothing to cut).
    pub fn whole(n: u64) -> Self {
        Blocks {
            starts: if n == 0 { vec![0] } else { vec![0, n] },
        }
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ids of block `k`.
    fn range(&self, k: usize) -> std::ops::Range<u64> {
        self.starts[k]..self.starts[k + 1]
    }

    /// Bytes of memory the blocks hold.
    pub fn heap_bytes(&self) -> usize {
        self.starts.capacity() * 8
    }
}

/// The blocks of one epoch in their shuffled order.
#[derive(Debug, Clone)]
pub struct BlockOrder {
    blocks: std::sync::Arc<Blocks>,
    /// Block numbers in shuffled order.
    perm: Vec<u32>,
    /// `ends[k]`: positions covered by the first `k + 1` shuffled blocks.
    ends: Vec<u64>,
}

impl BlockOrder {
    /// `blocks` shuffled by `seed` (Fisher–Yates with SplitMix64: the permutation the planner made
    /// of its block vector before version 2); `shuffle = false` keeps file order.
    pub fn new(blocks: std::sync::Arc<Blocks>, seed: &[u64], shuffle: bool) -> Self {
        let mut perm: Vec<u32> = (0..blocks.len() as u32).collect();
        if shuffle {
            SplitMix::new(seed).shuffle(&mut perm);
        }
        let mut ends = Vec::with_capacity(perm.len());
        let mut at = 0u64;
        for &k in &perm {
            let r = blocks.range(k as usize);
            at += r.end - r.start;
            ends.push(at);
        }
        BlockOrder { blocks, perm, ends }
    }

    /// Positions covered.
    pub fn len(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    /// Whether it covers nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the ids at positions `range` (inside `0..len()`) to `out`.
    pub fn fill(&self, range: std::ops::Range<u64>, out: &mut Vec<u64>) {
        if range.is_empty() {
            return;
        }
        let mut k = self.ends.partition_point(|&e| e <= range.start);
        let mut p = range.start;
        while p < range.end && k < self.perm.len() {
            let r = self.blocks.range(self.perm[k] as usize);
            let block_start = self.ends[k] - (r.end - r.start);
            let from = r.start + (p - block_start);
            let upto = (r.start + (range.end - block_start)).min(r.end);
            out.extend(from..upto);
            p += upto - from;
            k += 1;
        }
    }

    /// Bytes of memory it holds (its blocks not counted: they are shared between epochs).
    pub fn heap_bytes(&self) -> usize {
        self.perm.capacity() * 4 + self.ends.capacity() * 8
    }
}

thread_local! {
    /// [`EpochOrder::fill`]'s window buffer.
    static WINDOW: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// An epoch's global order: the sample id at every position.
#[derive(Debug, Clone)]
pub enum EpochOrder<'a> {
    /// Block order with a window shuffle of `window` samples (seeded per window by `seed`,
    /// `epoch`); `window = 0`: no window shuffle.
    Blocks {
        order: BlockOrder,
        window: u64,
        seed: u64,
        epoch: u64,
    },
    /// Explicit ids (a blend, a replayed step).
    Ids(std::borrow::Cow<'a, [u64]>),
    /// Megatron's shuffle index, read in place.
    Megatron(&'a ShuffleIndex),
}

impl EpochOrder<'_> {
    /// Positions in the order.
    pub fn len(&self) -> u64 {
        match self {
            EpochOrder::Blocks { order, .. } => order.len(),
            EpochOrder::Ids(v) => v.len() as u64,
            EpochOrder::Megatron(s) => s.len() as u64,
        }
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the ids at positions `range` (inside `0..len()`) to `out`. Whole windows are
    /// computed and the part asked for is kept, so any range costs at most two windows more.
    pub fn fill(&self, range: std::ops::Range<u64>, out: &mut Vec<u64>) {
        match self {
            EpochOrder::Ids(v) => {
                out.extend_from_slice(&v[range.start as usize..range.end as usize]);
            }
            EpochOrder::Megatron(s) => {
                out.extend((range.start..range.end).filter_map(|i| s.get(i as usize)));
            }
            EpochOrder::Blocks {
                order,
                window,
                seed,
                epoch,
            } => {
                if *window <= 1 {
                    order.fill(range, out);
                    return;
                }
                let n = order.len();
                // A window's ids, computed whole: one buffer per thread, reused (one per call was
                // an allocation per batch).
                WINDOW.with_borrow_mut(|buf| {
                    let mut w = range.start / window;
                    while w * window < range.end {
                        let ws = w * window;
                        let we = (ws + window).min(n);
                        buf.clear();
                        order.fill(ws..we, buf);
                        window_shuffle(buf, *seed, *epoch, w);
                        let a = range.start.max(ws) - ws;
                        let b = range.end.min(we) - ws;
                        out.extend_from_slice(&buf[a as usize..b as usize]);
                        w += 1;
                    }
                });
            }
        }
    }

    /// The id at position `p` (inside `0..len()`).
    pub fn id(&self, p: u64) -> u64 {
        let mut v = Vec::with_capacity(1);
        self.fill(p..p + 1, &mut v);
        v.first().copied().unwrap_or(0)
    }

    /// Every id, in order (for tests and small datasets: O(samples)).
    pub fn to_vec(&self) -> Vec<u64> {
        let mut v = Vec::with_capacity(self.len() as usize);
        self.fill(0..self.len(), &mut v);
        v
    }

    /// Bytes of memory the order holds beyond what it borrows or shares.
    pub fn heap_bytes(&self) -> usize {
        match self {
            EpochOrder::Blocks { order, .. } => order.heap_bytes(),
            EpochOrder::Ids(std::borrow::Cow::Owned(v)) => v.capacity() * 8,
            EpochOrder::Ids(_) | EpochOrder::Megatron(_) => 0,
        }
    }
}

/// The window shuffle of window `w` of `epoch` (plan version 2: a seed per window).
fn window_shuffle(ids: &mut [u64], seed: u64, epoch: u64, w: u64) {
    SplitMix::new(&[seed, epoch, w, 0x3141]).shuffle(ids);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::index::{DatasetIndex, SampleLoc, Samples, Shard};

    /// Raw records of `sizes[i]` records of `len[i]` bytes per shard, as runs and as a vector.
    fn raw(shards: &[(u64, u32)]) -> (DatasetIndex, DatasetIndex) {
        let mut fixed = DatasetIndex::default();
        let mut owned = DatasetIndex::default();
        let mut runs = Vec::new();
        let mut v = Vec::new();
        for (si, &(count, len)) in shards.iter().enumerate() {
            let sh = Shard {
                path: format!("s{si}").into(),
                size: count * len as u64,
            };
            fixed.shards.push(sh.clone());
            owned.shards.push(sh);
            runs.push((si as u32, len, count));
            v.extend((0..count).map(|i| SampleLoc {
                shard: si as u32,
                offset: i * len as u64,
                len,
            }));
        }
        fixed.samples = Samples::fixed(runs);
        owned.samples = v.into();
        (fixed, owned)
    }

    fn cfg() -> PlanConfig {
        PlanConfig {
            shuffle_block: 10_000,
            batch_size: 7,
            ..PlanConfig::default()
        }
    }

    #[test]
    fn fixed_records_cut_the_blocks_a_scan_cuts() {
        for shards in [
            vec![(1000, 512)],
            vec![(3, 4096), (0, 100), (250, 333), (1, 10_000), (77, 1)],
            vec![(20_000, 1)],
        ] {
            let (f, o) = raw(&shards);
            assert_eq!(f.samples, o.samples);
            let n = f.samples.len() as u64;
            for ids in [0..n, n / 3..n - n / 4] {
                let a = Blocks::of(&SampleSpace::Plain(&f), ids.clone(), &cfg());
                let b = Blocks::of(&SampleSpace::Plain(&o), ids.clone(), &cfg());
                assert_eq!(a, b, "{shards:?} {ids:?}");
            }
        }
    }

    #[test]
    fn the_block_permutation_is_the_one_a_shuffled_block_vector_had() {
        let (f, _) = raw(&[(5000, 300), (1234, 64)]);
        let blocks = Blocks::of(&SampleSpace::Plain(&f), 0..f.samples.len() as u64, &cfg());
        // The planner before plan version 2 shuffled the (start, end) pairs themselves.
        let mut pairs: Vec<(u64, u64)> = (0..blocks.len())
            .map(|k| (blocks.starts[k], blocks.starts[k + 1]))
            .collect();
        SplitMix::new(&[3, 1, 0xB10C]).shuffle(&mut pairs);
        let old: Vec<u64> = pairs.into_iter().flat_map(|(a, b)| a..b).collect();
        let o = BlockOrder::new(std::sync::Arc::new(blocks), &[3, 1, 0xB10C], true);
        let mut new = Vec::new();
        o.fill(0..o.len(), &mut new);
        assert_eq!(old, new);
    }

    #[test]
    fn the_order_is_a_permutation_and_a_function_of_position() {
        let (f, _) = raw(&[(997, 4096), (13, 4096), (500, 100)]);
        let space = SampleSpace::Plain(&f);
        for window in [0usize, 1, 7, 64, 5000] {
            let c = PlanConfig { window, ..cfg() };
            let o = super::super::epoch_order(&space, &c, 2, None);
            let all = o.to_vec();
            let mut sorted = all.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..f.samples.len() as u64).collect::<Vec<_>>());
            // Any range, alone, gives the same ids as the whole order there.
            for (a, b) in [
                (0, 1),
                (5, 6),
                (3, 40),
                (99, 777),
                (1000, 1510),
                (1509, 1510),
            ] {
                let mut part = Vec::new();
                o.fill(a..b, &mut part);
                assert_eq!(
                    part,
                    all[a as usize..b as usize],
                    "window {window}: {a}..{b}"
                );
                assert_eq!(o.id(a), all[a as usize]);
            }
        }
    }

    #[test]
    fn epochs_and_seeds_give_other_orders_and_no_shuffle_is_file_order() {
        let (f, _) = raw(&[(3000, 64)]);
        let space = SampleSpace::Plain(&f);
        let a = super::super::epoch_order(&space, &cfg(), 0, None).to_vec();
        let b = super::super::epoch_order(&space, &cfg(), 1, None).to_vec();
        let c =
            super::super::epoch_order(&space, &PlanConfig { seed: 9, ..cfg() }, 0, None).to_vec();
        assert_ne!(a, b);
        assert_ne!(a, c);
        let plain = super::super::epoch_order(
            &space,
            &PlanConfig {
                shuffle: false,
                ..cfg()
            },
            0,
            None,
        );
        assert_eq!(plain.to_vec(), (0..3000).collect::<Vec<_>>());
    }
}
