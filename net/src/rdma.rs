//! RDMA verbs transport (feature `rdma`): an opened device shared by every connection of a client or
//! a server, pools registered with it once at creation (a [`Registrar`]), RC queue pairs set up over
//! the TCP control connection, and one-sided RDMA WRITEs whose completions — polled by one thread per
//! device — release the source block. The safe side of `rdma_sys`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use ubdirect_ub::{Lease, PoolDescriptor, PoolId, Registrar, Registration};

use crate::rdma_sys::{self, Device, MemoryRegion};
pub use crate::rdma_sys::{Endpoint, PeerAccess};

/// Names of the RDMA devices present (empty when there are none). An error when the verbs
/// library cannot list them (`ibv_get_device_list` failed: no RDMA support in the kernel, or no
/// permission on `/dev/infiniband`).
pub fn device_names() -> Result<Vec<String>, RdmaError> {
    crate::rdma_sys::device_names().map_err(|e| RdmaError::DeviceList {
        source: std::sync::Arc::new(e),
    })
}

/// RDMA failures. Verbs calls report their own text (call and errno), kept as [`RdmaError::Verbs`].
#[derive(Debug, Clone, thiserror::Error)]
pub enum RdmaError {
    /// A verbs call failed (device open, queue pair, memory region, post).
    #[error("{0}")]
    Verbs(String),
    /// The lease's pool is not registered with this device.
    #[error("pool {pool:?} is not registered with {device}")]
    NotRegistered {
        /// Pool name.
        pool: String,
        /// Device name.
        device: String,
    },
    /// The RDMA devices could not be listed.
    #[error("ibv_get_device_list: {source}")]
    DeviceList {
        /// The OS error (shared: the error type is `Clone`).
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },
    /// The memory is not host-visible.
    #[error("RDMA needs host-visible memory (GPU memory needs GPUDirect RDMA)")]
    NotHostVisible,
    /// The range is outside the lease or its pool's memory region.
    #[error("range {off}+{len} is outside the lease or its memory region")]
    OutsideRegion {
        /// Offset in the lease.
        off: usize,
        /// Length.
        len: usize,
    },
    /// A write's or read's completion reported an error.
    #[error("RDMA operation failed: {0}")]
    Completion(String),
    /// A write or read got no completion in time.
    #[error("RDMA operation got no completion within {0:?}")]
    NoCompletion(Duration),
    /// The queue pair was destroyed with the operation outstanding.
    #[error("RDMA operation abandoned (queue pair destroyed)")]
    Abandoned,
    /// The completion thread could not start.
    #[error("cannot start the RDMA completion thread")]
    Thread(#[source] Arc<std::io::Error>),
    /// A lock was poisoned by a panic elsewhere.
    #[error("RDMA state poisoned")]
    Poisoned,
}

/// Which device and how deep.
#[derive(Debug, Clone, Default)]
pub struct RdmaConfig {
    /// Device name (`rxe0`); the first device when empty.
    pub device: String,
    /// GID index; automatic (first RoCE v2 IPv4 GID) when `None`.
    pub gid_index: Option<u8>,
}

/// Counters of one device.
#[derive(Debug, Default)]
pub struct RdmaStats {
    /// Memory regions registered (one per pool).
    pub registrations: AtomicU64,
    /// RDMA WRITEs posted.
    pub writes: AtomicU64,
    /// Bytes written.
    pub bytes: AtomicU64,
    /// RDMA READs posted.
    pub reads: AtomicU64,
    /// Bytes read.
    pub bytes_read: AtomicU64,
    /// Completions with an error status (flushes included).
    pub failed: AtomicU64,
}

struct Waiter {
    qpn: u32,
    /// The source block: released here, when its completion arrives (or its QP is destroyed).
    hold: Option<Lease>,
    tx: Notify,
}

/// Who hears of a completion: a task, or a thread blocked in a blocking operation.
enum Notify {
    Task(oneshot::Sender<Result<(), String>>),
    Thread(std::sync::mpsc::SyncSender<(u64, Result<(), String>)>),
}

impl Notify {
    fn send(self, id: u64, r: Result<(), String>) {
        match self {
            Notify::Task(tx) => {
                let _ = tx.send(r);
            }
            Notify::Thread(tx) => {
                let _ = tx.try_send((id, r));
            }
        }
    }
}

struct Shared {
    dev: Arc<Device>,
    waiters: Mutex<HashMap<u64, Waiter>>,
    regions: Mutex<HashMap<PoolId, Arc<MemoryRegion>>>,
    /// Pools peers may address one-sided (SMC regions): a read-only and, for writable ones, a
    /// read-write memory region over the same memory, each with its own rkey.
    windows: Mutex<HashMap<PoolId, Window>>,
    stop: AtomicBool,
    stats: RdmaStats,
}

/// An opened RDMA device with its completion thread. Cheap to clone.
#[derive(Clone)]
pub struct Rdma {
    sh: Arc<Shared>,
    _poller: Arc<Poller>,
    next: Arc<AtomicU64>,
}

impl std::fmt::Debug for Rdma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rdma")
            .field("device", &self.sh.dev.name)
            .field("gid_index", &self.sh.dev.gid_index)
            .finish()
    }
}

