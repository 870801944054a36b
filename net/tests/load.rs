//! 16 clients against one server for a while (5 s by default; `UBDIRECT_LOAD_SECS=600` for a real
//! soak by hand): every read returns the right bytes, memory stays bounded, and file descriptors
//! and pool blocks are all back afterwards. Each client runs whole rounds (connect, 50 reads), so
//! the read count has a floor that does not depend on the machine's speed.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ubdirect_net::{Client, Server, ServerConfig};
use ubdirect_ub::{MemoryKind, PoolConfig, UbPool};

use ubdirect_testkit::{fds, rss_mib};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_clients_bounded_memory_no_leaks() {
    let secs = ubdirect_testkit::soak_secs("UBDIRECT_LOAD_SECS", 5.0);
    let d = ubdirect_testkit::tmp!("net-load");
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
    let stop = Instant::now() + Duration::from_secs_f64(secs);
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
    // Every client ran at least one whole round of 50 reads (a count, not a speed).
    assert!(
        total.0 >= 16 * 50,
        "a client did not finish a round: {total:?}"
    );
    // Bounded: 16 clients × 4 MiB of leases + the server's 16 × 1 MiB pool + slack.
    assert!(
        peak < rss0 + 512.0,
        "RSS grew from {rss0} MiB to {peak} MiB"
    );
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
        "load: {} reads, {} MiB in {secs} s by 16 clients; RSS {rss0:.0} → peak {peak:.0} MiB; fds back to {fds0}",
        total.0,
        total.1 >> 20
    );
}
