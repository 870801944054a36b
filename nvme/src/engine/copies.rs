//! Reads copied out of the page cache by the copy threads (`thread_copies`), and copies out of
//! mapped files.

use super::*;

impl Engine {
    pub(super) fn copier(&self) -> Result<&crate::copier::Copier, IoError> {
        let c = self.shared.copier.get_or_init(|| {
            let n = match self.shared.cfg.copy_threads {
                0 => std::thread::available_parallelism()
                    .map_or(4, |n| n.get())
                    .min(64),
                n => n,
            };
            crate::copier::Copier::start(n, &self.shared.cfg.cpus)
                .map_err(|e| format!("starting {n} copy threads: {e}"))
        });
        c.as_ref().map_err(|e| IoError::Config(e.clone()))
    }

    /// Reads a range of a buffered (page-cache) file into `lease` at `lease_offset` on the copy
    /// threads: one `pread` straight into the block. For warm data; cold data blocks a thread on the
    /// device until it arrives. The lease goes in and comes back, also on error and timeout (then the
    /// block stays `Orphaned` until the copy has really ended).
    pub async fn copy_read(
        &self,
        file: &FileHandle,
        offset: u64,
        len: usize,
        lease: Lease,
        lease_offset: usize,
        deadline: Duration,
    ) -> (Result<ReadDone, IoError>, Lease) {
        let mut lease = lease;
        let f = &file.inner;
        if f.direct.is_some() {
            return (
                Err(IoError::Config(format!(
                    "{}: copy_read needs a buffered handle",
                    f.path.display()
                ))),
                lease,
            );
        }
        let plan = match self.plan(f, offset, len, &lease, lease_offset) {
            Ok(p) => p,
            Err(e) => return (Err(e), lease),
        };
        let base = match host_base(&lease) {
            Ok(b) => b,
            Err(e) => return (Err(e), lease),
        };
        if len == 0 {
            return (
                Ok(ReadDone {
                    data: lease_offset..lease_offset,
                    bytes_read: 0,
                    direct: false,
                }),
                lease,
            );
        }
        let copier = match self.copier() {
            Ok(c) => c,
            Err(e) => return (Err(e), lease),
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job = crate::copier::CopyJob {
            file: crate::copier::CopyFrom::File(f.clone()),
            offset: plan.start,
            len: plan.total,
            // `plan` checked lease_offset + total <= the block's size.
            dst: base + lease_offset,
            // SAFETY: the token moves into the `CopyJob`, which a copy thread drops only after its
            // `pread` into the block has returned; a stopped copier gives the job back unstarted,
            // to be dropped here.
            token: unsafe { lease.begin_op() },
            reply: tx,
        };
        if copier.submit(job).is_err() {
            return (Err(IoError::Closed), lease);
        }
        let started = Instant::now();
        let r = match tokio::time::timeout(deadline.min(self.shared.cfg.op_timeout), rx).await {
            Ok(Ok(Ok(got))) if got >= plan.required => {
                let st = &self.shared.stats;
                st.reads.fetch_add(1, Ordering::Relaxed);
                st.bytes.fetch_add(got as u64, Ordering::Relaxed);
                st.bytes_delivered.fetch_add(len as u64, Ordering::Relaxed);
                st.buffered_reads.fetch_add(1, Ordering::Relaxed);
                Ok(ReadDone {
                    data: lease_offset..lease_offset + len,
                    bytes_read: got,
                    direct: false,
                })
            }
            Ok(Ok(Ok(got))) => Err(IoError::UnexpectedEof {
                path: f.path.clone(),
                offset,
                len,
                got,
            }),
            Ok(Ok(Err(source))) => Err(IoError::Read {
                path: f.path.clone(),
                offset,
                len,
                source,
            }),
            Ok(Err(_dropped)) => Err(IoError::Closed),
            Err(_elapsed) => {
                self.shared.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                Err(IoError::Timeout {
                    path: f.path.clone(),
                    offset,
                    len,
                    waited: started.elapsed(),
                })
            }
        };
        (r, lease)
    }

    /// Copies `len` bytes at `offset` of a mapping ([`MappedFile`]: a shard's file, or an object's
    /// chunk files laid end to end) into `lease` at `lease_offset` on the copy threads: a `pread` on
    /// the mapping's own descriptors per file the range spans, all queued at once (a 4 MiB read over
    /// 1 MiB chunks is four copies on four threads). No open and no registered-file slot per file:
    /// for ranges the caller knows are resident. A piece that reads short (a file truncated since it
    /// was mapped) is [`IoError::UnexpectedEof`] naming that file. The lease comes back, also on
    /// error and timeout (then its block stays `Orphaned` until every copy has ended).
    pub async fn copy_mapped(
        &self,
        map: &Arc<MappedFile>,
        offset: u64,
        len: usize,
        lease: Lease,
        lease_offset: usize,
        deadline: Duration,
    ) -> (Result<ReadDone, IoError>, Lease) {
        let mut lease = lease;
        let pieces = match map.pieces(offset, len) {
            Ok(p) => p,
            Err(e) => return (Err(e.into()), lease),
        };
        let path_of = |i: usize| {
            map.part(i)
                .map(|(p, _)| p.to_path_buf())
                .unwrap_or_default()
        };
        if lease.check_range(lease_offset, len).is_err() {
            return (
                Err(IoError::BufferTooSmall {
                    path: path_of(pieces.first().map_or(0, |p| p.file)),
                    offset,
                    len,
                    need: len,
                    lease_offset,
                    capacity: lease.capacity(),
                }),
                lease,
            );
        }
        let base = match host_base(&lease) {
            Ok(b) => b,
            Err(e) => return (Err(e), lease),
        };
        let copier = match self.copier() {
            Ok(c) => c,
            Err(e) => return (Err(e), lease),
        };
        let replies =
            match self.submit_pieces(copier, map, &pieces, &mut lease, base + lease_offset) {
                Ok(r) => r,
                Err(e) => return (Err(e), lease),
            };
        let started = Instant::now();
        let all = async {
            let mut out = Vec::with_capacity(replies.len());
            for rx in replies {
                out.push(rx.await);
            }
            out
        };
        let r = match tokio::time::timeout(deadline.min(self.shared.cfg.op_timeout), all).await {
            Ok(results) => self.mapped_done(&pieces, results, &path_of, len, lease_offset),
            Err(_elapsed) => {
                self.shared.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                Err(IoError::Timeout {
                    path: path_of(pieces.first().map_or(0, |p| p.file)),
                    offset,
                    len,
                    waited: started.elapsed(),
                })
            }
        };
        (r, lease)
    }

    /// Queues one copy job per piece of a mapped range, each into the block at `dst + piece.at` and
    /// holding the block in flight; the replies in piece order, or `Closed` if the copier stopped.
    fn submit_pieces(
        &self,
        copier: &crate::copier::Copier,
        map: &Arc<MappedFile>,
        pieces: &[ubdirect_ub::Piece],
        lease: &mut Lease,
        dst: usize,
    ) -> Result<Vec<tokio::sync::oneshot::Receiver<std::io::Result<usize>>>, IoError> {
        let mut replies = Vec::with_capacity(pieces.len());
        for p in pieces {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let job = crate::copier::CopyJob {
                file: crate::copier::CopyFrom::Mapped(map.clone(), p.file),
                offset: p.file_offset,
                len: p.len,
                // `check_range` in `copy_mapped`: lease_offset + len fits the block, and the
                // pieces tile 0..len.
                dst: dst + p.at,
                // SAFETY: as in `copy_read`: the token moves into the `CopyJob`, which a copy
                // thread drops only after its `pread` into the block has returned (or here,
                // unstarted, when the copier has stopped).
                token: unsafe { lease.begin_op() },
                reply: tx,
            };
            if copier.submit(job).is_err() {
                return Err(IoError::Closed);
            }
            replies.push(rx);
        }
        Ok(replies)
    }

    /// The outcome of a mapped range's copies, all answered: the first piece that failed or read
    /// short, else the range (counted in the engine's stats).
    fn mapped_done(
        &self,
        pieces: &[ubdirect_ub::Piece],
        results: Vec<Result<std::io::Result<usize>, tokio::sync::oneshot::error::RecvError>>,
        path_of: &impl Fn(usize) -> PathBuf,
        len: usize,
        lease_offset: usize,
    ) -> Result<ReadDone, IoError> {
        let mut r = Ok(());
        for (p, res) in pieces.iter().zip(results) {
            let e = match res {
                Ok(Ok(got)) if got >= p.len => continue,
                Ok(Ok(got)) => IoError::UnexpectedEof {
                    path: path_of(p.file),
                    offset: p.file_offset,
                    len: p.len,
                    got,
                },
                Ok(Err(source)) => IoError::Read {
                    path: path_of(p.file),
                    offset: p.file_offset,
                    len: p.len,
                    source,
                },
                Err(_dropped) => IoError::Closed,
            };
            r = Err(e);
            break;
        }
        r.map(|()| {
            let st = &self.shared.stats;
            st.reads.fetch_add(1, Ordering::Relaxed);
            st.bytes.fetch_add(len as u64, Ordering::Relaxed);
            st.bytes_delivered.fetch_add(len as u64, Ordering::Relaxed);
            st.buffered_reads.fetch_add(1, Ordering::Relaxed);
            ReadDone {
                data: lease_offset..lease_offset + len,
                bytes_read: len,
                direct: false,
            }
        })
    }
}
