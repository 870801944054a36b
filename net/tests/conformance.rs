//! The transport conformance suite, on loopback: bytes equal the files, refusals are clear and do not
//! stop the server, a restarted server or a replica takes over, and no server means a typed error in
//! time. One suite for every transport: `UBDIRECT_TEST_TRANSPORT=tcp` (default) or `rdma` (a build with
//! `--features rdma` on a machine with an RDMA device: the NVMe/RDMA test guest runs it over rxe).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ubdirect_net::proto::Code;
use ubdirect_net::{Client, ClientError, Server, ServerConfig, Transport};
use ubdirect_ub::{MemoryKind, PoolConfig, UbPool};

fn transport_name() -> String {
    std::env::var("UBDIRECT_TEST_TRANSPORT").unwrap_or_else(|_| "tcp".into())
}

/// The transport under test (one device per process for RDMA).
fn transport() -> Arc<dyn Transport> {
    match transport_name().as_str() {
        "tcp" => Arc::new(ubdirect_net::Tcp),
        #[cfg(feature = "rdma")]
        "rdma" => {
            static R: std::sync::OnceLock<ubdirect_net::rdma::Rdma> = std::sync::OnceLock::new();
            let r = R.get_or_init(|| {
                ubdirect_net::rdma::Rdma::open(&Default::default())
                    .unwrap_or_else(|e| panic!("UBDIRECT_TEST_TRANSPORT=rdma: {e}"))
            });
            Arc::new(ubdirect_net::transport::RdmaTransport::new(r.clone()))
        }
        t => panic!("UBDIRECT_TEST_TRANSPORT={t}: not a transport of this build"),
    }
}

fn client(servers: Vec<SocketAddr>, token: &str, deadline: Duration) -> Client {
    Client::with_transport(servers, token, deadline, transport())
}

fn data_dir(name: &str) -> (PathBuf, Vec<u8>) {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("net")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("root/sub")).unwrap();
    let data: Vec<u8> = (0..(3u32 << 20) + 777)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(d.join("root/sub/shard.bin"), &data).unwrap();
    std::fs::write(d.join("secret.txt"), b"outside the root").unwrap();
    std::os::unix::fs::symlink(d.join("secret.txt"), d.join("root/escape")).unwrap();
    (d, data)
}

async fn server(dir: &std::path::Path, addr: SocketAddr) -> Server {
    Server::start(ServerConfig {
        listen: addr,
        token: b"s3cret".to_vec(),
        roots: vec![("data".into(), dir.join("root"))],
        max_request: 1 << 20,
        blocks: 16,
        rdma_device: (transport_name() == "rdma").then(String::new),
        ..ServerConfig::default()
    })
    .await
    .unwrap()
}

/// Destination blocks, registered once with the transport (RDMA) at creation.
fn pool() -> UbPool {
    let mut b = UbPool::builder(PoolConfig::new("net-test", 2 << 20, 8, MemoryKind::Host));
    if let Some(r) = transport().registrar() {
        b = b.register_with(r);
    }
    b.build().unwrap()
}

