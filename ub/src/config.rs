//! Pool configuration.

use std::fmt;

/// Where a pool's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Page-aligned anonymous host memory, locked with `mlock`, optionally bound to a NUMA node.
    Host,
    /// Host memory as [`MemoryKind::Host`], additionally page-locked for CUDA with
    /// `cuMemHostRegister` (portable, not write-combined, so the CPU reads it at full speed).
    Pinned,
    /// GPU memory, allocated once for the whole pool.
    Device,
}

impl MemoryKind {
    /// Whether the CPU can address this memory.
    pub fn is_host_visible(self) -> bool {
        matches!(self, MemoryKind::Host | MemoryKind::Pinned)
    }

    /// Stable lowercase name, as used in configs and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryKind::Host => "host",
            MemoryKind::Pinned => "pinned",
            MemoryKind::Device => "device",
        }
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for MemoryKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "host" => Ok(MemoryKind::Host),
            "pinned" => Ok(MemoryKind::Pinned),
            "device" => Ok(MemoryKind::Device),
            other => Err(format!(
                "unknown memory kind {other:?}: expected host, pinned or device"
            )),
        }
    }
}

/// What a pool is made from. Validated by [`PoolConfig::validate`] before anything is allocated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Name used in metrics, logs and errors.
    pub name: String,
    /// Bytes per block; a non-zero multiple of 4096.
    pub block_size: usize,
    /// Number of blocks; at least one.
    pub block_count: usize,
    /// Where the memory lives.
    pub kind: MemoryKind,
    /// NUMA node to bind host memory to (`mbind(MPOL_BIND)`); `None` leaves placement to the kernel.
    pub numa_node: Option<u32>,
    /// With `numa_node`: prefer the node (`MPOL_PREFERRED`: other nodes when it has no free
    /// memory) instead of binding to it — for placement the loader chose, not the user.
    pub numa_preferred: bool,
    /// Host memory (`Host`, `Pinned`) locked with `mlock` at creation (the default: every page
    /// resident, none swapped). `false` leaves it pageable — for a process whose RLIMIT_MEMLOCK
    /// is below the pool and that lacks CAP_IPC_LOCK; `Pinned` memory is still page-locked by CUDA,
    /// which does not count against the limit.
    pub lock: bool,
}

impl PoolConfig {
    /// A host pool of `block_count` blocks of `block_size` bytes.
    pub fn new(
        name: impl Into<String>,
        block_size: usize,
        block_count: usize,
        kind: MemoryKind,
    ) -> Self {
        Self {
            name: name.into(),
            block_size,
            block_count,
            kind,
            numa_node: None,
            numa_preferred: false,
            lock: true,
        }
    }

    /// Total bytes the pool holds.
    pub fn total_bytes(&self) -> Option<usize> {
        self.block_size.checked_mul(self.block_count)
    }

    /// Refuses configurations that cannot make a pool.
    pub fn validate(&self) -> Result<(), crate::UbError> {
        use crate::UbError::InvalidConfig;
        let bad = |reason: String| {
            Err(InvalidConfig {
                pool: self.name.clone(),
                reason,
            })
        };
        if self.block_count == 0 {
            return bad("block_count is 0: a pool needs at least one block".into());
        }
        if self.block_size == 0 || !self.block_size.is_multiple_of(crate::PAGE_SIZE) {
            return bad(format!(
                "block_size {} is not a non-zero multiple of {}",
                self.block_size,
                crate::PAGE_SIZE
            ));
        }
        if self.block_count > u32::MAX as usize {
            return bad(format!(
                "block_count {} exceeds {}",
                self.block_count,
                u32::MAX
            ));
        }
        if self.block_size > 1 << 30 {
            return bad(format!(
                "block_size {} exceeds 1 GiB, the largest buffer io_uring registers",
                self.block_size
            ));
        }
        match self.total_bytes() {
            None => bad("block_size * block_count overflows".into()),
            Some(t) if t > isize::MAX as usize => bad("pool larger than the address space".into()),
            Some(_) => Ok(()),
        }
    }
}
