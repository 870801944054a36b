//! A mapped region: the fault thread that fetches pages on first touch, write-back dirty tracking
//! (write-protect faults, or the kernel's with PAGEMAP_SCAN), and the barrier that pushes dirty pages
//! (requests straight out of the mapping, or one-sided RDMA WRITEs from a registered block).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::SmcError;
use super::region::{MapOptions, Region, SyncMode};
use crate::smc_sys::{Fault, Poisoned, UffdMapping};

mod push;

use push::{Push, push_all_one_sided, push_requests};

/// Runs of adjacent pages `(first, count)` from sorted page numbers.
fn runs_of(pages: impl IntoIterator<Item = usize>) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for p in pages {
        match runs.last_mut() {
            Some((s, n)) if *s + *n == p => *n += 1,
            _ => runs.push((p, 1)),
        }
    }
    runs
}

/// 4 KiB pages the first PAGEMAP_SCAN of a barrier looks for; each next scan looks for twice as
/// many, up to [`SCAN_MAX`]: the first push starts early, and later scans overlap with the pushes
/// of the earlier ones on the wire.
const SCAN_FIRST: usize = 64;
/// Vectored writes of a barrier sent before their acknowledgements are taken (each is ~20 bytes:
/// 256 of them stay far below any socket buffer).
const ACK_WINDOW: usize = 256;
const SCAN_MAX: usize = 1024;

/// A barrier's walk over the mapping's written pages (kernel dirty tracking): batch by batch, each
/// write-protected again by the scan that finds it.
struct Scanner {
    next: usize,
    batch: usize,
    done: bool,
    spent: Duration,
    failed: Option<String>,
}

impl Scanner {
    /// The next batch's SMC pages (of `page` bytes) not already in `pages`, added to it. A failed
    /// scan ends the walk (kept in `failed`; the pages found before it are still pushed).
    fn batch(&mut self, m: &UffdMapping, page: usize, pages: &mut BTreeSet<usize>) -> Vec<usize> {
        let t = Instant::now();
        let mut fresh = Vec::new();
        match m.scan_written_from(self.next, self.batch) {
            Ok((runs, next)) => {
                for (o, l) in runs {
                    for p in o / page..(o + l).div_ceil(page) {
                        if pages.insert(p) {
                            fresh.push(p);
                        }
                    }
                }
                self.done = next <= self.next || next >= m.len();
                self.next = next;
                self.batch = (self.batch * 2).min(SCAN_MAX);
            }
            Err(e) => {
                self.failed = Some(e);
                self.done = true;
            }
        }
        self.spent += t.elapsed();
        fresh.sort_unstable();
        fresh
    }
}

pub(super) struct MapShared {
    pub(super) m: UffdMapping,
    pub(super) region: Region,
    pub(super) page: usize,
    pub(super) readahead: usize,
    pub(super) spin: Duration,
    pub(super) wp: bool,
    pub(super) present: Vec<AtomicBool>,
    pub(super) dirty: Mutex<BTreeSet<usize>>,
    pub(super) failed: AtomicBool,
    /// One barrier at a time.
    pub(super) barrier: Mutex<()>,
    /// The block faults are fetched into (page × (1 + readahead) bytes); dropped before its pool.
    pub(super) staging: Mutex<Option<ubdirect_ub::Lease>>,
    /// The block barriers push from over a one-sided transport ([`PUSH_BLOCK`] or the region's
    /// size); dropped before its pool.
    pub(super) push: Mutex<Option<ubdirect_ub::Lease>>,
    pub(super) _pool: Option<ubdirect_ub::UbPool>,
    pub(super) _push_pool: Option<ubdirect_ub::UbPool>,
}

/// The registered block a barrier copies dirty runs into before writing them one-sided: large
/// enough that a 4 MiB barrier is one copy and one batch of WRITEs.
pub(super) const PUSH_BLOCK: usize = 4 << 20;

impl MapShared {
    fn fail(&self) {
        if !self.failed.swap(true, Ordering::SeqCst) {
            let name = &self.region.desc.name;
            match self.m.poison() {
                Ok(Poisoned::Sigbus) => {}
                Ok(Poisoned::Sigsegv { why }) => ubdirect_ub::fallback::record(
                    "smc_unavailable_sigsegv",
                    format!(
                        "smc region {name:?}: cannot install the SIGBUS mapping ({why}); \
                         accesses to the unavailable region raise SIGSEGV instead"
                    ),
                ),
                Err(why) => {
                    ubdirect_ub::fallback::record(
                        "smc_unavailable_no_signal",
                        format!("smc region {name:?}: cannot poison the mapping: {why}"),
                    );
                    tracing::error!(
                        region = %name,
                        "smc region unavailable and its mapping cannot be poisoned ({why}): \
                         threads faulting on it stay blocked"
                    );
                }
            }
        }
    }

