//! The wire protocol. Every frame is a 20-byte header and a payload:
//!
//! ```text
//! magic "UBN1" (4) | version u16 | kind u16 | request id u64 | payload length u32   (little endian)
//! ```
//!
//! Requests: `Hello{token}`, `Open{root, path}`, `Read{file, offset, len}`. Replies: `HelloOk{max_request,
//! max_inflight}`, `OpenOk{file, size}`, `ReadOk` (the payload is the data), `Error{code, message}`.
//! RDMA (on the same control connection): `RdmaConnect{endpoint}` → `RdmaAccept{endpoint}` joins two RC
//! queue pairs; `ReadTo{file, offset, len, addr, rkey}` asks the server to RDMA-WRITE the bytes into the
//! client's registered memory, and `ReadDone` (empty) says they are there.
//! Many requests may be in flight per connection; replies carry the request's id. Every length is
//! checked against [`MAX_CONTROL`] or the negotiated `max_request` before anything is allocated.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

pub const MAGIC: [u8; 4] = *b"UBN1";
pub const VERSION: u16 = 1;
pub const HEADER: usize = 20;
/// Largest payload of a non-data frame.
pub const MAX_CONTROL: u32 = 64 << 10;
/// Longest `Error` message (longer ones are cut, at a character boundary, when encoded).
pub const MAX_MESSAGE: u32 = 2048;

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Kind {
    Hello = 1,
    HelloOk = 2,
    Open = 3,
    OpenOk = 4,
    Read = 5,
    ReadOk = 6,
    Error = 7,
    RdmaConnect = 8,
    RdmaAccept = 9,
    ReadTo = 10,
    ReadDone = 11,
    SmcOpen = 12,
    SmcOpenOk = 13,
    SmcRead = 14,
    SmcWrite = 15,
    SmcWriteOk = 16,
    SmcWriteV = 17,
}

impl Kind {
    fn from_u16(v: u16) -> Option<Self> {
        Some(match v {
            1 => Self::Hello,
            2 => Self::HelloOk,
            3 => Self::Open,
            4 => Self::OpenOk,
            5 => Self::Read,
            6 => Self::ReadOk,
            7 => Self::Error,
            8 => Self::RdmaConnect,
            9 => Self::RdmaAccept,
            10 => Self::ReadTo,
            11 => Self::ReadDone,
            12 => Self::SmcOpen,
            13 => Self::SmcOpenOk,
            14 => Self::SmcRead,
            15 => Self::SmcWrite,
            16 => Self::SmcWriteOk,
            17 => Self::SmcWriteV,
            _ => return None,
        })
    }
}

/// An SMC region's memory as a peer's RDMA queue pair addresses it: the address of its first byte
/// and the remote key (read-only or read-write, as the registration allows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteWindow {
    /// Address of the region's byte 0 in the server's memory region.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
}

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub id: u64,
    pub len: u32,
}

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("bad magic {0:?}: not a ubdirect peer")]
    Magic([u8; 4]),
    #[error("protocol version {0} unsupported (this side speaks {VERSION})")]
    Version(u16),
    #[error("unknown frame kind {0}")]
    Kind(u16),
    #[error("{what}: length {len} exceeds {max}")]
    TooLong {
        what: &'static str,
        len: u64,
        max: u64,
    },
    #[error("truncated {0}")]
    Truncated(&'static str),
    #[error("{0} is not UTF-8")]
    Utf8(&'static str),
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(self.kind as u16).to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..20].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and bounds-checks a header; data frames may carry up to `max_data` bytes.
    pub fn decode(b: &[u8; HEADER], max_data: u32) -> Result<Self, ProtoError> {
        let magic: [u8; 4] = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(ProtoError::Magic(magic));
        }
        let v = u16::from_le_bytes([b[4], b[5]]);
        if v != VERSION {
            return Err(ProtoError::Version(v));
        }
        let k = u16::from_le_bytes([b[6], b[7]]);
        let kind = Kind::from_u16(k).ok_or(ProtoError::Kind(k))?;
        let id = u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8]));
        let len = u32::from_le_bytes([b[16], b[17], b[18], b[19]]);
        let max = if matches!(kind, Kind::ReadOk | Kind::SmcWrite | Kind::SmcWriteV) {
            max_data
        } else {
            MAX_CONTROL
        };
        if len > max {
            return Err(ProtoError::TooLong {
                what: "frame payload",
                len: len as u64,
                max: max as u64,
            });
        }
        Ok(Header { kind, id, len })
    }
}

