//! Assembly strategies: where a landed read's bytes go in the chunk's memory.
//!
//! - **contiguous**: each read copied whole by the device into the chunk's batch block, 4 KiB
//!   aligned (mapped reads that follow each other in the shard and the block go as one copy);
//! - **packed**: each sample's pieces copied back to back (GPT windows, several-column samples whose
//!   parts the batch describes), by the device piece by piece, or by the CPU into a pinned assembly
//!   block that then goes to the device in one transfer;
//! - **host**: no device block; the staging leases are the batch's memory.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ubdirect_ub::{CopyCompletion, Lease, ReadDone, ReadPath};

use super::super::shardmap::ShardMap;
use super::super::{Inner, LoadError, hist_bucket};
use super::land::Landed;
use super::lists::ChunkLists;
use super::packed::PackedChunk;
use crate::gpt::masks::{BatchTensors, TensorSpec};
use crate::planner::{ChunkPlan, EpochPlan};

/// Which strategy a chunk is assembled with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Strategy {
    /// Whole reads into the batch block.
    Contiguous,
    /// Packed pieces into the batch block, each a device copy.
    PackedDevice,
    /// Packed pieces into the pinned assembly block (CPU copies), one transfer at the end.
    PackedAssembled,
    /// Host batches: the staging leases kept.
    Host,
}

/// The strategy of a chunk with a batch block (`dev`), a packed layout and an assembly block.
fn strategy(dev: bool, packed: bool, asm: bool) -> Strategy {
    match (dev, packed, asm) {
        (false, _, _) => Strategy::Host,
        (true, true, true) => Strategy::PackedAssembled,
        (true, true, false) => Strategy::PackedDevice,
        (true, false, _) => Strategy::Contiguous,
    }
}

fn is_packed(plan: &EpochPlan) -> bool {
    plan.packed_sample_bytes.is_some() || plan.packed_parts
}

/// Whether a chunk of `plan` with these blocks is assembled by CPU copies into host-visible memory
/// (the pinned assembly block, or a batch block in host memory), so that reads at hand in memory
/// ([`Landed::Bytes`]) land with no staging block.
pub(super) fn lands_by_cpu(plan: &EpochPlan, dev: Option<&Lease>, asm: Option<&Lease>) -> bool {
    match strategy(dev.is_some(), is_packed(plan), asm.is_some()) {
        Strategy::PackedAssembled => true,
        Strategy::PackedDevice | Strategy::Contiguous => {
            dev.is_some_and(|d| d.host_ptr().is_some())
        }
        Strategy::Host => false,
    }
}

/// A chunk being assembled.
pub(super) struct Assembly<'p> {
    strategy: Strategy,
    /// The chunk's batch block (device batches).
    dev: Option<Lease>,
    /// The pinned assembly block (packed device batches).
    asm: Option<Lease>,
    /// The packed layout (packed batches).
    pub packed: Option<PackedChunk>,
    /// Where each read lands and starts (`dst`, `base`), each read's lease (host batches): lists
    /// kept from an earlier chunk.
    lists: ChunkLists,
    copies: Vec<CopyCompletion>,
    plan: &'p EpochPlan,
    chunk: &'p ChunkPlan,
    /// `[dataset.tensors]`: made in the host block after the pack copies.
    tensors: Option<TensorSpec>,
}

/// The chunk's memory once every copy is done.
pub(super) struct Assembled {
    /// The batch block (device batches).
    pub dev: Option<Arc<Lease>>,
    /// The staging leases, one per read (host batches).
    pub host: Arc<[Arc<Lease>]>,
    /// The packed layout (packed batches).
    pub packed: Option<PackedChunk>,
    /// `[dataset.tensors]`: each batch's tensors (by position in the chunk).
    pub tensors: Vec<Arc<BatchTensors>>,
    /// The chunk's lists: where each read's bytes start in its memory (`base`), the others emptied
    /// for a later chunk.
    pub lists: ChunkLists,
}

