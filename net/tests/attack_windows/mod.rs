//! A control for the attack tests' one confounder: on a small machine the attackers' own client code
//! (their connects, writes and reads, and the loopback stack they drive) takes CPU from the
//! legitimate clients, which on a real network would run on other machines. Without a control, a
//! 2-core box measures that sharing and calls it the server's weakness (0.67–0.77 × on the development
//! VM with a server that keeps 1.00–1.05 × on the H200 host).
//!
//! So the tests measure three kinds of window: alone, attacked, and a *control* in which a thread of
//! the attackers' runtime burns as much CPU as the attackers used in the window before, without
//! touching the server. attacked ÷ control is then what the attack costs the legitimate clients
//! through the server: staging blocks, connections, file slots, the server's own CPU spent on the
//! attackers. On a machine with idle cores the control changes nothing (control ≈ alone).
//!
//! CPU time is read from `/proc/self/task/<tid>/stat` (user + system, in `USER_HZ` = 100 ticks a
//! second, which Linux fixes for what it reports there), so a window must be long against 10 ms.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
#[derive(Clone, Default)]
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

/// GB/s of the legitimate clients, averaged per kind of window.
pub struct Rates {
    pub alone: f64,
    pub attacked: f64,
    pub control: f64,
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
    bytes: &std::sync::atomic::AtomicU64,
    server: &ubdirect_net::Server,
    mut attack: impl FnMut(Arc<AtomicBool>),
    mut note: impl FnMut() -> String,
) -> Rates {
    let st = server.stats();
    let legit = st.open_connections.load(Ordering::Relaxed);
    let mut sum = [0.0f64; 3];
    let mut share = 0.0f64;
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
        sum[w % 3] += rate;
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
    let n = rounds as f64;
    Rates {
        alone: sum[0] / n,
        attacked: sum[1] / n,
        control: sum[2] / n,
    }
}
