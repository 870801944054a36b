#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use super::clock::read_clock;
use super::*;

fn mkfifo(p: &Path) {
    let made = std::process::Command::new("mkfifo")
        .arg(p)
        .status()
        .unwrap();
    assert!(made.success(), "mkfifo {}", p.display());
}

#[test]
fn now_is_the_oldest_read_in_flight_and_a_new_plan_forgets_the_reads_before() {
    let d = tempfile::tempdir().unwrap();
    let engine = Engine::new(ubdirect_nvme::EngineConfig::default()).unwrap();
    let c = ChunkCache::new(d.path(), 1 << 20, 64 << 10, &engine).unwrap();
    assert_eq!(c.now(), 0);
    let (a, b, e) = (c.started(5), c.started(9), c.started(12));
    let b2 = c.started(9);
    assert_eq!(c.now(), 5, "the oldest read still waiting");
    drop(a);
    assert_eq!(c.now(), 9);
    drop(e);
    drop(b);
    assert_eq!(c.now(), 9, "another read at 9 is still in flight");
    drop(b2);
    assert_eq!(c.now(), 12, "none in flight: the latest started");
    let old = c.started(40);
    c.restart_clock();
    assert_eq!(c.now(), 0);
    let new = c.started(3);
    let other = c.started(40);
    drop(old); // of the plan before: leaves the new plan's read at 40 alone
    drop(new);
    assert_eq!(c.now(), 40);
    drop(other);
    assert_eq!(c.now(), 40);
}

#[test]
fn a_chunk_is_checked_against_a_regular_sidecar_and_a_fifo_in_its_place_is_no_match() {
    let d = tempfile::tempdir().unwrap();
    let chunk = d.path().join("obj.0");
    let data = vec![7u8; 5000];
    std::fs::write(&chunk, &data).unwrap();
    let side = chunk.with_extension("crc");
    std::fs::write(&side, format!("5000 {:08x}", crc32fast::hash(&data))).unwrap();
    assert!(matches_sidecar(&chunk, 5000).is_some());
    assert!(matches_sidecar(&chunk, 4999).is_none(), "another length");
    std::fs::write(&side, format!("5000 {:08x}", crc32fast::hash(&data) ^ 1)).unwrap();
    assert!(matches_sidecar(&chunk, 5000).is_none(), "another checksum");
    // Larger than the 1 MiB pieces it is read in: a byte changed in the last piece is no match.
    let big = d.path().join("big.0");
    let mut data = (0..(3 << 20) + 5)
        .map(|i| (i % 251) as u8)
        .collect::<Vec<u8>>();
    std::fs::write(
        big.with_extension("crc"),
        format!("{} {:08x}", data.len(), crc32fast::hash(&data)),
    )
    .unwrap();
    std::fs::write(&big, &data).unwrap();
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(&big).unwrap().ino();
    assert_eq!(matches_sidecar(&big, data.len() as u64), Some(ino));
    *data.last_mut().unwrap() ^= 1;
    std::fs::write(&big, &data).unwrap();
    assert_eq!(matches_sidecar(&big, data.len() as u64), None);
    // A FIFO as the sidecar, then as the chunk: no match, and no wait on a writer.
    std::fs::remove_file(&side).unwrap();
    mkfifo(&side);
    let t = Instant::now();
    assert!(matches_sidecar(&chunk, 5000).is_none());
    std::fs::remove_file(&side).unwrap();
    std::fs::write(&side, format!("5000 {:08x}", crc32fast::hash(&data))).unwrap();
    std::fs::remove_file(&chunk).unwrap();
    mkfifo(&chunk);
    assert!(matches_sidecar(&chunk, 5000).is_none());
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_clock_is_a_small_regular_file_and_anything_else_is_no_clock() {
    let d = tempfile::tempdir().unwrap();
    let ok = d.path().join(".clock-1");
    let f = open_clock(&ok).unwrap();
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&3u64.to_le_bytes());
    b[8..].copy_from_slice(&41u64.to_le_bytes());
    std::os::unix::fs::FileExt::write_at(&f, &b, 0).unwrap();
    assert_eq!(read_clock(&ok), Some((3, 41)));
    // A FIFO in a clock's place: neither read nor opened for writing waits on it.
    let fifo = d.path().join(".clock-2");
    mkfifo(&fifo);
    let t = Instant::now();
    assert_eq!(read_clock(&fifo), None);
    assert!(open_clock(&fifo).is_none());
    assert!(t.elapsed() < Duration::from_secs(5));
    // Too large, too short, or a link: no clock.
    let big = d.path().join(".clock-3");
    std::fs::write(&big, vec![0u8; 1 << 20]).unwrap();
    assert_eq!(read_clock(&big), None);
    let short = d.path().join(".clock-4");
    std::fs::write(&short, [1u8; 8]).unwrap();
    assert_eq!(read_clock(&short), None);
    let link = d.path().join(".clock-5");
    std::os::unix::fs::symlink(&big, &link).unwrap();
    assert!(open_clock(&link).is_none());
}

