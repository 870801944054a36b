//! SMC on loopback against a real `Server`: mapped stores from many threads, a barrier, and a fresh
//! client that sees exactly those bytes; only dirty pages travel; read-only tokens cannot write; a
//! peer that dies or goes silent gives an error within the deadline, and a mapped access SIGBUS.
//! Needs userfaultfd (root, as CI runs).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ubdirect_net::smc::{MapOptions, SmcClient, SmcError, SmcOptions, SmcStats, SyncMode};
use ubdirect_net::{RegionConfig, Server, ServerConfig};

const TOKEN: &str = "smc-test-token-rw";
const RO: &str = "smc-test-token-ro";
const KEY: &str = "region-key-1234";
const SIZE: u64 = 4 << 20;

fn start(rt: &tokio::runtime::Runtime, addr: SocketAddr) -> Server {
    rt.block_on(Server::start(ServerConfig {
        listen: addr,
        token: TOKEN.into(),
        read_only_tokens: vec![RO.into()],
        roots: vec![],
        max_request: 1 << 20,
        blocks: 2,
        regions: vec![RegionConfig {
            name: "kv".into(),
            size: SIZE,
            key: KEY.into(),
            writable: true,
            // UBDIRECT_TEST_SMC_GPU=0: the same suite against a region in GPU memory.
            gpu: std::env::var("UBDIRECT_TEST_SMC_GPU")
                .ok()
                .and_then(|v| v.parse().ok()),
        }],
        ..ServerConfig::default()
    }))
    .unwrap()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn opts() -> SmcOptions {
    SmcOptions {
        deadline: Duration::from_millis(500),
        retries: 2,
    }
}

#[test]
fn many_threads_store_then_barrier_then_a_fresh_client_sees_exactly_those_bytes() {
    // Dirty pages tracked by the kernel (WP_ASYNC + PAGEMAP_SCAN), then by write-protect faults.
    many_threads(true);
    many_threads(false);
}

fn many_threads(wp_async: bool) {
    let rt = rt();
    let s = start(&rt, "127.0.0.1:0".parse().unwrap());
    let c = SmcClient::new(s.local_addr(), TOKEN, opts());
    let r = c.register("kv", KEY).unwrap();
    assert_eq!((r.size(), r.writable()), (SIZE, true));
    // Registering again is free: no second descriptor fetch.
    let tx = SmcStats::get(&c.stats().transactions);
    let _again = c.register("kv", KEY).unwrap();
    assert_eq!(SmcStats::get(&c.stats().transactions), tx);
    assert_eq!(SmcStats::get(&c.stats().registrations), 1);
    let m = r
        .map(MapOptions {
            page_size: 4096,
            readahead: 0,
            mode: SyncMode::WriteBack,
            wp_async,
            ..MapOptions::default()
        })
        .unwrap();
    if wp_async {
        assert!(m.kernel_dirty_tracking(), "Linux >= 6.7 has WP_ASYNC");
    }
    // 8 threads, each 200 stores of 1..=300 bytes at offsets of its own stripe; some threads share
    // pages (stripes are 1000 bytes apart inside the same 64 KiB windows).
    let mut expected = vec![0u8; SIZE as usize];
    let mut plan = Vec::new();
    for t in 0..8u64 {
        let mut ops = Vec::new();
        let mut x = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for _ in 0..200 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let window = (x % 60) * 65536;
            let off = window + t * 1000 + (x >> 20) % 700;
            let len = 1 + (x >> 40) as usize % 300;
            let bytes: Vec<u8> = (0..len).map(|i| (x as usize + i) as u8).collect();
            ops.push((off as usize, bytes));
        }
        plan.push(ops);
    }
    // Expected: per thread in order (stripes do not overlap between threads).
    for ops in &plan {
        for (off, b) in ops {
            expected[*off..*off + b.len()].copy_from_slice(b);
        }
    }
    let mut pages = std::collections::BTreeSet::new();
    for ops in &plan {
        for (off, b) in ops {
            for p in off / 4096..=(off + b.len() - 1) / 4096 {
                pages.insert(p);
            }
        }
    }
    std::thread::scope(|sc| {
        for ops in &plan {
            let m = &m;
            sc.spawn(move || {
                for (off, b) in ops {
                    m.store(*off, b).unwrap();
                }
            });
        }
    });
    if !wp_async {
        assert_eq!(m.dirty_pages(), pages.len());
    }
    let b = m.barrier().unwrap();
    assert_eq!(b.pages, pages.len(), "every dirty page, only once");
    assert!(b.transfers <= b.pages && b.transfers >= 1);
    assert!(b.transactions <= b.transfers && b.transactions >= 1);
    assert_eq!(b.bytes, pages.len() * 4096);
    // Only dirty pages travelled.
    assert_eq!(
        s.stats().smc_bytes_written.load(Ordering::Relaxed),
        (pages.len() * 4096) as u64
    );
    // A fresh client (new connection, new registration) sees exactly the bytes written.
    let fresh = SmcClient::new(s.local_addr(), RO, opts());
    let fr = fresh.register("kv", KEY).unwrap();
    let mut got = vec![0u8; SIZE as usize];
    fr.read(0, &mut got).unwrap();
    assert!(got == expected, "remote bytes differ from what was stored");
    // And so does a fresh mapping of it (faults fetch the pages).
    let fm = fr.map(MapOptions::default()).unwrap();
    assert!(fm.as_slice() == &expected[..]);
    assert_eq!(
        SmcStats::get(&fresh.stats().faults),
        (SIZE / 4096),
        "one fault per page"
    );
}

