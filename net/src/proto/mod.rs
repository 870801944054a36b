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
//!
//! The codec is sans-IO ([`Header`], [`Msg`], and the heads of frames whose bulk travels apart:
//! [`smc_write_head`], [`smc_writev_head`], [`WriteHead`]): it turns values into bytes and bytes
//! into values, on buffers, and never touches a socket. The server, the async client and the SMC
//! links all frame through it; [`read_frame`] and its kin (`io`) are the async readers over it.

mod io;
mod msg;
#[cfg(test)]
mod tests;

pub use io::{
    FrameError, IDLE, discard_payload, read_frame, read_header, read_header_within, read_payload,
    read_payload_vec, read_write_ranges,
};
pub use msg::{Code, Msg, QpEndpoint, WriteHead, smc_read_frame, smc_write_head, smc_writev_head};

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

/// A frame's head: the header, declaring `fixed.len() + bulk` payload bytes, then `fixed` (the
/// frame's fixed fields); the `bulk` bytes follow from wherever they are (a lease, a mapping).
fn head(kind: Kind, id: u64, fixed: &[u8], bulk: usize) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER + fixed.len());
    h.extend_from_slice(
        &Header {
            kind,
            id,
            len: (fixed.len() + bulk) as u32,
        }
        .encode(),
    );
    h.extend_from_slice(fixed);
    h
}

/// An `SmcWriteV` range table — 12 bytes a range: `u64` offset, `u32` length — as `(offset, len)`
/// (a trailing partial range is ignored: callers pass whole tables).
pub fn decode_ranges(table: &[u8]) -> impl Iterator<Item = (u64, u32)> + '_ {
    table.chunks_exact(12).map(|c| {
        let mut o = [0u8; 8];
        o.copy_from_slice(&c[..8]);
        (
            u64::from_le_bytes(o),
            u32::from_le_bytes([c[8], c[9], c[10], c[11]]),
        )
    })
}

/// Compares two byte strings in time independent of where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | ((a.len() ^ b.len()) >> 8) as u8;
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xFF);
    }
    diff == 0
}
