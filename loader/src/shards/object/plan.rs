//! What the plan says about the cache's chunks: for each chunk of each planned object, the sorted
//! positions (places in the whole plan) of the reads that touch it, and for each object its reads
//! in order, so that a read arriving at the cache finds its own position.
//!
//! The cache decides with it (docs/object-store.md, "How the cache decides"): a chunk's *next use*
//! is its first planned position at or after a time; eviction takes the resident chunk whose next
//! use is farthest (Belady), a miss whose chunk is next used later than every resident chunk (or
//! never) fetches only its bytes.

use std::collections::HashMap;

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

/// The schedule of one generation (the epoch about to start and the next).
#[derive(Debug, Default)]
pub(crate) struct Schedule {
    generation: Option<u64>,
    /// Object (cache key) → its reads.
    objects: HashMap<u64, ObjectReads>,
    /// (object, chunk index) → (position, bytes of the chunk it reads) of the reads touching it,
    /// by position.
    uses: HashMap<(u64, u64), Vec<(u64, u64)>>,
}

impl Schedule {
    /// Sets object `key`'s reads (`chunk_size`-byte chunks) for `generation`; a new generation
    /// forgets every object of the last. Returns whether the generation is new.
    pub(crate) fn set(
        &mut self,
        generation: u64,
        key: u64,
        chunk_size: u64,
        reads: &[(u64, u64, u64)],
    ) -> bool {
        let fresh = self.generation != Some(generation);
        if fresh {
            self.generation = Some(generation);
            self.objects.clear();
            self.uses.clear();
        }
        self.uses.retain(|(k, _), _| *k != key);
        for &(pos, off, len) in reads {
            if len == 0 {
                continue;
            }
            for idx in off / chunk_size..=(off + len - 1) / chunk_size {
                let part = (off + len).min((idx + 1) * chunk_size) - off.max(idx * chunk_size);
                self.uses.entry((key, idx)).or_default().push((pos, part));
            }
        }
        for v in self.uses.values_mut() {
            v.sort_unstable();
        }
        self.objects.insert(
            key,
            ObjectReads {
                reads: reads.to_vec(),
                started: vec![false; reads.len()],
                cursor: 0,
                advised: 0,
            },
        );
        fresh
    }

    /// The position of object `key`'s read of (offset, len) starting now (`None`: not planned).
    pub(crate) fn start(&mut self, key: u64, offset: u64, len: u64) -> Option<u64> {
        self.objects.get_mut(&key)?.find(offset, len, false)
    }

    /// The position of object `key`'s read of (offset, len) advised now (`None`: not planned).
    pub(crate) fn advised(&mut self, key: u64, offset: u64, len: u64) -> Option<u64> {
        self.objects.get_mut(&key)?.find(offset, len, true)
    }

    /// Chunk `idx` of object `key`: its first use at or after `from`.
    pub(crate) fn next_use(&self, key: u64, idx: u64, from: u64) -> NextUse {
        if !self.objects.contains_key(&key) {
            return NextUse::Unknown;
        }
        match self.uses.get(&(key, idx)) {
            Some(v) => match v.get(v.partition_point(|&(p, _)| p < from)) {
                Some(&(p, _)) => NextUse::At(p),
                None => NextUse::Never,
            },
            None => NextUse::Never,
        }
    }
}

impl Schedule {
    /// Whether fetching chunk `idx` of object `key` whole (`cost` bytes more than the read at hand
    /// needs) pays back before `until` (when it would be evicted, or the chunks it evicts are needed
    /// again): the planned reads of it at positions `from..until` read at least `cost` bytes. An
    /// object unknown to the plan: always (least recently used, as without a plan).
    pub(crate) fn pays_back(&self, key: u64, idx: u64, from: u64, until: u64, cost: u64) -> bool {
        if !self.objects.contains_key(&key) {
            return true;
        }
        let Some(v) = self.uses.get(&(key, idx)) else {
            return false;
        };
        let mut saved = 0u64;
        for &(p, b) in &v[v.partition_point(|&(p, _)| p < from)..] {
            if p >= until {
                break;
            }
            saved += b;
            if saved >= cost {
                return true;
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
        s.set(0, o as u64, chunk_size, v);
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

    #[test]
    fn next_use_is_the_first_planned_position_at_or_after() {
        let mut s = Schedule::default();
        s.set(1, 7, 100, &[(0, 0, 10), (3, 150, 10), (5, 90, 20)]);
        assert_eq!(s.next_use(7, 0, 0), NextUse::At(0));
        assert_eq!(s.next_use(7, 0, 1), NextUse::At(5));
        assert_eq!(s.next_use(7, 1, 4), NextUse::At(5));
        assert_eq!(s.next_use(7, 0, 6), NextUse::Never);
        assert_eq!(s.next_use(7, 9, 0), NextUse::Never);
        assert_eq!(s.next_use(8, 0, 0), NextUse::Unknown);
        assert_eq!(s.start(7, 150, 10), Some(3));
        assert_eq!(s.start(7, 150, 10), None, "each planned read starts once");
        assert!(s.set(2, 7, 100, &[]), "a new generation");
        assert_eq!(s.next_use(7, 0, 0), NextUse::Never);
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
}
