//! Handing batches to the consumer: a blocking iterator (usable on any thread, also inside a
//! multi-threaded tokio runtime) and an async stream.

use std::future::Future;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::chunk::ChunkHandle;
use super::{Batch, Inner, LoadError};

/// The batches of one epoch, in order.
pub struct EpochIter {
    pub(super) inner: Arc<Inner>,
    pub(super) rt: Arc<super::LoaderRuntime>,
    pub(super) rx: mpsc::Receiver<ChunkHandle>,
    pub(super) ready: std::collections::VecDeque<Batch>,
    pub(super) pending: Option<ChunkHandle>,
    pub(super) waiting_since: Option<std::time::Instant>,
    pub(super) producer: JoinHandle<()>,
    /// Hands the plan's reads to the sources ahead of the producer (prefetch advice), if any wants it.
    pub(super) advisor: Option<JoinHandle<()>>,
    /// What the producer waits for (a block held by the consumer is [`LoadError::BlocksHeld`]).
    pub(super) starved: Arc<super::Starved>,
    pub(super) epoch: u64,
    pub(super) next: u64,
    pub(super) total: u64,
    /// Global position of the plan's first batch and samples per global batch: the state's
    /// position after batch `next` is `plan_start + (next − first) × step`.
    pub(super) plan_start: u64,
    pub(super) step: u64,
    pub(super) timeout: Duration,
    pub(super) done: bool,
    /// The loader's resume state follows this iterator (not for a replay).
    pub(super) track: bool,
    /// Staging blocks kept out of a cold epoch (given back when the epoch's iterator drops).
    pub(super) _held_back: Option<Arc<ubdirect_ub::HeldBack>>,
}

impl std::fmt::Debug for EpochIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpochIter")
            .field("epoch", &self.epoch)
            .field("next", &self.next)
            .field("total", &self.total)
            .finish()
    }
}

impl EpochIter {
    /// Batches in the epoch (for this rank), counting those before a resume's starting point.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Batches this iterator has yet to deliver (after a resume: what remains of the epoch). Also
    /// its [`ExactSizeIterator::len`].
    pub fn remaining(&self) -> u64 {
        if self.done {
            0
        } else {
            self.total.saturating_sub(self.next)
        }
    }

    /// Index of the next batch.
    pub fn position(&self) -> u64 {
        self.next
    }
}

/// How often a waiting consumer checks whether its wait can end ([`EpochIter::stalled`]).
const STALL_POLL: Duration = Duration::from_millis(100);

impl EpochIter {
    /// The consumer waits, and the producer has waited at least [`super::STALL_GRACE`] for a block
    /// that only the consumer can free: no chunk is queued, and the pool has no free block — every
    /// block is held by batches already delivered (or by another epoch's iterator). Batch pool: the
    /// producer acquires the chunk's block before handing the chunk over, so nothing is queued or
    /// pending. Staging (host zero-copy batches hold their staging blocks): the pending chunk waits
    /// for the rest of its reads' blocks. On a GPU, staging blocks come back as copies complete,
    /// so a wait for them is never the consumer's doing.
    fn stalled(&self) -> Option<LoadError> {
        if !self.rx.is_empty() {
            return None;
        }
        let inner = &self.inner;
        let (pool, key) = match self.starved.since(super::stall_grace())? {
            super::StarvedOn::Batch if self.pending.is_none() => {
                (inner.batch_pool.as_ref()?, "pool.batch_blocks")
            }
            super::StarvedOn::Staging if inner.batch_pool.is_none() => {
                (&inner.staging, "pool.staging_blocks")
            }
            _ => return None,
        };
        let st = pool.stats();
        (st.free == 0).then(|| LoadError::BlocksHeld {
            pool: if key == "pool.batch_blocks" {
                "batch"
            } else {
                "staging"
            },
            key,
            blocks: st.total,
        })
    }
}

/// What [`EpochIter::next_within`] found.
#[derive(Debug)]
pub enum Next {
    /// A batch, or the error that ended the epoch.
    Batch(Result<Batch, LoadError>),
    /// Nothing yet; call again (the batch deadline keeps running).
    Pending,
    /// The epoch is over.
    End,
}

