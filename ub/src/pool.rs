//! UB pools, leases and completion-gated recycling.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use crate::device::{Device, DeviceKind, DeviceMemory};
use crate::sys::HostMapping;
use crate::{MemoryKind, PoolConfig, UbError};

mod builder;
mod slots;

pub use builder::UbPoolBuilder;

use slots::{SlotEntry, Slots};

/// Process-unique pool identifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(pub u64);

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// Names one use of one block: the pool, the slot and the slot's generation at the time it was lent.
/// A handle from an earlier generation is refused by [`UbPool::resolve`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UbHandle {
    /// The pool.
    pub pool: PoolId,
    /// The block's index in the pool.
    pub slot: u32,
    /// Incremented every time the slot returns to `Free`.
    pub generation: u64,
}

/// Where a slot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// Ready to be lent.
    Free,
    /// Held by a lease, nothing in flight.
    Lent,
    /// Held by a lease, one or more I/Os or copies target it.
    InFlight,
    /// The lease was dropped while I/O or a copy was in flight; only the completion frees it.
    Orphaned,
}

/// One block of a pool: its addresses as the pool made them.
///
/// Only a pool makes one (the fields are private), so its addresses are always a live block of a
/// pool — the fact that lets a [`Registrar`] hand them to a kernel or a peer in safe code.
#[derive(Debug, Clone, Copy)]
pub struct BlockView {
    index: u32,
    host_ptr: Option<*mut u8>,
    device_ptr: Option<u64>,
    len: usize,
}

impl BlockView {
    /// Block index.
    pub fn index(&self) -> u32 {
        self.index
    }
    /// Host address (host-visible kinds).
    pub fn host_ptr(&self) -> Option<*mut u8> {
        self.host_ptr
    }
    /// Device address (device memory, or pinned memory mapped for the device).
    pub fn device_ptr(&self) -> Option<u64> {
        self.device_ptr
    }
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the block holds no bytes (never, for a pool's block).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What a registrar is shown when a pool is made.
///
/// Only [`UbPoolBuilder::build`] makes one (the fields are private): every block it lists is the
/// pool's own memory, allocated before the registrars are called and unmapped only after every
/// registration they returned has been dropped. That is the promise a registrar relies on to
/// register the memory for a kernel (io_uring fixed buffers) or a peer (an RDMA region) without an
/// `unsafe` contract of its own: safe code cannot make a descriptor of memory it picked.
#[derive(Debug)]
pub struct PoolDescriptor<'a> {
    id: PoolId,
    name: &'a str,
    kind: MemoryKind,
    block_size: usize,
    blocks: &'a [BlockView],
}

impl<'a> PoolDescriptor<'a> {
    /// The pool's id.
    pub fn id(&self) -> PoolId {
        self.id
    }
    /// The pool's name.
    pub fn name(&self) -> &'a str {
        self.name
    }
    /// Its memory kind.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }
    /// Bytes per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Every block, in index order.
    pub fn blocks(&self) -> &'a [BlockView] {
        self.blocks
    }
}

/// A consumer that must know a pool's memory before it can use it (an io_uring ring as fixed buffers,
/// a transport as a memory region). Called once per pool, at creation, with a descriptor only the
/// pool can make (see [`PoolDescriptor`]).
pub trait Registrar: Send + Sync {
    /// Who registers, for reports (`io_uring`, `cuda`, `rdma`).
    fn consumer(&self) -> String;
    /// Registers every block of the pool; the returned value unregisters on drop. The error is the
    /// consumer's own (kept as the `source()` of [`UbError::Registration`]).
    fn register(
        &self,
        pool: &PoolDescriptor<'_>,
    ) -> Result<Box<dyn Registration>, Box<dyn std::error::Error + Send + Sync>>;
    /// Whether the consumer can also use the pool unregistered (more slowly): io_uring reads an
    /// unregistered buffer by address, an RDMA NIC cannot. A pool that may not pin its memory
    /// (RLIMIT_MEMLOCK) leaves these registrars out.
    fn optional(&self) -> bool {
        false
    }
}