/// The header of a data reply (`ReadOk`) of `len` bytes, its payload to follow on the stream.
pub fn data_header(id: u64, len: u32) -> [u8; HEADER] {
    Header {
        kind: Kind::ReadOk,
        id,
        len,
    }
    .encode()
}

/// How long a connection may stay quiet between frames before a reader gives up on it. Once a
/// header has arrived, its payload must follow within the connection's (much shorter) I/O deadline.
pub const IDLE: Duration = Duration::from_secs(3600);

/// Why a frame could not be read. Cheap to clone (the I/O error is shared), so one connection's
/// failure can be handed to every request that was waiting on it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FrameError {
    /// The peer closed the connection between frames.
    #[error("connection closed by the peer")]
    Closed,
    /// The frame's header or payload did not arrive (or could not be sent) within the deadline.
    #[error("no frame {what} within {deadline:?}")]
    Timeout {
        /// `header`, `payload` (or `send`).
        what: &'static str,
        /// The deadline.
        deadline: Duration,
    },
    /// The connection failed mid-frame.
    #[error("connection lost reading a frame {what}")]
    Io {
        /// `header` or `payload`.
        what: &'static str,
        /// The socket's error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The header is not a valid frame (magic, version, kind, length over the maximum).
    #[error(transparent)]
    Proto(#[from] ProtoError),
}

impl FrameError {
    fn io(what: &'static str, e: std::io::Error) -> Self {
        FrameError::Io {
            what,
            source: Arc::new(e),
        }
    }
}

/// Reads and checks one frame header within `wait` (its first byte, then the rest): see
/// [`read_header_within`], of which this is the case `deadline = wait`.
pub async fn read_header<R: AsyncRead + Unpin + ?Sized>(
    rd: &mut R,
    max_data: u32,
    wait: Duration,
) -> Result<Header, FrameError> {
    read_header_within(rd, max_data, wait, wait).await
}

/// Reads and checks one frame header: its first byte within `wait` (how long the connection may be
/// quiet between frames), the rest within `deadline` of that first byte (a header sent by halves
/// cannot hold the reader longer). Data frames may declare up to `max_data` bytes, control frames
/// [`MAX_CONTROL`]. An end of stream before the first byte is [`FrameError::Closed`]; one inside the
/// header is an I/O error. For payloads received straight into caller memory (a lease): follow with
/// [`read_payload`].
pub async fn read_header_within<R: AsyncRead + Unpin + ?Sized>(
    rd: &mut R,
    max_data: u32,
    wait: Duration,
    deadline: Duration,
) -> Result<Header, FrameError> {
    let mut h = [0u8; HEADER];
    let first = async {
        loop {
            match rd.read(&mut h).await {
                Ok(0) => return Err(FrameError::Closed),
                Ok(k) => return Ok(k),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(FrameError::io("header", e)),
            }
        }
    };
    let n = match tokio::time::timeout(wait, first).await {
        Err(_) => {
            return Err(FrameError::Timeout {
                what: "header",
                deadline: wait,
            });
        }
        Ok(r) => r?,
    };
    if n < HEADER {
        match tokio::time::timeout(deadline, rd.read_exact(&mut h[n..])).await {
            Err(_) => {
                return Err(FrameError::Timeout {
                    what: "header",
                    deadline,
                });
            }
            Ok(Err(e)) => return Err(FrameError::io("header", e)),
            Ok(Ok(_)) => {}
        }
    }
    Ok(Header::decode(&h, max_data)?)
}

/// Reads the range table of an `SmcWriteV` frame — `count` ranges of 12 bytes (`u64` offset, `u32`
/// length), a count its header declared and the caller bounded by the frame's length — in pieces,
/// decoding each as it arrives: memory follows the bytes that arrived, not the count (a header that
/// declares a large table and stalls pins one 48 KiB piece).
pub async fn read_write_ranges<R: AsyncRead + Unpin + ?Sized>(
    rd: &mut R,
    count: usize,
    deadline: Duration,
) -> Result<Vec<(u64, u32)>, FrameError> {
    const PIECE: usize = 4096 * 12;
    let mut piece = vec![0u8; count.saturating_mul(12).min(PIECE)];
    let mut ranges = Vec::new();
    let mut left = count.saturating_mul(12);
    while left > 0 {
        let n = left.min(PIECE);
        read_payload(rd, &mut piece[..n], deadline).await?;
        ranges.extend(piece[..n].chunks_exact(12).map(|c| {
            let mut o = [0u8; 8];
            o.copy_from_slice(&c[..8]);
            (
                u64::from_le_bytes(o),
                u32::from_le_bytes([c[8], c[9], c[10], c[11]]),
            )
        }));
        left -= n;
    }
    Ok(ranges)
}

/// Reads a payload of exactly `buf.len()` bytes (the length its header declared) within `deadline`.
pub async fn read_payload<R: AsyncRead + Unpin + ?Sized>(
    rd: &mut R,
    buf: &mut [u8],
    deadline: Duration,
) -> Result<(), FrameError> {
    if buf.is_empty() {
        return Ok(());
    }
    match tokio::time::timeout(deadline, rd.read_exact(buf)).await {
        Err(_) => Err(FrameError::Timeout {
            what: "payload",
            deadline,
        }),
        Ok(Err(e)) => Err(FrameError::io("payload", e)),
        Ok(Ok(_)) => Ok(()),
    }
}

/// Reads a payload of `len` bytes (a length its header declared and [`Header::decode`] bounded)
/// within `deadline` into a buffer that grows as the bytes arrive: memory follows what the peer sent,
/// not what it declared (a peer that declares a large frame and stalls pins almost nothing).
pub async fn read_payload_vec<R: AsyncRead + Unpin + ?Sized>(
    rd: &mut R,
    len: u32,
    deadline: Duration,
) -> Result<Vec<u8>, FrameError> {
    let mut p = Vec::new();
    if len == 0 {
        return Ok(p);
    }
    let fill = async {
        let mut chunk = PAYLOAD_CHUNK.min(len as usize);
        while p.len() < len as usize {
            // At most doubling what arrived so far (and never past the declared length).
            let want = chunk.min(len as usize - p.len());
            p.try_reserve_exact(want)
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
            let at = p.len();
            p.resize(at + want, 0);
            let r = rd.read(&mut p[at..]).await;
            let k = *r.as_ref().unwrap_or(&0);
            p.truncate(at + k);
            match r {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            if p.len() >= chunk {
                chunk = p.len();
            }
        }
        Ok(())
    };
    let r = tokio::time::timeout(deadline, fill).await;
    match r {
        Err(_) => Err(FrameError::Timeout {
            what: "payload",
            deadline,
        }),
        Ok(Err(e)) => Err(FrameError::io("payload", e)),
        Ok(Ok(())) => Ok(p),
    }
}

/// Reads and drops a payload of `len` bytes within `deadline` (a reply nobody waits for any more),
/// through a small buffer: nothing the size of the declared length is allocated.
pub async fn discard_payload<R: AsyncRead + Unpin + ?Sized>(
    rd: &mut R,
    len: u32,
    deadline: Duration,
) -> Result<(), FrameError> {
    let drain = async {
        let mut buf = [0u8; 4096];
        let mut left = len as usize;
        while left > 0 {
            let n = left.min(buf.len());
            match rd.read(&mut buf[..n]).await {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(k) => left -= k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    };
    match tokio::time::timeout(deadline, drain).await {
        Err(_) => Err(FrameError::Timeout {
            what: "payload",
            deadline,
        }),
        Ok(Err(e)) => Err(FrameError::io("payload", e)),
        Ok(Ok(())) => Ok(()),
    }
}

/// The first step of [`read_payload_vec`]'s buffer (it then doubles with what arrived).
const PAYLOAD_CHUNK: usize = 64 << 10;

/// Reads one whole frame: its first byte within `wait` (how long the connection may be quiet), the
/// rest of its header and its payload each within `deadline`. The declared length is checked against
/// `max_data` (data frames) or [`MAX_CONTROL`] before anything is allocated, and the payload's
/// buffer grows only as its bytes arrive.
pub async fn read_frame<R: AsyncRead + Unpin + ?Sized>(
    rd: &mut R,
    max_data: u32,
    wait: Duration,
    deadline: Duration,
) -> Result<(Header, Vec<u8>), FrameError> {
    let h = read_header_within(rd, max_data, wait, deadline).await?;
    let p = read_payload_vec(rd, h.len, deadline).await?;
    Ok((h, p))
}

/// Control messages (everything but the data of `ReadOk`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    Hello {
        token: Vec<u8>,
    },
    HelloOk {
        max_request: u32,
        max_inflight: u32,
    },
    Open {
        root: String,
        path: String,
    },
    OpenOk {
        file: u32,
        size: u64,
    },
    Read {
        file: u32,
        offset: u64,
        len: u32,
    },
    Error {
        code: Code,
        message: String,
    },
    RdmaConnect(QpEndpoint),
    RdmaAccept(QpEndpoint),
    ReadTo {
        file: u32,
        offset: u64,
        len: u32,
        addr: u64,
        rkey: u32,
    },
    ReadDone,
    /// Register a memory region: its name and key.
    SmcOpen {
        name: String,
        key: Vec<u8>,
    },
    SmcOpenOk {
        region: u32,
        size: u64,
        writable: bool,
        /// Where this connection's RDMA queue pair may address the region one-sided (RDMA READ for
        /// faults, WRITE for dirty pages when `writable`); `None` on TCP, or for a region that is
        /// not in registered host memory.
        window: Option<RemoteWindow>,
    },
    /// Read region bytes (reply: `ReadOk` carrying them).
    SmcRead {
        region: u32,
        offset: u64,
        len: u32,
    },
    /// Write region bytes (a data frame: bounded by `max_request`, not `MAX_CONTROL`).
    SmcWrite {
        region: u32,
        offset: u64,
        data: Vec<u8>,
    },
    SmcWriteOk,
    /// Several ranges in one request (a barrier's merged dirty runs): `(offset, len)` each, then
    /// their bytes back to back. One acknowledgement for all.
    SmcWriteV {
        region: u32,
        ranges: Vec<(u64, u32)>,
        data: Vec<u8>,
    },
}

/// An RC queue pair's address, as exchanged by `RdmaConnect` / `RdmaAccept`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpEndpoint {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub mtu: u8,
    pub gid: [u8; 16],
}

fn put_ep(p: &mut Vec<u8>, e: &QpEndpoint) {
    p.extend_from_slice(&e.qpn.to_le_bytes());
    p.extend_from_slice(&e.psn.to_le_bytes());
    p.extend_from_slice(&e.lid.to_le_bytes());
    p.push(e.mtu);
    p.extend_from_slice(&e.gid);
}

/// Error codes of `Error` frames: why a peer refused a request. On the wire a `u16`; codes this
/// side does not know decode as [`Code::Other`] (so a newer peer's codes survive a round trip).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    /// Wrong or missing token, or a region's key.
    Auth,
    /// No such root, file or region.
    NotFound,
    /// A path that leaves its root, or a write through a read-only registration.
    Forbidden,
    /// A range past the end of the file or region.
    Range,
    /// A request larger than `max_request`.
    TooLarge,
    /// No staging block came free in time.
    Busy,
    /// The server's storage failed.
    Io,
    /// A malformed or unexpected frame.
    Protocol,
    /// A file or region id not opened on this connection.
    BadFile,
    /// A code this side does not know.
    Other(u16),
}

