//! What the plan says about the cache's chunks: for each chunk of each planned object, the sorted
//! positions (places in the whole plan) of the reads that touch it, and for each object its reads
//! in order, so that a read arriving at the cache finds its own position.
//!
//! The cache decides with it (docs/object-store.md, "How the cache decides"): a chunk's *next use*
//! is its first planned position at or after a time; eviction takes the resident chunk whose next
//! use is farthest (Belady), a miss whose chunk is next used later than every resident chunk (or
//! never) fetches only its bytes.

use std::collections::HashMap;

use ubdirect_ub::PlannedReads;

/// When a chunk is used next, as this process's plan says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NextUse {
    /// The chunk's object is not in this process's plan (another rank's, an index read at open, or
    /// no plan at all): the cache falls back to least recently used.
    Unknown,
    /// The object is planned but the chunk is not read again.
    Never,
    /// At this position.
    At(u64),
}

impl NextUse {
    /// Whether a resident chunk used next at `self` may be evicted for a chunk used next at `new`:
    /// it is used later (or never, or unknown to the plan); any chunk makes room for an unplanned
    /// one (least recently used first, as without a plan).
    pub(crate) fn evictable_for(self, new: NextUse) -> bool {
        match (self, new) {
            (NextUse::Never | NextUse::Unknown, _) | (_, NextUse::Unknown) => true,
            (NextUse::At(x), NextUse::At(y)) => x > y,
            (NextUse::At(_), NextUse::Never) => false,
        }
    }

    /// Eviction order: never used again first, then unknown to the plan, then the farthest next
    /// use first (ties: older mtime first, by the caller).
    pub(crate) fn evict_rank(self) -> (u8, u64) {
        match self {
            NextUse::Never => (0, 0),
            NextUse::Unknown => (1, 0),
            NextUse::At(x) => (2, u64::MAX - x),
        }
    }
}

/// The eviction policy, pure: which of `residents` — each (its next use, when it was last used,
/// its bytes) — to evict so that `need` more bytes fit in `max` with `used` in use, for a chunk
/// used next at `next`. Never used again first, then unknown to the plan (least recently used
/// first), then the farthest next use (Belady's choice), each only while it may be evicted for
/// `next`; the indices of the victims in eviction order, or `None` when they cannot make room. The
/// cache calls it with its directory's chunks ([`NextUse`] from the plan, the sidecars' mtimes).
pub(crate) fn choose_victims<T: Ord + Copy>(
    residents: &[(NextUse, T, u64)],
    used: u64,
    need: u64,
    max: u64,
    next: NextUse,
) -> Option<Vec<usize>> {
    let mut order: Vec<usize> = (0..residents.len()).collect();
    order.sort_by_key(|&i| (residents[i].0.evict_rank(), residents[i].1));
    let (mut used, mut out) = (used, Vec::new());
    let mut it = order.into_iter();
    while used.saturating_add(need) > max {
        let i = it.next().filter(|&i| residents[i].0.evictable_for(next))?;
        used = used.saturating_sub(residents[i].2);
        out.push(i);
    }
    Some(out)
}

/// One object's planned reads, in order, with a cursor over those already started.
#[derive(Debug, Default)]
struct ObjectReads {
    /// (position, offset, len).
    reads: Vec<(u64, u64, u64)>,
    /// Whether each read has started.
    started: Vec<bool>,
    /// First read not started.
    cursor: usize,
    /// First read not advised.
    advised: usize,
}

/// How far past the cursor a read is looked for (reads start in the plan's order, a few at once).
const LOOKAHEAD: usize = 1 << 14;

impl ObjectReads {
    /// Whether this object's read at position `pos` has started (a position it does not plan: no).
    fn started_at(&self, pos: u64) -> bool {
        self.reads
            .binary_search_by_key(&pos, |r| r.0)
            .is_ok_and(|i| self.started[i])
    }