/// A live registration; dropping it unregisters. Dropped before the pool's memory is freed.
pub trait Registration: Send + Sync + fmt::Debug {
    /// Who holds the registration.
    fn consumer(&self) -> String;
}

enum Memory {
    Host(HostMapping),
    Device(Box<dyn DeviceMemory>),
}

struct Gauges {
    free: metrics::Gauge,
    lent: metrics::Gauge,
    in_flight: metrics::Gauge,
    orphaned: metrics::Gauge,
    acquire_wait: metrics::Histogram,
}

struct PoolInner {
    id: PoolId,
    cfg: PoolConfig,
    device_name: String,
    host_base: Option<usize>,
    device_base: Option<u64>,
    slots: Mutex<Slots>,
    sem: Semaphore,
    registrations: Mutex<Vec<Box<dyn Registration>>>,
    registration_count: u64,
    consumers: Vec<String>,
    acquires: AtomicU64,
    acquire_wait_ns: AtomicU64,
    acquire_wait_max_ns: AtomicU64,
    gauges: Gauges,
    // Declared last: dropped after everything above (registrations are also emptied in Drop first).
    #[expect(
        dead_code,
        reason = "owns the pool's memory; read only through host_base/device_base"
    )]
    memory: Memory,
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // Registrations refer to the memory: release them before the memory goes.
        let regs = std::mem::take(
            self.registrations
                .get_mut()
                .unwrap_or_else(|p| p.into_inner()),
        );
        drop(regs);
        self.gauges.free.set(0.0);
        self.gauges.lent.set(0.0);
        self.gauges.in_flight.set(0.0);
        self.gauges.orphaned.set(0.0);
    }
}

impl PoolInner {
    fn lock(&self) -> MutexGuard<'_, Slots> {
        // A panic while holding this lock cannot leave the slot table half-updated (every update is a
        // few plain field writes), so a poisoned lock is safe to keep using.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update_gauges(&self, s: &Slots) {
        self.gauges.free.set(s.count[0] as f64);
        self.gauges.lent.set(s.count[1] as f64);
        self.gauges.in_flight.set(s.count[2] as f64);
        self.gauges.orphaned.set(s.count[3] as f64);
    }

    /// Returns an idle slot to the free list (checked: [`Slots::release`]) and its permit.
    fn release(&self, s: &mut Slots, slot: u32) {
        if s.release(slot) {
            self.sem.add_permits(1);
        }
    }

    fn lease_dropped(&self, slot: u32, generation: u64) {
        let mut s = self.lock();
        if s.drop_lease(slot, generation) {
            self.release(&mut s, slot);
        }
        self.update_gauges(&s);
    }

    fn op_completed(&self, slot: u32) {
        let mut s = self.lock();
        if s.complete_op(slot) {
            self.release(&mut s, slot);
        }
        self.update_gauges(&s);
    }

    fn counts(&self) -> (usize, usize, usize, usize) {
        let c = self.lock().count;
        (c[0], c[1], c[2], c[3])
    }
}

/// A pool of equally sized, register-once blocks. Cheap to clone (shared).
#[derive(Clone)]
pub struct UbPool {
    inner: Arc<PoolInner>,
}

impl fmt::Debug for UbPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UbPool")
            .field("id", &self.inner.id)
            .field("name", &self.inner.cfg.name)
            .field("kind", &self.inner.cfg.kind)
            .field("block_size", &self.inner.cfg.block_size)
            .field("block_count", &self.inner.cfg.block_count)
            .finish()
    }
}

/// A snapshot of a pool's counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks in the pool.
    pub total: usize,
    /// Free blocks.
    pub free: usize,
    /// Lent, idle blocks.
    pub lent: usize,
    /// Lent blocks with I/O or copies in flight.
    pub in_flight: usize,
    /// Blocks whose lease was dropped mid-flight, waiting for their completion.
    pub orphaned: usize,
    /// Registrations made (at creation only; never grows).
    pub registrations: u64,
    /// Successful acquires.
    pub acquires: u64,
    /// Total time acquirers waited.
    pub acquire_wait: Duration,
    /// Longest single wait.
    pub acquire_wait_max: Duration,
}

