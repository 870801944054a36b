//! The engine's public face: configuration, files, buffer registration, async reads.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::OpenOptions;
use std::ops::Range;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use io_uring::{cqueue, squeue};
use ubdirect_ub::pool::PoolDescriptor;
use ubdirect_ub::{Lease, MappedFile, PoolId, Registrar, Registration, UbError, fallback};

use crate::IoError;
use crate::passthru::{Namespace, NvmeError};
use crate::sys::{self, DioAlign};
use crate::worker::{Cmd, NvmeOp, ReadOp, RingSetup, Worker, WorkerHandle};

mod buffers;
mod config;
mod copies;
mod files;
mod nvme_io;

use buffers::*;
pub use config::{DirectMode, EngineConfig, EngineReport, EngineStats, pin_thread};
pub use files::FileHandle;
pub(crate) use files::FileInner;
pub(crate) use nvme_io::NvmePending;

pub(crate) struct Shared {
    pub(crate) cfg: EngineConfig,
    workers: Vec<WorkerHandle>,
    /// Passthrough rings (SQE128/CQE32), started on first use with every registered buffer.
    passthru: OnceLock<Vec<WorkerHandle>>,
    next_passthru: AtomicUsize,
    /// What is registered (held briefly).
    registered: Mutex<BufferLog>,
    /// Serialises registrations with the start of passthrough rings, so a ring never misses a
    /// pool. Never taken by a ring thread (which may drop a pool, and so unregister it).
    starting: Mutex<()>,
    /// The passthrough rings' table. Never held while waiting for a ring thread.
    pt: Mutex<PtState>,
    next: AtomicUsize,
    next_op: AtomicU64,
    pub(crate) stats: Arc<EngineStats>,
    bufs: Mutex<BufTable>,
    files: Mutex<Vec<u32>>,
    sqpoll_refused: Option<String>,
    direct_files: AtomicU64,
    fallback_files: AtomicU64,
    buffered_files: AtomicU64,
    /// Threads copying warm ranges (`thread_copies`), started on first use.
    copier: OnceLock<Result<crate::copier::Copier, String>>,
}

impl Shared {
    fn pt(&self) -> std::sync::MutexGuard<'_, PtState> {
        self.pt.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a pool's blocks at table indices `base..` on the read rings, and in chunks on the
    /// passthrough rings if they run; logs them so passthrough rings started later register them.
    fn register_buffers(&self, base: u32, iovecs: Arc<Vec<(usize, usize)>>) -> Result<(), IoError> {
        let _starting = self.starting.lock().unwrap_or_else(|p| p.into_inner());
        self.broadcast_sync_on(self.workers.iter(), "register buffers", |reply| {
            Cmd::RegisterBuffers {
                base,
                iovecs: iovecs.clone(),
                reply,
            }
        })?;
        if let Some(rings) = self.passthru.get() {
            let chunks = self.pt().alloc(&iovecs);
            if let Some((e, chunks)) = chunks {
                let r = self.broadcast_sync_on(
                    rings.iter(),
                    "register buffers (passthrough rings)",
                    |reply| Cmd::RegisterBuffers {
                        base: e.first,
                        iovecs: chunks.clone(),
                        reply,
                    },
                );
                let mut pt = self.pt();
                if let Err(err) = r {
                    for w in rings {
                        let _ = w.send(Cmd::UnregisterBuffers {
                            base: e.first,
                            count: e.count,
                        });
                    }
                    pt.table.release(e.first, e.count);
                    return Err(err);
                }
                pt.by_base.insert(base, e);
            }
        }
        self.registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(base, iovecs);
        Ok(())
    }

