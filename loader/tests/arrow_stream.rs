//! Arrow IPC streams (what Hugging Face `datasets` writes) and files with list columns, written by
//! pyarrow (`fixtures/arrow/make_fixtures.py`): every row's bytes equal pyarrow's reading of it, through
//! the index and through the loader.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::{Path, PathBuf};

use ubdirect_loader::{Loader, RunConfig};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/arrow")
        .join(name)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn expected() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap()
}

#[test]
fn stream_and_file_rows_equal_pyarrow() {
    let want = expected();
    for file in ["stream.arrow", "file.arrow"] {
        let bytes = std::fs::read(fixture(file)).unwrap();
        for column in ["input_ids", "labels", "text", "blob"] {
            let idx = ubdirect_loader::formats::arrow::open(&[fixture(file)], column)
                .unwrap_or_else(|e| panic!("{file} {column}: {e}"));
            let rows: Vec<String> = want["files"][file][column]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().to_string())
                .collect();
            assert_eq!(idx.samples.len(), rows.len(), "{file} {column}");
            for (i, (s, w)) in idx.samples.iter().zip(&rows).enumerate() {
                let got = &bytes[s.offset as usize..s.offset as usize + s.len as usize];
                assert_eq!(&hex(got), w, "{file} {column} row {i}");
            }
        }
    }
}

#[test]
fn a_stream_loads_through_the_loader() {
    let want = expected();
    let rows: Vec<String> = want["files"]["stream.arrow"]["labels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let mut c = RunConfig::default();
    c.dataset.format = "arrow".parse().unwrap();
    c.dataset.paths = vec![fixture("stream.arrow")];
    c.dataset.column = "labels".into();
    c.dataset.generate = false;
    c.device.select = ubdirect_ub::DeviceSelection::Host;
    c.loader.batch_size = 2;
    c.pool.staging_blocks = 8;
    let l = Loader::from_config(&c).unwrap();
    let mut seen = vec![false; rows.len()];
    for b in l.epoch(0).unwrap() {
        let b = b.unwrap();
        for (i, s) in b.samples().iter().enumerate() {
            assert_eq!(hex(&b.sample_to_vec(i).unwrap()), rows[s.id as usize]);
            seen[s.id as usize] = true;
        }
    }
    assert!(seen.iter().filter(|&&x| x).count() >= rows.len() - 1);
}

#[test]
fn not_arrow_is_a_clear_error() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("arrow-stream");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("junk.arrow");
    std::fs::write(&p, b"this is not arrow at all").unwrap();
    let e = ubdirect_loader::formats::arrow::open(&[p], "x").unwrap_err();
    assert!(
        e.to_string().contains("not an Arrow IPC file or stream"),
        "{e}"
    );
}

