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

/// Whether files are opened with O_DIRECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DirectMode {
    /// O_DIRECT where the file system supports it; buffered otherwise (counted as a fallback).
    #[default]
    Auto,
    /// O_DIRECT or an error.
    On,
    /// Buffered reads through the page cache (chosen, not a fallback).
    Off,
}

impl std::str::FromStr for DirectMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            o => Err(format!(
                "unknown direct mode {o:?}: expected auto, on or off"
            )),
        }
    }
}

/// Engine configuration. Defaults are the documented ones (docs/configuration.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Rings, one thread each; reads are spread round-robin.
    pub rings: usize,
    /// Reads in flight per ring (the submission queue depth). Tune by sweeping; 64–128 is a start.
    pub queue_depth: u32,
    /// Ask for a kernel submission-polling thread per ring. Refused → plain submission, reported.
    pub sqpoll: bool,
    /// SQPOLL thread idle time before it sleeps.
    pub sqpoll_idle: Duration,
    /// O_DIRECT policy.
    pub direct: DirectMode,
    /// Fixed-buffer table size per ring (kernel maximum 16384).
    pub max_fixed_buffers: u32,
    /// Registered-file table size per ring.
    pub max_files: u32,
    /// Deadline for one read, submission to completion.
    pub op_timeout: Duration,
    /// Retries of a read that failed with EINTR or EAGAIN.
    pub max_retries: u32,
    /// Hand buffered (page-cache) reads to io_uring's worker threads (`IOSQE_ASYNC`), so one ring
    /// copies several at once instead of one after another in its submit call.
    pub async_buffered: bool,
    /// Threads that copy warm (page-cache) ranges into leases with `pread` (the [`Engine::copy_read`]
    /// path, which [`crate::FileSource`] takes for resident ranges); 0: one per online CPU, at most
    /// 64. io_uring's buffered reads stay for files read without it.
    pub copy_threads: usize,
    /// Warm ranges go to the copy threads (`true`) or through io_uring's buffered reads (`false`).
    pub thread_copies: bool,
    /// CPUs the engine's threads (rings and copy threads) run on — a rank's GPU's NUMA node — or
    /// empty: wherever the scheduler puts them. Refused by the kernel (a CPU set outside this
    /// process's cgroup): a recorded fallback, the threads run unpinned.
    pub cpus: Vec<usize>,
}

/// Pins the calling thread to `cpus` (nothing for an empty list); a refusal is a recorded fallback.
pub fn pin_thread(cpus: &[usize]) {
    if cpus.is_empty() {
        return;
    }
    let mut set = nix::sched::CpuSet::new();
    for &c in cpus {
        if set.set(c).is_err() {
            break;
        }
    }
    if let Err(e) = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set) {
        fallback::record(
            "cpu_affinity_refused",
            format!(
                "sched_setaffinity to CPUs {} refused ({e}): loader threads run where the scheduler puts them",
                ubdirect_ub::topology::format_cpulist(cpus)
            ),
        );
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            rings: 1,
            queue_depth: 64,
            sqpoll: false,
            sqpoll_idle: Duration::from_millis(1000),
            direct: DirectMode::Auto,
            max_fixed_buffers: 4096,
            max_files: 1024,
            op_timeout: Duration::from_secs(30),
            max_retries: 16,
            async_buffered: true,
            copy_threads: 0,
            thread_copies: true,
            cpus: Vec::new(),
        }
    }
}

impl EngineConfig {
    fn validate(&self) -> Result<(), IoError> {
        let bad = |s: String| Err(IoError::Config(s));
        if self.rings == 0 || self.rings > 64 {
            return bad(format!("rings = {} (expected 1..=64)", self.rings));
        }
        if self.queue_depth == 0 || self.queue_depth > 4096 {
            return bad(format!(
                "queue_depth = {} (expected 1..=4096)",
                self.queue_depth
            ));
        }
        if self.max_fixed_buffers == 0 || self.max_fixed_buffers > 16384 {
            return bad(format!(
                "max_fixed_buffers = {} (expected 1..=16384)",
                self.max_fixed_buffers
            ));
        }
        if self.max_files == 0 || self.max_files > 1 << 20 {
            return bad(format!(
                "max_files = {} (expected 1..=1048576)",
                self.max_files
            ));
        }
        if self.op_timeout.is_zero() {
            return bad("op_timeout must be positive".into());
        }
        if self.copy_threads > 1024 {
            return bad(format!(
                "copy_threads = {} (expected 0..=1024; 0 = one per CPU)",
                self.copy_threads
            ));
        }
        Ok(())
    }
}

/// Counters, shared by every ring of an engine.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Reads completed successfully.
    pub reads: AtomicU64,
    /// Bytes transferred from storage (including widening for alignment).
    pub bytes: AtomicU64,
    /// Bytes delivered to callers.
    pub bytes_delivered: AtomicU64,
    /// Reads that returned fewer bytes than asked and were resubmitted for the rest.
    pub short_reads: AtomicU64,
    /// Resubmissions after EINTR/EAGAIN.
    pub retries: AtomicU64,
    /// Reads that ended in an error.
    pub errors: AtomicU64,
    /// Reads issued on O_DIRECT files.
    pub direct_reads: AtomicU64,
    /// Reads issued on buffered files.
    pub buffered_reads: AtomicU64,
    /// Reads that timed out.
    pub timeouts: AtomicU64,
    /// NVMe passthrough commands issued (one per max-transfer piece).
    pub nvme_cmds: AtomicU64,
    /// Bytes read by NVMe passthrough commands.
    pub nvme_bytes: AtomicU64,
    /// Passthrough commands issued with the buffer's address instead of its fixed-buffer index (the
    /// kernel refused the fixed buffer; see the `nvme_fixed_buffer_refused` fallback).
    pub nvme_cmds_unfixed: AtomicU64,
}