    /// Clears table indices `base..base + count` on the read rings, and the pool's chunks on the
    /// passthrough rings (queued behind their commands).
    fn unregister_buffers(&self, base: u32, count: u32) {
        // Out of the log first: passthrough rings that start from now on do not register it; ones
        // starting now hold the `pt` lock until their entry is in `by_base`, where it is found below.
        self.registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&base);
        for w in &self.workers {
            let _ = w.send(Cmd::UnregisterBuffers { base, count });
        }
        let mut pt = self.pt();
        if let Some(e) = pt.by_base.remove(&base) {
            // Queued before the slots can be handed out again (released after sending).
            for w in self.passthru.get().into_iter().flatten() {
                let _ = w.send(Cmd::UnregisterBuffers {
                    base: e.first,
                    count: e.count,
                });
            }
            pt.table.release(e.first, e.count);
        }
    }

    fn broadcast_sync(
        &self,
        what: &str,
        make: impl Fn(std::sync::mpsc::Sender<std::io::Result<()>>) -> Cmd,
    ) -> Result<(), IoError> {
        self.broadcast_sync_on(self.workers.iter(), what, make)
    }

    fn broadcast_sync_on<'a>(
        &self,
        rings: impl Iterator<Item = &'a WorkerHandle>,
        what: &str,
        make: impl Fn(std::sync::mpsc::Sender<std::io::Result<()>>) -> Cmd,
    ) -> Result<(), IoError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut sent = 0;
        for w in rings {
            w.send(make(tx.clone())).map_err(|_| IoError::Closed)?;
            sent += 1;
        }
        drop(tx);
        let deadline = Instant::now() + Duration::from_secs(10);
        for _ in 0..sent {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(Ok(())) => {}
                Ok(Err(source)) => {
                    return Err(IoError::Setup {
                        what: what.to_string(),
                        source,
                    });
                }
                Err(_) => {
                    return Err(IoError::Setup {
                        what: what.to_string(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "ring thread did not answer",
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    fn broadcast(&self, make: impl Fn() -> Cmd) {
        for w in &self.workers {
            let _ = w.send(make());
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.shutdown();
        }
        if let Some(ws) = self.passthru.get_mut() {
            for w in ws {
                w.shutdown();
            }
        }
    }
}

/// The io_uring read engine. Cheap to clone.
#[derive(Clone)]
pub struct Engine {
    shared: Arc<Shared>,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("cfg", &self.shared.cfg)
            .finish()
    }
}

impl Engine {
    /// Starts the rings. SQPOLL refused by the kernel is a recorded fallback, not an error.
    pub fn new(cfg: EngineConfig) -> Result<Self, IoError> {
        cfg.validate()?;
        let max_fixed_buffers = cfg.max_fixed_buffers;
        let stats = Arc::new(EngineStats::default());
        let mut workers: Vec<WorkerHandle> = Vec::with_capacity(cfg.rings);
        let mut sqpoll_refused = None;
        for i in 0..cfg.rings {
            let setup = RingSetup {
                name: format!("ubdirect-uring{i}"),
                sqpoll: cfg.sqpoll,
                files: true,
                buffers: &[],
            };
            let spawned = Worker::<squeue::Entry, cqueue::Entry>::spawn(setup, &cfg, stats.clone());
            let (w, refused) = match spawned {
                Ok(w) => w,
                Err(e) => {
                    for mut w in workers {
                        w.shutdown();
                    }
                    return Err(e);
                }
            };
            if let Some(r) = refused {
                sqpoll_refused.get_or_insert(r);
            }
            workers.push(w);
        }
        if let Some(r) = &sqpoll_refused {
            fallback::record(
                "sqpoll_refused",
                format!("io_uring SQPOLL refused by the kernel ({r}); using plain submission"),
            );
        }
        Ok(Self {
            shared: Arc::new(Shared {
                bufs: Mutex::new(BufTable {
                    free: vec![(0, cfg.max_fixed_buffers)],
                    by_pool: HashMap::new(),
                }),
                files: Mutex::new((0..cfg.max_files).rev().collect()),
                cfg,
                workers,
                passthru: OnceLock::new(),
                next_passthru: AtomicUsize::new(0),
                registered: Mutex::new(BTreeMap::new()),
                starting: Mutex::new(()),
                pt: Mutex::new(PtState {
                    table: BufTable {
                        free: vec![(0, max_fixed_buffers)],
                        by_pool: HashMap::new(),
                    },
                    by_base: HashMap::new(),
                }),
                next: AtomicUsize::new(0),
                next_op: AtomicU64::new(1),
                stats,
                sqpoll_refused,
                direct_files: AtomicU64::new(0),
                fallback_files: AtomicU64::new(0),
                buffered_files: AtomicU64::new(0),
                copier: OnceLock::new(),
            }),
        })
    }

    /// Threads of the warm-copy pool (0 until its first use, or when `thread_copies` is off).
    pub fn copy_threads(&self) -> usize {
        match self.shared.copier.get() {
            Some(Ok(c)) => c.threads(),
            _ => 0,
        }
    }

    /// Whether warm ranges are copied by the thread pool ([`EngineConfig::thread_copies`]).
    pub fn thread_copies(&self) -> bool {
        self.shared.cfg.thread_copies
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.shared.cfg
    }

    /// Live counters.
    pub fn stats(&self) -> &EngineStats {
        &self.shared.stats
    }

    /// What actually runs.
    pub fn report(&self) -> EngineReport {
        let s = &self.shared;
        EngineReport {
            rings: s.cfg.rings,
            queue_depth: s.cfg.queue_depth,
            sqpoll_requested: s.cfg.sqpoll,
            sqpoll_active: s.cfg.sqpoll && s.sqpoll_refused.is_none(),
            sqpoll_refused: s.sqpoll_refused.clone(),
            direct_files: s.direct_files.load(Ordering::Relaxed),
            buffered_fallback_files: s.fallback_files.load(Ordering::Relaxed),
            buffered_files: s.buffered_files.load(Ordering::Relaxed),
        }
    }

    /// A registrar that registers a pool's blocks as fixed buffers with every ring, once, at pool
    /// creation: `UbPool::builder(cfg).register_with(engine.registrar())`.
    pub fn registrar(&self) -> Arc<dyn Registrar> {
        Arc::new(EngineRegistrar {
            shared: self.shared.clone(),
        })
    }

    /// Panics every read ring's thread (tests of what a ring thread's panic leaves behind).
    #[cfg(test)]
    pub(crate) fn panic_read_rings(&self) {
        for w in &self.shared.workers {
            let _ = w.send(Cmd::Panic);
        }
    }

    /// Reads `len` bytes at `offset` of `file` into `lease` at `lease_offset`.
    ///
    /// The lease goes in and comes back, also on error. On O_DIRECT files the range is widened to the
    /// file system's alignment (so `lease_offset` must be aligned and the block must hold the widened
    /// range); [`ReadDone::data`] says where the requested bytes are. If this future is dropped, or
    /// the read times out, the block stays in flight (and orphaned once the lease is dropped) until
    /// the kernel completes the read.
    pub async fn read(
        &self,
        file: &FileHandle,
        offset: u64,
        len: usize,
        lease: Lease,
        lease_offset: usize,
    ) -> (Result<ReadDone, IoError>, Lease) {
        let d = self.shared.cfg.op_timeout;
        self.read_within(file, offset, len, lease, lease_offset, d)
            .await
    }

    /// As [`Engine::read`], answering within `deadline` (or the engine's `op_timeout`, whichever is
    /// shorter).
    pub async fn read_within(
        &self,
        file: &FileHandle,
        offset: u64,
        len: usize,
        lease: Lease,
        lease_offset: usize,
        deadline: Duration,
    ) -> (Result<ReadDone, IoError>, Lease) {
        let mut lease = lease;
        let f = &file.inner;
        let plan = match self.plan(f, offset, len, &lease, lease_offset) {
            Ok(p) => p,
            Err(e) => return (Err(e), lease),
        };
        if len == 0 {
            return (
                Ok(ReadDone {
                    data: lease_offset..lease_offset,
                    bytes_read: 0,
                    direct: f.direct.is_some(),
                }),
                lease,
            );
        }
        let base = match host_base(&lease) {
            Ok(b) => b,
            Err(e) => return (Err(e), lease),
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let op_id = self.shared.next_op.fetch_add(1, Ordering::Relaxed);
        let op = ReadOp {
            op_id,
            file: f.clone(),
            buf_index: plan.buf_index,
            // SAFETY-relevant: `plan` checked lease_offset + total <= block size.
            buf: base + lease_offset,
            file_offset: plan.start,
            total: plan.total,
            required: plan.required,
            done: 0,
            retries: 0,
            // SAFETY: the token moves into the `ReadOp`, which the ring thread drops only in
            // `Worker::finish`, after the read's final CQE, or before it was ever submitted
            // (cancelled in the backlog; a closed ring gives the op back to `send`'s caller, to be
            // dropped here).
            token: unsafe { lease.begin_op() },
            reply: Some(tx),
            req_offset: offset,
            req_len: len,
        };
        let w = self.shared.next.fetch_add(1, Ordering::Relaxed) % self.shared.workers.len();
        let worker = &self.shared.workers[w];
        if worker.send(Cmd::Read(Box::new(op))).is_err() {
            return (Err(IoError::Closed), lease);
        }
        let started = Instant::now();
        let r = match tokio::time::timeout(deadline.min(self.shared.cfg.op_timeout), rx).await {
            Ok(Ok(Ok(_got))) => {
                let head = (offset - plan.start) as usize;
                self.shared
                    .stats
                    .bytes_delivered
                    .fetch_add(len as u64, Ordering::Relaxed);
                Ok(ReadDone {
                    data: lease_offset + head..lease_offset + head + len,
                    bytes_read: plan.total,
                    direct: f.direct.is_some(),
                })
            }
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_dropped)) => Err(IoError::Closed),
            Err(_elapsed) => {
                self.shared.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                let _ = worker.send(Cmd::Cancel { op_id });
                Err(IoError::Timeout {
                    path: f.path.clone(),
                    offset,
                    len,
                    waited: started.elapsed(),
                })
            }
        };
        (r, lease)
    }

    fn plan(
        &self,
        f: &FileInner,
        offset: u64,
        len: usize,
        lease: &Lease,
        lease_offset: usize,
    ) -> Result<Plan, IoError> {
        let end = offset.checked_add(len as u64);
        if let Some(size) = f.size
            && end.is_none_or(|e| e > size)
        {
            return Err(IoError::PastEof {
                path: f.path.clone(),
                offset,
                len,
                size,
            });
        }
        let end = end.ok_or_else(|| IoError::PastEof {
            path: f.path.clone(),
            offset,
            len,
            size: u64::MAX,
        })?;
        let (start, total, required) = match f.direct {
            Some(a) => {
                if !lease_offset.is_multiple_of(a.mem as usize) {
                    return Err(IoError::Misaligned {
                        path: f.path.clone(),
                        lease_offset,
                        align: a.mem,
                    });
                }
                let al = a.offset as u64;
                let start = offset / al * al;
                let aend = end.div_ceil(al) * al;
                ((start), (aend - start) as usize, (end - start) as usize)
            }
            None => (offset, len, len),
        };
        if lease_offset
            .checked_add(total)
            .is_none_or(|e| e > lease.capacity())
        {
            return Err(IoError::BufferTooSmall {
                path: f.path.clone(),
                offset,
                len,
                need: total,
                lease_offset,
                capacity: lease.capacity(),
            });
        }
        // A pool not registered with the engine (pageable memory, where RLIMIT_MEMLOCK is below it)
        // is read by address: the kernel pins its pages for each read. Counted.
        let bufs = self.shared.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let buf_index =
            match bufs.by_pool.get(&lease.pool_id()) {
                Some(&(base, _)) => {
                    let i = base + lease.slot();
                    Some(u16::try_from(i).map_err(|_| {
                        IoError::Config(format!("fixed buffer index {i} exceeds u16"))
                    })?)
                }
                None => {
                    self.shared
                        .stats
                        .unregistered_reads
                        .fetch_add(1, Ordering::Relaxed);
                    None
                }
            };
        Ok(Plan {
            start,
            total,
            required,
            buf_index,
        })
    }
}

/// `deadline` from now; a deadline too far to represent is an hour away (no wait is unbounded).
pub(crate) fn deadline_at(deadline: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(deadline)
        .or_else(|| now.checked_add(Duration::from_secs(3600)))
        .unwrap_or(now)
}

struct Plan {
    start: u64,
    total: usize,
    required: usize,
    /// The fixed buffer; `None`: an unregistered pool, read by address.
    buf_index: Option<u16>,
}

/// The host address of `lease`'s block, or the error for memory that io_uring and the copy threads
/// cannot write (device memory).
fn host_base(lease: &Lease) -> Result<usize, IoError> {
    lease
        .host_ptr()
        .map(|p| p as usize)
        .ok_or_else(|| IoError::NotHostVisible {
            pool: lease.pool_name().to_string(),
            kind: lease.kind(),
        })
}

/// A completed read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadDone {
    /// Where the requested bytes are in the lease.
    pub data: Range<usize>,
    /// Bytes read from storage (the widened range on O_DIRECT files).
    pub bytes_read: usize,
    /// Whether the read bypassed the page cache.
    pub direct: bool,
}
