//! Every input the fuzzers (`loader/fuzz`, `net/fuzz`, run by `.ci/fuzz`) found crashing a decoder, replayed
//! through the same code as its target: `tests/fuzz_regressions/<target>/<input>`. Each must now end
//! in a value or a typed error, never a panic (tests build with overflow checks, as the fuzz targets do).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::io::Cursor;
use std::path::{Path, PathBuf};

use ubdirect_loader::RunConfig;
use ubdirect_loader::formats::{arrow, crc, megatron, npy, webdataset};

/// The same body as each fuzz target's.
fn replay(target: &str, data: &[u8]) {
    match target {
        "npy_header" => {
            let mut s = [(PathBuf::from("f.npy"), data.len() as u64, Cursor::new(data))];
            if let Ok(idx) = npy::open_readers(&mut s) {
                idx.validate().unwrap();
            }
        }
        "megatron_idx" => {
            let (size, bytes) = match data.split_first_chunk::<8>() {
                Some((s, rest)) => (u64::from_le_bytes(*s), rest),
                None => (0, data),
            };
            let (ip, bp) = (Path::new("m.idx"), Path::new("m.bin"));
            if let Ok(m) = megatron::parse_idx(ip, bytes)
                && let Ok(idx) = megatron::index_of(vec![(m, bp.to_path_buf(), size)])
            {
                idx.validate().unwrap();
                assert_eq!(idx.samples.iter().count(), idx.samples.len());
            }
        }
        "arrow_file" => {
            let mut s = [(
                PathBuf::from("f.arrow"),
                data.len() as u64,
                Cursor::new(data),
            )];
            if let Ok(idx) = arrow::open_readers(&mut s, "payload") {
                idx.validate().unwrap();
            }
        }
        "crc_sidecar" => {
            let want = data.len().saturating_sub(16) / 4;
            if let Ok(v) = crc::parse_sidecar(Path::new("s.crc32"), data, want) {
                assert_eq!(v.len(), want);
            }
        }
        "config_toml" => {
            if let Ok(cfg) = RunConfig::from_toml(std::str::from_utf8(data).unwrap_or(""), "t") {
                let _ = cfg.plan_config().validate();
            }
        }
        "config_json" => {
            if let Ok(cfg) = RunConfig::from_json(std::str::from_utf8(data).unwrap_or(""), "t") {
                let _ = cfg.plan_config().validate();
            }
        }
        "wire_decode" => {
            // net/fuzz's target: a header, then the payload; or a kind byte and a payload.
            use ubdirect_net::proto::{HEADER, Header, Kind, Msg};
            if let Some((h, payload)) = data.split_first_chunk::<HEADER>()
                && let Ok(hdr) = Header::decode(h, 1 << 20)
                && hdr.kind != Kind::ReadOk
            {
                let _ = Msg::decode(hdr.kind, &payload[..payload.len().min(hdr.len as usize)]);
            }
        }
        "webdataset_tar" => {
            let p = Path::new("f.tar");
            let size = data.len() as u64;
            let scanned = webdataset::tar::scan(&mut webdataset::tar::Bytes(data, p), p, size);
            let windowed = webdataset::scan_reader(&mut Cursor::new(data), p, size);
            if let Ok(m) = &scanned {
                for column in ["jpg", "cls"] {
                    let _ = webdataset::samples_of(m, p, column);
                }
                if let Ok(w) = &windowed {
                    assert_eq!(w, m);
                }
            }
        }
        "webdataset_sidecar" => {
            if let Some((size, side)) = data.split_first_chunk::<8>() {
                let size = u64::from_le_bytes(*size) % (1 << 40);
                let mut b = side.to_vec();
                b.extend_from_slice(&crc32fast::hash(side).to_le_bytes());
                if let Some(m) = webdataset::parse_sidecar(&b, size) {
                    assert!(m.entries().len() as u64 <= size / 512);
                }
            }
        }
        other => panic!("no replay for fuzz target {other}"),
    }
}

#[test]
fn crashes_found_by_fuzzing_stay_fixed() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_regressions");
    let mut n = 0;
    for dir in std::fs::read_dir(&root).unwrap() {
        let dir = dir.unwrap().path();
        let target = dir.file_name().unwrap().to_string_lossy().into_owned();
        for input in std::fs::read_dir(&dir).unwrap() {
            let input = input.unwrap().path();
            let data = std::fs::read(&input).unwrap();
            let r = std::panic::catch_unwind(|| replay(&target, &data));
            assert!(r.is_ok(), "{target}: {} panics", input.display());
            n += 1;
        }
    }
    assert!(n > 0, "no inputs under {}", root.display());
}
