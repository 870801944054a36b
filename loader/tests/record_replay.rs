//! Step records and replays: a run of two ranks records every step (`StepRecorder`, one file per
//! rank); `read_step` + `Loader::replay` deliver that step's samples again — the same ids in the same
//! global order, the same bytes — at world sizes 1, 2 and 4; a record of other samples is refused,
//! and so is a step that does not divide among the ranks.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::path::PathBuf;

use support::gpt::fixture;
use ubdirect_loader::gpt::Order;
use ubdirect_loader::record::{self, StepRecorder};
use ubdirect_loader::{LoadError, Loader, RunConfig};

fn config(rank: usize, world: usize, batch: usize, seq: u32) -> RunConfig {
    let mut c = support::gpt::config(seq, 1234, Order::Megatron, batch);
    c.dataset.paths = vec![fixture("u16a")];
    c.loader.rank = Some(rank);
    c.loader.world_size = Some(world);
    c
}

fn dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// (global position, sample id, bytes) of every sample the iterator delivers.
fn rows(
    it: impl Iterator<Item = Result<ubdirect_loader::Batch, LoadError>>,
) -> Vec<(u64, u64, Vec<u8>)> {
    let mut out = Vec::new();
    for b in it {
        let b = b.unwrap();
        for (i, s) in b.samples().iter().enumerate() {
            out.push((s.position, s.id, b.sample_to_vec(i).unwrap()));
        }
    }
    out
}

