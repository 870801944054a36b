//! Reading one chunk of batches, as stages: the producer acquires blocks in chunk order; each read
//! lands ([`land`]: in a staging lease through the shard's [`Source`](ubdirect_ub::Source), or in
//! place in a mapped page-cache range); its samples are checked against their CRCs ([`crc`]); an
//! assembly strategy puts its bytes in the chunk's memory ([`assemble`]: contiguous, packed, host);
//! then the chunk's batches are made over that memory ([`batches`]).

mod assemble;
mod batches;
mod crc;
mod issue;
mod land;
mod lists;
pub(super) mod packed;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use ubdirect_ub::{Lease, ReadDone, UbError};

use super::pagecache::Mapped;
use super::{Batch, Inner, LoadError};
use crate::planner::{ChunkPlan, EpochPlan, PlanError};
use assemble::Assembly;
use crc::CrcCheck;
use land::Landed;
pub(super) use lists::Spare;

pub(super) type ChunkHandle = JoinHandle<Result<Vec<Batch>, LoadError>>;

/// A read's bytes its source had at hand ([`ubdirect_ub::Source::read_at_hand`]), and their path.
type AtHand = (Arc<[u8]>, ubdirect_ub::ReadPath);

/// A read of a chunk (its index) whose bytes were at hand.
type ReadAtHand = (usize, AtHand);

/// A staging block given to one of a chunk's reads, and the read's count on its device (balanced
/// issue only) until it lands.
pub(super) struct Given {
    read: usize,
    lease: Lease,
    busy: Option<issue::Busy>,
}

/// An open chunk's task, as the producer sees it: where its reads' blocks go, and where a failed
/// block acquire is reported.
struct Sink {
    ci: usize,
    leases: mpsc::Sender<Given>,
    failed: Option<tokio::sync::oneshot::Sender<UbError>>,
}

