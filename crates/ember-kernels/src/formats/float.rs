//! The float rows: F32, BF16 and F16 weights, read by f32 activations.
//!
//! `dot(w (n,), x (n,)) -> f32`, accumulated in f32. The reference functions
//! are plain loops with one accumulator. The AVX2 kernels keep four 8-lane
//! accumulators (32 products in flight) so the FMA latency is hidden and the
//! loop is limited by memory, which is what bounds decoding; the AVX-512 and
//! AMX tiers run them too (decode is a memory stream: wider registers do not
//! read memory faster).

use super::{reference_kernels, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::{bf16, f16};

/// f32 weights.
pub struct F32;
/// BF16 weights: the top half of an f32, widened exactly.
pub struct Bf16;
/// IEEE half-precision weights, widened exactly.
pub struct F16;

macro_rules! float_row {
    ($row:ty, $t:ty, $variant:ident, $name:literal, $round:expr, $widen:expr, $zero:expr,
     $dot:ident, $rows4:ident, $dequantize:ident) => {
        impl Format for $row {
            const TYPE: WeightType = WeightType::$variant;
            const NAME: &'static str = $name;
            type Block = $t;
            const BLOCK_LEN: usize = 1;
            type Act = f32;
            const ZERO: $t = $zero;
            const QUANTIZED: bool = false;

            fn wrap(data: &[$t]) -> Weights<'_> {
                Weights::$variant(data)
            }

            fn quantize_row(src: &[f32], dst: &mut [$t]) {
                assert_eq!(src.len(), dst.len(), "row length");
                let round: fn(f32) -> $t = $round;
                dst.iter_mut().zip(src).for_each(|(d, &s)| *d = round(s));
            }

            fn dequantize_reference(src: &[$t], dst: &mut [f32]) {
                assert_eq!(src.len(), dst.len(), "row length");
                let widen: fn($t) -> f32 = $widen;
                dst.iter_mut().zip(src).for_each(|(d, &s)| *d = widen(s));
            }

            fn dot_reference(w: &[$t], x: &[f32]) -> f32 {
                assert_eq!(w.len(), x.len());
                let widen: fn($t) -> f32 = $widen;
                w.iter().zip(x).map(|(&a, b)| widen(a) * b).sum()
            }

            fn kernels(tier: Tier) -> Kernels<Self> {
                match tier {
                    Tier::Scalar => reference_kernels(),
                    #[cfg(target_arch = "x86_64")]
                    Tier::Avx2 | Tier::AvxVnni => Kernels {
                        dot: avx2::$dot,
                        rows4: avx2::$rows4,
                        rows4_quads: None,
                        dequantize: avx2::$dequantize,
                    },
                    #[cfg(target_arch = "x86_64")]
                    Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => Kernels {
                        dot: avx2::$dot,
                        rows4: avx512::$rows4,
                        rows4_quads: None,
                        dequantize: avx2::$dequantize,
                    },
                    #[cfg(not(target_arch = "x86_64"))]
                    Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
                        unreachable!("x86 tiers are only detected on x86")
                    }
                }
            }
        }
    };
}

