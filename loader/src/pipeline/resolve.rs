//! The pools' `0 = auto` keys resolved once, at open, each with its reason: what the pools are made
//! with, what a cold epoch holds back, and what the run summary says (`resolved`). Nothing
//! downstream reads `pool.staging_blocks`, `pool.batch_blocks` or `pool.cold_staging_blocks`
//! again (since 2026-12-05; before, `staging_blocks = 0` was read in five places).

use super::{COLD_STAGING_BLOCKS_GPU, LoadError, STAGING_BLOCKS_GPU, STAGING_BLOCKS_HOST};
use crate::RunConfig;

pub use crate::config::Resolved;

/// The reads and chunks of this rank's first epochs: what a small dataset's pools must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EpochShape {
    /// Reads of the largest epoch.
    pub reads: usize,
    /// Reads of the largest chunk.
    pub chunk_reads: usize,
    /// Chunks of the largest epoch.
    pub chunks: usize,
}

/// The pools' depths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PoolDepths {
    /// Staging blocks.
    pub staging: Resolved,
    /// Batch blocks (used where batches have a pool of their own).
    pub batch: Resolved,
    /// Staging blocks an epoch of cold O_DIRECT reads cycles through (the rest held back; GPU
    /// batches only: host batches hold their blocks until dropped).
    pub cold: Resolved,
}

impl PoolDepths {
    /// Staging blocks a cold epoch holds back.
    pub(crate) fn cold_hold_back(&self) -> usize {
        self.staging.value - self.cold.value
    }

    /// These, the engine's `0 = auto` keys and the default object cache, for the run summary.
    pub(crate) fn all_with(
        &self,
        cfg: &RunConfig,
        ranks: usize,
        window: Resolved,
        object_cache: Option<Resolved>,
    ) -> Vec<Resolved> {
        let mut v = vec![
            self.staging.clone(),
            self.batch.clone(),
            self.cold.clone(),
            copy_threads(cfg, ranks),
            crate::shards::max_open_shards(cfg.engine.max_open_shards),
            window,
        ];
        v.extend(object_cache);
        v
    }
}

/// Staging blocks of all the ranks of a node together, with GPU batches and the default depth.
const NODE_STAGING_BLOCKS: usize = 64;

/// The default GPU staging depth of one of `ranks` ranks of a node: 24 alone, fewer when several
/// ranks share the host's caches, never below 8. Eight ranks on one H200 host (2 epochs of 24 GiB,
/// warm, contexts made first): 8 blocks each read 35.9 GB/s together against 29.5 with 24 each
/// (medians of 3 rounds, docs/benchmarks.md 2026-12-02), while one process alone reads fastest with
/// 24.
pub(crate) fn gpu_staging_blocks(ranks: usize) -> usize {
    (NODE_STAGING_BLOCKS / ranks.max(1)).clamp(8, STAGING_BLOCKS_GPU)
}