    /// The position of the next read of (offset, len): the first not started (`advise`: the first
    /// after the last advised), looked for up to [`LOOKAHEAD`] reads ahead; marks it.
    fn find(&mut self, offset: u64, len: u64, advise: bool) -> Option<u64> {
        let from = if advise { self.advised } else { self.cursor };
        let end = self.reads.len().min(from + LOOKAHEAD);
        let i = (from..end).find(|&i| {
            let (_, o, l) = self.reads[i];
            o == offset && l == len && (advise || !self.started[i])
        })?;
        if advise {
            self.advised = i + 1;
        } else {
            self.started[i] = true;
            while self.cursor < self.started.len() && self.started[self.cursor] {
                self.cursor += 1;
            }
        }
        Some(self.reads[i].0)
    }
}

/// A planned read's use of a chunk: (position, bytes of the chunk it reads, local rank, the
/// object offset where those bytes start).
type Use = (u64, u64, u32, u64);

/// The schedule of one generation (the epoch about to start and the next), for the ranks of the
/// node: this process's reads and the other ranks', on one clock of positions.
#[derive(Debug, Default)]
pub(crate) struct Schedule {
    generation: Option<u64>,
    /// Object (cache key) → this process's reads of it.
    objects: HashMap<u64, ObjectReads>,
    /// (object, chunk index) → (position, bytes of the chunk it reads, local rank) of the reads
    /// touching it, by position.
    uses: HashMap<(u64, u64), Vec<Use>>,
    /// This process's local rank.
    me: u32,
    /// The other local ranks with reads in the schedule.
    others: Vec<u32>,
    /// Where other ranks stand, on this schedule's clock (as they published it); a rank not here is
    /// taken to be in step with this one.
    clocks: HashMap<u32, u64>,
    /// The epoch at position 0, and where the next starts.
    epoch: u64,
    next_epoch_at: u64,
}

impl Schedule {
    /// Sets object `key`'s reads (`chunk_size`-byte chunks) for the generation of `planned`, this
    /// process's and the node's other ranks' (which count for next uses but never start here); a
    /// new generation forgets every object of the last. Returns whether the generation is new.
    pub(crate) fn set(&mut self, key: u64, chunk_size: u64, planned: &PlannedReads<'_>) -> bool {
        // A schedule older than the one in force (an extension that arrives after the next epoch
        // started): ignored.
        if self.generation.is_some_and(|g| planned.generation < g) {
            return false;
        }
        let fresh = self.generation != Some(planned.generation);
        // The same generation again extends it (the other ranks' reads, the next epoch's): the
        // positions it had keep their meaning.
        self.next_epoch_at = planned.next_epoch_at;
        if fresh {
            self.generation = Some(planned.generation);
            self.objects.clear();
            self.uses.clear();
            self.others.clear();
            self.clocks.clear();
            self.me = planned.local_rank;
            self.epoch = planned.epoch;
            self.next_epoch_at = planned.next_epoch_at;
        }
        self.uses.retain(|(k, _), _| *k != key);
        let mut filled = Vec::new();
        let me = planned.local_rank;
        let all = planned
            .reads
            .iter()
            .map(|&(p, o, l)| (me, p, o, l))
            .chain(planned.others.iter().copied());
        for (rank, pos, off, len) in all {
            if len == 0 {
                continue;
            }
            if rank != me && !self.others.contains(&rank) {
                self.others.push(rank);
            }
            for idx in off / chunk_size..=(off + len - 1) / chunk_size {
                let part = (off + len).min((idx + 1) * chunk_size) - off.max(idx * chunk_size);
                let v = self.uses.entry((key, idx)).or_default();
                if v.is_empty() {
                    filled.push(idx);
                }
                v.push((pos, part, rank, off.max(idx * chunk_size)));
            }
        }
        // Only this object's chunks changed (a schedule has one call per object: sorting every
        // object's uses again on each was quadratic in the objects).
        for idx in filled {
            if let Some(v) = self.uses.get_mut(&(key, idx)) {
                v.sort_unstable();
            }
        }
        // An extension keeps what already started of the reads it repeats.
        let mut reads = ObjectReads {
            reads: planned.reads.to_vec(),
            started: vec![false; planned.reads.len()],
            cursor: 0,
            advised: 0,
        };
        if let Some(prev) = self.objects.remove(&key)
            && !fresh
            && planned.reads.starts_with(&prev.reads)
        {
            reads.started[..prev.started.len()].copy_from_slice(&prev.started);
            reads.cursor = prev.cursor;
            reads.advised = prev.advised;
        }
        self.objects.insert(key, reads);
        fresh
    }

