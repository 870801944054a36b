//! Which planned read gets the next free staging block. In plan order, one chunk after another —
//! unless the shards lie on several devices (file systems): then the chunks open at once form a
//! window, and the block goes to a read of the device with the fewest reads in flight.
//!
//! Why: a shuffled plan visits the devices at random, and with a dozen blocks in flight some
//! device has none queued much of the time (four devices, twelve reads at random: each idle about
//! a fifth of the time, a closed queue's figure). On the loop-device rig (H200, 4 devices) twelve
//! O_DIRECT reads in flight in shuffled order read 0.88 × the `dd` ceiling, the same reads taken
//! by the least busy device 1.20 × (docs/decisions.md, "Reads balanced over devices").

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Reads in flight per device, shared by the producer (which counts a read when it gives it a
/// block) and the chunks' tasks (whose [`Busy`] tokens uncount it when the read has landed).
#[derive(Clone)]
pub(crate) struct DeviceLoad(Arc<[AtomicUsize]>);

impl DeviceLoad {
    pub fn new(devices: usize) -> Self {
        Self((0..devices.max(1)).map(|_| AtomicUsize::new(0)).collect())
    }

    /// Reads in flight on each device, into `into` (kept by the caller: no allocation per block).
    pub fn snapshot(&self, into: &mut Vec<usize>) {
        into.clear();
        into.extend(self.0.iter().map(|a| a.load(Ordering::Relaxed)));
    }

    /// Counts a read on `device` until the token is dropped.
    pub fn busy(&self, device: usize) -> Busy {
        let d = device.min(self.0.len() - 1);
        self.0[d].fetch_add(1, Ordering::Relaxed);
        Busy {
            load: self.clone(),
            device: d,
        }
    }
}

/// One read in flight on a device; dropped when the read has landed (or its chunk is gone).
pub(crate) struct Busy {
    load: DeviceLoad,
    device: usize,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.load.0[self.device].fetch_sub(1, Ordering::Relaxed);
    }
}

/// The reads of the open chunks still waiting for a staging block, by device, each chunk's in plan
/// order. Chunks are pushed in chunk order and retired from the front once all of theirs have
/// blocks.
pub(crate) struct Window<C> {
    chunks: VecDeque<Open<C>>,
    devices: usize,
    /// Retired chunks' queues, empty, for the chunks pushed next (no allocation per chunk).
    spare: Vec<Vec<VecDeque<usize>>>,
}

struct Open<C> {
    /// Per device, the chunk's reads (indices in the chunk) without a block yet.
    pending: Vec<VecDeque<usize>>,
    left: usize,
    with: C,
}

impl<C> Window<C> {
    pub fn new(devices: usize) -> Self {
        Self {
            chunks: VecDeque::new(),
            devices: devices.max(1),
            spare: Vec::new(),
        }
    }

    /// Opens a chunk (the next in chunk order) whose reads `reads` (index in the chunk, device)
    /// need blocks; `with` travels with it (its task's channel).
    pub fn push(&mut self, reads: impl IntoIterator<Item = (usize, usize)>, with: C) {
        let mut pending = self.spare.pop().unwrap_or_default();
        pending.resize_with(self.devices, VecDeque::new);
        let mut left = 0;
        for (ri, d) in reads {
            pending[d.min(self.devices - 1)].push_back(ri);
            left += 1;
        }
        self.chunks.push_back(Open {
            pending,
            left,
            with,
        });
    }

    /// Reads still waiting for a block in all open chunks.
    pub fn pending(&self) -> usize {
        self.chunks.iter().map(|c| c.left).sum()
    }

    /// The front chunk, if all of its reads have blocks: retired (the caller counts it issued).
    pub fn retire(&mut self) -> Option<C> {
        match self.chunks.front() {
            Some(c) if c.left == 0 => self.chunks.pop_front().map(|mut c| {
                c.pending.iter_mut().for_each(VecDeque::clear);
                self.spare.push(c.pending);
                c.with
            }),
            _ => None,
        }
    }

    /// The earliest open chunk with a read still waiting (a failed block acquire is its error).
    pub fn first_waiting(&mut self) -> Option<&mut C> {
        self.chunks
            .iter_mut()
            .find(|c| c.left > 0)
            .map(|c| &mut c.with)
    }

