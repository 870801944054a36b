//! The storage server behind `ubdirect serve`: exports root directories read-only to clients that
//! present the token. Reads go through the io_uring engine into the server's own register-once pool
//! and are sent from there.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use ubdirect_nvme::{Engine, EngineConfig, FileHandle};
use ubdirect_ub::{Lease, MemoryKind, PoolConfig, UbPool};

use crate::proto::{self, Code, FrameError, Header, Kind, Msg};

/// Server settings (`[serve]` in `configs/serve.toml`).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// The token clients must present.
    pub token: Vec<u8>,
    /// Exported roots: name → directory.
    pub roots: Vec<(String, PathBuf)>,
    /// Largest read a client may ask for.
    pub max_request: u32,
    /// Reads in flight per client.
    pub max_inflight: u32,
    /// Staging blocks of the server's pool (shared by all clients).
    pub blocks: usize,
    /// Deadline for a client's hello, for the rest of every frame once its first byte arrived, and
    /// for writing every reply (a client that does not read its replies is disconnected).
    pub io_timeout: Duration,
    /// Connections open at once; one more is closed as soon as it is accepted.
    pub max_connections: usize,
    /// Connections open at once from one IP address.
    pub max_connections_per_peer: usize,
    /// Staging blocks the connections of one IP address may hold at once: reads in progress and
    /// replies not yet written (at most `blocks`).
    pub max_staging_per_peer: usize,
    /// Files one connection may have open (opening a file it already has returns the same id).
    pub max_open_files: usize,
    /// Files the connections of one IP address may have open together (the engine has 1,024 slots
    /// for the whole server).
    pub max_open_files_per_peer: usize,
    /// Connections open at once that present one token (each read-only token and the read-write
    /// token count apart): many addresses sharing a token cannot take every connection.
    pub max_connections_per_token: usize,
    /// Staging blocks the connections of one token may hold at once, over all their addresses (at
    /// most `blocks`).
    pub max_staging_per_token: usize,
    /// Files the connections of one token may have open together (engine slots).
    pub max_open_files_per_token: usize,
    /// Connections accepted that have not yet said hello with a valid token; when one more arrives,
    /// the oldest of them is closed (idle unauthenticated connections can neither take every
    /// connection nor keep new clients out until their hello deadline).
    pub max_pending_hellos: usize,
    /// Requests other than data (opens, registrations) and refused requests one connection may
    /// make a second, on average (bursts of as many); past it, its next request waits.
    pub max_control_rate: u32,
    /// After answering an SMC read, the connection polls its socket this long for the next request
    /// before going back to the runtime (faults come in bursts; catching the next one here saves the
    /// runtime's wake-up, most of a loopback fault's latency). At most a quarter of the runtime's
    /// workers poll at once, so pollers cannot starve other connections. Zero: never.
    pub smc_poll: Duration,
    /// RDMA device to offer clients (`rxe0`; empty: the first). `None`: TCP only.
    pub rdma_device: Option<String>,
    /// More tokens, each granting read-only access (files, and regions without writes).
    pub read_only_tokens: Vec<Vec<u8>>,
    /// SMC memory regions exported to clients that present the region's key.
    pub regions: Vec<RegionConfig>,
}

/// An exported SMC memory region (host memory of the server, zero-filled at start).
#[derive(Debug, Clone)]
pub struct RegionConfig {
    /// Name clients register.
    pub name: String,
    /// Bytes.
    pub size: u64,
    /// Key a client must present (with a server token).
    pub key: Vec<u8>,
    /// Whether read-write tokens may write (read-only tokens never may).
    pub writable: bool,
    /// GPU ordinal to hold the region in device memory (`None`: host memory).
    pub gpu: Option<usize>,
}

struct Region {
    cfg: RegionConfig,
    mem: RegionMem,
    /// Where peers' RDMA queue pairs may address it one-sided: (address, read-only rkey,
    /// read-write rkey when writable). Host regions in a UB pool on a server with RDMA.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    window: Option<(u64, u32, Option<u32>)>,
}

/// A host region's bytes: one block of a UB pool (page-aligned, locked, registered with the server's
/// RDMA device when there is one), or — when no such pool can be made (the memlock limit) — heap
/// memory, a recorded fallback (`smc_region_heap`).
enum HostBytes {
    Block(Lease),
    Heap(Vec<u8>),
}

impl HostBytes {
    fn get(&self, r: std::ops::Range<usize>) -> Result<&[u8], String> {
        let b = match self {
            HostBytes::Block(l) => l.as_slice().map_err(|e| e.to_string())?,
            HostBytes::Heap(v) => v,
        };
        b.get(r.clone())
            .ok_or_else(|| format!("{r:?} is outside the region's memory"))
    }

    fn get_mut(&mut self, r: std::ops::Range<usize>) -> Result<&mut [u8], String> {
        let b = match self {
            HostBytes::Block(l) => l.as_mut_slice().map_err(|e| e.to_string())?,
            HostBytes::Heap(v) => v,
        };
        b.get_mut(r.clone())
            .ok_or_else(|| format!("{r:?} is outside the region's memory"))
    }
}

/// Where a region's bytes live.
enum RegionMem {
    /// Host memory. Writes are received straight into it from the socket (the write lock is held
    /// only for each nonblocking receive, never across a wait).
    Host {
        // Field order: the lease goes back before its pool.
        bytes: std::sync::RwLock<HostBytes>,
        _pool: Option<UbPool>,
    },
    /// Device (GPU) memory: copies on a stream of its own through registered staging blocks,
    /// batched and polled (`gpu_region.rs`).
    Gpu(crate::gpu_region::GpuRegion),
}

impl Region {
    fn gpu(cfg: &RegionConfig, ordinal: usize, staging: usize) -> Result<RegionMem, String> {
        let sel = ubdirect_ub::select_device(ubdirect_ub::DeviceSelection::Cuda, ordinal)
            .map_err(|e| e.to_string())?;
        crate::gpu_region::GpuRegion::new(&cfg.name, sel.device, cfg.size as usize, staging)
            .map(RegionMem::Gpu)
    }
}

impl RegionMem {
    /// Host memory for region `r`: a one-block UB pool (locked; registered with `registrar`, the
    /// server's RDMA device, when given), or — for a region larger than a quarter of the machine's
    /// memory, or when the pool cannot be made — pageable heap memory (a recorded fallback).
    fn host(
        r: &RegionConfig,
        registrar: Option<Arc<dyn ubdirect_ub::Registrar>>,
    ) -> std::io::Result<RegionMem> {
        let (name, size) = (&r.name, r.size);
        let heap = |why: String| -> std::io::Result<RegionMem> {
            let v = zeroed_region(r)?;
            ubdirect_ub::fallback::record(
                "smc_region_heap",
                format!(
                    "smc region {name:?}: {why}: held in pageable heap memory, not registered \
                     with a transport"
                ),
            );
            Ok(RegionMem::Host {
                bytes: std::sync::RwLock::new(HostBytes::Heap(v)),
                _pool: None,
            })
        };
        if size > machine_memory() / 4 {
            return heap(format!(
                "{size} bytes is over a quarter of this machine's memory"
            ));
        }
        let block = (size as usize).div_ceil(4096) * 4096;
        let mut b = UbPool::builder(PoolConfig::new(
            format!("smc-region-{name}"),
            block,
            1,
            MemoryKind::Host,
        ));
        if let Some(r) = registrar {
            b = b.register_with(r);
        }
        // Anonymous memory: zero-filled, as regions start.
        match b.build().map(|p| (p.try_acquire(), p)) {
            Ok((Some(l), pool)) => Ok(RegionMem::Host {
                bytes: std::sync::RwLock::new(HostBytes::Block(l)),
                _pool: Some(pool),
            }),
            Ok((None, _)) => heap("its pool has no free block".into()),
            Err(e) => heap(format!("no UB pool block of {block} bytes ({e})")),
        }
    }

    fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>, String> {
        let o = offset as usize;
        match self {
            RegionMem::Host { bytes, .. } => {
                let m = bytes.read().unwrap_or_else(|p| p.into_inner());
                Ok(m.get(o..o + len)?.to_vec())
            }
            RegionMem::Gpu(_) => Err("a GPU region is served by its copy stream".into()),
        }
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        let o = offset as usize;
        match self {
            RegionMem::Host { bytes, .. } => {
                let mut m = bytes.write().unwrap_or_else(|p| p.into_inner());
                m.get_mut(o..o + data.len())?.copy_from_slice(data);
                Ok(())
            }
            RegionMem::Gpu(_) => Err("a GPU region is served by its copy stream".into()),
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7447)),
            token: Vec::new(),
            roots: Vec::new(),
            max_request: 16 << 20,
            max_inflight: 32,
            blocks: 64,
            io_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_connections_per_peer: 64,
            max_staging_per_peer: 32,
            max_open_files: 256,
            max_open_files_per_peer: 512,
            max_connections_per_token: 512,
            max_staging_per_token: 32,
            max_open_files_per_token: 512,
            max_pending_hellos: 256,
            max_control_rate: 1000,
            smc_poll: Duration::from_micros(50),
            rdma_device: None,
            read_only_tokens: Vec::new(),
            regions: Vec::new(),
        }
    }
}

