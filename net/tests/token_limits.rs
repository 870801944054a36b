//! Issue 23: limits that hold across addresses. Attackers on five loopback addresses (127.0.0.2 …
//! .6), all presenting one read-only token, pipeline reads whose replies they never read, hold idle
//! connections up to every cap, and send `SmcWriteV` headers that declare large range tables and
//! stall; legitimate clients of another token (from 127.0.0.1) must keep ≥ 0.8 × the throughput
//! they get alone, and the process's RSS must be back within 10 % of its baseline once the attackers
//! leave. Per address, the attackers stay within every per-address cap: before the per-token limits
//! (`serve.max_staging_per_token`, `serve.max_connections_per_token`) five addresses × 8 staging
//! blocks took all 24, and the legitimate clients got 0–1 % of their throughput.
//!
//! Windows cycle (alone, attacked, control, …) so that drift of a shared machine hits every kind
//! alike; the 0.8 holds for attacked ÷ control, where the control burns the attackers' own CPU
//! without touching the server (`attack_windows`: on 2 cores their client code would otherwise count
//! against the server). `UBDIRECT_ADVERSARIAL_SECS` sets the total (default 12 s),
//! `UBDIRECT_ADVERSARIAL_MIN` the 0.8, and
//! `UBDIRECT_TOKEN_LIMITS_OFF=1` sets the per-token limits to the whole server's (to see the attack
//! succeed without them).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod attack_windows;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use ubdirect_net::proto::{self, Header, Kind, Msg};
use ubdirect_net::{Client, Server, ServerConfig};
use ubdirect_ub::{MemoryKind, PoolConfig, UbPool};

const TOKEN: &str = "token-limits-legit-rw";
const RO: &str = "token-limits-attack-ro";
const BLOCK: usize = 1 << 20;
const ATTACKERS: [&str; 5] = [
    "127.0.0.2",
    "127.0.0.3",
    "127.0.0.4",
    "127.0.0.5",
    "127.0.0.6",
];

fn rss_mib() -> f64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages = s
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse::<u64>().ok())
        .unwrap_or(0);
    (pages * 4096) as f64 / (1 << 20) as f64
}

async fn connect_from(addr: SocketAddr, from: &str) -> std::io::Result<TcpStream> {
    let s = TcpSocket::new_v4()?;
    s.bind(format!("{from}:0").parse().unwrap())?;
    s.connect(addr).await
}

async fn hello(addr: SocketAddr, from: &str) -> std::io::Result<TcpStream> {
    let mut s = connect_from(addr, from).await?;
    s.write_all(&Msg::Hello { token: RO.into() }.frame(0))
        .await?;
    let t = Duration::from_secs(5);
    let (h, _) = proto::read_frame(&mut s, 0, t, t)
        .await
        .map_err(std::io::Error::other)?;
    if h.kind != Kind::HelloOk {
        return Err(std::io::Error::other("refused"));
    }
    Ok(s)
}

async fn until_closed(s: &mut TcpStream) {
    let mut b = [0u8; 4096];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await {
        if n == 0 {
            break;
        }
    }
}