#[test]
fn only_dirty_pages_travel_and_adjacent_pages_merge() {
    let rt = rt();
    let s = start(&rt, "127.0.0.1:0".parse().unwrap());
    let c = SmcClient::new(s.local_addr(), TOKEN, opts());
    let r = c.register("kv", KEY).unwrap();
    let m = r
        .map(MapOptions {
            page_size: 16384,
            readahead: 3,
            mode: SyncMode::WriteBack,
            ..MapOptions::default()
        })
        .unwrap();
    // Read-ahead: touching page 0 fetches pages 0..=3 in one request.
    assert_eq!(m.as_slice()[5], 0);
    assert_eq!(SmcStats::get(&c.stats().faults), 1);
    assert_eq!(SmcStats::get(&c.stats().bytes_fetched), 4 * 16384);
    // Pages 1 and 2 (adjacent) and 10: three dirty pages, two transfers.
    m.store(16384 + 5, b"one").unwrap();
    m.store(2 * 16384 + 7, b"two").unwrap();
    m.store(10 * 16384, b"ten").unwrap();
    m.store(10 * 16384 + 100, b"ten again").unwrap();
    let b = m.barrier().unwrap();
    assert_eq!(
        (b.pages, b.transfers, b.transactions, b.bytes),
        (3, 2, 1, 3 * 16384)
    );
    assert_eq!(s.stats().smc_writes.load(Ordering::Relaxed), 1);
    assert_eq!(
        s.stats().smc_bytes_written.load(Ordering::Relaxed),
        3 * 16384
    );
    // Nothing dirty: a barrier sends nothing.
    assert_eq!(m.barrier().unwrap().pages, 0);
    assert_eq!(s.stats().smc_writes.load(Ordering::Relaxed), 1);
    // Pages are write-protected again after the barrier: a new store is caught.
    m.store(10 * 16384 + 1, b"X").unwrap();
    assert_eq!(m.barrier().unwrap().pages, 1);
    let mut v = [0u8; 3];
    r.read(10 * 16384, &mut v).unwrap();
    assert_eq!(&v, b"tXn");
    // Write-through: returns after the ack; the server has it at once.
    r.write(123_456, b"through").unwrap();
    let mut w = [0u8; 7];
    SmcClient::new(s.local_addr(), TOKEN, opts())
        .register("kv", KEY)
        .unwrap()
        .read(123_456, &mut w)
        .unwrap();
    assert_eq!(&w, b"through");
}

