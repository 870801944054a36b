//! `ubdirect-bench smc`: seed 000's experiments on loopback TCP against a real `ubdirect serve`
//! region. Block sync and small random writes three ways — (a) copy into a host buffer and one
//! explicit send, (b) write-through (every application store sent and acknowledged), (c) write-back
//! (stores into the mapped shadow pages, then one barrier) — with latency, bandwidth and network
//! transactions; read-fault latency against an explicit read of the same size; and false sharing
//! (4 writers × 4 bytes in one page vs in separate pages: threads of one mapping, then separate
//! clients, where one page means lost updates). Same-run baselines: a plain socket moving the same
//! 4 MiB (send + 1-byte ack) for the barrier, an explicit read for the fault; fault latency p50/p99
//! per transport (TCP here; over RDMA — a build with `--features rdma` on a machine with a device — a
//! fault is a one-sided READ and a barrier one-sided WRITEs).

use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use serde::Serialize;
use ubdirect_net::smc::{MapOptions, Region, SmcClient, SmcOptions, SmcStats, SyncMode};
use ubdirect_net::{RegionConfig, Server, ServerConfig};

/// One measured row.
#[derive(Debug, Serialize)]
pub struct SmcRow {
    /// Experiment.
    pub experiment: String,
    /// Method.
    pub method: String,
    /// Median latency of one operation, µs.
    pub median_us: f64,
    /// 99th percentile (or max of the runs), µs.
    pub p99_us: f64,
    /// Payload GB/s (bytes the application wanted moved / median time).
    pub gbps: f64,
    /// Network transactions (requests sent) per operation.
    pub transactions: f64,
    /// Bytes sent to the server per operation.
    pub bytes_sent: f64,
    /// What it shows.
    pub note: String,
}

const TOKEN: &str = "bench-smc-token-rw-0123";
const KEY: &str = "bench-smc-region-key";

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return 0.0;
    }
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn delta(c: &AtomicU64, before: u64) -> u64 {
    SmcStats::get(c) - before
}

struct Env {
    _rt: tokio::runtime::Runtime,
    server: Server,
}

/// `UBDIRECT_BENCH_SMC_GPU=N`: the region lives in GPU N's memory on the server side.
fn gpu() -> Option<usize> {
    std::env::var("UBDIRECT_BENCH_SMC_GPU")
        .ok()
        .and_then(|v| v.parse().ok())
}

/// `UBDIRECT_BENCH_SMC_SPIN_US=N`: fault threads spin N µs for the next fault and for a fault's
/// reply before sleeping (`MapOptions::spin`); unset: the library's default.
fn spin() -> Duration {
    std::env::var("UBDIRECT_BENCH_SMC_SPIN_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_micros)
        .unwrap_or(MapOptions::default().spin)
}

/// A plain socket on loopback: a thread receives `len`-byte messages into one reused buffer and
/// answers each with one byte. Returns the connected client side.
fn plain_socket(len: usize) -> Result<std::net::TcpStream, String> {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(e)?;
    let addr = l.local_addr().map_err(e)?;
    std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let _ = s.set_nodelay(true);
        let mut buf = vec![0u8; len];
        while s.read_exact(&mut buf).is_ok() && s.write_all(&[1]).is_ok() {}
    });
    let c = std::net::TcpStream::connect(addr).map_err(e)?;
    c.set_nodelay(true).map_err(e)?;
    c.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(e)?;
    Ok(c)
}

fn server(size: u64) -> Result<Env, String> {
    server_on(size, None)
}

/// A server with one region of `size` bytes, serving RDMA on `rdma_device` when given.
fn server_on(size: u64, rdma_device: Option<String>) -> Result<Env, String> {
    server_in(size, rdma_device, gpu())
}

