#![no_main]
//! `SmcWriteV` frames as the server reads them: the 8 fixed bytes (region, range count), then the
//! range table read in pieces as it arrives (`proto::read_write_ranges`), then the data. Any bytes
//! are ranges that were sent — the table's memory follows the bytes that arrived, never the count
//! a header declared — and agree with the whole-frame decoder (`Msg::decode`).

use libfuzzer_sys::fuzz_target;
use std::time::Duration;
use ubdirect_net::proto::{Kind, Msg, read_write_ranges};

fuzz_target!(|data: &[u8]| {
    let Some((fixed, rest)) = data.split_first_chunk::<8>() else {
        return;
    };
    let count = u32::from_le_bytes([fixed[4], fixed[5], fixed[6], fixed[7]]) as usize;
    // The server refuses a count whose table does not fit the frame before reading it.
    if count.saturating_mul(12) > rest.len() {
        return;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let mut rd = rest;
    let ranges = rt
        .block_on(read_write_ranges(&mut rd, count, Duration::from_secs(1)))
        .expect("a table that arrived whole is read");
    assert_eq!(ranges.len(), count);
    assert!(
        ranges.capacity() <= count.max(4096) * 2,
        "memory beyond what arrived"
    );
    if let Ok(Msg::SmcWriteV { ranges: whole, .. }) = Msg::decode(Kind::SmcWriteV, data) {
        assert_eq!(whole, ranges);
    }
});
