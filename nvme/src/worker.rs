//! One io_uring ring on its own thread: the FFI edge of the engine.
//!
//! Callers push commands onto the ring's queue and signal its eventfd only when the thread is about
//! to sleep (or sleeps) in `io_uring_enter`; the thread keeps an eventfd read armed in the ring, so
//! one wait covers both new commands and completions.
//!
//! Two kinds of ring run this loop: read rings (16-byte SQEs: `READ_FIXED` on registered files) and
//! passthrough rings (SQE128/CQE32: `URING_CMD` NVMe reads into fixed buffers). Both have the same
//! fixed-buffer table.

use std::collections::{HashSet, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use io_uring::{IoUring, cqueue, opcode, squeue, types};
use ubdirect_ub::{InFlight, fallback};

use crate::engine::{EngineConfig, EngineStats, FileInner};
use crate::passthru::{Namespace, NvmeError, NvmeStatus};
use crate::{IoError, passthru_sys, sys};

mod ops;
#[cfg(test)]
mod tests;

use ops::{CANCEL, Failure, WAKE};
pub(crate) use ops::{Cmd, NvmeOp, Op, ReadOp, Sqe};

struct Queue {
    cmds: Mutex<(VecDeque<Cmd>, bool)>,
    sleeping: AtomicBool,
    efd: OwnedFd,
}

pub(crate) struct WorkerHandle {
    queue: Arc<Queue>,
    thread: Option<JoinHandle<()>>,
}

impl WorkerHandle {
    pub(crate) fn send(&self, cmd: Cmd) -> Result<(), Cmd> {
        let mut q = self.queue.cmds.lock().unwrap_or_else(|p| p.into_inner());
        if q.1 {
            return Err(cmd);
        }
        q.0.push_back(cmd);
        drop(q);
        if self.queue.sleeping.swap(false, Ordering::SeqCst) {
            sys::eventfd_signal(&self.queue.efd);
        }
        Ok(())
    }

    pub(crate) fn shutdown(&mut self) {
        self.queue.cmds.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
        sys::eventfd_signal(&self.queue.efd);
        if let Some(t) = self.thread.take() {
            // The last engine reference can be dropped by the ring thread itself (a completing read
            // held the last file handle); it then exits on its own after draining.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// Fixed buffers registered on the rings: (first table index, the blocks' address and length).
pub(crate) type Buffers = (u32, Arc<Vec<(usize, usize)>>);

/// How a ring is set up.
pub(crate) struct RingSetup<'a> {
    /// Thread name.
    pub(crate) name: String,
    /// Ask for SQPOLL (read rings, by config).
    pub(crate) sqpoll: bool,
    /// Set up a registered-file table (read rings).
    pub(crate) files: bool,
    /// Fixed buffers already registered on the other rings: (first index, iovecs).
    pub(crate) buffers: &'a [Buffers],
}

pub(crate) struct Worker<S: Sqe, C: cqueue::EntryMarker> {
    ring: IoUring<S, C>,
    queue: Arc<Queue>,
    ops: Vec<Option<Op>>,
    free_ops: Vec<usize>,
    backlog: VecDeque<Op>,
    in_flight: usize,
    qd: usize,
    max_retries: u32,
    async_buffered: bool,
    stats: Arc<EngineStats>,
    wake_buf: Box<u64>,
    wake_armed: bool,
    cancels: VecDeque<u64>,
    /// Reads whose caller gave up (its deadline passed and it sent a cancel): they end at their next
    /// completion instead of being resubmitted, so no block stays in flight past its read's deadline
    /// for longer than one kernel round trip.
    cancelled: HashSet<u64>,
    /// A safety net behind the engine's 256 KiB chunks (`engine::PT_CHUNK`), for queues with a
    /// smaller `max_segments`: passthrough commands whose fixed buffer spans this many pages to its
    /// end, or more, are issued with the plain address. Linux before "io_uring/rsrc: ensure segments counts are correct on
    /// offset" (2025; 6.1 in the test guest) counts every page from the command's start to the end
    /// of the registered buffer as a segment and refuses (EINVAL) more than the queue's
    /// `max_segments`; a refused command is re-issued plainly (the kernel pins its pages for the one
    /// command) and the smallest refused count is remembered here.
    fixed_tail_limit: u32,
}

impl<S: Sqe, C: cqueue::EntryMarker> Drop for Worker<S, C> {
    /// The ring thread leaves with operations still in the kernel only by a panic unwinding it
    /// (its loop returns once nothing is in flight). Their blocks may still be written, so their
    /// ops — with the `InFlight` tokens that keep each block from being recycled — are leaked, not
    /// dropped: before 2026-12-07 the ring was dropped first and the ops after it, which freed
    /// blocks the kernel could still write into. Completions already posted end normally first.
    fn drop(&mut self) {
        // Nothing more is taken: a send after this fails at once (`IoError::Closed`) instead of
        // waiting for a thread that is gone. Queued commands never reached the kernel, so they drop
        // normally (their blocks free, their callers answered `Closed`).
        let queued = {
            let mut q = self.queue.cmds.lock().unwrap_or_else(|p| p.into_inner());
            q.1 = true;
            std::mem::take(&mut q.0)
        };
        drop(queued);
        let done: Vec<u64> = self
            .ring
            .completion()
            .map(|c| {
                let c: cqueue::Entry = c.into();
                c.user_data()
            })
            .collect();
        for ud in done {
            if let Some(slot) = self.ops.get_mut(ud as usize) {
                // Completed: the kernel is done with its block; dropping it replies `Closed`.
                drop(slot.take());
            }
        }
        let mut leaked = 0usize;
        for op in self.ops.iter_mut().filter_map(Option::take) {
            // The caller is answered now (not at its deadline); the block's token is leaked.
            match op {
                Op::Read(mut o) => {
                    if let Some(r) = o.reply.take() {
                        let _ = r.send(Err(IoError::Closed));
                    }
                    std::mem::forget(o);
                }
                Op::Nvme(mut o) => {
                    if let Some(r) = o.reply.take() {
                        let _ = r.send(Err(NvmeError::Closed));
                    }
                    std::mem::forget(o);
                }
            }
            leaked += 1;
        }
        if leaked > 0 {
            fallback::record(
                "ring_thread_ended_in_flight",
                format!(
                    "an io_uring ring thread ended with {leaked} operation(s) in the kernel (a panic): their blocks stay out of their pools rather than be reused while they may still be written"
                ),
            );
        }
    }
}

/// A ring's set-up step `what` failed with `source`.
fn setup_err(what: &str, source: std::io::Error) -> IoError {
    IoError::Setup {
        what: what.to_string(),
        source,
    }
}

fn iovecs(v: &[(usize, usize)]) -> Vec<libc::iovec> {
    v.iter()
        .map(|&(p, l)| libc::iovec {
            iov_base: p as *mut libc::c_void,
            iov_len: l,
        })
        .collect()
}

impl<S: Sqe + Send + 'static, C: cqueue::EntryMarker + Send + 'static> Worker<S, C> {
    /// Starts a ring. Returns the handle and, if SQPOLL was asked for and refused, why.
    pub(crate) fn spawn(
        setup_: RingSetup<'_>,
        cfg: &EngineConfig,
        stats: Arc<EngineStats>,
    ) -> Result<(WorkerHandle, Option<String>), IoError> {
        let setup = setup_err;
        let (ring, refused) = Self::new_ring(&setup_, cfg)?;
        Self::register_tables(&ring, &setup_, cfg)?;
        let queue = Arc::new(Queue {
            cmds: Mutex::new((VecDeque::new(), false)),
            sleeping: AtomicBool::new(false),
            efd: sys::eventfd().map_err(|e| setup("eventfd", e))?,
        });
        let mut w = Worker {
            ring,
            queue: queue.clone(),
            ops: Vec::new(),
            free_ops: Vec::new(),
            backlog: VecDeque::new(),
            in_flight: 0,
            qd: cfg.queue_depth as usize,
            max_retries: cfg.max_retries,
            async_buffered: cfg.async_buffered,
            stats,
            wake_buf: Box::new(0),
            wake_armed: false,
            cancels: VecDeque::new(),
            cancelled: HashSet::new(),
            fixed_tail_limit: u32::MAX,
        };
        let cpus = cfg.cpus.clone();
        let thread = std::thread::Builder::new()
            .name(setup_.name)
            .spawn(move || {
                crate::engine::pin_thread(&cpus);
                w.run()
            })
            .map_err(|e| setup("spawn ring thread", e))?;
        Ok((
            WorkerHandle {
                queue,
                thread: Some(thread),
            },
            refused,
        ))
    }

    /// The ring (with SQPOLL if asked for, else or if refused without, and why), checked to take
    /// `URING_CMD` when it is a passthrough ring.
    fn new_ring(
        setup_: &RingSetup<'_>,
        cfg: &EngineConfig,
    ) -> Result<(IoUring<S, C>, Option<String>), IoError> {
        let setup = setup_err;
        // One extra entry for the armed eventfd read, one for a cancel.
        let entries = (cfg.queue_depth + 2).next_power_of_two();
        let mut refused = None;
        let plain = || {
            IoUring::<S, C>::builder()
                .build(entries)
                .map_err(|e| setup("setup", e))
        };
        let ring = if setup_.sqpoll {
            let mut b = IoUring::<S, C>::builder();
            b.setup_sqpoll(cfg.sqpoll_idle.as_millis().min(u32::MAX as u128) as u32);
            match b.build(entries) {
                Ok(r) => r,
                Err(e) => {
                    refused = Some(e.to_string());
                    plain()?
                }
            }
        } else {
            plain()?
        };
        if S::CMD {
            let mut probe = io_uring::Probe::new();
            ring.submitter()
                .register_probe(&mut probe)
                .map_err(|e| setup("register_probe", e))?;
            if !probe.is_supported(opcode::UringCmd80::CODE) {
                return Err(setup(
                    "probe",
                    std::io::Error::new(
                        std::io::ErrorKind::Unsupported,
                        "this kernel's io_uring has no URING_CMD (Linux >= 5.19 needed)",
                    ),
                ));
            }
        }
        Ok((ring, refused))
    }

    /// Sets up the ring's tables: registered files (read rings) and fixed buffers, filled with the
    /// buffers the other rings already have.
    fn register_tables(
        ring: &IoUring<S, C>,
        setup_: &RingSetup<'_>,
        cfg: &EngineConfig,
    ) -> Result<(), IoError> {
        let setup = setup_err;
        if setup_.files {
            ring.submitter()
                .register_files_sparse(cfg.max_files)
                .map_err(|e| setup("register_files_sparse", e))?;
        }
        ring.submitter()
            .register_buffers_sparse(cfg.max_fixed_buffers)
            .map_err(|e| setup("register_buffers_sparse", e))?;
        for (base, v) in setup_.buffers {
            // SAFETY: as for Cmd::RegisterBuffers: these are the blocks of live pools, registered on
            // the other rings under the same table indices; the engine holds its registration lock
            // while this ring starts, and a pool's registration (which keeps its memory mapped)
            // unregisters them from every ring, this one included, before it goes.
            unsafe {
                ring.submitter()
                    .register_buffers_update(*base, &iovecs(v), None)
            }
            .map_err(|e| setup("register_buffers_update", e))?;
        }
        Ok(())
    }

    fn run(&mut self) {
        let mut shutting_down = false;
        loop {
            let (cmds, closed) = {
                let mut q = self.queue.cmds.lock().unwrap_or_else(|p| p.into_inner());
                (std::mem::take(&mut q.0), q.1)
            };
            shutting_down |= closed;
            for c in cmds {
                self.handle(c);
            }
            self.arm_wake();
            self.fill();
            if shutting_down && self.in_flight == 0 && self.backlog.is_empty() {
                return;
            }
            // Announce sleep, then re-check the queue so a command pushed in between is not missed.
            self.queue.sleeping.store(true, Ordering::SeqCst);
            let pending = !self
                .queue
                .cmds
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .0
                .is_empty();
            let r = if pending {
                self.ring.submit()
            } else {
                self.ring.submit_and_wait(1)
            };
            self.queue.sleeping.store(false, Ordering::SeqCst);
            if let Err(e) = r
                && e.raw_os_error() != Some(libc::EINTR)
                && e.raw_os_error() != Some(libc::EBUSY)
            {
                tracing::error!("io_uring_enter failed: {e}");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            self.reap();
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Read(op) => self.backlog.push_back(Op::Read(op)),
            Cmd::Nvme(op) => self.backlog.push_back(Op::Nvme(op)),
            Cmd::Cancel { op_id } => {
                if let Some(pos) = self.backlog.iter().position(|o| o.op_id() == op_id) {
                    if let Some(op) = self.backlog.remove(pos) {
                        op.cancel();
                    }
                } else {
                    self.cancels.push_back(op_id);
                }
            }
            Cmd::RegisterFile { slot, fd, reply } => {
                let r = self
                    .ring
                    .submitter()
                    .register_files_update(slot, &[fd])
                    .map(|_| ());
                let _ = reply.send(r);
            }
            #[cfg(test)]
            Cmd::Panic => panic!("a ring thread's panic, injected by a test"),
            Cmd::UnregisterFile { slot } => {
                if let Err(e) = self.ring.submitter().register_files_update(slot, &[-1]) {
                    tracing::warn!(slot, "unregistering file failed: {e}");
                }
            }
            Cmd::RegisterBuffers {
                base,
                iovecs,
                reply,
            } => {
                let v = self::iovecs(&iovecs);
                // SAFETY: the iovecs describe the blocks of a pool that is being created; the pool
                // keeps its memory mapped until its registrations are dropped, and dropping this
                // registration queues UnregisterBuffers for these indices first.
                let r = unsafe {
                    self.ring
                        .submitter()
                        .register_buffers_update(base, &v, None)
                };
                let _ = reply.send(r);
            }
            Cmd::UnregisterBuffers { base, count } => {
                let v = vec![
                    libc::iovec {
                        iov_base: std::ptr::null_mut(),
                        iov_len: 0,
                    };
                    count as usize
                ];
                // SAFETY: null/zero iovecs clear the slots; no memory is referenced.
                if let Err(e) = unsafe {
                    self.ring
                        .submitter()
                        .register_buffers_update(base, &v, None)
                } {
                    tracing::warn!(base, count, "unregistering buffers failed: {e}");
                }
            }
        }
    }

    fn arm_wake(&mut self) {
        if self.wake_armed {
            return;
        }
        let buf: *mut u64 = &mut *self.wake_buf;
        let sqe = S::from(
            opcode::Read::new(types::Fd(self.queue.efd.as_raw_fd()), buf.cast(), 8)
                .build()
                .user_data(WAKE),
        );
        // SAFETY: the 8-byte buffer is boxed, owned by this worker and outlives the ring (fields drop
        // after `run` returns, and the ring is dropped — cancelling the read — before the box).
        if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
            self.wake_armed = true;
        }
    }

    fn fill(&mut self) {
        while let Some(op_id) = self.cancels.pop_front() {
            if let Some(idx) = self
                .ops
                .iter()
                .position(|o| o.as_ref().is_some_and(|o| o.op_id() == op_id))
            {
                self.cancelled.insert(op_id);
                let sqe = S::from(
                    opcode::AsyncCancel::new(idx as u64)
                        .build()
                        .user_data(CANCEL),
                );
                // SAFETY: a cancel references no memory.
                if unsafe { self.ring.submission().push(&sqe) }.is_err() {
                    self.cancels.push_front(op_id);
                    break;
                }
            }
        }
        while self.in_flight < self.qd {
            let Some(op) = self.backlog.pop_front() else {
                break;
            };
            if let Op::Nvme(n) = &op
                && !S::CMD
            {
                // The engine sends passthrough commands only to SQE128 rings; answer, never hang.
                let e = NvmeError::Range {
                    path: n.ns.path().to_path_buf(),
                    reason: "a passthrough command reached a ring without SQE128".into(),
                };
                if let Op::Nvme(mut n) = op
                    && let Some(r) = n.reply.take()
                {
                    drop(n);
                    let _ = r.send(Err(e));
                }
                continue;
            }
            let idx = match self.free_ops.pop() {
                Some(i) => i,
                None => {
                    self.ops.push(None);
                    self.ops.len() - 1
                }
            };
            match &op {
                Op::Read(r) if r.file.direct.is_some() => {
                    self.stats.direct_reads.fetch_add(1, Ordering::Relaxed);
                }
                Op::Read(_) => {
                    self.stats.buffered_reads.fetch_add(1, Ordering::Relaxed);
                }
                Op::Nvme(_) => {
                    self.stats.nvme_cmds.fetch_add(1, Ordering::Relaxed);
                }
            }
            self.ops[idx] = Some(op);
            if !self.submit_op(idx) {
                // Submission queue full: put it back and stop for now.
                if let Some(op) = self.ops[idx].take() {
                    self.backlog.push_front(op);
                }
                self.free_ops.push(idx);
                break;
            }
            self.in_flight += 1;
        }
    }

    fn submit_op(&mut self, idx: usize) -> bool {
        let limit = self.fixed_tail_limit;
        let sqe = match self.ops[idx].as_mut() {
            Some(Op::Read(op)) => S::from(read_sqe(op, idx, self.async_buffered)),
            Some(Op::Nvme(op)) => {
                op.fixed &= op.tail_pages < limit;
                if !op.fixed {
                    self.stats.nvme_cmds_unfixed.fetch_add(1, Ordering::Relaxed);
                }
                let cmd = op
                    .ns
                    .read_cmd(op.slba, op.nlb, op.buf as u64, op.len)
                    .to_cmd_bytes();
                let e = opcode::UringCmd80::new(
                    types::Fd(op.ns.raw_fd()),
                    passthru_sys::NVME_URING_CMD_IO,
                )
                .cmd(cmd)
                .buf_index(op.fixed.then_some(op.buf_index))
                .build()
                .user_data(idx as u64);
                match S::from_cmd(e) {
                    Some(s) => s,
                    None => return false,
                }
            }
            None => return false,
        };
        // SAFETY: a read's destination lies inside its lease's block (checked by the engine's plan:
        // done..total fits in it), a registered fixed buffer where buf_index is set (the lease's
        // block), else host memory of a live pool that the kernel pins for the read; a passthrough
        // command's `buf..buf + len` likewise (checked by `Engine::nvme_submit`), whether the kernel
        // takes it from the fixed buffer or pins it by address, and the namespace's descriptor is
        // kept open by the op's `Arc<Namespace>`. The block is held in flight by the op's token
        // until the op is dropped after its final completion.
        unsafe { self.ring.submission().push(&sqe) }.is_ok()
    }
}

fn read_sqe(op: &ReadOp, idx: usize, async_buffered: bool) -> squeue::Entry {
    {
        let left = op.total - op.done;
        let (fd, buf, offset) = (
            types::Fixed(op.file.slot),
            (op.buf + op.done) as *mut u8,
            op.file_offset + op.done as u64,
        );
        match op.buf_index {
            Some(i) => opcode::ReadFixed::new(fd, buf, left as u32, i)
                .offset(offset)
                .build(),
            None => opcode::Read::new(fd, buf, left as u32)
                .offset(offset)
                .build(),
        }
        .flags(if async_buffered && op.file.direct.is_none() {
            squeue::Flags::ASYNC
        } else {
            squeue::Flags::empty()
        })
        .user_data(idx as u64)
    }
}

impl<S: Sqe + Send + 'static, C: cqueue::EntryMarker + Send + 'static> Worker<S, C> {
    fn reap(&mut self) {
        let cqes: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| {
                let c: cqueue::Entry = c.into();
                (c.user_data(), c.result())
            })
            .collect();
        for (ud, res) in cqes {
            match ud {
                WAKE => {
                    self.wake_armed = false;
                }
                CANCEL => {}
                idx => self.complete(idx as usize, res),
            }
        }
    }

    fn complete(&mut self, idx: usize, res: i32) {
        match self.ops.get_mut(idx) {
            Some(Some(Op::Read(_))) => self.complete_read(idx, res),
            Some(Some(Op::Nvme(op))) => {
                let outcome = if res == 0 {
                    if op.refused_fixed && op.tail_pages < self.fixed_tail_limit {
                        self.fixed_tail_limit = op.tail_pages;
                        fallback::record(
                            "nvme_fixed_buffer_refused",
                            format!(
                                "{}: the kernel refused URING_CMD with a fixed buffer spanning {}                                  pages to its end (EINVAL; Linux before 2025 counts them against                                  the queue's max_segments); such commands go by address",
                                op.ns.path().display(),
                                op.tail_pages
                            ),
                        );
                    }
                    Some(Ok(op.len as usize))
                } else if res == -libc::EINVAL && op.fixed {
                    // Maybe the kernel's fixed-buffer segment count (see fixed_tail_limit): once
                    // more by address; a second EINVAL is the command's own error.
                    op.fixed = false;
                    op.refused_fixed = true;
                    None
                } else if (res == -libc::EINTR || res == -libc::EAGAIN)
                    && op.retries < self.max_retries
                {
                    op.retries += 1;
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    None
                } else {
                    Some(Err(Failure::Nvme(op.status(res))))
                };
                match outcome {
                    Some(r) => self.finish(idx, r),
                    None => {
                        if !self.submit_op(idx) {
                            self.finish(idx, Err(Failure::Closed));
                        }
                    }
                }
            }
            _ => {}
        }
    }

    fn complete_read(&mut self, idx: usize, res: i32) {
        let Some(Some(Op::Read(op))) = self.ops.get_mut(idx) else {
            return;
        };
        let direct_align = op.file.direct.map(|a| a.offset as usize);
        let outcome: Option<Result<usize, IoError>> = if res > 0 {
            let before = op.done;
            op.done += res as usize;
            if op.done >= op.required {
                Some(Ok(op.done))
            } else {
                self.stats.short_reads.fetch_add(1, Ordering::Relaxed);
                let reached = op.done;
                if let Some(a) = direct_align {
                    // Resume from an aligned position; re-reading a few bytes is harmless.
                    op.done = op.done / a * a;
                }
                if op.done <= before {
                    // No progress: an O_DIRECT read returns an unaligned count only at end of file
                    // (a file truncated to an unaligned size after open); resuming from the aligned
                    // position below it would read the same tail forever.
                    Some(Err(IoError::UnexpectedEof {
                        path: op.file.path.clone(),
                        offset: op.req_offset,
                        len: op.req_len,
                        got: reached.saturating_sub((op.req_offset - op.file_offset) as usize),
                    }))
                } else {
                    None
                }
            }
        } else if res == 0 {
            if op.done >= op.required {
                Some(Ok(op.done))
            } else {
                Some(Err(IoError::UnexpectedEof {
                    path: op.file.path.clone(),
                    offset: op.req_offset,
                    len: op.req_len,
                    got: op
                        .done
                        .saturating_sub((op.req_offset - op.file_offset) as usize),
                }))
            }
        } else if (res == -libc::EINTR || res == -libc::EAGAIN) && op.retries < self.max_retries {
            op.retries += 1;
            self.stats.retries.fetch_add(1, Ordering::Relaxed);
            None
        } else if res == -libc::ECANCELED {
            Some(Err(IoError::Cancelled {
                path: op.file.path.clone(),
                offset: op.req_offset,
                len: op.req_len,
            }))
        } else {
            Some(Err(IoError::Read {
                path: op.file.path.clone(),
                offset: op.req_offset,
                len: op.req_len,
                source: std::io::Error::from_raw_os_error(-res),
            }))
        };
        let outcome = match outcome {
            // The caller's deadline passed (it sent a cancel): end here rather than resubmit.
            None if self.cancelled.contains(&op.op_id) => Some(Err(IoError::Cancelled {
                path: op.file.path.clone(),
                offset: op.req_offset,
                len: op.req_len,
            })),
            o => o,
        };
        match outcome {
            None => {
                if !self.submit_op(idx) {
                    // Cannot happen while in_flight <= qd < entries; fail the op rather than lose it.
                    self.finish(idx, Err(Failure::Closed));
                }
            }
            Some(r) => self.finish(idx, r.map_err(Failure::Io)),
        }
    }

    fn finish(&mut self, idx: usize, r: Result<usize, Failure>) {
        let Some(op) = self.ops[idx].take() else {
            return;
        };
        self.cancelled.remove(&op.op_id());
        self.free_ops.push(idx);
        self.in_flight -= 1;
        let nvme = matches!(op, Op::Nvme(_));
        match &r {
            Ok(n) if nvme => {
                self.stats
                    .nvme_bytes
                    .fetch_add(*n as u64, Ordering::Relaxed);
            }
            Ok(n) => {
                self.stats.reads.fetch_add(1, Ordering::Relaxed);
                self.stats.bytes.fetch_add(*n as u64, Ordering::Relaxed);
            }
            Err(_) => {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        // The kernel is done with the block: release it (drop the op and its token) before telling
        // the caller, so a caller that sees the completion also sees the slot idle.
        match op {
            Op::Read(mut op) => {
                let reply = op.reply.take();
                drop(op);
                let r = r.map_err(|f| match f {
                    Failure::Io(e) => e,
                    Failure::Nvme(_) | Failure::Closed => IoError::Closed,
                });
                if let Some(tx) = reply {
                    let _ = tx.send(r);
                }
            }
            Op::Nvme(mut op) => {
                let reply = op.reply.take();
                drop(op);
                let r = r.map(|_| ()).map_err(|f| match f {
                    Failure::Nvme(e) => e,
                    Failure::Io(_) | Failure::Closed => NvmeError::Closed,
                });
                if let Some(tx) = reply {
                    let _ = tx.send(r);
                }
            }
        }
    }
}
