//! Making a pool: its memory allocated and locked (or device memory), shown to every registrar,
//! and its slots, all in [`UbPoolBuilder::build`].

use super::*;

/// Builds a [`UbPool`]: allocation, locking, and every registration happen in [`UbPoolBuilder::build`].
pub struct UbPoolBuilder {
    pub(super) cfg: PoolConfig,
    pub(super) device: Option<Arc<dyn Device>>,
    pub(super) registrars: Vec<Arc<dyn Registrar>>,
}

impl fmt::Debug for UbPoolBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UbPoolBuilder")
            .field("cfg", &self.cfg)
            .field("registrars", &self.registrars.len())
            .finish()
    }
}

impl UbPoolBuilder {
    /// The device that provides `Pinned` registration or `Device` memory.
    pub fn device(mut self, device: Arc<dyn Device>) -> Self {
        self.device = Some(device);
        self
    }

    /// Registers every block with `registrar` at creation (e.g. an io_uring engine).
    pub fn register_with(mut self, registrar: Arc<dyn Registrar>) -> Self {
        self.registrars.push(registrar);
        self
    }

    /// Allocates, locks and registers the pool.
    pub fn build(self) -> Result<UbPool, UbError> {
        let cfg = self.cfg;
        cfg.validate()?;
        let total = cfg.block_size * cfg.block_count;
        let pool_name = cfg.name.clone();
        let id = PoolId(NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed));
        let device_name = self
            .device
            .as_ref()
            .map_or_else(|| "none".to_string(), |d| d.info().name.clone());
        let mut registrations: Vec<Box<dyn Registration>> = Vec::new();
        let mut consumers = Vec::new();

        let memory = match cfg.kind {
            MemoryKind::Host | MemoryKind::Pinned => {
                let map = locked_mapping(&cfg, total)?;
                if cfg.kind == MemoryKind::Pinned {
                    let dev = cuda_device(self.device.as_ref(), &cfg, &device_name)?;
                    // SAFETY: `map` is this pool's own allocation; it becomes the pool's memory and
                    // is unmapped only after `registrations` (this one among them) are dropped.
                    let reg = unsafe { dev.register_host(map.as_ptr(), map.len()) }.map_err(
                        |source| UbError::Device {
                            pool: pool_name.clone(),
                            source: Box::new(source),
                        },
                    )?;
                    consumers.push(reg.consumer());
                    registrations.push(reg);
                }
                Memory::Host(map)
            }
            MemoryKind::Device => {
                let dev = cuda_device(self.device.as_ref(), &cfg, &device_name)?;
                Memory::Device(device_memory(dev.as_ref(), total, &pool_name)?)
            }
        };

        let (host_base, device_base) = match &memory {
            Memory::Host(m) => (Some(m.as_ptr() as usize), None),
            Memory::Device(d) => (None, Some(d.device_ptr())),
        };
        let blocks = block_views(&cfg, host_base, device_base);
        let desc = PoolDescriptor {
            id,
            name: &cfg.name,
            kind: cfg.kind,
            block_size: cfg.block_size,
            blocks: &blocks,
        };
        if let Err(e) = register_all(&self.registrars, &desc, &mut registrations, &mut consumers) {
            // Registrations before the memory they cover (locals would drop the other way round:
            // `memory` was declared after `registrations`): nothing is unregistered after unmap.
            drop(registrations);
            drop(memory);
            return Err(e);
        }
        let registration_count = registrations.len() as u64;
        count_registrations(&pool_name, &consumers);
        let gauges = pool_gauges(pool_name.clone());
        gauges.free.set(cfg.block_count as f64);
        let slots = Slots::new(&pool_name, cfg.block_count);
        tracing::debug!(pool = %pool_name, kind = %cfg.kind, bytes = total, registrations = registration_count, "pool created");
        Ok(UbPool {
            inner: Arc::new(PoolInner {
                id,
                sem: Semaphore::new(cfg.block_count),
                cfg,
                device_name,
                host_base,
                device_base,
                slots: Mutex::new(slots),
                registrations: Mutex::new(registrations),
                registration_count,
                consumers,
                acquires: AtomicU64::new(0),
                acquire_wait_ns: AtomicU64::new(0),
                acquire_wait_max_ns: AtomicU64::new(0),
                gauges,
                memory,
            }),
        })
    }
}