    /// The read that gets the next block: of the devices with a read waiting, the one with the
    /// fewest in flight (`load`), ties to the one whose waiting read comes first in the plan; of
    /// its reads, the first in plan order. With one device this is plan order. The flag: the read
    /// goes ahead of an earlier one of the plan still waiting.
    pub fn pick(&mut self, load: &[usize]) -> Option<(&C, usize, usize, bool)> {
        let first = self.chunks.iter().position(|c| c.left > 0).and_then(|ci| {
            let ri = self.chunks[ci]
                .pending
                .iter()
                .filter_map(|q| q.front())
                .min()?;
            Some((ci, *ri))
        });
        let mut best: Option<(usize, usize, usize)> = None; // (load, chunk, device)
        for d in 0..self.devices {
            let Some(ci) = self.chunks.iter().position(|c| !c.pending[d].is_empty()) else {
                continue;
            };
            let l = load.get(d).copied().unwrap_or(0);
            let better = match best {
                None => true,
                Some((bl, bc, bd)) => {
                    (l, ci) < (bl, bc)
                        || ((l, ci) == (bl, bc)
                            && self.chunks[ci].pending[d].front()
                                < self.chunks[ci].pending[bd].front())
                }
            };
            if better {
                best = Some((l, ci, d));
            }
        }
        let (_, ci, d) = best?;
        let c = &mut self.chunks[ci];
        let ri = c.pending[d].pop_front()?;
        c.left -= 1;
        Some((&c.with, ri, d, first != Some((ci, ri))))
    }

    /// Gives up the waiting reads of the chunk whose `with` matches (its task is gone).
    pub fn abandon(&mut self, gone: impl Fn(&C) -> bool) {
        for c in self.chunks.iter_mut().filter(|c| gone(&c.with)) {
            c.pending.iter_mut().for_each(VecDeque::clear);
            c.left = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;

    fn take(w: &mut Window<u32>, load: &[usize]) -> Option<(u32, usize, usize)> {
        w.pick(load).map(|(c, ri, d, _)| (*c, ri, d))
    }

    fn ahead(w: &mut Window<u32>, load: &[usize]) -> bool {
        w.pick(load).is_some_and(|(_, _, _, a)| a)
    }

    #[test]
    fn one_device_is_plan_order_chunk_after_chunk() {
        let mut w = Window::new(1);
        w.push([(0, 0), (2, 0), (3, 0)], 7);
        w.push([(0, 0), (1, 0)], 8);
        let got: Vec<_> = std::iter::from_fn(|| take(&mut w, &[5])).collect();
        assert_eq!(
            got,
            vec![(7, 0, 0), (7, 2, 0), (7, 3, 0), (8, 0, 0), (8, 1, 0)]
        );
        assert_eq!(w.retire(), Some(7));
        assert_eq!(w.retire(), Some(8));
        assert_eq!(w.retire(), None);
    }

    #[test]
    fn the_block_goes_to_the_least_busy_device_then_to_plan_order() {
        let mut w = Window::new(3);
        // Chunk 1: reads 0, 1 on device 0, read 2 on device 1; chunk 2: read 0 on device 2.
        w.push([(0, 0), (1, 0), (2, 1)], 1);
        w.push([(0, 2)], 2);
        // Device 0 and 1 busy, device 2 idle: the later chunk's read goes first.
        assert_eq!(take(&mut w, &[3, 3, 0]), Some((2, 0, 2)));
        // Equal load: the device whose read comes first in the plan (chunk 1, read 0).
        assert_eq!(take(&mut w, &[1, 1, 1]), Some((1, 0, 0)));
        // Chunk 1's read 2 before its read 1: ahead of the plan.
        let mut v = Window::new(2);
        v.push([(0, 0), (1, 1)], 1);
        assert!(!ahead(&mut v, &[0, 0]));
        v.push([(0, 0), (1, 1)], 2);
        assert!(ahead(&mut v, &[0, 1]));
        assert_eq!(take(&mut w, &[2, 1, 1]), Some((1, 2, 1)));
        assert_eq!(w.pending(), 1);
        // Chunk 2 has all of its blocks but retires only after chunk 1 (chunk order).
        assert_eq!(w.retire(), None);
        assert_eq!(take(&mut w, &[9, 0, 0]), Some((1, 1, 0)));
        assert_eq!(w.retire(), Some(1));
        assert_eq!(w.retire(), Some(2));
        assert!(w.chunks.is_empty());
    }

    #[test]
    fn an_abandoned_chunk_waits_for_nothing() {
        let mut w = Window::new(2);
        w.push([(0, 0), (1, 1)], 1);
        w.push([(0, 1)], 2);
        assert_eq!(w.first_waiting().copied(), Some(1));
        w.abandon(|c| *c == 1);
        assert_eq!(w.first_waiting().copied(), Some(2));
        assert_eq!(take(&mut w, &[0, 0]), Some((2, 0, 1)));
        assert_eq!(take(&mut w, &[0, 0]), None);
    }

    #[test]
    fn busy_tokens_count_reads_until_they_land() {
        let load = DeviceLoad::new(2);
        let a = load.busy(1);
        let b = load.busy(1);
        let c = load.busy(7); // out of range: the last device, not a panic
        let mut now = Vec::new();
        load.snapshot(&mut now);
        assert_eq!(now, [0, 3]);
        drop((a, c));
        load.snapshot(&mut now);
        assert_eq!(now, [0, 1]);
        drop(b);
        load.snapshot(&mut now);
        assert_eq!(now, [0, 0]);
    }
}
