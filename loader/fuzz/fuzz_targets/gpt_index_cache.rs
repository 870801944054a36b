#![no_main]
//! GPT index cache file (`PREFIX.idx.ubdirect-gpt-KEY`), unsealed (the structural path a start
//! without a sealing key takes): any bytes are indices whose every window is whole and in order over
//! the sequences they index, or are refused (a CRC proves a file whole, not right). Key, sequences
//! and settings are fixed: those of the committed seed; the input is tried as it is and with its
//! CRC recomputed.

use libfuzzer_sys::fuzz_target;
use ubdirect_loader::gpt::SplitPart;
use ubdirect_loader::gpt::cache;
use ubdirect_loader::gpt::check::check_indices;
use ubdirect_loader::gpt::megatron::MegatronGptConfig;

fn sizes() -> Vec<i32> {
    (0..40).map(|i| (i * 7919) % 23).collect()
}

fn cfg() -> MegatronGptConfig {
    MegatronGptConfig {
        seed: 5,
        sequence_length: 8,
        add_extra_token: true,
        num_samples: Some(60),
        split: "90,10".into(),
        part: SplitPart::Train,
    }
}

/// The input with its CRC recomputed, as anyone who can write the directory can: the fuzzer then
/// explores the contents the CRC would otherwise hide.
fn resealed(data: &[u8]) -> Vec<u8> {
    let mut b = data.to_vec();
    if b.len() >= 16 {
        let klen = u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8]));
        let h = klen
            .checked_add(7)
            .and_then(|k| (k / 8 * 8).checked_add(16));
        if let Some(h) = h.and_then(|h| usize::try_from(h).ok())
            && h.checked_add(40).is_some_and(|e| e <= b.len())
        {
            // The body ends where the (unsealed, unchecked) 32-byte seal begins.
            let end = b.len().saturating_sub(32).max(h + 40);
            let mut c = crc32fast::Hasher::new();
            c.update(&b[h..h + 32]);
            c.update(&b[h + 40..end]);
            let crc = c.finalize().to_le_bytes();
            b[h + 32..h + 36].copy_from_slice(&crc);
        }
    }
    b
}

fuzz_target!(|data: &[u8]| {
    let (sizes, cfg) = (sizes(), cfg());
    let _ = cache::parse(data, b"fuzz", &sizes[..], &cfg);
    if let Ok(ix) = cache::parse(&resealed(data), b"fuzz", &sizes[..], &cfg) {
        assert!(check_indices(&ix, &sizes[..], &cfg).is_ok());
        assert_eq!(
            ix.shuffle_index.as_ref().map_or(0, |s| s.len()) as u64,
            ix.samples()
        );
    }
});
