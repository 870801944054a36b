//! Reading one chunk of batches: staging leases acquired in chunk order, one read per planned block
//! through the shard's [`Source`](ubdirect_ub::Source), CRC checks, copies into the chunk's device
//! block, batches.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use ubdirect_ub::{CopyCompletion, Lease, ReadDone, ReadPath, UbError};

use super::batch::BatchMemory;
use super::pagecache::Mapped;
use super::{Batch, Inner, LoadError, SampleEntry, hist_bucket};
use crate::planner::EpochPlan;

pub(super) type ChunkHandle = JoinHandle<Result<Vec<Batch>, LoadError>>;

/// Acquires blocks in chunk order (so chunks never wait on each other's blocks) and spawns one task
/// per chunk; the bounded channel is the prefetch depth. `issued` counts the bytes of the chunks
/// whose reads have all been handed their blocks (the prefetch advice runs ahead of it).
pub(super) async fn produce(
    inner: Arc<Inner>,
    plan: Arc<EpochPlan>,
    start: u64,
    tx: mpsc::Sender<ChunkHandle>,
    mapped: Mapped,
    issued: tokio::sync::watch::Sender<u64>,
    starved: Arc<super::Starved>,
) {
    let Some(first_chunk) = plan.batches.get(start as usize).map(|b| b.chunk as usize) else {
        return;
    };
    for ci in first_chunk..plan.chunks.len() {
        let chunk = &plan.chunks[ci];
        // Shards registered in the background since the epoch started are copied from their
        // mappings from this chunk on (the chunk keeps the view it started with).
        let mapped = match &inner.page_cache {
            Some(pc) => pc.current(),
            None => mapped.clone(),
        };
        let batches: Vec<usize> = chunk.batch_range().filter(|&b| b as u64 >= start).collect();
        let dev = match &inner.batch_pool {
            Some(bp) => match starved
                .acquire(bp, super::StarvedOn::Batch, inner.acquire_timeout)
                .await
            {
                Ok(l) => Some(l),
                Err(e) => {
                    let _ = tx.send(tokio::spawn(async move { Err(e.into()) })).await;
                    return;
                }
            },
            None => None,
        };
        // Packed GPU batches: the chunk is assembled in a pinned block first.
        let asm = match (&inner.pack_pool, &dev) {
            (Some(pp), Some(_)) => match pp.acquire(inner.acquire_timeout).await {
                Ok(l) => Some(l),
                Err(e) => {
                    let _ = tx.send(tokio::spawn(async move { Err(e.into()) })).await;
                    return;
                }
            },
            _ => None,
        };
        // Reads copied by the device straight out of a mapped shard need no staging block.
        let nreads = chunk
            .reads
            .iter()
            .filter(|r| dev.is_none() || mapping(&mapped, r.shard).is_none())
            .count();
        let (ltx, lrx) = mpsc::channel(nreads.max(1));
        let (etx, erx) = tokio::sync::oneshot::channel();
        let h = tokio::spawn(build_chunk(
            inner.clone(),
            plan.clone(),
            ci,
            batches,
            lrx,
            dev,
            asm,
            erx,
            mapped.clone(),
        ));
        if tx.send(h).await.is_err() {
            return; // the iterator is gone
        }
        for _ in 0..nreads {
            match starved
                .acquire(
                    &inner.staging,
                    super::StarvedOn::Staging,
                    inner.acquire_timeout,
                )
                .await
            {
                Ok(l) => {
                    if ltx.send(l).await.is_err() {
                        break; // the chunk failed; its error reaches the consumer
                    }
                }
                Err(e) => {
                    let _ = etx.send(e);
                    return;
                }
            }
        }
        issued.send_modify(|b| *b += chunk.read_bytes());
    }
}

