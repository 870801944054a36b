//! The pools fitted to the machine they land on (since 2026-12-07; before, a 6 MB dataset locked
//! 1.08 GB of pools, and a default RLIMIT_MEMLOCK of 8 MiB failed the default config after its
//! synthetic dataset was written):
//!
//! - **the dataset**: where an epoch is small, the `0 = auto` depths hold its reads and chunks and
//!   no more ([`EpochShape`], taken from the plans of the first epochs);
//! - **the memory available** (`MemAvailable`, within the cgroup's `memory.max`): auto depths shrink
//!   to fit half of it (counted: `pools_fit_memory`); sizes set by hand that exceed it all are an
//!   error naming the keys, raised before anything is written;
//! - **RLIMIT_MEMLOCK**: the pools are locked, and registered with io_uring, only where the limit
//!   allows it or the process may lock beyond it (root, CAP_IPC_LOCK); else they are pageable and
//!   io_uring reads them by address (counted: `pools_not_locked`).
//!
//! The decisions are pure functions of [`Machine`] and the sizes, tested below.

use super::LoadError;
pub(crate) use super::resolve::EpochShape;
use super::resolve::{PoolDepths, Resolved};
use crate::planner::{PlanConfig, SampleSpace};

/// What the machine allows this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Machine {
    /// Bytes of memory available: `MemAvailable`, within the cgroup's room where it has a limit.
    pub available: u64,
    /// RLIMIT_MEMLOCK where it binds: `None` when unlimited, or when the process may lock past it.
    pub memlock: Option<u64>,
    /// Bytes this process has locked already (`VmLck`).
    pub locked: u64,
}

impl Machine {
    /// This process's machine, read from `/proc` and the cgroup file system.
    pub(crate) fn probe() -> Self {
        let limit = ubdirect_ub::memlock_limit();
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        Self {
            available: crate::formats::meminfo_bytes("MemAvailable:").min(cgroup_room()),
            memlock: (limit != u64::MAX && !may_lock_past_limit(&status)).then_some(limit),
            locked: status_kib(&status, "VmLck:").saturating_mul(1024),
        }
    }
}

/// Whether a process with `/proc/self/status` text `status` may lock memory past RLIMIT_MEMLOCK:
/// CAP_IPC_LOCK (bit 14) in its effective set, which root has.
pub(crate) fn may_lock_past_limit(status: &str) -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// A `… kB` field of `/proc/self/status`, in KiB (0 when absent).
fn status_kib(status: &str, field: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Bytes the cgroup (v2) of this process may still use: `memory.max - memory.current`;
/// `u64::MAX` where there is no limit or no cgroup file system.
fn cgroup_room() -> u64 {
    let read = |name: &str| {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{name}"))
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
    };
    match (read("memory.max"), read("memory.current")) {
        (Some(max), Some(cur)) => max.saturating_sub(cur),
        _ => u64::MAX,
    }
}

/// Samples up to which the shape is taken from plans at open (planning them costs ~1 µs a sample;
/// a larger dataset fills the default depths anyway).
const SHAPE_MAX_SAMPLES: u64 = 1 << 17;

/// The shape of this rank's first `epochs` epochs (at most 2), where the space is small enough to
/// plan them at open; `None` for a larger one or a plan that fails (its error comes at its
/// epoch's start, as without this).
pub(crate) fn epoch_shape(
    space: &SampleSpace<'_>,
    cfg: &PlanConfig,
    epochs: u64,
    rank: usize,
    world: usize,
) -> Option<EpochShape> {
    if space.len() > SHAPE_MAX_SAMPLES || space.is_empty() {
        return None;
    }
    let mut shape = EpochShape {
        reads: 0,
        chunk_reads: 0,
        chunks: 0,
    };
    for epoch in 0..epochs.clamp(1, 2) {
        let plan = crate::planner::plan(space, cfg, epoch, rank, world, 0).ok()?;
        shape.reads = shape
            .reads
            .max(plan.chunks.iter().map(|c| c.reads.len()).sum());
        shape.chunk_reads = shape
            .chunk_reads
            .max(plan.chunks.iter().map(|c| c.reads.len()).max().unwrap_or(0));
        shape.chunks = shape.chunks.max(plan.chunks.len());
    }
    Some(shape)
}

/// The pools' host memory (what `mlock` and io_uring pin), block bytes by pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HostPools {
    /// Bytes of a staging block.
    pub staging_block: u64,
    /// Bytes of a batch block, where the batch pool is host memory.
    pub batch_block: Option<u64>,
    /// Bytes of a packing block, where there is a packing pool (blocks: `pack_blocks`).
    pub pack_block: Option<u64>,
    /// Packing blocks.
    pub pack_blocks: usize,
}