#[test]
fn read_only_tokens_and_wrong_keys_are_refused() {
    let rt = rt();
    let s = start(&rt, "127.0.0.1:0".parse().unwrap());
    let ro = SmcClient::new(s.local_addr(), RO, opts());
    let r = ro.register("kv", KEY).unwrap();
    assert!(!r.writable());
    assert!(matches!(r.write(0, b"x"), Err(SmcError::ReadOnly { .. })));
    let m = r.map(MapOptions::default()).unwrap();
    assert!(matches!(m.store(0, b"x"), Err(SmcError::ReadOnly { .. })));
    assert_eq!(m.as_slice()[0], 0);
    // The server enforces it too: a raw SmcWrite on a read-only registration is refused.
    {
        use std::io::{Read, Write};
        use ubdirect_net::proto::{HEADER, Header, Msg};
        let mut sock = std::net::TcpStream::connect(s.local_addr()).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let reply = |sock: &mut std::net::TcpStream, m: Msg| {
            sock.write_all(&m.frame(1)).unwrap();
            let mut h = [0u8; HEADER];
            sock.read_exact(&mut h).unwrap();
            let h = Header::decode(&h, 1 << 20).unwrap();
            let mut p = vec![0u8; h.len as usize];
            sock.read_exact(&mut p).unwrap();
            Msg::decode(h.kind, &p).unwrap()
        };
        reply(&mut sock, Msg::Hello { token: RO.into() });
        let open = reply(
            &mut sock,
            Msg::SmcOpen {
                name: "kv".into(),
                key: KEY.into(),
            },
        );
        assert!(matches!(
            open,
            Msg::SmcOpenOk {
                writable: false,
                ..
            }
        ));
        let w = reply(
            &mut sock,
            Msg::SmcWrite {
                region: 0,
                offset: 0,
                data: vec![1; 8],
            },
        );
        assert!(matches!(w, Msg::Error { code: 3, .. }), "{w:?}");
    }
    assert_eq!(s.stats().smc_writes.load(Ordering::Relaxed), 0);
    // Wrong key, unknown region, wrong token: refused, typed.
    let c = SmcClient::new(s.local_addr(), TOKEN, opts());
    assert!(matches!(
        c.register("kv", "wrong-key-0000"),
        Err(SmcError::Refused { code: 1, .. })
    ));
    assert!(matches!(
        c.register("nope", KEY),
        Err(SmcError::Refused { code: 1, .. })
    ));
    let bad = SmcClient::new(s.local_addr(), "not-a-token", opts());
    assert!(bad.register("kv", KEY).is_err());
    // Out of range: typed, no request sent.
    let r = c.register("kv", KEY).unwrap();
    assert!(matches!(
        r.read(SIZE - 1, &mut [0u8; 2]),
        Err(SmcError::Range { .. })
    ));
}

/// Within the deadline: `retries + 1` attempts of `deadline` each, plus slack for a loaded machine.
fn bound() -> Duration {
    let o = opts();
    o.deadline * (o.retries + 1) + Duration::from_secs(3)
}

#[test]
fn a_silent_or_dead_peer_is_an_error_within_the_deadline() {
    let rt = rt();
    let s = start(&rt, "127.0.0.1:0".parse().unwrap());
    let addr = s.local_addr();
    let c = SmcClient::new(addr, TOKEN, opts());
    let r = c.register("kv", KEY).unwrap();
    let m = r.map(MapOptions::default()).unwrap();
    m.store(0, b"dirty").unwrap();
    // The server dies; a listener takes its address and never answers (a hung peer).
    s.shutdown();
    std::thread::sleep(Duration::from_millis(100));
    let silent = std::net::TcpListener::bind(addr).unwrap();
    let _holder = std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in silent.incoming().flatten() {
            held.push(s);
        }
    });
    // A barrier during the outage: error within the deadline, not a hang.
    let t = Instant::now();
    let e = m.barrier().unwrap_err();
    assert!(matches!(e, SmcError::Unavailable { .. }), "{e}");
    assert!(t.elapsed() < bound(), "barrier took {:?}", t.elapsed());
    assert!(SmcStats::get(&c.stats().retries) >= opts().retries as u64);
    // The region is marked unavailable: further calls fail at once.
    let t = Instant::now();
    assert!(matches!(
        r.read(0, &mut [0u8; 16]),
        Err(SmcError::Unavailable { .. })
    ));
    assert!(t.elapsed() < Duration::from_millis(100));
}

