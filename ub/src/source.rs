//! The one seam every read path goes through.
//!
//! A [`Source`] reads a byte range of one shard into a [`Lease`], owned-buffer style: the lease goes
//! in and always comes back, with the result, also on error and on timeout. Each read has a
//! deadline. Errors are typed ([`SourceError`], with a [`SourceErrorKind`] callers branch on) and
//! keep the backend's own error as their `source()`.
//!
//! Implementations: the io_uring file path and NVMe passthrough of a file's extents
//! (`ubdirect-nvme`), `ub://` storage servers over TCP or RDMA (`ubdirect-net`). Every one passes the
//! suite in [`conformance`].

use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::{Lease, Registrar, UbError};

/// The plan's reads of one source, handed to it before an epoch ([`Source::schedule`]): this rank's,
/// and those of the other ranks of its node, their plans merged with this one's batch by batch so
/// that positions (a read's place in the node's whole sequence) are one clock for all of them.
#[derive(Debug, Clone, Copy)]
pub struct PlannedReads<'a> {
    /// The same for every source of one schedule; a new generation replaces the last.
    pub generation: u64,
    /// This rank's reads, `(position, offset, len)`, positions increasing. Only these arrive here.
    pub reads: &'a [(u64, u64, u64)],
    /// The other ranks' reads, `(local rank, position, offset, len)`: what a cache shared by the
    /// node's processes keeps for them.
    pub others: &'a [(u32, u64, u64, u64)],
    /// This rank's place among the ranks of its node.
    pub local_rank: u32,
    /// The epoch at position 0.
    pub epoch: u64,
    /// Where the next epoch starts (`u64::MAX`: the schedule has one epoch).
    pub next_epoch_at: u64,
}

/// A completed read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadDone {
    /// Where the requested bytes are in the lease (a source may widen a read for alignment).
    pub data: Range<usize>,
    /// Bytes moved from storage (the widened range for O_DIRECT).
    pub bytes_read: usize,
    /// The path the bytes took.
    pub path: ReadPath,
}

/// The path a read's bytes took, for the run summary's bytes-per-path lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum ReadPath {
    /// io_uring with O_DIRECT (page cache bypassed).
    Direct,
    /// io_uring through the page cache.
    Buffered,
    /// NVMe passthrough commands on the namespace.
    NvmePassthru,
    /// A storage server, payload on the TCP stream.
    RemoteTcp,
    /// A storage server, payload by one-sided RDMA WRITE.
    RemoteRdma,
    /// Copied by the device straight out of the registered page-cache mapping (no read at all).
    Mapped,
    /// Ranged GETs of an object store, bodies copied into the lease.
    ObjectStore,
}

impl ReadPath {
    /// Every path, in summary order.
    pub const ALL: [ReadPath; 7] = [
        ReadPath::Mapped,
        ReadPath::Direct,
        ReadPath::Buffered,
        ReadPath::NvmePassthru,
        ReadPath::RemoteTcp,
        ReadPath::RemoteRdma,
        ReadPath::ObjectStore,
    ];

    /// Short name (`mapped`, `direct`, `buffered`, `nvme`, `remote_tcp`, `remote_rdma`,
    /// `object_store`).
    pub fn name(self) -> &'static str {
        match self {
            ReadPath::Mapped => "mapped",
            ReadPath::Direct => "direct",
            ReadPath::Buffered => "buffered",
            ReadPath::NvmePassthru => "nvme",
            ReadPath::RemoteTcp => "remote_tcp",
            ReadPath::RemoteRdma => "remote_rdma",
            ReadPath::ObjectStore => "object_store",
        }
    }

    /// Position in [`ReadPath::ALL`].
    pub fn index(self) -> usize {
        Self::ALL.iter().position(|p| *p == self).unwrap_or(0)
    }
}

impl fmt::Display for ReadPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What went wrong, for callers that branch (retry, report, give up).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SourceErrorKind {
    /// The range is not inside the shard.
    OutOfRange,
    /// The lease cannot hold the (widened) range, or is not usable by this source.
    Lease,
    /// No completion within the deadline.
    Timeout,
    /// The backend refused (permission, bad request): retrying will not help.
    Refused,
    /// The shard does not exist (any more).
    NotFound,
    /// No server or device answered within the deadline.
    Unavailable,
    /// The shard changed under the reader (size, identity).
    Changed,
    /// The device or kernel reported an I/O error.
    Io,
    /// The source is shut down.
    Closed,
}