float_row!(F32, f32, F32, "f32", |v: f32| v, |v: f32| v, 0.0, dot_f32, rows4_f32, copy_f32);
float_row!(
    Bf16,
    bf16,
    Bf16,
    "bf16",
    bf16::from_f32,
    |v: bf16| v.to_f32(),
    bf16::ZERO,
    dot_bf16,
    rows4_bf16,
    widen_bf16
);
float_row!(F16, f16, F16, "f16", f16::from_f32, |v: f16| v.to_f32(), f16::ZERO, dot_f16, rows4_f16, widen_f16c);

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    //! AVX2 + FMA (+ F16C) kernels. Each function requires the CPU to have
    //! those features; an `Isa` of the AVX2 tier or above is the proof.
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Lane `i` of the result is the sum of `v[i]`'s lanes: eight horizontal
    /// sums at once.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn reduce8(v: [__m256; 8]) -> __m256 {
        let h: [__m256; 4] = std::array::from_fn(|i| _mm256_hadd_ps(v[2 * i], v[2 * i + 1]));
        // Half h of g[k]: 2-lane sums of v[4k..4k + 4]'s half h, in order.
        let g = [_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3])];
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(g[0], g[1]), _mm256_permute2f128_ps::<0x31>(g[0], g[1]))
    }

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

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_f32(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
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

    dot_kernel!(dot_f32, f32, load_f32, "avx2,fma", |v: f32| v);
    dot_kernel!(dot_bf16, bf16, load_bf16, "avx2,fma", |v: bf16| v.to_f32());
    dot_kernel!(dot_f16, f16, load_f16, "avx2,fma,f16c", |v: f16| v.to_f32());

    /// f32 → f32: a copy (the F32 row's "dequantize").
    #[target_feature(enable = "avx2")]
    pub unsafe fn copy_f32(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    /// BF16 → f32: a BF16 is the top half of an f32.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
        let n = src.len();
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), load_bf16(src.as_ptr().add(i)));
            i += 8;
        }
        for (d, s) in dst[i..].iter_mut().zip(&src[i..]) {
            *d = s.to_f32();
        }
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
        for (d, s) in dst[i..].iter_mut().zip(&src[i..]) {
            *d = s.to_f32();
        }
    }

    /// How far ahead of the current column the next rows are prefetched, in
    /// bytes of each row (measured on the LM head).
    pub(super) const PREFETCH_AHEAD: usize = 4096;

    macro_rules! rows_kernel {
        ($name:ident, $t:ty, $load:ident, $features:literal, $widen:expr) => {
            /// Four dot products at once: `[w0 · x, w1 · x, w2 · x, w3 · x]`.
            /// Each x vector is loaded once for four rows, and when the rows
            /// come from four distant parts of a matrix, four independent
            /// memory streams are in flight, each prefetched ahead (the rows
            /// that follow a row in its stream are the next ones read) on
            /// CPUs where that pays ([`crate::cpu::software_prefetch`]).
            #[target_feature(enable = $features)]
            pub unsafe fn $name(w: [&[$t]; 4], x: &[f32]) -> [f32; 4] {
                #[target_feature(enable = $features)]
                unsafe fn rows<const PREFETCH: bool>(w: [&[$t]; 4], x: &[f32]) -> [f32; 4] {
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
                            // it is harmless. One per cache line.
                            if PREFETCH && (i * bytes) % 64 == 0 {
                                _mm_prefetch::<_MM_HINT_T0>(
                                    (r[k] as *const i8).wrapping_add(i * bytes + PREFETCH_AHEAD),
                                );
                            }
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
                match crate::cpu::software_prefetch() {
                    true => rows::<true>(w, x),
                    false => rows::<false>(w, x),
                }
            }
        };
    }

    rows_kernel!(rows4_f32, f32, load_f32, "avx2,fma", |v: f32| v);
    rows_kernel!(rows4_bf16, bf16, load_bf16, "avx2,fma", |v: bf16| v.to_f32());
    rows_kernel!(rows4_f16, f16, load_f16, "avx2,fma,f16c", |v: f16| v.to_f32());
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    //! AVX-512F mat-vec kernels (the decode loop). Memory-bound like the
    //! AVX2 ones, but with half the instructions per cache line of weights
    //! (one 16-lane widen and FMA per half line), so more lines are in
    //! flight: BF16 tg64 at 88–90% of the read ceiling against 81–86%
    //! with the AVX2 kernel, alternated in one sitting (Xeon, 2 threads).
    use super::avx2::PREFETCH_AHEAD;
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_f32(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }

    /// 16 F16 values widened to f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_f16(p: *const f16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }

    macro_rules! rows_kernel {
        ($name:ident, $t:ty, $load:ident, $widen:expr) => {
            /// Four dot products at once, as the AVX2 kernel of the same
            /// name: rows from four distant parts of a matrix, four memory
            /// streams, each prefetched ahead where that pays; 32 columns
            /// per step.
            #[target_feature(enable = "avx512f")]
            pub unsafe fn $name(w: [&[$t]; 4], x: &[f32]) -> [f32; 4] {
                #[target_feature(enable = "avx512f")]
                unsafe fn rows<const PREFETCH: bool>(w: [&[$t]; 4], x: &[f32]) -> [f32; 4] {
                    let cols = x.len();
                    debug_assert!(w.iter().all(|r| r.len() == cols));
                    let xp = x.as_ptr();
                    let r = w.map(|row| row.as_ptr());
                    let bytes = std::mem::size_of::<$t>();
                    let mut acc = [_mm512_setzero_ps(); 8];
                    let mut i = 0;
                    while i + 32 <= cols {
                        let x0 = _mm512_loadu_ps(xp.add(i));
                        let x1 = _mm512_loadu_ps(xp.add(i + 16));
                        for k in 0..4 {
                            // A prefetch is only a hint: past the end of the data
                            // it is harmless.
                            if PREFETCH {
                                _mm_prefetch::<_MM_HINT_T0>(
                                    (r[k] as *const i8).wrapping_add(i * bytes + PREFETCH_AHEAD),
                                );
                            }
                            acc[2 * k] = _mm512_fmadd_ps($load(r[k].add(i)), x0, acc[2 * k]);
                            acc[2 * k + 1] = _mm512_fmadd_ps($load(r[k].add(i + 16)), x1, acc[2 * k + 1]);
                        }
                        i += 32;
                    }
                    let widen = $widen;
                    let mut y = [0.0f32; 4];
                    for (k, yk) in y.iter_mut().enumerate() {
                        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * k], acc[2 * k + 1]));
                        for j in i..cols {
                            s += widen(w[k][j]) * x[j];
                        }
                        *yk = s;
                    }
                    y
                }
                match crate::cpu::software_prefetch() {
                    true => rows::<true>(w, x),
                    false => rows::<false>(w, x),
                }
            }
        };
    }

    rows_kernel!(rows4_f32, f32, load_f32, |v: f32| v);

    /// Four BF16 rows, as [`rows4_f32`] but without widening loads: one
    /// 64-byte load holds 16 column pairs, a shift makes the even columns
    /// f32 and a mask the odd ones, and they meet x's even and odd columns
    /// (two permutes a step, shared by the four rows). The zero-extending
    /// widen of the other kernels costs a cross-lane shuffle per 16
    /// weights, eight a step.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn rows4_bf16(w: [&[bf16]; 4], x: &[f32]) -> [f32; 4] {
        #[target_feature(enable = "avx512f")]
        unsafe fn rows<const PREFETCH: bool>(w: [&[bf16]; 4], x: &[f32]) -> [f32; 4] {
            let cols = x.len();
            debug_assert!(w.iter().all(|r| r.len() == cols));
            let xp = x.as_ptr();
            let r = w.map(|row| row.as_ptr());
            let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
            let mut acc = [_mm512_setzero_ps(); 8];
            let mut i = 0;
            while i + 32 <= cols {
                let (x0, x1) = (_mm512_loadu_ps(xp.add(i)), _mm512_loadu_ps(xp.add(i + 16)));
                let (xe, xo) = (_mm512_permutex2var_ps(x0, even, x1), _mm512_permutex2var_ps(x0, odd, x1));
                for k in 0..4 {
                    if PREFETCH {
                        // A hint: past the end of the data it is harmless.
                        _mm_prefetch::<_MM_HINT_T0>((r[k] as *const i8).wrapping_add(2 * i + PREFETCH_AHEAD));
                    }
                    // Little-endian: column 2j is word j's low half, 2j + 1 its high half.
                    let v = _mm512_loadu_si512(r[k].add(i) as *const _);
                    let we = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                    let wo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
                    acc[2 * k] = _mm512_fmadd_ps(we, xe, acc[2 * k]);
                    acc[2 * k + 1] = _mm512_fmadd_ps(wo, xo, acc[2 * k + 1]);
                }
                i += 32;
            }
            let mut y = [0.0f32; 4];
            for (k, yk) in y.iter_mut().enumerate() {
                let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * k], acc[2 * k + 1]));
                for j in i..cols {
                    s += w[k][j].to_f32() * x[j];
                }
                *yk = s;
            }
            y
        }
        match crate::cpu::software_prefetch() {
            true => rows::<true>(w, x),
            false => rows::<false>(w, x),
        }
    }
    rows_kernel!(rows4_f16, f16, load_f16, |v: f16| v.to_f32());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Isa;
    use crate::testutil::{close, synth};

    #[test]
    fn every_tier_matches_the_reference_at_every_length() {
        // Lengths cover empty, tails shorter than a vector, and the model's widths.
        for n in [0, 1, 7, 8, 31, 32, 33, 64, 100, 896, 4864] {
            let x = synth(n, n as u64);
            let w = synth(n, 1000 + n as u64);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let mag: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            for isa in Isa::supported() {
                let pairs = [
                    (F32::dot(isa, &w, &x), F32::dot_reference(&w, &x)),
                    (Bf16::dot(isa, &wb, &x), Bf16::dot_reference(&wb, &x)),
                    (F16::dot(isa, &wh, &x), F16::dot_reference(&wh, &x)),
                ];
                for (k, (fast, slow)) in pairs.into_iter().enumerate() {
                    assert!(close(fast, slow, mag), "{isa:?} kind {k} n={n}: {fast} vs {slow}");
                }
                let want_b: Vec<f32> = wb.iter().map(|x| x.to_f32()).collect();
                let want_h: Vec<f32> = wh.iter().map(|x| x.to_f32()).collect();
                let mut out = vec![f32::NAN; n];
                Bf16::dequantize(isa, &wb, &mut out);
                assert_eq!(out, want_b, "{isa:?} bf16 n={n}");
                F16::dequantize(isa, &wh, &mut out);
                assert_eq!(out, want_h, "{isa:?} f16 n={n}");
            }
        }
    }

    #[test]
    fn reference_is_exact_on_small_integers() {
        let w = [1.0f32, -2.0, 3.0, 0.5];
        let x = [4.0f32, 5.0, -6.0, 2.0];
        assert_eq!(F32::dot_reference(&w, &x), 4.0 - 10.0 - 18.0 + 1.0);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(Bf16::dot_reference(&wb, &x), -23.0);
    }
}