/// Counters.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Connections open now.
    pub open_connections: AtomicU64,
    /// Reads served.
    pub reads: AtomicU64,
    /// Bytes sent.
    pub bytes: AtomicU64,
    /// Requests refused (auth, path, range, size, limits).
    pub refused: AtomicU64,
    /// Connections closed at once because `max_connections` or `max_connections_per_peer` was reached.
    pub rejected_connections: AtomicU64,
    /// `accept` failures (out of descriptors, …), each followed by a pause that grows to 1 s.
    pub accept_errors: AtomicU64,
    /// Connections closed because a reply could not be written within `io_timeout`.
    pub write_timeouts: AtomicU64,
    /// Log lines not written (refusals and accept errors are logged at most once a second each).
    pub logs_suppressed: AtomicU64,
    /// Reads whose payload went by RDMA WRITE.
    pub rdma_reads: AtomicU64,
    /// Reads sent straight from the page cache by `sendfile` (resident ranges; the rest are read
    /// into a staging block first).
    pub page_cache_reads: AtomicU64,
    /// SMC region reads served.
    pub smc_reads: AtomicU64,
    /// SMC region writes applied.
    pub smc_writes: AtomicU64,
    /// SMC bytes written.
    pub smc_bytes_written: AtomicU64,
}

/// The engine's registered-file slots (`EngineConfig::default().max_files`), shared by every
/// connection of the server.
const ENGINE_FILES: usize = 1024;

struct Shared {
    cfg: ServerConfig,
    roots: HashMap<String, PathBuf>,
    engine: Engine,
    pool: UbPool,
    stats: Arc<ServerStats>,
    /// Connections and staging blocks per IP address (an entry lives while it has connections).
    peers: std::sync::Mutex<HashMap<IpAddr, Peer>>,
    /// Per token (the read-write token first, then each read-only token): its connections, its
    /// share of the staging blocks and of the file slots.
    tokens: Vec<TokenShare>,
    /// Engine file slots in use by all connections.
    open_files: Arc<AtomicUsize>,
    /// Connections accepted that have not said hello yet, and (oldest first) the flags and tasks of
    /// those that may still be waiting for it.
    pending_hellos: AtomicUsize,
    pending_queue: std::sync::Mutex<
        std::collections::VecDeque<(Arc<std::sync::atomic::AtomicBool>, tokio::task::AbortHandle)>,
    >,
    /// A connection ended since the heap was last trimmed.
    trim_due: std::sync::atomic::AtomicBool,
    /// One log line a second for refusals, one for accept errors and rejected connections.
    refusal_log: LogLimit,
    accept_log: LogLimit,
    regions: Vec<Region>,
    /// The runtime's workers, and how many connections poll for their next SMC request now.
    workers: usize,
    polling: AtomicUsize,
    #[cfg(feature = "rdma")]
    rdma: Option<crate::rdma::Rdma>,
}

/// One IP address's connections and its share of the staging pool.
struct Peer {
    conns: usize,
    staging: Arc<Semaphore>,
    /// Files its connections have open (engine slots).
    files: Arc<AtomicUsize>,
}

/// One token's connections and its shares of the staging blocks and file slots.
struct TokenShare {
    conns: AtomicUsize,
    staging: Arc<Semaphore>,
    files: Arc<AtomicUsize>,
}

/// Holds a connection's place in its token's connection count until dropped.
struct TokenSlot<'a> {
    share: &'a TokenShare,
}

impl<'a> TokenSlot<'a> {
    /// A place among the connections of token `i`, or how many it has.
    fn take(s: &'a Shared, i: usize) -> Result<Self, usize> {
        let share = &s.tokens[i];
        let n = share.conns.fetch_add(1, Ordering::Relaxed);
        if n >= s.cfg.max_connections_per_token {
            share.conns.fetch_sub(1, Ordering::Relaxed);
            return Err(n);
        }
        Ok(Self { share })
    }
}

