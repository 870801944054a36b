//! The epoch planner: a pure function of (index, config, epoch, rank, world size) → the epoch's reads
//! and batches. Identical inputs give identical plans, on every machine and build (the shuffles use
//! our own SplitMix64, not a library RNG whose stream may change between versions).
//!
//! 1. **Order**: samples in file order are cut into shuffle blocks (consecutive samples of one shard,
//!    about `shuffle_block` bytes); the blocks are shuffled. This keeps reads large.
//! 2. **Ranks**: the order is cut into `world` contiguous slices of equal length, a whole number of
//!    batches each: the remainder is dropped (`remainder = "drop"`) or the order is padded by wrapping
//!    around to its start (`"pad"`). Every rank gets the same number of batches.
//! 3. **Window**: inside each rank's slice, samples are shuffled within windows of `window` samples.
//! 4. **Chunks**: consecutive batches are grouped until their samples hold at least `min_read` bytes
//!    (at most `max_chunk_batches` batches), so small batches still make large reads without reading
//!    bytes nobody uses.
//! 5. **Reads**: each chunk's samples are sorted by (shard, offset) and merged into reads when the gap
//!    between them is at most `max_gap` and the aligned read stays within `max_read`; reads are
//!    aligned to `align` and widened to at least `min_read` (unless the shard is smaller).

use crate::index::DatasetIndex;

/// What happens to samples that do not fill the last batch of every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Remainder {
    /// Drop them (fewer than `world × batch_size` samples per epoch).
    Drop,
    /// Pad by repeating samples from the start of the epoch's order.
    Pad,
}

/// Planner settings (from `[loader]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanConfig {
    /// Samples per batch.
    pub batch_size: usize,
    /// Base seed.
    pub seed: u64,
    /// Shuffle at all.
    pub shuffle: bool,
    /// Bytes of consecutive samples that move together in the block shuffle.
    pub shuffle_block: u64,
    /// Samples per in-window shuffle (0 = one batch).
    pub window: usize,
    /// Drop or pad the remainder.
    pub remainder: Remainder,
    /// Reads shorter than this are widened (0 disables widening).
    pub min_read: u64,
    /// Largest gap bridged when merging two samples into one read.
    pub max_gap: u64,
    /// Largest read.
    pub max_read: u64,
    /// Read alignment (the direct-I/O block size).
    pub align: u64,
    /// Most batches grouped into one chunk of shared reads (1 = every batch reads on its own).
    pub max_chunk_batches: usize,
}

impl Default for PlanConfig {
    fn default() -> Self {
        Self {
            batch_size: 64,
            seed: 0,
            shuffle: true,
            shuffle_block: 4 << 20,
            window: 0,
            remainder: Remainder::Drop,
            min_read: 256 << 10,
            max_gap: 64 << 10,
            max_read: 4 << 20,
            align: 4096,
            max_chunk_batches: 16,
        }
    }
}

/// The largest batch the planner plans (samples per batch): padding a tiny dataset up to one batch
/// allocates it.
pub const MAX_BATCH_SIZE: usize = 1 << 24;
/// The largest world size the planner plans for.
pub const MAX_WORLD_SIZE: usize = 1 << 20;

impl PlanConfig {
    /// Refuses settings that cannot plan.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |s: String| Err(PlanError::Config(s));
        if self.batch_size == 0 || self.batch_size > MAX_BATCH_SIZE {
            return bad(format!(
                "loader.batch_size {} (expected 1..={MAX_BATCH_SIZE})",
                self.batch_size
            ));
        }
        if self.align == 0 || !self.align.is_power_of_two() {
            return bad(format!(
                "read alignment {} is not a power of two",
                self.align
            ));
        }
        if self.max_chunk_batches == 0 {
            return bad("max_chunk_batches must be at least 1".into());
        }
        if self.max_read < self.align || self.min_read > self.max_read {
            return bad(format!(
                "need align ({}) <= loader.max_read ({}) and loader.min_read ({}) <= loader.max_read",
                self.align, self.max_read, self.min_read
            ));
        }
        Ok(())
    }

    /// A stable fingerprint of the settings that shape a plan.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        for v in [
            self.batch_size as u64,
            self.seed,
            self.shuffle as u64,
            self.shuffle_block,
            self.window as u64,
            (self.remainder == Remainder::Pad) as u64,
            self.min_read,
            self.max_gap,
            self.max_read,
            self.align,
            self.max_chunk_batches as u64,
        ] {
            h.write(&v.to_le_bytes());
        }
        h.finish()
    }
}

/// Errors planning an epoch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Invalid settings.
    #[error("plan: {0}")]
    Config(String),
    /// A sample cannot be read in one read.
    #[error(
        "plan: sample {sample} ({len} bytes at {offset} in {shard}) spans {span} aligned bytes, more than loader.max_read {max_read}"
    )]
    SampleTooLarge {
        /// Sample id.
        sample: u64,
        /// Shard path.
        shard: String,
        /// Offset.
        offset: u64,
        /// Length.
        len: u32,
        /// Aligned span.
        span: u64,
        /// The limit.
        max_read: u64,
    },
    /// Rank outside the world.
    #[error("plan: rank {rank} is not below world size {world}")]
    Rank {
        /// Rank.
        rank: usize,
        /// World size.
        world: usize,
    },
}

