//! The local chunk cache of object-store data.
//!
//! An object is cached in chunks: aligned ranges of `cache.chunk_size` bytes, each fetched once and
//! written whole (`{key}-{index}.chunk`, a temporary file renamed into place after its checksum
//! sidecar `{key}-{index}.crc`: a partial write is never served). A chunk is checked by size and, the
//! first time this process reads it, by its CRC-32 against the sidecar. Reads of cached chunks go
//! through the io_uring [`FileSource`] like any local shard (O_DIRECT where the file system has it).
//!
//! Processes sharing the directory fetch a chunk once: the fetcher holds an `flock` on the chunk's
//! `.lock` file; the others wait on it and then find the chunk in place. Space is reserved under a
//! directory-wide `flock`: least recently used chunks (by their sidecar's mtime, refreshed on use) are evicted until
//! the new chunk fits in `cache.max_bytes`; a chunk that cannot fit is read straight from the store
//! (counted as bypassed), so the bound is never exceeded.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use ubdirect_nvme::{Engine, FileSource};
use ubdirect_ub::{
    Lease, PlannedReads, ReadDone, Source, SourceError, SourceErrorKind, SourceResult,
};

use super::plan::{NextUse, Schedule};
use super::source::ObjectSource;
use super::{STATS, add};

/// Open chunk files kept per process, at most: enough for the chunks an epoch cycles through (a
/// shuffled epoch of 512 chunks through 32 open files reopened ~95 % of its reads), within an eighth
/// of `RLIMIT_NOFILE` (two descriptors a chunk: O_DIRECT and buffered). Their descriptors keep a chunk
/// another process evicted until closed; this process's own evictions close theirs at once.
fn open_chunks() -> usize {
    (ubdirect_ub::open_files_limit() / 8).clamp(16, 1024) as usize
}

/// A cache directory shared by the processes of a node.
pub struct ChunkCache {
    dir: PathBuf,
    max_bytes: u64,
    chunk_size: u64,
    engine: Engine,
    slack: usize,
    /// Check every chunk's CRC the first time this process reads it, even one whose sidecar names it
    /// (`cache.recheck_chunks`).
    recheck: bool,
    /// Chunks whose CRC this process checked (or whose sidecar names them): path → inode.
    verified: Mutex<HashMap<PathBuf, u64>>,
    /// Open chunk files: path → (inode, source, last use).
    open: Mutex<HashMap<PathBuf, OpenChunk>>,
    /// Open chunk files kept at most ([`open_chunks`]).
    open_max: usize,
    /// Chunks fetched ahead of the planner's order (`cache.prefetch`), at most.
    prefetch: u64,
    /// Deadline of one prefetch (`remote.deadline_ms`).
    prefetch_deadline: Duration,
    /// Chunks a prefetch task is making present now.
    prefetching: Mutex<HashSet<PathBuf>>,
    /// Chunks this process prefetched that no read has used yet.
    prefetched: Mutex<HashSet<PathBuf>>,
    /// The plan's reads of the objects (`Source::schedule`): each chunk's next use.
    schedule: Mutex<Schedule>,
    /// The latest plan position whose read started.
    clock: AtomicU64,
    /// Plan positions of the reads started and not finished (a count each): the oldest is "now"
    /// for the next use of resident chunks ([`ChunkCache::now`]).
    in_flight: Mutex<std::collections::BTreeMap<u64, usize>>,
    /// Plans taken so far ([`ChunkCache::in_flight`] holds the latest's reads only).
    plans: AtomicU64,
    /// Bytes of chunks this process admitted and is fetching (counted as used until written, so
    /// that reads at once do not all admit a chunk into the same room).
    reserved: AtomicU64,
    /// Chunks whose CRC a task of this process is checking now: the reads that want one wait for
    /// that one check.
    checking: Mutex<HashMap<PathBuf, Check>>,
    /// Held while a chunk's admission is decided and reserved.
    admitting: Mutex<()>,
    /// Chunks admitted and being fetched by this process (a read of one waits for that fetch: it
    /// neither decides nor reserves again).
    fetching: Mutex<HashSet<PathBuf>>,
    /// Where this process stands, published to the node's other ranks, and where they stand.
    node: Mutex<NodeClock>,
    /// When this process last refreshed a chunk's mtime (see [`ChunkCache::touch`]).
    touched: Mutex<HashMap<PathBuf, Instant>>,
    /// Objects (by [`ChunkCache::key_of`]) whose chunk reads fill the page cache when they miss it
    /// ([`ChunkCache::fill_page_cache`]); the others' cold chunks are read with `O_DIRECT`.
    fill: Mutex<HashSet<u64>>,
    /// Chunks being opened ahead of their reads ([`ChunkCache::open_ahead`]).
    opening: Mutex<HashSet<PathBuf>>,
    /// Tests: called with a chunk's path between a read's check of it and the read (the window in
    /// which another process can cut the chunk short).
    #[cfg(test)]
    between_check_and_read: Mutex<Option<CheckedHook>>,
}

/// A chunk's mtime is refreshed at most this often by one process: it orders the least recently
/// used chunks, which a second does not change, and each refresh costs an open, a `utimensat` and a
/// close on the path of a cache hit.
const TOUCH_EVERY: Duration = Duration::from_secs(1);

/// Tests: see `ChunkCache::between_check_and_read`.
#[cfg(test)]
type CheckedHook = Box<dyn Fn(&Path) + Send + Sync>;

/// With the plans of the node's ranks: this process's position, published in `.clock-{local rank}`
/// of the cache directory as (epoch, position in it), and when the others' were last read. Ranks
/// are not in step (one starts later, one reads ahead): a use by another rank counts from where
/// that rank stands, not from where this one does.
#[derive(Default)]
struct NodeClock {
    file: Option<File>,
    read_at: Option<Instant>,
}

/// This process's clock file, created if missing: a regular file only, checked on the descriptor
/// (`O_NONBLOCK`: a FIFO in its place is not waited on; `O_NOFOLLOW`: a link in the shared
/// directory does not send the writes elsewhere). `None`: no clock is published, and the other
/// ranks take this one to be in step.
fn open_clock(p: &Path) -> Option<File> {
    open_shared(p).ok()
}

