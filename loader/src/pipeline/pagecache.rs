//! The page cache as a pool: shards that fit `pool.page_cache_budget` are read through the page
//! cache in their first epoch (so they become resident), then mapped read-only and registered once
//! with the device — never on the hot path — and their batches are copied by the device straight
//! out of the mapping. Between epochs every mapping is checked against the file it was made from
//! (size, mtime, inode): a changed shard is a typed error.
//!
//! When registration happens is `pool.page_cache_register` (docs/decisions.md, "No registration
//! wall"): registering runs at ~40 GB/s, serialised by the driver, and slows copies issued meanwhile,
//! so it pays back only for shards read again. `auto` never registers before an epoch's first batch:
//! a background thread registers resident shards one at a time, paced, once the loader knows it reads
//! them again often enough to pay it back (at least `REGISTER_EPOCHS_LEFT` more epochs, or a loop past
//! `loader.epochs`), and each chunk copies from the
//! mappings registered when it starts; until then warm reads go through the copy threads. `eager`
//! registers every resident shard at the start of each epoch (the 2026-11-30 behaviour); `never`
//! leaves the page cache to the copy threads.
//!
//! An object cached whole in an object store's chunk cache ([`Source::chunk_files`]) is a candidate
//! too, where the cache holds every object of the run (nothing it maps is evicted by the run's own
//! reads): once every chunk is present and checked, its chunk files are mapped and registered like a
//! local shard, and cache hits are copied by the device straight out of them. A chunk evicted or
//! replaced since is noticed at the next epoch's start: the object goes back to cache reads (a
//! counted fallback), never an error — the chunk is immutable, only its room is reclaimed.
//!
//! Such an object's chunk files are checked by mapping them (unregistered: an `open`, an `fstat` and
//! an `mmap` per chunk) and asking the mapping's own descriptors whether they are resident — once
//! per epoch start, not once per check — and that mapping is the one used: registered at once
//! (`eager`), made the copy threads' source of the object's reads until the registrar registers it
//! (`auto`, [`ShardMap::staged`]: a `pread` per read, not the cache's open, check and ring
//! registration of each chunk file on its first touch in the process), or read by the CPU (packed
//! batches).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ubdirect_nvme::FileSource;
use ubdirect_ub::{Device, MapError, MappedFile, PinBudget, Source};

use super::LoadError;
use super::shardmap::ShardMap;
use crate::config::{PageCacheBudget, RegisterPolicy};
use crate::formats::index::DatasetIndex;

mod candidate;
mod registrar;

use candidate::{Backing, Candidate, State};

/// Chunk files an epoch start's checks give one thread: starting and joining a thread costs about
/// as much as checking this many (on the H200 host, 4 threads for 8 chunk files took 0.2–0.4 ms
/// of each epoch's start against 0.04–0.08 ms in turn).
const FILES_PER_THREAD: usize = 32;

/// Per shard, the mapping this epoch copies from (if any).
pub(crate) type Mapped = Arc<Vec<Option<Arc<ShardMap>>>>;

/// What the background registrar and the epochs share.
struct Shared {
    budget: Arc<PinBudget>,
    device: Arc<dyn Device>,
    shards: Vec<Option<Candidate>>,
    /// The mappings chunks copy from now (replaced whole when a shard is registered).
    current: Mutex<Mapped>,
    /// Stops the background registrar.
    stop: AtomicBool,
    /// Shards registered in the background, and while an epoch was running.
    background: AtomicU64,
    /// Cold shards filled into the page cache by an epoch's reads (the run reads them again).
    filled: AtomicU64,
    /// Cold shards an epoch read with O_DIRECT, not filled (a single pass).
    cold_direct: AtomicU64,
    /// Shards mapped without registration for CPU copies (packed batches).
    cpu_mapped: AtomicU64,
    /// Objects mapped from their cache's chunk files.
    chunked: AtomicU64,
    /// Objects whose mapped chunks were evicted or replaced, read through the cache again.
    chunks_dropped: AtomicU64,
    /// Objects whose reads copied out of their chunk files' unregistered mapping for an epoch
    /// ([`ShardMap::staged`]), counted per epoch.
    staged: AtomicU64,
    /// Of those, the object-epochs that read the staged mapping of the epoch before again (checked,
    /// not made anew).
    staged_kept: AtomicU64,
}

