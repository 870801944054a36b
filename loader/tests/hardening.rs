//! Issue 14, "Loader and CLI": inputs that made the loader panic, abort on allocation or hang. Each
//! must now end with a typed error naming the file or key, promptly.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use ubdirect_loader::RunConfig;
use ubdirect_loader::formats::{self, FormatError, Opener};
use ubdirect_loader::planner::{PlanConfig, Remainder, plan_epoch};
use ubdirect_loader::{DatasetIndex, SampleLoc, Shard};

fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("hardening")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn mkfifo(p: &Path) {
    let st = Command::new("mkfifo").arg(p).status().expect("mkfifo");
    assert!(st.success(), "mkfifo {}", p.display());
}

/// Runs `f` on a thread and fails the test if it has not answered within 5 s (a hang).
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|_| panic!("{what}: no answer within 5 s (hangs)"))
}

fn sparse(p: &Path, len: u64, head: &[u8]) {
    let mut f = std::fs::File::create(p).unwrap();
    f.write_all(head).unwrap();
    f.set_len(len).unwrap();
}

fn npy_bytes(descr: &str, shape: &str) -> Vec<u8> {
    let mut h = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + h.len() + 1) % 64 != 0 {
        h.push(' ');
    }
    h.push('\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(h.len() as u16).to_le_bytes());
    b.extend_from_slice(h.as_bytes());
    b
}

fn one_sample_index() -> DatasetIndex {
    DatasetIndex {
        format: "raw".into(),
        shards: vec![Shard {
            path: "s.bin".into(),
            size: 4096,
        }],
        samples: vec![SampleLoc {
            shard: 0,
            offset: 0,
            len: 16,
        }]
        .into(),
    }
}

// ---- panics ----

#[test]
fn planner_world_times_batch_overflow_is_an_error() {
    let idx = one_sample_index();
    let cfg = PlanConfig {
        batch_size: usize::MAX / 2,
        ..PlanConfig::default()
    };
    assert!(plan_epoch(&idx, &cfg, 0, 0, 4).is_err());
    // Padding one sample up to an absurd batch would allocate it: refused, not aborted.
    let cfg = PlanConfig {
        batch_size: 1 << 40,
        remainder: Remainder::Pad,
        ..PlanConfig::default()
    };
    assert!(plan_epoch(&idx, &cfg, 0, 0, 1).is_err());
    let cfg = PlanConfig {
        batch_size: 8,
        remainder: Remainder::Pad,
        ..PlanConfig::default()
    };
    assert!(plan_epoch(&idx, &cfg, 0, 0, usize::MAX).is_err());
    assert!(plan_epoch(&idx, &cfg, 0, 0, 1).is_ok());
}

#[test]
fn config_values_that_overflow_checks_are_errors() {
    // (section, key, value, what the error names). TOML integers stop at i64::MAX; JSON goes to
    // u64::MAX (the Python package's dicts).
    let cases = [
        ("loader", "prefetch", u64::MAX, "loader.prefetch"),
        ("loader", "prefetch", i64::MAX as u64, "loader.prefetch"),
        ("loader", "prefetch", 1 << 32, "loader.prefetch"),
        ("loader", "max_read", u64::MAX, "loader.max_read"),
        ("loader", "max_read", u64::MAX - 2047, "loader.max_read"),
        ("loader", "max_read", i64::MAX as u64, "loader.max_read"),
        ("loader", "batch_size", 1 << 40, "loader.batch_size"),
        ("loader", "world_size", 0, "loader.world_size"),
        ("loader", "world_size", u64::MAX, "loader.world_size"),
        ("pool", "staging_blocks", 1 << 32, "pool.staging_blocks"),
        (
            "pool",
            "staging_block_size",
            u64::MAX,
            "pool.staging_block_size",
        ),
        ("pool", "batch_blocks", 1 << 32, "pool.batch_blocks"),
    ];
    for (section, key, value, names) in cases {
        let json = format!("{{\"{section}\": {{\"{key}\": {value}}}}}");
        let e = RunConfig::from_json(&json, "t").expect_err(&json);
        assert!(e.to_string().contains(names), "{json}: {e}");
        if value <= i64::MAX as u64 {
            let text = format!("[{section}]\n{key} = {value}\n");
            let e = RunConfig::from_toml(&text, "t").expect_err(&text);
            assert!(e.to_string().contains(names), "{text}: {e}");
        }
    }
}

