//! SMC on loopback against a real `Server`: mapped stores from many threads, a barrier, and a fresh
//! client that sees exactly those bytes; only dirty pages travel; read-only tokens cannot write; a
//! peer that dies or goes silent gives an error within the deadline, and a mapped access SIGBUS.
//! Needs userfaultfd (root, as CI runs). One suite for every transport: `UBDIRECT_TEST_TRANSPORT=tcp`
//! (default) or `rdma` (a build with `--features rdma` on a machine with an RDMA device: the QEMU
//! guest's Soft-RoCE, `nvme/tests/guest/run.sh`), where faults are RDMA READs and barriers RDMA
//! WRITEs into the region's memory.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ubdirect_net::proto::Code;
use ubdirect_net::smc::{MapOptions, Mapping, SmcClient, SmcError, SmcOptions, SmcStats, SyncMode};
use ubdirect_net::{RegionConfig, Server, ServerConfig, Transport};

const TOKEN: &str = "smc-test-token-rw";
const RO: &str = "smc-test-token-ro";
const KEY: &str = "region-key-1234";
const SIZE: u64 = 4 << 20;

fn transport_name() -> String {
    std::env::var("UBDIRECT_TEST_TRANSPORT").unwrap_or_else(|_| "tcp".into())
}

fn rdma() -> bool {
    transport_name() == "rdma"
}

/// The transport under test (one device per process for RDMA).
fn transport() -> Arc<dyn Transport> {
    match transport_name().as_str() {
        "tcp" => Arc::new(ubdirect_net::Tcp),
        #[cfg(feature = "rdma")]
        "rdma" => Arc::new(ubdirect_net::transport::RdmaTransport::new(
            rdma_dev().clone(),
        )),
        t => panic!("UBDIRECT_TEST_TRANSPORT={t}: not a transport of this build"),
    }
}

#[cfg(feature = "rdma")]
fn rdma_dev() -> &'static ubdirect_net::rdma::Rdma {
    static R: std::sync::OnceLock<ubdirect_net::rdma::Rdma> = std::sync::OnceLock::new();
    R.get_or_init(|| {
        ubdirect_net::rdma::Rdma::open(&Default::default())
            .unwrap_or_else(|e| panic!("UBDIRECT_TEST_TRANSPORT=rdma: {e}"))
    })
}

/// (RDMA WRITEs, bytes) this process wrote one-sided so far (0 on TCP).
fn one_sided_written() -> (u64, u64) {
    #[cfg(feature = "rdma")]
    if rdma() {
        let st = rdma_dev().stats();
        return (
            st.writes.load(Ordering::Relaxed),
            st.bytes.load(Ordering::Relaxed),
        );
    }
    (0, 0)
}

/// Bytes that reached the server's regions from barriers and writes since `base`
/// ([`one_sided_written`] then): received as requests (the server counts them) plus, over RDMA,
/// written one-sided (the client's device counts them; the server never sees them).
fn pushed_bytes(s: &Server, base: (u64, u64)) -> u64 {
    s.stats().smc_bytes_written.load(Ordering::Relaxed) + (one_sided_written().1 - base.1)
}

fn smc_client(addr: SocketAddr, token: &str, opts: SmcOptions) -> SmcClient {
    SmcClient::with_transport(addr, token, opts, transport())
}

/// The suite's server: one 4 MiB region `kv`, small staging (the QEMU guest has 1 GiB), RDMA when
/// the suite runs over it.
fn config(addr: SocketAddr) -> ServerConfig {
    ServerConfig {
        listen: addr,
        token: TOKEN.into(),
        read_only_tokens: vec![RO.into()],
        roots: vec![],
        max_request: 1 << 20,
        blocks: 2,
        rdma_device: rdma().then(String::new),
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
    }
}

fn start(rt: &tokio::runtime::Runtime, addr: SocketAddr) -> Server {
    rt.block_on(Server::start(config(addr))).unwrap()
}

