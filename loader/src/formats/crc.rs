//! Per-sample CRC-32 sidecars (`<shard>.crc32`), written by `ubdirect index` and checked on delivery.
//!
//! Layout: `b"UBCRC32\0"`, u64 LE sample count, then one u32 LE IEEE CRC-32 per sample of the shard, in
//! file order.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::index::DatasetIndex;
use super::{FormatError, corrupt, io_err};

pub(crate) const MAGIC: &[u8; 8] = b"UBCRC32\0";

/// The sidecar path of a shard.
pub fn sidecar_path(shard: &Path) -> PathBuf {
    let mut s = shard.as_os_str().to_owned();
    s.push(".crc32");
    PathBuf::from(s)
}

/// Computes every sample's CRC with plain reads and writes one sidecar per shard. Returns samples done.
pub fn write_sidecars(index: &DatasetIndex) -> Result<u64, FormatError> {
    let mut done = 0;
    for (si, shard) in index.shards.iter().enumerate() {
        let mut f = std::fs::File::open(&shard.path).map_err(io_err(&shard.path))?;
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        let samples: Vec<_> = index
            .samples
            .iter()
            .filter(|s| s.shard as usize == si)
            .collect();
        out.extend_from_slice(&(samples.len() as u64).to_le_bytes());
        let mut buf = Vec::new();
        for s in samples {
            buf.resize(s.len as usize, 0);
            f.seek(SeekFrom::Start(s.offset))
                .map_err(io_err(&shard.path))?;
            f.read_exact(&mut buf).map_err(io_err(&shard.path))?;
            out.extend_from_slice(&crc32fast::hash(&buf).to_le_bytes());
            done += 1;
        }
        let p = sidecar_path(&shard.path);
        ubdirect_ub::write_new(&p, &out).map_err(io_err(&p))?;
    }
    Ok(done)
}

/// Loads the sidecars of every shard: CRC per sample id.
pub fn load_sidecars(index: &DatasetIndex) -> Result<Vec<u32>, FormatError> {
    let mut crcs = Vec::with_capacity(index.samples.len());
    for (si, shard) in index.shards.iter().enumerate() {
        let p = sidecar_path(&shard.path);
        let want = index
            .samples
            .iter()
            .filter(|s| s.shard as usize == si)
            .count();
        // Its size is known before reading: 16 bytes of header and 4 per sample. A FIFO, a device
        // or a file of another size is refused before anything is read or allocated.
        let expect = 16 + 4 * want as u64;
        let (f, size) = super::open_regular(&p).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                FormatError::NoSidecar {
                    sidecar: p.clone(),
                    shard: shard.path.clone(),
                }
            } else {
                io_err(&p)(e)
            }
        })?;
        if size != expect {
            return Err(corrupt(
                &p,
                format!(
                    "{size} bytes, expected {expect} for the shard's {want} samples: stale sidecar, rerun `ubdirect index`"
                ),
            ));
        }
        let mut b = Vec::with_capacity(expect as usize);
        f.take(expect).read_to_end(&mut b).map_err(io_err(&p))?;
        crcs.extend(parse_sidecar(&p, &b, want)?);
    }
    Ok(crcs)
}

/// Parses a sidecar's bytes (`path` names it in errors) holding the CRCs of a shard of `want`
/// samples.
pub fn parse_sidecar(path: &Path, b: &[u8], want: usize) -> Result<Vec<u32>, FormatError> {
    if b.len() < 16 || &b[..8] != MAGIC {
        return Err(corrupt(
            path,
            "bad magic at offset 0: not a ubdirect CRC sidecar (run `ubdirect index`)",
        ));
    }
    let n = u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8]));
    if n != want as u64 || (b.len() as u64 - 16) / 4 != n || !b.len().is_multiple_of(4) {
        return Err(corrupt(
            path,
            format!(
                "holds {n} CRCs, shard has {want} samples: stale sidecar, rerun `ubdirect index`"
            ),
        ));
    }
    Ok(b[16..]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}
