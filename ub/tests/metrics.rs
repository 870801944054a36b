//! The pool exports its counters through the `metrics` crate.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use ubdirect_ub::{MemoryKind, PoolConfig, UbPool};

#[test]
fn pool_exports_block_states_and_acquire_waits() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let pool = UbPool::new_host(PoolConfig::new("metrics-pool", 4096, 3, MemoryKind::Host))
            .expect("pool");
        let mut a = pool.try_acquire().expect("a");
        let _b = pool.try_acquire().expect("b");
        // SAFETY: no hardware touches the block: the token models an operation, held until the test
        // completes it (`drop(t)` below).
        let t = unsafe { a.begin_op() };
        drop(a);
        let snap = snapshotter.snapshot().into_hashmap();
        let gauge = |state: &str| {
            snap.iter()
                .find(|(k, _)| {
                    let key = k.key();
                    key.name() == "ubdirect_ub_blocks"
                        && key
                            .labels()
                            .any(|l| l.key() == "state" && l.value() == state)
                        && key
                            .labels()
                            .any(|l| l.key() == "pool" && l.value() == "metrics-pool")
                })
                .map(|(_, (_, _, v))| match v {
                    DebugValue::Gauge(g) => g.into_inner(),
                    other => panic!("{other:?}"),
                })
                .unwrap_or_else(|| panic!("no gauge for {state}"))
        };
        assert_eq!(gauge("free"), 1.0);
        assert_eq!(gauge("lent"), 1.0);
        assert_eq!(gauge("orphaned"), 1.0);
        assert_eq!(gauge("in_flight"), 0.0);
        let waits = snap
            .iter()
            .find(|(k, _)| k.key().name() == "ubdirect_ub_acquire_wait_seconds")
            .map(|(_, (_, _, v))| match v {
                DebugValue::Histogram(h) => h.len(),
                _ => 0,
            });
        assert_eq!(waits, Some(2), "two acquires recorded");
        drop(t);
    });
}
