//! The client: a connection per server with many requests in flight, payloads received straight
//! into the destination lease (no intermediate buffer), reconnect-and-retry within a deadline, and
//! failover across replicas that hold the same files.
//!
//! Owned-buffer style: [`Client::read`] takes a lease and always gives it back, with the result —
//! also on a refusal, a timeout, or a connection lost mid-payload. While a request is out, its lease
//! sits in the connection's pending map inside a `Delivery`, which hands it back exactly once: when
//! the reply is in, or — from its `Drop` — when the connection goes away. The reader receives every
//! payload within the client's deadline, so a read that gave up waits at most that long for its lease.
//! Under RDMA, the connection's queue pair is destroyed before a lease whose RDMA WRITE may still
//! land is handed back (see `Conn::close_path`).

mod conn;
mod error;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use ubdirect_ub::Lease;

pub(crate) use conn::Conn;
use conn::{
    Delivery, Pending, PendingMap, close_path, fail_all, reader_loop, take_pending,
    unreachable_lease,
};
pub(crate) use error::Fail;
pub use error::{ClientError, LinkError};

use crate::proto::{self, Code, FrameError, Msg};
use crate::transport::{AttachError, Tcp, Transport};

/// (connection generation, root, path): file ids are per connection.
type OpenKey = (u64, String, String);

/// A region's id on one connection, its size, and whether this token may write.
pub(crate) type RegionId = (u32, u64, bool);

struct Inner {
    servers: Vec<SocketAddr>,
    token: Vec<u8>,
    deadline: Duration,
    next_id: AtomicU64,
    generation: AtomicU64,
    /// The connections reads are spread over (round robin), each made on first use and remade
    /// when it dies.
    conns: Vec<tokio::sync::Mutex<Option<Arc<Conn>>>>,
    next_conn: AtomicU64,
    preferred: AtomicU64,
    /// Whether any connection was ever made, and when a first contact was first refused: a server
    /// nobody ever reached that refuses for a second is not there (not retried to the deadline).
    connected_once: AtomicBool,
    first_refused: std::sync::Mutex<Option<Instant>>,
    /// Per connection generation: remote file ids by (root, path).
    opened: Mutex<HashMap<OpenKey, (u32, u64)>>,
    max_request: AtomicU64,
    /// Whether a server told its max_request yet.
    max_known: AtomicBool,
    transport: Arc<dyn Transport>,
}

/// A client of one or more servers holding the same files. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("servers", &self.inner.servers)
            .field("transport", &self.inner.transport.name())
            .finish()
    }
}

/// A file on the servers.
#[derive(Debug, Clone)]
pub struct RemoteFile {
    /// Export root.
    pub root: String,
    /// Path under it.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
}

/// Time left until `until` (at least 10 ms, so a last attempt can still complete).
fn left(until: Instant) -> Duration {
    until
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(10))
}

impl Client {
    /// A client for `servers` (replicas: a failed read moves to the next); every request is retried
    /// across reconnects until `deadline`.
    pub fn new(servers: Vec<SocketAddr>, token: impl Into<Vec<u8>>, deadline: Duration) -> Self {
        Self::with_transport(servers, token, deadline, Arc::new(Tcp))
    }

    /// As [`Client::new`], with payloads moved by `transport`.
    pub fn with_transport(
        servers: Vec<SocketAddr>,
        token: impl Into<Vec<u8>>,
        deadline: Duration,
        transport: Arc<dyn Transport>,
    ) -> Self {
        Self::with_connections(servers, token, deadline, transport, 1)
    }

