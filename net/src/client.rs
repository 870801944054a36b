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

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::oneshot;
use ubdirect_ub::Lease;

use crate::proto::{self, Code, FrameError, Kind, Msg};
use crate::smc::SmcLink;
use crate::transport::{AttachError, DataPath, Tcp, Transport};

/// Client errors.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server refused the request (auth, path, range, size): retrying will not help.
    #[error("{server}: {what}: refused ({code}): {message}")]
    Refused {
        /// Server address.
        server: String,
        /// The request.
        what: String,
        /// Why, as the protocol says it.
        code: Code,
        /// The server's message.
        message: String,
    },
    /// No server answered within the deadline (connection refused, dropped, or unusable).
    #[error("{what}: no server of {servers:?} answered within {waited:?}")]
    Unavailable {
        /// The request.
        what: String,
        /// Servers tried.
        servers: Vec<String>,
        /// How long it tried.
        waited: Duration,
        /// The last failure.
        #[source]
        last: LinkError,
    },
    /// A connected server took the request but its reply did not arrive (whole) within the deadline.
    #[error("{what}: no reply within {waited:?}")]
    Timeout {
        /// The request.
        what: String,
        /// Servers tried.
        servers: Vec<String>,
        /// How long it waited.
        waited: Duration,
        /// The last failure.
        #[source]
        last: LinkError,
    },
    /// A read larger than one request can carry.
    #[error("{what}: {len} bytes exceed the largest request ({max})")]
    TooLarge {
        /// The request.
        what: String,
        /// Bytes asked for.
        len: usize,
        /// The most one request carries.
        max: u64,
    },
    /// The destination lease refused the bytes.
    #[error(transparent)]
    Lease(#[from] ubdirect_ub::UbError),
}

