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
    let mean_sq = sum_of_squares(x) / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// `Σ x²` in sixteen interleaved partial sums, then those in order: the
/// compiler vectorises independent lanes but not one running sum, a chain
/// of dependent adds (RMSNorm at 896 wide, one thread, Emerald Rapids:
/// 0.79 → 0.25 µs; it runs twice a layer on the caller while the workers
/// wait). Lanes are also closer to the exact sum than one running f32 sum,
/// and the order is fixed, so every tier and path gives the same bits.
fn sum_of_squares(x: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut lanes = [0.0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v * v;
        }
    }
    let tail = chunks.remainder().iter().map(|v| v * v).sum::<f32>();
    lanes.iter().sum::<f32>() + tail
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

/// [`silu_mul`] with `isa`'s kernel: on the tiers above scalar eight lanes at
/// a time, the exponential a polynomial within a few ulp of `f32::exp`
/// (`silu_mul` is the twin).
pub fn silu_mul_with(isa: crate::cpu::Isa, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    #[cfg(target_arch = "x86_64")]
    if isa.tier() != crate::cpu::Tier::Scalar {
        // SAFETY: every tier above scalar has AVX2 and FMA (`isa` is the proof).
        return unsafe { avx2::silu_mul(gate, up) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    silu_mul(gate, up)
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

/// The vector forms of the exponential and SiLU.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// `e^x` in each lane, within a few ulp of `f32::exp` on −87..88; 0
    /// below −87 (where `e^x` < 2^-125: subnormal, and nothing against
    /// anything it is added to here), `e^88` above 88; NaN stays NaN.
    /// `x = n ln 2 + r`, `|r| ≤ ln 2 / 2`, `e^r` by Cephes' degree-6
    /// polynomial, `2^n` built in the exponent bits.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp(x: __m256) -> __m256 {
        // `max(a, x)` and `min(b, x)` return `x` when it is NaN.
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.0));
        let x = _mm256_min_ps(_mm256_set1_ps(88.0), _mm256_max_ps(_mm256_set1_ps(-87.0), x));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        // ln 2 in two parts, so `n · ln 2` is exact enough.
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
        let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_andnot_ps(under, _mm256_mul_ps(e, _mm256_castsi256_ps(two_n)))
    }

    /// `gate = silu(gate) · up`, eight lanes at a time, as [`super::silu`]
    /// writes it: `g / (1 + e^-g) · u`. The ragged end goes through the same
    /// lanes (padded), so each element's result does not depend on where a
    /// caller's slice starts or ends.
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
        assert_eq!(gate.len(), up.len());
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn lanes(g: *mut f32, u: *const f32) {
            let gv = _mm256_loadu_ps(g);
            let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            let s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0), e));
            _mm256_storeu_ps(g, _mm256_mul_ps(s, _mm256_loadu_ps(u)));
        }
        let whole = gate.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            lanes(gate.as_mut_ptr().add(i), up.as_ptr().add(i));
        }
        let rest = gate.len() - whole;
        if rest > 0 {
            let (mut g, mut u) = ([0.0f32; 8], [0.0f32; 8]);
            g[..rest].copy_from_slice(&gate[whole..]);
            u[..rest].copy_from_slice(&up[whole..]);
            lanes(g.as_mut_ptr(), u.as_ptr());
            gate[whole..].copy_from_slice(&g[..rest]);
        }
    }
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
    fn rmsnorm_of_a_long_row_matches_the_formula_in_f64() {
        // Longer than the sixteen lanes, with a ragged tail, and a spread of
        // magnitudes like a residual stream's.
        for n in [1, 15, 16, 17, 896, 903] {
            let x: Vec<f32> =
                (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) * if i % 7 == 0 { 3.0 } else { 0.01 }).collect();
            let w: Vec<f32> = (0..n).map(|i| 0.5 + (i % 5) as f32 * 0.25).collect();
            let mut out = vec![0.0; n];
            rmsnorm(&x, &w, 1e-6, &mut out);
            let ms = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / n as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            for i in 0..n {
                assert_relative_eq!(
                    out[i] as f64,
                    x[i] as f64 * inv * w[i] as f64,
                    max_relative = 1e-6,
                    epsilon = 1e-30
                );
            }
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

    /// The vector SiLU against its twin and f64 from −100 to 100, with
    /// ragged ends: within a few ulp where the value is a normal float
    /// (past −87 both are below 1e-35), NaN kept.
    #[test]
    fn vector_silu_matches_its_twin() {
        for isa in crate::cpu::Isa::supported() {
            for len in [1, 7, 8, 29, 1000] {
                let g0: Vec<f32> = (0..len).map(|i| (i as f32 * 0.7391).sin() * 100.0 * (i % 3) as f32 / 2.0).collect();
                let u: Vec<f32> = (0..len).map(|i| 1.0 + (i % 5) as f32 * 0.25).collect();
                let mut fast = g0.clone();
                silu_mul_with(isa, &mut fast, &u);
                for i in 0..len {
                    let g = g0[i] as f64;
                    let want = g / (1.0 + (-g).exp()) * u[i] as f64;
                    let tol = 8.0 * f32::EPSILON as f64 * want.abs() + 1e-35;
                    assert!((fast[i] as f64 - want).abs() <= tol, "{isa:?} len={len} g={g}: {} vs {want}", fast[i]);
                }
            }
            let mut g = vec![0.5f32; 9];
            g[3] = f32::NAN;
            silu_mul_with(isa, &mut g, &[1.0; 9]);
            assert!(g[3].is_nan() && g.iter().filter(|v| v.is_nan()).count() == 1, "{isa:?}");
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