/// The pools' depths for `cfg` with GPU batches or not, one of `ranks` ranks of a node; an auto
/// depth no larger than a small dataset's epochs need (`shape`, from `fit::epoch_shape`).
pub(crate) fn pool_depths(
    cfg: &RunConfig,
    gpu_batches: bool,
    ranks: usize,
    shape: Option<&EpochShape>,
) -> Result<PoolDepths, LoadError> {
    let set = |key, value| Resolved {
        key,
        value,
        why: "set".into(),
    };
    // A GPU batch's staging block is free again once its copy ran: a few dozen keep every copy
    // thread and the copy engine busy, and a small set stays in the CPU's caches between the read
    // that fills a block and the DMA that empties it (24 vs 64 blocks: 44.2 vs 37.1 GB/s warm on
    // the H200, CPU 0.25 vs 0.37 s/GB). The ranks of a node share those caches: their blocks
    // together are held to about NODE_STAGING_BLOCKS. Host batches hold their staging blocks
    // until dropped: more.
    let staging = match cfg.pool.staging_blocks {
        0 if gpu_batches => Resolved {
            key: "pool.staging_blocks",
            value: gpu_staging_blocks(ranks),
            why: format!(
                "GPU batches, {ranks} rank(s) on this node share about {NODE_STAGING_BLOCKS} (between 8 and {STAGING_BLOCKS_GPU} each)"
            ),
        },
        0 => Resolved {
            key: "pool.staging_blocks",
            value: STAGING_BLOCKS_HOST,
            why: "host batches hold their staging blocks until dropped".into(),
        },
        n => set("pool.staging_blocks", n),
    };
    let mut batch = match cfg.pool.batch_blocks {
        0 => Resolved {
            key: "pool.batch_blocks",
            value: cfg.loader.prefetch + 2,
            why: format!("loader.prefetch ({}) + 2", cfg.loader.prefetch),
        },
        n => set("pool.batch_blocks", n),
    };
    let mut staging = staging;
    if let Some(s) = shape {
        // A small dataset: an epoch's reads, and the next epoch's first chunk beside its last
        // batches; its chunks and two more.
        let need = (s.reads + s.chunk_reads).max(2);
        if cfg.pool.staging_blocks == 0 && need < staging.value {
            staging.why = format!(
                "the dataset: an epoch of this rank is {} reads, the next epoch's first chunk {} more; below the default {} ({})",
                s.reads, s.chunk_reads, staging.value, staging.why
            );
            staging.value = need;
        }
        let need = s.chunks + 2;
        if cfg.pool.batch_blocks == 0 && need < batch.value {
            batch.why = format!(
                "the dataset: an epoch of this rank is {} chunks, and 2 more; below the default {} ({})",
                s.chunks, batch.value, batch.why
            );
            batch.value = need;
        }
    }
    let total = staging.value;
    let cold = match (cfg.pool.cold_staging_blocks, cfg.pool.staging_blocks) {
        _ if !gpu_batches => Resolved {
            key: "pool.cold_staging_blocks",
            value: total,
            why: "host batches: every staging block (none held back)".into(),
        },
        (0, 0) => Resolved {
            key: "pool.cold_staging_blocks",
            value: COLD_STAGING_BLOCKS_GPU.min(total),
            why: format!(
                "the default staging depth: {COLD_STAGING_BLOCKS_GPU} cycled by a cold epoch (docs/decisions.md, \"Cold staging depth\")"
            ),
        },
        (0, _) => Resolved {
            key: "pool.cold_staging_blocks",
            value: total,
            why: "pool.staging_blocks set by hand: kept whole".into(),
        },
        (n, _) if n > total => {
            return Err(LoadError::Config(format!(
                "pool.cold_staging_blocks is {n} but the staging pool has {total} blocks (pool.staging_blocks): at most that many"
            )));
        }
        (n, _) => set("pool.cold_staging_blocks", n),
    };
    Ok(PoolDepths {
        staging,
        batch,
        cold,
    })
}

/// `loader.window`: set, or one batch (`loader.batch_size`), written into the plan's settings so
/// that the planner reads the value, not the `0`.
pub(crate) fn window(p: &mut crate::planner::PlanConfig) -> Resolved {
    if p.window == 0 {
        p.window = p.batch_size;
        Resolved {
            key: "loader.window",
            value: p.window,
            why: format!(
                "one batch (loader.batch_size {}): a batch's samples shuffled among themselves",
                p.batch_size
            ),
        }
    } else {
        Resolved {
            key: "loader.window",
            value: p.window,
            why: "set".into(),
        }
    }
}

/// `engine.copy_threads`: set, or one copy thread per CPU of this rank's share of the node
/// (torchrun's `LOCAL_WORLD_SIZE` ranks on one host split its cores, rather than each starting one
/// per core: 8 ranks × 16 threads on 16 cores only adds switching), between 2 and 64.
pub(crate) fn copy_threads(cfg: &RunConfig, ranks: usize) -> Resolved {
    match cfg.engine.copy_threads {
        0 => {
            let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
            Resolved {
                key: "engine.copy_threads",
                value: (cores / ranks.max(1)).clamp(2, 64),
                why: format!(
                    "{cores} CPUs shared by {ranks} rank(s) on this node, between 2 and 64"
                ),
            }
        }
        n => Resolved {
            key: "engine.copy_threads",
            value: n,
            why: "set".into(),
        },
    }
}

/// Where an object-store dataset read in Megatron order without `cache.dir` caches, and why
/// (documented in docs/object-store.md, "No cache configured").
pub(crate) const DEFAULT_OBJECT_CACHE: &str = "~/.cache/ubdirect/objects";

