//! Adversarial load on loopback: legitimate clients read while, at the same time, other peers hold
//! idle connections, send half frames, pipeline reads without reading the replies, and spam opens.
//! The server's connections, staging blocks, descriptors and memory must be back to their baseline
//! after; `ubdirect-bench` reports what the legitimate clients kept (attacked ÷ control).
//!
//! Attackers run on their own runtime (one thread) and come from other loopback addresses
//! (127.0.0.2 … .5), as other machines would.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use ubdirect_net::proto::{self, Header, Kind, Msg};
use ubdirect_net::{Server, ServerConfig};

use super::{
    BLOCK, Legit, Outcome, Threads, connect_from, hello, measure, non_reader, runtime, until_closed,
};
use crate::{fds, rss_mib};

const TOKEN: &str = "adversarial-token-rw";
const RO: &str = "adversarial-token-ro";
const FILES: usize = 48;

/// Attackers, each a loop until `stop`: what a peer without manners does to a server.
fn attack(addr: SocketAddr, stop: Arc<AtomicBool>, rt: &tokio::runtime::Runtime) {
    // `UBDIRECT_ADVERSARIAL_ONLY=idle,half,nonread,spam`: some kinds only (to see what each costs).
    let only = std::env::var("UBDIRECT_ADVERSARIAL_ONLY").unwrap_or_default();
    let on = |k: &str| only.is_empty() || only.split(',').any(|o| o == k);
    // Idle: hello'd connections that stay quiet (up to the per-peer cap; the rest are refused at
    // once), and unauthenticated ones dropped at the hello deadline, reconnecting.
    for _ in 0..if on("idle") { 24 } else { 0 } {
        let stop = stop.clone();
        rt.spawn(async move {
            let mut held = None;
            while !stop.load(Ordering::Relaxed) {
                if held.is_none() {
                    held = hello(addr, "127.0.0.2", RO).await.ok();
                }
                if held.is_none() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                } else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        });
    }
    for _ in 0..if on("idle") { 8 } else { 0 } {
        let stop = stop.clone();
        rt.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(mut s) = connect_from(addr, "127.0.0.2").await {
                    until_closed(&mut s).await;
                }
                // Refused at once (the peer is at its cap): again a little later.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
    }
    // Half-open: half a header after hello, or half a hello; held until the server drops it.
    for k in 0..if on("half") { 8 } else { 0 } {
        let stop = stop.clone();
        rt.spawn(async move {
            let h = Header {
                kind: Kind::SmcWrite,
                id: 1,
                len: 1 << 20,
            }
            .encode();
            while !stop.load(Ordering::Relaxed) {
                let s = if k % 2 == 0 {
                    hello(addr, "127.0.0.3", RO).await
                } else {
                    connect_from(addr, "127.0.0.3").await
                };
                let Ok(mut s) = s else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let part = if k % 4 < 2 { &h[..10] } else { &h[..] };
                if s.write_all(part).await.is_ok() {
                    until_closed(&mut s).await;
                }
            }
        });
    }
    // Non-reading: pipelines 64 reads, never reads a reply; reconnects once disconnected.
    for _ in 0..if on("nonread") { 4 } else { 0 } {
        non_reader(rt, addr, "127.0.0.4", RO, stop.clone());
    }
    // Open-spamming: opens of every file, back to back, replies read, again and again.
    for _ in 0..if on("spam") { 4 } else { 0 } {
        let stop = stop.clone();
        rt.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let Ok(mut s) = hello(addr, "127.0.0.5", RO).await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let mut burst = Vec::new();
                for i in 0..256u64 {
                    burst.extend(
                        Msg::Open {
                            root: "d".into(),
                            path: format!("f{}.bin", i as usize % FILES),
                        }
                        .frame(i),
                    );
                }
                let t = Duration::from_secs(5);
                'conn: while !stop.load(Ordering::Relaxed) {
                    if s.write_all(&burst).await.is_err() {
                        break;
                    }
                    for _ in 0..256 {
                        if proto::read_frame(&mut s, 0, t, t).await.is_err() {
                            break 'conn;
                        }
                    }
                }
            }
        });
    }
}

/// Runs the scenario over about `secs` seconds of windows ([`super::rounds`]) in `dir` (emptied).
pub fn run(dir: &Path, secs: f64) -> Outcome {
    let d = dir.to_path_buf();
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for i in 0..FILES {
        let n = if i < 4 { 16 << 20 } else { 4096 };
        std::fs::write(d.join(format!("f{i}.bin")), vec![i as u8; n]).unwrap();
    }
    let (server_rt, legit_rt) = (runtime(2), runtime(2));
    let attack_threads = Threads::default();
    let attack_rt = attack_threads.runtime(1);
    let cfg = ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: TOKEN.into(),
        read_only_tokens: vec![RO.into()],
        roots: vec![("d".into(), d.clone())],
        max_request: BLOCK as u32,
        max_inflight: 8,
        blocks: 24,
        io_timeout: Duration::from_millis(500),
        max_connections: 256,
        max_connections_per_peer: 16,
        max_staging_per_peer: 8,
        max_open_files: 32,
        ..ServerConfig::default()
    };
    let s = server_rt.block_on(async { Server::start(cfg).await.unwrap() });
    let addr = s.local_addr();
    let (fds0, rss0) = (fds(), rss_mib());
    let legit = Legit::start(&legit_rt, addr, TOKEN);
    let (rounds, window) = super::rounds(secs);
    let mut peak = rss0;
    let st = s.stats().clone();
    let rates = measure(
        rounds,
        window,
        &attack_threads,
        &legit.bytes,
        &s,
        |astop| attack(addr, astop, &attack_rt),
        || {
            peak = peak.max(rss_mib());
            String::new()
        },
    );
    let failures = legit.stop(&legit_rt);
    attack_rt.shutdown_timeout(Duration::from_secs(5));
    // Back to baseline: connections, blocks, descriptors, memory.
    let t = Instant::now();
    let recovered = loop {
        let open = st.open_connections.load(Ordering::Relaxed);
        let p = s.pool_stats();
        let (f, r) = (fds(), rss_mib());
        if open == 0 && p.free == p.total && f <= fds0 && r <= rss0 + 64.0 {
            break Ok(format!(
                "0 connections, {} of {} blocks free, fds {f} (were {fds0}), RSS {r:.0} MiB (was {rss0:.0}, peak {peak:.0})",
                p.free, p.total
            ));
        }
        if t.elapsed() > Duration::from_secs(20) {
            break Err(format!(
                "not back within 20 s: {open} connections, pool {p:?}, fds {f} (were {fds0}), RSS {r:.0} MiB (was {rss0:.0})"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let limits_reached = st.rejected_connections.load(Ordering::Relaxed) > 0
        && st.write_timeouts.load(Ordering::Relaxed) > 0;
    drop(s);
    server_rt.shutdown_timeout(Duration::from_secs(5));
    legit_rt.shutdown_timeout(Duration::from_secs(5));
    Outcome {
        rates,
        limits_reached,
        recovered,
        failures,
        rss_peak_mib: peak,
        rss_base_mib: rss0,
    }
}