struct Poller {
    sh: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.sh.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
    }
}

impl Shared {
    /// The memory region holding `lease[off..off + len]` and that range's address: the lease's pool
    /// must be registered here and the range inside the lease and the region.
    fn locate(
        &self,
        lease: &Lease,
        off: usize,
        len: usize,
    ) -> Result<(Arc<MemoryRegion>, u64), RdmaError> {
        let mr = self
            .regions
            .lock()
            .map_err(|_| RdmaError::Poisoned)?
            .get(&lease.pool_id())
            .cloned()
            .ok_or_else(|| RdmaError::NotRegistered {
                pool: lease.pool_name().to_string(),
                device: self.dev.name.clone(),
            })?;
        let base = lease.host_ptr().ok_or(RdmaError::NotHostVisible)?;
        let outside = RdmaError::OutsideRegion { off, len };
        if lease.check_range(off, len).is_err() {
            return Err(outside);
        }
        let addr = base as u64 + off as u64;
        if addr < mr.addr || addr + len as u64 > mr.addr + mr.len {
            return Err(outside);
        }
        Ok((mr, addr))
    }
}

fn complete(sh: &Shared, done: &mut Vec<(u64, Option<String>)>) {
    for (id, why) in done.drain(..) {
        let w = sh.waiters.lock().ok().and_then(|mut m| m.remove(&id));
        if let Some(mut w) = w {
            if why.is_some() {
                sh.stats.failed.fetch_add(1, Ordering::Relaxed);
            }
            drop(w.hold.take());
            w.tx.send(
                id,
                match why {
                    None => Ok(()),
                    Some(e) => Err(e),
                },
            );
        }
    }
}

fn poll_loop(sh: Arc<Shared>) {
    let mut done = Vec::new();
    let depth = sh.dev.cq_depth as usize;
    while !sh.stop.load(Ordering::SeqCst) {
        // Drain, re-arm, drain again (a completion between the two would otherwise wait for the
        // next event), then sleep on the channel with a short timeout so `stop` is seen.
        let r = sh
            .dev
            .poll(&mut done, depth)
            .and_then(|_| sh.dev.arm())
            .and_then(|_| sh.dev.poll(&mut done, depth));
        if let Err(e) = r {
            tracing::error!(device = %sh.dev.name, "completion queue: {e}");
        }
        let got = !done.is_empty();
        complete(&sh, &mut done);
        if !got {
            let _ = sh.dev.wait(50);
        }
    }
}

impl Rdma {
    /// Opens the device and starts its completion thread.
    pub fn open(cfg: &RdmaConfig) -> Result<Self, RdmaError> {
        let name = (!cfg.device.is_empty()).then_some(cfg.device.as_str());
        let dev = Arc::new(Device::open(name, cfg.gid_index, 4096).map_err(RdmaError::Verbs)?);
        let sh = Arc::new(Shared {
            dev,
            waiters: Mutex::new(HashMap::new()),
            regions: Mutex::new(HashMap::new()),
            windows: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            stats: RdmaStats::default(),
        });
        let s2 = sh.clone();
        let t = std::thread::Builder::new()
            .name(format!("ub-rdma-{}", sh.dev.name))
            .spawn(move || poll_loop(s2))
            .map_err(|e| RdmaError::Thread(Arc::new(e)))?;
        Ok(Self {
            sh: sh.clone(),
            _poller: Arc::new(Poller {
                sh,
                thread: Mutex::new(Some(t)),
            }),
            next: Arc::new(AtomicU64::new(1)),
        })
    }

