//! Files: opened without waiting (a FIFO cannot block), probed for direct I/O, registered with
//! every ring; the handle callers read through.

use super::*;

impl Engine {
    /// Opens `path` for reading, with O_DIRECT where the file system supports it, and registers it
    /// with every ring.
    pub fn open(&self, path: impl AsRef<Path>) -> Result<FileHandle, IoError> {
        let path = path.as_ref().to_path_buf();
        let open_err = |source| IoError::Open {
            path: path.clone(),
            source,
        };
        let plain = || open_read(&path, 0).map(OwnedFd::from).map_err(open_err);
        let want_direct = self.shared.cfg.direct != DirectMode::Off;
        let (fd, direct) = if !want_direct {
            self.shared.buffered_files.fetch_add(1, Ordering::Relaxed);
            (plain()?, None)
        } else {
            match self.probe_direct(&path)? {
                Ok((fd, align)) => {
                    self.shared.direct_files.fetch_add(1, Ordering::Relaxed);
                    (fd, Some(align))
                }
                Err(reason) => {
                    if self.shared.cfg.direct == DirectMode::On {
                        return Err(IoError::DirectUnsupported { path, reason });
                    }
                    fallback::record(
                        "o_direct_unsupported",
                        format!(
                            "{}: {reason}; reading through the page cache",
                            path.display()
                        ),
                    );
                    self.shared.fallback_files.fetch_add(1, Ordering::Relaxed);
                    (plain()?, None)
                }
            }
        };
        self.finish_open(path, fd, direct)
    }

    /// Opens `path` a second way for buffered reads, whatever `direct` says: the page-cache half of
    /// `direct = "auto"` (resident ranges are read through it, the rest with O_DIRECT).
    pub fn open_buffered(&self, path: impl AsRef<Path>) -> Result<FileHandle, IoError> {
        let path = path.as_ref().to_path_buf();
        let fd = open_read(&path, 0)
            .map(OwnedFd::from)
            .map_err(|source| IoError::Open {
                path: path.clone(),
                source,
            })?;
        self.finish_open(path, fd, None)
    }

    pub(super) fn finish_open(
        &self,
        path: PathBuf,
        fd: OwnedFd,
        direct: Option<DirectAlign>,
    ) -> Result<FileHandle, IoError> {
        let open_err = |source| IoError::Open {
            path: path.clone(),
            source,
        };
        let mut f = std::fs::File::from(fd.try_clone().map_err(open_err)?);
        let meta = f.metadata().map_err(open_err)?;
        if meta.is_dir() {
            return Err(open_err(std::io::Error::new(
                std::io::ErrorKind::IsADirectory,
                "is a directory",
            )));
        }
        // A block device's metadata says 0 bytes; its size is where SEEK_END lands.
        let size = if std::os::unix::fs::FileTypeExt::is_block_device(&meta.file_type()) {
            std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0)).map_err(open_err)?
        } else {
            meta.len()
        };
        self.register_fd(path, fd, direct, Some(size))
    }

    /// Registers an already open descriptor (a pipe, a socket, a device) for buffered reads.
    /// Its size is unknown, so end-of-file is only detected by the reads themselves.
    pub fn open_fd(&self, label: impl Into<PathBuf>, fd: OwnedFd) -> Result<FileHandle, IoError> {
        self.register_fd(label.into(), fd, None, None)
    }

    /// Tries O_DIRECT. Outer error: the file cannot be opened at all. Inner error: why direct I/O
    /// is not available (a fallback reason).
    #[allow(clippy::type_complexity)]
    pub(super) fn probe_direct(
        &self,
        path: &Path,
    ) -> Result<Result<(OwnedFd, DirectAlign), String>, IoError> {
        let open_err = |source| IoError::Open {
            path: path.to_path_buf(),
            source,
        };
        let dio = sys::dio_align(path).map_err(open_err)?;
        let align = match dio {
            DioAlign::Unsupported => {
                return Ok(Err(
                    "the file system reports no direct I/O (statx STATX_DIOALIGN = 0)".into(),
                ));
            }
            DioAlign::Supported { mem, offset } => DirectAlign { mem, offset },
            // Kernels before 6.1 do not say; 4096 satisfies every block device in practice.
            DioAlign::Unknown => DirectAlign {
                mem: 4096,
                offset: 4096,
            },
        };
        if align.mem as usize > ubdirect_ub::PAGE_SIZE
            || !align.offset.is_power_of_two()
            || !align.mem.is_power_of_two()
        {
            return Ok(Err(format!("unusual direct-I/O alignment {align:?}")));
        }
        match open_read(path, libc::O_DIRECT) {
            Ok(f) => {
                let fd = OwnedFd::from(f);
                if dio == DioAlign::Unknown
                    && sys::fs_magic(&fd).map_err(open_err)? == sys::TMPFS_MAGIC
                {
                    return Ok(Err("tmpfs accepts O_DIRECT but caches anyway".into()));
                }
                Ok(Ok((fd, align)))
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                Ok(Err("open(O_DIRECT) refused with EINVAL".into()))
            }
            Err(e) => Err(open_err(e)),
        }
    }

    pub(super) fn register_fd(
        &self,
        path: PathBuf,
        fd: OwnedFd,
        direct: Option<DirectAlign>,
        size: Option<u64>,
    ) -> Result<FileHandle, IoError> {
        let slot = self
            .shared
            .files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .ok_or_else(|| IoError::Setup {
                what: format!("register {}", path.display()),
                source: std::io::Error::other(format!(
                    "all {} registered-file slots of the io_uring engine are in use (EngineConfig::max_files; `ubdirect serve` bounds its clients' share with serve.max_open_files_per_peer and serve.max_open_files_per_token)",
                    self.shared.cfg.max_files
                )),
            })?;
        let raw = fd.as_raw_fd();
        if let Err(e) =
            self.shared
                .broadcast_sync(&format!("register file {}", path.display()), |reply| {
                    Cmd::RegisterFile {
                        slot,
                        fd: raw,
                        reply,
                    }
                })
        {
            self.shared.broadcast(|| Cmd::UnregisterFile { slot });
            self.shared
                .files
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(slot);
            return Err(e);
        }
        Ok(FileHandle {
            inner: Arc::new(FileInner {
                shared: self.shared.clone(),
                path,
                _fd: fd,
                slot,
                direct,
                size,
            }),
        })
    }
}

