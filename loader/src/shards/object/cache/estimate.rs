//! What an epoch will cost the object store, before it runs (since 2026-12-07, issue 47): the
//! cache's own decisions — Belady's eviction with its pay-back test ([`choose_victims`],
//! [`Schedule::pays_back`]), windows of the plan's near future ([`windows::choose`]), a part's own
//! bytes otherwise — replayed over the epoch's planned reads in their order, one read at a time.
//! It counts the requests and the bytes; [`Estimate::seconds`] and [`Estimate::usd`] turn them
//! into time and money at a latency, a bandwidth and prices the configuration names.
//!
//! It replays this process's reads alone, in plan order, one at a time: reads in flight together
//! (two reads of a chunk missing at once fetch it once) and other ranks' reads are not modelled,
//! and the cache directory starts as the simulation left it after the previous epoch (empty
//! before the first). The summary prints the estimate beside the realised figures, so a gap shows.

use std::collections::{BinaryHeap, HashMap};

use ubdirect_ub::PlannedReads;

use super::super::plan::{NextUse, Schedule, choose_victims};
use super::windows;
pub use crate::shards::object::cost::{CacheModel, Estimate};

/// Most reads an epoch's estimate replays; a larger epoch is scaled from its first ones (a cold
/// start: the estimate errs high).
pub const REPLAYED: usize = 1 << 20;

/// Bytes of a cached chunk's sidecar, as the cache counts them when it admits a chunk.
const SIDECAR: u64 = 64;

/// The cache's state between epochs, replayed.
#[derive(Debug)]
pub struct Replay {
    model: CacheModel,
    /// Chunk files: (object, chunk) → its bytes and when it was last used.
    resident: HashMap<(u64, u64), (u64, u64)>,
    used: u64,
    /// Windows kept: (object, a, b) → reads that still want it.
    windows: HashMap<(u64, u64, u64), u32>,
    window_used: u64,
    /// Bytes from the store and delivered, so far (the window choice's slack).
    fetched: u64,
    delivered: u64,
    tick: u64,
    generation: u64,
}

/// One part of a read: the object, its chunk and the object's bytes `a..b` in it.
#[derive(Debug, Clone, Copy)]
struct Part {
    o: u64,
    idx: u64,
    a: u64,
    b: u64,
}

impl Replay {
    /// A cache of `model`, empty.
    pub fn new(model: CacheModel) -> Self {
        Self {
            model,
            resident: HashMap::new(),
            used: 0,
            windows: HashMap::new(),
            window_used: 0,
            fetched: 0,
            delivered: 0,
            tick: 0,
            generation: 0,
        }
    }

    /// The cost of an epoch of `total` planned reads whose first ones of object `o` are `per[o]`
    /// ((position, offset, len), in position order) of objects of `sizes`: at most [`REPLAYED`] of
    /// them are replayed, the rest scaled (so a caller need not collect more than that).
    pub fn epoch(&mut self, per: &[&[(u64, u64, u64)]], sizes: &[u64], total: u64) -> Estimate {
        let total = total.max(per.iter().map(|v| v.len() as u64).sum());
        let order = merged(per, REPLAYED);
        let mut e = Estimate {
            reads: total,
            replayed: order.len() as u64,
            ..Estimate::default()
        };
        if !self.model.cached || self.model.chunk_size == 0 {
            for &(_, _, _, len) in &order {
                e.requests += gets(len, self.model.max_request);
                e.bytes += len;
                e.delivered += len;
            }
            return e.scaled(total);
        }
        // The schedule of the replayed reads (those after them are unknown to it: never used).
        let end = order.last().map_or(0, |r| r.0);
        let mut s = Schedule::default();
        self.generation += 1;
        for (o, v) in per.iter().enumerate() {
            let reads = &v[..v.partition_point(|r| r.0 <= end)];
            s.set(
                o as u64,
                self.model.chunk_size,
                &PlannedReads {
                    generation: self.generation,
                    reads,
                    others: &[],
                    local_rank: 0,
                    epoch: self.generation,
                    next_epoch_at: u64::MAX,
                },
            );
        }
        // A new plan: the windows kept for the last one are not known to be read.
        self.windows.clear();
        self.window_used = 0;
        for &(pos, o, off, len) in &order {
            // The read starts, as at the cache (its object's cursor moves past it).
            s.start(o, off, len);
            let size = sizes.get(o as usize).copied().unwrap_or(0);
            let cs = self.model.chunk_size;
            let end = (off + len).min(size);
            for idx in off / cs..=end.saturating_sub(1) / cs {
                if len == 0 {
                    break;
                }
                let part = Part {
                    o,
                    idx,
                    a: off.max(idx * cs),
                    b: end.min((idx + 1) * cs),
                };
                let clen = cs.min(size.saturating_sub(idx * cs));
                let (req, bytes) = self.part(&s, pos, part, clen);
                e.requests += req;
                e.bytes += bytes;
                self.fetched += bytes;
            }
            e.delivered += len;
            self.delivered += len;
        }
        e.scaled(total)
    }