/// A server with one region of `size` bytes in GPU `gpu`'s memory (`None`: host memory).
fn server_in(size: u64, rdma_device: Option<String>, gpu: Option<usize>) -> Result<Env, String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let server = rt
        .block_on(Server::start(ServerConfig {
            listen: "127.0.0.1:0".parse().map_err(|_| "addr")?,
            token: TOKEN.into(),
            roots: vec![],
            max_request: 16 << 20,
            blocks: 1,
            rdma_device,
            // `UBDIRECT_BENCH_SMC_POLL_US=N`: the server's `smc_poll` (unset: its default).
            smc_poll: std::env::var("UBDIRECT_BENCH_SMC_POLL_US")
                .ok()
                .and_then(|v| v.parse().ok())
                .map(Duration::from_micros)
                .unwrap_or(ServerConfig::default().smc_poll),
            regions: vec![RegionConfig {
                name: "bench".into(),
                size,
                key: KEY.into(),
                writable: true,
                gpu,
            }],
            ..ServerConfig::default()
        }))
        .map_err(|e| e.to_string())?;
    Ok(Env { _rt: rt, server })
}

fn unregistered(env: &Env) -> SmcClient {
    SmcClient::new(
        env.server.local_addr(),
        TOKEN,
        SmcOptions {
            deadline: Duration::from_secs(10),
            retries: 1,
        },
    )
}

fn client(env: &Env) -> Result<(SmcClient, Region), String> {
    let c = unregistered(env);
    let r = c.register("bench", KEY).map_err(|e| e.to_string())?;
    Ok((c, r))
}

struct Run {
    lat_us: Vec<f64>,
    tx: u64,
    sent: u64,
}

