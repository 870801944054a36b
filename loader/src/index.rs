//! The one index every format produces: shards and, for every sample, where its bytes are.

use std::path::PathBuf;

/// One file holding sample bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The file the bytes are read from (`.bin` for Megatron datasets).
    pub path: PathBuf,
    /// Its size in bytes when the index was built.
    pub size: u64,
}

/// Where one sample's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleLoc {
    /// Index into [`DatasetIndex::shards`].
    pub shard: u32,
    /// Byte offset in the shard.
    pub offset: u64,
    /// Byte length.
    pub len: u32,
}

/// A dataset: shards and samples. Sample ids are positions in `samples`, which is in file order
/// (shard by shard, offsets ascending within a shard).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DatasetIndex {
    /// Format name (`raw`, `megatron`, `npy`, `arrow`).
    pub format: String,
    /// Shards, in configuration order.
    pub shards: Vec<Shard>,
    /// Samples, in file order.
    pub samples: Vec<SampleLoc>,
}

impl DatasetIndex {
    /// Total sample bytes.
    pub fn sample_bytes(&self) -> u64 {
        self.samples.iter().map(|s| s.len as u64).sum()
    }

    /// The largest sample.
    pub fn max_sample_len(&self) -> u32 {
        self.samples.iter().map(|s| s.len).max().unwrap_or(0)
    }

    /// Checks that every sample lies inside its shard and that samples are in file order.
    pub fn validate(&self) -> Result<(), crate::formats::FormatError> {
        self.check().map_err(crate::formats::FormatError::Config)
    }

    fn check(&self) -> Result<(), String> {
        let mut prev: Option<SampleLoc> = None;
        for (i, s) in self.samples.iter().enumerate() {
            let shard = self.shards.get(s.shard as usize).ok_or_else(|| {
                format!(
                    "sample {i} names shard {} of {}",
                    s.shard,
                    self.shards.len()
                )
            })?;
            let end = s.offset.checked_add(s.len as u64);
            if end.is_none_or(|e| e > shard.size) {
                return Err(format!(
                    "sample {i} at {}+{} points past the end of {} ({} bytes)",
                    s.offset,
                    s.len,
                    shard.path.display(),
                    shard.size
                ));
            }
            if let Some(p) = prev
                && (p.shard > s.shard || (p.shard == s.shard && p.offset > s.offset))
            {
                return Err(format!("sample {i} is out of file order"));
            }
            prev = Some(*s);
        }
        Ok(())
    }

    /// A stable fingerprint of the index (shards, sizes, sample locations), for resume checks.
    pub fn fingerprint(&self) -> u64 {
        let mut h = crate::planner::Fnv::new();
        h.write(self.format.as_bytes());
        for s in &self.shards {
            h.write(s.path.as_os_str().as_encoded_bytes());
            h.write(&s.size.to_le_bytes());
        }
        for s in &self.samples {
            h.write(&s.shard.to_le_bytes());
            h.write(&s.offset.to_le_bytes());
            h.write(&s.len.to_le_bytes());
        }
        h.finish()
    }
}
