//! GPT fixtures (`tests/fixtures/gpt`, made by Megatron-Core) and GPT configurations.

use std::path::PathBuf;

use ubdirect_loader::RunConfig;
use ubdirect_loader::gpt::Order;

/// The loader crate's directory: `UBDIRECT_TEST_LOADER_DIR` where a test binary built here runs
/// on another machine (the GPU machine's copy of the tree), else where it was built.
pub fn loader_dir() -> PathBuf {
    std::env::var_os("UBDIRECT_TEST_LOADER_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// The GPT fixtures' directory.
pub fn fixtures() -> PathBuf {
    loader_dir().join("tests/fixtures/gpt")
}

/// `name` among the GPT fixtures.
pub fn fixture(name: &str) -> PathBuf {
    fixtures().join(name)
}

/// The Arrow fixtures' directory.
pub fn arrow_fixtures() -> PathBuf {
    loader_dir().join("tests/fixtures/arrow")
}

/// A `.npy` fixture (little-endian integer array, C order): its header, values as i64 and shape.
pub fn npy_with_header(name: &str) -> (String, Vec<i64>, Vec<usize>) {
    let b = std::fs::read(fixture(name)).unwrap();
    assert_eq!(&b[..6], b"\x93NUMPY");
    let (hlen, start) = if b[6] == 1 {
        (u16::from_le_bytes([b[8], b[9]]) as usize, 10)
    } else {
        (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12)
    };
    let header = std::str::from_utf8(&b[start..start + hlen]).unwrap();
    let descr = header
        .split("'descr': '")
        .nth(1)
        .unwrap()
        .split('\'')
        .next()
        .unwrap();
    let shape: Vec<usize> = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap()
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().unwrap())
        .collect();
    assert!(header.contains("'fortran_order': False"));
    let data = &b[start + hlen..];
    let v: Vec<i64> = match descr {
        "<i2" => data
            .chunks_exact(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]]) as i64)
            .collect(),
        "<i4" => data
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)
            .collect(),
        "<u4" => data
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()) as i64)
            .collect(),
        "|u1" => data.iter().map(|b| *b as i64).collect(),
        "<i8" => data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        d => panic!("{name}: dtype {d}"),
    };
    (header.to_string(), v, shape)
}

/// A `.npy` fixture as i64 values and its shape.
pub fn npy(name: &str) -> (Vec<i64>, Vec<usize>) {
    let (_, v, shape) = npy_with_header(name);
    (v, shape)
}

/// `CASE.tokens.npy` (int32, C order) as rows: Megatron-Core's samples.
pub fn expected(case: &str) -> Vec<Vec<i64>> {
    let (header, v, shape) = npy_with_header(&format!("{case}.tokens.npy"));
    assert!(header.contains("'<i4'"), "{header}");
    v.chunks(shape[1]).map(|r| r.to_vec()).collect()
}

/// A GPT configuration of Megatron datasets on the host: `seq`-token windows, `seed`, `order`,
/// batches of `batch`, 16 staging blocks; no paths.
pub fn config(seq: u32, seed: u64, order: Order, batch: usize) -> RunConfig {
    let mut c = RunConfig::default();
    c.dataset.format = "megatron".parse().unwrap();
    c.dataset.generate = false;
    c.dataset.sequence_length = seq;
    c.device.select = ubdirect_ub::DeviceSelection::Host;
    c.loader.order = order;
    c.loader.seed = seed;
    c.loader.batch_size = batch;
    c.pool.staging_blocks = 16;
    c
}

/// The configurations of the mask fixtures (`masks_cases.json`, made by `make_masks.py` with
/// Megatron-Core 0.16.1): (name, dataset, sequence length, extra token).
pub fn mask_cases() -> Vec<(String, String, u32, bool)> {
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("masks_cases.json")).unwrap()).unwrap();
    assert_eq!(meta["megatron_core"], "0.16.1");
    meta["configs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["dataset"].as_str().unwrap().to_string(),
                c["sequence_length"].as_u64().unwrap() as u32,
                c["add_extra_token"].as_bool().unwrap(),
            )
        })
        .collect()
}