/// This rank's place among the ranks of its node that share the page cache (`LOCAL_WORLD_SIZE`
/// ranks; its index is `RANK mod LOCAL_WORLD_SIZE`, torchrun's `LOCAL_RANK`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NodeShare {
    /// This rank's index on the node.
    pub index: usize,
    /// Ranks on the node (1: alone).
    pub ranks: usize,
}

/// The loader's registered page cache.
pub(crate) struct PageCache {
    shared: Arc<Shared>,
    policy: RegisterPolicy,
    /// Batches are packed by the CPU (GPT windows, several-column samples): every copy out of the
    /// page cache is a CPU copy, so resident shards are mapped without registering, at the start of
    /// each epoch, and read straight from the mapping.
    cpu_copies: bool,
    /// `loader.epochs`: more than one, and the first epoch already registers in the background.
    expected_epochs: u64,
    epochs_started: AtomicU64,
    registrar: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Why the budget is what it is (for the summary).
    pub(crate) budget_reason: String,
}

impl Drop for PageCache {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self
            .registrar
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = t.join();
        }
    }
}

/// Registration pace in the background: after a shard took `t` to register, the registrar rests
/// `t × REST_FACTOR`, so the driver is busy registering at most 1/(1 + REST_FACTOR) of the time
/// and copies issued meanwhile keep the rest (`UBDIRECT_REGISTER_REST` overrides it, for
/// measurements).
const REST_FACTOR: f64 = 3.0;

/// `auto` registers when at least this many epochs follow the current one.
const REGISTER_EPOCHS_LEFT: u64 = 3;

/// Total RAM from /proc/meminfo.
fn mem_total() -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Whether this process may lock memory beyond RLIMIT_MEMLOCK (CAP_IPC_LOCK, which root has).
fn privileged() -> bool {
    super::fit::may_lock_past_limit(
        &std::fs::read_to_string("/proc/self/status").unwrap_or_default(),
    )
}

/// The bytes to pin (`None`: a budget of 0) and why, within RLIMIT_MEMLOCK where that binds.
fn pinned_budget(budget: PageCacheBudget) -> Result<Option<(u64, String)>, LoadError> {
    let limit = ubdirect_ub::memlock_limit();
    let capped = !privileged() && limit != u64::MAX;
    Ok(Some(match budget {
        PageCacheBudget::Bytes(0) => return Ok(None),
        PageCacheBudget::Bytes(n) => {
            if capped && n > limit {
                return Err(LoadError::Config(format!(
                    "pool.page_cache_budget = {n} bytes is pinned memory, but RLIMIT_MEMLOCK is {limit} bytes and this process lacks CAP_IPC_LOCK. Fix: lower the budget, \"auto\", or raise the limit (`ulimit -l unlimited`, `LimitMEMLOCK=infinity`, `--ulimit memlock=-1`)"
                )));
            }
            (n, format!("{n} bytes (pool.page_cache_budget)"))
        }
        PageCacheBudget::Auto => {
            let quarter = mem_total().unwrap_or(0) / 4;
            if capped && limit < quarter {
                (
                    limit,
                    format!(
                        "auto: a quarter of RAM ({quarter} bytes) capped by RLIMIT_MEMLOCK ({limit} bytes)"
                    ),
                )
            } else {
                (quarter, format!("auto: a quarter of RAM ({quarter} bytes)"))
            }
        }
    }))
}

/// This rank's share of the node's budget of `bytes`, and why (`reason`, the node's).
fn rank_share(bytes: u64, reason: String, node: NodeShare) -> (u64, String) {
    (
        bytes / node.ranks as u64,
        format!(
            "{reason}, the node's; {} ranks of this node (LOCAL_WORLD_SIZE): this rank (local {}) pins shards i ≡ {} (mod {}), {} bytes",
            node.ranks,
            node.index,
            node.index,
            node.ranks,
            bytes / node.ranks as u64
        ),
    )
}

