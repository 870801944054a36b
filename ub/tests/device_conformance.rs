//! One conformance suite for every `Device` present on this machine: the host device always, CUDA
//! where a GPU is usable. Also: selection (`auto`, `cuda`, `host`) and what it reports.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::sync::Arc;
use std::time::Duration;

use ubdirect_ub::{
    CopyCompletion, Device, DeviceError, DeviceKind, DeviceSelection, MemoryKind, PoolConfig,
    SlotState, UbError, UbPool, select_device,
};

const BLOCK: usize = 1 << 20;

/// (source offset, length, destination offset, completion, source, destination, bytes)
type Pending = (
    usize,
    usize,
    usize,
    CopyCompletion,
    ubdirect_ub::Lease,
    ubdirect_ub::Lease,
    Vec<u8>,
);

fn devices() -> Vec<Arc<dyn Device>> {
    let mut v: Vec<Arc<dyn Device>> = vec![
        select_device(DeviceSelection::Host, 0)
            .expect("host")
            .device,
    ];
    if let Ok(s) = select_device(DeviceSelection::Cuda, 0) {
        v.push(s.device);
    }
    v
}

fn pools(dev: &Arc<dyn Device>, blocks: usize) -> (UbPool, UbPool) {
    let staging = UbPool::builder(PoolConfig::new(
        "staging",
        BLOCK,
        blocks,
        dev.staging_kind(),
    ))
    .device(dev.clone())
    .build()
    .expect("staging pool");
    let batch = UbPool::builder(PoolConfig::new("batch", BLOCK, blocks, dev.batch_kind()))
        .device(dev.clone())
        .build()
        .expect("batch pool");
    (staging, batch)
}