/// The attack, from every address, until `stop`.
fn attack(addr: SocketAddr, stop: Arc<AtomicBool>, rt: &tokio::runtime::Runtime) {
    for from in ATTACKERS {
        // Non-reading: 64 reads pipelined, no reply read; again once disconnected.
        for _ in 0..3 {
            let stop = stop.clone();
            rt.spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut s) = hello(addr, from).await else {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    };
                    let mut reqs = Msg::Open {
                        root: "d".into(),
                        path: "f0.bin".into(),
                    }
                    .frame(1);
                    for i in 0..64u64 {
                        reqs.extend(
                            Msg::Read {
                                file: 0,
                                offset: (i % 4) * BLOCK as u64,
                                len: BLOCK as u32,
                            }
                            .frame(2 + i),
                        );
                    }
                    if s.write_all(&reqs).await.is_err() {
                        continue;
                    }
                    for _ in 0..30 {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            });
        }
        // Idle connections with the token, as many as the caps let in.
        for _ in 0..20 {
            let stop = stop.clone();
            rt.spawn(async move {
                let mut held = None;
                while !stop.load(Ordering::Relaxed) {
                    if held.is_none() {
                        held = hello(addr, from).await.ok();
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
                    let Ok(mut s) = hello(addr, from).await else {
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

/// One legitimate client: reads of 256 KiB … 1 MiB at random offsets, 4 in flight, until `stop`.
async fn legit(addr: SocketAddr, seed: u64, bytes: Arc<AtomicU64>, stop: Arc<AtomicBool>) {
    let c = Client::new(vec![addr], TOKEN, Duration::from_secs(10));
    let pool = UbPool::new_host(PoolConfig::new("legit", BLOCK, 4, MemoryKind::Host)).unwrap();
    let mut files = Vec::new();
    for i in 0..4 {
        files.push(c.open("d", &format!("f{i}.bin")).await.unwrap());
    }
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..4u64 {
        let (c, pool, files, bytes, stop) = (
            c.clone(),
            pool.clone(),
            files.clone(),
            bytes.clone(),
            stop.clone(),
        );
        tasks.spawn(async move {
            let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (seed * 16 + k);
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let f = &files[x as usize % files.len()];
                let len = (256 << 10) + (x >> 16) as usize % (BLOCK - (256 << 10));
                let off = (x >> 8) % (f.size - len as u64);
                let l = pool.acquire(Duration::from_secs(10)).await.unwrap();
                let (r, _l) = c.read(f, off, len, l, 0).await;
                r.unwrap();
                bytes.fetch_add(len as u64, Ordering::Relaxed);
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
}

#[test]
fn attackers_sharing_a_token_on_many_addresses_cannot_starve_another_token() {
    let secs: f64 = std::env::var("UBDIRECT_ADVERSARIAL_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12.0);
    let min: f64 = std::env::var("UBDIRECT_ADVERSARIAL_MIN")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.8);
    let off = std::env::var_os("UBDIRECT_TOKEN_LIMITS_OFF").is_some();
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("net-token-limits");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for i in 0..4 {
        std::fs::write(d.join(format!("f{i}.bin")), vec![i as u8; 16 << 20]).unwrap();
    }
    let rt = |n| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build()
            .unwrap()
    };
    let (server_rt, legit_rt) = (rt(2), rt(2));
    let attack_threads = attack_windows::Threads::default();
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
        max_staging_per_token: if off { blocks } else { blocks / 2 },
        max_open_files: 32,
        ..ServerConfig::default()
    };
    let s = server_rt.block_on(async { Server::start(cfg).await.unwrap() });
    let addr = s.local_addr();
    let bytes = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for c in 0..4 {
        clients.push(legit_rt.spawn(legit(addr, c, bytes.clone(), stop.clone())));
    }
    let t = Instant::now();
    while bytes.load(Ordering::Relaxed) < 64 << 20 {
        assert!(t.elapsed() < Duration::from_secs(30), "no reads");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The baseline: the server serving the legitimate clients, the attackers' runtime idle.
    let rss0 = rss_mib();
    let rounds = 6;
    let window = Duration::from_secs_f64(secs / rounds as f64 / 3.0);
    let mut peak = rss0;
    let st = s.stats().clone();
    let r = attack_windows::measure(
        rounds,
        window,
        &attack_threads,
        &bytes,
        &s,
        |astop| attack(addr, astop, &attack_rt),
        || {
            peak = peak.max(rss_mib());
            format!(" RSS {:.0} MiB", rss_mib())
        },
    );
    let ratio = r.attacked / r.control;
    eprintln!(
        "token limits: legitimate clients {:.3} GB/s alone, {:.3} GB/s attacked, {:.3} GB/s with the attackers' CPU burned: attacked = {ratio:.2} x control, {:.2} x alone; RSS {rss0:.0} MiB before, peak {peak:.0} MiB",
        r.alone,
        r.attacked,
        r.control,
        r.attacked / r.alone
    );
    // After the attackers: only the legitimate clients' connections, and the RSS of before.
    let t = Instant::now();
    loop {
        let open = st.open_connections.load(Ordering::Relaxed);
        let r = rss_mib();
        if open <= 4 && r <= rss0 * 1.10 {
            eprintln!(
                "after: {open} connections, RSS {r:.0} MiB (baseline {rss0:.0}, peak {peak:.0})"
            );
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "not back: {open} connections, RSS {r:.0} MiB (baseline {rss0:.0} MiB, peak {peak:.0})"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        legit_rt.block_on(c).unwrap();
    }
    attack_rt.shutdown_timeout(Duration::from_secs(5));
    assert!(
        st.write_timeouts.load(Ordering::Relaxed) > 0 && st.refused.load(Ordering::Relaxed) > 0,
        "the attack did not reach the limits"
    );
    assert!(
        ratio >= min,
        "legitimate clients kept {ratio:.2} x their throughput with the attackers' CPU burned (need {min})"
    );
    drop(s);
    server_rt.shutdown_timeout(Duration::from_secs(5));
}
