//! File extents → NVMe LBAs: FIEMAP on a shard, the partition offset from sysfs, and the namespace's
//! generic char device, so the loader can read a file's bytes by NVMe passthrough. Extents that
//! cannot be read raw (unwritten, inline, encoded, encrypted, delayed allocation, or a file not on
//! an NVMe namespace) are marked and read through the file path instead.

use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct fiemap_extent {
    fe_logical: u64,
    fe_physical: u64,
    fe_length: u64,
    fe_reserved64: [u64; 2],
    fe_flags: u32,
    fe_reserved: [u32; 3],
}

#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct fiemap {
    fm_start: u64,
    fm_length: u64,
    fm_flags: u32,
    fm_mapped_extents: u32,
    fm_extent_count: u32,
    fm_reserved: u32,
}

const _: () =
    assert!(std::mem::size_of::<fiemap>() == 32 && std::mem::size_of::<fiemap_extent>() == 56);

const BATCH: usize = 128;

#[repr(C)]
struct FiemapBuf {
    hdr: fiemap,
    ext: [fiemap_extent; BATCH],
}

nix::ioctl_readwrite!(fs_ioc_fiemap, b'f', 11, fiemap);

const FIEMAP_FLAG_SYNC: u32 = 0x1;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// Flags that make an extent's bytes unreadable at its physical address.
const NOT_RAW: [(u32, &str); 8] = [
    (0x2, "unknown location"),
    (0x4, "delayed allocation"),
    (0x8, "encoded"),
    (0x80, "encrypted"),
    (0x100, "not block aligned"),
    (0x200, "inline in metadata"),
    (0x400, "packed tail"),
    (0x800, "unwritten (preallocated)"),
];

/// One extent of a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    /// Offset in the file.
    pub logical: u64,
    /// Byte offset on the namespace (partition start included).
    pub physical: u64,
    /// Length in bytes.
    pub len: u64,
    /// Why the extent cannot be read raw, if it cannot.
    pub not_raw: Option<&'static str>,
}

/// A file's layout on an NVMe namespace.
#[derive(Debug, Clone)]
pub struct FileMap {
    /// The namespace's generic char device (`/dev/ngXnY`).
    pub namespace: PathBuf,
    /// The partition's start on the namespace, in bytes (0 when the file system is on the namespace).
    pub partition_offset: u64,
    /// Extents, in file order.
    pub extents: Vec<Extent>,
}

impl FileMap {
    /// Bytes of the file covered by raw-readable extents.
    pub fn raw_bytes(&self) -> u64 {
        self.extents
            .iter()
            .filter(|e| e.not_raw.is_none())
            .map(|e| e.len)
            .sum()
    }
}

