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
pub use crate::rdma_sys::{Endpoint, device_names};

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
    /// A write's completion reported an error.
    #[error("RDMA write failed: {0}")]
    Completion(String),
    /// A write got no completion in time.
    #[error("RDMA write got no completion within {0:?}")]
    NoCompletion(Duration),
    /// The queue pair was destroyed with the write outstanding.
    #[error("RDMA write abandoned (queue pair destroyed)")]
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
    /// Completions with an error status (flushes included).
    pub failed: AtomicU64,
}

struct Waiter {
    qpn: u32,
    /// The source block: released here, when its completion arrives (or its QP is destroyed).
    hold: Option<Lease>,
    tx: oneshot::Sender<Result<(), String>>,
}

struct Shared {
    dev: Arc<Device>,
    waiters: Mutex<HashMap<u64, Waiter>>,
    regions: Mutex<HashMap<PoolId, Arc<MemoryRegion>>>,
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
            let _ = w.tx.send(match why {
                None => Ok(()),
                Some(e) => Err(e),
            });
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

    /// Connects to the peer; `remote_write` lets the peer write into our registered pools.
    pub fn connect(&self, remote: &Endpoint, remote_write: bool) -> Result<(), RdmaError> {
        self.qp
            .connect(remote, remote_write)
            .map_err(RdmaError::Verbs)
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
                tx,
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
            let _ = w.tx.send(Err("queue pair destroyed".into()));
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
        let first = pool.blocks.first().ok_or("pool has no blocks")?;
        let base = first.host_ptr.ok_or_else(|| {
            format!(
                "pool {:?} ({:?}) is not host-visible: RDMA here registers host memory only",
                pool.name, pool.kind
            )
        })?;
        // The blocks of a pool are one contiguous mapping: one region covers them all.
        for (i, b) in pool.blocks.iter().enumerate() {
            if b.host_ptr != Some(base.wrapping_add(i * pool.block_size)) {
                return Err(format!("pool {:?}: blocks are not contiguous", pool.name).into());
            }
        }
        let len = pool.block_size * pool.blocks.len();
        // SAFETY: the pool drops its registrations before unmapping its memory (ub's Registrar
        // contract), and the region is dropped with the registration or after the last write that
        // holds a lease of the pool.
        let mr = unsafe { MemoryRegion::register(&self.sh.dev, base, len, self.remote_write) }
            .map_err(RdmaError::Verbs)?;
        self.sh.stats.registrations.fetch_add(1, Ordering::Relaxed);
        self.sh
            .regions
            .lock()
            .map_err(|_| RdmaError::Poisoned)?
            .insert(pool.id, Arc::new(mr));
        Ok(Box::new(RdmaRegistration {
            sh: self.sh.clone(),
            pool: pool.id,
            device: self.sh.dev.name.clone(),
        }))
    }
}
