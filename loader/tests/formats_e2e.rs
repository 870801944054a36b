//! End to end on the host device, per format: `ubdirect run --dump-samples` CRCs equal CRCs computed
//! from the files by independent readers written here; exact resume; bad input is a clear error.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use arrow_array::Array;

use ubdirect_loader::config::ByteSize;
use ubdirect_loader::{LoadError, Loader, RunConfig};

fn tmp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("e2e")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn config(format: &str, dir: &Path) -> RunConfig {
    let mut c = RunConfig::default();
    c.dataset.format = format.parse().expect("format");
    c.dataset.dir = Some(dir.to_path_buf());
    c.dataset.generate = false;
    c.dataset.record_len = 1000; // 2000-byte records: not 4 KiB aligned
    c.device.select = ubdirect_ub::DeviceSelection::Host;
    c.loader.batch_size = 16;
    c.loader.seed = 7;
    c.pool.staging_blocks = 64;
    c
}

fn make_dataset(format: &str, dir: &Path, samples: u64) {
    let c = config(format, dir);
    ubdirect_loader::dataset::generate(
        dir,
        format.parse().expect("format"),
        samples,
        3,
        &c.dataset,
    )
    .unwrap();
}

fn sorted_files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(ext))
        .collect();
    v.sort();
    v
}

/// Independent readers: the CRC of every sample, in file order (= sample id).
fn reference_crcs(format: &str, dir: &Path) -> Vec<u32> {
    let mut out = Vec::new();
    match format {
        "raw" => {
            for p in sorted_files(dir, ".bin") {
                let data = std::fs::read(&p).unwrap();
                out.extend(data.chunks(2000).map(crc32fast::hash));
            }
        }
        "megatron" => {
            for idx in sorted_files(dir, ".idx") {
                let b = std::fs::read(&idx).unwrap();
                assert_eq!(&b[..9], b"MMIDIDX\0\0");
                let n = u64::from_le_bytes(b[18..26].try_into().unwrap()) as usize;
                let lens = &b[34..34 + 4 * n];
                let ptrs = &b[34 + 4 * n..34 + 12 * n];
                let bin = std::fs::read(idx.with_extension("bin")).unwrap();
                for i in 0..n {
                    let len =
                        i32::from_le_bytes(lens[4 * i..4 * i + 4].try_into().unwrap()) as usize * 2;
                    let p = i64::from_le_bytes(ptrs[8 * i..8 * i + 8].try_into().unwrap()) as usize;
                    out.push(crc32fast::hash(&bin[p..p + len]));
                }
            }
        }
        "npy" => {
            for p in sorted_files(dir, ".npy") {
                let b = std::fs::read(&p).unwrap();
                let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
                let header = std::str::from_utf8(&b[10..10 + hl]).unwrap();
                let rows: usize = header
                    .split("'shape': (")
                    .nth(1)
                    .unwrap()
                    .split(',')
                    .next()
                    .unwrap()
                    .trim()
                    .parse()
                    .unwrap();
                let data = &b[10 + hl..];
                assert_eq!(data.len(), rows * 1024);
                out.extend(data.chunks(1024).map(crc32fast::hash));
            }
        }
        "arrow" => {
            for p in sorted_files(dir, ".arrow") {
                let r =
                    arrow_ipc::reader::FileReader::try_new(std::fs::File::open(&p).unwrap(), None)
                        .unwrap();
                for rb in r {
                    let rb = rb.unwrap();
                    let col = rb.column_by_name("payload").unwrap();
                    let bin = col
                        .as_any()
                        .downcast_ref::<arrow_array::BinaryArray>()
                        .unwrap();
                    for i in 0..bin.len() {
                        out.push(crc32fast::hash(bin.value(i)));
                    }
                }
            }
        }
        _ => unreachable!(),
    }
    out
}

fn write_config(cfg: &RunConfig, path: &Path) {
    let text = toml::to_string(cfg).unwrap();
    std::fs::write(path, text).unwrap();
}