#[test]
fn a_recorded_step_replays_with_the_same_samples_at_any_world_size() {
    let d = dir("record-replay");
    let path = d.join("steps.arrow");
    // The recorded run: 2 ranks of 4 samples per step.
    let mut recorded = Vec::new(); // per rank: (step, ids in order, bytes)
    for rank in 0..2 {
        let l = Loader::from_config(&config(rank, 2, 4, 32)).unwrap();
        let mut rec =
            StepRecorder::create(&record::rank_path(&path, rank, 2), l.record_meta()).unwrap();
        for b in l.epoch(0).unwrap() {
            let b = b.unwrap();
            rec.record(&b).unwrap();
            let bytes: Vec<Vec<u8>> = (0..b.len()).map(|i| b.sample_to_vec(i).unwrap()).collect();
            recorded.push((
                b.index,
                b.samples()
                    .iter()
                    .map(|s| (s.position, s.id))
                    .collect::<Vec<_>>(),
                bytes,
            ));
        }
        rec.finish().unwrap();
    }
    assert_eq!(
        record::record_files(&path).unwrap(),
        vec![d.join("steps.arrow.rank0"), d.join("steps.arrow.rank1")]
    );
    for step in [0u64, 3, 5] {
        // What the two ranks delivered at `step`, in global order.
        let mut want: Vec<(u64, u64, Vec<u8>)> = recorded
            .iter()
            .filter(|r| r.0 == step)
            .flat_map(|r| r.1.iter().zip(&r.2).map(|(&(p, id), b)| (p, id, b.clone())))
            .collect();
        want.sort_by_key(|r| r.0);
        assert_eq!(want.len(), 8, "step {step}");
        let s = record::read_step(&path, None, step).unwrap();
        assert_eq!(
            (s.epoch, s.step, s.meta.world_size, s.meta.batch_size),
            (0, step, 2, 4)
        );
        assert_eq!(s.samples, want.iter().map(|r| r.1).collect::<Vec<_>>());
        for world in [1usize, 2, 4] {
            let mut got: Vec<(u64, Vec<u8>)> = Vec::new();
            for rank in 0..world {
                // Another batch size in the config: the replay's batches hold step / world samples.
                let l = Loader::from_config(&config(rank, world, 2, 32)).unwrap();
                let before = l.state();
                let r = rows(l.replay(&s).unwrap());
                assert_eq!(r.len(), 8 / world, "step {step}, rank {rank}/{world}");
                got.extend(r.into_iter().map(|(p, id, b)| {
                    let _ = p;
                    (id, b)
                }));
                assert_eq!(l.state(), before, "a replay leaves the resume state alone");
            }
            let want_ib: Vec<(u64, Vec<u8>)> = want.iter().map(|r| (r.1, r.2.clone())).collect();
            assert_eq!(got, want_ib, "step {step} at world size {world}");
        }
    }
    // Other samples (another sequence length) are refused; 8 samples do not divide among 3 ranks.
    let s = record::read_step(&path, Some(0), 1).unwrap();
    let other = Loader::from_config(&config(0, 1, 4, 16)).unwrap();
    assert!(matches!(other.replay(&s), Err(LoadError::Resume(_))));
    let three = Loader::from_config(&config(0, 3, 4, 32)).unwrap();
    match three.replay(&s) {
        Err(LoadError::Config(m)) => assert!(m.contains("do not divide among 3 ranks"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("8 samples replayed over 3 ranks"),
    }
    // A step nobody recorded, and a file that is not a record, are typed errors.
    assert!(matches!(
        record::read_step(&path, None, 10_000),
        Err(record::RecordError::NoStep { step: 10_000, .. })
    ));
    // A FIFO planted as a rank's file is an error at once, not a hang.
    let fifo = d.join("fifo.arrow.rank0");
    let st = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(st.success());
    let t0 = std::time::Instant::now();
    assert!(matches!(
        record::read_step(&d.join("fifo.arrow"), None, 0),
        Err(record::RecordError::Io { .. })
    ));
    assert!(t0.elapsed() < std::time::Duration::from_secs(5));
    let junk = d.join("junk.arrow");
    std::fs::write(&junk, b"not arrow at all").unwrap();
    assert!(matches!(
        record::read_step(&junk, None, 0),
        Err(record::RecordError::NotARecord { .. })
    ));
}

/// Writes a record of a world of one over the fixture: 4 samples a step.
fn one_rank_record(path: &std::path::Path) -> Loader {
    let l = Loader::from_config(&config(0, 1, 4, 32)).unwrap();
    let mut rec = StepRecorder::create(path, l.record_meta()).unwrap();
    for b in l.epoch(0).unwrap() {
        rec.record(&b.unwrap()).unwrap();
    }
    rec.finish().unwrap();
    l
}

/// A record file with `meta` in its schema and one row per (epoch, step, rank, position, sample).
fn forged_record(path: &std::path::Path, meta: &[(&str, String)], rows: &[[u64; 5]]) {
    use std::sync::Arc;
    let fields: Vec<arrow_schema::Field> = record::COLUMNS
        .iter()
        .map(|c| arrow_schema::Field::new(*c, arrow_schema::DataType::UInt64, false))
        .collect();
    let schema = Arc::new(
        arrow_schema::Schema::new(fields).with_metadata(
            meta.iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect::<std::collections::HashMap<String, String>>(),
        ),
    );
    let cols: Vec<arrow_array::ArrayRef> = (0..record::COLUMNS.len())
        .map(|c| {
            Arc::new(arrow_array::UInt64Array::from(
                rows.iter()
                    .map(|r| r.get(c).copied().unwrap_or(0))
                    .collect::<Vec<u64>>(),
            )) as arrow_array::ArrayRef
        })
        .collect();
    let batch = arrow_array::RecordBatch::try_new(schema.clone(), cols).unwrap();
    let mut w =
        arrow_ipc::writer::FileWriter::try_new(std::fs::File::create(path).unwrap(), &schema)
            .unwrap();
    w.write(&batch).unwrap();
    w.finish().unwrap();
}

/// Issue 43 (round 3 of the attacks), B: records are untrusted files. Each case below was a panic
/// or a silent partial replay; each is now a typed error.
#[test]
fn damaged_and_forged_records_are_typed_errors() {
    let d = dir("record-forged");
    let path = d.join("one.arrow");
    let l = one_rank_record(&path);
    let good = std::fs::read(&path).unwrap();
    let s = record::read_step(&path, None, 2).unwrap();
    assert_eq!(s.samples.len(), 4);
    // A sample id past the dataset, the fingerprint intact: was a panic in `Samples::loc`.
    let mut far = s.clone();
    far.samples[1] = 1_000_000_000_000;
    match l.replay(&far) {
        Err(LoadError::Resume(m)) => assert!(m.contains("1000000000000"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a sample past the dataset replayed"),
    }
    // Two ranks' record with rank 1's file missing: was 16 of 32 samples replayed.
    let two = d.join("two.arrow");
    for rank in 0..2 {
        let l = Loader::from_config(&config(rank, 2, 4, 32)).unwrap();
        let mut rec =
            StepRecorder::create(&record::rank_path(&two, rank, 2), l.record_meta()).unwrap();
        for b in l.epoch(0).unwrap() {
            rec.record(&b.unwrap()).unwrap();
        }
        rec.finish().unwrap();
    }
    assert_eq!(record::read_step(&two, None, 1).unwrap().samples.len(), 8);
    std::fs::remove_file(record::rank_path(&two, 1, 2)).unwrap();
    match record::read_step(&two, None, 1) {
        Err(record::RecordError::NotARecord { why, .. }) => {
            assert!(why.contains("missing ranks [1]"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    // A world-of-one record copied in as rank 3 of it: was merged into a 48-sample step.
    std::fs::copy(record::rank_path(&two, 0, 2), record::rank_path(&two, 1, 2)).unwrap();
    assert!(matches!(
        record::read_step(&two, None, 1),
        Err(record::RecordError::NotARecord { .. })
    ));
    std::fs::remove_file(record::rank_path(&two, 1, 2)).unwrap();
    std::fs::copy(&path, record::rank_path(&two, 3, 2)).unwrap();
    assert!(record::read_step(&two, None, 1).is_err());
    // World sizes 0 and 2^64 - 1 in the metadata: were accepted.
    for world in ["0", "18446744073709551615"] {
        let p = d.join(format!("world-{world}.arrow"));
        let meta = [
            ("ubdirect.samples_fingerprint", "1".to_string()),
            ("ubdirect.plan_fingerprint", "1".to_string()),
            ("ubdirect.world_size", world.to_string()),
            ("ubdirect.batch_size", "4".to_string()),
        ];
        forged_record(&p, &meta, &[[0, 0, 0, 0, 1]]);
        match record::read_step(&p, None, 0) {
            Err(record::RecordError::NotARecord { why, .. }) => {
                assert!(why.contains("world size"), "{why}")
            }
            other => panic!("world {world}: {other:?}"),
        }
    }
    // A sparse file whose footer declares 2^31 - 1 bytes: refused before anything is read (was
    // 2 GiB of memory before its error).
    let sparse = d.join("sparse.arrow");
    {
        use std::io::{Seek, Write};
        let mut f = std::fs::File::create(&sparse).unwrap();
        f.write_all(&good[..8]).unwrap();
        f.set_len(3 << 30).unwrap();
        f.seek(std::io::SeekFrom::End(-10)).unwrap();
        f.write_all(&(i32::MAX).to_le_bytes()).unwrap();
        f.write_all(b"ARROW1").unwrap();
    }
    let t0 = std::time::Instant::now();
    match record::read_step(&sparse, None, 0) {
        Err(record::RecordError::NotARecord { why, .. }) => {
            assert!(why.contains("footer"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    assert!(t0.elapsed() < std::time::Duration::from_secs(10));
    // 4,000 random mutations (the record_file fuzz target runs more): every mutated file is a typed
    // error or a record (arrow-ipc's reader panicked on 37 of 250). Deterministic, so a failure
    // names its case.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (mut refused, mut read) = (0, 0);
    for case in 0..4000 {
        let mut b = good.clone();
        for _ in 0..1 + next() % 4 {
            let at = (next() % b.len() as u64) as usize;
            b[at] = match next() % 3 {
                0 => b[at] ^ (1 << (next() % 8)),
                1 => 0xFF,
                _ => next() as u8,
            };
        }
        if next() % 8 == 0 {
            b.truncate((next() % b.len() as u64) as usize);
        }
        match std::panic::catch_unwind(|| record::parse(&b, 2)) {
            Ok(Ok(_)) => read += 1,
            Ok(Err(_)) => refused += 1,
            Err(_) => panic!("case {case}: a panic reading a mutated record"),
        }
    }
    eprintln!("4,000 mutated records: {refused} refused, {read} read");
    assert!(refused > 0 && read > 0);
}
