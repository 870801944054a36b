//! Packed batches: each sample's pieces are copied back to back into the chunk's block — GPT windows
//! (every batch a `(batch, tokens)` array) and several-column samples (parts 8-byte aligned) — each
//! batch starting on a 4 KiB boundary.

use crate::planner::{ChunkPlan, EpochPlan};

/// Where a packed chunk's bytes go.
pub(super) struct PackedChunk {
    /// Per batch of the chunk (by position in the chunk), the offset of each sample in the block.
    pub sample_at: Vec<Vec<usize>>,
    /// Per read of the chunk: `(offset in the read, length, destination in the block)`.
    pub copies: Vec<Vec<(u64, usize, usize)>>,
}

fn batch_bytes(plan: &EpochPlan, b: usize) -> u64 {
    plan.batches[b].samples.iter().map(|s| s.len as u64).sum()
}

/// Bytes a packed chunk needs in its block.
pub(in crate::pipeline) fn block_bytes(plan: &EpochPlan, chunk: &ChunkPlan) -> u64 {
    chunk
        .batch_range()
        .map(|b| batch_bytes(plan, b).div_ceil(4096) * 4096)
        .sum()
}

/// The layout of chunk `chunk`.
pub(super) fn layout(plan: &EpochPlan, chunk: &ChunkPlan) -> PackedChunk {
    let mut sample_at = Vec::with_capacity(chunk.batches as usize);
    let mut copies = vec![Vec::new(); chunk.reads.len()];
    let mut acc = 0usize;
    for b in chunk.batch_range() {
        let bp = &plan.batches[b];
        let mut at = acc;
        let mut offs = Vec::with_capacity(bp.samples.len());
        for s in &bp.samples {
            offs.push(at);
            let from = s.first_piece as usize;
            for p in &bp.pieces[from..from + s.pieces as usize] {
                copies[p.read as usize].push((
                    p.offset_in_read,
                    p.len as usize,
                    at + p.dst as usize,
                ));
            }
            at += s.len as usize;
        }
        sample_at.push(offs);
        acc += (batch_bytes(plan, b) as usize).div_ceil(4096) * 4096;
    }
    PackedChunk { sample_at, copies }
}