/// Whether the running kernel is at least `major.minor` (the QEMU guest runs 6.1: no WP_ASYNC).
fn kernel_at_least(major: u32, minor: u32) -> bool {
    let r = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut it = r
        .trim()
        .split(['.', '-'])
        .map(|x| x.parse::<u32>().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0)) >= (major, minor)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// One byte of a mapping (a mapped load: it faults the page in).
fn byte(m: &Mapping, off: usize) -> u8 {
    let mut b = [0u8; 1];
    m.load(off, &mut b).unwrap();
    b[0]
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
    let base = one_sided_written();
    let c = smc_client(s.local_addr(), TOKEN, opts());
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
    if wp_async && kernel_at_least(6, 7) {
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
    assert_eq!(pushed_bytes(&s, base), (pages.len() * 4096) as u64);
    // A fresh client (new connection, new registration) sees exactly the bytes written.
    let fresh = smc_client(s.local_addr(), RO, opts());
    let fr = fresh.register("kv", KEY).unwrap();
    let mut got = vec![0u8; SIZE as usize];
    fr.read(0, &mut got).unwrap();
    assert!(got == expected, "remote bytes differ from what was stored");
    // And so does a fresh mapping of it (faults fetch the pages).
    let fm = fr.map(MapOptions::default()).unwrap();
    let mut mapped = vec![0u8; SIZE as usize];
    fm.load(0, &mut mapped).unwrap();
    assert!(mapped == expected);
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
    let base = one_sided_written();
    let c = smc_client(s.local_addr(), TOKEN, opts());
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
    assert_eq!(byte(&m, 5), 0);
    assert_eq!(SmcStats::get(&c.stats().faults), 1);
    assert_eq!(SmcStats::get(&c.stats().bytes_fetched), 4 * 16384);
    // Pages 1 and 2 (adjacent) and 10: three dirty pages, two transfers.
    m.store(16384 + 5, b"one").unwrap();
    m.store(2 * 16384 + 7, b"two").unwrap();
    m.store(10 * 16384, b"ten").unwrap();
    m.store(10 * 16384 + 100, b"ten again").unwrap();
    let b = m.barrier().unwrap();
    // Over TCP the two runs go in one vectored request; over RDMA each run is one WRITE.
    let (tx, requests, writes) = if rdma() { (2, 0, 2) } else { (1, 1, 0) };
    assert_eq!(
        (b.pages, b.transfers, b.transactions, b.bytes),
        (3, 2, tx, 3 * 16384)
    );
    assert_eq!(s.stats().smc_writes.load(Ordering::Relaxed), requests);
    assert_eq!(one_sided_written().0 - base.0, writes);
    assert_eq!(pushed_bytes(&s, base), 3 * 16384);
    // Nothing dirty: a barrier sends nothing.
    assert_eq!(m.barrier().unwrap().pages, 0);
    assert_eq!(s.stats().smc_writes.load(Ordering::Relaxed), requests);
    assert_eq!(one_sided_written().0 - base.0, writes);
    // Pages are write-protected again after the barrier: a new store is caught.
    m.store(10 * 16384 + 1, b"X").unwrap();
    assert_eq!(m.barrier().unwrap().pages, 1);
    let mut v = [0u8; 3];
    r.read(10 * 16384, &mut v).unwrap();
    assert_eq!(&v, b"tXn");
    // Write-through: returns after the ack; the server has it at once.
    r.write(123_456, b"through").unwrap();
    let mut w = [0u8; 7];
    smc_client(s.local_addr(), TOKEN, opts())
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
    let ro = smc_client(s.local_addr(), RO, opts());
    let r = ro.register("kv", KEY).unwrap();
    assert!(!r.writable());
    assert!(matches!(r.write(0, b"x"), Err(SmcError::ReadOnly { .. })));
    let m = r.map(MapOptions::default()).unwrap();
    assert!(matches!(m.store(0, b"x"), Err(SmcError::ReadOnly { .. })));
    assert_eq!(byte(&m, 0), 0);
    // The server enforces it too: a raw SmcWrite on a read-only registration is refused.
    {
        use tokio::io::AsyncWriteExt;
        use ubdirect_net::proto::{Msg, read_frame};
        let mut sock = rt
            .block_on(tokio::net::TcpStream::connect(s.local_addr()))
            .unwrap();
        let reply = |sock: &mut tokio::net::TcpStream, m: Msg| {
            rt.block_on(async {
                sock.write_all(&m.frame(1)).await.unwrap();
                let t = Duration::from_secs(5);
                let (h, p) = read_frame(sock, 1 << 20, t, t).await.unwrap();
                Msg::decode(h.kind, &p).unwrap()
            })
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
        assert!(
            matches!(
                w,
                Msg::Error {
                    code: Code::Forbidden,
                    ..
                }
            ),
            "{w:?}"
        );
    }
    assert_eq!(s.stats().smc_writes.load(Ordering::Relaxed), 0);
    // Wrong key, unknown region, wrong token: refused, typed.
    let c = smc_client(s.local_addr(), TOKEN, opts());
    assert!(matches!(
        c.register("kv", "wrong-key-0000"),
        Err(SmcError::Refused {
            code: Code::Auth,
            ..
        })
    ));
    assert!(matches!(
        c.register("nope", KEY),
        Err(SmcError::Refused {
            code: Code::Auth,
            ..
        })
    ));
    let bad = smc_client(s.local_addr(), "not-a-token", opts());
    // A wrong token is a refusal at once (not retried until the region is unavailable).
    assert!(matches!(
        bad.register("kv", KEY),
        Err(SmcError::Refused {
            code: Code::Auth,
            ..
        })
    ));
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
    let c = smc_client(addr, TOKEN, opts());
    let r = c.register("kv", KEY).unwrap();
    let m = r.map(MapOptions::default()).unwrap();
    m.store(0, b"dirty").unwrap();
    // The server dies; a listener takes its address and never answers (a hung peer).
    s.shutdown();
    // Dropping the runtime returns once its tasks are dropped: the listener is closed.
    drop(rt);
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
    // The last transport failure is kept, typed, as the source.
    assert!(
        std::error::Error::source(&e)
            .is_some_and(|s| s.downcast_ref::<ubdirect_net::LinkError>().is_some()),
        "{e:?}"
    );
    assert!(t.elapsed() < bound(), "barrier took {:?}", t.elapsed());
    assert!(SmcStats::get(&c.stats().retries) >= opts().retries as u64);
    // The region is marked unavailable: further calls fail at once, without a connect or a retry
    // (the retry counter stays; the time bound is one deadline, which a wait would take at least).
    let retries = SmcStats::get(&c.stats().retries);
    let t = Instant::now();
    assert!(matches!(
        r.read(0, &mut [0u8; 16]),
        Err(SmcError::Unavailable { .. })
    ));
    assert_eq!(SmcStats::get(&c.stats().retries), retries);
    assert!(t.elapsed() < opts().deadline, "{:?}", t.elapsed());
}

/// Set in a child process started by [`child`]: which scenario it runs.
const CHILD: &str = "UBDIRECT_SMC_CHILD";

/// Runs this test binary again, as a child that runs only `test` with [`CHILD`] = `scenario` (stdin
/// from /dev/null, so descriptor 0 is open), and returns how it ended and its stderr. A child that
/// neither ends nor signals within the deadline is killed and fails the test.
fn child(test: &str, scenario: &str) -> (std::process::ExitStatus, String) {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD, scenario)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = c.stderr.take().unwrap();
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    // Polls the child's state until it ends or the deadline passes.
    let deadline = Instant::now() + bound() + Duration::from_secs(5);
    let status = loop {
        if let Some(st) = c.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            let _ = c.wait();
            panic!(
                "child {scenario:?} hung: {}",
                err.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (status, err.join().unwrap())
}

/// The scenario this process runs as a child, if it is one.
fn scenario() -> Option<String> {
    std::env::var(CHILD).ok()
}

/// Lowest descriptor number free now: every one below it is open (the kernel hands out the lowest).
fn lowest_free_fd() -> i32 {
    use std::os::fd::AsRawFd;
    std::fs::File::open("/dev/null").unwrap().as_raw_fd() // closed again at once
}

/// Sets the soft RLIMIT_NOFILE: with `n` = [`lowest_free_fd`], no new descriptor can be made; with
/// `n + 1`, exactly one.
fn set_nofile(n: i32) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid resource and a live struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur = n as libc::rlim_t;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
    }
}

/// Child: maps a region, fetches page 0, kills the server (or replaces it by a silent listener), then
/// touches page 2, which the fault thread cannot fetch: the process must die of a signal.
/// `no_fds`: no descriptor can be made any more (so the SIGBUS memfd cannot be either).
fn dead_peer_child(wp_async: bool, silent: bool, no_fds: bool) -> ! {
    let rt = rt();
    let s = start(&rt, "127.0.0.1:0".parse().unwrap());
    let c = smc_client(s.local_addr(), TOKEN, opts());
    let m = c
        .register("kv", KEY)
        .unwrap()
        .map(MapOptions {
            wp_async,
            ..MapOptions::default()
        })
        .unwrap();
    assert_eq!(byte(&m, 0), 0); // page 0 fetched
    let addr = s.local_addr();
    s.shutdown();
    // Dropping the runtime returns once its tasks are dropped: the server's sockets are closed.
    drop(rt);
    if silent {
        // A hung peer instead of a dead one: connections are accepted, nothing is ever answered.
        let silent = std::net::TcpListener::bind(addr).unwrap();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for s in silent.incoming().flatten() {
                held.push(s);
            }
        });
    }
    if no_fds {
        set_nofile(lowest_free_fd());
    }
    eprintln!("CHILD: server down, touching an unfetched page");
    let mut v = [0u8; 1];
    // Page 2: the fault cannot be served → a signal.
    let r = m.load(8192, &mut v);
    eprintln!("CHILD: survived with {r:?} {v:?}");
    std::process::exit(3);
}

