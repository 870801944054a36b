//! The connection loop: the hello (token, the token's share of connections), then one frame after
//! another, each message kind handed to a function of its own. Replies of file reads go through a
//! writer task (each within `io_timeout`); SMC replies are written at once by the loop.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Semaphore, mpsc};

use super::Shared;
use super::files::{Files, ReadJob, admit, open_file, serve_read};
use super::limits::{ConnSlot, Pace, TokenSlot, refuse};
use super::out::Out;
use super::reply::Reply;
use super::smc::{poll_next, smc_receive, smc_reply, smc_request};
use crate::proto::{self, Code, FrameError, Header, Kind, Msg};

fn io_err(e: FrameError) -> std::io::Error {
    std::io::Error::other(e)
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

/// Serves one connection until it closes, fails, or is refused.
pub(super) async fn serve_conn(
    s: Arc<Shared>,
    sock: TcpStream,
    slot: &ConnSlot,
) -> std::io::Result<()> {
    let peer = sock.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let (mut rd, mut wr) = sock.into_split();
    let t = s.cfg.io_timeout;
    let Some((which, id)) = hello(&s, &peer, &mut rd, &mut wr, slot).await? else {
        return Ok(());
    };
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
    let (tx, rx) = mpsc::channel::<Out>(s.cfg.max_inflight as usize * 2 + 8);
    // Shared so that SMC replies, produced in order by this loop, are written at once (no hop
    // through the writer task: that hop is part of every page fault's latency). Frames stay whole.
    let wr = Arc::new(tokio::sync::Mutex::new(wr));
    let mut writer = tokio::spawn(write_replies(s.clone(), wr.clone(), rx));
    let mut c = Conn {
        inflight: Arc::new(Semaphore::new(s.cfg.max_inflight as usize)),
        pace: Pace::new(s.cfg.max_control_rate),
        files: Files::new(
            slot.files.clone(),
            token_share.files.clone(),
            s.open_files.clone(),
        ),
        staging: [slot.staging.clone(), token_share.staging.clone()],
        s: s.clone(),
        peer,
        rw: which == 1,
        tx,
        wr,
        #[cfg(feature = "rdma")]
        qp: None,
        opened: Vec::new(),
    };
    let (result, writer_done) = c.run(&mut rd, &mut writer).await;
    // The writer ends once every sender is gone (this one, and those of reads still running); the
    // connection's files, queue pair and token slot go with it, after.
    let Conn { tx, .. } = c;
    drop(tx);
    if !writer_done {
        let _ = writer.await;
    }
    result
}

/// Reads the hello (the whole of it within `io_timeout`) and checks its token, in constant time
/// against every token. `Some((which, id))`: the token's place (1: the read-write token, then the
/// read-only ones) and the hello's request id; `None`: refused (the client was told) or closed.
async fn hello(
    s: &Shared,
    peer: &str,
    rd: &mut OwnedReadHalf,
    wr: &mut OwnedWriteHalf,
    slot: &ConnSlot,
) -> std::io::Result<Option<(usize, u64)>> {
    let t = s.cfg.io_timeout;
    // The whole hello within the deadline (not each of its parts: a peer sending it byte by byte
    // holds a connection no longer than one that sends nothing).
    let hello = match tokio::time::timeout(t, proto::read_frame(rd, 0, t, t)).await {
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
    let ok = which != 0 && which <= s.tokens.len();
    let id = hello.as_ref().map_or(0, |h| h.0.id);
    slot.hello_done();
    if !ok {
        refuse(s, peer, "wrong or missing token");
        let no = Msg::Error {
            code: Code::Auth,
            message: "wrong or missing token".into(),
        }
        .frame(id);
        let _ = write_within(wr, &[&no], t).await;
        return Ok(None);
    }
    Ok(Some((which, id)))
}

/// The connection's writer task: every reply within the deadline (a client that stops reading is
/// disconnected, and the blocks its replies hold go back).
async fn write_replies(
    s: Arc<Shared>,
    wr: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    mut rx: mpsc::Receiver<Out>,
) {
    let t = s.cfg.io_timeout;
    let mut next = None;
    loop {
        let o = match next.take() {
            Some(o) => o,
            None => match rx.recv().await {
                Some(o) => o,
                None => break,
            },
        };
        let mut wr = wr.lock().await;
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
                let h = proto::data_header(id, len);
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
                let h = proto::data_header(id, range.len() as u32);
                match lease.as_slice() {
                    Ok(b) => write_within(&mut *wr, &[&h, &b[range]], t).await,
                    Err(e) => Err(std::io::Error::other(e)),
                }
            }
        };
        if let Err(e) = r {
            if e.kind() == std::io::ErrorKind::TimedOut {
                s.stats.write_timeouts.fetch_add(1, Ordering::Relaxed);
            }
            break;
        }
    }
}

