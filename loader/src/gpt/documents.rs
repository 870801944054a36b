//! The documents a GPT dataset's windows run over: their lengths in tokens ([`Sizes`], a slice or a
//! mapped `.idx`) and their order ([`DocumentIndex`]: a range in file order, or Megatron's shuffled
//! epochs). [`super::megatron`] builds the order and [`super::windows`] cuts it into windows by
//! position; both read these, neither owns them.

/// The documents windows run over: a range in file order (`order = "block"`: nothing stored), or
/// Megatron's shuffled epochs (built, or read from a cached index).
#[derive(Debug, Clone)]
pub enum DocumentIndex {
    /// Documents `start..end`, in order, one epoch.
    InOrder(std::ops::Range<u32>),
    /// Document ids, shuffled (shared with the windows computed over them).
    Shuffled(std::sync::Arc<[u32]>),
    /// Document ids read in place from a cache file (`u32`s).
    Mapped(crate::formats::mapped::Ints),
}

impl PartialEq for DocumentIndex {
    fn eq(&self, o: &Self) -> bool {
        self.len() == o.len() && self.iter().eq(o.iter())
    }
}

impl Eq for DocumentIndex {}

impl Default for DocumentIndex {
    fn default() -> Self {
        DocumentIndex::InOrder(0..0)
    }
}

impl DocumentIndex {
    /// Entries.
    pub fn len(&self) -> usize {
        match self {
            DocumentIndex::InOrder(r) => r.len(),
            DocumentIndex::Shuffled(v) => v.len(),
            DocumentIndex::Mapped(m) => m.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entry `i`, if there is one.
    #[inline]
    pub fn get(&self, i: usize) -> Option<u32> {
        match self {
            DocumentIndex::InOrder(r) => (i < r.len()).then(|| r.start + i as u32),
            DocumentIndex::Shuffled(v) => v.get(i).copied(),
            DocumentIndex::Mapped(m) => m.get(i).map(|d| d as u32),
        }
    }

    /// Entries `first..first + out.len()` into `out`, read in bulk where they are mapped; `false`
    /// when they are not all there.
    pub fn fill(&self, first: usize, out: &mut [u64]) -> bool {
        if first.checked_add(out.len()).is_none_or(|e| e > self.len()) {
            return false;
        }
        if let DocumentIndex::Mapped(m) = self {
            return m.fill(first, out);
        }
        for (k, o) in out.iter_mut().enumerate() {
            match self.get(first + k) {
                Some(d) => *o = d as u64,
                None => return false,
            }
        }
        true
    }

    /// The entries in order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.len()).filter_map(|i| self.get(i))
    }
}

/// Sequence lengths in tokens, read by position: a slice, or a mapped `.idx` in place.
pub trait Sizes {
    /// Sequences.
    fn count(&self) -> usize;
    /// Tokens of sequence `i` (`i < count()`).
    fn size(&self, i: usize) -> i32;
    /// Tokens of sequences `range` (`range.end <= count()`), negative lengths counted as 0.
    fn tokens(&self, range: std::ops::Range<usize>) -> u64 {
        range.map(|i| self.size(i).max(0) as u64).sum()
    }
    /// The lengths as shareable [`TokenSizes`] (a copy, unless they are already).
    fn shared(&self) -> TokenSizes {
        TokenSizes::Owned((0..self.count()).map(|i| self.size(i)).collect())
    }
}

impl Sizes for [i32] {
    fn count(&self) -> usize {
        self.len()
    }
    #[inline]
    fn size(&self, i: usize) -> i32 {
        self[i]
    }
}

/// Positions in a document order, read by position.
pub trait Documents {
    /// Entries.
    fn count(&self) -> usize;
    /// Entry `i`, if there is one.
    fn doc(&self, i: usize) -> Option<u32>;
}

impl Documents for [u32] {
    fn count(&self) -> usize {
        self.len()
    }
    #[inline]
    fn doc(&self, i: usize) -> Option<u32> {
        self.get(i).copied()
    }
}

impl Documents for DocumentIndex {
    fn count(&self) -> usize {
        self.len()
    }
    #[inline]
    fn doc(&self, i: usize) -> Option<u32> {
        self.get(i)
    }
}

/// Sequence lengths in tokens: read in place from a mapped Megatron `.idx` (a dataset of one
/// shard whose element type is the token type), or a vector (other formats, several shards).
#[derive(Debug, Clone)]
pub enum TokenSizes {
    /// Lengths computed from the index's byte lengths (shared by the in-order windows).
    Owned(std::sync::Arc<[i32]>),
    /// The `.idx`'s `sequence_lengths`, read where they are.
    Mapped(std::sync::Arc<crate::formats::megatron::MegatronIdx>),
}

impl Sizes for TokenSizes {
    fn count(&self) -> usize {
        match self {
            TokenSizes::Owned(v) => v.len(),
            TokenSizes::Mapped(m) => m.sequences(),
        }
    }
    #[inline]
    fn size(&self, i: usize) -> i32 {
        match self {
            TokenSizes::Owned(v) => v.get(i).copied().unwrap_or(0),
            TokenSizes::Mapped(m) => m.length(i),
        }
    }
    fn shared(&self) -> TokenSizes {
        self.clone()
    }
    fn tokens(&self, range: std::ops::Range<usize>) -> u64 {
        let mut buf = [0i32; 64];
        let mut sum = 0u64;
        let mut at = range.start;
        while at < range.end {
            let n = (range.end - at).min(64);
            if !read_sizes(self, at, &mut buf[..n]) {
                break;
            }
            sum += buf[..n].iter().map(|&x| x.max(0) as u64).sum::<u64>();
            at += n;
        }
        sum
    }
}

/// Lengths of sequences `first..first + out.len()` into `out`, read at once (a mapped `.idx` in
/// one copy); `false` when they are not all there.
pub(crate) fn read_sizes(sizes: &TokenSizes, first: usize, out: &mut [i32]) -> bool {
    match sizes {
        TokenSizes::Owned(v) => match v.get(first..first + out.len()) {
            Some(s) => {
                out.copy_from_slice(s);
                true
            }
            None => false,
        },
        TokenSizes::Mapped(m) => m.read_lengths(first, out),
    }
}