fn dump_via_cli(cfg: &RunConfig, dir: &Path) -> Vec<serde_json::Value> {
    let cfg_path = dir.join("run.toml");
    write_config(cfg, &cfg_path);
    let dump = dir.join("dump.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["run", "--json", "--config"])
        .arg(&cfg_path)
        .arg("--dump-samples")
        .arg(&dump)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ubdirect run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["delivered_to"], "host memory (zero copy)");
    std::fs::read_to_string(&dump)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn check_format(format: &str, samples: u64) {
    let dir = tmp(format);
    let data = dir.join("data");
    make_dataset(format, &data, samples);
    let cfg = config(format, &data);
    let want = reference_crcs(format, &data);
    assert_eq!(
        want.len() as u64,
        samples,
        "{format}: reference reader disagrees on the sample count"
    );
    let lines = dump_via_cli(&cfg, &dir);
    let expected_delivered = samples / 16 * 16;
    assert_eq!(
        lines.len() as u64,
        expected_delivered,
        "{format}: delivered count"
    );
    let mut seen = HashMap::new();
    for (i, l) in lines.iter().enumerate() {
        let id = l["sample"].as_u64().unwrap();
        assert_eq!(l["position"].as_u64().unwrap(), i as u64);
        assert_eq!(l["epoch"], 0);
        assert_eq!(l["rank"], 0);
        assert!(l["shard"].as_str().unwrap().contains("shard-"));
        assert_eq!(
            l["crc32"].as_u64().unwrap() as u32,
            want[id as usize],
            "{format}: sample {id} bytes differ from the file"
        );
        *seen.entry(id).or_insert(0) += 1;
    }
    assert!(
        seen.values().all(|&c| c == 1),
        "{format}: a sample delivered twice"
    );
}

#[test]
fn raw_end_to_end() {
    check_format("raw", 1000);
}

#[test]
fn megatron_end_to_end() {
    check_format("megatron", 600);
}

#[test]
fn npy_end_to_end() {
    check_format("npy", 900);
}

#[test]
fn arrow_end_to_end() {
    check_format("arrow", 700);
}

#[test]
fn arrow_fixed_size_list_column() {
    let dir = tmp("arrow-fsl");
    make_dataset("arrow", &dir, 300);
    let mut cfg = config("arrow", &dir);
    cfg.dataset.column = "vec".into();
    let loader = Loader::from_config(&cfg).unwrap();
    let mut want = Vec::new();
    for p in sorted_files(&dir, ".arrow") {
        for rb in
            arrow_ipc::reader::FileReader::try_new(std::fs::File::open(&p).unwrap(), None).unwrap()
        {
            let rb = rb.unwrap();
            let col = rb.column_by_name("vec").unwrap();
            let fsl = col
                .as_any()
                .downcast_ref::<arrow_array::FixedSizeListArray>()
                .unwrap();
            for i in 0..fsl.len() {
                let v = fsl.value(i);
                let f = v
                    .as_any()
                    .downcast_ref::<arrow_array::Float32Array>()
                    .unwrap();
                let bytes: Vec<u8> = f.values().iter().flat_map(|x| x.to_le_bytes()).collect();
                want.push(crc32fast::hash(&bytes));
            }
        }
    }
    let mut n = 0;
    for b in loader.epoch(0).unwrap() {
        let b = b.unwrap();
        for (i, s) in b.samples().iter().enumerate() {
            assert_eq!(s.len, 64);
            assert_eq!(crc32fast::hash(b.sample(i).unwrap()), want[s.id as usize]);
            n += 1;
        }
    }
    assert_eq!(n, 288);
}

fn ids(it: impl Iterator<Item = Result<ubdirect_loader::Batch, LoadError>>) -> Vec<Vec<u64>> {
    it.map(|b| b.unwrap().samples().iter().map(|s| s.id).collect())
        .collect()
}

#[test]
fn resume_from_any_position_equals_an_uninterrupted_run() {
    let dir = tmp("resume");
    make_dataset("megatron", &dir, 400);
    let mut cfg = config("megatron", &dir);
    cfg.loader.batch_size = 8;
    cfg.loader.window = 24;
    let full = ids(Loader::from_config(&cfg).unwrap().epoch(1).unwrap());
    assert_eq!(full.len(), 50);
    for stop in [0usize, 1, 7, 25, 49, 50] {
        let a = Loader::from_config(&cfg).unwrap();
        let mut it = a.epoch(1).unwrap();
        let first: Vec<Vec<u64>> = (0..stop)
            .map(|_| {
                it.next()
                    .unwrap()
                    .unwrap()
                    .samples()
                    .iter()
                    .map(|s| s.id)
                    .collect()
            })
            .collect();
        drop(it);
        let state = a.state();
        if stop == full.len() {
            // The end of epoch 1 is the start of epoch 2 (torchdata's StatefulDataLoader).
            assert_eq!(
                (state.epoch, state.next_batch, state.position),
                (2, 0, Some(0))
            );
            let b = Loader::from_config(&cfg).unwrap();
            assert_eq!(ids(b.resume(&state).unwrap()), ids(b.epoch(2).unwrap()));
            continue;
        }
        assert_eq!((state.epoch, state.next_batch), (1, stop as u64));
        // The state survives serialization (checkpoints) and a fresh process.
        let state: ubdirect_loader::LoaderState =
            serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();
        drop(a);
        let b = Loader::from_config(&cfg).unwrap();
        let rest = ids(b.resume(&state).unwrap());
        let mut joined = first;
        joined.extend(rest);
        assert_eq!(joined, full, "resume at batch {stop} diverged");
    }
    // A state from other settings is refused.
    let state = Loader::from_config(&cfg).unwrap().state();
    let mut other = cfg.clone();
    other.loader.seed = 8;
    let e = Loader::from_config(&other)
        .unwrap()
        .resume(&state)
        .unwrap_err();
    assert!(e.to_string().contains("settings"), "{e}");
    // A state of plan version 1 (its settings without `plan.version`: saved before window shuffles
    // were seeded per window) is refused by name, before anything else is compared.
    let mut v1 = Loader::from_config(&cfg).unwrap().state();
    v1.settings.remove("plan.version");
    let e = Loader::from_config(&cfg).unwrap().resume(&v1).unwrap_err();
    assert!(e.to_string().contains("plan order version 1"), "{e}");
}

#[test]
fn ranks_partition_the_epoch() {
    let dir = tmp("ranks");
    make_dataset("raw", &dir, 500);
    let mut all = Vec::new();
    let mut counts = Vec::new();
    for rank in 0..3 {
        let mut cfg = config("raw", &dir);
        cfg.loader.rank = Some(rank);
        cfg.loader.world_size = Some(3);
        cfg.loader.remainder = ubdirect_loader::planner::Remainder::Pad;
        let l = Loader::from_config(&cfg).unwrap();
        let b = ids(l.epoch(0).unwrap());
        counts.push(b.len());
        all.extend(b.into_iter().flatten());
    }
    assert!(
        counts.iter().all(|&c| c == counts[0]),
        "unequal batch counts {counts:?}"
    );
    let distinct: std::collections::HashSet<u64> = all.iter().copied().collect();
    assert_eq!(distinct.len(), 500, "padding must still cover every sample");
    assert_eq!(all.len(), 3 * counts[0] * 16);
}

#[test]
fn dropping_batches_returns_every_block() {
    let dir = tmp("leases");
    make_dataset("npy", &dir, 300);
    let cfg = config("npy", &dir);
    let l = Loader::from_config(&cfg).unwrap();
    let mut it = l.epoch(0).unwrap();
    let held: Vec<_> = (0..3).map(|_| it.next().unwrap().unwrap()).collect();
    assert!(l.pools().0.stats().free < l.pools().0.block_count());
    drop(held);
    drop(it);
    // In-flight reads of prefetched batches finish on their own; wait for them with a deadline.
    let t = std::time::Instant::now();
    while l.pools().0.stats().free != l.pools().0.block_count() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "blocks not returned: {:?}",
            l.pools().0.stats()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(l.pools().0.stats().registrations, 1);
}

#[test]
fn crc_sidecars_catch_corruption() {
    let dir = tmp("crc");
    make_dataset("raw", &dir, 200);
    let mut cfg = config("raw", &dir);
    let idx = ubdirect_loader::dataset::open(&cfg.dataset).unwrap();
    ubdirect_loader::formats::crc::write_sidecars(&idx).unwrap();
    cfg.dataset.verify_crc = true;
    let l = Loader::from_config(&cfg).unwrap();
    assert_eq!(ids(l.epoch(0).unwrap()).concat().len(), 192);
    assert_eq!(
        l.stats()
            .crc_checked
            .load(std::sync::atomic::Ordering::Relaxed),
        192
    );
    // Flip one byte of sample 5 of the first shard.
    let shard = sorted_files(&dir, ".bin")[0].clone();
    let mut b = std::fs::read(&shard).unwrap();
    b[5 * 2000 + 17] ^= 0xFF;
    std::fs::write(&shard, b).unwrap();
    let l = Loader::from_config(&cfg).unwrap();
    let err = l
        .epoch(0)
        .unwrap()
        .find_map(|b| b.err())
        .expect("a CRC error");
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            LoadError::Crc {
                sample: 5,
                offset: 10000,
                ..
            }
        ),
        "{msg}"
    );
    assert!(msg.contains("shard-00000.bin"), "{msg}");
}

