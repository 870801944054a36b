#![no_main]
//! `.npy` header and index: any bytes are a header and the file it opens, or a typed error.

use libfuzzer_sys::fuzz_target;
use std::io::Cursor;
use std::path::PathBuf;
use ubdirect_loader::formats::npy;

fuzz_target!(|data: &[u8]| {
    let mut shards = [(PathBuf::from("f.npy"), data.len() as u64, Cursor::new(data))];
    if let Ok(idx) = npy::open_readers(&mut shards) {
        // What indexes lies inside the file it describes.
        assert!(idx.validate().is_ok());
    }
});
