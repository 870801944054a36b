#![allow(clippy::unwrap_used)]
use super::*;

fn file(tag: &str, len: usize) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ubdirect-mapped-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join("shard");
    std::fs::write(&p, vec![7u8; len]).unwrap();
    p
}

/// Issue 23: a shard truncated between the check and the copy killed the process with SIGBUS
/// (3 of 105 host epochs). Copies race a thread that truncates and restores the file; with the
/// old `check` + load from the mapping this test dies of SIGBUS within milliseconds; with
/// `pread` every copy is whole and right or a `Changed` error.
#[test]
fn copies_racing_truncation_are_errors_never_sigbus() {
    const LEN: usize = 4 << 20;
    let p = file("race", LEN);
    let dev = crate::HostDevice::new();
    let m = MappedFile::open(&p, &dev, &PinBudget::new(1 << 30)).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let t = {
        let (p, stop) = (p.clone(), stop.clone());
        std::thread::spawn(move || {
            let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
            while !stop.load(Ordering::Relaxed) {
                f.set_len(4096).unwrap();
                f.set_len(LEN as u64).unwrap();
            }
        })
    };
    let mut buf = vec![0u8; 1 << 20];
    let (mut ok, mut changed) = (0, 0);
    let t0 = std::time::Instant::now();
    while t0.elapsed() < std::time::Duration::from_millis(500) {
        match m.copy_out((LEN - buf.len()) as u64, &mut buf) {
            Ok(()) => ok += 1,
            Err(MapError::Changed { .. }) => changed += 1,
            Err(e) => panic!("{e}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    t.join().unwrap();
    assert!(changed > 0, "{ok} copies, none saw the truncation");
}

/// Issue 23: a file rewritten in place with its old mtime put back passed the check (size,
/// mtime, inode) and was served with different bytes; the ctime catches it.
#[test]
fn a_rewrite_with_its_mtime_put_back_is_a_change() {
    let p = file("rewrite", 8192);
    let dev = crate::HostDevice::new();
    let m = MappedFile::open(&p, &dev, &PinBudget::new(1 << 30)).unwrap();
    let mtime = std::fs::metadata(&p).unwrap().modified().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[9u8; 4096], 0).unwrap();
    f.set_modified(mtime).unwrap();
    drop(f);
    let mut buf = [0u8; 16];
    assert!(matches!(m.check(), Err(MapError::Changed { .. })));
    assert!(matches!(
        m.copy_out(0, &mut buf),
        Err(MapError::Changed { .. })
    ));
}

/// Each mapping holds a memory region per file (and a spare) of its budget's bound, refused past
/// it, given back when dropped; the default bound is half of `vm.max_map_count`.
#[test]
fn mappings_hold_their_regions_within_the_bound_and_give_them_back() {
    let p0 = file("regions", 64 << 10);
    let d = p0.parent().unwrap().to_path_buf();
    let p1 = d.join("c1");
    std::fs::write(&p1, vec![1u8; 64 << 10]).unwrap();
    let p2 = d.join("c2");
    std::fs::write(&p2, vec![2u8; 100]).unwrap();
    let budget = PinBudget::with_region_limit(1 << 30, 5);
    assert!(budget.regions_fit(3) && !budget.regions_fit(5));
    let paths = [p0.clone(), p1, p2];
    let chunks = MappedFile::open_chunks(&paths, 64 << 10, None, &budget).unwrap();
    assert_eq!(budget.regions(), 4, "three files and a spare");
    let one = MappedFile::open_unregistered(&p0, &budget).unwrap();
    assert_eq!(budget.regions(), 5);
    match MappedFile::open_unregistered(&p0, &budget) {
        Err(MapError::Regions {
            regions: 1,
            held: 5,
            limit: 5,
            ..
        }) => {}
        r => panic!("expected the region bound, got {r:?}"),
    }
    match MappedFile::open_chunks(&paths, 64 << 10, None, &budget) {
        Err(e @ MapError::Regions { .. }) => {
            assert!(e.to_string().contains("vm.max_map_count"), "{e}")
        }
        r => panic!("expected the region bound, got {r:?}"),
    }
    assert_eq!(budget.regions(), 5, "a refused mapping holds nothing");
    drop(chunks);
    assert_eq!(budget.regions(), 1);
    drop(one);
    assert_eq!(budget.regions(), 0);
    assert!(MappedFile::open_chunks(&paths, 64 << 10, None, &budget).is_ok());
    // The default bound is half the kernel's limit.
    let max: u64 = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .map_or(65_530, |s| s.trim().parse().unwrap());
    assert_eq!(PinBudget::new(0).region_limit(), max / 2);
}

/// `vm.max_map_count` bounds the process: the budgets of two loaders in one process count their
/// mappings' regions against one bound, not half the limit each.
#[test]
fn budgets_of_one_process_share_one_region_bound() {
    let p = file("shared-regions", 64 << 10);
    let (a, b) = (PinBudget::new(1 << 30), PinBudget::new(1 << 30));
    assert_eq!(a.region_limit(), b.region_limit());
    let m = MappedFile::open_unregistered(&p, &a).unwrap();
    // Other tests of this process may hold regions too, never fewer than this one.
    assert!(
        b.regions() >= 1,
        "a mapping of a is counted against b's bound too"
    );
    drop(m);
    let own = PinBudget::with_region_limit(1 << 30, 8);
    let m = MappedFile::open_unregistered(&p, &own).unwrap();
    assert_eq!(own.regions(), 1, "a budget with its own bound counts alone");
    drop(m);
    assert_eq!(own.regions(), 0);
}

/// An object's chunk files as one mapping: one registration, copies across chunk boundaries
/// equal the files' concatenation, each file checked; a chunk of the wrong size is refused.
#[test]
fn chunk_files_map_as_one_registered_range() {
    let p0 = file("chunks", 64 << 10);
    let d = p0.parent().unwrap().to_path_buf();
    let mut want = std::fs::read(&p0).unwrap();
    let p1 = d.join("c1");
    let b1: Vec<u8> = (0..(64 << 10)).map(|i| (i % 13) as u8).collect();
    std::fs::write(&p1, &b1).unwrap();
    want.extend_from_slice(&b1);
    let p2 = d.join("c2");
    let b2: Vec<u8> = (0..5000).map(|i| (i % 7 + 100) as u8).collect();
    std::fs::write(&p2, &b2).unwrap();
    want.extend_from_slice(&b2);
    let dev = crate::HostDevice::new();
    let budget = PinBudget::new(1 << 30);
    let paths = [p0.clone(), p1.clone(), p2.clone()];
    let m = MappedFile::open_chunks(&paths, 64 << 10, Some(&dev), &budget).unwrap();
    assert_eq!(m.len(), want.len() as u64);
    assert!(m.is_registered());
    assert_eq!(
        budget.registrations(),
        1,
        "one registration for the three files"
    );
    assert_eq!(m.files().count(), 3);
    let mut out = vec![0u8; 70_000];
    m.copy_out(60_000, &mut out).unwrap();
    assert!(out == want[60_000..130_000], "a copy across two boundaries");
    let mut tail = vec![0u8; 100];
    m.copy_out(want.len() as u64 - 100, &mut tail).unwrap();
    assert!(tail == want[want.len() - 100..]);
    assert!(
        m.copy_out(want.len() as u64 - 99, &mut tail).is_err(),
        "past the end"
    );
    // Touched by another process (its mtime): still fine; truncated: changed.
    let now = std::time::SystemTime::now();
    std::fs::File::options()
        .write(true)
        .open(&p1)
        .unwrap()
        .set_modified(now)
        .unwrap();
    m.check().unwrap();
    std::fs::File::options()
        .write(true)
        .open(&p1)
        .unwrap()
        .set_len(100)
        .unwrap();
    assert!(matches!(m.check(), Err(MapError::Changed { .. })));
    // A CPU copy checks the files it spans, only those: one within the first or the last chunk
    // still copies, one that reaches into the truncated chunk is `Changed`.
    let mut head = vec![0u8; 1000];
    m.copy_out(1000, &mut head).unwrap();
    assert!(head == want[1000..2000]);
    assert!(matches!(
        m.copy_out(60_000, &mut out),
        Err(MapError::Changed { ref path, .. }) if *path == p1
    ));
    m.copy_out((128 << 10) + 10, &mut tail).unwrap();
    assert!(
        tail == want[(128 << 10) + 10..(128 << 10) + 110],
        "the last chunk"
    );
    drop(m);
    assert_eq!(budget.used(), 0);
    // A chunk before the last that is not one chunk long: refused, nothing reserved.
    let e = MappedFile::open_chunks(&paths, 64 << 10, Some(&dev), &budget);
    assert!(e.is_err());
    assert_eq!(budget.used(), 0);
}

/// A mapping made for CPU copies and registered later: nothing is reserved until then, the
/// registration takes its pages from the budget (refused whole beyond it), and dropping it gives
/// them back.
#[test]
fn an_unregistered_mapping_registers_later_within_its_budget() {
    let p0 = file("later", 64 << 10);
    let d = p0.parent().unwrap().to_path_buf();
    let p1 = d.join("later1");
    std::fs::write(&p1, vec![7u8; 3000]).unwrap();
    let want = [std::fs::read(&p0).unwrap(), std::fs::read(&p1).unwrap()].concat();
    let dev = crate::HostDevice::new();
    let paths = [p0.clone(), p1.clone()];
    let small = PinBudget::new(64 << 10);
    let m = MappedFile::open_chunks(&paths, 64 << 10, None, &small).unwrap();
    assert!(!m.is_registered());
    assert_eq!(small.used(), 0, "an unregistered mapping pins nothing");
    let sizes: Vec<u64> = m
        .open_files()
        .map(|(_, f, n)| {
            assert_eq!(f.metadata().unwrap().len(), n);
            n
        })
        .collect();
    assert_eq!(sizes, vec![64 << 10, 3000]);
    assert!(matches!(
        m.into_registered(&dev),
        Err(MapError::Budget { len, .. }) if len == (64 << 10) + 4096
    ));
    assert_eq!(small.used(), 0, "a refused registration reserves nothing");
    let budget = PinBudget::new(1 << 30);
    let m = MappedFile::open_chunks(&paths, 64 << 10, None, &budget).unwrap();
    let m = m.into_registered(&dev).unwrap();
    assert!(m.is_registered());
    assert_eq!(budget.used(), (64 << 10) + 4096);
    assert_eq!(budget.registrations(), 1);
    let mut out = vec![0u8; want.len()];
    m.copy_out(0, &mut out).unwrap();
    assert!(out == want);
    let m = m.into_registered(&dev).unwrap();
    assert_eq!(budget.registrations(), 1, "registered once");
    drop(m);
    assert_eq!(budget.used(), 0);
}

/// A FIFO in a shard's or chunk's place is refused at once, never waited on.
#[test]
fn a_fifo_is_refused_without_waiting_for_a_writer() {
    let p = file("fifo", 4096);
    let fifo = p.with_file_name("fifo");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let budget = PinBudget::new(1 << 30);
    let t = std::time::Instant::now();
    assert!(MappedFile::open_unregistered(&fifo, &budget).is_err());
    let chunks = [p.clone(), fifo.clone()];
    assert!(MappedFile::open_chunks(&chunks, 4096, None, &budget).is_err());
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(budget.used(), 0);
}

/// A release past what was reserved (a release twice) is a broken invariant: a panic in debug
/// builds, a counted error in release — never a budget that silently reads as free.
#[test]
#[cfg_attr(debug_assertions, should_panic(expected = "pin budget"))]
fn a_pin_budget_released_twice_is_a_broken_invariant() {
    let b = PinBudget::new(1 << 20);
    b.reserve(4096).unwrap();
    b.release(4096);
    let before = crate::broken_transitions();
    b.release(4096);
    assert_eq!(crate::broken_transitions(), before + 1);
}
