use super::*;
use crate::gpt::SplitPart;

fn sizes() -> Vec<i32> {
    (0..60).map(|i| 5 + (i * 7919) % 61).collect()
}

fn cfg() -> MegatronGptConfig {
    MegatronGptConfig {
        seed: 3,
        sequence_length: 16,
        add_extra_token: true,
        num_samples: Some(300),
        split: "90,10".into(),
        part: SplitPart::Train,
    }
}

fn built() -> GptIndices {
    megatron::build(&sizes()[..], &cfg()).unwrap_or_else(|e| panic!("{e}"))
}

fn same(a: &GptIndices, b: &GptIndices) -> bool {
    a.document_index.iter().eq(b.document_index.iter())
        && a.sample_index == b.sample_index
        && a.epochs == b.epochs
        && a.shuffle_index.as_ref().map(|s| s.to_vec())
            == b.shuffle_index.as_ref().map(|s| s.to_vec())
}

/// The sealing key of these tests (not the user's).
const SEAL_KEY: [u8; 32] = [0x5e; 32];

/// Every single-byte change of a cache file is refused or (unsealed: padding and the empty
/// seal only) loads the same indices — never a panic, never other indices. Sealed, every one is
/// refused.
#[test]
fn every_flipped_byte_is_refused_or_harmless() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("c");
    let ix = built();
    let (sizes, cfg) = (sizes(), cfg());
    let key = b"a key of 13 b".to_vec();
    for sealed in [None, Some(SEAL_KEY)] {
        store(&path, &key, &ix, &sizes[..], sealed).unwrap_or_else(|e| panic!("{e}"));
        let sk = sealed.as_ref();
        let good = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
        let loaded = load(&path, &key, &sizes[..], &cfg, sk).unwrap_or_else(|e| panic!("{e}"));
        assert!(loaded.as_ref().is_some_and(|l| same(l, &ix)));
        assert!(load(&path, b"another key", &sizes[..], &cfg, sk).is_err());
        if sealed.is_none() {
            assert!(
                load(&path, &key, &sizes[..10], &cfg, sk).is_err(),
                "document ids past the sequences"
            );
            assert!(
                load(&path, &key, &sizes[..], &cfg, Some(&SEAL_KEY)).is_err(),
                "an unsealed file where a seal is expected"
            );
        } else {
            assert!(
                matches!(
                    load(&path, &key, &sizes[..], &cfg, Some(&[1; 32])),
                    Err(CacheError::Seal { .. })
                ),
                "another user's key"
            );
        }
        let (mut refused, mut harmless) = (0, 0);
        for at in 0..good.len() {
            let mut b = good.clone();
            b[at] ^= 0x01;
            std::fs::write(&path, &b).unwrap_or_else(|e| panic!("{e}"));
            match load(&path, &key, &sizes[..], &cfg, sk) {
                Err(_) => refused += 1,
                Ok(Some(l)) if same(&l, &ix) => harmless += 1,
                Ok(other) => panic!("byte {at}: loaded {other:?}"),
            }
        }
        // Unsealed: the key's padding (3 bytes), the word after the CRC (4 bytes) and the empty
        // seal (32) are not checked. Sealed: nothing is unchecked.
        let unchecked = if sealed.is_some() { 0 } else { 7 + 32 };
        assert_eq!(harmless, unchecked, "sealed {}", sealed.is_some());
        assert_eq!(refused, good.len() - unchecked);
        for n in [0, 8, 15, 16, good.len() / 2, good.len() - 1] {
            std::fs::write(&path, &good[..n]).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                load(&path, &key, &sizes[..], &cfg, sk).is_err(),
                "cut at {n}"
            );
        }
        std::fs::remove_file(&path).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(load(&path, &key, &sizes[..], &cfg, sk), Ok(None)));
    }
}

/// The layout of a stored file: (start of the counts, body, sample index, shuffle index).
fn layout(b: &[u8], key: &[u8]) -> (usize, usize, usize, usize) {
    let h = 16 + key.len().div_ceil(8) * 8;
    let docs = u64_at(b, h + 8) as usize;
    let entries = u64_at(b, h + 16) as usize;
    let body = h + FIXED;
    let shuffle_at = body + (docs * 4).div_ceil(8) * 8 + 8 * (docs.div_ceil(SHUFFLED_STRIDE) + 1);
    (h, body, entries, shuffle_at)
}

