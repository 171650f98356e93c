//! AVX2 kernels of the 32-weight ggml rows Q4_1 and Q5_1 against int8
//! activation blocks ([`BlockA8`]): each block's codes unpacked to 32
//! unsigned bytes (nibbles in place, Q5's fifth bits spread from `qh` by a
//! byte shuffle and a bit test), `vpmaddubsw` + `vpmaddwd` to eight i32
//! sums, one conversion and FMA by `d_w · d_x`; the minimum (`m · d_x ·
//! Σx`) is a scalar per block. Dequantizing
//! rounds as the reference does (a product, then the minimum added), so it
//! is bit for bit the same. Each kernel requires AVX2, FMA and F16C; an
//! `Isa` of the AVX2 tier or above is the proof. Q5_0's dequantizer is
//! here too; its dot products take INT5's step ([`super::int_avx2::x4`] and
//! [`super::int_avx512`]).

use super::act::{BlockA8, QK_A8 as QK};
use super::int_avx2::{hsum, nibbles, scale, store_scaled};
use super::q4_1::BlockQ4_1;
use super::q5_0::BlockQ5_0;
use super::q5_1::BlockQ5_1;
use super::PREFETCH_AHEAD;
use std::arch::x86_64::*;

/// Byte `j` = 16 where bit `j` of `qh` (little-endian) is set, else 0.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn fifth_bits(qh: [u8; 4]) -> __m256i {
    let h = _mm256_set1_epi32(u32::from_le_bytes(qh) as i32);
    // Byte j takes byte j / 8 of qh (both 128-bit lanes hold all four).
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(h, spread), bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

/// Σ u·x over a block as eight i32 sums (`u` unsigned below 32).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_u8(u: __m256i, a: &BlockA8) -> __m256i {
    let x = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))
}

/// The codes of each row as 32 unsigned bytes, with the f32 FMA scale and the
/// scalar term of the block against `a`.
trait Block32 {
    unsafe fn step(&self, a: &BlockA8, acc: &mut __m256, extra: &mut f32);
}

macro_rules! legacy {
    ($block:ty, $dot:ident, $rows4:ident, $dequantize:ident, |$b:ident| $codes:expr,
     |$s:ident, $a:ident, $dd:ident| $extra:expr, |$d:ident| $store:expr) => {
        /// Four rows against the same activations.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $rows4(w: [&[$block]; 4], x: &[BlockA8]) -> [f32; 4] {
            rows(w, x)
        }

        /// One row.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $dot(w: &[$block], x: &[BlockA8]) -> f32 {
            rows([w], x)[0]
        }

        /// Blocks to f32, bit for bit the reference.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $dequantize(src: &[$block], dst: &mut [f32]) {
            for ($b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
                let u: __m256i = $codes;
                let $d = (u, y.as_mut_ptr());
                $store
            }
        }

        impl Block32 for $block {
            #[inline(always)]
            unsafe fn step(&self, $a: &BlockA8, acc: &mut __m256, extra: &mut f32) {
                let $b = self;
                let u: __m256i = $codes;
                let $dd = scale($b.d) * $a.d;
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8(u, $a)), _mm256_set1_ps($dd), *acc);
                let $s = $b;
                *extra += $extra;
            }
        }
    };
}

/// `R` rows against the same activations.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows<B: Block32, const R: usize>(w: [&[B]; R], x: &[BlockA8]) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut extra = [0.0f32; R];
    let prefetch = crate::cpu::software_prefetch();
    for (i, a) in x.iter().enumerate() {
        for k in 0..R {
            let b = w[k].get_unchecked(i);
            if prefetch && i % 2 == 0 {
                // About one prefetch per cache line.
                _mm_prefetch::<_MM_HINT_T0>((b as *const B as *const i8).wrapping_add(PREFETCH_AHEAD));
            }
            b.step(a, &mut acc[k], &mut extra[k]);
        }
    }
    std::array::from_fn(|k| hsum(acc[k]) + extra[k])
}

/// `y[..32] = d · u + m` (a product, then a sum: the reference's rounding).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store_affine(u: __m256i, d: f32, m: f32, y: *mut f32) {
    let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
    let halves = [_mm256_castsi256_si128(u), _mm256_extracti128_si256::<1>(u)];
    for (h, part) in halves.into_iter().enumerate() {
        let lo = _mm256_cvtepu8_epi32(part);
        let hi = _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(part));
        _mm256_storeu_ps(y.add(16 * h), _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)), m));
        _mm256_storeu_ps(y.add(16 * h + 8), _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)), m));
    }
}

legacy!(
    BlockQ4_1,
    dot_q4_1,
    rows4_q4_1,
    dequantize_q4_1,
    |b| nibbles(b.qs.as_ptr()),
    |b, a, _dd| scale(b.m) * (a.d * a.sum as f32),
    |d| store_affine(d.0, scale(b.d), scale(b.m), d.1)
);

/// Q5_0 blocks to f32, bit for bit the reference. (Its dot products take
/// INT5's step: `int_avx2::x4`.)
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequantize_q5_0(src: &[BlockQ5_0], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        let u = _mm256_or_si256(nibbles(b.qs.as_ptr()), fifth_bits(b.qh));
        store_scaled(_mm256_sub_epi8(u, _mm256_set1_epi8(16)), scale(b.d), y.as_mut_ptr());
    }
}

legacy!(
    BlockQ5_1,
    dot_q5_1,
    rows4_q5_1,
    dequantize_q5_1,
    |b| _mm256_or_si256(nibbles(b.qs.as_ptr()), fifth_bits(b.qh)),
    |b, a, _dd| scale(b.m) * (a.d * a.sum as f32),
    |d| store_affine(d.0, scale(b.d), scale(b.m), d.1)
);