#[allow(clippy::too_many_arguments)] // one task's whole context, passed once
async fn build_chunk(
    inner: Arc<Inner>,
    plan: Arc<EpochPlan>,
    ci: usize,
    batches: Vec<usize>,
    mut leases: mpsc::Receiver<Lease>,
    mut dev: Option<Lease>,
    mut asm: Option<Lease>,
    acquire_err: tokio::sync::oneshot::Receiver<UbError>,
    mapped: Mapped,
) -> Result<Vec<Batch>, LoadError> {
    let chunk = &plan.chunks[ci];
    let n = chunk.reads.len();
    // Where each read lands in the chunk's device block (4 KiB aligned).
    let mut dst = Vec::with_capacity(n);
    let mut acc = 0usize;
    for r in &chunk.reads {
        dst.push(acc);
        acc += (r.len as usize).div_ceil(4096) * 4096;
    }
    // GPT batches: samples assembled from pieces, packed per batch.
    let packed = (plan.packed_sample_bytes.is_some() || plan.packed_parts)
        .then(|| super::packed::layout(&plan, chunk));
    // Which samples of the chunk each read holds (for CRC checks only: nothing per sample
    // otherwise).
    let mut holds: Vec<Vec<(usize, usize)>> = Vec::new();
    if inner.crcs.is_some() {
        holds = vec![Vec::new(); n];
        for &b in &batches {
            for (si, s) in plan.batches[b].samples.iter().enumerate() {
                holds[s.read as usize].push((b, si));
            }
        }
    }
    let mut host: Vec<Option<Arc<Lease>>> = (0..n).map(|_| None).collect();
    let mut base = vec![0usize; n];
    let mut copies: Vec<CopyCompletion> = Vec::new();
    let mut reads: JoinSet<(usize, Result<ReadDone, LoadError>, Lease)> = JoinSet::new();
    let mut received = 0;
    let mut acquire_err = acquire_err;
    while received < n || !reads.is_empty() {
        // Reads of mapped shards, in order: one device copy straight out of the page cache each.
        while received < n {
            let r = &chunk.reads[received];
            let (Some(d), Some(m)) = (dev.as_mut(), mapping(&mapped, r.shard)) else {
                break;
            };
            if let Some(crcs) = &inner.crcs {
                for &(b, si) in &holds[received] {
                    let s = &plan.batches[b].samples[si];
                    let mut bytes = vec![0u8; s.len as usize];
                    m.copy_out(r.offset + s.offset_in_read, &mut bytes)
                        .map_err(|e| ubdirect_ub::DeviceError::Mapped(Box::new(e)))?;
                    check_crc(&inner, crcs, s.id, s.len, &bytes)?;
                }
                inner
                    .stats
                    .crc_checked
                    .fetch_add(holds[received].len() as u64, Ordering::Relaxed);
            }
            match &packed {
                Some(pk) if asm.is_some() => {
                    // Into the assembly block (a copy out of the page cache per piece).
                    if let Some(a) = asm.as_mut() {
                        let buf = a.as_mut_slice()?;
                        for &(off, len, to) in &pk.copies[received] {
                            m.copy_out(r.offset + off, &mut buf[to..to + len])
                                .map_err(|e| ubdirect_ub::DeviceError::Mapped(Box::new(e)))?;
                        }
                    }
                }
                Some(pk) => {
                    for &(off, len, to) in &pk.copies[received] {
                        copies.push(inner.device.copy_mapped_to_device(
                            m,
                            r.offset + off,
                            len,
                            d,
                            to,
                        )?);
                    }
                }
                None => {
                    // Reads were split at `loader.max_read` for staging blocks; a mapping needs no
                    // block, so contiguous reads of the shard go as one larger copy (closer to the
                    // DMA ceiling). Their CRCs were checked one by one above.
                    let mut len = r.len as usize;
                    let mut last = received;
                    while let Some(next) = chunk.reads.get(last + 1) {
                        let prev = &chunk.reads[last];
                        let joins = next.shard == r.shard
                            && next.offset == prev.offset + prev.len
                            && dst[last + 1] == dst[last] + prev.len as usize
                            && inner.crcs.is_none();
                        if !joins {
                            break;
                        }
                        len += next.len as usize;
                        last += 1;
                        base[last] = dst[last];
                        count(&inner, next.len, ReadPath::Mapped, next.len);
                    }
                    copies.push(inner.device.copy_mapped_to_device(
                        m,
                        r.offset,
                        len,
                        d,
                        dst[received],
                    )?);
                    base[received] = dst[received];
                    count(&inner, r.len, ReadPath::Mapped, r.len);
                    received = last + 1;
                    continue;
                }
            }
            base[received] = dst[received];
            // Packed pieces copied out of the mapping: only their bytes moved (a widened or merged
            // read costs nothing here), so that is what the read counts.
            let moved = match &packed {
                Some(pk) => pk.copies[received].iter().map(|c| c.1 as u64).sum(),
                None => r.len,
            };
            count(&inner, moved, ReadPath::Mapped, moved);
            received += 1;
        }
        if received >= n && reads.is_empty() {
            break;
        }
        tokio::select! {
            l = leases.recv(), if received < n => {
                let Some(lease) = l else {
                    return Err(match (&mut acquire_err).await {
                        Ok(e) => e.into(),
                        Err(_) => LoadError::Closed(format!("chunk {ci}: staging blocks stopped coming")),
                    });
                };
                let r = &chunk.reads[received];
                let (ri, off, len, shard) = (received, r.offset, r.len as usize, r.shard as usize);
                let (src, deadline) = (inner.sources.get(shard).cloned(), inner.read_deadline);
                reads.spawn(async move {
                    match src {
                        Some(src) => {
                            let (res, lease) = src.read(off, len, lease, 0, deadline).await;
                            (ri, res.map_err(LoadError::from), lease)
                        }
                        None => (ri, Err(LoadError::Closed(format!("shard {shard} has no source"))), lease),
                    }
                });
                received += 1;
            }
            Some(j) = reads.join_next(), if !reads.is_empty() => {
                let (ri, res, lease) = j.map_err(|e| LoadError::Closed(format!("read task: {e}")))?;
                let done = res?;
                let mut lease = lease;
                let r = &chunk.reads[ri];
                count(&inner, r.len, done.path, done.bytes_read as u64);
                if let Some(crcs) = &inner.crcs {
                    let bytes = lease.as_slice()?;
                    for &(b, si) in &holds[ri] {
                        let s = &plan.batches[b].samples[si];
                        let at = done.data.start + s.offset_in_read as usize;
                        check_crc(&inner, crcs, s.id, s.len, &bytes[at..at + s.len as usize])?;
                    }
                    inner.stats.crc_checked.fetch_add(holds[ri].len() as u64, Ordering::Relaxed);
                }
                match dev.as_mut() {
                    Some(_) if packed.is_some() && asm.is_some() => {
                        // Pieces into the assembly block; the staging block goes back at once.
                        if let (Some(a), Some(pk)) = (asm.as_mut(), packed.as_ref()) {
                            let src = lease.as_slice()?;
                            let buf = a.as_mut_slice()?;
                            for &(off, len, to) in &pk.copies[ri] {
                                let at = done.data.start + off as usize;
                                buf[to..to + len].copy_from_slice(&src[at..at + len]);
                            }
                        }
                        drop(lease);
                    }
                    Some(d) if packed.is_some() => {
                        for &(off, len, to) in packed.as_ref().map_or(&[][..], |pk| &pk.copies[ri][..]) {
                            let at = done.data.start + off as usize;
                            copies.push(inner.device.copy_to_device(&mut lease, at..at + len, d, to)?);
                        }
                        drop(lease);
                    }
                    Some(d) => {
                        copies.push(inner.device.copy_to_device(&mut lease, done.data.clone(), d, dst[ri])?);
                        base[ri] = dst[ri];
                        // The staging block is orphaned until the copy's event fires, then recycled.
                        drop(lease);
                    }
                    None => {
                        base[ri] = done.data.start;
                        host[ri] = Some(Arc::new(lease));
                    }
                }
            }
        }
    }
    // An assembled chunk: one transfer of its whole packed block.
    if let (Some(mut a), Some(d), Some(_)) = (asm.take(), dev.as_mut(), packed.as_ref()) {
        let len = super::packed::block_bytes(&plan, chunk) as usize;
        copies.push(inner.device.copy_to_device(&mut a, 0..len, d, 0)?);
        // Orphaned until the copy's event fires, then recycled.
        drop(a);
    }
    for c in copies {
        c.wait(inner.acquire_timeout).await?;
    }
    let dev = dev.map(Arc::new);
    let host: Vec<Arc<Lease>> = if dev.is_none() {
        host.into_iter()
            .map(|l| l.ok_or_else(|| LoadError::Closed("missing read".into())))
            .collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    // Each batch's share of the chunk's reads; the last takes the division's remainder, so a whole
    // chunk's batches carry exactly its bytes (the summary's read-ahead figure).
    let share = chunk.read_bytes() / chunk.batches.max(1) as u64;
    let last_batch = chunk.first_batch as usize + chunk.batches.max(1) as usize - 1;
    // One sample table for the chunk's batches (each batch a range of it): no allocation per batch.
    let mut table: Vec<SampleEntry> =
        Vec::with_capacity(batches.iter().map(|&b| plan.batches[b].samples.len()).sum());
    let mut ranges = Vec::with_capacity(batches.len());
    for &b in &batches {
        let from = table.len();
        match &packed {
            Some(pk) => {
                let at = &pk.sample_at[b - chunk.first_batch as usize];
                table.extend(plan.batches[b].samples.iter().enumerate().map(|(si, s)| {
                    let r = &chunk.reads[s.read as usize];
                    SampleEntry {
                        id: s.id,
                        position: s.position,
                        shard: r.shard,
                        shard_offset: r.offset + s.offset_in_read,
                        len: s.len,
                        segment: 0,
                        offset: at[si],
                    }
                }));
            }
            None => table.extend(plan.batches[b].samples.iter().map(|s| {
                let r = &chunk.reads[s.read as usize];
                SampleEntry {
                    id: s.id,
                    position: s.position,
                    shard: r.shard,
                    shard_offset: r.offset + s.offset_in_read,
                    len: s.len,
                    segment: if dev.is_some() { 0 } else { s.read },
                    offset: base[s.read as usize] + s.offset_in_read as usize,
                }
            })),
        }
        ranges.push(from..table.len());
    }
    let table: Arc<[SampleEntry]> = table.into();
    let mut out = Vec::with_capacity(batches.len());
    for (&b, range) in batches.iter().zip(ranges) {
        let chunk_read = if b == last_batch {
            chunk.read_bytes() - share * (chunk.batches.max(1) as u64 - 1)
        } else {
            share
        };
        let samples = super::batch::SampleTable::new(table.clone(), range);
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
        let parts = (packed.is_some() && plan.packed_parts).then(|| {
            let bp = &plan.batches[b];
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
        });
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
        });
    }
    Ok(out)
}

