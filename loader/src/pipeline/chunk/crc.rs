//! The CRC check of delivered samples against their sidecar (`dataset.verify_crc`), in one place for
//! every kind of landing.

use std::sync::atomic::Ordering;

use super::super::{Inner, LoadError};
use super::land::Landed;
use crate::planner::{ChunkPlan, EpochPlan};

/// The samples of a chunk's batches by the read that holds them (nothing per sample otherwise).
pub(super) struct CrcCheck<'a> {
    crcs: &'a [u32],
    /// Per read of the chunk: `(batch, sample in the batch)`.
    holds: Vec<Vec<(usize, usize)>>,
}

impl<'a> CrcCheck<'a> {
    /// The check for the batches `batches` of a chunk of `reads` reads, when `inner` has sidecars.
    pub fn new(
        inner: &'a Inner,
        plan: &EpochPlan,
        batches: std::ops::Range<usize>,
        reads: usize,
    ) -> Option<Self> {
        let crcs = inner.crcs.as_deref()?;
        let mut holds = vec![Vec::new(); reads];
        for b in batches {
            for (si, s) in plan.batches[b].samples.iter().enumerate() {
                holds[s.read as usize].push((b, si));
            }
        }
        Some(Self { crcs, holds })
    }

    /// Checks every sample of the reads `landed` holds.
    pub fn check(
        &self,
        inner: &Inner,
        plan: &EpochPlan,
        chunk: &ChunkPlan,
        landed: &Landed<'_>,
    ) -> Result<(), LoadError> {
        let mut copied = Vec::new();
        for ri in landed.reads() {
            for &(b, si) in &self.holds[ri] {
                let s = &plan.batches[b].samples[si];
                let bytes = match landed {
                    Landed::Lease { lease, done, .. } => {
                        let at = done.data.start + s.offset_in_read as usize;
                        &lease.as_slice()?[at..at + s.len as usize]
                    }
                    Landed::Bytes { bytes, .. } => {
                        let at = s.offset_in_read as usize;
                        &bytes[at..at + s.len as usize]
                    }
                    Landed::Mapped { .. } => {
                        copied.resize(s.len as usize, 0);
                        landed.copy_out(&chunk.reads[ri], s.offset_in_read, &mut copied)?;
                        &copied[..]
                    }
                };
                self.sample(inner, s.id, s.len, bytes)?;
            }
            inner
                .stats
                .crc_checked
                .fetch_add(self.holds[ri].len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Checks one delivered sample against its sidecar entry.
    fn sample(&self, inner: &Inner, id: u64, len: u32, bytes: &[u8]) -> Result<(), LoadError> {
        let got = crc32fast::hash(bytes);
        let want = self.crcs[id as usize];
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
}