#[test]
fn a_lock_or_chunk_that_is_a_fifo_or_a_link_is_refused_or_skipped_without_a_wait() {
    let d = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let until = || Instant::now() + Duration::from_secs(1);
    // A plain lock file: taken, then busy until its holder drops it.
    let ok = d.path().join("a.lock");
    let held = rt.block_on(lock(&ok, until())).unwrap();
    assert!(held.is_some());
    let t = Instant::now();
    assert!(
        rt.block_on(lock(&ok, Instant::now() + Duration::from_millis(50)))
            .unwrap()
            .is_none()
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    drop(held);
    assert!(rt.block_on(lock(&ok, until())).unwrap().is_some());
    // A FIFO in a lock's place: an error naming it, at once (no writer is waited for).
    let fifo = d.path().join(".cache.lock");
    mkfifo(&fifo);
    let t = Instant::now();
    let e = rt.block_on(lock(&fifo, until())).unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "waited {:?}",
        t.elapsed()
    );
    assert!(e.to_string().contains(".cache.lock"), "{e}");
    // A link in a lock's place (dangling, or to a file elsewhere): refused, nothing created or
    // locked where it points.
    let target = d.path().join("elsewhere");
    let link = d.path().join("b.lock");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let e = rt.block_on(lock(&link, until())).unwrap_err();
    assert!(e.to_string().contains("b.lock"), "{e}");
    assert!(!target.exists(), "the link was followed");
    // Touching a FIFO or a link in a chunk's place returns at once and leaves the target alone.
    let chunk_fifo = d.path().join("c.chunk");
    mkfifo(&chunk_fifo);
    let t = Instant::now();
    touch_now(&chunk_fifo);
    assert!(t.elapsed() < Duration::from_secs(5));
    std::fs::write(&target, b"x").unwrap();
    let old = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
    std::fs::File::options()
        .write(true)
        .open(&target)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let chunk_link = d.path().join("d.chunk");
    std::os::unix::fs::symlink(&target, &chunk_link).unwrap();
    touch_now(&chunk_link);
    assert_eq!(std::fs::metadata(&target).unwrap().modified().unwrap(), old);
    // A real chunk is touched.
    let chunk = d.path().join("e.chunk");
    std::fs::write(&chunk, b"y").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&chunk)
        .unwrap()
        .set_modified(old)
        .unwrap();
    touch_now(&chunk);
    assert!(std::fs::metadata(&chunk).unwrap().modified().unwrap() > old);
}

#[test]
fn a_read_is_served_from_the_checked_inode_only_not_one_renamed_over_it() {
    let d = tempfile::tempdir().unwrap();
    let engine = Engine::new(ubdirect_nvme::EngineConfig::default()).unwrap();
    let c = ChunkCache::new(d.path(), 4 << 20, 64 << 10, &engine).unwrap();
    let p = d.path().join("0000000000000001-00000000.chunk");
    c.write_chunk(&p, &vec![3u8; 100_000]).unwrap();
    let checked = Some(c.checked_ino(&p));
    assert_eq!(checked, Some(std::fs::metadata(&p).unwrap().ino()));
    assert!(c.source_of(&p, checked).is_ok());
    // Another file of the same size renamed over it after the check (and after its open).
    let other = d.path().join("other");
    std::fs::write(&other, vec![7u8; 100_000]).unwrap();
    std::fs::rename(&other, &p).unwrap();
    c.open.lock().unwrap().clear();
    let e = c.source_of(&p, checked).unwrap_err();
    assert!(e.to_string().contains("replaced"), "{e}");
    // Opened ahead of its read (unchecked), it is kept, but a read wanting the checked inode
    // still refuses it.
    assert!(c.source_of(&p, None).is_ok());
    assert!(c.source_of(&p, checked).is_err());
    // A path this process never checked: no read is served from it.
    let q = d.path().join("0000000000000001-00000001.chunk");
    std::fs::write(&q, vec![1u8; 100_000]).unwrap();
    assert!(c.source_of(&q, Some(c.checked_ino(&q))).is_err());
}