impl EpochIter {
    /// Waits at most `wait` for the next batch: lets a caller check for interruption (Ctrl-C) between
    /// waits. `loader.batch_timeout_ms` still bounds the total wait for one batch. Works on any thread,
    /// also one of a multi-threaded tokio runtime; on a current-thread runtime it returns a clear
    /// error (use [`EpochIter::next_async`] there).
    pub fn next_within(&mut self, wait: Duration) -> Next {
        let rt = self.rt.clone();
        match crate::shards::block_on(&rt, self.next_within_async(wait)) {
            Ok(n) => n,
            Err(e) => Next::Batch(Err(e)),
        }
    }

    /// The next batch, awaited: `None` at the end of the epoch. The batch deadline applies. Callable
    /// from any async runtime (the loader's timers run on its own runtime).
    pub async fn next_async(&mut self) -> Option<Result<Batch, LoadError>> {
        loop {
            match self.next_within_async(self.timeout).await {
                Next::Batch(r) => return Some(r),
                Next::End => return None,
                Next::Pending => continue,
            }
        }
    }

    /// The epoch as an async [`Stream`](futures_core::Stream) of batches.
    pub fn into_stream(self) -> EpochStream {
        EpochStream {
            iter: Some(self),
            fut: None,
        }
    }

    /// As [`EpochIter::next_within`], awaited.
    pub async fn next_within_async(&mut self, wait: Duration) -> Next {
        if self.done || self.next >= self.total {
            return Next::End;
        }
        let r = match self.ready.pop_front() {
            Some(b) => Ok(b),
            None => match self.wait_for_chunk(wait).await {
                ControlFlow::Continue(r) => r,
                ControlFlow::Break(n) => return n,
            },
        };
        if let Some(since) = self.waiting_since.take() {
            // The consumer waited for data: the training loop's data stall.
            let waited = since.elapsed();
            let us = waited.as_micros().min(u128::from(u64::MAX)) as u64;
            self.inner.stats.wait_us.fetch_add(us, Ordering::Relaxed);
            metrics::counter!("ubdirect_loader_data_wait_microseconds_total").increment(us);
            metrics::gauge!("ubdirect_loader_last_batch_wait_seconds").set(waited.as_secs_f64());
        } else {
            metrics::gauge!("ubdirect_loader_last_batch_wait_seconds").set(0.0);
        }
        match &r {
            Ok(b) => self.delivered(b),
            Err(_) => self.done = true,
        }
        Next::Batch(r)
    }

    /// Waits at most `wait` (within the batch deadline) for the next chunk and takes its first
    /// batch; `Break`: what to return now (the deadline passed, a stall, or nothing yet).
    async fn wait_for_chunk(
        &mut self,
        wait: Duration,
    ) -> ControlFlow<Next, Result<Batch, LoadError>> {
        let since = *self
            .waiting_since
            .get_or_insert_with(std::time::Instant::now);
        let left = self.timeout.saturating_sub(since.elapsed());
        if left.is_zero() {
            self.done = true;
            return ControlFlow::Break(Next::Batch(Err(LoadError::Timeout(self.timeout))));
        }
        let wait_until = std::time::Instant::now() + wait.min(left);
        loop {
            // Woken every STALL_POLL to see whether the wait can end at all.
            let slice = wait_until
                .saturating_duration_since(std::time::Instant::now())
                .min(STALL_POLL);
            // The timer belongs to the loader's runtime, so the caller's executor needs none.
            let timer = {
                let _rt = self.rt.enter();
                tokio::time::sleep(slice)
            };
            tokio::pin!(timer);
            match self.recv_within(timer).await {
                None => {
                    if let Some(e) = self.stalled() {
                        self.done = true;
                        return ControlFlow::Break(Next::Batch(Err(e)));
                    }
                    if std::time::Instant::now() >= wait_until {
                        return ControlFlow::Break(Next::Pending);
                    }
                }
                Some(r) => {
                    return ControlFlow::Continue(r.and_then(|v| {
                        self.ready.extend(v);
                        self.ready
                            .pop_front()
                            .ok_or_else(|| LoadError::Closed("empty chunk".into()))
                    }));
                }
            }
        }
    }

