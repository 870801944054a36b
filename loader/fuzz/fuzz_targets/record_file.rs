#![no_main]
//! Step record files (`ubdirect run --record`, read by `ubdirect replay`): any bytes are a record
//! whose rows are what the file holds, or a typed error — never a panic (arrow-ipc's reader
//! panicked on 37 of 250 mutated records before records were read through
//! `formats::arrow::file_batches`), and never more rows than the file has bytes for.

use libfuzzer_sys::fuzz_target;
use ubdirect_loader::record;

fuzz_target!(|data: &[u8]| {
    for step in [0, 1] {
        if let Ok((meta, rows)) = record::parse(data, step) {
            assert!(meta.world_size >= 1);
            // Each row is 13 uint64s in the file.
            assert!(rows.len() * 8 * record::COLUMNS.len() <= data.len());
        }
    }
});
