//! Limits and pacing: a connection's place among the server's, its address's and its token's
//! connections (taken at accept, before its task runs), shares of the staging blocks, the control
//! request rate, log lines at most once a second, and the cap on connections polling their socket.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Semaphore;
use ubdirect_ub::Lease;

use super::reply::Reply;
use super::{ServerStats, Shared};
use crate::proto::Code;

/// One IP address's connections and its share of the staging pool.
pub(super) struct Peer {
    conns: usize,
    staging: Arc<Semaphore>,
    /// Files its connections have open (engine slots).
    files: Arc<AtomicUsize>,
}

/// One token's connections and its shares of the staging blocks and file slots.
pub(super) struct TokenShare {
    pub(super) conns: AtomicUsize,
    pub(super) staging: Arc<Semaphore>,
    pub(super) files: Arc<AtomicUsize>,
}

/// Holds a connection's place in its token's connection count until dropped.
pub(super) struct TokenSlot<'a> {
    pub(super) share: &'a TokenShare,
}

impl<'a> TokenSlot<'a> {
    /// A place among the connections of token `i`, or how many it has.
    pub(super) fn take(s: &'a Shared, i: usize) -> Result<Self, usize> {
        let share = &s.tokens[i];
        let n = share.conns.fetch_add(1, Ordering::Relaxed);
        if n >= s.cfg.max_connections_per_token {
            share.conns.fetch_sub(1, Ordering::Relaxed);
            return Err(n);
        }
        Ok(Self { share })
    }
}

