//! `ubdirect serve` against abusive and careless clients on loopback (issue 14): one test per defect
//! class found by trying — descriptors exhausted at accept, connection caps, a client that does not
//! read its replies, repeated opens, SMC handles, half-sent frames and declared-but-unsent payloads,
//! a FIFO swapped in between check and open, server paths in error frames, a file as a root, an
//! empty vectored write through a read-only token, a region beyond memory, and refusal logs.
//! Attackers connect from other loopback addresses (127.0.0.2, …) than the legitimate client
//! (127.0.0.1), as separate machines would.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use ubdirect_net::proto::{self, Code, Header, Kind, Msg};
use ubdirect_net::{Client, ClientError, RegionConfig, Server, ServerConfig};
use ubdirect_ub::{MemoryKind, PoolConfig, UbPool};

mod support;
use support::{largest, largest_reset};

const TOKEN: &str = "abuse-test-token-rw";
const RO: &str = "abuse-test-token-ro";
const KEY: &str = "region-key-abuse";
const T: Duration = Duration::from_secs(5);

fn dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("abuse")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("root")).unwrap();
    std::fs::write(d.join("root/a.bin"), vec![7u8; 4 << 20]).unwrap();
    std::fs::write(d.join("root/b.bin"), vec![9u8; 4096]).unwrap();
    d
}

fn config(d: &Path) -> ServerConfig {
    ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: TOKEN.into(),
        read_only_tokens: vec![RO.into()],
        roots: vec![("r".into(), d.join("root"))],
        max_request: 1 << 20,
        blocks: 8,
        io_timeout: Duration::from_secs(2),
        ..ServerConfig::default()
    }
}

/// A connection from loopback address `from` (`127.0.0.N`).
async fn connect_from(addr: SocketAddr, from: &str) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(format!("{from}:0").parse().unwrap()).unwrap();
    s.connect(addr).await.unwrap()
}

/// A connection from `from` that said hello with `token`.
async fn hello(addr: SocketAddr, from: &str, token: &str) -> TcpStream {
    let mut s = connect_from(addr, from).await;
    let r = ask(
        &mut s,
        &Msg::Hello {
            token: token.into(),
        },
        0,
    )
    .await;
    assert!(matches!(r, Msg::HelloOk { .. }), "{r:?}");
    s
}

/// Sends `m` with id `id` and returns the reply (a control frame).
async fn ask(s: &mut TcpStream, m: &Msg, id: u64) -> Msg {
    s.write_all(&m.frame(id)).await.unwrap();
    reply(s).await.1
}

async fn reply(s: &mut TcpStream) -> (Header, Msg) {
    let (h, p) = proto::read_frame(s, 16 << 20, T, T).await.unwrap();
    (h, Msg::decode(h.kind, &p).unwrap())
}

/// Waits (polling, up to `within`) until `cond` holds; panics with `what` if it never does.
async fn until(within: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < within, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn pool(block: usize, n: usize) -> UbPool {
    UbPool::new_host(PoolConfig::new("abuse", block, n, MemoryKind::Host)).unwrap()
}

/// A legitimate client from 127.0.0.1 reads `n` × 1 MiB; returns the refusals it got.
async fn legit_reads(addr: SocketAddr, n: usize) -> Vec<ClientError> {
    let c = Client::new(vec![addr], TOKEN, Duration::from_secs(10));
    let f = c.open("r", "a.bin").await.unwrap();
    let p = pool(1 << 20, 1);
    let mut errs = Vec::new();
    for i in 0..n {
        let l = p.acquire(T).await.unwrap();
        let (r, l) = c.read(&f, (i as u64 % 3) << 20, 1 << 20, l, 0).await;
        match r {
            Ok(()) => assert!(l.as_slice().unwrap()[..1 << 20].iter().all(|&b| b == 7)),
            Err(e) => errs.push(e),
        }
    }
    errs
}

// ---- connections ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_caps_close_the_excess_at_once_and_others_are_served() {
    let d = dir("caps");
    let s = Server::start(ServerConfig {
        max_connections: 6,
        max_connections_per_peer: 3,
        ..config(&d)
    })
    .await
    .unwrap();
    let addr = s.local_addr();
    // One peer opens 8: 3 stay (waiting for hello), 5 are closed as they arrive.
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(connect_from(addr, "127.0.0.2").await);
    }
    let st = s.stats().clone();
    until(T, "5 rejected", || {
        st.rejected_connections.load(Ordering::Relaxed) == 5
    })
    .await;
    assert_eq!(st.open_connections.load(Ordering::Relaxed), 3);
    // Another peer still gets in, up to the total.
    for _ in 0..3 {
        held.push(connect_from(addr, "127.0.0.3").await);
    }
    until(T, "6 open", || {
        st.open_connections.load(Ordering::Relaxed) == 6
    })
    .await;
    // Full: even a legitimate client is turned away now — at once, with a typed error.
    let c = Client::new(vec![addr], TOKEN, Duration::from_millis(500));
    assert!(c.open("r", "b.bin").await.is_err());
    drop(held);
    until(T, "all closed", || {
        st.open_connections.load(Ordering::Relaxed) == 0
    })
    .await;
    let c = Client::new(vec![addr], TOKEN, T);
    assert_eq!(c.open("r", "b.bin").await.unwrap().size, 4096);
}