    /// The other local ranks with reads in this schedule.
    pub(crate) fn other_ranks(&self) -> &[u32] {
        &self.others
    }

    /// Rank `rank` published that it stands at `pos` of `epoch` (`None`: nothing recent, so it is
    /// taken to be in step with this process).
    pub(crate) fn set_clock(&mut self, rank: u32, at: Option<(u64, u64)>) {
        let Some((epoch, pos)) = at else {
            self.clocks.remove(&rank);
            return;
        };
        let c = if epoch == self.epoch {
            pos
        } else if epoch < self.epoch {
            0 // behind: every read of this schedule is still ahead of it
        } else if epoch == self.epoch + 1 && self.next_epoch_at != u64::MAX {
            self.next_epoch_at.saturating_add(pos)
        } else {
            u64::MAX // past everything this schedule knows
        };
        self.clocks.insert(rank, c);
    }

    /// Position `pos` of this schedule as (epoch, position in that epoch), for other ranks.
    pub(crate) fn publish(&self, pos: u64) -> (u64, u64) {
        if pos >= self.next_epoch_at {
            (self.epoch + 1, pos - self.next_epoch_at)
        } else {
            (self.epoch, pos)
        }
    }

    /// This process's planned reads of chunk `idx` of object `key` at or
    /// after position `from` and within the horizon `room` bytes of windows hold, but the one at
    /// `skip`: each read's part of the chunk (the object's bytes `a..b`), in the order they come
    /// (the windows a chunk fetched whole keeps, `cache/windows.rs`).
    pub(crate) fn parts_ahead(
        &self,
        key: u64,
        idx: u64,
        from: u64,
        skip: u64,
        room: u64,
    ) -> Vec<(u64, u64)> {
        let (Some(o), Some(v)) = (self.objects.get(&key), self.uses.get(&(key, idx))) else {
            return Vec::new();
        };
        // Belady over windows: room for the windows of every chunk read within the horizon, not
        // for one chunk's whole future — the positions whose reads `room` bytes hold, at this
        // object's mean read.
        let mean = (o.reads.iter().map(|r| r.2).sum::<u64>() / o.reads.len().max(1) as u64).max(1);
        let horizon = from.saturating_add(room / mean);
        // From this object's first read not started, which may come before `from` (the oldest read
        // in flight; reads start a few at once, out of order): reads planned before it but not
        // started yet want their windows too — before 2026-12-07 they were left out, and each cost
        // a GET of its own (65 of 67 requests in two Megatron epochs with a default cache). A read
        // before `from` that started has finished; from `from` on, started ones are in flight and
        // may be waiting for this very chunk.
        let first = o.reads.get(o.cursor).map_or(from, |r| r.0).min(from);
        v[v.partition_point(|u| u.0 < first)..]
            .iter()
            .take_while(|u| u.0 <= horizon)
            .filter(|u| u.2 == self.me && u.0 != skip && (u.0 >= from || !o.started_at(u.0)))
            .map(|&(_, n, _, a)| (a, a + n))
            .collect()
    }

    /// The position of object `key`'s read of (offset, len) starting now (`None`: not planned).
    pub(crate) fn start(&mut self, key: u64, offset: u64, len: u64) -> Option<u64> {
        self.objects.get_mut(&key)?.find(offset, len, false)
    }

    /// The position of object `key`'s read of (offset, len) advised now (`None`: not planned).
    pub(crate) fn advised(&mut self, key: u64, offset: u64, len: u64) -> Option<u64> {
        self.objects.get_mut(&key)?.find(offset, len, true)
    }

