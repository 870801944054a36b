//! Windows of the plan's near future (since 2026-12-07): where a chunk is not worth keeping whole
//! (a random order over more than the cache: Megatron's), a miss still fetches the whole chunk in
//! one GET, and keeps — in memory, within `cache.window_fraction` of `cache.max_bytes` — the parts
//! of it that this process's planned reads use next, nearest first; those reads then cost no
//! request. Before, such a miss fetched its own bytes only: one GET per GPT window (16,544 GETs for
//! 16,000 windows), the byte minimum at 800–1,600 × the local epoch's time (docs/object-store.md,
//! "Windows of the future").
//!
//! The choice is pure ([`choose`]); the store is a map from a part (object, bytes) to its bytes and
//! how many planned reads still want it.

use std::collections::HashMap;
use std::sync::Arc;

/// A part of an object: (cache key, first byte, end).
pub(super) type PartKey = (u64, u64, u64);

/// A part of a chunk to keep, `(a, b)` of its object, and how many planned reads want it.
pub(super) type Keep = ((u64, u64), u32);

/// Per chunk (object key, index): the lock its window fetch is decided under.
pub(super) type ChunkLocks = HashMap<(u64, u64), Arc<tokio::sync::Mutex<()>>>;

/// Kept parts and their budget.
#[derive(Debug, Default)]
pub(super) struct Windows {
    parts: HashMap<PartKey, (Arc<[u8]>, u32)>,
    bytes: u64,
    max: u64,
}

impl Windows {
    /// A store of at most `max` bytes (0: off).
    pub(super) fn new(max: u64) -> Self {
        Self {
            max,
            ..Self::default()
        }
    }

    /// Bytes that may still be kept.
    pub(super) fn room(&self) -> u64 {
        self.max.saturating_sub(self.bytes)
    }

    /// Its bound.
    pub(super) fn max(&self) -> u64 {
        self.max
    }

    /// Whether the store is on.
    pub(super) fn on(&self) -> bool {
        self.max > 0
    }

    /// Keeps `bytes` of `key` for `uses` more planned reads (another copy of a kept part adds uses).
    pub(super) fn keep(&mut self, key: PartKey, bytes: &[u8], uses: u32) {
        if let Some((_, n)) = self.parts.get_mut(&key) {
            *n += uses;
            return;
        }
        if bytes.len() as u64 > self.room() {
            return;
        }
        self.bytes += bytes.len() as u64;
        self.parts.insert(key, (bytes.into(), uses));
    }

    /// The bytes of `key` for one planned read, if kept; the part goes when no read wants it more.
    pub(super) fn take(&mut self, key: PartKey) -> Option<Arc<[u8]>> {
        let (b, n) = self.parts.get_mut(&key)?;
        let out = b.clone();
        *n -= 1;
        if *n == 0 {
            self.parts.remove(&key);
            self.bytes -= out.len() as u64;
        }
        Some(out)
    }

    /// Whether `key` is kept.
    pub(super) fn has(&self, key: PartKey) -> bool {
        self.parts.contains_key(&key)
    }

    /// A new plan: nothing kept is known to be read.
    pub(super) fn clear(&mut self) {
        self.parts.clear();
        self.bytes = 0;
    }
}

/// A useful fraction below which a whole chunk is not fetched for its windows: its own part and
/// the parts kept must be at least a quarter of it, so the store reads at most ~4 × what is
/// delivered (the bound the object-store runs are held to).
pub(super) const MIN_USEFUL: u64 = 4;

/// Of a chunk of `len` bytes, the planned parts `(a, b)` (in the order they are read next) to keep
/// within `room` bytes, each with its number of reads; and whether fetching the chunk whole pays:
/// at least one later read is spared its request, and the bytes stay within [`MIN_USEFUL`] × what
/// is delivered — this fetch's own (the read at hand's `part` and the parts kept use at least
/// 1 / [`MIN_USEFUL`] of it), or the run's so far (`run`: bytes fetched and bytes delivered), where
/// the slack of well-used fetches pays for a chunk near the plan's end, whose few reads left would
/// each cost a request.
pub(super) fn choose(
    len: u64,
    part: u64,
    next: impl Iterator<Item = (u64, u64)>,
    room: u64,
    run: (u64, u64),
) -> (Vec<Keep>, bool) {
    let mut kept: Vec<Keep> = Vec::new();
    // Where each part is in `kept`: a chunk of 8 MiB holds ~16,000 GPT windows, and a search of
    // `kept` per planned read made the choice quadratic (61 % of the CPU of a default-cache
    // Megatron epoch on 2026-12-07).
    let mut at: HashMap<(u64, u64), usize> = HashMap::new();
    let (mut bytes, mut spared) = (0u64, 0u64);
    for (a, b) in next {
        if let Some(&i) = at.get(&(a, b)) {
            kept[i].1 += 1;
            spared += 1;
            continue;
        }
        let n = b - a;
        if bytes + n > room {
            break;
        }
        bytes += n;
        spared += 1;
        at.insert((a, b), kept.len());
        kept.push(((a, b), 1));
    }
    let used = bytes + part;
    let (fetched, delivered) = run;
    let within = used.saturating_mul(MIN_USEFUL) >= len
        || fetched.saturating_add(len) <= delivered.saturating_add(used).saturating_mul(MIN_USEFUL);
    (kept, spared > 0 && within)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_kept_nearest_first_within_the_room_and_counted_per_read() {
        let next = [(0, 100), (500, 600), (0, 100), (900, 1000)];
        let (kept, pays) = choose(1000, 100, next.into_iter(), 200, (0, 0));
        assert_eq!(kept, vec![((0, 100), 2), ((500, 600), 1)]);
        assert!(pays, "300 of 1000 bytes used, 3 requests spared");
        // Too little of the chunk is used, and the run has no slack: its own bytes only.
        let (_, pays) = choose(100_000, 100, next.into_iter(), 200, (40_000, 10_000));
        assert!(!pays);
        // The same with the run's slack (1 MB fetched for 1 MB delivered): fetched whole.
        let (_, pays) = choose(100_000, 100, next.into_iter(), 200, (1 << 20, 1 << 20));
        assert!(pays);
        // No later read: nothing spared.
        let (kept, pays) = choose(1000, 900, std::iter::empty(), 1 << 20, (0, 1 << 20));
        assert!(kept.is_empty() && !pays);
    }

    #[test]
    fn a_kept_part_serves_as_many_reads_as_want_it_then_frees_its_room() {
        let mut w = Windows::new(150);
        w.keep((1, 0, 100), &[7; 100], 2);
        w.keep((1, 200, 300), &[8; 100], 1); // no room: not kept
        assert_eq!((w.room(), w.has((1, 200, 300))), (50, false));
        assert_eq!(w.take((1, 0, 100)).map(|b| b.len()), Some(100));
        assert!(w.has((1, 0, 100)));
        assert!(w.take((1, 0, 100)).is_some());
        assert_eq!((w.has((1, 0, 100)), w.room()), (false, 150));
        assert!(w.take((1, 0, 100)).is_none());
    }
}
