//! Packed batches: each sample's pieces are copied back to back into the chunk's block — GPT windows
//! (every batch a `(batch, tokens)` array) and several-column samples (parts 8-byte aligned) — each
//! batch starting on a 4 KiB boundary. With `[dataset.tensors]` a GPT batch's Megatron tensors
//! follow its tokens in the same block (made by the host after the pack copies), so they go to
//! the GPU in the chunk's one transfer.

use crate::gpt::masks::{TensorLayout, TensorSpec};
use crate::planner::{ChunkPlan, EpochPlan};

/// Where a packed chunk's bytes go.
pub(super) struct PackedChunk {
    /// Per batch of the chunk (by position in the chunk), the offset of each sample in the block.
    pub sample_at: Vec<Vec<usize>>,
    /// Per read of the chunk: `(offset in the read, length, destination in the block)`.
    pub copies: Vec<Vec<(u64, usize, usize)>>,
    /// GPT batches with `[dataset.tensors]`: per batch, where its tensors go (after its tokens).
    pub tensors: Vec<TensorLayout>,
}

/// Bytes of batch `b` in the block starting at `at` (its samples, then its tensors), and its
/// tensors' layout.
fn batch_span(
    plan: &EpochPlan,
    b: usize,
    at: usize,
    tensors: Option<&TensorSpec>,
) -> (usize, Option<TensorLayout>) {
    let samples = &plan.batches[b].samples;
    let bytes: usize = samples.iter().map(|s| s.len as usize).sum();
    match tensors {
        Some(t) => {
            let (l, end) = t.layout(at, samples.len());
            ((end - at).div_ceil(4096) * 4096, Some(l))
        }
        None => (bytes.div_ceil(4096) * 4096, None),
    }
}

/// Bytes a packed chunk needs in its block.
pub(in crate::pipeline) fn block_bytes(
    plan: &EpochPlan,
    chunk: &ChunkPlan,
    tensors: Option<&TensorSpec>,
) -> u64 {
    let mut acc = 0;
    for b in chunk.batch_range() {
        acc += batch_span(plan, b, acc, tensors).0;
    }
    acc as u64
}

/// The layout of chunk `chunk`.
pub(super) fn layout(
    plan: &EpochPlan,
    chunk: &ChunkPlan,
    tensors: Option<&TensorSpec>,
) -> PackedChunk {
    let mut sample_at = Vec::with_capacity(chunk.batches as usize);
    let mut layouts = Vec::new();
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
        let (span, l) = batch_span(plan, b, acc, tensors);
        layouts.extend(l);
        acc += span;
    }
    PackedChunk {
        sample_at,
        copies,
        tensors: layouts,
    }
}