/// The pool's host memory: `total` bytes mapped, bound to the configured NUMA node, and locked
/// (unless `cfg.lock` is off).
fn locked_mapping(cfg: &PoolConfig, total: usize) -> Result<HostMapping, UbError> {
    let pool_name = &cfg.name;
    let mut map = HostMapping::new(total).map_err(|source| UbError::Os {
        pool: pool_name.clone(),
        op: "mmap",
        source,
    })?;
    if let Some(node) = cfg.numa_node {
        map.bind_numa(node, cfg.numa_preferred)
            .map_err(|source| UbError::Os {
                pool: pool_name.clone(),
                op: "mbind (NUMA node binding)",
                source,
            })?;
    }
    if cfg.lock
        && let Err(source) = map.lock()
    {
        return Err(lock_error(pool_name.clone(), total, source));
    }
    Ok(map)
}

/// A failed `mlock` of `total` bytes: `MemlockLimit` when the limit explains it, else the OS error.
fn lock_error(pool_name: String, total: usize, source: std::io::Error) -> UbError {
    let limit = crate::sys::memlock_limit();
    let code = source.raw_os_error();
    let limit_hit = matches!(code, Some(libc::ENOMEM) | Some(libc::EPERM))
        && (limit == 0 || (limit != u64::MAX && total as u64 > limit / 2));
    if limit_hit || code == Some(libc::EPERM) {
        UbError::MemlockLimit {
            pool: pool_name,
            requested: total,
            limit,
        }
    } else {
        UbError::Os {
            pool: pool_name,
            op: "mlock",
            source,
        }
    }
}

/// The CUDA device a `Pinned` or `Device` pool needs, or `KindUnsupported` naming the one given.
fn cuda_device<'a>(
    device: Option<&'a Arc<dyn Device>>,
    cfg: &PoolConfig,
    device_name: &str,
) -> Result<&'a Arc<dyn Device>, UbError> {
    match device {
        Some(d) if d.info().kind == DeviceKind::Cuda => Ok(d),
        _ => Err(UbError::KindUnsupported {
            pool: cfg.name.clone(),
            kind: cfg.kind,
            device: device_name.to_string(),
        }),
    }
}

/// The `Device` pool's memory: `total` bytes allocated on `dev`.
fn device_memory(
    dev: &dyn Device,
    total: usize,
    pool_name: &str,
) -> Result<Box<dyn DeviceMemory>, UbError> {
    dev.alloc_device(total).map_err(|source| UbError::Device {
        pool: pool_name.to_string(),
        source: Box::new(source),
    })
}

/// Every block's addresses, in index order, from the pool's host or device base.
fn block_views(
    cfg: &PoolConfig,
    host_base: Option<usize>,
    device_base: Option<u64>,
) -> Vec<BlockView> {
    (0..cfg.block_count)
        .map(|i| BlockView {
            index: i as u32,
            host_ptr: host_base.map(|b| (b + i * cfg.block_size) as *mut u8),
            device_ptr: device_base.map(|b| b + (i * cfg.block_size) as u64),
            len: cfg.block_size,
        })
        .collect()
}

/// Shows the pool to every registrar in turn, keeping each registration and its consumer.
fn register_all(
    registrars: &[Arc<dyn Registrar>],
    desc: &PoolDescriptor<'_>,
    registrations: &mut Vec<Box<dyn Registration>>,
    consumers: &mut Vec<String>,
) -> Result<(), UbError> {
    for r in registrars {
        let reg = r.register(desc).map_err(|source| UbError::Registration {
            pool: desc.name.to_string(),
            consumer: r.consumer(),
            source,
        })?;
        consumers.push(reg.consumer());
        registrations.push(reg);
    }
    Ok(())
}

/// Counts each registration the pool was made with, by consumer.
fn count_registrations(pool_name: &str, consumers: &[String]) {
    for c in consumers {
        metrics::counter!("ubdirect_ub_registrations_total", "pool" => pool_name.to_string(), "consumer" => c.clone())
            .increment(1);
    }
}

/// The pool's block-state gauges and acquire-wait histogram, labelled with its name.
fn pool_gauges(name: String) -> Gauges {
    Gauges {
        free: metrics::gauge!("ubdirect_ub_blocks", "pool" => name.clone(), "state" => "free"),
        lent: metrics::gauge!("ubdirect_ub_blocks", "pool" => name.clone(), "state" => "lent"),
        in_flight: metrics::gauge!("ubdirect_ub_blocks", "pool" => name.clone(), "state" => "in_flight"),
        orphaned: metrics::gauge!("ubdirect_ub_blocks", "pool" => name.clone(), "state" => "orphaned"),
        acquire_wait: metrics::histogram!("ubdirect_ub_acquire_wait_seconds", "pool" => name),
    }
}