#[test]
fn gpt_windows_over_a_token_column() {
    // The input_ids of the stream, row after row (null rows hold no tokens), cut into windows of
    // 16 + 1 tokens sharing one: the block order delivers each once.
    let want = expected();
    let stream: Vec<i32> = want["files"]["stream.arrow"]["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|v| {
            let h = v.as_str().unwrap();
            (0..h.len() / 8)
                .map(|i| {
                    let b = u32::from_str_radix(&h[i * 8..i * 8 + 8], 16).unwrap();
                    i32::from_le_bytes(b.to_be_bytes())
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let windows: Vec<Vec<i32>> = (0..(stream.len() - 1) / 16)
        .map(|k| stream[k * 16..k * 16 + 17].to_vec())
        .collect();
    let mut c = RunConfig::default();
    c.dataset.format = "arrow".parse().unwrap();
    c.dataset.paths = vec![fixture("stream.arrow")];
    c.dataset.column = "input_ids".into();
    c.dataset.generate = false;
    c.dataset.sequence_length = 16;
    c.device.select = ubdirect_ub::DeviceSelection::Host;
    c.loader.batch_size = 1;
    c.pool.staging_blocks = 8;
    let l = Loader::from_config(&c).unwrap();
    let mut got = Vec::new();
    for b in l.epoch(0).unwrap() {
        let b = b.unwrap();
        let t = b.tokens().unwrap();
        assert_eq!(
            (t.dtype, t.cols),
            (ubdirect_loader::formats::Dtype::I32, 17)
        );
        let v = b.sample_to_vec(0).unwrap();
        got.push(
            v.chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect::<Vec<_>>(),
        );
    }
    got.sort();
    let mut windows = windows;
    windows.sort();
    assert_eq!(got, windows);
}

#[test]
fn a_stream_over_ub_equals_pyarrow() {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("arrow-stream-ub");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let token = "a-test-token-of-enough-length";
    std::fs::write(
        d.join("serve.toml"),
        format!(
            "[serve]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"{token}\"\nmax_request = \"4MiB\"\nblocks = 8\n[serve.roots]\nfx = \"{}\"\n",
            fixture("").display()
        ),
    )
    .unwrap();
    let mut server = std::process::Command::new(env!("CARGO_BIN_EXE_ubdirect"))
        .args(["serve", "--config"])
        .arg(d.join("serve.toml"))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t.elapsed().as_secs() < 20, "server did not come up");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let want = expected();
    let mut c = RunConfig::default();
    c.dataset.format = "arrow".parse().unwrap();
    c.dataset.paths = vec![PathBuf::from(format!(
        "ub://127.0.0.1:{port}/fx/stream.arrow"
    ))];
    c.dataset.column = "input_ids".into();
    c.dataset.generate = false;
    c.device.select = ubdirect_ub::DeviceSelection::Host;
    c.loader.batch_size = 3;
    c.pool.staging_blocks = 8;
    c.remote.token = token.into();
    c.remote.deadline_ms = 10_000;
    let l = Loader::from_config(&c).unwrap();
    let rows = want["files"]["stream.arrow"]["input_ids"]
        .as_array()
        .unwrap();
    let mut n = 0;
    for b in l.epoch(0).unwrap() {
        let b = b.unwrap();
        for (i, s) in b.samples().iter().enumerate() {
            assert_eq!(
                hex(&b.sample_to_vec(i).unwrap()),
                rows[s.id as usize].as_str().unwrap()
            );
            n += 1;
        }
    }
    assert_eq!(n, 12);
    server.kill().unwrap();
    let _ = server.wait();
}

#[test]
fn several_columns_are_one_samples_parts() {
    // input_ids, labels and text of one row, delivered as one sample: parts back to back, each
    // 8-byte aligned, their places in the sample given by Batch::parts.
    let want = expected();
    let cols = ["input_ids", "labels", "text"];
    for file in ["stream.arrow", "file.arrow"] {
        let mut c = RunConfig::default();
        c.dataset.format = "arrow".parse().unwrap();
        c.dataset.paths = vec![fixture(file)];
        c.dataset.columns = cols.iter().map(|s| s.to_string()).collect();
        c.dataset.generate = false;
        c.device.select = ubdirect_ub::DeviceSelection::Host;
        c.loader.batch_size = 4;
        c.pool.staging_blocks = 8;
        let l = Loader::from_config(&c).unwrap();
        let mut n = 0;
        for b in l.epoch(0).unwrap() {
            let b = b.unwrap();
            for (i, s) in b.samples().iter().enumerate() {
                let bytes = b.sample_to_vec(i).unwrap();
                let parts = b.parts(i).unwrap();
                assert_eq!(parts.len(), 3);
                for (k, &(off, len)) in parts.iter().enumerate() {
                    assert_eq!(off % 8, 0, "part {k} aligned");
                    assert_eq!(
                        hex(&bytes[off as usize..(off + len) as usize]),
                        want["files"][file][cols[k]][s.id as usize]
                            .as_str()
                            .unwrap(),
                        "{file} row {} column {}",
                        s.id,
                        cols[k]
                    );
                }
                n += 1;
            }
        }
        assert_eq!(n, 12, "{file}");
    }
    // Not with GPT mode.
    let mut c = RunConfig::default();
    c.dataset.format = "arrow".parse().unwrap();
    c.dataset.paths = vec![fixture("stream.arrow")];
    c.dataset.columns = vec!["input_ids".into(), "labels".into()];
    c.dataset.sequence_length = 8;
    let e = Loader::from_config(&c).unwrap_err();
    assert!(e.to_string().contains("dataset.columns"), "{e}");
}

#[test]
fn the_stream_scan_is_kept_beside_the_file_until_it_changes() {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("arrow-sidecar");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join("data.arrow");
    std::fs::copy(fixture("stream.arrow"), &p).unwrap();
    let side = d.join("data.arrow.ubdirect-index");
    let first = ubdirect_loader::formats::arrow::open(std::slice::from_ref(&p), "labels").unwrap();
    assert_eq!(first.samples.len(), 12);
    assert!(side.exists(), "the scan is kept beside the file");
    let again = ubdirect_loader::formats::arrow::open(std::slice::from_ref(&p), "labels").unwrap();
    assert_eq!(again, first);
    // The sidecar is what the second open used (it was not written again) ...
    let sealed = std::fs::read(&side).unwrap();
    let written = std::fs::metadata(&side).unwrap().modified().unwrap();
    let _ = ubdirect_loader::formats::arrow::open(std::slice::from_ref(&p), "labels").unwrap();
    assert_eq!(
        std::fs::metadata(&side).unwrap().modified().unwrap(),
        written
    );
    // ... and one forged to list no batches, with the file's identity (issue 43: "1 shard(s), 0
    // samples", no fallback), is refused by its seal: the stream is scanned again, to every row,
    // and the sidecar written anew.
    let mut b = sealed.clone();
    b.truncate(80);
    b[76..80].copy_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&[0; 32]);
    std::fs::write(&side, &b).unwrap();
    let before = ubdirect_ub::fallback::count("arrow_sidecar_invalid");
    let forged = ubdirect_loader::formats::arrow::open(std::slice::from_ref(&p), "labels").unwrap();
    assert_eq!(forged.samples, first.samples);
    assert!(
        ubdirect_ub::fallback::count("arrow_sidecar_invalid") > before,
        "counted"
    );
    assert_eq!(std::fs::read(&side).unwrap(), sealed);
    // ... until the file changes (here: its modification time), when the stream is scanned again.
    let f = std::fs::File::options().write(true).open(&p).unwrap();
    f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5))
        .unwrap();
    drop(f);
    let rescanned =
        ubdirect_loader::formats::arrow::open(std::slice::from_ref(&p), "labels").unwrap();
    assert_eq!(rescanned.samples, first.samples);
    // A sidecar that is not one is ignored.
    std::fs::write(&side, b"garbage").unwrap();
    let ignored =
        ubdirect_loader::formats::arrow::open(std::slice::from_ref(&p), "labels").unwrap();
    assert_eq!(ignored.samples, first.samples);
}
