//! A ring thread's panic, injected: what its unwinding leaves behind.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use ubdirect_ub::{MemoryKind, PoolConfig, UbPool, fallback};

use crate::{Engine, EngineConfig, IoError};

/// A read that stays in the kernel (a pipe with no data yet, its write end held open) when the
/// ring thread panics: its caller is answered `Closed` at once, not at its deadline; its block
/// stays out of the pool (the kernel may still write it), counted as a fallback; and a read sent
/// afterwards fails at once instead of queueing for a thread that is gone.
#[tokio::test]
async fn a_ring_thread_panic_answers_its_reads_and_keeps_their_blocks_out_of_the_pool() {
    let eng = Engine::new(EngineConfig {
        rings: 1,
        queue_depth: 4,
        ..EngineConfig::default()
    })
    .expect("engine");
    let pool = UbPool::builder(PoolConfig::new("ring-panic", 1 << 16, 2, MemoryKind::Host))
        .register_with(eng.registrar())
        .build()
        .expect("pool");
    let (rd, wr) = std::io::pipe().expect("pipe");
    let f = eng
        .open_fd("test-pipe", OwnedFd::from(rd))
        .expect("open_fd");
    let lease = pool.acquire(Duration::from_secs(5)).await.expect("lease");
    let deadline = Duration::from_secs(60);
    let (e2, f2) = (eng.clone(), f.clone());
    let read = tokio::spawn(async move { e2.read_within(&f2, 0, 4096, lease, 0, deadline).await });
    // The read is in the kernel once its block is in flight.
    let t0 = Instant::now();
    while pool.stats().in_flight == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the read never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = fallback::count("ring_thread_ended_in_flight");
    let panicked = Instant::now();
    eng.panic_read_rings();
    let (r, lease) = tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("the read is answered within 10 s of the panic, not at its 60 s deadline")
        .expect("read task");
    assert!(matches!(r, Err(IoError::Closed)), "{r:?}");
    assert!(panicked.elapsed() < Duration::from_secs(10));
    assert_eq!(fallback::count("ring_thread_ended_in_flight"), before + 1);
    // Its block is not handed out again: the lease dropped, it stays in flight (orphaned).
    drop(lease);
    let s = pool.stats();
    assert_eq!((s.free, s.orphaned), (1, 1), "{s:?}");
    let other = pool
        .acquire(Duration::from_secs(5))
        .await
        .expect("the other block");
    assert!(
        pool.try_acquire().is_none(),
        "the in-flight block was lent again"
    );
    // The ring is gone: a new read fails at once.
    let t1 = Instant::now();
    let (r, _other) = eng.read_within(&f, 0, 4096, other, 0, deadline).await;
    assert!(matches!(r, Err(IoError::Closed)), "{r:?}");
    assert!(t1.elapsed() < Duration::from_secs(5));
    drop(wr);
}