fn pattern(seed: u32, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

#[tokio::test]
async fn conformance_copies_round_trip() {
    for dev in devices() {
        let name = dev.info().name.clone();
        let (staging, batch) = pools(&dev, 8);
        // Offsets and lengths: whole blocks, odd sizes, odd offsets.
        let cases = [
            (0usize, BLOCK, 0usize),
            (1, 1000, 3),
            (4096, 65536, 8192),
            (BLOCK - 7, 7, BLOCK - 7),
            (12345, 54321, 777),
        ];
        let mut pending: Vec<Pending> = Vec::new();
        for (i, &(so, len, dof)) in cases.iter().enumerate() {
            let mut src = staging.acquire(Duration::from_secs(5)).await.expect("src");
            let mut dst = batch.acquire(Duration::from_secs(5)).await.expect("dst");
            let bytes = pattern(i as u32, len);
            src.as_mut_slice().expect("host-visible staging")[so..so + len].copy_from_slice(&bytes);
            let c = dev
                .copy_to_device(&mut src, so..so + len, &mut dst, dof)
                .expect("copy");
            pending.push((so, len, dof, c, src, dst, bytes));
        }
        for (_so, len, dof, c, src, dst, bytes) in pending {
            c.wait(Duration::from_secs(10))
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(
                src.state(),
                SlotState::Lent,
                "{name}: source still in flight after completion"
            );
            let mut back = vec![0u8; len];
            dev.copy_to_host(&dst, dof..dof + len, &mut back)
                .expect("copy back");
            assert!(
                back == bytes,
                "{name}: bytes differ after round trip ({len} at {dof})"
            );
        }
        dev.synchronize().expect("synchronize");
        let (s, b) = (staging.stats(), batch.stats());
        assert_eq!((s.free, b.free), (8, 8), "{name}: leases not returned");
    }
}

#[tokio::test]
async fn conformance_many_copies_in_flight() {
    for dev in devices() {
        let name = dev.info().name.clone();
        let (staging, batch) = pools(&dev, 32);
        let mut pending = Vec::new();
        for i in 0..32u32 {
            let mut src = staging.acquire(Duration::from_secs(5)).await.expect("src");
            let mut dst = batch.acquire(Duration::from_secs(5)).await.expect("dst");
            let bytes = pattern(1000 + i, BLOCK);
            src.as_mut_slice().expect("host")[..].copy_from_slice(&bytes);
            let c = dev
                .copy_to_device(&mut src, 0..BLOCK, &mut dst, 0)
                .expect("copy");
            // The source lease is dropped at once: its slot must wait for the copy.
            drop(src);
            pending.push((c, dst, bytes));
        }
        for (c, dst, bytes) in pending {
            c.wait(Duration::from_secs(10)).await.expect("completion");
            let mut back = vec![0u8; BLOCK];
            dev.copy_to_host(&dst, 0..BLOCK, &mut back)
                .expect("copy back");
            assert!(back == bytes, "{name}: data corrupted");
        }
        let s = staging.stats();
        assert_eq!((s.free, s.orphaned), (32, 0), "{name}");
    }
}

/// A source lease dropped right after a copy was enqueued stays out of circulation until the copy's
/// event fires. The copy is queued behind a large one so it is still pending when we look.
#[tokio::test]
async fn conformance_dropped_source_waits_for_the_copy() {
    for dev in devices() {
        let name = dev.info().name.clone();
        let big = 256 << 20;
        let big_staging = UbPool::builder(PoolConfig::new("big", big, 1, dev.staging_kind()))
            .device(dev.clone())
            .build()
            .expect("big");
        let big_batch = UbPool::builder(PoolConfig::new("bigd", big, 1, dev.batch_kind()))
            .device(dev.clone())
            .build()
            .expect("bigd");
        let (staging, batch) = pools(&dev, 1);
        let (mut bs, mut bd) = (
            big_staging.try_acquire().expect("b"),
            big_batch.try_acquire().expect("b"),
        );
        let c0 = dev
            .copy_to_device(&mut bs, 0..big, &mut bd, 0)
            .expect("big copy");
        let mut src = staging.try_acquire().expect("src");
        let mut dst = batch.try_acquire().expect("dst");
        let slot = src.slot();
        let c = dev
            .copy_to_device(&mut src, 0..BLOCK, &mut dst, 0)
            .expect("copy");
        drop(src);
        let state = staging.slot_state(slot).expect("slot");
        if dev.info().kind == DeviceKind::Host {
            // Synchronous copies complete before returning.
            assert_eq!(state, SlotState::Free, "{name}");
        } else {
            assert_eq!(
                state,
                SlotState::Orphaned,
                "{name}: slot freed before the copy completed"
            );
            assert!(
                staging.try_acquire().is_none(),
                "{name}: orphaned slot handed out"
            );
        }
        c.wait(Duration::from_secs(10)).await.expect("copy");
        c0.wait(Duration::from_secs(10)).await.expect("big copy");
        assert_eq!(staging.slot_state(slot), Some(SlotState::Free), "{name}");
        drop((dst, bs, bd));
    }
}

/// A copy stream of its own: batched parts to the device and back, polled to completion; parts
/// outside a block are refused before anything is enqueued; both leases are free again after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_copy_stream_batches_round_trip() {
    use ubdirect_ub::CopyPart;
    for dev in devices() {
        let (staging, batch) = pools(&dev, 1);
        let cs = dev.copy_stream().expect("copy stream");
        let mut st = staging.try_acquire().expect("staging");
        let mut region = batch.try_acquire().expect("region");
        let data = pattern(7, 3 * 4096);
        st.as_mut_slice().unwrap()[..data.len()].copy_from_slice(&data);
        // Three parts, the first two adjacent, the third elsewhere.
        let parts = [
            CopyPart {
                host: 0,
                device: 8192,
                len: 4096,
            },
            CopyPart {
                host: 4096,
                device: 12288,
                len: 4096,
            },
            CopyPart {
                host: 8192,
                device: BLOCK - 4096,
                len: 4096,
            },
        ];
        let t = Duration::from_secs(10);
        cs.to_device(&mut st, &mut region, &parts)
            .unwrap()
            .wait(Duration::from_micros(100), t)
            .await
            .unwrap();
        st.as_mut_slice().unwrap().fill(0);
        let back = [
            CopyPart {
                host: 100,
                device: 8192,
                len: 8192,
            },
            CopyPart {
                host: 100 + 8192,
                device: BLOCK - 4096,
                len: 4096,
            },
        ];
        cs.to_host(&mut region, &mut st, &back)
            .unwrap()
            .wait(Duration::from_micros(100), t)
            .await
            .unwrap();
        assert!(
            st.as_slice().unwrap()[100..100 + data.len()] == data[..],
            "{}: copy stream round trip differs",
            dev.info().name
        );
        let bad = [CopyPart {
            host: 0,
            device: BLOCK - 8,
            len: 16,
        }];
        let e = cs.to_device(&mut st, &mut region, &bad).unwrap_err();
        assert!(
            matches!(e, DeviceError::Pool(UbError::OutOfRange { .. })),
            "{e}"
        );
        assert_eq!(
            st.state(),
            SlotState::Lent,
            "a completed batch left staging in flight"
        );
        assert_eq!(
            region.state(),
            SlotState::Lent,
            "a completed batch left the region in flight"
        );
    }
}

