//! The NVMe test binary the project's QEMU guest runs (`nvme/tests/guest/run.sh`): identify fields,
//! ioctl and io_uring URING_CMD reads against O_DIRECT reads of the same LBAs, writes read back, and
//! clear errors for bad input. Prints `PASS:`/`FAIL:` lines and `GUEST RESULT: N passed, M failed`.

use std::time::Duration;

use ubdirect_nvme::passthru::CmdRead;
use ubdirect_nvme::{Controller, DirectMode, Engine, EngineConfig, Namespace, NvmeError};
use ubdirect_ub::{MemoryKind, PoolConfig, UbPool};

struct T {
    pass: u32,
    fail: u32,
}

impl T {
    fn check(&mut self, ok: bool, what: String) {
        if ok {
            self.pass += 1;
            println!("PASS: {what}");
        } else {
            self.fail += 1;
            println!("FAIL: {what}");
        }
    }
}

/// The disk image's content, as the harness writes it: block `lba` starts with "LBA%08u", then bytes
/// `(i + lba) & 0xff`.
fn expected(lba: u64, bs: usize) -> Vec<u8> {
    let mut b: Vec<u8> = (0..bs).map(|i| (i as u64 + lba) as u8).collect();
    let hdr = format!("LBA{lba:08}");
    b[..11].copy_from_slice(hdr.as_bytes());
    b[11..16].fill(0);
    b
}

fn main() {
    let mut t = T { pass: 0, fail: 0 };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    run(&mut t, &rt);
    println!("GUEST RESULT: {} passed, {} failed", t.pass, t.fail);
    std::process::exit(if t.fail == 0 { 0 } else { 1 });
}