    /// Device name.
    pub fn device(&self) -> &str {
        &self.sh.dev.name
    }

    /// GID index in use.
    pub fn gid_index(&self) -> u8 {
        self.sh.dev.gid_index
    }

    /// Counters.
    pub fn stats(&self) -> &RdmaStats {
        &self.sh.stats
    }

    /// A registrar that registers a pool's blocks with this device once, at pool creation;
    /// `remote_write` lets peers write into them (client side), otherwise local access only (a
    /// server's staging blocks, which peers never address).
    pub fn registrar(&self, remote_write: bool) -> Arc<dyn Registrar> {
        Arc::new(RdmaRegistrar {
            sh: self.sh.clone(),
            remote_write,
        })
    }

    /// A registrar for memory peers address one-sided (a server's SMC regions): each pool gets a
    /// read-only memory region and, when `writable`, a read-write one over the same memory; which
    /// key a peer is given ([`Rdma::window`]) decides what it may do.
    pub fn window_registrar(&self, writable: bool) -> Arc<dyn Registrar> {
        Arc::new(WindowRegistrar {
            sh: self.sh.clone(),
            writable,
        })
    }

    /// The one-sided window over `lease` (a block of a pool registered by
    /// [`Rdma::window_registrar`]): its address and the rkey of the read-only region, or of the
    /// read-write one when `write` (`None`: not registered so, or not writable).
    pub fn window(&self, lease: &Lease, write: bool) -> Option<(u64, u32)> {
        let w = self.sh.windows.lock().ok()?.get(&lease.pool_id())?.clone();
        let addr = lease.host_ptr()? as u64;
        let mr = if write { w.rw.as_ref()? } else { &w.ro };
        (addr >= mr.addr && addr + lease.capacity() as u64 <= mr.addr + mr.len)
            .then_some((addr, mr.rkey))
    }

    /// Where a peer may write `len` bytes into `lease[off..]`: (address, rkey), when the lease's
    /// pool is registered with this device.
    pub fn remote_target(&self, lease: &Lease, off: usize, len: usize) -> Option<(u64, u32)> {
        let (mr, addr) = self.sh.locate(lease, off, len).ok()?;
        Some((addr, mr.rkey))
    }

    /// A new RC queue pair; connect it with [`QueuePair::connect`] once the peer's endpoint is known.
    pub fn queue_pair(&self, max_wr: u32) -> Result<QueuePair, RdmaError> {
        let psn = (self.next.fetch_add(7919, Ordering::Relaxed) as u32).wrapping_mul(2654435761);
        let qp = rdma_sys::QueuePair::new(&self.sh.dev, max_wr, psn).map_err(RdmaError::Verbs)?;
        Ok(QueuePair {
            reaper: Reaper {
                rdma: self.clone(),
                qpn: qp.local.qpn,
            },
            qp,
        })
    }
}

/// An RC queue pair. Dropping it destroys it and fails (and releases) whatever it still had posted.
pub struct QueuePair {
    // Field order matters: the queue pair is destroyed before the reaper releases its blocks.
    qp: rdma_sys::QueuePair,
    reaper: Reaper,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QueuePair({})", self.qp.local.qpn)
    }
}

impl QueuePair {
    /// Our endpoint, for the peer.
    pub fn endpoint(&self) -> Endpoint {
        self.qp.local
    }

    /// Connects to the peer; `peer` is what the peer may do one-sided to our memory regions (each
    /// region's access narrows it further).
    pub fn connect(&self, remote: &Endpoint, peer: PeerAccess) -> Result<(), RdmaError> {
        self.qp.connect(remote, peer).map_err(RdmaError::Verbs)
    }