impl ClientError {
    /// The refusal's code, when the server refused.
    pub fn code(&self) -> Option<Code> {
        match self {
            ClientError::Refused { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// Why one attempt on one connection failed (the request is retried, on a new connection, until the
/// deadline). Cheap to clone: one connection's failure is handed to every request waiting on it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LinkError {
    /// The client has no servers.
    #[error("no servers configured")]
    NoServers,
    /// The TCP connection could not be made.
    #[error("{server}: connect")]
    Connect {
        /// Server address.
        server: SocketAddr,
        /// The socket's error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// Sending a request failed.
    #[error("{server}: send")]
    Send {
        /// Server address.
        server: SocketAddr,
        /// The socket's error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// Receiving a frame failed (connection lost, a frame's header or payload late, a bad frame).
    #[error("{server}: receive")]
    Receive {
        /// Server address.
        server: SocketAddr,
        /// The frame reader's error.
        #[source]
        source: FrameError,
    },
    /// Connecting, sending, or a reply, did not complete within the deadline.
    #[error("{server}: no {what} within {waited:?}")]
    Deadline {
        /// Server address.
        server: SocketAddr,
        /// `connection`, `hello reply`, `send`, `reply`.
        what: &'static str,
        /// The deadline.
        waited: Duration,
    },
    /// A reply of the wrong kind, or a payload of the wrong length.
    #[error("{server}: unexpected reply {kind:?} ({len} bytes)")]
    Unexpected {
        /// Server address.
        server: SocketAddr,
        /// The reply's kind.
        kind: Kind,
        /// Its payload length.
        len: u32,
    },
    /// The transport's data path (RDMA queue pair) could not be set up.
    #[error("{server}: data path")]
    Attach {
        /// Server address.
        server: SocketAddr,
        /// The transport's error.
        #[source]
        source: Arc<AttachError>,
    },
    /// A one-sided operation (RDMA READ of a fault, WRITE of a barrier) failed or got no
    /// completion in time; the link is dropped.
    #[error("{server}: one-sided {what}")]
    OneSided {
        /// Server address.
        server: SocketAddr,
        /// `read` or `write`.
        what: &'static str,
        /// The transport's error.
        #[source]
        source: crate::transport::OneSidedError,
    },
    /// The connection was closed under the request (by another request's failure).
    #[error("{server}: connection closed")]
    Closed {
        /// Server address.
        server: SocketAddr,
    },
}

impl LinkError {
    /// Whether the failure is a deadline (a request that timed out rather than a server that is gone).
    fn is_deadline(&self) -> bool {
        matches!(
            self,
            LinkError::Deadline {
                what: "reply" | "send",
                ..
            } | LinkError::Receive {
                source: FrameError::Timeout { .. },
                ..
            }
        )
    }
}

/// How one attempt failed.
pub(crate) enum Fail {
    /// The server refused: not retried.
    Refused(SocketAddr, Code, String),
    /// The lease cannot take the payload: not retried.
    Lease(ubdirect_ub::UbError),
    /// Retried on another connection until the deadline.
    Retry(LinkError),
}

/// A data request's lease while the request is out, and where it goes back. It answers exactly once:
/// [`Delivery::finish`], or — if it is dropped first (connection gone, reader stopped) — its `Drop`,
/// which hands the lease back with [`LinkError::Closed`]. So the lease always comes back (or, when
/// the requester is gone, returns to its pool).
struct Delivery {
    lease: Option<Lease>,
    off: usize,
    len: usize,
    server: SocketAddr,
    tx: Option<oneshot::Sender<(Result<(), Fail>, Lease)>>,
}

impl Delivery {
    fn finish(mut self, r: Result<(), Fail>) {
        if let (Some(lease), Some(tx)) = (self.lease.take(), self.tx.take()) {
            let _ = tx.send((r, lease));
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        if let (Some(lease), Some(tx)) = (self.lease.take(), self.tx.take()) {
            let closed = LinkError::Closed {
                server: self.server,
            };
            let _ = tx.send((Err(Fail::Retry(closed)), lease));
        }
    }
}

enum Pending {
    Control(oneshot::Sender<Result<Msg, LinkError>>),
    Data(Delivery),
}

type PendingMap = Arc<Mutex<HashMap<u64, Pending>>>;

pub(crate) struct Conn {
    server: SocketAddr,
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: PendingMap,
    dead: Arc<AtomicBool>,
    reader: tokio::task::JoinHandle<()>,
    generation: u64,
    /// Taken (destroying an RDMA queue pair) before pending leases are handed back, so that no late
    /// remote write can land in a block that is already reused.
    path: Arc<Mutex<Option<Box<dyn DataPath>>>>,
}

impl Conn {
    /// Destroys the data path (an RDMA queue pair: no WRITE of the server lands after this returns).
    fn close_path(&self) {
        close_path(&self.path);
    }
}

fn close_path(path: &Mutex<Option<Box<dyn DataPath>>>) {
    let p = path.lock().unwrap_or_else(|p| p.into_inner()).take();
    drop(p);
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Path first: every lease still pending goes back only after its queue pair is destroyed.
        self.close_path();
        self.reader.abort();
        fail_all(
            &self.pending,
            &LinkError::Closed {
                server: self.server,
            },
        );
    }
}

fn take_pending(pending: &Mutex<HashMap<u64, Pending>>, id: u64) -> Option<Pending> {
    pending
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&id)
}

fn fail_all(pending: &Mutex<HashMap<u64, Pending>>, why: &LinkError) {
    let drained: Vec<Pending> = pending
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .drain()
        .map(|(_, v)| v)
        .collect();
    for p in drained {
        match p {
            Pending::Control(tx) => {
                let _ = tx.send(Err(why.clone()));
            }
            Pending::Data(d) => d.finish(Err(Fail::Retry(why.clone()))),
        }
    }
}

/// Receives replies until the connection fails; returns why. A payload is received within
/// `deadline` of its header. A request whose reply failed half-way is put back in the pending map,
/// so that its lease is handed back by [`fail_all`] after the data path is closed.
async fn reader_loop(
    mut rd: OwnedReadHalf,
    pending: &Mutex<HashMap<u64, Pending>>,
    max_data: u32,
    server: SocketAddr,
    deadline: Duration,
) -> LinkError {
    let recv = |source| LinkError::Receive { server, source };
    let put_back = |id, p| {
        pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, p);
    };
    loop {
        // Quiet for as long as the server likes between frames; a frame, once begun, arrives whole
        // within the deadline (a server sending halves cannot hold the connection).
        let hdr = match proto::read_header_within(&mut rd, max_data, proto::IDLE, deadline).await {
            Ok(h) => h,
            Err(e) => return recv(e),
        };
        let unexpected = LinkError::Unexpected {
            server,
            kind: hdr.kind,
            len: hdr.len,
        };
        match (hdr.kind, take_pending(pending, hdr.id)) {
            (Kind::ReadOk, Some(Pending::Data(mut d))) => {
                if hdr.len as usize != d.len {
                    put_back(hdr.id, Pending::Data(d));
                    return unexpected;
                }
                // Straight into the lease: no intermediate buffer.
                let (off, len) = (d.off, d.len);
                let got = match d.lease.as_mut().map(|l| l.as_mut_slice()) {
                    Some(Ok(b)) => proto::read_payload(&mut rd, &mut b[off..off + len], deadline)
                        .await
                        .map_err(recv),
                    Some(Err(e)) => {
                        // Not host memory: the payload is on the stream and nowhere to go.
                        d.finish(Err(Fail::Lease(e)));
                        return unexpected;
                    }
                    None => Err(LinkError::Closed { server }),
                };
                match got {
                    Ok(()) => d.finish(Ok(())),
                    Err(e) => {
                        put_back(hdr.id, Pending::Data(d));
                        return e;
                    }
                }
            }
            (Kind::ReadDone, Some(Pending::Data(d))) if hdr.len == 0 => {
                // The server wrote the bytes into the lease by RDMA before answering.
                d.finish(Ok(()));
            }
            (_, None) => {
                // A reply to a request that gave up, or to no request at all (an id the server made
                // up): drained through a small buffer, whatever length it declares.
                if let Err(e) = proto::discard_payload(&mut rd, hdr.len, deadline).await {
                    return recv(e);
                }
            }
            (kind, p) => {
                // Bounded by the header check (MAX_CONTROL, or max_data for a data frame), and the
                // buffer grows only as the bytes arrive.
                let buf = match proto::read_payload_vec(&mut rd, hdr.len, deadline).await {
                    Ok(b) => b,
                    Err(e) => {
                        if let Some(p) = p {
                            put_back(hdr.id, p);
                        }
                        return recv(e);
                    }
                };
                match p {
                    Some(Pending::Control(tx)) => {
                        let _ = tx
                            .send(Msg::decode(kind, &buf).map_err(|e| recv(FrameError::Proto(e))));
                    }
                    Some(Pending::Data(d)) => match Msg::decode(kind, &buf) {
                        // A refusal comes before any byte moved (no RDMA WRITE was posted).
                        Ok(Msg::Error { code, message }) => {
                            d.finish(Err(Fail::Refused(server, code, message)))
                        }
                        // Anything else: the server is confused; the lease goes back only after
                        // the data path is closed.
                        _ => {
                            put_back(hdr.id, Pending::Data(d));
                            return unexpected;
                        }
                    },
                    None => {}
                }
            }
        }
    }
}

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
                    *g = Some(c.clone());
                    return Ok(c);
                }
                Err(Fail::Retry(e)) => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(Fail::Retry(last))
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
            if Instant::now() >= until {
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
            if Instant::now() >= until {
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

/// A `Delivery` holds its lease until it answers, and answers exactly once (from `finish` or its
/// `Drop`, which runs also when the reader task is aborted); ids are never reused. So a request's
/// entry always holds its lease and its channel always delivers it: this is not reachable.
#[cold]
fn unreachable_lease() -> ! {
    unreachable!("a Delivery answered without its lease")
}

impl Client {
    /// A fresh [`SmcLink`] to the preferred server (the next replica on failure), within `until`:
    /// this client's connect, hello and token, and its transport's data path.
    pub(crate) async fn smc_link(&self, until: Instant) -> Result<SmcLink, Fail> {
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
            return Ok(SmcLink::new(sock, addr, max_request, path));
        }
        Err(Fail::Retry(last))
    }
}
