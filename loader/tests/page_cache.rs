//! The page cache as a pool (`pool.page_cache_budget`): shards that fit the budget are filled in
//! their first epoch, then mapped and registered once and copied straight out of the mapping. Here
//! on the host device with contiguous batches (the CPU copies out of the mapping after checking the
//! file); on the GPU the same path copies by DMA (`ubdirect-bench epoch` on the H200).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use ubdirect_loader::config::{PageCacheBudget, RegisterPolicy};
use ubdirect_loader::{Loader, RunConfig};
use ubdirect_ub::ReadPath;

fn dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("page-cache")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn config(format: &str, dir: &Path, budget: PageCacheBudget) -> RunConfig {
    let mut c = RunConfig::default();
    c.dataset.format = format.parse().unwrap();
    c.dataset.dir = Some(dir.to_path_buf());
    c.dataset.generate = false;
    c.dataset.record_len = 1000;
    c.device.select = ubdirect_ub::DeviceSelection::Host;
    c.loader.contiguous_batches = true;
    c.loader.batch_size = 16;
    c.loader.seed = 3;
    c.pool.batch_block_size = ubdirect_loader::config::ByteSize(32 << 20);
    c.pool.page_cache_budget = budget;
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

fn mapped_bytes(loader: &Loader) -> u64 {
    loader.stats().path_bytes[ReadPath::Mapped.index()].load(Ordering::Relaxed)
}

#[test]
fn mapped_epochs_equal_the_io_uring_epochs_for_every_format() {
    for format in ["raw", "megatron", "npy", "arrow"] {
        let d = dir(format);
        let c = config(format, &d, PageCacheBudget::Bytes(0));
        ubdirect_loader::dataset::generate(&d, format.parse().unwrap(), 1200, 3, &c.dataset)
            .unwrap();
        let plain = Loader::from_config(&c).unwrap();
        assert!(plain.page_cache().is_none());
        let want: Vec<_> = (0..3).map(|e| epoch_crcs(&plain, e)).collect();
        drop(plain);

        // `eager`: every resident shard registered at the start of each epoch (the mapped path is
        // what this test is about; `auto` is tested below).
        let mut ce = config(format, &d, PageCacheBudget::Auto);
        ce.pool.page_cache_register = RegisterPolicy::Eager;
        let loader = Loader::from_config(&ce).unwrap();
        let (_, pinned0, budget, ..) = loader.page_cache().expect("page cache on");
        assert_eq!(
            pinned0, 0,
            "{format}: nothing is registered before the first epoch"
        );
        assert!(budget > 0);
        // Epoch 0 fills the page cache; from epoch 1 every shard is mapped.
        assert_eq!(epoch_crcs(&loader, 0), want[0], "{format}: epoch 0");
        for (e, w) in want.iter().enumerate().skip(1) {
            let before = mapped_bytes(&loader);
            assert_eq!(epoch_crcs(&loader, e as u64), *w, "{format}: epoch {e}");
            assert!(
                mapped_bytes(&loader) > before,
                "{format}: epoch {e} was not served from the mapping"
            );
        }
        let (mapped, pinned, _, registrations, ..) = loader.page_cache().unwrap();
        assert_eq!(mapped, 3, "{format}: every shard mapped");
        assert_eq!(
            registrations, 3,
            "{format}: each registered once, not per epoch"
        );
        assert!(pinned <= budget);
    }
}

#[test]
fn the_budget_is_never_exceeded() {
    let d = dir("budget");
    let c = config("raw", &d, PageCacheBudget::Bytes(0));
    // 4 shards of 600 × 2000 bytes (~1.15 MiB each); a 2.5 MiB budget holds two.
    ubdirect_loader::dataset::generate(&d, "raw".parse().unwrap(), 2400, 4, &c.dataset).unwrap();
    let want = epoch_crcs(&Loader::from_config(&c).unwrap(), 1);
    let loader = Loader::from_config(&config("raw", &d, PageCacheBudget::Bytes(5 << 19))).unwrap();
    for e in 0..3 {
        let got = epoch_crcs(&loader, e);
        if e == 1 {
            assert_eq!(got, want);
        }
        let (mapped, pinned, budget, ..) = loader.page_cache().unwrap();
        assert!(pinned <= budget, "epoch {e}: {pinned} pinned > {budget}");
        assert!(mapped <= 2, "epoch {e}: {mapped} shards mapped");
    }
    // The registrar maps in the background, paced: under a loaded CI machine three epochs did not
    // always leave it time for both shards. More epochs until it did (each within the budget).
    for e in 3..200 {
        let (mapped, pinned, budget, ..) = loader.page_cache().unwrap();
        assert!(pinned <= budget, "epoch {e}: {pinned} pinned > {budget}");
        if mapped >= 2 {
            break;
        }
        epoch_crcs(&loader, e);
    }
    let (mapped, ..) = loader.page_cache().unwrap();
    assert_eq!(mapped, 2);
    // The other two shards are still read (through the engine) every epoch.
    let s = loader.stats();
    let other: u64 = [ReadPath::Direct, ReadPath::Buffered]
        .iter()
        .map(|p| s.path_bytes[p.index()].load(Ordering::Relaxed))
        .sum();
    assert!(other > 0);
}

#[test]
fn a_shard_truncated_under_the_mapping_is_a_typed_error_not_sigbus() {
    let d = dir("truncate");
    let c = config("raw", &d, PageCacheBudget::Auto);
    ubdirect_loader::dataset::generate(&d, "raw".parse().unwrap(), 3000, 2, &c.dataset).unwrap();
    let mut c = c;
    c.pool.page_cache_register = RegisterPolicy::Eager; // epoch 1 from the mapping
    c.loader.prefetch = 1;
    c.pool.batch_blocks = 2;
    c.loader.max_chunk_batches = 1;
    let loader = Loader::from_config(&c).unwrap();
    epoch_crcs(&loader, 0);
    let mut it = loader.epoch(1).unwrap();
    it.next().unwrap().unwrap();
    assert!(mapped_bytes(&loader) > 0, "epoch 1 reads from the mapping");
    // Truncate every shard to half its size while the epoch runs.
    for e in std::fs::read_dir(&d).unwrap() {
        let p = e.unwrap().path();
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        let len = f.metadata().unwrap().len();
        f.set_len(len / 2).unwrap();
    }
    let err = it
        .find_map(|b| b.err())
        .expect("a truncated shard must end the epoch with an error");
    let msg = err.to_string();
    assert!(msg.contains("changed under the loader"), "{msg}");
    // The next epoch refuses to start on the changed file.
    let e = loader.epoch(2).unwrap_err();
    assert!(e.to_string().contains("changed under the loader"), "{e}");
}

/// Runs in a child process without CAP_IPC_LOCK (as `nobody`, via setpriv), where pinned memory is
/// bounded by RLIMIT_MEMLOCK.
#[test]
fn a_budget_over_the_memlock_limit_is_a_clear_error() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if ubdirect_testkit::is_nobody_child() || !root {
        ubdirect_testkit::set_memlock_soft_limit(8 << 20);
        let d = PathBuf::from(
            std::env::var_os("UBDIRECT_PC_DIR").unwrap_or_else(|| dir("memlock").into_os_string()),
        );
        let mut c = config("raw", &d, PageCacheBudget::Bytes(1 << 30));
        c.dataset.generate = true;
        c.dataset.generate_samples = 64;
        c.pool.staging_blocks = 1;
        c.pool.staging_block_size = ubdirect_loader::config::ByteSize((4 << 20) + (64 << 10));
        c.pool.batch_blocks = 1;
        c.pool.batch_block_size = ubdirect_loader::config::ByteSize(1 << 20);
        let e = Loader::from_config(&c).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("RLIMIT_MEMLOCK") && m.contains("page_cache_budget"),
            "{m}"
        );
        return;
    }
    let d = dir("memlock");
    ubdirect_testkit::rerun_as_nobody(
        "a_budget_over_the_memlock_limit_is_a_clear_error",
        &d,
        &[("UBDIRECT_PC_DIR", d.as_os_str())],
    );
}