/// Per shard, whether it is a candidate (a file, or an object of a cache in `caches`, of this
/// rank's share where `share`, fitting in `bytes` in order); `None` when no shard is.
fn candidates(
    index: &DatasetIndex,
    files: &[Option<Arc<FileSource>>],
    sources: &[Arc<dyn Source>],
    caches: &[PathBuf],
    bytes: u64,
    share: bool,
    node: NodeShare,
) -> Option<Vec<Option<Candidate>>> {
    let page = ubdirect_ub::PAGE_SIZE as u64;
    let mut left = bytes;
    let mut shards = Vec::with_capacity(index.shards.len());
    let mut any = false;
    for (i, s) in index.shards.iter().enumerate() {
        let need = s.size.div_ceil(page) * page;
        let ours = !share || i % node.ranks == node.index;
        let backing = match (files.get(i).and_then(|f| f.as_ref()), sources.get(i)) {
            (Some(f), _) => Some(Backing::File {
                file: f.clone(),
                path: s.path.clone(),
            }),
            (None, Some(src))
                if src
                    .chunk_cache()
                    .is_some_and(|(dir, ..)| caches.contains(&dir)) =>
            {
                Some(Backing::Chunks(src.clone()))
            }
            _ => None,
        };
        match backing {
            Some(backing) if ours && s.size > 0 && need <= left => {
                left -= need;
                any = true;
                shards.push(Some(Candidate::new(backing)));
            }
            _ => shards.push(None),
        }
    }
    any.then_some(shards)
}

impl PageCache {
    /// The page cache for `files` (per shard: its io_uring file source, if it has one), or `None`
    /// when the budget is 0 or nothing qualifies.
    #[allow(clippy::too_many_arguments)] // the page cache's whole setting, passed once
    pub(crate) fn new(
        budget: PageCacheBudget,
        policy: RegisterPolicy,
        cpu_copies: bool,
        expected_epochs: u64,
        index: &DatasetIndex,
        files: &[Option<Arc<FileSource>>],
        sources: &[Arc<dyn Source>],
        device: Arc<dyn Device>,
        node: NodeShare,
    ) -> Result<Option<Self>, LoadError> {
        let Some((bytes, reason)) = pinned_budget(budget)? else {
            return Ok(None);
        };
        // A node of several ranks: the budget is the node's, and each rank pins its own share of
        // the shards (shard i by the rank with i ≡ its local index mod the ranks), so every page
        // is pinned — and its registration paid — once per node, not once per rank. Ranks read
        // the shards they do not pin through the engine (copy threads, O_DIRECT when cold).
        // Packed batches map without pinning: every rank maps every shard.
        let share = node.ranks > 1 && !cpu_copies;
        let (bytes, reason) = if share {
            rank_share(bytes, reason, node)
        } else {
            (bytes, reason)
        };
        let (caches, chunk_note) = caches_holding_the_run(index, sources);
        let reason = match chunk_note {
            Some(n) => format!("{reason}; {n}"),
            None => reason,
        };
        let Some(shards) = candidates(index, files, sources, &caches, bytes, share, node) else {
            return Ok(None);
        };
        Ok(Some(Self {
            shared: Arc::new(Shared::new(PinBudget::new(bytes), device, shards)),
            policy,
            cpu_copies,
            expected_epochs,
            epochs_started: AtomicU64::new(0),
            registrar: Mutex::new(None),
            budget_reason: reason,
        }))
    }

