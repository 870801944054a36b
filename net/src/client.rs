//! The client: a connection per server with many requests in flight, payloads received straight
//! into the destination lease (no intermediate buffer), reconnect-and-retry within a deadline, and
//! failover across replicas that hold the same files.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::oneshot;
use ubdirect_ub::Lease;

use crate::proto::{HEADER, Header, Kind, Msg, code};
use crate::transport::{DataPath, Tcp, Transport};

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
        /// Protocol error code.
        code: u16,
        /// The server's message.
        message: String,
    },
    /// No server answered within the deadline (connection refused, dropped, or silent).
    #[error("{what}: no server of {servers:?} answered within {waited:?}: {last}")]
    Unavailable {
        /// The request.
        what: String,
        /// Servers tried.
        servers: Vec<String>,
        /// How long it tried.
        waited: Duration,
        /// The last failure.
        last: String,
    },
    /// The destination lease refused the bytes.
    #[error(transparent)]
    Lease(#[from] ubdirect_ub::UbError),
}

enum Pending {
    Control(oneshot::Sender<Result<Msg, String>>),
    Data {
        lease: Lease,
        off: usize,
        len: usize,
        tx: oneshot::Sender<(Result<(), String>, Lease)>,
    },
}

struct Conn {
    server: SocketAddr,
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Arc<Mutex<HashMap<u64, Pending>>>,
    dead: Arc<std::sync::atomic::AtomicBool>,
    reader: tokio::task::JoinHandle<()>,
    generation: u64,
    /// Taken (destroying an RDMA queue pair) before pending leases are handed back, so that no late
    /// remote write can land in a block that is already reused.
    path: Arc<Mutex<Option<Box<dyn DataPath>>>>,
}

