//! An SMC region in device (GPU) memory, served without synchronous copies: a copy stream of its own
//! ([`ubdirect_ub::Device::copy_stream`]: a non-blocking CUDA stream, never behind the loader's
//! copies), staging blocks registered with the device once (pinned), a fault's pages or a barrier's
//! dirty runs moved as one batch of copies with one completion marker, and that marker polled by the
//! connection's task (a spin, then yields to the runtime) — no `spawn_blocking` hop, no completion
//! thread, no `cuMemcpy` that waits for the whole device. The host device implements the same copy
//! stream with `memcpy`, which is how the tests run this path on machines without a GPU.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::tcp::OwnedReadHalf;
use ubdirect_ub::{CopyPart, CopyStream, Device, Lease, PoolConfig, UbPool};

use crate::proto;

/// How long a copy's completion is polled by spinning before the task yields between polls: a
/// 4 KiB fault's copy completes in a few µs, a 4 MiB barrier's in ~100 µs at PCIe speed.
const SPIN: Duration = Duration::from_micros(100);

/// Staging blocks per region: a fault's read and a barrier's receive proceed side by side.
const STAGING_BLOCKS: usize = 2;

/// The region's device block and its copy stream (the lock orders copies, never a socket wait).
struct Device_ {
    lease: Lease,
    stream: Box<dyn CopyStream>,
}

/// A region in device memory.
pub(crate) struct GpuRegion {
    // Field order: the region's block goes back before its pool, staging blocks before theirs.
    dev: tokio::sync::Mutex<Device_>,
    staging: UbPool,
    _pool: UbPool,
    size: usize,
}

impl std::fmt::Debug for GpuRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuRegion")
            .field("size", &self.size)
            .finish()
    }
}

/// Why a request on a device region failed: the connection's stream is still in step (the payload
/// was consumed), so it is answered with an error frame.
pub(crate) type RegionError = String;

impl GpuRegion {
    /// `size` bytes of `device`'s memory (its batch kind) named `name`, zeroed, with staging blocks
    /// of `staging` bytes (its staging kind: pinned for CUDA, registered once at creation).
    pub(crate) fn new(
        name: &str,
        device: Arc<dyn Device>,
        size: usize,
        staging: usize,
    ) -> Result<Self, RegionError> {
        let size = size.div_ceil(4096) * 4096;
        let staging = staging.div_ceil(4096).max(1) * 4096;
        let pool = UbPool::builder(PoolConfig::new(
            format!("smc-{name}"),
            size,
            1,
            device.batch_kind(),
        ))
        .device(device.clone())
        .build()
        .map_err(|e| e.to_string())?;
        let staging_pool = UbPool::builder(PoolConfig::new(
            format!("smc-{name}-staging"),
            staging,
            STAGING_BLOCKS,
            device.staging_kind(),
        ))
        .device(device.clone())
        .build()
        .map_err(|e| e.to_string())?;
        let stream = device.copy_stream().map_err(|e| e.to_string())?;
        let (Some(mut lease), Some(mut zeros)) = (pool.try_acquire(), staging_pool.try_acquire())
        else {
            return Err("region pools are empty".into());
        };
        // Device memory starts undefined: zero it, as host regions are.
        zeros.as_mut_slice().map_err(|e| e.to_string())?.fill(0);
        let mut at = 0;
        while at < size {
            let n = staging.min(size - at);
            let part = CopyPart {
                host: 0,
                device: at,
                len: n,
            };
            stream
                .to_device(&mut zeros, &mut lease, &[part])
                .and_then(|f| f.wait_blocking())
                .map_err(|e| e.to_string())?;
            at += n;
        }
        drop(zeros);
        Ok(Self {
            dev: tokio::sync::Mutex::new(Device_ { lease, stream }),
            staging: staging_pool,
            _pool: pool,
            size,
        })
    }

