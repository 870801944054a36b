//! The io_uring file path as a [`Source`]: `READ_FIXED` on a registered file, O_DIRECT where the file
//! system supports it, page cache otherwise.

use std::sync::Arc;
use std::time::Duration;

use ubdirect_ub::{
    Lease, ReadDone, ReadFuture, ReadPath, Registrar, Source, SourceError, SourceErrorKind,
};

use crate::{Engine, FileHandle, IoError};

/// A shard read by the engine.
///
/// With `direct = "auto"` on a file system that does direct I/O, the source is page-cache aware: it
/// holds a second, buffered handle, asks `cachestat(2)` once per read (a read is a merged block of
/// ≥ 256 KiB, never a sample) whether the whole range is resident, and reads it through the page
/// cache if so, with O_DIRECT otherwise. Warm data is copied from memory by io_uring's workers; cold
/// data streams from the device without polluting the cache. (io_uring's `RWF_NOWAIT` would avoid the
/// syscall, but on Linux 6.18 a buffered `READ_FIXED` with it waits for the readahead it starts
/// instead of failing with `EAGAIN` as `preadv2` does: docs/decisions.md.)
#[derive(Clone)]
pub struct FileSource {
    engine: Engine,
    file: FileHandle,
    /// Buffered handle for page-cache-first reads (`direct = "auto"` on an O_DIRECT file).
    cached: Option<FileHandle>,
    /// Cleared when `cachestat` is not available (then every read goes O_DIRECT, a fallback).
    cachestat: Arc<std::sync::atomic::AtomicBool>,
    /// Read through the page cache even what is not resident, so the file becomes resident (the
    /// loader sets it for shards that fit its page-cache budget).
    populate: Arc<std::sync::atomic::AtomicBool>,
    shard: String,
    size: u64,
}

impl std::fmt::Debug for FileSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileSource")
            .field("shard", &self.shard)
            .field("size", &self.size)
            .field("direct", &self.file.is_direct())
            .finish()
    }
}

impl FileSource {
    /// Opens `path` on `engine` (registered with every ring; O_DIRECT per the engine's policy).
    pub fn open(engine: &Engine, path: impl AsRef<std::path::Path>) -> Result<Self, IoError> {
        let file = engine.open(path.as_ref())?;
        let mut s = Self::from_handle(engine, file);
        if engine.config().direct == crate::DirectMode::Auto && s.file.is_direct() {
            s.cached = Some(engine.open_buffered(path.as_ref())?);
        }
        Ok(s)
    }