    /// As [`Client::with_transport`], with requests spread round robin over `connections`
    /// connections to the server (at least 1): each is its own stream with its own reader, so
    /// payloads are received on several cores where one stream is the limit.
    pub fn with_connections(
        servers: Vec<SocketAddr>,
        token: impl Into<Vec<u8>>,
        deadline: Duration,
        transport: Arc<dyn Transport>,
        connections: usize,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                servers,
                token: token.into(),
                deadline,
                next_id: AtomicU64::new(1),
                generation: AtomicU64::new(0),
                conns: (0..connections.max(1))
                    .map(|_| tokio::sync::Mutex::new(None))
                    .collect(),
                next_conn: AtomicU64::new(0),
                preferred: AtomicU64::new(0),
                connected_once: AtomicBool::new(false),
                first_refused: std::sync::Mutex::new(None),
                opened: Mutex::new(HashMap::new()),
                max_request: AtomicU64::new(16 << 20),
                max_known: AtomicBool::new(false),
                transport,
            }),
        }
    }

    /// How many connections reads are spread over.
    pub fn connections(&self) -> usize {
        self.inner.conns.len()
    }

    /// The transport's name (`tcp`, `rdma`).
    pub fn transport(&self) -> &'static str {
        self.inner.transport.name()
    }

    /// What destination pools must be registered with (at creation) for payloads to land in them
    /// without a fallback; `None` for TCP.
    pub fn registrar(&self) -> Option<Arc<dyn ubdirect_ub::Registrar>> {
        self.inner.transport.registrar()
    }

    /// Largest read the connected server accepts.
    pub fn max_request(&self) -> u64 {
        self.inner.max_request.load(Ordering::Relaxed)
    }

    /// The deadline of every request (retries included).
    pub fn deadline(&self) -> Duration {
        self.inner.deadline
    }

    /// The servers, as `host:port`.
    pub fn servers(&self) -> Vec<String> {
        self.inner.servers.iter().map(|s| s.to_string()).collect()
    }

    /// Connects to `addr` and says hello (the token): the start of every connection, learning the
    /// server's max_request. Returns the stream, ready for requests.
    async fn handshake(&self, addr: SocketAddr, until: Instant) -> Result<TcpStream, Fail> {
        let wait = left(until).min(Duration::from_secs(10));
        let io = |source| {
            Fail::Retry(LinkError::Send {
                server: addr,
                source: Arc::new(source),
            })
        };
        let mut sock = tokio::time::timeout(wait, TcpStream::connect(addr))
            .await
            .map_err(|_| {
                Fail::Retry(LinkError::Deadline {
                    server: addr,
                    what: "connection",
                    waited: wait,
                })
            })?
            .map_err(|e| {
                Fail::Retry(LinkError::Connect {
                    server: addr,
                    source: Arc::new(e),
                })
            })?;
        let _ = sock.set_nodelay(true);
        let hello = Msg::Hello {
            token: self.inner.token.clone(),
        }
        .frame(0);
        tokio::time::timeout(wait, sock.write_all(&hello))
            .await
            .map_err(|_| {
                Fail::Retry(LinkError::Deadline {
                    server: addr,
                    what: "send",
                    waited: wait,
                })
            })?
            .map_err(io)?;
        let (hdr, p) = proto::read_frame(&mut sock, 0, wait, wait)
            .await
            .map_err(|source| {
                // A silent peer is no server (unavailable), not a late reply.
                Fail::Retry(match source {
                    FrameError::Timeout { .. } => LinkError::Deadline {
                        server: addr,
                        what: "hello reply",
                        waited: wait,
                    },
                    source => LinkError::Receive {
                        server: addr,
                        source,
                    },
                })
            })?;
        match Msg::decode(hdr.kind, &p) {
            Ok(Msg::HelloOk { max_request, .. }) => {
                self.inner
                    .max_request
                    .store(max_request as u64, Ordering::Relaxed);
                self.inner.max_known.store(true, Ordering::Relaxed);
                Ok(sock)
            }
            Ok(Msg::Error { code, message }) => Err(Fail::Refused(addr, code, message)),
            Ok(_) => Err(Fail::Retry(LinkError::Unexpected {
                server: addr,
                kind: hdr.kind,
                len: hdr.len,
            })),
            Err(e) => Err(Fail::Retry(LinkError::Receive {
                server: addr,
                source: FrameError::Proto(e),
            })),
        }
    }

    async fn connect_one(&self, addr: SocketAddr, until: Instant) -> Result<Arc<Conn>, Fail> {
        let wait = left(until).min(Duration::from_secs(10));
        let (mut rd, mut wr) = self.handshake(addr, until).await?.into_split();
        let path = self
            .inner
            .transport
            .attach(&mut rd, &mut wr, wait)
            .await
            .map_err(|e| match e {
                AttachError::Refused { code, message } => Fail::Refused(addr, code, message),
                e => Fail::Retry(LinkError::Attach {
                    server: addr,
                    source: Arc::new(e),
                }),
            })?;
        let pending: PendingMap = Arc::default();
        let dead = Arc::new(AtomicBool::new(false));
        let path = Arc::new(Mutex::new(Some(path)));
        let (p2, d2, path2) = (pending.clone(), dead.clone(), path.clone());
        let max = self.inner.max_request.load(Ordering::Relaxed) as u32;
        let payload_deadline = self.inner.deadline;
        let reader = tokio::spawn(async move {
            let why = reader_loop(rd, &p2, max, addr, payload_deadline).await;
            d2.store(true, Ordering::SeqCst);
            // Path first: no late RDMA WRITE lands in a lease handed back below.
            close_path(&path2);
            fail_all(&p2, &why);
        });
        Ok(Arc::new(Conn {
            server: addr,
            writer: tokio::sync::Mutex::new(wr),
            pending,
            dead,
            reader,
            generation: self.inner.generation.fetch_add(1, Ordering::Relaxed) + 1,
            path,
        }))
    }

    pub(crate) async fn conn(&self, until: Instant) -> Result<Arc<Conn>, Fail> {
        let conns = &self.inner.conns;
        let k = match conns.len() {
            1 => 0,
            n => (self.inner.next_conn.fetch_add(1, Ordering::Relaxed) % n as u64) as usize,
        };
        let Some(slot) = conns.get(k) else {
            return Err(Fail::Retry(LinkError::NoServers));
        };
        let mut g = slot.lock().await;
        if let Some(c) = g.as_ref()
            && !c.dead.load(Ordering::SeqCst)
        {
            return Ok(c.clone());
        }
        *g = None;
        let n = self.inner.servers.len().max(1);
        let start = self.inner.preferred.load(Ordering::Relaxed) as usize;
        let mut last = LinkError::NoServers;
        for k in 0..n {
            let i = (start + k) % n;
            let Some(&addr) = self.inner.servers.get(i) else {
                break;
            };
            match self.connect_one(addr, until).await {
                Ok(c) => {
                    self.inner.preferred.store(i as u64, Ordering::Relaxed);
                    self.inner.connected_once.store(true, Ordering::Relaxed);
                    *g = Some(c.clone());
                    return Ok(c);
                }
                Err(Fail::Retry(e)) => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(Fail::Retry(last))
    }

    /// Whether to stop retrying before the deadline: no connection was ever made, and every
    /// server has refused connections for a second (nothing listens there; a restarting server
    /// that was reached before is retried to the deadline).
    fn nobody_listens(&self, last: &LinkError) -> bool {
        const GRACE: Duration = Duration::from_secs(1);
        let refused = matches!(last, LinkError::Connect { source, .. }
            if source.kind() == std::io::ErrorKind::ConnectionRefused);
        if !refused || self.inner.connected_once.load(Ordering::Relaxed) {
            return false;
        }
        let mut first = self
            .inner
            .first_refused
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        first.get_or_insert_with(Instant::now).elapsed() >= GRACE
    }

    pub(crate) fn drop_conn(&self, c: &Arc<Conn>) {
        c.dead.store(true, Ordering::SeqCst);
        // Try the next replica first on reconnect.
        let n = self.inner.servers.len().max(1) as u64;
        let _ = self.inner.preferred.compare_exchange(
            self.inner.preferred.load(Ordering::Relaxed),
            (self.inner.preferred.load(Ordering::Relaxed) + 1) % n,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// Sends a whole frame within the deadline. A frame cut short leaves the stream unusable: the
    /// caller drops the connection on any error.
    async fn send(&self, c: &Conn, frame: &[u8], until: Instant) -> Result<(), LinkError> {
        let wait = left(until);
        match tokio::time::timeout(wait, async { c.writer.lock().await.write_all(frame).await })
            .await
        {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(LinkError::Send {
                server: c.server,
                source: Arc::new(e),
            }),
            Err(_) => Err(LinkError::Deadline {
                server: c.server,
                what: "send",
                waited: wait,
            }),
        }
    }

    async fn control(&self, c: &Arc<Conn>, m: Msg, until: Instant) -> Result<Msg, Fail> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        c.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Pending::Control(tx));
        if let Err(e) = self.send(c, &m.frame(id), until).await {
            take_pending(&c.pending, id);
            return Err(Fail::Retry(e));
        }
        let wait = left(until);
        match tokio::time::timeout(wait, rx).await {
            Ok(Ok(Ok(Msg::Error { code, message }))) => Err(Fail::Refused(c.server, code, message)),
            Ok(Ok(Ok(m))) => Ok(m),
            Ok(Ok(Err(e))) => Err(Fail::Retry(e)),
            Ok(Err(_)) => Err(Fail::Retry(LinkError::Closed { server: c.server })),
            Err(_) => {
                take_pending(&c.pending, id);
                Err(Fail::Retry(LinkError::Deadline {
                    server: c.server,
                    what: "reply",
                    waited: wait,
                }))
            }
        }
    }

    async fn file_id(
        &self,
        c: &Arc<Conn>,
        root: &str,
        path: &str,
        until: Instant,
    ) -> Result<(u32, u64), Fail> {
        let key = (c.generation, root.to_string(), path.to_string());
        if let Some(v) = self
            .inner
            .opened
            .lock()
            .ok()
            .and_then(|m| m.get(&key).copied())
        {
            return Ok(v);
        }
        let open = Msg::Open {
            root: root.into(),
            path: path.into(),
        };
        match self.control(c, open, until).await? {
            Msg::OpenOk { file, size } => {
                if let Ok(mut m) = self.inner.opened.lock() {
                    m.insert(key, (file, size));
                }
                Ok((file, size))
            }
            other => Err(Fail::Retry(LinkError::Unexpected {
                server: c.server,
                kind: other.kind(),
                len: 0,
            })),
        }
    }

    /// The error of a request that ran out of time after `last`.
    fn gave_up(&self, what: String, start: Instant, last: LinkError) -> ClientError {
        let (servers, waited) = (self.servers(), start.elapsed());
        if last.is_deadline() {
            ClientError::Timeout {
                what,
                servers,
                waited,
                last,
            }
        } else {
            ClientError::Unavailable {
                what,
                servers,
                waited,
                last,
            }
        }
    }

    fn refused(
        &self,
        what: String,
        server: SocketAddr,
        code: Code,
        message: String,
    ) -> ClientError {
        ClientError::Refused {
            server: server.to_string(),
            what,
            code,
            message,
        }
    }

    /// Opens `root/path` on the servers.
    pub async fn open(&self, root: &str, path: &str) -> Result<RemoteFile, ClientError> {
        let what = || format!("open {root}/{path}");
        let start = Instant::now();
        let until = start + self.inner.deadline;
        loop {
            let r = match self.conn(until).await {
                Ok(c) => {
                    let r = self.file_id(&c, root, path, until).await;
                    if matches!(r, Err(Fail::Retry(_))) {
                        self.drop_conn(&c);
                    }
                    r
                }
                Err(e) => Err(e),
            };
            let last = match r {
                Ok((_, size)) => {
                    return Ok(RemoteFile {
                        root: root.into(),
                        path: path.into(),
                        size,
                    });
                }
                Err(Fail::Refused(server, code, message)) => {
                    return Err(self.refused(what(), server, code, message));
                }
                Err(Fail::Lease(e)) => return Err(e.into()),
                Err(Fail::Retry(e)) => e,
            };
            if Instant::now() >= until || self.nobody_listens(&last) {
                return Err(self.gave_up(what(), start, last));
            }
            tokio::time::sleep(Duration::from_millis(50).min(left(until))).await;
        }
    }

    /// Reads `len` bytes at `offset` of `file` into `lease[off..]`, within the client's deadline (see
    /// [`Client::read_within`]).
    pub async fn read(
        &self,
        file: &RemoteFile,
        offset: u64,
        len: usize,
        lease: Lease,
        off: usize,
    ) -> (Result<(), ClientError>, Lease) {
        self.read_within(file, offset, len, lease, off, self.inner.deadline)
            .await
    }

    /// Reads `len` bytes at `offset` of `file` into `lease[off..]` within `deadline`. The lease
    /// always comes back with the result. Dead connections are replaced (next replica first) and the
    /// read retried until the deadline; refusals are returned at once. A reply that is late as a
    /// whole is [`ClientError::Timeout`]; no usable server is [`ClientError::Unavailable`]. When the
    /// deadline passes while the payload is arriving, the lease comes back once the reader has
    /// received or abandoned it (within the client's deadline).
    pub async fn read_within(
        &self,
        file: &RemoteFile,
        offset: u64,
        len: usize,
        lease: Lease,
        off: usize,
        deadline: Duration,
    ) -> (Result<(), ClientError>, Lease) {
        let what = || format!("read {}/{} at {offset}+{len}", file.root, file.path);
        if let Err(e) = lease.check_range(off, len) {
            return (Err(e.into()), lease);
        }
        let Ok(len32) = u32::try_from(len) else {
            let e = ClientError::TooLarge {
                what: what(),
                len,
                max: self.max_request(),
            };
            return (Err(e), lease);
        };
        let start = Instant::now();
        let until = start + deadline;
        let mut lease = lease;
        loop {
            let (r, l) = self.attempt(file, offset, len32, lease, off, until).await;
            lease = l;
            let last = match r {
                Ok(()) => return (Ok(()), lease),
                Err(Fail::Refused(server, code, message)) => {
                    return (Err(self.refused(what(), server, code, message)), lease);
                }
                Err(Fail::Lease(e)) => return (Err(e.into()), lease),
                Err(Fail::Retry(e)) => e,
            };
            if Instant::now() >= until || self.nobody_listens(&last) {
                return (Err(self.gave_up(what(), start, last)), lease);
            }
            tokio::time::sleep(Duration::from_millis(50).min(left(until))).await;
        }
    }

    /// One attempt of a read on the current connection.
    async fn attempt(
        &self,
        file: &RemoteFile,
        offset: u64,
        len: u32,
        lease: Lease,
        off: usize,
        until: Instant,
    ) -> (Result<(), Fail>, Lease) {
        let c = match self.conn(until).await {
            Ok(c) => c,
            Err(e) => return (Err(e), lease),
        };
        let fid = match self.file_id(&c, &file.root, &file.path, until).await {
            Ok((fid, _)) => fid,
            Err(e) => {
                if matches!(e, Fail::Retry(_)) {
                    self.drop_conn(&c);
                }
                return (Err(e), lease);
            }
        };
        let req = c
            .path
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|p| p.request(fid, offset, len, &lease, off));
        let Some(req) = req else {
            // The data path was closed under us: the connection is going away.
            self.drop_conn(&c);
            return (
                Err(Fail::Retry(LinkError::Closed { server: c.server })),
                lease,
            );
        };
        self.exchange_into(&c, req, lease, off, len as usize, until)
            .await
    }

    /// Sends `req` on `c` and receives its reply's payload (`ReadOk`, or an RDMA WRITE and
    /// `ReadDone`) straight into `lease[off..off + len]`. The lease always comes back; on a failure the
    /// connection is given up (data path closed first).
    pub(crate) async fn exchange_into(
        &self,
        c: &Arc<Conn>,
        req: Msg,
        lease: Lease,
        off: usize,
        len: usize,
        until: Instant,
    ) -> (Result<(), Fail>, Lease) {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, mut rx) = oneshot::channel();
        c.pending.lock().unwrap_or_else(|p| p.into_inner()).insert(
            id,
            Pending::Data(Delivery {
                lease: Some(lease),
                off,
                len,
                server: c.server,
                tx: Some(tx),
            }),
        );
        let failure = match self.send(c, &req.frame(id), until).await {
            Err(e) => e,
            Ok(()) => {
                let wait = left(until);
                match tokio::time::timeout(wait, &mut rx).await {
                    Ok(Ok((r, lease))) => {
                        if matches!(r, Err(Fail::Retry(_))) {
                            self.drop_conn(c);
                        }
                        return (r, lease);
                    }
                    // A `Delivery` always answers; a closed channel reads as a closed connection.
                    Ok(Err(_)) => LinkError::Closed { server: c.server },
                    Err(_) => LinkError::Deadline {
                        server: c.server,
                        what: "reply",
                        waited: wait,
                    },
                }
            }
        };
        // Give up on this connection. The data path goes first (no RDMA WRITE lands after it), then
        // the reader is stopped (a payload it was receiving into the lease is abandoned: its
        // `Delivery` hands the lease back as it is dropped), so the lease comes back now — from the
        // pending map if no reply began, else from the stopped reader — not after a slow payload.
        self.drop_conn(c);
        c.close_path();
        c.reader.abort();
        let mine = take_pending(&c.pending, id);
        // The connection's other requests are retried on a new one.
        fail_all(&c.pending, &LinkError::Closed { server: c.server });
        match mine {
            Some(Pending::Data(mut d)) => {
                d.tx = None;
                match d.lease.take() {
                    Some(lease) => (Err(Fail::Retry(failure)), lease),
                    None => unreachable_lease(),
                }
            }
            Some(Pending::Control(_)) | None => match rx.await {
                Ok((Ok(()), lease)) => (Ok(()), lease),
                Ok((Err(Fail::Retry(_)), lease)) => (Err(Fail::Retry(failure)), lease),
                Ok((Err(e), lease)) => (Err(e), lease),
                Err(_) => unreachable_lease(),
            },
        }
    }
}

