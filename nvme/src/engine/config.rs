//! The engine's configuration, its counters and what it reports it runs.

use super::*;

/// Whether files are opened with O_DIRECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DirectMode {
    /// O_DIRECT where the file system supports it; buffered otherwise (counted as a fallback).
    #[default]
    Auto,
    /// O_DIRECT or an error.
    On,
    /// Buffered reads through the page cache (chosen, not a fallback).
    Off,
}

impl std::str::FromStr for DirectMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            o => Err(format!(
                "unknown direct mode {o:?}: expected auto, on or off"
            )),
        }
    }
}

/// Engine configuration. Defaults are the documented ones (docs/configuration.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Rings, one thread each; reads are spread round-robin.
    pub rings: usize,
    /// Reads in flight per ring (the submission queue depth). Tune by sweeping; 64–128 is a start.
    pub queue_depth: u32,
    /// Ask for a kernel submission-polling thread per ring. Refused → plain submission, reported.
    pub sqpoll: bool,
    /// SQPOLL thread idle time before it sleeps.
    pub sqpoll_idle: Duration,
    /// O_DIRECT policy.
    pub direct: DirectMode,
    /// Fixed-buffer table size per ring (kernel maximum 16384).
    pub max_fixed_buffers: u32,
    /// Registered-file table size per ring.
    pub max_files: u32,
    /// Deadline for one read, submission to completion.
    pub op_timeout: Duration,
    /// Retries of a read that failed with EINTR or EAGAIN.
    pub max_retries: u32,
    /// Hand buffered (page-cache) reads to io_uring's worker threads (`IOSQE_ASYNC`), so one ring
    /// copies several at once instead of one after another in its submit call.
    pub async_buffered: bool,
    /// Threads that copy warm (page-cache) ranges into leases with `pread` (the [`Engine::copy_read`]
    /// path, which [`crate::FileSource`] takes for resident ranges); 0: one per online CPU, at most
    /// 64. io_uring's buffered reads stay for files read without it.
    pub copy_threads: usize,
    /// Warm ranges go to the copy threads (`true`) or through io_uring's buffered reads (`false`).
    pub thread_copies: bool,
    /// CPUs the engine's threads (rings and copy threads) run on — a rank's GPU's NUMA node — or
    /// empty: wherever the scheduler puts them. Refused by the kernel (a CPU set outside this
    /// process's cgroup): a recorded fallback, the threads run unpinned.
    pub cpus: Vec<usize>,
}

/// Pins the calling thread to `cpus` (nothing for an empty list); a refusal is a recorded fallback.
pub fn pin_thread(cpus: &[usize]) {
    if cpus.is_empty() {
        return;
    }
    let mut set = nix::sched::CpuSet::new();
    for &c in cpus {
        if set.set(c).is_err() {
            break;
        }
    }
    if let Err(e) = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set) {
        fallback::record(
            "cpu_affinity_refused",
            format!(
                "sched_setaffinity to CPUs {} refused ({e}): loader threads run where the scheduler puts them",
                ubdirect_ub::topology::format_cpulist(cpus)
            ),
        );
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            rings: 1,
            queue_depth: 64,
            sqpoll: false,
            sqpoll_idle: Duration::from_millis(1000),
            direct: DirectMode::Auto,
            max_fixed_buffers: 4096,
            max_files: 1024,
            op_timeout: Duration::from_secs(30),
            max_retries: 16,
            async_buffered: true,
            copy_threads: 0,
            thread_copies: true,
            cpus: Vec::new(),
        }
    }
}

impl EngineConfig {
    pub(super) fn validate(&self) -> Result<(), IoError> {
        let bad = |s: String| Err(IoError::Config(s));
        if self.rings == 0 || self.rings > 64 {
            return bad(format!("rings = {} (expected 1..=64)", self.rings));
        }
        if self.queue_depth == 0 || self.queue_depth > 4096 {
            return bad(format!(
                "queue_depth = {} (expected 1..=4096)",
                self.queue_depth
            ));
        }
        if self.max_fixed_buffers == 0 || self.max_fixed_buffers > 16384 {
            return bad(format!(
                "max_fixed_buffers = {} (expected 1..=16384)",
                self.max_fixed_buffers
            ));
        }
        if self.max_files == 0 || self.max_files > 1 << 20 {
            return bad(format!(
                "max_files = {} (expected 1..=1048576)",
                self.max_files
            ));
        }
        if self.op_timeout.is_zero() {
            return bad("op_timeout must be positive".into());
        }
        if self.copy_threads > 1024 {
            return bad(format!(
                "copy_threads = {} (expected 0..=1024; 0 = one per CPU)",
                self.copy_threads
            ));
        }
        Ok(())
    }
}

/// Counters, shared by every ring of an engine.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Reads completed successfully.
    pub reads: AtomicU64,
    /// Bytes transferred from storage (including widening for alignment).
    pub bytes: AtomicU64,
    /// Bytes delivered to callers.
    pub bytes_delivered: AtomicU64,
    /// Reads that returned fewer bytes than asked and were resubmitted for the rest.
    pub short_reads: AtomicU64,
    /// Resubmissions after EINTR/EAGAIN.
    pub retries: AtomicU64,
    /// Reads that ended in an error.
    pub errors: AtomicU64,
    /// Reads issued on O_DIRECT files.
    pub direct_reads: AtomicU64,
    /// Reads issued on buffered files.
    pub buffered_reads: AtomicU64,
    /// Reads that timed out.
    pub timeouts: AtomicU64,
    /// NVMe passthrough commands issued (one per max-transfer piece).
    pub nvme_cmds: AtomicU64,
    /// Bytes read by NVMe passthrough commands.
    pub nvme_bytes: AtomicU64,
    /// Passthrough commands issued with the buffer's address instead of its fixed-buffer index (the
    /// kernel refused the fixed buffer; see the `nvme_fixed_buffer_refused` fallback).
    pub nvme_cmds_unfixed: AtomicU64,
    /// Reads into a pool not registered with the engine (pageable memory, read by address: the
    /// loader's pools where RLIMIT_MEMLOCK is below them).
    pub unregistered_reads: AtomicU64,
}

/// What the engine actually runs, for summaries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineReport {
    /// Rings (threads).
    pub rings: usize,
    /// Queue depth per ring.
    pub queue_depth: u32,
    /// SQPOLL asked for.
    pub sqpoll_requested: bool,
    /// SQPOLL running on every ring.
    pub sqpoll_active: bool,
    /// Why SQPOLL is not running, where it was asked for.
    pub sqpoll_refused: Option<String>,
    /// Files opened O_DIRECT.
    pub direct_files: u64,
    /// Files opened buffered because the file system has no direct I/O (fallback).
    pub buffered_fallback_files: u64,
    /// Files opened buffered by config.
    pub buffered_files: u64,
}
