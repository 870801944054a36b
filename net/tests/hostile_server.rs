//! A misbehaving server against the `ub://` client and the SMC client (issue 14, item 6): a fake
//! server (a plain tokio listener that speaks just enough of the protocol) answers reads with lying
//! lengths, wrong request ids, slow or endless payloads, or a disconnect in the middle of a frame.
//! Each client must return a typed error within its deadline, give the lease back, and allocate
//! nothing near what the server declares.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use ubdirect_net::proto::{self, Header, Kind, Msg};
use ubdirect_net::smc::{SmcClient, SmcError, SmcOptions};
use ubdirect_net::{Client, ClientError};
use ubdirect_ub::{MemoryKind, PoolConfig, UbPool};

mod support;
use support::{largest, largest_reset};

/// How the fake server answers a read (`Read` or `SmcRead`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Lie {
    /// A `ReadOk` one byte longer than asked, with that many bytes.
    Length,
    /// A `ReadOk` declaring 4 GiB.
    Huge,
    /// The right reply under another request's id.
    WrongId,
    /// The right header, then one byte every 20 ms.
    Slow,
    /// Replies to ids nobody asked for, 1 MiB each, without end.
    Endless,
    /// Half a header, then the connection is closed.
    CutMidFrame,
    /// `HelloOk` announces `max_request = u32::MAX`; a read's reply declares that much and stalls.
    HugeHello,
}

const MAX: u32 = 1 << 20;

/// Starts a fake server on a runtime of its own (its threads are not the test's); returns its
/// address and the runtime, which keeps it alive.
fn fake(lie: Lie) -> (SocketAddr, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    rt.spawn(async move {
        let l = TcpListener::from_std(l).unwrap();
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(fake_conn(s, lie));
        }
    });
    (addr, rt)
}

async fn fake_conn(mut s: TcpStream, lie: Lie) {
    let t = Duration::from_secs(60);
    loop {
        let Ok((h, p)) = proto::read_frame(&mut s, 16 << 20, t, t).await else {
            return;
        };
        let answer = match Msg::decode(h.kind, &p) {
            Ok(Msg::Hello { .. }) => Msg::HelloOk {
                max_request: if lie == Lie::HugeHello { u32::MAX } else { MAX },
                max_inflight: 8,
            },
            Ok(Msg::Open { .. }) => Msg::OpenOk {
                file: 0,
                size: 1 << 30,
            },
            Ok(Msg::SmcOpen { .. }) => Msg::SmcOpenOk {
                region: 0,
                size: 1 << 20,
                writable: true,
                window: None,
            },
            Ok(Msg::Read { len, .. } | Msg::SmcRead { len, .. }) => {
                if misbehave(&mut s, lie, h.id, len).await.is_err() {
                    return;
                }
                continue;
            }
            _ => return,
        };
        if s.write_all(&answer.frame(h.id)).await.is_err() {
            return;
        }
    }
}

fn read_ok(id: u64, len: u32) -> [u8; proto::HEADER] {
    Header {
        kind: Kind::ReadOk,
        id,
        len,
    }
    .encode()
}