/// Runs `op` `reps` times, timing each, counting the client's transactions and bytes pushed.
fn timed(
    c: &SmcClient,
    reps: usize,
    mut op: impl FnMut(usize) -> Result<(), String>,
) -> Result<Run, String> {
    let (t0, b0) = (
        SmcStats::get(&c.stats().transactions),
        SmcStats::get(&c.stats().bytes_pushed),
    );
    let mut lat_us = Vec::with_capacity(reps);
    for i in 0..reps {
        let t = Instant::now();
        op(i)?;
        lat_us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(Run {
        lat_us,
        tx: delta(&c.stats().transactions, t0),
        sent: delta(&c.stats().bytes_pushed, b0),
    })
}

fn row(exp: &str, method: &str, mut r: Run, reps: usize, bytes: usize, note: &str) -> SmcRow {
    let med = pct(&mut r.lat_us, 0.5);
    SmcRow {
        experiment: exp.into(),
        method: method.into(),
        median_us: med,
        p99_us: pct(&mut r.lat_us, 0.99),
        gbps: if med > 0.0 {
            bytes as f64 / (med * 1e3)
        } else {
            0.0
        },
        transactions: r.tx as f64 / reps as f64,
        bytes_sent: r.sent as f64 / reps as f64,
        note: note.into(),
    }
}

fn e<E: std::fmt::Display>(x: E) -> String {
    x.to_string()
}

/// Runs every experiment; prints the table and returns the rows.
pub fn run(quick: bool) -> Result<Vec<SmcRow>, String> {
    let block: usize = 4 << 20;
    let env = server(32 << 20)?;
    let mut rows = Vec::new();
    let wb = MapOptions {
        page_size: 4096,
        readahead: 0,
        mode: SyncMode::WriteBack,
        spin: spin(),
        ..MapOptions::default()
    };

    // 0. Registration: the first fetches the descriptor, the next is served from the cache.
    {
        let c = unregistered(&env);
        let first = timed(&c, 1, |_| c.register("bench", KEY).map(|_| ()).map_err(e))?;
        let reps = 1000;
        let cached = timed(&c, reps, |_| {
            c.register("bench", KEY).map(|_| ()).map_err(e)
        })?;
        rows.push(row(
            "register region",
            "first registration (connect + hello + open)",
            first,
            1,
            0,
            "descriptor fetched once",
        ));
        rows.push(row(
            "register region",
            "registering again",
            cached,
            reps,
            0,
            "cached: no request",
        ));
    }

    // 1. 4 MiB block sync.
    let reps = if quick { 5 } else { 20 };
    let src: Vec<u8> = (0..block).map(|i| (i * 31 + 7) as u8).collect();
    let (c, r) = client(&env)?;
    let mut host = vec![0u8; block];
    let a = timed(&c, reps, |_| {
        host.copy_from_slice(&src);
        r.write(0, &host).map_err(e)
    })?;
    rows.push(row(
        "4 MiB block sync",
        "(a) copy to host buffer + explicit send",
        a,
        reps,
        block,
        "one transfer of the whole block",
    ));
    let b = timed(&c, reps.min(3), |_| {
        for (i, pg) in src.chunks(4096).enumerate() {
            r.write((i * 4096) as u64, pg).map_err(e)?;
        }
        Ok(())
    })?;
    rows.push(row(
        "4 MiB block sync",
        "(b) write-through (4 KiB stores, each acknowledged)",
        b,
        reps.min(3),
        block,
        "one round trip per store",
    ));
    let m = r.map(wb).map_err(e)?;
    prefault(&m); // every page present and clean
    m.load(0, &mut host).map_err(e)?;
    let mut s = src.clone();
    // Stores first (untimed), then the barrier: its time against the plain socket's.
    let mut stores = Vec::with_capacity(reps);
    let mut bar = Vec::with_capacity(reps);
    let (mut scans, mut pushes) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    let cc = timed(&c, reps, |i| {
        s[0] = i as u8; // a real change every round
        let t = Instant::now();
        m.store(0, &s).map_err(e)?;
        stores.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let b = m.barrier().map_err(e)?;
        bar.push(t.elapsed().as_secs_f64() * 1e6);
        scans.push(b.scan.as_secs_f64() * 1e6);
        pushes.push(b.push.as_secs_f64() * 1e6);
        Ok(())
    })?;
    let cc_tx = cc.tx;
    rows.push(row(
        "4 MiB block sync",
        "(c) write-back: stores + barrier",
        cc,
        reps,
        block,
        "write-protect faults mark pages dirty; the barrier merges them",
    ));
    drop(m);
    // The plain socket, in the same run: the same 4 MiB sent and acknowledged.
    let mut sock = plain_socket(block)?;
    let mut plain = timed(&c, reps, |_| {
        use std::io::{Read, Write};
        sock.write_all(&src).map_err(e)?;
        let mut ack = [0u8; 1];
        sock.read_exact(&mut ack).map_err(e)
    })?;
    (plain.tx, plain.sent) = (reps as u64, (block * reps) as u64);
    let plain_med = {
        let mut v = plain.lat_us.clone();
        pct(&mut v, 0.5)
    };
    let bar_med = pct(&mut bar.clone(), 0.5);
    let ratio = if bar_med > 0.0 {
        plain_med / bar_med
    } else {
        0.0
    };
    rows.push(row(
        "4 MiB block sync",
        "(c') the barrier alone (after the stores)",
        Run {
            lat_us: bar,
            tx: cc_tx,
            sent: (block * reps) as u64,
        },
        reps,
        block,
        &format!(
            "{ratio:.2} × the plain socket's throughput (goal ≥ 0.8: {}); stores {:.0} µs; \
             barrier: scan {:.0} µs + push {:.0} µs",
            if ratio >= 0.8 { "met" } else { "missed" },
            pct(&mut stores, 0.5),
            pct(&mut scans, 0.5),
            pct(&mut pushes, 0.5)
        ),
    ));
    rows.push(row(
        "4 MiB block sync",
        "(p) plain socket: send 4 MiB + 1-byte ack (baseline)",
        plain,
        reps,
        block,
        "loopback TCP, one reused receive buffer",
    ));

    // 2. 64-byte random writes in a 4 MiB window.
    let k = if quick { 2000 } else { 10000 };
    let offs: Vec<u64> = {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        (0..k)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % (block as u64 / 64)) * 64
            })
            .collect()
    };
    let payload = [0xA5u8; 64];
    let a = timed(&c, 1, |_| {
        for &o in &offs {
            host[o as usize..o as usize + 64].copy_from_slice(&payload);
        }
        r.write(0, &host).map_err(e)
    })?;
    rows.push(row(
        &format!("{k} random 64 B writes"),
        "(a) copy to host buffer + explicit send",
        a,
        1,
        k * 64,
        "the whole 4 MiB window sent once",
    ));
    let b = timed(&c, 1, |_| {
        for &o in &offs {
            r.write(o, &payload).map_err(e)?;
        }
        Ok(())
    })?;
    let wt_tx = b.tx;
    rows.push(row(
        &format!("{k} random 64 B writes"),
        "(b) write-through",
        b,
        1,
        k * 64,
        "one transaction per write",
    ));
    let m = r.map(wb).map_err(e)?;
    prefault(&m);
    let cc = timed(&c, 1, |_| {
        for &o in &offs {
            m.store(o as usize, &payload).map_err(e)?;
        }
        m.barrier().map(|_| ()).map_err(e)
    })?;
    let wb_tx = cc.tx.max(1);
    rows.push(row(
        &format!("{k} random 64 B writes"),
        "(c) write-back: stores + barrier",
        cc,
        1,
        k * 64,
        &format!(
            "{:.0}× fewer transactions than write-through (goal ≥ 50×: {})",
            wt_tx as f64 / wb_tx as f64,
            if wt_tx >= 50 * wb_tx { "met" } else { "missed" }
        ),
    ));
    drop(m);

    // 3. Read faults vs explicit reads of one page, per transport (SMC travels on TCP today).
    let n = if quick { 256 } else { 2048 };
    // The default first, then no spinning at all (the fault thread and the reply wait sleep).
    let spins: Vec<Duration> = if spin().is_zero() {
        vec![Duration::ZERO]
    } else {
        vec![spin(), Duration::ZERO]
    };
    for (k, sp) in spins.into_iter().enumerate() {
        let (c2, r2) = client(&env)?;
        let m = r2
            .map(MapOptions {
                mode: SyncMode::WriteThrough,
                spin: sp,
                ..wb
            })
            .map_err(e)?;
        let f0 = SmcStats::get(&c2.stats().faults);
        let mut one = [0u8; 1];
        // Each round a page no earlier round touched (rounds of several spin settings apart).
        let base = k * n;
        let fr = timed(&c2, n, |i| {
            m.load((base + i) * 4096 + 1, &mut one).map_err(e)?;
            std::hint::black_box(one);
            Ok(())
        })?;
        let faults = delta(&c2.stats().faults, f0);
        let med = {
            let mut v = fr.lat_us.clone();
            pct(&mut v, 0.5)
        };
        rows.push(row(
            "read fault, 4 KiB page (tcp)",
            &format!(
                "mapped load of an absent page, fault thread spin {} µs",
                sp.as_micros()
            ),
            fr,
            n,
            4096,
            &format!(
                "{faults} faults; goal median ≤ 30 µs: {}",
                if med <= 30.0 { "met" } else { "missed" }
            ),
        ));
        drop(m);
        if k == 0 {
            let mut page = vec![0u8; 4096];
            let er = timed(&c2, n, |i| r2.read((i * 4096) as u64, &mut page).map_err(e))?;
            rows.push(row(
                "read fault, 4 KiB page (tcp)",
                "explicit read() of one page (baseline: the round trip)",
                er,
                n,
                4096,
                "same request, no fault",
            ));
        }
    }
    #[cfg(feature = "rdma")]
    rdma_rows(quick, block, &mut rows)?;
    #[cfg(not(feature = "rdma"))]
    eprintln!("skip: smc over rdma: this build has no RDMA (build with --features rdma)");

    // 4. False sharing: 4 writers × 4 B per round, one page vs separate pages.
    let rounds = if quick { 100 } else { 1000 };
    for (label, stride) in [("one page", 4usize), ("separate pages", 8192)] {
        let (c3, r3) = client(&env)?;
        let m = r3.map(wb).map_err(e)?;
        prefault(&m);
        let wp0 = SmcStats::get(&c3.stats().wp_faults);
        let gate = std::sync::Barrier::new(5);
        let run = std::thread::scope(|sc| {
            for t in 0..4usize {
                let (m, gate) = (&m, &gate);
                sc.spawn(move || {
                    for i in 0..rounds {
                        gate.wait();
                        let _ = m.store((1 << 20) | (t * stride), &(i as u32).to_le_bytes());
                        gate.wait();
                    }
                });
            }
            // Every round completes for the writer threads even if a barrier fails (no stuck wait).
            let mut first_err = None;
            let r = timed(&c3, rounds, |_| {
                gate.wait();
                gate.wait();
                if let Err(x) = m.barrier() {
                    first_err.get_or_insert(x.to_string());
                }
                Ok(())
            });
            match first_err {
                Some(x) => Err(x),
                None => r,
            }
        })?;
        let wp = delta(&c3.stats().wp_faults, wp0) as f64 / rounds as f64;
        let amp = run.sent as f64 / (rounds * 16) as f64;
        let how = if m.kernel_dirty_tracking() {
            "write faults resolved by the kernel".to_string()
        } else {
            format!("{wp:.1} write-protect faults per round")
        };
        rows.push(row(
            "false sharing, 4 threads × 4 B",
            &format!("{label}, one mapping (threads)"),
            run,
            rounds,
            16,
            &format!("{amp:.0} bytes pushed per byte written; {how}"),
        ));
    }
    // Separate clients (as separate nodes would be): each writes its 4 bytes and pushes its page.
    for (label, stride) in [("one page", 4usize), ("separate pages", 8192)] {
        let base = 2usize << 20;
        let clients: Vec<_> = (0..4)
            .map(|_| client(&env))
            .collect::<Result<Vec<_>, _>>()?;
        let maps: Vec<_> = clients
            .iter()
            .map(|(_, r)| r.map(wb).map_err(e))
            .collect::<Result<Vec<_>, _>>()?;
        for m in &maps {
            m.load(base, &mut [0u8; 1]).map_err(e)?; // each caches the page(s) first
        }
        let (c0, _) = &clients[0];
        let run = timed(c0, 1, |_| {
            for (t, m) in maps.iter().enumerate() {
                m.store(base + t * stride, &[0xEE; 4]).map_err(e)?;
            }
            for m in &maps {
                m.barrier().map_err(e)?;
            }
            Ok(())
        })?;
        let mut check = vec![0u8; 4 * stride];
        clients[0].1.read(base as u64, &mut check).map_err(e)?;
        let survived = (0..4)
            .filter(|t| check[t * stride..t * stride + 4] == [0xEE; 4])
            .count();
        rows.push(row(
            "false sharing, 4 clients × 4 B",
            &format!("{label}, separate clients (nodes)"),
            run,
            1,
            16,
            &if survived == 4 {
                "4 of 4 writes survive".to_string()
            } else {
                format!(
                    "{survived} of 4 writes survive: whole pages are pushed, the last barrier wins"
                )
            },
        ));
    }
    gpu_vs_host(quick, &mut rows)?;
    print(&rows);
    Ok(rows)
}