    fn handle(&self, f: Fault) -> Result<(), SmcError> {
        let off = (f.addr - self.m.base() as u64) as usize;
        let p = off / self.page;
        let stats = &self.region.client.inner.stats;
        if f.wp {
            stats.wp_faults.fetch_add(1, Ordering::Relaxed);
            if self.dirty.lock().map(|mut d| d.insert(p)).unwrap_or(false) {
                stats.dirty_pages.fetch_add(1, Ordering::Relaxed);
            }
            self.m
                .protect(p * self.page, self.page, false)
                .map_err(|why| SmcError::Map {
                    region: self.region.desc.name.clone(),
                    why,
                })?;
            return Ok(());
        }
        if self.present[p].load(Ordering::SeqCst) {
            self.m.wake(p * self.page, self.page);
            return Ok(());
        }
        // The faulting page and read-ahead pages up to the first present one.
        let mut n = 1;
        while n <= self.readahead
            && p + n < self.present.len()
            && !self.present[p + n].load(Ordering::SeqCst)
        {
            n += 1;
        }
        let start = (p * self.page) as u64;
        let end = (start + (n * self.page) as u64).min(self.region.desc.size);
        // Received straight into the mapping's staging block (one UB lease registered with the
        // transport, reused by every fault: over RDMA the READ lands in it); a fresh buffer only
        // when no pool could be made (a recorded fallback).
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let got = end.saturating_sub(start) as usize;
        let mut fresh = Vec::new();
        let buf: &mut [u8] = match staging.as_mut() {
            Some(l) if l.capacity() >= n * self.page => {
                if got > 0 {
                    self.region.fetch(start, l, got, self.spin)?;
                }
                match l.as_mut_slice() {
                    Ok(b) => &mut b[..n * self.page],
                    Err(e) => {
                        return Err(SmcError::Map {
                            region: self.region.desc.name.clone(),
                            why: format!("the staging block is not host memory: {e}"),
                        });
                    }
                }
            }
            _ => {
                fresh.resize(n * self.page, 0);
                if got > 0 {
                    self.region.read_spin(start, &mut fresh[..got], self.spin)?;
                }
                &mut fresh
            }
        };
        // Past the region's end: zeros (the block is reused).
        buf[got..].fill(0);
        stats.faults.fetch_add(1, Ordering::Relaxed);
        // A first touch that is a store, with fault-tracked dirtiness: dirty before the fill wakes
        // the writer (a barrier racing with this fault must not miss it), released after. With
        // kernel tracking, the retried store is resolved and recorded by the kernel itself.
        let store_miss = f.write && self.wp && !self.m.wp_async();
        if store_miss && self.dirty.lock().map(|mut d| d.insert(p)).unwrap_or(false) {
            stats.dirty_pages.fetch_add(1, Ordering::Relaxed);
        }
        self.m
            .fill(p * self.page, buf, self.wp)
            .map_err(|why| SmcError::Map {
                region: self.region.desc.name.clone(),
                why,
            })?;
        for q in p..p + n {
            self.present[q].store(true, Ordering::SeqCst);
        }
        if store_miss {
            self.m
                .protect(p * self.page, self.page, false)
                .map_err(|why| SmcError::Map {
                    region: self.region.desc.name.clone(),
                    why,
                })?;
        }
        Ok(())
    }
}

pub(super) fn fault_loop(sh: &MapShared) {
    let mut faults = Vec::new();
    let spin = sh.spin;
    let mut last = Instant::now()
        .checked_sub(spin)
        .unwrap_or_else(Instant::now);
    loop {
        faults.clear();
        let got = if last.elapsed() < spin {
            sh.m.try_read(&mut faults).map(|_| true)
        } else {
            sh.m.wait(&mut faults)
        };
        match got {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                tracing::error!("smc fault thread: {e}");
                sh.fail();
                return;
            }
        }
        if faults.is_empty() {
            std::hint::spin_loop();
            continue;
        }
        last = Instant::now();
        for f in faults.drain(..) {
            if let Err(e) = sh.handle(f) {
                tracing::error!("smc fault at {:#x}: {e}; accesses now raise SIGBUS", f.addr);
                sh.fail();
                return;
            }
        }
    }
}

