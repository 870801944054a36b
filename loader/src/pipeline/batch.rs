//! What the consumer gets: a batch over host or device memory, its samples, and zero-copy access.

use std::sync::Arc;

use ubdirect_ub::{Device, Lease, MemoryKind};

use super::LoadError;

/// One sample of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleEntry {
    /// Sample id (position in the dataset index).
    pub id: u64,
    /// Position in this rank's epoch stream.
    pub position: u64,
    /// Shard index.
    pub shard: u32,
    /// Offset in the shard.
    pub shard_offset: u64,
    /// Length.
    pub len: u32,
    /// Which memory segment of the batch holds it.
    pub segment: u32,
    /// Offset in that segment.
    pub offset: usize,
}

pub(super) enum BatchMemory {
    /// Staging leases of the batch's chunk, one per read, shared by the chunk's batches (host
    /// device: zero copy).
    Host(Arc<[Arc<Lease>]>),
    /// One block holding every read of the batch's chunk, shared by the chunk's batches: device
    /// memory on a GPU, host memory with `loader.contiguous_batches` on the host device.
    Block(Arc<Lease>),
}

/// A batch's samples: its range of its chunk's one table (built once per chunk, no allocation per
/// batch or sample).
#[derive(Debug, Clone)]
pub(super) struct SampleTable {
    all: std::sync::Arc<[SampleEntry]>,
    range: std::ops::Range<usize>,
}

impl SampleTable {
    /// Batch `range` of a chunk's table (clamped to it).
    pub(super) fn new(all: std::sync::Arc<[SampleEntry]>, range: std::ops::Range<usize>) -> Self {
        let end = range.end.min(all.len());
        Self {
            range: range.start.min(end)..end,
            all,
        }
    }
}

impl std::ops::Deref for SampleTable {
    type Target = [SampleEntry];
    fn deref(&self) -> &[SampleEntry] {
        &self.all[self.range.clone()]
    }
}

/// A batch's single block, for zero-copy hand-over (DLPack).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef {
    /// Device address (GPU) or host address.
    pub addr: u64,
    /// Bytes in the block.
    pub len: usize,
    /// Whether `addr` is device memory.
    pub on_device: bool,
    /// CUDA ordinal of the device memory.
    pub device_ordinal: Option<usize>,
}

/// A batch: samples over host or device memory. Dropping it returns its blocks to their pools.
pub struct Batch {
    /// Epoch.
    pub epoch: u64,
    /// Index of the batch in this rank's epoch.
    pub index: u64,
    /// Rank.
    pub rank: usize,
    pub(super) samples: SampleTable,
    pub(super) memory: BatchMemory,
    pub(super) device: Arc<dyn Device>,
    pub(super) read_bytes: u64,
    /// GPT batches: the token type and tokens per sample (samples are packed rows).
    pub(super) tokens: Option<(crate::formats::Dtype, u32)>,
    /// Several-column samples: per sample, each part's (offset in the sample, length).
    pub(super) parts: Option<Vec<Vec<(u32, u32)>>>,
    /// GPT batches: the samples' windows, for [`Batch::provenance`].
    pub(super) gpt: Option<std::sync::Arc<crate::gpt::GptSamples>>,
    /// GPT batches with `[dataset.tensors]`: Megatron's tensors in the batch's block.
    pub(super) tensors: Option<Arc<crate::gpt::masks::BatchTensors>>,
}

