//! Scaled dot-product attention of one query token against a KV cache.
//!
//! Grouped-query attention: `n_heads` query heads share `n_kv_heads` key/value
//! heads, query head `h` reading KV head `h / (n_heads / n_kv_heads)`.

use crate::dot::{axpy, dot_f32};
use crate::isa::Isa;
use crate::ops::softmax;

/// Shapes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    /// Width of one cached key or value row: `n_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// `out (n_heads * head_dim,) = softmax(q · Kᵀ / sqrt(head_dim)) · V` over
/// every cached position given (causal by construction: the caller passes
/// positions up to the current one only).
///
/// `q (n_heads * head_dim,)`, `keys` and `values (len, kv_dim)` row-major,
/// `scores (len..,)` scratch.
pub fn attend(
    isa: Isa,
    shape: AttnShape,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    scores: &mut [f32],
    out: &mut [f32],
) {
    assert_eq!(out.len(), shape.n_heads * shape.head_dim);
    attend_heads(isa, shape, 0..shape.n_heads, q, keys, values, scores, out);
}

/// [`attend`] for query heads `heads` only, so threads can split the heads.
/// `out (heads.len() * head_dim,)` receives those heads' outputs.
#[allow(clippy::too_many_arguments)]
pub fn attend_heads(
    isa: Isa,
    shape: AttnShape,
    heads: std::ops::Range<usize>,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    scores: &mut [f32],
    out: &mut [f32],
) {
    let AttnShape { n_heads, n_kv_heads, head_dim: hd } = shape;
    let kv_dim = shape.kv_dim();
    let len = keys.len() / kv_dim;
    assert!(heads.end <= n_heads);
    assert_eq!(q.len(), n_heads * hd);
    assert_eq!(out.len(), heads.len() * hd);
    assert!(keys.len() == len * kv_dim && values.len() == len * kv_dim, "keys and values are (len, kv_dim)");
    assert!(len > 0 && scores.len() >= len);
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let scores = &mut scores[..len];
    for (i, h) in heads.enumerate() {
        let kv = (h / group) * hd;
        let qh = &q[h * hd..(h + 1) * hd];
        for (t, s) in scores.iter_mut().enumerate() {
            *s = dot_f32(isa, qh, &keys[t * kv_dim + kv..t * kv_dim + kv + hd]) * scale;
        }
        softmax(scores);
        let oh = &mut out[i * hd..(i + 1) * hd];
        oh.fill(0.0);
        for (t, &p) in scores.iter().enumerate() {
            axpy(isa, p, &values[t * kv_dim + kv..t * kv_dim + kv + hd], oh);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::tests::synth;

    /// Textbook attention in f64, one head at a time.
    fn reference(shape: AttnShape, q: &[f32], k: &[f32], v: &[f32], len: usize) -> Vec<f32> {
        let (hd, kvd) = (shape.head_dim, shape.kv_dim());
        let group = shape.n_heads / shape.n_kv_heads;
        let mut out = vec![0.0f32; shape.n_heads * hd];
        for h in 0..shape.n_heads {
            let kv = (h / group) * hd;
            let s: Vec<f64> = (0..len)
                .map(|t| {
                    (0..hd).map(|i| q[h * hd + i] as f64 * k[t * kvd + kv + i] as f64).sum::<f64>() / (hd as f64).sqrt()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for i in 0..hd {
                out[h * hd + i] = (0..len).map(|t| e[t] / z * v[t * kvd + kv + i] as f64).sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn matches_reference_with_grouped_heads() {
        let shape = AttnShape { n_heads: 6, n_kv_heads: 2, head_dim: 16 };
        for len in [1, 2, 9, 40] {
            let q = synth(shape.n_heads * 16, len as u64);
            let k = synth(len * shape.kv_dim(), 100 + len as u64);
            let v = synth(len * shape.kv_dim(), 200 + len as u64);
            let want = reference(shape, &q, &k, &v, len);
            for isa in Isa::supported() {
                let mut scores = vec![0.0; len];
                let mut out = vec![0.0; q.len()];
                attend(isa, shape, &q, &k, &v, &mut scores, &mut out);
                for (a, b) in out.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-5, "{isa:?} len={len}: {a} vs {b}");
                }
                // Split by heads, the same numbers.
                let mut split = vec![0.0; q.len()];
                let (lo, hi) = split.split_at_mut(4 * 16);
                attend_heads(isa, shape, 0..4, &q, &k, &v, &mut scores, lo);
                attend_heads(isa, shape, 4..6, &q, &k, &v, &mut scores, hi);
                assert_eq!(split, out);
            }
        }
    }
}