/// One read of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadPlan {
    /// Shard index.
    pub shard: u32,
    /// Aligned offset.
    pub offset: u64,
    /// Length (aligned, or up to the end of the shard).
    pub len: u64,
    /// Bytes between merged samples (bridged gaps).
    pub gap_bytes: u64,
}

/// One sample of a batch, in delivery order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedSample {
    /// Sample id (position in the index).
    pub id: u64,
    /// Position in this rank's epoch stream.
    pub position: u64,
    /// Index of the read holding it, in its chunk's [`ChunkPlan::reads`].
    pub read: u32,
    /// Offset of its first byte in that read.
    pub offset_in_read: u64,
    /// Length.
    pub len: u32,
}

/// One batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPlan {
    /// The chunk whose reads hold this batch's samples.
    pub chunk: u32,
    /// Samples in delivery order.
    pub samples: Vec<PlannedSample>,
}

/// Consecutive batches that share one set of reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkPlan {
    /// First batch of the chunk.
    pub first_batch: u32,
    /// Batches in the chunk.
    pub batches: u32,
    /// Reads, sorted by (shard, offset).
    pub reads: Vec<ReadPlan>,
}

impl ChunkPlan {
    /// Bytes read for this chunk.
    pub fn read_bytes(&self) -> u64 {
        self.reads.iter().map(|r| r.len).sum()
    }

    /// Batch indices of the chunk.
    pub fn batch_range(&self) -> std::ops::Range<usize> {
        self.first_batch as usize..(self.first_batch + self.batches) as usize
    }
}

/// Totals of a plan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Samples in the dataset.
    pub dataset_samples: u64,
    /// Samples this rank delivers.
    pub samples: u64,
    /// Samples repeated to pad (all ranks).
    pub padded: u64,
    /// Samples dropped (all ranks).
    pub dropped: u64,
    /// Reads.
    pub reads: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// Sample bytes delivered.
    pub sample_bytes: u64,
}

/// A rank's plan for one epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochPlan {
    /// Epoch.
    pub epoch: u64,
    /// Rank.
    pub rank: usize,
    /// World size.
    pub world: usize,
    /// Batches in delivery order.
    pub batches: Vec<BatchPlan>,
    /// Chunks of consecutive batches sharing reads, in order.
    pub chunks: Vec<ChunkPlan>,
    /// Totals.
    pub stats: PlanStats,
}

impl EpochPlan {
    /// The chunk holding batch `b`.
    pub fn chunk_of(&self, b: usize) -> Option<&ChunkPlan> {
        self.batches
            .get(b)
            .map(|bp| &self.chunks[bp.chunk as usize])
    }
}

/// FNV-1a, for stable fingerprints and seeds.
#[derive(Debug, Clone)]
pub struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self::new()
    }
}

impl Fnv {
    /// Starts a hash.
    pub fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    /// Adds bytes.
    pub fn write(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= x as u64;
            self.0 = self.0.wrapping_mul(0x100_0000_01b3);
        }
    }
    /// The hash.
    pub fn finish(&self) -> u64 {
        self.0
    }
}

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

