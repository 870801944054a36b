//! A pool's slot state machine: `Free → Lent`, then `Lent ⇄ InFlight` as operations begin and
//! complete, back to `Free` when the lease is dropped and nothing is in flight — or `Orphaned` when
//! it is dropped with operations in flight, `Free` at the last completion.
//!
//! Every transition checks what it assumes. A broken one — a completion with nothing in flight (a
//! double completion), a lease dropped twice or by an older generation, an operation begun on a slot
//! not lent, a busy slot released, a slot freed twice — is a panic in debug builds and tests, and in
//! release a counted error ([`crate::broken_transitions`], the metric
//! `ubdirect_ub_broken_transitions_total`, logged) that leaves the slot as safe as it can be: never
//! free while an operation may still write it (until 2026-12-05 a double completion was absorbed by
//! a `saturating_sub`, and a release trusted its caller).

use super::SlotState;

/// A transition whose precondition does not hold: a bug in a caller of the pool.
fn broken(pool: &str, slot: u32, what: &str) {
    crate::invariant::broken("pool slots", &format!("pool {pool:?}, slot {slot}: {what}"));
}

#[derive(Debug, Clone, Copy)]
pub(super) struct SlotEntry {
    pub(super) generation: u64,
    pub(super) leased: bool,
    pub(super) ops: u32,
}

impl SlotEntry {
    pub(super) fn state(&self) -> SlotState {
        match (self.leased, self.ops) {
            (false, 0) => SlotState::Free,
            (true, 0) => SlotState::Lent,
            (true, _) => SlotState::InFlight,
            (false, _) => SlotState::Orphaned,
        }
    }
}

#[derive(Debug)]
pub(super) struct Slots {
    pool: String,
    pub(super) entries: Vec<SlotEntry>,
    pub(super) free: Vec<u32>,
    /// Whether each slot is in `free` (a slot freed twice is caught, not listed twice).
    listed: Vec<bool>,
    /// Slots per state (Free, Lent, InFlight, Orphaned), kept by `change`: no scan per transition.
    pub(super) count: [usize; 4],
}

fn state_index(s: SlotState) -> usize {
    match s {
        SlotState::Free => 0,
        SlotState::Lent => 1,
        SlotState::InFlight => 2,
        SlotState::Orphaned => 3,
    }
}

impl Slots {
    /// `n` free slots of pool `pool`, handed out low slots first.
    pub(super) fn new(pool: &str, n: usize) -> Self {
        Slots {
            pool: pool.to_string(),
            entries: vec![
                SlotEntry {
                    generation: 0,
                    leased: false,
                    ops: 0,
                };
                n
            ],
            // Popped from the back: hand out low slots first.
            free: (0..n as u32).rev().collect(),
            listed: vec![true; n],
            count: [n, 0, 0, 0],
        }
    }

    /// Applies `f` to a slot's entry and keeps the per-state counts in step.
    fn change<R>(&mut self, slot: u32, f: impl FnOnce(&mut SlotEntry) -> R) -> R {
        let e = &mut self.entries[slot as usize];
        let before = state_index(e.state());
        let r = f(e);
        let after = state_index(e.state());
        self.count[before] -= 1;
        self.count[after] += 1;
        r
    }

    /// `Free → Lent` for a free slot: (slot, generation); `None` when none is free.
    pub(super) fn lend(&mut self) -> Option<(u32, u64)> {
        let slot = self.free.pop()?;
        self.listed[slot as usize] = false;
        if self.entries[slot as usize].state() != SlotState::Free {
            broken(&self.pool, slot, "a slot on the free list is not free");
        }
        let generation = self.change(slot, |e| {
            e.leased = true;
            e.generation
        });
        Some((slot, generation))
    }

    /// An operation begins on a lent slot (`Lent | InFlight → InFlight`).
    pub(super) fn begin_op(&mut self, slot: u32) {
        if !self.entries[slot as usize].leased {
            broken(
                &self.pool,
                slot,
                "an operation begun on a slot that is not lent",
            );
        }
        self.change(slot, |e| e.ops += 1);
    }

    /// An operation completes; whether the slot is now idle (to be released). A completion with
    /// nothing in flight is broken and changes nothing.
    pub(super) fn complete_op(&mut self, slot: u32) -> bool {
        if self.entries[slot as usize].ops == 0 {
            broken(
                &self.pool,
                slot,
                "a completion with nothing in flight (completed twice?)",
            );
            return false;
        }
        self.change(slot, |e| {
            e.ops -= 1;
            e.ops == 0 && !e.leased
        })
    }

    /// The lease of `generation` is dropped; whether the slot is now idle. A drop of a slot not lent,
    /// or by another generation's lease, is broken and changes nothing.
    pub(super) fn drop_lease(&mut self, slot: u32, generation: u64) -> bool {
        let e = self.entries[slot as usize];
        if !e.leased || e.generation != generation {
            broken(
                &self.pool,
                slot,
                "a lease dropped twice, or by another generation",
            );
            return false;
        }
        self.change(slot, |e| {
            e.leased = false;
            e.ops == 0
        })
    }

    /// An idle slot goes back on the free list under a new generation (handles of the old one are
    /// refused from now on); `false` (and broken) when it is busy or already free.
    pub(super) fn release(&mut self, slot: u32) -> bool {
        let e = self.entries[slot as usize];
        if e.leased || e.ops != 0 || self.listed[slot as usize] {
            broken(
                &self.pool,
                slot,
                "a busy slot released, or a free one released again",
            );
            return false;
        }
        self.entries[slot as usize].generation += 1;
        self.listed[slot as usize] = true;
        self.free.push(slot);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_goes_free_lent_in_flight_orphaned_free() {
        let mut s = Slots::new("t", 2);
        let (slot, g) = s.lend().unwrap_or_else(|| panic!("a free slot"));
        assert_eq!((slot, g, s.count), (0, 0, [1, 1, 0, 0]));
        s.begin_op(slot);
        s.begin_op(slot);
        assert_eq!(s.entries[0].state(), SlotState::InFlight);
        assert!(
            !s.drop_lease(slot, g),
            "dropped with operations in flight: orphaned"
        );
        assert_eq!(s.entries[0].state(), SlotState::Orphaned);
        assert!(!s.complete_op(slot));
        assert!(s.complete_op(slot), "the last completion frees it");
        assert!(s.release(slot));
        assert_eq!((s.count, s.entries[0].generation), ([2, 0, 0, 0], 1));
        assert_eq!(s.lend(), Some((0, 1)));
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "completed twice")]
    fn a_double_completion_is_a_panic_in_debug() {
        let mut s = Slots::new("t", 1);
        let (slot, _) = s.lend().unwrap_or_else(|| panic!("a free slot"));
        s.begin_op(slot);
        s.complete_op(slot);
        s.complete_op(slot);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "released again")]
    fn a_slot_released_twice_is_a_panic_in_debug() {
        let mut s = Slots::new("t", 1);
        let (slot, g) = s.lend().unwrap_or_else(|| panic!("a free slot"));
        assert!(s.drop_lease(slot, g));
        s.release(slot);
        s.release(slot);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "another generation")]
    fn a_lease_of_an_older_generation_is_a_panic_in_debug() {
        let mut s = Slots::new("t", 1);
        let (slot, g) = s.lend().unwrap_or_else(|| panic!("a free slot"));
        assert!(s.drop_lease(slot, g));
        s.release(slot);
        let _ = s.lend();
        s.drop_lease(slot, g);
    }
}