/// What the engine actually runs, for summaries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineReport {
    /// Rings (threads).
    pub rings: usize,
    /// Queue depth per ring.
    pub queue_depth: u32,
    /// SQPOLL asked for.
    pub sqpoll_requested: bool,
    /// SQPOLL running on every ring.
    pub sqpoll_active: bool,
    /// Why SQPOLL is not running, where it was asked for.
    pub sqpoll_refused: Option<String>,
    /// Files opened O_DIRECT.
    pub direct_files: u64,
    /// Files opened buffered because the file system has no direct I/O (fallback).
    pub buffered_fallback_files: u64,
    /// Files opened buffered by config.
    pub buffered_files: u64,
}

struct BufTable {
    /// Free fixed-buffer index ranges (start, len), sorted.
    free: Vec<(u32, u32)>,
    by_pool: HashMap<PoolId, (u32, u32)>,
}

impl BufTable {
    fn alloc(&mut self, n: u32) -> Option<u32> {
        let i = self.free.iter().position(|&(_, len)| len >= n)?;
        let (start, len) = self.free[i];
        if len == n {
            self.free.remove(i);
        } else {
            self.free[i] = (start + n, len - n);
        }
        Some(start)
    }

    fn release(&mut self, start: u32, n: u32) {
        self.free.push((start, n));
        self.free.sort_unstable();
        let mut merged: Vec<(u32, u32)> = Vec::with_capacity(self.free.len());
        for &(s, l) in &self.free {
            match merged.last_mut() {
                Some(last) if last.0 + last.1 == s => last.1 += l,
                _ => merged.push((s, l)),
            }
        }
        self.free = merged;
    }
}

/// Blocks (or chunks) as (address, length).
type Iovecs = Arc<Vec<(usize, usize)>>;

/// Fixed buffers registered on the read rings: first table index → the blocks.
type BufferLog = BTreeMap<u32, Iovecs>;

/// Bytes of one fixed buffer on the passthrough rings: their table holds each block as chunks of
/// this size. Linux before "io_uring/rsrc: ensure segments counts are correct on offset" (2025;
/// 6.1 in the test guest) counts every page from a command's start to the end of its fixed buffer
/// as a segment and refuses (EINVAL) more than the queue's `max_segments` (127 on nvme-pci): 64
/// pages stay under it wherever a command starts. Commands are split at chunk boundaries.
pub(crate) const PT_CHUNK: usize = 64 * ubdirect_ub::PAGE_SIZE;

/// A pool's blocks in the passthrough rings' table.
#[derive(Debug, Clone, Copy)]
struct PtEntry {
    first: u32,
    per_block: u32,
    count: u32,
}

/// The passthrough rings' fixed-buffer table: its own index space (chunks, not blocks).
struct PtState {
    table: BufTable,
    /// Keyed by the pool's first index in the read rings' table.
    by_base: HashMap<u32, PtEntry>,
}