/// Run by `a_mapped_access_to_a_dead_peer_raises_sigbus` in a child process.
#[test]
fn sigbus_child() {
    let Ok(port) = std::env::var("UBDIRECT_SMC_SIGBUS_CHILD") else {
        return; // only meaningful as the child
    };
    let rt = rt();
    let s = start(&rt, format!("127.0.0.1:{port}").parse().unwrap());
    let c = SmcClient::new(s.local_addr(), TOKEN, opts());
    let m = c
        .register("kv", KEY)
        .unwrap()
        .map(MapOptions {
            wp_async: std::env::var("UBDIRECT_SMC_WP_ASYNC").is_ok_and(|v| v == "1"),
            ..MapOptions::default()
        })
        .unwrap();
    assert_eq!(m.as_slice()[0], 0); // page 0 fetched
    let addr = s.local_addr();
    s.shutdown();
    // Aborting the server's tasks is asynchronous: let its connections close.
    std::thread::sleep(Duration::from_millis(300));
    if std::env::var("UBDIRECT_SMC_CHILD_SILENT").is_ok_and(|v| v == "1") {
        // A hung peer instead of a dead one: connections are accepted, nothing is ever answered.
        let silent = std::net::TcpListener::bind(addr).unwrap();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for s in silent.incoming().flatten() {
                held.push(s);
            }
        });
    }
    eprintln!("CHILD: server down, touching an unfetched page");
    let v = m.as_slice()[8192]; // page 2: the fault cannot be served → SIGBUS
    eprintln!("CHILD: survived with {v}");
    std::process::exit(3);
}

#[test]
fn a_mapped_access_to_a_dead_peer_raises_sigbus() {
    // Dead server and hung server; kernel and fault-tracked write protection.
    sigbus(true, false);
    sigbus(false, true);
}

fn sigbus(wp_async: bool, silent: bool) {
    use std::os::unix::process::ExitStatusExt;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t = Instant::now();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "sigbus_child", "--nocapture", "--test-threads=1"])
        .env("UBDIRECT_SMC_SIGBUS_CHILD", port.to_string())
        .env("UBDIRECT_SMC_WP_ASYNC", if wp_async { "1" } else { "" })
        .env("UBDIRECT_SMC_CHILD_SILENT", if silent { "1" } else { "" })
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t.elapsed() > bound() + Duration::from_secs(5) {
            let _ = child.kill();
            panic!("the child hung on a fault to a dead server");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(status.signal(), Some(libc_sigbus()), "{status:?}: {err}");
    assert!(err.contains("server down"), "{err}");
}

fn libc_sigbus() -> i32 {
    7 // SIGBUS on x86_64 and aarch64 Linux
}

#[test]
fn a_gpu_region_without_a_gpu_is_a_clear_error() {
    if ubdirect_ub::cuda_driver_present() {
        return; // covered by running this suite with UBDIRECT_TEST_SMC_GPU on the GPU machine
    }
    let rt = rt();
    let e = rt
        .block_on(Server::start(ServerConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            token: TOKEN.into(),
            regions: vec![RegionConfig {
                name: "g".into(),
                size: 1 << 20,
                key: KEY.into(),
                writable: true,
                gpu: Some(0),
            }],
            ..ServerConfig::default()
        }))
        .unwrap_err();
    assert!(e.to_string().contains("region \"g\" on gpu 0"), "{e}");
}

#[test]
fn two_mib_smc_pages_fetch_and_push_whole_pages() {
    let rt = rt();
    let s = start(&rt, "127.0.0.1:0".parse().unwrap());
    let c = SmcClient::new(s.local_addr(), TOKEN, opts());
    let r = c.register("kv", KEY).unwrap();
    r.write(3 << 20, b"remote").unwrap();
    let m = r
        .map(MapOptions {
            page_size: 2 << 20,
            ..MapOptions::default()
        })
        .unwrap();
    // One fault fetches the whole 2 MiB SMC page holding the byte.
    assert_eq!(&m.as_slice()[3 << 20..(3 << 20) + 6], b"remote");
    assert_eq!(SmcStats::get(&c.stats().faults), 1);
    assert_eq!(SmcStats::get(&c.stats().bytes_fetched), 2 << 20);
    // A 1-byte store dirties the whole SMC page: the barrier pushes all 2 MiB of it, in pieces no
    // larger than the server's max_request (1 MiB here).
    m.store((2 << 20) + 1, b"x").unwrap();
    let b = m.flush().unwrap();
    assert_eq!((b.pages, b.bytes), (1, 2 << 20));
    assert!(b.transactions >= 2, "{b:?}");
    assert_eq!(
        s.stats().smc_bytes_written.load(Ordering::Relaxed),
        (2 << 20) + 6
    );
    let mut v = [0u8; 6];
    r.read(3 << 20, &mut v).unwrap();
    assert_eq!(&v, b"remote");
    // A page size that is not a power of two in 4 KiB ..= 2 MiB is refused.
    assert!(matches!(
        r.map(MapOptions {
            page_size: 4 << 20,
            ..MapOptions::default()
        }),
        Err(SmcError::Map { .. })
    ));
}