    /// Writes `lease[range]` into the peer's memory at `remote_addr` (`rkey`), one-sided. The lease
    /// is held until the completion queue reports the write, then released (recycled); the result
    /// comes back within `deadline` or as an error (the caller then drops the connection, which
    /// destroys the queue pair and releases the block).
    pub async fn write(
        &self,
        lease: Lease,
        range: std::ops::Range<usize>,
        remote_addr: u64,
        rkey: u32,
        deadline: Duration,
    ) -> Result<(), RdmaError> {
        let sh = &self.reaper.rdma.sh;
        let (mr, src) = sh.locate(&lease, range.start, range.len())?;
        let id = self.reaper.rdma.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let qpn = self.qp.local.qpn;
        let len = range.len() as u32;
        sh.waiters.lock().map_err(|_| RdmaError::Poisoned)?.insert(
            id,
            Waiter {
                qpn,
                hold: Some(lease),
                tx: Notify::Task(tx),
            },
        );
        // SAFETY: `src..src+len` lies in a registered pool block now held by the waiter `id`, which
        // only the completion thread (or this queue pair's Drop, after destroying it) releases.
        let posted = unsafe {
            self.qp
                .post_write(id, src as *const u8, len, mr.lkey, remote_addr, rkey)
        };
        if let Err(e) = posted {
            let w = sh.waiters.lock().ok().and_then(|mut m| m.remove(&id));
            drop(w);
            return Err(RdmaError::Verbs(e));
        }
        sh.stats.writes.fetch_add(1, Ordering::Relaxed);
        sh.stats.bytes.fetch_add(len as u64, Ordering::Relaxed);
        match tokio::time::timeout(deadline, rx).await {
            Ok(Ok(r)) => r.map_err(RdmaError::Completion),
            Ok(Err(_)) => Err(RdmaError::Abandoned),
            Err(_) => Err(RdmaError::NoCompletion(deadline)),
        }
    }

    /// Reads `len` bytes at the peer's `remote_addr` (`rkey`) into `lease[off..]`, one-sided,
    /// blocking the calling thread until the completion or `until`. On any error the queue pair is
    /// moved to the error state first (a late READ cannot land in the lease once this returns: the
    /// device flushes it) and the caller must drop it.
    pub fn read_blocking(
        &self,
        lease: &mut Lease,
        off: usize,
        len: usize,
        remote_addr: u64,
        rkey: u32,
        until: std::time::Instant,
    ) -> Result<(), RdmaError> {
        let sh = &self.reaper.rdma.sh;
        let (mr, dst) = sh.locate(lease, off, len)?;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let id = self.track(tx)?;
        // SAFETY: `dst..dst+len` lies in a registered pool block that the caller lends us mutably
        // (no one else touches it) until this returns; it returns after the completion or, on
        // failure, after the queue pair was flushed (see `settle`).
        let posted = unsafe {
            self.qp
                .post_read(id, dst as *mut u8, len as u32, mr.lkey, remote_addr, rkey)
        };
        if let Err(e) = posted {
            self.untrack(id);
            return Err(RdmaError::Verbs(e));
        }
        sh.stats.reads.fetch_add(1, Ordering::Relaxed);
        sh.stats.bytes_read.fetch_add(len as u64, Ordering::Relaxed);
        self.settle(&rx, &mut vec![id], 0, until)
    }

