//! Locks in the shared cache directory: `flock` on regular files, opened without following links
//! or waiting on FIFOs.

use super::*;

/// A file of the shared cache directory opened for writing, created if missing: a regular file
/// only, checked on the descriptor (`O_NONBLOCK`: a FIFO in its place is not waited on;
/// `O_NOFOLLOW`: a link does not send the writes, or the lock, elsewhere).
pub(super) fn open_shared(p: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(p)?;
    if f.metadata()?.is_file() {
        Ok(f)
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ))
    }
}

/// `flock(fd, op)`; `Ok(false)` when a non-blocking lock is held elsewhere.
pub(super) fn flock(f: &File, op: libc::c_int) -> std::io::Result<bool> {
    // SAFETY: flock on a descriptor this `File` owns for the call's duration; no memory is passed.
    let r = unsafe { libc::flock(f.as_raw_fd(), op) };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}