impl Drop for TokenSlot<'_> {
    fn drop(&mut self) {
        self.share.conns.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Holds a connection's place in the connection counts (total and per peer) until dropped, also
/// when its task is aborted.
struct ConnSlot {
    s: Arc<Shared>,
    ip: IpAddr,
    staging: Arc<Semaphore>,
    files: Arc<AtomicUsize>,
    /// Still counted among the connections that have not said hello.
    pending: Arc<std::sync::atomic::AtomicBool>,
}

impl ConnSlot {
    /// Takes a place for a connection from `ip`, or says which cap is reached.
    fn take(s: &Arc<Shared>, ip: IpAddr) -> Result<Self, &'static str> {
        let mut peers = s.peers.lock().unwrap_or_else(|p| p.into_inner());
        if s.stats.open_connections.load(Ordering::Relaxed) >= s.cfg.max_connections as u64 {
            return Err("serve.max_connections");
        }
        let share = s.cfg.max_staging_per_peer.clamp(1, s.cfg.blocks.max(1));
        let p = peers.entry(ip).or_insert_with(|| Peer {
            conns: 0,
            staging: Arc::new(Semaphore::new(share)),
            files: Arc::default(),
        });
        if p.conns >= s.cfg.max_connections_per_peer {
            return Err("serve.max_connections_per_peer");
        }
        p.conns += 1;
        s.stats.open_connections.fetch_add(1, Ordering::Relaxed);
        s.pending_hellos.fetch_add(1, Ordering::Relaxed);
        Ok(Self {
            s: s.clone(),
            ip,
            staging: p.staging.clone(),
            files: p.files.clone(),
            pending: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        })
    }

    /// Makes room for one more connection that has not said hello: at `serve.max_pending_hellos`,
    /// the oldest such connection is closed (its task aborted; its slot goes back as it drops).
    fn evict_pending(s: &Shared) {
        let mut q = s.pending_queue.lock().unwrap_or_else(|p| p.into_inner());
        while q.front().is_some_and(|(p, _)| !p.load(Ordering::Relaxed)) {
            q.pop_front();
        }
        if s.pending_hellos.load(Ordering::Relaxed) < s.cfg.max_pending_hellos {
            return;
        }
        while let Some((p, task)) = q.pop_front() {
            if p.load(Ordering::Relaxed) {
                task.abort();
                s.stats.rejected_connections.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }

    /// The connection said hello (or is closing): no longer counted among the pending ones.
    fn hello_done(&self) {
        if self.pending.swap(false, Ordering::Relaxed) {
            self.s.pending_hellos.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.hello_done();
        self.s
            .trim_due
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let mut peers = self.s.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = peers.get_mut(&self.ip) {
            p.conns = p.conns.saturating_sub(1);
            if p.conns == 0 {
                peers.remove(&self.ip);
            }
        }
        self.s
            .stats
            .open_connections
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// At most one log line a second; the lines held back are counted (`ServerStats::logs_suppressed`)
/// and their number is told with the next line.
struct LogLimit {
    start: std::time::Instant,
    /// Milliseconds since `start` before which nothing more is logged.
    next_ms: AtomicU64,
    held: AtomicU64,
}

impl LogLimit {
    fn new() -> Self {
        Self {
            start: std::time::Instant::now(),
            next_ms: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// `Some(lines held back since the last one)` when a line may be written now.
    fn allow(&self, stats: &ServerStats) -> Option<u64> {
        let now = self.start.elapsed().as_millis() as u64;
        let next = self.next_ms.load(Ordering::Relaxed);
        if now >= next
            && self
                .next_ms
                .compare_exchange(next, now + 1000, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.held.swap(0, Ordering::Relaxed));
        }
        self.held.fetch_add(1, Ordering::Relaxed);
        stats.logs_suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// A token bucket: at most `rate` requests a second on average (bursts of `rate`); past it, the
/// connection waits before its next request is read.
struct Pace {
    rate: f64,
    tokens: f64,
    last: std::time::Instant,
}

impl Pace {
    fn new(rate: u32) -> Self {
        let rate = rate.max(1) as f64;
        Self {
            rate,
            tokens: rate,
            last: std::time::Instant::now(),
        }
    }

    /// Takes a token, waiting for one when there is none.
    async fn wait(&mut self) {
        let now = std::time::Instant::now();
        let refill = now.duration_since(self.last).as_secs_f64() * self.rate;
        self.tokens = (self.tokens + refill).min(self.rate) - 1.0;
        self.last = now;
        if self.tokens < 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(-self.tokens / self.rate)).await;
        }
    }
}

/// The pause after a failed `accept` (out of descriptors): it doubles up to a second while accepts
/// keep failing, so a full descriptor table costs a few wake-ups a second instead of a busy loop.
fn accept_backoff(prev: Duration) -> Duration {
    (prev * 2).clamp(Duration::from_millis(5), Duration::from_secs(1))
}

/// A running server. Dropping it (or [`Server::shutdown`]) stops it and drops every connection.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    stats: Arc<ServerStats>,
    pool: UbPool,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Binds and starts serving on the current tokio runtime.
    pub async fn start(cfg: ServerConfig) -> std::io::Result<Self> {
        let mut roots = HashMap::new();
        for (name, dir) in &cfg.roots {
            let canon = std::fs::canonicalize(dir).map_err(|e| {
                std::io::Error::new(e.kind(), format!("root {name:?} = {}: {e}", dir.display()))
            })?;
            if !canon.is_dir() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("root {name:?} = {}: not a directory", dir.display()),
                ));
            }
            roots.insert(name.clone(), canon);
        }
        if cfg.token.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "serve: an empty token would admit anyone; set one",
            ));
        }
        let all_tokens: Vec<&Vec<u8>> = std::iter::once(&cfg.token)
            .chain(&cfg.read_only_tokens)
            .collect();
        if (1..all_tokens.len()).any(|i| all_tokens[..i].contains(&all_tokens[i])) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "serve: token and read_only_tokens must all differ (each has its own limits)",
            ));
        }
        let engine = Engine::new(EngineConfig {
            max_files: ENGINE_FILES as u32,
            ..EngineConfig::default()
        })
        .map_err(std::io::Error::other)?;
        let block = (cfg.max_request as usize + 8192).div_ceil(4096) * 4096;
        let builder = UbPool::builder(PoolConfig::new(
            "serve",
            block,
            cfg.blocks.max(1),
            MemoryKind::Host,
        ))
        .register_with(engine.registrar());
        #[cfg(feature = "rdma")]
        let (builder, rdma) = match &cfg.rdma_device {
            Some(d) => {
                let r = crate::rdma::Rdma::open(&crate::rdma::RdmaConfig {
                    device: d.clone(),
                    gid_index: None,
                })
                .map_err(|e| std::io::Error::other(format!("serve: rdma: {e}")))?;
                tracing::info!(
                    device = r.device(),
                    gid_index = r.gid_index(),
                    "serving RDMA"
                );
                // Local access only: peers never address the server's memory.
                (builder.register_with(r.registrar(false)), Some(r))
            }
            None => (builder, None),
        };
        #[cfg(not(feature = "rdma"))]
        if cfg.rdma_device.is_some() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "serve: rdma_device is set but this build has no RDMA (build with --features rdma)",
            ));
        }
        let pool = builder.build().map_err(std::io::Error::other)?;
        let mut regions = Vec::new();
        for r in &cfg.regions {
            if r.key.len() < 8 || r.size == 0 || r.size > 1 << 40 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "serve: region {:?} needs a key of >= 8 bytes and a size in 1 B ..= 1 TiB",
                        r.name
                    ),
                ));
            }
            // Host regions are exposed to peers' queue pairs one-sided: a read-only memory region,
            // and a read-write one when the region is writable (the key a peer gets follows its
            // token's access).
            #[cfg(feature = "rdma")]
            let region_registrar = rdma.as_ref().map(|d| d.window_registrar(r.writable));
            #[cfg(not(feature = "rdma"))]
            let region_registrar: Option<Arc<dyn ubdirect_ub::Registrar>> = None;
            let mem = match r.gpu {
                None => RegionMem::host(r, region_registrar)?,
                Some(ordinal) => {
                    Region::gpu(r, ordinal, cfg.max_request as usize).map_err(|e| {
                        std::io::Error::other(format!(
                            "serve: region {:?} on gpu {ordinal}: {e}",
                            r.name
                        ))
                    })?
                }
            };
            #[cfg(feature = "rdma")]
            let window = match (&rdma, &mem) {
                (Some(d), RegionMem::Host { bytes, .. }) => {
                    let b = bytes.read().unwrap_or_else(|p| p.into_inner());
                    match &*b {
                        HostBytes::Block(l) => d
                            .window(l, false)
                            .map(|(addr, ro)| (addr, ro, d.window(l, true).map(|w| w.1))),
                        HostBytes::Heap(_) => None,
                    }
                }
                _ => None,
            };
            #[cfg(not(feature = "rdma"))]
            let window = None;
            regions.push(Region {
                cfg: r.clone(),
                mem,
                window,
            });
        }
        let listener = TcpListener::bind(cfg.listen).await?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(ServerStats::default());
        let shared = Arc::new(Shared {
            cfg: cfg.clone(),
            roots,
            engine,
            pool: pool.clone(),
            stats: stats.clone(),
            peers: std::sync::Mutex::new(HashMap::new()),
            tokens: (0..=cfg.read_only_tokens.len())
                .map(|_| TokenShare {
                    conns: AtomicUsize::new(0),
                    staging: Arc::new(Semaphore::new(
                        cfg.max_staging_per_token.clamp(1, cfg.blocks.max(1)),
                    )),
                    files: Arc::default(),
                })
                .collect(),
            open_files: Arc::default(),
            pending_hellos: AtomicUsize::new(0),
            pending_queue: std::sync::Mutex::new(std::collections::VecDeque::new()),
            trim_due: std::sync::atomic::AtomicBool::new(false),
            refusal_log: LogLimit::new(),
            workers: tokio::runtime::Handle::current().metrics().num_workers(),
            polling: AtomicUsize::new(0),
            accept_log: LogLimit::new(),
            regions,
            #[cfg(feature = "rdma")]
            rdma,
        });
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            let mut pause = Duration::ZERO;
            // Memory that ended connections gave back to the allocator is returned to the system
            // (at most once a second): a burst of connections does not leave the server larger.
            let mut trim = tokio::time::interval(Duration::from_secs(1));
            trim.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = trim.tick() => {
                        if shared.trim_due.swap(false, Ordering::Relaxed) {
                            let _ = tokio::task::spawn_blocking(crate::sys::trim_heap).await;
                        }
                    }
                    a = listener.accept() => match a {
                        Ok((sock, peer)) => {
                            pause = Duration::ZERO;
                            let s = shared.clone();
                            ConnSlot::evict_pending(&s);
                            // Counted here, before the task runs, so a burst cannot overshoot a cap.
                            let slot = match ConnSlot::take(&s, peer.ip()) {
                                Ok(slot) => slot,
                                Err(cap) => {
                                    // Closed at once: the peer sees a reset, not a hang.
                                    s.stats.rejected_connections.fetch_add(1, Ordering::Relaxed);
                                    if let Some(held) = s.accept_log.allow(&s.stats) {
                                        tracing::warn!(%peer, held, "connection refused: {cap} reached");
                                    }
                                    drop(sock);
                                    continue;
                                }
                            };
                            let _ = sock.set_nodelay(true);
                            s.stats.connections.fetch_add(1, Ordering::Relaxed);
                            let pending = slot.pending.clone();
                            let track = s.clone();
                            let task = conns.spawn(async move {
                                if let Err(e) = serve_conn(s.clone(), sock, &slot).await {
                                    tracing::debug!(%peer, "connection closed: {e}");
                                }
                                drop(slot);
                            });
                            if pending.load(Ordering::Relaxed) {
                                track
                                    .pending_queue
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .push_back((pending, task));
                            }
                        }
                        Err(e) => {
                            // Out of descriptors (EMFILE, ENFILE) or memory: the connection stays in
                            // the backlog, so an immediate retry fails the same way. Pause instead.
                            shared.stats.accept_errors.fetch_add(1, Ordering::Relaxed);
                            pause = accept_backoff(pause);
                            if let Some(held) = shared.accept_log.allow(&shared.stats) {
                                tracing::warn!(held, "accept: {e}; pausing {pause:?}");
                            }
                            tokio::time::sleep(pause).await;
                        }
                    },
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(Self {
            addr,
            stats,
            pool,
            task,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<ServerStats> {
        &self.stats
    }

    /// The server's staging pool (free blocks return as reads are sent).
    pub fn pool_stats(&self) -> ubdirect_ub::PoolStats {
        self.pool.stats()
    }

    /// Stops listening and drops every connection at once (as a crash would, for clients).
    pub fn shutdown(self) {
        self.task.abort();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

enum Out {
    Control(Vec<u8>),
    Data {
        id: u64,
        lease: Lease,
        range: std::ops::Range<usize>,
        /// The read's in-flight permit and its share of the peer's staging blocks: released once
        /// the reply is written (or given up), with the block.
        _hold: Hold,
    },
    /// A resident range of a file, sent from the page cache by `sendfile`. The reply still holds a
    /// staging block (the payload goes through it only where `sendfile` is refused), so the limits
    /// on blocks count it like any read.
    File {
        id: u64,
        file: Arc<std::fs::File>,
        offset: u64,
        len: u32,
        block: Lease,
        _hold: Hold,
    },
    /// Close the connection (its data path failed).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    Close,
}

/// Counts a refusal and logs it (at most one line a second: a client cannot flood the log).
fn refuse(s: &Shared, peer: &str, what: &str) {
    s.stats.refused.fetch_add(1, Ordering::Relaxed);
    if let Some(held) = s.refusal_log.allow(&s.stats) {
        tracing::warn!(peer, held, "refused: {what}");
    }
}

/// A host region's memory, zeroed, or an error when the machine cannot hold it (instead of the
/// allocation failure that would abort the process).
fn zeroed_region(r: &RegionConfig) -> std::io::Result<Vec<u8>> {
    let too_big = |why: String| {
        std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!("serve: region {:?} of {} bytes: {why}", r.name, r.size),
        )
    };
    let memory = machine_memory();
    if r.size > memory {
        return Err(too_big(format!(
            "more than this machine's memory and swap ({memory} bytes)"
        )));
    }
    let n = usize::try_from(r.size).map_err(|_| too_big("not addressable".into()))?;
    // Reserved first (an error, not an abort, when refused), then filled lazily by zero pages.
    let mut probe = Vec::<u8>::new();
    probe
        .try_reserve_exact(n)
        .map_err(|e| too_big(e.to_string()))?;
    drop(probe);
    Ok(vec![0u8; n])
}

/// `MemTotal` + `SwapTotal` of `/proc/meminfo`, in bytes (`u64::MAX` when it cannot be read).
fn machine_memory() -> u64 {
    let Ok(m) = std::fs::read_to_string("/proc/meminfo") else {
        return u64::MAX;
    };
    let kib = |key: &str| {
        m.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
    };
    match (kib("MemTotal:"), kib("SwapTotal:")) {
        (Some(a), b) => a.saturating_add(b.unwrap_or(0)).saturating_mul(1024),
        _ => u64::MAX,
    }
}

/// What a read holds until its reply is written: its in-flight permit and its staging permits (its
/// address's share and its token's).
type Hold = (tokio::sync::OwnedSemaphorePermit, Shares);

/// A read's place in its address's and its token's shares of the staging blocks.
type Shares = [tokio::sync::OwnedSemaphorePermit; 2];

/// A file opened on a connection: its handle, its size at the open, and its name as the client
/// gave it (`root/path`: error frames name files this way, never by their server path).
struct OpenFile {
    f: FileHandle,
    /// The descriptor the open was checked on (buffered): resident ranges are sent from it.
    plain: Arc<std::fs::File>,
    size: u64,
    name: String,
}

/// Files opened on one connection: ids are indices; the same name, or the same file (device, inode)
/// under another name, opened again gets its first id, so repeated opens take no more engine slots
/// (and the same name costs no system call). Its files count against its address's budget until
/// it is dropped.
struct Files {
    list: Vec<OpenFile>,
    by_inode: HashMap<(u64, u64), u32>,
    by_name: HashMap<(String, String), u32>,
    /// Engine slots held: by this address, by this token, by the whole server.
    budgets: [Arc<AtomicUsize>; 3],
}

impl Files {
    fn new(peer: Arc<AtomicUsize>, token: Arc<AtomicUsize>, all: Arc<AtomicUsize>) -> Self {
        Self {
            list: Vec::new(),
            by_inode: HashMap::new(),
            by_name: HashMap::new(),
            budgets: [peer, token, all],
        }
    }

    /// Takes one engine slot of each budget, or says which is full (and how many it holds).
    fn take_slot(&self, limits: [usize; 3]) -> Result<(), (usize, usize)> {
        for (k, (b, &limit)) in self.budgets.iter().zip(&limits).enumerate() {
            let held = b.fetch_add(1, Ordering::Relaxed);
            if held >= limit {
                for b in &self.budgets[..=k] {
                    b.fetch_sub(1, Ordering::Relaxed);
                }
                return Err((k, held));
            }
        }
        Ok(())
    }

    /// Gives one engine slot back to each budget.
    fn give_slot(&self) {
        for b in &self.budgets {
            b.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        for b in &self.budgets {
            b.fetch_sub(self.list.len(), Ordering::Relaxed);
        }
    }
}

/// The innermost cause of an error, for an error frame (outer layers of engine errors name server
/// paths).
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut e = e;
    while let Some(next) = e.source() {
        e = next;
    }
    e.to_string()
}

/// Opens `root/path` for connection `files` (or returns the id it already has there): resolved
/// under the root, opened without following a last symlink and without blocking (`O_NONBLOCK`: a
/// FIFO swapped in after the check cannot block a worker), checked on the descriptor (a regular
/// file, still under the root), then handed to the engine through the descriptor itself.
fn open_file(
    s: &Shared,
    files: &mut Files,
    root: &str,
    path: &str,
) -> Result<(u32, u64), (Code, String)> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let key = (root.to_string(), path.to_string());
    if let Some(&id) = files.by_name.get(&key)
        && let Some(f) = files.list.get(id as usize)
    {
        return Ok((id, f.size));
    }
    let name = format!("{root}/{path}");
    let full = || {
        (
            Code::TooLarge,
            format!(
                "{name}: this connection has {} files open already (serve.max_open_files)",
                files.list.len()
            ),
        )
    };
    if files.list.len() >= s.cfg.max_open_files {
        // Refused before any system call: past its cap, a connection's opens cost nothing.
        return Err(full());
    }
    let (base, canon) = resolve(&s.roots, root, path)?;
    let check = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY)
        .open(&canon)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => (
                Code::Forbidden,
                format!("{name} leads out of the root (symlink)"),
            ),
            Some(libc::ENOENT) => (Code::NotFound, format!("{name}: {e}")),
            _ => (Code::Io, format!("{name}: {e}")),
        })?;
    let meta = check
        .metadata()
        .map_err(|e| (Code::Io, format!("{name}: {e}")))?;
    if !meta.is_file() {
        return Err((Code::NotFound, format!("{name} is not a regular file")));
    }
    // The descriptor's own path: a directory on the way swapped for a symlink after the check
    // shows here.
    let fd_path = format!("/proc/self/fd/{}", check.as_raw_fd());
    match std::fs::read_link(&fd_path) {
        Ok(real) if real.starts_with(base) => {}
        Ok(_) => {
            return Err((
                Code::Forbidden,
                format!("{name} leads out of the root (symlink)"),
            ));
        }
        Err(e) => return Err((Code::Io, format!("{name}: cannot check the open file: {e}"))),
    }
    let inode = (meta.dev(), meta.ino());
    if let Some(&id) = files.by_inode.get(&inode)
        && let Some(f) = files.list.get(id as usize)
    {
        // Names of files already open: remembered up to a bound (a root full of links to one file
        // cannot grow the map without end).
        if files.by_name.len() < 4 * s.cfg.max_open_files {
            files.by_name.insert(key, id);
        }
        return Ok((id, f.size));
    }
    // A slot of the address's budget of engine slots (given back if the open fails, or with the
    // connection's files).
    let limits = [
        s.cfg.max_open_files_per_peer,
        s.cfg.max_open_files_per_token,
        ENGINE_FILES,
    ];
    if let Err((which, held)) = files.take_slot(limits) {
        let who = [
            "this address has {held} files open already (serve.max_open_files_per_peer)",
            "this token has {held} files open already (serve.max_open_files_per_token)",
            "all of the server's {held} file slots are in use (serve.max_open_files_per_token bounds each token's share)",
        ][which]
            .replace("{held}", &held.to_string());
        return Err((Code::TooLarge, format!("{name}: {who}")));
    }
    // Through the checked descriptor: the engine opens that very file (O_DIRECT where it can).
    let f = s.engine.open(&fd_path).map_err(|e| {
        files.give_slot();
        tracing::debug!("open {}: {e}", canon.display());
        (Code::Io, format!("{name}: cannot open: {}", root_cause(&e)))
    })?;
    // A regular file now: blocking again, so that `sendfile` from it never answers EAGAIN for the
    // file's side (which would read as a full socket).
    nix::fcntl::fcntl(
        &check,
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
    )
    .map_err(|e| {
        files.give_slot();
        (Code::Io, format!("{name}: {e}"))
    })?;
    let size = f.size().unwrap_or(meta.len());
    let id = files.list.len() as u32;
    files.list.push(OpenFile {
        f,
        plain: Arc::new(check),
        size,
        name,
    });
    files.by_inode.insert(inode, id);
    files.by_name.insert(key, id);
    Ok((id, size))
}