impl SourceErrorKind {
    fn describe(self) -> &'static str {
        match self {
            SourceErrorKind::OutOfRange => "range outside the shard",
            SourceErrorKind::Lease => "lease cannot take the read",
            SourceErrorKind::Timeout => "no completion within the deadline",
            SourceErrorKind::Refused => "refused",
            SourceErrorKind::NotFound => "not found",
            SourceErrorKind::Unavailable => "unavailable",
            SourceErrorKind::Changed => "shard changed under the reader",
            SourceErrorKind::Io => "I/O error",
            SourceErrorKind::Closed => "source closed",
        }
    }
}

/// A failed read: what, where, and the backend's own error as `source()`.
#[derive(Debug, thiserror::Error)]
#[error("read {shard} at {offset}+{len}: {}", kind.describe())]
pub struct SourceError {
    /// What went wrong.
    pub kind: SourceErrorKind,
    /// The shard (path or URL).
    pub shard: String,
    /// Requested offset.
    pub offset: u64,
    /// Requested length.
    pub len: usize,
    /// The backend's error.
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl SourceError {
    /// An error of `kind` for the read `shard` at `offset`+`len`.
    pub fn new(kind: SourceErrorKind, shard: impl Into<String>, offset: u64, len: usize) -> Self {
        Self {
            kind,
            shard: shard.into(),
            offset,
            len,
            source: None,
        }
    }

    /// The same, keeping the backend's error.
    pub fn with_source(
        mut self,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        self.source = Some(source.into());
        self
    }

    /// The backend's error of type `E`, if that is what caused this one.
    pub fn source_as<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.source.as_deref().and_then(|e| e.downcast_ref::<E>())
    }
}

/// A read's outcome: the result and the lease, which always comes back.
pub type SourceResult = (Result<ReadDone, SourceError>, Lease);

/// The boxed future of [`Source::read`].
pub type ReadFuture<'a> = Pin<Box<dyn Future<Output = SourceResult> + Send + 'a>>;

/// A shard's bytes as local files of `chunk_size` bytes each (the last may be shorter), in order:
/// chunk `i` holds bytes `i × chunk_size ..` of the shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkFiles {
    /// Bytes of every chunk but the last.
    pub chunk_size: u64,
    /// Each chunk's file and the inode its contents were checked on.
    pub chunks: Vec<(std::path::PathBuf, u64)>,
}