    async fn stage(&self, deadline: Duration) -> Result<Lease, RegionError> {
        self.staging
            .acquire(deadline)
            .await
            .map_err(|e| format!("no staging block for the region within {deadline:?}: {e}"))
    }

    /// Runs one batch (`to_device` or back) and polls it to completion.
    async fn batch(
        &self,
        staging: &mut Lease,
        parts: &[CopyPart],
        to_device: bool,
        deadline: Duration,
    ) -> Result<(), RegionError> {
        if parts.is_empty() {
            return Ok(());
        }
        let mut g = self.dev.lock().await;
        let Device_ { lease, stream } = &mut *g;
        let fence = if to_device {
            stream.to_device(staging, lease, parts)
        } else {
            stream.to_host(lease, staging, parts)
        }
        .map_err(|e| e.to_string())?;
        fence.wait(SPIN, deadline).await.map_err(|e| e.to_string())
    }

    /// Appends `len` bytes at `offset` of the region to `out` (a reply frame): one copy into a
    /// staging block per block's worth, then one CPU copy into the frame (as for a host region).
    pub(crate) async fn read_into(
        &self,
        offset: u64,
        len: usize,
        out: &mut Vec<u8>,
        deadline: Duration,
    ) -> Result<(), RegionError> {
        let mut st = self.stage(deadline).await?;
        let cap = st.capacity();
        let mut done = 0;
        while done < len {
            let n = (len - done).min(cap);
            let part = CopyPart {
                host: 0,
                device: offset as usize + done,
                len: n,
            };
            self.batch(&mut st, &[part], false, deadline).await?;
            let b = st.as_slice().map_err(|e| e.to_string())?;
            out.extend_from_slice(&b[..n]);
            done += n;
        }
        Ok(())
    }

    /// Writes `data`, the bytes of `ranges` packed one after the other, through the staging block:
    /// a block's worth at a time, each as one batch (adjacent ranges one copy).
    pub(crate) async fn write(
        &self,
        ranges: &[(u64, u32)],
        data: &[u8],
        deadline: Duration,
    ) -> Result<(), RegionError> {
        let mut st = self.stage(deadline).await?;
        let cap = st.capacity();
        let mut at = 0;
        while at < data.len() {
            let n = (data.len() - at).min(cap);
            st.as_mut_slice().map_err(|e| e.to_string())?[..n].copy_from_slice(&data[at..at + n]);
            let parts = parts_of(ranges, at, n);
            self.batch(&mut st, &parts, true, deadline).await?;
            at += n;
        }
        Ok(())
    }

    /// Receives `data_len` payload bytes (the packed ranges) from the socket straight into a
    /// staging block — the region's lock is not held while the socket is awaited — and copies each
    /// block's worth to the device as one batch. The outer error is the connection's (it must
    /// close); the inner one is the request's, after the whole payload was consumed.
    pub(crate) async fn receive(
        &self,
        rd: &mut OwnedReadHalf,
        ranges: &[(u64, u32)],
        data_len: usize,
        deadline: Duration,
    ) -> std::io::Result<Result<(), RegionError>> {
        let io = std::io::Error::other;
        let mut st = match self.stage(deadline).await {
            Ok(st) => st,
            Err(e) => {
                proto::discard_payload(rd, data_len as u32, deadline)
                    .await
                    .map_err(io)?;
                return Ok(Err(e));
            }
        };
        let cap = st.capacity();
        let mut at = 0;
        while at < data_len {
            let n = (data_len - at).min(cap);
            let buf = match st.as_mut_slice() {
                Ok(b) => &mut b[..n],
                Err(e) => {
                    proto::discard_payload(rd, (data_len - at) as u32, deadline)
                        .await
                        .map_err(io)?;
                    return Ok(Err(e.to_string()));
                }
            };
            proto::read_payload(rd, buf, deadline).await.map_err(io)?;
            let parts = parts_of(ranges, at, n);
            if let Err(e) = self.batch(&mut st, &parts, true, deadline).await {
                let rest = data_len - at - n;
                proto::discard_payload(rd, rest as u32, deadline)
                    .await
                    .map_err(io)?;
                return Ok(Err(e));
            }
            at += n;
        }
        Ok(Ok(()))
    }
}