#[test]
fn npy_non_ascii_descr_is_an_error() {
    for descr in ["<é4", "é", "<U\u{0663}", "|ü1"] {
        let b = npy_bytes(descr, "(4,)");
        let r = formats::npy::read_header_from(&mut std::io::Cursor::new(b), Path::new("x.npy"));
        assert!(
            matches!(r, Err(FormatError::Unsupported { .. })),
            "{descr}: {r:?}"
        );
    }
}

#[test]
fn npy_item_sizes_that_wrap_are_errors() {
    // 4 × n wraps to 4 (UTF-32 strings of 2^62 + 1 characters).
    for descr in [
        "<U4611686018427387905",
        "<U18446744073709551615",
        "|S18446744073709551616",
    ] {
        let b = npy_bytes(descr, "(4,)");
        let r = formats::npy::read_header_from(&mut std::io::Cursor::new(b), Path::new("x.npy"));
        assert!(r.is_err(), "{descr}: {r:?}");
    }
}

// ---- allocation aborts ----

/// Raw records index in O(shards) (2026-12-04): a sparse file of 2^40 one-byte records opens with
/// nothing per record, and planning an epoch of it is a typed error naming the memory it would need,
/// not an allocation abort.
#[test]
fn a_huge_sparse_raw_file_indexes_in_constant_memory_and_its_plan_is_an_error() {
    let d = scratch("sparse-raw");
    let p = d.join("huge.bin");
    sparse(&p, 1 << 40, b"");
    let idx = formats::raw::open(std::slice::from_ref(&p), formats::Dtype::U8, 1).unwrap();
    assert_eq!(idx.samples.len(), 1 << 40);
    assert_eq!(idx.samples.fixed_runs(), Some(vec![(0, 1 << 40, 1)]));
    assert_eq!(
        idx.samples.get((1 << 40) - 1).unwrap().offset,
        (1 << 40) - 1
    );
    assert!(idx.samples.get(1 << 40).is_none());
    idx.validate().unwrap();
    let e = plan_epoch(&idx, &PlanConfig::default(), 0, 0, 1).expect_err("a 2^40-sample plan");
    assert!(e.to_string().contains("memory"), "{e}");
}

/// `.npy` rows are fixed-size records after the header (since 2026-12-05): 2^40 rows index in
/// constant memory, each row where the header says, and planning all of them at once is the typed
/// memory error (it was an error naming the file at open, when every row had an entry).
#[test]
fn index_of_a_huge_npy_shape_is_constant_memory() {
    let d = scratch("sparse-npy");
    let p = d.join("huge.npy");
    let head = npy_bytes("|u1", "(1099511627776,)");
    sparse(&p, (1 << 40) + head.len() as u64, &head);
    let idx = formats::npy::open(std::slice::from_ref(&p)).unwrap();
    assert_eq!(idx.samples.len(), 1 << 40);
    assert_eq!(idx.samples.fixed_runs(), Some(vec![(0, 1 << 40, 1)]));
    let last = idx.samples.get((1 << 40) - 1).unwrap();
    assert_eq!(last.offset, head.len() as u64 + (1 << 40) - 1);
    assert!(idx.samples.get(1 << 40).is_none());
    idx.validate().unwrap();
    let e = plan_epoch(&idx, &PlanConfig::default(), 0, 0, 1).expect_err("a 2^40-sample plan");
    assert!(e.to_string().contains("memory"), "{e}");
    // One row fewer bytes than the header claims: refused, naming the file.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len((1 << 40) + head.len() as u64 - 1)
        .unwrap();
    let e = formats::npy::open(std::slice::from_ref(&p)).expect_err("truncated");
    assert!(e.to_string().contains("huge.npy"), "{e}");
}

#[test]
fn huge_sparse_megatron_idx_is_refused_before_reading() {
    let d = scratch("sparse-idx");
    let prefix = d.join("m");
    // A valid header claiming 2^33 sequences in a 40 GiB (sparse) .idx (under the old 64 GiB cap, above memory): refused by size, not read.
    let mut head = b"MMIDIDX\x00\x00".to_vec();
    head.extend_from_slice(&1u64.to_le_bytes());
    head.push(8); // u16
    head.extend_from_slice(&(1u64 << 33).to_le_bytes());
    head.extend_from_slice(&1u64.to_le_bytes());
    sparse(&d.join("m.idx"), 40 << 30, &head);
    sparse(&d.join("m.bin"), 4096, b"");
    let e = within("40 GiB .idx", move || {
        formats::megatron::open(&[prefix]).map(|_| ())
    })
    .expect_err("refused");
    assert!(e.to_string().contains("m.idx"), "{e}");
}

