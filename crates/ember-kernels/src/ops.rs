//! The small element-wise operations of a decoder layer.
//!
//! These touch a few thousand floats per token, against the millions of a
//! mat-vec, so they are plain scalar loops that the compiler vectorises; they
//! stay on one thread. Each follows HuggingFace transformers' float32
//! arithmetic, step for step, so logits agree to rounding.

/// RMSNorm: `out = x / sqrt(mean(x²) + eps) * weight`.
/// `x (n,)`, `weight (n,)`, `out (n,)`.
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), weight.len());
    assert_eq!(x.len(), out.len());
    let mean_sq = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// Rotary position embedding tables, computed the way transformers does
/// (`inv_freq = 1 / theta^(2i/d)` and `angle = pos * inv_freq`, both rounded
/// to f32), so positions in the thousands still agree to rounding.
#[derive(Clone, Debug)]
pub struct Rope {
    /// `(head_dim / 2,)`
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Tables for heads of `head_dim` (even) and base `theta`.
    pub fn new(head_dim: usize, theta: f32) -> Rope {
        assert!(head_dim.is_multiple_of(2), "RoPE needs an even head_dim");
        let inv_freq = (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)).collect();
        Rope { inv_freq }
    }

    /// Half the head dimension: the length of the cos/sin tables.
    pub fn half(&self) -> usize {
        self.inv_freq.len()
    }

    /// Fills `cos (head_dim/2,)` and `sin (head_dim/2,)` for position `pos`.
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let angle = pos as f32 * f;
            // The angle is an f32 (as in transformers); cos/sin of it are taken
            // accurately, then rounded.
            *c = (angle as f64).cos() as f32;
            *s = (angle as f64).sin() as f32;
        }
    }
}

/// Rotate-half RoPE (HF/NeoX layout, not interleaved pairs) applied in place to
/// every head of `x (n_heads * head_dim,)`: within a head, element `i` of the
/// first half pairs with element `i` of the second half.
/// `cos`, `sin`: `(head_dim / 2,)` for this token's position.
pub fn rope_rotate_half(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    assert_eq!(cos.len(), half);
    assert_eq!(sin.len(), half);
    assert_eq!(x.len() % head_dim, 0);
    for head in x.chunks_exact_mut(head_dim) {
        let (a, b) = head.split_at_mut(half);
        for i in 0..half {
            let (x0, x1) = (a[i], b[i]);
            a[i] = x0 * cos[i] - x1 * sin[i];
            b[i] = x1 * cos[i] + x0 * sin[i];
        }
    }
}

/// Softmax in place over `x (n,)`, shifted by the maximum for stability.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `silu(g) = g / (1 + e^-g)`, as transformers computes it.
#[inline]
pub fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// SwiGLU's gate: `gate = silu(gate) * up`.
/// `gate (n,)`, `up (n,)`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    gate.iter_mut().zip(up).for_each(|(g, &u)| *g = silu(*g) * u);
}

/// Residual connection: `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len());
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// `x += bias`, the projection biases of q, k and v.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    add_assign(x, bias)
}

#[cfg(test)]
mod tests {
    use super::*;
    use approx::assert_relative_eq;

    #[test]
    fn rmsnorm_matches_formula() {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let w = [1.0f32, 0.5, 2.0, -1.0];
        let mut out = [0.0; 4];
        rmsnorm(&x, &w, 1e-6, &mut out);
        let ms = (1.0 + 4.0 + 9.0 + 0.25) / 4.0;
        let inv = 1.0 / (ms + 1e-6f64).sqrt();
        for i in 0..4 {
            assert_relative_eq!(out[i] as f64, x[i] as f64 * inv * w[i] as f64, max_relative = 1e-6);
        }
    }

    #[test]
    fn rope_is_a_rotation_of_half_pairs() {
        let rope = Rope::new(8, 10000.0);
        let (mut cos, mut sin) = (vec![0.0; 4], vec![0.0; 4]);
        // Position 0 is the identity.
        rope.cos_sin(0, &mut cos, &mut sin);
        let orig: Vec<f32> = (0..16).map(|i| i as f32 - 7.5).collect();
        let mut x = orig.clone();
        rope_rotate_half(&mut x, 8, &cos, &sin);
        assert_eq!(x, orig);
        // Any position preserves each pair's length and rotates by pos * inv_freq.
        rope.cos_sin(37, &mut cos, &mut sin);
        rope_rotate_half(&mut x, 8, &cos, &sin);
        for h in 0..2 {
            for i in 0..4 {
                let (a0, b0) = (orig[h * 8 + i] as f64, orig[h * 8 + 4 + i] as f64);
                let (a1, b1) = (x[h * 8 + i] as f64, x[h * 8 + 4 + i] as f64);
                assert_relative_eq!(a0.hypot(b0), a1.hypot(b1), max_relative = 1e-5);
                let theta = 37.0 * (1.0 / 10000f64.powf(2.0 * i as f64 / 8.0));
                assert_relative_eq!(a1, a0 * theta.cos() - b0 * theta.sin(), epsilon = 1e-4);
            }
        }
    }

    #[test]
    fn rope_moves_data_only_between_half_partners() {
        // A swap-only rotation (angle pi/2 in every pair) is a pure permutation
        // with a sign: exact equality, no rounding.
        let (cos, sin) = ([0.0f32; 2], [1.0f32; 2]);
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        rope_rotate_half(&mut x, 4, &cos, &sin);
        assert_eq!(x, [-3.0, -4.0, 1.0, 2.0]);
    }

    #[test]
    fn softmax_sums_to_one_and_survives_large_inputs() {
        let mut x = [1000.0f32, 1001.0, 999.0, f32::NEG_INFINITY];
        softmax(&mut x);
        assert_relative_eq!(x.iter().sum::<f32>(), 1.0, max_relative = 1e-6);
        assert_eq!(x[3], 0.0);
        let e = [(-1.0f64).exp(), 1.0, (-2.0f64).exp()];
        let s: f64 = e.iter().sum();
        for i in 0..3 {
            assert_relative_eq!(x[i] as f64, e[i] / s, max_relative = 1e-6);
        }
    }

    #[test]
    fn silu_mul_matches_formula() {
        let mut g = [-3.0f32, 0.0, 2.5];
        let u = [2.0f32, 5.0, -1.0];
        silu_mul(&mut g, &u);
        for (i, &gv) in [-3.0f64, 0.0, 2.5].iter().enumerate() {
            let want = gv / (1.0 + (-gv).exp()) * u[i] as f64;
            assert_relative_eq!(g[i] as f64, want, max_relative = 1e-6);
        }
    }
}