impl UbPool {
    /// Starts building a pool from `cfg`.
    pub fn builder(cfg: PoolConfig) -> UbPoolBuilder {
        UbPoolBuilder {
            cfg,
            device: None,
            registrars: Vec::new(),
        }
    }

    /// A host pool with no registrations (convenience for tests and tools).
    pub fn new_host(cfg: PoolConfig) -> Result<Self, UbError> {
        Self::builder(cfg).build()
    }

    /// The pool's id.
    pub fn id(&self) -> PoolId {
        self.inner.id
    }

    /// The configuration it was made from.
    pub fn config(&self) -> &PoolConfig {
        &self.inner.cfg
    }

    /// Bytes per block.
    pub fn block_size(&self) -> usize {
        self.inner.cfg.block_size
    }

    /// Blocks in the pool.
    pub fn block_count(&self) -> usize {
        self.inner.cfg.block_count
    }

    /// Memory kind.
    pub fn kind(&self) -> MemoryKind {
        self.inner.cfg.kind
    }

    /// Name of the device that provided or registered the memory (`none` for plain host pools).
    pub fn device_name(&self) -> &str {
        &self.inner.device_name
    }

    /// Consumers the pool was registered with at creation.
    pub fn consumers(&self) -> &[String] {
        &self.inner.consumers
    }

    /// Keeps up to `n` of the blocks free now out of use until the guard drops, so that acquirers
    /// cycle through fewer blocks: the free list is a stack, so the blocks in use are the same few
    /// (the staging footprint of a cold epoch, docs/decisions.md "Cold staging depth"). Takes only
    /// what is free at the call, never waits; [`HeldBack::blocks`] says how many it got.
    pub fn hold_back(&self, n: usize) -> HeldBack {
        let mut got = 0;
        while got < n {
            match self.inner.sem.try_acquire() {
                Ok(p) => {
                    p.forget();
                    got += 1;
                }
                Err(_) => break,
            }
        }
        HeldBack {
            pool: self.inner.clone(),
            blocks: got,
        }
    }

    /// Takes a free block without waiting.
    pub fn try_acquire(&self) -> Option<Lease> {
        let permit = self.inner.sem.try_acquire().ok()?;
        permit.forget();
        Some(self.take_free(Duration::ZERO))
    }

    /// Waits for a free block — the pipeline's backpressure — for at most `deadline`.
    pub async fn acquire(&self, deadline: Duration) -> Result<Lease, UbError> {
        let start = Instant::now();
        match tokio::time::timeout(deadline, self.inner.sem.acquire()).await {
            Ok(Ok(permit)) => {
                permit.forget();
                Ok(self.take_free(start.elapsed()))
            }
            Ok(Err(_closed)) => Err(UbError::Closed {
                pool: self.inner.cfg.name.clone(),
            }),
            Err(_elapsed) => {
                let (_, lent, in_flight, orphaned) = self.inner.counts();
                Err(UbError::AcquireTimeout {
                    pool: self.inner.cfg.name.clone(),
                    waited: start.elapsed(),
                    lent,
                    in_flight,
                    orphaned,
                    total: self.inner.cfg.block_count,
                })
            }
        }
    }

    fn take_free(&self, waited: Duration) -> Lease {
        let inner = &self.inner;
        let mut s = inner.lock();
        // Invariant: semaphore permits <= free.len() (== unless blocks are held back), and we hold one
        // permit.
        let (slot, generation) = s
            .lend()
            .unwrap_or_else(|| unreachable!("permit held but free list empty"));
        inner.update_gauges(&s);
        drop(s);
        let ns = waited.as_nanos().min(u64::MAX as u128) as u64;
        inner.acquires.fetch_add(1, Ordering::Relaxed);
        inner.acquire_wait_ns.fetch_add(ns, Ordering::Relaxed);
        inner.acquire_wait_max_ns.fetch_max(ns, Ordering::Relaxed);
        inner.gauges.acquire_wait.record(waited.as_secs_f64());
        Lease {
            pool: self.inner.clone(),
            slot,
            generation,
        }
    }

    /// Closes the pool: waiting and future `acquire`s fail with [`UbError::Closed`]. Leases already
    /// out stay valid.
    pub fn close(&self) {
        self.inner.sem.close();
    }