/// Where a shard's bytes come from. Object safe: the pipeline holds `Arc<dyn Source>` per shard.
pub trait Source: Send + Sync + fmt::Debug {
    /// The shard's name (local path or URL), as errors and reports print it.
    fn shard(&self) -> &str;
    /// Size in bytes when opened.
    fn size(&self) -> u64;
    /// The path reads take, in words, for the run summary.
    fn describe(&self) -> String;
    /// Bytes a read may be widened by on each side (O_DIRECT alignment); a lease must hold
    /// `len + 2 × slack` bytes from an aligned `lease_offset`. 0 for sources that never widen.
    fn slack(&self) -> usize {
        0
    }
    /// What destination pools must be registered with, at creation, for this source to read into
    /// them (io_uring fixed buffers, an RDMA memory region). `None` when any host block will do.
    fn registrars(&self) -> Vec<Arc<dyn Registrar>> {
        Vec::new()
    }
    /// How many bytes of planned reads, beyond those already issued, this source wants to be told of
    /// through [`Source::advise`] (its prefetch window); 0, the default: none.
    fn advise_window(&self) -> u64 {
        0
    }
    /// Whether this source wants the plan's reads of the coming epochs ([`Source::schedule`]);
    /// false, the default: it is never called.
    fn wants_schedule(&self) -> bool {
        false
    }
    /// The plan's reads of this source for the epoch about to start and, when known, the next one
    /// ([`PlannedReads`]). A source with a cache may keep what the plan reads next; ignoring it is
    /// always correct, and it must neither block nor fail here.
    fn schedule(&self, planned: &PlannedReads<'_>) {
        let _ = planned;
    }
    /// Advice from the pipeline: `offset..offset + len` will be read soon, after the ranges advised
    /// before it (the planner's order). A source may fetch it ahead (an object store's cache does);
    /// it must neither block nor fail here, and ignoring the advice is always correct.
    fn advise(&self, offset: u64, len: usize) {
        let _ = (offset, len);
    }
    /// The cache this source's bytes may sit in as local chunk files (an object store's chunk
    /// cache): (its directory, its bound in bytes, its chunk size); `None`, the default: no such
    /// cache.
    fn chunk_cache(&self) -> Option<(std::path::PathBuf, u64, u64)> {
        None
    }
    /// When every byte of the shard sits in local chunk files of [`Source::chunk_cache`], checked
    /// by this process: the files, so that the page-cache pool may map them like a local shard.
    /// Must not block beyond a `stat` per chunk; `None`, the default: not (all) present.
    fn chunk_files(&self) -> Option<ChunkFiles> {
        None
    }
    /// Whether this source's reads of its [`Source::chunk_files`] that miss the page cache go
    /// through it, filling it (`true`), or around it with `O_DIRECT` (`false`): the page-cache pool
    /// asks for a fill when the run reads the shard again, so that a later epoch maps it, as it
    /// does for a cold local shard. Nothing by default.
    fn fill_page_cache(&self, on: bool) {
        let _ = on;
    }
    /// The `len` bytes at `offset` when this source holds them in memory now (an object cache's
    /// kept windows), with the path they count under: the read is then done (the source counts it
    /// as read), with no block, no task and no I/O. `None`, the default: not at hand, and nothing
    /// was consumed; the read goes through [`Source::read`]. It must neither block nor fail here.
    fn read_at_hand(&self, offset: u64, len: usize) -> Option<(std::sync::Arc<[u8]>, ReadPath)> {
        let _ = (offset, len);
        None
    }
    /// Reads `len` bytes at `offset` into `lease[lease_offset..]`, within `deadline`. The lease comes
    /// back with the result. Dropping the future before it completes never frees a block that a
    /// device may still write: the block stays in flight (orphaned) until its completion.
    fn read(
        &self,
        offset: u64,
        len: usize,
        lease: Lease,
        lease_offset: usize,
        deadline: Duration,
    ) -> ReadFuture<'_>;
}

/// Checks a request against the shard's size and the lease's capacity before anything is issued: the
/// first two checks every source makes, in one place.
pub fn check_request(
    src: &dyn Source,
    offset: u64,
    len: usize,
    lease: &Lease,
    lease_offset: usize,
) -> Result<(), SourceError> {
    let err = |k| SourceError::new(k, src.shard(), offset, len);
    match offset.checked_add(len as u64) {
        Some(end) if end <= src.size() => {}
        _ => {
            return Err(err(SourceErrorKind::OutOfRange)
                .with_source(format!("the shard holds {} bytes", src.size())));
        }
    }
    lease
        .check_range(lease_offset, len)
        .map_err(|e: UbError| err(SourceErrorKind::Lease).with_source(e))
}

pub mod conformance {
    //! The one suite every [`Source`] passes (`nvme/tests/source_conformance.rs` runs it on the file
    //! source here and on NVMe passthrough in the test guest; `net/tests/source_conformance.rs` on
    //! `ub://` over TCP, and over RDMA in the guest). Each check returns a message instead of
    //! panicking, so a runner can print results per source.

    use super::*;
    use crate::UbPool;

    /// One check's outcome.
    #[derive(Debug)]
    pub struct Check {
        /// The check's name.
        pub name: &'static str,
        /// `Err(why)` when it failed.
        pub result: Result<(), String>,
    }

    fn ensure(ok: bool, why: impl FnOnce() -> String) -> Result<(), String> {
        if ok { Ok(()) } else { Err(why()) }
    }

    async fn read_eq(
        src: &dyn Source,
        pool: &UbPool,
        expected: &[u8],
        offset: u64,
        len: usize,
    ) -> Result<(), String> {
        let lease = pool
            .acquire(Duration::from_secs(10))
            .await
            .map_err(|e| format!("acquire: {e}"))?;
        let handle = lease.handle();
        let (r, lease) = src
            .read(offset, len, lease, 0, Duration::from_secs(30))
            .await;
        ensure(lease.handle() == handle, || {
            "the lease that came back is not the one sent".into()
        })?;
        let done = r.map_err(|e| format!("read at {offset}+{len}: {e} ({:?})", e.source))?;
        ensure(done.data.len() == len, || {
            format!("read at {offset}+{len}: data range {:?}", done.data)
        })?;
        let got = &lease.as_slice().map_err(|e| e.to_string())?[done.data.clone()];
        let want = &expected[offset as usize..offset as usize + len];
        if got != want {
            let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            return Err(format!(
                "read at {offset}+{len}: bytes differ from the file at +{at}"
            ));
        }
        Ok(())
    }

