#![no_main]
//! CRC sidecar: any bytes are the CRCs of a shard of the count they claim, or are refused.

use libfuzzer_sys::fuzz_target;
use std::path::Path;
use ubdirect_loader::formats::crc;

fuzz_target!(|data: &[u8]| {
    let want = data.len().saturating_sub(16) / 4;
    if let Ok(v) = crc::parse_sidecar(Path::new("s.bin.crc32"), data, want) {
        assert_eq!(v.len(), want);
    }
    let _ = crc::parse_sidecar(Path::new("s.bin.crc32"), data, want + 1);
});