impl<'p> Assembly<'p> {
    /// The strategy for `chunk`, given the blocks the producer acquired.
    pub fn new(
        plan: &'p EpochPlan,
        chunk: &'p ChunkPlan,
        dev: Option<Lease>,
        asm: Option<Lease>,
        tensors: Option<&TensorSpec>,
        mut lists: ChunkLists,
    ) -> Self {
        let n = chunk.reads.len();
        // Kept from an earlier chunk: empty, their capacity kept.
        lists.base.resize(n, 0);
        lists.host.resize_with(n, || None);
        let mut acc = 0usize;
        for r in &chunk.reads {
            lists.dst.push(acc);
            acc += (r.len as usize).div_ceil(4096) * 4096;
        }
        let packed = is_packed(plan).then(|| super::packed::layout(plan, chunk, tensors));
        let strategy = strategy(dev.is_some(), packed.is_some(), asm.is_some());
        Self {
            strategy,
            dev,
            asm,
            packed,
            lists,
            copies: Vec::new(),
            plan,
            chunk,
            tensors: tensors.copied(),
        }
    }

    /// Whether the chunk has a batch block (reads of mapped shards then land in place).
    pub fn has_device(&self) -> bool {
        self.dev.is_some()
    }

    /// Whether mapped reads `prev` and `next` (contiguous in the shard) may go as one copy: whole
    /// reads, contiguous in the block too, and no CRC to check one by one.
    pub fn joins(&self, prev: usize, next: usize, crc: bool) -> bool {
        self.strategy == Strategy::Contiguous
            && !crc
            && self.lists.dst[next] == self.lists.dst[prev] + self.chunk.reads[prev].len as usize
    }

    /// The pieces of read `ri` (packed batches).
    fn pieces(&self, ri: usize) -> &[(u64, usize, usize)] {
        self.packed
            .as_ref()
            .map_or(&[][..], |pk| &pk.copies[ri][..])
    }

    /// Places a landed read, and counts what it moved.
    pub fn place(&mut self, inner: &Inner, landed: Landed<'_>) -> Result<(), LoadError> {
        match landed {
            Landed::Mapped {
                reads,
                map,
                offset,
                len,
            } => self.place_mapped(inner, reads, map, offset, len),
            Landed::Lease { read, lease, done } => self.place_lease(inner, read, lease, done),
            Landed::Bytes { read, bytes } => self.place_bytes(read, &bytes),
        }
    }

    /// Places read `ri`, at hand as `bytes`, by CPU copies into the chunk's host-visible block
    /// (the assembly block, or a batch block in host memory: [`lands_by_cpu`]).
    fn place_bytes(&mut self, ri: usize, bytes: &[u8]) -> Result<(), LoadError> {
        let short = || LoadError::Closed(format!("read {ri} at hand: fewer bytes than planned"));
        let pieces = self
            .packed
            .as_ref()
            .map_or(&[][..], |pk| &pk.copies[ri][..]);
        let block = match self.strategy {
            Strategy::PackedAssembled => self.asm.as_mut(),
            Strategy::PackedDevice | Strategy::Contiguous => self.dev.as_mut(),
            Strategy::Host => None,
        };
        let buf = block.ok_or_else(no_block)?.as_mut_slice()?;
        if self.strategy == Strategy::Contiguous {
            let at = self.lists.dst[ri];
            let dst = buf.get_mut(at..at + bytes.len()).ok_or_else(no_block)?;
            dst.copy_from_slice(bytes);
        } else {
            for &(off, len, to) in pieces {
                let src = bytes
                    .get(off as usize..off as usize + len)
                    .ok_or_else(short)?;
                let dst = buf.get_mut(to..to + len).ok_or_else(no_block)?;
                dst.copy_from_slice(src);
            }
        }
        self.lists.base[ri] = self.lists.dst[ri];
        Ok(())
    }