/// Recomputes a forged file's CRC, as anyone who can write the directory can.
fn reseal(b: &mut [u8], key: &[u8]) {
    let (h, body, ..) = layout(b, key);
    let mut c = crc32fast::Hasher::new();
    c.update(&b[h..h + 32]);
    c.update(&b[body..b.len() - seal::SEAL]);
    let crc = c.finalize().to_le_bytes();
    b[h + 32..h + 36].copy_from_slice(&crc);
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// Issue 23: cache files with a recomputed CRC and inconsistent contents were accepted (11 of
/// 19 forgeries; decreasing offsets gave a sample with no pieces and a panic in the chunk
/// builder). Each forgery below loaded before; each is now refused with the entry named.
#[test]
fn forged_caches_with_a_valid_crc_are_refused() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("c");
    let ix = built();
    let (sizes, cfg) = (sizes(), cfg());
    let key = b"k".to_vec();
    store(&path, &key, &ix, &sizes[..], None).unwrap_or_else(|e| panic!("{e}"));
    let good = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
    let (h, body, entries, shuffle_at) = layout(&good, &key);
    type Forge = Box<dyn Fn(&mut Vec<u8>)>;
    // The sample index is computed from the document index since `UBDGPT03`: its forgeries
    // (decreasing offsets, windows not sequence_length apart, ...) have no bytes to forge.
    let forgeries: Vec<(&str, Forge)> = vec![
        (
            "a document outside the split (the validation part's)",
            Box::new(move |b: &mut Vec<u8>| put_u32(b, body, 59)),
        ),
        (
            "a shuffled sample twice",
            Box::new(move |b: &mut Vec<u8>| {
                let first = u32_at(b, shuffle_at);
                put_u32(b, shuffle_at + 4, first);
            }),
        ),
        (
            "a prefix entry raised (windows that are not the documents')",
            Box::new(move |b: &mut Vec<u8>| {
                let at = shuffle_at - 16;
                let v = u64_at(b, at) + 1;
                b[at..at + 8].copy_from_slice(&v.to_le_bytes());
            }),
        ),
        (
            "a document past the sequences",
            Box::new(move |b: &mut Vec<u8>| put_u32(b, body + 8, 1 << 30)),
        ),
        // Round 3 of the attacks (2026-12-04): cut to 3 sample entries, the counts and the
        // shuffle made to agree: loaded and delivered nothing. Now: the windows the documents
        // make are counted.
        (
            "cut to 3 sample entries",
            Box::new(move |b: &mut Vec<u8>| {
                let width = u32_at(b, h + 4) as usize;
                b.truncate(shuffle_at);
                b[h + 16..h + 24].copy_from_slice(&3u64.to_le_bytes());
                b[h + 24..h + 32].copy_from_slice(&2u64.to_le_bytes());
                for v in [1u64, 0] {
                    b.extend_from_slice(&v.to_le_bytes()[..width]);
                }
                b.extend_from_slice(&[0; seal::SEAL]);
            }),
        ),
    ];
    assert!(entries > 3);
    for (what, forge) in forgeries {
        let mut b = good.clone();
        forge(&mut b);
        reseal(&mut b, &key);
        std::fs::write(&path, &b).unwrap_or_else(|e| panic!("{e}"));
        match load(&path, &key, &sizes[..], &cfg, None) {
            Err(CacheError::Inconsistent { offset, source }) => {
                assert!(offset as usize >= body, "{what}: offset {offset}: {source}")
            }
            // Counted before the structural checks: the windows a forged document order makes.
            Err(CacheError::Layout { .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
}

/// Round 3 of the attacks: a shuffle reversed (or left in order) and the CRC recomputed passes
/// every structural check — it is a permutation — and changed the order. A sealed file is
/// refused unless this user's key sealed it.
#[test]
fn a_reversed_shuffle_passes_structure_and_fails_the_seal() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("c");
    let ix = built();
    let (sizes, cfg) = (sizes(), cfg());
    let key = b"k".to_vec();
    store(&path, &key, &ix, &sizes[..], Some(SEAL_KEY)).unwrap_or_else(|e| panic!("{e}"));
    let mut b = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
    let (h, _, _, shuffle_at) = layout(&b, &key);
    let width = u32_at(&b, h + 4) as usize;
    let end = b.len() - seal::SEAL;
    let mut entries: Vec<Vec<u8>> = b[shuffle_at..end]
        .chunks(width)
        .map(|c| c.to_vec())
        .collect();
    entries.reverse();
    b[shuffle_at..end].copy_from_slice(&entries.concat());
    reseal(&mut b, &key);
    std::fs::write(&path, &b).unwrap_or_else(|e| panic!("{e}"));
    let unsealed = load(&path, &key, &sizes[..], &cfg, None).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        unsealed.is_some_and(|l| !same(&l, &ix)),
        "structure alone accepts it"
    );
    assert!(matches!(
        load(&path, &key, &sizes[..], &cfg, Some(&SEAL_KEY)),
        Err(CacheError::Seal { .. })
    ));
}
