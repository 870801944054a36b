#![no_main]
//! Megatron `.idx`: any bytes parse or are refused; what parses indexes against a `.bin` whose size
//! the input's first 8 bytes give, or is refused.

use libfuzzer_sys::fuzz_target;
use std::path::Path;
use ubdirect_loader::formats::megatron;

fuzz_target!(|data: &[u8]| {
    let (size, idx_bytes) = match data.split_first_chunk::<8>() {
        Some((s, rest)) => (u64::from_le_bytes(*s), rest),
        None => (0, data),
    };
    let (ip, bp) = (Path::new("m.idx"), Path::new("m.bin"));
    if let Ok(m) = megatron::parse_idx(ip, idx_bytes)
        && let Ok(idx) = megatron::index_of(vec![(m, bp.to_path_buf(), size)])
    {
        assert!(idx.validate().is_ok());
        // Every sample reads in place without panicking.
        assert_eq!(idx.samples.iter().count(), idx.samples.len());
    }
});