async fn misbehave(s: &mut TcpStream, lie: Lie, id: u64, len: u32) -> std::io::Result<()> {
    match lie {
        Lie::Length => {
            s.write_all(&read_ok(id, len + 1)).await?;
            s.write_all(&vec![1u8; len as usize + 1]).await
        }
        Lie::Huge | Lie::HugeHello => {
            s.write_all(&read_ok(id, u32::MAX)).await?;
            s.write_all(&[1u8; 100]).await?;
            // Then silence, holding the connection.
            std::future::pending().await
        }
        Lie::WrongId => {
            s.write_all(&read_ok(id + 1000, len)).await?;
            s.write_all(&vec![1u8; len as usize]).await
        }
        Lie::Slow => {
            s.write_all(&read_ok(id, len)).await?;
            loop {
                s.write_all(&[1u8]).await?;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Lie::Endless => {
            let junk = vec![1u8; MAX as usize];
            for k in 1.. {
                s.write_all(&read_ok(id + 1000 * k, MAX)).await?;
                s.write_all(&junk).await?;
            }
            Ok(())
        }
        Lie::CutMidFrame => {
            s.write_all(&read_ok(id, len)[..10]).await?;
            Err(std::io::ErrorKind::ConnectionAborted.into())
        }
    }
}

const ALL: [Lie; 7] = [
    Lie::Length,
    Lie::Huge,
    Lie::WrongId,
    Lie::Slow,
    Lie::Endless,
    Lie::CutMidFrame,
    Lie::HugeHello,
];

/// Slack over a deadline for a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(700);

#[tokio::test(flavor = "current_thread")]
async fn the_ub_client_returns_typed_errors_within_its_deadline() {
    let pool = UbPool::new_host(PoolConfig::new(
        "hostile",
        MAX as usize,
        1,
        MemoryKind::Host,
    ))
    .unwrap();
    let deadline = Duration::from_millis(800);
    for lie in ALL {
        let (addr, rt) = fake(lie);
        let c = Client::new(vec![addr], "hostile-token-0123", deadline);
        let f = c.open("r", "f.bin").await.unwrap();
        let lease = pool.acquire(Duration::from_secs(1)).await.unwrap();
        largest_reset();
        let t = Instant::now();
        let (r, lease) = c.read(&f, 0, 64 << 10, lease, 0).await;
        let took = t.elapsed();
        let big = largest();
        let e = r.expect_err("a lying server's read succeeded");
        eprintln!(
            "{lie:?}: {took:?}, largest allocation {big} B: {e} ({:?})",
            {
                use std::error::Error;
                e.source().map(|s| s.to_string())
            }
        );
        assert!(
            matches!(
                e,
                ClientError::Timeout { .. } | ClientError::Unavailable { .. }
            ),
            "{lie:?}: {e:?}"
        );
        assert!(took < deadline + SLACK, "{lie:?}: {took:?}");
        assert!(big < 256 << 10, "{lie:?}: allocated {big} bytes");
        drop(lease);
        rt.shutdown_background();
    }
    assert_eq!(pool.stats().free, 1);
}

#[test]
fn the_smc_client_returns_typed_errors_within_its_deadline() {
    let opts = SmcOptions {
        deadline: Duration::from_millis(400),
        retries: 1,
    };
    let bound = opts.deadline * (opts.retries + 1) + SLACK;
    for lie in ALL {
        let (addr, rt) = fake(lie);
        let c = SmcClient::new(addr, "hostile-token-0123", opts);
        let r = c.register("kv", "region-key").unwrap();
        let mut buf = vec![0u8; 64 << 10];
        largest_reset();
        let t = Instant::now();
        let e = r
            .read(0, &mut buf)
            .expect_err("a lying server's read succeeded");
        let (took, big) = (t.elapsed(), largest());
        eprintln!("smc {lie:?}: {took:?}, largest allocation {big} B: {e}");
        assert!(matches!(e, SmcError::Unavailable { .. }), "{lie:?}: {e:?}");
        assert!(took < bound, "{lie:?}: {took:?} (bound {bound:?})");
        assert!(big < 1 << 20, "{lie:?}: allocated {big} bytes");
        rt.shutdown_background();
    }
}

/// A server nobody ever reached that refuses connections is not there: the client says so within
/// a couple of seconds, not after its 30 s deadline (issue 45: `Connection refused` was retried for
/// the whole `remote.deadline_ms`).
#[tokio::test(flavor = "current_thread")]
async fn nothing_listening_is_an_error_in_seconds_not_the_deadline() {
    // A port that was just free: bound, then closed.
    let addr = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let c = Client::new(vec![addr], "t", Duration::from_secs(30));
    let t0 = Instant::now();
    let e = c.open("r", "x.bin").await.unwrap_err();
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(10), "{took:?}: {e}");
    assert!(
        took >= Duration::from_millis(900),
        "a starting server gets a second: {took:?}"
    );
    assert!(matches!(e, ClientError::Unavailable { .. }), "{e:?}");
    let chain = std::iter::successors(Some(&e as &dyn std::error::Error), |e| e.source())
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join(" / ");
    assert!(chain.contains("refused"), "{chain}");
}
