//! The fixed-buffer tables of the read and passthrough rings, and the registrar through which
//! pools register their blocks with every ring.

use super::*;

pub(super) struct BufTable {
    /// Free fixed-buffer index ranges (start, len), sorted.
    pub(super) free: Vec<(u32, u32)>,
    pub(super) by_pool: HashMap<PoolId, (u32, u32)>,
}

impl BufTable {
    pub(super) fn alloc(&mut self, n: u32) -> Option<u32> {
        let i = self.free.iter().position(|&(_, len)| len >= n)?;
        let (start, len) = self.free[i];
        if len == n {
            self.free.remove(i);
        } else {
            self.free[i] = (start + n, len - n);
        }
        Some(start)
    }

    pub(super) fn release(&mut self, start: u32, n: u32) {
        self.free.push((start, n));
        self.free.sort_unstable();
        let mut merged: Vec<(u32, u32)> = Vec::with_capacity(self.free.len());
        for &(s, l) in &self.free {
            match merged.last_mut() {
                Some(last) if last.0 + last.1 == s => last.1 += l,
                _ => merged.push((s, l)),
            }
        }
        self.free = merged;
    }
}

/// Blocks (or chunks) as (address, length).
pub(super) type Iovecs = Arc<Vec<(usize, usize)>>;

/// Fixed buffers registered on the read rings: first table index → the blocks.
pub(super) type BufferLog = BTreeMap<u32, Iovecs>;

/// Bytes of one fixed buffer on the passthrough rings: their table holds each block as chunks of
/// this size. Linux before "io_uring/rsrc: ensure segments counts are correct on offset" (2025;
/// 6.1 in the test guest) counts every page from a command's start to the end of its fixed buffer
/// as a segment and refuses (EINVAL) more than the queue's `max_segments` (127 on nvme-pci): 64
/// pages stay under it wherever a command starts. Commands are split at chunk boundaries.
pub(crate) const PT_CHUNK: usize = 64 * ubdirect_ub::PAGE_SIZE;

/// A pool's blocks in the passthrough rings' table.
#[derive(Debug, Clone, Copy)]
pub(super) struct PtEntry {
    pub(super) first: u32,
    pub(super) per_block: u32,
    pub(super) count: u32,
}

/// The passthrough rings' fixed-buffer table: its own index space (chunks, not blocks).
pub(super) struct PtState {
    pub(super) table: BufTable,
    /// Keyed by the pool's first index in the read rings' table.
    pub(super) by_base: HashMap<u32, PtEntry>,
}

impl PtState {
    /// Allocates chunk slots for a pool's blocks; `None` when the table is full (its commands then
    /// go by address, recorded as a fallback).
    pub(super) fn alloc(&mut self, iovecs: &[(usize, usize)]) -> Option<(PtEntry, Iovecs)> {
        let per = iovecs
            .iter()
            .map(|&(_, l)| l.div_ceil(PT_CHUNK))
            .max()
            .unwrap_or(1)
            .max(1);
        let mut v = Vec::with_capacity(iovecs.len() * per);
        for &(p, l) in iovecs {
            for k in 0..per {
                let o = k * PT_CHUNK;
                v.push(if p != 0 && o < l {
                    (p + o, (l - o).min(PT_CHUNK))
                } else {
                    (0, 0)
                });
            }
        }
        let count = u32::try_from(v.len()).ok()?;
        let Some(first) = self.table.alloc(count) else {
            fallback::record(
                "nvme_fixed_table_full",
                format!(
                    "no {count} free fixed-buffer slots on the passthrough rings (raise \
                     max_fixed_buffers); NVMe commands into this pool go by address"
                ),
            );
            return None;
        };
        let e = PtEntry {
            first,
            per_block: per as u32,
            count,
        };
        Some((e, Arc::new(v)))
    }
}