    async fn expect_err(
        src: &dyn Source,
        pool: &UbPool,
        offset: u64,
        len: usize,
        lease_offset: usize,
        kinds: &[SourceErrorKind],
    ) -> Result<(), String> {
        let lease = pool
            .acquire(Duration::from_secs(10))
            .await
            .map_err(|e| format!("acquire: {e}"))?;
        let handle = lease.handle();
        let (r, lease) = src
            .read(offset, len, lease, lease_offset, Duration::from_secs(30))
            .await;
        ensure(lease.handle() == handle, || {
            "the lease did not come back with the error".into()
        })?;
        match r {
            Ok(d) => Err(format!(
                "read at {offset}+{len} (lease offset {lease_offset}) succeeded ({d:?}); expected {kinds:?}"
            )),
            Err(e) if kinds.contains(&e.kind) => {
                ensure(e.to_string().contains(src.shard()), || {
                    format!("error does not name the shard: {e}")
                })
            }
            Err(e) => Err(format!("expected {kinds:?}, got {:?}: {e}", e.kind)),
        }
    }

    /// Runs every check of `src` against `expected` (the shard's bytes), reading into blocks of
    /// `pool` (registered with `src.registrars()`, at least 4 blocks of ≥ 256 KiB).
    pub async fn run(src: &dyn Source, pool: &UbPool, expected: &[u8]) -> Vec<Check> {
        let mut out = Vec::new();
        let size = expected.len();
        let cap = pool.block_size() - 2 * src.slack();
        out.push(Check {
            name: "size",
            result: ensure(src.size() == size as u64, || {
                format!("size() = {}, the shard holds {size}", src.size())
            }),
        });
        out.push(Check {
            name: "whole shard equals the file",
            result: whole_shard(src, pool, expected, cap).await,
        });
        out.push(Check {
            name: "unaligned offsets and lengths",
            result: unaligned(src, pool, expected, cap).await,
        });
        let tail = (size.min(4097)).min(cap);
        out.push(Check {
            name: "tail ends exactly at the end",
            result: read_eq(src, pool, expected, (size - tail) as u64, tail).await,
        });
        out.push(Check {
            name: "zero-length read",
            result: read_eq(src, pool, expected, (size / 2) as u64, 0).await,
        });
        refused_reads(src, pool, size, &mut out).await;
        out.push(Check {
            name: "reads in flight at once",
            result: reads_in_flight(src, pool, expected, cap).await,
        });
        out.push(Check {
            name: "a dropped read's block comes back",
            result: dropped_read(src, pool, size, cap).await,
        });
        out.push(Check {
            name: "every block free after the suite",
            result: every_block_free(pool).await,
        });
        out
    }

    /// The whole shard, block by block (`cap` bytes a read), stopping at the first difference.
    async fn whole_shard(
        src: &dyn Source,
        pool: &UbPool,
        expected: &[u8],
        cap: usize,
    ) -> Result<(), String> {
        let size = expected.len();
        let mut whole = Ok(());
        let mut at = 0usize;
        while at < size && whole.is_ok() {
            let n = cap.min(size - at);
            whole = read_eq(src, pool, expected, at as u64, n).await;
            at += n;
        }
        whole
    }

    /// Unaligned offsets and lengths (each at most `cap`), those that fit in the shard.
    async fn unaligned(
        src: &dyn Source,
        pool: &UbPool,
        expected: &[u8],
        cap: usize,
    ) -> Result<(), String> {
        let size = expected.len();
        let mut unaligned = Ok(());
        for (o, l) in [
            (1u64, 1usize),
            (4095, 2),
            (4097, 5000),
            (12345, 65537),
            (511, 131_072),
        ] {
            let l = l.min(cap);
            if (o as usize) + l <= size && unaligned.is_ok() {
                unaligned = read_eq(src, pool, expected, o, l).await;
            }
        }
        unaligned
    }