#[test]
fn gen_with_absurd_sizes_is_an_error() {
    let d = scratch("gen");
    for (format, samples, shards) in [
        ("raw", "18446744073709551615", "1"),
        ("megatron", "18446744073709551615", "1"),
        ("npy", "18446744073709551615", "1"),
        ("arrow", "18446744073709551615", "1"),
        ("raw", "1099511627776", "2"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
            .args(["gen", "--out"])
            .arg(&d)
            .args(["--format", format, "--samples", samples, "--shards", shards])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{format} {samples}: {:?}: {err}",
            out.status
        );
        assert!(err.contains("error"), "{err}");
    }
}

// ---- hangs ----

#[test]
fn fifo_as_megatron_idx_is_refused() {
    let d = scratch("fifo-idx");
    mkfifo(&d.join("m.idx"));
    sparse(&d.join("m.bin"), 4096, b"");
    let prefix = d.join("m");
    let e = within("FIFO .idx", move || {
        formats::megatron::open(&[prefix]).map(|_| ())
    })
    .expect_err("FIFO refused");
    assert!(e.to_string().contains("m.idx"), "{e}");
    let p = d.join("m.idx");
    let e = within("FIFO .idx (read_idx)", move || {
        formats::megatron::read_idx(&p).map(|_| ())
    })
    .expect_err("FIFO refused");
    assert!(e.to_string().contains("regular file"), "{e}");
}

#[test]
fn dev_zero_as_megatron_idx_is_refused() {
    let d = scratch("zero-idx");
    std::os::unix::fs::symlink("/dev/zero", d.join("m.idx")).unwrap();
    sparse(&d.join("m.bin"), 4096, b"");
    let prefix = d.join("m");
    let e = within("/dev/zero .idx", move || {
        formats::megatron::open(&[prefix]).map(|_| ())
    })
    .expect_err("device refused");
    assert!(e.to_string().contains("regular file"), "{e}");
    let e = within("/dev/zero (read_idx)", || {
        formats::megatron::read_idx(Path::new("/dev/zero")).map(|_| ())
    })
    .expect_err("device refused");
    assert!(e.to_string().contains("regular file"), "{e}");
}

#[test]
fn local_files_refuse_fifos_devices_and_directories() {
    let d = scratch("opener");
    mkfifo(&d.join("fifo"));
    for p in [d.join("fifo"), PathBuf::from("/dev/zero"), d.clone()] {
        let q = p.clone();
        let r = within("LocalFiles::open", move || {
            formats::LocalFiles.open(&q).map(|_| ())
        });
        let e = r.expect_err("refused");
        assert!(
            e.to_string().contains("regular file"),
            "{}: {e}",
            p.display()
        );
    }
}

#[test]
fn fifo_or_device_as_crc_sidecar_is_refused() {
    let d = scratch("fifo-crc");
    let shard = d.join("s.bin");
    sparse(&shard, 4096, b"");
    let idx = DatasetIndex {
        format: "raw".into(),
        shards: vec![Shard {
            path: shard.clone(),
            size: 4096,
        }],
        samples: vec![SampleLoc {
            shard: 0,
            offset: 0,
            len: 4096,
        }]
        .into(),
    };
    let side = formats::crc::sidecar_path(&shard);
    mkfifo(&side);
    let i = idx.clone();
    let e = within("FIFO sidecar", move || {
        formats::crc::load_sidecars(&i).map(|_| ())
    })
    .expect_err("FIFO refused");
    assert!(e.to_string().contains(".crc32"), "{e}");
    std::fs::remove_file(&side).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &side).unwrap();
    let e = within("/dev/zero sidecar", move || {
        formats::crc::load_sidecars(&idx).map(|_| ())
    })
    .expect_err("device refused");
    assert!(e.to_string().contains(".crc32"), "{e}");
}

#[test]
fn huge_crc_sidecar_is_refused_before_reading() {
    let d = scratch("huge-crc");
    let shard = d.join("s.bin");
    sparse(&shard, 4096, b"");
    let idx = DatasetIndex {
        format: "raw".into(),
        shards: vec![Shard {
            path: shard.clone(),
            size: 4096,
        }],
        samples: vec![SampleLoc {
            shard: 0,
            offset: 0,
            len: 4096,
        }]
        .into(),
    };
    let mut head = b"UBCRC32\0".to_vec();
    head.extend_from_slice(&1u64.to_le_bytes());
    sparse(&formats::crc::sidecar_path(&shard), 100 << 30, &head);
    let e = within("100 GiB sidecar", move || {
        formats::crc::load_sidecars(&idx).map(|_| ())
    })
    .expect_err("refused");
    assert!(e.to_string().contains(".crc32"), "{e}");
}

