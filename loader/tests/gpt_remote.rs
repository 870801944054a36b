//! GPT mode over `ub://`: Megatron datasets served by an in-process `ubdirect serve` (loopback) give
//! the same token windows in the same order as the same files read locally — `order = "megatron"`
//! (also Megatron-Core's own samples, from `fixtures/gpt/`), a Megatron blend, an `int32` dataset
//! with a split, and `order = "block"`. The token type is read from each `.idx` fetched through the
//! shard's source, so a blend of mixed types over `ub://` is the same clear error as locally. Arrow
//! files over `ub://` too: GPT windows over a token column (the type from the schema read through
//! the shard's source) and several columns as one sample's parts.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::path::PathBuf;

use support::gpt::{arrow_fixtures, expected, fixtures};
use ubdirect_loader::gpt::{BlendEntry, Order};
use ubdirect_loader::{Loader, RunConfig};

const TOKEN: &str = "gpt-remote-test-token";

/// A loopback `ubdirect serve` exporting the GPT fixtures as root `gpt` (the Arrow ones as `arrow`), on its own runtime and
/// thread; stopped when the returned guard is dropped.
struct Served {
    port: u16,
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(h) = self.thread.take() {
            let _ = h.join();
        }
    }
}

fn serve() -> Served {
    let port = support::free_port();
    let (tx, thread) = support::ub::start(support::ub::loopback(
        port,
        TOKEN.as_bytes(),
        vec![
            ("gpt".into(), fixtures()),
            ("arrow".into(), arrow_fixtures()),
        ],
        1 << 20,
    ));
    Served {
        port,
        stop: Some(tx),
        thread: Some(thread),
    }
}

fn config(seq: u32, seed: u64, order: Order, batch: usize) -> RunConfig {
    let mut c = support::gpt::config(seq, seed, order, batch);
    c.remote.token = TOKEN.into();
    c.remote.deadline_ms = 10_000;
    c
}

/// The same configuration over `ub://`: every local fixture path becomes its URL on `port`.
fn remote(cfg: &RunConfig, port: u16) -> RunConfig {
    let url = |p: &PathBuf| match p.strip_prefix(fixtures()) {
        Ok(name) => PathBuf::from(format!("ub://127.0.0.1:{port}/gpt/{}", name.display())),
        Err(_) => PathBuf::from(format!(
            "ub://127.0.0.1:{port}/arrow/{}",
            p.strip_prefix(arrow_fixtures()).unwrap().display()
        )),
    };
    let mut c = cfg.clone();
    c.dataset.paths = cfg.dataset.paths.iter().map(url).collect();
    for b in &mut c.dataset.blend {
        b.paths = b.paths.iter().map(url).collect();
    }
    c
}

/// One epoch's samples as token rows (`es`-byte little-endian tokens), with the per-dataset counts.
fn epoch(cfg: &RunConfig, es: usize) -> (Vec<Vec<i64>>, Vec<u64>) {
    let l = Loader::from_config(cfg).unwrap();
    let mut out = Vec::new();
    for b in l.epoch(0).unwrap() {
        let b = b.unwrap();
        let t = b.tokens().expect("GPT batches are token arrays");
        assert_eq!(t.rows, b.len());
        for i in 0..b.len() {
            let v = b.sample_to_vec(i).unwrap();
            assert_eq!(v.len(), t.cols * es);
            out.push(
                v.chunks_exact(es)
                    .map(|c| match es {
                        2 => u16::from_le_bytes([c[0], c[1]]) as i64,
                        4 => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64,
                        _ => unreachable!("u16 and i32 fixtures"),
                    })
                    .collect(),
            );
        }
    }
    let per = l.plan(0).unwrap().stats.per_dataset.clone();
    (out, per)
}

/// `ubdirect run --dump-samples` of `cfg`: every delivered sample's (id, CRC-32).
fn dump(cfg: &RunConfig, name: &str) -> Vec<(u64, u64)> {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gpt-remote");
    std::fs::create_dir_all(&d).unwrap();
    let (toml_path, out) = (
        d.join(format!("{name}.toml")),
        d.join(format!("{name}.jsonl")),
    );
    std::fs::write(&toml_path, toml::to_string(cfg).unwrap()).unwrap();
    support::dump(&toml_path, &out)
}

#[test]
fn megatron_order_over_ub_equals_local_and_megatron_core() {
    let s = serve();
    // u16 tokens, one dataset.
    let mut cfg = config(32, 1234, Order::Megatron, 8);
    cfg.dataset.paths = vec![fixtures().join("u16a")];
    let (local, _) = epoch(&cfg, 2);
    let (over_ub, _) = epoch(&remote(&cfg, s.port), 2);
    let want = expected("one_epoch_s1234_n32");
    assert_eq!(local.len(), want.len() / 8 * 8);
    assert_eq!(
        local[..],
        want[..local.len()],
        "local differs from Megatron"
    );
    assert_eq!(over_ub, local, "ub:// differs from local");
    // The same through `ubdirect run --dump-samples`: sample ids and CRCs of the delivered windows.
    let (dl, dr) = (
        dump(&cfg, "megatron-local"),
        dump(&remote(&cfg, s.port), "megatron-ub"),
    );
    assert_eq!(dl.len(), local.len());
    assert_eq!(dl, dr, "--dump-samples over ub:// differs from local");
    // int32 tokens, a split (train of 90,5,5), the `.idx` named by its path.
    let mut cfg = config(64, 7, Order::Megatron, 1);
    cfg.dataset.paths = vec![fixtures().join("i32a.idx")];
    cfg.dataset.split = "90,5,5".into();
    let (over_ub, _) = epoch(&remote(&cfg, s.port), 4);
    assert_eq!(
        over_ub,
        expected("i32_split_s7_n64"),
        "i32 split over ub://"
    );
    assert_eq!(epoch(&cfg, 4).0, over_ub);
}