/// Resolves `path` under root `root`, refusing anything that leaves it: the root's directory and
/// the canonical path.
fn resolve<'a>(
    roots: &'a HashMap<String, PathBuf>,
    root: &str,
    path: &str,
) -> Result<(&'a Path, PathBuf), (Code, String)> {
    let base = roots
        .get(root)
        .ok_or_else(|| (Code::NotFound, format!("no exported root {root:?}")))?;
    let p = Path::new(path);
    if p.as_os_str().is_empty()
        || p.is_absolute()
        || p.components().any(|c| !matches!(c, Component::Normal(_)))
    {
        return Err((
            Code::Forbidden,
            format!("path {path:?} is absolute or leaves the root"),
        ));
    }
    let canon = std::fs::canonicalize(base.join(p))
        .map_err(|e| (Code::NotFound, format!("{root}/{path}: {e}")))?;
    if !canon.starts_with(base) {
        return Err((
            Code::Forbidden,
            format!("{root}/{path} leads out of the root (symlink)"),
        ));
    }
    Ok((base, canon))
}

/// Writes `bytes` within `deadline`; a client that does not take them in time is an error
/// (`TimedOut`), and the connection is closed.
async fn write_within<W: tokio::io::AsyncWrite + Unpin + ?Sized>(
    wr: &mut W,
    parts: &[&[u8]],
    deadline: Duration,
) -> std::io::Result<()> {
    let all = async {
        for p in parts {
            wr.write_all(p).await?;
        }
        Ok(())
    };
    match tokio::time::timeout(deadline, all).await {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("reply not taken by the client within {deadline:?}"),
        )),
    }
}

