//! Allocations in a steady epoch, counted by a global allocator (alone in its test binary: the
//! count is the process's). Issue 44 asks for none per batch.
//!
//! History: a host epoch of raw records made 7.6 allocations and 29 KB per batch of 64 on
//! 2026-12-05; 3.7 and 28 KB on 2026-12-07 (a chunk's read leases shared by its batches, the window
//! shuffle's buffer reused, a chunk's batch plans parts of one sample list); 1.1-1.3 and ~10 KB on
//! 2026-12-07, after a segment's chunks were planned into one list each of reads, samples and
//! pieces (`planner/reads.rs`) and a chunk's working lists and sample table were kept from one chunk
//! to the next (`pipeline/chunk/lists.rs`).
//!
//! What is left is per chunk and per read, not per batch: the chunk's task and channels, one task
//! and one boxed read future per read, the chunk's list of batches; and per planned segment its
//! lists. The test shows it so: the same samples in batches of 16 (four times the batches, the same
//! chunks and reads) cost no more allocations than in batches of 64; and it bounds what a chunk
//! costs, so a growth per batch or per chunk (a leak, a copy of the plan) fails it.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(l.size() as u64, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on as it is.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` was allocated by `System` with `l` (every allocation goes through `alloc`).
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(n as u64, Ordering::Relaxed);
        // SAFETY: as for `dealloc`; the caller's contract for `realloc` is passed on.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations and bytes allocated by a whole steady epoch (epoch 1, after epoch 0: the same
/// segments, chunks and reads whatever the batch size), with `batch_size` samples of 1 KiB per
/// batch and chunks of at most `max_chunk_batches` batches; and the batches it made.
fn steady(name: &str, batch_size: usize, max_chunk_batches: usize) -> (u64, u64, u64) {
    let d = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    let toml = format!(
        "[dataset]\nformat = \"raw\"\ndir = \"{}\"\ngenerate = true\ngenerate_samples = {SAMPLES}\ngenerate_shards = 4\ndtype = \"u8\"\nrecord_len = 1024\n[loader]\nbatch_size = {batch_size}\nmax_chunk_batches = {max_chunk_batches}\n[device]\nselect = \"host\"\n",
        d.display()
    );
    let cfg = ubdirect_loader::RunConfig::from_toml(&toml, "t").unwrap();
    let l = ubdirect_loader::Loader::from_config(&cfg).unwrap();
    for b in l.epoch(0).unwrap() {
        b.unwrap();
    }
    let (a0, b0) = (
        ALLOCS.load(Ordering::Relaxed),
        BYTES.load(Ordering::Relaxed),
    );
    let mut batches = 0;
    for b in l.epoch(1).unwrap() {
        drop(b.unwrap());
        batches += 1;
    }
    let got = (
        ALLOCS.load(Ordering::Relaxed) - a0,
        BYTES.load(Ordering::Relaxed) - b0,
        batches,
    );
    drop(l);
    let _ = std::fs::remove_dir_all(&d);
    got
}

const SAMPLES: u64 = 65_536;

#[test]
fn a_steady_epoch_allocates_per_chunk_not_per_batch() {
    // 65,536 samples of 1 KiB either way, in 64 chunks of 1 MiB (1,024 samples).
    let (a64, b64, n64) = steady("steady-alloc-64", 64, 16);
    let (a16, b16, n16) = steady("steady-alloc-16", 16, 64);
    assert_eq!((n64, n16), (SAMPLES / 64, SAMPLES / 16));
    let chunks = (SAMPLES / 1024) as f64;
    eprintln!(
        "steady epoch, {SAMPLES} samples of 1 KiB in {chunks} chunks of 1 MiB: batches of 64: {a64} allocations ({:.2} per batch, {:.1} per chunk), {b64} bytes; batches of 16: {a16} allocations ({:.2} per batch, {:.1} per chunk), {b16} bytes",
        a64 as f64 / n64 as f64,
        a64 as f64 / chunks,
        a16 as f64 / n16 as f64,
        a16 as f64 / chunks
    );
    // One allocation per batch would add 3,072 here.
    assert!(
        a16 <= a64 + a64 / 10 + 32,
        "four times the batches cost more allocations: {a16} against {a64}"
    );
    for (a, b) in [(a64, b64), (a16, b16)] {
        assert!(
            a as f64 / chunks <= 32.0 && b as f64 / chunks <= 1024.0 * 1024.0,
            "{a} allocations, {b} bytes for {chunks} chunks"
        );
    }
}
