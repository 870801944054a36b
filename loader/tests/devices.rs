//! Shards on two devices (`engine.balance_devices`): staging blocks go to reads of the less busy
//! device, across the chunks ahead, and the batches are the same, in the same order, as when they
//! go to reads in plan order. The two devices here are two file systems of this machine: the
//! target directory's and `/dev/shm` (tmpfs).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use ubdirect_loader::config::PageCacheBudget;
use ubdirect_loader::{Loader, RunConfig};

const RECORD: usize = 64 << 10;

fn shard(dir: &Path, i: usize, records: usize) -> PathBuf {
    let p = dir.join(format!("shard-{i:02}.bin"));
    let mut v = vec![0u8; records * RECORD];
    let mut x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for b in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
    }
    std::fs::write(&p, v).unwrap();
    p
}

fn config(paths: &[PathBuf], balance: bool) -> RunConfig {
    let mut c = RunConfig::default();
    c.dataset.format = "raw".parse().unwrap();
    c.dataset.paths = paths.to_vec();
    c.dataset.generate = false;
    c.dataset.dtype = ubdirect_loader::formats::Dtype::U8;
    c.dataset.record_len = RECORD as u64;
    c.device.select = ubdirect_ub::DeviceSelection::Host;
    c.loader.contiguous_batches = true;
    c.loader.batch_size = 8;
    c.loader.seed = 11;
    c.pool.batch_block_size = ubdirect_loader::config::ByteSize(4 << 20);
    c.loader.max_chunk_batches = 2;
    c.pool.page_cache_budget = PageCacheBudget::Bytes(0);
    c.engine.balance_devices = balance;
    c
}

/// (sample id, crc) of every sample of `epoch`, in delivery order.
fn epoch_crcs(loader: &Loader, epoch: u64) -> Vec<(u64, u32)> {
    let mut v = Vec::new();
    for b in loader.epoch(epoch).unwrap() {
        let b = b.unwrap();
        for (i, s) in b.samples().iter().enumerate() {
            v.push((s.id, crc32fast::hash(&b.sample_to_vec(i).unwrap())));
        }
    }
    v
}

#[test]
fn reads_balanced_over_two_devices_deliver_the_plan_order() {
    let a = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("devices");
    let b = PathBuf::from("/dev/shm").join(format!("ubdirect-devices-{}", std::process::id()));
    for d in [&a, &b] {
        let _ = std::fs::remove_dir_all(d);
        if let Err(e) = std::fs::create_dir_all(d) {
            ubdirect_testkit::skip(
                "reads_balanced_over_two_devices_deliver_the_plan_order",
                &format!("cannot make {}: {e} (two file systems needed)", d.display()),
            );
            return;
        }
    }
    let (da, db) = (
        std::fs::metadata(&a).unwrap().dev(),
        std::fs::metadata(&b).unwrap().dev(),
    );
    if da == db {
        let _ = std::fs::remove_dir_all(&b);
        ubdirect_testkit::skip(
            "reads_balanced_over_two_devices_deliver_the_plan_order",
            &format!(
                "{} and {} are one file system here (two needed)",
                a.display(),
                b.display()
            ),
        );
        return;
    }
    // 8 shards of 48 records, alternating between the two file systems.
    let paths: Vec<PathBuf> = (0..8)
        .map(|i| shard(if i % 2 == 0 { &a } else { &b }, i, 48))
        .collect();

    let plain = Loader::from_config(&config(&paths, false)).unwrap();
    assert_eq!(plain.read_balance(), (0, 0), "balance off: plan order");
    assert_eq!(plain.index().samples.len(), 8 * 48);
    let want: Vec<_> = (0..2).map(|e| epoch_crcs(&plain, e)).collect();
    drop(plain);
    assert_eq!(want[0].len(), 8 * 48);

    let loader = Loader::from_config(&config(&paths, true)).unwrap();
    for (e, w) in want.iter().enumerate() {
        assert_eq!(epoch_crcs(&loader, e as u64), *w, "epoch {e}");
    }
    let (devices, ahead) = loader.read_balance();
    assert_eq!(devices, 2, "the shards lie on two file systems");
    assert!(
        ahead > 0,
        "no read was given its block ahead of the plan: nothing was balanced"
    );

    // One file system: plan order (nothing to balance), whatever the setting.
    let one: Vec<PathBuf> = paths.iter().step_by(2).cloned().collect();
    let l = Loader::from_config(&config(&one, true)).unwrap();
    assert_eq!(l.read_balance(), (0, 0));
    assert_eq!(epoch_crcs(&l, 0).len(), 4 * 48);
    let _ = std::fs::remove_dir_all(&b);
}
