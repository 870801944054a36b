//! SMC on the server: a registered region's reads and writes, checked against the connection's
//! registrations and the token's rights; writes received from the socket straight into a host
//! region's memory; replies written at once by the connection loop (no hop through its writer), and
//! the short poll for the next request after a read (faults come in bursts).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedReadHalf;

use super::Shared;
use super::limits::{POLL_BUDGET, Polling, refuse};
use super::regions::{HostBytes, RegionMem};
use super::reply::Reply;
use crate::proto::{self, Code, FrameError, Header, Kind, Msg, WriteHead};

/// Checks an SMC access: region registered on this connection, in bounds, within max_request, and
/// writable when writing. Returns the region's index.
pub(super) fn smc_range(
    s: &Shared,
    opened: &[(usize, bool)],
    region: u32,
    offset: u64,
    len: u64,
    write: bool,
) -> Result<usize, Reply> {
    let Some(&(i, writable)) = opened.get(region as usize) else {
        return Err(Reply(
            Code::BadFile,
            format!("region {region} was not registered on this connection"),
        ));
    };
    let r = &s.regions[i].cfg;
    if write && !writable {
        return Err(Reply(
            Code::Forbidden,
            format!("region {:?} is read-only for this token", r.name),
        ));
    }
    if len > s.cfg.max_request as u64 {
        return Err(Reply(
            Code::TooLarge,
            format!("{len} bytes exceed max_request {}", s.cfg.max_request),
        ));
    }
    if offset.checked_add(len).is_none_or(|e| e > r.size) {
        return Err(Reply(
            Code::Range,
            format!(
                "region {:?}: {offset}+{len} is past its end ({} bytes)",
                r.name, r.size
            ),
        ));
    }
    Ok(i)
}

/// Polls the connection's socket (`MSG_PEEK`, nonblocking) for up to `smc_poll` for the next
/// request, so that a burst of faults is served without a runtime wake-up between them. At most a
/// quarter of the workers poll at once (the rest go straight back to the runtime); returns as soon as
/// bytes (or the end of the stream) are there.
pub(super) fn poll_next(s: &Shared, rd: &tokio::net::tcp::OwnedReadHalf) {
    let Some(_poll) = Polling::start(s) else {
        return;
    };
    let sock = socket2::SockRef::from(rd.as_ref());
    let until = Instant::now() + s.cfg.smc_poll;
    let mut b = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    while Instant::now() < until {
        match sock.peek(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            _ => break,
        }
    }
}

/// Serves one SMC read or write on a region registered on this connection; returns the reply frame.
pub(super) async fn smc_request(
    s: &Arc<Shared>,
    peer: &str,
    opened: &[(usize, bool)],
    m: Msg,
    id: u64,
) -> Vec<u8> {
    let (region, ranges, data, read) = match m {
        Msg::SmcRead {
            region,
            offset,
            len,
        } => (region, vec![(offset, len)], Vec::new(), true),
        Msg::SmcWrite {
            region,
            offset,
            data,
        } => (region, vec![(offset, data.len() as u32)], data, false),
        Msg::SmcWriteV {
            region,
            ranges,
            data,
        } => (region, ranges, data, false),
        other => {
            return Reply(
                Code::Protocol,
                format!("not an SMC request: {:?}", other.kind()),
            )
            .frame(id);
        }
    };
    let i = match smc_check(s, peer, opened, region, &ranges, read, id) {
        Ok(Some(i)) => i,
        // No ranges: still only on a region registered here, and writable by this token.
        Ok(None) => return Msg::SmcWriteOk.frame(id),
        Err(refused) => return refused,
    };
    match &s.regions[i].mem {
        // Copies on the region's own stream, polled here: no thread hop.
        RegionMem::Gpu(g) => gpu_request(s, g, id, &ranges, &data, read).await,
        RegionMem::Host { bytes, .. } if read => host_read(s, bytes, id, ranges[0]),
        // A host region: a memcpy, inline.
        RegionMem::Host { .. } => host_write(s, &s.regions[i].mem, id, &ranges, &data),
    }
}