impl PtState {
    /// Allocates chunk slots for a pool's blocks; `None` when the table is full (its commands then
    /// go by address, recorded as a fallback).
    fn alloc(&mut self, iovecs: &[(usize, usize)]) -> Option<(PtEntry, Iovecs)> {
        let per = iovecs
            .iter()
            .map(|&(_, l)| l.div_ceil(PT_CHUNK))
            .max()
            .unwrap_or(1)
            .max(1);
        let mut v = Vec::with_capacity(iovecs.len() * per);
        for &(p, l) in iovecs {
            for k in 0..per {
                let o = k * PT_CHUNK;
                v.push(if p != 0 && o < l {
                    (p + o, (l - o).min(PT_CHUNK))
                } else {
                    (0, 0)
                });
            }
        }
        let count = u32::try_from(v.len()).ok()?;
        let Some(first) = self.table.alloc(count) else {
            fallback::record(
                "nvme_fixed_table_full",
                format!(
                    "no {count} free fixed-buffer slots on the passthrough rings (raise \
                     max_fixed_buffers); NVMe commands into this pool go by address"
                ),
            );
            return None;
        };
        let e = PtEntry {
            first,
            per_block: per as u32,
            count,
        };
        Some((e, Arc::new(v)))
    }
}

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

    fn copier(&self) -> Result<&crate::copier::Copier, IoError> {
        let c = self.shared.copier.get_or_init(|| {
            let n = match self.shared.cfg.copy_threads {
                0 => std::thread::available_parallelism()
                    .map_or(4, |n| n.get())
                    .min(64),
                n => n,
            };
            crate::copier::Copier::start(n, &self.shared.cfg.cpus)
                .map_err(|e| format!("starting {n} copy threads: {e}"))
        });
        c.as_ref().map_err(|e| IoError::Config(e.clone()))
    }

    /// Reads a range of a buffered (page-cache) file into `lease` at `lease_offset` on the copy
    /// threads: one `pread` straight into the block. For warm data; cold data blocks a thread on the
    /// device until it arrives. The lease goes in and comes back, also on error and timeout (then the
    /// block stays `Orphaned` until the copy has really ended).
    pub async fn copy_read(
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
        if f.direct.is_some() {
            return (
                Err(IoError::Config(format!(
                    "{}: copy_read needs a buffered handle",
                    f.path.display()
                ))),
                lease,
            );
        }
        let plan = match self.plan(f, offset, len, &lease, lease_offset) {
            Ok(p) => p,
            Err(e) => return (Err(e), lease),
        };
        let base = match host_base(&lease) {
            Ok(b) => b,
            Err(e) => return (Err(e), lease),
        };
        if len == 0 {
            return (
                Ok(ReadDone {
                    data: lease_offset..lease_offset,
                    bytes_read: 0,
                    direct: false,
                }),
                lease,
            );
        }
        let copier = match self.copier() {
            Ok(c) => c,
            Err(e) => return (Err(e), lease),
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job = crate::copier::CopyJob {
            file: crate::copier::CopyFrom::File(f.clone()),
            offset: plan.start,
            len: plan.total,
            // `plan` checked lease_offset + total <= the block's size.
            dst: base + lease_offset,
            token: lease.begin_op(),
            reply: tx,
        };
        if copier.submit(job).is_err() {
            return (Err(IoError::Closed), lease);
        }
        let started = Instant::now();
        let r = match tokio::time::timeout(deadline.min(self.shared.cfg.op_timeout), rx).await {
            Ok(Ok(Ok(got))) if got >= plan.required => {
                let st = &self.shared.stats;
                st.reads.fetch_add(1, Ordering::Relaxed);
                st.bytes.fetch_add(got as u64, Ordering::Relaxed);
                st.bytes_delivered.fetch_add(len as u64, Ordering::Relaxed);
                st.buffered_reads.fetch_add(1, Ordering::Relaxed);
                Ok(ReadDone {
                    data: lease_offset..lease_offset + len,
                    bytes_read: got,
                    direct: false,
                })
            }
            Ok(Ok(Ok(got))) => Err(IoError::UnexpectedEof {
                path: f.path.clone(),
                offset,
                len,
                got,
            }),
            Ok(Ok(Err(source))) => Err(IoError::Read {
                path: f.path.clone(),
                offset,
                len,
                source,
            }),
            Ok(Err(_dropped)) => Err(IoError::Closed),
            Err(_elapsed) => {
                self.shared.stats.timeouts.fetch_add(1, Ordering::Relaxed);
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

    /// Copies `len` bytes at `offset` of a mapping ([`MappedFile`]: a shard's file, or an object's
    /// chunk files laid end to end) into `lease` at `lease_offset` on the copy threads: a `pread` on
    /// the mapping's own descriptors per file the range spans, all queued at once (a 4 MiB read over
    /// 1 MiB chunks is four copies on four threads). No open and no registered-file slot per file:
    /// for ranges the caller knows are resident. A piece that reads short (a file truncated since it
    /// was mapped) is [`IoError::UnexpectedEof`] naming that file. The lease comes back, also on
    /// error and timeout (then its block stays `Orphaned` until every copy has ended).
    pub async fn copy_mapped(
        &self,
        map: &Arc<MappedFile>,
        offset: u64,
        len: usize,
        lease: Lease,
        lease_offset: usize,
        deadline: Duration,
    ) -> (Result<ReadDone, IoError>, Lease) {
        let mut lease = lease;
        let pieces = match map.pieces(offset, len) {
            Ok(p) => p,
            Err(e) => return (Err(e.into()), lease),
        };
        let path_of = |i: usize| {
            map.part(i)
                .map(|(p, _)| p.to_path_buf())
                .unwrap_or_default()
        };
        if lease.check_range(lease_offset, len).is_err() {
            return (
                Err(IoError::BufferTooSmall {
                    path: path_of(pieces.first().map_or(0, |p| p.file)),
                    offset,
                    len,
                    need: len,
                    lease_offset,
                    capacity: lease.capacity(),
                }),
                lease,
            );
        }
        let base = match host_base(&lease) {
            Ok(b) => b,
            Err(e) => return (Err(e), lease),
        };
        let copier = match self.copier() {
            Ok(c) => c,
            Err(e) => return (Err(e), lease),
        };
        let mut replies = Vec::with_capacity(pieces.len());
        for p in &pieces {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let job = crate::copier::CopyJob {
                file: crate::copier::CopyFrom::Mapped(map.clone(), p.file),
                offset: p.file_offset,
                len: p.len,
                // `check_range` above: lease_offset + len fits the block, and the pieces tile
                // 0..len.
                dst: base + lease_offset + p.at,
                token: lease.begin_op(),
                reply: tx,
            };
            if copier.submit(job).is_err() {
                return (Err(IoError::Closed), lease);
            }
            replies.push(rx);
        }
        let started = Instant::now();
        let all = async {
            let mut out = Vec::with_capacity(replies.len());
            for rx in replies {
                out.push(rx.await);
            }
            out
        };
        let r = match tokio::time::timeout(deadline.min(self.shared.cfg.op_timeout), all).await {
            Ok(results) => {
                let mut r = Ok(());
                for (p, res) in pieces.iter().zip(results) {
                    let e = match res {
                        Ok(Ok(got)) if got >= p.len => continue,
                        Ok(Ok(got)) => IoError::UnexpectedEof {
                            path: path_of(p.file),
                            offset: p.file_offset,
                            len: p.len,
                            got,
                        },
                        Ok(Err(source)) => IoError::Read {
                            path: path_of(p.file),
                            offset: p.file_offset,
                            len: p.len,
                            source,
                        },
                        Err(_dropped) => IoError::Closed,
                    };
                    r = Err(e);
                    break;
                }
                r.map(|()| {
                    let st = &self.shared.stats;
                    st.reads.fetch_add(1, Ordering::Relaxed);
                    st.bytes.fetch_add(len as u64, Ordering::Relaxed);
                    st.bytes_delivered.fetch_add(len as u64, Ordering::Relaxed);
                    st.buffered_reads.fetch_add(1, Ordering::Relaxed);
                    ReadDone {
                        data: lease_offset..lease_offset + len,
                        bytes_read: len,
                        direct: false,
                    }
                })
            }
            Err(_elapsed) => {
                self.shared.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                Err(IoError::Timeout {
                    path: path_of(pieces.first().map_or(0, |p| p.file)),
                    offset,
                    len,
                    waited: started.elapsed(),
                })
            }
        };
        (r, lease)
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

    /// Opens `path` for reading, with O_DIRECT where the file system supports it, and registers it
    /// with every ring.
    pub fn open(&self, path: impl AsRef<Path>) -> Result<FileHandle, IoError> {
        let path = path.as_ref().to_path_buf();
        let open_err = |source| IoError::Open {
            path: path.clone(),
            source,
        };
        let plain = || open_read(&path, 0).map(OwnedFd::from).map_err(open_err);
        let want_direct = self.shared.cfg.direct != DirectMode::Off;
        let (fd, direct) = if !want_direct {
            self.shared.buffered_files.fetch_add(1, Ordering::Relaxed);
            (plain()?, None)
        } else {
            match self.probe_direct(&path)? {
                Ok((fd, align)) => {
                    self.shared.direct_files.fetch_add(1, Ordering::Relaxed);
                    (fd, Some(align))
                }
                Err(reason) => {
                    if self.shared.cfg.direct == DirectMode::On {
                        return Err(IoError::DirectUnsupported { path, reason });
                    }
                    fallback::record(
                        "o_direct_unsupported",
                        format!(
                            "{}: {reason}; reading through the page cache",
                            path.display()
                        ),
                    );
                    self.shared.fallback_files.fetch_add(1, Ordering::Relaxed);
                    (plain()?, None)
                }
            }
        };
        self.finish_open(path, fd, direct)
    }

    /// Opens `path` a second way for buffered reads, whatever `direct` says: the page-cache half of
    /// `direct = "auto"` (resident ranges are read through it, the rest with O_DIRECT).
    pub fn open_buffered(&self, path: impl AsRef<Path>) -> Result<FileHandle, IoError> {
        let path = path.as_ref().to_path_buf();
        let fd = open_read(&path, 0)
            .map(OwnedFd::from)
            .map_err(|source| IoError::Open {
                path: path.clone(),
                source,
            })?;
        self.finish_open(path, fd, None)
    }

    fn finish_open(
        &self,
        path: PathBuf,
        fd: OwnedFd,
        direct: Option<DirectAlign>,
    ) -> Result<FileHandle, IoError> {
        let open_err = |source| IoError::Open {
            path: path.clone(),
            source,
        };
        let mut f = std::fs::File::from(fd.try_clone().map_err(open_err)?);
        let meta = f.metadata().map_err(open_err)?;
        if meta.is_dir() {
            return Err(open_err(std::io::Error::new(
                std::io::ErrorKind::IsADirectory,
                "is a directory",
            )));
        }
        // A block device's metadata says 0 bytes; its size is where SEEK_END lands.
        let size = if std::os::unix::fs::FileTypeExt::is_block_device(&meta.file_type()) {
            std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0)).map_err(open_err)?
        } else {
            meta.len()
        };
        self.register_fd(path, fd, direct, Some(size))
    }

    /// Registers an already open descriptor (a pipe, a socket, a device) for buffered reads.
    /// Its size is unknown, so end-of-file is only detected by the reads themselves.
    pub fn open_fd(&self, label: impl Into<PathBuf>, fd: OwnedFd) -> Result<FileHandle, IoError> {
        self.register_fd(label.into(), fd, None, None)
    }

    /// Tries O_DIRECT. Outer error: the file cannot be opened at all. Inner error: why direct I/O
    /// is not available (a fallback reason).
    #[allow(clippy::type_complexity)]
    fn probe_direct(&self, path: &Path) -> Result<Result<(OwnedFd, DirectAlign), String>, IoError> {
        let open_err = |source| IoError::Open {
            path: path.to_path_buf(),
            source,
        };
        let dio = sys::dio_align(path).map_err(open_err)?;
        let align = match dio {
            DioAlign::Unsupported => {
                return Ok(Err(
                    "the file system reports no direct I/O (statx STATX_DIOALIGN = 0)".into(),
                ));
            }
            DioAlign::Supported { mem, offset } => DirectAlign { mem, offset },
            // Kernels before 6.1 do not say; 4096 satisfies every block device in practice.
            DioAlign::Unknown => DirectAlign {
                mem: 4096,
                offset: 4096,
            },
        };
        if align.mem as usize > ubdirect_ub::PAGE_SIZE
            || !align.offset.is_power_of_two()
            || !align.mem.is_power_of_two()
        {
            return Ok(Err(format!("unusual direct-I/O alignment {align:?}")));
        }
        match open_read(path, libc::O_DIRECT) {
            Ok(f) => {
                let fd = OwnedFd::from(f);
                if dio == DioAlign::Unknown
                    && sys::fs_magic(&fd).map_err(open_err)? == sys::TMPFS_MAGIC
                {
                    return Ok(Err("tmpfs accepts O_DIRECT but caches anyway".into()));
                }
                Ok(Ok((fd, align)))
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                Ok(Err("open(O_DIRECT) refused with EINVAL".into()))
            }
            Err(e) => Err(open_err(e)),
        }
    }

    fn register_fd(
        &self,
        path: PathBuf,
        fd: OwnedFd,
        direct: Option<DirectAlign>,
        size: Option<u64>,
    ) -> Result<FileHandle, IoError> {
        let slot = self
            .shared
            .files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .ok_or_else(|| IoError::Setup {
                what: format!("register {}", path.display()),
                source: std::io::Error::other(format!(
                    "all {} registered-file slots of the io_uring engine are in use (EngineConfig::max_files; `ubdirect serve` bounds its clients' share with serve.max_open_files_per_peer and serve.max_open_files_per_token)",
                    self.shared.cfg.max_files
                )),
            })?;
        let raw = fd.as_raw_fd();
        if let Err(e) =
            self.shared
                .broadcast_sync(&format!("register file {}", path.display()), |reply| {
                    Cmd::RegisterFile {
                        slot,
                        fd: raw,
                        reply,
                    }
                })
        {
            self.shared.broadcast(|| Cmd::UnregisterFile { slot });
            self.shared
                .files
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(slot);
            return Err(e);
        }
        Ok(FileHandle {
            inner: Arc::new(FileInner {
                shared: self.shared.clone(),
                path,
                _fd: fd,
                slot,
                direct,
                size,
            }),
        })
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
            token: lease.begin_op(),
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

    /// Starts the passthrough rings (SQE128/CQE32, one per read ring) if they are not running yet.
    /// Their fixed-buffer table holds every registered pool too, each block as chunks of
    /// 256 KiB (older kernels refuse commands whose fixed buffer spans more pages to its end than the
    /// queue's `max_segments`). Called by the first passthrough read; call it early to learn at
    /// open time whether this kernel can run them (URING_CMD needs Linux ≥ 5.19, fixed buffers with
    /// it ≥ 6.1).
    pub fn passthru_rings(&self) -> Result<(), IoError> {
        let s = &self.shared;
        if s.passthru.get().is_some() {
            return Ok(());
        }
        // Held while the rings start: no pool registers meanwhile.
        let _starting = s.starting.lock().unwrap_or_else(|p| p.into_inner());
        if s.passthru.get().is_some() {
            return Ok(());
        }
        // Held until the new rings' entries are in `by_base`, so a pool unregistered meanwhile
        // finds and clears them. Spawning waits on no running ring thread.
        let mut pt = s.pt();
        let log: Vec<crate::worker::Buffers> = s
            .registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(b, v)| (*b, v.clone()))
            .collect();
        let mut entries = Vec::new();
        let mut buffers: Vec<crate::worker::Buffers> = Vec::new();
        for (base, v) in &log {
            if let Some((e, chunks)) = pt.alloc(v) {
                entries.push((*base, e));
                buffers.push((e.first, chunks));
            }
        }
        let mut rings = Vec::with_capacity(s.cfg.rings);
        for i in 0..s.cfg.rings {
            let setup = RingSetup {
                name: format!("ubdirect-nvme{i}"),
                sqpoll: false,
                files: false,
                buffers: &buffers,
            };
            match Worker::<squeue::Entry128, cqueue::Entry32>::spawn(setup, &s.cfg, s.stats.clone())
            {
                Ok((w, _)) => rings.push(w),
                Err(e) => {
                    for mut w in rings {
                        w.shutdown();
                    }
                    for (_, en) in &entries {
                        pt.table.release(en.first, en.count);
                    }
                    return Err(e);
                }
            }
        }
        if let Err(rings) = s.passthru.set(rings) {
            // Cannot happen under the lock; do not leak the threads if it does.
            for mut w in rings {
                w.shutdown();
            }
            for (_, en) in &entries {
                pt.table.release(en.first, en.count);
            }
            return Ok(());
        }
        pt.by_base.extend(entries);
        Ok(())
    }

    /// Reads `nlb` logical blocks at `slba` of `ns` into `lease[lease_offset..]` with NVMe read
    /// commands on the passthrough rings (`IORING_OP_URING_CMD`, `NVME_URING_CMD_IO`, the lease's
    /// block as a fixed buffer), split at [`Namespace::max_transfer`]; done when every piece is.
    ///
    /// The lease comes back, also on error. The pool must be registered with this engine. If this
    /// future is dropped, or the read times out, the block stays in flight (orphaned once the lease
    /// is dropped) until every command has completed.
    pub async fn nvme_read(
        &self,
        ns: &Arc<Namespace>,
        slba: u64,
        nlb: u32,
        mut lease: Lease,
        lease_offset: usize,
        deadline: Duration,
    ) -> (Result<(), NvmeError>, Lease) {
        let until = deadline_at(deadline.min(self.shared.cfg.op_timeout));
        let pending = match self.nvme_submit(ns, slba, nlb, &mut lease, lease_offset) {
            Ok(p) => p,
            Err(e) => return (Err(e), lease),
        };
        (self.nvme_wait(ns, pending, until).await, lease)
    }

    /// Issues the commands of [`Engine::nvme_read`] without waiting: each holds the block in flight
    /// until its completion.
    pub(crate) fn nvme_submit(
        &self,
        ns: &Arc<Namespace>,
        slba: u64,
        nlb: u32,
        lease: &mut Lease,
        lease_offset: usize,
    ) -> Result<Vec<NvmePending>, NvmeError> {
        let bs = ns.id().lba_size as u64;
        let range_err = |reason: String| NvmeError::Range {
            path: ns.path().to_path_buf(),
            reason,
        };
        if nlb == 0
            || slba
                .checked_add(nlb as u64)
                .is_none_or(|e| e > ns.id().nsze)
        {
            return Err(range_err(format!(
                "LBA {slba}+{nlb} outside the namespace ({} blocks)",
                ns.id().nsze
            )));
        }
        let len = nlb as usize * bs as usize;
        lease.check_range(lease_offset, len)?;
        let base = lease.host_ptr().ok_or_else(|| UbError::NotHostVisible {
            pool: lease.pool_name().to_string(),
            kind: lease.kind(),
        })? as usize;
        let read_base = {
            let bufs = self.shared.bufs.lock().unwrap_or_else(|p| p.into_inner());
            let Some(&(first, _)) = bufs.by_pool.get(&lease.pool_id()) else {
                return Err(NvmeError::NotRegistered {
                    pool: lease.pool_name().to_string(),
                });
            };
            first
        };
        self.passthru_rings().map_err(|source| NvmeError::Rings {
            path: ns.path().to_path_buf(),
            source,
        })?;
        let rings = self.shared.passthru.get().ok_or(NvmeError::Closed)?;
        // The block's chunks in the passthrough rings' table (none: by address).
        let chunks = self.shared.pt().by_base.get(&read_base).copied();
        let per_cmd = (ns.max_transfer() as u64 / bs).clamp(1, 65536) as u32;
        let mut pending = Vec::with_capacity(nlb.div_ceil(per_cmd) as usize);
        let mut done = 0u32;
        while done < nlb {
            let at = lease_offset + done as usize * bs as usize;
            let to_chunk_end = PT_CHUNK - at % PT_CHUNK;
            // Split at the chunk's end where that falls on an LBA boundary; a command crossing it
            // (an LBA-unaligned lease offset) goes by address.
            let (n, fixed) = if to_chunk_end.is_multiple_of(bs as usize) {
                let lbas = (to_chunk_end / bs as usize).min(u32::MAX as usize) as u32;
                (per_cmd.min(nlb - done).min(lbas), chunks.is_some())
            } else {
                let n = per_cmd.min(nlb - done);
                (
                    n,
                    chunks.is_some() && (n as usize * bs as usize) <= to_chunk_end,
                )
            };
            let buf_index = chunks
                .map(|c| {
                    c.first as u64
                        + lease.slot() as u64 * c.per_block as u64
                        + (at / PT_CHUNK) as u64
                })
                .and_then(|i| u16::try_from(i).ok());
            let fixed = fixed && buf_index.is_some();
            let (tx, rx) = tokio::sync::oneshot::channel();
            let op_id = self.shared.next_op.fetch_add(1, Ordering::Relaxed);
            let ring = self.shared.next_passthru.fetch_add(1, Ordering::Relaxed) % rings.len();
            let op = NvmeOp {
                op_id,
                ns: ns.clone(),
                slba: slba + done as u64,
                nlb: n,
                buf_index: buf_index.unwrap_or(0),
                // Inside the block: lease_offset + len <= block size was checked above.
                buf: base + at,
                len: n * bs as u32,
                tail_pages: (PT_CHUNK - at % PT_CHUNK).div_ceil(ubdirect_ub::PAGE_SIZE) as u32,
                fixed,
                refused_fixed: false,
                retries: 0,
                token: lease.begin_op(),
                reply: Some(tx),
            };
            if rings[ring].send(Cmd::Nvme(Box::new(op))).is_err() {
                return Err(NvmeError::Closed);
            }
            pending.push(NvmePending {
                rx,
                ring,
                op_id,
                slba: slba + done as u64,
                nlb: n,
            });
            done += n;
        }
        Ok(pending)
    }

    /// Waits for every command of `pending` until `until`; the first error wins. Commands still
    /// running at the deadline keep their blocks in flight.
    pub(crate) async fn nvme_wait(
        &self,
        ns: &Namespace,
        pending: Vec<NvmePending>,
        until: Instant,
    ) -> Result<(), NvmeError> {
        let started = Instant::now();
        let mut first = None;
        let mut timed_out = None;
        for p in pending {
            let NvmePending {
                rx,
                ring,
                op_id,
                slba,
                nlb,
            } = p;
            if timed_out.is_some() {
                self.cancel_passthru(ring, op_id);
                continue;
            }
            match tokio::time::timeout_at(until.into(), rx).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => {
                    first.get_or_insert(e);
                }
                Ok(Err(_dropped)) => {
                    first.get_or_insert(NvmeError::Closed);
                }
                Err(_elapsed) => {
                    self.shared.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                    self.cancel_passthru(ring, op_id);
                    timed_out = Some((slba, nlb));
                }
            }
        }
        if let Some((slba, nlb)) = timed_out {
            return Err(NvmeError::Timeout {
                op: "NVMe read (uring_cmd)",
                path: ns.path().to_path_buf(),
                slba,
                nlb,
                waited: started.elapsed(),
            });
        }
        first.map_or(Ok(()), Err)
    }

    /// Takes a command still queued back (an in-flight one runs to its completion).
    fn cancel_passthru(&self, ring: usize, op_id: u64) {
        if let Some(rings) = self.shared.passthru.get()
            && let Some(w) = rings.get(ring)
        {
            let _ = w.send(Cmd::Cancel { op_id });
        }
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
        let bufs = self.shared.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let Some(&(base, _)) = bufs.by_pool.get(&lease.pool_id()) else {
            return Err(IoError::NotRegistered {
                pool: lease.pool_name().to_string(),
            });
        };
        let buf_index = base + lease.slot();
        let buf_index = u16::try_from(buf_index)
            .map_err(|_| IoError::Config(format!("fixed buffer index {buf_index} exceeds u16")))?;
        Ok(Plan {
            start,
            total,
            required,
            buf_index,
        })
    }
}

/// Opens `path` for reading without waiting on it: with `O_NONBLOCK`, so that a FIFO swapped in
/// for a data file cannot block the open (it would wait for a writer), then checked on the
/// descriptor (`fstat`): only a regular file or a block device is read. `O_NONBLOCK` is cleared
/// again before the descriptor is used (io_uring answers `EAGAIN` instead of waiting on a
/// non-blocking file).
fn open_read(path: &Path, flags: i32) -> std::io::Result<std::fs::File> {
    use nix::fcntl::{FcntlArg, OFlag, fcntl};
    use std::os::unix::fs::FileTypeExt;
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(flags | libc::O_NONBLOCK)
        .open(path)?;
    let t = f.metadata()?.file_type();
    if !(t.is_file() || t.is_block_device()) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file or block device",
        ));
    }
    let fl = OFlag::from_bits_truncate(fcntl(&f, FcntlArg::F_GETFL)?);
    fcntl(&f, FcntlArg::F_SETFL(fl - OFlag::O_NONBLOCK))?;
    Ok(f)
}