#[test]
fn a_mapped_access_to_a_dead_peer_raises_sigbus() {
    use std::os::unix::process::ExitStatusExt;
    let test = "a_mapped_access_to_a_dead_peer_raises_sigbus";
    // Dead server and hung server; kernel and fault-tracked write protection.
    match scenario().as_deref() {
        Some("dead") => dead_peer_child(true, false, false),
        Some("silent") => dead_peer_child(false, true, false),
        _ => {}
    }
    for sc in ["dead", "silent"] {
        let (status, err) = child(test, sc);
        assert_eq!(
            status.signal(),
            Some(libc::SIGBUS),
            "{sc}: {status:?}: {err}"
        );
        assert!(err.contains("server down"), "{err}");
    }
}

/// `poison()` cannot make its SIGBUS memfd (no descriptor left): the mapping is made inaccessible
/// instead, so the access raises SIGSEGV rather than hanging.
#[test]
fn an_unavailable_region_signals_even_when_no_descriptor_is_left() {
    use std::os::unix::process::ExitStatusExt;
    if scenario().as_deref() == Some("no-fds") {
        dead_peer_child(false, false, true);
    }
    let (status, err) = child(
        "an_unavailable_region_signals_even_when_no_descriptor_is_left",
        "no-fds",
    );
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}: {err}");
    assert!(err.contains("server down"), "{err}");
}