    /// The reads a source must refuse with the right kind and give the lease back (one check each).
    async fn refused_reads(src: &dyn Source, pool: &UbPool, size: usize, out: &mut Vec<Check>) {
        out.push(Check {
            name: "read past the end is OutOfRange, lease back",
            result: expect_err(src, pool, size as u64, 1, 0, &[SourceErrorKind::OutOfRange]).await,
        });
        out.push(Check {
            name: "read straddling the end is OutOfRange, lease back",
            result: expect_err(
                src,
                pool,
                size.saturating_sub(10) as u64,
                20,
                0,
                &[SourceErrorKind::OutOfRange],
            )
            .await,
        });
        out.push(Check {
            name: "offset overflow is OutOfRange",
            result: expect_err(
                src,
                pool,
                u64::MAX - 2,
                16,
                0,
                &[SourceErrorKind::OutOfRange],
            )
            .await,
        });
        out.push(Check {
            name: "range larger than the lease is a Lease error, lease back",
            result: expect_err(
                src,
                pool,
                0,
                size.min(pool.block_size()),
                pool.block_size() - 4096,
                &[SourceErrorKind::Lease],
            )
            .await,
        });
    }

    /// Many reads in flight at once, each into its own block; the first failure is the result.
    async fn reads_in_flight(
        src: &dyn Source,
        pool: &UbPool,
        expected: &[u8],
        cap: usize,
    ) -> Result<(), String> {
        let size = expected.len();
        let n = pool.block_count().min(16);
        let step = (size / n.max(1)).max(1);
        let mut futs = Vec::new();
        for i in 0..n {
            let off = (i * step) as u64;
            let len = step.min(cap).min(size - i * step);
            futs.push(read_eq(src, pool, expected, off, len));
        }
        let mut concurrent = Ok(());
        for r in join_all(futs).await {
            if concurrent.is_ok() {
                concurrent = r;
            }
        }
        concurrent
    }

    /// A dropped read: its block comes back to the pool (after the completion), never lost.
    async fn dropped_read(
        src: &dyn Source,
        pool: &UbPool,
        size: usize,
        cap: usize,
    ) -> Result<(), String> {
        let lease = pool
            .acquire(Duration::from_secs(10))
            .await
            .map_err(|e| e.to_string())?;
        let len = cap.min(size);
        let fut = src.read(0, len, lease, 0, Duration::from_secs(30));
        // Poll it once so the read is issued, then drop it.
        let mut fut = fut;
        let _ = tokio::time::timeout(Duration::from_micros(1), &mut fut).await;
        drop(fut);
        every_block_free(pool).await
    }

    /// Waits (up to 30 s) until every block of `pool` can be leased at once.
    pub async fn every_block_free(pool: &UbPool) -> Result<(), String> {
        let mut held = Vec::new();
        for _ in 0..pool.block_count() {
            match pool.acquire(Duration::from_secs(30)).await {
                Ok(l) => held.push(l),
                Err(e) => {
                    return Err(format!(
                        "{} of {} blocks came back: {e}",
                        held.len(),
                        pool.block_count()
                    ));
                }
            }
        }
        Ok(())
    }

    async fn join_all<F: Future>(futs: Vec<F>) -> Vec<F::Output> {
        let mut set = Vec::with_capacity(futs.len());
        let mut pinned: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
        let mut done: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
        std::future::poll_fn(|cx| {
            let mut pending = false;
            for (i, f) in pinned.iter_mut().enumerate() {
                if done[i].is_none() {
                    match f.as_mut().poll(cx) {
                        std::task::Poll::Ready(v) => done[i] = Some(v),
                        std::task::Poll::Pending => pending = true,
                    }
                }
            }
            if pending {
                std::task::Poll::Pending
            } else {
                std::task::Poll::Ready(())
            }
        })
        .await;
        set.extend(done.into_iter().flatten());
        set
    }

    /// Prints each check (`ok`/`FAIL`) under `label` and returns the failures.
    pub fn report(label: &str, checks: &[Check]) -> Vec<String> {
        let mut failed = Vec::new();
        for c in checks {
            match &c.result {
                Ok(()) => println!("conformance [{label}] ok   {}", c.name),
                Err(why) => {
                    println!("conformance [{label}] FAIL {}: {why}", c.name);
                    failed.push(format!("{}: {why}", c.name));
                }
            }
        }
        failed
    }
}