    /// Where rank `rank` stands, seen from this process at `from`.
    fn threshold(&self, rank: u32, from: u64) -> u64 {
        if rank == self.me {
            from
        } else {
            self.clocks.get(&rank).copied().unwrap_or(from)
        }
    }

    /// The least and the greatest of where the ranks stand, seen from `from`.
    fn bounds(&self, from: u64) -> (u64, u64) {
        let ranks = std::iter::once(self.me).chain(self.others.iter().copied());
        ranks
            .map(|r| self.threshold(r, from))
            .filter(|&t| t != u64::MAX) // past everything: no use of it is ahead
            .fold((u64::MAX, 0u64), |(lo, hi), t| (lo.min(t), hi.max(t)))
    }

    /// When use `(p, _, r)` comes, seen from `from` on this process's clock (a use `d` positions
    /// ahead of where its rank stands is at `from + d`); `None`: its rank is past it.
    fn when(&self, p: u64, r: u32, from: u64) -> Option<u64> {
        let t = self.threshold(r, from);
        (p >= t).then(|| from.saturating_add(p - t))
    }

    /// Chunk `idx` of object `key`: its first use by any rank of the node at or after `from` (this
    /// process's clock; other ranks' uses counted from where they stand).
    pub(crate) fn next_use(&self, key: u64, idx: u64, from: u64) -> NextUse {
        if !self.objects.contains_key(&key) {
            return NextUse::Unknown;
        }
        let Some(v) = self.uses.get(&(key, idx)) else {
            return NextUse::Never;
        };
        let (lo, hi) = self.bounds(from);
        let mut best = u64::MAX;
        for &(p, _, r, _) in &v[v.partition_point(|&(p, ..)| p < lo)..] {
            // Every use from here on comes at least this late.
            if from.saturating_add(p.saturating_sub(hi)) >= best {
                break;
            }
            if let Some(at) = self.when(p, r, from) {
                best = best.min(at);
            }
        }
        match best {
            u64::MAX => NextUse::Never,
            b => NextUse::At(b),
        }
    }
}

impl Schedule {
    /// Whether fetching chunk `idx` of object `key` whole (`cost` bytes more than the read at hand
    /// needs) pays back before `until` (when it would be evicted, or the chunks it evicts are needed
    /// again): the planned reads of it at `from..until`, by every rank of the node, read at least
    /// `cost` bytes. An object unknown to the plan: always (least recently used, as without a plan).
    pub(crate) fn pays_back(&self, key: u64, idx: u64, from: u64, until: u64, cost: u64) -> bool {
        if !self.objects.contains_key(&key) {
            return true;
        }
        let Some(v) = self.uses.get(&(key, idx)) else {
            return false;
        };
        let (lo, hi) = self.bounds(from);
        let mut saved = 0u64;
        for &(p, b, r, _) in &v[v.partition_point(|&(p, ..)| p < lo)..] {
            if from.saturating_add(p.saturating_sub(hi)) >= until {
                break;
            }
            if self.when(p, r, from).is_some_and(|at| at < until) {
                saved += b;
                if saved >= cost {
                    return true;
                }
            }
        }
        false
    }
}

