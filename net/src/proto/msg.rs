//! Messages: every control frame as a value, encoded into and decoded from byte buffers.

use super::{Kind, MAX_MESSAGE, ProtoError, RemoteWindow};

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
            // Frames whose bulk may travel apart: their heads, then the bytes.
            Msg::SmcRead {
                region,
                offset,
                len,
            } => return smc_read_frame(id, *region, *offset, *len),
            Msg::SmcWrite {
                region,
                offset,
                data,
            } => {
                let mut f = smc_write_head(id, *region, *offset, data.len());
                f.extend_from_slice(data);
                return f;
            }
            Msg::SmcWriteV {
                region,
                ranges,
                data,
            } => {
                let mut f = smc_writev_head(id, *region, ranges.iter().copied());
                f.extend_from_slice(data);
                return f;
            }
        }
        super::head(self.kind(), id, &p, 0)
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
                window: decode_window(&mut r)?,
            },
            Kind::SmcRead => Msg::SmcRead {
                region: r.u32("region")?,
                offset: r.u64("offset")?,
                len: r.u32("len")?,
            },
            Kind::SmcWriteV => decode_writev(&mut r)?,
            Kind::SmcWrite => decode_write(&mut r)?,
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

/// The optional window at the end of an `SmcOpenOk` (none when no bytes are left).
fn decode_window(r: &mut Rd<'_>) -> Result<Option<RemoteWindow>, ProtoError> {
    Ok(if r.0.is_empty() {
        None
    } else {
        Some(RemoteWindow {
            addr: r.u64("window addr")?,
            rkey: r.u32("window rkey")?,
        })
    })
}

/// An `SmcWriteV` payload: region, range table, and data exactly as long as the ranges say.
fn decode_writev(r: &mut Rd<'_>) -> Result<Msg, ProtoError> {
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
    Ok(Msg::SmcWriteV {
        region,
        ranges,
        data,
    })
}

/// An `SmcWrite` payload: region, offset, and the rest as data.
fn decode_write(r: &mut Rd<'_>) -> Result<Msg, ProtoError> {
    let region = r.u32("region")?;
    let offset = r.u64("offset")?;
    let data = std::mem::take(&mut r.0).to_vec();
    Ok(Msg::SmcWrite {
        region,
        offset,
        data,
    })
}

/// A whole `SmcRead` frame: `len` bytes of region `region` at `offset`.
pub fn smc_read_frame(id: u64, region: u32, offset: u64, len: u32) -> Vec<u8> {
    let mut f = [0u8; 16];
    f[..4].copy_from_slice(&region.to_le_bytes());
    f[4..12].copy_from_slice(&offset.to_le_bytes());
    f[12..].copy_from_slice(&len.to_le_bytes());
    super::head(Kind::SmcRead, id, &f, 0)
}

/// The head of an `SmcWrite` frame (header, region, offset) whose `data_len` bytes of data follow
/// from the sender's buffer: head + data is [`Msg::SmcWrite`]'s frame.
pub fn smc_write_head(id: u64, region: u32, offset: u64, data_len: usize) -> Vec<u8> {
    let mut f = [0u8; 12];
    f[..4].copy_from_slice(&region.to_le_bytes());
    f[4..].copy_from_slice(&offset.to_le_bytes());
    super::head(Kind::SmcWrite, id, &f, data_len)
}

/// The head of an `SmcWriteV` frame (header, region, range count, range table) whose data — the
/// ranges' bytes back to back — follows from the sender's memory: head + data is
/// [`Msg::SmcWriteV`]'s frame.
pub fn smc_writev_head(
    id: u64,
    region: u32,
    ranges: impl IntoIterator<Item = (u64, u32)>,
) -> Vec<u8> {
    let mut f = Vec::with_capacity(8 + 12 * 16);
    f.extend_from_slice(&region.to_le_bytes());
    f.extend_from_slice(&[0; 4]);
    let (mut count, mut data) = (0u32, 0usize);
    for (o, l) in ranges {
        f.extend_from_slice(&o.to_le_bytes());
        f.extend_from_slice(&l.to_le_bytes());
        count += 1;
        data += l as usize;
    }
    f[4..8].copy_from_slice(&count.to_le_bytes());
    super::head(Kind::SmcWriteV, id, &f, data)
}

/// The fixed fields at the start of an `SmcWrite` / `SmcWriteV` payload, read before its data (a
/// server receives the data straight into a region's memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteHead {
    /// `SmcWrite`: region and offset (12 bytes); the data is the rest of the payload.
    One { region: u32, offset: u64 },
    /// `SmcWriteV`: region and range count (8 bytes); `count` ranges of 12 bytes follow
    /// ([`super::read_write_ranges`]), then the data.
    Vectored { region: u32, count: u32 },
}

impl WriteHead {
    /// Bytes of the fixed fields of a write of `kind` (`None`: not a write).
    pub fn fixed_len(kind: Kind) -> Option<usize> {
        match kind {
            Kind::SmcWrite => Some(12),
            Kind::SmcWriteV => Some(8),
            _ => None,
        }
    }

    /// Decodes the fixed fields of a write of `kind` from `b` (at least [`WriteHead::fixed_len`]
    /// bytes).
    pub fn decode(kind: Kind, b: &[u8]) -> Result<Self, ProtoError> {
        let mut r = Rd(b);
        match kind {
            Kind::SmcWrite => Ok(WriteHead::One {
                region: r.u32("region")?,
                offset: r.u64("offset")?,
            }),
            Kind::SmcWriteV => Ok(WriteHead::Vectored {
                region: r.u32("region")?,
                count: r.u32("range count")?,
            }),
            k => Err(ProtoError::Kind(k as u16)),
        }
    }

    /// The region written.
    pub fn region(&self) -> u32 {
        match *self {
            WriteHead::One { region, .. } | WriteHead::Vectored { region, .. } => region,
        }
    }
}