/// Reads split at `max_read` for staging blocks are joined into one copy out of the mapping; the
/// bytes stay the same.
#[test]
fn joined_mapped_copies_deliver_the_same_bytes() {
    let d = dir("joined");
    let mut c = config("raw", &d, PageCacheBudget::Bytes(0));
    c.dataset.record_len = 2048; // 4 KiB records: page-aligned reads that can be joined
    c.loader.batch_size = 1024; // a 4 MiB shuffle block per batch, read as four 1 MiB reads
    c.loader.min_read = ubdirect_loader::config::ByteSize(1 << 20);
    c.loader.max_read = ubdirect_loader::config::ByteSize(1 << 20);
    c.pool.staging_block_size = ubdirect_loader::config::ByteSize((1 << 20) + (64 << 10));
    ubdirect_loader::dataset::generate(&d, "raw".parse().unwrap(), 4096, 2, &c.dataset).unwrap();
    let want: Vec<_> = (0..2)
        .map(|e| epoch_crcs(&Loader::from_config(&c).unwrap(), e))
        .collect();
    c.pool.page_cache_budget = PageCacheBudget::Auto;
    c.pool.page_cache_register = RegisterPolicy::Eager;
    let loader = Loader::from_config(&c).unwrap();
    for (e, w) in want.iter().enumerate() {
        assert_eq!(epoch_crcs(&loader, e as u64), *w, "epoch {e}");
    }
    assert!(mapped_bytes(&loader) > 0);
}