async fn serve_conn(s: Arc<Shared>, sock: TcpStream, slot: &ConnSlot) -> std::io::Result<()> {
    let peer = sock.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let (mut rd, mut wr) = sock.into_split();
    let t = s.cfg.io_timeout;
    // Hello first, within the deadline, with the right token.
    let io_err = |e: FrameError| std::io::Error::other(e);
    // The whole hello within the deadline (not each of its parts: a peer sending it byte by byte
    // holds a connection no longer than one that sends nothing).
    let hello = match tokio::time::timeout(t, proto::read_frame(&mut rd, 0, t, t)).await {
        Ok(Ok(f)) => Some(f),
        Ok(Err(FrameError::Closed)) => None,
        Ok(Err(e)) => return Err(io_err(e)),
        Err(_) => {
            return Err(io_err(FrameError::Timeout {
                what: "hello",
                deadline: t,
            }));
        }
    };
    let token = match &hello {
        Some((h, p)) if h.kind == Kind::Hello => match Msg::decode(Kind::Hello, p) {
            Ok(Msg::Hello { token }) => Some(token),
            _ => None,
        },
        _ => None,
    };
    // Every candidate is compared (constant time each), so the time says nothing about which matched;
    // `which` is the matching token's place (read-write first), found without branching on it.
    let which = token.as_ref().map_or(0, |t| {
        std::iter::once(&s.cfg.token)
            .chain(&s.cfg.read_only_tokens)
            .enumerate()
            .fold(0usize, |acc, (i, k)| {
                acc | (proto::constant_time_eq(t, k) as usize * (i + 1))
            })
    });
    let rw = which == 1;
    let ok = which != 0 && which <= s.tokens.len();
    let id = hello.as_ref().map_or(0, |h| h.0.id);
    slot.hello_done();
    if !ok {
        refuse(&s, &peer, "wrong or missing token");
        let no = Msg::Error {
            code: Code::Auth,
            message: "wrong or missing token".into(),
        }
        .frame(id);
        let _ = write_within(&mut wr, &[&no], t).await;
        return Ok(());
    }
    // The token's share of connections: many addresses presenting one token cannot take them all.
    let token_slot = match TokenSlot::take(&s, which - 1) {
        Ok(t) => t,
        Err(n) => {
            let why =
                format!("this token has {n} connections open (serve.max_connections_per_token)");
            refuse(&s, &peer, &why);
            let no = Msg::Error {
                code: Code::Busy,
                message: why,
            }
            .frame(id);
            let _ = write_within(&mut wr, &[&no], t).await;
            return Ok(());
        }
    };
    let token_share = token_slot.share;
    let yes = Msg::HelloOk {
        max_request: s.cfg.max_request,
        max_inflight: s.cfg.max_inflight,
    }
    .frame(id);
    write_within(&mut wr, &[&yes], t).await?;
    let (tx, mut rx) = mpsc::channel::<Out>(s.cfg.max_inflight as usize * 2 + 8);
    // Shared so that SMC replies, produced in order by this loop, are written at once (no hop
    // through the writer task: that hop is part of every page fault's latency). Frames stay whole.
    let wr = Arc::new(tokio::sync::Mutex::new(wr));
    let (wr2, s3) = (wr.clone(), s.clone());
    // Every reply is written within the deadline: a client that stops reading is disconnected, and
    // the blocks its replies hold go back.
    let mut writer = tokio::spawn(async move {
        let mut next = None;
        loop {
            let o = match next.take() {
                Some(o) => o,
                None => match rx.recv().await {
                    Some(o) => o,
                    None => break,
                },
            };
            let mut wr = wr2.lock().await;
            let r = match o {
                Out::Control(mut f) => {
                    // Control replies queued behind this one go out in the same write: a client
                    // pipelining small requests costs one system call per batch, not per reply.
                    while f.len() < 64 << 10 {
                        match rx.try_recv() {
                            Ok(Out::Control(g)) => f.extend_from_slice(&g),
                            Ok(other) => {
                                next = Some(other);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    write_within(&mut *wr, &[&f], t).await
                }
                Out::Close => break,
                Out::File {
                    id,
                    file,
                    offset,
                    len,
                    mut block,
                    ..
                } => {
                    let h = Header {
                        kind: Kind::ReadOk,
                        id,
                        len,
                    }
                    .encode();
                    let send = crate::zerocopy::send_file(
                        &mut wr,
                        &h,
                        &file,
                        offset,
                        len as usize,
                        &mut block,
                    );
                    match tokio::time::timeout(t, send).await {
                        Ok(r) => r,
                        Err(_) => Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("reply not taken by the client within {t:?}"),
                        )),
                    }
                }
                Out::Data {
                    id, lease, range, ..
                } => {
                    let h = Header {
                        kind: Kind::ReadOk,
                        id,
                        len: range.len() as u32,
                    }
                    .encode();
                    match lease.as_slice() {
                        Ok(b) => write_within(&mut *wr, &[&h, &b[range]], t).await,
                        Err(e) => Err(std::io::Error::other(e)),
                    }
                }
            };
            if let Err(e) = r {
                if e.kind() == std::io::ErrorKind::TimedOut {
                    s3.stats.write_timeouts.fetch_add(1, Ordering::Relaxed);
                }
                break;
            }
        }
    });
    let mut writer_done = false;
    let inflight = Arc::new(Semaphore::new(s.cfg.max_inflight as usize));
    let mut pace = Pace::new(s.cfg.max_control_rate);
    let mut files = Files::new(
        slot.files.clone(),
        token_share.files.clone(),
        s.open_files.clone(),
    );
    #[cfg(feature = "rdma")]
    let mut qp: Option<Arc<crate::rdma::QueuePair>> = None;
    // SMC regions registered on this connection: (index into s.regions, may write).
    let mut opened: Vec<(usize, bool)> = Vec::new();
    let err = |id, c, m: String| {
        Out::Control(
            Msg::Error {
                code: c,
                message: m,
            }
            .frame(id),
        )
    };
    let result = loop {
        // Quiet between requests for up to an hour; a frame, once begun, arrives within io_timeout
        // (its payload's memory grows as its bytes arrive, or it goes straight into a region). A
        // writer that gave up ends it all.
        let header = tokio::select! {
            h = proto::read_header_within(&mut rd, s.cfg.max_request.saturating_add(12), proto::IDLE, t) => h,
            _ = &mut writer => {
                writer_done = true;
                break Ok(());
            }
        };
        let h = match header {
            Ok(h) => h,
            Err(FrameError::Closed) => break Ok(()),
            Err(e) => break Err(io_err(e)),
        };
        if matches!(h.kind, Kind::SmcWrite | Kind::SmcWriteV) {
            // Into a host region straight from the socket: no frame buffer, no copy.
            let (f, go_on) = match smc_receive(&s, &peer, &opened, &mut rd, h).await {
                Ok(v) => v,
                Err(e) => break Err(e),
            };
            if let Err(e) = smc_reply(&s, &wr, &f).await {
                break Err(e);
            }
            if go_on {
                continue;
            }
            break Ok(());
        }
        let p = match proto::read_payload_vec(&mut rd, h.len, t).await {
            Ok(p) => p,
            Err(e) => break Err(io_err(e)),
        };
        let msg = match Msg::decode(h.kind, &p) {
            Ok(m) => m,
            Err(e) => {
                refuse(&s, &peer, &format!("malformed frame: {e}"));
                let _ = tx.send(err(h.id, Code::Protocol, e.to_string())).await;
                break Ok(());
            }
        };
        // Opens, registrations and anything else that is not data are paced (so are refused
        // reads, below): a client spamming them gets its share of the server at that rate.
        if !matches!(
            msg,
            Msg::Read { .. } | Msg::ReadTo { .. } | Msg::SmcRead { .. }
        ) {
            pace.wait().await;
        }
        match msg {
            Msg::Open { root, path } => match open_file(&s, &mut files, &root, &path) {
                Ok((file, size)) => {
                    let _ = tx
                        .send(Out::Control(Msg::OpenOk { file, size }.frame(h.id)))
                        .await;
                }
                Err((c, m)) => {
                    refuse(&s, &peer, &m);
                    let _ = tx.send(err(h.id, c, m)).await;
                }
            },
            #[cfg(feature = "rdma")]
            Msg::RdmaConnect(ep) => {
                let r = match (&s.rdma, &qp) {
                    (None, _) => Err("this server offers no RDMA (serve.rdma_device unset)".into()),
                    (_, Some(_)) => Err("RDMA is already connected on this connection".into()),
                    (Some(r), None) => r
                        .queue_pair(s.cfg.max_inflight.max(1))
                        .and_then(|q| {
                            // Peers may read (and write) one-sided only what a region's window
                            // key allows; every other memory region of ours is local-only.
                            let peer = if s.regions.iter().any(|r| r.window.is_some()) {
                                crate::rdma::PeerAccess::ReadWrite
                            } else {
                                crate::rdma::PeerAccess::None
                            };
                            q.connect(&crate::transport::from_wire_ep(ep), peer)?;
                            Ok(q)
                        })
                        .map_err(|e| e.to_string()),
                };
                match r {
                    Ok(q) => {
                        let ep = crate::transport::to_wire_ep(q.endpoint());
                        qp = Some(Arc::new(q));
                        let _ = tx.send(Out::Control(Msg::RdmaAccept(ep).frame(h.id))).await;
                    }
                    Err(m) => {
                        refuse(&s, &peer, &m);
                        let _ = tx.send(err(h.id, Code::Protocol, m)).await;
                    }
                }
            }
            Msg::SmcOpen { name, key } => {
                let found = s
                    .regions
                    .iter()
                    .position(|r| r.cfg.name == name && proto::constant_time_eq(&key, &r.cfg.key));
                match found {
                    Some(i) => {
                        let writable = rw && s.regions[i].cfg.writable;
                        // One handle per region and connection: registering again returns it, so
                        // the handles are bounded by the exported regions.
                        let handle = match opened.iter().position(|&(j, _)| j == i) {
                            Some(k) => k,
                            None => {
                                opened.push((i, writable));
                                opened.len() - 1
                            }
                        };
                        // On a connection with a queue pair: the window, with the key its access
                        // allows (a read-only token gets the read-only key).
                        #[cfg(feature = "rdma")]
                        let window = match (&qp, s.regions[i].window) {
                            (Some(_), Some((addr, ro, rw))) => Some(proto::RemoteWindow {
                                addr,
                                rkey: if writable { rw.unwrap_or(ro) } else { ro },
                            }),
                            _ => None,
                        };
                        #[cfg(not(feature = "rdma"))]
                        let window = None;
                        let _ = tx
                            .send(Out::Control(
                                Msg::SmcOpenOk {
                                    region: handle as u32,
                                    size: s.regions[i].cfg.size,
                                    writable,
                                    window,
                                }
                                .frame(h.id),
                            ))
                            .await;
                    }
                    None => {
                        refuse(&s, &peer, &format!("region {name:?}: unknown or wrong key"));
                        let _ = tx
                            .send(err(
                                h.id,
                                Code::Auth,
                                format!("region {name:?}: no such region or wrong key"),
                            ))
                            .await;
                    }
                }
            }
            m @ (Msg::SmcRead { .. } | Msg::SmcWrite { .. } | Msg::SmcWriteV { .. }) => {
                // Written at once by this loop: no hop through the writer task on a fault's path.
                let read = matches!(m, Msg::SmcRead { .. });
                let f = smc_request(&s, &peer, &opened, m, h.id).await;
                if let Err(e) = smc_reply(&s, &wr, &f).await {
                    break Err(e);
                }
                if read {
                    poll_next(&s, &rd);
                }
            }
            m @ (Msg::Read { .. } | Msg::ReadTo { .. }) => {
                // `Read`: the payload follows on the stream. `ReadTo`: it goes by RDMA WRITE into the
                // client's registered memory, then `ReadDone` on the stream.
                let (file, offset, len, to) = match m {
                    Msg::ReadTo {
                        file,
                        offset,
                        len,
                        addr,
                        rkey,
                    } => (file, offset, len, Some((addr, rkey))),
                    Msg::Read { file, offset, len } => (file, offset, len, None),
                    _ => continue,
                };
                #[cfg(feature = "rdma")]
                let q = match (to, qp.clone()) {
                    (Some(_), None) => None,
                    (_, q) => Some(q),
                };
                #[cfg(not(feature = "rdma"))]
                let q: Option<Option<()>> = if to.is_some() { None } else { Some(None) };
                let Some(q) = q else {
                    refuse(&s, &peer, "ReadTo without an RDMA connection");
                    let _ = tx
                        .send(err(
                            h.id,
                            Code::Protocol,
                            "ReadTo needs RdmaConnect first (and a server with rdma_device)".into(),
                        ))
                        .await;
                    continue;
                };
                let (f, plain, name, permit) =
                    match admit(&s, &peer, &files, &inflight, file, offset, len).await {
                        Ok(v) => v,
                        Err(Some(o)) => {
                            let _ = tx.send(o.into_frame(h.id)).await;
                            pace.wait().await;
                            continue;
                        }
                        Err(None) => break Ok(()),
                    };
                let (s2, tx2) = (s.clone(), tx.clone());
                let staging = [slot.staging.clone(), token_share.staging.clone()];
                tokio::spawn(async move {
                    // A resident range on the stream: from the page cache by sendfile, no copy here.
                    if to.is_none() && crate::zerocopy::resident(&plain, offset, len as u64) {
                        let out = match reserve(&s2, &staging).await {
                            Ok((block, share)) => {
                                s2.stats.reads.fetch_add(1, Ordering::Relaxed);
                                s2.stats.bytes.fetch_add(len as u64, Ordering::Relaxed);
                                s2.stats.page_cache_reads.fetch_add(1, Ordering::Relaxed);
                                Out::File {
                                    id: h.id,
                                    file: plain,
                                    offset,
                                    len,
                                    block,
                                    _hold: (permit, share),
                                }
                            }
                            Err(r) => r.into_frame(h.id),
                        };
                        let _ = tx2.send(out).await;
                        return;
                    }
                    let out = match read_block(&s2, &staging, &f, &name, offset, len).await {
                        Ok((lease, range, block)) => {
                            deliver(&s2, h.id, lease, range, q, to, (permit, block)).await
                        }
                        Err(r) => r.into_frame(h.id),
                    };
                    let _ = tx2.send(out).await;
                });
            }
            other => {
                refuse(&s, &peer, &format!("unexpected {:?}", other.kind()));
                let _ = tx
                    .send(err(
                        h.id,
                        Code::Protocol,
                        format!("unexpected {:?} from a client", other.kind()),
                    ))
                    .await;
            }
        }
    };
    drop(tx);
    if !writer_done {
        let _ = writer.await;
    }
    result
}

/// What answers a read whose bytes are in `lease[range]`: the bytes on the stream, or — with a queue
/// pair and a target — an RDMA WRITE into the client's memory and `ReadDone` once its completion
/// arrived (the completion, not this function, releases the block).
#[cfg(feature = "rdma")]
async fn deliver(
    s: &Shared,
    id: u64,
    lease: Lease,
    range: std::ops::Range<usize>,
    q: Option<Arc<crate::rdma::QueuePair>>,
    to: Option<(u64, u32)>,
    hold: Hold,
) -> Out {
    match (q, to) {
        (Some(q), Some((addr, rkey))) => {
            match q.write(lease, range, addr, rkey, s.cfg.io_timeout).await {
                Ok(()) => {
                    s.stats.rdma_reads.fetch_add(1, Ordering::Relaxed);
                    Out::Control(Msg::ReadDone.frame(id))
                }
                Err(e) => {
                    tracing::warn!("rdma write to the client failed: {e}; closing");
                    Out::Close
                }
            }
        }
        _ => Out::Data {
            id,
            lease,
            range,
            _hold: hold,
        },
    }
}

#[cfg(not(feature = "rdma"))]
async fn deliver(
    _: &Shared,
    id: u64,
    lease: Lease,
    range: std::ops::Range<usize>,
    _: Option<()>,
    _: Option<(u64, u32)>,
    hold: Hold,
) -> Out {
    Out::Data {
        id,
        lease,
        range,
        _hold: hold,
    }
}

/// Why a read was not served: an `Error` frame's code and message.
struct Reply(Code, String);

impl Reply {
    fn frame(self, id: u64) -> Vec<u8> {
        Msg::Error {
            code: self.0,
            message: self.1,
        }
        .frame(id)
    }

    fn into_frame(self, id: u64) -> Out {
        Out::Control(self.frame(id))
    }
}

/// Checks a read (file opened here, size within max_request, range within the file) and takes an
/// in-flight permit. `Err(None)`: the connection is closing.
#[allow(clippy::type_complexity)]
async fn admit(
    s: &Shared,
    peer: &str,
    files: &Files,
    inflight: &Arc<Semaphore>,
    file: u32,
    offset: u64,
    len: u32,
) -> Result<
    (
        FileHandle,
        Arc<std::fs::File>,
        String,
        tokio::sync::OwnedSemaphorePermit,
    ),
    Option<Reply>,
> {
    let Some((f, plain, size, name)) = files
        .list
        .get(file as usize)
        .map(|o| (o.f.clone(), o.plain.clone(), o.size, o.name.clone()))
    else {
        refuse(s, peer, &format!("read of unopened file {file}"));
        return Err(Some(Reply(
            Code::BadFile,
            format!("file {file} was not opened on this connection"),
        )));
    };
    if len > s.cfg.max_request {
        refuse(s, peer, &format!("read of {len} bytes"));
        return Err(Some(Reply(
            Code::TooLarge,
            format!(
                "read of {len} bytes exceeds max_request {}",
                s.cfg.max_request
            ),
        )));
    }
    if offset.checked_add(len as u64).is_none_or(|e| e > size) {
        refuse(
            s,
            peer,
            &format!("read {offset}+{len} past the end ({size})"),
        );
        return Err(Some(Reply(
            Code::Range,
            format!("{name}: {offset}+{len} is past the end of the file ({size} bytes)"),
        )));
    }
    match inflight.clone().acquire_owned().await {
        Ok(p) => Ok((f, plain, name, p)),
        Err(_) => Err(None),
    }
}

/// A staging block of the server's pool, within the address's and the token's shares of blocks
/// (the permits come back with the block and are held until the reply is written), or `Busy` after
/// `io_timeout`.
async fn reserve(s: &Shared, staging: &[Arc<Semaphore>; 2]) -> Result<(Lease, Shares), Reply> {
    let t = s.cfg.io_timeout;
    let start = std::time::Instant::now();
    let busy = || {
        Reply(
            Code::Busy,
            format!(
                "no staging block within {t:?} (this address or this token holds its share — serve.max_staging_per_peer, serve.max_staging_per_token — or all serve.blocks are in use)"
            ),
        )
    };
    let peer = match tokio::time::timeout(t, staging[0].clone().acquire_owned()).await {
        Ok(Ok(p)) => p,
        _ => return Err(busy()),
    };
    let token = match tokio::time::timeout(
        t.saturating_sub(start.elapsed()),
        staging[1].clone().acquire_owned(),
    )
    .await
    {
        Ok(Ok(p)) => p,
        _ => return Err(busy()),
    };
    let share = [peer, token];
    let lease = s
        .pool
        .acquire(t.saturating_sub(start.elapsed()))
        .await
        .map_err(|_| busy())?;
    Ok((lease, share))
}

/// Reads into a staging block of the server's pool, within the address's and the token's shares of
/// blocks (the permits come back with the block and are held until the reply is written).
async fn read_block(
    s: &Shared,
    staging: &[Arc<Semaphore>; 2],
    f: &FileHandle,
    name: &str,
    offset: u64,
    len: u32,
) -> Result<(Lease, std::ops::Range<usize>, Shares), Reply> {
    let (lease, share) = reserve(s, staging).await?;
    let (r, lease) = s.engine.read(f, offset, len as usize, lease, 0).await;
    match r {
        Ok(d) => {
            s.stats.reads.fetch_add(1, Ordering::Relaxed);
            s.stats.bytes.fetch_add(len as u64, Ordering::Relaxed);
            Ok((lease, d.data, share))
        }
        Err(e) => {
            tracing::debug!("read {name} at {offset}+{len}: {e}");
            Err(Reply(
                Code::Io,
                format!("read {name} at {offset}+{len}: {}", root_cause(&e)),
            ))
        }
    }
}

/// Checks an SMC access: region registered on this connection, in bounds, within max_request, and
/// writable when writing. Returns the region's index.
fn smc_range(
    s: &Shared,
    opened: &[(usize, bool)],
    region: u32,
    offset: u64,
    len: u64,
    write: bool,
) -> Result<usize, Reply> {
    let Some(&(i, writable)) = opened.get(region as usize) else {
        return Err(Reply(
            Code::BadFile,
            format!("region {region} was not registered on this connection"),
        ));
    };
    let r = &s.regions[i].cfg;
    if write && !writable {
        return Err(Reply(
            Code::Forbidden,
            format!("region {:?} is read-only for this token", r.name),
        ));
    }
    if len > s.cfg.max_request as u64 {
        return Err(Reply(
            Code::TooLarge,
            format!("{len} bytes exceed max_request {}", s.cfg.max_request),
        ));
    }
    if offset.checked_add(len).is_none_or(|e| e > r.size) {
        return Err(Reply(
            Code::Range,
            format!(
                "region {:?}: {offset}+{len} is past its end ({} bytes)",
                r.name, r.size
            ),
        ));
    }
    Ok(i)
}

/// Polls the connection's socket (`MSG_PEEK`, nonblocking) for up to `smc_poll` for the next
/// request, so that a burst of faults is served without a runtime wake-up between them. At most a
/// quarter of the workers poll at once (the rest go straight back to the runtime); returns as soon as
/// bytes (or the end of the stream) are there.
fn poll_next(s: &Shared, rd: &tokio::net::tcp::OwnedReadHalf) {
    let Some(_poll) = Polling::start(s) else {
        return;
    };
    let sock = socket2::SockRef::from(rd.as_ref());
    let until = Instant::now() + s.cfg.smc_poll;
    let mut b = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    while Instant::now() < until {
        match sock.peek(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            _ => break,
        }
    }
}

/// The most time one SMC write's receive spends polling an empty socket, over all its gaps.
const POLL_BUDGET: Duration = Duration::from_millis(2);

/// A connection polling its socket (`smc_poll`), counted so that at most a quarter of the runtime's
/// workers do at once; `None` when polling is off or the cap is reached.
struct Polling<'a>(&'a Shared);