impl Drop for TokenSlot<'_> {
    fn drop(&mut self) {
        self.share.conns.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Holds a connection's place in the connection counts (total and per peer) until dropped, also
/// when its task is aborted.
pub(super) struct ConnSlot {
    s: Arc<Shared>,
    ip: IpAddr,
    pub(super) staging: Arc<Semaphore>,
    pub(super) files: Arc<AtomicUsize>,
    /// Still counted among the connections that have not said hello.
    pub(super) pending: Arc<std::sync::atomic::AtomicBool>,
}

impl ConnSlot {
    /// Takes a place for a connection from `ip`, or says which cap is reached.
    pub(super) fn take(s: &Arc<Shared>, ip: IpAddr) -> Result<Self, &'static str> {
        let mut peers = s.peers.lock().unwrap_or_else(|p| p.into_inner());
        if s.stats.open_connections.load(Ordering::Relaxed) >= s.cfg.max_connections as u64 {
            return Err("serve.max_connections");
        }
        let share = s.cfg.max_staging_per_peer.clamp(1, s.cfg.blocks.max(1));
        let p = peers.entry(ip).or_insert_with(|| Peer {
            conns: 0,
            staging: Arc::new(Semaphore::new(share)),
            files: Arc::default(),
        });
        if p.conns >= s.cfg.max_connections_per_peer {
            return Err("serve.max_connections_per_peer");
        }
        p.conns += 1;
        s.stats.open_connections.fetch_add(1, Ordering::Relaxed);
        s.pending_hellos.fetch_add(1, Ordering::Relaxed);
        Ok(Self {
            s: s.clone(),
            ip,
            staging: p.staging.clone(),
            files: p.files.clone(),
            pending: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        })
    }

    /// Makes room for one more connection that has not said hello: at `serve.max_pending_hellos`,
    /// the oldest such connection is closed (its task aborted; its slot goes back as it drops).
    pub(super) fn evict_pending(s: &Shared) {
        let mut q = s.pending_queue.lock().unwrap_or_else(|p| p.into_inner());
        while q.front().is_some_and(|(p, _)| !p.load(Ordering::Relaxed)) {
            q.pop_front();
        }
        if s.pending_hellos.load(Ordering::Relaxed) < s.cfg.max_pending_hellos {
            return;
        }
        while let Some((p, task)) = q.pop_front() {
            if p.load(Ordering::Relaxed) {
                task.abort();
                s.stats.rejected_connections.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }

    /// The connection said hello (or is closing): no longer counted among the pending ones.
    pub(super) fn hello_done(&self) {
        if self.pending.swap(false, Ordering::Relaxed) {
            self.s.pending_hellos.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.hello_done();
        self.s
            .trim_due
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let mut peers = self.s.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = peers.get_mut(&self.ip) {
            p.conns = p.conns.saturating_sub(1);
            if p.conns == 0 {
                peers.remove(&self.ip);
            }
        }
        self.s
            .stats
            .open_connections
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// At most one log line a second; the lines held back are counted (`ServerStats::logs_suppressed`)
/// and their number is told with the next line.
pub(super) struct LogLimit {
    start: std::time::Instant,
    /// Milliseconds since `start` before which nothing more is logged.
    next_ms: AtomicU64,
    held: AtomicU64,
}

impl LogLimit {
    pub(super) fn new() -> Self {
        Self {
            start: std::time::Instant::now(),
            next_ms: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// `Some(lines held back since the last one)` when a line may be written now.
    pub(super) fn allow(&self, stats: &ServerStats) -> Option<u64> {
        let now = self.start.elapsed().as_millis() as u64;
        let next = self.next_ms.load(Ordering::Relaxed);
        if now >= next
            && self
                .next_ms
                .compare_exchange(next, now + 1000, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.held.swap(0, Ordering::Relaxed));
        }
        self.held.fetch_add(1, Ordering::Relaxed);
        stats.logs_suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// A token bucket: at most `rate` requests a second on average (bursts of `rate`); past it, the
/// connection waits before its next request is read.
pub(super) struct Pace {
    rate: f64,
    tokens: f64,
    last: std::time::Instant,
}

impl Pace {
    pub(super) fn new(rate: u32) -> Self {
        let rate = rate.max(1) as f64;
        Self {
            rate,
            tokens: rate,
            last: std::time::Instant::now(),
        }
    }

    /// Takes a token, waiting for one when there is none.
    pub(super) async fn wait(&mut self) {
        let now = std::time::Instant::now();
        let refill = now.duration_since(self.last).as_secs_f64() * self.rate;
        self.tokens = (self.tokens + refill).min(self.rate) - 1.0;
        self.last = now;
        if self.tokens < 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(-self.tokens / self.rate)).await;
        }
    }
}

/// The pause after a failed `accept` (out of descriptors): it doubles up to a second while accepts
/// keep failing, so a full descriptor table costs a few wake-ups a second instead of a busy loop.
pub(super) fn accept_backoff(prev: Duration) -> Duration {
    (prev * 2).clamp(Duration::from_millis(5), Duration::from_secs(1))
}

/// Counts a refusal and logs it (at most one line a second: a client cannot flood the log).
pub(super) fn refuse(s: &Shared, peer: &str, what: &str) {
    s.stats.refused.fetch_add(1, Ordering::Relaxed);
    if let Some(held) = s.refusal_log.allow(&s.stats) {
        tracing::warn!(peer, held, "refused: {what}");
    }
}

/// What a read holds until its reply is written: its in-flight permit and its staging permits (its
/// address's share and its token's).
pub(super) type Hold = (tokio::sync::OwnedSemaphorePermit, Shares);

/// A read's place in its address's and its token's shares of the staging blocks.
pub(super) type Shares = [tokio::sync::OwnedSemaphorePermit; 2];

/// The most time one SMC write's receive spends polling an empty socket, over all its gaps.
pub(super) const POLL_BUDGET: Duration = Duration::from_millis(2);

/// A connection polling its socket (`smc_poll`), counted so that at most a quarter of the runtime's
/// workers do at once; `None` when polling is off or the cap is reached.
pub(super) struct Polling<'a>(&'a Shared);

impl<'a> Polling<'a> {
    pub(super) fn start(s: &'a Shared) -> Option<Self> {
        if s.cfg.smc_poll.is_zero() {
            return None;
        }
        let cap = (s.workers / 4).max(1);
        if s.polling.fetch_add(1, Ordering::AcqRel) >= cap {
            s.polling.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Self(s))
    }
}

impl Drop for Polling<'_> {
    fn drop(&mut self) {
        self.0.polling.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A staging block of the server's pool, within the address's and the token's shares of blocks
/// (the permits come back with the block and are held until the reply is written), or `Busy` after
/// `io_timeout`.
pub(super) async fn reserve(
    s: &Shared,
    staging: &[Arc<Semaphore>; 2],
) -> Result<(Lease, Shares), Reply> {
    let t = s.cfg.io_timeout;
    let start = std::time::Instant::now();
    let busy = || {
        Reply(
            Code::Busy,
            format!(
                "no staging block within {t:?} (this address or this token holds its share — serve.max_staging_per_peer, serve.max_staging_per_token — or all serve.blocks are in use)"
            ),
        )
    };
    let peer = match tokio::time::timeout(t, staging[0].clone().acquire_owned()).await {
        Ok(Ok(p)) => p,
        _ => return Err(busy()),
    };
    let token = match tokio::time::timeout(
        t.saturating_sub(start.elapsed()),
        staging[1].clone().acquire_owned(),
    )
    .await
    {
        Ok(Ok(p)) => p,
        _ => return Err(busy()),
    };
    let share = [peer, token];
    let lease = s
        .pool
        .acquire(t.saturating_sub(start.elapsed()))
        .await
        .map_err(|_| busy())?;
    Ok((lease, share))
}