/// Plans one epoch for one rank.
pub fn plan_epoch(
    index: &DatasetIndex,
    cfg: &PlanConfig,
    epoch: u64,
    rank: usize,
    world: usize,
) -> Result<EpochPlan, PlanError> {
    cfg.validate()?;
    if world == 0 || rank >= world {
        return Err(PlanError::Rank { rank, world });
    }
    if world > MAX_WORLD_SIZE {
        return Err(PlanError::Config(format!(
            "world size {world} (expected 1..={MAX_WORLD_SIZE})"
        )));
    }
    let n = index.samples.len() as u64;
    // 1. Block-level shuffle.
    let mut order: Vec<u64> = Vec::with_capacity(n as usize);
    if cfg.shuffle && n > 0 {
        let mut blocks: Vec<(u64, u64)> = Vec::new();
        let (mut start, mut bytes) = (0u64, 0u64);
        for (i, s) in index.samples.iter().enumerate() {
            let i = i as u64;
            if i > start
                && (index.samples[(i - 1) as usize].shard != s.shard || bytes >= cfg.shuffle_block)
            {
                blocks.push((start, i));
                start = i;
                bytes = 0;
            }
            bytes += s.len.max(1) as u64;
        }
        blocks.push((start, n));
        SplitMix::new(&[cfg.seed, epoch, 0xB10C]).shuffle(&mut blocks);
        for (a, b) in blocks {
            order.extend(a..b);
        }
    } else {
        order.extend(0..n);
    }
    // 2. Equal contiguous slices per rank.
    let nb = batches_per_rank(n, world, cfg);
    let per_rank = nb * cfg.batch_size as u64;
    let total = per_rank * world as u64;
    let (padded, dropped) = if total >= n {
        (total - n, 0)
    } else {
        (0, n - total)
    };
    let mut mine: Vec<u64> = (rank as u64 * per_rank..(rank as u64 + 1) * per_rank)
        .map(|p| order[(p % n.max(1)) as usize])
        .collect();
    // 3. In-window shuffle, per rank.
    if cfg.shuffle {
        let window = if cfg.window == 0 {
            cfg.batch_size
        } else {
            cfg.window
        };
        let mut rng = SplitMix::new(&[cfg.seed, epoch, rank as u64, 0x3140]);
        for w in mine.chunks_mut(window) {
            rng.shuffle(w);
        }
    }
    // 4. Chunks of consecutive batches, 5. reads per chunk.
    let mut stats = PlanStats {
        dataset_samples: n,
        samples: per_rank,
        padded,
        dropped,
        ..PlanStats::default()
    };
    let batch_ids: Vec<&[u64]> = mine.chunks(cfg.batch_size).collect();
    let mut batches = Vec::with_capacity(batch_ids.len());
    let mut chunks = Vec::new();
    let mut b = 0usize;
    while b < batch_ids.len() {
        let first = b;
        let mut bytes = 0u64;
        while b < batch_ids.len()
            && (b == first || (bytes < cfg.min_read && b - first < cfg.max_chunk_batches))
        {
            bytes += batch_ids[b]
                .iter()
                .map(|&id| index.samples[id as usize].len as u64)
                .sum::<u64>();
            b += 1;
        }
        let ids: Vec<u64> = batch_ids[first..b]
            .iter()
            .flat_map(|c| c.iter().copied())
            .collect();
        let (reads, samples) = plan_reads(index, cfg, &ids, first as u64 * cfg.batch_size as u64)?;
        stats.reads += reads.len() as u64;
        stats.read_bytes += reads.iter().map(|r| r.len).sum::<u64>();
        stats.sample_bytes += samples.iter().map(|s| s.len as u64).sum::<u64>();
        for part in samples.chunks(cfg.batch_size) {
            batches.push(BatchPlan {
                chunk: chunks.len() as u32,
                samples: part.to_vec(),
            });
        }
        chunks.push(ChunkPlan {
            first_batch: first as u32,
            batches: (b - first) as u32,
            reads,
        });
    }
    Ok(EpochPlan {
        epoch,
        rank,
        world,
        batches,
        chunks,
        stats,
    })
}

fn align_down(x: u64, a: u64) -> u64 {
    x / a * a
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

fn plan_reads(
    index: &DatasetIndex,
    cfg: &PlanConfig,
    ids: &[u64],
    first_position: u64,
) -> Result<(Vec<ReadPlan>, Vec<PlannedSample>), PlanError> {
    let a = cfg.align;
    let mut items: Vec<(u32, u64, u64, usize)> = ids
        .iter()
        .enumerate()
        .map(|(k, &id)| {
            let s = index.samples[id as usize];
            (s.shard, s.offset, s.offset + s.len as u64, k)
        })
        .collect();
    items.sort_unstable();
    let mut reads: Vec<ReadPlan> = Vec::new();
    // (read index) for each item, by k
    let mut read_of = vec![0u32; ids.len()];
    let mut cur: Option<(u32, u64, u64, u64)> = None; // shard, start, end, gap
    let flush = |cur: Option<(u32, u64, u64, u64)>, reads: &mut Vec<ReadPlan>| {
        if let Some((shard, start, end, gap)) = cur {
            let size = index.shards[shard as usize].size;
            let mut s = align_down(start, a);
            let mut e = align_up(end, a).min(size);
            if cfg.min_read > 0 && e - s < cfg.min_read {
                e = align_up(s + cfg.min_read, a).min(size);
                if e - s < cfg.min_read {
                    s = align_down(e.saturating_sub(cfg.min_read), a);
                }
            }
            reads.push(ReadPlan {
                shard,
                offset: s,
                len: e - s,
                gap_bytes: gap,
            });
        }
    };
    for &(shard, off, end, k) in &items {
        let span = align_up(end, a) - align_down(off, a);
        if span > cfg.max_read {
            let id = ids[k];
            return Err(PlanError::SampleTooLarge {
                sample: id,
                shard: index.shards[shard as usize].path.display().to_string(),
                offset: off,
                len: (end - off) as u32,
                span,
                max_read: cfg.max_read,
            });
        }
        match cur {
            Some((cs, cstart, cend, gap))
                if cs == shard
                    && off <= cend + cfg.max_gap
                    && align_up(end.max(cend), a) - align_down(cstart, a) <= cfg.max_read =>
            {
                cur = Some((cs, cstart, cend.max(end), gap + off.saturating_sub(cend)));
            }
            _ => {
                flush(cur, &mut reads);
                cur = Some((shard, off, end, 0));
            }
        }
        read_of[k] = reads.len() as u32;
    }
    flush(cur, &mut reads);
    let samples = ids
        .iter()
        .enumerate()
        .map(|(k, &id)| {
            let s = index.samples[id as usize];
            let r = &reads[read_of[k] as usize];
            PlannedSample {
                id,
                position: first_position + k as u64,
                read: read_of[k],
                offset_in_read: s.offset - r.offset,
                len: s.len,
            }
        })
        .collect();
    Ok((reads, samples))
}
