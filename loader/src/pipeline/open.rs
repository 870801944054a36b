//! Building a [`Loader`] from a run configuration, step by step: where this rank runs, the runtime
//! and the engine, the dataset opened through the shard layer (and GPT samples or extra columns
//! built over its index), the pools (registered once), the page cache and the planner's settings.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ubdirect_nvme::Engine;
use ubdirect_ub::{Device, MemoryKind, PoolConfig, UbPool, select_device};

use super::{
    Inner, LoadError, Loader, LoaderRuntime, LoaderState, LoaderStats, PACK_BLOCKS, ReadDevices,
    fit, pagecache, plan_settings, resolve,
};
use crate::RunConfig;
use crate::formats::index::DatasetIndex;
use crate::gpt::{GptSamples, GptSettings};
use crate::planner::PlanConfig;
use crate::shards::Opened;

/// Rank, world size and device ordinal: from the config, else torchrun's environment.
fn placement(cfg: &RunConfig) -> Result<(usize, usize, usize), LoadError> {
    let rank = match cfg.loader.rank {
        Some(r) => r,
        None => env_usize("RANK")?.unwrap_or(0),
    };
    let world = match cfg.loader.world_size {
        Some(w) => w,
        None => env_usize("WORLD_SIZE")?.unwrap_or(1),
    };
    if world == 0 || rank >= world {
        return Err(LoadError::Config(format!(
            "rank {rank} is not below world size {world}"
        )));
    }
    let ordinal = match cfg.device.ordinal {
        Some(o) => o,
        None => env_usize("LOCAL_RANK")?.unwrap_or(0),
    };
    Ok((rank, world, ordinal))
}

/// The engine of `engine_config`, with copy threads sized to this rank's share of the node.
/// Where a rank's host memory and threads go ([`Loader::numa_placement`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaPlacement {
    /// The NUMA node host pools are bound to.
    pub node: u32,
    /// CPUs the loader's threads run on (empty: not pinned).
    pub cpus: Vec<usize>,
    /// Why: the GPU it follows, or `pool.numa_node`.
    pub reason: String,
}

/// This rank's placement: `pool.numa_node` when set (memory only, threads not pinned); else, on a
/// host of several NUMA nodes, its GPU's node and the CPUs local to the GPU. `None`: one node, no
/// GPU, or a platform that does not say where the GPU is.
fn numa_placement(cfg: &RunConfig, device: &Arc<dyn Device>) -> Option<NumaPlacement> {
    if let Some(node) = cfg.pool.numa_node {
        return Some(NumaPlacement {
            node,
            cpus: Vec::new(),
            reason: "pool.numa_node".into(),
        });
    }
    let addr = device.info().pci_bus_id.clone()?;
    let topo = ubdirect_ub::topology::Topology::probe();
    let gpu = topo.device(&addr)?;
    let (node, cpus) = topo.placement(gpu)?;
    Some(NumaPlacement {
        node,
        cpus,
        reason: format!("GPU {} is on NUMA node {node}", gpu.address),
    })
}

/// The loader's runtime, its threads on `cpus` (none: unpinned), with the metrics endpoint when
/// `metrics.listen` asks for one (installed before the pools exist, so their gauges report to it).
fn runtime(cfg: &RunConfig, cpus: &[usize]) -> Result<tokio::runtime::Runtime, LoadError> {
    let cpus = cpus.to_vec();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.loader.threads)
        .thread_name("ubdirect-loader")
        .on_thread_start(move || ubdirect_nvme::pin_thread(&cpus))
        .enable_all()
        .build()
        .map_err(LoadError::Runtime)?;
    if let Some(addr) = &cfg.metrics.listen {
        install_prometheus(&rt, addr)?;
    }
    Ok(rt)
}

fn start_engine(cfg: &RunConfig, cpus: &[usize]) -> Result<Engine, LoadError> {
    // Two descriptors and two registered-file slots a shard (or open chunk file): the soft
    // RLIMIT_NOFILE (often 1,024), raised to the hard limit at the start of `from_config`, sizes the
    // engine's table.
    let mut engine_cfg = cfg.engine_config();
    engine_cfg.cpus = cpus.to_vec();
    engine_cfg.copy_threads = resolve::copy_threads(cfg, local_world_size(cfg)?).value;
    Ok(Engine::new(engine_cfg)?)
}