    /// The mappings a chunk starting now copies from.
    pub(crate) fn current(&self) -> Mapped {
        self.shared
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Registers every resident shard not registered yet, now, on this thread (for a caller that
    /// knows many epochs follow: `Loader::register_page_cache`). Returns the shards registered.
    pub(crate) fn register_now(&self) -> usize {
        let mut n = 0;
        for i in 0..self.shared.shards.len() {
            if self.shared.register(i, false) {
                n += 1;
            }
        }
        n
    }

    /// At the start of an epoch: checks every mapping against its file, maps and registers the
    /// candidates that became resident, and sets the others to fill the page cache this epoch.
    pub(crate) fn prepare(&self) -> Result<Mapped, LoadError> {
        let started = self.epochs_started.fetch_add(1, Ordering::Relaxed) + 1;
        let t0 = std::time::Instant::now();
        self.shared.recheck_all()?;
        let rechecked = t0.elapsed();
        if self.policy != RegisterPolicy::Eager {
            // A cold shard is filled into the page cache only when the run reads it again: a single
            // pass reads it with O_DIRECT, at the device's speed, leaving the cache alone
            // (docs/decisions.md, "Cold first pass").
            let reads_again = self.expected_epochs > 1 || started >= 2;
            let states = self.shared.states();
            let checked = t0.elapsed();
            // Staged mappings of the epoch before are made again below, from this epoch's checks.
            self.shared.unstage();
            for (i, (c, st)) in self.shared.shards.iter().zip(states).enumerate() {
                let (Some(c), Some(st)) = (c, st) else {
                    continue;
                };
                if self.cpu_copies && st.resident {
                    // Packed batches: a mapping without registration (no pin, no wait), and the
                    // pieces are copied out of it into the pack block — a small window is one
                    // memcpy, not a read through a staging block.
                    self.shared.map_and_publish(i, None, st.chunks);
                } else if st.resident {
                    c.set_populate(false);
                    // An object's chunks: its reads copy out of the check's mapping (or the one
                    // of the epoch before, still right) until it is registered.
                    if let Some(m) = st.chunks {
                        self.shared.stage(i, Arc::new(ShardMap::staged(m)));
                    } else if let Some(m) = st.kept {
                        self.shared.staged_kept.fetch_add(1, Ordering::Relaxed);
                        self.shared.stage(i, m);
                    }
                } else if st.cold {
                    c.fill_if(reads_again);
                    let n = if reads_again {
                        &self.shared.filled
                    } else {
                        &self.shared.cold_direct
                    };
                    n.fetch_add(1, Ordering::Relaxed);
                }
            }
            // Registration pays back only over several epochs (a copy epoch runs at 0.7–0.85 × a
            // mapped one, registering costs about a mapped epoch and slows copies meanwhile):
            // started when at least REGISTER_EPOCHS_LEFT epochs follow this one, or when the caller
            // loops past `loader.epochs` (a training loop that did not say how long it runs).
            let left = self.expected_epochs.saturating_sub(started);
            let looping = self.expected_epochs <= 1 && started >= 2;
            if self.policy == RegisterPolicy::Auto
                && !self.cpu_copies
                && (left >= REGISTER_EPOCHS_LEFT || looping)
            {
                self.start_registrar();
            }
            tracing::debug!(target: "ubdirect_loader::epoch", rechecked_s = rechecked.as_secs_f64(),
                states_s = (checked - rechecked).as_secs_f64(), rest_s = (t0.elapsed() - checked).as_secs_f64(),
                "page cache prepared");
            return Ok(self.current());
        }
        let states = self.shared.states();
        for (i, (c, st)) in self.shared.shards.iter().zip(states).enumerate() {
            let (Some(c), Some(st)) = (c, st) else {
                continue;
            };
            if st.resident {
                self.shared
                    .map_and_publish(i, Some(self.shared.device.as_ref()), st.chunks);
            } else if st.cold {
                // Fill the page cache this epoch: reads go through it (their read-ahead covers
                // small gaps).
                c.fill_if(true);
                self.shared.filled.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(self.current())
    }

    /// (cold shards filled through the page cache, cold shards read O_DIRECT and left out of it),
    /// counted per epoch.
    pub(crate) fn cold_paths(&self) -> (u64, u64) {
        (
            self.shared.filled.load(Ordering::Relaxed),
            self.shared.cold_direct.load(Ordering::Relaxed),
        )
    }

    /// Shards mapped (not registered) for CPU copies into packed batches.
    pub(crate) fn cpu_mapped(&self) -> u64 {
        self.shared.cpu_mapped.load(Ordering::Relaxed)
    }

    /// (objects mapped from their cache's chunk files, objects whose mapped chunks were evicted and
    /// that went back to cache reads).
    pub(crate) fn chunk_maps(&self) -> (u64, u64) {
        (
            self.shared.chunked.load(Ordering::Relaxed),
            self.shared.chunks_dropped.load(Ordering::Relaxed),
        )
    }

    /// Objects whose reads copied out of their chunk files' unregistered mapping, counted per epoch
    /// (until registered).
    pub(crate) fn chunks_staged(&self) -> u64 {
        self.shared.staged.load(Ordering::Relaxed)
    }

    /// Of [`PageCache::chunks_staged`], the object-epochs that read the epoch before's staged
    /// mapping again.
    pub(crate) fn chunks_staged_kept(&self) -> u64 {
        self.shared.staged_kept.load(Ordering::Relaxed)
    }

    /// Shards registered by the background registrar.
    pub(crate) fn registered_in_background(&self) -> u64 {
        self.shared.background.load(Ordering::Relaxed)
    }

    /// (mapped shards, pinned bytes, budget, registrations, seconds registering).
    pub(crate) fn stats(&self) -> (usize, u64, u64, u64, f64) {
        let b = &self.shared.budget;
        let mapped = self
            .shared
            .shards
            .iter()
            .flatten()
            .filter(|c| c.mapping().is_some())
            .count();
        (
            mapped,
            b.used(),
            b.limit(),
            b.registrations(),
            b.register_time().as_secs_f64(),
        )
    }
}

impl Shared {
    /// The pool of `shards` (`None`: not a candidate), nothing mapped yet.
    fn new(
        budget: Arc<PinBudget>,
        device: Arc<dyn Device>,
        shards: Vec<Option<Candidate>>,
    ) -> Self {
        let n = shards.len();
        Self {
            budget,
            device,
            shards,
            current: Mutex::new(Arc::new(vec![None; n])),
            stop: AtomicBool::new(false),
            background: AtomicU64::new(0),
            filled: AtomicU64::new(0),
            cold_direct: AtomicU64::new(0),
            cpu_mapped: AtomicU64::new(0),
            chunked: AtomicU64::new(0),
            chunks_dropped: AtomicU64::new(0),
            staged: AtomicU64::new(0),
            staged_kept: AtomicU64::new(0),
        }
    }

    /// At an epoch's start: checks shard `i`'s mapping against its files. A local shard that changed
    /// is a typed error; an object whose chunk was evicted or replaced is unmapped and read through
    /// its cache again (its bytes were right, their room is the cache's to reclaim), counted.
    fn recheck(&self, i: usize) -> Result<(), LoadError> {
        let Some(Some(c)) = self.shards.get(i) else {
            return Ok(());
        };
        let mut slot = c.mapped.lock().unwrap_or_else(|p| p.into_inner());
        let Some(m) = slot.as_ref() else {
            return Ok(());
        };
        if !m.is_chunked() {
            return m.check().map_err(map_err);
        }
        let why = match m.check() {
            Err(e) => Some(e.to_string()),
            Ok(()) if m.evicted() => Some("its path names another file now, or none".to_string()),
            Ok(()) => None,
        };
        if let Some(why) = why {
            *slot = None;
            drop(slot);
            self.publish(i, None);
            self.chunks_dropped.fetch_add(1, Ordering::Relaxed);
            ubdirect_ub::fallback::record(
                "object_cache_chunk_evicted",
                format!(
                    "a mapped chunk of {} was evicted or replaced ({why}): the object is read through its cache again, and mapped again once its chunks are back",
                    c.name()
                ),
            );
        }
        Ok(())
    }

    /// Each candidate not mapped or refused: its [`Candidate::state`] now (`None` for the others).
    /// Checked on several threads where objects of a chunk cache are among them: a `stat`, an
    /// `open`, an `fstat`, an `mmap` and a `cachestat` per chunk (and its sidecar, the first time
    /// in the process), one chunk after another, took tens of milliseconds of every epoch's start
    /// for 512 chunks (a local shard is one `cachestat`: checked here, in turn).
    fn states(&self) -> Vec<Option<State>> {
        let open: Vec<usize> = (0..self.shards.len())
            .filter(|&i| {
                self.shards[i].as_ref().is_some_and(|c| {
                    !c.refused.load(Ordering::Relaxed)
                        && !c.registering.load(Ordering::Acquire)
                        && c.mapping().is_none()
                })
            })
            .collect();
        let mut out: Vec<Option<State>> = (0..self.shards.len()).map(|_| None).collect();
        let got = self.on_threads(&open, |i| {
            self.shards[i].as_ref().map(|c| c.state(&self.budget))
        });
        for (i, st) in open.into_iter().zip(got) {
            out[i] = st;
        }
        out
    }

    /// At an epoch's start: [`Shared::recheck`] of every mapped shard, on several threads where
    /// objects of a chunk cache are among them (a `stat` and an `fstat` per chunk file: 2,048 chunk
    /// files one after another took milliseconds of each start).
    fn recheck_all(&self) -> Result<(), LoadError> {
        let mapped: Vec<usize> = (0..self.shards.len())
            .filter(|&i| {
                self.shards[i]
                    .as_ref()
                    .is_some_and(|c| c.mapping().is_some())
            })
            .collect();
        self.on_threads(&mapped, |i| self.recheck(i))
            .into_iter()
            .collect()
    }

    /// `f` of each of `shards`, in their order: on up to 16 threads where objects of a chunk cache
    /// are among them and their checks touch enough chunk files to pay for the threads (a thread's
    /// start and join cost about what checking [`FILES_PER_THREAD`] chunk files does), here in turn
    /// otherwise. A thread that cannot start has its part done here.
    fn on_threads<T: Send>(&self, shards: &[usize], f: impl Fn(usize) -> T + Sync) -> Vec<T> {
        let files: usize = shards.iter().map(|&i| self.chunk_files_checked(i)).sum();
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(shards.len())
            .min(files / FILES_PER_THREAD)
            .min(16);
        if threads <= 1 {
            return shards.iter().map(|&i| f(i)).collect();
        }
        let f = &f;
        std::thread::scope(|s| {
            let parts: Vec<_> = shards
                .chunks(shards.len().div_ceil(threads))
                .map(|part| {
                    let b = std::thread::Builder::new().name("ubdirect-pcheck".into());
                    (
                        part,
                        b.spawn_scoped(s, move || part.iter().map(|&i| f(i)).collect::<Vec<T>>()),
                    )
                })
                .collect();
            let mut out = Vec::with_capacity(shards.len());
            for (part, h) in parts {
                match h.map(|h| h.join()) {
                    Ok(Ok(v)) => out.extend(v),
                    // Could not start (or panicked): this part here.
                    _ => out.extend(part.iter().map(|&i| f(i))),
                }
            }
            out
        })
    }

    /// The chunk files a check of shard `i` touches: those of its mapping (registered or staged)
    /// where it has one; an object not mapped yet counts as [`FILES_PER_THREAD`] (its first check
    /// opens, maps and measures every chunk file); a local shard, none (one `cachestat`).
    fn chunk_files_checked(&self, i: usize) -> usize {
        let Some(c) = self.shards[i].as_ref() else {
            return 0;
        };
        if !matches!(c.backing, Backing::Chunks(_)) {
            return 0;
        }
        // One lock at a time (the registrar takes `mapped` on its own thread).
        let mapped = c.mapping().map(|m| m.file().files().count());
        mapped
            .or_else(|| lock(&c.staged).as_ref().map(|m| m.file().files().count()))
            .unwrap_or(FILES_PER_THREAD)
    }

    /// Maps shard `i` (registered with `device`, or for CPU copies) unless mapped or refused, and
    /// publishes it — `chunks`, an object's chunk files its check mapped unregistered, are used
    /// instead of mapping them again. False: not mapped now.
    fn map_and_publish(
        &self,
        i: usize,
        device: Option<&dyn Device>,
        chunks: Option<MappedFile>,
    ) -> bool {
        let Some(Some(c)) = self.shards.get(i) else {
            return false;
        };
        let mut slot = c.mapped.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_some() || c.refused.load(Ordering::Relaxed) {
            return false;
        }
        // Cleared on every way out, once the slot holds the outcome.
        struct Registering<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Registering<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        // Under the slot's lock: nothing else maps or registers this shard meanwhile.
        if c.registering.swap(true, Ordering::AcqRel) {
            ubdirect_ub::invariant::broken(
                "page cache registrar",
                &format!("shard {i} mapped while a mapping of it was being made"),
            );
            return false;
        }
        let _registering = Registering(&c.registering);
        let made = match (chunks, device) {
            (Some(m), Some(d)) => m.into_registered(d).map(|m| Some(ShardMap::chunks(m))),
            (Some(m), None) => Ok(Some(ShardMap::chunks(m))),
            (None, _) => c.map(device, &self.budget),
        };
        match made {
            Ok(Some(m)) => {
                c.set_populate(false);
                // Registered (or mapped in place): the staged mapping's descriptors are let go.
                lock(&c.staged).take();
                if m.is_chunked() {
                    self.chunked.fetch_add(1, Ordering::Relaxed);
                }
                let m = Arc::new(m);
                *slot = Some(m.clone());
                drop(slot);
                self.publish(i, Some(m));
                if device.is_none() {
                    self.cpu_mapped.fetch_add(1, Ordering::Relaxed);
                }
                true
            }
            Ok(None) => false,
            Err(e) => {
                c.refuse(&e);
                false
            }
        }
    }

    /// Makes the resident object `i`'s unregistered (staged) mapping `m` the one its reads copy out
    /// of, from the next chunk on, unless it was registered meanwhile; the object keeps it for the
    /// next epoch's check.
    fn stage(&self, i: usize, m: Arc<ShardMap>) {
        let Some(Some(c)) = self.shards.get(i) else {
            return;
        };
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur.get(i).is_some_and(|e| e.is_none()) {
            let mut staged = lock(&c.staged);
            // Refused, or being registered (both let the staged mapping go, under this lock, after
            // raising their flag): not staged again, or it would be held for the rest of the run.
            if c.refused.load(Ordering::Relaxed) || c.registering.load(Ordering::Acquire) {
                return;
            }
            let mut next: Vec<Option<Arc<ShardMap>>> = cur.as_ref().clone();
            next[i] = Some(m.clone());
            *cur = Arc::new(next);
            *staged = Some(m);
            self.staged.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Withdraws shard `i`'s staged mapping, if that is what its reads copy out of now.
    fn unpublish_staged(&self, i: usize) {
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur
            .get(i)
            .is_some_and(|e| e.as_ref().is_some_and(|m| m.is_staged()))
        {
            let mut next: Vec<Option<Arc<ShardMap>>> = cur.as_ref().clone();
            next[i] = None;
            *cur = Arc::new(next);
        }
    }

    /// Withdraws every staged mapping (the chunks that hold one keep it).
    fn unstage(&self) {
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur.iter().flatten().any(|m| m.is_staged()) {
            let next: Vec<Option<Arc<ShardMap>>> = cur
                .iter()
                .map(|e| e.clone().filter(|m| !m.is_staged()))
                .collect();
            *cur = Arc::new(next);
        }
    }

    /// Makes `m` the mapping chunks starting from now copy shard `i` from (`None`: read it).
    fn publish(&self, i: usize, m: Option<Arc<ShardMap>>) {
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let mut next: Vec<Option<Arc<ShardMap>>> = cur.as_ref().clone();
        if let Some(e) = next.get_mut(i) {
            *e = m;
        }
        *cur = Arc::new(next);
    }
}

/// The chunk caches that hold every object of the run read through them: the sum of those objects'
/// bytes (with each chunk's sidecar) within the cache's bound, so that nothing a mapping holds is
/// evicted by the run's own reads. With a note for the summary when a cache is used.
fn caches_holding_the_run(
    index: &DatasetIndex,
    sources: &[Arc<dyn Source>],
) -> (Vec<PathBuf>, Option<String>) {
    let mut need: Vec<(PathBuf, u64, u64)> = Vec::new(); // (dir, bytes, bound)
    for (s, src) in index.shards.iter().zip(sources) {
        let Some((dir, bound, chunk)) = src.chunk_cache() else {
            continue;
        };
        // A sidecar (and the reservation's margin) of 64 bytes per chunk, as the cache counts it.
        let bytes = s.size + 64 * s.size.div_ceil(chunk.max(1));
        match need.iter_mut().find(|(d, ..)| *d == dir) {
            Some(e) => e.1 += bytes,
            None => need.push((dir, bytes, bound)),
        }
    }
    let mut held = Vec::new();
    let mut notes = Vec::new();
    for (dir, bytes, bound) in need {
        if bytes <= bound {
            notes.push(format!(
                "the object cache {} holds the run ({bytes} of {bound} bytes): objects whose chunks are all present are mapped as shards",
                dir.display()
            ));
            held.push(dir);
        } else {
            let why = format!(
                "the object cache {} is smaller than the run ({bytes} > cache.max_bytes {bound}): its hits are reads through the copy threads, not mappings (a mapping would hold chunks the cache evicts)",
                dir.display()
            );
            ubdirect_ub::fallback::record("object_cache_not_mapped", why.clone());
            notes.push(why);
        }
    }
    let note = (!notes.is_empty()).then(|| notes.join("; "));
    (held, note)
}

fn map_err(e: MapError) -> LoadError {
    LoadError::Device(ubdirect_ub::DeviceError::Mapped(Box::new(e)))
}

/// Locks `m`, taking the value of a holder that panicked (each slot here is replaced whole).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests;
