//! The benchmark's `--dir`: what it needs free before the run, and what the run wrote, removed
//! after it unless `--keep` (a full run wrote 9.1 GB there on 2026-12-05, and left it).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// What a full run writes at most (its largest scenario's files together, measured 2026-12-05 on
/// the development VM: 9.1 GB); `--quick` writes far less.
pub const FULL_RUN_BYTES: u64 = 10 << 30;
/// The same for `--quick` (its files are small by design).
pub const QUICK_RUN_BYTES: u64 = 2 << 30;

/// `--dir` as found before the run: whether it existed, and its entries then.
#[derive(Debug)]
pub struct Workdir {
    dir: PathBuf,
    existed: bool,
    before: BTreeSet<std::ffi::OsString>,
}

impl Workdir {
    /// Notes what `dir` holds now and says how much the run needs against what is free there.
    pub fn open(dir: &Path, quick: bool) -> Result<Self, String> {
        let existed = dir.exists();
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let before = entries(dir);
        let need = if quick {
            QUICK_RUN_BYTES
        } else {
            FULL_RUN_BYTES
        };
        let free = nix::sys::statvfs::statvfs(dir)
            .map(|s| s.blocks_available() * s.fragment_size())
            .ok();
        let gb = |b: u64| b as f64 / 1e9;
        match free {
            Some(f) if f < need => eprintln!(
                "warning: {} has {:.1} GB free; a{} run writes up to {:.1} GB there (--dir elsewhere, or --quick)",
                dir.display(),
                gb(f),
                if quick { " --quick" } else { " full" },
                gb(need)
            ),
            _ => println!(
                "disk:    up to {:.1} GB written in {} ({} free), removed after the run unless --keep",
                gb(need),
                dir.display(),
                free.map_or("? GB".to_string(), |f| format!("{:.1} GB", gb(f)))
            ),
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            existed,
            before,
        })
    }

    /// Removes what the run added (the whole directory when the run made it), or says what it
    /// keeps; returns the bytes the run had left there.
    pub fn finish(self, keep: bool) -> u64 {
        let added: Vec<PathBuf> = entries(&self.dir)
            .into_iter()
            .filter(|n| !self.before.contains(n))
            .map(|n| self.dir.join(n))
            .collect();
        let bytes: u64 = added.iter().map(|p| size_of(p)).sum();
        if keep {
            println!(
                "disk:    {:.2} GB the run wrote kept in {} (--keep)",
                bytes as f64 / 1e9,
                self.dir.display()
            );
            return bytes;
        }
        for p in &added {
            let _ = if p.is_dir() && !p.is_symlink() {
                std::fs::remove_dir_all(p)
            } else {
                std::fs::remove_file(p)
            };
        }
        if !self.existed {
            let _ = std::fs::remove_dir(&self.dir);
        }
        println!(
            "disk:    {:.2} GB the run wrote in {} removed (--keep keeps them, e.g. for bench/peers)",
            bytes as f64 / 1e9,
            self.dir.display()
        );
        bytes
    }
}

fn entries(dir: &Path) -> BTreeSet<std::ffi::OsString> {
    std::fs::read_dir(dir)
        .map(|r| r.filter_map(|e| e.ok().map(|e| e.file_name())).collect())
        .unwrap_or_default()
}

/// Bytes of a file, or of everything under a directory (links not followed).
fn size_of(p: &Path) -> u64 {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => std::fs::read_dir(p)
            .map(|r| r.filter_map(|e| e.ok()).map(|e| size_of(&e.path())).sum())
            .unwrap_or(0),
        Ok(m) => m.len(),
        Err(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_run_removes_what_it_wrote_and_only_that() {
        let base = std::env::temp_dir().join(format!("ubdirect-workdir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        std::fs::write(base.join("users-file"), b"mine").unwrap();
        let w = Workdir::open(&base, true).unwrap();
        std::fs::create_dir_all(base.join("epoch-4096")).unwrap();
        std::fs::write(base.join("epoch-4096/shard-0.bin"), vec![0u8; 5000]).unwrap();
        std::fs::write(base.join("probe.bin"), vec![0u8; 1000]).unwrap();
        assert_eq!(w.finish(false), 6000);
        assert!(base.join("users-file").exists());
        assert!(!base.join("epoch-4096").exists() && !base.join("probe.bin").exists());
        // A directory the run made is removed whole; --keep leaves everything.
        let made = base.join("made");
        let w = Workdir::open(&made, true).unwrap();
        std::fs::write(made.join("x"), b"12").unwrap();
        assert_eq!(w.finish(true), 2);
        assert!(made.join("x").exists());
        std::fs::remove_dir_all(&made).unwrap();
        let w = Workdir::open(&made, true).unwrap();
        std::fs::write(made.join("x"), b"12").unwrap();
        w.finish(false);
        assert!(!made.exists());
        std::fs::remove_dir_all(&base).unwrap();
    }
}