#[test]
fn fifo_or_device_as_token_file_is_refused() {
    let d = scratch("fifo-token");
    mkfifo(&d.join("token"));
    for p in [d.join("token"), PathBuf::from("/dev/zero"), d.clone()] {
        let q = p.clone();
        let r = within("token file", move || {
            ubdirect_loader::config::read_token_file(&q, "remote.token_file")
        });
        let e = r.expect_err("refused");
        assert!(e.to_string().contains("remote.token_file"), "{e}");
    }
}

#[test]
fn fifo_or_device_as_config_file_is_refused() {
    let d = scratch("fifo-config");
    mkfifo(&d.join("c.toml"));
    for p in [d.join("c.toml"), PathBuf::from("/dev/zero"), d.clone()] {
        let q = p.clone();
        let e = within("config file", move || RunConfig::load(Some(&q)).map(|_| ()))
            .expect_err("refused");
        assert!(
            e.to_string().contains("regular file"),
            "{}: {e}",
            p.display()
        );
    }
}

// ---- doctor's probe files ----

/// Issue 14: `ubdirect doctor --path DIR` wrote its probe file through a symlink planted at the probe's
/// name (run as root on /tmp: a classic symlink attack). The target must stay untouched.
#[test]
fn doctor_never_writes_through_a_planted_symlink() {
    let d = scratch("doctor");
    let target = d.join("precious");
    std::fs::write(&target, b"precious bytes").unwrap();
    let probes = d.join("probes");
    std::fs::create_dir_all(&probes).unwrap();
    for name in [".ubdirect-doctor-probe", ".ubdirect-cufile-probe"] {
        std::os::unix::fs::symlink(&target, probes.join(name)).unwrap();
    }
    let out = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["doctor", "--json", "--path"])
        .arg(&probes)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read(&target).unwrap(), b"precious bytes");
    for name in [".ubdirect-doctor-probe", ".ubdirect-cufile-probe"] {
        let l = probes.join(name);
        assert_eq!(std::fs::read_link(&l).unwrap(), target, "{name} left alone");
    }
    // It still probed the directory (an unnamed file), and left nothing behind.
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let direct = report.to_string();
    assert!(!direct.contains("cannot write a probe file"), "{direct}");
    assert_eq!(std::fs::read_dir(&probes).unwrap().count(), 2);
}

#[test]
fn fifo_or_device_as_serve_config_is_refused() {
    let d = scratch("fifo-serve");
    mkfifo(&d.join("serve.toml"));
    for p in [d.join("serve.toml"), PathBuf::from("/dev/zero"), d.clone()] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
            .args(["serve", "--config"])
            .arg(&p)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let t0 = std::time::Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if t0.elapsed() > Duration::from_secs(5) {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "ubdirect serve --config {}: no answer within 5 s (hangs)",
                    p.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        assert!(!status.success(), "{}: {err}", p.display());
        assert!(err.contains("regular file"), "{}: {err}", p.display());
    }
}

// ---- issue 23: data that changes under the loader ----

/// Issue 23: a shard rewritten in place with its old mtime put back (same size, same inode) was
/// served silently with different bytes (6 of 8 runs): the change check ignored ctime. The next
/// epoch now refuses to start, naming the shard.
#[test]
fn a_shard_rewritten_in_place_with_its_mtime_put_back_is_an_error() {
    use std::os::unix::fs::FileExt;
    let d = scratch("rewrite-mtime");
    let mut c = RunConfig::default();
    c.dataset.format = "raw".parse().unwrap();
    c.dataset.dir = Some(d.clone());
    c.dataset.generate = false;
    c.device.select = ubdirect_ub::DeviceSelection::Host;
    ubdirect_loader::dataset::generate(&d, "raw".parse().unwrap(), 512, 1, &c.dataset).unwrap();
    let shard = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "bin"))
        .unwrap();
    let l = ubdirect_loader::Loader::from_config(&c).unwrap();
    for b in l.epoch(0).unwrap() {
        b.unwrap();
    }
    let mtime = std::fs::metadata(&shard).unwrap().modified().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap();
    f.write_all_at(&[0xEE; 4096], 0).unwrap();
    f.set_modified(mtime).unwrap();
    drop(f);
    assert_eq!(
        std::fs::metadata(&shard).unwrap().modified().unwrap(),
        mtime
    );
    let err = match l.epoch(1) {
        Err(e) => e,
        Ok(it) => it
            .into_iter()
            .find_map(|b| b.err())
            .expect("the rewritten shard was served"),
    };
    let msg = err.to_string();
    assert!(msg.contains("changed under the loader"), "{msg}");
    assert!(msg.contains(&*shard.to_string_lossy()), "{msg}");
}

