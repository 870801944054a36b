//! SMC regions: memory the server exports (`[serve.regions.*]`), in host memory (a one-block UB
//! pool, registered with the RDMA device when there is one, or heap memory as a recorded fallback) or
//! in GPU memory, and the one-sided window a peer's queue pair may address.

use std::sync::Arc;

use ubdirect_ub::{Lease, MemoryKind, PoolConfig, UbPool};

use super::RdmaDev;
use super::config::{RegionConfig, ServerConfig};

/// Every configured region, checked and allocated (zero-filled), with its window on `rdma`.
pub(super) fn build_regions(
    cfg: &ServerConfig,
    rdma: Option<&RdmaDev>,
) -> std::io::Result<Vec<Region>> {
    let mut regions = Vec::new();
    for r in &cfg.regions {
        if r.key.len() < 8 || r.size == 0 || r.size > 1 << 40 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "serve: region {:?} needs a key of >= 8 bytes and a size in 1 B ..= 1 TiB",
                    r.name
                ),
            ));
        }
        // Host regions are exposed to peers' queue pairs one-sided: a read-only memory region,
        // and a read-write one when the region is writable (the key a peer gets follows its
        // token's access).
        #[cfg(feature = "rdma")]
        let region_registrar = rdma.map(|d| d.window_registrar(r.writable));
        #[cfg(not(feature = "rdma"))]
        let region_registrar: Option<Arc<dyn ubdirect_ub::Registrar>> = None;
        let mem = match r.gpu {
            None => RegionMem::host(r, region_registrar)?,
            Some(ordinal) => Region::gpu(r, ordinal, cfg.max_request as usize).map_err(|e| {
                std::io::Error::other(format!("serve: region {:?} on gpu {ordinal}: {e}", r.name))
            })?,
        };
        let window = window(rdma, &mem);
        regions.push(Region {
            cfg: r.clone(),
            mem,
            window,
        });
    }
    Ok(regions)
}

/// A host region's window on the server's RDMA device: (address, read-only rkey, read-write rkey
/// when the registration allows writes). None for GPU and heap regions, and without RDMA.
#[cfg(feature = "rdma")]
fn window(rdma: Option<&RdmaDev>, mem: &RegionMem) -> Option<(u64, u32, Option<u32>)> {
    match (rdma, mem) {
        (Some(d), RegionMem::Host { bytes, .. }) => {
            let b = bytes.read().unwrap_or_else(|p| p.into_inner());
            match &*b {
                HostBytes::Block(l) => d
                    .window(l, false)
                    .map(|(addr, ro)| (addr, ro, d.window(l, true).map(|w| w.1))),
                HostBytes::Heap(_) => None,
            }
        }
        _ => None,
    }
}

#[cfg(not(feature = "rdma"))]
fn window(_: Option<&RdmaDev>, _: &RegionMem) -> Option<(u64, u32, Option<u32>)> {
    None
}

/// An exported region: its settings, its memory and its one-sided window.
pub(super) struct Region {
    pub(super) cfg: RegionConfig,
    pub(super) mem: RegionMem,
    /// Where peers' RDMA queue pairs may address it one-sided: (address, read-only rkey,
    /// read-write rkey when writable). Host regions in a UB pool on a server with RDMA.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(super) window: Option<(u64, u32, Option<u32>)>,
}

/// A host region's bytes: one block of a UB pool (page-aligned, locked, registered with the server's
/// RDMA device when there is one), or — when no such pool can be made (the memlock limit) — heap
/// memory, a recorded fallback (`smc_region_heap`).
pub(super) enum HostBytes {
    Block(Lease),
    Heap(Vec<u8>),
}

impl HostBytes {
    pub(super) fn get(&self, r: std::ops::Range<usize>) -> Result<&[u8], String> {
        let b = match self {
            HostBytes::Block(l) => l.as_slice().map_err(|e| e.to_string())?,
            HostBytes::Heap(v) => v,
        };
        b.get(r.clone())
            .ok_or_else(|| format!("{r:?} is outside the region's memory"))
    }

    pub(super) fn get_mut(&mut self, r: std::ops::Range<usize>) -> Result<&mut [u8], String> {
        let b = match self {
            HostBytes::Block(l) => l.as_mut_slice().map_err(|e| e.to_string())?,
            HostBytes::Heap(v) => v,
        };
        b.get_mut(r.clone())
            .ok_or_else(|| format!("{r:?} is outside the region's memory"))
    }
}

