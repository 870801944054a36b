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

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::os::fd::AsFd;

use crate::client::{Client, Fail, LinkError, RegionId, SmcLink};
use crate::proto::{Code, Header, Kind, Msg};
use crate::smc_sys::{Fault, Poisoned, UffdMapping};

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
    /// Context for the links' frame reader, and the runtime that connects new links.
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

/// What travels after a request's header.
enum Body<'a> {
    Empty,
    Bytes(&'a [u8]),
    /// Ranges (offset, len) of a mapping, sent straight out of it.
    Mapped(&'a UffdMapping, Vec<(usize, usize)>),
}

/// One request of a pipelined exchange: its frame header and fixed fields, its body, and where the
/// reply's payload goes (`None`: an acknowledgement).
struct Request<'a> {
    id: u64,
    head: Vec<u8>,
    body: Body<'a>,
    into: Option<&'a mut [u8]>,
}

impl<'a> Request<'a> {
    /// The frame header of a request of `kind` with `len` payload bytes, then `fixed`.
    fn head(kind: Kind, id: u64, len: usize, fixed: &[u8]) -> Vec<u8> {
        let mut h = Header {
            kind,
            id,
            len: len as u32,
        }
        .encode()
        .to_vec();
        h.extend_from_slice(fixed);
        h
    }

    /// `SmcRead` of `dst.len()` bytes at `offset`, the reply's payload into `dst`.
    fn read(id: u64, region: u32, offset: u64, dst: &'a mut [u8]) -> Self {
        let mut f = Vec::with_capacity(16);
        f.extend_from_slice(&region.to_le_bytes());
        f.extend_from_slice(&offset.to_le_bytes());
        f.extend_from_slice(&(dst.len() as u32).to_le_bytes());
        Self {
            id,
            head: Self::head(Kind::SmcRead, id, f.len(), &f),
            body: Body::Empty,
            into: Some(dst),
        }
    }

    /// `SmcWrite` of `src` at `offset`.
    fn write(id: u64, region: u32, offset: u64, src: &'a [u8]) -> Self {
        let mut f = Vec::with_capacity(12);
        f.extend_from_slice(&region.to_le_bytes());
        f.extend_from_slice(&offset.to_le_bytes());
        Self {
            id,
            head: Self::head(Kind::SmcWrite, id, f.len() + src.len(), &f),
            body: Body::Bytes(src),
            into: None,
        }
    }

    /// `SmcWriteV` of `ranges` of the mapping `m` (region offsets = mapping offsets).
    fn write_mapped(id: u64, region: u32, m: &'a UffdMapping, ranges: Vec<(usize, usize)>) -> Self {
        let mut f = Vec::with_capacity(8 + 12 * ranges.len());
        f.extend_from_slice(&region.to_le_bytes());
        f.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
        let mut data = 0;
        for &(o, l) in &ranges {
            f.extend_from_slice(&(o as u64).to_le_bytes());
            f.extend_from_slice(&(l as u32).to_le_bytes());
            data += l;
        }
        Self {
            id,
            head: Self::head(Kind::SmcWriteV, id, f.len() + data, &f),
            body: Body::Mapped(m, ranges),
            into: None,
        }
    }

    /// Bytes on the wire.
    fn wire_len(&self) -> usize {
        self.head.len()
            + match &self.body {
                Body::Empty => 0,
                Body::Bytes(b) => b.len(),
                Body::Mapped(_, r) => r.iter().map(|r| r.1).sum(),
            }
    }
}

/// Requests in flight at once on a link: enough to keep the server busy while the next is sent,
/// few enough that the replies of small requests never fill a socket buffer nobody reads yet.
const WINDOW: usize = 8;

