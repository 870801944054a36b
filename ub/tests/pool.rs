//! Pool behaviour: validation, backpressure, deadlines, completion-gated recycling, stale handles.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::time::Duration;

use ubdirect_ub::{MemoryKind, PoolConfig, SlotState, UbError, UbPool};

fn host_pool(blocks: usize) -> UbPool {
    UbPool::new_host(PoolConfig::new("test", 64 * 1024, blocks, MemoryKind::Host))
        .expect("host pool")
}

#[test]
fn zero_blocks_is_refused() {
    let e = UbPool::new_host(PoolConfig::new("zero", 4096, 0, MemoryKind::Host)).unwrap_err();
    assert!(matches!(e, UbError::InvalidConfig { .. }), "{e}");
    assert!(e.to_string().contains("block_count is 0"), "{e}");
}

#[test]
fn block_size_must_be_a_multiple_of_4096() {
    for bs in [0usize, 1000, 4097, 6144] {
        let e = UbPool::new_host(PoolConfig::new("odd", bs, 4, MemoryKind::Host)).unwrap_err();
        assert!(matches!(e, UbError::InvalidConfig { .. }), "{bs}: {e}");
        assert!(e.to_string().contains("multiple of 4096"), "{e}");
    }
}

#[test]
fn overflowing_size_is_refused() {
    let e = UbPool::new_host(PoolConfig::new(
        "huge",
        1 << 30,
        usize::MAX / 4096,
        MemoryKind::Host,
    ))
    .unwrap_err();
    assert!(matches!(e, UbError::InvalidConfig { .. }), "{e}");
}

#[test]
fn pinned_and_device_need_cuda() {
    for kind in [MemoryKind::Pinned, MemoryKind::Device] {
        let e = UbPool::new_host(PoolConfig::new("k", 4096, 1, kind)).unwrap_err();
        assert!(matches!(e, UbError::KindUnsupported { .. }), "{e}");
    }
}

#[test]
fn blocks_are_page_aligned_distinct_and_writable() {
    let pool = host_pool(4);
    let mut leases: Vec<_> = (0..4)
        .map(|_| pool.try_acquire().expect("free block"))
        .collect();
    let mut ptrs: Vec<usize> = leases
        .iter()
        .map(|l| l.host_ptr().expect("host") as usize)
        .collect();
    for (i, l) in leases.iter_mut().enumerate() {
        assert_eq!(l.host_ptr().expect("host") as usize % 4096, 0);
        l.as_mut_slice().expect("idle").fill(i as u8 + 1);
    }
    for (i, l) in leases.iter().enumerate() {
        assert!(
            l.as_slice()
                .expect("idle")
                .iter()
                .all(|&b| b == i as u8 + 1)
        );
    }
    ptrs.sort_unstable();
    ptrs.dedup();
    assert_eq!(ptrs.len(), 4);
    assert!(pool.try_acquire().is_none(), "pool of 4 lent 5 blocks");
}

#[test]
fn lease_dropped_mid_flight_orphans_the_slot_until_completion() {
    let pool = host_pool(1);
    let mut lease = pool.try_acquire().expect("free");
    let handle = lease.handle();
    assert_eq!(lease.state(), SlotState::Lent);
    // SAFETY: no hardware touches the block: the token models an operation, held until the test
    // completes it (`drop(token)` below).
    let token = unsafe { lease.begin_op() };
    assert_eq!(lease.state(), SlotState::InFlight);
    assert!(
        matches!(lease.as_slice(), Err(UbError::Busy { .. })),
        "bytes readable while in flight"
    );
    drop(lease);
    assert_eq!(pool.slot_state(handle.slot), Some(SlotState::Orphaned));
    assert!(
        pool.try_acquire().is_none(),
        "orphaned slot handed out again"
    );
    assert_eq!(pool.stats().orphaned, 1);
    drop(token);
    assert_eq!(pool.slot_state(handle.slot), Some(SlotState::Free));
    let again = pool.try_acquire().expect("free after completion");
    assert_eq!(again.slot(), handle.slot);
    assert_eq!(again.handle().generation, handle.generation + 1);
}

