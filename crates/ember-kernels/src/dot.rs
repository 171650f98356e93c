//! f32 vector kernels of attention: `q · k` and `o += p · v`.
//!
//! The reference functions are plain loops; the AVX2 ones are the F32 row's
//! dot kernel ([`crate::formats::F32`]) and an FMA axpy.

use crate::cpu::{Isa, Tier};

/// Reference dot product of two f32 vectors.
pub fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

/// `a · b` with `isa`'s kernel.
#[inline]
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    match isa.tier() {
        Tier::Scalar => dot_f32_scalar(a, b),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier's features are present (`isa` is the proof).
        Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => unsafe {
            crate::formats::float::avx2::dot_f32(a, b)
        },
        #[cfg(not(target_arch = "x86_64"))]
        Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
            unreachable!("x86 tiers are only detected on x86")
        }
    }
}

/// Reference `y += a * x`.
pub fn axpy_scalar(a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// `y += a * x` with `isa`'s kernel: the value-weighted sum of attention.
#[inline]
pub fn axpy(isa: Isa, a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    match isa.tier() {
        Tier::Scalar => axpy_scalar(a, x, y),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => unsafe {
            avx2::axpy(a, x, y)
        },
        #[cfg(not(target_arch = "x86_64"))]
        Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
            unreachable!("x86 tiers are only detected on x86")
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{close, synth};

    #[test]
    fn every_tier_matches_the_reference() {
        for n in [0, 3, 8, 64, 67, 128] {
            let x = synth(n, 5);
            let y0 = synth(n, 6);
            let mag: f32 = x.iter().zip(&y0).map(|(a, b)| (a * b).abs()).sum();
            let mut want = y0.clone();
            axpy_scalar(0.37, &x, &mut want);
            for isa in Isa::supported() {
                assert!(close(dot_f32(isa, &x, &y0), dot_f32_scalar(&x, &y0), mag), "{isa:?} n={n}");
                let mut y = y0.clone();
                axpy(isa, 0.37, &x, &mut y);
                for (a, b) in y.iter().zip(&want) {
                    // One fused rounding against two: at most an ulp or so apart.
                    assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{isa:?} n={n}: {a} vs {b}");
                }
            }
        }
    }
}