    /// Places reads `reads` found in place in `map` (the first at `offset`, `len` bytes in all),
    /// copied out of the mapping, and counts what they moved.
    fn place_mapped(
        &mut self,
        inner: &Inner,
        reads: Range<usize>,
        map: &Arc<ShardMap>,
        offset: u64,
        len: usize,
    ) -> Result<(), LoadError> {
        let ri = reads.start;
        match self.strategy {
            Strategy::PackedAssembled => {
                let r = &self.chunk.reads[ri];
                if let Some(a) = self.asm.as_mut() {
                    let buf = a.as_mut_slice()?;
                    for &(off, len, to) in self
                        .packed
                        .as_ref()
                        .map_or(&[][..], |pk| &pk.copies[ri][..])
                    {
                        map.copy_out(r.offset + off, &mut buf[to..to + len])
                            .map_err(|e| ubdirect_ub::DeviceError::Mapped(Box::new(e)))?;
                    }
                }
            }
            Strategy::PackedDevice => {
                let r = &self.chunk.reads[ri];
                let d = self.dev.as_mut().ok_or_else(no_block)?;
                for &(off, len, to) in self
                    .packed
                    .as_ref()
                    .map_or(&[][..], |pk| &pk.copies[ri][..])
                {
                    map.copy_to_device(
                        inner.device.as_ref(),
                        r.offset + off,
                        len,
                        d,
                        to,
                        &mut self.copies,
                    )?;
                }
            }
            Strategy::Contiguous => {
                let d = self.dev.as_mut().ok_or_else(no_block)?;
                map.copy_to_device(
                    inner.device.as_ref(),
                    offset,
                    len,
                    d,
                    self.lists.dst[ri],
                    &mut self.copies,
                )?;
                for i in reads {
                    self.lists.base[i] = self.lists.dst[i];
                    let rl = self.chunk.reads[i].len;
                    count(inner, rl, ReadPath::Mapped, rl);
                }
                return Ok(());
            }
            Strategy::Host => return Err(no_block()),
        }
        self.lists.base[ri] = self.lists.dst[ri];
        // Packed pieces copied out of the mapping: only their bytes moved (a widened or
        // merged read costs nothing here), so that is what the read counts.
        let moved = self.pieces(ri).iter().map(|c| c.1 as u64).sum();
        count(inner, moved, ReadPath::Mapped, moved);
        Ok(())
    }

    /// Places read `ri`, landed in staging `lease` (its bytes at `done.data`), by the strategy.
    fn place_lease(
        &mut self,
        inner: &Inner,
        ri: usize,
        mut lease: Lease,
        done: ReadDone,
    ) -> Result<(), LoadError> {
        match self.strategy {
            Strategy::PackedAssembled => {
                // Pieces into the assembly block; the staging block goes back at once.
                if let Some(a) = self.asm.as_mut() {
                    let src = lease.as_slice()?;
                    let buf = a.as_mut_slice()?;
                    for &(off, len, to) in self
                        .packed
                        .as_ref()
                        .map_or(&[][..], |pk| &pk.copies[ri][..])
                    {
                        let at = done.data.start + off as usize;
                        buf[to..to + len].copy_from_slice(&src[at..at + len]);
                    }
                }
            }
            Strategy::PackedDevice => {
                let d = self.dev.as_mut().ok_or_else(no_block)?;
                for &(off, len, to) in self
                    .packed
                    .as_ref()
                    .map_or(&[][..], |pk| &pk.copies[ri][..])
                {
                    let at = done.data.start + off as usize;
                    self.copies.push(inner.device.copy_to_device(
                        &mut lease,
                        at..at + len,
                        d,
                        to,
                    )?);
                }
            }
            Strategy::Contiguous => {
                let d = self.dev.as_mut().ok_or_else(no_block)?;
                self.copies.push(inner.device.copy_to_device(
                    &mut lease,
                    done.data.clone(),
                    d,
                    self.lists.dst[ri],
                )?);
                self.lists.base[ri] = self.lists.dst[ri];
                // The staging block is orphaned until the copy's event fires, then recycled.
            }
            Strategy::Host => {
                self.lists.base[ri] = done.data.start;
                self.lists.host[ri] = Some(Arc::new(lease));
            }
        }
        Ok(())
    }

    /// Sends an assembled block to the device in one transfer, waits for every copy, and hands back
    /// the chunk's memory.
    pub async fn finish(mut self, inner: &Inner) -> Result<Assembled, LoadError> {
        let mut tensors = Vec::new();
        let mut host_done = false;
        if let (Some(mut a), true, true) =
            (self.asm.take(), self.dev.is_some(), self.packed.is_some())
        {
            // The tensors are made beside the tokens in the assembly block: one transfer for all.
            tensors = self.finish_host_block(inner, a.as_mut_slice()?)?;
            host_done = true;
            let d = self.dev.as_mut().ok_or_else(no_block)?;
            let len =
                super::packed::block_bytes(self.plan, self.chunk, self.tensors.as_ref()) as usize;
            self.copies
                .push(inner.device.copy_to_device(&mut a, 0..len, d, 0)?);
            // Orphaned until the copy's event fires, then recycled.
            drop(a);
        }
        for c in std::mem::take(&mut self.copies) {
            c.wait(inner.acquire_timeout).await?;
        }
        // Packed host batch blocks: the pack copies are done; padding and tensors are made in place.
        if !host_done
            && self.packed.is_some()
            && let Some(mut d) = self.dev.take()
        {
            if d.kind() != ubdirect_ub::MemoryKind::Device {
                tensors = self.finish_host_block(inner, d.as_mut_slice()?)?;
            }
            self.dev = Some(d);
        }
        let dev = self.dev.map(Arc::new);
        // One list of the reads' leases for all of the chunk's batches (a clone per batch was an
        // allocation per batch).
        let host: Arc<[Arc<Lease>]> = if dev.is_none() {
            if self.lists.host.iter().any(Option::is_none) {
                return Err(LoadError::Closed("missing read".into()));
            }
            // Listed in the kept list, then copied into the one the batches share: one allocation.
            self.lists
                .leases
                .extend(self.lists.host.drain(..).flatten());
            let all = Arc::from(&self.lists.leases[..]);
            self.lists.leases.clear();
            all
        } else {
            Arc::new([])
        };
        Ok(Assembled {
            dev,
            host,
            packed: self.packed,
            tensors,
            lists: self.lists,
        })
    }

