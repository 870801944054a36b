//! Every fallback the process takes: counted, logged once per kind, shown in run summaries.
//!
//! A fallback is the system doing something other than what was asked or what is best
//! (buffered reads instead of O_DIRECT, host instead of CUDA, no SQPOLL). The invariant is that the
//! path that actually ran is never a guess: [`record`] counts it, logs the first occurrence of each
//! kind with its detail, and exports a `ubdirect_fallbacks_total{kind}` counter; [`snapshot`]
//! gives the table for summaries.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// One kind of fallback and how often it was taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FallbackEntry {
    /// Stable identifier, e.g. `o_direct_unsupported`.
    pub kind: &'static str,
    /// How many times it was taken.
    pub count: u64,
    /// What the first occurrence said (path, reason).
    pub first_detail: String,
}

static LOG: Mutex<BTreeMap<&'static str, FallbackEntry>> = Mutex::new(BTreeMap::new());

/// Records one fallback. Logs a warning the first time each kind is seen.
pub fn record(kind: &'static str, detail: impl Into<String>) {
    let detail = detail.into();
    metrics::counter!("ubdirect_fallbacks_total", "kind" => kind).increment(1);
    let mut log = LOG.lock().unwrap_or_else(|p| p.into_inner());
    match log.get_mut(kind) {
        Some(e) => e.count += 1,
        None => {
            tracing::warn!(
                fallback = kind,
                "{detail} (logged once; counted in the run summary)"
            );
            log.insert(
                kind,
                FallbackEntry {
                    kind,
                    count: 1,
                    first_detail: detail,
                },
            );
        }
    }
}

/// All fallbacks taken so far in this process, by kind.
pub fn snapshot() -> Vec<FallbackEntry> {
    let log = LOG.lock().unwrap_or_else(|p| p.into_inner());
    log.values().cloned().collect()
}

/// How many times `kind` was taken so far.
pub fn count(kind: &str) -> u64 {
    let log = LOG.lock().unwrap_or_else(|p| p.into_inner());
    log.get(kind).map_or(0, |e| e.count)
}