impl Conn {
    fn close_path(&self) {
        let p = self.path.lock().ok().and_then(|mut p| p.take());
        drop(p);
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

fn fail_all(pending: &Mutex<HashMap<u64, Pending>>, why: &str) {
    let drained: Vec<Pending> = pending
        .lock()
        .map(|mut p| p.drain().map(|(_, v)| v).collect())
        .unwrap_or_default();
    for p in drained {
        match p {
            Pending::Control(tx) => {
                let _ = tx.send(Err(why.to_string()));
            }
            Pending::Data { lease, tx, .. } => {
                let _ = tx.send((Err(why.to_string()), lease));
            }
        }
    }
}

async fn reader_loop(
    mut rd: tokio::net::tcp::OwnedReadHalf,
    pending: Arc<Mutex<HashMap<u64, Pending>>>,
    max_data: u32,
) -> String {
    loop {
        let mut h = [0u8; HEADER];
        if let Err(e) = rd.read_exact(&mut h).await {
            return format!("connection lost: {e}");
        }
        let hdr = match Header::decode(&h, max_data) {
            Ok(h) => h,
            Err(e) => return format!("protocol error: {e}"),
        };
        let p = pending.lock().ok().and_then(|mut m| m.remove(&hdr.id));
        match (hdr.kind, p) {
            (
                Kind::ReadOk,
                Some(Pending::Data {
                    mut lease,
                    off,
                    len,
                    tx,
                }),
            ) => {
                if hdr.len as usize != len {
                    return format!("server sent {} bytes for a read of {len}", hdr.len);
                }
                // Straight into the lease: no intermediate buffer.
                let r = match lease.as_mut_slice() {
                    Ok(b) => rd
                        .read_exact(&mut b[off..off + len])
                        .await
                        .map(|_| ())
                        .map_err(|e| format!("connection lost: {e}")),
                    Err(e) => Err(e.to_string()),
                };
                let lost = r.is_err();
                let _ = tx.send((r, lease));
                if lost {
                    return "connection lost mid-payload".into();
                }
            }
            (Kind::ReadDone, Some(Pending::Data { lease, tx, .. })) if hdr.len == 0 => {
                // The server wrote the bytes into the lease by RDMA before answering.
                let _ = tx.send((Ok(()), lease));
            }
            (kind, p) => {
                let mut buf = vec![0u8; hdr.len as usize];
                if let Err(e) = rd.read_exact(&mut buf).await {
                    return format!("connection lost: {e}");
                }
                let msg = Msg::decode(kind, &buf).map_err(|e| e.to_string());
                match p {
                    Some(Pending::Control(tx)) => {
                        let _ = tx.send(msg);
                    }
                    Some(Pending::Data { lease, tx, .. }) => {
                        let _ = tx.send((
                            msg.and_then(|m| match m {
                                Msg::Error { code, message } => {
                                    Err(format!("refused {code}: {message}"))
                                }
                                other => Err(format!("unexpected reply {:?}", other.kind())),
                            }),
                            lease,
                        ));
                    }
                    None => {}
                }
            }
        }
    }
}

/// (connection generation, root, path): file ids are per connection.
type OpenKey = (u64, String, String);

struct Inner {
    servers: Vec<SocketAddr>,
    token: Vec<u8>,
    deadline: Duration,
    next_id: AtomicU64,
    generation: AtomicU64,
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
    preferred: AtomicU64,
    /// Per connection generation: remote file ids by (root, path).
    opened: Mutex<HashMap<OpenKey, (u32, u64)>>,
    max_request: AtomicU64,
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

enum Fail {
    Refused(u16, String),
    Retry(String),
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
        Self {
            inner: Arc::new(Inner {
                servers,
                token: token.into(),
                deadline,
                next_id: AtomicU64::new(1),
                generation: AtomicU64::new(0),
                conn: tokio::sync::Mutex::new(None),
                preferred: AtomicU64::new(0),
                opened: Mutex::new(HashMap::new()),
                max_request: AtomicU64::new(16 << 20),
                transport,
            }),
        }
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

    async fn connect_one(&self, addr: SocketAddr) -> Result<Arc<Conn>, Fail> {
        let left = self.inner.deadline.min(Duration::from_secs(10));
        let sock = tokio::time::timeout(left, TcpStream::connect(addr))
            .await
            .map_err(|_| Fail::Retry(format!("{addr}: connect timed out")))?
            .map_err(|e| Fail::Retry(format!("{addr}: {e}")))?;
        let _ = sock.set_nodelay(true);
        let (mut rd, mut wr) = sock.into_split();
        wr.write_all(
            &Msg::Hello {
                token: self.inner.token.clone(),
            }
            .frame(0),
        )
        .await
        .map_err(|e| Fail::Retry(format!("{addr}: {e}")))?;
        let mut h = [0u8; HEADER];
        tokio::time::timeout(left, rd.read_exact(&mut h))
            .await
            .map_err(|_| Fail::Retry(format!("{addr}: no hello reply")))?
            .map_err(|e| Fail::Retry(format!("{addr}: {e}")))?;
        let hdr = Header::decode(&h, 0).map_err(|e| Fail::Retry(format!("{addr}: {e}")))?;
        let mut p = vec![0u8; hdr.len as usize];
        rd.read_exact(&mut p)
            .await
            .map_err(|e| Fail::Retry(format!("{addr}: {e}")))?;
        match Msg::decode(hdr.kind, &p) {
            Ok(Msg::HelloOk { max_request, .. }) => {
                self.inner
                    .max_request
                    .store(max_request as u64, Ordering::Relaxed);
            }
            Ok(Msg::Error { code, message }) => return Err(Fail::Refused(code, message)),
            other => {
                return Err(Fail::Retry(format!(
                    "{addr}: unexpected hello reply {other:?}"
                )));
            }
        }
        let path = self
            .inner
            .transport
            .attach(&mut rd, &mut wr, left)
            .await
            .map_err(|e| {
                if e.starts_with("server refused") {
                    Fail::Refused(code::PROTOCOL, format!("{addr}: {e}"))
                } else {
                    Fail::Retry(format!("{addr}: {e}"))
                }
            })?;
        let pending: Arc<Mutex<HashMap<u64, Pending>>> = Arc::default();
        let dead = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let path = Arc::new(Mutex::new(Some(path)));
        let (p2, d2, path2) = (pending.clone(), dead.clone(), path.clone());
        let max = self.inner.max_request.load(Ordering::Relaxed) as u32;
        let reader = tokio::spawn(async move {
            let why = reader_loop(rd, p2.clone(), max).await;
            d2.store(true, Ordering::SeqCst);
            let closed = path2.lock().ok().and_then(|mut p| p.take());
            drop(closed);
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

    async fn conn(&self) -> Result<Arc<Conn>, Fail> {
        let mut g = self.inner.conn.lock().await;
        if let Some(c) = g.as_ref()
            && !c.dead.load(Ordering::SeqCst)
        {
            return Ok(c.clone());
        }
        *g = None;
        let n = self.inner.servers.len().max(1);
        let start = self.inner.preferred.load(Ordering::Relaxed) as usize;
        let mut last = String::from("no servers configured");
        for k in 0..n {
            let i = (start + k) % n;
            let Some(&addr) = self.inner.servers.get(i) else {
                break;
            };
            match self.connect_one(addr).await {
                Ok(c) => {
                    self.inner.preferred.store(i as u64, Ordering::Relaxed);
                    *g = Some(c.clone());
                    return Ok(c);
                }
                Err(Fail::Refused(c, m)) => return Err(Fail::Refused(c, m)),
                Err(Fail::Retry(m)) => last = m,
            }
        }
        Err(Fail::Retry(last))
    }

    fn drop_conn(&self, c: &Arc<Conn>) {
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

    async fn control(&self, c: &Arc<Conn>, m: Msg) -> Result<Msg, Fail> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        c.pending
            .lock()
            .map_err(|_| Fail::Retry("poisoned".into()))?
            .insert(id, Pending::Control(tx));
        if let Err(e) = c.writer.lock().await.write_all(&m.frame(id)).await {
            c.pending.lock().map(|mut p| p.remove(&id)).ok();
            return Err(Fail::Retry(format!("{}: {e}", c.server)));
        }
        match tokio::time::timeout(self.inner.deadline, rx).await {
            Ok(Ok(Ok(Msg::Error { code, message }))) => Err(Fail::Refused(code, message)),
            Ok(Ok(Ok(m))) => Ok(m),
            Ok(Ok(Err(e))) => Err(Fail::Retry(e)),
            Ok(Err(_)) => Err(Fail::Retry("connection closed".into())),
            Err(_) => Err(Fail::Retry(format!(
                "{}: no reply within {:?}",
                c.server, self.inner.deadline
            ))),
        }
    }

    async fn file_id(&self, c: &Arc<Conn>, root: &str, path: &str) -> Result<(u32, u64), Fail> {
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
        match self
            .control(
                c,
                Msg::Open {
                    root: root.into(),
                    path: path.into(),
                },
            )
            .await?
        {
            Msg::OpenOk { file, size } => {
                if let Ok(mut m) = self.inner.opened.lock() {
                    m.insert(key, (file, size));
                }
                Ok((file, size))
            }
            other => Err(Fail::Retry(format!("unexpected reply {:?}", other.kind()))),
        }
    }

    fn unavailable(&self, what: String, start: Instant, last: String) -> ClientError {
        ClientError::Unavailable {
            what,
            servers: self.servers(),
            waited: start.elapsed(),
            last,
        }
    }

    fn servers(&self) -> Vec<String> {
        self.inner.servers.iter().map(|s| s.to_string()).collect()
    }

    /// Opens `root/path` on the servers.
    pub async fn open(&self, root: &str, path: &str) -> Result<RemoteFile, ClientError> {
        let what = format!("open {root}/{path}");
        let start = Instant::now();
        let mut last;
        loop {
            let r = match self.conn().await {
                Ok(c) => {
                    let r = self.file_id(&c, root, path).await;
                    if matches!(r, Err(Fail::Retry(_))) {
                        self.drop_conn(&c);
                    }
                    r
                }
                Err(e) => Err(e),
            };
            match r {
                Ok((_, size)) => {
                    return Ok(RemoteFile {
                        root: root.into(),
                        path: path.into(),
                        size,
                    });
                }
                Err(Fail::Refused(code, message)) => {
                    return Err(ClientError::Refused {
                        server: self.servers().join(","),
                        what,
                        code,
                        message,
                    });
                }
                Err(Fail::Retry(m)) => last = m,
            }
            if start.elapsed() >= self.inner.deadline {
                return Err(self.unavailable(what, start, last));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Reads `len` bytes at `offset` of `file` into `lease[off..]`. The lease comes back with the
    /// result — except when a reply timed out while its payload was arriving: then the lease is
    /// dropped (returned to its pool) with the connection, and `None` comes back with the error.
    /// Dead connections are replaced (next replica first) and the read retried until the client's
    /// deadline; refusals are returned at once.
    pub async fn read(
        &self,
        file: &RemoteFile,
        offset: u64,
        len: usize,
        mut lease: Lease,
        off: usize,
    ) -> (Result<(), ClientError>, Option<Lease>) {
        let what = format!("read {}/{} at {offset}+{len}", file.root, file.path);
        if let Err(e) = lease.check_range(off, len) {
            return (Err(e.into()), Some(lease));
        }
        let start = Instant::now();
        let mut last;
        loop {
            let attempt: Result<Arc<Conn>, Fail> = async {
                let c = self.conn().await?;
                Ok(c)
            }
            .await;
            let r: Result<(), Fail> = match attempt {
                Err(e) => Err(e),
                Ok(c) => match self.file_id(&c, &file.root, &file.path).await {
                    Err(e) => {
                        if matches!(e, Fail::Retry(_)) {
                            self.drop_conn(&c);
                        }
                        Err(e)
                    }
                    Ok((fid, _)) => {
                        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
                        let (tx, rx) = oneshot::channel();
                        let req = c.path.lock().ok().and_then(|p| {
                            p.as_ref()
                                .map(|p| p.request(fid, offset, len as u32, &lease, off))
                        });
                        let Some(req) = req else {
                            // The data path was closed under us: the connection is going away.
                            self.drop_conn(&c);
                            last = format!("{}: connection closed", c.server);
                            if start.elapsed() >= self.inner.deadline {
                                return (Err(self.unavailable(what, start, last)), Some(lease));
                            }
                            continue;
                        };
                        c.pending.lock().unwrap_or_else(|p| p.into_inner()).insert(
                            id,
                            Pending::Data {
                                lease,
                                off,
                                len,
                                tx,
                            },
                        );
                        let mut rx = rx;
                        let sent = c.writer.lock().await.write_all(&req.frame(id)).await;
                        if sent.is_err() {
                            self.drop_conn(&c);
                        }
                        match tokio::time::timeout(
                            self.inner
                                .deadline
                                .saturating_sub(start.elapsed())
                                .max(Duration::from_millis(10)),
                            &mut rx,
                        )
                        .await
                        {
                            Ok(Ok((r, l))) => {
                                lease = l;
                                match r {
                                    Ok(()) => return (Ok(()), Some(lease)),
                                    Err(m) if m.starts_with("refused ") => {
                                        let code = m[8..]
                                            .split(':')
                                            .next()
                                            .and_then(|c| c.parse().ok())
                                            .unwrap_or(code::IO);
                                        return (
                                            Err(ClientError::Refused {
                                                server: c.server.to_string(),
                                                what,
                                                code,
                                                message: m,
                                            }),
                                            Some(lease),
                                        );
                                    }
                                    Err(m) => {
                                        self.drop_conn(&c);
                                        Err(Fail::Retry(m))
                                    }
                                }
                            }
                            Ok(Err(_)) | Err(_) => {
                                // The lease is still in the pending map: take it back by dropping the
                                // connection, which fails every pending request and returns leases.
                                self.drop_conn(&c);
                                c.reader.abort();
                                c.close_path();
                                let back = c.pending.lock().ok().and_then(|mut p| p.remove(&id));
                                match back {
                                    Some(Pending::Data { lease: l, .. }) => {
                                        lease = l;
                                        Err(Fail::Retry(format!(
                                            "{}: no reply within the deadline",
                                            c.server
                                        )))
                                    }
                                    _ => {
                                        return (
                                            Err(ClientError::Unavailable {
                                                what,
                                                servers: self.servers(),
                                                waited: start.elapsed(),
                                                last: "no reply within the deadline (payload was arriving; the lease went back to its pool)".into(),
                                            }),
                                            None,
                                        );
                                    }
                                }
                            }
                        }
                    }
                },
            };
            match r {
                Ok(()) => return (Ok(()), Some(lease)),
                Err(Fail::Refused(code, message)) => {
                    return (
                        Err(ClientError::Refused {
                            server: self.servers().join(","),
                            what,
                            code,
                            message,
                        }),
                        Some(lease),
                    );
                }
                Err(Fail::Retry(m)) => last = m,
            }
            if start.elapsed() >= self.inner.deadline {
                return (Err(self.unavailable(what, start, last)), Some(lease));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
