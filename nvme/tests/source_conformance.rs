//! The `Source` conformance suite (`ubdirect_ub::source::conformance`) against the local sources:
//! `FileSource` on a file of the work disk (O_DIRECT where the file system has it), and
//! `NvmeSource` (passthrough on io_uring URING_CMD with fixed buffers) on a file of an NVMe
//! namespace named by `UBDIRECT_TEST_NVME_FILE` — the QEMU guest (`nvme/tests/guest/run.sh`) sets it;
//! elsewhere that test prints a `skip:` line.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use ubdirect_nvme::{Engine, EngineConfig, FileSource, NvmeSource, NvmeSourceError};
use ubdirect_ub::source::conformance;
use ubdirect_ub::{MemoryKind, PoolConfig, Source, UbPool};

const BLOCK: usize = 1 << 20;

/// Printed past the test harness's capture, so a skip is visible in every run.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn work_file(name: &str, len: usize, seed: u64) -> (PathBuf, Vec<u8>) {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nvme-source-conformance");
    std::fs::create_dir_all(&d).unwrap();
    let mut data = vec![0u8; len];
    SmallRng::seed_from_u64(seed).fill(&mut data[..]);
    let p = d.join(name);
    let mut f = std::fs::File::create(&p).unwrap();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    (p, data)
}

fn pool_for(src: &dyn Source, block: usize, blocks: usize) -> UbPool {
    let mut b = UbPool::builder(PoolConfig::new(
        "conformance",
        block,
        blocks,
        MemoryKind::Host,
    ));
    for r in src.registrars() {
        b = b.register_with(r);
    }
    b.build().unwrap()
}