/// Set in a child process: the scenario it runs.
const CHILD: &str = "UBDIRECT_ABUSE_CHILD";

/// Runs `test` of this binary again in a child with [`CHILD`] set; returns its exit status and
/// stderr (a child that does not end in 60 s is killed).
fn child(test: &str) -> (std::process::ExitStatus, String) {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
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
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = c.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = c.kill();
            let _ = c.wait();
            panic!("child hung: {}", err.join().unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (status, err.join().unwrap())
}

fn set_nofile(n: u64) {
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

/// This process's CPU time (user + system), from `/proc/self/stat` opened before (read again from
/// its start: no descriptor is needed).
fn cpu_time(stat: &std::fs::File) -> Duration {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 4096];
    let n = stat.read_at(&mut b, 0).unwrap();
    let s = String::from_utf8_lossy(&b[..n]);
    let after = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<u64> = after
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // Fields 14 and 15 of proc(5) (utime, stime), in clock ticks (100 a second on Linux).
    Duration::from_millis((f[11] + f[12]) * 10)
}

/// Descriptors exhausted: connections wait in the backlog and every accept fails with EMFILE. The
/// accept loop must pause (not spin at 100 % CPU writing a log line per failure), and serve again once
/// descriptors are back.
#[test]
fn accept_errors_back_off_instead_of_spinning() {
    const NAME: &str = "accept_errors_back_off_instead_of_spinning";
    if std::env::var(CHILD).is_err() {
        let (st, err) = child(NAME);
        eprintln!(
            "{}",
            err.lines()
                .filter(|l| l.starts_with("accept:"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        assert!(st.success(), "child failed: {err}");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let d = dir("emfile");
    let s = rt
        .block_on(Server::start(ServerConfig {
            io_timeout: Duration::from_secs(30),
            ..config(&d)
        }))
        .unwrap();
    let addr = s.local_addr();
    rt.block_on(async {
        // Sockets made while descriptors remain, connected after none do: the server cannot accept.
        let socks: Vec<TcpSocket> = (0..4).map(|_| TcpSocket::new_v4().unwrap()).collect();
        let stat = std::fs::File::open("/proc/self/stat").unwrap();
        let lowest = std::fs::File::open("/dev/null").map(|f| {
            use std::os::fd::AsRawFd;
            f.as_raw_fd()
        });
        let mut old = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit with a valid resource and a live struct.
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut old) };
        set_nofile(lowest.unwrap() as u64);
        let mut conns = Vec::new();
        for k in socks {
            conns.push(k.connect(addr).await.unwrap());
        }
        let st = s.stats().clone();
        // One second with the backlog full and no descriptor to take it: measured, not waited on.
        let (cpu0, t0) = (cpu_time(&stat), Instant::now());
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (cpu, wall) = (cpu_time(&stat) - cpu0, t0.elapsed());
        let errors = st.accept_errors.load(Ordering::Relaxed);
        eprintln!("accept: {errors} errors and {cpu:?} of CPU in {wall:?} with no descriptor left");
        assert!(
            cpu < Duration::from_millis(300),
            "the accept loop spins: {cpu:?} of CPU in {wall:?}"
        );
        assert!(
            (1..=40).contains(&errors),
            "{errors} accept errors in {wall:?}"
        );
        // Descriptors back: the waiting connections are accepted and served.
        set_nofile(old.rlim_cur);
        let c = Client::new(vec![addr], TOKEN, T);
        assert_eq!(c.open("r", "b.bin").await.unwrap().size, 4096);
        drop(conns);
    });
}

// ---- staging blocks and replies ------------------------------------------------------------------

/// A client pipelines reads and never reads the replies: it may hold its share of the staging
/// blocks until the write deadline, then it is disconnected; everyone else keeps reading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_its_replies_cannot_take_every_block() {
    let d = dir("nonreader");
    let s = Server::start(ServerConfig {
        max_staging_per_peer: 4,
        ..config(&d)
    })
    .await
    .unwrap();
    let addr = s.local_addr();
    let mut bad = hello(addr, "127.0.0.2", RO).await;
    let open = Msg::Open {
        root: "r".into(),
        path: "a.bin".into(),
    };
    assert!(matches!(ask(&mut bad, &open, 1).await, Msg::OpenOk { .. }));
    let mut reqs = Vec::new();
    for i in 0..64u64 {
        reqs.extend(
            Msg::Read {
                file: 0,
                offset: (i % 4) << 20,
                len: 1 << 20,
            }
            .frame(10 + i),
        );
    }
    bad.write_all(&reqs).await.unwrap();
    // It holds what it can: its share (the socket buffers took some replies already).
    let st = s.stats().clone();
    until(T, "the non-reader holds blocks", || {
        s.pool_stats().free <= 4
    })
    .await;
    // Everyone else keeps reading while it stays.
    let errs = legit_reads(addr, 16).await;
    assert!(errs.is_empty(), "a legitimate client was refused: {errs:?}");
    // Its replies are not taken: disconnected at the write deadline, and its blocks come back.
    until(Duration::from_secs(10), "write deadline", || {
        st.write_timeouts.load(Ordering::Relaxed) >= 1
    })
    .await;
    until(T, "blocks back", || {
        let p = s.pool_stats();
        p.free == p.total
    })
    .await;
    drop(bad);
    until(T, "connections closed", || {
        st.open_connections.load(Ordering::Relaxed) == 0
    })
    .await;
}

// ---- opens and handles ---------------------------------------------------------------------------

/// One client opening the same file 1,500 times, then 80 different files: the same id each time,
/// then a refusal past `max_open_files`; the engine's slots stay free for everyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_opens_cannot_fill_the_file_slots() {
    let d = dir("opens");
    for i in 0..80 {
        std::fs::write(d.join(format!("root/f{i}.bin")), b"x").unwrap();
    }
    let s = Server::start(ServerConfig {
        max_open_files: 64,
        ..config(&d)
    })
    .await
    .unwrap();
    let addr = s.local_addr();
    let mut bad = hello(addr, "127.0.0.2", RO).await;
    let open = |p: &str| Msg::Open {
        root: "r".into(),
        path: p.into(),
    };
    let mut burst = Vec::new();
    for i in 0..1500 {
        burst.extend(open("a.bin").frame(i));
    }
    bad.write_all(&burst).await.unwrap();
    let mut ids = std::collections::BTreeSet::new();
    for _ in 0..1500 {
        match reply(&mut bad).await.1 {
            Msg::OpenOk { file, .. } => {
                ids.insert(file);
            }
            other => panic!("open {} refused: {other:?}", ids.len()),
        }
    }
    assert_eq!(ids.len(), 1, "one file, {} ids", ids.len());
    let mut refused = 0;
    for i in 0..80 {
        match ask(&mut bad, &open(&format!("f{i}.bin")), 5000 + i).await {
            Msg::OpenOk { .. } => {}
            Msg::Error {
                code: Code::TooLarge,
                message,
            } => {
                assert!(message.contains("max_open_files"), "{message}");
                refused += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(refused, 80 - 63, "a.bin plus 63 more fill the 64");
    // Someone else opens as usual.
    let c = Client::new(vec![addr], TOKEN, T);
    assert_eq!(c.open("r", "b.bin").await.unwrap().size, 4096);
}

/// Registering a region over and over gives one handle: handles are bounded by the regions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smc_handles_are_bounded_by_the_regions() {
    let d = dir("handles");
    let s = Server::start(ServerConfig {
        regions: vec![RegionConfig {
            name: "kv".into(),
            size: 1 << 20,
            key: KEY.into(),
            writable: true,
            gpu: None,
        }],
        ..config(&d)
    })
    .await
    .unwrap();
    let mut c = hello(s.local_addr(), "127.0.0.2", TOKEN).await;
    let open = Msg::SmcOpen {
        name: "kv".into(),
        key: KEY.into(),
    };
    let mut burst = Vec::new();
    for i in 0..5000 {
        burst.extend(open.frame(i));
    }
    c.write_all(&burst).await.unwrap();
    let mut ids = std::collections::BTreeSet::new();
    for _ in 0..5000 {
        match reply(&mut c).await.1 {
            Msg::SmcOpenOk { region, .. } => {
                ids.insert(region);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(ids.len(), 1, "{} handles for one region", ids.len());
}

// ---- frames --------------------------------------------------------------------------------------

/// After hello: half a header, or a header whose declared payload never comes, is dropped at the
/// deadline; and the declared length is not allocated up front.
#[tokio::test(flavor = "current_thread")]
async fn half_sent_frames_are_dropped_at_the_deadline_and_not_allocated_ahead() {
    let d = dir("half");
    let s = Server::start(ServerConfig {
        max_request: 16 << 20,
        io_timeout: Duration::from_millis(300),
        regions: vec![RegionConfig {
            name: "kv".into(),
            size: 1 << 20,
            key: KEY.into(),
            writable: true,
            gpu: None,
        }],
        ..config(&d)
    })
    .await
    .unwrap();
    let addr = s.local_addr();
    // From here on, what this thread allocates (the server's connection tasks run on it).
    largest_reset();
    let mut conns = Vec::new();
    for k in 0..8 {
        let mut c = hello(addr, "127.0.0.2", TOKEN).await;
        let h = Header {
            kind: Kind::SmcWrite,
            id: 1,
            len: (16 << 20) + 12,
        }
        .encode();
        if k % 2 == 0 {
            // Half a header.
            c.write_all(&h[..10]).await.unwrap();
        } else {
            // A whole header declaring 16 MiB, and 1,000 bytes of it.
            c.write_all(&h).await.unwrap();
            c.write_all(&[0u8; 1000]).await.unwrap();
        }
        conns.push(c);
    }
    let t = Instant::now();
    for c in &mut conns {
        // The server closes each within its deadline (plus slack), not after the hour's idle wait.
        let mut b = [0u8; 64];
        let r = tokio::time::timeout(Duration::from_secs(3), c.read(&mut b)).await;
        assert!(
            matches!(r, Ok(Ok(0)) | Ok(Err(_))),
            "still open after {:?}: {r:?}",
            t.elapsed()
        );
    }
    let big = largest();
    assert!(
        big < 1 << 20,
        "a connection allocated {big} bytes for a payload of which 1,000 arrived"
    );
    let st = s.stats().clone();
    until(T, "closed", || {
        st.open_connections.load(Ordering::Relaxed) == 0
    })
    .await;
}

/// Issue 23: an `SmcWriteV` header sized its range table from the count it declared before the bytes
/// arrived — 28 bytes cost ~12 MiB with max_request 16 MiB, any token (read-only included) — and
/// 250 such connections from 5 addresses held +2.5 GB. The table is now read in pieces as it
/// arrives: a stalled header costs one piece. (Before: this test saw a 16 MiB allocation.)
#[tokio::test(flavor = "current_thread")]
async fn a_vectored_write_header_allocates_nothing_ahead_of_its_bytes() {
    let d = dir("writev-header");
    let s = Server::start(ServerConfig {
        max_request: 16 << 20,
        io_timeout: Duration::from_millis(300),
        ..config(&d)
    })
    .await
    .unwrap();
    let addr = s.local_addr();
    largest_reset();
    let mut conns = Vec::new();
    for k in 0..8 {
        let mut c = hello(addr, "127.0.0.2", if k % 2 == 0 { TOKEN } else { RO }).await;
        let len = (16u32 << 20) + 12;
        let mut f = Header {
            kind: Kind::SmcWriteV,
            id: 1,
            len,
        }
        .encode()
        .to_vec();
        // Region 0, as many ranges as the frame could hold: 28 bytes in all.
        f.extend_from_slice(&0u32.to_le_bytes());
        f.extend_from_slice(&((len - 8) / 12).to_le_bytes());
        c.write_all(&f).await.unwrap();
        conns.push(c);
    }
    for c in &mut conns {
        let mut b = [0u8; 64];
        let r = tokio::time::timeout(Duration::from_secs(3), c.read(&mut b)).await;
        assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "still open: {r:?}");
    }
    let big = largest();
    assert!(
        big < 256 << 10,
        "a connection allocated {big} bytes for a range table of which nothing arrived"
    );
}

/// Issue 23: idle connections that never say hello, up to `max_connections`, kept everyone out until
/// their hello deadline (`io_timeout`). Now at most `serve.max_pending_hellos` of them are held: one
/// more closes the oldest, so a client that says hello at once gets in. (Before: the client's open
/// failed — every connection slot was held for the 10 s deadline.)
#[tokio::test(flavor = "current_thread")]
async fn idle_connections_without_a_hello_cannot_keep_clients_out() {
    let d = dir("pending");
    let s = Server::start(ServerConfig {
        max_connections: 4,
        max_connections_per_peer: 4,
        max_pending_hellos: 2,
        io_timeout: Duration::from_secs(10),
        ..config(&d)
    })
    .await
    .unwrap();
    let addr = s.local_addr();
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(connect_from(addr, "127.0.0.2").await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let t = Instant::now();
    let c = Client::new(vec![addr], TOKEN, Duration::from_secs(3));
    assert_eq!(c.open("r", "b.bin").await.unwrap().size, 4096);
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // The oldest idle connections were closed.
    let mut b = [0u8; 8];
    let r = tokio::time::timeout(Duration::from_secs(2), idle[0].read(&mut b)).await;
    assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "{r:?}");
}

// ---- files ---------------------------------------------------------------------------------------

/// Issue 23: two addresses opening distinct files filled all 1,024 registered-file slots (the error
/// then named `max_files`, which no config has). A token now has a budget over all its addresses
/// (`serve.max_open_files_per_token`), named in the error, and another token still opens files.
#[tokio::test(flavor = "current_thread")]
async fn a_token_has_a_budget_of_file_slots_over_all_its_addresses() {
    let d = dir("tokenfiles");
    for i in 0..60 {
        std::fs::write(d.join(format!("root/f{i}.bin")), b"x").unwrap();
    }
    let s = Server::start(ServerConfig {
        max_open_files: 20,
        max_open_files_per_peer: 20,
        max_open_files_per_token: 45,
        ..config(&d)
    })
    .await
    .unwrap();
    let addr = s.local_addr();
    let open = |i: u64| Msg::Open {
        root: "r".into(),
        path: format!("f{i}.bin"),
    };
    let mut refused = 0;
    let mut held = Vec::new();
    for (a, from) in ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        .into_iter()
        .enumerate()
    {
        let mut c = hello(addr, from, RO).await;
        for i in 0..20 {
            let k = a as u64 * 20 + i;
            match ask(&mut c, &open(k), k).await {
                Msg::OpenOk { .. } => {}
                Msg::Error { code, message } => {
                    assert_eq!(code, Code::TooLarge);
                    assert!(
                        message.contains("serve.max_open_files_per_token"),
                        "{message}"
                    );
                    refused += 1;
                }
                other => panic!("{other:?}"),
            }
        }
        held.push(c);
    }
    assert_eq!(
        refused, 15,
        "three addresses of one token: 45 files, not 60"
    );
    let c = Client::new(vec![addr], TOKEN, T);
    assert_eq!(c.open("r", "b.bin").await.unwrap().size, 4096);
}

/// Issue 23: holding connections on many addresses with one token took every connection. A token
/// now has `serve.max_connections_per_token` over all its addresses (named in the refusal), and
/// clients of another token still connect.
#[tokio::test(flavor = "current_thread")]
async fn a_token_has_a_budget_of_connections_over_all_its_addresses() {
    let d = dir("tokenconns");
    let s = Server::start(ServerConfig {
        max_connections: 64,
        max_connections_per_peer: 8,
        max_connections_per_token: 12,
        ..config(&d)
    })
    .await
    .unwrap();
    let addr = s.local_addr();
    let mut held = Vec::new();
    let mut refused = 0;
    for from in ["127.0.0.2", "127.0.0.3"] {
        for _ in 0..8 {
            let mut c = connect_from(addr, from).await;
            match ask(&mut c, &Msg::Hello { token: RO.into() }, 0).await {
                Msg::HelloOk { .. } => held.push(c),
                Msg::Error { code, message } => {
                    assert_eq!(code, Code::Busy);
                    assert!(
                        message.contains("serve.max_connections_per_token"),
                        "{message}"
                    );
                    refused += 1;
                }
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!((held.len(), refused), (12, 4));
    let c = Client::new(vec![addr], TOKEN, T);
    assert_eq!(c.open("r", "b.bin").await.unwrap().size, 4096);
}

/// A regular file swapped for a FIFO between the server's checks and its open, over and over: no
/// open blocks a worker, and the server keeps answering. The server runs on a runtime of its own, so
/// the client's deadlines still fire if its workers are stuck.
#[tokio::test(flavor = "current_thread")]
async fn a_fifo_swapped_in_cannot_block_the_server() {
    let d = dir("fifo");
    let (reg, fifo, name) = (d.join("reg"), d.join("fifo"), d.join("root/swap.bin"));
    std::fs::write(&reg, b"regular").unwrap();
    let st = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(st.success());
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cfg = config(&d);
    let s = server_rt
        .spawn(async move { Server::start(cfg).await.unwrap() })
        .await
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    std::fs::copy(&reg, &name).unwrap();
    let swapper = {
        let (stop, base) = (stop.clone(), std::fs::File::open(&d).unwrap());
        // `root/swap.bin` and `fifo` exchange places atomically, over and over: the name is always
        // there, a regular file half of the time and a FIFO the other half.
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                nix::fcntl::renameat2(
                    &base,
                    "fifo",
                    &base,
                    "root/swap.bin",
                    nix::fcntl::RenameFlags::RENAME_EXCHANGE,
                )
                .unwrap();
            }
        })
    };
    let mut c = hello(s.local_addr(), "127.0.0.2", TOKEN).await;
    let open = Msg::Open {
        root: "r".into(),
        path: "swap.bin".into(),
    };
    let (mut ok, mut refused) = (0, 0);
    let mut hung = None;
    for i in 0..2000u64 {
        c.write_all(&open.frame(i)).await.unwrap();
        match tokio::time::timeout(Duration::from_secs(2), reply(&mut c)).await {
            Ok((_, Msg::OpenOk { .. })) => ok += 1,
            Ok((_, Msg::Error { .. })) => refused += 1,
            Ok((_, other)) => panic!("{other:?}"),
            Err(_) => {
                hung = Some(i);
                break;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    if hung.is_some() {
        // Release the blocked open (a writer appears), so the process can end.
        let _ = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&fifo);
        let _ = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&name);
    }
    if hung.is_some() {
        drop(s);
        server_rt.shutdown_background();
        panic!("open {hung:?} got no reply: a worker is blocked ({ok} opened, {refused} refused)");
    }
    eprintln!("fifo swap: {ok} opened, {refused} refused, none blocked");
    // And the server still says hello.
    let c = Client::new(vec![s.local_addr()], TOKEN, T);
    assert_eq!(c.open("r", "b.bin").await.unwrap().size, 4096);
    drop(s);
    server_rt.shutdown_background();
}

/// Error frames name files as the client did (`root/path`), never by the server's paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_frames_reveal_no_server_path() {
    let d = dir("paths");
    std::fs::create_dir_all(d.join("root/sub")).unwrap();
    std::fs::write(d.join("outside.txt"), b"secret").unwrap();
    std::os::unix::fs::symlink(d.join("outside.txt"), d.join("root/escape")).unwrap();
    let st = std::process::Command::new("mkfifo")
        .arg(d.join("root/pipe"))
        .status()
        .unwrap();
    assert!(st.success());
    let s = Server::start(config(&d)).await.unwrap();
    let mut c = hello(s.local_addr(), "127.0.0.2", TOKEN).await;
    let server_path = d.canonicalize().unwrap().display().to_string();
    let mut messages = Vec::new();
    for (i, p) in [
        "missing.bin",
        "sub",
        "escape",
        "pipe",
        "../x",
        "sub/../a.bin",
    ]
    .iter()
    .enumerate()
    {
        let m = ask(
            &mut c,
            &Msg::Open {
                root: "r".into(),
                path: (*p).into(),
            },
            i as u64,
        )
        .await;
        match m {
            Msg::Error { message, .. } => messages.push(message),
            other => panic!("{p}: {other:?}"),
        }
    }
    assert!(matches!(
        ask(
            &mut c,
            &Msg::Open {
                root: "r".into(),
                path: "b.bin".into()
            },
            50
        )
        .await,
        Msg::OpenOk { file: 0, .. }
    ));
    for (i, req) in [
        Msg::Read {
            file: 0,
            offset: 4000,
            len: 1000,
        },
        Msg::Read {
            file: 7,
            offset: 0,
            len: 1,
        },
    ]
    .iter()
    .enumerate()
    {
        match ask(&mut c, req, 60 + i as u64).await {
            Msg::Error { message, .. } => messages.push(message),
            other => panic!("{other:?}"),
        }
    }
    for m in &messages {
        assert!(
            !m.contains(&server_path) && !m.contains(env!("CARGO_TARGET_TMPDIR")),
            "an error frame names a server path: {m:?}"
        );
    }
    assert!(
        messages.iter().any(|m| m.contains("r/b.bin")),
        "{messages:?}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_regular_file_is_not_a_root() {
    let d = dir("fileroot");
    let r = Server::start(ServerConfig {
        roots: vec![("r".into(), d.join("root/a.bin"))],
        ..config(&d)
    })
    .await;
    let e = r.expect_err("a file accepted as a root");
    assert!(e.to_string().contains("not a directory"), "{e}");
}

// ---- SMC -----------------------------------------------------------------------------------------

/// A vectored write with no ranges is still a write: refused for a read-only token and for a
/// region not registered on the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_vectored_write_is_checked_like_any_write() {
    let d = dir("writev");
    let s = Server::start(ServerConfig {
        regions: vec![RegionConfig {
            name: "kv".into(),
            size: 1 << 20,
            key: KEY.into(),
            writable: true,
            gpu: None,
        }],
        ..config(&d)
    })
    .await
    .unwrap();
    let mut c = hello(s.local_addr(), "127.0.0.2", RO).await;
    let open = Msg::SmcOpen {
        name: "kv".into(),
        key: KEY.into(),
    };
    assert!(matches!(
        ask(&mut c, &open, 1).await,
        Msg::SmcOpenOk {
            region: 0,
            writable: false,
            ..
        }
    ));
    let empty = |region| Msg::SmcWriteV {
        region,
        ranges: vec![],
        data: vec![],
    };
    let r = ask(&mut c, &empty(0), 2).await;
    assert!(
        matches!(
            r,
            Msg::Error {
                code: Code::Forbidden,
                ..
            }
        ),
        "read-only token: {r:?}"
    );
    let r = ask(&mut c, &empty(9), 3).await;
    assert!(
        matches!(
            r,
            Msg::Error {
                code: Code::BadFile,
                ..
            }
        ),
        "unregistered region: {r:?}"
    );
    let mut w = hello(s.local_addr(), "127.0.0.2", TOKEN).await;
    assert!(matches!(
        ask(&mut w, &open, 1).await,
        Msg::SmcOpenOk { writable: true, .. }
    ));
    assert!(matches!(ask(&mut w, &empty(0), 2).await, Msg::SmcWriteOk));
}

/// A region larger than the machine's memory is an error at start, not an abort.
#[tokio::test(flavor = "current_thread")]
async fn a_region_beyond_memory_is_an_error() {
    let d = dir("bigregion");
    let r = Server::start(ServerConfig {
        regions: vec![RegionConfig {
            name: "huge".into(),
            size: 1 << 40,
            key: KEY.into(),
            writable: true,
            gpu: None,
        }],
        ..config(&d)
    })
    .await;
    let e = r.expect_err("a 1 TiB region was accepted");
    assert!(e.to_string().contains("huge"), "{e}");
}

// ---- logs ----------------------------------------------------------------------------------------

/// 2,000 refusals in a burst: each is counted, but at most a line a second is logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusal_logs_are_rate_limited_and_counted() {
    let d = dir("logs");
    let s = Server::start(config(&d)).await.unwrap();
    let mut c = hello(s.local_addr(), "127.0.0.2", TOKEN).await;
    let bad = Msg::Read {
        file: 3,
        offset: 0,
        len: 1,
    };
    let mut burst = Vec::new();
    for i in 0..2000 {
        burst.extend(bad.frame(i));
    }
    let t = Instant::now();
    c.write_all(&burst).await.unwrap();
    for _ in 0..2000 {
        assert!(matches!(
            reply(&mut c).await.1,
            Msg::Error {
                code: Code::BadFile,
                ..
            }
        ));
    }
    let secs = t.elapsed().as_secs() + 1;
    let st = s.stats();
    assert!(st.refused.load(Ordering::Relaxed) >= 2000);
    let held = st.logs_suppressed.load(Ordering::Relaxed);
    assert!(
        held >= 2000 - 2 * secs,
        "{held} of 2000 refusal lines held back in {secs} s"
    );
}

/// The connections of one address share a budget of engine file slots; another address is not
/// affected, and the budget comes back when the connections close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_has_a_budget_of_file_slots() {
    let d = dir("peerfiles");
    for i in 0..30 {
        std::fs::write(d.join(format!("root/f{i}.bin")), b"x").unwrap();
    }
    let s = Server::start(ServerConfig {
        max_open_files: 20,
        max_open_files_per_peer: 25,
        ..config(&d)
    })
    .await
    .unwrap();
    let addr = s.local_addr();
    let open = |i: u64| Msg::Open {
        root: "r".into(),
        path: format!("f{i}.bin"),
    };
    let (mut a, mut b) = (
        hello(addr, "127.0.0.2", RO).await,
        hello(addr, "127.0.0.2", RO).await,
    );
    for i in 0..15 {
        assert!(matches!(ask(&mut a, &open(i), i).await, Msg::OpenOk { .. }));
    }
    let mut refused = 0;
    for i in 15..30 {
        if let Msg::Error { code, message } = ask(&mut b, &open(i), i).await {
            assert_eq!(code, Code::TooLarge);
            assert!(message.contains("max_open_files_per_peer"), "{message}");
            refused += 1;
        }
    }
    assert_eq!(refused, 5, "15 + 10 fill the address's 25");
    // Another address opens as usual.
    let c = Client::new(vec![addr], TOKEN, T);
    assert_eq!(c.open("r", "b.bin").await.unwrap().size, 4096);
    // Closed: the budget is back.
    drop(a);
    let st = s.stats().clone();
    until(T, "a closed", || {
        st.open_connections.load(Ordering::Relaxed) == 2
    })
    .await;
    assert!(matches!(
        ask(&mut b, &open(29), 99).await,
        Msg::OpenOk { .. }
    ));
}

/// A hello trickled in so that each part (first byte, rest of the header, payload) comes within the
/// deadline but the whole does not: the whole hello has one deadline, so the connection is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_trickled_in_is_dropped_at_the_deadline() {
    let d = dir("trickle");
    let s = Server::start(ServerConfig {
        io_timeout: Duration::from_millis(400),
        ..config(&d)
    })
    .await
    .unwrap();
    let mut c = connect_from(s.local_addr(), "127.0.0.2").await;
    let hello = Msg::Hello {
        token: TOKEN.into(),
    }
    .frame(0);
    let t = Instant::now();
    // 43 bytes, one every 15 ms: about 650 ms in all, no part longer than 400 ms.
    for b in &hello {
        if c.write_all(std::slice::from_ref(b)).await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    let r = tokio::time::timeout(T, proto::read_frame(&mut c, 0, T, T)).await;
    assert!(
        !matches!(
            r,
            Ok(Ok((
                Header {
                    kind: Kind::HelloOk,
                    ..
                },
                _
            )))
        ),
        "a hello that took {:?} was accepted",
        t.elapsed()
    );
}
