//! The page cache as a pool: shards that fit `pool.page_cache_budget` are read through the page
//! cache in their first epoch (so they become resident), then mapped read-only and registered once
//! with the device at the start of an epoch — never on the hot path — and their batches are copied
//! by the device straight out of the mapping. Between epochs every mapping is checked against the
//! file it was made from (size, mtime, inode): a changed shard is a typed error.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use ubdirect_nvme::FileSource;
use ubdirect_ub::{Device, MapError, MappedFile, PinBudget};

use super::LoadError;
use crate::config::PageCacheBudget;
use crate::index::DatasetIndex;

/// Per shard, the mapping this epoch copies from (if any).
pub(crate) type Mapped = Arc<Vec<Option<Arc<MappedFile>>>>;

struct Candidate {
    file: Arc<FileSource>,
    path: PathBuf,
    mapped: Mutex<Option<Arc<MappedFile>>>,
    /// The device refused it once: read through the engine from then on.
    refused: std::sync::atomic::AtomicBool,
}

/// The loader's registered page cache.
pub(crate) struct PageCache {
    budget: Arc<PinBudget>,
    device: Arc<dyn Device>,
    shards: Vec<Option<Candidate>>,
    /// Why the budget is what it is (for the summary).
    pub(crate) budget_reason: String,
}

/// Total RAM from /proc/meminfo.
fn mem_total() -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Whether this process may lock memory beyond RLIMIT_MEMLOCK (root; CAP_IPC_LOCK is not checked
/// separately).
fn privileged() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

impl PageCache {
    /// The page cache for `files` (per shard: its io_uring file source, if it has one), or `None`
    /// when the budget is 0 or nothing qualifies.
    pub(crate) fn new(
        budget: PageCacheBudget,
        index: &DatasetIndex,
        files: &[Option<Arc<FileSource>>],
        device: Arc<dyn Device>,
    ) -> Result<Option<Self>, LoadError> {
        let limit = ubdirect_ub::memlock_limit();
        let capped = !privileged() && limit != u64::MAX;
        let (bytes, reason) = match budget {
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
        };
        let page = ubdirect_ub::PAGE_SIZE as u64;
        let mut left = bytes;
        let mut shards = Vec::with_capacity(index.shards.len());
        let mut any = false;
        for (s, f) in index.shards.iter().zip(files) {
            let need = s.size.div_ceil(page) * page;
            match f {
                Some(f) if s.size > 0 && need <= left => {
                    left -= need;
                    any = true;
                    shards.push(Some(Candidate {
                        file: f.clone(),
                        path: s.path.clone(),
                        mapped: Mutex::new(None),
                        refused: std::sync::atomic::AtomicBool::new(false),
                    }));
                }
                _ => shards.push(None),
            }
        }
        if !any {
            return Ok(None);
        }
        Ok(Some(Self {
            budget: PinBudget::new(bytes),
            device,
            shards,
            budget_reason: reason,
        }))
    }

    /// At the start of an epoch: checks every mapping against its file, maps and registers the
    /// candidates that became resident, and sets the others to fill the page cache this epoch.
    pub(crate) fn prepare(&self) -> Result<Mapped, LoadError> {
        use std::sync::atomic::Ordering;
        let mut out = Vec::with_capacity(self.shards.len());
        for c in &self.shards {
            let Some(c) = c else {
                out.push(None);
                continue;
            };
            let mut slot = c.mapped.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(m) = slot.as_ref() {
                m.check().map_err(map_err)?;
                out.push(Some(m.clone()));
                continue;
            }
            if c.refused.load(Ordering::Relaxed) {
                out.push(None);
                continue;
            }
            if c.file.fully_resident() {
                match MappedFile::open(&c.path, self.device.as_ref(), &self.budget) {
                    Ok(m) => {
                        c.file.set_populate(false);
                        let m = Arc::new(m);
                        *slot = Some(m.clone());
                        out.push(Some(m));
                        continue;
                    }
                    Err(e) => {
                        c.refused.store(true, Ordering::Relaxed);
                        c.file.set_populate(false);
                        ubdirect_ub::fallback::record(
                            "page_cache_not_mapped",
                            format!("{e}: read through the engine instead"),
                        );
                    }
                }
            } else {
                // Fill the page cache this epoch: reads go through it, and the kernel reads the rest
                // of the file (headers, gaps) in the background.
                c.file.set_populate(true);
                if let Err(e) = c.file.prefetch() {
                    ubdirect_ub::fallback::record("page_cache_prefetch", e.to_string());
                }
            }
            out.push(None);
        }
        Ok(Arc::new(out))
    }

    /// (mapped shards, pinned bytes, budget, registrations, seconds registering).
    pub(crate) fn stats(&self) -> (usize, u64, u64, u64, f64) {
        let mapped = self
            .shards
            .iter()
            .flatten()
            .filter(|c| c.mapped.lock().is_ok_and(|m| m.is_some()))
            .count();
        (
            mapped,
            self.budget.used(),
            self.budget.limit(),
            self.budget.registrations(),
            self.budget.register_time().as_secs_f64(),
        )
    }
}

fn map_err(e: MapError) -> LoadError {
    LoadError::Device(ubdirect_ub::DeviceError::Mapped(Box::new(e)))
}
