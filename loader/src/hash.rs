//! A stable hash for fingerprints (FNV-1a, 64 bit): the same bytes give the same value in every
//! build and on every machine, so plans, resume states and on-disk caches can be checked against it.
//! A leaf: the index, the GPT builder and the planner all fingerprint with it.

/// FNV-1a, for stable fingerprints and seeds.
#[derive(Debug, Clone)]
pub struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self::new()
    }
}

impl Fnv {
    /// Starts a hash.
    pub fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    /// Adds bytes.
    pub fn write(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= x as u64;
            self.0 = self.0.wrapping_mul(0x100_0000_01b3);
        }
    }
    /// The hash.
    pub fn finish(&self) -> u64 {
        self.0
    }
}