    /// Writes `lease[off..off + len]` to the peer's `addr` (`rkey`) for each `(off, len, addr)` of
    /// `parts`, one-sided, all posted before waiting (at most `window` unfinished), blocking until
    /// every completion or `until`. Errors as [`QueuePair::read_blocking`].
    pub fn write_blocking(
        &self,
        lease: &Lease,
        parts: &[(usize, usize, u64)],
        rkey: u32,
        window: usize,
        until: std::time::Instant,
    ) -> Result<(), RdmaError> {
        let sh = &self.reaper.rdma.sh;
        let window = window.max(1);
        let (tx, rx) = std::sync::mpsc::sync_channel(window);
        // Every part checked before the first is posted.
        let located = parts
            .iter()
            .map(|&(off, len, addr)| {
                sh.locate(lease, off, len)
                    .map(|(mr, src)| (mr, src, len, addr))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut open: Vec<u64> = Vec::with_capacity(window);
        for (mr, src, len, addr) in located {
            if open.len() == window {
                self.settle(&rx, &mut open, window - 1, until)?;
            }
            let id = self.track(tx.clone())?;
            // SAFETY: `src..src+len` lies in a registered pool block the caller lends us (shared)
            // until this returns, which is after every completion or after the flush.
            let posted = unsafe {
                self.qp
                    .post_write(id, src as *const u8, len as u32, mr.lkey, addr, rkey)
            };
            if let Err(e) = posted {
                self.untrack(id);
                let _ = self.settle(&rx, &mut open, 0, std::time::Instant::now());
                return Err(RdmaError::Verbs(e));
            }
            sh.stats.writes.fetch_add(1, Ordering::Relaxed);
            sh.stats.bytes.fetch_add(len as u64, Ordering::Relaxed);
            open.push(id);
        }
        self.settle(&rx, &mut open, 0, until)
    }

    fn track(
        &self,
        tx: std::sync::mpsc::SyncSender<(u64, Result<(), String>)>,
    ) -> Result<u64, RdmaError> {
        let sh = &self.reaper.rdma.sh;
        let id = self.reaper.rdma.next.fetch_add(1, Ordering::Relaxed);
        sh.waiters.lock().map_err(|_| RdmaError::Poisoned)?.insert(
            id,
            Waiter {
                qpn: self.qp.local.qpn,
                hold: None,
                tx: Notify::Thread(tx),
            },
        );
        Ok(id)
    }

    fn untrack(&self, id: u64) {
        let w = self
            .reaper
            .rdma
            .sh
            .waiters
            .lock()
            .ok()
            .and_then(|mut m| m.remove(&id));
        drop(w);
    }

    /// Waits until at most `keep` of the operations in `pending` are unfinished (completions come
    /// in any order), within `until`. On a failure or a timeout the queue pair is put in the error
    /// state and every other pending operation is awaited (as a flush, for at most a second more),
    /// so that none still touches local memory when this returns — unless the device failed to
    /// flush in that second; the caller then drops the queue pair, which destroys it.
    fn settle(
        &self,
        rx: &std::sync::mpsc::Receiver<(u64, Result<(), String>)>,
        pending: &mut Vec<u64>,
        keep: usize,
        until: std::time::Instant,
    ) -> Result<(), RdmaError> {
        let mut first: Option<RdmaError> = None;
        let mut until = until;
        loop {
            let target = if first.is_some() { 0 } else { keep };
            if pending.len() <= target {
                break;
            }
            let wait = until.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(wait) {
                Ok((id, r)) => {
                    pending.retain(|&x| x != id);
                    if let (Err(e), None) = (r, &first) {
                        first = Some(RdmaError::Completion(e));
                        self.qp.set_error();
                        until = std::time::Instant::now() + Duration::from_secs(1);
                    }
                }
                Err(_) if first.is_none() => {
                    first = Some(RdmaError::NoCompletion(wait));
                    self.qp.set_error();
                    until = std::time::Instant::now() + Duration::from_secs(1);
                }
                Err(_) => break,
            }
        }
        if first.is_some() {
            for id in pending.drain(..) {
                self.untrack(id);
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // Outstanding writes complete as flushed; then the fields drop in order: the queue pair is
        // destroyed (the device touches none of its blocks any more), then the reaper releases them.
        self.qp.set_error();
    }
}

/// Releases, after its queue pair is destroyed, every block that queue pair still held.
struct Reaper {
    rdma: Rdma,
    qpn: u32,
}

impl Drop for Reaper {
    fn drop(&mut self) {
        let orphans: Vec<Waiter> = self
            .rdma
            .sh
            .waiters
            .lock()
            .map(|mut m| {
                let ids: Vec<u64> = m
                    .iter()
                    .filter(|(_, w)| w.qpn == self.qpn)
                    .map(|(k, _)| *k)
                    .collect();
                ids.into_iter().filter_map(|k| m.remove(&k)).collect()
            })
            .unwrap_or_default();
        for mut w in orphans {
            drop(w.hold.take());
            w.tx.send(0, Err("queue pair destroyed".into()));
        }
    }
}

struct RdmaRegistrar {
    sh: Arc<Shared>,
    remote_write: bool,
}

#[derive(Debug)]
struct RdmaRegistration {
    sh: Arc<Shared>,
    pool: PoolId,
    device: String,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rdma({})", self.dev.name)
    }
}

impl Registration for RdmaRegistration {
    fn consumer(&self) -> String {
        format!("rdma:{}", self.device)
    }
}

impl Drop for RdmaRegistration {
    fn drop(&mut self) {
        if let Ok(mut m) = self.sh.regions.lock() {
            m.remove(&self.pool);
        }
    }
}

impl Registrar for RdmaRegistrar {
    fn consumer(&self) -> String {
        format!("rdma:{}", self.sh.dev.name)
    }

    fn register(
        &self,
        pool: &PoolDescriptor<'_>,
    ) -> Result<Box<dyn Registration>, Box<dyn std::error::Error + Send + Sync>> {
        let (base, len) = contiguous(pool)?;
        let peer = if self.remote_write {
            PeerAccess::Write
        } else {
            PeerAccess::None
        };
        // SAFETY: the pool drops its registrations before unmapping its memory (ub's Registrar
        // contract), and the region is dropped with the registration or after the last write that
        // holds a lease of the pool.
        let mr = unsafe { MemoryRegion::register(&self.sh.dev, base, len, peer) }
            .map_err(RdmaError::Verbs)?;
        self.sh.stats.registrations.fetch_add(1, Ordering::Relaxed);
        self.sh
            .regions
            .lock()
            .map_err(|_| RdmaError::Poisoned)?
            .insert(pool.id(), Arc::new(mr));
        Ok(Box::new(RdmaRegistration {
            sh: self.sh.clone(),
            pool: pool.id(),
            device: self.sh.dev.name.clone(),
        }))
    }
}

/// The memory regions of one pool that peers address one-sided.
#[derive(Clone)]
struct Window {
    ro: Arc<MemoryRegion>,
    rw: Option<Arc<MemoryRegion>>,
}

struct WindowRegistrar {
    sh: Arc<Shared>,
    writable: bool,
}

#[derive(Debug)]
struct WindowRegistration {
    sh: Arc<Shared>,
    pool: PoolId,
    device: String,
}

impl Registration for WindowRegistration {
    fn consumer(&self) -> String {
        format!("rdma-window:{}", self.device)
    }
}

impl Drop for WindowRegistration {
    fn drop(&mut self) {
        if let Ok(mut m) = self.sh.windows.lock() {
            m.remove(&self.pool);
        }
    }
}

impl Registrar for WindowRegistrar {
    fn consumer(&self) -> String {
        format!("rdma-window:{}", self.sh.dev.name)
    }

    fn register(
        &self,
        pool: &PoolDescriptor<'_>,
    ) -> Result<Box<dyn Registration>, Box<dyn std::error::Error + Send + Sync>> {
        let (base, len) = contiguous(pool)?;
        // SAFETY: the pool drops its registrations before unmapping its memory (ub's Registrar
        // contract); both regions are dropped with the registration (the map holds the only other
        // references, removed in its Drop).
        let ro = unsafe { MemoryRegion::register(&self.sh.dev, base, len, PeerAccess::Read) }
            .map_err(RdmaError::Verbs)?;
        let rw = if self.writable {
            // SAFETY: as above.
            Some(Arc::new(
                unsafe { MemoryRegion::register(&self.sh.dev, base, len, PeerAccess::ReadWrite) }
                    .map_err(RdmaError::Verbs)?,
            ))
        } else {
            None
        };
        self.sh.stats.registrations.fetch_add(1, Ordering::Relaxed);
        self.sh
            .windows
            .lock()
            .map_err(|_| RdmaError::Poisoned)?
            .insert(
                pool.id(),
                Window {
                    ro: Arc::new(ro),
                    rw,
                },
            );
        Ok(Box::new(WindowRegistration {
            sh: self.sh.clone(),
            pool: pool.id(),
            device: self.sh.dev.name.clone(),
        }))
    }
}

/// A pool's memory as one range: its blocks must be host-visible and contiguous.
fn contiguous(
    pool: &PoolDescriptor<'_>,
) -> Result<(*mut u8, usize), Box<dyn std::error::Error + Send + Sync>> {
    let first = pool.blocks().first().ok_or("pool has no blocks")?;
    let base = first.host_ptr().ok_or_else(|| {
        format!(
            "pool {:?} ({:?}) is not host-visible: RDMA here registers host memory only",
            pool.name(),
            pool.kind()
        )
    })?;
    for (i, b) in pool.blocks().iter().enumerate() {
        if b.host_ptr() != Some(base.wrapping_add(i * pool.block_size())) {
            return Err(format!("pool {:?}: blocks are not contiguous", pool.name()).into());
        }
    }
    Ok((base, pool.block_size() * pool.blocks().len()))
}
