//! `direct = "auto"` is page-cache aware: a resident range is copied from the page cache, an evicted
//! one is read with O_DIRECT — decided per read (a merged block, not a sample) with `cachestat(2)`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::time::Duration;

use ubdirect_nvme::{DirectMode, Engine, EngineConfig, FileSource};
use ubdirect_ub::{MemoryKind, PoolConfig, ReadPath, Source, UbPool};

fn evict(f: &std::fs::File) {
    // SAFETY: posix_fadvise on an open descriptor; no memory is passed.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0, "posix_fadvise(DONTNEED)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_reads_resident_ranges_from_the_page_cache_and_the_rest_direct() {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("page-cache-auto");
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join("shard.bin");
    let data: Vec<u8> = (0..(8usize << 20))
        .map(|i| (i * 7 + i / 4096) as u8)
        .collect();
    let mut f = std::fs::File::create(&p).unwrap();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let engine = Engine::new(EngineConfig {
        direct: DirectMode::Auto,
        ..EngineConfig::default()
    })
    .unwrap();
    let src = FileSource::open(&engine, &p).unwrap();
    if !src.handle().is_direct() {
        let _ = writeln!(
            std::io::stderr(),
            "skip: auto_reads_resident_ranges_from_the_page_cache_and_the_rest_direct: {} has no O_DIRECT",
            d.display()
        );
        assert!(
            std::env::var_os("UBDIRECT_TEST_STRICT").is_none(),
            "UBDIRECT_TEST_STRICT: the work disk must do O_DIRECT"
        );
        return;
    }
    assert!(
        src.describe()
            .contains("resident ranges through the page cache"),
        "{}",
        src.describe()
    );
    let mut b = UbPool::builder(PoolConfig::new("pc", 2 << 20, 2, MemoryKind::Host));
    for r in src.registrars() {
        b = b.register_with(r);
    }
    let pool = b.build().unwrap();
    let mut f = std::fs::File::open(&p).unwrap();
    let (src, pool, data) = (&src, &pool, &data);
    let read = |off: u64, len: usize| async move {
        let lease = pool.acquire(Duration::from_secs(5)).await.unwrap();
        let (r, lease) = src.read(off, len, lease, 0, Duration::from_secs(10)).await;
        let done = r.unwrap();
        let got = lease.as_slice().unwrap()[done.data.clone()].to_vec();
        assert_eq!(
            got,
            data[off as usize..off as usize + len],
            "bytes at {off}+{len}"
        );
        done.path
    };
    // Evicted: straight from the device.
    evict(&f);
    assert_eq!(read(1 << 20, 1 << 20).await, ReadPath::Direct);
    // O_DIRECT did not populate the cache: still direct.
    assert_eq!(read(1 << 20, 1 << 20).await, ReadPath::Direct);
    // Made resident by a buffered read: from the page cache.
    let mut warm = vec![0u8; 1 << 20];
    f.seek(SeekFrom::Start(4 << 20)).unwrap();
    f.read_exact(&mut warm).unwrap();
    assert_eq!(read(4 << 20, 1 << 20).await, ReadPath::Buffered);
    assert_eq!(read((4 << 20) + 12345, 4096).await, ReadPath::Buffered);
    // Partly resident (the first half only): the whole read goes direct, bytes still right.
    evict(&f);
    f.seek(SeekFrom::Start(6 << 20)).unwrap();
    f.read_exact(&mut warm[..512 << 10]).unwrap();
    assert_eq!(read(6 << 20, 1 << 20).await, ReadPath::Direct);
    // Evicted again: direct.
    evict(&f);
    assert_eq!(read(4 << 20, 1 << 20).await, ReadPath::Direct);
}