/// A failed `eventfd` while mapping is an error that closes only what the mapping opened (it once
/// closed descriptor 0, stdin).
#[test]
fn a_failed_eventfd_is_an_error_and_leaves_stdin_open() {
    let test = "a_failed_eventfd_is_an_error_and_leaves_stdin_open";
    if scenario().as_deref() == Some("eventfd") {
        let rt = rt();
        let s = start(&rt, "127.0.0.1:0".parse().unwrap());
        let r = smc_client(s.local_addr(), TOKEN, opts())
            .register("kv", KEY)
            .unwrap();
        // SAFETY: fcntl(F_GETFD) only queries descriptor flags.
        assert!(unsafe { libc::fcntl(0, libc::F_GETFD) } >= 0, "stdin open");
        // One descriptor left: userfaultfd gets it, eventfd fails with EMFILE.
        let free = lowest_free_fd();
        set_nofile(free + 1);
        let e = r.map(MapOptions::default()).unwrap_err();
        set_nofile(free + 64);
        assert!(
            matches!(&e, SmcError::Map { why, .. } if why.contains("eventfd")),
            "{e}"
        );
        assert!(
            // SAFETY: as above.
            unsafe { libc::fcntl(0, libc::F_GETFD) } >= 0,
            "stdin closed by {e}"
        );
        // The descriptors the failed map opened are closed again: the same one is free.
        assert_eq!(lowest_free_fd(), free);
        // And mapping works again once descriptors are available.
        assert_eq!(byte(&r.map(MapOptions::default()).unwrap(), 0), 0);
        return;
    }
    let (status, err) = child(test, "eventfd");
    assert!(status.success(), "{status:?}: {err}");
}