fn path_bytes(loader: &Loader, p: ReadPath) -> u64 {
    loader.stats().path_bytes[p.index()].load(Ordering::Relaxed)
}

/// `pool.page_cache_register = "auto"` (the default): a run of one epoch registers nothing — its
/// warm reads are copies — and a run of several registers in the background while epochs run, never
/// before a first batch has to wait for it; every epoch delivers the same bytes either way.
#[test]
fn auto_registers_only_when_the_run_reads_again_and_in_the_background() {
    let d = dir("auto");
    let plain_cfg = config("raw", &d, PageCacheBudget::Bytes(0));
    ubdirect_loader::dataset::generate(&d, "raw".parse().unwrap(), 1200, 3, &plain_cfg.dataset)
        .unwrap();
    let plain = Loader::from_config(&plain_cfg).unwrap();
    let want: Vec<_> = (0..3).map(|e| epoch_crcs(&plain, e)).collect();
    drop(plain);

    // One epoch (`loader.epochs` = 1, the default): nothing registered, warm reads copied.
    let one = Loader::from_config(&config("raw", &d, PageCacheBudget::Auto)).unwrap();
    assert_eq!(epoch_crcs(&one, 0), want[0]);
    let (mapped, pinned, _, registrations, ..) = one.page_cache().unwrap();
    assert_eq!(
        (mapped, pinned, registrations),
        (0, 0, 0),
        "a single pass registers nothing"
    );
    assert_eq!(path_bytes(&one, ReadPath::Mapped), 0);
    assert!(
        path_bytes(&one, ReadPath::Buffered) > 0,
        "warm reads are copies"
    );
    drop(one);

    // Four epochs (three follow the first): the registrar starts with the first and registers every
    // shard meanwhile.
    let mut c = config("raw", &d, PageCacheBudget::Auto);
    c.loader.epochs = 4;
    let loader = Loader::from_config(&c).unwrap();
    assert_eq!(epoch_crcs(&loader, 0), want[0], "epoch 0");
    let t = std::time::Instant::now();
    while loader.page_cache().unwrap().3 < 3 {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(30),
            "the background registrar did not register the 3 shards: {:?}",
            loader.page_cache()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(loader.page_cache_background_registrations(), 3);
    let before = path_bytes(&loader, ReadPath::Mapped);
    assert_eq!(epoch_crcs(&loader, 1), want[1], "epoch 1");
    assert_eq!(epoch_crcs(&loader, 2), want[2], "epoch 2");
    assert!(
        path_bytes(&loader, ReadPath::Mapped) > before,
        "registered shards are copied from their mappings"
    );
    assert_eq!(loader.page_cache().unwrap().3, 3, "each registered once");
}

/// Ranks of one node (`loader.local_world_size`, else `LOCAL_WORLD_SIZE`) share the page cache: the
/// budget is the node's, and each rank pins only its share of the shards (shard i by local rank
/// i mod the ranks), so every page is pinned once per node; every rank still delivers its samples
/// equal to a rank alone.
#[test]
fn ranks_of_a_node_each_pin_their_share_once() {
    let d = dir("node-share");
    let plain_cfg = config("raw", &d, PageCacheBudget::Bytes(0));
    ubdirect_loader::dataset::generate(&d, "raw".parse().unwrap(), 1200, 4, &plain_cfg.dataset)
        .unwrap();
    let mut pinned_total = 0;
    let mut registrations_total = 0;
    let budget = 64u64 << 20;
    for r in 0..2 {
        let mut plain = plain_cfg.clone();
        plain.loader.rank = Some(r);
        plain.loader.world_size = Some(2);
        let want: Vec<_> = {
            let l = Loader::from_config(&plain).unwrap();
            (0..2).map(|e| epoch_crcs(&l, e)).collect()
        };
        let mut c = config("raw", &d, PageCacheBudget::Bytes(budget));
        c.pool.page_cache_register = RegisterPolicy::Eager;
        c.loader.rank = Some(r);
        c.loader.world_size = Some(2);
        c.loader.local_world_size = Some(2);
        let l = Loader::from_config(&c).unwrap();
        for (e, w) in want.iter().enumerate() {
            assert_eq!(epoch_crcs(&l, e as u64), *w, "rank {r} epoch {e}");
        }
        let (mapped, pinned, b, registrations, _, why) = l.page_cache().unwrap();
        assert_eq!(b, budget / 2, "rank {r}: half the node's budget");
        assert!(why.contains("LOCAL_WORLD_SIZE"), "{why}");
        assert_eq!(
            (mapped, registrations),
            (2, 2),
            "rank {r} maps shards {r} and {}",
            r + 2
        );
        assert!(
            mapped_bytes(&l) > 0 && path_bytes(&l, ReadPath::Buffered) > 0,
            "rank {r}: its own shards from the mapping, the others through the engine"
        );
        pinned_total += pinned;
        registrations_total += registrations;
    }
    let data: u64 = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert_eq!(
        registrations_total, 4,
        "each of the 4 shards registered once on the node"
    );
    assert!(
        pinned_total <= data + 4 * 4096,
        "{pinned_total} pinned for {data} of shards"
    );
}

/// Three raw shards in `d`, read a batch a chunk: a plain epoch 0's samples (no page-cache pool),
/// a loader with the pool (`auto`), and its config.
fn three_shards_a_batch_a_chunk(d: &Path) -> (Vec<(u64, u32)>, Loader, RunConfig) {
    let mut plain_cfg = config("raw", d, PageCacheBudget::Bytes(0));
    plain_cfg.loader.max_chunk_batches = 1;
    plain_cfg.loader.prefetch = 1;
    ubdirect_loader::dataset::generate(d, "raw".parse().unwrap(), 1200, 3, &plain_cfg.dataset)
        .unwrap();
    let want = epoch_crcs(&Loader::from_config(&plain_cfg).unwrap(), 0);
    let mut c = plain_cfg;
    c.pool.page_cache_budget = PageCacheBudget::Auto;
    (want, Loader::from_config(&c).unwrap(), c)
}

/// A shard registered while an epoch runs: the chunks that started before read through staging, the
/// ones after copy from the mapping, and the epoch's bytes are those of a plain epoch.
#[test]
fn a_shard_registered_mid_epoch_switches_paths_with_the_same_bytes() {
    let d = dir("mid-epoch");
    let (want, loader, _) = three_shards_a_batch_a_chunk(&d);
    let mut got = Vec::new();
    let mut it = loader.epoch(0).unwrap();
    for _ in 0..2 {
        let b = it.next().unwrap().unwrap();
        for (i, s) in b.samples().iter().enumerate() {
            got.push((s.id, crc32fast::hash(&b.sample_to_vec(i).unwrap())));
        }
    }
    assert_eq!(
        path_bytes(&loader, ReadPath::Mapped),
        0,
        "nothing mapped yet"
    );
    let staged = path_bytes(&loader, ReadPath::Buffered) + path_bytes(&loader, ReadPath::Direct);
    assert!(staged > 0);
    assert_eq!(loader.register_page_cache(), 3, "the 3 resident shards");
    for b in it {
        let b = b.unwrap();
        for (i, s) in b.samples().iter().enumerate() {
            got.push((s.id, crc32fast::hash(&b.sample_to_vec(i).unwrap())));
        }
    }
    assert_eq!(got, want);
    assert!(
        path_bytes(&loader, ReadPath::Mapped) > 0,
        "chunks after the registration copy from the mappings"
    );
    assert_eq!(loader.page_cache_background_registrations(), 0);
}

/// GPT windows (packed batches, assembled by the CPU): resident shards are mapped without
/// registering at the start of the epoch and every window is one copy out of the page cache — no
/// read through a staging block per 130-byte window, nothing pinned, nothing registered — and in
/// Megatron's order what is copied is what is delivered (not the widened reads' bytes).
#[test]
fn gpt_windows_are_copied_out_of_unregistered_mappings() {
    let d = dir("gpt");
    let mut c = config("megatron", &d, PageCacheBudget::Bytes(0));
    c.dataset.sequence_length = 64;
    c.loader.order = ubdirect_loader::gpt::Order::Megatron;
    ubdirect_loader::dataset::generate(&d, "megatron".parse().unwrap(), 3000, 2, &c.dataset)
        .unwrap();
    let plain = Loader::from_config(&c).unwrap();
    let want = epoch_crcs(&plain, 0);
    assert!(plain.page_cache().is_none());
    drop(plain);

    c.pool.page_cache_budget = PageCacheBudget::Auto;
    let loader = Loader::from_config(&c).unwrap();
    assert_eq!(epoch_crcs(&loader, 0), want);
    let (mapped, pinned, _, registrations, ..) = loader.page_cache().unwrap();
    assert_eq!(mapped, 2, "both shards mapped for CPU copies");
    assert_eq!(
        (pinned, registrations),
        (0, 0),
        "nothing pinned or registered"
    );
    assert_eq!(loader.page_cache_cpu_mapped(), 2);
    let s = loader.stats();
    let (read, delivered) = (
        s.read_bytes.load(Ordering::Relaxed),
        s.sample_bytes.load(Ordering::Relaxed),
    );
    assert_eq!(
        path_bytes(&loader, ReadPath::Mapped),
        read,
        "every byte from the mappings"
    );
    // Consecutive windows share one token, so the bytes copied are at most the delivered ones.
    assert!(
        read as f64 <= delivered as f64 * 1.10,
        "copied {read} bytes to deliver {delivered}"
    );
}

/// A shard's path names another file (renamed over it) by the time the page-cache pool maps it:
/// the mapping is not the shard the loader opened and checked, so it is refused (a fallback, named)
/// and the epoch reads on from the opened file, with the same bytes as a run that never mapped.
#[test]
fn a_file_renamed_over_a_shard_before_it_is_mapped_is_not_mapped() {
    let d = dir("renamed-over");
    let (want, loader, c) = three_shards_a_batch_a_chunk(&d);
    // The shards are resident: a loader that finds them unchanged maps all three.
    let control = Loader::from_config(&c).unwrap();
    let mut control_epoch = control.epoch(0).unwrap();
    control_epoch.next().unwrap().unwrap();
    assert_eq!(
        control.register_page_cache(),
        3,
        "the shards would be mapped"
    );
    drop((control_epoch, control));
    let mut got = Vec::new();
    let mut it = loader.epoch(0).unwrap();
    let b = it.next().unwrap().unwrap();
    for (i, s) in b.samples().iter().enumerate() {
        got.push((s.id, crc32fast::hash(&b.sample_to_vec(i).unwrap())));
    }
    // Every shard replaced by a file of the same size with other bytes.
    for e in std::fs::read_dir(&d).unwrap() {
        let p = e.unwrap().path();
        let mut bytes = std::fs::read(&p).unwrap();
        bytes.iter_mut().for_each(|b| *b ^= 0x5a);
        let tmp = p.with_extension("new");
        std::fs::write(&tmp, &bytes).unwrap();
        std::fs::rename(&tmp, &p).unwrap();
    }
    assert_eq!(
        loader.register_page_cache(),
        0,
        "no replaced file is mapped"
    );
    for b in it {
        let b = b.unwrap();
        for (i, s) in b.samples().iter().enumerate() {
            got.push((s.id, crc32fast::hash(&b.sample_to_vec(i).unwrap())));
        }
    }
    assert_eq!(got, want, "the epoch reads on from the files it opened");
    assert_eq!(path_bytes(&loader, ReadPath::Mapped), 0);
    // Counted as a fallback (its first detail may be another test's in this process).
    assert!(
        ubdirect_loader::fallbacks()
            .iter()
            .any(|(what, n, _)| what == "page_cache_not_mapped" && *n > 0)
    );
}
