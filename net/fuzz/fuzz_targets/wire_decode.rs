#![no_main]
//! The wire protocol's decoders (`proto::Header::decode`, `proto::Msg::decode`): any bytes decode
//! or are refused, never panic or over-allocate; what decodes re-encodes to the same message.
//! Input: a 20-byte header, then the payload (for every kind when the header does not decode).

use libfuzzer_sys::fuzz_target;
use ubdirect_net::proto::{HEADER, Header, Kind, MAX_CONTROL, Msg};

/// Every frame kind (`Kind`'s values 1..=17).
const KINDS: [Kind; 17] = [
    Kind::Hello,
    Kind::HelloOk,
    Kind::Open,
    Kind::OpenOk,
    Kind::Read,
    Kind::ReadOk,
    Kind::Error,
    Kind::RdmaConnect,
    Kind::RdmaAccept,
    Kind::ReadTo,
    Kind::ReadDone,
    Kind::SmcOpen,
    Kind::SmcOpenOk,
    Kind::SmcRead,
    Kind::SmcWrite,
    Kind::SmcWriteOk,
    Kind::SmcWriteV,
];

fn round_trip(kind: Kind, payload: &[u8]) {
    if let Ok(m) = Msg::decode(kind, payload) {
        let f = m.frame(7);
        let h: [u8; HEADER] = f[..HEADER].try_into().expect("frame has a header");
        let hdr = Header::decode(&h, u32::MAX).expect("own header decodes");
        assert_eq!(hdr.kind, kind);
        assert_eq!(
            hdr.len as usize,
            f.len() - HEADER,
            "header length is the payload's"
        );
        assert_eq!(Msg::decode(hdr.kind, &f[HEADER..]).expect("own frame"), m);
    }
}

fuzz_target!(|data: &[u8]| {
    if let Some((h, payload)) = data.split_first_chunk::<HEADER>() {
        if let Ok(hdr) = Header::decode(h, 1 << 20) {
            assert!(hdr.len <= (1 << 20).max(MAX_CONTROL), "bounded by max_data");
            if hdr.kind != Kind::ReadOk {
                round_trip(hdr.kind, &payload[..payload.len().min(hdr.len as usize)]);
            }
            return;
        }
    }
    if let Some((&k, payload)) = data.split_first() {
        round_trip(KINDS[k as usize % KINDS.len()], payload);
    }
});
