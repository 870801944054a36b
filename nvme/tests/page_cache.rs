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
        ubdirect_testkit::skip(
            "auto_reads_resident_ranges_from_the_page_cache_and_the_rest_direct",
            &format!(
                "{} has no O_DIRECT (the work disk must do O_DIRECT)",
                d.display()
            ),
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

/// `Engine::copy_mapped` reads a range of a mapping of several files (an object's chunk files laid
/// end to end) with one `pread` per file on the copy threads: the bytes are the files' bytes across
/// every boundary, a range past the mapping is an error before any copy, and a file truncated after
/// it was mapped is an `UnexpectedEof` naming that file — never a wrong or partly stale block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_mapped_reads_across_chunk_files_and_names_a_truncated_one() {
    use std::sync::Arc;
    use ubdirect_nvme::IoError;
    use ubdirect_ub::{MappedFile, PinBudget};
    const CHUNK: usize = 64 << 10;
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("copy-mapped");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    // Three whole chunks and a short last one.
    let data: Vec<u8> = (0..3 * CHUNK + 5000)
        .map(|i| (i * 31 + i / 977) as u8)
        .collect();
    let paths: Vec<PathBuf> = data
        .chunks(CHUNK)
        .enumerate()
        .map(|(i, c)| {
            let p = d.join(format!("chunk-{i}"));
            std::fs::write(&p, c).unwrap();
            p
        })
        .collect();
    let map = Arc::new(
        MappedFile::open_chunks(&paths, CHUNK as u64, None, &PinBudget::new(1 << 30))
            .unwrap()
            .times_ignored(),
    );
    let engine = Engine::new(EngineConfig {
        copy_threads: 3,
        ..EngineConfig::default()
    })
    .unwrap();
    let pool = UbPool::builder(PoolConfig::new("cm", 1 << 20, 2, MemoryKind::Host))
        .build()
        .unwrap();
    let (engine, map, pool, data) = (&engine, &map, &pool, &data);
    let copy = |off: u64, len: usize, at: usize| async move {
        let lease = pool.acquire(Duration::from_secs(5)).await.unwrap();
        let (r, lease) = engine
            .copy_mapped(map, off, len, lease, at, Duration::from_secs(10))
            .await;
        r.map(|done| lease.as_slice().unwrap()[done.data].to_vec())
    };
    // Inside one file, across one boundary, across all four files, the short tail.
    for (off, len, at) in [
        (100u64, 4000usize, 0usize),
        (CHUNK as u64 - 10, 20, 7),
        (1, data.len() - 2, 4096),
        (3 * CHUNK as u64, 5000, 0),
    ] {
        let got = copy(off, len, at).await.unwrap();
        assert_eq!(got, data[off as usize..off as usize + len], "{off}+{len}");
    }
    // Past the mapping: refused before any copy.
    assert!(matches!(
        copy(data.len() as u64 - 10, 20, 0).await,
        Err(IoError::Mapped(_))
    ));
    // Past the lease's block.
    assert!(matches!(
        copy(0, 4096, (1 << 20) - 100).await,
        Err(IoError::BufferTooSmall { .. })
    ));
    // The third file truncated under the mapping: the copy that spans it fails and names it.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&paths[2])
        .unwrap()
        .set_len(100)
        .unwrap();
    match copy(CHUNK as u64, 2 * CHUNK, 0).await {
        Err(IoError::UnexpectedEof { path, got, .. }) => {
            assert_eq!(path, paths[2]);
            assert_eq!(got, 100);
        }
        other => panic!("expected UnexpectedEof naming {:?}: {other:?}", paths[2]),
    }
    // The files before it still copy.
    assert_eq!(copy(0, CHUNK, 0).await.unwrap(), data[..CHUNK]);
}