#[test]
fn a_chunk_cut_short_between_its_check_and_its_read_is_read_from_the_store() {
    use object_store::ObjectStore;
    let d = tempfile::tempdir().unwrap();
    let engine = Engine::new(ubdirect_nvme::EngineConfig::default()).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let store = Arc::new(object_store::memory::InMemory::new());
    let at = object_store::path::Path::from("o");
    rt.block_on(store.put(&at, data.clone().into())).unwrap();
    let cache = Arc::new(ChunkCache::new(d.path(), 4 << 20, 64 << 10, &engine).unwrap());
    let src = super::super::source::ObjectSource::new(
        store,
        at,
        "memory:///o".into(),
        data.len() as u64,
        None,
        4 << 20,
        Some(cache.clone()),
    );
    let pool = ubdirect_ub::UbPool::builder(ubdirect_ub::PoolConfig::new(
        "t",
        1 << 20,
        1,
        ubdirect_ub::MemoryKind::Host,
    ))
    .register_with(engine.registrar())
    .build()
    .unwrap();
    let read = || {
        let lease = pool.try_acquire().unwrap();
        let (r, lease) = rt.block_on(src.read(0, data.len(), lease, 0, Duration::from_secs(10)));
        r.map(|d| lease.as_slice().unwrap()[d.data].to_vec())
    };
    // The first read fetches the four chunks and keeps them.
    assert_eq!(read().unwrap(), data);
    let chunks = |len: u64| {
        std::fs::read_dir(d.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "chunk"))
            .filter(|e| e.metadata().unwrap().len() == len)
            .count()
    };
    assert_eq!(chunks(64 << 10), 3);
    let files: Vec<(PathBuf, u64)> = std::fs::read_dir(d.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "chunk"))
        .map(|e| (e.path(), e.metadata().unwrap().ino()))
        .collect();
    assert!(files.iter().all(|(p, ino)| cache.is_verified(p, *ino)));
    let recorded = ubdirect_ub::fallback::count("object_cache_chunk_read_failed");
    // Another process cuts each chunk to half after the read checked it: the read is served
    // whole, from the store, and says so.
    *cache.between_check_and_read.lock().unwrap() = Some(Box::new(|p: &Path| {
        let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
        let len = f.metadata().unwrap().len();
        f.set_len(len / 2).unwrap();
    }));
    assert_eq!(read().unwrap(), data);
    assert_eq!(
        ubdirect_ub::fallback::count("object_cache_chunk_read_failed") - recorded,
        4,
        "each chunk's part read from the store"
    );
    assert_eq!(chunks(64 << 10), 0, "every chunk was cut");
    // No longer counted as checked, nor held open.
    assert!(
        files
            .iter()
            .all(|(p, ino)| !cache.is_verified(p, *ino)
                && !cache.open.lock().unwrap().contains_key(p))
    );
    // The next read finds them cut, fetches them again, and reads them from the cache.
    *cache.between_check_and_read.lock().unwrap() = None;
    assert_eq!(read().unwrap(), data);
    assert_eq!(chunks(64 << 10), 3, "fetched and kept again");
}