/// Where each sample of a batch comes from ([`Batch::provenance`]), one entry per sample in
/// delivery order (struct of arrays: what a step log or a numpy view wants).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Provenance {
    /// Sample ids (positions in the dataset index; GPT: window ids, dataset after dataset).
    pub sample: Vec<u64>,
    /// Dataset of a blend (0 when not blended, and for whole samples).
    pub dataset: Vec<u32>,
    /// GPT: the window's row in its dataset's sample index (Megatron's
    /// `shuffle_index[dataset_sample_index]`); whole samples: the sample id.
    pub window: Vec<u64>,
    /// GPT: the first document the window reads (a sequence id of its dataset's `.idx`); whole
    /// samples: the sample id.
    pub document: Vec<u64>,
    /// GPT: the token offset in that document; whole samples: 0.
    pub token_offset: Vec<u64>,
    /// GPT: documents the window spans; whole samples: 1.
    pub documents: Vec<u32>,
    /// Tokens of the sample (GPT), or its bytes (whole samples).
    pub length: Vec<u32>,
    /// Shard of the sample's first byte (an index into the dataset's shard list).
    pub shard: Vec<u32>,
    /// Byte offset of the sample's first byte in that shard.
    pub shard_offset: Vec<u64>,
}

/// A GPT batch as an array: `rows × cols` tokens of `dtype`, row after row from `offset` in the
/// batch's block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenArray {
    /// Token type (the dataset's, from its `.idx`).
    pub dtype: crate::formats::Dtype,
    /// Samples.
    pub rows: usize,
    /// Tokens per sample (`sequence_length + 1`).
    pub cols: usize,
    /// Offset of the first token in the block ([`Batch::block`]).
    pub offset: usize,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("epoch", &self.epoch)
            .field("index", &self.index)
            .field("samples", &self.samples.len())
            .field("device", &self.is_device())
            .finish()
    }
}