/// The page cache as a pool, where batches have a block to copy into and O_DIRECT is not forced.
fn page_cache(
    cfg: &RunConfig,
    pools: &Pools,
    packed: bool,
    index: &DatasetIndex,
    opened: &Opened,
    device: &Arc<dyn Device>,
    rank: usize,
) -> Result<Option<pagecache::PageCache>, LoadError> {
    if pools.batch.is_none() || cfg.engine.direct == ubdirect_nvme::DirectMode::On {
        return Ok(None);
    }
    pagecache::PageCache::new(
        cfg.pool.page_cache_budget,
        cfg.pool.page_cache_register,
        packed,
        cfg.loader.epochs,
        index,
        &opened.files,
        &opened.sources,
        device.clone(),
        node_share(cfg, rank)?,
    )
}

/// Seconds each phase of a loader's start took, in order (the summary's `startup` line).
struct Phases {
    at: std::time::Instant,
    done: Vec<(&'static str, f64)>,
}

impl Phases {
    fn start() -> Self {
        Self {
            at: std::time::Instant::now(),
            done: Vec::new(),
        }
    }

    fn mark(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.done
            .push((name, now.duration_since(self.at).as_secs_f64()));
        self.at = now;
    }

    fn done(self) -> Vec<(&'static str, f64)> {
        self.done
    }
}

/// `[dataset.tensors]` for the dataset's token type and window width.
fn tensor_spec(
    cfg: &RunConfig,
    gpt: Option<&GptSamples>,
) -> Result<Option<crate::gpt::masks::TensorSpec>, LoadError> {
    let (Some(g), Some(t)) = (gpt, cfg.dataset.tensors) else {
        return Ok(None);
    };
    if crate::gpt::masks::token_at(&[0; 8], g.dtype, 0).is_none() {
        return Err(crate::gpt::GptError::Config(format!(
            "[dataset.tensors] finds EOD tokens in integer tokens; this dataset's are {}",
            g.dtype.name()
        ))
        .into());
    }
    let spec = crate::gpt::masks::TensorSpec {
        mask: crate::gpt::masks::MaskConfig {
            eod: t.eod.unwrap_or_default(),
            reset_position_ids: t.reset_position_ids,
            reset_attention_mask: t.reset_attention_mask,
            eod_mask_loss: t.eod_mask_loss,
            add_extra_token: cfg.dataset.add_extra_token,
        },
        attention: t.create_attention_mask,
        width: g.tokens as usize,
        dtype: g.dtype,
    };
    check_batch_fits(cfg, &spec)?;
    Ok(Some(spec))
}

/// Refuses, before any pool is allocated, a batch whose tokens and tensors do not fit one batch
/// block: it was an error only once the plan was checked, after the pools (18.7 GB of 1 GiB
/// blocks for attention masks of sequence 16,384 allocated first).
fn check_batch_fits(cfg: &RunConfig, t: &crate::gpt::masks::TensorSpec) -> Result<(), LoadError> {
    let (rows, block) = (cfg.loader.batch_size, cfg.pool.batch_block_size.0);
    let (s, w) = (t.seq_len() as u128, t.width as u128);
    // Bounded first (the mask is rows × s² bytes), so the layout's arithmetic cannot overflow.
    let most =
        rows as u128 * (w * t.dtype.size() as u128 + s * 16 + if t.attention { s * s } else { 0 });
    let need = if most <= u64::MAX as u128 / 2 {
        t.layout(0, rows).1 as u128
    } else {
        most
    };
    if need > block as u128 {
        return Err(LoadError::Config(format!(
            "a batch of {rows} GPT samples with its [dataset.tensors] needs {need} bytes{}, more than pool.batch_block_size ({block}): raise pool.batch_block_size, or lower loader.batch_size or dataset.sequence_length",
            if t.attention {
                " (the attention mask alone is batch × sequence² bytes)"
            } else {
                ""
            }
        )));
    }
    Ok(())
}

/// The opened dataset with what is built over its index.
struct Dataset {
    opened: Opened,
    index: Arc<DatasetIndex>,
    gpt: Option<Arc<GptSamples>>,
    columns: Option<Vec<Vec<crate::formats::index::SampleLoc>>>,
    sample_type: Result<crate::formats::sample_type::SampleType, String>,
    /// The default object cache, where one was made (`resolve::object_cache`).
    cache: Option<resolve::Resolved>,
    /// The object cache as the cost estimate models it.
    cost: crate::objstore::CacheModel,
}

/// Opens the dataset through the shard layer (a blend's datasets as one shard list, entry after
/// entry), then reads the token type (Arrow: each shard's schema) and the other columns of
/// several-column samples through the shards' own opener: local files or `ub://`.
fn open_dataset(
    rt: &tokio::runtime::Runtime,
    cfg: &RunConfig,
    engine: &Engine,
    gpt_settings: Option<&GptSettings>,
    memory: u64,
) -> Result<Dataset, LoadError> {
    let dataset = cfg.dataset.for_opening();
    // Megatron's order is random over the dataset: the cache's room goes to windows of the plan's
    // near future, not to chunks rarely read again soon; other orders read chunks through, which
    // the chunk files serve across ranks and runs (`cache.window_fraction`).
    let mut cache = cfg.cache.clone();
    cache.window_fraction =
        cache
            .window_fraction
            .or(Some(if cfg.loader.order == crate::gpt::Order::Megatron {
                1.0
            } else {
                0.0
            }));
    let (from_store, default_cache) =
        super::estimate::default_object_cache(cfg, &dataset, gpt_settings, &mut cache, memory);
    let shard_cfg = crate::shards::ShardConfig {
        dataset: &dataset,
        engine: &cfg.engine,
        remote: &cfg.remote,
        object_store: &cfg.object_store,
        cache: &cache,
    };
    let mut opened = crate::shards::open(rt, &shard_cfg, engine)?;
    let index = Arc::new(std::mem::take(&mut opened.index));
    let d = &cfg.dataset;
    let indexed = opened.columns.take();
    let (gpt, columns, sample_type) =
        crate::shards::with_opener(rt, &cfg.remote, &index, |opener| {
            let gpt = match gpt_settings {
                Some(s) => {
                    let remote = index.shards.iter().any(|s| {
                        crate::shards::ShardUrl::kind_of(&s.path) != crate::shards::ShardKind::Local
                    });
                    let dtype = crate::gpt::dataset_dtype(
                        remote, d.format, d.dtype, &d.column, &index, opener,
                    )?;
                    Some(Arc::new(crate::gpt::build_with_cache(
                        &index,
                        dtype,
                        s,
                        d.gpt_index_cache,
                    )?))
                }
                None => None,
            };
            let columns = match indexed {
                Some(c) => Some(c),
                None => crate::gpt::extra_columns(
                    d.format,
                    &d.columns,
                    d.dtype,
                    d.record_len,
                    &index,
                    opener,
                )?,
            };
            let sample_type = match (&gpt, &columns) {
                (Some(_), _) => {
                    Err("GPT batches are token arrays: torch.from_dlpack(batch)".into())
                }
                (None, Some(_)) => {
                    Err("several columns: batch.parts(i) gives each sample's".into())
                }
                (None, None) => crate::formats::sample_type::sample_type(
                    d.format,
                    d.dtype,
                    d.record_len,
                    &d.column,
                    &index,
                    opener,
                ),
            };
            Ok::<_, LoadError>((gpt, columns, sample_type))
        })??;
    if from_store && cache.dir.is_none() {
        super::estimate::warn_without_cache(gpt.as_deref());
    }
    Ok(Dataset {
        opened,
        index,
        gpt,
        columns,
        sample_type,
        cache: default_cache,
        cost: super::estimate::model_of(&cache, cfg.object_store.max_request.0),
    })
}

/// The loader's pools.
struct Pools {
    staging: UbPool,
    batch: Option<UbPool>,
    pack: Option<UbPool>,
}

/// What the pools are fitted to: a small dataset's epochs, the machine, the NUMA node.
struct Fitting {
    shape: Option<fit::EpochShape>,
    machine: fit::Machine,
    /// The node to bind (or, `true`, prefer) the host pools to.
    numa: Option<(u32, bool)>,
}

impl Fitting {
    fn new(
        cfg: &RunConfig,
        shape: Option<fit::EpochShape>,
        machine: fit::Machine,
        numa: Option<&NumaPlacement>,
    ) -> Self {
        Self {
            shape,
            machine,
            // The user's node binds; the GPU's is preferred (the kernel may spill to another node).
            numa: numa.map(|p| (p.node, cfg.pool.numa_node.is_none())),
        }
    }
}

/// The dataset's CRC sidecars, where `dataset.verify_crc` asks for them.
fn crc_sidecars(cfg: &RunConfig, index: &DatasetIndex) -> Result<Option<Arc<Vec<u32>>>, LoadError> {
    cfg.dataset
        .verify_crc
        .then(|| crate::formats::crc::load_sidecars(index).map(Arc::new))
        .transpose()
        .map_err(LoadError::from)
}

/// Where the batch pool's memory lives: device memory for GPU batches; host memory for contiguous
/// host batches and packed (GPT, several-column) ones; none for zero-copy host batches.
fn batch_kind(cfg: &RunConfig, device: &Arc<dyn Device>, packed: bool) -> Option<MemoryKind> {
    if device.batch_kind() == MemoryKind::Device {
        Some(MemoryKind::Device)
    } else if cfg.loader.contiguous_batches || packed {
        // GPT batches are packed arrays: one block each.
        Some(MemoryKind::Host)
    } else {
        None
    }
}

/// The pools' host memory by block, for these batches.
fn host_pools(
    cfg: &RunConfig,
    device: &Arc<dyn Device>,
    packed: bool,
    batch_blocks: usize,
) -> fit::HostPools {
    let kind = batch_kind(cfg, device, packed);
    let bb = cfg.pool.batch_block_size.0;
    let pack = kind == Some(MemoryKind::Device) && packed;
    fit::HostPools {
        staging_block: cfg.pool.staging_block_size.0,
        batch_block: (kind == Some(MemoryKind::Host)).then_some(bb),
        pack_block: pack.then_some(bb),
        pack_blocks: if pack {
            PACK_BLOCKS.min(batch_blocks)
        } else {
            0
        },
    }
}

/// Refuses pools whose host memory (staging, host batches, packing blocks) exceeds what this
/// machine has available even with their `0 = auto` depths at their floors — before the dataset
/// is opened, so before a generated one is written: pools are locked, so a pool past the memory
/// was gigabytes faulted in before its error (18.7 GB for 1 GiB batch blocks of attention masks).
/// Packed batches are assumed where the config may make them (GPT, several columns). The error
/// names the keys that size them. Returns what the machine allows, for the pools' fitting.
fn check_host_memory(cfg: &RunConfig, device: &Arc<dyn Device>) -> Result<fit::Machine, LoadError> {
    let machine = fit::Machine::probe();
    let gpu = device.batch_kind() == MemoryKind::Device;
    let mut depths = resolve::pool_depths(cfg, gpu, local_world_size(cfg)?, None)?;
    let packed = cfg.dataset.sequence_length != 0 || !cfg.dataset.columns.is_empty();
    let pools = host_pools(cfg, device, packed, depths.batch.value);
    let auto = (cfg.pool.staging_blocks == 0, cfg.pool.batch_blocks == 0);
    fit::fit_memory(&mut depths, &pools, auto, None, gpu, machine.available)?;
    Ok(machine)
}

/// The staging pool (registered once, at creation, with every consumer a source reads through:
/// io_uring fixed buffers, an RDMA memory region), the batch pool (device batches, contiguous host
/// batches, packed GPT batches) and the pinned pool packed device batches are assembled in — fitted
/// to the dataset (`shape`) and the machine ([`fit`]): smaller where the memory is short, pageable
/// where RLIMIT_MEMLOCK is below them (each counted).
fn make_pools(
    cfg: &RunConfig,
    device: &Arc<dyn Device>,
    opened: &Opened,
    packed: bool,
    fitting: &Fitting,
) -> Result<(Pools, resolve::PoolDepths), LoadError> {
    let (shape, machine, numa) = (fitting.shape.as_ref(), &fitting.machine, fitting.numa);
    let gpu = device.batch_kind() == MemoryKind::Device;
    let ranks = local_world_size(cfg)?;
    let mut depths = resolve::pool_depths(cfg, gpu, ranks, shape)?;
    let host = host_pools(cfg, device, packed, depths.batch.value);
    let auto = (cfg.pool.staging_blocks == 0, cfg.pool.batch_blocks == 0);
    if fit::fit_memory(&mut depths, &host, auto, shape, gpu, machine.available)? {
        ubdirect_ub::fallback::record(
            "pools_fit_memory",
            format!(
                "the pools' default depths need more than half of the {} bytes of memory available: pool.staging_blocks = {}, pool.batch_blocks = {} ({})",
                machine.available, depths.staging.value, depths.batch.value, depths.staging.why
            ),
        );
    }
    let staging_bytes = host.staging_block * depths.staging.value as u64;
    let locking = fit::locking(host.bytes(&depths), staging_bytes, machine, ranks);
    if let Some(why) = &locking.why {
        ubdirect_ub::fallback::record("pools_not_locked", why.clone());
    }
    let (staging_blocks, batch_blocks) = (depths.staging.value, depths.batch.value);
    let batch_kind = batch_kind(cfg, device, packed);
    let pool =
        |name: &str, block: u64, count: usize, kind: MemoryKind, numa: Option<(u32, bool)>| {
            UbPool::builder(PoolConfig {
                numa_node: numa.map(|n| n.0),
                numa_preferred: numa.is_some_and(|n| n.1),
                lock: locking.lock,
                ..PoolConfig::new(name, block as usize, count, kind)
            })
            .device(device.clone())
        };
    let mut staging = pool(
        "staging",
        host.staging_block,
        staging_blocks,
        device.staging_kind(),
        numa,
    );
    for r in opened
        .registrars
        .iter()
        .filter(|r| locking.register || !r.optional())
    {
        staging = staging.register_with(r.clone());
    }
    let staging = staging.build()?;
    let bb = cfg.pool.batch_block_size.0;
    let batch = match batch_kind {
        Some(kind) => Some(pool("batch", bb, batch_blocks, kind, None).build()?),
        None => None,
    };
    let pack = match host.pack_blocks {
        0 => None,
        n => Some(pool("pack", bb, n, device.staging_kind(), numa).build()?),
    };
    Ok((
        Pools {
            staging,
            batch,
            pack,
        },
        depths,
    ))
}

impl Loader {
    /// Builds a loader: indexes the dataset, selects the device, starts the engine, makes the pools
    /// (registered once) and opens every shard. Rank and world size come from the config, else from
    /// torchrun's `RANK` / `WORLD_SIZE`; the GPU from `device.ordinal`, else `LOCAL_RANK`.
    pub fn from_config(cfg: &RunConfig) -> Result<Self, LoadError> {
        cfg.validate("config")?;
        let mut phases = Phases::start();
        reserve_descriptors(cfg);
        let (rank, world, ordinal) = placement(cfg)?;
        // The device first: nothing is written (a generated dataset) before it is known usable, so
        // `device.select = "cuda"` without a GPU fails before `dataset.generate` writes a byte.
        let selected = select_device(cfg.device.select, ordinal)?;
        let device = selected.device.clone();
        // Likewise pools that cannot fit this machine's memory.
        let machine = check_host_memory(cfg, &device)?;
        phases.mark("device");
        let numa = numa_placement(cfg, &device); // memory and threads on the GPU's NUMA node
        let cpus = numa.as_ref().map(|p| p.cpus.clone()).unwrap_or_default();
        let rt = runtime(cfg, &cpus)?;
        let engine = start_engine(cfg, &cpus)?;
        phases.mark("engine");
        let gpt_settings = GptSettings::from_config(cfg)?;
        let Dataset {
            opened,
            index,
            gpt,
            columns,
            sample_type,
            cache: default_cache,
            cost,
        } = open_dataset(&rt, cfg, &engine, gpt_settings.as_ref(), machine.available)?;
        phases.mark("dataset");
        let generated = opened.generated.clone();
        let crcs = crc_sidecars(cfg, &index)?;
        let packed = gpt.is_some() || columns.is_some();
        let tensors = tensor_spec(cfg, gpt.as_deref())?;
        let PlanSetup {
            plan_cfg,
            raised_min_read,
            advise_window,
            samples_fingerprint,
            state,
            window,
        } = plan_setup(cfg, &opened, &index, gpt_settings.as_ref(), rank, world)?;
        let space = super::space_of(&index, gpt.as_deref(), columns.as_deref());
        let shape = fit::epoch_shape(&space, &plan_cfg, cfg.loader.epochs, rank, world);
        let fitting = Fitting::new(cfg, shape, machine, numa.as_ref());
        let (pools, depths) = make_pools(cfg, &device, &opened, packed, &fitting)?;
        phases.mark("pools");
        let page_cache = page_cache(cfg, &pools, packed, &index, &opened, &device, rank)?;
        phases.mark("page_cache");
        let estimator = super::estimate::for_dataset(
            cfg,
            cost,
            &index,
            &opened.sources,
            pools.staging.block_count(),
        );
        Ok(Self {
            inner: Arc::new(Inner {
                acquire_timeout: Duration::from_millis(cfg.pool.acquire_timeout_ms),
                cfg: cfg.clone(),
                index,
                plan_cfg,
                samples_fingerprint,
                numa,
                rank,
                world,
                engine,
                device,
                device_reason: selected.reason,
                cold_hold_back: depths.cold_hold_back(),
                resolved: depths.all_with(cfg, local_world_size(cfg)?, window, default_cache),
                held_back: Mutex::new(std::sync::Weak::new()),
                staging: pools.staging,
                read_devices: read_devices(cfg, &opened.devices, pools.batch.is_some()),
                spare: Default::default(),
                batch_pool: pools.batch,
                pack_pool: pools.pack,
                shard_idents: shard_idents(&opened.files),
                estimator,
                sources: opened.sources,
                read_deadline: opened.deadline,
                advise_window,
                read_ahead: cfg.loader.prefetch.max(opened.read_ahead),
                raised_min_read,
                page_cache,
                crcs,
                tensors,
                gpt,
                columns,
                sample_type,
                stats: LoaderStats::default(),
                state: Mutex::new(state),
                plans: Mutex::new(std::collections::VecDeque::new()),
                node_plans: Mutex::new(None),
                planning: (Mutex::new(Vec::new()), std::sync::Condvar::new()),
                blocks: std::sync::OnceLock::new(),
                generated,
                startup: phases.done(),
            }),
            rt: Arc::new(LoaderRuntime(Some(rt))),
        })
    }
}

/// Room for every descriptor the engine can register, made at open — before the device and the
/// runtime start threads, where the CLI is still one thread and growing the table waits for nothing
/// — rather than doubling by doubling while an epoch opens chunk files.
fn reserve_descriptors(cfg: &RunConfig) {
    ubdirect_ub::raise_open_files_limit();
    if let Err(e) = ubdirect_ub::reserve_descriptors(u64::from(cfg.engine_config().max_files)) {
        ubdirect_ub::fallback::record(
            "descriptor_table",
            format!("the descriptor table was not grown ahead ({e}): it grows as files open"),
        );
    }
}

/// What the planner is given beside the config: the sources' read sizes, and what names a plan and
/// a sample id (the loader's state at position 0).
struct PlanSetup {
    plan_cfg: PlanConfig,
    raised_min_read: Option<u64>,
    advise_window: u64,
    samples_fingerprint: u64,
    state: LoaderState,
    /// `loader.window` as the plans use it.
    window: resolve::Resolved,
}

/// The plan's settings as the opened sources need them, and the state a new loader starts from.
fn plan_setup(
    cfg: &RunConfig,
    opened: &Opened,
    index: &DatasetIndex,
    gpt_settings: Option<&GptSettings>,
    rank: usize,
    world: usize,
) -> Result<PlanSetup, LoadError> {
    let mut plan_cfg = cfg.plan_config();
    // Object stores: few large ranged GETs by default (`object_store.min_read`).
    let source_min_read = opened.min_read.min(plan_cfg.max_read);
    let raised_min_read = (source_min_read > plan_cfg.min_read).then(|| {
        plan_cfg.min_read = source_min_read;
        source_min_read
    });
    // Object stores: reads exact to the byte (no alignment: a 260-byte window is not a 4 KiB
    // GET), within a bound of their samples' bytes.
    if opened.max_amplification > 0 {
        plan_cfg.align = 1;
        plan_cfg.max_amplification = opened.max_amplification;
    }
    plan_cfg.validate()?;
    let advise_window = opened
        .sources
        .iter()
        .map(|s| s.advise_window())
        .max()
        .unwrap_or(0);
    let mut plan_fingerprint = plan_cfg.fingerprint();
    // What names a sample id: the dataset, and the GPT windows over it.
    let index_fingerprint = index.fingerprint();
    let mut samples_fingerprint = index_fingerprint;
    if let Some(s) = gpt_settings {
        plan_fingerprint ^= crate::gpt::fingerprint(s);
        samples_fingerprint ^= crate::gpt::fingerprint(s).rotate_left(17);
    }
    let state = LoaderState {
        epoch: 0,
        next_batch: 0,
        position: Some(0),
        rank,
        world_size: world,
        plan_fingerprint,
        index_fingerprint,
        settings: plan_settings(&plan_cfg, gpt_settings),
    };
    // After the fingerprint and the settings, which name the configured value (a state saved with
    // `window = 0` resumes as before).
    let window = resolve::window(&mut plan_cfg);
    Ok(PlanSetup {
        plan_cfg,
        raised_min_read,
        advise_window,
        samples_fingerprint,
        state,
        window,
    })
}

/// This rank's share of the node's page cache: `loader.local_world_size` or `LOCAL_WORLD_SIZE` ranks
/// (torchrun sets it), this
/// one the `RANK mod LOCAL_WORLD_SIZE`-th (torchrun's `LOCAL_RANK`; also right where several ranks
/// share one GPU and so one `LOCAL_RANK`).
fn node_share(cfg: &RunConfig, rank: usize) -> Result<pagecache::NodeShare, LoadError> {
    let ranks = local_world_size(cfg)?;
    Ok(pagecache::NodeShare {
        index: rank % ranks,
        ranks,
    })
}

/// Ranks of this node: `loader.local_world_size`, else `LOCAL_WORLD_SIZE`, else 1.
pub(super) fn local_world_size(cfg: &RunConfig) -> Result<usize, LoadError> {
    Ok(match cfg.loader.local_world_size {
        Some(n) => n,
        None => env_usize("LOCAL_WORLD_SIZE")?.unwrap_or(1),
    }
    .max(1))
}

fn env_usize(name: &str) -> Result<Option<usize>, LoadError> {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().map(Some).map_err(|_| {
            LoadError::Config(format!("environment variable {name}={v:?} is not a number"))
        }),
        Err(_) => Ok(None),
    }
}