/// Opens `path` for reading without waiting on it: with `O_NONBLOCK`, so that a FIFO swapped in
/// for a data file cannot block the open (it would wait for a writer), then checked on the
/// descriptor (`fstat`): only a regular file or a block device is read. `O_NONBLOCK` is cleared
/// again before the descriptor is used (io_uring answers `EAGAIN` instead of waiting on a
/// non-blocking file).
pub(super) fn open_read(path: &Path, flags: i32) -> std::io::Result<std::fs::File> {
    use nix::fcntl::{FcntlArg, OFlag, fcntl};
    use std::os::unix::fs::FileTypeExt;
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(flags | libc::O_NONBLOCK)
        .open(path)?;
    let t = f.metadata()?.file_type();
    if !(t.is_file() || t.is_block_device()) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file or block device",
        ));
    }
    let fl = OFlag::from_bits_truncate(fcntl(&f, FcntlArg::F_GETFL)?);
    fcntl(&f, FcntlArg::F_SETFL(fl - OFlag::O_NONBLOCK))?;
    Ok(f)
}

/// Direct-I/O alignment of an O_DIRECT file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DirectAlign {
    pub(crate) mem: u32,
    pub(crate) offset: u32,
}

pub(crate) struct FileInner {
    pub(super) shared: Arc<Shared>,
    pub(crate) path: PathBuf,
    pub(super) _fd: OwnedFd,
    pub(crate) slot: u32,
    pub(crate) direct: Option<DirectAlign>,
    pub(super) size: Option<u64>,
}

impl Drop for FileInner {
    fn drop(&mut self) {
        let slot = self.slot;
        // Queued behind any read on this file (reads hold the file alive, so none is in flight).
        self.shared.broadcast(|| Cmd::UnregisterFile { slot });
        self.shared
            .files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(slot);
    }
}

impl FileInner {
    pub(crate) fn fd_owned(&self) -> &OwnedFd {
        &self._fd
    }
}

impl FileHandle {
    /// The open descriptor (for `cachestat`, `fstat`).
    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.inner._fd
    }
}

/// An open, registered file. Cheap to clone; unregistered when the last clone and read are gone.
#[derive(Clone)]
pub struct FileHandle {
    pub(super) inner: Arc<FileInner>,
}

impl fmt::Debug for FileHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileHandle")
            .field("path", &self.inner.path)
            .field("direct", &self.inner.direct)
            .field("size", &self.inner.size)
            .finish()
    }
}

impl FileHandle {
    /// The file's identity now (size, device, inode, mtime, ctime): one `fstat` of the open
    /// descriptor, to tell whether it changed since it was indexed.
    pub fn ident(&self) -> std::io::Result<ubdirect_ub::FileIdent> {
        use std::os::fd::AsFd;
        ubdirect_ub::FileIdent::of_fd(self.inner._fd.as_fd())
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Size at open time (`None` for descriptors of unknown size).
    pub fn size(&self) -> Option<u64> {
        self.inner.size
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.inner.direct.is_some()
    }

    /// Alignment (file offset) that reads are widened to; 1 for buffered files.
    pub fn offset_align(&self) -> u32 {
        self.inner.direct.map_or(1, |a| a.offset)
    }

    /// Alignment of the destination memory that reads need; 1 for buffered files.
    pub fn mem_align(&self) -> u32 {
        self.inner.direct.map_or(1, |a| a.mem)
    }

    /// The I/O path reads of this file take, in words.
    pub fn io_path(&self) -> &'static str {
        if self.is_direct() {
            "io_uring READ_FIXED, registered file, O_DIRECT"
        } else {
            "io_uring READ_FIXED, registered file, buffered (page cache)"
        }
    }
}