    /// The state of one slot.
    pub fn slot_state(&self, slot: u32) -> Option<SlotState> {
        self.inner
            .lock()
            .entries
            .get(slot as usize)
            .map(SlotEntry::state)
    }

    /// Checks that `handle` names the current use of a slot of this pool and returns that block's view.
    pub fn resolve(&self, handle: UbHandle) -> Result<BlockView, UbError> {
        let s = self.inner.lock();
        let stale = |current| UbError::StaleHandle {
            handle,
            pool: self.inner.cfg.name.clone(),
            slot: handle.slot,
            current,
        };
        if handle.pool != self.inner.id {
            return Err(stale(0));
        }
        let e = s
            .entries
            .get(handle.slot as usize)
            .ok_or_else(|| stale(0))?;
        if e.generation != handle.generation || !e.leased {
            return Err(stale(e.generation));
        }
        Ok(self.block_view(handle.slot))
    }

    fn block_view(&self, slot: u32) -> BlockView {
        let bs = self.inner.cfg.block_size;
        BlockView {
            index: slot,
            host_ptr: self
                .inner
                .host_base
                .map(|b| (b + slot as usize * bs) as *mut u8),
            device_ptr: self
                .inner
                .device_base
                .map(|b| b + (slot as usize * bs) as u64),
            len: bs,
        }
    }

    /// Counters and the current distribution of slot states.
    pub fn stats(&self) -> PoolStats {
        let (free, lent, in_flight, orphaned) = self.inner.counts();
        PoolStats {
            total: self.inner.cfg.block_count,
            free,
            lent,
            in_flight,
            orphaned,
            registrations: self.inner.registration_count,
            acquires: self.inner.acquires.load(Ordering::Relaxed),
            acquire_wait: Duration::from_nanos(self.inner.acquire_wait_ns.load(Ordering::Relaxed)),
            acquire_wait_max: Duration::from_nanos(
                self.inner.acquire_wait_max_ns.load(Ordering::Relaxed),
            ),
        }
    }
}

/// Blocks kept out of use by [`UbPool::hold_back`]; dropping it gives them back.
#[must_use = "dropping it gives the blocks back at once"]
pub struct HeldBack {
    pool: Arc<PoolInner>,
    blocks: usize,
}

impl HeldBack {
    /// Blocks held back.
    pub fn blocks(&self) -> usize {
        self.blocks
    }
}

impl fmt::Debug for HeldBack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeldBack")
            .field("pool", &self.pool.cfg.name)
            .field("blocks", &self.blocks)
            .finish()
    }
}

impl Drop for HeldBack {
    fn drop(&mut self) {
        self.pool.sem.add_permits(self.blocks);
    }
}

/// An owned handle to one block. Dropping it returns the block to the pool — at once if nothing is in
/// flight, otherwise when the last completion arrives (the slot is `Orphaned` until then).
pub struct Lease {
    pool: Arc<PoolInner>,
    slot: u32,
    generation: u64,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("pool", &self.pool.cfg.name)
            .field("slot", &self.slot)
            .field("generation", &self.generation)
            .finish()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.pool.lease_dropped(self.slot, self.generation);
    }
}

impl Lease {
    /// The handle naming this use of the block.
    pub fn handle(&self) -> UbHandle {
        UbHandle {
            pool: self.pool.id,
            slot: self.slot,
            generation: self.generation,
        }
    }

    /// The pool's id.
    pub fn pool_id(&self) -> PoolId {
        self.pool.id
    }

    /// The pool's name.
    pub fn pool_name(&self) -> &str {
        &self.pool.cfg.name
    }

    /// The block's index in its pool.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Bytes in the block.
    pub fn capacity(&self) -> usize {
        self.pool.cfg.block_size
    }

    /// The pool's memory kind.
    pub fn kind(&self) -> MemoryKind {
        self.pool.cfg.kind
    }

    /// The block's host address, for host-visible kinds. Writing through it while an operation is in
    /// flight is a data race; use [`Lease::as_mut_slice`] for checked access.
    pub fn host_ptr(&self) -> Option<*mut u8> {
        self.pool
            .host_base
            .map(|b| (b + self.slot as usize * self.pool.cfg.block_size) as *mut u8)
    }

