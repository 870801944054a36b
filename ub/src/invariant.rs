//! Broken invariants of the state machines (pool slots, pin budgets, the object cache's reads in
//! flight, the page cache's registrar): a panic in debug builds and tests, and in release a counted
//! error ([`broken_transitions`], the metric `ubdirect_ub_broken_transitions_total{area}`, logged)
//! after which the caller leaves its state as safe as it can be. A broken one is a bug in ubdirect,
//! never bad input: input errors are typed errors (since 2026-12-05 for slots, 2026-12-07 for the
//! rest; before, a double release was absorbed by a `saturating_sub`).

use std::sync::atomic::{AtomicU64, Ordering};

static BROKEN: AtomicU64 = AtomicU64::new(0);

/// Broken transitions and invariants seen by this process (release builds; debug builds panic).
pub fn broken_transitions() -> u64 {
    BROKEN.load(Ordering::Relaxed)
}

/// An invariant of `area` that does not hold (`what`, with the state that shows it).
pub fn broken(area: &str, what: &str) {
    debug_assert!(false, "{area}: {what}");
    BROKEN.fetch_add(1, Ordering::Relaxed);
    metrics::counter!("ubdirect_ub_broken_transitions_total", "area" => area.to_string())
        .increment(1);
    tracing::error!(area, "broken invariant: {what}");
}
