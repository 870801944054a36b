use std::time::Duration;

use super::*;

#[test]
fn every_message_round_trips_and_truncations_are_errors() {
    for m in [
        Msg::Hello {
            token: b"secret".to_vec(),
        },
        Msg::HelloOk {
            max_request: 1 << 24,
            max_inflight: 64,
        },
        Msg::Open {
            root: "data".into(),
            path: "a/b.bin".into(),
        },
        Msg::OpenOk {
            file: 3,
            size: 1 << 40,
        },
        Msg::Read {
            file: 3,
            offset: 12345,
            len: 4096,
        },
        Msg::Error {
            code: Code::Range,
            message: "past end".into(),
        },
        Msg::RdmaConnect(QpEndpoint {
            qpn: 17,
            psn: 0xabcdef,
            lid: 0,
            mtu: 3,
            gid: [7; 16],
        }),
        Msg::RdmaAccept(QpEndpoint {
            qpn: 18,
            psn: 1,
            lid: 2,
            mtu: 5,
            gid: [0; 16],
        }),
        Msg::ReadTo {
            file: 1,
            offset: 4096,
            len: 8192,
            addr: 0x7f00_0000_1000,
            rkey: 0x1234,
        },
        Msg::ReadDone,
        Msg::SmcOpen {
            name: "kv".into(),
            key: b"k3y".to_vec(),
        },
        Msg::SmcOpenOk {
            region: 2,
            size: 1 << 30,
            writable: true,
            window: None,
        },
        Msg::SmcOpenOk {
            region: 3,
            size: 4096,
            writable: false,
            window: Some(RemoteWindow {
                addr: 0x7f00_0000_2000,
                rkey: 0x99,
            }),
        },
        Msg::SmcRead {
            region: 2,
            offset: 4096,
            len: 65536,
        },
        Msg::SmcWrite {
            region: 2,
            offset: 64,
            data: vec![9; 100],
        },
        Msg::SmcWriteOk,
        Msg::SmcWriteV {
            region: 1,
            ranges: vec![(0, 3), (8192, 2)],
            data: vec![1, 2, 3, 4, 5],
        },
    ] {
        let f = m.frame(42);
        let h = Header::decode(f[..HEADER].try_into().unwrap_or(&[0; HEADER]), 1 << 20)
            .expect("header");
        assert_eq!(
            (h.kind, h.id, h.len as usize),
            (m.kind(), 42, f.len() - HEADER)
        );
        assert_eq!(Msg::decode(h.kind, &f[HEADER..]).expect("decode"), m);
        // Every truncation is an error, never a panic.
        for cut in 0..f.len() - HEADER {
            let _ = Msg::decode(h.kind, &f[HEADER..HEADER + cut]);
        }
    }
}

#[test]
fn headers_messages_and_codes_are_bounded() {
    let mut h = Header {
        kind: Kind::ReadOk,
        id: 1,
        len: 1 << 30,
    }
    .encode();
    assert!(matches!(
        Header::decode(&h, 1 << 20),
        Err(ProtoError::TooLong { .. })
    ));
    h[0] = b'X';
    assert!(matches!(
        Header::decode(&h, 1 << 20),
        Err(ProtoError::Magic(_))
    ));
    assert_eq!(Code::from(4), Code::Range);
    // A long message is cut at a character boundary and still decodes.
    let long = Msg::Error {
        code: Code::Io,
        message: "é".repeat(1500),
    };
    let f = long.frame(1);
    match Msg::decode(Kind::Error, &f[HEADER..]) {
        Ok(Msg::Error { message, .. }) => assert_eq!(message, "é".repeat(1024)),
        other => panic!("{other:?}"),
    }
    assert_eq!(u16::from(Code::from(77)), 77);
    assert!(
        constant_time_eq(b"abc", b"abc")
            && !constant_time_eq(b"abc", b"abd")
            && !constant_time_eq(b"abc", b"ab")
    );
}

#[test]
fn write_heads_decode_what_the_heads_encode() {
    let f = smc_write_head(5, 7, 4096, 3);
    assert_eq!(
        WriteHead::decode(Kind::SmcWrite, &f[HEADER..]).expect("head"),
        WriteHead::One {
            region: 7,
            offset: 4096
        }
    );
    let f = smc_writev_head(6, 2, [(0, 3), (8192, 2)]);
    assert_eq!(WriteHead::fixed_len(Kind::SmcWriteV), Some(8));
    assert_eq!(
        WriteHead::decode(Kind::SmcWriteV, &f[HEADER..HEADER + 8]).expect("head"),
        WriteHead::Vectored {
            region: 2,
            count: 2
        }
    );
    assert_eq!(
        decode_ranges(&f[HEADER + 8..]).collect::<Vec<_>>(),
        vec![(0, 3), (8192, 2)]
    );
    assert!(WriteHead::decode(Kind::SmcWrite, &f[HEADER..HEADER + 5]).is_err());
    assert!(WriteHead::decode(Kind::Read, &[0; 12]).is_err());
    assert_eq!(WriteHead::fixed_len(Kind::Read), None);
}

