//! Files written beside data others can write: never through a planted link, never into a FIFO.
//!
//! Every file the loader and its tools write next to a dataset — the GPT index cache, the Arrow
//! sidecar, CRC sidecars (`ubdirect index`), the shards `ubdirect gen` makes — goes through
//! [`NewFile`]. Its directory is opened once (`O_DIRECTORY`) and every later call is relative to that
//! descriptor. The file is an unnamed `O_TMPFILE` in it, or, where the file system has none, a new
//! random name created with `O_CREAT | O_EXCL | O_NOFOLLOW` (which fails on any existing name, a
//! symlink or a FIFO included, and is never opened). Once written whole, [`NewFile::commit`] gives
//! it a fresh random name (`linkat`, which never replaces) and renames that over the destination
//! (`renameat` replaces a name — a symlink planted there is replaced, its target untouched). A
//! reader never sees half a file, and a crash leaves at most an unreferenced random name.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::sys;

/// A file being written, that appears at its destination only when [`commit`](Self::commit)ted.
/// Dropped uncommitted, it leaves nothing behind.
#[derive(Debug)]
pub struct NewFile {
    file: File,
    dir: File,
    dest: PathBuf,
    name: OsString,
    /// The random name of a named (no `O_TMPFILE`) file, until committed.
    temp: Option<OsString>,
}

/// A name no one can guess ahead: `.NAME.ubdirect-<64 random bits>`.
fn random_name(name: &OsStr) -> OsString {
    use std::hash::{BuildHasher, Hasher};
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    // std's RandomState is seeded from the OS's randomness once per thread, then stepped.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    let mut s = OsString::from(".");
    s.push(name);
    s.push(format!(".ubdirect-{:016x}", h.finish()));
    s
}

impl NewFile {
    /// Starts a new file that will become `path` (mode `0o666` less the umask). The directory must
    /// exist; nothing is created or changed at `path` until [`commit`](Self::commit).
    pub fn create(path: &Path) -> io::Result<NewFile> {
        let name = path
            .file_name()
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, "a file path has a file name")
            })?
            .to_owned();
        let dir_path = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags_dir()
            .open(dir_path)?;
        let rw = libc::O_RDWR;
        let (file, temp) = match sys::openat(&dir, OsStr::new("."), rw | libc::O_TMPFILE, 0o666) {
            Ok(f) => (f, None),
            // EOPNOTSUPP / EISDIR (no O_TMPFILE in this file system or kernel): a new random name.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EISDIR)) => {
                Self::create_named(&dir, &name)?
            }
            Err(e) => return Err(e),
        };
        Ok(NewFile {
            file,
            dir,
            dest: path.to_path_buf(),
            name,
            temp,
        })
    }

    /// A new file under a random name (`O_CREAT | O_EXCL | O_NOFOLLOW`; a taken name is retried).
    fn create_named(dir: &File, name: &OsStr) -> io::Result<(File, Option<OsString>)> {
        let flags = libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW;
        let mut last = io::Error::from(io::ErrorKind::AlreadyExists);
        for _ in 0..16 {
            let t = random_name(name);
            match sys::openat(dir, &t, flags, 0o666) {
                Ok(f) => return Ok((f, Some(t))),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// Where the file will be.
    pub fn path(&self) -> &Path {
        &self.dest
    }

    /// The open file.
    pub fn file(&mut self) -> &mut File {
        &mut self.file
    }

    /// Whether the file is unnamed until committed (`O_TMPFILE`).
    pub fn is_unnamed(&self) -> bool {
        self.temp.is_none()
    }

    /// Puts the whole file at its destination, replacing what is there (a planted symlink is
    /// replaced, not followed). Not synced: callers that need durability call `sync_all` first.
    pub fn commit(mut self) -> io::Result<()> {
        let temp = match self.temp.take() {
            Some(t) => t,
            None => {
                let mut linked = None;
                for _ in 0..16 {
                    let t = random_name(&self.name);
                    match sys::link_fd(&self.file, &self.dir, &t) {
                        Ok(()) => {
                            linked = Some(t);
                            break;
                        }
                        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                        Err(e) => return Err(e),
                    }
                }
                linked.ok_or_else(|| io::Error::from(io::ErrorKind::AlreadyExists))?
            }
        };
        let r = sys::rename_in(&self.dir, &temp, &self.name);
        if r.is_err() {
            let _ = sys::unlink_in(&self.dir, &temp);
        }
        r
    }
}

impl Write for NewFile {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.file.write(b)
    }
    fn write_all(&mut self, b: &[u8]) -> io::Result<()> {
        self.file.write_all(b)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl Drop for NewFile {
    fn drop(&mut self) {
        if let Some(t) = self.temp.take() {
            // Ours: created with O_EXCL under a random name. Unlinking never follows a symlink.
            let _ = sys::unlink_in(&self.dir, &t);
        }
    }
}

/// `O_DIRECTORY` on an `OpenOptions`.
trait DirFlags {
    fn custom_flags_dir(&mut self) -> &mut Self;
}

impl DirFlags for std::fs::OpenOptions {
    fn custom_flags_dir(&mut self) -> &mut Self {
        std::os::unix::fs::OpenOptionsExt::custom_flags(self, libc::O_DIRECTORY | libc::O_CLOEXEC)
    }
}

/// Writes `bytes` as the new file `path` ([`NewFile`]).
pub fn write_new(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = NewFile::create(path)?;
    f.write_all(bytes)?;
    f.commit()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn tempdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ubdirect-newfile-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A symlink or a FIFO planted at the destination is replaced, its target untouched, and the
    /// write does not block; nothing else is left in the directory.
    #[test]
    fn planted_links_and_fifos_are_replaced_not_followed() {
        let d = tempdir("planted");
        let target = d.join("victim");
        std::fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, d.join("out")).unwrap();
        write_new(&d.join("out"), b"new bytes").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        assert!(!d.join("out").symlink_metadata().unwrap().is_symlink());
        assert_eq!(std::fs::read(d.join("out")).unwrap(), b"new bytes");
        let st = std::process::Command::new("mkfifo")
            .arg(d.join("pipe"))
            .status()
            .unwrap();
        assert!(st.success());
        write_new(&d.join("pipe"), b"x").unwrap();
        assert!(d.join("pipe").metadata().unwrap().is_file());
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 3);
    }

    /// The named fallback: an existing name is never opened, and a dropped file leaves nothing.
    #[test]
    fn the_named_fallback_never_opens_an_existing_name() {
        let d = tempdir("named");
        let dir = File::open(&d).unwrap();
        let (f, t) = NewFile::create_named(&dir, OsStr::new("x")).unwrap();
        let t = t.unwrap();
        assert!(t.to_string_lossy().starts_with(".x.ubdirect-"));
        drop(f);
        let flags = libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW;
        let e = sys::openat(&dir, &t, flags, 0o600).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        let n = NewFile {
            file: sys::openat(&dir, &t, libc::O_RDWR, 0).unwrap(),
            dir,
            dest: d.join("x"),
            name: "x".into(),
            temp: Some(t),
        };
        drop(n);
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
    }
}