/// Serves Prometheus metrics on `addr` from the loader's runtime. One per process: a second call (or
/// another recorder already installed) is an error.
fn install_prometheus(rt: &tokio::runtime::Runtime, addr: &str) -> Result<(), LoadError> {
    let sock: std::net::SocketAddr = addr
        .parse()
        .map_err(|_| LoadError::Config(format!("metrics.listen {addr:?} is not an address")))?;
    let _guard = rt.enter();
    let (recorder, exporter) = metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(sock)
        .build()
        .map_err(|e| LoadError::Config(format!("metrics.listen {addr}: {e}")))?;
    metrics::set_global_recorder(recorder).map_err(|_| {
        LoadError::Config(
            "metrics.listen: a metrics recorder is already installed in this process".into(),
        )
    })?;
    // Fallbacks taken before the recorder existed (the device's `no_gpu`, a descriptor table not
    // grown) were counted nowhere: counted now, as the summary counts them.
    for (kind, count, _) in crate::fallbacks() {
        metrics::counter!("ubdirect_fallbacks_total", "kind" => kind).increment(count);
    }
    rt.spawn(async move {
        if let Err(e) = exporter.await {
            tracing::error!(target: "ubdirect_loader::pipeline", "prometheus endpoint stopped: {e:?}");
        }
    });
    Ok(())
}