/// ENOMEM from buffer registration, with what to do about it; the engine's error is the source.
#[derive(Debug, thiserror::Error)]
#[error(
    "registering buffers pins memory against RLIMIT_MEMLOCK (ENOMEM): run as root, raise `ulimit -l`, or make the pools smaller (`pool.staging_blocks` × `pool.staging_block_size`)"
)]
pub(super) struct MemlockHint(#[source] IoError);

pub(super) struct EngineRegistrar {
    pub(super) shared: Arc<Shared>,
}

impl Registrar for EngineRegistrar {
    fn consumer(&self) -> String {
        "io_uring fixed buffers".into()
    }

    fn optional(&self) -> bool {
        // Reads into a pool not registered here go by address (`Engine::plan`).
        true
    }

    fn register(
        &self,
        pool: &PoolDescriptor<'_>,
    ) -> Result<Box<dyn Registration>, Box<dyn std::error::Error + Send + Sync>> {
        if !pool.kind().is_host_visible() {
            return Err(
                format!("{} memory cannot be an io_uring fixed buffer", pool.kind()).into(),
            );
        }
        let n = u32::try_from(pool.blocks().len()).map_err(|_| "too many blocks")?;
        let base = self
            .shared
            .bufs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .alloc(n)
            .ok_or_else(|| {
                format!(
                    "no {n} free fixed-buffer slots left of {} (raise max_fixed_buffers)",
                    self.shared.cfg.max_fixed_buffers
                )
            })?;
        let iovecs: Vec<(usize, usize)> = pool
            .blocks()
            .iter()
            .map(|b| (b.host_ptr().map_or(0, |p| p as usize), b.len()))
            .collect();
        let iovecs = Arc::new(iovecs);
        let r = self.shared.register_buffers(base, iovecs);
        if let Err(e) = r {
            self.shared.unregister_buffers(base, n);
            self.shared
                .bufs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .release(base, n);
            if matches!(&e, IoError::Setup { source, .. } if source.raw_os_error() == Some(libc::ENOMEM))
            {
                return Err(Box::new(MemlockHint(e)));
            }
            return Err(Box::new(e));
        }
        self.shared
            .bufs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .by_pool
            .insert(pool.id(), (base, n));
        Ok(Box::new(BufferRegistration {
            shared: self.shared.clone(),
            pool: pool.id(),
            base,
            count: n,
        }))
    }
}

pub(super) struct BufferRegistration {
    pub(super) shared: Arc<Shared>,
    pub(super) pool: PoolId,
    pub(super) base: u32,
    pub(super) count: u32,
}

impl fmt::Debug for BufferRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferRegistration")
            .field("pool", &self.pool)
            .field("base", &self.base)
            .field("count", &self.count)
            .finish()
    }
}

impl Registration for BufferRegistration {
    fn consumer(&self) -> String {
        format!(
            "io_uring fixed buffers {}..{}",
            self.base,
            self.base + self.count
        )
    }
}

impl Drop for BufferRegistration {
    fn drop(&mut self) {
        self.shared.unregister_buffers(self.base, self.count);
        let (base, count) = (self.base, self.count);
        let mut b = self.shared.bufs.lock().unwrap_or_else(|p| p.into_inner());
        b.by_pool.remove(&self.pool);
        b.release(base, count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(n: u32) -> PtState {
        PtState {
            table: BufTable {
                free: vec![(0, n)],
                by_pool: HashMap::new(),
            },
            by_base: HashMap::new(),
        }
    }

    #[test]
    fn passthrough_table_holds_blocks_as_chunks() {
        let mut pt = table(16);
        // Two 1 MiB blocks: four 256 KiB chunks each, in block order.
        let (e, v) = pt
            .alloc(&[(0x10_0000, 1 << 20), (0x40_0000, 1 << 20)])
            .expect("room");
        assert_eq!((e.first, e.per_block, e.count), (0, 4, 8));
        assert_eq!(v[0], (0x10_0000, PT_CHUNK));
        assert_eq!(v[3], (0x10_0000 + 3 * PT_CHUNK, PT_CHUNK));
        assert_eq!(v[4], (0x40_0000, PT_CHUNK));
        // A block smaller than a chunk is one entry; a ragged one ends short.
        let (e, v) = pt
            .alloc(&[(0x80_0000, 4096), (0x90_0000, 300 << 10)])
            .expect("room");
        assert_eq!((e.first, e.per_block, e.count), (8, 2, 4));
        assert_eq!(
            *v,
            vec![
                (0x80_0000, 4096),
                (0, 0),
                (0x90_0000, PT_CHUNK),
                (0x90_0000 + PT_CHUNK, (300 << 10) - PT_CHUNK)
            ]
        );
        // Full: none (the pool's commands go by address), never a panic.
        assert!(pt.alloc(&[(0x100_0000, 8 << 20)]).is_none());
        pt.table.release(0, 8);
        assert!(pt.alloc(&[(0x100_0000, 2 << 20)]).is_some());
    }
}