/// `[cache]` for an object-store dataset read in Megatron order with no `cache.dir`: a GET per
/// window otherwise (16,544 GETs for 16,000 windows, 156 samples/s, on 2026-12-06), so the run gets
/// a cache in [`DEFAULT_OBJECT_CACHE`] of at most `cache.max_bytes`, half the free disk there and a
/// quarter of the `memory` available (in Megatron order its room is windows held in memory,
/// `cache.window_fraction` 1), with the reason for the summary. `prepare` makes the directory and
/// says the disk free there (`None`: unknown); the decision itself touches nothing. `cache.dir = ""` says "no cache"
/// (`None` here; the caller warns with the GETs an epoch costs). Other orders, local datasets and a
/// set `cache.dir` are left alone.
pub(crate) fn object_cache(
    cache: &mut crate::config::CacheSection,
    objects: bool,
    megatron: bool,
    memory: u64,
    prepare: impl FnOnce(&std::path::Path) -> std::io::Result<Option<u64>>,
) -> Option<Resolved> {
    if cache
        .dir
        .as_deref()
        .is_some_and(|d| d.as_os_str().is_empty())
    {
        cache.dir = None;
        return None;
    }
    if cache.dir.is_some() || !objects || !megatron {
        return None;
    }
    let dir = crate::config::expand_home(std::path::Path::new(DEFAULT_OBJECT_CACHE));
    // A home that cannot hold it (read-only, not there): no default; the caller warns.
    let free = prepare(&dir).ok()?;
    let (bytes, why) = default_cache_bytes(cache.max_bytes.0, free, memory);
    cache.dir = Some(DEFAULT_OBJECT_CACHE.into());
    cache.max_bytes = crate::config::ByteSize(bytes);
    Some(Resolved {
        key: "cache.max_bytes",
        value: bytes as usize,
        why: format!(
            "cache.dir unset in Megatron order from an object store (a GET per window without one): {DEFAULT_OBJECT_CACHE}, {why}; cache.dir = \"\" for none"
        ),
    })
}

