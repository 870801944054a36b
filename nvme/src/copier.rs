//! Warm reads by many threads: page-cache ranges copied into staging leases with `pread`, one read
//! per thread at a time, as many threads as the machine has cores.
//!
//! A warm range costs a CPU copy out of the page cache whatever issues it; what decides its speed is
//! how many cores copy at once and how little else they do. io_uring's buffered path runs those
//! copies on its worker threads behind a ring thread (29–36 GB/s on a 16-core H200 host at 0.32–0.41
//! CPU s/GB), KvikIO runs them on a plain thread pool (45 GB/s). This is the plain pool: no ring, no
//! submission, a blocking `pread` straight into the registered block (docs/decisions.md).
//!
//! Each job holds its file open and its lease's [`InFlight`] token, so a read whose caller gave up
//! (deadline) keeps the block `Orphaned` until the copy really ended.

use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use ubdirect_ub::InFlight;

use crate::engine::FileInner;

/// What a copy reads from: an engine file, or one file of a mapping (kept open by the mapping).
pub(crate) enum CopyFrom {
    File(Arc<FileInner>),
    Mapped(Arc<ubdirect_ub::MappedFile>, usize),
}

impl CopyFrom {
    /// The descriptor; `None` for a mapping's file index it does not have (the engine made the
    /// index from the same mapping's pieces, so this does not happen).
    fn fd(&self) -> Option<std::os::fd::RawFd> {
        match self {
            CopyFrom::File(f) => Some(f.fd_raw()),
            CopyFrom::Mapped(m, i) => m.part(*i).map(|(_, f)| f.as_raw_fd()),
        }
    }
}

/// One copy: `len` bytes at `offset` of `file` into the memory at `dst`.
pub(crate) struct CopyJob {
    pub(crate) file: CopyFrom,
    pub(crate) offset: u64,
    pub(crate) len: usize,
    /// Host address inside the lease's block (checked by the engine's plan: `len` bytes fit).
    pub(crate) dst: usize,
    /// Keeps the block from being reused until the copy has ended.
    pub(crate) token: InFlight,
    pub(crate) reply: tokio::sync::oneshot::Sender<std::io::Result<usize>>,
}

/// The pool of copy threads.
pub(crate) struct Copier {
    tx: Mutex<Option<mpsc::Sender<CopyJob>>>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    count: usize,
}

impl std::fmt::Debug for Copier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Copier")
            .field("threads", &self.count)
            .finish()
    }
}

impl Copier {
    /// Starts `n` threads (at least one).
    pub(crate) fn start(n: usize, cpus: &[usize]) -> std::io::Result<Self> {
        let n = n.max(1);
        let (tx, rx) = mpsc::channel::<CopyJob>();
        let rx = Arc::new(Mutex::new(rx));
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let rx = rx.clone();
            let cpus = cpus.to_vec();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("ubdirect-copy-{i}"))
                    .spawn(move || {
                        crate::engine::pin_thread(&cpus);
                        run(&rx)
                    })?,
            );
        }
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            threads: Mutex::new(threads),
            count: n,
        })
    }

    /// Threads in the pool.
    pub(crate) fn threads(&self) -> usize {
        self.count
    }

    /// Queues a job; gives it back when the pool has stopped.
    pub(crate) fn submit(&self, job: CopyJob) -> Result<(), Box<CopyJob>> {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        match tx.as_ref() {
            Some(tx) => tx.send(job).map_err(|e| Box::new(e.0)),
            None => Err(Box::new(job)),
        }
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        // Closing the channel ends every thread after the jobs already queued.
        drop(self.tx.lock().unwrap_or_else(|p| p.into_inner()).take());
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        let me = std::thread::current().id();
        for t in threads {
            // A job's file may be the last thing holding the engine: never join ourselves.
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}

fn run(rx: &Mutex<mpsc::Receiver<CopyJob>>) {
    loop {
        let job = {
            let rx = rx.lock().unwrap_or_else(|p| p.into_inner());
            match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        let r = match job.file.fd() {
            // SAFETY: `dst .. dst + len` lies inside the lease's block (the engine checked it), the
            // block stays allocated and unused by anyone else while `job.token` is held (the slot
            // cannot return to Free before it drops, after the copy), and `fd` stays open while
            // `job.file` lives (an engine file, or a mapping that owns its files).
            Some(fd) => unsafe {
                crate::sys::pread_full(fd, job.dst as *mut u8, job.len, job.offset)
            },
            None => Err(std::io::Error::from_raw_os_error(libc::EBADF)),
        };
        drop(job.token);
        let _ = job.reply.send(r);
    }
}

impl FileInner {
    fn fd_raw(&self) -> std::os::fd::RawFd {
        self.fd_owned().as_raw_fd()
    }
}
