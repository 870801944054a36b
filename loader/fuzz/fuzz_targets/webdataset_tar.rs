#![no_main]
//! WebDataset tar (ustar, GNU long names, pax records): any bytes list members inside the file, in
//! file order, or are a typed error; read through memory and through the windowed reader alike;
//! samples grouped from them lie inside the file.

use libfuzzer_sys::fuzz_target;
use std::io::Cursor;
use std::path::Path;
use ubdirect_loader::formats::webdataset::{self, tar};

fuzz_target!(|data: &[u8]| {
    let p = Path::new("f.tar");
    let size = data.len() as u64;
    let scanned = tar::scan(&mut tar::Bytes(data, p), p, size);
    let windowed = webdataset::scan_reader(&mut Cursor::new(data), p, size);
    if let Ok(m) = &scanned {
        let mut end = 0u64;
        for e in m.entries() {
            assert!(e.header >= end && e.offset >= e.header + 512);
            end = e.offset + e.size;
            assert!(end <= size);
        }
        for column in ["jpg", "cls"] {
            if let Ok(s) = webdataset::samples_of(m, p, column) {
                assert!(s.iter().all(|&(o, l)| o + l as u64 <= size));
            }
        }
        // The windowed reader sees the same members (unless the bytes look compressed).
        if let Ok(w) = &windowed {
            assert_eq!(w, m);
        }
    }
});
