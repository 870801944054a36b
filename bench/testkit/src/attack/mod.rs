//! The adversarial loopback scenarios: attackers against `ubdirect serve` while legitimate clients
//! read. The net tests run them for their behaviour (limits enforced, attackers refused, every
//! legitimate read served, the server back to its baseline); `ubdirect-bench` runs them for the
//! throughput the legitimate clients keep (a ratio against a control window of the same run).
//!
//! A control for the scenarios' one confounder: on a small machine the attackers' own client code
//! (their connects, writes and reads, and the loopback stack they drive) takes CPU from the
//! legitimate clients, which on a real network would run on other machines. Without a control, a
//! 2-core box measures that sharing and calls it the server's weakness (0.67–0.77 × on the development
//! VM with a server that keeps 1.00–1.05 × on the H200 host).
//!
//! So the scenarios measure three kinds of window: alone, attacked, and a *control* in which a thread of
//! the attackers' runtime burns as much CPU as the attackers used in the window before, without
//! touching the server. attacked ÷ control is then what the attack costs the legitimate clients
//! through the server: staging blocks, connections, file slots, the server's own CPU spent on the
//! attackers. On a machine with idle cores the control changes nothing (control ≈ alone).
//!
//! CPU time is read from `/proc/self/task/<tid>/stat` (user + system, in `USER_HZ` = 100 ticks a
//! second, which Linux fixes for what it reports there), so a window must be long against 10 ms.

pub mod adversarial;
pub mod token_limits;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use ubdirect_net::Client;
use ubdirect_net::proto::{self, Kind, Msg};
use ubdirect_ub::{MemoryKind, PoolConfig, UbPool};

/// Ticks a second in `/proc/*/stat` (`USER_HZ`, the same on every Linux architecture we build for).
const USER_HZ: f64 = 100.0;

/// CPU seconds (user + system) a thread of this process has used, from its `stat` file.
fn thread_cpu(path: &str) -> f64 {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    // The command name (field 2) may hold spaces; fields after its closing parenthesis are plain.
    let rest = s.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // After ')': state is field 3, so utime (14) and stime (15) are at 11 and 12.
    (f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0)) as f64 / USER_HZ
}

/// The threads of one runtime, whose CPU time can be read from outside.
#[derive(Clone, Default, Debug)]
pub struct Threads(Arc<Mutex<Vec<String>>>);

impl Threads {
    /// A multi-thread runtime with `workers` workers whose threads this records.
    pub fn runtime(&self, workers: usize) -> tokio::runtime::Runtime {
        let me = self.clone();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .on_thread_start(move || {
                // "/proc/thread-self" links to "<pid>/task/<tid>".
                if let Ok(p) = std::fs::read_link("/proc/thread-self") {
                    me.0.lock()
                        .unwrap()
                        .push(format!("/proc/{}/stat", p.display()));
                }
            })
            .build()
            .unwrap()
    }

    /// CPU seconds used so far by every thread the runtime started.
    pub fn cpu(&self) -> f64 {
        self.0.lock().unwrap().iter().map(|p| thread_cpu(p)).sum()
    }
}

/// Burns `share` of one core (CPU time ÷ wall time) on a thread of its own until dropped.
#[derive(Debug)]
pub struct Burner {
    stop: Arc<AtomicBool>,
    join: Option<std::thread::JoinHandle<()>>,
}