#[tokio::test]
async fn frame_reader_bounds_and_deadlines() {
    use tokio::io::AsyncWriteExt;
    let short = Duration::from_millis(50);
    // A whole frame.
    let (mut a, mut b) = tokio::io::duplex(1 << 16);
    let f = Msg::Read {
        file: 1,
        offset: 2,
        len: 3,
    }
    .frame(9);
    a.write_all(&f).await.expect("write");
    let (h, p) = read_frame(&mut b, 0, short, short).await.expect("frame");
    assert_eq!((h.kind, h.id), (Kind::Read, 9));
    assert_eq!(
        Msg::decode(h.kind, &p).expect("decode"),
        Msg::Read {
            file: 1,
            offset: 2,
            len: 3
        }
    );
    // Nothing arrives: a timeout on the header.
    assert!(matches!(
        read_frame(&mut b, 0, short, short).await,
        Err(FrameError::Timeout { what: "header", .. })
    ));
    // A header whose payload never comes: a timeout on the payload.
    a.write_all(&f[..HEADER + 2]).await.expect("write");
    assert!(matches!(
        read_frame(&mut b, 0, short, short).await,
        Err(FrameError::Timeout {
            what: "payload",
            ..
        })
    ));
    // A declared length over the maximum is refused from the header alone.
    let (mut a, mut b) = tokio::io::duplex(1 << 16);
    let big = Header {
        kind: Kind::ReadOk,
        id: 1,
        len: u32::MAX,
    }
    .encode();
    a.write_all(&big).await.expect("write");
    assert!(matches!(
        read_frame(&mut b, 1 << 20, short, short).await,
        Err(FrameError::Proto(ProtoError::TooLong { .. }))
    ));
    // A quiet connection may wait `wait`; a header once begun must finish within `deadline`.
    let (mut a, mut b) = tokio::io::duplex(1 << 16);
    a.write_all(&f[..7]).await.expect("write");
    let t = std::time::Instant::now();
    assert!(matches!(
        read_header_within(&mut b, 0, Duration::from_secs(3600), short).await,
        Err(FrameError::Timeout { what: "header", .. })
    ));
    assert!(t.elapsed() < Duration::from_secs(5));
    // A declared payload is not allocated ahead: what arrived is all there is, and a payload
    // that arrives in pieces is put together.
    let (mut a, mut b) = tokio::io::duplex(1 << 20);
    let data: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
    let send = tokio::spawn(async move {
        for part in data.chunks(70_000) {
            a.write_all(part).await.expect("write");
            tokio::task::yield_now().await;
        }
        a
    });
    let p = read_payload_vec(&mut b, 300_000, Duration::from_secs(5))
        .await
        .expect("payload");
    assert!(p.len() == 300_000 && p.iter().enumerate().all(|(i, &x)| x == i as u8));
    let mut a = send.await.expect("sender");
    a.write_all(&[1, 2, 3]).await.expect("write");
    assert!(matches!(
        read_payload_vec(&mut b, 16 << 20, short).await,
        Err(FrameError::Timeout {
            what: "payload",
            ..
        })
    ));
    // A payload nobody waits for is drained, and the stream stays in step.
    a.write_all(&[9u8; 5000]).await.expect("write");
    a.write_all(&f).await.expect("write");
    discard_payload(&mut b, 5000, short).await.expect("drain");
    assert_eq!(
        read_frame(&mut b, 0, short, short)
            .await
            .expect("frame")
            .0
            .id,
        9
    );
    // A clean close between frames, and one inside a header.
    let (a, mut b) = tokio::io::duplex(64);
    drop(a);
    assert!(matches!(
        read_header(&mut b, 0, short).await,
        Err(FrameError::Closed)
    ));
    let (mut a, mut b) = tokio::io::duplex(64);
    a.write_all(&f[..5]).await.expect("write");
    drop(a);
    assert!(matches!(
        read_header(&mut b, 0, short).await,
        Err(FrameError::Io { what: "header", .. })
    ));
}
