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
        Err(record::RecordError::Arrow { .. })
    ));
}