// ---- issue 23: sizes that multiply ----

/// Issue 23: `sequence_length = 4294967295` wrapped (`+ 1` token) to empty samples and was accepted;
/// `num_samples = u64::MAX` silently became one epoch (`as i64` is -1); a blend weight of 1.7e308
/// summed to infinity and gave 0 samples. Each is now refused by `validate`, naming the key.
#[test]
fn gpt_sizes_that_multiply_are_bounded_naming_the_key() {
    let cases = [
        (
            "{\"dataset\": {\"sequence_length\": 4294967295}}".to_string(),
            "dataset.sequence_length",
        ),
        (
            "{\"dataset\": {\"sequence_length\": 4096, \"num_samples\": 18446744073709551615}}"
                .to_string(),
            "dataset.num_samples",
        ),
        (
            "{\"dataset\": {\"sequence_length\": 4096, \"blend\": [{\"paths\": [\"a\"], \"weight\": 1.7e308}, {\"paths\": [\"b\"], \"weight\": 1.0}]}}"
                .to_string(),
            "dataset.blend[0].weight",
        ),
    ];
    for (json, names) in cases {
        let e = RunConfig::from_json(&json, "t").expect_err(&json);
        assert!(e.to_string().contains(names), "{json}: {e}");
    }
}

/// Issue 23: `ubdirect gen --shards 4294967295` wrote files until the disk was full. It is now
/// refused before anything is written, naming `--shards`.
#[test]
fn gen_with_absurd_shard_counts_writes_nothing() {
    let d = scratch("gen-shards");
    let out_dir = d.join("out");
    for (samples, shards) in [("1", "4294967295"), ("4294967295", "65536")] {
        let out = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
            .args(["gen", "--out"])
            .arg(&out_dir)
            .args(["--format", "raw", "--samples", samples, "--shards", shards])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{shards}: {err}");
        assert!(err.contains("--shards"), "{err}");
        let written = std::fs::read_dir(&out_dir).map_or(0, |r| r.count());
        assert_eq!(written, 0, "{shards}: files were written");
    }
}

/// Issue 23: an Arrow sidecar (`FILE.ubdirect-index`, untrusted: anyone who can write the
/// directory can write one) listing one block 2^18 times cost 11 s and 2.1 GB before an error.
/// Blocks must now be listed once each, in file order, so the work is bounded by the file: the
/// forged sidecar is ignored and the stream scanned again, promptly, to the right index.
#[test]
fn an_arrow_sidecar_listing_one_block_many_times_is_ignored_promptly() {
    let d = scratch("arrow-sidecar");
    let p = d.join("s.arrows");
    // An IPC stream (no footer), so the index comes from a scan and is kept in a sidecar.
    {
        use arrow_array::{ArrayRef, BinaryArray, RecordBatch};
        use std::sync::Arc;
        let schema = Arc::new(arrow_schema::Schema::new(vec![arrow_schema::Field::new(
            "payload",
            arrow_schema::DataType::Binary,
            false,
        )]));
        let f = std::fs::File::create(&p).unwrap();
        let mut w = arrow_ipc::writer::StreamWriter::try_new(f, &schema).unwrap();
        for k in 0..3u8 {
            let (a, b) = ([k; 100], [k; 50]);
            let rows: Vec<&[u8]> = vec![&a[..], &b[..]];
            let col: ArrayRef = Arc::new(BinaryArray::from(rows));
            w.write(&RecordBatch::try_new(schema.clone(), vec![col]).unwrap())
                .unwrap();
        }
        w.finish().unwrap();
    }
    let size = std::fs::metadata(&p).unwrap().len();
    let paths = vec![p.clone()];
    let index = |what: &str| {
        let (paths, what) = (paths.clone(), what.to_string());
        within(&what.clone(), move || {
            let t0 = std::time::Instant::now();
            let r = formats::index(
                formats::Format::Arrow,
                &paths,
                &formats::LocalFiles,
                formats::Dtype::U8,
                0,
                "payload",
            );
            (r.map_err(|e| format!("{what}: {e}")), t0.elapsed())
        })
    };
    let (good, _) = index("first scan");
    let good = good.unwrap();
    assert_eq!(good.samples.len(), 6);
    let sp = {
        let mut s = p.as_os_str().to_owned();
        s.push(".ubdirect-index");
        PathBuf::from(s)
    };
    let side = std::fs::read(&sp).expect("the scan keeps a sidecar");
    let n = u32::from_le_bytes(side[76..80].try_into().unwrap()) as usize;
    assert_eq!(side.len(), 80 + 20 * n + 32);
    // The first block listed 2^18 times, the count patched to match (refused by the seal when this
    // user has a key, by the blocks' order when not).
    let mut forged = side[..80].to_vec();
    forged[76..80].copy_from_slice(&(1u32 << 18).to_le_bytes());
    for _ in 0..1 << 18 {
        forged.extend_from_slice(&side[80..100]);
    }
    forged.extend_from_slice(&[0; 32]);
    std::fs::write(&sp, &forged).unwrap();
    let (again, took) = index("forged sidecar");
    assert_eq!(again.unwrap(), good, "a {size}-byte file");
    assert!(took < Duration::from_secs(2), "{took:?}");
}