    /// A read's part at plan position `pos` of chunk `clen` bytes long: (requests, bytes).
    fn part(&mut self, s: &Schedule, pos: u64, p: Part, clen: u64) -> (u64, u64) {
        let key = (p.o, p.a, p.b);
        if let Some(n) = self.windows.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.windows.remove(&key);
                self.window_used -= p.b - p.a;
            }
            return (0, 0);
        }
        self.tick += 1;
        if let Some(r) = self.resident.get_mut(&(p.o, p.idx)) {
            r.1 = self.tick;
            return (0, 0);
        }
        let next = s.next_use(p.o, p.idx, pos + 1);
        // The cache fetches a chunk, or a part, in one GET.
        let whole = 1;
        if self.admit(s, pos, p, clen, next) {
            self.resident
                .insert((p.o, p.idx), (clen + SIDECAR, self.tick));
            self.used += clen + SIDECAR;
            return (whole, clen);
        }
        // Not cached: fetched whole for its windows, or its own bytes.
        if self.model.window_bytes > 0 && next != NextUse::Unknown {
            let room = self.model.window_bytes.saturating_sub(self.window_used);
            let ahead = s.parts_ahead(p.o, p.idx, pos, pos, self.model.window_bytes);
            let fresh = ahead
                .into_iter()
                .filter(|&(a, b)| !self.windows.contains_key(&(p.o, a, b)));
            let run = (self.fetched, self.delivered);
            let (chosen, pays) = windows::choose(clen, p.b - p.a, fresh, room, run);
            if pays {
                for ((a, b), n) in chosen {
                    *self.windows.entry((p.o, a, b)).or_insert_with(|| {
                        self.window_used += b - a;
                        0
                    }) += n;
                }
                return (whole, clen);
            }
        }
        (1, p.b - p.a)
    }

    /// Whether the cache fetches the chunk of `p` whole and keeps it (`ChunkCache::admits`),
    /// evicting what that takes.
    fn admit(&mut self, s: &Schedule, pos: u64, p: Part, clen: u64, next: NextUse) -> bool {
        let keys: Vec<(u64, u64)> = self.resident.keys().copied().collect();
        let residents: Vec<(NextUse, u64, u64)> = keys
            .iter()
            .map(|&(o, i)| {
                let (bytes, at) = self.resident[&(o, i)];
                (s.next_use(o, i, pos), at, bytes)
            })
            .collect();
        let need = clen + SIDECAR;
        let Some(victims) = choose_victims(&residents, self.used, need, self.model.max_bytes, next)
        else {
            return false;
        };
        if !victims.is_empty() {
            let until = victims
                .iter()
                .filter_map(|&v| match residents[v].0 {
                    NextUse::At(x) => Some(x),
                    _ => None,
                })
                .min()
                .unwrap_or(u64::MAX);
            let cost = clen.saturating_sub(p.b - p.a);
            if next == NextUse::Never || !s.pays_back(p.o, p.idx, pos + 1, until, cost) {
                return false;
            }
        }
        for v in victims {
            if let Some((bytes, _)) = self.resident.remove(&keys[v]) {
                self.used -= bytes;
            }
        }
        true
    }
}

/// GETs a fetch of `len` bytes takes (split at `max_request`; 0: no split).
fn gets(len: u64, max_request: u64) -> u64 {
    match max_request {
        0 => u64::from(len > 0),
        m => len.div_ceil(m),
    }
}

