//! Megatron-Core's `BlendedDataset` rule (`helpers.cpp: build_blending_indices`): sample `i` comes
//! from the dataset whose count is furthest behind `weight × max(i, 1)` (the first such on ties), and
//! the builder's per-dataset sizes (`_get_size_per_split_per_dataset`).

/// `(dataset, sample of that dataset)` for each of `size` blended samples.
pub fn blending_indices(weights: &[f64], size: u64) -> Vec<(u16, u64)> {
    let mut current = vec![0u64; weights.len()];
    let mut out = Vec::with_capacity(size as usize);
    for i in 0..size {
        let x = (i as f64).max(1.0);
        let mut best = 0usize;
        let mut best_err = weights[0] * x - current[0] as f64;
        for (d, w) in weights.iter().enumerate().skip(1) {
            let err = w * x - current[d] as f64;
            if err > best_err {
                best_err = err;
                best = d;
            }
        }
        out.push((best as u16, current[best]));
        current[best] += 1;
    }
    out
}

/// The same rule, stopped before any dataset would give more than `available[d]` samples (ubdirect's
/// block order: an epoch of a blend ends when its first dataset is used up).
pub fn blending_indices_bounded(weights: &[f64], available: &[u64]) -> Vec<(u16, u64)> {
    let mut current = vec![0u64; weights.len()];
    let mut out = Vec::new();
    let mut i = 0u64;
    loop {
        let x = (i as f64).max(1.0);
        let mut best = 0usize;
        let mut best_err = weights[0] * x - current[0] as f64;
        for (d, w) in weights.iter().enumerate().skip(1) {
            let err = w * x - current[d] as f64;
            if err > best_err {
                best_err = err;
                best = d;
            }
        }
        if current[best] >= available[best] {
            return out;
        }
        out.push((best as u16, current[best]));
        current[best] += 1;
        i += 1;
    }
}

/// `_get_size_per_split_per_dataset` for one split: per dataset, the samples the blend targets
/// (`ceil(size × w)`) and the samples built (`ceil(ceil(size × w) × (1 + surplus))`).
pub fn sizes_per_dataset(weights: &[f64], size: u64) -> (Vec<u64>, Vec<u64>) {
    let target: Vec<u64> = weights
        .iter()
        .map(|w| (size as f64 * w).ceil() as u64)
        .collect();
    let buffer = target
        .iter()
        .map(|&t| (t as f64 * (1.0 + super::MID_LEVEL_SURPLUS)).ceil() as u64)
        .collect();
    (target, buffer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_prefix_within_one_sample_of_the_weights() {
        let w = [0.2, 0.5, 0.3];
        let picks = blending_indices(&w, 1000);
        let mut c = [0f64; 3];
        for (i, &(d, k)) in picks.iter().enumerate() {
            assert_eq!(k as f64, c[d as usize]);
            c[d as usize] += 1.0;
            for (d, w) in w.iter().enumerate() {
                assert!(
                    (c[d] - w * (i + 1) as f64).abs() <= 1.0,
                    "prefix {i}: {c:?}"
                );
            }
        }
    }
}
