#![no_main]
//! Arrow sidecar (`FILE.ubdirect-index`): any bytes list record batch blocks that lie inside the
//! file, once each and in file order (so what they cost is bounded by the file), or are ignored.
//! Input: the file's size (8 bytes, little-endian), then the sidecar.

use libfuzzer_sys::fuzz_target;
use ubdirect_loader::formats::arrow;

fuzz_target!(|data: &[u8]| {
    let Some((size, side)) = data.split_first_chunk::<8>() else {
        return;
    };
    let size = u64::from_le_bytes(*size) % (1 << 40);
    if let Some(blocks) = arrow::parse_sidecar(side, size) {
        assert!(blocks.len() as u64 <= size / 8);
        let mut end = 0u64;
        for (o, m, l) in blocks {
            let (o, m, l) = (o as u64, m as u64, l as u64);
            assert!(o >= end && m >= 8);
            end = o + m + l;
            assert!(end <= size);
        }
    }
});
