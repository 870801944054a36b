//! An object-store run's cost, predicted (`cache/estimate.rs` replays the cache's decisions over
//! the plan) or realised, in requests and bytes, and from them time and money.

use serde::Serialize;

/// The cache being modelled.
#[derive(Debug, Clone, Copy)]
pub struct CacheModel {
    /// Whether there is a cache at all (`false`: every read its own GETs).
    pub cached: bool,
    /// `cache.chunk_size`.
    pub chunk_size: u64,
    /// Bytes of chunk files (`cache.max_bytes` less the windows').
    pub max_bytes: u64,
    /// Bytes of windows (`cache.window_fraction` of `cache.max_bytes`); 0: no windows.
    pub window_bytes: u64,
    /// `object_store.max_request`: a fetch larger than this is several GETs.
    pub max_request: u64,
}

/// The run's object-store cost: predicted before each epoch, beside what it cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct CostReport {
    /// The epochs replayed, summed.
    pub predicted: Estimate,
    /// Plans replayed (an epoch's, or each later segment's).
    pub epochs: u64,
    /// Epochs not replayed in time for the report.
    pub pending: u64,
    /// Requests issued since the first epoch began.
    pub realised_requests: u64,
    /// Bytes from the store since the first epoch began.
    pub realised_bytes: u64,
    /// The model's latency of a request (`object_store.estimate_request_ms`).
    pub request_ms: f64,
    /// The model's bandwidth in GB/s (`object_store.estimate_gbps`).
    pub gbps: f64,
    /// GETs in flight at once in the model: the reads the staging pool holds, at most
    /// `object_store.max_in_flight`.
    pub in_flight: usize,
    /// Seconds of store time predicted at those.
    pub predicted_s: f64,
    /// Dollars predicted at `object_store.price_per_1k_requests` and `price_per_gb`.
    pub predicted_usd: f64,
    /// Dollars realised at the same prices.
    pub realised_usd: f64,
}

/// An epoch's (or a run's) predicted cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Estimate {
    /// GET requests.
    pub requests: u64,
    /// Bytes from the store.
    pub bytes: u64,
    /// Bytes the planned reads ask for (merged reads: at least the samples' bytes).
    pub delivered: u64,
    /// Planned reads.
    pub reads: u64,
    /// Of them, replayed (the rest scaled from them).
    pub replayed: u64,
}

impl Estimate {
    /// Seconds at `request_s` per request with `in_flight` at once, and `bytes_per_s`: the larger
    /// of the two (requests overlap the transfer).
    pub fn seconds(&self, request_s: f64, in_flight: usize, bytes_per_s: f64) -> f64 {
        let waits = self.requests as f64 * request_s / in_flight.max(1) as f64;
        let transfer = if bytes_per_s > 0.0 {
            self.bytes as f64 / bytes_per_s
        } else {
            0.0
        };
        waits.max(transfer)
    }

    /// Dollars at `per_1k_requests` and `per_gb` (10⁹ bytes).
    pub fn usd(&self, per_1k_requests: f64, per_gb: f64) -> f64 {
        self.requests as f64 / 1e3 * per_1k_requests + self.bytes as f64 / 1e9 * per_gb
    }

    /// The sum of two.
    pub fn add(&mut self, o: &Estimate) {
        self.requests += o.requests;
        self.bytes += o.bytes;
        self.delivered += o.delivered;
        self.reads += o.reads;
        self.replayed += o.replayed;
    }

    /// Scaled from the reads replayed to all `total`.
    pub(crate) fn scaled(mut self, total: u64) -> Self {
        if self.replayed > 0 && self.replayed < total {
            let f = total as f64 / self.replayed as f64;
            self.requests = (self.requests as f64 * f).round() as u64;
            self.bytes = (self.bytes as f64 * f).round() as u64;
            self.delivered = (self.delivered as f64 * f).round() as u64;
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_and_price_follow_requests_and_bytes() {
        let e = Estimate {
            requests: 1000,
            bytes: 2_000_000_000,
            ..Estimate::default()
        };
        // 1000 × 20 ms over 4 in flight = 5 s, above 2 GB at 1 GB/s.
        assert!((e.seconds(0.02, 4, 1e9) - 5.0).abs() < 1e-9);
        assert!((e.seconds(0.001, 4, 1e9) - 2.0).abs() < 1e-9);
        assert!((e.usd(0.4, 0.09) - (0.4 + 0.18)).abs() < 1e-9);
    }
}
