//! NVMe passthrough reads: the SQE128/CQE32 rings, started on first use, and their commands.

use super::*;

impl Engine {
    /// Starts the passthrough rings (SQE128/CQE32, one per read ring) if they are not running yet.
    /// Their fixed-buffer table holds every registered pool too, each block as chunks of
    /// 256 KiB (older kernels refuse commands whose fixed buffer spans more pages to its end than the
    /// queue's `max_segments`). Called by the first passthrough read; call it early to learn at
    /// open time whether this kernel can run them (URING_CMD needs Linux ≥ 5.19, fixed buffers with
    /// it ≥ 6.1).
    pub fn passthru_rings(&self) -> Result<(), IoError> {
        let s = &self.shared;
        if s.passthru.get().is_some() {
            return Ok(());
        }
        // Held while the rings start: no pool registers meanwhile.
        let _starting = s.starting.lock().unwrap_or_else(|p| p.into_inner());
        if s.passthru.get().is_some() {
            return Ok(());
        }
        // Held until the new rings' entries are in `by_base`, so a pool unregistered meanwhile
        // finds and clears them. Spawning waits on no running ring thread.
        let mut pt = s.pt();
        let log: Vec<crate::worker::Buffers> = s
            .registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(b, v)| (*b, v.clone()))
            .collect();
        let mut entries = Vec::new();
        let mut buffers: Vec<crate::worker::Buffers> = Vec::new();
        for (base, v) in &log {
            if let Some((e, chunks)) = pt.alloc(v) {
                entries.push((*base, e));
                buffers.push((e.first, chunks));
            }
        }
        let mut rings = Vec::with_capacity(s.cfg.rings);
        for i in 0..s.cfg.rings {
            let setup = RingSetup {
                name: format!("ubdirect-nvme{i}"),
                sqpoll: false,
                files: false,
                buffers: &buffers,
            };
            match Worker::<squeue::Entry128, cqueue::Entry32>::spawn(setup, &s.cfg, s.stats.clone())
            {
                Ok((w, _)) => rings.push(w),
                Err(e) => {
                    for mut w in rings {
                        w.shutdown();
                    }
                    for (_, en) in &entries {
                        pt.table.release(en.first, en.count);
                    }
                    return Err(e);
                }
            }
        }
        if let Err(rings) = s.passthru.set(rings) {
            // Cannot happen under the lock; do not leak the threads if it does.
            for mut w in rings {
                w.shutdown();
            }
            for (_, en) in &entries {
                pt.table.release(en.first, en.count);
            }
            return Ok(());
        }
        pt.by_base.extend(entries);
        Ok(())
    }

    /// Reads `nlb` logical blocks at `slba` of `ns` into `lease[lease_offset..]` with NVMe read
    /// commands on the passthrough rings (`IORING_OP_URING_CMD`, `NVME_URING_CMD_IO`, the lease's
    /// block as a fixed buffer), split at [`Namespace::max_transfer`]; done when every piece is.
    ///
    /// The lease comes back, also on error. The pool must be registered with this engine. If this
    /// future is dropped, or the read times out, the block stays in flight (orphaned once the lease
    /// is dropped) until every command has completed.
    pub async fn nvme_read(
        &self,
        ns: &Arc<Namespace>,
        slba: u64,
        nlb: u32,
        mut lease: Lease,
        lease_offset: usize,
        deadline: Duration,
    ) -> (Result<(), NvmeError>, Lease) {
        let until = deadline_at(deadline.min(self.shared.cfg.op_timeout));
        let pending = match self.nvme_submit(ns, slba, nlb, &mut lease, lease_offset) {
            Ok(p) => p,
            Err(e) => return (Err(e), lease),
        };
        (self.nvme_wait(ns, pending, until).await, lease)
    }

    /// Issues the commands of [`Engine::nvme_read`] without waiting: each holds the block in flight
    /// until its completion.
    pub(crate) fn nvme_submit(
        &self,
        ns: &Arc<Namespace>,
        slba: u64,
        nlb: u32,
        lease: &mut Lease,
        lease_offset: usize,
    ) -> Result<Vec<NvmePending>, NvmeError> {
        let bs = ns.id().lba_size as u64;
        let (base, read_base) = self.nvme_target(ns, slba, nlb, bs, lease, lease_offset)?;
        self.passthru_rings().map_err(|source| NvmeError::Rings {
            path: ns.path().to_path_buf(),
            source,
        })?;
        let rings = self.shared.passthru.get().ok_or(NvmeError::Closed)?;
        // The block's chunks in the passthrough rings' table (none: by address).
        let chunks = self.shared.pt().by_base.get(&read_base).copied();
        let per_cmd = (ns.max_transfer() as u64 / bs).clamp(1, 65536) as u32;
        let mut pending = Vec::with_capacity(nlb.div_ceil(per_cmd) as usize);
        let mut done = 0u32;
        while done < nlb {
            let at = lease_offset + done as usize * bs as usize;
            let (n, fixed) = cmd_extent(at, bs, per_cmd, nlb - done, chunks.is_some());
            let buf_index = chunks
                .map(|c| {
                    c.first as u64
                        + lease.slot() as u64 * c.per_block as u64
                        + (at / PT_CHUNK) as u64
                })
                .and_then(|i| u16::try_from(i).ok());
            let fixed = fixed && buf_index.is_some();
            let (tx, rx) = tokio::sync::oneshot::channel();
            let op_id = self.shared.next_op.fetch_add(1, Ordering::Relaxed);
            let ring = self.shared.next_passthru.fetch_add(1, Ordering::Relaxed) % rings.len();
            let op = NvmeOp {
                op_id,
                ns: ns.clone(),
                slba: slba + done as u64,
                nlb: n,
                buf_index: buf_index.unwrap_or(0),
                // Inside the block: lease_offset + len <= block size was checked above.
                buf: base + at,
                len: n * bs as u32,
                tail_pages: (PT_CHUNK - at % PT_CHUNK).div_ceil(ubdirect_ub::PAGE_SIZE) as u32,
                fixed,
                refused_fixed: false,
                retries: 0,
                // SAFETY: the token moves into the `NvmeOp`, which the ring thread drops only in
                // `Worker::finish`, after the command's final CQE, or before it was ever submitted
                // (cancelled in the backlog, refused by a ring without SQE128; a closed ring gives
                // the op back to `send`'s caller, to be dropped here).
                token: unsafe { lease.begin_op() },
                reply: Some(tx),
            };
            if rings[ring].send(Cmd::Nvme(Box::new(op))).is_err() {
                return Err(NvmeError::Closed);
            }
            pending.push(NvmePending {
                rx,
                ring,
                op_id,
                slba: slba + done as u64,
                nlb: n,
            });
            done += n;
        }
        Ok(pending)
    }

    /// Checks a passthrough read of LBAs `slba..slba + nlb` into `lease` at `lease_offset` (inside
    /// the namespace and the block, a host-visible pool registered here); the block's host address
    /// and its pool's first index in the read rings' table.
    fn nvme_target(
        &self,
        ns: &Namespace,
        slba: u64,
        nlb: u32,
        bs: u64,
        lease: &Lease,
        lease_offset: usize,
    ) -> Result<(usize, u32), NvmeError> {
        let range_err = |reason: String| NvmeError::Range {
            path: ns.path().to_path_buf(),
            reason,
        };
        if nlb == 0
            || slba
                .checked_add(nlb as u64)
                .is_none_or(|e| e > ns.id().nsze)
        {
            return Err(range_err(format!(
                "LBA {slba}+{nlb} outside the namespace ({} blocks)",
                ns.id().nsze
            )));
        }
        let len = nlb as usize * bs as usize;
        lease.check_range(lease_offset, len)?;
        let base = lease.host_ptr().ok_or_else(|| UbError::NotHostVisible {
            pool: lease.pool_name().to_string(),
            kind: lease.kind(),
        })? as usize;
        let read_base = {
            let bufs = self.shared.bufs.lock().unwrap_or_else(|p| p.into_inner());
            let Some(&(first, _)) = bufs.by_pool.get(&lease.pool_id()) else {
                return Err(NvmeError::NotRegistered {
                    pool: lease.pool_name().to_string(),
                });
            };
            first
        };
        Ok((base, read_base))
    }

    /// Waits for every command of `pending` until `until`; the first error wins. Commands still
    /// running at the deadline keep their blocks in flight.
    pub(crate) async fn nvme_wait(
        &self,
        ns: &Namespace,
        pending: Vec<NvmePending>,
        until: Instant,
    ) -> Result<(), NvmeError> {
        let started = Instant::now();
        let mut first = None;
        let mut timed_out = None;
        for p in pending {
            let NvmePending {
                rx,
                ring,
                op_id,
                slba,
                nlb,
            } = p;
            if timed_out.is_some() {
                self.cancel_passthru(ring, op_id);
                continue;
            }
            match tokio::time::timeout_at(until.into(), rx).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => {
                    first.get_or_insert(e);
                }
                Ok(Err(_dropped)) => {
                    first.get_or_insert(NvmeError::Closed);
                }
                Err(_elapsed) => {
                    self.shared.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                    self.cancel_passthru(ring, op_id);
                    timed_out = Some((slba, nlb));
                }
            }
        }
        if let Some((slba, nlb)) = timed_out {
            return Err(NvmeError::Timeout {
                op: "NVMe read (uring_cmd)",
                path: ns.path().to_path_buf(),
                slba,
                nlb,
                waited: started.elapsed(),
            });
        }
        first.map_or(Ok(()), Err)
    }

    /// Takes a command still queued back (an in-flight one runs to its completion).
    pub(super) fn cancel_passthru(&self, ring: usize, op_id: u64) {
        if let Some(rings) = self.shared.passthru.get()
            && let Some(w) = rings.get(ring)
        {
            let _ = w.send(Cmd::Cancel { op_id });
        }
    }
}

/// The next command at `at` in the block: its LBAs (at most `per_cmd` of the `left`) and whether it
/// may use its fixed buffer (the block has `chunks` in the passthrough rings' table).
fn cmd_extent(at: usize, bs: u64, per_cmd: u32, left: u32, chunks: bool) -> (u32, bool) {
    let to_chunk_end = PT_CHUNK - at % PT_CHUNK;
    // Split at the chunk's end where that falls on an LBA boundary; a command crossing it
    // (an LBA-unaligned lease offset) goes by address.
    if to_chunk_end.is_multiple_of(bs as usize) {
        let lbas = (to_chunk_end / bs as usize).min(u32::MAX as usize) as u32;
        (per_cmd.min(left).min(lbas), chunks)
    } else {
        let n = per_cmd.min(left);
        (n, chunks && (n as usize * bs as usize) <= to_chunk_end)
    }
}

/// A passthrough command on its way.
pub(crate) struct NvmePending {
    pub(super) rx: tokio::sync::oneshot::Receiver<Result<(), NvmeError>>,
    pub(super) ring: usize,
    pub(super) op_id: u64,
    pub(super) slba: u64,
    pub(super) nlb: u32,
}