impl Burner {
    pub fn start(share: f64) -> Burner {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let join = std::thread::spawn(move || {
            let (t0, c0) = (Instant::now(), thread_cpu("/proc/thread-self/stat"));
            let mut x = 1u64;
            while !s.load(Ordering::Relaxed) {
                let used = thread_cpu("/proc/thread-self/stat") - c0;
                if used < share * t0.elapsed().as_secs_f64() {
                    // Spin ~1 ms of work, then look again.
                    let t = Instant::now();
                    while t.elapsed() < Duration::from_millis(1) {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                } else {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        });
        Burner {
            stop,
            join: Some(join),
        }
    }
}

impl Drop for Burner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

/// The legitimate clients' GB/s in one round's three windows.
#[derive(Clone, Copy, Debug)]
pub struct Round {
    pub alone: f64,
    pub attacked: f64,
    pub control: f64,
}

/// Every round's rates, in order.
#[derive(Clone, Debug, Default)]
pub struct Rates {
    pub rounds: Vec<Round>,
}

impl Rates {
    /// The median over rounds of attacked ÷ control (each round's windows are adjacent in time, so
    /// drift of a shared machine cancels within a round).
    pub fn attacked_over_control(&self) -> f64 {
        crate::median(
            &self
                .rounds
                .iter()
                .map(|r| r.attacked / r.control)
                .collect::<Vec<_>>(),
        )
    }

    /// The median over rounds of attacked ÷ alone.
    pub fn attacked_over_alone(&self) -> f64 {
        crate::median(
            &self
                .rounds
                .iter()
                .map(|r| r.attacked / r.alone)
                .collect::<Vec<_>>(),
        )
    }

    /// The lowest rate of any attacked window (0 means the attack starved the legitimate clients).
    pub fn min_attacked(&self) -> f64 {
        self.rounds
            .iter()
            .map(|r| r.attacked)
            .fold(f64::INFINITY, f64::min)
    }
}

/// Runs `rounds` rounds of three windows (alone, attacked, control) of `window` each, counting the
/// legitimate clients' `bytes` on `server`. `attack` starts the attackers until the flag it is given
/// is set; `threads` are the attackers' runtime's. After an attacked window, the attackers told to
/// stop, it waits (up to 15 s) until the server holds no more connections than before the first
/// window (the legitimate clients', connected). Each window is logged with the server's counters
/// and what `note` adds.
pub fn measure(
    rounds: usize,
    window: Duration,
    threads: &Threads,
    bytes: &AtomicU64,
    server: &ubdirect_net::Server,
    mut attack: impl FnMut(Arc<AtomicBool>),
    mut note: impl FnMut() -> String,
) -> Rates {
    let st = server.stats();
    let legit = st.open_connections.load(Ordering::Relaxed);
    let mut out = Rates::default();
    let mut share = 0.0f64;
    let mut cur = [0.0f64; 3];
    for w in 0..rounds * 3 {
        let kind = ["alone", "attacked", "control"][w % 3];
        let astop = Arc::new(AtomicBool::new(false));
        let burner = (kind == "control").then(|| Burner::start(share));
        if kind == "attacked" {
            attack(astop.clone());
            // The attack builds up before it is measured.
            std::thread::sleep(window / 4);
        }
        let (b0, t0, c0) = (bytes.load(Ordering::Relaxed), Instant::now(), threads.cpu());
        std::thread::sleep(window);
        let dt = t0.elapsed().as_secs_f64();
        let rate = (bytes.load(Ordering::Relaxed) - b0) as f64 / dt / 1e9;
        if kind == "attacked" {
            share = (threads.cpu() - c0) / dt;
        }
        astop.store(true, Ordering::Relaxed);
        drop(burner);
        let t = Instant::now();
        while kind == "attacked"
            && st.open_connections.load(Ordering::Relaxed) > legit
            && t.elapsed() < Duration::from_secs(15)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        cur[w % 3] = rate;
        if w % 3 == 2 {
            out.rounds.push(Round {
                alone: cur[0],
                attacked: cur[1],
                control: cur[2],
            });
        }
        eprintln!(
            "window {w}: {kind} {rate:.3} GB/s; attackers' CPU {share:.2} of a core; open {} refused {} rejected {} write-timeouts {} free blocks {}{}",
            st.open_connections.load(Ordering::Relaxed),
            st.refused.load(Ordering::Relaxed),
            st.rejected_connections.load(Ordering::Relaxed),
            st.write_timeouts.load(Ordering::Relaxed),
            server.pool_stats().free,
            note()
        );
    }
    out
}

/// Rounds and window length for about `secs` seconds of windows: at least 2 rounds, and windows of
/// at least 1 s, because an attacked window must outlast the server's 0.5 s write deadline for the
/// non-reading attackers to meet it (shorter windows stop them before the limit acts).
pub fn rounds(secs: f64) -> (usize, Duration) {
    let rounds = ((secs / 3.0).floor() as usize).max(2);
    let window = (secs / rounds as f64 / 3.0).max(1.0);
    (rounds, Duration::from_secs_f64(window))
}

/// Reads of this size at most, by the legitimate clients.
pub const BLOCK: usize = 1 << 20;

/// A connection to `addr` from the loopback address `from` (127.0.0.2 … : another machine).
pub async fn connect_from(addr: SocketAddr, from: &str) -> std::io::Result<TcpStream> {
    let s = TcpSocket::new_v4()?;
    s.bind(format!("{from}:0").parse().map_err(std::io::Error::other)?)?;
    s.connect(addr).await
}

/// A connection from `from` that said hello with `token` and got `HelloOk`.
pub async fn hello(addr: SocketAddr, from: &str, token: &str) -> std::io::Result<TcpStream> {
    let mut s = connect_from(addr, from).await?;
    s.write_all(
        &Msg::Hello {
            token: token.into(),
        }
        .frame(0),
    )
    .await?;
    let t = Duration::from_secs(5);
    let (h, _) = proto::read_frame(&mut s, 0, t, t)
        .await
        .map_err(std::io::Error::other)?;
    if h.kind != Kind::HelloOk {
        return Err(std::io::Error::other("no hello"));
    }
    Ok(s)
}

/// Waits for the server to close `s` (reading and dropping whatever comes), 10 s at most per read.
pub async fn until_closed(s: &mut TcpStream) {
    let mut b = [0u8; 4096];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await {
        if n == 0 {
            break;
        }
    }
}

/// One legitimate client: reads of 256 KiB … 1 MiB at random offsets of `f0.bin` … `f3.bin` in root
/// `d`, 4 in flight, until `stop`; adds the bytes it read to `bytes`. Every failed request (an
/// error, or no reply within the client's 10 s deadline) is pushed to `failures`.
pub async fn legit(
    addr: SocketAddr,
    token: &'static str,
    seed: u64,
    bytes: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    failures: Arc<Mutex<Vec<String>>>,
) {
    let fail = |what: String| failures.lock().unwrap().push(what);
    let c = Client::new(vec![addr], token, Duration::from_secs(10));
    let pool = match UbPool::new_host(PoolConfig::new("legit", BLOCK, 4, MemoryKind::Host)) {
        Ok(p) => p,
        Err(e) => return fail(format!("client {seed}: pool: {e}")),
    };
    let mut files = Vec::new();
    for i in 0..4 {
        match c.open("d", &format!("f{i}.bin")).await {
            Ok(f) => files.push(f),
            Err(e) => return fail(format!("client {seed}: open f{i}.bin: {e}")),
        }
    }
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..4u64 {
        let (c, pool, files, bytes, stop, failures) = (
            c.clone(),
            pool.clone(),
            files.clone(),
            bytes.clone(),
            stop.clone(),
            failures.clone(),
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
                let l = match pool.acquire(Duration::from_secs(10)).await {
                    Ok(l) => l,
                    Err(e) => {
                        failures.lock().unwrap().push(format!("acquire: {e}"));
                        return;
                    }
                };
                let (r, _l) = c.read(f, off, len, l, 0).await;
                if let Err(e) = r {
                    failures
                        .lock()
                        .unwrap()
                        .push(format!("read {off}+{len}: {e}"));
                    return;
                }
                bytes.fetch_add(len as u64, Ordering::Relaxed);
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        if let Err(e) = r {
            fail(format!("client {seed}: task: {e}"));
        }
    }
}

/// Four legitimate clients ([`legit`]) of `token` reading on `rt`, warmed up: together they have
/// read 64 MiB when [`Legit::start`] returns (within 60 s, a deadline against a hang).
#[derive(Debug)]
pub struct Legit {
    /// Bytes they have read.
    pub bytes: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    failures: Arc<Mutex<Vec<String>>>,
    clients: Vec<tokio::task::JoinHandle<()>>,
}

impl Legit {
    /// Starts them against `addr` and waits for the warm-up.
    pub fn start(rt: &tokio::runtime::Runtime, addr: SocketAddr, token: &'static str) -> Legit {
        let l = Legit {
            bytes: Arc::new(AtomicU64::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            failures: Arc::new(Mutex::new(Vec::new())),
            clients: Vec::new(),
        };
        let clients = (0..4)
            .map(|c| {
                rt.spawn(legit(
                    addr,
                    token,
                    c,
                    l.bytes.clone(),
                    l.stop.clone(),
                    l.failures.clone(),
                ))
            })
            .collect();
        let l = Legit { clients, ..l };
        let t = Instant::now();
        while l.bytes.load(Ordering::Relaxed) < 64 << 20 {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "no reads within 60 s: {:?}",
                l.failures.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        l
    }

    /// Stops them, waits for each, and returns every request of theirs that failed.
    pub fn stop(self, rt: &tokio::runtime::Runtime) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        for c in self.clients {
            let _ = rt.block_on(c);
        }
        std::mem::take(&mut *self.failures.lock().unwrap())
    }
}

/// A non-reading attacker from `from` with `token`, until `stop`: it opens `f0.bin` of root `d`,
/// pipelines 64 reads of [`BLOCK`] bytes, never reads a reply, holds the connection 1.5 s (past the
/// server's write deadline), and does it again.
pub fn non_reader(
    rt: &tokio::runtime::Runtime,
    addr: SocketAddr,
    from: &'static str,
    token: &'static str,
    stop: Arc<AtomicBool>,
) {
    rt.spawn(async move {
        while !stop.load(Ordering::Relaxed) {
            let Ok(mut s) = hello(addr, from, token).await else {
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

/// A multi-thread runtime of `n` workers.
pub fn runtime(n: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(n)
        .enable_all()
        .build()
        .unwrap()
}

/// What a scenario found: the legitimate clients' rates per round, whether the attack reached the
/// server's limits, whether the server came back to its baseline, and every failed legitimate
/// request.
#[derive(Debug)]
pub struct Outcome {
    pub rates: Rates,
    /// The attack met the limits it is meant to meet (refusals, write deadlines).
    pub limits_reached: bool,
    /// `Ok(what)`: back to the baseline after the attack; `Err(what)`: not within 20 s.
    pub recovered: Result<String, String>,
    /// Legitimate requests that failed or missed their deadline.
    pub failures: Vec<String>,
    /// Peak RSS during the windows, MiB, and the baseline before them.
    pub rss_peak_mib: f64,
    pub rss_base_mib: f64,
}
