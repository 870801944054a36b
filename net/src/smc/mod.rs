//! SMC: memory that lives on a server (`ubdirect serve`, `[serve.regions.*]`), used by this process
//! through plain loads and stores on a local mapping, or through explicit `read` / `write` calls.
//!
//! * [`SmcClient::register`] fetches a region's descriptor once (cached: registering again is free).
//! * [`Region::map`] maps it: the first touch of an SMC page (4 KiB … 2 MiB) faults, and the fault
//!   thread fetches the page (plus optional read-ahead) and installs it with `UFFDIO_COPY`.
//! * Write-through: [`Region::write`] returns after the server acknowledged. Write-back: stores go to
//!   the mapped shadow pages, which are installed write-protected; the first store to a clean page is
//!   a write-protect fault that marks it dirty; [`Mapping::barrier`] re-protects and pushes only the
//!   dirty pages, adjacent ones merged into one transfer, and returns after every acknowledgement.
//! * Requests travel on links: connections of their own, made by the storage client ([`Client`]:
//!   its connect, hello and token) and pooled per `SmcClient`, then driven by the thread that waits
//!   for the reply — no runtime, task, timer or channel between it and the socket. Replies are read
//!   with the crate's one frame reader (with deadlines) over a blocking adapter, payloads straight
//!   into their destination (a fault's pages into the mapping's staging block, a one-block UB pool);
//!   a barrier's pages go out straight from the mapping (`writev`), and the server receives them
//!   straight into the region's memory. Requests of one call are pipelined.
//! * Every request has a deadline and a bounded number of retries (reconnecting between them); past
//!   them the region is unavailable: calls return [`SmcError::Unavailable`], and a mapped access that
//!   needs the server raises SIGBUS (the mapping is replaced by one that faults) instead of hanging.

mod link;
mod mapping;
mod region;
mod wire;

pub(crate) use link::SmcLink;
pub use mapping::{BarrierStats, Mapping};
pub use region::{MapOptions, Region, SyncMode};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::client::{Client, Fail, LinkError, RegionId};
use crate::proto::{Code, Msg};

/// SMC errors. Every variant names the region.
#[derive(Debug, thiserror::Error)]
pub enum SmcError {
    /// The server refused (wrong key or token, unknown region, out of range, read-only).
    #[error("smc region {region:?}: refused ({code}): {message}")]
    Refused {
        /// Region name.
        region: String,
        /// Why, as the protocol says it.
        code: Code,
        /// The server's message.
        message: String,
    },
    /// A write through a read-only registration.
    #[error("smc region {region:?} is read-only for this token")]
    ReadOnly {
        /// Region name.
        region: String,
    },
    /// Offset and length outside the region.
    #[error("smc region {region:?}: {offset}+{len} is outside its {size} bytes")]
    Range {
        /// Region name.
        region: String,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Region size.
        size: u64,
    },
    /// The server did not answer within the deadline after every retry; the region stays
    /// unavailable (mapped accesses that need the server raise SIGBUS).
    #[error("smc region {region:?} unavailable after {attempts} attempts in {waited:?}")]
    Unavailable {
        /// Region name.
        region: String,
        /// Attempts made.
        attempts: u32,
        /// Time spent.
        waited: Duration,
        /// The last failure (`None`: marked unavailable by an earlier one).
        #[source]
        last: Option<LinkError>,
    },
    /// Mapping failed (userfaultfd needs root or `vm.unprivileged_userfaultfd = 1`).
    #[error("smc region {region:?}: cannot map: {why}")]
    Map {
        /// Region name.
        region: String,
        /// Why.
        why: String,
    },
}

/// Deadline and retries of every remote request.
#[derive(Debug, Clone, Copy)]
pub struct SmcOptions {
    /// Deadline of one attempt (connect + request + reply).
    pub deadline: Duration,
    /// Further attempts after the first, each on a fresh connection.
    pub retries: u32,
}

impl Default for SmcOptions {
    fn default() -> Self {
        Self {
            deadline: Duration::from_secs(2),
            retries: 2,
        }
    }
}

/// Counters of one client (all its regions and mappings).
#[derive(Debug, Default)]
pub struct SmcStats {
    /// Region descriptors fetched from the server (a cached re-register does not count).
    pub registrations: AtomicU64,
    /// Time spent fetching them, in nanoseconds.
    pub register_ns: AtomicU64,
    /// Missing-page faults resolved.
    pub faults: AtomicU64,
    /// Write-protect faults (first store to a clean page).
    pub wp_faults: AtomicU64,
    /// Bytes fetched for faults and reads.
    pub bytes_fetched: AtomicU64,
    /// Pages that became dirty.
    pub dirty_pages: AtomicU64,
    /// Merged transfers pushed by barriers.
    pub pushes: AtomicU64,
    /// Bytes pushed by barriers and writes.
    pub bytes_pushed: AtomicU64,
    /// Requests sent to the server (reads, writes, registrations).
    pub transactions: AtomicU64,
    /// Attempts repeated after a failure.
    pub retries: AtomicU64,
}