/// Per shard, the index of the local device it is read from, when `engine.balance_devices` is on,
/// the shards lie on two devices or more, and staging blocks are free again once their copy into
/// a batch block ran (`frees_blocks`; host batches that hold their reads' blocks keep plan order).
fn read_devices(
    cfg: &RunConfig,
    devices: &[Option<u64>],
    frees_blocks: bool,
) -> Option<ReadDevices> {
    if !cfg.engine.balance_devices || !frees_blocks {
        return None;
    }
    let mut seen: Vec<u64> = Vec::new();
    let shard: Vec<u32> = devices
        .iter()
        .map(|d| match d {
            None => 0,
            Some(d) => {
                let i = seen.iter().position(|s| s == d).unwrap_or_else(|| {
                    seen.push(*d);
                    seen.len() - 1
                });
                (i + 1).min(MAX_READ_DEVICES) as u32
            }
        })
        .collect();
    (seen.len() >= 2).then(|| ReadDevices {
        shard: Arc::new(shard),
        count: seen.len().min(MAX_READ_DEVICES) + 1,
    })
}

/// Devices reads are balanced over; shards on more share the last index.
const MAX_READ_DEVICES: usize = 256;

/// The identity of every engine-read local shard, from its open descriptor.
fn shard_idents(
    files: &[Option<Arc<ubdirect_nvme::FileSource>>],
) -> Vec<(Arc<ubdirect_nvme::FileSource>, ubdirect_ub::FileIdent)> {
    files
        .iter()
        .flatten()
        .filter_map(|f| Some((f.clone(), f.handle().ident().ok()?)))
        .collect()
}