/// An authenticated, nonblocking connection with its transport's data path attached.
pub(crate) struct Attached {
    pub(crate) sock: std::net::TcpStream,
    pub(crate) server: SocketAddr,
    pub(crate) max_request: u32,
    pub(crate) path: Box<dyn crate::transport::DataPath>,
}

impl Client {
    /// A fresh attached connection to the preferred server (the next replica on failure), within
    /// `until`: this client's connect, hello and token, and its transport's data path, as SMC's link
    /// is made of (the client knows nothing of SMC).
    pub(crate) async fn attached(&self, until: Instant) -> Result<Attached, Fail> {
        let n = self.inner.servers.len().max(1);
        let start = self.inner.preferred.load(Ordering::Relaxed) as usize;
        let mut last = LinkError::NoServers;
        for k in 0..n {
            let i = (start + k) % n;
            let Some(&addr) = self.inner.servers.get(i) else {
                break;
            };
            let sock = match self.handshake(addr, until).await {
                Ok(s) => s,
                Err(Fail::Retry(e)) => {
                    last = e;
                    continue;
                }
                Err(e) => return Err(e),
            };
            // The transport's data path (RDMA: a queue pair, for one-sided faults and barriers).
            let (mut rd, mut wr) = sock.into_split();
            let wait = left(until).min(Duration::from_secs(10));
            let path = match self.inner.transport.attach(&mut rd, &mut wr, wait).await {
                Ok(p) => p,
                Err(AttachError::Refused { code, message }) => {
                    return Err(Fail::Refused(addr, code, message));
                }
                Err(e) => {
                    last = LinkError::Attach {
                        server: addr,
                        source: Arc::new(e),
                    };
                    continue;
                }
            };
            let sock = rd.reunite(wr).map_err(|e| {
                Fail::Retry(LinkError::Connect {
                    server: addr,
                    source: Arc::new(std::io::Error::other(e)),
                })
            })?;
            let sock = sock.into_std().map_err(|e| {
                Fail::Retry(LinkError::Connect {
                    server: addr,
                    source: Arc::new(e),
                })
            })?;
            // Nonblocking (as tokio left it): every wait is a poll(2) with the time left.
            sock.set_nonblocking(true).map_err(|e| {
                Fail::Retry(LinkError::Connect {
                    server: addr,
                    source: Arc::new(e),
                })
            })?;
            self.inner.preferred.store(i as u64, Ordering::Relaxed);
            let max_request = self.max_request().min(u32::MAX as u64) as u32;
            return Ok(Attached {
                sock,
                server: addr,
                max_request,
                path,
            });
        }
        Err(Fail::Retry(last))
    }
}
