//! Reads that land: each planned read of a chunk ends up either in a staging lease (read through the
//! shard's [`Source`](ubdirect_ub::Source)) or in place, in a mapped page-cache range the device
//! copies from (no staging block, no read issued). The stages after this one — the CRC check and the
//! assembly strategies — take a [`Landed`] and do not care which.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use ubdirect_nvme::Engine;
use ubdirect_ub::{DeviceError, Lease, ReadDone, Source};

use super::super::LoadError;
use super::super::pagecache::Mapped;
use super::super::shardmap::ShardMap;
use crate::planner::{ChunkPlan, ReadPlan};

/// One or more planned reads of a chunk, landed.
pub(super) enum Landed<'m> {
    /// Read through the shard's source into a staging lease: the read's bytes are `data` of it.
    Lease {
        /// The read (index in the chunk).
        read: usize,
        /// The staging block.
        lease: Lease,
        /// How the source moved the bytes, and where they are in the lease.
        done: ReadDone,
    },
    /// At hand in memory ([`Source::read_at_hand`]: an object cache's kept window): the read's bytes
    /// are `bytes`, copied by the CPU into the chunk's host-visible block.
    Bytes {
        /// The read (index in the chunk).
        read: usize,
        /// Its bytes.
        bytes: Arc<[u8]>,
    },
    /// In place in a mapped page-cache range: the reads `reads` (contiguous in the shard and in the
    /// chunk's block when more than one) start at the first one's offset in `map`.
    Mapped {
        /// The reads (indices in the chunk).
        reads: Range<usize>,
        /// The shard's mapping.
        map: &'m Arc<ShardMap>,
        /// Offset of the first read in the shard.
        offset: u64,
        /// Bytes of all of them.
        len: usize,
    },
}

impl Landed<'_> {
    /// The reads it holds (indices in the chunk).
    pub fn reads(&self) -> Range<usize> {
        match self {
            Landed::Lease { read, .. } | Landed::Bytes { read, .. } => *read..*read + 1,
            Landed::Mapped { reads, .. } => reads.clone(),
        }
    }

    /// Copies the bytes at `off` of read `r` (one it holds) into `out`.
    pub fn copy_out(&self, r: &ReadPlan, off: u64, out: &mut [u8]) -> Result<(), LoadError> {
        match self {
            Landed::Lease { lease, done, .. } => {
                let at = done.data.start + off as usize;
                out.copy_from_slice(&lease.as_slice()?[at..at + out.len()]);
                Ok(())
            }
            Landed::Bytes { bytes, .. } => {
                let at = off as usize;
                out.copy_from_slice(&bytes[at..at + out.len()]);
                Ok(())
            }
            Landed::Mapped { map, .. } => map
                .copy_out(r.offset + off, out)
                .map_err(|e| DeviceError::Mapped(Box::new(e)).into()),
        }
    }
}

/// The mapping read `r` lands in, if it lands in place: a mapped shard, copied by the device into the
/// chunk's batch block (`device`). The producer asks the same question to count staging blocks.
pub(super) fn in_place<'m>(
    mapped: &'m Mapped,
    device: bool,
    r: &ReadPlan,
) -> Option<&'m Arc<ShardMap>> {
    if !device {
        return None;
    }
    mapping(mapped, r.shard as usize).filter(|m| !m.is_staged())
}

/// Shard `shard`'s mapping for this chunk, in place or staged.
fn mapping(mapped: &Mapped, shard: usize) -> Option<&Arc<ShardMap>> {
    mapped.get(shard).and_then(|m| m.as_ref())
}

/// Read `ri` landed in place in `map`, joined with the reads after it that `joins(prev, next)`
/// accepts (contiguous reads of one shard: one larger device copy, closer to the DMA ceiling).
pub(super) fn mapped<'m>(
    chunk: &ChunkPlan,
    ri: usize,
    map: &'m Arc<ShardMap>,
    joins: impl Fn(usize, usize) -> bool,
) -> Landed<'m> {
    let r = &chunk.reads[ri];
    let mut len = r.len as usize;
    let mut last = ri;
    while let Some(next) = chunk.reads.get(last + 1) {
        let prev = &chunk.reads[last];
        if !(next.shard == r.shard
            && next.offset == prev.offset + prev.len
            && joins(last, last + 1))
        {
            break;
        }
        len += next.len as usize;
        last += 1;
    }
    Landed::Mapped {
        reads: ri..last + 1,
        map,
        offset: r.offset,
        len,
    }
}

/// Reads in flight through their shards' sources: (read, result, the lease back).
pub(super) type InFlight = JoinSet<(usize, Result<ReadDone, LoadError>, Lease)>;

/// Issues read `ri` of the chunk into `lease`: through its shard's source, or out of the shard's
/// staged mapping ([`ShardMap::staged`]) by `pread`s on the engine's copy threads, one per chunk
/// file the read spans.
#[allow(clippy::too_many_arguments)] // one read's whole context, passed once
pub(super) fn issue(
    reads: &mut InFlight,
    engine: &Engine,
    sources: &[Arc<dyn Source>],
    mapped: &Mapped,
    deadline: Duration,
    r: &ReadPlan,
    ri: usize,
    lease: Lease,
) {
    let (off, len, shard) = (r.offset, r.len as usize, r.shard as usize);
    let src = sources.get(shard).cloned();
    if let Some(staged) = mapping(mapped, shard).filter(|m| m.reads_staged()) {
        let (m, engine, staged) = (staged.file().clone(), engine.clone(), staged.clone());
        reads.spawn(async move {
            let started = std::time::Instant::now();
            let (res, lease) = engine.copy_mapped(&m, off, len, lease, 0, deadline).await;
            match (res, src) {
                (Ok(d), _) => {
                    let d = ReadDone {
                        data: d.data,
                        bytes_read: d.bytes_read,
                        path: ubdirect_ub::ReadPath::Buffered,
                    };
                    (ri, Ok(d), lease)
                }
                // A staged mapping is an object cache's chunk files: one cut short or unreadable
                // since it was checked (another process of the node, a damaged disk) costs this
                // read a trip through the object's source (its cache, which fetches the chunk
                // again, or the store), not the epoch. Only those: after a timeout or a failed
                // submission a copy may still write the lease, and an engine that cannot copy or
                // a lease that cannot take the bytes end the read as before.
                (Err(e), Some(src)) if e.means_damaged_file() => {
                    staged.read_failed();
                    ubdirect_ub::fallback::record(
                        "object_cache_staged_read_failed",
                        format!("{e}: read through the object's source instead"),
                    );
                    let left = deadline.saturating_sub(started.elapsed());
                    let (res, lease) = src.read(off, len, lease, 0, left).await;
                    (ri, res.map_err(LoadError::from), lease)
                }
                (Err(e), _) => (ri, Err(LoadError::from(e)), lease),
            }
        });
        return;
    }
    reads.spawn(async move {
        match src {
            Some(src) => {
                let (res, lease) = src.read(off, len, lease, 0, deadline).await;
                (ri, res.map_err(LoadError::from), lease)
            }
            None => (
                ri,
                Err(LoadError::Closed(format!("shard {shard} has no source"))),
                lease,
            ),
        }
    });
}
