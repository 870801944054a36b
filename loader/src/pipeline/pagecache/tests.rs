#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use super::candidate::map_chunks;
use super::*;
use std::os::unix::fs::MetadataExt;

#[test]
fn chunk_files_cut_short_or_replaced_since_they_were_checked_are_not_mapped() {
    let d = tempfile::tempdir().unwrap();
    let chunk = 64u64 << 10;
    let size = 2 * chunk + 5000;
    let paths: Vec<PathBuf> = (0..3)
        .map(|i| d.path().join(format!("{i}.chunk")))
        .collect();
    for (i, p) in paths.iter().enumerate() {
        let n = if i == 2 { 5000 } else { chunk as usize };
        std::fs::write(p, vec![i as u8; n]).unwrap();
    }
    let files = || ubdirect_ub::ChunkFiles {
        chunk_size: chunk,
        chunks: paths
            .iter()
            .map(|p| (p.clone(), std::fs::metadata(p).unwrap().ino()))
            .collect(),
    };
    let budget = PinBudget::new(1 << 30);
    let m = map_chunks(&files(), size, None, &budget).unwrap().unwrap();
    assert_eq!(m.len(), size);
    drop(m);
    // The last chunk cut short in place (same inode): not mapped, not an error.
    let checked = files();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&paths[2])
        .unwrap()
        .set_len(100)
        .unwrap();
    assert!(map_chunks(&checked, size, None, &budget).unwrap().is_none());
    // Whole again, then a chunk replaced by another file (a new inode): not mapped.
    std::fs::write(&paths[2], vec![2u8; 5000]).unwrap();
    let checked = files();
    assert!(map_chunks(&checked, size, None, &budget).unwrap().is_some());
    let other = d.path().join("other");
    std::fs::write(&other, vec![9u8; chunk as usize]).unwrap();
    std::fs::rename(&other, &paths[1]).unwrap();
    assert!(map_chunks(&checked, size, None, &budget).unwrap().is_none());
    // Evicted (gone): not mapped, not an error.
    std::fs::remove_file(&paths[0]).unwrap();
    assert!(
        map_chunks(&files_without(&paths), size, None, &budget)
            .unwrap()
            .is_none()
    );
}

/// A local shard of 8 KiB in `dir`, as the pool holds it.
fn local_candidate(dir: &std::path::Path) -> Candidate {
    let p = dir.join("shard");
    std::fs::write(&p, vec![5u8; 8192]).unwrap();
    let engine = ubdirect_nvme::Engine::new(ubdirect_nvme::EngineConfig::default()).unwrap();
    Candidate::new(Backing::File {
        file: Arc::new(FileSource::open(&engine, &p).unwrap()),
        path: p,
    })
}

/// An object held in chunk files on disk, as a cache keeps it: only its chunk files matter to
/// the pool's decisions tested here (its reads are not made).
#[derive(Debug)]
struct ChunksOnDisk {
    files: Vec<PathBuf>,
    chunk: u64,
    size: u64,
}

impl Source for ChunksOnDisk {
    fn shard(&self) -> &str {
        "s3://test/object"
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn describe(&self) -> String {
        "chunk files on disk".into()
    }
    fn chunk_files(&self) -> Option<ubdirect_ub::ChunkFiles> {
        Some(ubdirect_ub::ChunkFiles {
            chunk_size: self.chunk,
            chunks: self
                .files
                .iter()
                .map(|p| (p.clone(), std::fs::metadata(p).map_or(0, |m| m.ino())))
                .collect(),
        })
    }
    fn read(
        &self,
        offset: u64,
        len: usize,
        lease: ubdirect_ub::Lease,
        _: usize,
        _: Duration,
    ) -> ubdirect_ub::ReadFuture<'_> {
        let e = ubdirect_ub::SourceError::new(
            ubdirect_ub::SourceErrorKind::Refused,
            self.shard(),
            offset,
            len,
        );
        Box::pin(async move { (Err(e), lease) })
    }
}

#[test]
fn chunk_files_not_as_the_cache_wrote_them_put_the_object_off_not_refuse_it() {
    let d = tempfile::tempdir().unwrap();
    let (files, c) = chunk_object(d.path());
    let chunk = 64u64 << 10;
    // The middle chunk cut short (another process rewriting it, say).
    std::fs::write(&files[1], vec![1u8; 100]).unwrap();
    let budget = PinBudget::new(1 << 30);
    assert!(
        c.map(None, &budget).unwrap().is_none(),
        "put off, not an error"
    );
    assert!(
        crate::fallbacks()
            .iter()
            .any(|(what, ..)| what == "object_cache_chunks_not_mapped")
    );
    // Whole again: mapped.
    std::fs::write(&files[1], vec![1u8; chunk as usize]).unwrap();
    let m = c.map(None, &budget).unwrap().unwrap();
    assert_eq!(m.file().len(), 3 * chunk);
}

/// An object of 3 whole chunk files (64 KiB) written in `dir`, and the pool's candidate for it.
fn chunk_object(dir: &std::path::Path) -> (Vec<PathBuf>, Candidate) {
    let chunk = 64u64 << 10;
    let files: Vec<PathBuf> = (0..3).map(|i| dir.join(format!("{i}.chunk"))).collect();
    for f in &files {
        std::fs::write(f, vec![1u8; chunk as usize]).unwrap();
    }
    let c = Candidate::new(Backing::Chunks(Arc::new(ChunksOnDisk {
        files: files.clone(),
        chunk,
        size: 3 * chunk,
    })));
    (files, c)
}