impl Batch {
    /// Samples in delivery order.
    pub fn samples(&self) -> &[SampleEntry] {
        &self.samples
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether the batch has no samples.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Whether the batch lives in device memory.
    pub fn is_device(&self) -> bool {
        matches!(&self.memory, BatchMemory::Block(l) if l.kind() == MemoryKind::Device)
    }

    /// The one block holding the batch (its chunk's reads; sample offsets are relative to it), when
    /// the batch is a single buffer: always on a GPU, and on the host with
    /// `loader.contiguous_batches`. `None` for zero-copy host batches spread over staging blocks.
    pub fn block(&self) -> Option<BlockRef> {
        match &self.memory {
            BatchMemory::Block(l) => Some(BlockRef {
                addr: l.device_ptr().or_else(|| l.host_ptr().map(|p| p as u64))?,
                len: l.capacity(),
                on_device: l.kind() == MemoryKind::Device,
                device_ordinal: if l.kind() == MemoryKind::Device {
                    self.device.info().ordinal
                } else {
                    None
                },
            }),
            BatchMemory::Host(_) => None,
        }
    }

    /// GPT batches: the `(batch, sequence_length + 1)` token array this batch is (`None` for whole
    /// samples).
    pub fn tokens(&self) -> Option<TokenArray> {
        let (dtype, cols) = self.tokens?;
        Some(TokenArray {
            dtype,
            rows: self.samples.len(),
            cols: cols as usize,
            offset: self.samples.first().map_or(0, |s| s.offset),
        })
    }

    /// GPT batches with `[dataset.tensors]`: where Megatron's `position_ids` (int64), `loss_mask`
    /// (float32), `cu_seqlens` (int32) and `attention_mask` (bool) are in [`Batch::block`] (on the
    /// batch's device, made with the tokens: no extra transfer), with `cu_seqlens` and `max_seqlen`
    /// also on the host.
    pub fn tensors(&self) -> Option<&crate::gpt::masks::BatchTensors> {
        self.tensors.as_deref()
    }

    /// A copy of `len` bytes at `offset` in the batch's block (host or device memory): how a test
    /// or a tool reads a tensor of [`Batch::tensors`] without a framework.
    pub fn block_to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>, LoadError> {
        let BatchMemory::Block(l) = &self.memory else {
            return Err(LoadError::NoSample {
                index: offset,
                len: 0,
            });
        };
        if offset.checked_add(len).is_none_or(|e| e > l.capacity()) {
            return Err(LoadError::NoSample {
                index: offset,
                len: l.capacity(),
            });
        }
        if l.kind() == MemoryKind::Device {
            let mut v = vec![0u8; len];
            self.device.copy_to_host(l, offset..offset + len, &mut v)?;
            Ok(v)
        } else {
            Ok(l.as_slice()?[offset..offset + len].to_vec())
        }
    }

    /// Several-column samples (`dataset.columns`): sample `i`'s parts, one per column in order, as
    /// (offset from the sample's start, length); each part starts 8-byte aligned. `None` otherwise.
    pub fn parts(&self, i: usize) -> Option<&[(u32, u32)]> {
        self.parts.as_ref()?.get(i).map(|v| &v[..])
    }

    /// Where each sample comes from: dataset of a blend, document and token offset (GPT), shard and
    /// byte offset. Costs a few lookups per sample; nothing is read.
    pub fn provenance(&self) -> Provenance {
        let n = self.samples.len();
        let mut p = Provenance {
            sample: Vec::with_capacity(n),
            dataset: Vec::with_capacity(n),
            window: Vec::with_capacity(n),
            document: Vec::with_capacity(n),
            token_offset: Vec::with_capacity(n),
            documents: Vec::with_capacity(n),
            length: Vec::with_capacity(n),
            shard: Vec::with_capacity(n),
            shard_offset: Vec::with_capacity(n),
        };
        for s in self.samples.iter() {
            let origin = self
                .gpt
                .as_ref()
                .and_then(|g| Some((g.origin(s.id)?, g.tokens)));
            let (dataset, window, document, token_offset, documents, length) = match origin {
                Some((o, tokens)) => (
                    o.dataset,
                    o.window,
                    o.document,
                    o.token_offset,
                    o.documents,
                    tokens,
                ),
                None => (0, s.id, s.id, 0, 1, s.len),
            };
            p.sample.push(s.id);
            p.dataset.push(dataset);
            p.window.push(window);
            p.document.push(document);
            p.token_offset.push(token_offset);
            p.documents.push(documents);
            p.length.push(length);
            p.shard.push(s.shard);
            p.shard_offset.push(s.shard_offset);
        }
        p
    }

    /// Bytes read from storage for this batch.
    pub fn read_bytes(&self) -> u64 {
        self.read_bytes
    }

    /// Sample bytes in this batch.
    pub fn sample_bytes(&self) -> u64 {
        self.samples.iter().map(|s| s.len as u64).sum()
    }

    fn entry(&self, i: usize) -> Result<&SampleEntry, LoadError> {
        self.samples.get(i).ok_or_else(|| LoadError::NoSample {
            index: i,
            len: self.samples.len(),
        })
    }

    /// A host batch's sample bytes (zero copy).
    pub fn sample(&self, i: usize) -> Result<&[u8], LoadError> {
        let e = self.entry(i)?;
        let l: &Lease = match &self.memory {
            BatchMemory::Host(leases) => &leases[e.segment as usize],
            BatchMemory::Block(l) if l.kind() != MemoryKind::Device => l,
            BatchMemory::Block(_) => {
                return Err(LoadError::OnDevice);
            }
        };
        Ok(&l.as_slice()?[e.offset..e.offset + e.len as usize])
    }

    /// A copy of a sample's bytes, from host or device memory.
    pub fn sample_to_vec(&self, i: usize) -> Result<Vec<u8>, LoadError> {
        let e = *self.entry(i)?;
        match &self.memory {
            BatchMemory::Block(l) if l.kind() == MemoryKind::Device => {
                let mut v = vec![0u8; e.len as usize];
                self.device
                    .copy_to_host(l, e.offset..e.offset + e.len as usize, &mut v)?;
                Ok(v)
            }
            _ => Ok(self.sample(i)?.to_vec()),
        }
    }

    /// A device batch's sample address.
    pub fn device_ptr(&self, i: usize) -> Option<u64> {
        let e = self.samples.get(i)?;
        match &self.memory {
            BatchMemory::Block(l) => l.device_ptr().map(|p| p + e.offset as u64),
            BatchMemory::Host(_) => None,
        }
    }
}