// ---- issue 23: files written next to datasets ----

/// Issue 23: the GPT index cache's temporary name (`IDX.ubdirect-gpt-KEY.tmpPID-N`), the Arrow
/// sidecar's (`FILE.tmpPID`), `ubdirect gen --out DIR`'s shards and `ubdirect index`'s CRC sidecars
/// were opened with `File::create`: a symlink planted there had its target overwritten (3.6 MB and
/// 76 B of cache bytes into a victim file), a FIFO blocked the loader forever. The names are
/// planted here for this very process (its PID is known, as an attacker's guess would be); before,
/// the victim was overwritten and the FIFO hung; now every write goes through `NewFile`.
#[test]
fn files_written_next_to_datasets_never_follow_planted_links_or_open_fifos() {
    use std::os::unix::fs::symlink;
    let d = scratch("planted-writers");
    let victim = d.join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let pid = std::process::id();

    // The GPT index cache: learn its name, remove it, plant its temporary names, build it again.
    let gpt = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt");
    for ext in ["bin", "idx"] {
        std::fs::copy(
            gpt.join(format!("u16a.{ext}")),
            d.join(format!("u16a.{ext}")),
        )
        .unwrap();
    }
    let mut c = RunConfig::default();
    c.dataset.format = "megatron".parse().unwrap();
    c.dataset.paths = vec![d.join("u16a")];
    c.dataset.generate = false;
    c.dataset.sequence_length = 32;
    c.device.select = ubdirect_ub::DeviceSelection::Host;
    c.loader.order = ubdirect_loader::gpt::Order::Megatron;
    c.loader.batch_size = 8;
    ubdirect_loader::Loader::from_config(&c).unwrap();
    let files = ubdirect_loader::gpt::cache::cache_files(&d.join("u16a.idx"));
    assert_eq!(files.len(), 1);
    std::fs::remove_file(&files[0]).unwrap();
    for n in 0..256 {
        let mut t = files[0].as_os_str().to_owned();
        t.push(format!(".tmp{pid}-{n}"));
        symlink(&victim, PathBuf::from(t)).unwrap();
    }
    let cfg = c.clone();
    let used = within("GPT cache store", move || {
        ubdirect_loader::Loader::from_config(&cfg)
            .map(|l| l.gpt().unwrap().parts[0].cache)
            .map_err(|e| e.to_string())
    });
    assert_eq!(used, Ok(ubdirect_loader::gpt::cache::CacheUse::Stored));
    let intact = |what: &str| {
        assert!(
            std::fs::read(&victim).unwrap() == b"precious",
            "{what}: the victim was written through a planted link"
        )
    };
    intact("GPT cache");

    // The Arrow sidecar of a stream: a FIFO at its temporary name.
    let a = d.join("s.arrows");
    {
        use arrow_array::{ArrayRef, BinaryArray, RecordBatch};
        use std::sync::Arc;
        let schema = Arc::new(arrow_schema::Schema::new(vec![arrow_schema::Field::new(
            "payload",
            arrow_schema::DataType::Binary,
            false,
        )]));
        let mut w =
            arrow_ipc::writer::StreamWriter::try_new(std::fs::File::create(&a).unwrap(), &schema)
                .unwrap();
        let col: ArrayRef = Arc::new(BinaryArray::from(vec![&b"row"[..]]));
        w.write(&RecordBatch::try_new(schema.clone(), vec![col]).unwrap())
            .unwrap();
        w.finish().unwrap();
    }
    mkfifo(&d.join(format!("s.arrows.tmp{pid}")));
    let paths = vec![a.clone()];
    let n = within("Arrow sidecar store", move || {
        formats::index(
            formats::Format::Arrow,
            &paths,
            &formats::LocalFiles,
            formats::Dtype::U8,
            0,
            "payload",
        )
        .map(|i| i.samples.len())
        .map_err(|e| e.to_string())
    });
    assert_eq!(n, Ok(1));

    // `ubdirect gen --out DIR` and `ubdirect index`: symlinks at the shard's and the sidecar's names.
    let out = d.join("gen");
    std::fs::create_dir_all(&out).unwrap();
    symlink(&victim, out.join("shard-00000.bin")).unwrap();
    symlink(&victim, out.join("shard-00000.bin.crc32")).unwrap();
    let st = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["gen", "--out"])
        .arg(&out)
        .args(["--format", "raw", "--samples", "16", "--shards", "1"])
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let cfg_path = d.join("index.toml");
    std::fs::write(
        &cfg_path,
        format!(
            "[dataset]\nformat = \"raw\"\npaths = [{:?}]\ngenerate = false\n",
            out.join("shard-00000.bin").display().to_string()
        ),
    )
    .unwrap();
    let st = Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["index", "--config"])
        .arg(&cfg_path)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    intact("gen / index");
    for name in ["shard-00000.bin", "shard-00000.bin.crc32"] {
        let m = std::fs::symlink_metadata(out.join(name)).unwrap();
        assert!(m.is_file(), "{name}: replaced by a regular file");
    }
}