/// A file of the shared cache directory opened for writing, created if missing: a regular file
/// only, checked on the descriptor (`O_NONBLOCK`: a FIFO in its place is not waited on;
/// `O_NOFOLLOW`: a link does not send the writes, or the lock, elsewhere).
fn open_shared(p: &Path) -> std::io::Result<File> {
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

/// A clock file older than this is a rank that stopped: it is taken to be in step.
const CLOCK_STALE: Duration = Duration::from_secs(30);

/// Another rank's published (epoch, position), when recent. The cache directory is shared: a FIFO,
/// a device or an oversized file in a clock's place is no clock (refused on the descriptor before
/// anything is read), never a wait.
fn read_clock(p: &Path) -> Option<(u64, u64)> {
    let m = std::fs::metadata(p).ok()?;
    if m.modified().ok()?.elapsed().ok()? > CLOCK_STALE {
        return None;
    }
    let b = crate::formats::read_regular(p, 16).ok()?;
    let e = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
    let pos = u64::from_le_bytes(b.get(8..16)?.try_into().ok()?);
    Some((e, pos))
}

/// What a read (or a prefetch) wants of a chunk: its next use after the read at hand, where the
/// plan's future starts for it, and the bytes the read at hand needs of it (fetched either way).
#[derive(Debug, Clone, Copy)]
struct Want {
    next: NextUse,
    from: u64,
    part: u64,
}

/// A chunk this process admitted and is fetching: its bytes in [`ChunkCache::reserved`] and its
/// path in [`ChunkCache::fetching`] while it lives.
struct Reservation<'a> {
    cache: &'a ChunkCache,
    path: PathBuf,
    bytes: u64,
}

impl<'a> Reservation<'a> {
    /// Reserves `bytes` for `path`; call under [`ChunkCache::admitting`].
    fn new(cache: &'a ChunkCache, path: &Path, bytes: u64) -> Self {
        cache.reserved.fetch_add(bytes, Ordering::Relaxed);
        lock_set(&cache.fetching).insert(path.to_path_buf());
        Self {
            cache,
            path: path.to_path_buf(),
            bytes,
        }
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        lock_set(&self.cache.fetching).remove(&self.path);
        self.cache.reserved.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A planned read started and not finished: its position leaves [`ChunkCache::in_flight`] when it
/// drops (the read ended, failed, or was given up).
struct InFlightRead<'a> {
    cache: &'a ChunkCache,
    pos: u64,
    /// The plan it was started under ([`ChunkCache::plans`]).
    plan: u64,
}

impl Drop for InFlightRead<'_> {
    fn drop(&mut self) {
        let mut f = self
            .cache
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // Compared under the lock `restart_clock` holds: a plan since cleared the reads in flight.
        if self.cache.plans.load(Ordering::Relaxed) != self.plan {
            return;
        }
        if let Some(n) = f.get_mut(&self.pos) {
            *n -= 1;
            if *n == 0 {
                f.remove(&self.pos);
            }
        }
    }
}

/// A chunk file of the directory, as eviction sees it.
struct Resident {
    path: PathBuf,
    /// Its bytes and its sidecar's.
    bytes: u64,
    mtime: SystemTime,
    next: NextUse,
}

/// The cache key and chunk index of a chunk file's name (`{key:016x}-{idx:08}.chunk`).
fn parse_chunk_name(name: &str) -> Option<(u64, u64)> {
    let stem = name.strip_suffix(".chunk")?;
    let (k, i) = stem.split_once('-')?;
    Some((u64::from_str_radix(k, 16).ok()?, i.parse().ok()?))
}

/// A chunk file as a prefetch sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Presence {
    /// None of the right length.
    Absent,
    /// In place (this inode), its CRC not yet checked by this process.
    Unchecked(u64),
    /// In place and checked.
    Checked,
}

/// A chunk's CRC check under way (on the blocking pool): the inode whose bytes matched, if they did.
type Check = futures_util::future::Shared<futures_util::future::BoxFuture<'static, Option<u64>>>;

/// An open chunk file: (inode, its source, last use).
type OpenChunk = (u64, Arc<FileSource>, Instant);

impl std::fmt::Debug for ChunkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkCache")
            .field("dir", &self.dir)
            .field("max_bytes", &self.max_bytes)
            .field("chunk_size", &self.chunk_size)
            .finish()
    }
}

