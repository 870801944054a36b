//! The planner's inputs and outputs: its settings ([`PlanConfig`]), its errors, and the epoch plan
//! (chunks of reads, batches of samples and pieces).

use super::Fnv;

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
    /// Bytes a chunk of batches holds at least (with `min_read`), within `max_chunk_batches`. Not in
    /// the fingerprint: chunking moves no sample.
    pub chunk_bytes: u64,
    /// Bound on a read's bytes ÷ the bytes of its samples, for merges (bridged gaps) and widening
    /// (0: no bound beyond `max_gap` and the widening rule). Object stores set 2: every byte fetched
    /// is paid for. Not in the fingerprint: reads move no sample.
    pub max_amplification: u64,
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
            min_read: 1 << 20,
            max_gap: 64 << 10,
            max_read: 4 << 20,
            align: 4096,
            max_chunk_batches: 16,
            chunk_bytes: 0,
            max_amplification: 0,
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
            super::PLAN_VERSION,
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
    /// A sample's bytes lie outside its shard (the index, or a file it reads in place, changed).
    #[error(
        "plan: sample {sample} names {len} bytes at {offset} of shard {shard}, which has {size} bytes: the dataset's index changed under the loader"
    )]
    OutsideShard {
        /// Sample id.
        sample: u64,
        /// Shard number.
        shard: u32,
        /// Offset.
        offset: u64,
        /// Length.
        len: u32,
        /// The shard's size.
        size: u64,
    },
    /// A GPT sample's pieces do not add up to a whole sample: its indices (an index cache file) or
    /// the sequence lengths they were built from (a `.idx` read in place) are inconsistent.
    #[error(
        "plan: GPT sample {sample} is made of {bytes} bytes of sequences, not {expected}: its indices or the dataset's sequence lengths changed (or a cache file is inconsistent)"
    )]
    GptSample {
        /// Sample id.
        sample: u64,
        /// Bytes its pieces hold.
        bytes: u64,
        /// Bytes of a sample.
        expected: u64,
    },
    /// A chunk's plan names a read or piece it does not have.
    #[error("plan: chunk {chunk}: {what} names read {read} of {reads}")]
    Inconsistent {
        /// Chunk number.
        chunk: usize,
        /// What (sample or piece).
        what: &'static str,
        /// The read named.
        read: u64,
        /// Reads the chunk has.
        reads: usize,
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
    /// Sample id (position in the index; GPT: the window's id).
    pub id: u64,
    /// Position in the epoch's global order.
    pub position: u64,
    /// Index of the read holding it (GPT: its first piece), in its chunk's [`ChunkPlan::reads`].
    pub read: u32,
    /// Offset of its first byte in that read.
    pub offset_in_read: u64,
    /// Length (GPT: of the whole window).
    pub len: u32,
    /// GPT: its pieces are `BatchPlan::pieces[first_piece..first_piece + pieces]`.
    pub first_piece: u32,
    /// GPT: number of pieces (0 for a sample that is one byte range).
    pub pieces: u32,
}

/// One byte range of a GPT sample, copied to `dst` bytes into the sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedPiece {
    /// Index of the read holding it.
    pub read: u32,
    /// Offset of its first byte in that read.
    pub offset_in_read: u64,
    /// Length.
    pub len: u32,
    /// Where it goes in the sample.
    pub dst: u32,
}

/// A batch's part of a list its chunk's batches share: one allocation per chunk, not one per batch
/// (since 2026-12-07). Reads as the slice.
#[derive(Clone)]
pub struct Shared<T> {
    all: std::sync::Arc<[T]>,
    range: std::ops::Range<usize>,
}

impl<T> Shared<T> {
    /// `range` of `all` (clamped to it).
    pub fn part(all: &std::sync::Arc<[T]>, range: std::ops::Range<usize>) -> Self {
        let end = range.end.min(all.len());
        Self {
            all: all.clone(),
            range: range.start.min(end)..end,
        }
    }
}

impl<T> std::ops::Deref for Shared<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.all[self.range.clone()]
    }
}

impl<T> From<Vec<T>> for Shared<T> {
    fn from(v: Vec<T>) -> Self {
        let n = v.len();
        Self {
            all: v.into(),
            range: 0..n,
        }
    }
}

impl<'a, T> IntoIterator for &'a Shared<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

impl<T: PartialEq> PartialEq for Shared<T> {
    fn eq(&self, o: &Self) -> bool {
        **self == **o
    }
}

impl<T: Eq> Eq for Shared<T> {}

/// One batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPlan {
    /// The chunk whose reads hold this batch's samples.
    pub chunk: u32,
    /// Samples in delivery order (a part of the chunk's list).
    pub samples: Shared<PlannedSample>,
    /// GPT samples' pieces (empty when every sample is one byte range; a part of the chunk's list).
    pub pieces: Shared<PlannedPiece>,
}

/// Consecutive batches that share one set of reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkPlan {
    /// First batch of the chunk.
    pub first_batch: u32,
    /// Batches in the chunk.
    pub batches: u32,
    /// Reads, sorted by (shard, offset) (a part of the segment's list).
    pub reads: Shared<ReadPlan>,
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
    /// Blends: samples this rank delivers from each blended dataset.
    pub per_dataset: Vec<u64>,
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
    /// Global position of the plan's first global batch (0 unless resumed).
    pub start: u64,
    /// Index of the first batch (`start / (world × batch_size)`), so batch indices continue across
    /// a resume at the same world size.
    pub first_batch: u64,
    /// Samples per global batch (`world × batch_size`).
    pub step: u64,
    /// GPT: every sample is this many bytes, assembled from pieces (batches are packed arrays).
    pub packed_sample_bytes: Option<u64>,
    /// Several columns per sample: each sample's parts are copied back to back (each part 8-byte
    /// aligned) and samples packed one after the other.
    pub packed_parts: bool,
    /// This rank's batches of the epoch after this plan's (0: the plan runs to the epoch's end). A
    /// plan may be one segment of its epoch: the iterator plans the next from [`EpochPlan::end`]
    /// while this one is read, so memory holds a segment, not an epoch.
    pub later_batches: u64,
    /// Batches in delivery order.
    pub batches: Vec<BatchPlan>,
    /// Chunks of consecutive batches sharing reads, in order.
    pub chunks: Vec<ChunkPlan>,
    /// Totals.
    pub stats: PlanStats,
}

impl EpochPlan {
    /// The global position after this rank's first `batches` batches (of every rank's, as all ranks
    /// move together): what a resume continues from.
    pub fn position_after(&self, batches: u64) -> u64 {
        self.start + batches * self.step
    }

    /// The global position after this plan's last batch (where the next segment starts).
    pub fn end(&self) -> u64 {
        self.position_after(self.batches.len() as u64)
    }

    /// This rank's batches from this plan's start to the epoch's end (this segment and the later).
    pub fn total_batches(&self) -> u64 {
        self.batches.len() as u64 + self.later_batches
    }

    /// The chunk holding batch `b`.
    pub fn chunk_of(&self, b: usize) -> Option<&ChunkPlan> {
        self.batches
            .get(b)
            .map(|bp| &self.chunks[bp.chunk as usize])
    }
}