#[test]
fn bad_input_is_a_clear_error() {
    let d = tmp("bad");
    let expect = |cfg: &RunConfig, needle: &str| {
        let e = Loader::from_config(cfg).unwrap_err().to_string();
        assert!(e.contains(needle), "expected {needle:?} in: {e}");
    };
    // Missing shard.
    let mut c = config("raw", &d);
    c.dataset.paths = vec![d.join("nope.bin")];
    expect(&c, "nope.bin");
    // Raw file not a whole number of records.
    std::fs::write(d.join("odd.bin"), vec![0u8; 2001]).unwrap();
    c.dataset.paths = vec![d.join("odd.bin")];
    expect(&c, "not a multiple of the record size");
    // Megatron: truncated .bin (the index points past its end), bad magic, truncated .idx.
    let m = d.join("m");
    make_dataset("megatron", &m, 30);
    let bin = sorted_files(&m, ".bin")[0].clone();
    let len = std::fs::metadata(&bin).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&bin)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    let c = config("megatron", &m);
    expect(&c, "points past the end");
    let idx = sorted_files(&m, ".idx")[0].clone();
    let mut b = std::fs::read(&idx).unwrap();
    b[0] = b'X';
    std::fs::write(&idx, &b).unwrap();
    expect(&c, "bad magic");
    b[0] = b'M';
    b.truncate(40);
    std::fs::write(&idx, &b).unwrap();
    expect(&c, "exceeds the file");
    // npy: corrupt header, truncated data.
    let n = d.join("n");
    std::fs::create_dir_all(&n).unwrap();
    std::fs::write(n.join("a.npy"), b"\x93NUMPY\x01\x00\x0f\x00{'descr': 1234}").unwrap();
    expect(&config("npy", &n), "'descr'");
    ubdirect_loader::formats::npy::write(&n.join("a.npy"), "<f4", &[10, 4], &[0u8; 100]).unwrap();
    expect(&config("npy", &n), "truncated");
    std::fs::write(n.join("a.npy"), b"not numpy at all").unwrap();
    expect(&config("npy", &n), "bad magic");
    // Arrow: unsupported column type, missing column.
    let a = d.join("a");
    make_dataset("arrow", &a, 20);
    let mut c = config("arrow", &a);
    c.dataset.column = "id".into();
    expect(&c, "unsupported");
    c.dataset.column = "nope".into();
    expect(&c, "no column \"nope\"");
    // A batch larger than the device... on the host: more reads per batch than staging blocks.
    let r = d.join("r");
    make_dataset("raw", &r, 200);
    let mut c = config("raw", &r);
    c.loader.shuffle_block = ByteSize(4096);
    c.loader.max_gap = ByteSize(0);
    c.loader.min_read = ByteSize(0);
    c.loader.max_read = ByteSize(8192);
    c.loader.max_chunk_batches = 1;
    c.pool.staging_block_size = ByteSize(12288);
    c.pool.staging_blocks = 2;
    let l = Loader::from_config(&c).unwrap();
    let e = l.epoch(0).unwrap_err().to_string();
    assert!(e.contains("pool.staging_blocks"), "{e}");
}

