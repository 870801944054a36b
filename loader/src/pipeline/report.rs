//! What a loader ran and measured, for run summaries: its dataset, placement, device and I/O
//! paths, pools, start-up phases, page-cache pool and sources (the getters a report is made from).

use super::*;

impl Loader {
    /// The synthetic dataset this loader generated at open (`dataset.generate`), if it did.
    pub fn generated(&self) -> Option<&crate::shards::dataset::Generated> {
        self.inner.generated.as_ref()
    }

    /// The dataset index.
    pub fn index(&self) -> &DatasetIndex {
        &self.inner.index
    }

    /// Rank and world size.
    pub fn rank_world(&self) -> (usize, usize) {
        (self.inner.rank, self.inner.world)
    }

    /// The device batches go to, and why it was chosen.
    pub fn device(&self) -> (&Arc<dyn Device>, &str) {
        (&self.inner.device, &self.inner.device_reason)
    }

    /// The io_uring engine.
    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// The staging pool and, on a GPU, the batch pool.
    pub fn pools(&self) -> (&UbPool, Option<&UbPool>) {
        (&self.inner.staging, self.inner.batch_pool.as_ref())
    }

    /// The path reads take (the first shard's; all are opened the same way), with the planned read
    /// size where the sources raised it and the prefetch window where there is one.
    pub fn io_path(&self) -> String {
        let mut p = self
            .inner
            .sources
            .first()
            .map_or_else(|| "none".to_string(), |s| s.describe());
        let size = |b: u64| crate::config::ByteSize(b).to_string();
        if let Some(m) = self.inner.raised_min_read {
            p += &format!(
                "; reads of ≥ {} (object_store.min_read, over loader.min_read {})",
                size(m),
                size(self.inner.cfg.loader.min_read.0)
            );
        }
        if self.inner.advise_window > 0 {
            p += &format!(
                "; prefetch {} ahead of the reads in flight",
                size(self.inner.advise_window)
            );
        }
        p
    }

    /// The planner's smallest read when the sources raised it above `loader.min_read` (an object
    /// dataset: `object_store.min_read`).
    pub fn raised_min_read(&self) -> Option<u64> {
        self.inner.raised_min_read
    }

    /// Bytes of planned reads advised to the sources ahead of the reads in flight (a cache's
    /// prefetch window); 0: none.
    pub fn advise_window(&self) -> u64 {
        self.inner.advise_window
    }

    /// Seconds each phase of this loader's start took, in order: `device` (selecting it: CUDA's
    /// context), `engine` (runtime, rings, copy threads), `dataset` (indexing and opening the
    /// shards, GPT indices), `pools` (allocating and registering the staging, batch and pack
    /// pools), `page_cache`.
    pub fn startup_phases(&self) -> &[(&'static str, f64)] {
        &self.inner.startup
    }

    /// The registered page cache: (mapped shards, pinned bytes, budget, registrations, seconds spent
    /// registering, why the budget is what it is); `None` when off.
    pub fn page_cache(&self) -> Option<(usize, u64, u64, u64, f64, String)> {
        self.inner.page_cache.as_ref().map(|pc| {
            let (m, p, b, r, t) = pc.stats();
            (m, p, b, r, t, pc.budget_reason.clone())
        })
    }

    /// Registers every resident shard of the page cache now, on this thread, so that the chunks
    /// started from here on copy straight out of the mappings (for a caller that knows many epochs
    /// follow; `pool.page_cache_register = "auto"` does it in the background once a second epoch
    /// starts). Returns the shards registered; 0 without a page cache.
    pub fn register_page_cache(&self) -> usize {
        self.inner
            .page_cache
            .as_ref()
            .map_or(0, |pc| pc.register_now())
    }

    /// The local devices reads are balanced over (0: none, plan order; `engine.balance_devices`)
    /// and the reads given a block ahead of an earlier one of the plan.
    pub fn read_balance(&self) -> (usize, u64) {
        let n = self.inner.read_devices.as_ref().map_or(0, |d| d.count - 1);
        (n, self.inner.stats.reads_ahead.load(Ordering::Relaxed))
    }

    /// The object store's cost of the epochs begun: predicted as each began, and realised since
    /// the first did (waiting up to 10 s for an epoch still being replayed); `None` when the
    /// dataset is not in an object store.
    pub fn object_store_cost(&self) -> Option<crate::objstore::CostReport> {
        self.inner
            .estimator
            .as_ref()?
            .report(Duration::from_secs(10))
    }

    /// Staging blocks an epoch of mostly cold O_DIRECT reads cycles through (`pool.cold_staging_blocks`;
    /// the staging pool's size when it holds none back), and the epochs that did.
    pub fn cold_staging(&self) -> (usize, u64) {
        (
            self.inner.staging.block_count() - self.inner.cold_hold_back,
            self.inner.stats.cold_staging_epochs.load(Ordering::Relaxed),
        )
    }

    /// Cold shards per epoch (summed over epochs): (filled into the page cache because the run
    /// reads them again, read with O_DIRECT and left out of it: a single pass).
    pub fn page_cache_cold_paths(&self) -> (u64, u64) {
        self.inner
            .page_cache
            .as_ref()
            .map_or((0, 0), |pc| pc.cold_paths())
    }

    /// Shards mapped without registration for CPU copies into packed batches (GPT windows,
    /// several-column samples).
    pub fn page_cache_cpu_mapped(&self) -> u64 {
        self.inner
            .page_cache
            .as_ref()
            .map_or(0, |pc| pc.cpu_mapped())
    }

    /// (objects mapped from their cache's chunk files, objects whose mapped chunks were evicted and
    /// that went back to cache reads).
    pub fn page_cache_chunk_maps(&self) -> (u64, u64) {
        self.inner
            .page_cache
            .as_ref()
            .map_or((0, 0), |pc| pc.chunk_maps())
    }

    /// Objects whose cache hits copied out of their chunk files' unregistered mapping, counted per
    /// epoch (until the registrar registered them).
    pub fn page_cache_chunks_staged(&self) -> u64 {
        self.inner
            .page_cache
            .as_ref()
            .map_or(0, |pc| pc.chunks_staged())
    }

    /// Of [`Loader::page_cache_chunks_staged`], the object-epochs that read the epoch before's
    /// staged mapping again: its chunk files checked through the mapping's own descriptors (same
    /// inode at each path, same size, wholly resident), none opened or mapped anew.
    pub fn page_cache_chunks_staged_kept(&self) -> u64 {
        self.inner
            .page_cache
            .as_ref()
            .map_or(0, |pc| pc.chunks_staged_kept())
    }

    /// Shards the background registrar registered (`pool.page_cache_register = "auto"`).
    pub fn page_cache_background_registrations(&self) -> u64 {
        self.inner
            .page_cache
            .as_ref()
            .map_or(0, |pc| pc.registered_in_background())
    }

    /// The shards' sources, in index order.
    pub fn sources(&self) -> &[Arc<dyn Source>] {
        &self.inner.sources
    }

    /// Counters.
    pub fn stats(&self) -> &LoaderStats {
        &self.inner.stats
    }

    /// The pools' `0 = auto` keys as resolved at open, each with its reason.
    pub fn resolved(&self) -> &[super::resolve::Resolved] {
        &self.inner.resolved
    }

    /// The configuration.
    pub fn config(&self) -> &RunConfig {
        &self.inner.cfg
    }
}
