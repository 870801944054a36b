//! The `Source` conformance suite (`ubdirect_ub::source::conformance`) on `ub://`: a real server on
//! loopback, a `RemoteSource` over TCP — or over RDMA with `UBDIRECT_TEST_TRANSPORT=rdma` (a build with
//! `--features rdma` on a machine with an RDMA device: the test guest runs it over rxe). Then the
//! error kinds a remote read maps to, and the lease coming back from a reply that stalls, against a
//! scripted peer.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use ubdirect_net::proto::{self, Header, Kind, Msg};
use ubdirect_net::{Client, RemoteFile, RemoteSource, Server, ServerConfig, Transport};
use ubdirect_ub::source::conformance;
use ubdirect_ub::{MemoryKind, PoolConfig, Source, SourceErrorKind, UbPool};

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

/// 2 MiB + 4097 bytes of xorshift noise (no period a misplaced read could hide in).
fn shard(name: &str) -> (PathBuf, Vec<u8>) {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("net-source")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let data: Vec<u8> = (0..(2 << 20) + 4097)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    std::fs::write(d.join("shard.bin"), &data).unwrap();
    (d, data)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_source_passes_the_source_conformance_suite() {
    let (d, data) = shard("suite");
    // max_request below the block size: a read larger than one request is split by the source.
    let s = Server::start(ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: b"s3cret".to_vec(),
        roots: vec![("data".into(), d.clone())],
        max_request: 256 << 10,
        blocks: 16,
        rdma_device: (transport_name() == "rdma").then(String::new),
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    let addr = s.local_addr();
    let client = Client::with_transport(vec![addr], "s3cret", Duration::from_secs(10), transport());
    let src = RemoteSource::open(
        client,
        "data",
        "shard.bin",
        format!("ub://{addr}/data/shard.bin"),
    )
    .await
    .unwrap();
    println!("source: {}", src.describe());
    let mut b = UbPool::builder(PoolConfig::new(
        "net-source",
        512 << 10,
        8,
        MemoryKind::Host,
    ));
    for r in src.registrars() {
        b = b.register_with(r);
    }
    let pool = b.build().unwrap();
    let checks = conformance::run(&src, &pool, &data).await;
    let failed = conformance::report(&format!("ub:// {}", transport_name()), &checks);
    assert!(failed.is_empty(), "{failed:#?}");
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
                > 0,
            "no payload went by RDMA WRITE"
        );
    }
}