/// The mapping shard `shard` is copied from this epoch, if any.
fn mapping(mapped: &Mapped, shard: u32) -> Option<&Arc<ubdirect_ub::MappedFile>> {
    mapped.get(shard as usize).and_then(|m| m.as_ref())
}

/// Counts one read of `len` planned bytes that moved `moved` bytes along `path`.
fn count(inner: &Inner, len: u64, path: ReadPath, moved: u64) {
    let s = &inner.stats;
    s.path_bytes[path.index()].fetch_add(moved, Ordering::Relaxed);
    s.reads.fetch_add(1, Ordering::Relaxed);
    s.read_bytes.fetch_add(len, Ordering::Relaxed);
    s.read_hist[hist_bucket(len)].fetch_add(1, Ordering::Relaxed);
}

/// Checks one delivered sample against its CRC sidecar entry.
fn check_crc(
    inner: &Inner,
    crcs: &[u32],
    id: u64,
    len: u32,
    bytes: &[u8],
) -> Result<(), LoadError> {
    let got = crc32fast::hash(bytes);
    let want = crcs[id as usize];
    if got == want {
        return Ok(());
    }
    let loc = inner.index.samples.loc(id as usize);
    Err(LoadError::Crc {
        shard: inner.index.shards[loc.shard as usize].path.clone(),
        sample: id,
        offset: loc.offset,
        len,
        got,
        expected: want,
    })
}