/// Belady's minimum, offline: the bytes a cache of `max_bytes` (each chunk costing its length
/// plus `overhead`) fetches from the store for `reads` (object, position-ordered offset, len) of
/// objects of `sizes`, when a miss either fetches its chunk (evicting the resident chunk used
/// farthest ahead, if that is later than the missing chunk's next use) or only its bytes.
pub fn belady_bytes(
    reads: &[(usize, u64, u64)],
    sizes: &[u64],
    chunk_size: u64,
    max_bytes: u64,
    overhead: u64,
) -> u64 {
    let mut s = Schedule::default();
    let mut per: Vec<Vec<(u64, u64, u64)>> = vec![Vec::new(); sizes.len()];
    for (pos, &(o, off, len)) in reads.iter().enumerate() {
        if let Some(v) = per.get_mut(o) {
            v.push((pos as u64, off, len));
        }
    }
    for (o, v) in per.iter().enumerate() {
        s.set(
            o as u64,
            chunk_size,
            &PlannedReads {
                generation: 0,
                reads: v,
                others: &[],
                local_rank: 0,
                epoch: 0,
                next_epoch_at: u64::MAX,
            },
        );
    }
    let clen = |o: usize, idx: u64| chunk_size.min(sizes[o] - idx * chunk_size);
    let mut resident: Vec<(usize, u64)> = Vec::new();
    let (mut used, mut fetched) = (0u64, 0u64);
    for (pos, &(o, off, len)) in reads.iter().enumerate() {
        let (pos, end) = (pos as u64, off + len);
        for idx in off / chunk_size..=end.saturating_sub(1) / chunk_size {
            if len == 0 || resident.contains(&(o, idx)) {
                continue;
            }
            let part = end.min((idx + 1) * chunk_size) - off.max(idx * chunk_size);
            let next = s.next_use(o as u64, idx, pos + 1);
            let need = clen(o, idx) + overhead;
            // The victims, farthest next use first, while each is used later than this chunk.
            let mut order: Vec<(usize, NextUse)> = resident
                .iter()
                .enumerate()
                .map(|(i, &(ro, ri))| (i, s.next_use(ro as u64, ri, pos)))
                .collect();
            order.sort_by_key(|&(_, n)| n.evict_rank());
            let (mut free, mut victims, mut until) = (max_bytes - used, Vec::new(), u64::MAX);
            for &(i, n) in &order {
                if free >= need || !n.evictable_for(next) {
                    break;
                }
                let (ro, ri) = resident[i];
                free += clen(ro, ri) + overhead;
                victims.push(i);
                if let NextUse::At(x) = n {
                    until = until.min(x);
                }
            }
            let admit = free >= need
                && (victims.is_empty()
                    || (next != NextUse::Never
                        && s.pays_back(o as u64, idx, pos + 1, until, clen(o, idx) - part)));
            if admit {
                victims.sort_unstable_by(|a, b| b.cmp(a));
                for i in victims {
                    let (ro, ri) = resident.swap_remove(i);
                    used -= clen(ro, ri) + overhead;
                }
                resident.push((o, idx));
                used += need;
                fetched += clen(o, idx);
            } else {
                fetched += part;
            }
        }
    }
    fetched
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A schedule of generation `g` for local rank `me`: `reads`, and `others` of other ranks.
    fn planned<'a>(
        g: u64,
        me: u32,
        reads: &'a [(u64, u64, u64)],
        others: &'a [(u32, u64, u64, u64)],
    ) -> PlannedReads<'a> {
        PlannedReads {
            generation: g,
            reads,
            others,
            local_rank: me,
            epoch: 0,
            next_epoch_at: u64::MAX,
        }
    }

    #[test]
    fn next_use_is_the_first_planned_position_at_or_after() {
        let mut s = Schedule::default();
        s.set(
            7,
            100,
            &planned(1, 0, &[(0, 0, 10), (3, 150, 10), (5, 90, 20)], &[]),
        );
        assert_eq!(s.next_use(7, 0, 0), NextUse::At(0));
        assert_eq!(s.next_use(7, 0, 1), NextUse::At(5));
        assert_eq!(s.next_use(7, 1, 4), NextUse::At(5));
        assert_eq!(s.next_use(7, 0, 6), NextUse::Never);
        assert_eq!(s.next_use(7, 9, 0), NextUse::Never);
        assert_eq!(s.next_use(8, 0, 0), NextUse::Unknown);
        assert_eq!(s.start(7, 150, 10), Some(3));
        assert_eq!(s.start(7, 150, 10), None, "each planned read starts once");
        assert!(s.set(7, 100, &planned(2, 0, &[], &[])), "a new generation");
        assert_eq!(s.next_use(7, 0, 0), NextUse::Never);
    }

    #[test]
    fn other_ranks_reads_count_from_where_those_ranks_stand_and_never_start_here() {
        let mut s = Schedule::default();
        // Local rank 0 reads chunk 0 at 0 and 4; rank 1 reads chunk 1 at 1, chunk 0 at 2, and
        // object 9, which rank 0 never reads, at 3.
        let mine = [(0, 0, 10), (4, 20, 10)];
        s.set(
            7,
            100,
            &planned(1, 0, &mine, &[(1, 1, 150, 10), (1, 2, 30, 10)]),
        );
        s.set(9, 100, &planned(1, 0, &[], &[(1, 3, 0, 10)]));
        // Rank 1 unheard of: in step with this one.
        assert_eq!(s.next_use(7, 0, 1), NextUse::At(2), "the other rank's read");
        assert_eq!(s.next_use(7, 1, 0), NextUse::At(1));
        assert_eq!(
            s.next_use(9, 0, 0),
            NextUse::At(3),
            "known from the other rank's plan"
        );
        assert_eq!(s.next_use(9, 0, 4), NextUse::Never);
        assert_eq!(
            s.start(7, 150, 10),
            None,
            "another rank's read does not start here"
        );
        assert_eq!(s.start(7, 20, 10), Some(4));
        assert!(s.pays_back(7, 1, 0, 5, 10));
        // Rank 1 is behind, at 0: seen from 3, its read at 3 is 3 ahead of it, at 6.
        s.set_clock(1, Some((0, 0)));
        assert_eq!(s.next_use(9, 0, 3), NextUse::At(6));
        assert!(!s.pays_back(9, 0, 3, 6, 10) && s.pays_back(9, 0, 3, 7, 10));
        // Rank 1 is ahead, at 3: its read of chunk 0 at 2 is behind it, so chunk 0 waits for 4.
        s.set_clock(1, Some((0, 3)));
        assert_eq!(s.next_use(7, 0, 1), NextUse::At(4));
        // Rank 1 in the next epoch, which this schedule does not hold: past all of it.
        s.set_clock(1, Some((1, 0)));
        assert_eq!(s.next_use(9, 0, 0), NextUse::Never);
        s.set_clock(1, None);
        assert_eq!(
            s.next_use(9, 0, 0),
            NextUse::At(3),
            "heard of no more: in step"
        );
        assert_eq!(s.publish(5), (0, 5));
    }

    #[test]
    fn an_extension_keeps_what_started_and_a_stale_schedule_is_ignored() {
        let mut s = Schedule::default();
        let this = [(0, 0, 10), (1, 100, 10)];
        assert!(
            s.set(7, 100, &planned(4, 0, &this, &[])),
            "a new generation"
        );
        assert_eq!(s.start(7, 0, 10), Some(0));
        // The next epoch's reads arrive later under the same generation: an extension.
        let both = [(0, 0, 10), (1, 100, 10), (2, 0, 10), (3, 100, 10)];
        let mut ext = planned(4, 0, &both, &[]);
        ext.next_epoch_at = 2;
        assert!(!s.set(7, 100, &ext), "the same generation extends");
        assert_eq!(
            s.next_use(7, 0, 1),
            NextUse::At(2),
            "the next epoch's use is known"
        );
        // The read at 0 started before: the same range is the next epoch's read now.
        assert_eq!(s.start(7, 0, 10), Some(2));
        assert_eq!(s.start(7, 100, 10), Some(1));
        // A schedule of an older generation (an extension arriving after the next epoch began).
        assert!(s.set(7, 100, &planned(5, 0, &this, &[])));
        assert!(!s.set(7, 100, &ext), "stale: ignored");
        assert_eq!(
            s.next_use(7, 0, 1),
            NextUse::Never,
            "the stale reads were not taken"
        );
    }

    /// Reads start a few at once, out of order: the windows a chunk's fetch keeps include reads
    /// planned before the oldest in flight that have not started, not those that have finished.
    #[test]
    fn windows_are_kept_for_reads_not_started_before_the_clock() {
        let mut s = Schedule::default();
        let reads = [(0, 0, 10), (1, 10, 10), (2, 20, 10), (3, 30, 10)];
        s.set(7, 100, &planned(1, 0, &reads, &[]));
        // The read at 2 started first (it is the oldest in flight), and fetches the chunk.
        assert_eq!(s.start(7, 20, 10), Some(2));
        assert_eq!(
            s.parts_ahead(7, 0, 2, 2, 1000),
            vec![(0, 10), (10, 20), (30, 40)],
            "the reads at 0 and 1 have not started"
        );
        // The read at 0 started and finished; 1 has not started.
        assert_eq!(s.start(7, 0, 10), Some(0));
        assert_eq!(s.parts_ahead(7, 0, 2, 2, 1000), vec![(10, 20), (30, 40)]);
    }

    #[test]
    fn eviction_prefers_the_farthest_next_use() {
        assert!(NextUse::At(9).evictable_for(NextUse::At(3)));
        assert!(!NextUse::At(3).evictable_for(NextUse::At(9)));
        assert!(!NextUse::At(3).evictable_for(NextUse::Never));
        assert!(NextUse::Never.evict_rank() < NextUse::At(100).evict_rank());
        assert!(NextUse::At(100).evict_rank() < NextUse::At(3).evict_rank());
    }

    #[test]
    fn belady_keeps_what_is_read_again_and_fetches_the_rest_exactly() {
        // Two chunks of 100 bytes fit; chunk 0 read often, chunks 1..4 once each.
        let reads: Vec<(usize, u64, u64)> = (0..8u64)
            .map(|i| {
                if i % 2 == 0 {
                    (0, 10, 5)
                } else {
                    (0, 100 * (i / 2 + 1), 5)
                }
            })
            .collect();
        // Chunks 0 and 1 fill the free room; chunks 2..4 are read once: their bytes alone.
        let b = belady_bytes(&reads, &[500], 100, 200, 0);
        assert_eq!(b, 200 + 3 * 5);
        // Chunks 0 and 1 fill the room; 2..4, read 10 times each, would not pay back an eviction.
        let reads: Vec<(usize, u64, u64)> = (0..80u64)
            .map(|i| {
                if i % 2 == 0 {
                    (0, 10, 5)
                } else {
                    (0, 100 * (1 + (i / 2) % 4), 5)
                }
            })
            .collect();
        let b = belady_bytes(&reads, &[500], 100, 200, 0);
        assert_eq!(b, 200 + 30 * 5);
    }

    /// The eviction policy against a brute force on random residents: when it evicts, its victims
    /// are a smallest set that makes room among those it may evict, and no resident it keeps is used
    /// later than one it evicts (Belady's choice); it refuses only when even every evictable one
    /// would not make room.
    #[test]
    fn the_eviction_policy_is_beladys_choice_on_random_residents() {
        let mut x = 0x853c_49e6_748f_ea9bu64;
        let mut rnd = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..5000 {
            let n = rnd(8) as usize;
            let residents: Vec<(NextUse, u64, u64)> = (0..n)
                .map(|i| {
                    let next = match rnd(5) {
                        0 => NextUse::Never,
                        1 => NextUse::Unknown,
                        _ => NextUse::At(rnd(50)),
                    };
                    (next, i as u64, 1)
                })
                .collect();
            let max = n as u64 + rnd(3);
            let used = n as u64;
            let need = rnd(4);
            let next = match rnd(4) {
                0 => NextUse::Never,
                1 => NextUse::Unknown,
                _ => NextUse::At(rnd(50)),
            };
            let evictable = residents.iter().filter(|r| r.0.evictable_for(next)).count() as u64;
            let must = (used + need).saturating_sub(max);
            match choose_victims(&residents, used, need, max, next) {
                None => assert!(
                    evictable < must,
                    "refused with {evictable} evictable, {must} needed"
                ),
                Some(v) => {
                    assert_eq!(v.len() as u64, must, "a smallest set");
                    for &i in &v {
                        assert!(residents[i].0.evictable_for(next));
                        for (k, r) in residents.iter().enumerate() {
                            if !v.contains(&k) {
                                assert!(
                                    r.0.evict_rank() >= residents[i].0.evict_rank(),
                                    "kept {:?}, evicted {:?}",
                                    r.0,
                                    residents[i].0
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
