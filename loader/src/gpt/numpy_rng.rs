//! numpy's legacy `RandomState` (MT19937) as far as Megatron-Core uses it: seeding with an integer,
//! and `shuffle` of a 1-D array. Written out here (no crate reproduces numpy's legacy bounded-integer
//! algorithm), and checked against numpy's own output in the tests below and, through Megatron's
//! indices, in `loader/tests/gpt_megatron.rs`.
//!
//! - `RandomState(seed)`: `mt19937_seed` (Knuth's initialisation, multiplier 1812433253).
//! - `shuffle(x)`: for `i` from `n - 1` down to 1, `j = random_interval(i)`, swap `x[i]`, `x[j]`.
//! - `random_interval(max)`: the smallest all-ones mask covering `max`, then draws masked values
//!   until one is `<= max` — 32-bit draws when `max` fits in 32 bits, else 64-bit draws made of two
//!   32-bit outputs (high word first).

const N: usize = 624;
const M: usize = 397;

/// numpy's `RandomState` core: MT19937 with numpy's seeding.
#[derive(Clone)]
pub struct RandomState {
    key: [u32; N],
    pos: usize,
}

impl std::fmt::Debug for RandomState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RandomState")
            .field("pos", &self.pos)
            .finish()
    }
}

impl RandomState {
    /// `numpy.random.RandomState(seed)` for an integer seed (numpy refuses seeds of 2³² and more).
    pub fn new(seed: u32) -> Self {
        let mut key = [0u32; N];
        let mut s = seed;
        for (pos, k) in key.iter_mut().enumerate() {
            *k = s;
            s = 1_812_433_253u32
                .wrapping_mul(s ^ (s >> 30))
                .wrapping_add(pos as u32 + 1);
        }
        Self { key, pos: N }
    }

    fn generate(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        const MATRIX_A: u32 = 0x9908_b0df;
        let mag = |y: u32| if y & 1 == 1 { MATRIX_A } else { 0 };
        for i in 0..N {
            let y = (self.key[i] & UPPER) | (self.key[(i + 1) % N] & LOWER);
            self.key[i] = self.key[(i + M) % N] ^ (y >> 1) ^ mag(y);
        }
        self.pos = 0;
    }