impl Code {
    /// The wire value.
    pub fn as_u16(self) -> u16 {
        match self {
            Code::Auth => 1,
            Code::NotFound => 2,
            Code::Forbidden => 3,
            Code::Range => 4,
            Code::TooLarge => 5,
            Code::Busy => 6,
            Code::Io => 7,
            Code::Protocol => 8,
            Code::BadFile => 9,
            Code::Other(v) => v,
        }
    }

    /// Short name (`auth`, `not-found`, …).
    pub fn name(self) -> &'static str {
        match self {
            Code::Auth => "auth",
            Code::NotFound => "not-found",
            Code::Forbidden => "forbidden",
            Code::Range => "range",
            Code::TooLarge => "too-large",
            Code::Busy => "busy",
            Code::Io => "io",
            Code::Protocol => "protocol",
            Code::BadFile => "bad-file",
            Code::Other(_) => "other",
        }
    }
}

impl From<u16> for Code {
    fn from(v: u16) -> Self {
        match v {
            1 => Code::Auth,
            2 => Code::NotFound,
            3 => Code::Forbidden,
            4 => Code::Range,
            5 => Code::TooLarge,
            6 => Code::Busy,
            7 => Code::Io,
            8 => Code::Protocol,
            9 => Code::BadFile,
            v => Code::Other(v),
        }
    }
}

