//! Raw fixed-size records (e.g. token files): sample = `record_len` elements of `dtype`.

use std::path::PathBuf;

use super::index::{DatasetIndex, Samples, Shard};
use super::{Dtype, FormatError, corrupt, file_size};

/// Indexes raw record files. A file whose size is not a whole number of records is refused.
pub fn open(paths: &[PathBuf], dtype: Dtype, record_len: u64) -> Result<DatasetIndex, FormatError> {
    let sized = paths
        .iter()
        .map(|p| Ok((p.clone(), file_size(p)?)))
        .collect::<Result<Vec<_>, FormatError>>()?;
    open_sized(&sized, dtype, record_len)
}

/// Indexes raw record files of known sizes (remote shards).
pub fn open_sized(
    files: &[(PathBuf, u64)],
    dtype: Dtype,
    record_len: u64,
) -> Result<DatasetIndex, FormatError> {
    let rec = record_len
        .checked_mul(dtype.size() as u64)
        .filter(|r| *r > 0 && *r <= u32::MAX as u64)
        .ok_or_else(|| {
            FormatError::Config(format!(
                "dataset.record_len {record_len} × {dtype:?} is not a valid record size"
            ))
        })?;
    let mut idx = DatasetIndex {
        format: "raw".into(),
        ..Default::default()
    };
    let mut runs = Vec::with_capacity(files.len());
    for (si, (p, size)) in files.iter().enumerate() {
        let size = *size;
        if size % rec != 0 {
            return Err(corrupt(
                p,
                format!(
                    "size {size} is not a multiple of the record size {rec} ({record_len} × {dtype:?}): truncated or wrong dtype/record_len"
                ),
            ));
        }
        idx.shards.push(Shard {
            path: p.clone(),
            size,
        });
        runs.push((si as u32, rec as u32, size / rec));
    }
    // Nothing per record: the runs say where every record is (O(shards) memory at any size).
    idx.samples = Samples::fixed(runs);
    Ok(idx)
}
