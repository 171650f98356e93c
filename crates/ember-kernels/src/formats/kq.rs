//! What the K rows (Q2_K .. Q6_K) share: the super-block length, the 6-bit
//! scale packing of Q4_K and Q5_K, and the reference quantizer's fits.

/// Weights per K super-block (ggml's `QK_K`).
pub const QK_K: usize = 256;

/// Q4_K's and Q5_K's 12 bytes of scales as eight 6-bit scales and eight
/// 6-bit minimums (ggml's `get_scale_min_k4`): bytes 0..4 hold scales 0..4
/// in their low six bits, bytes 4..8 minimums 0..4, bytes 8..12 the low
/// four bits of scales 4..8 (low nibble) and minimums 4..8 (high nibble),
/// whose top two bits are the top bits of bytes 0..4 and 4..8.
#[inline]
pub fn scale_min_k4(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let sc = std::array::from_fn(|j| if j < 4 { s[j] & 63 } else { (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4) });
    let m = std::array::from_fn(|j| if j < 4 { s[j + 4] & 63 } else { (s[j + 4] >> 4) | ((s[j] >> 6) << 4) });
    (sc, m)
}

/// The inverse of [`scale_min_k4`] (values below 64).
pub fn pack_scale_min_k4(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
    }
    s
}

/// The reference quantizers' fit of one group to `d · q − m` with `q` in
/// `0..=nmax`: `d = (max − min') / nmax`, `m = −min'`, `min' = min(min, 0)`
/// (so zero stays representable and `m ≥ 0`).
pub fn fit_min(x: &[f32], nmax: u8) -> (f32, f32) {
    let lo = x.iter().fold(0.0f32, |a, &v| a.min(v));
    let hi = x.iter().fold(lo, |a, &v| a.max(v));
    ((hi - lo) / nmax as f32, -lo)
}

/// Rounds `v / step` to the integer scale grid `0..=max`.
pub fn level(v: f32, step: f32, max: u8) -> u8 {
    if step > 0.0 {
        (v / step).round().clamp(0.0, max as f32) as u8
    } else {
        0
    }
}

/// The codes of `x` for `d · q − m`, `q` rounded to `0..=nmax`.
pub fn codes_min(x: &[f32], d: f32, m: f32, nmax: u8, out: &mut [u8]) {
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (o, &v) in out.iter_mut().zip(x) {
        *o = ((v + m) * inv).round().clamp(0.0, nmax as f32) as u8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn six_bit_scales_round_trip() {
        let sc = [0, 1, 63, 17, 32, 63, 5, 48];
        let m = [63, 0, 2, 33, 15, 16, 62, 1];
        assert_eq!(scale_min_k4(&pack_scale_min_k4(&sc, &m)), (sc, m));
    }
}
