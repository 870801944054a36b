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

mod clock;
pub(crate) mod estimate;
mod fetch;
mod locks;
mod read;
mod store;
mod windows;

use clock::{NodeClock, open_clock};
use locks::*;
pub(crate) use store::cache_key;
use store::*;

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
    /// Windows of the plan's near future kept from chunks fetched whole but not cached.
    windows: Mutex<windows::Windows>,
    /// Per chunk (object key, index): held while a read decides and fetches it for its windows,
    /// so that the reads of one chunk at once fetch it once.
    window_locks: Mutex<windows::ChunkLocks>,
    /// Bytes the reads through this cache delivered (the windows' bound on bytes fetched).
    delivered: AtomicU64,
    /// Bytes this cache fetched from the store: its own, not the process's (`STATS`), which other
    /// loaders of the process add to — before 2026-12-07 the windows' bound read the process's, so
    /// a second loader in one process (a validation set, a benchmark's next round) found no slack
    /// and fetched 422 of 445 parts on their own.
    fetched: AtomicU64,
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
        match f.get_mut(&self.pos) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                f.remove(&self.pos);
            }
            None => ubdirect_ub::invariant::broken(
                "object cache",
                &format!(
                    "the read at plan position {} ended but was not in flight",
                    self.pos
                ),
            ),
        }
    }
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
            windows: Mutex::new(windows::Windows::new(0)),
            window_locks: Mutex::new(HashMap::new()),
            delivered: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
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

    /// The same cache holding `fraction` of its bound in memory as windows of the plan's near
    /// future (`cache.window_fraction`); the chunk files keep the rest (none at 1).
    pub fn with_windows(mut self, fraction: f64) -> Self {
        let w = (self.max_bytes as f64 * fraction.clamp(0.0, 1.0)) as u64;
        self.max_bytes -= w;
        self.windows = Mutex::new(windows::Windows::new(w));
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
}

#[cfg(test)]
mod tests;