/// One connection past its hello: what the handlers of its messages share.
struct Conn {
    s: Arc<Shared>,
    peer: String,
    /// The read-write token (else a read-only one).
    rw: bool,
    /// To the writer task.
    tx: mpsc::Sender<Out>,
    /// The socket's write half, for SMC replies written at once.
    wr: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    files: Files,
    /// Reads in flight (`max_inflight`).
    inflight: Arc<Semaphore>,
    pace: Pace,
    /// The address's and the token's shares of the staging blocks.
    staging: [Arc<Semaphore>; 2],
    #[cfg(feature = "rdma")]
    qp: Option<Arc<crate::rdma::QueuePair>>,
    /// SMC regions registered on this connection: (index into `s.regions`, may write).
    opened: Vec<(usize, bool)>,
}

/// What a handler says: go on with the next frame, or end the connection with this result.
type Flow = ControlFlow<std::io::Result<()>>;

impl Conn {
    /// Frames until the peer closes, a frame fails, or the writer gave up. Returns the result and
    /// whether the writer task has ended.
    async fn run(
        &mut self,
        rd: &mut OwnedReadHalf,
        writer: &mut tokio::task::JoinHandle<()>,
    ) -> (std::io::Result<()>, bool) {
        let t = self.s.cfg.io_timeout;
        let max_data = self.s.cfg.max_request.saturating_add(12);
        loop {
            // Quiet between requests for up to an hour; a frame, once begun, arrives within
            // io_timeout (its payload's memory grows as its bytes arrive, or it goes straight into
            // a region). A writer that gave up ends it all.
            let header = tokio::select! {
                h = proto::read_header_within(rd, max_data, proto::IDLE, t) => h,
                _ = &mut *writer => return (Ok(()), true),
            };
            let h = match header {
                Ok(h) => h,
                Err(FrameError::Closed) => return (Ok(()), false),
                Err(e) => return (Err(io_err(e)), false),
            };
            if let ControlFlow::Break(r) = self.frame(rd, h).await {
                return (r, false);
            }
        }
    }

    /// One frame whose header `h` was read: its payload, decoded, to its handler.
    async fn frame(&mut self, rd: &mut OwnedReadHalf, h: Header) -> Flow {
        if matches!(h.kind, Kind::SmcWrite | Kind::SmcWriteV) {
            return self.smc_write(rd, h).await;
        }
        let p = match proto::read_payload_vec(rd, h.len, self.s.cfg.io_timeout).await {
            Ok(p) => p,
            Err(e) => return ControlFlow::Break(Err(io_err(e))),
        };
        let msg = match Msg::decode(h.kind, &p) {
            Ok(m) => m,
            Err(e) => {
                refuse(&self.s, &self.peer, &format!("malformed frame: {e}"));
                self.send(Reply(Code::Protocol, e.to_string()).into_frame(h.id))
                    .await;
                return ControlFlow::Break(Ok(()));
            }
        };
        // Opens, registrations and anything else that is not data are paced (so are refused
        // reads, below): a client spamming them gets its share of the server at that rate.
        if !matches!(
            msg,
            Msg::Read { .. } | Msg::ReadTo { .. } | Msg::SmcRead { .. }
        ) {
            self.pace.wait().await;
        }
        self.dispatch(rd, h.id, msg).await
    }

