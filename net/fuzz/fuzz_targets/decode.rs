#![no_main]
//! Fuzzes the wire decoder: any bytes must decode or be refused, never panic or over-allocate.

use libfuzzer_sys::fuzz_target;
use ubdirect_net::proto::{HEADER, Header, Kind, Msg};

fuzz_target!(|data: &[u8]| {
    if data.len() >= HEADER {
        let h: [u8; HEADER] = data[..HEADER].try_into().expect("length checked");
        if let Ok(hdr) = Header::decode(&h, 1 << 20) {
            let payload = &data[HEADER..];
            if hdr.kind != Kind::ReadOk {
                let _ = Msg::decode(hdr.kind, &payload[..payload.len().min(hdr.len as usize)]);
            }
        }
    }
    for k in [Kind::Hello, Kind::HelloOk, Kind::Open, Kind::OpenOk, Kind::Read, Kind::Error] {
        if let Ok(m) = Msg::decode(k, data) {
            // What decodes re-encodes to a frame that decodes to the same message.
            let f = m.frame(7);
            let h: [u8; HEADER] = f[..HEADER].try_into().expect("frame has a header");
            let hdr = Header::decode(&h, 0).expect("own header");
            assert_eq!(Msg::decode(hdr.kind, &f[HEADER..]).expect("own frame"), m);
        }
    }
});
