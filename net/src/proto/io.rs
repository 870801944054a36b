//! The async side of the codec: frames read from a tokio stream with deadlines, memory that grows
//! as bytes arrive (never what a header declared), each header checked by [`Header::decode`].

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

use super::{HEADER, Header, ProtoError, decode_ranges};

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
    pub(crate) fn io(what: &'static str, e: std::io::Error) -> Self {
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
/// [`MAX_CONTROL`](super::MAX_CONTROL). An end of stream before the first byte is [`FrameError::Closed`]; one inside the
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
        ranges.extend(decode_ranges(&piece[..n]));
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
/// `max_data` (data frames) or [`MAX_CONTROL`](super::MAX_CONTROL) before anything is allocated, and the payload's
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
