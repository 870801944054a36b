//! Probe files that no planted name can redirect (`ubdirect doctor`, the cuFile probe).
//!
//! A probe written to a fixed name in a shared directory (`/tmp`, a dataset directory others can
//! write) is the classic symlink attack: whoever plants a symlink at that name makes a root process
//! truncate and overwrite the link's target. A [`ProbeFile`] is never reached through an existing
//! name: it is an unnamed `O_TMPFILE` in the directory, reopened through `/proc/self/fd/N` (the
//! file itself, not a name in the directory), or, where the file system has no `O_TMPFILE`, a new
//! file created with `O_CREAT | O_EXCL | O_NOFOLLOW` (which fails on any existing name, symlinks
//! included) and unlinked when dropped.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// A file of known contents in a directory, made for probing and gone when dropped.
#[derive(Debug)]
pub struct ProbeFile {
    file: File,
    path: PathBuf,
    named: Option<PathBuf>,
}

impl ProbeFile {
    /// Creates a probe file of `len` zero bytes in `dir`. `name` is used only where `O_TMPFILE` is
    /// not supported, and only if nothing (no file, no symlink) has it yet: an existing name is an
    /// error (`AlreadyExists`), never opened.
    pub fn create(dir: &Path, name: &str, len: usize) -> io::Result<ProbeFile> {
        let mut p = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC)
            .mode(0o600)
            .open(dir)
        {
            Ok(file) => {
                let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
                ProbeFile {
                    file,
                    path,
                    named: None,
                }
            }
            // EOPNOTSUPP / EISDIR (no O_TMPFILE in this file system or kernel): a new name.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EISDIR)) => {
                Self::create_named(dir, name)?
            }
            Err(e) => return Err(e),
        };
        p.file.write_all(&vec![0u8; len])?;
        p.file.sync_all()?;
        Ok(p)
    }

    /// A new file at `dir/name`, created with `O_CREAT | O_EXCL | O_NOFOLLOW`: any existing name
    /// (a symlink included) is `AlreadyExists`, never opened.
    fn create_named(dir: &Path, name: &str) -> io::Result<ProbeFile> {
        let path = dir.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true) // O_CREAT | O_EXCL
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .mode(0o600)
            .open(&path)?;
        Ok(ProbeFile {
            file,
            path: path.clone(),
            named: Some(path),
        })
    }

    /// A path that opens this file (and no other): `/proc/self/fd/N` for an unnamed file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Whether the file is unnamed (`O_TMPFILE`).
    pub fn is_unnamed(&self) -> bool {
        self.named.is_none()
    }
}

impl Drop for ProbeFile {
    fn drop(&mut self) {
        if let Some(p) = &self.named {
            // Ours: created with O_EXCL. Unlinking a name never follows a symlink.
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn unnamed_probe_leaves_no_name_and_reopens() {
        let d = tempdir();
        let p = ProbeFile::create(&d, ".probe", 8192).unwrap();
        let len = std::fs::metadata(p.path()).unwrap().len();
        assert_eq!(len, 8192);
        if p.is_unnamed() {
            assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
        }
        drop(p);
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
    }

    #[test]
    fn named_probe_refuses_a_planted_symlink_and_removes_only_its_own_file() {
        let d = tempdir();
        let target = d.join("target");
        std::fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, d.join(".probe")).unwrap();
        let e = ProbeFile::create_named(&d, ".probe").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        assert!(d.join(".probe").symlink_metadata().unwrap().is_symlink());
        let p = ProbeFile::create_named(&d, ".probe2").unwrap();
        assert!(!p.is_unnamed());
        drop(p);
        assert!(!d.join(".probe2").exists());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "ubdirect-probe-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