/// `deadline` from now; a deadline too far to represent is an hour away (no wait is unbounded).
pub(crate) fn deadline_at(deadline: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(deadline)
        .or_else(|| now.checked_add(Duration::from_secs(3600)))
        .unwrap_or(now)
}

/// A passthrough command on its way.
pub(crate) struct NvmePending {
    rx: tokio::sync::oneshot::Receiver<Result<(), NvmeError>>,
    ring: usize,
    op_id: u64,
    slba: u64,
    nlb: u32,
}

struct Plan {
    start: u64,
    total: usize,
    required: usize,
    buf_index: u16,
}

/// Direct-I/O alignment of an O_DIRECT file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DirectAlign {
    pub(crate) mem: u32,
    pub(crate) offset: u32,
}

pub(crate) struct FileInner {
    shared: Arc<Shared>,
    pub(crate) path: PathBuf,
    _fd: OwnedFd,
    pub(crate) slot: u32,
    pub(crate) direct: Option<DirectAlign>,
    size: Option<u64>,
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

impl Drop for FileInner {
    fn drop(&mut self) {
        let slot = self.slot;
        // Queued behind any read on this file (reads hold the file alive, so none is in flight).
        self.shared.broadcast(|| Cmd::UnregisterFile { slot });
        self.shared
            .files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(slot);
    }
}

impl FileInner {
    pub(crate) fn fd_owned(&self) -> &OwnedFd {
        &self._fd
    }
}

impl FileHandle {
    /// The open descriptor (for `cachestat`, `fstat`).
    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.inner._fd
    }
}