async fn conform(label: &str, src: &dyn Source, block: usize, expected: &[u8]) {
    let pool = pool_for(src, block, 8);
    println!(
        "conformance [{label}] {} ({} bytes): {}",
        src.shard(),
        src.size(),
        src.describe()
    );
    let checks = conformance::run(src, &pool, expected).await;
    let failed = conformance::report(label, &checks);
    assert!(failed.is_empty(), "{label}: {failed:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_source_passes_the_suite() {
    // A few MiB with a ragged tail, so the last read is short of a block and of a page.
    let (p, data) = work_file("file.bin", (3 << 20) + 12_345, 7);
    let engine = Engine::new(EngineConfig::default()).unwrap();
    let src = FileSource::open(&engine, &p).unwrap();
    let label = if src.handle().is_direct() {
        "file, O_DIRECT"
    } else {
        "file, buffered"
    };
    conform(label, &src, BLOCK, &data).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvme_source_passes_the_suite() {
    let Some(path) = std::env::var_os("UBDIRECT_TEST_NVME_FILE").map(PathBuf::from) else {
        say(
            "skip: nvme_source_passes_the_suite: UBDIRECT_TEST_NVME_FILE is not set (no NVMe \
             namespace here; the QEMU guest of nvme/tests/guest/run.sh runs it)",
        );
        return;
    };
    let data = std::fs::read(&path).unwrap();
    // 256 KiB blocks and 1 MiB blocks (256 pages: registered on the passthrough rings in 256 KiB
    // chunks, since kernels before 2025 refuse a fixed buffer spanning more pages to its end than
    // the queue's max_segments).
    for block in [256 << 10, BLOCK] {
        let engine = Engine::new(EngineConfig::default()).unwrap();
        let src = match NvmeSource::open(&engine, &path) {
            Ok(s) => s,
            Err(e) => panic!("{}: passthrough not possible: {e} ({e:?})", path.display()),
        };
        let label = format!("nvme, {} KiB blocks", block >> 10);
        conform(&label, &src, block, &data).await;
        // The bytes came by passthrough, not through the file path.
        let st = engine.stats();
        let cmds = st.nvme_cmds.load(Ordering::Relaxed);
        let bytes = st.nvme_bytes.load(Ordering::Relaxed);
        let unfixed = st.nvme_cmds_unfixed.load(Ordering::Relaxed);
        let mapped: u64 = src.map().extents.iter().map(|e| e.len).sum();
        println!(
            "conformance [{label}] {} extents, {} bytes in holes",
            src.map().extents.len(),
            (data.len() as u64).saturating_sub(mapped)
        );
        println!(
            "conformance [{label}] {cmds} URING_CMD reads ({unfixed} by address, the rest from fixed \
             buffers), {bytes} bytes by passthrough (max transfer {} KiB), {} extent(s) through the \
             file path",
            src.namespace().max_transfer() >> 10,
            src.extents_via_file()
        );
        assert!(
            cmds > 0 && bytes >= data.len() as u64,
            "{cmds} commands, {bytes} bytes"
        );
        assert!(unfixed < cmds, "no command used the fixed buffer");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvme_source_reads_unwritten_extents_through_the_file() {
    let Some(dir) = std::env::var_os("UBDIRECT_TEST_NVME_DIR").map(PathBuf::from) else {
        say(
            "skip: nvme_source_reads_unwritten_extents_through_the_file: UBDIRECT_TEST_NVME_DIR \
             (a writable directory on an NVMe namespace) is not set; the QEMU guest sets it",
        );
        return;
    };
    // 1 MiB written, 512 KiB preallocated (an unwritten extent: zeros, not readable raw), then
    // 1 MiB + 100 bytes written.
    let p = dir.join("unwritten.bin");
    let mut rng = SmallRng::seed_from_u64(3);
    let mut head = vec![0u8; 1 << 20];
    let mut tail = vec![0u8; (1 << 20) + 100];
    rng.fill(&mut head[..]);
    rng.fill(&mut tail[..]);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::create(&p).unwrap();
        f.write_all_at(&head, 0).unwrap();
        nix::fcntl::fallocate(&f, nix::fcntl::FallocateFlags::empty(), 1 << 20, 512 << 10).unwrap();
        f.write_all_at(&tail, (1 << 20) + (512 << 10)).unwrap();
        f.sync_all().unwrap();
    }
    let data = std::fs::read(&p).unwrap();
    let engine = Engine::new(EngineConfig::default()).unwrap();
    let src = NvmeSource::open(&engine, &p).unwrap();
    assert!(
        src.extents_via_file() > 0,
        "no unwritten extent in {:?}",
        src.map().extents
    );
    conform("nvme, unwritten extent", &src, BLOCK, &data).await;
    let st = engine.stats();
    let cmds = st.nvme_cmds.load(Ordering::Relaxed);
    let file_reads = st.reads.load(Ordering::Relaxed);
    println!(
        "conformance [nvme, unwritten extent] {cmds} URING_CMD reads, {file_reads} reads through \
         the file path, {} of {} extents through the file path",
        src.extents_via_file(),
        src.map().extents.len()
    );
    assert!(
        cmds > 0 && file_reads > 0,
        "{cmds} commands, {file_reads} file reads"
    );
    let _ = std::fs::remove_file(&p);
}

#[test]
fn nvme_source_off_nvme_says_why() {
    // The work disk (virtio or tmpfs here) is not NVMe: a typed reason the loader can fall back on.
    let (p, _) = work_file("not-nvme.bin", 8192, 1);
    let engine = Engine::new(EngineConfig::default()).unwrap();
    match NvmeSource::open(&engine, &p) {
        Err(e @ NvmeSourceError::Map(_)) => {
            assert_eq!(e.path(), p.as_path());
            assert!(e.to_string().contains(&p.display().to_string()), "{e}");
        }
        Err(e) if std::env::var_os("UBDIRECT_TEST_NVME_FILE").is_some() => {
            say(&format!("note: {e}"));
        }
        Err(e) => panic!("unexpected error kind: {e:?}"),
        Ok(s) => assert!(
            std::env::var_os("UBDIRECT_TEST_NVME_FILE").is_some(),
            "{} opened for passthrough off NVMe: {s:?}",
            p.display()
        ),
    }
    let e = NvmeSource::open(&engine, Path::new("/nonexistent/shard.bin")).unwrap_err();
    assert!(matches!(e, NvmeSourceError::Map(_)), "{e:?}");
}

#[test]
fn passthrough_rings_take_pools_registered_before_and_after() {
    // SQE128/CQE32 rings start here too (the kernel has them); the fixed-buffer table must hold the
    // pools registered before they start and after.
    let engine = Engine::new(EngineConfig {
        rings: 2,
        ..EngineConfig::default()
    })
    .unwrap();
    let before = UbPool::builder(PoolConfig::new("before", 1 << 16, 4, MemoryKind::Host))
        .register_with(engine.registrar())
        .build()
        .unwrap();
    engine.passthru_rings().unwrap();
    engine.passthru_rings().unwrap();
    let after = UbPool::builder(PoolConfig::new("after", 1 << 16, 4, MemoryKind::Host))
        .register_with(engine.registrar())
        .build()
        .unwrap();
    drop(before);
    let again = UbPool::builder(PoolConfig::new("again", 1 << 16, 8, MemoryKind::Host))
        .register_with(engine.registrar())
        .build()
        .unwrap();
    drop((after, again));
}
