//! A chunk's working lists, kept from one chunk to the next (issue 44: no allocation per batch in a
//! steady epoch). Each chunk being built takes a set from the pipeline's [`Spare`] and gives it
//! back once its batches are made; a set's sample table is filled again for a later chunk once the
//! batches that shared it are gone.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use ubdirect_ub::Lease;

use super::super::SampleEntry;
use super::issue::Busy;

/// Sets kept at most: more than the chunks a pipeline builds at once (its prefetch depth, the reads
/// ahead while balancing), so that a set comes back before it is needed again.
const KEPT: usize = 64;

/// One chunk's working lists (all empty between chunks, their capacity kept).
#[derive(Default)]
pub(super) struct ChunkLists {
    /// Where each read lands in the batch block.
    pub dst: Vec<usize>,
    /// Where each read's bytes start in its memory.
    pub base: Vec<usize>,
    /// Host batches: each read's staging lease.
    pub host: Vec<Option<Arc<Lease>>>,
    /// Host batches: the leases listed for the batches' one list of them.
    pub leases: Vec<Arc<Lease>>,
    /// Per read: its count on its device (balanced issue) until it lands.
    pub busy: Vec<Option<Busy>>,
    /// The sample table this set's last chunk gave its batches.
    table: Option<Arc<[SampleEntry]>>,
}

impl ChunkLists {
    /// A sample table of `n` entries for a chunk's batches, each filled by `fill`, in order: the
    /// last one's again where its batches are gone and it is as long (a steady epoch's chunks are
    /// alike), a new one otherwise.
    pub fn table(&mut self, n: usize, fill: impl FnMut(&mut SampleEntry)) -> Arc<[SampleEntry]> {
        let fresh = || std::iter::repeat_n(EMPTY, n).collect::<Arc<[SampleEntry]>>();
        let mut t = self
            .table
            .take()
            .filter(|t| t.len() == n)
            .unwrap_or_else(fresh);
        if Arc::get_mut(&mut t).is_none() {
            t = fresh(); // a batch still holds it
        }
        // Unique now (kept or new): filled in place.
        if let Some(entries) = Arc::get_mut(&mut t) {
            entries.iter_mut().for_each(fill);
        }
        self.table = Some(t.clone());
        t
    }

    /// Emptied for the next chunk (capacity kept).
    fn clear(&mut self) {
        self.dst.clear();
        self.base.clear();
        self.host.clear();
        self.leases.clear();
        self.busy.clear();
    }
}

const EMPTY: SampleEntry = SampleEntry {
    id: 0,
    position: 0,
    shard: 0,
    shard_offset: 0,
    len: 0,
    segment: 0,
    offset: 0,
};

/// The pipeline's spare sets, oldest first (the oldest's table is the likeliest to be free).
#[derive(Default)]
pub(crate) struct Spare(Mutex<VecDeque<ChunkLists>>);

impl Spare {
    /// A set for a chunk: a spare one, or a new one.
    pub(super) fn take(&self) -> ChunkLists {
        let mut q = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        q.pop_front().unwrap_or_default()
    }

    /// `lists` back, emptied, for a later chunk.
    pub(super) fn give(&self, mut lists: ChunkLists) {
        lists.clear();
        let mut q = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if q.len() < KEPT {
            q.push_back(lists);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;

    /// Ids 0, 10, 20, … in fill order.
    fn tens() -> impl FnMut(&mut SampleEntry) {
        let mut i = 0;
        move |e| {
            e.id = i * 10;
            i += 1;
        }
    }

    #[test]
    fn a_table_is_filled_again_only_when_its_batches_are_gone() {
        let mut l = ChunkLists::default();
        let a = l.table(3, tens());
        assert_eq!(a.iter().map(|e| e.id).collect::<Vec<_>>(), [0, 10, 20]);
        // A batch still holds `a`: the next chunk gets a new table, `a` is unchanged.
        let b = l.table(3, |e| e.id = 3);
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(a[2].id, 20);
        assert_eq!(b[2].id, 3);
        let p = Arc::as_ptr(&b);
        drop(b);
        // `b`'s batches are gone: its memory is filled again, with every entry rewritten.
        let c = l.table(3, tens());
        assert_eq!(Arc::as_ptr(&c), p);
        assert_eq!(c.iter().map(|e| e.id).collect::<Vec<_>>(), [0, 10, 20]);
        drop(c);
        // Another length: a new table.
        let d = l.table(2, tens());
        assert_eq!(d.len(), 2);
    }

    #[test]
    fn spare_sets_come_back_empty_oldest_first() {
        let s = Spare::default();
        let mut l = s.take();
        l.base.extend([1, 2, 3]);
        let cap = l.base.capacity();
        s.give(l);
        let l = s.take();
        assert!(l.base.is_empty());
        assert_eq!(l.base.capacity(), cap);
        assert!(s.take().base.capacity() == 0);
    }
}