/// Loads copy the bytes as they are now: a reader polling a page that another thread keeps storing
/// to sees every byte only move forward, and finally the last value stored.
#[test]
fn loads_see_concurrent_stores() {
    let rt = rt();
    let s = start(&rt, "127.0.0.1:0".parse().unwrap());
    let r = smc_client(s.local_addr(), TOKEN, opts())
        .register("kv", KEY)
        .unwrap();
    let m = r
        .map(MapOptions {
            mode: SyncMode::WriteBack,
            ..MapOptions::default()
        })
        .unwrap();
    const LEN: usize = 3 * 4096 + 13; // unaligned at both ends, across pages
    const AT: usize = 4096 - 5;
    let go = std::sync::Barrier::new(2);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            go.wait();
            for k in 1..=255u8 {
                m.store(AT, &[k; LEN]).unwrap();
            }
        });
        let mut seen = vec![0u8; LEN];
        let mut now = vec![0u8; LEN];
        go.wait();
        let deadline = Instant::now() + bound();
        loop {
            m.load(AT, &mut now).unwrap();
            for (i, (&a, &b)) in seen.iter().zip(&now).enumerate() {
                assert!(b >= a, "byte {i} went back from {a} to {b}");
            }
            std::mem::swap(&mut seen, &mut now);
            if seen.iter().all(|&b| b == 255) {
                break;
            }
            assert!(Instant::now() < deadline, "the last store never showed");
        }
    });
    // The barrier pushes what the loads saw.
    m.barrier().unwrap();
    let mut remote = vec![0u8; LEN];
    r.read(AT as u64, &mut remote).unwrap();
    assert!(remote.iter().all(|&b| b == 255));
}

/// A region on a GPU that does not exist is a clear error: on a machine without a CUDA driver (CI)
/// and on the GPU machine alike (no ordinal is that large). The suite itself runs against a real GPU
/// region with `UBDIRECT_TEST_SMC_GPU=0` on the GPU machine.
#[test]
fn a_gpu_region_on_a_missing_gpu_is_a_clear_error() {
    let rt = rt();
    let e = rt
        .block_on(Server::start(ServerConfig {
            regions: vec![RegionConfig {
                name: "g".into(),
                size: 1 << 20,
                key: KEY.into(),
                writable: true,
                gpu: Some(4095),
            }],
            ..config("127.0.0.1:0".parse().unwrap())
        }))
        .unwrap_err();
    assert!(e.to_string().contains("region \"g\" on gpu 4095"), "{e}");
}

