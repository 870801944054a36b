//! A registered region: explicit reads and writes (pipelined requests on a link), fetches for
//! faults (one-sided when the link has a window). `Region::map` is in [`super::mapping`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::wire::{Request, exchange};
use super::{Desc, SmcClient, SmcError};
use crate::client::{Fail, LinkError};

/// A registered region.
#[derive(Clone)]
pub struct Region {
    pub(super) client: SmcClient,
    pub(super) desc: Arc<Desc>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("name", &self.desc.name)
            .field("size", &self.desc.size)
            .field("writable", &self.desc.writable)
            .finish()
    }
}

/// How stores on a mapping reach the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncMode {
    /// Stores stay local; [`Region::write`] (or `Mapping::write`) sends and waits for the ack.
    WriteThrough,
    /// Stores mark pages dirty; [`Mapping::barrier`] pushes the dirty pages.
    WriteBack,
}

/// Mapping options.
#[derive(Debug, Clone, Copy)]
pub struct MapOptions {
    /// SMC page size: a power of two, 4 KiB ..= 2 MiB.
    pub page_size: usize,
    /// SMC pages fetched after the faulting one (stopping at the first present page).
    pub readahead: usize,
    /// Sync mode.
    pub mode: SyncMode,
    /// After a fault, the fault thread polls for the next one this long before sleeping, and it
    /// polls the socket this long for a fault's reply: faults come in bursts (a loop over a buffer),
    /// and a sleeping thread costs a wake-up per fault and per reply (several µs each on a VM).
    /// Bounded: at most this much CPU after each burst (the default, 50 µs); zero: always sleep.
    pub spin: Duration,
    /// Write-back dirty tracking by the kernel (UFFD_FEATURE_WP_ASYNC + PAGEMAP_SCAN, Linux 6.7+):
    /// a first store to a clean page costs a minor fault in the kernel instead of a round trip
    /// through the fault thread. Without kernel support the fault thread does it (a recorded
    /// fallback).
    pub wp_async: bool,
}

impl Default for MapOptions {
    fn default() -> Self {
        Self {
            page_size: 4096,
            readahead: 0,
            mode: SyncMode::WriteBack,
            spin: Duration::from_micros(50),
            wp_async: true,
        }
    }
}

impl Region {
    /// Bytes.
    pub fn size(&self) -> u64 {
        self.desc.size
    }

    /// Whether this registration may write.
    pub fn writable(&self) -> bool {
        self.desc.writable
    }

    pub(super) fn check(&self, offset: u64, len: u64) -> Result<(), SmcError> {
        if offset.checked_add(len).is_none_or(|e| e > self.desc.size) {
            return Err(SmcError::Range {
                region: self.desc.name.clone(),
                offset,
                len,
                size: self.desc.size,
            });
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset` into `buf`, in requests of at most max_request sent back
    /// to back; waits for each reply spinning up to `spin` first.
    pub(super) fn read_spin(
        &self,
        offset: u64,
        buf: &mut [u8],
        spin: Duration,
    ) -> Result<(), SmcError> {
        self.check(offset, buf.len() as u64)?;
        let stats = &self.client.inner.stats;
        self.client.with_link(&self.desc, |link, rid, until| {
            let max = (link.max_request() as usize).max(4096);
            let mut reqs: Vec<Request<'_>> = Vec::with_capacity(buf.len().div_ceil(max));
            for (i, dst) in buf.chunks_mut(max).enumerate() {
                let id = link.next_id();
                reqs.push(Request::read(id, rid, offset + (i * max) as u64, dst));
            }
            stats
                .transactions
                .fetch_add(reqs.len() as u64, Ordering::Relaxed);
            exchange(link, &mut reqs, until, spin)
        })?;
        stats
            .bytes_fetched
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Fetches `len` bytes at `offset` into `lease[..len]`: one-sided (RDMA READ from the region's
    /// window) when the link has it, else a request whose reply lands in the lease.
    pub(super) fn fetch(
        &self,
        offset: u64,
        lease: &mut ubdirect_ub::Lease,
        len: usize,
        spin: Duration,
    ) -> Result<(), SmcError> {
        self.check(offset, len as u64)?;
        let stats = &self.client.inner.stats;
        let name = &self.desc.name;
        self.client.with_link(&self.desc, |link, rid, until| {
            stats.transactions.fetch_add(1, Ordering::Relaxed);
            if let Some((os, w)) = link.one_sided(name) {
                return os
                    .read(lease, 0, len, w.addr + offset, w.rkey, until)
                    .map_err(|source| {
                        Fail::Retry(LinkError::OneSided {
                            server: link.server(),
                            what: "read",
                            source,
                        })
                    });
            }
            let dst = lease.as_mut_slice().map_err(|e| {
                Fail::Retry(LinkError::OneSided {
                    server: link.server(),
                    what: "read",
                    source: Arc::new(e),
                })
            })?;
            let max = (link.max_request() as usize).max(4096);
            let mut reqs: Vec<Request<'_>> = Vec::with_capacity(len.div_ceil(max));
            for (i, d) in dst[..len].chunks_mut(max).enumerate() {
                let id = link.next_id();
                reqs.push(Request::read(id, rid, offset + (i * max) as u64, d));
            }
            stats
                .transactions
                .fetch_add(reqs.len() as u64 - 1, Ordering::Relaxed);
            exchange(link, &mut reqs, until, spin)
        })?;
        stats.bytes_fetched.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset` from the server.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), SmcError> {
        self.read_spin(offset, buf, Duration::ZERO)
    }

    /// Writes `data` at `offset`; returns after the server acknowledged (write-through).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), SmcError> {
        self.check(offset, data.len() as u64)?;
        if !self.desc.writable {
            return Err(SmcError::ReadOnly {
                region: self.desc.name.clone(),
            });
        }
        let stats = &self.client.inner.stats;
        self.client.with_link(&self.desc, |link, rid, until| {
            let max = (link.max_request() as usize).max(4096);
            let mut reqs: Vec<Request<'_>> = Vec::with_capacity(data.len().div_ceil(max));
            for (i, src) in data.chunks(max).enumerate() {
                let id = link.next_id();
                reqs.push(Request::write(id, rid, offset + (i * max) as u64, src));
            }
            stats
                .transactions
                .fetch_add(reqs.len() as u64, Ordering::Relaxed);
            exchange(link, &mut reqs, until, Duration::ZERO)
        })?;
        stats
            .bytes_pushed
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}