#[test]
fn megatron_blend_over_ub_equals_local_and_megatron_core() {
    let s = serve();
    let mut cfg = config(24, 99, Order::Megatron, 10);
    cfg.dataset.num_samples = 400;
    cfg.dataset.blend = vec![
        BlendEntry {
            paths: vec![fixtures().join("u16a")],
            weight: 0.3,
        },
        BlendEntry {
            paths: vec![fixtures().join("u16b.bin")],
            weight: 0.7,
        },
    ];
    let (over_ub, per) = epoch(&remote(&cfg, s.port), 2);
    assert_eq!(over_ub, expected("blend_s99_n24"));
    assert_eq!(per, vec![120, 280]);
    assert_eq!(epoch(&cfg, 2).0, over_ub, "local differs from ub://");
    // Mixed token types are read from the fetched `.idx` files and refused.
    cfg.dataset.blend[1].paths = vec![fixtures().join("i32a")];
    let e = Loader::from_config(&remote(&cfg, s.port)).unwrap_err();
    assert!(e.to_string().contains("mixed token types"), "{e}");
}

#[test]
fn block_order_over_ub_equals_local() {
    let s = serve();
    for (paths, es, seq) in [
        (vec![fixtures().join("u16a")], 2, 20),
        (
            vec![fixtures().join("u16a"), fixtures().join("u16b")],
            2,
            33,
        ),
        (vec![fixtures().join("i32a")], 4, 16),
    ] {
        let mut cfg = config(seq, 5, Order::Block, 6);
        cfg.loader.shuffle_block = ubdirect_loader::config::ByteSize(4096);
        cfg.dataset.paths = paths;
        let (local, _) = epoch(&cfg, es);
        let (over_ub, _) = epoch(&remote(&cfg, s.port), es);
        assert!(local.len() > 100, "{} windows", local.len());
        assert!(local.iter().all(|r| r.len() == seq as usize + 1));
        assert_eq!(
            over_ub, local,
            "block order over ub://, {seq}-token windows"
        );
        let name = format!("block-{seq}");
        let dl = dump(&cfg, &format!("{name}-local"));
        assert_eq!(dl.len(), local.len());
        assert_eq!(dl, dump(&remote(&cfg, s.port), &format!("{name}-ub")));
    }
}

/// Every sample of an epoch: (id, bytes, parts).
type Delivered = Vec<(u64, Vec<u8>, Option<Vec<(u32, u32)>>)>;

fn delivered(cfg: &RunConfig) -> Delivered {
    let l = Loader::from_config(cfg).unwrap();
    let mut out = Vec::new();
    for b in l.epoch(0).unwrap() {
        let b = b.unwrap();
        for (i, s) in b.samples().iter().enumerate() {
            out.push((
                s.id,
                b.sample_to_vec(i).unwrap(),
                b.parts(i).map(|p| p.to_vec()),
            ));
        }
    }
    out
}

#[test]
fn arrow_gpt_windows_and_columns_over_ub_equal_local() {
    let s = serve();
    for file in ["stream.arrow", "file.arrow"] {
        let mut cfg = config(16, 5, Order::Block, 2);
        cfg.dataset.format = "arrow".parse().unwrap();
        cfg.dataset.paths = vec![arrow_fixtures().join(file)];
        cfg.dataset.column = "input_ids".into();
        for order in [Order::Block, Order::Megatron] {
            cfg.loader.order = order;
            let (local, _) = epoch(&cfg, 4);
            assert!(local.len() >= 4, "{file}: {} windows", local.len());
            assert_eq!(
                epoch(&remote(&cfg, s.port), 4).0,
                local,
                "{file} {order:?}: GPT windows over ub://"
            );
        }
        // Several columns of one row as one sample's parts.
        let mut cfg = config(0, 5, Order::Block, 4);
        cfg.dataset.format = "arrow".parse().unwrap();
        cfg.dataset.paths = vec![arrow_fixtures().join(file)];
        cfg.dataset.columns = vec!["input_ids".into(), "labels".into(), "text".into()];
        let local = delivered(&cfg);
        assert_eq!(local.len(), 12, "{file}");
        assert!(
            local
                .iter()
                .all(|d| d.2.as_ref().is_some_and(|p| p.len() == 3))
        );
        assert_eq!(
            delivered(&remote(&cfg, s.port)),
            local,
            "{file}: several columns over ub://"
        );
    }
}