/// Issue 43 (round 3 of the attacks), C: pools past this machine's memory were allocated and
/// locked before an error (18.7 GB for 1 GiB batch blocks of attention masks). Now refused before
/// any is allocated, naming the keys that size them.
#[test]
fn pools_past_the_machines_memory_are_refused_before_allocating() {
    let d = scratch("pools-past-memory");
    let toml = format!(
        "[dataset]\nformat = \"raw\"\ndir = \"{}\"\ngenerate = true\ngenerate_samples = 64\ngenerate_shards = 1\ndtype = \"u8\"\nrecord_len = 64\n[loader]\nbatch_size = 4\ncontiguous_batches = true\n[pool]\nbatch_blocks = 64\nbatch_block_size = \"64GiB\"\n[device]\nselect = \"host\"\n",
        d.display()
    );
    let cfg = RunConfig::from_toml(&toml, "t").unwrap();
    let got = within("pools past memory", move || {
        ubdirect_loader::Loader::from_config(&cfg).map(|_| ())
    });
    match got {
        Err(ubdirect_loader::LoadError::Config(m)) => {
            assert!(
                m.contains("pool.batch_blocks × pool.batch_block_size = 64 × 68719476736"),
                "{m}"
            )
        }
        other => panic!("{other:?}"),
    }
}

