//! The pinned-byte budget a loader's mappings share, and the memory regions (`vm.max_map_count`)
//! they hold of the process's bound.

use super::*;

/// Pinned bytes of a loader's mapped shards, bounded.
#[derive(Debug)]
pub struct PinBudget {
    pub(super) limit: u64,
    pub(super) used: AtomicU64,
    pub(super) registrations: AtomicU64,
    pub(super) register_ns: AtomicU64,
    /// Memory regions (VMAs) the mappings made within this budget hold, and their bound: shared by
    /// every budget of the process made with [`PinBudget::new`].
    pub(super) regions: Arc<RegionCount>,
}

/// Memory regions held by mappings, and their bound.
#[derive(Debug)]
pub(super) struct RegionCount {
    pub(super) held: AtomicU64,
    pub(super) limit: u64,
}

/// The process's region count: `vm.max_map_count` is a limit of the process, not of a loader, so
/// two loaders in one process (a training and an evaluation dataset) share one bound, not half
/// the limit each.
pub(super) fn process_regions() -> Arc<RegionCount> {
    static REGIONS: std::sync::OnceLock<Arc<RegionCount>> = std::sync::OnceLock::new();
    REGIONS
        .get_or_init(|| {
            Arc::new(RegionCount {
                held: AtomicU64::new(0),
                limit: default_region_limit(),
            })
        })
        .clone()
}

/// The share of `vm.max_map_count` the page-cache pool's mappings may hold: half. An object's chunk files
/// are one region each (1 MiB chunks of 64 GiB are 65,536, the kernel's default limit); the rest
/// of the process (allocator, thread stacks, CUDA, io_uring rings) keeps the other half.
pub(super) fn default_region_limit() -> u64 {
    static LIMIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(65_530)
            / 2
    })
}

impl PinBudget {
    /// A budget of `limit` bytes; its mappings and those of every other budget made this way in
    /// the process hold at most half of `vm.max_map_count` regions together.
    pub fn new(limit: u64) -> Arc<Self> {
        Self::with_regions(limit, process_regions())
    }

    /// A budget of `limit` bytes whose mappings hold at most `regions` memory regions, counted
    /// apart from the process's.
    pub fn with_region_limit(limit: u64, regions: u64) -> Arc<Self> {
        Self::with_regions(
            limit,
            Arc::new(RegionCount {
                held: AtomicU64::new(0),
                limit: regions,
            }),
        )
    }

    pub(super) fn with_regions(limit: u64, regions: Arc<RegionCount>) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicU64::new(0),
            registrations: AtomicU64::new(0),
            register_ns: AtomicU64::new(0),
            regions,
        })
    }

    /// Memory regions its mappings may hold (with the other budgets sharing its count).
    pub fn region_limit(&self) -> u64 {
        self.regions.limit
    }

    /// Memory regions its mappings hold now (with the other budgets sharing its count).
    pub fn regions(&self) -> u64 {
        self.regions.held.load(Ordering::Relaxed)
    }

    /// Whether a mapping of `files` more files would fit in the regions left now (a check before
    /// the files are opened; the mapping itself reserves them).
    pub fn regions_fit(&self, files: u64) -> bool {
        self.regions().saturating_add(files + 1) <= self.regions.limit
    }

    pub(super) fn reserve_regions(
        self: &Arc<Self>,
        n: u64,
        path: &Path,
    ) -> Result<Regions, MapError> {
        self.regions
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|t| *t <= self.regions.limit)
            })
            .map(|_| Regions {
                budget: self.clone(),
                n,
            })
            .map_err(|held| MapError::Regions {
                path: path.to_path_buf(),
                regions: n,
                held,
                limit: self.regions.limit,
            })
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes pinned now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Registrations made (each once, never on the hot path).
    pub fn registrations(&self) -> u64 {
        self.registrations.load(Ordering::Relaxed)
    }

    /// Time spent registering, in total.
    pub fn register_time(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.register_ns.load(Ordering::Relaxed))
    }

    pub(super) fn reserve(&self, n: u64) -> Result<(), (u64, u64)> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|t| *t <= self.limit)
            })
            .map(|_| ())
            .map_err(|u| (u, self.limit))
    }

    pub(super) fn release(&self, n: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                Some(u.checked_sub(n).unwrap_or_else(|| {
                    crate::invariant::broken(
                        "pin budget",
                        &format!("{n} bytes released of the {u} reserved (a release twice)"),
                    );
                    0
                }))
            });
    }
}

/// Memory regions a mapping holds of its budget's bound, given back when it is dropped.
#[derive(Debug)]
pub(super) struct Regions {
    pub(super) budget: Arc<PinBudget>,
    pub(super) n: u64,
}

impl Drop for Regions {
    fn drop(&mut self) {
        let _ = self
            .budget
            .regions
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                Some(u.checked_sub(self.n).unwrap_or_else(|| {
                    crate::invariant::broken(
                        "pin budget",
                        &format!("{} memory regions given back of the {u} held", self.n),
                    );
                    0
                }))
            });
    }
}
