//! Shared by the net tests that bound what a peer can make this process allocate: a global allocator
//! that counts the largest single allocation of the current thread (a current-thread runtime runs the
//! server's connection tasks, or a client's reader, on the test's thread, so this sees what a frame
//! costs). Include with `mod support;` — it installs the allocator for that test binary.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Counts the largest single allocation made by the current thread since [`largest_reset`].
struct Largest;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = LARGEST.try_with(|c| {
        if size > c.get() {
            c.set(size);
        }
    });
}

// SAFETY: every call is forwarded unchanged to the system allocator; only a thread-local number is
// updated besides (no allocation inside).
unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note(l.size());
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note(l.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        note(new);
        // SAFETY: as above.
        unsafe { System.realloc(p, l, new) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Largest = Largest;

pub fn largest_reset() {
    LARGEST.with(|c| c.set(0));
}

pub fn largest() -> usize {
    LARGEST.with(|c| c.get())
}