    /// A packed chunk's host block (the assembly block, or a host batch block) once its pieces are
    /// in: padding zeroed, then the batches' tensors made beside their tokens.
    fn finish_host_block(
        &self,
        inner: &Inner,
        block: &mut [u8],
    ) -> Result<Vec<Arc<BatchTensors>>, LoadError> {
        self.zero_padding(block);
        self.make_tensors(inner, block)
    }

    /// Zeroes the bytes of a packed block that no piece fills — each part's padding to the next
    /// 8-byte boundary — so that a sample's bytes are the same whatever the block held before (a
    /// reused block would otherwise leave another chunk's bytes between the parts).
    fn zero_padding(&self, block: &mut [u8]) {
        let Some(pk) = &self.packed else { return };
        for (i, b) in self.chunk.batch_range().enumerate() {
            let (Some(bp), Some(at)) = (self.plan.batches.get(b), pk.sample_at.get(i)) else {
                break;
            };
            for (s, &start) in bp.samples.iter().zip(at) {
                let from = s.first_piece as usize;
                let pieces = bp.pieces.get(from..from + s.pieces as usize).unwrap_or(&[]);
                for (k, p) in pieces.iter().enumerate() {
                    let end = pieces.get(k + 1).map_or(s.len, |n| n.dst);
                    let pad = start + (p.dst + p.len) as usize..start + end as usize;
                    if let Some(z) = block.get_mut(pad) {
                        z.fill(0);
                    }
                }
            }
        }
    }

    /// `[dataset.tensors]`: each batch's Megatron tensors, made in `block` (which holds the
    /// chunk's packed tokens); nothing without them.
    fn make_tensors(
        &self,
        inner: &Inner,
        block: &mut [u8],
    ) -> Result<Vec<Arc<BatchTensors>>, LoadError> {
        let (Some(spec), Some(pk), Some(gpt)) = (&self.tensors, &self.packed, &inner.gpt) else {
            return Ok(Vec::new());
        };
        let es = spec.dtype.size().max(1) as u32;
        let mut locs = Vec::new();
        let mut out = Vec::with_capacity(pk.tensors.len());
        for (i, b) in self.chunk.batch_range().enumerate() {
            let (Some(layout), Some(rows_at)) = (pk.tensors.get(i), pk.sample_at.get(i)) else {
                break;
            };
            let samples = &self.plan.batches[b].samples;
            out.push(Arc::new(spec.fill(
                block,
                layout.clone(),
                rows_at,
                |si, pieces| {
                    locs.clear();
                    gpt.pieces(&inner.index, samples[si].id, &mut locs);
                    pieces.extend(locs.iter().map(|l| l.len / es));
                },
            )?));
        }
        Ok(out)
    }
}

fn no_block() -> LoadError {
    LoadError::Closed("a read landed in place without a batch block".into())
}

/// Counts one read of `len` planned bytes that moved `moved` bytes along `path`.
pub(super) fn count(inner: &Inner, len: u64, path: ReadPath, moved: u64) {
    let s = &inner.stats;
    s.path_bytes[path.index()].fetch_add(moved, Ordering::Relaxed);
    s.reads.fetch_add(1, Ordering::Relaxed);
    s.read_bytes.fetch_add(len, Ordering::Relaxed);
    s.read_hist[hist_bucket(len)].fetch_add(1, Ordering::Relaxed);
}