/// The copies that put `data[window..window + len]` in place, where `data` is `ranges` packed one
/// after the other: each range's share of the window, adjacent ones (on the device and in the
/// window) merged into one part.
pub(crate) fn parts_of(ranges: &[(u64, u32)], window: usize, len: usize) -> Vec<CopyPart> {
    let end = window + len;
    let mut parts: Vec<CopyPart> = Vec::new();
    let mut d0 = 0usize;
    for &(off, l) in ranges {
        let d1 = d0 + l as usize;
        let (a, b) = (d0.max(window), d1.min(end));
        if a < b {
            let p = CopyPart {
                host: a - window,
                device: off as usize + (a - d0),
                len: b - a,
            };
            match parts.last_mut() {
                Some(q) if q.host + q.len == p.host && q.device + q.len == p.device => {
                    q.len += p.len
                }
                _ => parts.push(p),
            }
        }
        if d1 >= end {
            break;
        }
        d0 = d1;
    }
    parts
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;
    use ubdirect_ub::HostDevice;

    fn part(host: usize, device: usize, len: usize) -> CopyPart {
        CopyPart { host, device, len }
    }

    #[test]
    fn adjacent_ranges_are_one_copy_and_windows_split_ranges() {
        // Three dirty runs, the first two adjacent on the device: one copy for them.
        let r = [(0u64, 4096u32), (4096, 4096), (65536, 8192)];
        assert_eq!(
            parts_of(&r, 0, 16384),
            vec![part(0, 0, 8192), part(8192, 65536, 8192)]
        );
        // A window that cuts the third run: its share only, at the right device offset.
        assert_eq!(parts_of(&r, 8192, 4096), vec![part(0, 65536, 4096)]);
        assert_eq!(parts_of(&r, 12288, 4096), vec![part(0, 69632, 4096)]);
        // A window across the first two: still one copy.
        assert_eq!(parts_of(&r, 2048, 4096), vec![part(0, 2048, 4096)]);
        // Adjacent in the data but not on the device: two copies.
        let r = [(8192u64, 4096u32), (0, 4096)];
        assert_eq!(
            parts_of(&r, 0, 8192),
            vec![part(0, 8192, 4096), part(4096, 0, 4096)]
        );
        assert!(parts_of(&r, 0, 0).is_empty());
    }

    /// The device region's paths — zeroed at start, packed writes through a staging block smaller
    /// than the data, reads back across block boundaries — on the host device's copy stream.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_device_region_reads_back_what_was_written_through_small_staging_blocks() {
        let g = GpuRegion::new("t", Arc::new(HostDevice::new()), 64 << 10, 8192).unwrap();
        let t = Duration::from_secs(5);
        let mut out = Vec::new();
        g.read_into(0, 64 << 10, &mut out, t).await.unwrap();
        assert!(out.iter().all(|&b| b == 0), "not zeroed");
        // Runs of 12 KiB and 20 KiB (through 8 KiB staging blocks), the second not adjacent.
        let ranges = [(4096u64, 12288u32), (32768, 20480)];
        let data: Vec<u8> = (0..32768u32).map(|i| (i % 251) as u8 + 1).collect();
        g.write(&ranges, &data, t).await.unwrap();
        let mut out = Vec::new();
        g.read_into(0, 64 << 10, &mut out, t).await.unwrap();
        let mut want = vec![0u8; 64 << 10];
        want[4096..16384].copy_from_slice(&data[..12288]);
        want[32768..53248].copy_from_slice(&data[12288..]);
        assert!(out == want, "region differs from what was written");
        // Both staging blocks are back.
        assert_eq!(g.staging.stats().free, STAGING_BLOCKS);
    }
}
