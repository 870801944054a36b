//! A read's payload from the server's page cache to the client's socket with no copy in user space:
//! `sendfile(2)` hands the cached pages to the socket (a NIC sends them by DMA; over loopback the
//! receiver copies them once, straight into its lease). Used for ranges that are resident
//! (`cachestat(2)`); the rest keep the io_uring O_DIRECT path into a staging block. Measured against
//! the alternatives in docs/decisions.md ("Remote reads from the page cache by sendfile").

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::tcp::OwnedWriteHalf;
use ubdirect_ub::Lease;

/// Cleared once `cachestat(2)` failed (a kernel before 6.5): every read then takes the staging path.
static CACHESTAT: AtomicBool = AtomicBool::new(true);
/// Cleared once `sendfile(2)` refused a file (a file system without `splice_read`).
static SENDFILE: AtomicBool = AtomicBool::new(true);

/// Whether `offset..offset + len` of `file` is in the page cache, so that `sendfile` will not wait
/// for the disk. `false` where `cachestat` is missing (recorded once as the fallback
/// `serve_cachestat_unavailable`) and after `sendfile` was found unsupported.
pub(crate) fn resident(file: &File, offset: u64, len: u64) -> bool {
    if !CACHESTAT.load(Ordering::Relaxed) || !SENDFILE.load(Ordering::Relaxed) {
        return false;
    }
    match ubdirect_nvme::page_cache_resident(file, offset, len) {
        Ok(r) => r,
        Err(e) => {
            CACHESTAT.store(false, Ordering::Relaxed);
            ubdirect_ub::fallback::record(
                "serve_cachestat_unavailable",
                format!(
                    "cachestat(2) failed ({e}; Linux >= 6.5 has it): every read goes through a \
                     staging block (O_DIRECT where the file system allows), warm ranges too"
                ),
            );
            false
        }
    }
}

/// Writes `head`, then `len` bytes of `file` at `offset` by `sendfile`, on the connection's socket.
/// `block` is the staging block the reply holds: the bytes go through it only where `sendfile`
/// refuses the file (recorded once as `serve_sendfile_unsupported`). A file that ends before
/// `offset + len` (truncated since it was opened) is an error: the connection must be closed, the
/// frame cannot be finished. No deadline here: the caller bounds the whole reply.
pub(crate) async fn send_file(
    wr: &mut OwnedWriteHalf,
    head: &[u8],
    file: &File,
    offset: u64,
    len: usize,
    block: &mut Lease,
) -> std::io::Result<()> {
    // The header waits for the payload (MSG_MORE): one segment, not a 16-byte one first.
    let mut sent = 0;
    while sent < head.len() {
        let sock = wr.as_ref();
        sock.writable().await?;
        match sock.try_io(Interest::WRITABLE, || {
            socket2::SockRef::from(sock).send_with_flags(&head[sent..], libc::MSG_MORE)
        }) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let end = offset + len as u64;
    let mut at = offset as libc::off64_t;
    while (at as u64) < end {
        let sock = wr.as_ref();
        sock.writable().await?;
        let want = (end - at as u64) as usize;
        let r = sock.try_io(Interest::WRITABLE, || {
            nix::sys::sendfile::sendfile64(sock.as_fd(), file.as_fd(), Some(&mut at), want)
                .map_err(std::io::Error::from)
        });
        match r {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the file ends before {end} (truncated while being served)"),
                ));
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if at as u64 == offset
                    && matches!(
                        e.raw_os_error(),
                        Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)
                    ) =>
            {
                SENDFILE.store(false, Ordering::Relaxed);
                ubdirect_ub::fallback::record(
                    "serve_sendfile_unsupported",
                    format!(
                        "sendfile(2) refused a file ({e}): reads are copied through staging blocks"
                    ),
                );
                return copy_through(wr, file, offset, len, block).await;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The payload through the reply's staging block: `pread` (the range is resident: a memory copy)
/// and a write.
async fn copy_through(
    wr: &mut OwnedWriteHalf,
    file: &File,
    offset: u64,
    len: usize,
    block: &mut Lease,
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let b = block
        .as_mut_slice()
        .map_err(std::io::Error::other)?
        .get_mut(..len)
        .ok_or_else(|| std::io::Error::other("staging block smaller than the read"))?;
    file.read_exact_at(b, offset)?;
    wr.write_all(b).await
}