fn fnv64(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain([0u8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// `flock(fd, op)`; `Ok(false)` when a non-blocking lock is held elsewhere.
fn flock(f: &File, op: libc::c_int) -> std::io::Result<bool> {
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

/// Takes an exclusive `flock` on `path` (created if absent), polling until `until`. The cache
/// directory is shared: a FIFO in the lock's place is not waited on (`O_NONBLOCK`), a link is not
/// followed (`O_NOFOLLOW`), anything but a regular file is refused on the descriptor, and an error
/// names the path.
async fn lock(path: &Path, until: Instant) -> std::io::Result<Option<File>> {
    let named =
        |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()));
    let f = open_shared(path).map_err(named)?;
    loop {
        if flock(&f, libc::LOCK_EX | libc::LOCK_NB).map_err(named)? {
            return Ok(Some(f));
        }
        if Instant::now() >= until {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn lock_set<T>(s: &Mutex<HashSet<T>>) -> std::sync::MutexGuard<'_, HashSet<T>> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sets a chunk's access and modification times to now, on the path itself (`utimensat` with
/// `AT_SYMLINK_NOFOLLOW` and `UTIME_NOW`): nothing is opened, so a FIFO in the chunk's place is not
/// waited on, a link is not followed, and another user's chunk on a shared node is touched where
/// write permission allows (explicit times would need its owner). A failure only leaves the chunk
/// looking older to the eviction.
fn touch_now(p: &Path) {
    use nix::sys::stat::{UtimensatFlags, utimensat};
    use nix::sys::time::TimeSpec;
    let _ = utimensat(
        nix::fcntl::AT_FDCWD,
        p,
        &TimeSpec::UTIME_NOW,
        &TimeSpec::UTIME_NOW,
        UtimensatFlags::NoFollowSymlink,
    );
}

impl ChunkCache {
    /// A cache in `dir` (created), bounded by `max_bytes`, of `chunk_size`-byte chunks read on
    /// `engine`.
    pub fn new(
        dir: &Path,
        max_bytes: u64,
        chunk_size: u64,
        engine: &Engine,
    ) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
        if chunk_size < (64 << 10) || !chunk_size.is_power_of_two() {
            return Err(bad(format!(
                "cache.chunk_size {chunk_size}: expected a power of two of at least 64 KiB"
            )));
        }
        if max_bytes < 2 * chunk_size {
            return Err(bad(format!(
                "cache.max_bytes {max_bytes} must hold at least two chunks of cache.chunk_size ({chunk_size})"
            )));
        }
        // The file source's alignment on this file system, from a probe file.
        let probe = ubdirect_ub::ProbeFile::create(dir, ".ubdirect-cache-probe", 4096)?;
        let slack = FileSource::open(engine, probe.path())
            .map(|f| f.slack())
            .unwrap_or(4096);
        drop(probe);
        Ok(Self {
            dir: dir.to_path_buf(),
            max_bytes,
            chunk_size,
            engine: engine.clone(),
            slack,
            recheck: false,
            verified: Mutex::new(HashMap::new()),
            open: Mutex::new(HashMap::new()),
            open_max: open_chunks(),
            prefetch: 0,
            prefetch_deadline: Duration::from_secs(30),
            prefetching: Mutex::new(HashSet::new()),
            prefetched: Mutex::new(HashSet::new()),
            schedule: Mutex::new(Schedule::default()),
            clock: AtomicU64::new(0),
            in_flight: Mutex::new(std::collections::BTreeMap::new()),
            plans: AtomicU64::new(0),
            reserved: AtomicU64::new(0),
            checking: Mutex::new(HashMap::new()),
            admitting: Mutex::new(()),
            fetching: Mutex::new(HashSet::new()),
            node: Mutex::new(NodeClock::default()),
            touched: Mutex::new(HashMap::new()),
            fill: Mutex::new(HashSet::new()),
            opening: Mutex::new(HashSet::new()),
            #[cfg(test)]
            between_check_and_read: Mutex::new(None),
        })
    }

    /// The same cache fetching up to `chunks` chunks ahead of the planner's order (at most half of
    /// `max_bytes`, so that prefetched chunks are not the least recently used when room is made),
    /// each prefetch within `deadline`.
    pub fn with_prefetch(mut self, chunks: usize, deadline: Duration) -> Self {
        let fit = (self.max_bytes / 2) / self.chunk_size;
        self.prefetch = (chunks as u64).min(fit);
        self.prefetch_deadline = deadline;
        self
    }

    /// The same cache checking every chunk's CRC the first time this process reads it, even one its
    /// sidecar names (`cache.recheck_chunks`).
    pub fn with_recheck(mut self, recheck: bool) -> Self {
        self.recheck = recheck;
        self
    }

    /// Bytes of planned reads the pipeline should advise ahead of the reads it issued (0: no
    /// prefetch).
    pub(crate) fn advise_window(&self) -> u64 {
        self.prefetch * self.chunk_size
    }

    /// Fetches the chunks of `src` covering `offset..offset + len` in the background (on the current
    /// tokio runtime), unless present, being fetched, or already prefetched. Never blocks.
    pub(crate) fn prefetch(self: &Arc<Self>, src: &ObjectSource, offset: u64, len: usize) {
        if self.prefetch == 0 || len == 0 || offset >= src.size() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let end = (offset + len as u64).min(src.size());
        let key = Self::key_of(src);
        let pos = self.plan().advised(key, offset, len as u64);
        for idx in offset / self.chunk_size..=(end - 1) / self.chunk_size {
            let p = self.chunk_path(src, idx);
            let clen = self.chunk_len(src, idx);
            match self.presence(&p, clen) {
                Presence::Checked => {
                    self.open_ahead(&rt, p);
                    continue;
                }
                Presence::Unchecked(_) => {
                    // In place, not yet checked by this process (a restarted job's first epoch):
                    // its CRC check starts now, ahead of the read, which then finds it done (or
                    // joins it). Nothing to fetch, so no admission to weigh: deciding one scans
                    // the directory, and doing that per advised chunk cost a warm first epoch
                    // most of its time.
                    if !self
                        .checking
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .contains_key(&p)
                    {
                        let (cache, rt2) = (self.clone(), rt.clone());
                        rt.spawn(async move {
                            if cache.valid(&p, clen).await {
                                cache.open_ahead(&rt2, p);
                            }
                        });
                    }
                    continue;
                }
                Presence::Absent => {}
            }
            // With a plan: only chunks it would keep, at most `prefetch` of them ahead, and never
            // by evicting a chunk the plan reads again (the read at hand decides that, when it
            // comes: decided ahead, on a clock behind the advised read, it fetched chunks twice).
            let want = match pos {
                Some(at) => Want {
                    next: self.plan().next_use(key, idx, at),
                    from: at,
                    part: 0,
                },
                None => self.want(src, idx, None, 0),
            };
            if pos.is_some()
                && (lock_set(&self.prefetching).len() + lock_set(&self.prefetched).len()
                    >= self.prefetch as usize
                    || !self.admits(src, idx, &p, self.chunk_len(src, idx), want)
                    || self
                        .victims(self.chunk_len(src, idx) + 64, &p, want.next, false)
                        .is_none_or(|v| v.iter().any(|c| matches!(c.next, NextUse::At(_)))))
            {
                continue;
            }
            if lock_set(&self.prefetched).contains(&p)
                || !lock_set(&self.prefetching).insert(p.clone())
            {
                continue;
            }
            let (cache, src) = (self.clone(), src.clone());
            rt.spawn(async move {
                let until = Instant::now() + cache.prefetch_deadline;
                if let Err(e) = cache.ensure(&src, idx, until, true, want, &mut None).await {
                    add(&STATS.prefetch_failed, 1);
                    ubdirect_ub::fallback::record(
                        "object_store_prefetch_failed",
                        format!("cache prefetch: {e}; the read fetches the chunk itself"),
                    );
                }
                lock_set(&cache.prefetching).remove(&p);
            });
        }
    }

    /// Opens present chunk `p` and refreshes its mtime ahead of the read the plan has for it, on the
    /// blocking pool: a cache hit then finds its file open and its touch done, instead of waiting
    /// for the open's registration with every ring, the sidecar and the `utimensat` on its own path
    /// (a restarted job's first epoch opens every chunk).
    fn open_ahead(self: &Arc<Self>, rt: &tokio::runtime::Handle, p: PathBuf) {
        let open = self.open.lock().map(|o| o.contains_key(&p)).unwrap_or(true);
        if open || !lock_set(&self.opening).insert(p.clone()) {
            return;
        }
        let cache = self.clone();
        drop(rt.spawn_blocking(move || {
            if cache.source_of(&p, None).is_ok() {
                cache.touch(&p);
            }
            lock_set(&cache.opening).remove(&p);
        }));
    }

    /// Whether `p` is a chunk of `len` bytes, and whether this process checked it (a stat, no read).
    fn presence(&self, p: &Path, len: u64) -> Presence {
        let Ok(m) = std::fs::metadata(p) else {
            return Presence::Absent;
        };
        if m.len() != len {
            return Presence::Absent;
        }
        if self.is_verified(p, m.ino()) {
            Presence::Checked
        } else {
            Presence::Unchecked(m.ino())
        }
    }

    /// The inode this process checked at `p` (0, which no file has, when none).
    fn checked_ino(&self, p: &Path) -> u64 {
        self.verified
            .lock()
            .ok()
            .and_then(|v| v.get(p).copied())
            .unwrap_or(0)
    }

    /// Inode `ino` at chunk `p` no longer counts as checked, and its descriptor is closed: the
    /// chunk's next use checks it again (and fetches it again if it is not whole). A chunk fetched
    /// again meanwhile (another inode) is left as it is.
    fn forget(&self, p: &Path, ino: u64) {
        {
            let mut v = self.verified.lock().unwrap_or_else(|e| e.into_inner());
            if v.get(p) == Some(&ino) {
                v.remove(p);
            }
        }
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if open.get(p).is_some_and(|(i, _, _)| *i == ino) {
            open.remove(p);
        }
    }

    /// Whether this process counts inode `ino` at `p` as checked.
    fn is_verified(&self, p: &Path, ino: u64) -> bool {
        self.verified
            .lock()
            .map(|v| v.get(p) == Some(&ino))
            .unwrap_or(false)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes of one chunk.
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// The bound on the directory's bytes (`cache.max_bytes`).
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Every chunk file of `src`, when each is present, whole, and checked on the inode its path
    /// names now — by this process, or by its writer (its sidecar names it) — a `stat` per chunk and
    /// at most a sidecar read: what the page-cache pool may map.
    pub(crate) fn chunk_files(&self, src: &ObjectSource) -> Option<ubdirect_ub::ChunkFiles> {
        if src.size() == 0 {
            return None;
        }
        let n = src.size().div_ceil(self.chunk_size);
        let mut chunks = Vec::with_capacity(n as usize);
        for idx in 0..n {
            let p = self.chunk_path(src, idx);
            let m = std::fs::symlink_metadata(&p).ok()?;
            let len = self.chunk_len(src, idx);
            if !m.is_file() || m.len() != len {
                return None;
            }
            let checked = self.is_verified(&p, m.ino());
            // Or its sidecar names it (as a read would trust it: [`ChunkCache::valid`]), so that a
            // restarted job maps a warm cache from its first epoch, as it does its local shards.
            if !checked {
                if self.recheck || !names_this_file(&p, len, m.ino()) {
                    return None;
                }
                if let Ok(mut v) = self.verified.lock() {
                    v.insert(p.clone(), m.ino());
                }
            }
            chunks.push((p, m.ino()));
        }
        Some(ubdirect_ub::ChunkFiles {
            chunk_size: self.chunk_size,
            chunks,
        })
    }

    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    pub(crate) fn slack(&self) -> usize {
        self.slack
    }

    /// Bytes in the cache directory now (chunks, sidecars, files being written).
    pub fn used_bytes(&self) -> u64 {
        std::fs::read_dir(&self.dir)
            .map(|d| {
                d.filter_map(|e| e.ok()?.metadata().ok())
                    .filter(|m| m.is_file())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    }

    /// The cache key of `src`: its URL, size and entity tag hashed.
    /// Whether the reads of `src`'s chunk files that miss the page cache fill it (the page-cache
    /// pool asks for it where the run reads the object again and will map its chunks) or go around
    /// it with `O_DIRECT`, as a cold local shard's do.
    pub(crate) fn fill_page_cache(&self, src: &ObjectSource, on: bool) {
        let mut f = lock_set(&self.fill);
        if on {
            f.insert(Self::key_of(src));
        } else {
            f.remove(&Self::key_of(src));
        }
    }

    fn key_of(src: &ObjectSource) -> u64 {
        let size = src.size().to_string();
        fnv64(&[src.shard(), &size, src.etag().unwrap_or("")])
    }

    fn chunk_path(&self, src: &ObjectSource, idx: u64) -> PathBuf {
        let key = Self::key_of(src);
        self.dir.join(format!("{key:016x}-{idx:08}.chunk"))
    }

    /// Where this process stands in the plan: the oldest read started and not finished, else the
    /// latest started. A pipeline keeps many chunks of batches in flight and starts reads well
    /// ahead of the ones still waiting for their chunks; counting from the latest would take the
    /// chunks those older reads still need for used (docs/decisions.md, "The cache's now").
    fn now(&self) -> u64 {
        let f = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        match f.keys().next() {
            Some(&oldest) => oldest,
            None => self.clock.load(Ordering::Relaxed),
        }
    }

    /// The read at plan position `p` started: the clock moves to it, and it counts as in flight
    /// until the value returned drops.
    fn started(&self, p: u64) -> InFlightRead<'_> {
        self.clock.fetch_max(p, Ordering::Relaxed);
        let plan = {
            let mut f = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            *f.entry(p).or_insert(0) += 1;
            self.plans.load(Ordering::Relaxed)
        };
        self.node_clock();
        InFlightRead {
            cache: self,
            pos: p,
            plan,
        }
    }

    /// A new plan: the clock restarts, and reads of the plan before (given up, still ending) no
    /// longer say where this process stands.
    fn restart_clock(&self) {
        self.clock.store(0, Ordering::Relaxed);
        // Under the lock, so that a read ending meanwhile sees either the old plan and its count,
        // or the new plan and leaves the new counts alone.
        let mut f = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        self.plans.fetch_add(1, Ordering::Relaxed);
        f.clear();
    }

    fn plan(&self) -> std::sync::MutexGuard<'_, Schedule> {
        self.schedule.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `src`'s planned reads, and those of the node's other ranks (`Source::schedule`); a new
    /// generation restarts the clock.
    pub(crate) fn schedule(&self, src: &ObjectSource, planned: &PlannedReads<'_>) {
        if self.plan().set(Self::key_of(src), self.chunk_size, planned) {
            self.restart_clock();
            self.node.lock().unwrap_or_else(|e| e.into_inner()).read_at = None;
        }
        // The other ranks' reads may come with the schedule's extension, after its start.
        if !planned.others.is_empty() {
            let mut n = self.node.lock().unwrap_or_else(|e| e.into_inner());
            if n.file.is_none() {
                n.file = open_clock(&self.dir.join(format!(".clock-{}", planned.local_rank)));
            }
        }
        self.node_clock();
    }

    /// Publishes where this process stands and, at most every 10 ms, reads where the node's other
    /// ranks do (with a plan of several ranks; nothing otherwise).
    fn node_clock(&self) {
        let others = self.plan().other_ranks().to_vec();
        if others.is_empty() {
            return;
        }
        let mut n = self.node.lock().unwrap_or_else(|e| e.into_inner());
        let (e, pos) = self.plan().publish(self.now());
        if let Some(f) = &n.file {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&e.to_le_bytes());
            b[8..].copy_from_slice(&pos.to_le_bytes());
            // A clock not written is a rank taken to be in step: never an error.
            let _ = std::os::unix::fs::FileExt::write_at(f, &b, 0);
        }
        if n.read_at
            .is_some_and(|t| t.elapsed() < Duration::from_millis(10))
        {
            return;
        }
        n.read_at = Some(Instant::now());
        drop(n);
        for r in others {
            let at = read_clock(&self.dir.join(format!(".clock-{r}")));
            self.plan().set_clock(r, at);
        }
    }

    /// What the read at `pos` (`None`: a read the plan does not name) of `part` bytes of chunk
    /// `idx` of `src` wants of it.
    fn want(&self, src: &ObjectSource, idx: u64, pos: Option<u64>, part: u64) -> Want {
        match pos {
            Some(p) => Want {
                next: self.plan().next_use(Self::key_of(src), idx, p + 1),
                from: p + 1,
                part,
            },
            None => Want {
                next: NextUse::Unknown,
                from: 0,
                part,
            },
        }
    }

    /// Whether chunk `idx` of `src` (at `p`, `len` bytes) is to be fetched whole and kept: it fits
    /// without evicting anything; or it is used again, room can be made for it by evicting chunks
    /// used later, and its planned reads before those are needed again read more than fetching it
    /// whole costs beyond the read at hand.
    fn admits(&self, src: &ObjectSource, idx: u64, p: &Path, len: u64, want: Want) -> bool {
        let Some(victims) = self.victims(len + 64, p, want.next, false) else {
            return false;
        };
        // Free room is filled whatever the plan says (a later run or another rank may read it);
        // evicting is for chunks that pay it back.
        if victims.is_empty() {
            return true;
        }
        if want.next == NextUse::Never {
            return false;
        }
        let until = victims
            .iter()
            .filter_map(|v| match v.next {
                NextUse::At(x) => Some(x),
                _ => None,
            })
            .min()
            .unwrap_or(u64::MAX);
        self.plan().pays_back(
            Self::key_of(src),
            idx,
            want.from,
            until,
            len.saturating_sub(want.part),
        )
    }

    fn chunk_len(&self, src: &ObjectSource, idx: u64) -> u64 {
        let start = idx * self.chunk_size;
        self.chunk_size.min(src.size() - start)
    }

    /// Whether `p` holds a whole, checked chunk of `len` bytes. The first check of a chunk in this
    /// process (its CRC against the sidecar: a read of the whole chunk) runs on the blocking pool,
    /// once however many reads wait for it: checks of different chunks run in parallel, and the
    /// runtime's threads keep serving reads meanwhile (a restarted job's first epoch from a warm
    /// cache checks every chunk).
    async fn valid(&self, p: &Path, len: u64) -> bool {
        let ino = match self.presence(p, len) {
            Presence::Absent => return false,
            Presence::Checked => return true,
            Presence::Unchecked(ino) => ino,
        };
        // The sidecar names this very file: its writer computed the CRC from the bytes it fetched
        // and wrote them to this inode (synced before it was renamed into place).
        if !self.recheck && names_this_file(p, len, ino) {
            if let Ok(mut v) = self.verified.lock() {
                v.insert(p.to_path_buf(), ino);
            }
            return true;
        }
        let check = {
            use futures_util::FutureExt;
            let mut c = self.checking.lock().unwrap_or_else(|e| e.into_inner());
            c.entry(p.to_path_buf())
                .or_insert_with(|| {
                    let path = p.to_path_buf();
                    async move {
                        tokio::task::spawn_blocking(move || matches_sidecar(&path, len))
                            .await
                            .unwrap_or(None)
                    }
                    .boxed()
                    .shared()
                })
                .clone()
        };
        let ino = check.await;
        self.checking
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(p);
        let ok = ino.is_some();
        if let (Some(ino), Ok(mut v)) = (ino, self.verified.lock()) {
            v.insert(p.to_path_buf(), ino);
        }
        if !ok {
            tracing::warn!(target: "ubdirect_loader::objstore::cache",
                "cache: {} fails its checksum; fetching it again",
                p.display()
            );
        }
        ok
    }

    /// Marks chunk `p` used now (its sidecar's mtime: touching the chunk would change its ctime,
    /// which the sidecar names), unless this process did within [`TOUCH_EVERY`].
    fn touch(&self, p: &Path) {
        {
            let mut t = self.touched.lock().unwrap_or_else(|e| e.into_inner());
            if t.get(p).is_some_and(|at| at.elapsed() < TOUCH_EVERY) {
                return;
            }
            if t.len() >= 4096 {
                t.retain(|_, at| at.elapsed() < TOUCH_EVERY);
            }
            t.insert(p.to_path_buf(), Instant::now());
        }
        touch_now(&p.with_extension("crc"));
    }

    /// Makes chunk `idx` of `src` present; `Ok(None)` when it is not to be cached: used `next`
    /// never again, or later than every resident chunk it would evict (or it cannot fit in the
    /// bound). A `prefetch` that fetches the chunk counts it and marks it prefetched (before its
    /// lock is released, so a read waiting on the lock finds the mark). A chunk fetched whole that
    /// then cannot be kept (another process of the node took the room meanwhile) is put in `kept`,
    /// for the read at hand (fetching its bytes again would pay twice).
    async fn ensure(
        &self,
        src: &ObjectSource,
        idx: u64,
        until: Instant,
        prefetch: bool,
        want: Want,
        kept: &mut Option<Vec<u8>>,
    ) -> Result<Option<PathBuf>, SourceError> {
        let p = self.chunk_path(src, idx);
        let len = self.chunk_len(src, idx);
        let start = idx * self.chunk_size;
        let err = |k, e: Box<dyn std::error::Error + Send + Sync>| {
            SourceError::new(k, src.shard(), start, len as usize).with_source(e)
        };
        if self.valid(&p, len).await {
            self.touch(&p);
            return Ok(Some(p));
        }
        // Decided and reserved under one lock: reads at once do not all admit into the same room.
        let bypass = || {
            if !prefetch {
                add(&STATS.cache_bypassed, 1);
            }
            Ok(None)
        };
        let reserved = {
            let _one = self.admitting.lock().unwrap_or_else(|e| e.into_inner());
            if lock_set(&self.fetching).contains(&p) {
                None // admitted by another read of this process: wait for its fetch below
            } else if self.admits(src, idx, &p, len, want) {
                Some(Reservation::new(self, &p, len + 64))
            } else {
                return bypass();
            }
        };
        let _held = match lock(&p.with_extension("lock"), until).await {
            Ok(Some(f)) => f,
            Ok(None) => {
                return Err(err(
                    SourceErrorKind::Timeout,
                    "another process held the chunk's fetch lock past the deadline".into(),
                ));
            }
            Err(e) => return Err(err(SourceErrorKind::Io, Box::new(e))),
        };
        if self.valid(&p, len).await {
            self.touch(&p);
            return Ok(Some(p));
        }
        if reserved.is_none() {
            return bypass(); // the fetch waited on did not keep the chunk
        }
        let mut buf = vec![0u8; len as usize];
        src.fetch_into(start, &mut buf, until)
            .await
            .map_err(|e| err(super::source::kind_of(&e), Box::new(e)))?;
        add(&STATS.chunks_fetched, 1);
        let all = match lock(&self.dir.join(".cache.lock"), until).await {
            Ok(Some(f)) => f,
            Ok(None) => {
                return Err(err(
                    SourceErrorKind::Timeout,
                    "the cache lock was held past the deadline".into(),
                ));
            }
            Err(e) => return Err(err(SourceErrorKind::Io, Box::new(e))),
        };
        // The reservation (`len + 64`, counted as used) stands for the chunk until it is written:
        // room is made for nothing more, and no admission meanwhile sees the room free.
        if !self.make_room(0, &p, want.next) {
            add(&STATS.cache_bypassed, 1);
            drop(all);
            *kept = Some(buf);
            return Ok(None);
        }
        if let Err(e) = self.write_chunk(&p, &buf) {
            // A cache that cannot take the chunk (its disk full, a directory in the chunk's
            // place, the directory made read-only): the read is served from the bytes fetched,
            // the cache bypassed, and the run goes on, recorded.
            if !prefetch {
                add(&STATS.cache_bypassed, 1);
            }
            // Its sidecar, if written, names no chunk: not left to count against the bound.
            let _ = std::fs::remove_file(p.with_extension("crc"));
            ubdirect_ub::fallback::record(
                "object_cache_write_failed",
                format!(
                    "{}: {e}: served from the bytes fetched, not cached",
                    p.display()
                ),
            );
            drop(all);
            *kept = Some(buf);
            return Ok(None);
        }
        drop(reserved);
        drop(all);
        if prefetch {
            add(&STATS.chunks_prefetched, 1);
            add(&STATS.bytes_prefetched, len);
            lock_set(&self.prefetched).insert(p.clone());
        }
        Ok(Some(p))
    }

    /// Writes `data` as the chunk `p`: the data to a new file (not visible yet) and synced, then the
    /// sidecar naming its length, CRC and inode, then the data renamed into place — a reader never
    /// sees a partial chunk, and a sidecar names only the file whose bytes its CRC was computed from.
    fn write_chunk(&self, p: &Path, data: &[u8]) -> std::io::Result<()> {
        let mut f = ubdirect_ub::NewFile::create(p)?;
        f.write_all(data)?;
        f.file().sync_data()?;
        let ino = f.file().metadata()?.ino();
        let (side, crc) = (p.with_extension("crc"), crc32fast::hash(data));
        ubdirect_ub::write_new(
            &side,
            format!("{} {crc:08x} {ino}\n", data.len()).as_bytes(),
        )?;
        f.commit()?;
        // The ctime after the rename (which sets it): with it, the sidecar names this very file to
        // other processes ([`names_this_file`]); until then they check the chunk's CRC.
        if let Ok(m) = std::fs::symlink_metadata(p)
            && m.ino() == ino
        {
            let line = format!(
                "{} {crc:08x} {ino} {} {}\n",
                data.len(),
                m.ctime(),
                m.ctime_nsec()
            );
            ubdirect_ub::write_new(&side, line.as_bytes())?;
        }
        // The inode written, not whatever the path names a moment later.
        if let Ok(mut v) = self.verified.lock() {
            v.insert(p.to_path_buf(), ino);
        }
        Ok(())
    }

    /// The chunks to evict so that `need` more bytes fit, for a chunk used next at `next`: never
    /// used again first, then unknown to the plan (least recently used first), then the farthest
    /// next use first, each only while it is used later than `next` (any, for an unplanned chunk);
    /// never `keep`. `None`: they cannot be made to fit. `sweep` removes leftovers of writers that
    /// died (under the directory lock only).
    fn victims(&self, need: u64, keep: &Path, next: NextUse, sweep: bool) -> Option<Vec<Resident>> {
        let rd = std::fs::read_dir(&self.dir).ok()?;
        let now = self.now();
        let mut used = self.reserved.load(Ordering::Relaxed);
        let mut chunks = Vec::new();
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if !m.is_file() {
                continue;
            }
            let p = e.path();
            let name = e.file_name();
            let name = name.to_string_lossy();
            // Leftovers of a process that died while writing (older than a minute).
            if sweep
                && name.starts_with(".tmp-")
                && m.modified()
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|a| a > Duration::from_secs(60))
            {
                let _ = std::fs::remove_file(&p);
                continue;
            }
            used += m.len();
            if let Some((key, idx)) = parse_chunk_name(&name)
                && p != keep
            {
                // Last used: the sidecar's mtime (what `touch` marks), else the chunk's.
                let side = std::fs::metadata(p.with_extension("crc")).ok();
                let used_at = side
                    .as_ref()
                    .and_then(|s| s.modified().ok())
                    .or_else(|| m.modified().ok());
                let side = side.map_or(0, |s| s.len());
                chunks.push(Resident {
                    next: self.plan().next_use(key, idx, now),
                    mtime: used_at.unwrap_or(SystemTime::UNIX_EPOCH),
                    path: p,
                    bytes: m.len() + side,
                });
            }
        }
        chunks.sort_by_key(|c| (c.next.evict_rank(), c.mtime));
        let mut out = Vec::new();
        let mut it = chunks.into_iter();
        while used + need > self.max_bytes {
            let c = it.next().filter(|c| c.next.evictable_for(next))?;
            used = used.saturating_sub(c.bytes);
            out.push(c);
        }
        Some(out)
    }

    /// Evicts [`Self::victims`] so that `need` more bytes fit; false if they cannot. Called under
    /// the directory lock.
    fn make_room(&self, need: u64, keep: &Path, next: NextUse) -> bool {
        let Some(out) = self.victims(need, keep, next, true) else {
            return false;
        };
        for c in out {
            // Its descriptor would keep the evicted blocks.
            self.open
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&c.path);
            let _ = std::fs::remove_file(&c.path);
            let _ = std::fs::remove_file(c.path.with_extension("crc"));
            add(&STATS.chunks_evicted, 1);
        }
        true
    }

    /// The io_uring source of a present chunk (kept open for the next reads). `checked`: the inode
    /// this process checked at `p` (its bytes against their CRC, or its sidecar naming it), which a
    /// read is served from and nothing else: a chunk renamed over between the check and the open is
    /// refused (the read goes to the store), since the inode opened is compared, not the path.
    /// `None` (opened ahead of its read, unchecked): opened and kept, for a read to use once its
    /// inode is checked.
    fn source_of(
        &self,
        p: &Path,
        checked: Option<u64>,
    ) -> Result<Arc<FileSource>, ubdirect_nvme::IoError> {
        let hit = |open: &mut HashMap<PathBuf, OpenChunk>| {
            let (i, f, used) = open.get_mut(p)?;
            checked.is_none_or(|c| *i == c).then(|| {
                *used = Instant::now();
                f.clone()
            })
        };
        if let Some(f) = hit(&mut self.open.lock().unwrap_or_else(|e| e.into_inner())) {
            return Ok(f);
        }
        // Opened without the lock: an open registers the file with every ring, a round trip to
        // each ring's thread, which the reads of chunks already open must not queue behind.
        let f = Arc::new(FileSource::open(&self.engine, p)?);
        let opened = |source: std::io::Error| ubdirect_nvme::IoError::Open {
            path: p.to_path_buf(),
            source,
        };
        let ino = f.handle().ident().map_err(opened)?.ino;
        if checked.is_some_and(|c| c != ino) {
            return Err(opened(std::io::Error::other(
                "the chunk was replaced since this process checked it",
            )));
        }
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = hit(&mut open) {
            return Ok(f); // opened by another read meanwhile
        }
        if open.len() >= self.open_max
            && let Some(old) = open
                .iter()
                .min_by_key(|(_, (_, _, t))| *t)
                .map(|(k, _)| k.clone())
        {
            open.remove(&old);
        }
        open.insert(p.to_path_buf(), (ino, f.clone(), Instant::now()));
        Ok(f)
    }

    /// Reads `len` bytes of `src` at `offset` into the lease from the chunks covering them, chunk
    /// after chunk. A part lands right after the previous one; with O_DIRECT the parts after the
    /// first start at a chunk boundary, so they stay aligned. A chunk that cannot be cached (the bound,
    /// or evicted by another process before it was opened) is fetched straight into its place.
    pub(crate) async fn read(
        &self,
        src: &ObjectSource,
        offset: u64,
        len: usize,
        mut lease: Lease,
        lease_offset: usize,
        until: Instant,
    ) -> SourceResult {
        let end = offset + len as u64;
        let first = offset / self.chunk_size;
        let last = (end - 1) / self.chunk_size;
        let mut data_start = lease_offset;
        let mut cursor = lease_offset;
        let mut bytes_read = 0usize;
        let mut path = ubdirect_ub::ReadPath::ObjectStore;
        let fail = |k: SourceErrorKind, e: Box<dyn std::error::Error + Send + Sync>| {
            SourceError::new(k, src.shard(), offset, len).with_source(e)
        };
        // Where the plan has this read: the clock moves to it.
        let key = Self::key_of(src);
        let pos = self.plan().start(key, offset, len as u64);
        let fill = lock_set(&self.fill).contains(&key);
        let _in_flight = pos.map(|p| self.started(p));
        // The chunks of the read fetched at once (a read of several chunks waits for the slowest
        // GET, not for their sum).
        let ensured = futures_util::future::join_all((first..=last).map(|idx| async move {
            let cs = idx * self.chunk_size;
            let part = end.min(cs + self.chunk_size) - offset.max(cs);
            let mut kept = None;
            let want = self.want(src, idx, pos, part);
            let r = self.ensure(src, idx, until, false, want, &mut kept).await;
            (r, kept)
        }))
        .await;
        for ((i, idx), (present, kept)) in (first..=last).enumerate().zip(ensured) {
            let cs = idx * self.chunk_size;
            let a = offset.max(cs);
            let b = end.min(cs + self.chunk_size);
            let n = (b - a) as usize;
            if let Ok(Some(p)) = &present
                && lock_set(&self.prefetched).remove(p)
            {
                add(&STATS.prefetch_hits, 1);
            }
            let file = match present {
                Ok(Some(p)) => {
                    let ino = self.checked_ino(&p);
                    match self.source_of(&p, Some(ino)) {
                        Ok(f) => Some((f, p, ino)),
                        Err(e) => {
                            tracing::debug!(target: "ubdirect_loader::objstore::cache", "cache: {e}; reading the chunk from the store");
                            add(&STATS.cache_bypassed, 1);
                            None
                        }
                    }
                }
                Ok(None) => None,
                Err(e) => return (Err(e), lease),
            };
            let mut from_store = true;
            if let Some((f, p, ino)) = file {
                #[cfg(test)]
                if let Some(hook) = &*self
                    .between_check_and_read
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                {
                    hook(&p);
                }
                let left = until.saturating_duration_since(Instant::now());
                f.set_populate(fill);
                let (r, l) = f.read(a - cs, n, lease, cursor, left).await;
                lease = l;
                match r {
                    Ok(d) => {
                        from_store = false;
                        if i == 0 {
                            data_start = d.data.start;
                            // A part read through the page cache lands at `lease_offset`, which leaves
                            // the next part at an offset O_DIRECT cannot read into, should its chunk be
                            // cold: moved to where an aligned read would have put it (the lease holds
                            // the slack), the next part then starts aligned at the chunk boundary.
                            let at = lease_offset + (offset % self.slack.max(1) as u64) as usize;
                            if last > first
                                && self.slack > 0
                                && !(data_start + n).is_multiple_of(self.slack)
                                && at != data_start
                            {
                                match lease.as_mut_slice() {
                                    Ok(s) if at + n <= s.len() => {
                                        s.copy_within(data_start..data_start + n, at);
                                        data_start = at;
                                    }
                                    Ok(_) => {
                                        let e = "the lease cannot hold the read with its alignment slack";
                                        return (
                                            Err(fail(SourceErrorKind::Lease, e.into())),
                                            lease,
                                        );
                                    }
                                    Err(e) => {
                                        return (
                                            Err(fail(SourceErrorKind::Lease, Box::new(e))),
                                            lease,
                                        );
                                    }
                                }
                            }
                        } else if d.data.start != cursor {
                            match lease.as_mut_slice() {
                                Ok(s) => s.copy_within(d.data.clone(), cursor),
                                Err(e) => {
                                    return (Err(fail(SourceErrorKind::Lease, Box::new(e))), lease);
                                }
                            }
                        }
                        bytes_read += d.bytes_read;
                        path = d.path;
                        add(&STATS.bytes_from_cache, n as u64);
                    }
                    // A chunk cut short or unreadable since it was checked (another process of the
                    // node, a damaged disk): this part comes from the store, and the chunk is
                    // checked again at its next use (and so fetched again). The cache is a copy;
                    // the store has the bytes.
                    Err(e)
                        if e.source_as::<ubdirect_nvme::IoError>()
                            .is_some_and(|e| e.means_damaged_file()) =>
                    {
                        self.forget(&p, ino);
                        add(&STATS.cache_bypassed, 1);
                        ubdirect_ub::fallback::record(
                            "object_cache_chunk_read_failed",
                            format!("{e}: read from the store instead"),
                        );
                    }
                    // An engine that cannot read at all, a lease that cannot take the bytes, a
                    // deadline passed: the read ends, as any read of a local file would.
                    Err(e) => return (Err(fail(e.kind, Box::new(e))), lease),
                }
            }
            if from_store {
                if i == 0 && self.slack > 0 {
                    // Where an aligned read would have put it, so later parts stay aligned.
                    data_start = lease_offset + (offset % self.slack as u64) as usize;
                    cursor = data_start;
                }
                let from_kept = kept
                    .as_deref()
                    .and_then(|k| k.get((a - cs) as usize..(b - cs) as usize));
                let r = match lease.as_mut_slice() {
                    Ok(s) => match (s.get_mut(cursor..cursor + n), from_kept) {
                        // The chunk was fetched whole but not kept: its bytes are here.
                        (Some(dst), Some(k)) => {
                            dst.copy_from_slice(k);
                            Ok(())
                        }
                        (Some(dst), None) => src
                            .fetch_into(a, dst, until)
                            .await
                            .map_err(|e| fail(super::source::kind_of(&e), Box::new(e))),
                        (None, _) => Err(fail(
                            SourceErrorKind::Lease,
                            "the lease cannot hold the read with its alignment slack".into(),
                        )),
                    },
                    Err(e) => Err(fail(SourceErrorKind::Lease, Box::new(e))),
                };
                if let Err(e) = r {
                    return (Err(e), lease);
                }
                bytes_read += n;
            }
            cursor = data_start + (b - offset) as usize;
        }
        let done = ReadDone {
            data: data_start..data_start + len,
            bytes_read,
            path,
        };
        (Ok(done), lease)
    }
}

/// Whether chunk `p`'s sidecar names it: its length `len` and its inode `ino` (written by a writer
/// that computed the CRC from the bytes it wrote to that inode). A sidecar of an older writer (no
/// inode) names nothing.
///
/// And its ctime (since 2026-12-05): a chunk rewritten in place keeps its inode and length — and
/// its mtime, if put back — but not its ctime, which the sidecar records after the chunk was renamed
/// into place (the use a chunk's eviction order needs is marked on the sidecar, so nothing of
/// ubdirect's changes a chunk's ctime). A sidecar without it names nothing: the chunk's CRC is
/// checked.
fn names_this_file(p: &Path, len: u64, ino: u64) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(side) = crate::formats::read_regular(&p.with_extension("crc"), 96) else {
        return false;
    };
    let Ok(m) = std::fs::symlink_metadata(p) else {
        return false;
    };
    let side = String::from_utf8_lossy(&side);
    let f: Vec<&str> = side.split_whitespace().collect();
    let [l, _crc, i, cs, cns] = f[..] else {
        return false;
    };
    l.parse::<u64>().ok() == Some(len)
        && i.parse::<u64>().ok() == Some(ino)
        && m.ino() == ino
        && cs.parse::<i64>().ok() == Some(m.ctime())
        && cns.parse::<i64>().ok() == Some(m.ctime_nsec())
}

/// The inode of chunk `p` when it holds `len` bytes whose CRC-32 its `.crc` sidecar names
/// (`"{len} {crc:08x}"`); `None` otherwise. Both are read as regular files only, within their sizes:
/// the cache directory is shared, and a FIFO or device in a sidecar's or chunk's place must not block
/// or flood a read. The chunk is read in 1 MiB pieces (no buffer of its size).
fn matches_sidecar(p: &Path, len: u64) -> Option<u64> {
    use std::io::Read;
    let side = crate::formats::read_regular(&p.with_extension("crc"), 64).ok()?;
    let side = String::from_utf8_lossy(&side);
    let mut it = side.split_whitespace();
    let (l, c) = (it.next()?, it.next()?);
    if l.parse::<u64>().ok() != Some(len) {
        return None;
    }
    let want = u32::from_str_radix(c, 16).ok()?;
    let (f, size) = crate::formats::open_regular(p).ok()?;
    if size != len {
        return None;
    }
    let ino = f.metadata().ok()?.ino();
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; (1 << 20).min(len as usize)];
    let mut f = f.take(len);
    let mut got = 0u64;
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                h.update(&buf[..n]);
                got += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    (got == len && h.finalize() == want).then_some(ino)
}

#[cfg(test)]
mod tests;
