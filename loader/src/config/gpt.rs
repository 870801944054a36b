//! GPT mode's settings read from a run configuration: the configuration knows every module's
//! settings, so `gpt` never sees a [`RunConfig`] (and does not depend on this module).

use std::borrow::Cow;

use super::{DatasetSection, RunConfig};
use crate::formats::Format;
use crate::gpt::{GptError, GptSettings, Order};

impl GptSettings {
    /// GPT mode's settings from a run configuration: `None` when `dataset.sequence_length` is 0.
    /// Settings that only make sense in GPT mode are refused without it.
    pub fn from_config(cfg: &RunConfig) -> Result<Option<GptSettings>, GptError> {
        let d = &cfg.dataset;
        let bad = |s: String| Err(GptError::Config(s));
        if !d.columns.is_empty() {
            if !matches!(d.format, Format::Arrow | Format::WebDataset) {
                return bad("dataset.columns needs format = \"arrow\" or \"webdataset\"".into());
            }
            if d.sequence_length != 0 {
                return bad("dataset.columns and GPT mode (dataset.sequence_length) do not combine: GPT windows read one token column".into());
            }
            if d.verify_crc {
                return bad(
                    "dataset.verify_crc checks whole samples of one column, not dataset.columns"
                        .into(),
                );
            }
        }
        if d.sequence_length == 0 {
            if d.tensors.is_some() {
                return bad("[dataset.tensors] needs GPT mode (dataset.sequence_length)".into());
            }
            if cfg.loader.order == Order::Megatron {
                return bad(
                    "loader.order = \"megatron\" needs GPT mode (dataset.sequence_length)".into(),
                );
            }
            if !d.blend.is_empty() {
                return bad("dataset.blend needs GPT mode (dataset.sequence_length)".into());
            }
            if d.num_samples != 0 {
                return bad("dataset.num_samples needs GPT mode (dataset.sequence_length)".into());
            }
            return Ok(None);
        }
        if matches!(d.format, Format::Npy | Format::WebDataset) {
            return bad(
                "GPT mode reads token sequences of megatron, raw or arrow (list column) datasets, not npy or webdataset"
                    .into(),
            );
        }
        if d.verify_crc {
            return bad(
                "dataset.verify_crc checks whole sequences; GPT mode reads parts of them".into(),
            );
        }
        if d.tensors.is_some_and(|t| t.eod.is_none()) {
            return bad(
                "[dataset.tensors] needs eod: the end-of-document token (Megatron's tokenizer.eod)"
                    .into(),
            );
        }
        if d.num_samples != 0 && cfg.loader.order != Order::Megatron {
            return bad("dataset.num_samples needs loader.order = \"megatron\"".into());
        }
        for (i, b) in d.blend.iter().enumerate() {
            if !(b.weight.is_finite() && b.weight > 0.0) {
                return bad(format!(
                    "dataset.blend[{i}].weight {} must be positive",
                    b.weight
                ));
            }
            if b.paths.is_empty() {
                return bad(format!("dataset.blend[{i}].paths is empty"));
            }
            if cfg.loader.order == Order::Megatron && b.paths.len() != 1 {
                return bad(format!(
                    "dataset.blend[{i}]: Megatron blends name one dataset (prefix) per entry, not {}",
                    b.paths.len()
                ));
            }
        }
        Ok(Some(GptSettings {
            sequence_length: d.sequence_length,
            add_extra_token: d.add_extra_token,
            seed: cfg.loader.seed,
            num_samples: d.num_samples,
            split: d.split.clone(),
            part: d.split_part,
            order: cfg.loader.order,
            blend: d.blend.iter().map(|b| (b.weight, b.paths.len())).collect(),
        }))
    }
}

impl DatasetSection {
    /// The dataset section the shards are opened with: a blend's entries' paths, in order, as
    /// `paths`; with several columns, the first as `column`.
    pub fn for_opening(&self) -> Cow<'_, DatasetSection> {
        if self.blend.is_empty() && self.columns.is_empty() {
            return Cow::Borrowed(self);
        }
        let mut c = self.clone();
        if let Some(first) = self.columns.first() {
            c.column = first.clone();
        }
        if self.blend.is_empty() {
            return Cow::Owned(c);
        }
        c.paths = self
            .blend
            .iter()
            .flat_map(|b| b.paths.iter().cloned())
            .collect();
        c.generate = false;
        Cow::Owned(c)
    }
}