/// The default cache's bound: `max_bytes`, at most half of `free` disk (unknown: not bounded by
/// it) and a quarter of the `memory` available.
fn default_cache_bytes(max_bytes: u64, free: Option<u64>, memory: u64) -> (u64, String) {
    let disk = free.map_or(u64::MAX, |f| f / 2);
    let bytes = max_bytes.min(disk).min(memory / 4);
    let why = if bytes == max_bytes {
        "cache.max_bytes".to_string()
    } else if bytes == disk {
        format!(
            "half the {} MiB of disk free there",
            free.unwrap_or(0) >> 20
        )
    } else {
        format!("a quarter of the {} MiB of memory available", memory >> 20)
    };
    (bytes, why)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(toml: &str) -> RunConfig {
        RunConfig::from_toml(toml, "test").unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn ranks_of_a_node_share_the_default_gpu_staging_depth() {
        assert_eq!(gpu_staging_blocks(1), 24);
        assert_eq!(gpu_staging_blocks(2), 24);
        assert_eq!(gpu_staging_blocks(4), 16);
        assert_eq!(gpu_staging_blocks(8), 8);
        assert_eq!(gpu_staging_blocks(64), 8);
        assert_eq!(gpu_staging_blocks(0), 24);
    }

    #[test]
    fn every_auto_depth_is_resolved_once_with_its_reason() {
        let hold = |toml: &str, gpu: bool, ranks: usize| {
            pool_depths(&cfg(toml), gpu, ranks, None).map(|d| d.cold_hold_back())
        };
        // The default GPU depth: 24 blocks, 12 held back in a cold epoch; a rank of eight on a
        // node has 8 and holds none back.
        let d = pool_depths(&cfg(""), true, 1, None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (d.staging.value, d.cold.value, d.cold_hold_back()),
            (24, 12, 12)
        );
        assert!(d.staging.why.contains("1 rank(s)"), "{}", d.staging.why);
        let prefetch = cfg("").loader.prefetch;
        assert_eq!(
            (d.batch.value, d.batch.why.clone()),
            (prefetch + 2, format!("loader.prefetch ({prefetch}) + 2"))
        );
        assert_eq!(hold("", true, 8).ok(), Some(0));
        // Host batches hold their blocks: 64, nothing held back.
        let h = pool_depths(&cfg(""), false, 1, None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((h.staging.value, h.cold_hold_back()), (64, 0));
        // A depth set by hand is kept whole unless cold_staging_blocks says otherwise.
        assert_eq!(hold("[pool]\nstaging_blocks = 32\n", true, 1).ok(), Some(0));
        assert_eq!(
            hold(
                "[pool]\nstaging_blocks = 32\ncold_staging_blocks = 8\n",
                true,
                1
            )
            .ok(),
            Some(24)
        );
        assert_eq!(
            hold("[pool]\ncold_staging_blocks = 24\n", true, 1).ok(),
            Some(0)
        );
        let e = hold("[pool]\ncold_staging_blocks = 25\n", true, 1)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("pool.cold_staging_blocks is 25"), "{e}");
    }

    #[test]
    fn the_window_is_one_batch_unless_set_and_the_plan_reads_the_value() {
        let mut p = cfg("[loader]\nbatch_size = 48\n").plan_config();
        let r = window(&mut p);
        assert_eq!((r.value, p.window), (48, 48));
        assert!(
            r.why.starts_with("one batch (loader.batch_size 48)"),
            "{}",
            r.why
        );
        let mut p = cfg("[loader]\nwindow = 1000\n").plan_config();
        assert_eq!((window(&mut p).why.as_str(), p.window), ("set", 1000));
    }

    #[test]
    fn a_small_datasets_auto_depths_hold_its_epoch_and_no_more() {
        let shape = EpochShape {
            reads: 3,
            chunk_reads: 2,
            chunks: 2,
        };
        let d = pool_depths(&cfg(""), false, 1, Some(&shape)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((d.staging.value, d.batch.value, d.cold.value), (5, 4, 5));
        assert!(
            d.staging
                .why
                .starts_with("the dataset: an epoch of this rank is 3 reads")
        );
        assert!(d.batch.why.contains("2 chunks"), "{}", d.batch.why);
        // Depths set by hand are kept; a large epoch keeps the defaults.
        let set = "[pool]\nstaging_blocks = 9\nbatch_blocks = 7\n";
        let d = pool_depths(&cfg(set), false, 1, Some(&shape)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((d.staging.value, d.batch.value), (9, 7));
        let big = EpochShape {
            reads: 900,
            chunk_reads: 30,
            chunks: 300,
        };
        let d = pool_depths(&cfg(""), true, 1, Some(&big)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((d.staging.value, d.cold.value), (24, 12));
    }

    /// The default object cache's bound: the least of `cache.max_bytes`, half the free disk and a
    /// quarter of the memory available.
    #[test]
    fn the_default_object_cache_takes_at_most_half_the_free_disk_and_a_quarter_of_memory() {
        let big = 1 << 40;
        assert_eq!(
            super::default_cache_bytes(64 << 30, Some(10 << 30), big).0,
            5 << 30
        );
        assert_eq!(
            super::default_cache_bytes(64 << 30, Some(big), big).0,
            64 << 30
        );
        assert_eq!(super::default_cache_bytes(64 << 30, None, big).0, 64 << 30);
        assert_eq!(
            super::default_cache_bytes(64 << 30, None, 8 << 30).0,
            2 << 30
        );
    }

    /// Only an object-store dataset in Megatron order without `cache.dir` gets the default; `""`
    /// is no cache.
    #[test]
    fn only_megatron_order_from_an_object_store_without_a_cache_gets_the_default() {
        let c = crate::config::CacheSection::default;
        let mut a = c();
        let r = super::object_cache(&mut a, true, true, 1 << 40, |_| Ok(Some(1 << 40)))
            .expect("resolved");
        assert_eq!(
            a.dir.as_deref(),
            Some(std::path::Path::new(super::DEFAULT_OBJECT_CACHE))
        );
        assert_eq!(r.value as u64, a.max_bytes.0);
        assert!(a.max_bytes.0 <= c().max_bytes.0);
        for (objects, megatron) in [(false, true), (true, false)] {
            let mut b = c();
            assert!(
                super::object_cache(&mut b, objects, megatron, 1 << 40, |_| {
                    panic!("no directory for a run left alone")
                })
                .is_none()
            );
            assert_eq!(b, c());
        }
        let mut none = c();
        none.dir = Some("".into());
        assert!(super::object_cache(&mut none, true, true, 1 << 40, |_| Ok(None)).is_none());
        assert_eq!(none.dir, None);
        // A home that cannot hold the directory: no default (the caller warns).
        let mut unwritable = c();
        let denied = || std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        assert!(
            super::object_cache(&mut unwritable, true, true, 1 << 40, |_| Err(denied())).is_none()
        );
        assert_eq!(unwritable.dir, None);
        let mut set = c();
        set.dir = Some("/x".into());
        assert!(super::object_cache(&mut set, true, true, 1 << 40, |_| Ok(None)).is_none());
        assert_eq!(set.dir.as_deref(), Some(std::path::Path::new("/x")));
    }
}
