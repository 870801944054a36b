//! Reading one chunk of batches, as stages: the producer acquires blocks in chunk order; each read
//! lands ([`land`]: in a staging lease through the shard's [`Source`](ubdirect_ub::Source), or in
//! place in a mapped page-cache range); its samples are checked against their CRCs ([`crc`]); an
//! assembly strategy puts its bytes in the chunk's memory ([`assemble`]: contiguous, packed, host);
//! then the chunk's batches are made over that memory ([`batches`]).

mod assemble;
mod batches;
mod crc;
mod land;
pub(super) mod packed;

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use ubdirect_ub::{Lease, UbError};

use super::pagecache::Mapped;
use super::{Batch, Inner, LoadError};
use crate::planner::{EpochPlan, PlanError};
use assemble::Assembly;
use crc::CrcCheck;
use land::Landed;

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
            .filter(|r| land::in_place(&mapped, dev.is_some(), r).is_none())
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
    dev: Option<Lease>,
    asm: Option<Lease>,
    mut acquire_err: tokio::sync::oneshot::Receiver<UbError>,
    mapped: Mapped,
) -> Result<Vec<Batch>, LoadError> {
    let Some(chunk) = plan.chunks.get(ci) else {
        return Err(PlanError::Inconsistent {
            chunk: ci,
            what: "the epoch",
            read: 0,
            reads: 0,
        }
        .into());
    };
    check_chunk(&plan, ci, &batches)?;
    let n = chunk.reads.len();
    let crc = CrcCheck::new(&inner, &plan, &batches, n);
    let mut assembly = Assembly::new(&plan, chunk, dev, asm, inner.tensors.as_ref());
    let mut reads = land::InFlight::new();
    let mut received = 0;
    while received < n || !reads.is_empty() {
        // Reads of mapped shards, in order: they land in place (one device copy each, or one for
        // several contiguous ones), with no staging block.
        while received < n {
            let r = &chunk.reads[received];
            let Some(m) = land::in_place(&mapped, assembly.has_device(), r) else {
                break;
            };
            let landed = land::mapped(chunk, received, m, |prev, next| {
                assembly.joins(prev, next, crc.is_some())
            });
            received = landed.reads().end;
            if let Some(c) = &crc {
                c.check(&inner, &plan, chunk, &landed)?;
            }
            assembly.place(&inner, landed)?;
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
                land::issue(&mut reads, &inner.engine, &inner.sources, &mapped, inner.read_deadline, r, received, lease);
                received += 1;
            }
            Some(j) = reads.join_next(), if !reads.is_empty() => {
                let (ri, res, lease) = j.map_err(|e| LoadError::Closed(format!("read task: {e}")))?;
                let done = res?;
                let r = &chunk.reads[ri];
                assemble::count(&inner, r.len, done.path, done.bytes_read as u64);
                let landed = Landed::Lease { read: ri, lease, done };
                if let Some(c) = &crc {
                    c.check(&inner, &plan, chunk, &landed)?;
                }
                assembly.place(&inner, landed)?;
            }
        }
    }
    let mem = assembly.finish(&inner).await?;
    batches::build(&inner, &plan, chunk, &batches, mem)
}

/// Checks that every sample and piece of the chunk's batches names one of the chunk's reads and
/// that every piece range exists, so that the rest of the chunk indexes only what is there: a plan
/// made from inconsistent indices is a typed error, not an index out of bounds.
fn check_chunk(plan: &EpochPlan, ci: usize, batches: &[usize]) -> Result<(), PlanError> {
    let chunk = &plan.chunks[ci];
    let reads = chunk.reads.len();
    let bad = |what, read: u64| PlanError::Inconsistent {
        chunk: ci,
        what,
        read,
        reads,
    };
    for b in chunk.batch_range().chain(batches.iter().copied()) {
        let Some(bp) = plan.batches.get(b) else {
            return Err(bad("a batch", b as u64));
        };
        for s in &bp.samples {
            if s.read as usize >= reads {
                return Err(bad("a sample", s.read as u64));
            }
            let from = s.first_piece as usize;
            let Some(pieces) = bp.pieces.get(from..from + s.pieces as usize) else {
                return Err(bad("a sample's pieces", s.read as u64));
            };
            if let Some(p) = pieces.iter().find(|p| p.read as usize >= reads) {
                return Err(bad("a piece", p.read as u64));
            }
        }
    }
    Ok(())
}
