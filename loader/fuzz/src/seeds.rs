//! Writes seed inputs for every target into `DIR/<target>/`: valid files made by the loader's own
//! writers (so the fuzzer starts past the magic numbers), and the repository's configs.
//! Usage: `seeds DIR [CONFIG.toml ...]`. Build it without the fuzzing flags (it does not link
//! libFuzzer): `cargo run --manifest-path loader/fuzz/Cargo.toml --bin seeds -- loader/fuzz/seeds
//! configs/*.toml` regenerates the committed seeds after a format change.

use std::path::{Path, PathBuf};

use ubdirect_loader::formats::{Dtype, arrow, crc, megatron, npy, webdataset};
use ubdirect_loader::{DatasetIndex, RunConfig, SampleLoc, Shard};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args_os().skip(1);
    let dir = PathBuf::from(args.next().ok_or("usage: seeds DIR [CONFIG.toml ...]")?);
    let sub = |t: &str| -> std::io::Result<PathBuf> {
        let d = dir.join(t);
        std::fs::create_dir_all(&d)?;
        Ok(d)
    };
    let tmp = sub("tmp")?;

    // npy: a few dtypes and shapes.
    for (i, (descr, shape)) in [
        ("<f4", vec![3u64, 2]),
        ("|u1", vec![5]),
        ("<U3", vec![2, 2]),
    ]
    .iter()
    .enumerate()
    {
        let n: u64 = shape.iter().product();
        let item = match descr.as_bytes()[1] {
            b'U' => 12,
            b'u' => 1,
            _ => 4,
        };
        let p = sub("npy_header")?.join(format!("seed-{i}.npy"));
        npy::write(&p, descr, shape, &vec![7u8; (n * item) as usize])?;
    }

    // Megatron: the .idx with the .bin size in front (the target's input layout).
    for (i, dtype) in [Dtype::U16, Dtype::I32].into_iter().enumerate() {
        let seqs: Vec<Vec<u8>> = (1..4).map(|k| vec![1u8; k * 2 * dtype.size()]).collect();
        let prefix = tmp.join(format!("m{i}"));
        megatron::write(&prefix, dtype, &seqs)?;
        let idx = std::fs::read(prefix.with_extension("idx"))?;
        let bin = std::fs::metadata(prefix.with_extension("bin"))?.len();
        let mut input = bin.to_le_bytes().to_vec();
        input.extend_from_slice(&idx);
        std::fs::write(sub("megatron_idx")?.join(format!("seed-{i}")), input)?;
    }

    // Arrow IPC file: small payloads, one and several record batches.
    for (i, rows) in [1usize, 2].into_iter().enumerate() {
        let payloads: Vec<Vec<u8>> = (0..4).map(|k| vec![k as u8; 3 + k]).collect();
        arrow::write(
            &sub("arrow_file")?.join(format!("seed-{i}.arrow")),
            &payloads,
            rows,
        )?;
    }

    // CRC sidecar of a small shard.
    let shard = tmp.join("s.bin");
    std::fs::write(&shard, [5u8; 64])?;
    let index = DatasetIndex {
        format: "raw".into(),
        shards: vec![Shard {
            path: shard.clone(),
            size: 64,
        }],
        samples: (0..4)
            .map(|k| SampleLoc {
                shard: 0,
                offset: k * 16,
                len: 16,
            })
            .collect::<Vec<_>>()
            .into(),
    };
    crc::write_sidecars(&index)?;
    std::fs::copy(
        crc::sidecar_path(&shard),
        sub("crc_sidecar")?.join("seed-0"),
    )?;

    // GPT index cache: the indices `gpt_index_cache` checks (its sizes and settings), stored under
    // its key.
    {
        use ubdirect_loader::gpt::{SplitPart, cache, megatron};
        let sizes: Vec<i32> = (0..40).map(|i| (i * 7919) % 23).collect();
        let cfg = megatron::MegatronGptConfig {
            seed: 5,
            sequence_length: 8,
            add_extra_token: true,
            num_samples: Some(60),
            split: "90,10".into(),
            part: SplitPart::Train,
        };
        let ix = megatron::build(&sizes[..], &cfg)?;
        std::fs::write(
            sub("gpt_index_cache")?.join("seed-0"),
            cache::to_bytes(b"fuzz", &ix, &sizes[..])?,
        )?;
    }

    // Arrow sidecar: three blocks of a 4 KiB file, after the file's size (the target's layout).
    {
        let mut b = 4096u64.to_le_bytes().to_vec();
        b.extend_from_slice(b"UBDASX02");
        for v in [0u64, 0, 4096, 0, 0, 0, 0, 8] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&3u32.to_le_bytes());
        for (o, m, l) in [(8i64, 200i32, 800i64), (1008, 200, 800), (2008, 200, 1000)] {
            b.extend_from_slice(&o.to_le_bytes());
            b.extend_from_slice(&m.to_le_bytes());
            b.extend_from_slice(&l.to_le_bytes());
        }
        b.extend_from_slice(&[0; 32]); // unsealed
        std::fs::write(sub("arrow_sidecar")?.join("seed-0"), b)?;
    }

    // WebDataset: a tar of two samples (one with a GNU long name), and its sidecar (after the
    // shard's size, without its CRC-32: the target's layout).
    {
        let long = format!("{}/k1", "d".repeat(110));
        let members = vec![
            ("k0.jpg".to_string(), vec![1u8; 700]),
            ("k0.cls".to_string(), b"3".to_vec()),
            (format!("{long}.jpg"), vec![2u8; 20]),
            (format!("{long}.cls"), b"4".to_vec()),
        ];
        let shard = tmp.join("w.tar");
        webdataset::write(&shard, &members)?;
        std::fs::copy(&shard, sub("webdataset_tar")?.join("seed-0.tar"))?;
        let size = std::fs::metadata(&shard)?.len();
        let mut f = std::fs::File::open(&shard)?;
        webdataset::open_readers(&mut [(shard.clone(), size, &mut f)], "jpg")?;
        let side = std::fs::read(tmp.join("w.tar.ubdirect-index"))?;
        let mut b = size.to_le_bytes().to_vec();
        b.extend_from_slice(&side[..side.len() - 4 - 32]); // without the CRC-32 and the seal
        std::fs::write(sub("webdataset_sidecar")?.join("seed-0"), b)?;
    }

    // Step record: two steps of a raw dataset of 64 records (a world of one), as `--record` writes.
    {
        let data = tmp.join("rec-data");
        let cfg = RunConfig::from_toml(
            &format!(
                "[dataset]\nformat = \"raw\"\ndir = \"{}\"\ngenerate = true\ngenerate_samples = 64\ngenerate_shards = 2\ndtype = \"u8\"\nrecord_len = 64\n[loader]\nbatch_size = 4\n[device]\nselect = \"host\"\n",
                data.display()
            ),
            "seed",
        )?;
        let l = ubdirect_loader::Loader::from_config(&cfg)?;
        let p = sub("record_file")?.join("seed-0.arrow");
        let mut rec = ubdirect_loader::record::StepRecorder::create(&p, l.record_meta())?;
        for b in l.epoch(0)?.take(2) {
            rec.record(&b?)?;
        }
        rec.finish()?;
    }

    // Configs: the repository's TOML files, and each as JSON.
    for (i, p) in args.map(PathBuf::from).enumerate() {
        let text = std::fs::read_to_string(&p)?;
        std::fs::write(sub("config_toml")?.join(format!("seed-{i}.toml")), &text)?;
        if let Ok(v) = toml_to_json(&text) {
            std::fs::write(sub("config_json")?.join(format!("seed-{i}.json")), v)?;
        }
    }
    let d = RunConfig::from_toml(ubdirect_loader::config::DEFAULT_CONFIG, "default")?;
    std::fs::write(
        sub("config_json")?.join("seed-default.json"),
        serde_json_string(&d)?,
    )?;
    std::fs::remove_dir_all(Path::new(&tmp))?;
    Ok(())
}

fn toml_to_json(text: &str) -> Result<String, Box<dyn std::error::Error>> {
    let cfg = RunConfig::from_toml(text, "seed")?;
    serde_json_string(&cfg)
}

fn serde_json_string(cfg: &RunConfig) -> Result<String, Box<dyn std::error::Error>> {
    Ok(serde_json::to_string_pretty(cfg)?)
}