#[test]
fn a_chunk_its_sidecar_names_is_trusted_unless_rechecked_and_any_other_is_checked() {
    use std::io::Write;
    let d = tempfile::tempdir().unwrap();
    let engine = Engine::new(ubdirect_nvme::EngineConfig::default()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let p = d.path().join("0000000000000001-00000000.chunk");
    let data = vec![3u8; 100_000];
    let writer = ChunkCache::new(d.path(), 4 << 20, 64 << 10, &engine).unwrap();
    writer.write_chunk(&p, &data).unwrap();
    let len = data.len() as u64;
    // Another process: the sidecar names this file (length, inode, ctime), so it is not read
    // again — shown with a sidecar whose CRC no longer matches, which only a read would see...
    let side = p.with_extension("crc");
    let line = std::fs::read_to_string(&side).unwrap();
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f.len(), 5, "{line}");
    std::fs::write(
        &side,
        format!("{} 00000000 {} {} {}\n", f[0], f[2], f[3], f[4]),
    )
    .unwrap();
    let trusting = ChunkCache::new(d.path(), 4 << 20, 64 << 10, &engine).unwrap();
    assert!(rt.block_on(trusting.valid(&p, len)));
    // ...unless `cache.recheck_chunks`, which reads it.
    let rechecking = ChunkCache::new(d.path(), 4 << 20, 64 << 10, &engine)
        .unwrap()
        .with_recheck(true);
    assert!(!rt.block_on(rechecking.valid(&p, len)));
    std::fs::write(&side, &line).unwrap();
    // Bytes changed in place (same inode, same length, the mtime put back: issue 43, which
    // served 16 samples that differ from the store): the ctime moved, so the sidecar names it
    // no more and the CRC check finds it changed.
    let mtime = std::fs::metadata(&p).unwrap().modified().unwrap();
    let mut bad = data.clone();
    bad[99_999] ^= 1;
    {
        let mut f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.write_all(&bad).unwrap();
        f.set_modified(mtime).unwrap();
    }
    let fresh = ChunkCache::new(d.path(), 4 << 20, 64 << 10, &engine).unwrap();
    assert!(
        !rt.block_on(fresh.valid(&p, len)),
        "rewritten in place: checked, and fails"
    );
    // A file put in the chunk's place (another inode) is checked by CRC whatever the setting.
    let other = d.path().join("other");
    std::fs::write(&other, &bad).unwrap();
    std::fs::rename(&other, &p).unwrap();
    let fresh = ChunkCache::new(d.path(), 4 << 20, 64 << 10, &engine).unwrap();
    assert!(
        !rt.block_on(fresh.valid(&p, len)),
        "another inode: checked, and fails"
    );
    std::fs::write(&other, &data).unwrap();
    std::fs::rename(&other, &p).unwrap();
    let fresh = ChunkCache::new(d.path(), 4 << 20, 64 << 10, &engine).unwrap();
    assert!(
        rt.block_on(fresh.valid(&p, len)),
        "another inode, the right bytes: checked, passes"
    );
}

#[test]
fn a_read_at_hand_takes_a_kept_window_whole_or_nothing() {
    let d = tempfile::tempdir().unwrap();
    let engine = Engine::new(ubdirect_nvme::EngineConfig::default()).unwrap();
    let cache = Arc::new(ChunkCache::new(d.path(), 4 << 20, 64 << 10, &engine).unwrap());
    let store = Arc::new(object_store::memory::InMemory::new());
    let src = super::super::source::ObjectSource::new(
        store,
        object_store::path::Path::from("o"),
        "memory:///o".into(),
        200_000,
        None,
        4 << 20,
        Some(cache.clone()),
    );
    let key = src.cache_key();
    let window: Vec<u8> = (0..130u8).collect();
    {
        let mut w = cache.windows.lock().unwrap();
        *w = windows::Windows::new(1 << 20);
        // Two planned reads want bytes 1000..1130; one wants the part of chunk 0 at its end.
        w.keep((key, 1000, 1130), &window, 2);
        w.keep((key, (64 << 10) - 30, 64 << 10), &window[..30], 1);
    }
    let at_hand = |off: u64, len: usize| {
        ubdirect_ub::Source::read_at_hand(&src, off, len).map(|(b, _)| b.to_vec())
    };
    // Not a kept part (another range of it, a read across two chunks, past the end): nothing is
    // taken, and the read goes through the cache as any other.
    assert_eq!(at_hand(1000, 100), None);
    assert_eq!(at_hand((64 << 10) - 30, 60), None, "spans chunks 0 and 1");
    assert_eq!(at_hand(199_990, 20), None, "past the object's end");
    assert!(
        cache
            .windows
            .lock()
            .unwrap()
            .has((key, (64 << 10) - 30, 64 << 10))
    );
    // The kept part, once per read that wants it, then no more.
    assert_eq!(at_hand(1000, 130), Some(window.clone()));
    assert_eq!(at_hand(1000, 130), Some(window.clone()));
    assert_eq!(at_hand(1000, 130), None);
    assert_eq!(at_hand((64 << 10) - 30, 30), Some(window[..30].to_vec()));
    assert_eq!(
        cache.windows.lock().unwrap().room(),
        1 << 20,
        "all taken: its room is free"
    );
}