fn pool() -> UbPool {
    UbPool::new_host(PoolConfig::new(
        "net-source-err",
        64 << 10,
        2,
        MemoryKind::Host,
    ))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_and_dead_servers_map_to_source_error_kinds() {
    let (d, _) = shard("kinds");
    let s = Server::start(ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: b"s3cret".to_vec(),
        roots: vec![("data".into(), d.clone())],
        // Small: the QEMU guest that runs this over RDMA has little memory.
        max_request: 256 << 10,
        blocks: 4,
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    let addr = s.local_addr();
    let client = Client::new(vec![addr], "s3cret", Duration::from_secs(2));
    // Opening a missing file: refused, not found.
    let e = RemoteSource::open(client.clone(), "data", "nope.bin", "ub://x/data/nope.bin")
        .await
        .unwrap_err();
    assert_eq!(
        ubdirect_net::source::kind_of(&e),
        SourceErrorKind::NotFound,
        "{e}"
    );
    // A file that shrank under the source (the size it was opened with is stale): the server's
    // range refusal is OutOfRange, and the lease comes back.
    let file = client.open("data", "shard.bin").await.unwrap();
    let stale = RemoteFile {
        size: file.size + 4096,
        ..file
    };
    let src = RemoteSource::new(client, stale, format!("ub://{addr}/data/shard.bin"));
    let p = pool();
    let l = p.try_acquire().unwrap();
    let h = l.handle();
    let (r, l) = src
        .read(src.size() - 100, 100, l, 0, Duration::from_secs(2))
        .await;
    let e = r.unwrap_err();
    assert_eq!(e.kind, SourceErrorKind::OutOfRange, "{e}");
    assert!(e.source_as::<ubdirect_net::ClientError>().is_some());
    assert_eq!(l.handle(), h);
    // No server: Unavailable within the deadline, lease back.
    drop(s);
    let dead = RemoteSource::new(
        Client::new(vec![addr], "s3cret", Duration::from_millis(500)),
        RemoteFile {
            root: "data".into(),
            path: "shard.bin".into(),
            size: 1 << 20,
        },
        format!("ub://{addr}/data/shard.bin"),
    );
    let t = Instant::now();
    let (r, l) = dead.read(0, 100, l, 0, Duration::from_millis(500)).await;
    let e = r.unwrap_err();
    assert_eq!(e.kind, SourceErrorKind::Unavailable, "{e}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // The chain is kept, typed: SourceError → ClientError → LinkError (connect) → the socket's error.
    let ce = e.source_as::<ubdirect_net::ClientError>().unwrap();
    let link = std::error::Error::source(ce)
        .and_then(|s| s.downcast_ref::<ubdirect_net::LinkError>())
        .unwrap();
    match link {
        // Refused at once: the socket's error is kept as the source.
        ubdirect_net::LinkError::Connect { .. } => {
            assert!(std::error::Error::source(link).is_some());
        }
        // The QEMU guest (TCG, RDMA) is slow enough that the attempt itself can run out of time.
        ubdirect_net::LinkError::Deadline {
            what: "connection", ..
        } => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(l.handle(), h);
}

/// A scripted peer: answers the hello and opens (a 1 MiB file), and answers every read according to
/// `on_read` (nothing, or a header and half the payload).
async fn scripted_peer(stall_mid_payload: bool) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((sock, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut rd, mut wr) = sock.into_split();
                let t = Duration::from_secs(30);
                while let Ok((h, p)) = proto::read_frame(&mut rd, 0, t, t).await {
                    let reply = match Msg::decode(h.kind, &p) {
                        Ok(Msg::Hello { .. }) => Msg::HelloOk {
                            max_request: 1 << 20,
                            max_inflight: 8,
                        }
                        .frame(h.id),
                        Ok(Msg::Open { .. }) => Msg::OpenOk {
                            file: 0,
                            size: 1 << 20,
                        }
                        .frame(h.id),
                        Ok(Msg::Read { len, .. }) if stall_mid_payload => {
                            let mut f = Header {
                                kind: Kind::ReadOk,
                                id: h.id,
                                len,
                            }
                            .encode()
                            .to_vec();
                            f.extend(std::iter::repeat_n(7u8, len as usize / 2));
                            f
                        }
                        _ => continue,
                    };
                    if wr.write_all(&reply).await.is_err() {
                        break;
                    }
                }
                // Keep the connection open (silent) until the client goes.
                let _ = proto::read_frame(&mut rd, 0, Duration::from_secs(30), t).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_or_stalled_reply_is_a_timeout_and_the_lease_comes_back() {
    for stall in [false, true] {
        let addr = scripted_peer(stall).await;
        // The client's deadline bounds a payload once it began; the read's own deadline is shorter.
        let client = Client::new(vec![addr], "t0ken", Duration::from_millis(600));
        let src = RemoteSource::open(client, "r", "f", format!("ub://{addr}/r/f"))
            .await
            .unwrap();
        let p = pool();
        let l = p.try_acquire().unwrap();
        let h = l.handle();
        let t = Instant::now();
        let (r, l) = src
            .read(0, 32 << 10, l, 0, Duration::from_millis(300))
            .await;
        let e = r.unwrap_err();
        assert_eq!(e.kind, SourceErrorKind::Timeout, "stall={stall}: {e}");
        assert_eq!(l.handle(), h, "stall={stall}: another lease came back");
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "stall={stall}: {:?}",
            t.elapsed()
        );
        drop(l);
        assert_eq!(p.stats().free, 2);
    }
}
