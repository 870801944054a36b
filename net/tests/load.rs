//! 16 clients against one server for a while (60 s by default; `UBDIRECT_LOAD_SECS`): memory stays
//! bounded, and file descriptors and pool blocks are all back afterwards.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ubdirect_net::{Client, Server, ServerConfig};
use ubdirect_ub::{MemoryKind, PoolConfig, UbPool};

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn rss_mib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages = s
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse::<u64>().ok())
        .unwrap_or(0);
    (pages * 4096) >> 20
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_clients_bounded_memory_no_leaks() {
    let secs: u64 = std::env::var("UBDIRECT_LOAD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("net-load");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for i in 0..4 {
        std::fs::write(d.join(format!("s{i}.bin")), vec![i as u8; 8 << 20]).unwrap();
    }
    let s = Server::start(ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: b"load-test-token".to_vec(),
        roots: vec![("d".into(), d.clone())],
        max_request: 1 << 20,
        max_inflight: 8,
        blocks: 16,
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    let addr = s.local_addr();
    let fds0 = fds();
    let rss0 = rss_mib();
    let stop = Instant::now() + Duration::from_secs(secs);
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..16u64 {
        tasks.spawn(async move {
            let pool =
                UbPool::new_host(PoolConfig::new("load", 1 << 20, 4, MemoryKind::Host)).unwrap();
            let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ c;
            let (mut reads, mut bytes) = (0u64, 0u64);
            while Instant::now() < stop {
                // Every client reconnects now and then: connections come and go.
                let client = Client::new(vec![addr], "load-test-token", Duration::from_secs(10));
                for _ in 0..50 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let shard = x % 4;
                    let f = client.open("d", &format!("s{shard}.bin")).await.unwrap();
                    let len = 1 + (x >> 20) as usize % (1 << 20);
                    let off = (x >> 8) % (f.size - len as u64);
                    let (r, l) = client
                        .read(
                            &f,
                            off,
                            len,
                            pool.acquire(Duration::from_secs(10)).await.unwrap(),
                            0,
                        )
                        .await;
                    r.unwrap();
                    assert!(
                        l.as_slice().unwrap()[..len]
                            .iter()
                            .all(|&b| b == shard as u8)
                    );
                    reads += 1;
                    bytes += len as u64;
                }
            }
            (reads, bytes)
        });
    }
    let mut peak = rss0;
    let mut total = (0u64, 0u64);
    loop {
        tokio::select! {
            r = tasks.join_next() => match r {
                Some(r) => { let (a, b) = r.unwrap(); total.0 += a; total.1 += b; }
                None => break,
            },
            _ = tokio::time::sleep(Duration::from_millis(500)) => peak = peak.max(rss_mib()),
        }
    }
    assert!(total.0 > 1000, "too few reads: {total:?}");
    // Bounded: 16 clients × 4 MiB of leases + the server's 16 × 1 MiB pool + slack.
    assert!(peak < rss0 + 512, "RSS grew from {rss0} MiB to {peak} MiB");
    let t = Instant::now();
    loop {
        let open = s.stats().open_connections.load(Ordering::Relaxed);
        let p = s.pool_stats();
        if open == 0 && p.free == p.total && fds() <= fds0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "leak: {open} connections open, pool {p:?}, fds {} (were {fds0})",
            fds()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "load: {} reads, {} MiB in {secs} s by 16 clients; RSS {rss0} → peak {peak} MiB; fds back to {fds0}",
        total.0,
        total.1 >> 20
    );
}