    /// Each message kind to its handler.
    async fn dispatch(&mut self, rd: &OwnedReadHalf, id: u64, msg: Msg) -> Flow {
        match msg {
            Msg::Open { root, path } => self.open(id, &root, &path).await,
            #[cfg(feature = "rdma")]
            Msg::RdmaConnect(ep) => self.rdma_connect(id, ep).await,
            Msg::SmcOpen { name, key } => self.smc_open(id, &name, &key).await,
            m @ (Msg::SmcRead { .. } | Msg::SmcWrite { .. } | Msg::SmcWriteV { .. }) => {
                return self.smc(rd, id, m).await;
            }
            // The payload follows on the stream.
            Msg::Read { file, offset, len } => return self.read(id, file, offset, len, None).await,
            // The payload goes by RDMA WRITE into the client's registered memory, then `ReadDone`
            // on the stream.
            Msg::ReadTo {
                file,
                offset,
                len,
                addr,
                rkey,
            } => return self.read(id, file, offset, len, Some((addr, rkey))).await,
            other => {
                refuse(
                    &self.s,
                    &self.peer,
                    &format!("unexpected {:?}", other.kind()),
                );
                let m = format!("unexpected {:?} from a client", other.kind());
                self.send(Reply(Code::Protocol, m).into_frame(id)).await;
            }
        }
        ControlFlow::Continue(())
    }

    /// Queues a reply for the writer task (gone: the connection is ending anyway).
    async fn send(&self, o: Out) {
        let _ = self.tx.send(o).await;
    }

    /// `Open`: a file of an exported root, confined to it.
    async fn open(&mut self, id: u64, root: &str, path: &str) {
        match open_file(&self.s, &mut self.files, root, path) {
            Ok((file, size)) => {
                self.send(Out::Control(Msg::OpenOk { file, size }.frame(id)))
                    .await
            }
            Err((c, m)) => {
                refuse(&self.s, &self.peer, &m);
                self.send(Reply(c, m).into_frame(id)).await;
            }
        }
    }