/// Why a file cannot be read by passthrough at all.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    /// The file cannot be examined.
    #[error("{path}: {source}")]
    Stat {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file system is not on a block device.
    #[error(
        "{path}: on device {major}:{minor}, which is not a block device (tmpfs, overlay, network file system)"
    )]
    NotBlockDevice {
        /// The file.
        path: PathBuf,
        /// Device major number.
        major: u32,
        /// Device minor number.
        minor: u32,
    },
    /// The block device is not an NVMe namespace (or a partition of one).
    #[error("{path} is on {device}, not an NVMe namespace")]
    NotNvme {
        /// The file.
        path: PathBuf,
        /// The block device's name.
        device: String,
    },
    /// A partition whose start sysfs does not show.
    #[error("{path}: partition {device} without a start in sysfs")]
    Partition {
        /// The file.
        path: PathBuf,
        /// The partition's name.
        device: String,
    },
    /// FIEMAP failed (the file system does not map extents).
    #[error("{path}: FIEMAP: {source}")]
    Fiemap {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

fn read(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Which NVMe namespace (char device) and partition offset hold a file. `Err` says why there is none.
pub fn namespace_of(path: &Path) -> Result<(PathBuf, u64), MapError> {
    let meta = std::fs::metadata(path).map_err(|source| MapError::Stat {
        path: path.to_path_buf(),
        source,
    })?;
    let dev = meta.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let sys = std::fs::canonicalize(format!("/sys/dev/block/{major}:{minor}")).map_err(|_| {
        MapError::NotBlockDevice {
            path: path.to_path_buf(),
            major,
            minor,
        }
    })?;
    let name = sys
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let (ns_name, offset) = if sys.join("partition").exists() {
        let start: u64 = read(sys.join("start"))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| MapError::Partition {
                path: path.to_path_buf(),
                device: name.clone(),
            })?;
        let parent = sys
            .parent()
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        (parent, start * 512)
    } else {
        (name.clone(), 0)
    };
    // nvme<ctrl>n<ns> → ng<ctrl>n<ns>
    let rest = ns_name
        .strip_prefix("nvme")
        .filter(|r| r.contains('n') && r.chars().all(|c| c.is_ascii_digit() || c == 'n'));
    match rest {
        Some(r) => Ok((PathBuf::from(format!("/dev/ng{r}")), offset)),
        None => Err(MapError::NotNvme {
            path: path.to_path_buf(),
            device: name,
        }),
    }
}

/// FIEMAP of a whole file (synced first, so delayed allocations are placed).
pub fn extents(file: &std::fs::File, partition_offset: u64) -> std::io::Result<Vec<Extent>> {
    let mut out = Vec::new();
    let mut start = 0u64;
    loop {
        let mut buf = FiemapBuf {
            hdr: fiemap {
                fm_start: start,
                fm_length: u64::MAX - start,
                fm_flags: FIEMAP_FLAG_SYNC,
                fm_extent_count: BATCH as u32,
                ..Default::default()
            },
            ext: [fiemap_extent::default(); BATCH],
        };
        // SAFETY: `buf` is a fiemap header followed by room for `fm_extent_count` extents, as the
        // ioctl expects; it lives for the call.
        unsafe { fs_ioc_fiemap(file.as_raw_fd(), (&mut buf as *mut FiemapBuf).cast()) }
            .map_err(std::io::Error::from)?;
        let n = buf.hdr.fm_mapped_extents as usize;
        if n == 0 {
            return Ok(out);
        }
        let mut last = false;
        for e in &buf.ext[..n.min(BATCH)] {
            let not_raw = NOT_RAW
                .iter()
                .find(|(f, _)| e.fe_flags & f != 0)
                .map(|(_, why)| *why);
            out.push(Extent {
                logical: e.fe_logical,
                physical: e.fe_physical + partition_offset,
                len: e.fe_length,
                not_raw,
            });
            start = e.fe_logical + e.fe_length;
            last |= e.fe_flags & FIEMAP_EXTENT_LAST != 0;
        }
        if last {
            return Ok(out);
        }
    }
}

impl FileMap {
    /// Maps a file for passthrough reads. `Err` is the reason it cannot be read raw at all.
    pub fn of(path: &Path) -> Result<Self, MapError> {
        let (namespace, partition_offset) = namespace_of(path)?;
        let f = std::fs::File::open(path).map_err(|source| MapError::Stat {
            path: path.to_path_buf(),
            source,
        })?;
        let extents = extents(&f, partition_offset).map_err(|source| MapError::Fiemap {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(FileMap {
            namespace,
            partition_offset,
            extents,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fiemap_covers_a_written_file_and_tmpfs_is_not_nvme() {
        let dir = std::env::temp_dir().join(format!("ubdirect-fiemap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_default();
        let p = dir.join("f.bin");
        std::fs::write(&p, vec![7u8; 3 << 20]).unwrap_or_default();
        let f = std::fs::File::open(&p).expect("open");
        let ex = extents(&f, 0).expect("fiemap on the work disk");
        let covered: u64 = ex.iter().map(|e| e.len).sum();
        assert!(covered >= 3 << 20, "{ex:?}");
        assert!(ex.windows(2).all(|w| w[0].logical < w[1].logical));
        // Not on NVMe here (virtio disk or tmpfs): a reason, not a panic.
        assert!(FileMap::of(&p).is_err());
        let _ = std::fs::remove_dir_all(dir);
        if Path::new("/dev/shm").exists() {
            let s = Path::new("/dev/shm").join(format!("ubdirect-fiemap-{}", std::process::id()));
            std::fs::write(&s, b"x").unwrap_or_default();
            let e = namespace_of(&s).unwrap_err();
            assert!(
                matches!(
                    e,
                    MapError::NotBlockDevice { .. } | MapError::NotNvme { .. }
                ),
                "{e}"
            );
            assert!(e.to_string().contains(&s.display().to_string()), "{e}");
            let _ = std::fs::remove_file(s);
        }
    }
}
