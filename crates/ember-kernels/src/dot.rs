//! Dot products of an f32 activation vector with one row of weights.
//!
//! `dot_*(w (n,), x (n,)) -> f32`, accumulated in f32. The scalar functions are
//! the reference: plain loops, one accumulator. The AVX2 functions keep four
//! 8-lane accumulators (32 products in flight) so the FMA latency is hidden and
//! the loop is limited by memory, which is what bounds decoding.

use crate::isa::Isa;
use half::{bf16, f16};

/// Reference dot product, f32 weights.
pub fn dot_f32_scalar(w: &[f32], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len());
    w.iter().zip(x).map(|(a, b)| a * b).sum()
}

/// Reference dot product, BF16 weights (widened exactly to f32).
pub fn dot_bf16_scalar(w: &[bf16], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len());
    w.iter().zip(x).map(|(a, b)| a.to_f32() * b).sum()
}

/// Reference dot product, F16 weights (widened exactly to f32).
pub fn dot_f16_scalar(w: &[f16], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len());
    w.iter().zip(x).map(|(a, b)| a.to_f32() * b).sum()
}

/// f32 · f32 with the given tier.
#[inline]
pub fn dot_f32(isa: Isa, w: &[f32], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers only pass tiers that `Isa::is_supported` accepted.
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe { avx2::dot_f32(w, x) },
        _ => dot_f32_scalar(w, x),
    }
}

/// BF16 · f32 with the given tier.
#[inline]
pub fn dot_bf16(isa: Isa, w: &[bf16], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe { avx2::dot_bf16(w, x) },
        _ => dot_bf16_scalar(w, x),
    }
}

/// F16 · f32 with the given tier.
#[inline]
pub fn dot_f16(isa: Isa, w: &[f16], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe { avx2::dot_f16(w, x) },
        _ => dot_f16_scalar(w, x),
    }
}

/// Reference widening of BF16 to f32 (exact).
pub fn widen_bf16_scalar(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    dst.iter_mut().zip(src).for_each(|(d, s)| *d = f32::from_bits((s.to_bits() as u32) << 16));
}

/// Reference widening of F16 to f32 (exact).
pub fn widen_f16_scalar(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
}

/// BF16 → f32 with the given tier.
pub fn widen_bf16(isa: Isa, src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe { avx2::widen_bf16(src, dst) },
        _ => widen_bf16_scalar(src, dst),
    }
}

/// F16 → f32 with the given tier.
pub fn widen_f16(isa: Isa, src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; F16C is part of the Avx2 tier.
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe { avx2::widen_f16c(src, dst) },
        _ => widen_f16_scalar(src, dst),
    }
}

