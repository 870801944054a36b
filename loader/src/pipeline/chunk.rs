//! Reading one chunk of batches: staging leases acquired in chunk order, one read per planned block
//! through the shard's [`Source`](ubdirect_ub::Source), CRC checks, copies into the chunk's device
//! block, batches.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use ubdirect_ub::{CopyCompletion, Lease, ReadDone, UbError};

use super::batch::BatchMemory;
use super::{Batch, Inner, LoadError, SampleEntry, hist_bucket};
use crate::planner::EpochPlan;

pub(super) type ChunkHandle = JoinHandle<Result<Vec<Batch>, LoadError>>;

/// Acquires blocks in chunk order (so chunks never wait on each other's blocks) and spawns one task
/// per chunk; the bounded channel is the prefetch depth.
pub(super) async fn produce(
    inner: Arc<Inner>,
    plan: Arc<EpochPlan>,
    start: u64,
    tx: mpsc::Sender<ChunkHandle>,
) {
    let Some(first_chunk) = plan.batches.get(start as usize).map(|b| b.chunk as usize) else {
        return;
    };
    for ci in first_chunk..plan.chunks.len() {
        let chunk = &plan.chunks[ci];
        let batches: Vec<usize> = chunk.batch_range().filter(|&b| b as u64 >= start).collect();
        let dev = match &inner.batch_pool {
            Some(bp) => match bp.acquire(inner.acquire_timeout).await {
                Ok(l) => Some(l),
                Err(e) => {
                    let _ = tx.send(tokio::spawn(async move { Err(e.into()) })).await;
                    return;
                }
            },
            None => None,
        };
        let nreads = chunk.reads.len();
        let (ltx, lrx) = mpsc::channel(nreads.max(1));
        let (etx, erx) = tokio::sync::oneshot::channel();
        let h = tokio::spawn(build_chunk(
            inner.clone(),
            plan.clone(),
            ci,
            batches,
            lrx,
            dev,
            erx,
        ));
        if tx.send(h).await.is_err() {
            return; // the iterator is gone
        }
        for _ in 0..nreads {
            match inner.staging.acquire(inner.acquire_timeout).await {
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
    }
}

async fn build_chunk(
    inner: Arc<Inner>,
    plan: Arc<EpochPlan>,
    ci: usize,
    batches: Vec<usize>,
    mut leases: mpsc::Receiver<Lease>,
    mut dev: Option<Lease>,
    acquire_err: tokio::sync::oneshot::Receiver<UbError>,
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
    // Which samples of the chunk each read holds (for CRC checks).
    let mut holds: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n];
    for &b in &batches {
        for (si, s) in plan.batches[b].samples.iter().enumerate() {
            holds[s.read as usize].push((b, si));
        }
    }
    let mut host: Vec<Option<Arc<Lease>>> = (0..n).map(|_| None).collect();
    let mut base = vec![0usize; n];
    let mut copies: Vec<CopyCompletion> = Vec::new();
    let mut reads: JoinSet<(usize, Result<ReadDone, LoadError>, Lease)> = JoinSet::new();
    let mut received = 0;
    let mut acquire_err = acquire_err;
    while received < n || !reads.is_empty() {
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
                inner.stats.path_bytes[done.path.index()].fetch_add(done.bytes_read as u64, Ordering::Relaxed);
                inner.stats.reads.fetch_add(1, Ordering::Relaxed);
                inner.stats.read_bytes.fetch_add(r.len, Ordering::Relaxed);
                inner.stats.read_hist[hist_bucket(r.len)].fetch_add(1, Ordering::Relaxed);
                if let Some(crcs) = &inner.crcs {
                    let bytes = lease.as_slice()?;
                    for &(b, si) in &holds[ri] {
                        let s = &plan.batches[b].samples[si];
                        let at = done.data.start + s.offset_in_read as usize;
                        let got = crc32fast::hash(&bytes[at..at + s.len as usize]);
                        let want = crcs[s.id as usize];
                        if got != want {
                            let loc = inner.index.samples[s.id as usize];
                            return Err(LoadError::Crc {
                                shard: inner.index.shards[loc.shard as usize].path.clone(),
                                sample: s.id,
                                offset: loc.offset,
                                len: s.len,
                                got,
                                expected: want,
                            });
                        }
                    }
                    inner.stats.crc_checked.fetch_add(holds[ri].len() as u64, Ordering::Relaxed);
                }
                match dev.as_mut() {
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
    let chunk_read = chunk.read_bytes() / chunk.batches.max(1) as u64;
    let mut out = Vec::with_capacity(batches.len());
    for &b in &batches {
        let samples = plan.batches[b]
            .samples
            .iter()
            .map(|s| {
                let loc = inner.index.samples[s.id as usize];
                SampleEntry {
                    id: s.id,
                    position: s.position,
                    shard: loc.shard,
                    shard_offset: loc.offset,
                    len: s.len,
                    segment: if dev.is_some() { 0 } else { s.read },
                    offset: base[s.read as usize] + s.offset_in_read as usize,
                }
            })
            .collect();
        let memory = match &dev {
            Some(d) => BatchMemory::Block(d.clone()),
            None => BatchMemory::Host(host.clone()),
        };
        out.push(Batch {
            epoch: plan.epoch,
            index: b as u64,
            rank: plan.rank,
            samples,
            memory,
            device: inner.device.clone(),
            read_bytes: chunk_read,
        });
    }
    Ok(out)
}