/// Sends `reqs` on `link` (at most [`WINDOW`] unanswered) and takes their replies in order, each
/// payload straight into its destination; within `until`, spinning up to `spin` for each reply.
fn exchange(
    link: &mut SmcLink,
    reqs: &mut [Request<'_>],
    until: Instant,
    spin: Duration,
) -> Result<(), Fail> {
    let (mut sent, mut done) = (0, 0);
    while done < reqs.len() {
        while sent < reqs.len() && sent - done < WINDOW {
            send_request(link, &reqs[sent], until)?;
            sent += 1;
        }
        take_reply(link, &mut reqs[done], until, spin)?;
        done += 1;
    }
    Ok(())
}

/// Writes one request (head and body) within `until`.
fn send_request(link: &SmcLink, r: &Request<'_>, until: Instant) -> Result<(), Fail> {
    match &r.body {
        Body::Empty => link.send(&[&r.head], until),
        Body::Bytes(b) => link.send(&[&r.head, b], until),
        Body::Mapped(m, ranges) => link.send_with(r.wire_len(), until, |sock, at| {
            m.writev_from(sock.as_fd(), &r.head, ranges, at)
        }),
    }
    .map_err(Fail::Retry)
}

/// Takes the reply to `r` (the next one on the link), its payload straight into `r.into`.
fn take_reply(
    link: &mut SmcLink,
    r: &mut Request<'_>,
    until: Instant,
    spin: Duration,
) -> Result<(), Fail> {
    let server = link.server();
    let h = link.read_header(until, spin).map_err(Fail::Retry)?;
    let unexpected = || {
        Fail::Retry(LinkError::Unexpected {
            server,
            kind: h.kind,
            len: h.len,
        })
    };
    match (h.kind, &mut r.into) {
        _ if h.id != r.id => Err(unexpected()),
        (Kind::ReadOk, Some(dst)) if h.len as usize == dst.len() => {
            link.read_payload(dst, until).map_err(Fail::Retry)
        }
        (Kind::SmcWriteOk, None) if h.len == 0 => Ok(()),
        (Kind::Error, _) => {
            // Bounded by the header check (MAX_CONTROL).
            let mut p = vec![0u8; h.len as usize];
            link.read_payload(&mut p, until).map_err(Fail::Retry)?;
            Err(match Msg::decode(Kind::Error, &p) {
                Ok(Msg::Error { code, message }) => Fail::Refused(server, code, message),
                _ => unexpected(),
            })
        }
        _ => Err(unexpected()),
    }
}

/// Runs of adjacent pages `(first, count)` from sorted page numbers.
fn runs_of(pages: impl IntoIterator<Item = usize>) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for p in pages {
        match runs.last_mut() {
            Some((s, n)) if *s + *n == p => *n += 1,
            _ => runs.push((p, 1)),
        }
    }
    runs
}

/// 4 KiB pages the first PAGEMAP_SCAN of a barrier looks for; each next scan looks for twice as
/// many, up to [`SCAN_MAX`]: the first push starts early, and later scans overlap with the pushes
/// of the earlier ones on the wire.
const SCAN_FIRST: usize = 64;
/// Vectored writes of a barrier sent before their acknowledgements are taken (each is ~20 bytes:
/// 256 of them stay far below any socket buffer).
const ACK_WINDOW: usize = 256;
const SCAN_MAX: usize = 1024;

/// A barrier's walk over the mapping's written pages (kernel dirty tracking): batch by batch, each
/// write-protected again by the scan that finds it.
struct Scanner {
    next: usize,
    batch: usize,
    done: bool,
    spent: Duration,
    failed: Option<String>,
}