    /// The pending chunk's batches (the next chunk received first if none is pending), unless
    /// `timer` fires first (`None`).
    async fn recv_within(
        &mut self,
        mut timer: std::pin::Pin<&mut tokio::time::Sleep>,
    ) -> Option<Result<Vec<Batch>, LoadError>> {
        let (rx, pending) = (&mut self.rx, &mut self.pending);
        if pending.is_none() {
            tokio::select! {
                h = rx.recv() => match h {
                    Some(h) => *pending = Some(h),
                    None => return Some(Err(LoadError::Closed("the producer stopped".into()))),
                },
                _ = &mut timer => return None,
            }
        }
        let h = pending.as_mut()?;
        tokio::select! {
            res = h => {
                *pending = None;
                Some(
                    res.map_err(|e| LoadError::Closed(format!("chunk task: {e}")))
                        .and_then(|r| r),
                )
            }
            _ = &mut timer => None,
        }
    }

    /// Counts batch `b` delivered (stats, metrics) and moves the resume state past it.
    fn delivered(&mut self, b: &Batch) {
        self.next += 1;
        let s = &self.inner.stats;
        s.batches.fetch_add(1, Ordering::Relaxed);
        s.samples.fetch_add(b.len() as u64, Ordering::Relaxed);
        s.sample_bytes
            .fetch_add(b.sample_bytes(), Ordering::Relaxed);
        s.delivered_read_bytes
            .fetch_add(b.read_bytes(), Ordering::Relaxed);
        metrics::counter!("ubdirect_loader_batches_total").increment(1);
        metrics::counter!("ubdirect_loader_samples_total").increment(b.len() as u64);
        metrics::counter!("ubdirect_loader_sample_bytes_total").increment(b.sample_bytes());
        metrics::counter!("ubdirect_loader_read_bytes_total").increment(b.read_bytes());
        let mut st = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        if !self.track {
            // A replay: the training run's position stays where it was.
        } else if self.next >= self.total {
            // The epoch's end is the next epoch's start (torchdata's StatefulDataLoader):
            // a checkpoint taken now resumes at `epoch + 1`, not at an empty epoch.
            st.epoch = self.epoch.saturating_add(1);
            st.next_batch = 0;
            st.position = Some(0);
        } else {
            st.epoch = self.epoch;
            st.next_batch = self.next;
            let first = self.plan_start / self.step.max(1);
            st.position = Some(self.plan_start + (self.next - first) * self.step);
        }
    }
}

type NextFuture =
    std::pin::Pin<Box<dyn Future<Output = (EpochIter, Option<Result<Batch, LoadError>>)> + Send>>;

/// An epoch's batches as an async stream ([`EpochIter::into_stream`], [`Loader::stream`](super::Loader::stream)).
pub struct EpochStream {
    iter: Option<EpochIter>,
    fut: Option<NextFuture>,
}

impl std::fmt::Debug for EpochStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpochStream")
            .field("iter", &self.iter)
            .finish()
    }
}

impl futures_core::Stream for EpochStream {
    type Item = Result<Batch, LoadError>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.fut.is_none() {
            let Some(mut it) = this.iter.take() else {
                return std::task::Poll::Ready(None);
            };
            this.fut = Some(Box::pin(async move {
                let r = it.next_async().await;
                (it, r)
            }));
        }
        let Some(fut) = this.fut.as_mut() else {
            return std::task::Poll::Ready(None);
        };
        match fut.as_mut().poll(cx) {
            std::task::Poll::Pending => std::task::Poll::Pending,
            std::task::Poll::Ready((it, r)) => {
                this.fut = None;
                if r.is_some() {
                    this.iter = Some(it);
                }
                std::task::Poll::Ready(r)
            }
        }
    }
}

impl Iterator for EpochIter {
    type Item = Result<Batch, LoadError>;

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = usize::try_from(self.remaining()).unwrap_or(usize::MAX);
        (n, Some(n))
    }

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.next_within(self.timeout) {
                Next::Batch(r) => return Some(r),
                Next::End => return None,
                Next::Pending => continue,
            }
        }
    }
}

impl ExactSizeIterator for EpochIter {}

impl Drop for EpochIter {
    fn drop(&mut self) {
        self.producer.abort();
        if let Some(a) = &self.advisor {
            a.abort();
        }
        self.rx.close();
        while let Ok(h) = self.rx.try_recv() {
            h.abort();
        }
        if let Some(h) = self.pending.take() {
            h.abort();
        }
    }
}
