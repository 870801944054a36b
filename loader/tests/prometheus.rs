//! `[metrics] listen` serves Prometheus metrics (its own test binary: one recorder per process).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::io::{Read, Write};
use std::path::PathBuf;

use ubdirect_loader::{Loader, RunConfig};

#[test]
fn prometheus_endpoint_serves_pool_and_loader_metrics() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("prom");
    let _ = std::fs::remove_dir_all(&dir);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cfg = RunConfig::default();
    cfg.dataset.dir = Some(dir);
    cfg.dataset.generate = true;
    cfg.dataset.generate_samples = 512;
    cfg.device.select = ubdirect_ub::DeviceSelection::Host;
    cfg.metrics.listen = Some(format!("127.0.0.1:{port}"));
    // A fallback taken before the endpoint exists (issue 45: `no_gpu` was in the summary, not in
    // /metrics) is counted there too.
    ubdirect_ub::fallback::record("before_the_recorder", "a test's fallback");
    let loader = Loader::from_config(&cfg).unwrap();
    let n = loader
        .epoch(0)
        .unwrap()
        .map(|b| b.unwrap().len())
        .sum::<usize>();
    assert_eq!(n, 512);
    // The first batch cannot have been ready when it was asked for (its reads start with the epoch).
    assert!(
        loader
            .stats()
            .wait_us
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    let mut body = String::new();
    for _ in 0..50 {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .unwrap();
            s.read_to_string(&mut body).unwrap();
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for m in [
        "ubdirect_ub_blocks",
        "ubdirect_loader_samples_total 512",
        "ubdirect_ub_registrations_total",
        "ubdirect_ub_acquire_wait_seconds",
        "ubdirect_fallbacks_total{kind=\"before_the_recorder\"} 1",
        // The data stall a training loop watches (issue 45): time waited for batches not ready.
        "ubdirect_loader_data_wait_microseconds_total",
        "ubdirect_loader_last_batch_wait_seconds",
    ] {
        assert!(body.contains(m), "{m} missing from:\n{body}");
    }
    // A second endpoint in the same process is refused, not silently ignored.
    let e = Loader::from_config(&cfg).unwrap_err();
    assert!(e.to_string().contains("metrics"), "{e}");
}