/// Every payload took the transport's own path: no fallback to TCP payloads under RDMA.
fn assert_no_fallback(s: &Server) {
    assert_eq!(
        ubdirect_ub::fallback::count("rdma_unregistered_lease"),
        0,
        "a payload fell back to TCP"
    );
    if transport_name() == "rdma" {
        assert!(
            s.stats()
                .rdma_reads
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_equal_the_file() {
    let (d, data) = data_dir("equal");
    let s = server(&d, "127.0.0.1:0".parse().unwrap()).await;
    let c = client(vec![s.local_addr()], "s3cret", Duration::from_secs(5));
    let f = c.open("data", "sub/shard.bin").await.unwrap();
    assert_eq!(f.size, data.len() as u64);
    let p = pool();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, (off, len)) in [
        (0u64, 1usize),
        (1, 4095),
        (4096, 1 << 20),
        (data.len() as u64 - 777, 777),
        (12345, 100_000),
    ]
    .into_iter()
    .enumerate()
    {
        let (c, f, l) = (
            c.clone(),
            f.clone(),
            p.acquire(Duration::from_secs(5)).await.unwrap(),
        );
        tasks.spawn(async move {
            let lo = (i % 2) * 4096;
            let (r, l) = c.read(&f, off, len, l, lo).await;
            r.unwrap();
            (off, len, l.as_slice().unwrap()[lo..lo + len].to_vec())
        });
    }
    while let Some(r) = tasks.join_next().await {
        let (off, len, got) = r.unwrap();
        assert!(
            got == data[off as usize..off as usize + len],
            "bytes differ at {off}+{len}"
        );
    }
    assert_no_fallback(&s);
    // Every staging block of the server is back once the replies are out.
    let t = Instant::now();
    while s.pool_stats().free != 16 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(s.pool_stats().free, 16, "{:?}", s.pool_stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_clear_and_the_server_keeps_serving() {
    let (d, data) = data_dir("refuse");
    let s = server(&d, "127.0.0.1:0".parse().unwrap()).await;
    let addr = s.local_addr();
    let bad = client(vec![addr], "wrong", Duration::from_secs(2));
    let e = bad.open("data", "sub/shard.bin").await.unwrap_err();
    assert!(
        matches!(
            e,
            ClientError::Refused {
                code: Code::Auth,
                ..
            }
        ),
        "{e}"
    );
    let none = client(vec![addr], "", Duration::from_secs(2));
    assert!(matches!(
        none.open("data", "sub/shard.bin").await.unwrap_err(),
        ClientError::Refused {
            code: Code::Auth,
            ..
        }
    ));
    let c = client(vec![addr], "s3cret", Duration::from_secs(2));
    for (root, path, code) in [
        ("data", "../secret.txt", Code::Forbidden),
        ("data", "/etc/passwd", Code::Forbidden),
        ("data", "escape", Code::Forbidden),
        ("data", "nope.bin", Code::NotFound),
        ("other", "x", Code::NotFound),
    ] {
        let e = c.open(root, path).await.unwrap_err();
        assert!(
            matches!(&e, ClientError::Refused { code: got, .. } if *got == code),
            "{root}/{path}: {e}"
        );
    }
    let f = c.open("data", "sub/shard.bin").await.unwrap();
    let p = pool();
    let (r, l) = c
        .read(&f, data.len() as u64 - 10, 11, p.try_acquire().unwrap(), 0)
        .await;
    assert!(
        matches!(
            r,
            Err(ClientError::Refused {
                code: Code::Range,
                ..
            })
        ),
        "{r:?}"
    );
    let (r, l2) = c.read(&f, 0, (1 << 20) + 1, l, 0).await;
    assert!(
        matches!(
            r,
            Err(ClientError::Refused {
                code: Code::TooLarge,
                ..
            })
        ),
        "{r:?}"
    );
    // Still serving, on the same connection and on new ones.
    let (r, l3) = c.read(&f, 100, 1000, l2, 0).await;
    r.unwrap();
    assert_eq!(l3.as_slice().unwrap()[..1000], data[100..1100]);
    assert!(s.stats().refused.load(std::sync::atomic::Ordering::Relaxed) >= 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_or_a_replica_takes_over_and_no_server_is_a_typed_error() {
    let (d, data) = data_dir("faults");
    let s1 = server(&d, "127.0.0.1:0".parse().unwrap()).await;
    let a1 = s1.local_addr();
    let c = client(vec![a1], "s3cret", Duration::from_secs(5));
    let f = c.open("data", "sub/shard.bin").await.unwrap();
    let p = pool();
    let (r, l) = c.read(&f, 0, 4096, p.try_acquire().unwrap(), 0).await;
    r.unwrap();
    // Kill the server; restart it on the same address 300 ms later: the read retries and succeeds.
    s1.shutdown();
    let d2 = d.clone();
    let restart = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        server(&d2, a1).await
    });
    let (r, l) = c.read(&f, 8192, 4096, l, 0).await;
    r.unwrap();
    assert_eq!(l.as_slice().unwrap()[..4096], data[8192..12288]);
    let s1b = restart.await.unwrap();
    // Two replicas: the first dies, the second serves.
    let s2 = server(&d, "127.0.0.1:0".parse().unwrap()).await;
    let rc = client(
        vec![s1b.local_addr(), s2.local_addr()],
        "s3cret",
        Duration::from_secs(5),
    );
    let (r, l) = rc.read(&f, 0, 100, l, 0).await;
    r.unwrap();
    s1b.shutdown();
    let (r, l) = rc.read(&f, 200, 100, l, 0).await;
    r.unwrap();
    assert_eq!(l.as_slice().unwrap()[..100], data[200..300]);
    // No server at all: a typed error within the deadline, not a hang.
    drop(s2);
    let dead = client(vec![a1], "s3cret", Duration::from_millis(700));
    let t = Instant::now();
    let (r, _l) = dead.read(&f, 0, 100, l, 0).await;
    assert!(matches!(r, Err(ClientError::Unavailable { .. })), "{r:?}");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
}