#[test]
fn two_mib_smc_pages_fetch_and_push_whole_pages() {
    let rt = rt();
    let s = start(&rt, "127.0.0.1:0".parse().unwrap());
    let base = one_sided_written();
    let c = smc_client(s.local_addr(), TOKEN, opts());
    let r = c.register("kv", KEY).unwrap();
    r.write(3 << 20, b"remote").unwrap();
    let m = r
        .map(MapOptions {
            page_size: 2 << 20,
            ..MapOptions::default()
        })
        .unwrap();
    // One fault fetches the whole 2 MiB SMC page holding the byte.
    let mut got = [0u8; 6];
    m.load(3 << 20, &mut got).unwrap();
    assert_eq!(&got, b"remote");
    assert_eq!(SmcStats::get(&c.stats().faults), 1);
    assert_eq!(SmcStats::get(&c.stats().bytes_fetched), 2 << 20);
    // It landed in the mapping's staging lease (a UB pool block), not a fresh buffer.
    assert_eq!(ubdirect_ub::fallback::count("smc_fault_buffers"), 0);
    // A 1-byte store dirties the whole SMC page: the barrier pushes all 2 MiB of it, in pieces no
    // larger than the server's max_request (1 MiB here) — over RDMA in one WRITE.
    m.store((2 << 20) + 1, b"x").unwrap();
    let b = m.flush().unwrap();
    assert_eq!((b.pages, b.bytes), (1, 2 << 20));
    assert!(b.transactions >= if rdma() { 1 } else { 2 }, "{b:?}");
    assert_eq!(pushed_bytes(&s, base), (2 << 20) + 6);
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

/// Writes are received straight into the region's memory (a UB pool block): a raw vectored write
/// lands range by range; a refused one (past the end) is drained, so the connection stays in step
/// and answers the next request; a malformed table ends the connection with a protocol error.
#[test]
fn vectored_writes_land_in_region_memory_and_refusals_keep_the_stream_in_step() {
    use tokio::io::AsyncWriteExt;
    use ubdirect_net::proto::{Msg, read_frame};
    let rt = rt();
    let s = start(&rt, "127.0.0.1:0".parse().unwrap());
    assert_eq!(ubdirect_ub::fallback::count("smc_region_heap"), 0);
    let mut sock = rt
        .block_on(tokio::net::TcpStream::connect(s.local_addr()))
        .unwrap();
    let mut reply = |frame: Vec<u8>| {
        rt.block_on(async {
            sock.write_all(&frame).await.unwrap();
            let t = Duration::from_secs(5);
            let (h, p) = read_frame(&mut sock, 1 << 20, t, t).await.unwrap();
            Msg::decode(h.kind, &p).unwrap()
        })
    };
    reply(
        Msg::Hello {
            token: TOKEN.into(),
        }
        .frame(1),
    );
    let open = reply(
        Msg::SmcOpen {
            name: "kv".into(),
            key: KEY.into(),
        }
        .frame(2),
    );
    assert!(matches!(open, Msg::SmcOpenOk { region: 0, .. }), "{open:?}");
    let w = reply(
        Msg::SmcWriteV {
            region: 0,
            ranges: vec![(100, 3), (SIZE - 2, 2)],
            data: b"abcde".to_vec(),
        }
        .frame(3),
    );
    assert_eq!(w, Msg::SmcWriteOk);
    // Past the end: refused, its data drained; the next request is answered.
    let w = reply(
        Msg::SmcWriteV {
            region: 0,
            ranges: vec![(0, 1), (SIZE - 1, 2)],
            data: b"xyz".to_vec(),
        }
        .frame(4),
    );
    assert!(
        matches!(
            w,
            Msg::Error {
                code: Code::Range,
                ..
            }
        ),
        "{w:?}"
    );
    let w = reply(
        Msg::SmcWrite {
            region: 0,
            offset: 200,
            data: b"f".to_vec(),
        }
        .frame(5),
    );
    assert_eq!(w, Msg::SmcWriteOk);
    assert_eq!(s.stats().smc_writes.load(Ordering::Relaxed), 2);
    assert_eq!(s.stats().smc_bytes_written.load(Ordering::Relaxed), 6);
    let c = smc_client(s.local_addr(), TOKEN, opts());
    let region = c.register("kv", KEY).unwrap();
    let (mut a, mut b) = ([0u8; 3], [0u8; 2]);
    region.read(100, &mut a).unwrap();
    region.read(SIZE - 2, &mut b).unwrap();
    assert_eq!((&a, &b), (b"abc", b"de"));
    let mut f = [0u8; 1];
    region.read(200, &mut f).unwrap();
    assert_eq!(&f, b"f");
    // A table that claims more ranges than the frame holds: a protocol error.
    let mut bad = Msg::SmcWriteV {
        region: 0,
        ranges: vec![(0, 1)],
        data: b"q".to_vec(),
    }
    .frame(6);
    bad[20 + 4..20 + 8].copy_from_slice(&1000u32.to_le_bytes());
    let e = reply(bad);
    assert!(
        matches!(
            e,
            Msg::Error {
                code: Code::Protocol,
                ..
            }
        ),
        "{e:?}"
    );
}

/// Requests of many threads on one client run on several pooled links at once, and every reply
/// reaches the thread that asked (no cross-talk between links or requests).
#[test]
fn many_threads_read_and_write_through_one_client_in_parallel() {
    let rt = rt();
    let s = start(&rt, "127.0.0.1:0".parse().unwrap());
    let c = smc_client(s.local_addr(), TOKEN, opts());
    let r = c.register("kv", KEY).unwrap();
    std::thread::scope(|sc| {
        for t in 0..8u64 {
            let r = r.clone();
            sc.spawn(move || {
                for k in 0..100u64 {
                    let off = t * 65536 + k * 512;
                    let v = vec![(t * 31 + k) as u8; 300];
                    r.write(off, &v).unwrap();
                    let mut back = vec![0u8; 300];
                    r.read(off, &mut back).unwrap();
                    assert_eq!(back, v, "thread {t} write {k}");
                }
            });
        }
    });
    assert_eq!(SmcStats::get(&c.stats().retries), 0);
    assert_eq!(s.stats().smc_writes.load(Ordering::Relaxed), 800);
}

/// A server that restarts on the same address: the pooled link to the old one is dead, the next
/// request is retried on a fresh link (which opens the region again) and succeeds.
#[test]
fn a_restarted_server_is_reached_again_on_a_fresh_link() {
    let rt = rt();
    let s = start(&rt, "127.0.0.1:0".parse().unwrap());
    let addr = s.local_addr();
    let c = smc_client(addr, TOKEN, opts());
    let r = c.register("kv", KEY).unwrap();
    r.write(10, b"before").unwrap();
    s.shutdown();
    drop(rt);
    let rt = self::rt();
    let s = start(&rt, addr);
    // A fresh region (zeros) on the new server; the write goes through after a retry.
    r.write(20, b"after").unwrap();
    let mut b = [0u8; 16];
    r.read(10, &mut b).unwrap();
    assert_eq!(&b, b"\0\0\0\0\0\0\0\0\0\0after\0");
    assert!(SmcStats::get(&c.stats().retries) >= 1);
    assert_eq!(s.stats().smc_writes.load(Ordering::Relaxed), 1);
}

/// A barrier of more vectored writes than the client keeps unacknowledged (a server with 8 KiB
/// requests: one page each, 1024 of them): every page arrives, none twice, and the connection
/// stays in step (a write-through afterwards is acknowledged on the same client).
#[test]
fn a_barrier_of_a_thousand_requests_takes_its_acknowledgements_as_it_goes() {
    let rt = rt();
    let s = rt
        .block_on(Server::start(ServerConfig {
            max_request: 8192,
            ..config("127.0.0.1:0".parse().unwrap())
        }))
        .unwrap();
    let base = one_sided_written();
    let c = smc_client(s.local_addr(), TOKEN, opts());
    let r = c.register("kv", KEY).unwrap();
    let m = r.map(MapOptions::default()).unwrap();
    let data: Vec<u8> = (0..SIZE as usize).map(|i| (i * 7 + 3) as u8).collect();
    m.store(0, &data).unwrap();
    let b = m.barrier().unwrap();
    assert_eq!((b.pages, b.bytes), (1024, SIZE as usize));
    if !rdma() {
        assert_eq!(b.transactions, 1024, "{b:?}");
    }
    assert_eq!(pushed_bytes(&s, base), SIZE);
    r.write(0, b"after").unwrap();
    let mut got = vec![0u8; SIZE as usize];
    r.read(0, &mut got).unwrap();
    assert_eq!(&got[..5], b"after");
    assert!(got[5..] == data[5..], "the region differs from the stores");
}
