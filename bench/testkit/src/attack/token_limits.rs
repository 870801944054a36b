//! Limits that hold across addresses: attackers on five loopback addresses (127.0.0.2 … .6), all
//! presenting one read-only token, pipeline reads whose replies they never read, hold idle
//! connections up to every cap, and send `SmcWriteV` headers that declare large range tables and
//! stall, while legitimate clients of another token read (from 127.0.0.1). Per address, the
//! attackers stay within every per-address cap: before the per-token limits
//! (`serve.max_staging_per_token`, `serve.max_connections_per_token`) five addresses × 8 staging
//! blocks took all 24, and the legitimate clients got 0–1 % of their throughput.
//!
//! `UBDIRECT_TOKEN_LIMITS_OFF=1` sets the per-token limits to the whole server's (to see the attack
//! succeed without them).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use ubdirect_net::proto::{Header, Kind};
use ubdirect_net::{Server, ServerConfig};

use super::{BLOCK, Legit, Outcome, Threads, hello, measure, non_reader, runtime, until_closed};
use crate::rss_mib;

const TOKEN: &str = "token-limits-legit-rw";
const RO: &str = "token-limits-attack-ro";
const ATTACKERS: [&str; 5] = [
    "127.0.0.2",
    "127.0.0.3",
    "127.0.0.4",
    "127.0.0.5",
    "127.0.0.6",
];

/// The attack, from every address, until `stop`.
fn attack(addr: SocketAddr, stop: Arc<AtomicBool>, rt: &tokio::runtime::Runtime) {
    for from in ATTACKERS {
        // Non-reading: 64 reads pipelined, no reply read; again once disconnected.
        for _ in 0..3 {
            non_reader(rt, addr, from, RO, stop.clone());
        }
        // Idle connections with the token, as many as the caps let in.
        for _ in 0..20 {
            let stop = stop.clone();
            rt.spawn(async move {
                let mut held = None;
                while !stop.load(Ordering::Relaxed) {
                    if held.is_none() {
                        held = hello(addr, from, RO).await.ok();
                    }
                    tokio::time::sleep(Duration::from_millis(if held.is_none() {
                        100
                    } else {
                        20
                    }))
                    .await;
                }
            });
        }
        // `SmcWriteV` headers declaring a full table, then nothing: held to the deadline, again.
        for _ in 0..6 {
            let stop = stop.clone();
            rt.spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut s) = hello(addr, from, RO).await else {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    };
                    let len = BLOCK as u32 + 12;
                    let mut f = Header {
                        kind: Kind::SmcWriteV,
                        id: 1,
                        len,
                    }
                    .encode()
                    .to_vec();
                    f.extend_from_slice(&0u32.to_le_bytes());
                    f.extend_from_slice(&((len - 8) / 12).to_le_bytes());
                    if s.write_all(&f).await.is_ok() {
                        until_closed(&mut s).await;
                    }
                }
            });
        }
    }
}

/// Runs the scenario over about `secs` seconds of windows ([`super::rounds`]) in `dir` (emptied).
pub fn run(dir: &Path, secs: f64) -> Outcome {
    let off = std::env::var_os("UBDIRECT_TOKEN_LIMITS_OFF").is_some();
    let d = dir.to_path_buf();
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for i in 0..4 {
        std::fs::write(d.join(format!("f{i}.bin")), vec![i as u8; 16 << 20]).unwrap();
    }
    let (server_rt, legit_rt) = (runtime(2), runtime(2));
    let attack_threads = Threads::default();
    let attack_rt = attack_threads.runtime(1);
    let blocks = 24;
    let cfg = ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: TOKEN.into(),
        read_only_tokens: vec![RO.into()],
        roots: vec![("d".into(), d.clone())],
        max_request: BLOCK as u32,
        max_inflight: 8,
        blocks,
        io_timeout: Duration::from_millis(500),
        max_connections: 256,
        max_connections_per_peer: 32,
        max_staging_per_peer: 8,
        max_connections_per_token: if off { 256 } else { 96 },
        // Off: all blocks but one (a share of every block is lowered to half with several tokens).
        max_staging_per_token: if off { blocks - 1 } else { blocks / 2 },
        max_open_files: 32,
        ..ServerConfig::default()
    };
    let s = server_rt.block_on(async { Server::start(cfg).await.unwrap() });
    let addr = s.local_addr();
    let legit = Legit::start(&legit_rt, addr, TOKEN);
    // The baseline: the server serving the legitimate clients, the attackers' runtime idle.
    let rss0 = rss_mib();
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
            format!(" RSS {:.0} MiB", rss_mib())
        },
    );
    // After the attackers: only the legitimate clients' connections, and the RSS of before.
    let t = Instant::now();
    let recovered = loop {
        let open = st.open_connections.load(Ordering::Relaxed);
        let r = rss_mib();
        if open <= 4 && r <= rss0 * 1.10 {
            break Ok(format!(
                "{open} connections, RSS {r:.0} MiB (baseline {rss0:.0}, peak {peak:.0})"
            ));
        }
        if t.elapsed() > Duration::from_secs(20) {
            break Err(format!(
                "not back within 20 s: {open} connections, RSS {r:.0} MiB (baseline {rss0:.0} MiB, peak {peak:.0})"
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let failures = legit.stop(&legit_rt);
    attack_rt.shutdown_timeout(Duration::from_secs(5));
    let limits_reached =
        st.write_timeouts.load(Ordering::Relaxed) > 0 && st.refused.load(Ordering::Relaxed) > 0;
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