/// The GPU to compare with host memory: `UBDIRECT_BENCH_SMC_GPU`, else GPU 0 when one is usable.
fn compare_gpu() -> Option<usize> {
    gpu().or_else(|| {
        (ubdirect_ub::cuda_driver_present() && ubdirect_ub::CudaDevice::new(0).is_ok()).then_some(0)
    })
}

/// A region in host memory and one in GPU memory, measured alternately in one run: the read
/// fault's median (goal: GPU ≤ 1.3 × host) and the 4 MiB write-back barrier against a plain
/// socket's send + ack (goal ≥ 0.8 × for both). Only where a GPU is usable.
fn gpu_vs_host(quick: bool, rows: &mut Vec<SmcRow>) -> Result<(), String> {
    let Some(ord) = compare_gpu() else {
        eprintln!("skip: smc gpu vs host region: no usable GPU");
        return Ok(());
    };
    let block: usize = 4 << 20;
    let (rounds, n, reps) = if quick { (2, 256, 5) } else { (3, 1024, 20) };
    let src: Vec<u8> = (0..block).map(|i| (i * 29 + 3) as u8).collect();
    // [host, gpu] × (fault latencies, barrier latencies); plain socket latencies.
    let mut faults = [Vec::new(), Vec::new()];
    let mut bars = [Vec::new(), Vec::new()];
    let mut plain = Vec::new();
    let mut sock = plain_socket(block)?;
    for round in 0..rounds {
        for (k, g) in [None, Some(ord)].into_iter().enumerate() {
            let env = server_in(32 << 20, None, g)?;
            let (c, r) = client(&env)?;
            let m = r
                .map(MapOptions {
                    page_size: 4096,
                    readahead: 0,
                    mode: SyncMode::WriteThrough,
                    spin: spin(),
                    ..MapOptions::default()
                })
                .map_err(e)?;
            let mut one = [0u8; 1];
            let fr = timed(&c, n, |i| {
                m.load(i * 4096 + 1, &mut one).map_err(e)?;
                std::hint::black_box(one);
                Ok(())
            })?;
            faults[k].extend(fr.lat_us);
            drop(m);
            let m = r
                .map(MapOptions {
                    page_size: 4096,
                    readahead: 0,
                    mode: SyncMode::WriteBack,
                    spin: spin(),
                    ..MapOptions::default()
                })
                .map_err(e)?;
            prefault(&m);
            let mut s2 = src.clone();
            for i in 0..reps {
                s2[0] = (i + round) as u8;
                m.store(0, &s2).map_err(e)?;
                let t = Instant::now();
                m.barrier().map_err(e)?;
                bars[k].push(t.elapsed().as_secs_f64() * 1e6);
            }
            drop(m);
            for _ in 0..reps {
                use std::io::{Read, Write};
                let t = Instant::now();
                sock.write_all(&src).map_err(e)?;
                let mut ack = [0u8; 1];
                sock.read_exact(&mut ack).map_err(e)?;
                plain.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    let med = |v: &[f64]| pct(&mut v.to_vec(), 0.5);
    let (fh, fg) = (med(&faults[0]), med(&faults[1]));
    let p = med(&plain);
    let exp = "smc: GPU vs host region (alternated)";
    let mk = |method: String, lat: Vec<f64>, reps: usize, bytes: usize, note: String| {
        row(
            exp,
            &method,
            Run {
                lat_us: lat,
                tx: 0,
                sent: 0,
            },
            reps,
            bytes,
            &note,
        )
    };
    let fault_ratio = if fh > 0.0 { fg / fh } else { 0.0 };
    rows.push(mk(
        "read fault, host region".into(),
        faults[0].clone(),
        n,
        4096,
        format!("{} faults over {rounds} rounds", faults[0].len()),
    ));
    rows.push(mk(
        format!("read fault, GPU {ord} region"),
        faults[1].clone(),
        n,
        4096,
        format!(
            "{fault_ratio:.2} × the host region's (goal ≤ 1.3: {})",
            if fault_ratio <= 1.3 { "met" } else { "missed" }
        ),
    ));
    for (k, name) in [(0, "host".to_string()), (1, format!("GPU {ord}"))] {
        let b = med(&bars[k]);
        let ratio = if b > 0.0 { p / b } else { 0.0 };
        rows.push(mk(
            format!("4 MiB barrier alone, {name} region"),
            bars[k].clone(),
            reps,
            block,
            format!(
                "{ratio:.2} × the plain socket's send + ack ({p:.0} µs; goal ≥ 0.8: {})",
                if ratio >= 0.8 { "met" } else { "missed" }
            ),
        ));
    }
    Ok(())
}

/// Touches every page (loads), so that later stores are write-protect faults, not fetches.
fn prefault(m: &ubdirect_net::smc::Mapping) {
    let mut b = [0u8; 1];
    let mut sum = 0u64;
    let mut i = 0;
    while m.load(i, &mut b).is_ok() {
        sum = sum.wrapping_add(b[0] as u64);
        i += 4096;
    }
    std::hint::black_box(sum);
}

fn print(rows: &[SmcRow]) {
    println!(
        "\n== smc: loopback TCP, real server region in {}, 4 KiB SMC pages",
        gpu().map_or("host memory".to_string(), |g| format!("GPU {g} memory"))
    );
    println!(
        "{:<34} {:<58} {:>10} {:>10} {:>8} {:>9} {:>11}  note",
        "experiment", "method", "median µs", "p99 µs", "GB/s", "txn/op", "bytes/op"
    );
    for r in rows {
        println!(
            "{:<34} {:<58} {:>10.1} {:>10.1} {:>8.3} {:>9.1} {:>11.0}  {}",
            r.experiment,
            r.method,
            r.median_us,
            r.p99_us,
            r.gbps,
            r.transactions,
            r.bytes_sent,
            r.note
        );
    }
}

/// SMC over RDMA (a device present, e.g. Soft-RoCE in the test guest): read faults as one-sided
/// READs into the mapping's registered staging block against an explicit read's request, and the
/// 4 MiB write-back barrier as one-sided WRITEs from the registered push block.
#[cfg(feature = "rdma")]
fn rdma_rows(quick: bool, block: usize, rows: &mut Vec<SmcRow>) -> Result<(), String> {
    use ubdirect_net::rdma::{Rdma, RdmaConfig};
    use ubdirect_net::transport::RdmaTransport;
    let dev = match ubdirect_net::rdma::device_names() {
        Ok(d) if !d.is_empty() => d[0].clone(),
        _ => {
            eprintln!("skip: smc over rdma: no RDMA device on this machine");
            return Ok(());
        }
    };
    let env = server_on(32 << 20, Some(dev.clone()))?;
    let rdma = Rdma::open(&RdmaConfig {
        device: dev.clone(),
        gid_index: None,
    })
    .map_err(e)?;
    let c = SmcClient::with_transport(
        env.server.local_addr(),
        TOKEN,
        SmcOptions {
            deadline: Duration::from_secs(10),
            retries: 1,
        },
        std::sync::Arc::new(RdmaTransport::new(rdma.clone())),
    );
    let r = c.register("bench", KEY).map_err(e)?;
    let label = format!("read fault, 4 KiB page (rdma {dev})");
    let n = if quick { 256 } else { 2048 };
    let m = r
        .map(MapOptions {
            page_size: 4096,
            readahead: 0,
            mode: SyncMode::WriteThrough,
            spin: spin(),
            ..MapOptions::default()
        })
        .map_err(e)?;
    let reads0 = rdma
        .stats()
        .reads
        .load(std::sync::atomic::Ordering::Relaxed);
    let mut one = [0u8; 1];
    let fr = timed(&c, n, |i| {
        m.load(i * 4096 + 1, &mut one).map_err(e)?;
        std::hint::black_box(one);
        Ok(())
    })?;
    let reads = rdma
        .stats()
        .reads
        .load(std::sync::atomic::Ordering::Relaxed)
        - reads0;
    rows.push(row(
        &label,
        &format!(
            "mapped load of an absent page (one-sided RDMA READ), spin {} µs",
            spin().as_micros()
        ),
        fr,
        n,
        4096,
        &format!("{reads} RDMA READs"),
    ));
    drop(m);
    let mut page = vec![0u8; 4096];
    let er = timed(&c, n, |i| r.read((i * 4096) as u64, &mut page).map_err(e))?;
    rows.push(row(
        &label,
        "explicit read() of one page (a request on the connection)",
        er,
        n,
        4096,
        "same page size, request + reply",
    ));
    // The write-back barrier: 4 MiB of dirty pages, written one-sided.
    let reps = if quick { 5 } else { 20 };
    let m = r
        .map(MapOptions {
            page_size: 4096,
            readahead: 0,
            mode: SyncMode::WriteBack,
            spin: spin(),
            ..MapOptions::default()
        })
        .map_err(e)?;
    prefault(&m);
    let mut src: Vec<u8> = (0..block).map(|i| (i * 13 + 1) as u8).collect();
    let w0 = rdma
        .stats()
        .writes
        .load(std::sync::atomic::Ordering::Relaxed);
    let mut bar = Vec::with_capacity(reps);
    let cc = timed(&c, reps, |i| {
        src[0] = i as u8;
        m.store(0, &src).map_err(e)?;
        let t = Instant::now();
        m.barrier().map(|_| ()).map_err(e)?;
        bar.push(t.elapsed().as_secs_f64() * 1e6);
        Ok(())
    })?;
    let writes = rdma
        .stats()
        .writes
        .load(std::sync::atomic::Ordering::Relaxed)
        - w0;
    // What the region holds now is what was stored last.
    let mut back = vec![0u8; block];
    r.read(0, &mut back).map_err(e)?;
    if back != src {
        return Err("smc over rdma: the region differs from the last barrier's pages".into());
    }
    let tx = cc.tx;
    rows.push(row(
        &format!("4 MiB block sync (rdma {dev})"),
        "(c') the barrier alone: one-sided RDMA WRITEs",
        Run {
            lat_us: bar,
            tx,
            sent: (block * reps) as u64,
        },
        reps,
        block,
        &format!("{writes} RDMA WRITEs over {reps} barriers; region checked after"),
    ));
    Ok(())
}
