//! Every file ubdirect writes beside a dataset or in a cache and reads back later, and what its
//! format begins with: the list `docs/security.md` ("Files ubdirect writes and trusts later")
//! documents row for row (`loader/tests/written_files.rs` walks both). One rule holds for all
//! (since 2026-12-05): a file is keyed by the full identity of what it describes
//! ([`crate::formats::file_identity`]: device, inode, size, mtime and ctime) where it describes a
//! file, sealed under this user's key where a forgery could change what is delivered, and checked
//! against the data and settings wherever that is cheap; anything else is rebuilt and counted.

/// A kind of file ubdirect writes and trusts later.
#[derive(Debug, Clone, Copy)]
pub struct WrittenFile {
    /// Its name, as the docs' table spells it.
    pub name: &'static str,
    /// What it begins with (its format's magic), or empty where it has none.
    pub begins: &'static [u8],
    /// The module that writes and reads it.
    pub by: &'static str,
}

/// Every kind of file ubdirect writes and trusts later.
pub const WRITTEN_FILES: &[WrittenFile] = &[
    WrittenFile {
        name: "PREFIX.idx.ubdirect-gpt-HASH",
        begins: crate::gpt::cache::MAGIC,
        by: "gpt::cache",
    },
    WrittenFile {
        name: "FIRST_SHARD.ubdirect-samples-HASH",
        begins: crate::formats::samples_cache::MAGIC,
        by: "formats::samples_cache",
    },
    WrittenFile {
        name: "STREAM.arrow.ubdirect-index",
        begins: crate::formats::arrow::SIDECAR_MAGIC,
        by: "formats::arrow",
    },
    WrittenFile {
        name: "SHARD.tar.ubdirect-index",
        begins: crate::formats::webdataset::SIDECAR_MAGIC,
        by: "formats::webdataset::sidecar",
    },
    WrittenFile {
        name: "SHARD.crc32",
        begins: crate::formats::crc::MAGIC,
        by: "formats::crc",
    },
    WrittenFile {
        name: "KEY-INDEX.chunk, KEY-INDEX.crc",
        begins: b"",
        by: "shards::object::cache",
    },
    WrittenFile {
        name: ".ubdirect-generating, .ubdirect-generated",
        begins: b"ubdirect synthetic dataset 1",
        by: "shards::dataset",
    },
    WrittenFile {
        name: "RECORD[.rankR]",
        begins: b"ARROW1",
        by: "pipeline::record",
    },
    WrittenFile {
        name: "~/.cache/ubdirect/index.key",
        begins: b"",
        by: "formats::seal",
    },
];