impl Scanner {
    /// The next batch's SMC pages (of `page` bytes) not already in `pages`, added to it. A failed
    /// scan ends the walk (kept in `failed`; the pages found before it are still pushed).
    fn batch(&mut self, m: &UffdMapping, page: usize, pages: &mut BTreeSet<usize>) -> Vec<usize> {
        let t = Instant::now();
        let mut fresh = Vec::new();
        match m.scan_written_from(self.next, self.batch) {
            Ok((runs, next)) => {
                for (o, l) in runs {
                    for p in o / page..(o + l).div_ceil(page) {
                        if pages.insert(p) {
                            fresh.push(p);
                        }
                    }
                }
                self.done = next <= self.next || next >= m.len();
                self.next = next;
                self.batch = (self.batch * 2).min(SCAN_MAX);
            }
            Err(e) => {
                self.failed = Some(e);
                self.done = true;
            }
        }
        self.spent += t.elapsed();
        fresh.sort_unstable();
        fresh
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
        let f = self.inner.client.smc_link(until, rt.handle().clone());
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
        if desc.unavailable.load(Ordering::SeqCst) {
            return Err(SmcError::Unavailable {
                region: desc.name.clone(),
                attempts: 0,
                waited: Duration::ZERO,
                last: None,
            });
        }
        let rt = match &self.inner.rt {
            Ok(rt) => rt,
            Err(e) => {
                return Err(SmcError::Unavailable {
                    region: desc.name.clone(),
                    attempts: 0,
                    waited: Duration::ZERO,
                    last: Some(LinkError::Connect {
                        server: self.inner.addr,
                        source: e.clone(),
                    }),
                });
            }
        };
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
            let r = got.and_then(|mut link| {
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
            });
            match r {
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

/// A registered region.
#[derive(Clone)]
pub struct Region {
    client: SmcClient,
    desc: Arc<Desc>,
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

    fn check(&self, offset: u64, len: u64) -> Result<(), SmcError> {
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
    fn read_spin(&self, offset: u64, buf: &mut [u8], spin: Duration) -> Result<(), SmcError> {
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
    fn fetch(
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

    /// Maps the region into this process (see the module documentation).
    pub fn map(&self, opts: MapOptions) -> Result<Mapping, SmcError> {
        let bad = |why: String| SmcError::Map {
            region: self.desc.name.clone(),
            why,
        };
        if !opts.page_size.is_power_of_two() || !(4096..=2 << 20).contains(&opts.page_size) {
            return Err(bad(format!(
                "page size {} is not a power of two in 4 KiB ..= 2 MiB",
                opts.page_size
            )));
        }
        let len = (self.desc.size as usize).div_ceil(opts.page_size) * opts.page_size;
        let wp = opts.mode == SyncMode::WriteBack && self.desc.writable;
        let m = UffdMapping::new(len, self.desc.writable, wp, opts.wp_async).map_err(bad)?;
        if wp && opts.wp_async && !m.wp_async() {
            ubdirect_ub::fallback::record(
                "smc_wp_sync",
                "the kernel has no UFFD_FEATURE_WP_ASYNC / PAGEMAP_SCAN (Linux < 6.7): dirty pages \
                 are tracked by write-protect faults through the fault thread",
            );
        }
        let pages = len / opts.page_size;
        let block = opts
            .page_size
            .checked_mul(opts.readahead.saturating_add(1))
            .ok_or_else(|| bad(format!("readahead {} is too large", opts.readahead)))?;
        // Registered with the transport once, here (RDMA: the faults' READs land in it).
        let registrar = self.client.inner.client.registrar();
        let host_pool = |name: String, block: usize| {
            let mut b = ubdirect_ub::UbPool::builder(ubdirect_ub::PoolConfig::new(
                name,
                block,
                1,
                ubdirect_ub::MemoryKind::Host,
            ));
            if let Some(r) = &registrar {
                b = b.register_with(r.clone());
            }
            b.build()
        };
        let pool = host_pool(format!("smc-{}", self.desc.name), block);
        // Write-back over a transport with one-sided writes: dirty runs are copied into this block
        // (registered once) and written from it; the mapping itself is never registered (pinning
        // its pages would fault in the whole region).
        let push = match (&registrar, wp) {
            (Some(_), true) => {
                let block = PUSH_BLOCK.min(len.div_ceil(4096) * 4096);
                match host_pool(format!("smc-{}-push", self.desc.name), block) {
                    Ok(p) => p.try_acquire().map(|l| (l, p)),
                    Err(e) => {
                        ubdirect_ub::fallback::record(
                            "smc_push_buffer",
                            format!(
                                "no registered push block for SMC barriers ({e}): dirty pages go \
                                 out as requests on the connection"
                            ),
                        );
                        None
                    }
                }
            }
            _ => None,
        };
        let (push, push_pool) = match push {
            Some((l, p)) => (Some(l), Some(p)),
            None => (None, None),
        };
        let (pool, staging) = match pool {
            Ok(p) => {
                let l = p.try_acquire();
                (Some(p), l)
            }
            Err(e) => {
                ubdirect_ub::fallback::record(
                    "smc_fault_buffers",
                    format!("no staging pool for SMC faults ({e}): each fault allocates its pages"),
                );
                (None, None)
            }
        };
        let sh = Arc::new(MapShared {
            m,
            region: self.clone(),
            page: opts.page_size,
            readahead: opts.readahead,
            spin: opts.spin,
            wp,
            present: (0..pages).map(|_| AtomicBool::new(false)).collect(),
            dirty: Mutex::new(BTreeSet::new()),
            failed: AtomicBool::new(false),
            barrier: Mutex::new(()),
            staging: Mutex::new(staging),
            push: Mutex::new(push),
            _pool: pool,
            _push_pool: push_pool,
        });
        let s2 = sh.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ub-smc-{}", self.desc.name))
            .spawn(move || fault_loop(&s2))
            .map_err(|e| bad(format!("cannot start the fault thread: {e}")))?;
        Ok(Mapping {
            sh,
            thread: Some(thread),
        })
    }
}

struct MapShared {
    m: UffdMapping,
    region: Region,
    page: usize,
    readahead: usize,
    spin: Duration,
    wp: bool,
    present: Vec<AtomicBool>,
    dirty: Mutex<BTreeSet<usize>>,
    failed: AtomicBool,
    /// One barrier at a time.
    barrier: Mutex<()>,
    /// The block faults are fetched into (page × (1 + readahead) bytes); dropped before its pool.
    staging: Mutex<Option<ubdirect_ub::Lease>>,
    /// The block barriers push from over a one-sided transport ([`PUSH_BLOCK`] or the region's
    /// size); dropped before its pool.
    push: Mutex<Option<ubdirect_ub::Lease>>,
    _pool: Option<ubdirect_ub::UbPool>,
    _push_pool: Option<ubdirect_ub::UbPool>,
}

/// The registered block a barrier copies dirty runs into before writing them one-sided: large
/// enough that a 4 MiB barrier is one copy and one batch of WRITEs.
const PUSH_BLOCK: usize = 4 << 20;

impl MapShared {
    fn fail(&self) {
        if !self.failed.swap(true, Ordering::SeqCst) {
            let name = &self.region.desc.name;
            match self.m.poison() {
                Ok(Poisoned::Sigbus) => {}
                Ok(Poisoned::Sigsegv { why }) => ubdirect_ub::fallback::record(
                    "smc_unavailable_sigsegv",
                    format!(
                        "smc region {name:?}: cannot install the SIGBUS mapping ({why}); \
                         accesses to the unavailable region raise SIGSEGV instead"
                    ),
                ),
                Err(why) => {
                    ubdirect_ub::fallback::record(
                        "smc_unavailable_no_signal",
                        format!("smc region {name:?}: cannot poison the mapping: {why}"),
                    );
                    tracing::error!(
                        region = %name,
                        "smc region unavailable and its mapping cannot be poisoned ({why}): \
                         threads faulting on it stay blocked"
                    );
                }
            }
        }
    }

    fn handle(&self, f: Fault) -> Result<(), SmcError> {
        let off = (f.addr - self.m.base() as u64) as usize;
        let p = off / self.page;
        let stats = &self.region.client.inner.stats;
        if f.wp {
            stats.wp_faults.fetch_add(1, Ordering::Relaxed);
            if self.dirty.lock().map(|mut d| d.insert(p)).unwrap_or(false) {
                stats.dirty_pages.fetch_add(1, Ordering::Relaxed);
            }
            self.m
                .protect(p * self.page, self.page, false)
                .map_err(|why| SmcError::Map {
                    region: self.region.desc.name.clone(),
                    why,
                })?;
            return Ok(());
        }
        if self.present[p].load(Ordering::SeqCst) {
            self.m.wake(p * self.page, self.page);
            return Ok(());
        }
        // The faulting page and read-ahead pages up to the first present one.
        let mut n = 1;
        while n <= self.readahead
            && p + n < self.present.len()
            && !self.present[p + n].load(Ordering::SeqCst)
        {
            n += 1;
        }
        let start = (p * self.page) as u64;
        let end = (start + (n * self.page) as u64).min(self.region.desc.size);
        // Received straight into the mapping's staging block (one UB lease registered with the
        // transport, reused by every fault: over RDMA the READ lands in it); a fresh buffer only
        // when no pool could be made (a recorded fallback).
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let got = end.saturating_sub(start) as usize;
        let mut fresh = Vec::new();
        let buf: &mut [u8] = match staging.as_mut() {
            Some(l) if l.capacity() >= n * self.page => {
                if got > 0 {
                    self.region.fetch(start, l, got, self.spin)?;
                }
                match l.as_mut_slice() {
                    Ok(b) => &mut b[..n * self.page],
                    Err(e) => {
                        return Err(SmcError::Map {
                            region: self.region.desc.name.clone(),
                            why: format!("the staging block is not host memory: {e}"),
                        });
                    }
                }
            }
            _ => {
                fresh.resize(n * self.page, 0);
                if got > 0 {
                    self.region.read_spin(start, &mut fresh[..got], self.spin)?;
                }
                &mut fresh
            }
        };
        // Past the region's end: zeros (the block is reused).
        buf[got..].fill(0);
        stats.faults.fetch_add(1, Ordering::Relaxed);
        // A first touch that is a store, with fault-tracked dirtiness: dirty before the fill wakes
        // the writer (a barrier racing with this fault must not miss it), released after. With
        // kernel tracking, the retried store is resolved and recorded by the kernel itself.
        let store_miss = f.write && self.wp && !self.m.wp_async();
        if store_miss && self.dirty.lock().map(|mut d| d.insert(p)).unwrap_or(false) {
            stats.dirty_pages.fetch_add(1, Ordering::Relaxed);
        }
        self.m
            .fill(p * self.page, buf, self.wp)
            .map_err(|why| SmcError::Map {
                region: self.region.desc.name.clone(),
                why,
            })?;
        for q in p..p + n {
            self.present[q].store(true, Ordering::SeqCst);
        }
        if store_miss {
            self.m
                .protect(p * self.page, self.page, false)
                .map_err(|why| SmcError::Map {
                    region: self.region.desc.name.clone(),
                    why,
                })?;
        }
        Ok(())
    }
}

fn fault_loop(sh: &MapShared) {
    let mut faults = Vec::new();
    let spin = sh.spin;
    let mut last = Instant::now()
        .checked_sub(spin)
        .unwrap_or_else(Instant::now);
    loop {
        faults.clear();
        let got = if last.elapsed() < spin {
            sh.m.try_read(&mut faults).map(|_| true)
        } else {
            sh.m.wait(&mut faults)
        };
        match got {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                tracing::error!("smc fault thread: {e}");
                sh.fail();
                return;
            }
        }
        if faults.is_empty() {
            std::hint::spin_loop();
            continue;
        }
        last = Instant::now();
        for f in faults.drain(..) {
            if let Err(e) = sh.handle(f) {
                tracing::error!("smc fault at {:#x}: {e}; accesses now raise SIGBUS", f.addr);
                sh.fail();
                return;
            }
        }
    }
}

/// A barrier's dirty runs (first page, pages) written one-sided: copied out of the mapping into the
/// registered `push` block as many as fit, written from it into the region's window (all in flight
/// at once), and again until every run went. Returns (transfers, transactions, bytes): one WRITE
/// per contiguous piece.
#[allow(clippy::too_many_arguments)]
fn push_one_sided(
    m: &UffdMapping,
    runs: &[(usize, usize)],
    page: usize,
    size: usize,
    push: &mut ubdirect_ub::Lease,
    os: &dyn crate::transport::OneSided,
    w: crate::proto::RemoteWindow,
    until: Instant,
) -> Result<(usize, usize, usize), crate::transport::OneSidedError> {
    let cap = push.capacity();
    let (mut transfers, mut bytes) = (0, 0);
    let mut parts: Vec<(usize, usize, u64)> = Vec::new();
    let mut used = 0;
    let flush = |parts: &mut Vec<(usize, usize, u64)>,
                 push: &mut ubdirect_ub::Lease|
     -> Result<(), crate::transport::OneSidedError> {
        if !parts.is_empty() {
            os.write(push, parts, w.rkey, until)?;
            parts.clear();
        }
        Ok(())
    };
    for &(s, n) in runs {
        let (a, b) = (s * page, ((s + n) * page).min(size));
        let mut o = a;
        while o < b {
            if used == cap {
                flush(&mut parts, push)?;
                used = 0;
            }
            let l = (b - o).min(cap - used);
            let dst = push
                .as_mut_slice()
                .map_err(|e| Arc::new(e) as crate::transport::OneSidedError)?;
            // The pages are write-protected again (or scanned and re-protected): what is copied
            // is what this barrier pushes; a later store is caught for the next one.
            m.load(o, &mut dst[used..used + l]).map_err(|e| {
                Arc::new(std::io::Error::other(e)) as crate::transport::OneSidedError
            })?;
            parts.push((used, l, w.addr + o as u64));
            used += l;
            bytes += l;
            transfers += 1;
            o += l;
        }
    }
    flush(&mut parts, push)?;
    Ok((transfers, transfers, bytes))
}

/// What a barrier pushed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BarrierStats {
    /// Dirty pages pushed.
    pub pages: usize,
    /// Contiguous transfers (runs of adjacent dirty pages, split at max_request).
    pub transfers: usize,
    /// Network transactions (vectored writes carrying the transfers, each ≤ max_request).
    pub transactions: usize,
    /// Bytes pushed.
    pub bytes: usize,
    /// Time spent finding the dirty pages and protecting them again (PAGEMAP_SCAN, or
    /// re-protecting fault-tracked pages); over TCP most of it overlaps with `push`.
    pub scan: Duration,
    /// Time from the first byte sent to the last acknowledgement (or completion).
    pub push: Duration,
}

/// A region mapped into this process. Dropping it stops its fault thread and unmaps it (dirty pages
/// not pushed by a barrier are lost).
pub struct Mapping {
    sh: Arc<MapShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("region", &self.sh.region.desc.name)
            .field("page", &self.sh.page)
            .finish()
    }
}

impl Mapping {
    /// Start address, for code that loads and stores through raw pointers. The bytes behind it are
    /// shared memory that the kernel and other threads change at any time (and that turns into a
    /// SIGBUS mapping when the region becomes unavailable): access them through raw pointers
    /// (`read_volatile`/`write_volatile`), never through a `&[u8]` made from this pointer.
    /// [`Mapping::load`] and [`Mapping::store`] do that for you.
    pub fn as_ptr(&self) -> *mut u8 {
        self.sh.m.base()
    }

    /// Stores `data` at `offset` in the mapping (write-back: the pages become dirty).
    pub fn store(&self, offset: usize, data: &[u8]) -> Result<(), SmcError> {
        self.sh.region.check(offset as u64, data.len() as u64)?;
        if !self.sh.region.desc.writable {
            return Err(SmcError::ReadOnly {
                region: self.sh.region.desc.name.clone(),
            });
        }
        self.alive()?;
        self.sh.m.store(offset, data).map_err(|why| SmcError::Map {
            region: self.sh.region.desc.name.clone(),
            why,
        })
    }

    /// Loads `buf.len()` bytes at `offset` from the mapping.
    pub fn load(&self, offset: usize, buf: &mut [u8]) -> Result<(), SmcError> {
        self.sh.region.check(offset as u64, buf.len() as u64)?;
        self.alive()?;
        self.sh.m.load(offset, buf).map_err(|why| SmcError::Map {
            region: self.sh.region.desc.name.clone(),
            why,
        })
    }

    fn alive(&self) -> Result<(), SmcError> {
        if self.sh.failed.load(Ordering::SeqCst) {
            return Err(SmcError::Unavailable {
                region: self.sh.region.desc.name.clone(),
                attempts: 0,
                waited: Duration::ZERO,
                last: None,
            });
        }
        Ok(())
    }

    /// Write-through from the mapping's side: sends `data` to the server, waits for the ack, and
    /// stores it locally too.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), SmcError> {
        self.sh.region.write(offset as u64, data)?;
        self.store(offset, data)
    }

    /// Pushes every dirty page (adjacent pages merged, split at the server's max_request) and
    /// returns after the server acknowledged all of them; the pages are write-protected again
    /// first, so stores made during the barrier are caught for the next one.
    pub fn barrier(&self) -> Result<BarrierStats, SmcError> {
        self.alive()?;
        let _one = self.sh.barrier.lock().unwrap_or_else(|p| p.into_inner());
        let name = || self.sh.region.desc.name.clone();
        let map_err = |why| SmcError::Map {
            region: name(),
            why,
        };
        let page = self.sh.page;
        let m = &self.sh.m;
        let t0 = Instant::now();
        // Pages recorded by write-protect faults (without kernel tracking: every dirty page; each
        // is protected again before it is read, so a store during the barrier is caught for the
        // next one).
        let mut pages: BTreeSet<usize> =
            std::mem::take(&mut *self.sh.dirty.lock().unwrap_or_else(|p| p.into_inner()));
        let recorded = pages.len();
        if !m.wp_async() {
            for &p in &pages {
                m.protect(p * page, page, true).map_err(map_err)?;
            }
        }
        // With kernel tracking the written pages are found by PAGEMAP_SCAN in growing batches, each
        // write-protected again by the scan that finds it; over TCP a batch's pages go out before
        // the next batch is scanned, so the page-table walk overlaps with the wire.
        let mut scan = Scanner {
            next: 0,
            batch: SCAN_FIRST,
            done: !m.wp_async(),
            spent: t0.elapsed(),
            failed: None,
        };
        let size = self.sh.region.desc.size as usize;
        let stats = &self.sh.region.client.inner.stats;
        let mut push = self.sh.push.lock().unwrap_or_else(|p| p.into_inner());
        let mut first_send: Option<Instant> = None;
        let pushed = self
            .sh
            .region
            .client
            .with_link(&self.sh.region.desc, |link, rid, until| {
                if let Some((os, w)) = link.one_sided(&self.sh.region.desc.name)
                    && let Some(push) = push.as_mut()
                {
                    // One-sided: every batch first (the copy into the push block is the overlap).
                    while !scan.done {
                        scan.batch(m, page, &mut pages);
                    }
                    let runs = runs_of(pages.iter().copied());
                    first_send.get_or_insert_with(Instant::now);
                    return push_one_sided(m, &runs, page, size, push, os, w, until)
                        .inspect(|v| {
                            stats.transactions.fetch_add(v.1 as u64, Ordering::Relaxed);
                        })
                        .map_err(|source| {
                            Fail::Retry(LinkError::OneSided {
                                server: link.server(),
                                what: "write",
                                source,
                            })
                        });
                }
                let max = (link.max_request() as usize).max(4096);
                // Pieces of at most max_request less a range header, in 4 KiB units: an SMC page
                // larger than max_request (2 MiB pages, 1 MiB requests) is pushed in several.
                let chunk = (max.saturating_sub(12) / 4096).max(1) * 4096;
                let (mut transfers, mut bytes) = (0usize, 0usize);
                let mut reqs: Vec<Request<'_>> = Vec::new();
                let (mut sent, mut taken) = (0, 0);
                // What is known first (recorded pages, or what an earlier attempt scanned), then
                // batch by batch. Each run (split at max_request) is one range; a batch's ranges
                // are packed into vectored writes of at most max_request bytes (one network
                // transaction each), sent straight out of the mapping, back to back; the
                // acknowledgements (a few bytes each) are taken at the end.
                let mut fresh: Vec<usize> = pages.iter().copied().collect();
                loop {
                    if !fresh.is_empty() {
                        let mut packed: Vec<(Vec<(usize, usize)>, usize)> = Vec::new();
                        for (s, n) in runs_of(fresh.iter().copied()) {
                            let (a, b) = (s * page, ((s + n) * page).min(size));
                            let mut o = a;
                            while o < b {
                                let e = (o + chunk).min(b);
                                match packed.last_mut() {
                                    Some((r, d)) if *d + (r.len() + 1) * 12 + (e - o) <= max => {
                                        r.push((o, e - o));
                                        *d += e - o;
                                    }
                                    _ => packed.push((vec![(o, e - o)], e - o)),
                                }
                                transfers += 1;
                                bytes += e - o;
                                o = e;
                            }
                        }
                        for (r, _) in packed {
                            let id = link.next_id();
                            reqs.push(Request::write_mapped(id, rid, m, r));
                        }
                        first_send.get_or_insert_with(Instant::now);
                        while sent < reqs.len() {
                            // Acknowledgements are a few bytes each, but unread ones add up: past
                            // ACK_WINDOW the oldest is taken first, so the server never blocks
                            // writing replies nobody reads.
                            if sent - taken >= ACK_WINDOW {
                                take_reply(link, &mut reqs[taken], until, Duration::ZERO)?;
                                taken += 1;
                            }
                            send_request(link, &reqs[sent], until)?;
                            sent += 1;
                        }
                    }
                    if scan.done {
                        break;
                    }
                    fresh = scan.batch(m, page, &mut pages);
                }
                stats
                    .transactions
                    .fetch_add(reqs.len() as u64, Ordering::Relaxed);
                for r in reqs[taken..].iter_mut() {
                    take_reply(link, r, until, Duration::ZERO)?;
                }
                Ok((transfers, reqs.len(), bytes))
            });
        stats
            .dirty_pages
            .fetch_add((pages.len() - recorded) as u64, Ordering::Relaxed);
        let (transfers, transactions, bytes) = match pushed {
            Ok((v, _)) => v,
            Err(e) => {
                // Not pushed: still dirty (the region is unavailable now, but nothing is forgotten).
                if let Ok(mut d) = self.sh.dirty.lock() {
                    d.extend(pages.iter().copied());
                }
                return Err(e);
            }
        };
        if let Some(why) = scan.failed {
            // What was found before the failed scan went out; the rest stays written (the next
            // barrier's scan finds it).
            return Err(map_err(why));
        }
        stats
            .pushes
            .fetch_add(transactions as u64, Ordering::Relaxed);
        stats
            .bytes_pushed
            .fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(BarrierStats {
            pages: pages.len(),
            transfers,
            transactions,
            bytes,
            scan: scan.spent,
            push: first_send.map(|t| t.elapsed()).unwrap_or_default(),
        })
    }

    /// Same as [`Mapping::barrier`], for code that reads `flush` better.
    pub fn flush(&self) -> Result<BarrierStats, SmcError> {
        self.barrier()
    }

    /// Pages dirty now as far as the fault thread knows (with kernel-tracked write protection the
    /// count is known only at the next barrier: this returns what earlier faults recorded).
    pub fn dirty_pages(&self) -> usize {
        self.sh.dirty.lock().map(|d| d.len()).unwrap_or(0)
    }

    /// Whether dirty pages are tracked by the kernel (WP_ASYNC + PAGEMAP_SCAN).
    pub fn kernel_dirty_tracking(&self) -> bool {
        self.sh.m.wp_async()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        self.sh.m.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;

    /// The heads written by hand (so that bodies travel without a copy) are the protocol's frames.
    #[test]
    fn request_heads_and_bodies_are_the_protocols_frames() {
        let mut dst = [0u8; 4096];
        let r = Request::read(7, 3, 8192, &mut dst);
        let want = Msg::SmcRead {
            region: 3,
            offset: 8192,
            len: 4096,
        }
        .frame(7);
        assert_eq!((r.head.clone(), r.wire_len()), (want.clone(), want.len()));
        let src = b"some bytes";
        let w = Request::write(9, 1, 100, src);
        let mut got = w.head.clone();
        got.extend_from_slice(src);
        assert_eq!(
            got,
            Msg::SmcWrite {
                region: 1,
                offset: 100,
                data: src.to_vec(),
            }
            .frame(9)
        );
        assert_eq!(w.wire_len(), got.len());
        // A vectored write of two ranges of a mapping: the head carries the table, the bytes
        // follow from the mapping.
        let m = UffdMapping::new(4 * 4096, true, false, false).unwrap();
        m.fill(0, &[5u8; 8192], false).unwrap();
        let v = Request::write_mapped(11, 2, &m, vec![(10, 20), (4096, 100)]);
        let want = Msg::SmcWriteV {
            region: 2,
            ranges: vec![(10, 20), (4096, 100)],
            data: vec![5u8; 120],
        }
        .frame(11);
        assert_eq!(v.wire_len(), want.len());
        assert_eq!(v.head[..], want[..want.len() - 120]);
    }
}
