//! GPT batches: each sample's pieces are copied back to back into the chunk's block, every batch a
//! packed `(batch, tokens)` array starting on a 4 KiB boundary.

use crate::planner::{ChunkPlan, EpochPlan};

/// Where a packed chunk's bytes go.
pub(super) struct PackedChunk {
    /// Offset of each batch of the chunk (by position in the chunk) in the block.
    pub batch_base: Vec<usize>,
    /// Per read of the chunk: `(offset in the read, length, destination in the block)`.
    pub copies: Vec<Vec<(u64, usize, usize)>>,
}

/// Bytes a packed chunk needs in its block.
pub(super) fn block_bytes(plan: &EpochPlan, chunk: &ChunkPlan, sample_bytes: u64) -> u64 {
    chunk
        .batch_range()
        .map(|b| (plan.batches[b].samples.len() as u64 * sample_bytes).div_ceil(4096) * 4096)
        .sum()
}

/// The layout of chunk `chunk`'s batches `batches` (absolute batch indices, ascending).
pub(super) fn layout(plan: &EpochPlan, chunk: &ChunkPlan, sample_bytes: u64) -> PackedChunk {
    let mut batch_base = Vec::with_capacity(chunk.batches as usize);
    let mut copies = vec![Vec::new(); chunk.reads.len()];
    let mut acc = 0usize;
    for b in chunk.batch_range() {
        let bp = &plan.batches[b];
        batch_base.push(acc);
        for (si, s) in bp.samples.iter().enumerate() {
            let at = acc + si * sample_bytes as usize;
            let from = s.first_piece as usize;
            for p in &bp.pieces[from..from + s.pieces as usize] {
                copies[p.read as usize].push((
                    p.offset_in_read,
                    p.len as usize,
                    at + p.dst as usize,
                ));
            }
        }
        acc += (bp.samples.len() * sample_bytes as usize).div_ceil(4096) * 4096;
    }
    PackedChunk { batch_base, copies }
}