/// Reference `y += a * x`.
pub fn axpy_scalar(a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// `y += a * x` with the given tier: the value-weighted sum of attention.
#[inline]
pub fn axpy(isa: Isa, a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe { avx2::axpy(a, x, y) },
        _ => axpy_scalar(a, x, y),
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    //! AVX2 + FMA (+ F16C) kernels. Each function requires the CPU to have
    //! those features; `Isa::Avx2` is only chosen when it does.
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Sum of the eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Eight BF16 values widened to f32: a BF16 is the top half of an f32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn load_bf16(p: *const bf16) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }

    /// Eight F16 values widened to f32 with F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn load_f16(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    macro_rules! dot_kernel {
        ($name:ident, $t:ty, $load:ident, $features:literal, $widen:expr) => {
            /// Dot product; see the module docs.
            #[target_feature(enable = $features)]
            pub unsafe fn $name(w: &[$t], x: &[f32]) -> f32 {
                let n = w.len();
                let (wp, xp) = (w.as_ptr(), x.as_ptr());
                let mut acc = [_mm256_setzero_ps(); 4];
                let mut i = 0;
                while i + 32 <= n {
                    for (j, a) in acc.iter_mut().enumerate() {
                        let o = i + 8 * j;
                        *a = _mm256_fmadd_ps($load(wp.add(o)), _mm256_loadu_ps(xp.add(o)), *a);
                    }
                    i += 32;
                }
                while i + 8 <= n {
                    acc[0] = _mm256_fmadd_ps($load(wp.add(i)), _mm256_loadu_ps(xp.add(i)), acc[0]);
                    i += 8;
                }
                let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
                let mut s = hsum(sum);
                let widen = $widen;
                while i < n {
                    s += widen(w[i]) * x[i];
                    i += 1;
                }
                s
            }
        };
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_f32(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }

    dot_kernel!(dot_f32, f32, load_f32, "avx2,fma", |v: f32| v);

    /// BF16 → f32: a BF16 is the top half of an f32.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
        let n = src.len();
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), load_bf16(src.as_ptr().add(i)));
            i += 8;
        }
        super::widen_bf16_scalar(&src[i..], &mut dst[i..]);
    }

    /// F16 → f32 with F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn widen_f16c(src: &[f16], dst: &mut [f32]) {
        let n = src.len();
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), load_f16(src.as_ptr().add(i)));
            i += 8;
        }
        super::widen_f16_scalar(&src[i..], &mut dst[i..]);
    }

    /// `y += a * x`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len();
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            let yp = y.as_mut_ptr().add(i);
            _mm256_storeu_ps(yp, _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(yp)));
            i += 8;
        }
        while i < n {
            y[i] += a * x[i];
            i += 1;
        }
    }
    dot_kernel!(dot_bf16, bf16, load_bf16, "avx2,fma", |v: bf16| v.to_f32());
    dot_kernel!(dot_f16, f16, load_f16, "avx2,fma,f16c", |v: f16| v.to_f32());

    /// How far ahead of the current column the next rows are prefetched, in
    /// bytes of each row (measured on the LM head: see `matvec_rows`).
    const PREFETCH_AHEAD: usize = 4096;

    macro_rules! rows_kernel {
        ($name:ident, $t:ty, $load:ident, $features:literal, $widen:expr) => {
            /// Four dot products at once: `[w0 · x, w1 · x, w2 · x, w3 · x]`.
            /// Each x vector is loaded once for four rows, and when the rows
            /// come from four distant parts of a matrix, four independent
            /// memory streams are in flight, each prefetched ahead (the rows
            /// that follow a row in its stream are the next ones read).
            #[target_feature(enable = $features)]
            pub unsafe fn $name(w: [&[$t]; 4], x: &[f32]) -> [f32; 4] {
                let cols = x.len();
                debug_assert!(w.iter().all(|r| r.len() == cols));
                let xp = x.as_ptr();
                let r = w.map(|row| row.as_ptr());
                let mut acc = [_mm256_setzero_ps(); 8];
                let mut i = 0;
                let bytes = std::mem::size_of::<$t>();
                while i + 16 <= cols {
                    let x0 = _mm256_loadu_ps(xp.add(i));
                    let x1 = _mm256_loadu_ps(xp.add(i + 8));
                    for k in 0..4 {
                        // A prefetch is only a hint: past the end of the data
                        // it is harmless.
                        _mm_prefetch::<_MM_HINT_T0>((r[k] as *const i8).wrapping_add(i * bytes + PREFETCH_AHEAD));
                        acc[2 * k] = _mm256_fmadd_ps($load(r[k].add(i)), x0, acc[2 * k]);
                        acc[2 * k + 1] = _mm256_fmadd_ps($load(r[k].add(i + 8)), x1, acc[2 * k + 1]);
                    }
                    i += 16;
                }
                while i + 8 <= cols {
                    let x0 = _mm256_loadu_ps(xp.add(i));
                    for k in 0..4 {
                        acc[2 * k] = _mm256_fmadd_ps($load(r[k].add(i)), x0, acc[2 * k]);
                    }
                    i += 8;
                }
                let widen = $widen;
                let mut y = [0.0f32; 4];
                for k in 0..4 {
                    let mut s = hsum(_mm256_add_ps(acc[2 * k], acc[2 * k + 1]));
                    for j in i..cols {
                        s += widen(w[k][j]) * x[j];
                    }
                    y[k] = s;
                }
                y
            }
        };
    }

    rows_kernel!(rows4_f32, f32, load_f32, "avx2,fma", |v: f32| v);
    rows_kernel!(rows4_bf16, bf16, load_bf16, "avx2,fma", |v: bf16| v.to_f32());
    rows_kernel!(rows4_f16, f16, load_f16, "avx2,fma,f16c", |v: f16| v.to_f32());
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

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

    #[test]
    fn every_tier_matches_the_scalar_twin() {
        // Lengths cover empty, tails shorter than a vector, and the model's widths.
        for n in [0, 1, 7, 8, 31, 32, 33, 64, 100, 896, 4864] {
            let x = synth(n, n as u64);
            let w = synth(n, 1000 + n as u64);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let mag: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            for isa in Isa::supported() {
                let pairs = [
                    (dot_f32(isa, &w, &x), dot_f32_scalar(&w, &x)),
                    (dot_bf16(isa, &wb, &x), dot_bf16_scalar(&wb, &x)),
                    (dot_f16(isa, &wh, &x), dot_f16_scalar(&wh, &x)),
                ];
                for (k, (fast, slow)) in pairs.into_iter().enumerate() {
                    assert!(close(fast, slow, mag), "{isa:?} kind {k} n={n}: {fast} vs {slow}");
                }
            }
        }
    }

    #[test]
    fn widening_is_exact_on_every_tier() {
        for n in [0, 5, 8, 33, 896] {
            let v = synth(n, 77);
            let b: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
            let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            let want_b: Vec<f32> = b.iter().map(|x| x.to_f32()).collect();
            let want_h: Vec<f32> = h.iter().map(|x| x.to_f32()).collect();
            for isa in Isa::supported() {
                let mut out = vec![f32::NAN; n];
                widen_bf16(isa, &b, &mut out);
                assert_eq!(out, want_b, "{isa:?} bf16 n={n}");
                widen_f16(isa, &h, &mut out);
                assert_eq!(out, want_h, "{isa:?} f16 n={n}");
            }
        }
    }

    #[test]
    fn axpy_matches_the_scalar_twin() {
        for n in [0, 3, 8, 64, 67] {
            let x = synth(n, 5);
            let y0 = synth(n, 6);
            let mut want = y0.clone();
            axpy_scalar(0.37, &x, &mut want);
            for isa in Isa::supported() {
                let mut y = y0.clone();
                axpy(isa, 0.37, &x, &mut y);
                for (a, b) in y.iter().zip(&want) {
                    // One fused rounding against two: at most an ulp or so apart.
                    assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{isa:?} n={n}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn scalar_twin_is_exact_on_small_integers() {
        let w = [1.0f32, -2.0, 3.0, 0.5];
        let x = [4.0f32, 5.0, -6.0, 2.0];
        assert_eq!(dot_f32_scalar(&w, &x), 4.0 - 10.0 - 18.0 + 1.0);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(dot_bf16_scalar(&wb, &x), -23.0);
    }
}