    /// The block's device address, for device memory.
    pub fn device_ptr(&self) -> Option<u64> {
        self.pool
            .device_base
            .map(|b| b + (self.slot as usize * self.pool.cfg.block_size) as u64)
    }

    /// The slot's current state (`Lent` or `InFlight` while this lease lives).
    pub fn state(&self) -> SlotState {
        self.pool.lock().entries[self.slot as usize].state()
    }

    /// Operations currently in flight on this block.
    pub fn ops_in_flight(&self) -> u32 {
        self.pool.lock().entries[self.slot as usize].ops
    }

    /// Checks that `offset..offset+len` lies inside the block.
    pub fn check_range(&self, offset: usize, len: usize) -> Result<(), UbError> {
        let bs = self.pool.cfg.block_size;
        match offset.checked_add(len) {
            Some(end) if end <= bs => Ok(()),
            _ => Err(UbError::OutOfRange {
                pool: self.pool.cfg.name.clone(),
                offset,
                len,
                block_size: bs,
            }),
        }
    }

    fn check_idle_host(&self) -> Result<*mut u8, UbError> {
        let ptr = self.host_ptr().ok_or_else(|| UbError::NotHostVisible {
            pool: self.pool.cfg.name.clone(),
            kind: self.pool.cfg.kind,
        })?;
        let ops = self.ops_in_flight();
        if ops > 0 {
            return Err(UbError::Busy {
                pool: self.pool.cfg.name.clone(),
                slot: self.slot,
                in_flight: ops,
            });
        }
        Ok(ptr)
    }

    /// The block's bytes; refused for device memory and while an operation is in flight.
    pub fn as_slice(&self) -> Result<&[u8], UbError> {
        let ptr = self.check_idle_host()?;
        // SAFETY: the block lies inside the pool's live mapping (kept alive by `self.pool`), is
        // exclusively ours while leased, and no I/O or copy is in flight (checked above; new ones need
        // `&mut self`, which this borrow prevents).
        Ok(unsafe { std::slice::from_raw_parts(ptr, self.pool.cfg.block_size) })
    }

    /// The block's bytes, mutable; refused for device memory and while an operation is in flight.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], UbError> {
        let ptr = self.check_idle_host()?;
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, self.pool.cfg.block_size) })
    }

    /// Marks an operation (I/O, copy, transfer) as in flight on this block. The slot cannot return to
    /// `Free` until the returned token is dropped — which the backend must do only when the hardware's
    /// completion (CQE, CUDA event, transport completion) says the block is no longer touched.
    ///
    /// # Safety
    ///
    /// The returned [`InFlight`] must be dropped only once the hardware's completion for the
    /// operation it stands for has arrived (an io_uring CQE, a CUDA event, a transport completion),
    /// or before that operation was ever handed to the hardware: dropping it while a DMA or an
    /// io_uring operation may still read or write the block lets the slot be recycled — lent again,
    /// written through [`Lease::as_mut_slice`] — under it. Leaking the token (`mem::forget`) is
    /// allowed: the slot then stays out of circulation.
    pub unsafe fn begin_op(&mut self) -> InFlight {
        let mut s = self.pool.lock();
        s.begin_op(self.slot);
        self.pool.update_gauges(&s);
        drop(s);
        InFlight {
            pool: self.pool.clone(),
            slot: self.slot,
            generation: self.generation,
        }
    }
}

/// Proof that an operation is in flight on a block; dropping it is the completion.
pub struct InFlight {
    pool: Arc<PoolInner>,
    slot: u32,
    generation: u64,
}

impl fmt::Debug for InFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight")
            .field("pool", &self.pool.cfg.name)
            .field("slot", &self.slot)
            .field("generation", &self.generation)
            .finish()
    }
}

impl InFlight {
    /// The handle of the lease the operation was started on.
    pub fn handle(&self) -> UbHandle {
        UbHandle {
            pool: self.pool.id,
            slot: self.slot,
            generation: self.generation,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.pool.op_completed(self.slot);
    }
}
