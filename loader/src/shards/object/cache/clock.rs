//! The node's shared clock: each rank publishes its (epoch, position) in the cache directory, and the
//! cache's eviction reads the slowest live rank's (a rank silent for 30 s is taken to be in step).

use super::*;

/// With the plans of the node's ranks: this process's position, published in `.clock-{local rank}`
/// of the cache directory as (epoch, position in it), and when the others' were last read. Ranks
/// are not in step (one starts later, one reads ahead): a use by another rank counts from where
/// that rank stands, not from where this one does.
#[derive(Default)]
pub(super) struct NodeClock {
    pub(super) file: Option<File>,
    pub(super) read_at: Option<Instant>,
}

/// This process's clock file, created if missing: a regular file only, checked on the descriptor
/// (`O_NONBLOCK`: a FIFO in its place is not waited on; `O_NOFOLLOW`: a link in the shared
/// directory does not send the writes elsewhere). `None`: no clock is published, and the other
/// ranks take this one to be in step.
pub(super) fn open_clock(p: &Path) -> Option<File> {
    open_shared(p).ok()
}

/// A clock file older than this is a rank that stopped: it is taken to be in step.
pub(super) const CLOCK_STALE: Duration = Duration::from_secs(30);

/// Another rank's published (epoch, position), when recent. The cache directory is shared: a FIFO,
/// a device or an oversized file in a clock's place is no clock (refused on the descriptor before
/// anything is read), never a wait.
pub(super) fn read_clock(p: &Path) -> Option<(u64, u64)> {
    let m = std::fs::metadata(p).ok()?;
    if m.modified().ok()?.elapsed().ok()? > CLOCK_STALE {
        return None;
    }
    let b = crate::formats::read_regular(p, 16).ok()?;
    let e = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
    let pos = u64::from_le_bytes(b.get(8..16)?.try_into().ok()?);
    Some((e, pos))
}

impl ChunkCache {
    /// Where this process stands in the plan: the oldest read started and not finished, else the
    /// latest started. A pipeline keeps many chunks of batches in flight and starts reads well
    /// ahead of the ones still waiting for their chunks; counting from the latest would take the
    /// chunks those older reads still need for used (docs/decisions.md, "The cache's now").
    pub(super) fn now(&self) -> u64 {
        let f = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        match f.keys().next() {
            Some(&oldest) => oldest,
            None => self.clock.load(Ordering::Relaxed),
        }
    }

    /// The read at plan position `p` started: the clock moves to it, and it counts as in flight
    /// until the value returned drops.
    pub(super) fn started(&self, p: u64) -> InFlightRead<'_> {
        self.clock.fetch_max(p, Ordering::Relaxed);
        let plan = {
            let mut f = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            *f.entry(p).or_insert(0) += 1;
            self.plans.load(Ordering::Relaxed)
        };
        self.node_clock();
        InFlightRead {
            cache: self,
            pos: p,
            plan,
        }
    }

    /// A new plan: the clock restarts, and reads of the plan before (given up, still ending) no
    /// longer say where this process stands.
    pub(super) fn restart_clock(&self) {
        self.clock.store(0, Ordering::Relaxed);
        // Under the lock, so that a read ending meanwhile sees either the old plan and its count,
        // or the new plan and leaves the new counts alone.
        let mut f = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        self.plans.fetch_add(1, Ordering::Relaxed);
        f.clear();
        self.windows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Publishes where this process stands and, at most every 10 ms, reads where the node's other
    /// ranks do (with a plan of several ranks; nothing otherwise).
    pub(super) fn node_clock(&self) {
        let others = self.plan().other_ranks().to_vec();
        if others.is_empty() {
            return;
        }
        let mut n = self.node.lock().unwrap_or_else(|e| e.into_inner());
        let (e, pos) = self.plan().publish(self.now());
        if let Some(f) = &n.file {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&e.to_le_bytes());
            b[8..].copy_from_slice(&pos.to_le_bytes());
            // A clock not written is a rank taken to be in step: never an error.
            let _ = std::os::unix::fs::FileExt::write_at(f, &b, 0);
        }
        if n.read_at
            .is_some_and(|t| t.elapsed() < Duration::from_millis(10))
        {
            return;
        }
        n.read_at = Some(Instant::now());
        drop(n);
        for r in others {
            let at = read_clock(&self.dir.join(format!(".clock-{r}")));
            self.plan().set_clock(r, at);
        }
    }
}
