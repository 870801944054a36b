#![no_main]
//! WebDataset sidecar (`SHARD.tar.ubdirect-index`): any bytes (given a valid CRC, so the fuzzer
//! reaches the checks behind it) list members inside the shard, each after a header of its own, in
//! file order, or are ignored. Input: the shard's size (8 bytes, little-endian), then the sidecar
//! without its CRC-32.

use libfuzzer_sys::fuzz_target;
use ubdirect_loader::formats::webdataset;

fuzz_target!(|data: &[u8]| {
    let Some((size, side)) = data.split_first_chunk::<8>() else {
        return;
    };
    let size = u64::from_le_bytes(*size) % (1 << 40);
    let mut b = side.to_vec();
    b.extend_from_slice(&crc32fast::hash(side).to_le_bytes());
    b.extend_from_slice(&[0; 32]); // an unsealed file's seal
    if let Some(m) = webdataset::parse_sidecar(&b, size) {
        assert!(m.entries().len() as u64 <= size / 512);
        let mut end = 0u64;
        for e in m.entries() {
            assert!(e.header >= end && e.offset >= e.header + 512);
            end = e.offset + e.size;
            assert!(end <= size);
        }
    }
});