    /// `RdmaConnect`: a queue pair joined to the client's (one per connection).
    #[cfg(feature = "rdma")]
    async fn rdma_connect(&mut self, id: u64, ep: proto::QpEndpoint) {
        let s = &self.s;
        let r = match (&s.rdma, &self.qp) {
            (None, _) => Err("this server offers no RDMA (serve.rdma_device unset)".into()),
            (_, Some(_)) => Err("RDMA is already connected on this connection".into()),
            (Some(r), None) => r
                .queue_pair(s.cfg.max_inflight.max(1))
                .and_then(|q| {
                    // Peers may read (and write) one-sided only what a region's window key
                    // allows; every other memory region of ours is local-only.
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
                self.qp = Some(Arc::new(q));
                self.send(Out::Control(Msg::RdmaAccept(ep).frame(id))).await;
            }
            Err(m) => {
                refuse(&self.s, &self.peer, &m);
                self.send(Reply(Code::Protocol, m).into_frame(id)).await;
            }
        }
    }

    /// `SmcOpen`: registers a region on this connection (its key, compared in constant time).
    async fn smc_open(&mut self, id: u64, name: &str, key: &[u8]) {
        let s = self.s.clone();
        let found = s
            .regions
            .iter()
            .position(|r| r.cfg.name == name && proto::constant_time_eq(key, &r.cfg.key));
        let Some(i) = found else {
            refuse(
                &s,
                &self.peer,
                &format!("region {name:?}: unknown or wrong key"),
            );
            let m = format!("region {name:?}: no such region or wrong key");
            self.send(Reply(Code::Auth, m).into_frame(id)).await;
            return;
        };
        let writable = self.rw && s.regions[i].cfg.writable;
        // One handle per region and connection: registering again returns it, so the handles are
        // bounded by the exported regions.
        let handle = match self.opened.iter().position(|&(j, _)| j == i) {
            Some(k) => k,
            None => {
                self.opened.push((i, writable));
                self.opened.len() - 1
            }
        };
        // On a connection with a queue pair: the window, with the key its access allows (a
        // read-only token gets the read-only key).
        #[cfg(feature = "rdma")]
        let window = match (&self.qp, s.regions[i].window) {
            (Some(_), Some((addr, ro, rw))) => Some(proto::RemoteWindow {
                addr,
                rkey: if writable { rw.unwrap_or(ro) } else { ro },
            }),
            _ => None,
        };
        #[cfg(not(feature = "rdma"))]
        let window = None;
        let ok = Msg::SmcOpenOk {
            region: handle as u32,
            size: s.regions[i].cfg.size,
            writable,
            window,
        };
        self.send(Out::Control(ok.frame(id))).await;
    }

    /// `SmcRead` (and a write that arrived as a whole frame): served and answered at once by this
    /// loop, no hop through the writer task on a fault's path; after a read, a short poll for the
    /// next request.
    async fn smc(&mut self, rd: &OwnedReadHalf, id: u64, m: Msg) -> Flow {
        let read = matches!(m, Msg::SmcRead { .. });
        let f = smc_request(&self.s, &self.peer, &self.opened, m, id).await;
        if let Err(e) = smc_reply(&self.s, &self.wr, &f).await {
            return ControlFlow::Break(Err(e));
        }
        if read {
            poll_next(&self.s, rd);
        }
        ControlFlow::Continue(())
    }

    /// `SmcWrite` / `SmcWriteV`: into a host region straight from the socket (no frame buffer, no
    /// copy), answered at once; a malformed frame ends the connection.
    async fn smc_write(&mut self, rd: &mut OwnedReadHalf, h: Header) -> Flow {
        let (f, go_on) = match smc_receive(&self.s, &self.peer, &self.opened, rd, h).await {
            Ok(v) => v,
            Err(e) => return ControlFlow::Break(Err(e)),
        };
        if let Err(e) = smc_reply(&self.s, &self.wr, &f).await {
            return ControlFlow::Break(Err(e));
        }
        if go_on {
            ControlFlow::Continue(())
        } else {
            ControlFlow::Break(Ok(()))
        }
    }

    /// `Read` / `ReadTo` (with `to`: the client's address and key): checked and admitted here (an
    /// in-flight permit), then served by a task of its own; the reply goes through the writer.
    async fn read(
        &mut self,
        id: u64,
        file: u32,
        offset: u64,
        len: u32,
        to: Option<(u64, u32)>,
    ) -> Flow {
        #[cfg(feature = "rdma")]
        let q = match (to, self.qp.clone()) {
            (Some(_), None) => None,
            (_, q) => Some(q),
        };
        #[cfg(not(feature = "rdma"))]
        let q: Option<Option<()>> = if to.is_some() { None } else { Some(None) };
        let Some(q) = q else {
            refuse(&self.s, &self.peer, "ReadTo without an RDMA connection");
            let m = "ReadTo needs RdmaConnect first (and a server with rdma_device)".into();
            self.send(Reply(Code::Protocol, m).into_frame(id)).await;
            return ControlFlow::Continue(());
        };
        let admitted = admit(
            &self.s,
            &self.peer,
            &self.files,
            &self.inflight,
            file,
            offset,
            len,
        )
        .await;
        let (f, plain, name, permit) = match admitted {
            Ok(v) => v,
            Err(Some(o)) => {
                self.send(o.into_frame(id)).await;
                self.pace.wait().await;
                return ControlFlow::Continue(());
            }
            Err(None) => return ControlFlow::Break(Ok(())),
        };
        let job = ReadJob {
            id,
            f,
            plain,
            name,
            offset,
            len,
            to,
            q,
            permit,
        };
        tokio::spawn(serve_read(
            self.s.clone(),
            self.tx.clone(),
            self.staging.clone(),
            job,
        ));
        ControlFlow::Continue(())
    }
}
