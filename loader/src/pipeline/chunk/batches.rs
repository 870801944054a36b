//! The chunk's batches: one sample table for all of them (each batch a range of it), where each
//! sample is in the chunk's memory — a read's base plus the sample's offset in it (contiguous and
//! host), or its place in the packed block — and, for several-column samples, each part's place.

use std::ops::Range;
use std::sync::Arc;

use super::super::batch::BatchMemory;
use super::super::{Batch, Inner, LoadError, SampleEntry};
use super::assemble::Assembled;
use super::lists::ChunkLists;
use super::packed::PackedChunk;
use crate::planner::{BatchPlan, ChunkPlan, EpochPlan, PlannedSample};

/// The batches `batches` of `chunk`, over its assembled memory.
pub(super) fn build(
    inner: &Inner,
    plan: &EpochPlan,
    chunk: &ChunkPlan,
    batches: Range<usize>,
    mem: Assembled,
) -> Result<Vec<Batch>, LoadError> {
    let Assembled {
        dev,
        host,
        packed,
        tensors,
        mut lists,
    } = mem;
    // Each batch's share of the chunk's reads; the last takes the division's remainder, so a whole
    // chunk's batches carry exactly its bytes (the summary's read-ahead figure).
    let share = chunk.read_bytes() / chunk.batches.max(1) as u64;
    let last_batch = chunk.first_batch as usize + chunk.batches.max(1) as usize - 1;
    let base = std::mem::take(&mut lists.base);
    let table = sample_table(
        plan,
        chunk,
        batches.clone(),
        packed.as_ref(),
        dev.is_some(),
        &base,
        &mut lists,
    );
    lists.base = base;
    // The lists for a later chunk (the table with them, filled again once these batches are gone).
    inner.spare.give(lists);
    let mut out = Vec::with_capacity(batches.len());
    let mut from = 0;
    for b in batches {
        let range = from..from + plan.batches[b].samples.len();
        from = range.end;
        let chunk_read = if b == last_batch {
            chunk.read_bytes() - share * (chunk.batches.max(1) as u64 - 1)
        } else {
            share
        };
        let samples = super::super::batch::SampleTable::new(table.clone(), range);
        let memory = match (&dev, &packed) {
            (Some(d), _) => BatchMemory::Block(d.clone()),
            (None, Some(_)) => {
                return Err(LoadError::Closed(
                    "packed batches need a batch block".into(),
                ));
            }
            (None, None) => BatchMemory::Host(host.clone()),
        };
        // Several-column samples: each part's place in its sample.
        let parts = (packed.is_some() && plan.packed_parts).then(|| parts_of(&plan.batches[b]));
        out.push(Batch {
            epoch: plan.epoch,
            index: plan.first_batch + b as u64,
            rank: plan.rank,
            samples,
            memory,
            device: inner.device.clone(),
            read_bytes: chunk_read,
            tokens: if packed.is_some() {
                inner.gpt.as_ref().map(|g| (g.dtype, g.tokens))
            } else {
                None
            },
            parts,
            gpt: inner.gpt.clone(),
            tensors: tensors.get(b - chunk.first_batch as usize).cloned(),
        });
    }
    Ok(out)
}

/// One sample table for the chunk's batches (each batch a range of it, in order): no allocation
/// per batch, and none per chunk once the table of an earlier chunk is free again
/// ([`ChunkLists::table`]). Each sample is at its place in the packed block, or at its read's `base`
/// plus its offset in it (`segment`: its read, for host batches without a batch block).
fn sample_table(
    plan: &EpochPlan,
    chunk: &ChunkPlan,
    batches: Range<usize>,
    packed: Option<&PackedChunk>,
    has_block: bool,
    base: &[usize],
    lists: &mut ChunkLists,
) -> Arc<[SampleEntry]> {
    let n = batches.clone().map(|b| plan.batches[b].samples.len()).sum();
    // The entries in order: (batch, sample in it).
    let mut at = batches.flat_map(|b| (0..plan.batches[b].samples.len()).map(move |si| (b, si)));
    lists.table(n, |e| {
        let Some((b, si)) = at.next() else {
            return;
        };
        let s = &plan.batches[b].samples[si];
        *e = match packed {
            Some(pk) => entry(
                chunk,
                s,
                0,
                pk.sample_at[b - chunk.first_batch as usize][si],
            ),
            None => {
                let segment = if has_block { 0 } else { s.read };
                entry(
                    chunk,
                    s,
                    segment,
                    base[s.read as usize] + s.offset_in_read as usize,
                )
            }
        };
    })
}

/// Sample `s`'s entry in the table: where its read took it from, and its `segment` and `offset`
/// in the batch's memory.
fn entry(chunk: &ChunkPlan, s: &PlannedSample, segment: u32, offset: usize) -> SampleEntry {
    let r = &chunk.reads[s.read as usize];
    SampleEntry {
        id: s.id,
        position: s.position,
        shard: r.shard,
        shard_offset: r.offset + s.offset_in_read,
        len: s.len,
        segment,
        offset,
    }
}

/// Each part's `(place, length)` in its sample, per sample of batch `bp` (several-column samples).
fn parts_of(bp: &BatchPlan) -> Vec<Vec<(u32, u32)>> {
    bp.samples
        .iter()
        .map(|s| {
            let from = s.first_piece as usize;
            bp.pieces[from..from + s.pieces as usize]
                .iter()
                .map(|p| (p.dst, p.len))
                .collect()
        })
        .collect()
}