#[test]
fn completion_before_drop_returns_the_slot_on_drop() {
    let pool = host_pool(1);
    let mut lease = pool.try_acquire().expect("free");
    // SAFETY: no hardware touches the block: the tokens model two operations, each held until the
    // test completes it (the drops below).
    let t1 = unsafe { lease.begin_op() };
    // SAFETY: as for `t1`.
    let t2 = unsafe { lease.begin_op() };
    drop(t1);
    assert_eq!(
        lease.state(),
        SlotState::InFlight,
        "one of two ops still in flight"
    );
    drop(t2);
    assert_eq!(lease.state(), SlotState::Lent);
    drop(lease);
    assert_eq!(pool.stats().free, 1);
}

#[test]
fn stale_and_foreign_handles_are_refused() {
    let pool = host_pool(1);
    let other = host_pool(1);
    let lease = pool.try_acquire().expect("free");
    let h = lease.handle();
    assert!(pool.resolve(h).is_ok());
    assert!(matches!(other.resolve(h), Err(UbError::StaleHandle { .. })));
    drop(lease);
    let e = pool.resolve(h).unwrap_err();
    assert!(matches!(e, UbError::StaleHandle { .. }), "{e}");
    let _new = pool.try_acquire().expect("free");
    let e = pool.resolve(h).unwrap_err();
    assert!(
        matches!(e, UbError::StaleHandle { current, .. } if current == h.generation + 1),
        "{e}"
    );
}

#[tokio::test]
async fn acquire_waits_for_a_block_and_wakes_when_one_returns() {
    let pool = host_pool(1);
    let held = pool.try_acquire().expect("free");
    let mut waiter = Box::pin(pool.acquire(Duration::from_secs(10)));
    // Polled once with the pool empty: it does not return, and it is queued for the next block
    // (no sleep needed to be sure it is waiting before the block comes back).
    let first = std::future::poll_fn(|cx| std::task::Poll::Ready(waiter.as_mut().poll(cx))).await;
    assert!(
        first.is_pending(),
        "acquire returned while the pool was empty"
    );
    drop(held);
    let lease = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("woken")
        .expect("lease");
    assert_eq!(lease.slot(), 0);
    let st = pool.stats();
    assert!(st.acquire_wait > Duration::ZERO && st.acquire_wait == st.acquire_wait_max);
}

#[tokio::test]
async fn acquire_times_out_with_a_typed_error() {
    let pool = host_pool(2);
    let _a = pool.try_acquire().expect("free");
    let mut b = pool.try_acquire().expect("free");
    // SAFETY: no hardware touches the block: the token models an operation that never completes,
    // held to the end of the test.
    let _t = unsafe { b.begin_op() };
    drop(b);
    let e = pool.acquire(Duration::from_millis(30)).await.unwrap_err();
    match e {
        UbError::AcquireTimeout {
            lent,
            orphaned,
            total,
            waited,
            ..
        } => {
            assert_eq!((lent, orphaned, total), (1, 1, 2));
            assert!(waited >= Duration::from_millis(30));
        }
        other => panic!("expected AcquireTimeout, got {other}"),
    }
}

#[tokio::test]
async fn closed_pool_refuses_waiters() {
    let pool = host_pool(1);
    let _a = pool.try_acquire().expect("free");
    pool.close();
    assert!(matches!(
        pool.acquire(Duration::from_secs(1)).await,
        Err(UbError::Closed { .. })
    ));
}

