//! The SMC mapping's own tests: poisoning, bounds, unaligned and concurrent copies.
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use super::*;

/// The permissions and path of the /proc/self/maps line holding `addr`.
fn vma(addr: *mut u8) -> (String, String) {
    let a = addr as u64;
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for l in maps.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (s, e) = f[0].split_once('-').unwrap();
        let (s, e) = (
            u64::from_str_radix(s, 16).unwrap(),
            u64::from_str_radix(e, 16).unwrap(),
        );
        if (s..e).contains(&a) {
            return (f[1].to_string(), f.get(5).unwrap_or(&"").to_string());
        }
    }
    panic!("{a:#x} is not mapped");
}

/// Needs userfaultfd: root, as CI runs (the integration tests in net/tests/smc.rs need it too).
fn mapping() -> UffdMapping {
    let m = UffdMapping::new(4 * 4096, true, false, false).unwrap();
    // Pages 0 and 1 present, so that loads and stores below do not wait for a fault thread.
    m.fill(0, &[7u8; 8192], false).unwrap();
    m
}

#[test]
fn poison_installs_a_sigbus_mapping_in_place() {
    let m = mapping();
    assert_eq!(vma(m.base()).0, "rw-p");
    assert_eq!(m.poison().unwrap(), Poisoned::Sigbus);
    let (perm, path) = vma(m.base());
    assert_eq!(perm, "rw-s");
    assert!(path.contains("ubdirect-smc-unavailable"), "{path}");
    // The whole range, end included, is the memfd mapping.
    let end = m.base().wrapping_add(m.len - 1);
    assert_eq!(vma(end), (perm, path));
}

#[test]
fn without_the_memfd_poison_makes_the_range_inaccessible() {
    let m = mapping();
    let got = m.poison_with(false).unwrap();
    assert!(matches!(got, Poisoned::Sigsegv { .. }), "{got:?}");
    assert_eq!(vma(m.base()).0, "---p");
    assert_eq!(vma(m.base().wrapping_add(m.len - 1)).0, "---p");
}

#[test]
fn loads_and_stores_are_bounds_checked_and_copy_unaligned_ranges() {
    let m = mapping();
    let mut b = vec![0u8; 8192 - 3];
    m.load(3, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 7));
    let src: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
    for off in [0, 1, 5, 8, 13, 4093] {
        m.store(off, &src[..3000]).unwrap();
        let mut back = vec![0u8; 3000];
        m.load(off, &mut back).unwrap();
        assert_eq!(back, src[..3000]);
    }
    // Short copies that end before the first aligned word.
    m.store(9, b"abc").unwrap();
    let mut s = [0u8; 3];
    m.load(9, &mut s).unwrap();
    assert_eq!(&s, b"abc");
    // A partial-word store keeps the word's other bytes.
    m.store(8, &[1; 8]).unwrap();
    m.store(10, b"xy").unwrap();
    let mut w = [0u8; 8];
    m.load(8, &mut w).unwrap();
    assert_eq!(&w, &[1, 1, b'x', b'y', 1, 1, 1, 1]);
    // Threads storing and loading the same words at once: no data race (each is atomic), and
    // every word read is one that some store wrote whole.
    std::thread::scope(|sc| {
        for t in 0..4u8 {
            let m = &m;
            sc.spawn(move || {
                for _ in 0..200 {
                    m.store(64, &[t; 64]).unwrap();
                    let mut r = [0u8; 64];
                    m.load(64, &mut r).unwrap();
                    assert!(r.chunks(8).all(|c| c.iter().all(|&x| x == c[0])));
                }
            });
        }
    });
    let len = m.len;
    assert!(m.load(len - 1, &mut [0u8; 2]).is_err());
    assert!(m.store(usize::MAX, &[1]).is_err());
    assert!(m.fill(usize::MAX - 10, &[0u8; 4096], false).is_err());
    assert!(m.protect(len, 4096, true).is_err());
}