impl<'a> Polling<'a> {
    fn start(s: &'a Shared) -> Option<Self> {
        if s.cfg.smc_poll.is_zero() {
            return None;
        }
        let cap = (s.workers / 4).max(1);
        if s.polling.fetch_add(1, Ordering::AcqRel) >= cap {
            s.polling.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Self(s))
    }
}

impl Drop for Polling<'_> {
    fn drop(&mut self) {
        self.0.polling.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves one SMC read or write on a region registered on this connection; returns the reply frame.
async fn smc_request(
    s: &Arc<Shared>,
    peer: &str,
    opened: &[(usize, bool)],
    m: Msg,
    id: u64,
) -> Vec<u8> {
    let (region, ranges, data, read) = match m {
        Msg::SmcRead {
            region,
            offset,
            len,
        } => (region, vec![(offset, len)], Vec::new(), true),
        Msg::SmcWrite {
            region,
            offset,
            data,
        } => (region, vec![(offset, data.len() as u32)], data, false),
        Msg::SmcWriteV {
            region,
            ranges,
            data,
        } => (region, ranges, data, false),
        other => {
            return Reply(
                Code::Protocol,
                format!("not an SMC request: {:?}", other.kind()),
            )
            .frame(id);
        }
    };
    let mut ix = None;
    for &(o, l) in &ranges {
        match smc_range(s, opened, region, o, l as u64, !read) {
            Ok(i) => ix = Some(i),
            Err(r) => {
                refuse(s, peer, &r.1);
                return r.frame(id);
            }
        }
    }
    let Some(i) = ix else {
        // No ranges: still only on a region registered here, and writable by this token.
        return match smc_range(s, opened, region, 0, 0, !read) {
            Ok(_) => Msg::SmcWriteOk.frame(id),
            Err(r) => {
                refuse(s, peer, &r.1);
                r.frame(id)
            }
        };
    };
    let n = data.len() as u64;
    if let (true, RegionMem::Host { bytes, .. }) = (read, &s.regions[i].mem) {
        // The reply frame in one buffer, the bytes copied once (under the read lock).
        let (o, l) = ranges[0];
        let m = bytes.read().unwrap_or_else(|p| p.into_inner());
        return match m.get(o as usize..o as usize + l as usize) {
            Ok(b) => {
                let mut f = Vec::with_capacity(proto::HEADER + b.len());
                f.extend_from_slice(
                    &Header {
                        kind: Kind::ReadOk,
                        id,
                        len: l,
                    }
                    .encode(),
                );
                f.extend_from_slice(b);
                s.stats.smc_reads.fetch_add(1, Ordering::Relaxed);
                f
            }
            Err(e) => Reply(Code::Io, e).frame(id),
        };
    }
    if let RegionMem::Gpu(g) = &s.regions[i].mem {
        // Copies on the region's own stream, polled here: no thread hop.
        let t = s.cfg.io_timeout;
        if read {
            let (o, l) = ranges[0];
            let mut f = Header {
                kind: Kind::ReadOk,
                id,
                len: l,
            }
            .encode()
            .to_vec();
            f.reserve(l as usize);
            return match g.read_into(o, l as usize, &mut f, t).await {
                Ok(()) => {
                    s.stats.smc_reads.fetch_add(1, Ordering::Relaxed);
                    f
                }
                Err(e) => Reply(Code::Io, e).frame(id),
            };
        }
        return match g.write(&ranges, &data, t).await {
            Ok(()) => {
                s.stats.smc_writes.fetch_add(1, Ordering::Relaxed);
                s.stats.smc_bytes_written.fetch_add(n, Ordering::Relaxed);
                Msg::SmcWriteOk.frame(id)
            }
            Err(e) => Reply(Code::Io, e).frame(id),
        };
    }
    let work = move |s: &Shared| -> Result<Vec<u8>, String> {
        if read {
            let (o, l) = ranges[0];
            return s.regions[i].mem.read(o, l as usize);
        }
        let mut at = 0usize;
        for (o, l) in ranges {
            s.regions[i].mem.write(o, &data[at..at + l as usize])?;
            at += l as usize;
        }
        Ok(Vec::new())
    };
    // A host region: a memcpy, inline.
    match work(s) {
        Ok(bytes) if read => {
            s.stats.smc_reads.fetch_add(1, Ordering::Relaxed);
            let mut f = Header {
                kind: Kind::ReadOk,
                id,
                len: bytes.len() as u32,
            }
            .encode()
            .to_vec();
            f.extend_from_slice(&bytes);
            f
        }
        Ok(_) => {
            s.stats.smc_writes.fetch_add(1, Ordering::Relaxed);
            s.stats.smc_bytes_written.fetch_add(n, Ordering::Relaxed);
            Msg::SmcWriteOk.frame(id)
        }
        Err(e) => Reply(Code::Io, e).frame(id),
    }
}

/// Receives a payload of `len` bytes straight into `mem[at..at + len]` within `until`: each
/// nonblocking receive holds the region's write lock, never a wait for the socket.
async fn recv_into(
    s: &Shared,
    rd: &mut OwnedReadHalf,
    mem: &std::sync::RwLock<HostBytes>,
    at: usize,
    len: usize,
    until: tokio::time::Instant,
) -> std::io::Result<()> {
    let mut done = 0;
    // While bytes keep coming, read them straight off the socket (a nonblocking `read` outside the
    // runtime's readiness) and poll up to `smc_poll` when it is momentarily empty: a 4 MiB barrier
    // arrives in many segments, and going back to the runtime between them costs a wake-up each.
    // Past the poll (or with polling off / capped), the runtime's readiness takes over.
    let mut poll = Polling::start(s);
    let mut quiet_since: Option<Instant> = None;
    let (mut spent, mut last) = (Duration::ZERO, Instant::now());
    while done < len {
        let direct = poll.is_some();
        let r = {
            let mut g = mem.write().unwrap_or_else(|p| p.into_inner());
            match g.get_mut(at + done..at + len) {
                Ok(dst) if direct => {
                    use std::io::Read;
                    (&*socket2::SockRef::from(rd.as_ref())).read(dst)
                }
                Ok(dst) => rd.try_read(dst),
                Err(e) => Err(std::io::Error::other(e)),
            }
        };
        match r {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => {
                done += k;
                quiet_since = None;
                last = Instant::now();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && direct => {
                let now = Instant::now();
                let q = *quiet_since.get_or_insert(now);
                // One quiet gap of at most smc_poll, and at most POLL_BUDGET of them in all (a
                // client trickling bytes gets the runtime, not a spinning worker).
                spent += now.saturating_duration_since(last);
                last = now;
                if now - q >= s.cfg.smc_poll || spent >= POLL_BUDGET {
                    poll = None;
                } else {
                    std::hint::spin_loop();
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                match tokio::time::timeout_at(until, rd.readable()).await {
                    Err(_) => {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "smc write payload: no bytes within the deadline",
                        ));
                    }
                    Ok(r) => r?,
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads and drops `len` payload bytes within `deadline` (a refused write: the stream stays in step).
async fn drain(rd: &mut OwnedReadHalf, len: usize, deadline: Duration) -> std::io::Result<()> {
    proto::discard_payload(rd, len as u32, deadline)
        .await
        .map_err(std::io::Error::other)
}

/// Writes an SMC reply at once (no hop through the writer task on a fault's path): the lock and
/// the write within io_timeout together; a client that does not take it is an error.
async fn smc_reply(
    s: &Shared,
    wr: &tokio::sync::Mutex<tokio::net::tcp::OwnedWriteHalf>,
    f: &[u8],
) -> std::io::Result<()> {
    let sent = async { wr.lock().await.write_all(f).await };
    let sent = tokio::time::timeout(s.cfg.io_timeout, sent)
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "reply not taken by the client in time",
            ))
        });
    if let Err(e) = &sent
        && e.kind() == std::io::ErrorKind::TimedOut
    {
        s.stats.write_timeouts.fetch_add(1, Ordering::Relaxed);
    }
    sent
}

/// Serves an `SmcWrite` / `SmcWriteV` whose header `h` was read: its fixed fields and range table
/// are read and checked, then the data goes from the socket straight into the host region's memory
/// (a GPU region, or a region not registered here, takes the general path). Returns the reply frame
/// and whether the connection goes on (a malformed frame ends it).
async fn smc_receive(
    s: &Arc<Shared>,
    peer: &str,
    opened: &[(usize, bool)],
    rd: &mut OwnedReadHalf,
    h: Header,
) -> std::io::Result<(Vec<u8>, bool)> {
    let deadline = s.cfg.io_timeout;
    let until = tokio::time::Instant::now() + deadline;
    let io = |e: FrameError| std::io::Error::other(e);
    let len = h.len as usize;
    let v = h.kind == Kind::SmcWriteV;
    let fixed = if v { 8 } else { 12 };
    let malformed = |s: &Shared, why: String| {
        refuse(s, peer, &format!("malformed frame: {why}"));
        (Reply(Code::Protocol, why).frame(h.id), false)
    };
    if len < fixed {
        drain(rd, len, deadline).await?;
        return Ok(malformed(s, format!("{:?} of {len} bytes", h.kind)));
    }
    let mut head = [0u8; 12];
    proto::read_payload(rd, &mut head[..fixed], deadline)
        .await
        .map_err(io)?;
    let region = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    let mut table_len = 0;
    let ranges: Vec<(u64, u32)> = if v {
        let count = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
        if count.saturating_mul(12) > len - fixed {
            drain(rd, len - fixed, deadline).await?;
            return Ok(malformed(s, format!("{count} ranges in {len} bytes")));
        }
        table_len = count * 12;
        // Read in pieces, the ranges growing as their bytes arrive: a header that declares a large
        // table and stalls pins one piece, not the table (28 bytes used to cost 12 MiB with
        // max_request = 16 MiB).
        proto::read_write_ranges(rd, count, deadline)
            .await
            .map_err(io)?
    } else {
        let mut o = [0u8; 8];
        o.copy_from_slice(&head[4..12]);
        vec![(u64::from_le_bytes(o), (len - fixed) as u32)]
    };
    let data = len - fixed - table_len;
    if ranges.iter().map(|r| r.1 as u64).sum::<u64>() != data as u64 {
        drain(rd, data, deadline).await?;
        return Ok(malformed(s, "range lengths differ from the data".into()));
    }
    let mem = opened
        .get(region as usize)
        .and_then(|&(i, _)| s.regions.get(i))
        .map(|r| &r.mem);
    let Some(mem) = mem else {
        // The general path (it refuses unregistered regions).
        let payload = proto::read_payload_vec(rd, data as u32, deadline)
            .await
            .map_err(io)?;
        let m = if v {
            Msg::SmcWriteV {
                region,
                ranges,
                data: payload,
            }
        } else {
            Msg::SmcWrite {
                region,
                offset: ranges[0].0,
                data: payload,
            }
        };
        return Ok((smc_request(s, peer, opened, m, h.id).await, true));
    };
    // An empty write still checks the region and the token's right to write.
    let checks = if ranges.is_empty() {
        &[(0, 0)][..]
    } else {
        &ranges[..]
    };
    for &(o, l) in checks {
        if let Err(r) = smc_range(s, opened, region, o, l as u64, true) {
            refuse(s, peer, &r.1);
            drain(rd, data, deadline).await?;
            return Ok((r.frame(h.id), true));
        }
    }
    match mem {
        RegionMem::Host { bytes, .. } => {
            for &(o, l) in &ranges {
                recv_into(s, rd, bytes, o as usize, l as usize, until).await?;
            }
        }
        // Into a registered staging block straight from the socket, then one batch of copies.
        RegionMem::Gpu(g) => {
            if let Err(e) = g.receive(rd, &ranges, data, deadline).await? {
                return Ok((Reply(Code::Io, e).frame(h.id), true));
            }
        }
    }
    s.stats.smc_writes.fetch_add(1, Ordering::Relaxed);
    s.stats
        .smc_bytes_written
        .fetch_add(data as u64, Ordering::Relaxed);
    Ok((Msg::SmcWriteOk.frame(h.id), true))
}
