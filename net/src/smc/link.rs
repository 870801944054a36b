//! The SMC link: a connection of its own for blocking SMC requests, driven by the thread that waits
//! for its replies. Frames are encoded and decoded by the codec (`proto`); this module only moves
//! their bytes, with `poll(2)` waits bounded by each request's deadline.

use std::collections::HashMap;
use std::io::Read;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::{LinkError, RegionId};
use crate::proto::{self, FrameError, HEADER, Header};
use crate::transport::DataPath;

/// A connection of its own for blocking SMC requests (a mapping's fault thread, a barrier, explicit
/// reads and writes). It is made by `Client::smc_link` — the client's connect, hello and token —
/// and then driven by the thread that waits for it, with no runtime in between: the caller writes
/// its requests (heads from the codec, bodies from its own buffers or straight out of a mapping) and
/// reads the replies' bytes off the socket, each header checked by the codec ([`Header::decode`]),
/// every wait bounded by the request's deadline. One thread uses a link at a time (links are
/// pooled by the SMC client), so there is no pending map: replies come back in request order.
///
/// Why not the shared connection: a request on it costs a runtime entry, timer registrations, a
/// reader task and a channel wake-up on top of the round trip. On the H200 host (loopback) an
/// explicit 4 KiB read took 36–38 µs that way and 27–28 µs on a link, in the same run.
pub(crate) struct SmcLink {
    sock: std::net::TcpStream,
    server: SocketAddr,
    max_request: u32,
    next_id: u64,
    /// SMC region ids on this connection, by name (with the key they were opened with), and the
    /// region's one-sided window when the data path has one.
    regions: HashMap<String, (Vec<u8>, RegionId, Option<crate::proto::RemoteWindow>)>,
    /// The transport's data path on this connection (an RDMA queue pair: one-sided faults and
    /// barriers); dropped with the link.
    path: Box<dyn DataPath>,
}

impl std::fmt::Debug for SmcLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmcLink")
            .field("server", &self.server)
            .finish()
    }
}

/// The blocking side of a link's socket: `read` reads what is there, spins until `spin_until` while
/// nothing is, then sleeps in `poll(2)` for at most the time left before `until` (past it:
/// `TimedOut`).
struct Blocking<'a> {
    sock: &'a std::net::TcpStream,
    until: Instant,
    spin_until: Instant,
}