/// Spawns one task per chunk, in chunk order (the bounded channel is the prefetch depth), and
/// gives staging blocks to their reads. In plan order, one chunk after another; with
/// [`ReadDevices`](super::ReadDevices), the chunks ahead also open while a batch block and the
/// channel allow it without waiting, until their reads waiting for blocks fill the staging depth,
/// and each block goes to a read of the least busy device ([`issue::Window`]). A chunk that must
/// wait (for a batch block, for the consumer) waits only when nothing else is waiting, so blocks
/// are taken in chunk order as before. `issued` counts the bytes of the chunks whose reads have
/// all been handed their blocks, in chunk order (the prefetch advice runs ahead of it).
pub(super) async fn produce(
    inner: Arc<Inner>,
    plan: Arc<EpochPlan>,
    start: u64,
    tx: mpsc::Sender<ChunkHandle>,
    mapped: Mapped,
    issued: &tokio::sync::watch::Sender<u64>,
    starved: Arc<super::Starved>,
) {
    let Some(first_chunk) = plan.batches.get(start as usize).map(|b| b.chunk as usize) else {
        return;
    };
    let devices = inner.read_devices.clone();
    let count = devices.as_ref().map_or(1, |d| d.count);
    // `issued` counts chunks in order, so it lags reads given blocks ahead: fine for the advisor,
    // whose sources (the object cache) balance no devices, conservative for the rest. Reads
    // waiting for blocks while balancing: as many as the pool has blocks, as in the rig's runs
    // (docs/benchmarks.md, 2026-12-03, "reads balanced over devices"; 12 was not better).
    let ahead = if devices.is_some() {
        inner.staging.block_count()
    } else {
        0
    };
    let load = issue::DeviceLoad::new(count);
    let mut window: issue::Window<Sink> = issue::Window::new(count);
    let mut next = first_chunk;
    // Kept from chunk to chunk: the reads of the chunk being opened, each device's reads in flight.
    let (mut reads, mut busy_now) = (Vec::new(), Vec::new());
    let (inner_, plan_, tx_, mapped_, starved_) = (&inner, &plan, &tx, &mapped, &starved);
    let open = |ci: usize, wait: bool, mut reads: Vec<(usize, usize)>| {
        let devices = devices.as_ref();
        async move {
            let sink = open_chunk(
                inner_, plan_, ci, start, tx_, mapped_, starved_, devices, wait, &mut reads,
            )
            .await;
            (reads, sink)
        }
    };
    loop {
        while let Some(s) = window.retire() {
            issued.send_modify(|b| *b += plan.chunks[s.ci].read_bytes());
        }
        if window.pending() == 0 {
            // Nothing waits for a block: the next chunk, waiting for what it needs.
            if next >= plan.chunks.len() {
                return;
            }
            let sink;
            (reads, sink) = open(next, true, std::mem::take(&mut reads)).await;
            let Some(sink) = sink else { return };
            window.push(reads.drain(..), sink);
            next += 1;
            continue;
        }
        while window.pending() < ahead && next < plan.chunks.len() {
            let sink;
            (reads, sink) = open(next, false, std::mem::take(&mut reads)).await;
            let Some(sink) = sink else { break };
            window.push(reads.drain(..), sink);
            next += 1;
        }
        let lease = match starved
            .acquire(
                &inner.staging,
                super::StarvedOn::Staging,
                inner.acquire_timeout,
            )
            .await
        {
            Ok(l) => l,
            Err(e) => {
                // To the earliest chunk still waiting (the ones before it have all their blocks):
                // the consumer meets it first. If that chunk has failed already, its own error
                // comes first and this one is moot.
                if let Some(f) = window.first_waiting().and_then(|s| s.failed.take()) {
                    let _ = f.send(e);
                }
                return;
            }
        };
        load.snapshot(&mut busy_now);
        let Some((sink, read, device, ahead_of_plan)) = window.pick(&busy_now) else {
            continue;
        };
        let (ci, to) = (sink.ci, sink.leases.clone());
        let busy = devices.is_some().then(|| load.busy(device));
        if to.send(Given { read, lease, busy }).await.is_err() {
            // The chunk failed; its error reaches the consumer. Its other reads need no block.
            window.abandon(|s| s.ci == ci);
        } else if ahead_of_plan {
            inner.stats.reads_ahead.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Opens chunk `ci`: its batch (and pack) block, its task, sent to the iterator. `wait`: as long
/// as these take (`None` when the iterator is gone or a block cannot come, the error sent as the
/// chunk); otherwise only if they are there now (`None`: not now). Returns the chunk's sink; its
/// reads that need a staging block, with their devices, are in `reads` (the producer's list, kept
/// from one chunk to the next).
#[allow(clippy::too_many_arguments)] // the producer's context, passed once
async fn open_chunk(
    inner: &Arc<Inner>,
    plan: &Arc<EpochPlan>,
    ci: usize,
    start: u64,
    tx: &mpsc::Sender<ChunkHandle>,
    mapped: &Mapped,
    starved: &super::Starved,
    devices: Option<&super::ReadDevices>,
    wait: bool,
    reads: &mut Vec<(usize, usize)>,
) -> Option<Sink> {
    let chunk = &plan.chunks[ci];
    // Not waiting: a place in the channel first, so that nothing taken below waits on the consumer.
    let permit = if wait {
        None
    } else {
        Some(tx.try_reserve().ok()?)
    };
    // Shards registered in the background since the epoch started are copied from their mappings
    // from this chunk on (the chunk keeps the view it started with).
    let mapped = match &inner.page_cache {
        Some(pc) => pc.current(),
        None => mapped.clone(),
    };
    // The chunk's batches from `start` on (a resumed epoch's first chunk may start within it).
    let all = chunk.batch_range();
    let batches = all.start.max(start.min(all.end as u64) as usize)..all.end;
    let dev = match &inner.batch_pool {
        Some(bp) if !wait => Some(bp.try_acquire()?),
        Some(bp) => match starved
            .acquire(bp, super::StarvedOn::Batch, inner.acquire_timeout)
            .await
        {
            Ok(l) => Some(l),
            Err(e) => {
                let _ = tx.send(tokio::spawn(async move { Err(e.into()) })).await;
                return None;
            }
        },
        None => None,
    };
    // Packed GPU batches: the chunk is assembled in a pinned block first.
    let asm = match (&inner.pack_pool, &dev) {
        (Some(pp), Some(_)) if !wait => Some(pp.try_acquire()?),
        (Some(pp), Some(_)) => match pp.acquire(inner.acquire_timeout).await {
            Ok(l) => Some(l),
            Err(e) => {
                let _ = tx.send(tokio::spawn(async move { Err(e.into()) })).await;
                return None;
            }
        },
        _ => None,
    };
    let by_cpu = assemble::lands_by_cpu(plan, dev.as_ref(), asm.as_ref());
    let at_hand = needing_blocks(inner, chunk, &mapped, dev.is_some(), by_cpu, devices, reads);
    let (ltx, lrx) = mpsc::channel(reads.len().max(1));
    let (etx, erx) = tokio::sync::oneshot::channel();
    let h = tokio::spawn(build_chunk(
        inner.clone(),
        plan.clone(),
        ci,
        batches,
        lrx,
        reads.len(),
        dev,
        asm,
        erx,
        mapped,
        at_hand,
    ));
    match permit {
        Some(p) => p.send(h),
        None => tx.send(h).await.ok()?, // the iterator is gone
    }
    let sink = Sink {
        ci,
        leases: ltx,
        failed: Some(etx),
    };
    Some(sink)
}

/// The reads of `chunk` that need a staging block, each with its device, into `reads`; and those
/// whose bytes their sources had at hand, taken. Reads copied by the device straight out of a mapped shard
/// need no staging block, nor do reads whose bytes their source holds in memory where the CPU
/// assembles the chunk (`by_cpu`).
fn needing_blocks(
    inner: &Inner,
    chunk: &ChunkPlan,
    mapped: &Mapped,
    device: bool,
    by_cpu: bool,
    devices: Option<&super::ReadDevices>,
    reads: &mut Vec<(usize, usize)>,
) -> Vec<ReadAtHand> {
    let mut at_hand = Vec::new();
    reads.clear();
    for (ri, r) in chunk.reads.iter().enumerate() {
        if land::in_place(mapped, device, r).is_some() {
            continue;
        }
        let got = by_cpu
            .then(|| inner.sources.get(r.shard as usize))
            .flatten()
            .and_then(|s| s.read_at_hand(r.offset, r.len as usize));
        if let Some(got) = got {
            at_hand.push((ri, got));
            continue;
        }
        let d = devices
            .and_then(|d| d.shard.get(r.shard as usize))
            .map_or(0, |&d| d as usize);
        reads.push((ri, d));
    }
    at_hand
}

#[allow(clippy::too_many_arguments)] // one task's whole context, passed once
async fn build_chunk(
    inner: Arc<Inner>,
    plan: Arc<EpochPlan>,
    ci: usize,
    batches: std::ops::Range<usize>,
    mut leases: mpsc::Receiver<Given>,
    leased: usize,
    dev: Option<Lease>,
    asm: Option<Lease>,
    mut acquire_err: tokio::sync::oneshot::Receiver<UbError>,
    mapped: Mapped,
    at_hand: Vec<ReadAtHand>,
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
    check_chunk(&plan, ci, batches.clone())?;
    let n = chunk.reads.len();
    let mut lists = inner.spare.take();
    let mut busy = std::mem::take(&mut lists.busy);
    busy.resize_with(n, || None);
    let mut build = Build {
        inner: &inner,
        plan: &plan,
        chunk,
        ci,
        mapped: &mapped,
        crc: CrcCheck::new(&inner, &plan, batches.clone(), n),
        assembly: Assembly::new(&plan, chunk, dev, asm, inner.tensors.as_ref(), lists),
        reads: land::InFlight::new(),
        busy,
    };
    for (ri, got) in at_hand {
        build.land_at_hand(ri, got)?;
    }
    let mut given = build.land_mapped(&mut leases)?;
    // The others, as the producer gives them staging blocks (in plan order, or by device).
    while given < leased || !build.reads.is_empty() {
        tokio::select! {
            g = leases.recv(), if given < leased => {
                let Some(g) = g else {
                    return Err(match (&mut acquire_err).await {
                        Ok(e) => e.into(),
                        Err(_) => LoadError::Closed(format!("chunk {ci}: staging blocks stopped coming")),
                    });
                };
                build.issue_given(g)?;
                given += 1;
            }
            Some(j) = build.reads.join_next(), if !build.reads.is_empty() => {
                let (ri, res, lease) = j.map_err(|e| LoadError::Closed(format!("read task: {e}")))?;
                build.landed(ri, res, lease)?;
            }
        }
    }
    let Build {
        assembly, mut busy, ..
    } = build;
    let mut mem = assembly.finish(&inner).await?;
    busy.clear();
    mem.lists.busy = busy;
    batches::build(&inner, &plan, chunk, batches, mem)
}

/// A chunk being built ([`build_chunk`]): its plan, its reads in flight, and their assembly.
struct Build<'a> {
    inner: &'a Inner,
    plan: &'a EpochPlan,
    chunk: &'a ChunkPlan,
    ci: usize,
    mapped: &'a Mapped,
    crc: Option<CrcCheck<'a>>,
    assembly: Assembly<'a>,
    reads: land::InFlight,
    /// Per read: its count on its device (balanced issue) until it lands.
    busy: Vec<Option<issue::Busy>>,
}

impl Build<'_> {
    /// A staging block given to one of the other reads: the read is issued.
    fn issue_given(&mut self, g: Given) -> Result<(), LoadError> {
        let (inner, chunk) = (self.inner, self.chunk);
        let Some(r) = chunk.reads.get(g.read) else {
            return Err(LoadError::Closed(format!(
                "chunk {}: a block for read {} of {}",
                self.ci,
                g.read,
                chunk.reads.len()
            )));
        };
        land::issue(
            &mut self.reads,
            &inner.engine,
            &inner.sources,
            self.mapped,
            inner.read_deadline,
            r,
            g.read,
            g.lease,
        );
        self.busy[g.read] = g.busy;
        Ok(())
    }

    /// Lands the reads of mapped shards, and issues the reads given blocks meanwhile; returns how
    /// many were given.
    fn land_mapped(&mut self, leases: &mut mpsc::Receiver<Given>) -> Result<usize, LoadError> {
        let (inner, chunk) = (self.inner, self.chunk);
        let mut given = 0;
        // Reads of mapped shards: they land in place (one device copy each, or one for several
        // contiguous ones), with no staging block. Blocks given meanwhile to the others are put to
        // work between them, so their reads do not wait for the copies.
        let mut ri = 0;
        while ri < chunk.reads.len() {
            while let Ok(g) = leases.try_recv() {
                self.issue_given(g)?;
                given += 1;
            }
            let Some(m) = land::in_place(self.mapped, self.assembly.has_device(), &chunk.reads[ri])
            else {
                ri += 1;
                continue;
            };
            let landed = land::mapped(chunk, ri, m, |prev, next| {
                self.assembly.joins(prev, next, self.crc.is_some())
            });
            ri = landed.reads().end;
            if let Some(c) = &self.crc {
                c.check(inner, self.plan, chunk, &landed)?;
            }
            self.assembly.place(inner, landed)?;
        }
        Ok(given)
    }

    /// Read `ri`, whose source had its bytes at hand: counted, checked and placed.
    fn land_at_hand(&mut self, ri: usize, (bytes, path): AtHand) -> Result<(), LoadError> {
        let (inner, chunk) = (self.inner, self.chunk);
        let Some(r) = chunk
            .reads
            .get(ri)
            .filter(|r| r.len as usize == bytes.len())
        else {
            return Err(LoadError::Closed(format!(
                "chunk {}: read {ri} at hand is not the planned read",
                self.ci
            )));
        };
        assemble::count(inner, r.len, path, r.len);
        let landed = Landed::Bytes { read: ri, bytes };
        if let Some(c) = &self.crc {
            c.check(inner, self.plan, chunk, &landed)?;
        }
        self.assembly.place(inner, landed)
    }

    /// Read `ri` has landed in `lease` (or failed): counted, checked and placed.
    fn landed(
        &mut self,
        ri: usize,
        res: Result<ReadDone, LoadError>,
        lease: Lease,
    ) -> Result<(), LoadError> {
        let (inner, chunk) = (self.inner, self.chunk);
        // The read has landed: its device is free for the next.
        if let Some(b) = self.busy.get_mut(ri) {
            b.take();
        }
        let done = res?;
        let r = &chunk.reads[ri];
        assemble::count(inner, r.len, done.path, done.bytes_read as u64);
        let landed = Landed::Lease {
            read: ri,
            lease,
            done,
        };
        if let Some(c) = &self.crc {
            c.check(inner, self.plan, chunk, &landed)?;
        }
        self.assembly.place(inner, landed)
    }
}

/// Checks that every sample and piece of the chunk's batches names one of the chunk's reads and
/// that every piece range exists, so that the rest of the chunk indexes only what is there: a plan
/// made from inconsistent indices is a typed error, not an index out of bounds.
fn check_chunk(
    plan: &EpochPlan,
    ci: usize,
    batches: std::ops::Range<usize>,
) -> Result<(), PlanError> {
    let chunk = &plan.chunks[ci];
    let reads = chunk.reads.len();
    let bad = |what, read: u64| PlanError::Inconsistent {
        chunk: ci,
        what,
        read,
        reads,
    };
    for b in chunk.batch_range().chain(batches) {
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
