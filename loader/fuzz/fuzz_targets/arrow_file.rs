#![no_main]
//! Arrow IPC file (footer, schema, record batch metadata) and stream: any bytes index column
//! `payload` or are refused.

use libfuzzer_sys::fuzz_target;
use std::io::Cursor;
use std::path::PathBuf;
use ubdirect_loader::formats::arrow;

fuzz_target!(|data: &[u8]| {
    let mut shards = [(
        PathBuf::from("f.arrow"),
        data.len() as u64,
        Cursor::new(data),
    )];
    if let Ok(idx) = arrow::open_readers(&mut shards, "payload") {
        assert!(idx.validate().is_ok());
    }
});