#[tokio::test]
async fn conformance_bad_ranges_are_errors() {
    for dev in devices() {
        let (staging, batch) = pools(&dev, 2);
        let mut src = staging.try_acquire().expect("src");
        let mut dst = batch.try_acquire().expect("dst");
        let e = dev
            .copy_to_device(&mut src, 0..BLOCK + 1, &mut dst, 0)
            .unwrap_err();
        assert!(
            matches!(e, DeviceError::Pool(UbError::OutOfRange { .. })),
            "{e}"
        );
        let e = dev
            .copy_to_device(&mut src, 0..16, &mut dst, BLOCK - 8)
            .unwrap_err();
        assert!(
            matches!(e, DeviceError::Pool(UbError::OutOfRange { .. })),
            "{e}"
        );
        let mut back = vec![0u8; 10];
        assert!(
            dev.copy_to_host(&dst, BLOCK - 5..BLOCK + 5, &mut back)
                .is_err()
        );
        assert_eq!(
            src.state(),
            SlotState::Lent,
            "a refused copy left the lease in flight"
        );
    }
}

#[test]
fn selection_reports_what_was_chosen() {
    let host = select_device(DeviceSelection::Host, 0).expect("host");
    assert_eq!(host.device.info().kind, DeviceKind::Host);
    assert!(!host.fallback);
    let cuda_usable =
        ubdirect_ub::cuda_driver_present() && select_device(DeviceSelection::Cuda, 0).is_ok();
    let auto = select_device(DeviceSelection::Auto, 0).expect("auto never fails");
    if cuda_usable {
        assert_eq!(auto.device.info().kind, DeviceKind::Cuda, "{}", auto.reason);
        assert!(!auto.fallback);
    } else {
        assert_eq!(auto.device.info().kind, DeviceKind::Host);
        assert!(auto.fallback);
        assert!(auto.reason.contains("no usable GPU"), "{}", auto.reason);
        assert!(
            ubdirect_ub::fallback::count("no_gpu") >= 1,
            "fallback not recorded"
        );
        let e = select_device(DeviceSelection::Cuda, 0).unwrap_err();
        assert!(matches!(e, DeviceError::CudaUnavailable { .. }), "{e}");
        assert!(e.to_string().contains("CUDA unavailable"), "{e}");
    }
}

#[test]
fn cuda_out_of_range_ordinal_is_an_error_not_a_panic() {
    let e = select_device(DeviceSelection::Cuda, 4096).unwrap_err();
    assert!(matches!(e, DeviceError::CudaUnavailable { .. }), "{e}");
}

#[test]
fn host_device_has_no_pinned_or_device_memory() {
    let dev = select_device(DeviceSelection::Host, 0)
        .expect("host")
        .device;
    assert_eq!(
        (dev.staging_kind(), dev.batch_kind()),
        (MemoryKind::Host, MemoryKind::Host)
    );
    for kind in [MemoryKind::Pinned, MemoryKind::Device] {
        let e = UbPool::builder(PoolConfig::new("x", 4096, 1, kind))
            .device(dev.clone())
            .build()
            .unwrap_err();
        assert!(matches!(e, UbError::KindUnsupported { .. }), "{e}");
    }
}

/// The conformance tests above run against every device present; on the GPU machine this says
/// that CUDA was one of them (elsewhere it is ignored, visibly).
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn cuda_is_in_the_conformance_suite() {
    let kinds: Vec<_> = devices().iter().map(|d| d.info().kind).collect();
    assert!(kinds.contains(&DeviceKind::Cuda), "devices: {kinds:?}");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on the GPU machine"]
fn cuda_pools_register_once() {
    let s = select_device(DeviceSelection::Cuda, 0).expect("a usable CUDA device");
    let dev = s.device;
    let p = UbPool::builder(PoolConfig::new("pinned", BLOCK, 4, MemoryKind::Pinned))
        .device(dev.clone())
        .build()
        .expect("pinned");
    assert_eq!(p.stats().registrations, 1);
    assert!(p.consumers()[0].contains("host registration"));
    let d = UbPool::builder(PoolConfig::new("dev", BLOCK, 4, MemoryKind::Device))
        .device(dev.clone())
        .build()
        .expect("device");
    let mut s = p.try_acquire().expect("s");
    let mut t = d.try_acquire().expect("t");
    for _ in 0..50 {
        dev.copy_to_device(&mut s, 0..4096, &mut t, 0)
            .expect("copy")
            .wait_blocking(Duration::from_secs(5))
            .expect("done");
    }
    assert_eq!(p.stats().registrations, 1, "registration on the hot path");
    // A pageable host source is refused rather than silently made synchronous.
    let h = UbPool::new_host(PoolConfig::new("h", BLOCK, 1, MemoryKind::Host)).expect("host");
    let mut hl = h.try_acquire().expect("h");
    let e = dev.copy_to_device(&mut hl, 0..10, &mut t, 0).unwrap_err();
    assert!(matches!(e, DeviceError::WrongKind { .. }), "{e}");
}