/// An open, registered file. Cheap to clone; unregistered when the last clone and read are gone.
#[derive(Clone)]
pub struct FileHandle {
    inner: Arc<FileInner>,
}

impl fmt::Debug for FileHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileHandle")
            .field("path", &self.inner.path)
            .field("direct", &self.inner.direct)
            .field("size", &self.inner.size)
            .finish()
    }
}

impl FileHandle {
    /// The file's identity now (size, device, inode, mtime, ctime): one `fstat` of the open
    /// descriptor, to tell whether it changed since it was indexed.
    pub fn ident(&self) -> std::io::Result<ubdirect_ub::FileIdent> {
        use std::os::fd::AsFd;
        ubdirect_ub::FileIdent::of_fd(self.inner._fd.as_fd())
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Size at open time (`None` for descriptors of unknown size).
    pub fn size(&self) -> Option<u64> {
        self.inner.size
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.inner.direct.is_some()
    }

    /// Alignment (file offset) that reads are widened to; 1 for buffered files.
    pub fn offset_align(&self) -> u32 {
        self.inner.direct.map_or(1, |a| a.offset)
    }

    /// Alignment of the destination memory that reads need; 1 for buffered files.
    pub fn mem_align(&self) -> u32 {
        self.inner.direct.map_or(1, |a| a.mem)
    }

    /// The I/O path reads of this file take, in words.
    pub fn io_path(&self) -> &'static str {
        if self.is_direct() {
            "io_uring READ_FIXED, registered file, O_DIRECT"
        } else {
            "io_uring READ_FIXED, registered file, buffered (page cache)"
        }
    }
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

/// ENOMEM from buffer registration, with what to do about it; the engine's error is the source.
#[derive(Debug, thiserror::Error)]
#[error(
    "registering buffers pins memory against RLIMIT_MEMLOCK (ENOMEM): run as root, raise `ulimit -l`, or make the pools smaller (`pool.staging_blocks` × `pool.staging_block_size`)"
)]
struct MemlockHint(#[source] IoError);

struct EngineRegistrar {
    shared: Arc<Shared>,
}

impl Registrar for EngineRegistrar {
    fn consumer(&self) -> String {
        "io_uring fixed buffers".into()
    }

    fn register(
        &self,
        pool: &PoolDescriptor<'_>,
    ) -> Result<Box<dyn Registration>, Box<dyn std::error::Error + Send + Sync>> {
        if !pool.kind().is_host_visible() {
            return Err(
                format!("{} memory cannot be an io_uring fixed buffer", pool.kind()).into(),
            );
        }
        let n = u32::try_from(pool.blocks().len()).map_err(|_| "too many blocks")?;
        let base = self
            .shared
            .bufs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .alloc(n)
            .ok_or_else(|| {
                format!(
                    "no {n} free fixed-buffer slots left of {} (raise max_fixed_buffers)",
                    self.shared.cfg.max_fixed_buffers
                )
            })?;
        let iovecs: Vec<(usize, usize)> = pool
            .blocks()
            .iter()
            .map(|b| (b.host_ptr().map_or(0, |p| p as usize), b.len()))
            .collect();
        let iovecs = Arc::new(iovecs);
        let r = self.shared.register_buffers(base, iovecs);
        if let Err(e) = r {
            self.shared.unregister_buffers(base, n);
            self.shared
                .bufs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .release(base, n);
            if matches!(&e, IoError::Setup { source, .. } if source.raw_os_error() == Some(libc::ENOMEM))
            {
                return Err(Box::new(MemlockHint(e)));
            }
            return Err(Box::new(e));
        }
        self.shared
            .bufs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .by_pool
            .insert(pool.id(), (base, n));
        Ok(Box::new(BufferRegistration {
            shared: self.shared.clone(),
            pool: pool.id(),
            base,
            count: n,
        }))
    }
}

struct BufferRegistration {
    shared: Arc<Shared>,
    pool: PoolId,
    base: u32,
    count: u32,
}

impl fmt::Debug for BufferRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferRegistration")
            .field("pool", &self.pool)
            .field("base", &self.base)
            .field("count", &self.count)
            .finish()
    }
}