/// A pool of one such object in `dir`, with `regions` memory regions.
fn one_object_pool(dir: &std::path::Path, regions: u64) -> Shared {
    Shared::new(
        PinBudget::with_region_limit(1 << 30, regions),
        Arc::new(ubdirect_ub::HostDevice::new()),
        vec![Some(chunk_object(dir).1)],
    )
}

#[test]
fn a_refused_object_is_not_staged_again() {
    let d = tempfile::tempdir().unwrap();
    let pool = one_object_pool(d.path(), 1 << 20);
    let c = pool.shards[0].as_ref().unwrap();
    let m = c.state(&pool.budget).chunks.expect("resident chunk files");
    c.refuse(&MapError::Regions {
        path: PathBuf::new(),
        regions: 0,
        held: 0,
        limit: 0,
    });
    // A start that checked it before the refusal stages it after.
    pool.stage(0, Arc::new(ShardMap::staged(m)));
    assert!(
        lock(&c.staged).is_none(),
        "a refused object holds no staged mapping"
    );
    assert!(pool.current.lock().unwrap()[0].is_none());
    assert_eq!(pool.budget.regions(), 0, "its regions are given back");
}

#[test]
fn a_staged_mapping_gives_way_to_the_registration_where_regions_are_short() {
    let d = tempfile::tempdir().unwrap();
    // Room for one mapping of the 3 chunk files (3 regions and a spare), not two.
    let pool = one_object_pool(d.path(), 6);
    let c = pool.shards[0].as_ref().unwrap();
    let m = c.state(&pool.budget).chunks.expect("resident chunk files");
    pool.stage(0, Arc::new(ShardMap::staged(m)));
    assert_eq!(pool.budget.regions(), 4);
    // The registrar finds the staged mapping still right, with no room to map the files again:
    // the staged mapping is let go, not kept while the registration waits for ever.
    assert!(!pool.register(0, true));
    assert!(lock(&c.staged).is_none());
    assert!(pool.current.lock().unwrap()[0].is_none());
    assert_eq!(pool.budget.regions(), 0);
    // The next pass registers it.
    assert!(pool.register(0, true));
    assert!(c.mapping().is_some_and(|m| m.file().is_registered()));
    assert_eq!(pool.budget.regions(), 4);
}

#[test]
fn a_mapping_short_of_memory_regions_is_put_off_and_recorded_not_refused() {
    let d = tempfile::tempdir().unwrap();
    let c = local_candidate(d.path());
    let none_left = PinBudget::with_region_limit(1 << 30, 0);
    assert!(
        c.map(None, &none_left).unwrap().is_none(),
        "put off, not an error"
    );
    assert!(!c.refused.load(Ordering::Relaxed));
    assert!(
        crate::fallbacks()
            .iter()
            .any(|(what, n, why)| what == "page_cache_map_regions"
                && *n >= 1
                && why.contains("vm.max_map_count"))
    );
    // With room, the same shard maps.
    let room = PinBudget::with_region_limit(1 << 30, 4);
    assert!(c.map(None, &room).unwrap().is_some());
    // Chunk files: refused by count before any file is opened (these do not exist).
    let files = ubdirect_ub::ChunkFiles {
        chunk_size: 64 << 10,
        chunks: (0..8)
            .map(|i| (d.path().join(format!("{i}.chunk")), 1))
            .collect(),
    };
    match map_chunks(&files, 8 << 16, None, &room) {
        Err(MapError::Regions { regions: 9, .. }) => {}
        r => panic!("expected the region bound, got {r:?}"),
    }
}

#[test]
fn a_shard_being_registered_is_not_waited_for() {
    let d = tempfile::tempdir().unwrap();
    let c = local_candidate(d.path());
    let budget = PinBudget::new(1 << 30);
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        // A registration that takes 2 s, as `map_and_publish` makes it: the slot locked, the
        // flag up, then the mapping stored.
        s.spawn(|| {
            let mut slot = c.mapped.lock().unwrap();
            c.registering.store(true, Ordering::Release);
            held_tx.send(()).unwrap();
            std::thread::sleep(Duration::from_secs(2));
            *slot = c.map(None, &budget).unwrap().map(Arc::new);
            c.registering.store(false, Ordering::Release);
        });
        held_rx.recv().unwrap();
        let t = std::time::Instant::now();
        assert!(c.mapping().is_none(), "not mapped yet");
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "waited {:?}",
            t.elapsed()
        );
    });
    assert!(c.mapping().is_some(), "mapped once the registration ended");
}

/// The chunk list with the inodes as they were (the first one since removed).
fn files_without(paths: &[PathBuf]) -> ubdirect_ub::ChunkFiles {
    ubdirect_ub::ChunkFiles {
        chunk_size: 64 << 10,
        chunks: paths
            .iter()
            .map(|p| (p.clone(), std::fs::metadata(p).map_or(1, |m| m.ino())))
            .collect(),
    }
}