/// Checks every range of an SMC request with [`smc_range`] (a request without ranges: the region
/// and the right to write). The region's index (`None` without ranges), or the refusal's frame.
fn smc_check(
    s: &Shared,
    peer: &str,
    opened: &[(usize, bool)],
    region: u32,
    ranges: &[(u64, u32)],
    read: bool,
    id: u64,
) -> Result<Option<usize>, Vec<u8>> {
    let refused = |r: Reply| {
        refuse(s, peer, &r.1);
        r.frame(id)
    };
    let mut ix = None;
    for &(o, l) in ranges {
        ix = Some(smc_range(s, opened, region, o, l as u64, !read).map_err(refused)?);
    }
    if ix.is_none() {
        smc_range(s, opened, region, 0, 0, !read).map_err(refused)?;
    }
    Ok(ix)
}

/// A read of a host region: the reply frame in one buffer, the bytes copied once (under the read
/// lock).
fn host_read(
    s: &Shared,
    bytes: &std::sync::RwLock<HostBytes>,
    id: u64,
    (o, l): (u64, u32),
) -> Vec<u8> {
    let m = bytes.read().unwrap_or_else(|p| p.into_inner());
    match m.get(o as usize..o as usize + l as usize) {
        Ok(b) => {
            let mut f = Vec::with_capacity(proto::HEADER + b.len());
            f.extend_from_slice(&proto::data_header(id, l));
            f.extend_from_slice(b);
            s.stats.smc_reads.fetch_add(1, Ordering::Relaxed);
            f
        }
        Err(e) => Reply(Code::Io, e).frame(id),
    }
}

/// A write of a host region whose data arrived in a frame buffer (the general path): one copy per
/// range.
fn host_write(s: &Shared, mem: &RegionMem, id: u64, ranges: &[(u64, u32)], data: &[u8]) -> Vec<u8> {
    let mut at = 0usize;
    for &(o, l) in ranges {
        if let Err(e) = mem.write(o, &data[at..at + l as usize]) {
            return Reply(Code::Io, e).frame(id);
        }
        at += l as usize;
    }
    s.stats.smc_writes.fetch_add(1, Ordering::Relaxed);
    s.stats
        .smc_bytes_written
        .fetch_add(data.len() as u64, Ordering::Relaxed);
    Msg::SmcWriteOk.frame(id)
}

/// A read or write of a GPU region: copies on the region's own stream, polled here.
async fn gpu_request(
    s: &Shared,
    g: &crate::gpu_region::GpuRegion,
    id: u64,
    ranges: &[(u64, u32)],
    data: &[u8],
    read: bool,
) -> Vec<u8> {
    let t = s.cfg.io_timeout;
    if read {
        let (o, l) = ranges[0];
        let mut f = proto::data_header(id, l).to_vec();
        f.reserve(l as usize);
        return match g.read_into(o, l as usize, &mut f, t).await {
            Ok(()) => {
                s.stats.smc_reads.fetch_add(1, Ordering::Relaxed);
                f
            }
            Err(e) => Reply(Code::Io, e).frame(id),
        };
    }
    match g.write(ranges, data, t).await {
        Ok(()) => {
            s.stats.smc_writes.fetch_add(1, Ordering::Relaxed);
            s.stats
                .smc_bytes_written
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            Msg::SmcWriteOk.frame(id)
        }
        Err(e) => Reply(Code::Io, e).frame(id),
    }
}