#[test]
fn contiguous_host_batches_are_one_block_with_the_same_bytes() {
    let dir = tmp("contiguous");
    make_dataset("npy", &dir, 500);
    let want = reference_crcs("npy", &dir);
    let mut cfg = config("npy", &dir);
    cfg.loader.contiguous_batches = true;
    let l = Loader::from_config(&cfg).unwrap();
    let mut n = 0;
    for b in l.epoch(0).unwrap() {
        let b = b.unwrap();
        let block = b.block().expect("one block");
        assert!(!block.on_device);
        for (i, s) in b.samples().iter().enumerate() {
            assert!(s.offset + s.len as usize <= block.len);
            assert_eq!(crc32fast::hash(b.sample(i).unwrap()), want[s.id as usize]);
            n += 1;
        }
    }
    assert_eq!(n, 496);
    let (staging, batch) = l.pools();
    let t = std::time::Instant::now();
    while staging.stats().free != staging.block_count()
        || batch.unwrap().stats().free != batch.unwrap().block_count()
    {
        assert!(t.elapsed() < std::time::Duration::from_secs(10));
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn doctor_runs_and_says_what_is_absent() {
    let dir = tmp("doctor");
    let out = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["doctor", "--json", "--path"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for k in [
        "nvme",
        "gpus",
        "rdma",
        "io_uring",
        "memlock_bytes",
        "path_direct_io",
        "cufile",
        "device_path",
        "warnings",
    ] {
        assert!(r.get(k).is_some(), "doctor JSON lacks {k}");
    }
    assert!(
        r["io_uring"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c[0] == "op READ_FIXED" && c[1] == true)
    );
    if r["nvme"].as_array().unwrap().is_empty() {
        assert!(
            r["warnings"]
                .as_array()
                .unwrap()
                .iter()
                .any(|w| w.as_str().unwrap().contains("no NVMe controllers"))
        );
    }
    let human = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["doctor", "--path"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&human.stdout).contains("O_DIRECT"));
}

/// What each format says its samples are (the typed tensors of host and GPU batches): raw from its
/// keys, npy from its header, Arrow from its list column, Megatron its token type; WebDataset says
/// why it cannot.
#[test]
fn every_format_says_what_its_samples_are() {
    use ubdirect_loader::formats::Dtype;
    let dir = tmp("sample-type");
    let of = |format: &str, column: Option<&str>| {
        let d = dir.join(format).join(column.unwrap_or("-"));
        std::fs::create_dir_all(&d).unwrap();
        make_dataset(format, &d, 96);
        let mut cfg = config(format, &d);
        if let Some(c) = column {
            cfg.dataset.column = c.into();
        }
        let loader = Loader::from_config(&cfg).unwrap();
        loader
            .sample_type()
            .map(|t| (t.dtype, t.shape.clone()))
            .map_err(str::to_string)
    };
    assert_eq!(of("raw", None), Ok((Dtype::U16, Some(vec![1000]))));
    // The generator writes float32 arrays of shape (n, 256) (`ubdirect gen --help`).
    assert_eq!(of("npy", None), Ok((Dtype::F32, Some(vec![256]))));
    assert_eq!(of("arrow", Some("vec")), Ok((Dtype::F32, Some(vec![16]))));
    assert_eq!(of("megatron", None), Ok((Dtype::U16, None)));
    let bytes = of("arrow", None).unwrap_err();
    assert!(bytes.contains("\"payload\" is not a list"), "{bytes}");
    let wds = of("webdataset", Some("jpg")).unwrap_err();
    assert!(wds.contains("WebDataset"), "{wds}");
}