fn run(t: &mut T, rt: &tokio::runtime::Runtime) {
    // The controller holding the pattern disk (the harness finds it by serial; names can vary).
    let c = std::env::var("UB_NVME").unwrap_or_else(|_| "0".into());
    let (ctrl_dev, blk_dev, chr_dev) = (
        format!("/dev/nvme{c}"),
        format!("/dev/nvme{c}n1"),
        format!("/dev/ng{c}n1"),
    );
    let ctrl = match Controller::open(&ctrl_dev).and_then(|c| c.identify().map(|id| (c, id))) {
        Ok((_c, id)) => {
            t.check(
                id.serial == "deadbeef" && id.model == "QEMU NVMe Ctrl" && id.vid == 0x1b36 && !id.firmware.is_empty() && id.namespaces >= 1,
                format!("identify controller: vid={:#06x} model={:?} serial={:?} fw={:?} mdts={} max_transfer={:?} nn={}", id.vid, id.model, id.serial, id.firmware, id.mdts, id.max_transfer(), id.namespaces),
            );
            true
        }
        Err(e) => {
            t.check(false, format!("identify controller: {e}"));
            false
        }
    };
    if !ctrl {
        return;
    }
    let blk = match Namespace::open(&blk_dev) {
        Ok(n) => n,
        Err(e) => return t.check(false, format!("open {blk_dev}: {e}")),
    };
    let chr = match Namespace::open(&chr_dev) {
        Ok(n) => n,
        Err(e) => return t.check(false, format!("open {chr_dev}: {e}")),
    };
    let bs = blk.id().lba_size as usize;
    let nsze = blk.id().nsze;
    t.check(
        blk.nsid() == 1
            && chr.nsid() == 1
            && nsze == (64 << 20) / bs as u64
            && blk.id() == chr.id(),
        format!(
            "identify namespace: nsid {} lba {} B, {} blocks (block and char device agree)",
            blk.nsid(),
            bs,
            nsze
        ),
    );

    let pool = |eng: Option<&Engine>, n: usize| {
        let b = UbPool::builder(PoolConfig::new("guest", 1 << 20, n, MemoryKind::Host));
        match eng {
            Some(e) => b.register_with(e.registrar()).build(),
            None => b.build(),
        }
        .expect("pool")
    };
    let engine = Engine::new(EngineConfig {
        direct: DirectMode::On,
        queue_depth: 32,
        ..EngineConfig::default()
    })
    .expect("engine");
    let file_pool = pool(Some(&engine), 4);
    let pt_pool = pool(None, 70);
    let file = engine.open("/dev/nvme0n1").expect("engine open nvme0n1");
    t.check(
        file.is_direct(),
        format!(
            "engine opens /dev/nvme0n1 with O_DIRECT: {}",
            file.io_path()
        ),
    );

    // Ranges: (slba, nlb), including the last blocks of the namespace.
    let mut x: u64 = 0x1234_5678;
    let mut ranges = vec![
        (0u64, 1u32),
        (5, 8),
        (nsze - 1, 1),
        (nsze - 64, 64),
        (1000, 128),
    ];
    while ranges.len() < 64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let nlb = 1 + (x % 64) as u32;
        ranges.push((x % (nsze - nlb as u64), nlb));
    }
    // O_DIRECT through the engine.
    let mut via_file = Vec::new();
    for &(slba, nlb) in &ranges {
        let lease = rt
            .block_on(file_pool.acquire(Duration::from_secs(5)))
            .expect("lease");
        let (r, lease) =
            rt.block_on(engine.read(&file, slba * bs as u64, nlb as usize * bs, lease, 0));
        match r {
            Ok(d) => via_file.push(lease.as_slice().expect("idle")[d.data].to_vec()),
            Err(e) => return t.check(false, format!("engine O_DIRECT read LBA {slba}+{nlb}: {e}")),
        }
    }
    let content_ok = ranges.iter().zip(&via_file).all(|(&(slba, nlb), b)| {
        (0..nlb as u64)
            .all(|k| b[k as usize * bs..(k as usize + 1) * bs] == expected(slba + k, bs)[..])
    });
    t.check(
        content_ok,
        format!(
            "O_DIRECT reads of {} ranges match the disk image",
            ranges.len()
        ),
    );

    // ioctl reads.
    let mut ok = true;
    for (i, &(slba, nlb)) in ranges.iter().enumerate() {
        let mut l = pt_pool.try_acquire().expect("lease");
        match chr.read(slba, nlb, &mut l, 0) {
            Ok(()) => ok &= l.as_slice().expect("idle")[..nlb as usize * bs] == via_file[i][..],
            Err(e) => return t.check(false, format!("ioctl read LBA {slba}+{nlb}: {e}")),
        }
    }
    t.check(
        ok,
        format!(
            "NVME_IOCTL_IO_CMD reads equal O_DIRECT reads ({} ranges, /dev/ng0n1)",
            ranges.len()
        ),
    );

    // URING_CMD reads, 16 in flight.
    let mut leases: Vec<_> = (0..ranges.len())
        .map(|_| pt_pool.try_acquire().expect("lease"))
        .collect();
    let r = {
        let mut q = chr.uring(16).expect("uring");
        let mut reads: Vec<CmdRead<'_>> = ranges
            .iter()
            .zip(leases.iter_mut())
            .map(|(&(slba, nlb), lease)| CmdRead {
                slba,
                nlb,
                lease,
                off: 0,
            })
            .collect();
        q.read_many(&mut reads)
    };
    let ok = r.is_ok()
        && ranges.iter().enumerate().all(|(i, &(_, nlb))| {
            leases[i].as_slice().expect("idle")[..nlb as usize * bs] == via_file[i][..]
        });
    t.check(
        ok,
        format!(
            "io_uring URING_CMD reads equal O_DIRECT reads ({} ranges, QD 16): {:?}",
            ranges.len(),
            r.err().map(|e| e.to_string())
        ),
    );
    drop(leases);

    // Write by ioctl, read back by URING_CMD and O_DIRECT.
    let mut w = pt_pool.try_acquire().expect("lease");
    for (k, c) in w.as_mut_slice().expect("idle")[..8 * bs]
        .chunks_mut(bs)
        .enumerate()
    {
        c.copy_from_slice(&expected(9_000_000 + k as u64, bs));
    }
    let wr = blk.write(4096, 8, &mut w, 0);
    let mut back = pt_pool.try_acquire().expect("lease");
    let rd = chr.uring(1).and_then(|mut q| {
        q.read_many(&mut [CmdRead {
            slba: 4096,
            nlb: 8,
            lease: &mut back,
            off: 0,
        }])
    });
    let lease = rt
        .block_on(file_pool.acquire(Duration::from_secs(5)))
        .expect("lease");
    let (r2, l2) = rt.block_on(engine.read(&file, 4096 * bs as u64, 8 * bs, lease, 0));
    let same = wr.is_ok()
        && rd.is_ok()
        && r2.is_ok()
        && back.as_slice().expect("idle")[..8 * bs] == w.as_slice().expect("idle")[..8 * bs]
        && l2.as_slice().expect("idle")[..8 * bs] == w.as_slice().expect("idle")[..8 * bs];
    t.check(
        same,
        format!(
            "ioctl write of 8 blocks reads back equal by URING_CMD and O_DIRECT ({:?} {:?} {:?})",
            wr.err().map(|e| e.to_string()),
            rd.err().map(|e| e.to_string()),
            r2.err().map(|e| e.to_string())
        ),
    );

    // Bad input: clear errors.
    let e = Namespace::open("/dev/null").err();
    t.check(
        matches!(e, Some(NvmeError::NotNvme { .. })),
        format!(
            "passthrough on /dev/null: {}",
            e.map_or("no error".into(), |e| e.to_string())
        ),
    );
    let mut l = pt_pool.try_acquire().expect("lease");
    let e = chr.read(nsze - 1, 2, &mut l, 0).err();
    t.check(
        matches!(e, Some(NvmeError::Range { .. })),
        format!(
            "read past the namespace end: {}",
            e.map_or("no error".into(), |e| e.to_string())
        ),
    );
}