impl HostPools {
    /// The host bytes of pools of these depths.
    pub(crate) fn bytes(&self, d: &PoolDepths) -> u64 {
        let s = self.staging_block.saturating_mul(d.staging.value as u64);
        let b = self
            .batch_block
            .map_or(0, |b| b.saturating_mul(d.batch.value as u64));
        let p = self
            .pack_block
            .map_or(0, |b| b.saturating_mul(self.pack_blocks as u64));
        s.saturating_add(b).saturating_add(p)
    }
}

/// Staging and batch depths auto may go down to for the memory: a chunk's reads (host batches
/// hold them), else a few blocks to keep reads in flight.
fn floors(shape: Option<&EpochShape>, gpu_batches: bool) -> (usize, usize) {
    let staging = match shape {
        Some(s) if !gpu_batches => s.chunk_reads.max(2),
        _ => 8,
    };
    (staging, 3)
}

/// Shrinks the auto depths of `d` (`auto.0`: staging, `auto.1`: batch) until the pools fit half of
/// `available` (the rest is the training process's), staging first, never below the floors; says
/// so in each shrunk key's reason. Returns whether it shrank. An error where the pools exceed all
/// of `available` even so, naming the keys that size them.
pub(crate) fn fit_memory(
    d: &mut PoolDepths,
    pools: &HostPools,
    auto: (bool, bool),
    shape: Option<&EpochShape>,
    gpu_batches: bool,
    available: u64,
) -> Result<bool, LoadError> {
    let budget = available / 2;
    let (floor_s, floor_b) = floors(shape, gpu_batches);
    let before = (d.staging.value, d.batch.value);
    while pools.bytes(d) > budget {
        let can_s = auto.0 && d.staging.value > floor_s;
        let can_b = auto.1 && pools.batch_block.is_some() && d.batch.value > floor_b;
        let staging_bytes = pools.staging_block * d.staging.value as u64;
        let batch_bytes = pools.batch_block.unwrap_or(0) * d.batch.value as u64;
        if can_s && (!can_b || staging_bytes >= batch_bytes) {
            d.staging.value -= 1;
        } else if can_b {
            d.batch.value -= 1;
        } else {
            break;
        }
    }
    let shrunk = (d.staging.value, d.batch.value) != before;
    let note = |r: &mut Resolved, from: usize| {
        if r.value != from {
            r.why = format!(
                "{}; lowered from {from} to fit half of the {available} bytes of memory available",
                r.why
            );
        }
    };
    note(&mut d.staging, before.0);
    note(&mut d.batch, before.1);
    d.cold.value = d.cold.value.min(d.staging.value);
    let need = pools.bytes(d);
    if need > available {
        let mut terms = vec![format!(
            "pool.staging_blocks × pool.staging_block_size = {} × {}",
            d.staging.value, pools.staging_block
        )];
        if let Some(b) = pools.batch_block {
            terms.push(format!(
                "pool.batch_blocks × pool.batch_block_size = {} × {b}",
                d.batch.value
            ));
        }
        if let Some(b) = pools.pack_block {
            terms.push(format!(
                "packing blocks × pool.batch_block_size = {} × {b}",
                pools.pack_blocks
            ));
        }
        return Err(LoadError::Config(format!(
            "the pools need {need} bytes of host memory ({}), more than the {available} bytes this machine has available: lower those keys",
            terms.join(", ")
        )));
    }
    Ok(shrunk)
}

/// Whether the pools are locked and registered with io_uring, and what to say where not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Locking {
    /// `mlock` the pools' host memory.
    pub lock: bool,
    /// Register the staging pool as io_uring fixed buffers (pins it, against the same limit).
    pub register: bool,
    /// The fallback's detail where either is off.
    pub why: Option<String>,
}