    /// The next 32-bit output.
    pub fn next_u32(&mut self) -> u32 {
        if self.pos == N {
            self.generate();
        }
        let mut y = self.key[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// The next 64-bit output (numpy: high word first).
    pub fn next_u64(&mut self) -> u64 {
        let hi = self.next_u32() as u64;
        (hi << 32) | self.next_u32() as u64
    }

    /// numpy's legacy `random_interval`: uniform in `0..=max`.
    pub fn random_interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        mask |= mask >> 1;
        mask |= mask >> 2;
        mask |= mask >> 4;
        mask |= mask >> 8;
        mask |= mask >> 16;
        mask |= mask >> 32;
        if max <= 0xffff_ffff {
            loop {
                let v = self.next_u32() as u64 & mask;
                if v <= max {
                    return v;
                }
            }
        }
        loop {
            let v = self.next_u64() & mask;
            if v <= max {
                return v;
            }
        }
    }

    /// `RandomState.shuffle` of a 1-D array.
    ///
    /// The draws do not depend on the array, so they are made a batch at a time and the batch's swaps
    /// done after: the same swaps in the same order as numpy's loop, but the swap loop has nothing
    /// else in it and the CPU keeps many of its cache misses (random `x[j]`) in flight at once.
    pub fn shuffle<T>(&mut self, x: &mut [T]) {
        const BATCH: usize = 256;
        let mut js = [0usize; BATCH];
        let mut hi = x.len();
        while hi > 1 {
            let lo = hi.saturating_sub(BATCH).max(1);
            for (k, i) in (lo..hi).rev().enumerate() {
                js[k] = self.random_interval(i as u64) as usize;
            }
            for (k, i) in (lo..hi).rev().enumerate() {
                x.swap(i, js[k]);
            }
            hi = lo;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MT19937's reference outputs for `init_genrand(5489)` (numpy:
    /// `RandomState(5489).randint(0, 2**32, size=3, dtype=numpy.uint64)`).
    #[test]
    fn mt19937_reference_outputs() {
        let mut r = RandomState::new(5489);
        let first: Vec<u32> = (0..3).map(|_| r.next_u32()).collect();
        assert_eq!(first, [3_499_211_612, 581_869_302, 3_890_346_734]);
    }

    /// Draws wider than 32 bits: `RandomState(3).randint(0, 2**40 + 1, dtype=numpy.uint64)`, 4 times
    /// (numpy's masked rejection on 64-bit draws, as in `random_interval`).
    #[test]
    fn wide_intervals_like_numpy() {
        let mut r = RandomState::new(3);
        let got: Vec<u64> = (0..4).map(|_| r.random_interval(1 << 40)).collect();
        assert_eq!(
            got,
            [1073054410371, 867663915883, 593770158997, 511502908838]
        );
    }

    /// `a = numpy.arange(n); numpy.random.RandomState(seed).shuffle(a)` as numpy 2.4 prints it.
    #[test]
    fn shuffles_like_numpy() {
        for (seed, n, want) in numpy_cases() {
            let mut a: Vec<u64> = (0..n).collect();
            RandomState::new(seed).shuffle(&mut a);
            assert_eq!(a, want, "seed {seed} n {n}");
        }
    }

    /// The batched shuffle makes numpy's swaps in numpy's order: equal to the plain loop across
    /// batch boundaries (lengths around multiples of the batch), for narrow and wide elements.
    #[test]
    fn batched_shuffle_equals_the_plain_loop() {
        for (seed, n) in [(1u32, 255usize), (2, 256), (3, 257), (4, 513), (5, 10_000)] {
            let mut plain: Vec<u64> = (0..n as u64).collect();
            let mut r = RandomState::new(seed);
            for i in (1..plain.len()).rev() {
                let j = r.random_interval(i as u64) as usize;
                plain.swap(i, j);
            }
            let mut wide: Vec<u64> = (0..n as u64).collect();
            let mut narrow: Vec<u32> = (0..n as u32).collect();
            RandomState::new(seed).shuffle(&mut wide);
            RandomState::new(seed).shuffle(&mut narrow);
            assert_eq!(wide, plain, "seed {seed} n {n}");
            assert!(narrow.iter().map(|&x| x as u64).eq(plain.iter().copied()));
            // The generator is left where the plain loop leaves it.
            let mut q = RandomState::new(seed);
            q.shuffle(&mut vec![0u8; n]);
            assert_eq!(q.next_u32(), r.next_u32(), "seed {seed} n {n}");
        }
    }

    fn numpy_cases() -> Vec<(u32, u64, Vec<u64>)> {
        vec![
            (0, 10, vec![2, 8, 4, 9, 1, 6, 7, 3, 0, 5]),
            (
                1234,
                17,
                vec![14, 11, 0, 13, 16, 2, 10, 7, 1, 9, 8, 4, 12, 5, 6, 3, 15],
            ),
            (42, 1, vec![0]),
            (7, 2, vec![0, 1]),
            (
                4294967295,
                33,
                vec![
                    24, 15, 19, 3, 21, 2, 28, 30, 1, 6, 8, 31, 27, 4, 32, 16, 17, 9, 5, 14, 13, 10,
                    23, 11, 18, 29, 25, 26, 22, 0, 20, 7, 12,
                ],
            ),
            (
                99,
                64,
                vec![
                    56, 16, 7, 24, 6, 31, 36, 14, 45, 10, 39, 47, 13, 28, 46, 51, 30, 25, 11, 44,
                    50, 33, 42, 41, 55, 61, 26, 22, 19, 3, 34, 37, 21, 32, 59, 17, 27, 15, 20, 8,
                    58, 12, 0, 2, 54, 43, 38, 29, 48, 53, 49, 62, 23, 63, 52, 5, 4, 18, 60, 9, 40,
                    57, 35, 1,
                ],
            ),
        ]
    }
}