/// Where a region's bytes live.
pub(super) enum RegionMem {
    /// Host memory. Writes are received straight into it from the socket (the write lock is held
    /// only for each nonblocking receive, never across a wait).
    Host {
        // Field order: the lease goes back before its pool.
        bytes: std::sync::RwLock<HostBytes>,
        _pool: Option<UbPool>,
    },
    /// Device (GPU) memory: copies on a stream of its own through registered staging blocks,
    /// batched and polled (`gpu_region.rs`).
    Gpu(crate::gpu_region::GpuRegion),
}

impl Region {
    fn gpu(cfg: &RegionConfig, ordinal: usize, staging: usize) -> Result<RegionMem, String> {
        let sel = ubdirect_ub::select_device(ubdirect_ub::DeviceSelection::Cuda, ordinal)
            .map_err(|e| e.to_string())?;
        crate::gpu_region::GpuRegion::new(&cfg.name, sel.device, cfg.size as usize, staging)
            .map(RegionMem::Gpu)
    }
}

impl RegionMem {
    /// Host memory for region `r`: a one-block UB pool (locked; registered with `registrar`, the
    /// server's RDMA device, when given), or — for a region larger than a quarter of the machine's
    /// memory, or when the pool cannot be made — pageable heap memory (a recorded fallback).
    fn host(
        r: &RegionConfig,
        registrar: Option<Arc<dyn ubdirect_ub::Registrar>>,
    ) -> std::io::Result<RegionMem> {
        let (name, size) = (&r.name, r.size);
        let heap = |why: String| -> std::io::Result<RegionMem> {
            let v = zeroed_region(r)?;
            ubdirect_ub::fallback::record(
                "smc_region_heap",
                format!(
                    "smc region {name:?}: {why}: held in pageable heap memory, not registered \
                     with a transport"
                ),
            );
            Ok(RegionMem::Host {
                bytes: std::sync::RwLock::new(HostBytes::Heap(v)),
                _pool: None,
            })
        };
        if size > machine_memory() / 4 {
            return heap(format!(
                "{size} bytes is over a quarter of this machine's memory"
            ));
        }
        let block = (size as usize).div_ceil(4096) * 4096;
        let mut b = UbPool::builder(PoolConfig::new(
            format!("smc-region-{name}"),
            block,
            1,
            MemoryKind::Host,
        ));
        if let Some(r) = registrar {
            b = b.register_with(r);
        }
        // Anonymous memory: zero-filled, as regions start.
        match b.build().map(|p| (p.try_acquire(), p)) {
            Ok((Some(l), pool)) => Ok(RegionMem::Host {
                bytes: std::sync::RwLock::new(HostBytes::Block(l)),
                _pool: Some(pool),
            }),
            Ok((None, _)) => heap("its pool has no free block".into()),
            Err(e) => heap(format!("no UB pool block of {block} bytes ({e})")),
        }
    }

    /// Copies `data` into a host region at `offset` (a GPU region is served by its copy stream).
    pub(super) fn write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        let o = offset as usize;
        match self {
            RegionMem::Host { bytes, .. } => {
                let mut m = bytes.write().unwrap_or_else(|p| p.into_inner());
                m.get_mut(o..o + data.len())?.copy_from_slice(data);
                Ok(())
            }
            RegionMem::Gpu(_) => Err("a GPU region is served by its copy stream".into()),
        }
    }
}

/// A host region's memory, zeroed, or an error when the machine cannot hold it (instead of the
/// allocation failure that would abort the process).
fn zeroed_region(r: &RegionConfig) -> std::io::Result<Vec<u8>> {
    let too_big = |why: String| {
        std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!("serve: region {:?} of {} bytes: {why}", r.name, r.size),
        )
    };
    let memory = machine_memory();
    if r.size > memory {
        return Err(too_big(format!(
            "more than this machine's memory and swap ({memory} bytes)"
        )));
    }
    let n = usize::try_from(r.size).map_err(|_| too_big("not addressable".into()))?;
    // Reserved first (an error, not an abort, when refused), then filled lazily by zero pages.
    let mut probe = Vec::<u8>::new();
    probe
        .try_reserve_exact(n)
        .map_err(|e| too_big(e.to_string()))?;
    drop(probe);
    Ok(vec![0u8; n])
}

/// `MemTotal` + `SwapTotal` of `/proc/meminfo`, in bytes (`u64::MAX` when it cannot be read).
fn machine_memory() -> u64 {
    let Ok(m) = std::fs::read_to_string("/proc/meminfo") else {
        return u64::MAX;
    };
    let kib = |key: &str| {
        m.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
    };
    match (kib("MemTotal:"), kib("SwapTotal:")) {
        (Some(a), b) => a.saturating_add(b.unwrap_or(0)).saturating_mul(1024),
        _ => u64::MAX,
    }
}