    /// A source over a file already open on `engine`.
    pub fn from_handle(engine: &Engine, file: FileHandle) -> Self {
        Self {
            engine: engine.clone(),
            shard: file.path().display().to_string(),
            size: file.size().unwrap_or(0),
            file,
            cached: None,
            cachestat: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            populate: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }

    /// The engine's handle of the file.
    pub fn handle(&self) -> &FileHandle {
        &self.file
    }
}

/// The kind of an engine error, for callers that branch.
pub fn kind_of(e: &IoError) -> SourceErrorKind {
    match e {
        IoError::PastEof { .. } => SourceErrorKind::OutOfRange,
        IoError::UnexpectedEof { .. } => SourceErrorKind::Changed,
        IoError::NotHostVisible { .. }
        | IoError::BufferTooSmall { .. }
        | IoError::Misaligned { .. } => SourceErrorKind::Lease,
        IoError::Timeout { .. } => SourceErrorKind::Timeout,
        IoError::Closed => SourceErrorKind::Closed,
        IoError::Open { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            SourceErrorKind::NotFound
        }
        _ => SourceErrorKind::Io,
    }
}

impl FileSource {
    /// Reads through the page cache from now on (also what is not resident), so that the file
    /// becomes resident; `false` returns to page-cache-aware reads. Only for `direct = "auto"`.
    pub fn set_populate(&self, on: bool) {
        self.populate
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Asks the kernel to start reading the file into the page cache (`POSIX_FADV_WILLNEED` over the
    /// whole file). Linux reads only the head: max(`read_ahead_kb`, `max_sectors_kb`) per call
    /// (`force_page_cache_ra`), with small pages. That head (a format's header) is what the plan's
    /// reads may not cover; the reads themselves fill the rest (docs/decisions.md, "Filling ahead").
    pub fn prefetch(&self) -> Result<(), IoError> {
        let fd = match &self.cached {
            Some(c) => c.fd(),
            None => self.file.fd(),
        };
        crate::sys::will_need(fd).map_err(|source| IoError::Read {
            path: self.file.path().to_path_buf(),
            offset: 0,
            len: self.size as usize,
            source,
        })
    }

    /// Whether reads of the file would go to the device with O_DIRECT now: a file opened for
    /// direct I/O that is not being filled into the page cache and is not all resident.
    pub fn reads_cold_direct(&self) -> bool {
        self.file.is_direct()
            && (self.cached.is_none()
                || (!self.populate.load(std::sync::atomic::Ordering::Relaxed)
                    && !self.fully_resident()))
    }

    /// Whether the whole file is in the page cache now (`cachestat`; `false` where it is missing).
    pub fn fully_resident(&self) -> bool {
        let fd = match &self.cached {
            Some(c) => c.fd(),
            None => self.file.fd(),
        };
        self.size > 0 && crate::sys::all_cached(fd, 0, self.size).unwrap_or(false)
    }

    /// Whether every page of the range is in the page cache (`cachestat`).
    fn resident(&self, cached: &FileHandle, offset: u64, len: usize) -> bool {
        use std::sync::atomic::Ordering;
        if self.populate.load(Ordering::Relaxed) {
            return true;
        }
        if !self.cachestat.load(Ordering::Relaxed) {
            return false;
        }
        match crate::sys::all_cached(cached.fd(), offset, len as u64) {
            Ok(all) => all,
            Err(e) => {
                self.cachestat.store(false, Ordering::Relaxed);
                ubdirect_ub::fallback::record(
                    "cachestat_unavailable",
                    format!(
                        "{}: cachestat(2) failed ({e}; {}): direct = \"auto\" reads everything with O_DIRECT, warm data too",
                        self.shard,
                        cachestat_cause(&e)
                    ),
                );
                false
            }
        }
    }
}

/// Why `cachestat(2)` failed, in words: the kernel refuses it (EPERM) on a file this process opened
/// read-only and neither owns nor may write — the normal case for a shared dataset — and lacks it
/// (ENOSYS) before Linux 6.5.
fn cachestat_cause(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EPERM) => {
            "the kernel allows it only on files this user owns or may write, and this dataset's files are another user's (shared datasets are); run as their owner, or set engine.direct = \"off\" to read warm data through the page cache"
        }
        Some(libc::ENOSYS) => "this kernel lacks it: Linux ≥ 6.5 has it",
        _ => "Linux ≥ 6.5 has it",
    }
}

impl Source for FileSource {
    fn shard(&self) -> &str {
        &self.shard
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn describe(&self) -> String {
        if self.cached.is_some() && self.engine.thread_copies() {
            "io_uring READ_FIXED, registered files: resident ranges through the page cache (cachestat per read), copied into the block by the copy threads; the rest O_DIRECT".into()
        } else if self.cached.is_some() {
            "io_uring READ_FIXED, registered files: resident ranges through the page cache, the rest O_DIRECT (cachestat per read)".into()
        } else if self.engine.thread_copies() && !self.file.is_direct() {
            "page cache, copied by the copy threads (pread into registered blocks)".into()
        } else {
            self.file.io_path().to_string()
        }
    }

    fn slack(&self) -> usize {
        if self.file.is_direct() {
            self.file.offset_align() as usize
        } else {
            0
        }
    }

    fn registrars(&self) -> Vec<Arc<dyn Registrar>> {
        vec![self.engine.registrar()]
    }

    fn read(
        &self,
        offset: u64,
        len: usize,
        lease: Lease,
        lease_offset: usize,
        deadline: Duration,
    ) -> ReadFuture<'_> {
        Box::pin(async move {
            // Resident ranges through the buffered handle, the rest through the main one: the
            // engine's `direct` flag then says which path the bytes took.
            let file = match &self.cached {
                Some(cached) if self.resident(cached, offset, len) => cached,
                _ => &self.file,
            };
            // Warm ranges on the copy threads (one `pread` each, many at once), the rest on the
            // rings.
            let (r, lease) = if !file.is_direct() && self.engine.thread_copies() {
                self.engine
                    .copy_read(file, offset, len, lease, lease_offset, deadline)
                    .await
            } else {
                self.engine
                    .read_within(file, offset, len, lease, lease_offset, deadline)
                    .await
            };
            let r = r
                .map(|d| ReadDone {
                    data: d.data,
                    bytes_read: d.bytes_read,
                    path: if d.direct {
                        ReadPath::Direct
                    } else {
                        ReadPath::Buffered
                    },
                })
                .map_err(|e| {
                    SourceError::new(kind_of(&e), &self.shard, offset, len).with_source(e)
                });
            (r, lease)
        })
    }
}

#[cfg(test)]
mod tests {
    /// Issue 45: a shared dataset's files are another user's, and cachestat's EPERM said "Linux ≥ 6.5
    /// has it" on a 6.18 kernel. The cause is ownership; the message says so and what to do.
    #[test]
    fn cachestats_refusal_names_ownership_not_the_kernel_version() {
        let eperm = std::io::Error::from_raw_os_error(libc::EPERM);
        let why = super::cachestat_cause(&eperm);
        assert!(
            why.contains("another user's") && why.contains("engine.direct"),
            "{why}"
        );
        assert!(!why.contains("6.5"), "{why}");
        let enosys = std::io::Error::from_raw_os_error(libc::ENOSYS);
        assert!(super::cachestat_cause(&enosys).contains("6.5"));
    }
}