/// What a barrier pushed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BarrierStats {
    /// Dirty pages pushed.
    pub pages: usize,
    /// Contiguous transfers (runs of adjacent dirty pages, split at max_request).
    pub transfers: usize,
    /// Network transactions (vectored writes carrying the transfers, each ≤ max_request).
    pub transactions: usize,
    /// Bytes pushed.
    pub bytes: usize,
    /// Time spent finding the dirty pages and protecting them again (PAGEMAP_SCAN, or
    /// re-protecting fault-tracked pages); over TCP most of it overlaps with `push`.
    pub scan: Duration,
    /// Time from the first byte sent to the last acknowledgement (or completion).
    pub push: Duration,
}

/// A region mapped into this process. Dropping it stops its fault thread and unmaps it (dirty pages
/// not pushed by a barrier are lost).
pub struct Mapping {
    pub(super) sh: Arc<MapShared>,
    pub(super) thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("region", &self.sh.region.desc.name)
            .field("page", &self.sh.page)
            .finish()
    }
}

impl Mapping {
    /// Start address, for code that loads and stores through raw pointers. The bytes behind it are
    /// shared memory that the kernel and other threads change at any time (and that turns into a
    /// SIGBUS mapping when the region becomes unavailable): access them through raw pointers, never
    /// through a `&[u8]` made from this pointer. Dereferencing it is `unsafe`, and the caller's
    /// promise there is the usual one for shared memory: no data race with other accesses to the
    /// same bytes. [`Mapping::load`] and [`Mapping::store`] are safe: every access they make is a
    /// relaxed atomic access of an aligned 8-byte word (`AtomicU64::from_ptr` on this address plus a
    /// multiple of 8 is the way to share bytes with them from raw-pointer code).
    pub fn as_ptr(&self) -> *mut u8 {
        self.sh.m.base()
    }

    /// Stores `data` at `offset` in the mapping (write-back: the pages become dirty). Sound with
    /// any other loads and stores through this mapping, from any thread: the copy is made of atomic
    /// word accesses (concurrent stores to the same bytes leave each word old or new).
    pub fn store(&self, offset: usize, data: &[u8]) -> Result<(), SmcError> {
        self.sh.region.check(offset as u64, data.len() as u64)?;
        if !self.sh.region.desc.writable {
            return Err(SmcError::ReadOnly {
                region: self.sh.region.desc.name.clone(),
            });
        }
        self.alive()?;
        self.sh.m.store(offset, data).map_err(|why| SmcError::Map {
            region: self.sh.region.desc.name.clone(),
            why,
        })
    }

    /// Loads `buf.len()` bytes at `offset` from the mapping, with atomic word loads (a concurrent
    /// store shows word by word, never as a data race).
    pub fn load(&self, offset: usize, buf: &mut [u8]) -> Result<(), SmcError> {
        self.sh.region.check(offset as u64, buf.len() as u64)?;
        self.alive()?;
        self.sh.m.load(offset, buf).map_err(|why| SmcError::Map {
            region: self.sh.region.desc.name.clone(),
            why,
        })
    }

    fn alive(&self) -> Result<(), SmcError> {
        if self.sh.failed.load(Ordering::SeqCst) {
            return Err(SmcError::Unavailable {
                region: self.sh.region.desc.name.clone(),
                attempts: 0,
                waited: Duration::ZERO,
                last: None,
            });
        }
        Ok(())
    }