impl From<Code> for u16 {
    fn from(c: Code) -> u16 {
        c.as_u16()
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.as_u16(), self.name())
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

struct Rd<'a>(&'a [u8]);

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], ProtoError> {
        if self.0.len() < n {
            return Err(ProtoError::Truncated(what));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u16(&mut self, w: &'static str) -> Result<u16, ProtoError> {
        let b = self.take(2, w)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, w: &'static str) -> Result<u32, ProtoError> {
        let b = self.take(4, w)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, w: &'static str) -> Result<u64, ProtoError> {
        Ok(u64::from_le_bytes(
            self.take(8, w)?.try_into().unwrap_or([0; 8]),
        ))
    }
    fn bytes(&mut self, w: &'static str, max: u32) -> Result<&'a [u8], ProtoError> {
        let n = self.u32(w)?;
        if n > max {
            return Err(ProtoError::TooLong {
                what: w,
                len: n as u64,
                max: max as u64,
            });
        }
        self.take(n as usize, w)
    }
    fn ep(&mut self) -> Result<QpEndpoint, ProtoError> {
        let qpn = self.u32("qpn")?;
        let psn = self.u32("psn")?;
        let lid = self.u16("lid")?;
        let mtu = self.take(1, "mtu")?[0];
        if !(1..=5).contains(&mtu) {
            return Err(ProtoError::TooLong {
                what: "mtu",
                len: mtu as u64,
                max: 5,
            });
        }
        let gid = self.take(16, "gid")?.try_into().unwrap_or([0; 16]);
        Ok(QpEndpoint {
            qpn,
            psn,
            lid,
            mtu,
            gid,
        })
    }
    fn string(&mut self, w: &'static str) -> Result<String, ProtoError> {
        self.string_max(w, 4096)
    }
    fn string_max(&mut self, w: &'static str, max: u32) -> Result<String, ProtoError> {
        let b = self.bytes(w, max)?;
        String::from_utf8(b.to_vec()).map_err(|_| ProtoError::Utf8(w))
    }
}

impl Msg {
    pub fn kind(&self) -> Kind {
        match self {
            Msg::Hello { .. } => Kind::Hello,
            Msg::HelloOk { .. } => Kind::HelloOk,
            Msg::Open { .. } => Kind::Open,
            Msg::OpenOk { .. } => Kind::OpenOk,
            Msg::Read { .. } => Kind::Read,
            Msg::Error { .. } => Kind::Error,
            Msg::RdmaConnect(_) => Kind::RdmaConnect,
            Msg::RdmaAccept(_) => Kind::RdmaAccept,
            Msg::ReadTo { .. } => Kind::ReadTo,
            Msg::ReadDone => Kind::ReadDone,
            Msg::SmcOpen { .. } => Kind::SmcOpen,
            Msg::SmcOpenOk { .. } => Kind::SmcOpenOk,
            Msg::SmcRead { .. } => Kind::SmcRead,
            Msg::SmcWrite { .. } => Kind::SmcWrite,
            Msg::SmcWriteOk => Kind::SmcWriteOk,
            Msg::SmcWriteV { .. } => Kind::SmcWriteV,
        }
    }

    /// A whole frame: header and payload.
    pub fn frame(&self, id: u64) -> Vec<u8> {
        let mut p = Vec::new();
        match self {
            Msg::Hello { token } => put_bytes(&mut p, token),
            Msg::HelloOk {
                max_request,
                max_inflight,
            } => {
                p.extend_from_slice(&max_request.to_le_bytes());
                p.extend_from_slice(&max_inflight.to_le_bytes());
            }
            Msg::Open { root, path } => {
                put_bytes(&mut p, root.as_bytes());
                put_bytes(&mut p, path.as_bytes());
            }
            Msg::OpenOk { file, size } => {
                p.extend_from_slice(&file.to_le_bytes());
                p.extend_from_slice(&size.to_le_bytes());
            }
            Msg::Read { file, offset, len } => {
                p.extend_from_slice(&file.to_le_bytes());
                p.extend_from_slice(&offset.to_le_bytes());
                p.extend_from_slice(&len.to_le_bytes());
            }
            Msg::Error { code, message } => {
                p.extend_from_slice(&code.as_u16().to_le_bytes());
                // At most MAX_MESSAGE bytes, cut at a character boundary (it decodes as sent).
                let mut n = message.len().min(MAX_MESSAGE as usize);
                while !message.is_char_boundary(n) {
                    n -= 1;
                }
                put_bytes(&mut p, &message.as_bytes()[..n]);
            }
            Msg::RdmaConnect(e) | Msg::RdmaAccept(e) => put_ep(&mut p, e),
            Msg::ReadTo {
                file,
                offset,
                len,
                addr,
                rkey,
            } => {
                p.extend_from_slice(&file.to_le_bytes());
                p.extend_from_slice(&offset.to_le_bytes());
                p.extend_from_slice(&len.to_le_bytes());
                p.extend_from_slice(&addr.to_le_bytes());
                p.extend_from_slice(&rkey.to_le_bytes());
            }
            Msg::ReadDone | Msg::SmcWriteOk => {}
            Msg::SmcOpen { name, key } => {
                put_bytes(&mut p, name.as_bytes());
                put_bytes(&mut p, key);
            }
            Msg::SmcOpenOk {
                region,
                size,
                writable,
                window,
            } => {
                p.extend_from_slice(&region.to_le_bytes());
                p.extend_from_slice(&size.to_le_bytes());
                p.push(*writable as u8);
                if let Some(w) = window {
                    p.extend_from_slice(&w.addr.to_le_bytes());
                    p.extend_from_slice(&w.rkey.to_le_bytes());
                }
            }
            Msg::SmcRead {
                region,
                offset,
                len,
            } => {
                p.extend_from_slice(&region.to_le_bytes());
                p.extend_from_slice(&offset.to_le_bytes());
                p.extend_from_slice(&len.to_le_bytes());
            }
            Msg::SmcWrite {
                region,
                offset,
                data,
            } => {
                p.extend_from_slice(&region.to_le_bytes());
                p.extend_from_slice(&offset.to_le_bytes());
                p.extend_from_slice(data);
            }
            Msg::SmcWriteV {
                region,
                ranges,
                data,
            } => {
                p.extend_from_slice(&region.to_le_bytes());
                p.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
                for (o, l) in ranges {
                    p.extend_from_slice(&o.to_le_bytes());
                    p.extend_from_slice(&l.to_le_bytes());
                }
                p.extend_from_slice(data);
            }
        }
        let mut f = Header {
            kind: self.kind(),
            id,
            len: p.len() as u32,
        }
        .encode()
        .to_vec();
        f.extend_from_slice(&p);
        f
    }

    /// Decodes a control payload of `kind`.
    pub fn decode(kind: Kind, payload: &[u8]) -> Result<Self, ProtoError> {
        let mut r = Rd(payload);
        let m = match kind {
            Kind::Hello => Msg::Hello {
                token: r.bytes("token", 4096)?.to_vec(),
            },
            Kind::HelloOk => Msg::HelloOk {
                max_request: r.u32("max_request")?,
                max_inflight: r.u32("max_inflight")?,
            },
            Kind::Open => Msg::Open {
                root: r.string("root")?,
                path: r.string("path")?,
            },
            Kind::OpenOk => Msg::OpenOk {
                file: r.u32("file")?,
                size: r.u64("size")?,
            },
            Kind::Read => Msg::Read {
                file: r.u32("file")?,
                offset: r.u64("offset")?,
                len: r.u32("len")?,
            },
            Kind::Error => Msg::Error {
                code: Code::from(r.u16("code")?),
                message: r.string_max("message", MAX_MESSAGE)?,
            },
            Kind::RdmaConnect => Msg::RdmaConnect(r.ep()?),
            Kind::RdmaAccept => Msg::RdmaAccept(r.ep()?),
            Kind::ReadTo => Msg::ReadTo {
                file: r.u32("file")?,
                offset: r.u64("offset")?,
                len: r.u32("len")?,
                addr: r.u64("addr")?,
                rkey: r.u32("rkey")?,
            },
            Kind::ReadDone => Msg::ReadDone,
            Kind::SmcWriteOk => Msg::SmcWriteOk,
            Kind::SmcOpen => Msg::SmcOpen {
                name: r.string("region name")?,
                key: r.bytes("region key", 4096)?.to_vec(),
            },
            Kind::SmcOpenOk => Msg::SmcOpenOk {
                region: r.u32("region")?,
                size: r.u64("size")?,
                writable: r.take(1, "writable")?[0] != 0,
                window: if r.0.is_empty() {
                    None
                } else {
                    Some(RemoteWindow {
                        addr: r.u64("window addr")?,
                        rkey: r.u32("window rkey")?,
                    })
                },
            },
            Kind::SmcRead => Msg::SmcRead {
                region: r.u32("region")?,
                offset: r.u64("offset")?,
                len: r.u32("len")?,
            },
            Kind::SmcWriteV => {
                let region = r.u32("region")?;
                let n = r.u32("range count")?;
                let mut ranges = Vec::new();
                let mut total = 0u64;
                for _ in 0..n {
                    // Each range is 12 bytes of a payload already bounded: `take` fails first on a
                    // count that lies.
                    let o = r.u64("range offset")?;
                    let l = r.u32("range len")?;
                    total += l as u64;
                    ranges.push((o, l));
                }
                if total != r.0.len() as u64 {
                    return Err(ProtoError::TooLong {
                        what: "vectored write data",
                        len: r.0.len() as u64,
                        max: total,
                    });
                }
                let data = std::mem::take(&mut r.0).to_vec();
                Msg::SmcWriteV {
                    region,
                    ranges,
                    data,
                }
            }
            Kind::SmcWrite => {
                let region = r.u32("region")?;
                let offset = r.u64("offset")?;
                let data = std::mem::take(&mut r.0).to_vec();
                Msg::SmcWrite {
                    region,
                    offset,
                    data,
                }
            }
            Kind::ReadOk => return Err(ProtoError::Kind(Kind::ReadOk as u16)),
        };
        if !r.0.is_empty() {
            return Err(ProtoError::TooLong {
                what: "trailing bytes",
                len: r.0.len() as u64,
                max: 0,
            });
        }
        Ok(m)
    }
}

/// Compares two byte strings in time independent of where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | ((a.len() ^ b.len()) >> 8) as u8;
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xFF);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bounds() {
        for m in [
            Msg::Hello {
                token: b"secret".to_vec(),
            },
            Msg::HelloOk {
                max_request: 1 << 24,
                max_inflight: 64,
            },
            Msg::Open {
                root: "data".into(),
                path: "a/b.bin".into(),
            },
            Msg::OpenOk {
                file: 3,
                size: 1 << 40,
            },
            Msg::Read {
                file: 3,
                offset: 12345,
                len: 4096,
            },
            Msg::Error {
                code: Code::Range,
                message: "past end".into(),
            },
            Msg::RdmaConnect(QpEndpoint {
                qpn: 17,
                psn: 0xabcdef,
                lid: 0,
                mtu: 3,
                gid: [7; 16],
            }),
            Msg::RdmaAccept(QpEndpoint {
                qpn: 18,
                psn: 1,
                lid: 2,
                mtu: 5,
                gid: [0; 16],
            }),
            Msg::ReadTo {
                file: 1,
                offset: 4096,
                len: 8192,
                addr: 0x7f00_0000_1000,
                rkey: 0x1234,
            },
            Msg::ReadDone,
            Msg::SmcOpen {
                name: "kv".into(),
                key: b"k3y".to_vec(),
            },
            Msg::SmcOpenOk {
                region: 2,
                size: 1 << 30,
                writable: true,
                window: None,
            },
            Msg::SmcOpenOk {
                region: 3,
                size: 4096,
                writable: false,
                window: Some(RemoteWindow {
                    addr: 0x7f00_0000_2000,
                    rkey: 0x99,
                }),
            },
            Msg::SmcRead {
                region: 2,
                offset: 4096,
                len: 65536,
            },
            Msg::SmcWrite {
                region: 2,
                offset: 64,
                data: vec![9; 100],
            },
            Msg::SmcWriteOk,
            Msg::SmcWriteV {
                region: 1,
                ranges: vec![(0, 3), (8192, 2)],
                data: vec![1, 2, 3, 4, 5],
            },
        ] {
            let f = m.frame(42);
            let h = Header::decode(f[..HEADER].try_into().unwrap_or(&[0; HEADER]), 1 << 20)
                .expect("header");
            assert_eq!(
                (h.kind, h.id, h.len as usize),
                (m.kind(), 42, f.len() - HEADER)
            );
            assert_eq!(Msg::decode(h.kind, &f[HEADER..]).expect("decode"), m);
            // Every truncation is an error, never a panic.
            for cut in 0..f.len() - HEADER {
                let _ = Msg::decode(h.kind, &f[HEADER..HEADER + cut]);
            }
        }
        let mut h = Header {
            kind: Kind::ReadOk,
            id: 1,
            len: 1 << 30,
        }
        .encode();
        assert!(matches!(
            Header::decode(&h, 1 << 20),
            Err(ProtoError::TooLong { .. })
        ));
        h[0] = b'X';
        assert!(matches!(
            Header::decode(&h, 1 << 20),
            Err(ProtoError::Magic(_))
        ));
        assert_eq!(Code::from(4), Code::Range);
        // A long message is cut at a character boundary and still decodes.
        let long = Msg::Error {
            code: Code::Io,
            message: "é".repeat(1500),
        };
        let f = long.frame(1);
        match Msg::decode(Kind::Error, &f[HEADER..]) {
            Ok(Msg::Error { message, .. }) => assert_eq!(message, "é".repeat(1024)),
            other => panic!("{other:?}"),
        }
        assert_eq!(u16::from(Code::from(77)), 77);
        assert!(
            constant_time_eq(b"abc", b"abc")
                && !constant_time_eq(b"abc", b"abd")
                && !constant_time_eq(b"abc", b"ab")
        );
    }

    #[tokio::test]
    async fn frame_reader_bounds_and_deadlines() {
        use tokio::io::AsyncWriteExt;
        let short = Duration::from_millis(50);
        // A whole frame.
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let f = Msg::Read {
            file: 1,
            offset: 2,
            len: 3,
        }
        .frame(9);
        a.write_all(&f).await.expect("write");
        let (h, p) = read_frame(&mut b, 0, short, short).await.expect("frame");
        assert_eq!((h.kind, h.id), (Kind::Read, 9));
        assert_eq!(
            Msg::decode(h.kind, &p).expect("decode"),
            Msg::Read {
                file: 1,
                offset: 2,
                len: 3
            }
        );
        // Nothing arrives: a timeout on the header.
        assert!(matches!(
            read_frame(&mut b, 0, short, short).await,
            Err(FrameError::Timeout { what: "header", .. })
        ));
        // A header whose payload never comes: a timeout on the payload.
        a.write_all(&f[..HEADER + 2]).await.expect("write");
        assert!(matches!(
            read_frame(&mut b, 0, short, short).await,
            Err(FrameError::Timeout {
                what: "payload",
                ..
            })
        ));
        // A declared length over the maximum is refused from the header alone.
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let big = Header {
            kind: Kind::ReadOk,
            id: 1,
            len: u32::MAX,
        }
        .encode();
        a.write_all(&big).await.expect("write");
        assert!(matches!(
            read_frame(&mut b, 1 << 20, short, short).await,
            Err(FrameError::Proto(ProtoError::TooLong { .. }))
        ));
        // A quiet connection may wait `wait`; a header once begun must finish within `deadline`.
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        a.write_all(&f[..7]).await.expect("write");
        let t = std::time::Instant::now();
        assert!(matches!(
            read_header_within(&mut b, 0, Duration::from_secs(3600), short).await,
            Err(FrameError::Timeout { what: "header", .. })
        ));
        assert!(t.elapsed() < Duration::from_secs(5));
        // A declared payload is not allocated ahead: what arrived is all there is, and a payload
        // that arrives in pieces is put together.
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        let data: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        let send = tokio::spawn(async move {
            for part in data.chunks(70_000) {
                a.write_all(part).await.expect("write");
                tokio::task::yield_now().await;
            }
            a
        });
        let p = read_payload_vec(&mut b, 300_000, Duration::from_secs(5))
            .await
            .expect("payload");
        assert!(p.len() == 300_000 && p.iter().enumerate().all(|(i, &x)| x == i as u8));
        let mut a = send.await.expect("sender");
        a.write_all(&[1, 2, 3]).await.expect("write");
        assert!(matches!(
            read_payload_vec(&mut b, 16 << 20, short).await,
            Err(FrameError::Timeout {
                what: "payload",
                ..
            })
        ));
        // A payload nobody waits for is drained, and the stream stays in step.
        a.write_all(&[9u8; 5000]).await.expect("write");
        a.write_all(&f).await.expect("write");
        discard_payload(&mut b, 5000, short).await.expect("drain");
        assert_eq!(
            read_frame(&mut b, 0, short, short)
                .await
                .expect("frame")
                .0
                .id,
            9
        );
        // A clean close between frames, and one inside a header.
        let (a, mut b) = tokio::io::duplex(64);
        drop(a);
        assert!(matches!(
            read_header(&mut b, 0, short).await,
            Err(FrameError::Closed)
        ));
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&f[..5]).await.expect("write");
        drop(a);
        assert!(matches!(
            read_header(&mut b, 0, short).await,
            Err(FrameError::Io { what: "header", .. })
        ));
    }
}