impl Read for Blocking<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::os::fd::AsFd;
        loop {
            match (&mut &*self.sock).read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let now = Instant::now();
                    if now < self.spin_until {
                        std::hint::spin_loop();
                        continue;
                    }
                    let left = self.until.saturating_duration_since(now);
                    if left.is_zero() {
                        return Err(std::io::ErrorKind::TimedOut.into());
                    }
                    crate::smc_sys::wait_fd(self.sock.as_fd(), libc::POLLIN, left)?;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl SmcLink {
    /// A link over `sock` (connected, hello done, nonblocking) to `server`, which accepts requests
    /// of up to `max_request` bytes, with the transport's data path on it.
    pub(crate) fn new(
        sock: std::net::TcpStream,
        server: SocketAddr,
        max_request: u32,
        path: Box<dyn DataPath>,
    ) -> Self {
        Self {
            sock,
            server,
            max_request,
            next_id: 1,
            regions: HashMap::new(),
            path,
        }
    }

    /// The server's address.
    pub(crate) fn server(&self) -> SocketAddr {
        self.server
    }

    /// The largest request the server accepts.
    pub(crate) fn max_request(&self) -> u32 {
        self.max_request
    }

    /// A fresh request id.
    pub(crate) fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Region `name`'s id on this link, if it was opened here.
    pub(crate) fn region(&self, name: &str, key: &[u8]) -> Option<RegionId> {
        // No allocation: looked up on every request.
        self.regions
            .get(name)
            .and_then(|(k, id, _)| (k[..] == *key).then_some(*id))
    }

    /// Records region `name`'s id on this link, and its one-sided window.
    pub(crate) fn set_region(
        &mut self,
        name: &str,
        key: &[u8],
        id: RegionId,
        window: Option<crate::proto::RemoteWindow>,
    ) {
        self.regions
            .insert(name.to_string(), (key.to_vec(), id, window));
    }

    /// One-sided access to region `name` on this link: the data path's and the region's window,
    /// when both exist (RDMA, and a region in registered host memory).
    pub(crate) fn one_sided(
        &self,
        name: &str,
    ) -> Option<(&dyn crate::transport::OneSided, crate::proto::RemoteWindow)> {
        let w = self.regions.get(name)?.2?;
        Some((self.path.one_sided()?, w))
    }

    /// Whether this link's data path has one-sided access at all.
    pub(crate) fn has_one_sided(&self) -> bool {
        self.path.one_sided().is_some()
    }

    /// Sends `total` bytes, produced by `write` (given the socket and how many bytes went already;
    /// it returns how many more went), within `until`. A frame cut short leaves the link unusable:
    /// callers drop it on any error.
    pub(crate) fn send_with(
        &self,
        total: usize,
        until: Instant,
        mut write: impl FnMut(&std::net::TcpStream, usize) -> std::io::Result<usize>,
    ) -> Result<(), LinkError> {
        use std::os::fd::AsFd;
        let server = self.server;
        let fail = |e: std::io::Error| LinkError::Send {
            server,
            source: Arc::new(e),
        };
        let budget = until.saturating_duration_since(Instant::now());
        let mut done = 0;
        while done < total {
            match write(&self.sock, done) {
                Ok(0) => return Err(fail(std::io::ErrorKind::WriteZero.into())),
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(LinkError::Deadline {
                            server,
                            what: "send",
                            waited: budget,
                        });
                    }
                    crate::smc_sys::wait_fd(self.sock.as_fd(), libc::POLLOUT, left)
                        .map_err(fail)?;
                }
                Err(e) => return Err(fail(e)),
            }
        }
        Ok(())
    }

    /// Sends `parts` back to back (one frame, or several) within `until`.
    pub(crate) fn send(&self, parts: &[&[u8]], until: Instant) -> Result<(), LinkError> {
        use std::io::Write;
        let total = parts.iter().map(|p| p.len()).sum();
        self.send_with(total, until, |sock, done| {
            let mut skip = done;
            let mut iov = Vec::with_capacity(parts.len());
            for p in parts {
                if skip >= p.len() {
                    skip -= p.len();
                    continue;
                }
                iov.push(std::io::IoSlice::new(&p[skip..]));
                skip = 0;
            }
            (&mut &*sock).write_vectored(&iov)
        })
    }

    /// Reads the next reply's header within `until`, spinning up to `spin` before sleeping: its
    /// first bytes (an end of stream before them is [`FrameError::Closed`]), then the rest, checked
    /// by the codec against `max_request`.
    pub(crate) fn read_header(
        &mut self,
        until: Instant,
        spin: Duration,
    ) -> Result<proto::Header, LinkError> {
        let now = Instant::now();
        let mut rd = Blocking {
            sock: &self.sock,
            until,
            spin_until: now + spin,
        };
        let mut h = [0u8; HEADER];
        let r = match rd.read(&mut h) {
            Ok(0) => Err(FrameError::Closed),
            Ok(n) => rd
                .read_exact(&mut h[n..])
                .map_err(|e| FrameError::io("header", e))
                .and_then(|()| Ok(Header::decode(&h, self.max_request)?)),
            Err(e) => Err(FrameError::io("header", e)),
        };
        self.frame_result(r, "reply", until.saturating_duration_since(now))
    }

    /// Reads a payload of exactly `buf.len()` bytes (the length its header declared) into `buf`.
    pub(crate) fn read_payload(&mut self, buf: &mut [u8], until: Instant) -> Result<(), LinkError> {
        let now = Instant::now();
        let mut rd = Blocking {
            sock: &self.sock,
            until,
            spin_until: now,
        };
        let r = rd.read_exact(buf).map_err(|e| FrameError::io("payload", e));
        self.frame_result(r, "reply payload", until.saturating_duration_since(now))
    }

    fn frame_result<T>(
        &self,
        r: Result<T, FrameError>,
        what: &'static str,
        waited: Duration,
    ) -> Result<T, LinkError> {
        let server = self.server;
        match r {
            Ok(v) => Ok(v),
            Err(FrameError::Io { source, .. }) if source.kind() == std::io::ErrorKind::TimedOut => {
                Err(LinkError::Deadline {
                    server,
                    what,
                    waited,
                })
            }
            Err(FrameError::Timeout { .. }) => Err(LinkError::Deadline {
                server,
                what,
                waited,
            }),
            Err(source) => Err(LinkError::Receive { server, source }),
        }
    }
}