    /// Write-through from the mapping's side: sends `data` to the server, waits for the ack, and
    /// stores it locally too.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), SmcError> {
        self.sh.region.write(offset as u64, data)?;
        self.store(offset, data)
    }

    /// Pushes every dirty page (adjacent pages merged, split at the server's max_request) and
    /// returns after the server acknowledged all of them; the pages are write-protected again
    /// first, so stores made during the barrier are caught for the next one.
    pub fn barrier(&self) -> Result<BarrierStats, SmcError> {
        self.alive()?;
        let _one = self.sh.barrier.lock().unwrap_or_else(|p| p.into_inner());
        let name = || self.sh.region.desc.name.clone();
        let map_err = |why| SmcError::Map {
            region: name(),
            why,
        };
        let page = self.sh.page;
        let m = &self.sh.m;
        let t0 = Instant::now();
        let mut pages = self.recorded_dirty().map_err(map_err)?;
        let recorded = pages.len();
        // With kernel tracking the written pages are found by PAGEMAP_SCAN in growing batches, each
        // write-protected again by the scan that finds it; over TCP a batch's pages go out before
        // the next batch is scanned, so the page-table walk overlaps with the wire.
        let mut scan = Scanner {
            next: 0,
            batch: SCAN_FIRST,
            done: !m.wp_async(),
            spent: t0.elapsed(),
            failed: None,
        };
        let size = self.sh.region.desc.size as usize;
        let stats = &self.sh.region.client.inner.stats;
        let mut push = self.sh.push.lock().unwrap_or_else(|p| p.into_inner());
        let mut first_send: Option<Instant> = None;
        let p = Push {
            m,
            page,
            size,
            stats,
        };
        let pushed = self.push_dirty(&p, &mut push, &mut pages, &mut scan, &mut first_send);
        stats
            .dirty_pages
            .fetch_add((pages.len() - recorded) as u64, Ordering::Relaxed);
        let (transfers, transactions, bytes) = match pushed {
            Ok((v, _)) => v,
            Err(e) => {
                // Not pushed: still dirty (the region is unavailable now, but nothing is forgotten).
                if let Ok(mut d) = self.sh.dirty.lock() {
                    d.extend(pages.iter().copied());
                }
                return Err(e);
            }
        };
        if let Some(why) = scan.failed {
            // What was found before the failed scan went out; the rest stays written (the next
            // barrier's scan finds it).
            return Err(map_err(why));
        }
        stats
            .pushes
            .fetch_add(transactions as u64, Ordering::Relaxed);
        stats
            .bytes_pushed
            .fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(BarrierStats {
            pages: pages.len(),
            transfers,
            transactions,
            bytes,
            scan: scan.spent,
            push: first_send.map(|t| t.elapsed()).unwrap_or_default(),
        })
    }

    /// A barrier's push on a live link (retried on a fresh one): one-sided from the `push` block
    /// where the link's transport has it, else as requests. Returns (transfers, transactions,
    /// bytes) and the region's id.
    fn push_dirty(
        &self,
        p: &Push<'_>,
        push: &mut Option<ubdirect_ub::Lease>,
        pages: &mut BTreeSet<usize>,
        scan: &mut Scanner,
        first_send: &mut Option<Instant>,
    ) -> Result<((usize, usize, usize), crate::client::RegionId), SmcError> {
        self.sh
            .region
            .client
            .with_link(&self.sh.region.desc, |link, rid, until| {
                if let Some((os, w)) = link.one_sided(&self.sh.region.desc.name)
                    && let Some(push) = push.as_mut()
                {
                    return push_all_one_sided(
                        p, link, os, w, push, scan, pages, first_send, until,
                    );
                }
                push_requests(p, link, rid, pages, scan, first_send, until)
            })
    }

    /// Takes the pages recorded by write-protect faults (without kernel tracking: every dirty page)
    /// and, without kernel tracking, protects each again before it is read, so a store during the
    /// barrier is caught for the next one.
    fn recorded_dirty(&self) -> Result<BTreeSet<usize>, String> {
        let (page, m) = (self.sh.page, &self.sh.m);
        let pages: BTreeSet<usize> =
            std::mem::take(&mut *self.sh.dirty.lock().unwrap_or_else(|p| p.into_inner()));
        if !m.wp_async() {
            for &p in &pages {
                m.protect(p * page, page, true)?;
            }
        }
        Ok(pages)
    }

    /// Same as [`Mapping::barrier`], for code that reads `flush` better.
    pub fn flush(&self) -> Result<BarrierStats, SmcError> {
        self.barrier()
    }

    /// Pages dirty now as far as the fault thread knows (with kernel-tracked write protection the
    /// count is known only at the next barrier: this returns what earlier faults recorded).
    pub fn dirty_pages(&self) -> usize {
        self.sh.dirty.lock().map(|d| d.len()).unwrap_or(0)
    }

    /// Whether dirty pages are tracked by the kernel (WP_ASYNC + PAGEMAP_SCAN).
    pub fn kernel_dirty_tracking(&self) -> bool {
        self.sh.m.wp_async()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        self.sh.m.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Region {
    /// Maps the region into this process (see the module documentation).
    pub fn map(&self, opts: MapOptions) -> Result<Mapping, SmcError> {
        let bad = |why: String| SmcError::Map {
            region: self.desc.name.clone(),
            why,
        };
        if !opts.page_size.is_power_of_two() || !(4096..=2 << 20).contains(&opts.page_size) {
            return Err(bad(format!(
                "page size {} is not a power of two in 4 KiB ..= 2 MiB",
                opts.page_size
            )));
        }
        let len = (self.desc.size as usize).div_ceil(opts.page_size) * opts.page_size;
        let wp = opts.mode == SyncMode::WriteBack && self.desc.writable;
        let m = UffdMapping::new(len, self.desc.writable, wp, opts.wp_async).map_err(bad)?;
        if wp && opts.wp_async && !m.wp_async() {
            ubdirect_ub::fallback::record(
                "smc_wp_sync",
                "the kernel has no UFFD_FEATURE_WP_ASYNC / PAGEMAP_SCAN (Linux < 6.7): dirty pages \
                 are tracked by write-protect faults through the fault thread",
            );
        }
        let pages = len / opts.page_size;
        let block = opts
            .page_size
            .checked_mul(opts.readahead.saturating_add(1))
            .ok_or_else(|| bad(format!("readahead {} is too large", opts.readahead)))?;
        let MapBlocks {
            pool,
            staging,
            push,
            push_pool,
        } = self.map_blocks(block, len, wp);
        let sh = Arc::new(MapShared {
            m,
            region: self.clone(),
            page: opts.page_size,
            readahead: opts.readahead,
            spin: opts.spin,
            wp,
            present: (0..pages).map(|_| AtomicBool::new(false)).collect(),
            dirty: Mutex::new(BTreeSet::new()),
            failed: AtomicBool::new(false),
            barrier: Mutex::new(()),
            staging: Mutex::new(staging),
            push: Mutex::new(push),
            _pool: pool,
            _push_pool: push_pool,
        });
        let s2 = sh.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ub-smc-{}", self.desc.name))
            .spawn(move || fault_loop(&s2))
            .map_err(|e| bad(format!("cannot start the fault thread: {e}")))?;
        Ok(Mapping {
            sh,
            thread: Some(thread),
        })
    }

    /// The mapping's registered blocks: the staging block faults are fetched into (`block` bytes)
    /// and, for write-back over a transport with one-sided writes, the block barriers push from;
    /// each with its pool, or none (a fallback recorded).
    fn map_blocks(&self, block: usize, len: usize, wp: bool) -> MapBlocks {
        // Registered with the transport once, here (RDMA: the faults' READs land in it).
        let registrar = self.client.inner.client.registrar();
        let host_pool = |name: String, block: usize| {
            let mut b = ubdirect_ub::UbPool::builder(ubdirect_ub::PoolConfig::new(
                name,
                block,
                1,
                ubdirect_ub::MemoryKind::Host,
            ));
            if let Some(r) = &registrar {
                b = b.register_with(r.clone());
            }
            b.build()
        };
        let pool = host_pool(format!("smc-{}", self.desc.name), block);
        // Write-back over a transport with one-sided writes: dirty runs are copied into this block
        // (registered once) and written from it; the mapping itself is never registered (pinning
        // its pages would fault in the whole region).
        let push = match (&registrar, wp) {
            (Some(_), true) => {
                let block = PUSH_BLOCK.min(len.div_ceil(4096) * 4096);
                match host_pool(format!("smc-{}-push", self.desc.name), block) {
                    Ok(p) => p.try_acquire().map(|l| (l, p)),
                    Err(e) => {
                        ubdirect_ub::fallback::record(
                            "smc_push_buffer",
                            format!(
                                "no registered push block for SMC barriers ({e}): dirty pages go \
                                 out as requests on the connection"
                            ),
                        );
                        None
                    }
                }
            }
            _ => None,
        };
        let (push, push_pool) = match push {
            Some((l, p)) => (Some(l), Some(p)),
            None => (None, None),
        };
        let (pool, staging) = match pool {
            Ok(p) => {
                let l = p.try_acquire();
                (Some(p), l)
            }
            Err(e) => {
                ubdirect_ub::fallback::record(
                    "smc_fault_buffers",
                    format!("no staging pool for SMC faults ({e}): each fault allocates its pages"),
                );
                (None, None)
            }
        };
        MapBlocks {
            pool,
            staging,
            push,
            push_pool,
        }
    }
}

/// A mapping's blocks and their pools (`Region::map_blocks`).
struct MapBlocks {
    pool: Option<ubdirect_ub::UbPool>,
    staging: Option<ubdirect_ub::Lease>,
    push: Option<ubdirect_ub::Lease>,
    push_pool: Option<ubdirect_ub::UbPool>,
}