#[test]
fn slot_never_handed_out_twice_under_concurrency() {
    let pool = host_pool(8);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                for i in 0..2000u32 {
                    if let Some(mut l) = pool.try_acquire() {
                        let tag = (t * 100_000 + i) as u64;
                        l.as_mut_slice().expect("idle")[..8].copy_from_slice(&tag.to_le_bytes());
                        // SAFETY: no hardware touches the block: the token models an operation,
                        // held until the test completes it (`drop(tok)` below).
                        let tok = unsafe { l.begin_op() };
                        std::thread::yield_now();
                        drop(tok);
                        assert_eq!(
                            l.as_slice().expect("idle")[..8],
                            tag.to_le_bytes(),
                            "slot shared"
                        );
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    let s = pool.stats();
    assert_eq!((s.free, s.lent, s.in_flight, s.orphaned), (8, 0, 0, 0));
}

#[test]
fn registrations_happen_once_at_creation() {
    let pool = host_pool(4);
    assert_eq!(
        pool.stats().registrations,
        0,
        "a plain host pool has no consumers"
    );
    for _ in 0..100 {
        let mut l = pool.try_acquire().expect("free");
        // SAFETY: no hardware touches the block: the token models an operation that completes at
        // once.
        drop(unsafe { l.begin_op() });
    }
    assert_eq!(pool.stats().registrations, 0);
}

/// Runs in a child process without CAP_IPC_LOCK (as `nobody`), where mlock is bound by RLIMIT_MEMLOCK.
#[test]
fn memlock_limit_is_a_clear_error() {
    if ubdirect_testkit::is_nobody_child() || !is_root() {
        // Lowering a soft limit is always allowed; 8 MiB is the usual default, 256 MiB far above it.
        ubdirect_testkit::set_memlock_soft_limit(8 << 20);
        let e =
            UbPool::new_host(PoolConfig::new("big", 1 << 20, 256, MemoryKind::Host)).unwrap_err();
        assert!(matches!(e, UbError::MemlockLimit { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("RLIMIT_MEMLOCK")
                && msg.contains("ulimit -l")
                && msg.contains("pool.staging_blocks"),
            "{msg}"
        );
        // The same pool unlocked is made, used and unmapped under the limit: pageable memory.
        let pool = UbPool::new_host(PoolConfig {
            lock: false,
            ..PoolConfig::new("big", 1 << 20, 256, MemoryKind::Host)
        })
        .expect("an unlocked pool is not bound by RLIMIT_MEMLOCK");
        let mut l = pool.try_acquire().expect("free");
        l.as_mut_slice().expect("host memory")[..4].copy_from_slice(b"ok!!");
        assert_eq!(&l.as_slice().expect("host memory")[..4], b"ok!!");
        assert!(!pool.config().lock);
        return;
    }
    let d = std::env::temp_dir().join("ubdirect-memlock-limit-test");
    std::fs::create_dir_all(&d).expect("scratch dir");
    ubdirect_testkit::rerun_as_nobody("memlock_limit_is_a_clear_error", &d, &[]);
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn held_back_blocks_shrink_the_set_in_use_until_the_guard_drops() {
    let pool = host_pool(4);
    let busy = pool.try_acquire().expect("free");
    // Three are free: asking for five holds back only those three, and never waits.
    let held = pool.hold_back(5);
    assert_eq!(held.blocks(), 3);
    assert!(
        pool.try_acquire().is_none(),
        "every free block is held back"
    );
    drop(held);
    drop(busy);
    // One block in use at a time, cycled: with two held back, the same two slots come back
    // (the free list is a stack), never the others.
    let held = pool.hold_back(2);
    assert_eq!(held.blocks(), 2);
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..8 {
        let a = pool.try_acquire().expect("free");
        let b = pool.try_acquire().expect("free");
        assert!(
            pool.try_acquire().is_none(),
            "only two of four blocks in use"
        );
        seen.insert(a.slot());
        seen.insert(b.slot());
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(
        pool.stats().free,
        4,
        "held-back blocks stay free in the slot table"
    );
    drop(held);
    let all: Vec<_> = (0..4).map(|_| pool.try_acquire().expect("free")).collect();
    assert_eq!(all.len(), 4);
}
