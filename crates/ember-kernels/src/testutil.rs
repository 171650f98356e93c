//! Helpers shared by the kernel tests.

/// Deterministic pseudo-random values in [-1, 1) (SplitMix64).
pub fn synth(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The error bound of a dot product in f32: a few ulps of the sum of |w·x|.
pub fn close(fast: f32, reference: f32, magnitude: f32) -> bool {
    (fast - reference).abs() <= 1e-5 * magnitude.max(1.0)
}