/// Receives a payload of `len` bytes straight into `mem[at..at + len]` within `until`: each
/// nonblocking receive holds the region's write lock, never a wait for the socket.
async fn recv_into(
    s: &Shared,
    rd: &mut OwnedReadHalf,
    mem: &std::sync::RwLock<HostBytes>,
    at: usize,
    len: usize,
    until: tokio::time::Instant,
) -> std::io::Result<()> {
    let mut done = 0;
    // While bytes keep coming, read them straight off the socket (a nonblocking `read` outside the
    // runtime's readiness) and poll up to `smc_poll` when it is momentarily empty: a 4 MiB barrier
    // arrives in many segments, and going back to the runtime between them costs a wake-up each.
    // Past the poll (or with polling off / capped), the runtime's readiness takes over.
    let mut poll = Polling::start(s);
    let mut quiet_since: Option<Instant> = None;
    let (mut spent, mut last) = (Duration::ZERO, Instant::now());
    while done < len {
        let direct = poll.is_some();
        let r = {
            let mut g = mem.write().unwrap_or_else(|p| p.into_inner());
            match g.get_mut(at + done..at + len) {
                Ok(dst) if direct => {
                    use std::io::Read;
                    (&*socket2::SockRef::from(rd.as_ref())).read(dst)
                }
                Ok(dst) => rd.try_read(dst),
                Err(e) => Err(std::io::Error::other(e)),
            }
        };
        match r {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => {
                done += k;
                quiet_since = None;
                last = Instant::now();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && direct => {
                let now = Instant::now();
                let q = *quiet_since.get_or_insert(now);
                // One quiet gap of at most smc_poll, and at most POLL_BUDGET of them in all (a
                // client trickling bytes gets the runtime, not a spinning worker).
                spent += now.saturating_duration_since(last);
                last = now;
                if now - q >= s.cfg.smc_poll || spent >= POLL_BUDGET {
                    poll = None;
                } else {
                    std::hint::spin_loop();
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                match tokio::time::timeout_at(until, rd.readable()).await {
                    Err(_) => {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "smc write payload: no bytes within the deadline",
                        ));
                    }
                    Ok(r) => r?,
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads and drops `len` payload bytes within `deadline` (a refused write: the stream stays in step).
async fn drain(rd: &mut OwnedReadHalf, len: usize, deadline: Duration) -> std::io::Result<()> {
    proto::discard_payload(rd, len as u32, deadline)
        .await
        .map_err(std::io::Error::other)
}

/// Writes an SMC reply at once (no hop through the writer task on a fault's path): the lock and
/// the write within io_timeout together; a client that does not take it is an error.
pub(super) async fn smc_reply(
    s: &Shared,
    wr: &tokio::sync::Mutex<tokio::net::tcp::OwnedWriteHalf>,
    f: &[u8],
) -> std::io::Result<()> {
    let sent = async { wr.lock().await.write_all(f).await };
    let sent = tokio::time::timeout(s.cfg.io_timeout, sent)
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "reply not taken by the client in time",
            ))
        });
    if let Err(e) = &sent
        && e.kind() == std::io::ErrorKind::TimedOut
    {
        s.stats.write_timeouts.fetch_add(1, Ordering::Relaxed);
    }
    sent
}

/// Serves an `SmcWrite` / `SmcWriteV` whose header `h` was read: its fixed fields and range table
/// are read and checked, then the data goes from the socket straight into the host region's memory
/// (a GPU region, or a region not registered here, takes the general path). Returns the reply frame
/// and whether the connection goes on (a malformed frame ends it).
pub(super) async fn smc_receive(
    s: &Arc<Shared>,
    peer: &str,
    opened: &[(usize, bool)],
    rd: &mut OwnedReadHalf,
    h: Header,
) -> std::io::Result<(Vec<u8>, bool)> {
    let deadline = s.cfg.io_timeout;
    let until = tokio::time::Instant::now() + deadline;
    let malformed = |s: &Shared, why: String| {
        refuse(s, peer, &format!("malformed frame: {why}"));
        (Reply(Code::Protocol, why).frame(h.id), false)
    };
    let (region, ranges, data) = match write_table(rd, &h, deadline).await? {
        Ok(t) => t,
        Err(why) => return Ok(malformed(s, why)),
    };
    let mem = opened
        .get(region as usize)
        .and_then(|&(i, _)| s.regions.get(i))
        .map(|r| &r.mem);
    let Some(mem) = mem else {
        // The general path (it refuses unregistered regions).
        return general_write(s, peer, opened, rd, &h, region, ranges, data).await;
    };
    if let Err(r) = check_write_ranges(s, peer, opened, region, &ranges) {
        drain(rd, data, deadline).await?;
        return Ok((r.frame(h.id), true));
    }
    match mem {
        RegionMem::Host { bytes, .. } => {
            for &(o, l) in &ranges {
                recv_into(s, rd, bytes, o as usize, l as usize, until).await?;
            }
        }
        // Into a registered staging block straight from the socket, then one batch of copies.
        RegionMem::Gpu(g) => {
            if let Err(e) = g.receive(rd, &ranges, data, deadline).await? {
                return Ok((Reply(Code::Io, e).frame(h.id), true));
            }
        }
    }
    s.stats.smc_writes.fetch_add(1, Ordering::Relaxed);
    s.stats
        .smc_bytes_written
        .fetch_add(data as u64, Ordering::Relaxed);
    Ok((Msg::SmcWriteOk.frame(h.id), true))
}

/// Reads a write's fixed fields and range table: its region, ranges and the bytes of data that
/// follow, or why the frame is malformed (its payload then drained).
async fn write_table(
    rd: &mut OwnedReadHalf,
    h: &Header,
    deadline: Duration,
) -> std::io::Result<Result<(u32, Vec<(u64, u32)>, usize), String>> {
    let io = |e: FrameError| std::io::Error::other(e);
    let len = h.len as usize;
    let fixed = WriteHead::fixed_len(h.kind).unwrap_or(12);
    if len < fixed {
        drain(rd, len, deadline).await?;
        return Ok(Err(format!("{:?} of {len} bytes", h.kind)));
    }
    let mut head = [0u8; 12];
    proto::read_payload(rd, &mut head[..fixed], deadline)
        .await
        .map_err(io)?;
    let head = WriteHead::decode(h.kind, &head[..fixed]).map_err(|e| io(e.into()))?;
    let region = head.region();
    let mut table_len = 0;
    let ranges: Vec<(u64, u32)> = match head {
        WriteHead::Vectored { count, .. } => {
            let count = count as usize;
            if count.saturating_mul(12) > len - fixed {
                drain(rd, len - fixed, deadline).await?;
                return Ok(Err(format!("{count} ranges in {len} bytes")));
            }
            table_len = count * 12;
            // Read in pieces, the ranges growing as their bytes arrive: a header that declares a large
            // table and stalls pins one piece, not the table (28 bytes used to cost 12 MiB with
            // max_request = 16 MiB).
            proto::read_write_ranges(rd, count, deadline)
                .await
                .map_err(io)?
        }
        WriteHead::One { offset, .. } => vec![(offset, (len - fixed) as u32)],
    };
    let data = len - fixed - table_len;
    if ranges.iter().map(|r| r.1 as u64).sum::<u64>() != data as u64 {
        drain(rd, data, deadline).await?;
        return Ok(Err("range lengths differ from the data".into()));
    }
    Ok(Ok((region, ranges, data)))
}

/// A write to a region not in this connection's registered memory: its `data` bytes read whole
/// and served as a request (which refuses unregistered regions).
#[allow(clippy::too_many_arguments)]
async fn general_write(
    s: &Arc<Shared>,
    peer: &str,
    opened: &[(usize, bool)],
    rd: &mut OwnedReadHalf,
    h: &Header,
    region: u32,
    ranges: Vec<(u64, u32)>,
    data: usize,
) -> std::io::Result<(Vec<u8>, bool)> {
    let payload = proto::read_payload_vec(rd, data as u32, s.cfg.io_timeout)
        .await
        .map_err(|e: FrameError| std::io::Error::other(e))?;
    let m = if h.kind == Kind::SmcWriteV {
        Msg::SmcWriteV {
            region,
            ranges,
            data: payload,
        }
    } else {
        Msg::SmcWrite {
            region,
            offset: ranges[0].0,
            data: payload,
        }
    };
    Ok((smc_request(s, peer, opened, m, h.id).await, true))
}

/// Checks every range of a write against the region and the token's right to write; a refusal is
/// counted.
fn check_write_ranges(
    s: &Shared,
    peer: &str,
    opened: &[(usize, bool)],
    region: u32,
    ranges: &[(u64, u32)],
) -> Result<(), Reply> {
    // An empty write still checks the region and the token's right to write.
    let checks = if ranges.is_empty() {
        &[(0, 0)][..]
    } else {
        ranges
    };
    for &(o, l) in checks {
        if let Err(r) = smc_range(s, opened, region, o, l as u64, true) {
            refuse(s, peer, &r.1);
            return Err(r);
        }
    }
    Ok(())
}