impl SmcStats {
    /// One counter's value.
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

struct Desc {
    name: String,
    key: Vec<u8>,
    size: u64,
    writable: bool,
    unavailable: AtomicBool,
}

struct Inner {
    addr: SocketAddr,
    opts: SmcOptions,
    /// The storage client: its connect, hello and token make every SMC link.
    client: Client,
    /// The runtime that connects new links.
    rt: Result<tokio::runtime::Runtime, Arc<std::io::Error>>,
    /// Idle links (connections of their own, driven by the thread that uses them): a request takes
    /// one (or connects one) and puts it back when the exchange completed.
    links: Mutex<Vec<SmcLink>>,
    regions: Mutex<HashMap<String, Arc<Desc>>>,
    stats: SmcStats,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Never blocks (an SmcClient may be dropped inside async code).
        let rt = std::mem::replace(
            &mut self.rt,
            Err(Arc::new(std::io::ErrorKind::NotConnected.into())),
        );
        if let Ok(rt) = rt {
            rt.shutdown_background();
        }
    }
}

/// A client of one server's SMC regions. Cheap to clone; clones share one pool of connections
/// (each request uses one at a time: several threads' requests are in flight together on several).
#[derive(Clone)]
pub struct SmcClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for SmcClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmcClient")
            .field("server", &self.inner.addr)
            .finish()
    }
}

impl SmcClient {
    /// A client of the server at `addr` presenting `token`, over TCP. Connects lazily.
    pub fn new(addr: SocketAddr, token: impl Into<Vec<u8>>, opts: SmcOptions) -> Self {
        Self::with_transport(addr, token, opts, Arc::new(crate::transport::Tcp))
    }