/// Locking for pools of `host_bytes` (staging: `staging_bytes`) on `m`, one of `ranks` ranks of the
/// node: `mlock` counts against RLIMIT_MEMLOCK per process (with what it locked already), io_uring's
/// registration per user (every rank of the node registers its staging pool).
pub(crate) fn locking(host_bytes: u64, staging_bytes: u64, m: &Machine, ranks: usize) -> Locking {
    let Some(limit) = m.memlock else {
        return Locking {
            lock: true,
            register: true,
            why: None,
        };
    };
    let lock = m.locked.saturating_add(host_bytes) <= limit;
    let register = staging_bytes.saturating_mul(ranks.max(1) as u64) <= limit;
    let why = (!lock || !register).then(|| {
        let what = match (lock, register) {
            (false, false) => {
                "the pools are pageable (not locked) and io_uring reads them by address (no fixed buffers)"
            }
            (false, true) => "the pools are pageable (not locked)",
            _ => "io_uring reads the staging pool by address (no fixed buffers)",
        };
        format!(
            "RLIMIT_MEMLOCK is {limit} bytes and this process lacks CAP_IPC_LOCK: the pools hold {host_bytes} bytes ({staging_bytes} staging, {ranks} rank(s) of this node), so {what}; for locked pools raise the limit (`ulimit -l unlimited`, `LimitMEMLOCK=infinity`, docker `--ulimit memlock=-1`) or make the pools smaller (docs/tuning.md)"
        )
    });
    Locking {
        lock,
        register,
        why,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depths(staging: usize, batch: usize) -> PoolDepths {
        let r = |key, value| Resolved {
            key,
            value,
            why: "auto".into(),
        };
        PoolDepths {
            staging: r("pool.staging_blocks", staging),
            batch: r("pool.batch_blocks", batch),
            cold: r("pool.cold_staging_blocks", staging),
        }
    }

    const MIB: u64 = 1 << 20;

    fn host(batch: Option<u64>) -> HostPools {
        HostPools {
            staging_block: 4 * MIB,
            batch_block: batch,
            pack_block: None,
            pack_blocks: 0,
        }
    }

    #[test]
    fn capabilities_are_read_from_the_effective_set() {
        assert!(may_lock_past_limit("Name:\tx\nCapEff:\t000001ffffffffff\n"));
        assert!(may_lock_past_limit("CapEff:\t0000000000004000\n"));
        assert!(!may_lock_past_limit("CapEff:\t0000000000000000\n"));
        assert!(!may_lock_past_limit("CapEff:\t0000000000003fff\n"));
        assert!(!may_lock_past_limit("no such line\n"));
        assert_eq!(status_kib("VmLck:\t    1024 kB\n", "VmLck:"), 1024);
    }

    #[test]
    fn pools_lock_where_the_limit_allows_and_say_why_where_not() {
        let m = |memlock, locked| Machine {
            available: 1 << 40,
            memlock,
            locked,
        };
        let all = Locking {
            lock: true,
            register: true,
            why: None,
        };
        assert_eq!(locking(1 << 30, 1 << 29, &m(None, 0), 8), all);
        assert_eq!(locking(4 * MIB, 4 * MIB, &m(Some(8 * MIB), 0), 1), all);
        // What the process locked already counts.
        let l = locking(4 * MIB, 4 * MIB, &m(Some(8 * MIB), 5 * MIB), 1);
        assert!(!l.lock && l.register, "{l:?}");
        // io_uring's charge is per user: every rank of the node registers its staging pool.
        let l = locking(4 * MIB, 4 * MIB, &m(Some(8 * MIB), 0), 4);
        assert!(l.lock && !l.register, "{l:?}");
        let l = locking(260 * MIB, 260 * MIB, &m(Some(8 * MIB), 0), 1);
        assert!(!l.lock && !l.register, "{l:?}");
        let why = l.why.expect("a reason");
        assert!(
            why.contains("RLIMIT_MEMLOCK is 8388608") && why.contains("ulimit -l"),
            "{why}"
        );
    }

    #[test]
    fn auto_depths_shrink_to_half_the_memory_and_set_ones_do_not() {
        let pools = host(Some(16 * MIB));
        // 64 × 4 MiB + 18 × 16 MiB = 544 MiB into a 400 MiB budget (800 MiB available).
        let mut d = depths(64, 18);
        let shrunk = fit_memory(&mut d, &pools, (true, true), None, false, 800 * MIB).unwrap();
        assert!(shrunk);
        assert!(pools.bytes(&d) <= 400 * MIB, "{d:?}");
        assert!(d.staging.value >= 8 && d.batch.value >= 3, "{d:?}");
        assert!(d.staging.why.contains("lowered from 64"), "{d:?}");
        assert!(d.cold.value <= d.staging.value);
        // Plenty of memory: untouched.
        let mut d = depths(64, 18);
        assert!(!fit_memory(&mut d, &pools, (true, true), None, false, 64 << 30).unwrap());
        assert_eq!((d.staging.value, d.batch.value), (64, 18));
        // Set by hand and over all of the memory: an error naming the keys.
        let mut d = depths(64, 18);
        let e = fit_memory(&mut d, &pools, (false, false), None, false, 300 * MIB).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("pool.staging_blocks × pool.staging_block_size = 64")
                && msg.contains("pool.batch_blocks"),
            "{msg}"
        );
        // Host batches never go below a chunk's reads.
        let shape = EpochShape {
            reads: 100,
            chunk_reads: 20,
            chunks: 5,
        };
        let mut d = depths(64, 18);
        let _ = fit_memory(
            &mut d,
            &host(None),
            (true, true),
            Some(&shape),
            false,
            100 * MIB,
        );
        assert_eq!(d.staging.value, 20, "{d:?}");
    }
}