impl Registration for BufferRegistration {
    fn consumer(&self) -> String {
        format!(
            "io_uring fixed buffers {}..{}",
            self.base,
            self.base + self.count
        )
    }
}

impl Drop for BufferRegistration {
    fn drop(&mut self) {
        self.shared.unregister_buffers(self.base, self.count);
        let (base, count) = (self.base, self.count);
        let mut b = self.shared.bufs.lock().unwrap_or_else(|p| p.into_inner());
        b.by_pool.remove(&self.pool);
        b.release(base, count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(n: u32) -> PtState {
        PtState {
            table: BufTable {
                free: vec![(0, n)],
                by_pool: HashMap::new(),
            },
            by_base: HashMap::new(),
        }
    }

    #[test]
    fn passthrough_table_holds_blocks_as_chunks() {
        let mut pt = table(16);
        // Two 1 MiB blocks: four 256 KiB chunks each, in block order.
        let (e, v) = pt
            .alloc(&[(0x10_0000, 1 << 20), (0x40_0000, 1 << 20)])
            .expect("room");
        assert_eq!((e.first, e.per_block, e.count), (0, 4, 8));
        assert_eq!(v[0], (0x10_0000, PT_CHUNK));
        assert_eq!(v[3], (0x10_0000 + 3 * PT_CHUNK, PT_CHUNK));
        assert_eq!(v[4], (0x40_0000, PT_CHUNK));
        // A block smaller than a chunk is one entry; a ragged one ends short.
        let (e, v) = pt
            .alloc(&[(0x80_0000, 4096), (0x90_0000, 300 << 10)])
            .expect("room");
        assert_eq!((e.first, e.per_block, e.count), (8, 2, 4));
        assert_eq!(
            *v,
            vec![
                (0x80_0000, 4096),
                (0, 0),
                (0x90_0000, PT_CHUNK),
                (0x90_0000 + PT_CHUNK, (300 << 10) - PT_CHUNK)
            ]
        );
        // Full: none (the pool's commands go by address), never a panic.
        assert!(pt.alloc(&[(0x100_0000, 8 << 20)]).is_none());
        pt.table.release(0, 8);
        assert!(pt.alloc(&[(0x100_0000, 2 << 20)]).is_some());
    }
}