    /// As [`SmcClient::new`], with each link's data path set up by `transport`: over RDMA
    /// (`RdmaTransport`) a fault is one RDMA READ from the region's memory into the mapping's
    /// staging block and a barrier RDMA WRITEs the dirty runs into it, one-sided; the staging blocks
    /// are UB pools registered with the transport once, at map time.
    pub fn with_transport(
        addr: SocketAddr,
        token: impl Into<Vec<u8>>,
        opts: SmcOptions,
        transport: Arc<dyn crate::transport::Transport>,
    ) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(Arc::new);
        Self {
            inner: Arc::new(Inner {
                addr,
                opts,
                client: Client::with_transport(vec![addr], token, opts.deadline, transport),
                rt,
                links: Mutex::new(Vec::new()),
                regions: Mutex::new(HashMap::new()),
                stats: SmcStats::default(),
            }),
        }
    }

    /// Counters.
    pub fn stats(&self) -> &SmcStats {
        &self.inner.stats
    }

    /// A new link (connect, hello) within `until`, made on the client's runtime. From inside another
    /// runtime (async code calling this blocking API) it runs on a helper thread instead of
    /// panicking.
    fn connect(&self, rt: &tokio::runtime::Runtime, until: Instant) -> Result<SmcLink, Fail> {
        let client = self.inner.client.clone();
        let f = async move {
            let a = client.attached(until).await?;
            Ok(SmcLink::new(a.sock, a.server, a.max_request, a.path))
        };
        if tokio::runtime::Handle::try_current().is_err() {
            return rt.block_on(f);
        }
        std::thread::scope(|s| s.spawn(|| rt.block_on(f)).join()).unwrap_or_else(|_| {
            Err(Fail::Retry(LinkError::Closed {
                server: self.inner.addr,
            }))
        })
    }

    /// Region `desc`'s id on `link`, opening it there first if needed.
    fn open_on(&self, link: &mut SmcLink, desc: &Desc, until: Instant) -> Result<RegionId, Fail> {
        if let Some(r) = link.region(&desc.name, &desc.key) {
            return Ok(r);
        }
        let server = link.server();
        let id = link.next_id();
        let open = Msg::SmcOpen {
            name: desc.name.clone(),
            key: desc.key.clone(),
        }
        .frame(id);
        self.inner
            .stats
            .transactions
            .fetch_add(1, Ordering::Relaxed);
        link.send(&[&open], until).map_err(Fail::Retry)?;
        let h = link
            .read_header(until, Duration::ZERO)
            .map_err(Fail::Retry)?;
        let mut p = vec![0u8; h.len as usize];
        link.read_payload(&mut p, until).map_err(Fail::Retry)?;
        let unexpected = Fail::Retry(LinkError::Unexpected {
            server,
            kind: h.kind,
            len: h.len,
        });
        if h.id != id {
            return Err(unexpected);
        }
        match Msg::decode(h.kind, &p) {
            Ok(Msg::SmcOpenOk {
                region,
                size,
                writable,
                window,
            }) => {
                let v = (region, size, writable);
                if window.is_none() && link.has_one_sided() {
                    ubdirect_ub::fallback::record(
                        "smc_no_window",
                        format!(
                            "smc region {:?} has no one-sided window on this server (GPU or heap \
                             memory): faults and barriers use requests on the connection",
                            desc.name
                        ),
                    );
                }
                link.set_region(&desc.name, &desc.key, v, window);
                Ok(v)
            }
            Ok(Msg::Error { code, message }) => Err(Fail::Refused(server, code, message)),
            _ => Err(unexpected),
        }
    }

    /// Runs `f` on a live link with region `desc` open on it, retrying on transport failures (each
    /// attempt on a fresh link, within the deadline); past the retries the region is marked
    /// unavailable. Returns `f`'s value and the region's id.
    fn with_link<T>(
        &self,
        desc: &Desc,
        mut f: impl FnMut(&mut SmcLink, u32, Instant) -> Result<T, Fail>,
    ) -> Result<(T, RegionId), SmcError> {
        let rt = self.link_runtime(desc)?;
        let start = Instant::now();
        let mut why = None;
        let attempts = self.inner.opts.retries + 1;
        for attempt in 0..attempts {
            if attempt > 0 {
                self.inner.stats.retries.fetch_add(1, Ordering::Relaxed);
                // A short pause before reconnecting to a peer that just failed.
                std::thread::sleep(Duration::from_millis(20));
            }
            let until = Instant::now() + self.inner.opts.deadline;
            match self.attempt_once(rt, desc, until, &mut f) {
                Ok(v) => return Ok(v),
                Err(Fail::Refused(_, code, message)) => {
                    return Err(if code == Code::Forbidden {
                        SmcError::ReadOnly {
                            region: desc.name.clone(),
                        }
                    } else {
                        SmcError::Refused {
                            region: desc.name.clone(),
                            code,
                            message,
                        }
                    });
                }
                Err(Fail::Lease(e)) => {
                    return Err(SmcError::Map {
                        region: desc.name.clone(),
                        why: e.to_string(),
                    });
                }
                Err(Fail::Retry(e)) => {
                    // The other idle links lead to the same server: suspect too.
                    self.inner
                        .links
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .clear();
                    why = Some(e);
                }
            }
        }
        desc.unavailable.store(true, Ordering::SeqCst);
        let e = SmcError::Unavailable {
            region: desc.name.clone(),
            attempts,
            waited: start.elapsed(),
            last: why,
        };
        tracing::error!("{e}");
        Err(e)
    }

    /// The runtime links run on, unless region `desc` is already unavailable or the client has no
    /// runtime (both `Unavailable` after no attempt).
    fn link_runtime(&self, desc: &Desc) -> Result<&tokio::runtime::Runtime, SmcError> {
        if desc.unavailable.load(Ordering::SeqCst) {
            return Err(SmcError::Unavailable {
                region: desc.name.clone(),
                attempts: 0,
                waited: Duration::ZERO,
                last: None,
            });
        }
        match &self.inner.rt {
            Ok(rt) => Ok(rt),
            Err(e) => Err(SmcError::Unavailable {
                region: desc.name.clone(),
                attempts: 0,
                waited: Duration::ZERO,
                last: Some(LinkError::Connect {
                    server: self.inner.addr,
                    source: e.clone(),
                }),
            }),
        }
    }

    /// One attempt of [`Self::with_link`]: an idle link (or a new one), region `desc` opened on
    /// it, then `f`; the link goes back to the idle ones only if all of that succeeded.
    fn attempt_once<T>(
        &self,
        rt: &tokio::runtime::Runtime,
        desc: &Desc,
        until: Instant,
        f: &mut impl FnMut(&mut SmcLink, u32, Instant) -> Result<T, Fail>,
    ) -> Result<(T, RegionId), Fail> {
        let idle = self
            .inner
            .links
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        let got = match idle {
            Some(l) => Ok(l),
            None => self.connect(rt, until),
        };
        got.and_then(|mut link| {
            let r = self
                .open_on(&mut link, desc, until)
                .and_then(|rid| f(&mut link, rid.0, until).map(|v| (v, rid)));
            if r.is_ok() {
                self.inner
                    .links
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(link);
            }
            // Otherwise the link is dropped: a refusal may leave replies of a batch unread,
            // a failure leaves the stream unusable.
            r
        })
    }

    /// Registers region `name` with its `key`: the descriptor is fetched once and cached; a second
    /// registration of the same name costs nothing.
    pub fn register(&self, name: &str, key: impl Into<Vec<u8>>) -> Result<Region, SmcError> {
        let key = key.into();
        if let Some(d) = self
            .inner
            .regions
            .lock()
            .ok()
            .and_then(|m| m.get(name).cloned())
            && d.key == key
        {
            return Ok(Region {
                client: self.clone(),
                desc: d,
            });
        }
        let t = Instant::now();
        let probe = Desc {
            name: name.into(),
            key: key.clone(),
            size: 0,
            writable: false,
            unavailable: AtomicBool::new(false),
        };
        let ((), (_, size, writable)) = self.with_link(&probe, |_, _, _| Ok(()))?;
        self.inner
            .stats
            .registrations
            .fetch_add(1, Ordering::Relaxed);
        self.inner
            .stats
            .register_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let d = Arc::new(Desc {
            name: name.into(),
            key,
            size,
            writable,
            unavailable: AtomicBool::new(false),
        });
        if let Ok(mut m) = self.inner.regions.lock() {
            m.insert(name.into(), d.clone());
        }
        Ok(Region {
            client: self.clone(),
            desc: d,
        })
    }
}