/// Issue 43 (round 3 of the attacks), A: `kill -9` during a generation left 6 of 8 shards, and a
/// later start with `generate = true` asking for 8 used "6 shard(s)" silently. A generation now
/// writes a marker first and a manifest last: one cut short, or made with other settings, is
/// written again (and said so); shards without either are the user's and are used as they are.
#[test]
fn a_generation_cut_short_or_of_other_settings_is_written_again() {
    use ubdirect_loader::dataset::{GENERATING, MANIFEST, open_local};
    let d = scratch("gen-cut-short");
    let cfg = |samples: u64| {
        RunConfig::from_toml(
            &format!(
                "[dataset]\nformat = \"raw\"\ndir = \"{}\"\ngenerate = true\ngenerate_samples = {samples}\ngenerate_shards = 8\ndtype = \"u8\"\nrecord_len = 64\n",
                d.display()
            ),
            "t",
        )
        .unwrap()
        .dataset
    };
    let (idx, g) = open_local(&cfg(64)).unwrap();
    assert!(g.is_some_and(|g| g.regenerated.is_none()));
    assert_eq!((idx.shards.len(), idx.samples.len()), (8, 64));
    assert!(d.join(MANIFEST).exists() && !d.join(GENERATING).exists());
    // Whole and of these settings: used.
    let (_, g) = open_local(&cfg(64)).unwrap();
    assert!(g.is_none());
    // Cut short after 6 of 8 shards: the marker, no manifest.
    std::fs::remove_file(d.join(MANIFEST)).unwrap();
    std::fs::write(d.join(GENERATING), b"x").unwrap();
    for s in [6, 7] {
        std::fs::remove_file(d.join(format!("shard-{s:05}.bin"))).unwrap();
    }
    let (idx, g) = open_local(&cfg(64)).unwrap();
    let why = g.and_then(|g| g.regenerated).expect("written again");
    assert!(why.contains("cut short"), "{why}");
    assert_eq!((idx.shards.len(), idx.samples.len()), (8, 64));
    // Asked for other settings: written again to them.
    let (idx, g) = open_local(&cfg(128)).unwrap();
    assert!(g.and_then(|g| g.regenerated).is_some());
    assert_eq!(idx.samples.len(), 128);
    // A shard of the manifest cut: written again.
    let f = std::fs::File::options()
        .write(true)
        .open(d.join("shard-00003.bin"))
        .unwrap();
    f.set_len(64).unwrap();
    drop(f);
    let (idx, g) = open_local(&cfg(128)).unwrap();
    assert!(
        g.and_then(|g| g.regenerated)
            .is_some_and(|w| w.contains("shard-00003.bin"))
    );
    assert_eq!(idx.samples.len(), 128);
    // The user's shards (no marker, no manifest) are theirs: used as they are.
    std::fs::remove_file(d.join(MANIFEST)).unwrap();
    for s in 2..8 {
        std::fs::remove_file(d.join(format!("shard-{s:05}.bin"))).unwrap();
    }
    let (idx, g) = open_local(&cfg(128)).unwrap();
    assert!(g.is_none());
    assert_eq!(idx.shards.len(), 2);
}

/// Issue 43, C: `[dataset.tensors]` with `create_attention_mask` at sequence 16,384 and 1 GiB batch
/// blocks allocated 18.7 GB of pools before its typed error (a batch's mask alone is 8 × 16,384²
/// bytes). Now refused before any pool, naming the keys.
#[test]
fn a_batch_larger_than_its_block_is_refused_before_the_pools() {
    let d = scratch("gpt-mask-too-big");
    let toml = format!(
        "[dataset]\nformat = \"megatron\"\ndir = \"{}\"\ngenerate = true\ngenerate_samples = 3000\ngenerate_shards = 1\nsequence_length = 16384\n[dataset.tensors]\neod = 0\ncreate_attention_mask = true\n[loader]\nbatch_size = 8\n[pool]\nbatch_block_size = \"1GiB\"\n[device]\nselect = \"host\"\n",
        d.display()
    );
    let cfg = RunConfig::from_toml(&toml, "t").unwrap();
    let got = within("a batch past its block", move || {
        ubdirect_loader::Loader::from_config(&cfg).map(|_| ())
    });
    match got {
        Err(ubdirect_loader::LoadError::Config(m)) => {
            assert!(
                m.contains("pool.batch_block_size") && m.contains("attention mask"),
                "{m}"
            )
        }
        other => panic!("{other:?}"),
    }
}

/// Issue 45: an epoch of zero batches was a success ("delivered 0 batches", rc 0), and a training
/// loop over epochs of nothing ran forever. Now an error naming the cause and the keys.
#[test]
fn an_epoch_of_no_batches_is_an_error_naming_why() {
    let d = scratch("no-batches");
    let toml = |batch: u64| {
        format!(
            "[dataset]\nformat = \"raw\"\ndir = \"{}\"\ngenerate = true\ngenerate_samples = 3000\ngenerate_shards = 1\ndtype = \"u8\"\nrecord_len = 64\n[loader]\nbatch_size = {batch}\n[device]\nselect = \"host\"\n",
            d.display()
        )
    };
    let l =
        ubdirect_loader::Loader::from_config(&RunConfig::from_toml(&toml(100_000), "t").unwrap())
            .unwrap();
    match l.epoch(0) {
        Err(ubdirect_loader::LoadError::Config(m)) => assert!(
            m.contains("an epoch of 0 batches")
                && m.contains("3000 samples")
                && m.contains("loader.batch_size 100000"),
            "{m}"
        ),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("an epoch of no batches started"),
    }
    // A batch that fits: batches as before.
    let l = ubdirect_loader::Loader::from_config(&RunConfig::from_toml(&toml(1000), "t").unwrap())
        .unwrap();
    assert_eq!(l.epoch(0).unwrap().count(), 3);
}
