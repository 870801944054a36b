//! The storage server behind `ubdirect serve`: exports root directories read-only to clients that
//! present the token, and SMC memory regions to clients that present a region's key. Reads go
//! through the io_uring engine into the server's own register-once pool and are sent from there.
//!
//! Rooms, one job each:
//! * [`config`]: [`ServerConfig`] and [`RegionConfig`], their defaults and checks;
//! * `limits`: a connection's place among the server's, its address's and its token's (connections,
//!   staging blocks), pacing of control requests, rate-limited logs, the cap on pollers;
//! * `files`: exported roots, path confinement, files opened on a connection, reads into staging
//!   blocks and their delivery (stream, `sendfile`, or RDMA WRITE);
//! * `regions`: SMC regions' memory (`RegionMem`: host or GPU) and their one-sided windows;
//! * `conn`: the connection loop — the hello, then each message kind to a function of its own;
//! * `smc`: SMC reads and writes on registered regions.
//!
//! Every frame is encoded and decoded by [`crate::proto`]; nothing here writes a header by hand.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use ubdirect_nvme::{Engine, EngineConfig};
use ubdirect_ub::{MemoryKind, PoolConfig, UbPool};

pub mod config;
mod conn;
mod files;
mod limits;
mod out;
mod regions;
mod reply;
mod smc;

pub use config::{RegionConfig, ServerConfig};

use files::ENGINE_FILES;
use limits::{ConnSlot, LogLimit, Peer, TokenShare, accept_backoff};
use regions::Region;

/// The server's RDMA device (a type that has no value in a build without RDMA).
#[cfg(feature = "rdma")]
type RdmaDev = crate::rdma::Rdma;
#[cfg(not(feature = "rdma"))]
type RdmaDev = std::convert::Infallible;

/// A connection's RDMA queue pair (nothing in a build without RDMA).
#[cfg(feature = "rdma")]
type Qp = Arc<crate::rdma::QueuePair>;
#[cfg(not(feature = "rdma"))]
type Qp = ();

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

/// What every connection of a server shares: its settings, roots, engine, staging pool, limits
/// and regions.
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
        let roots = files::open_roots(&cfg)?;
        config::check_tokens(&cfg)?;
        let engine = Engine::new(EngineConfig {
            max_files: ENGINE_FILES as u32,
            ..EngineConfig::default()
        })
        .map_err(std::io::Error::other)?;
        let (pool, rdma) = staging_pool(&cfg, &engine)?;
        let regions = regions::build_regions(&cfg, rdma.as_ref())?;
        let listener = TcpListener::bind(cfg.listen).await?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(ServerStats::default());
        let shared = Arc::new(Shared::new(
            cfg,
            roots,
            engine,
            pool.clone(),
            stats.clone(),
            regions,
            rdma,
        ));
        let task = tokio::spawn(accept_loop(shared, listener));
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

/// The server's staging pool (`blocks` of `max_request` + 8 KiB, registered with the engine, and
/// with the RDMA device when `rdma_device` is set), and that device.
fn staging_pool(cfg: &ServerConfig, engine: &Engine) -> std::io::Result<(UbPool, Option<RdmaDev>)> {
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
    let rdma = match cfg.rdma_device {
        Some(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "serve: rdma_device is set but this build has no RDMA (build with --features rdma)",
            ));
        }
        None => None,
    };
    let pool = builder.build().map_err(std::io::Error::other)?;
    Ok((pool, rdma))
}

impl Shared {
    #[allow(clippy::too_many_arguments)]
    fn new(
        cfg: ServerConfig,
        roots: HashMap<String, PathBuf>,
        engine: Engine,
        pool: UbPool,
        stats: Arc<ServerStats>,
        regions: Vec<Region>,
        #[cfg_attr(not(feature = "rdma"), allow(unused_variables))] rdma: Option<RdmaDev>,
    ) -> Self {
        Shared {
            roots,
            engine,
            pool,
            stats,
            peers: std::sync::Mutex::new(HashMap::new()),
            tokens: (0..=cfg.read_only_tokens.len())
                .map(|_| TokenShare {
                    conns: AtomicUsize::new(0),
                    staging: Arc::new(Semaphore::new(config::token_share(&cfg))),
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
            cfg,
        }
    }
}

/// Accepts connections until the server is dropped, each served by a task of its own; gives the
/// memory of ended connections back to the system at most once a second.
async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let mut conns = JoinSet::new();
    let mut pause = Duration::ZERO;
    // Memory that ended connections gave back to the allocator is returned to the system (at most
    // once a second): a burst of connections does not leave the server larger.
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
                    accept_one(&shared, &mut conns, sock, peer);
                }
                Err(e) => {
                    // Out of descriptors (EMFILE, ENFILE) or memory: the connection stays in the
                    // backlog, so an immediate retry fails the same way. Pause instead.
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
}

/// Takes an accepted connection's place (or closes it at once when a cap is reached) and starts its
/// task; a connection that has not said hello is queued for eviction.
fn accept_one(
    shared: &Arc<Shared>,
    conns: &mut JoinSet<()>,
    sock: tokio::net::TcpStream,
    peer: SocketAddr,
) {
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
            return;
        }
    };
    let _ = sock.set_nodelay(true);
    s.stats.connections.fetch_add(1, Ordering::Relaxed);
    let pending = slot.pending.clone();
    let track = s.clone();
    let task = conns.spawn(async move {
        if let Err(e) = conn::serve_conn(s.clone(), sock, &slot).await {
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