/// The first `limit` reads of all objects in position order: (position, object, offset, len).
fn merged(per: &[&[(u64, u64, u64)]], limit: usize) -> Vec<(u64, u64, u64, u64)> {
    let mut heap: BinaryHeap<std::cmp::Reverse<(u64, usize, usize)>> = per
        .iter()
        .enumerate()
        .filter_map(|(o, v)| v.first().map(|r| std::cmp::Reverse((r.0, o, 0))))
        .collect();
    let mut out = Vec::with_capacity(limit.min(per.iter().map(|v| v.len()).sum()));
    while let Some(std::cmp::Reverse((pos, o, i))) = heap.pop() {
        if out.len() >= limit {
            break;
        }
        let (_, off, len) = per[o][i];
        out.push((pos, o as u64, off, len));
        if let Some(r) = per[o].get(i + 1) {
            heap.push(std::cmp::Reverse((r.0, o, i + 1)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(max_bytes: u64, window_bytes: u64) -> CacheModel {
        CacheModel {
            cached: true,
            chunk_size: 100,
            max_bytes,
            window_bytes,
            max_request: 0,
        }
    }

    #[test]
    fn without_a_cache_every_read_is_its_own_gets() {
        let reads = [(0, 0, 10), (2, 50, 250)];
        let other = [(1, 0, 5)];
        let mut r = Replay::new(CacheModel {
            cached: false,
            max_request: 100,
            ..model(0, 0)
        });
        let e = r.epoch(&[&reads, &other], &[1000, 1000], 3);
        assert_eq!(
            (e.requests, e.bytes, e.delivered, e.reads),
            (5, 265, 265, 3)
        );
    }

    #[test]
    fn a_cache_holding_the_dataset_fetches_each_chunk_once_and_the_next_epoch_nothing() {
        // 3 chunks of 100 bytes, read in a scattered order twice.
        let reads: Vec<(u64, u64, u64)> = (0..30u64).map(|i| (i, (i * 37) % 290, 10)).collect();
        let mut r = Replay::new(model(1000, 0));
        let e = r.epoch(&[&reads], &[300], 30);
        assert_eq!((e.requests, e.bytes), (3, 300));
        let e = r.epoch(&[&reads], &[300], 30);
        assert_eq!((e.requests, e.bytes), (0, 0), "the chunks stayed");
    }

    #[test]
    fn windows_serve_the_near_future_of_a_chunk_not_worth_keeping() {
        // One chunk of room (none for chunk files beyond it): chunk 0 is kept; chunks 1 and 2 are
        // read in turns, so neither pays back evicting the other — chunk 1 fetched whole once for
        // its windows serves its later reads.
        let reads: Vec<(u64, u64, u64)> = (0..12u64)
            .map(|i| match i % 3 {
                0 => (i, 10, 10),
                1 => (i, 100 + 10 * (i / 3), 10),
                _ => (i, 200 + 10 * (i / 3), 10),
            })
            .collect();
        let none = Replay::new(model(164, 0)).epoch(&[&reads], &[300], 12);
        let with = Replay::new(model(164, 200)).epoch(&[&reads], &[300], 12);
        assert!(
            with.requests < none.requests,
            "windows {with:?} vs none {none:?}"
        );
    }

    #[test]
    fn a_large_epoch_is_scaled_from_its_first_reads() {
        let n = REPLAYED as u64 + 1000;
        let reads: Vec<(u64, u64, u64)> = (0..n).map(|i| (i, i * 10, 10)).collect();
        let e = Replay::new(CacheModel {
            cached: false,
            ..model(0, 0)
        })
        .epoch(&[&reads], &[n * 10], n);
        assert_eq!((e.reads, e.replayed), (n, REPLAYED as u64));
        assert_eq!((e.requests, e.bytes), (n, n * 10));
        // The same from the first reads alone, told the epoch's total.
        let e = Replay::new(CacheModel {
            cached: false,
            ..model(0, 0)
        })
        .epoch(&[&reads[..REPLAYED]], &[n * 10], n);
        assert_eq!((e.reads, e.replayed, e.requests), (n, REPLAYED as u64, n));
    }
}
