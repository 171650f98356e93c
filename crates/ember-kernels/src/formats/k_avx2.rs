//! AVX2 kernels of the K rows (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) against
//! 256-wide int8 activations ([`BlockA8K`]).
//!
//! A super-block is eight chunks of 32 weights. Each chunk's codes are
//! unpacked to 32 unsigned bytes (`u`, below 64) with shifts and masks in
//! place, `vpmaddubsw` multiplies them by the activations into i16 pair
//! sums (at most 2 · 63 · 127), and `vpmaddwd` multiplies those by the
//! groups' integer scales (one i16 per lane: one scale per 16 or 32
//! weights) into eight i32 sums. Offsets and minimums are paid with the
//! activations' sums of 16 in one more `vpmaddwd` per super-block. Every
//! sum is exact in i32; a super-block costs one conversion and one FMA by
//! `d_x · d_w` (and one more for the minimums). Dequantizing reuses the
//! unpacking and rounds as the reference does (a product, then the minimum
//! subtracted), so it is bit for bit the same. Each kernel requires AVX2,
//! FMA and F16C; an `Isa` of the AVX2 tier or above is the proof.

use super::act::BlockA8K;
use super::int_avx2::{hsum, scale};
use super::kq::scale_min_k4;
use super::q2_k::BlockQ2K;
use super::q3_k::BlockQ3K;
use super::q4_k::BlockQ4K;
use super::q5_k::BlockQ5K;
use super::q6_k::BlockQ6K;
use super::PREFETCH_AHEAD;
use std::arch::x86_64::*;

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bytes(v: u8) -> __m256i {
    _mm256_set1_epi8(v as i8)
}

/// `(v >> s) & mask` per byte, `s` a run-time shift.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn shr_mask(v: __m256i, s: u32, mask: u8) -> __m256i {
    _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s as i32)), bytes(mask))
}

/// `value` in the bytes of `v` whose bit `bit` is set, 0 elsewhere.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bit_as(v: __m256i, bit: u32, value: u8) -> __m256i {
    let b = bytes(1u8 << bit);
    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, b), b), bytes(value))
}

/// 16 i16 lanes: scale `s[2t]` in the first 8, `s[2t + 1]` in the last 8
/// (the two groups of 16 of chunk `t`), from 16 i8 scales in `s`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn pair_scales(s: __m128i, t: usize) -> __m256i {
    let pick = _mm_add_epi8(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm_set1_epi8(2 * t as i8));
    _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s, pick))
}

/// Σ_lanes scales · (u · x pair sums): eight i32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn scaled_dot(u: __m256i, x: *const i8, scales: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, load(x as *const u8)), scales)
}

/// The activations' sums of 16 times 16 i16 `weights`, as eight i32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bsum_dot(a: &BlockA8K, weights: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i), weights)
}

/// `y[..16] = dl · q − ml` for 16 signed byte codes (the reference's
/// rounding: a product, then a difference; `MIN = false` skips it).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn store16<const MIN: bool>(q: __m128i, dl: f32, ml: f32, y: *mut f32) {
    let (d, m) = (_mm256_set1_ps(dl), _mm256_set1_ps(ml));
    for (h, part) in [q, _mm_srli_si128::<8>(q)].into_iter().enumerate() {
        let v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part)));
        _mm256_storeu_ps(y.add(8 * h), if MIN { _mm256_sub_ps(v, m) } else { v });
    }
}

/// The two 16-byte halves of a chunk.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn halves(u: __m256i) -> [__m128i; 2] {
    [_mm256_castsi256_si128(u), _mm256_extracti128_si256::<1>(u)]
}

/// Prefetches a block's bytes `PREFETCH_AHEAD` ahead, one per cache line
/// (where [`crate::cpu::software_prefetch`] says it pays).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn prefetch<B>(b: &B) {
    let p = b as *const B as *const i8;
    let mut off = 0;
    while off < std::mem::size_of::<B>() {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_AHEAD + off));
        off += 64;
    }
}

/// A super-block's contribution: `acc += d_x · d · Σ scaled` and
/// `accm += d_x · dmin · Σ mins` (i32 lanes converted once).
trait SuperBlock {
    unsafe fn step(&self, a: &BlockA8K, acc: &mut __m256, accm: &mut __m256);
}

/// `R` rows against the same activations: `Σ acc − Σ accm` per row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows<B: SuperBlock, const R: usize>(w: [&[B]; R], x: &[BlockA8K]) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut accm = [_mm256_setzero_ps(); R];
    let ahead = crate::cpu::software_prefetch();
    for (i, a) in x.iter().enumerate() {
        for k in 0..R {
            let b = w[k].get_unchecked(i);
            if ahead {
                prefetch(b);
            }
            b.step(a, &mut acc[k], &mut accm[k]);
        }
    }
    std::array::from_fn(|k| hsum(_mm256_sub_ps(acc[k], accm[k])))
}

/// Adds `d_x · d · isum` to `acc`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn add_scaled(acc: &mut __m256, isum: __m256i, s: f32) {
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(s), *acc);
}

macro_rules! entry_points {
    ($block:ty, $dot:ident, $rows4:ident) => {
        /// Four rows against the same activations.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $rows4(w: [&[$block]; 4], x: &[BlockA8K]) -> [f32; 4] {
            rows(w, x)
        }

        /// One row.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $dot(w: &[$block], x: &[BlockA8K]) -> f32 {
            rows([w], x)[0]
        }
    };
}

// ---- Q4_K and Q5_K: eight groups of 32, six-bit scales and minimums ----

/// Chunk pair `c` (groups `2c`, `2c + 1`) of a Q4_K block: its nibbles.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q4k_pair(qs: &[u8; 128], c: usize) -> (__m256i, __m256i) {
    let q = load(qs.as_ptr().add(32 * c));
    (_mm256_and_si256(q, bytes(15)), shr_mask(q, 4, 15))
}

/// Chunk pair `c` of a Q5_K block: Q4_K's nibbles and the fifth bits.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q5k_pair(b: &BlockQ5K, qh: __m256i, c: usize) -> (__m256i, __m256i) {
    let (lo, hi) = q4k_pair(&b.qs, c);
    (_mm256_or_si256(lo, bit_as(qh, 2 * c as u32, 16)), _mm256_or_si256(hi, bit_as(qh, 2 * c as u32 + 1, 16)))
}

/// The minimum term of Q4_K / Q5_K: Σ_g m_g (bsum_2g + bsum_2g+1).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn k4_mins(a: &BlockA8K, m: &[u8; 8]) -> __m256i {
    // Each minimum for both sums of 16 of its group.
    let m = _mm_loadl_epi64(m.as_ptr() as *const __m128i);
    let twice = _mm_unpacklo_epi8(m, m);
    bsum_dot(a, _mm256_cvtepu8_epi16(twice))
}

impl SuperBlock for BlockQ4K {
    #[inline(always)]
    unsafe fn step(&self, a: &BlockA8K, acc: &mut __m256, accm: &mut __m256) {
        let (sc, m) = scale_min_k4(&self.scales);
        let mut isum = _mm256_setzero_si256();
        for c in 0..4 {
            let (lo, hi) = q4k_pair(&self.qs, c);
            let x = a.qs.as_ptr().add(64 * c);
            isum = _mm256_add_epi32(isum, scaled_dot(lo, x, _mm256_set1_epi16(sc[2 * c] as i16)));
            isum = _mm256_add_epi32(isum, scaled_dot(hi, x.add(32), _mm256_set1_epi16(sc[2 * c + 1] as i16)));
        }
        add_scaled(acc, isum, a.d * scale(self.d));
        add_scaled(accm, k4_mins(a, &m), a.d * scale(self.dmin));
    }
}
entry_points!(BlockQ4K, dot_q4k, rows4_q4k);

/// Q4_K blocks to f32.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequantize_q4k(src: &[BlockQ4K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(256)) {
        let (sc, m) = scale_min_k4(&b.scales);
        let (d, dmin) = (scale(b.d), scale(b.dmin));
        for c in 0..4 {
            let (lo, hi) = q4k_pair(&b.qs, c);
            for (g, u) in [(2 * c, lo), (2 * c + 1, hi)] {
                let (dl, ml) = (d * sc[g] as f32, dmin * m[g] as f32);
                for (h, part) in halves(u).into_iter().enumerate() {
                    store16::<true>(part, dl, ml, y.as_mut_ptr().add(32 * g + 16 * h));
                }
            }
        }
    }
}

impl SuperBlock for BlockQ5K {
    #[inline(always)]
    unsafe fn step(&self, a: &BlockA8K, acc: &mut __m256, accm: &mut __m256) {
        let (sc, m) = scale_min_k4(&self.scales);
        let qh = load(self.qh.as_ptr());
        let mut isum = _mm256_setzero_si256();
        for c in 0..4 {
            let (lo, hi) = q5k_pair(self, qh, c);
            let x = a.qs.as_ptr().add(64 * c);
            isum = _mm256_add_epi32(isum, scaled_dot(lo, x, _mm256_set1_epi16(sc[2 * c] as i16)));
            isum = _mm256_add_epi32(isum, scaled_dot(hi, x.add(32), _mm256_set1_epi16(sc[2 * c + 1] as i16)));
        }
        add_scaled(acc, isum, a.d * scale(self.d));
        add_scaled(accm, k4_mins(a, &m), a.d * scale(self.dmin));
    }
}
entry_points!(BlockQ5K, dot_q5k, rows4_q5k);

/// Q5_K blocks to f32.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequantize_q5k(src: &[BlockQ5K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(256)) {
        let (sc, m) = scale_min_k4(&b.scales);
        let (d, dmin) = (scale(b.d), scale(b.dmin));
        let qh = load(b.qh.as_ptr());
        for c in 0..4 {
            let (lo, hi) = q5k_pair(b, qh, c);
            for (g, u) in [(2 * c, lo), (2 * c + 1, hi)] {
                let (dl, ml) = (d * sc[g] as f32, dmin * m[g] as f32);
                for (h, part) in halves(u).into_iter().enumerate() {
                    store16::<true>(part, dl, ml, y.as_mut_ptr().add(32 * g + 16 * h));
                }
            }
        }
    }
}

// ---- Q6_K: sixteen groups of 16, int8 scales, offset 32 ----

/// The four chunks of half `h` of a Q6_K block: six-bit codes (0..64).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q6k_half(b: &BlockQ6K, h: usize) -> [__m256i; 4] {
    let lo = load(b.ql.as_ptr().add(64 * h));
    let hi = load(b.ql.as_ptr().add(64 * h + 32));
    let qh = load(b.qh.as_ptr().add(32 * h));
    let top = bytes(0x30);
    let nib = bytes(15);
    // Bits 2k, 2k + 1 of qh moved to bits 4, 5.
    let t0 = _mm256_and_si256(_mm256_slli_epi16::<4>(qh), top);
    let t1 = _mm256_and_si256(_mm256_slli_epi16::<2>(qh), top);
    let t2 = _mm256_and_si256(qh, top);
    let t3 = _mm256_and_si256(_mm256_srli_epi16::<2>(qh), top);
    [
        _mm256_or_si256(_mm256_and_si256(lo, nib), t0),
        _mm256_or_si256(_mm256_and_si256(hi, nib), t1),
        _mm256_or_si256(shr_mask(lo, 4, 15), t2),
        _mm256_or_si256(shr_mask(hi, 4, 15), t3),
    ]
}

impl SuperBlock for BlockQ6K {
    #[inline(always)]
    unsafe fn step(&self, a: &BlockA8K, acc: &mut __m256, _accm: &mut __m256) {
        let s = _mm_loadu_si128(self.scales.as_ptr() as *const __m128i);
        // Σ_g sc_g · (Σ c·x − 32 · Σ x).
        let mut isum =
            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<5>(bsum_dot(a, _mm256_cvtepi8_epi16(s))));
        for h in 0..2 {
            let codes = q6k_half(self, h);
            for (k, u) in codes.into_iter().enumerate() {
                let t = 4 * h + k;
                isum = _mm256_add_epi32(isum, scaled_dot(u, a.qs.as_ptr().add(32 * t), pair_scales(s, t)));
            }
        }
        add_scaled(acc, isum, a.d * scale(self.d));
    }
}
entry_points!(BlockQ6K, dot_q6k, rows4_q6k);

/// Q6_K blocks to f32.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequantize_q6k(src: &[BlockQ6K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(256)) {
        let d = scale(b.d);
        for h in 0..2 {
            for (k, u) in q6k_half(b, h).into_iter().enumerate() {
                let t = 4 * h + k;
                let q = _mm256_sub_epi8(u, bytes(32));
                for (i, part) in halves(q).into_iter().enumerate() {
                    let g = 2 * t + i;
                    store16::<false>(part, d * b.scales[g] as f32, 0.0, y.as_mut_ptr().add(16 * g));
                }
            }
        }
    }
}

// ---- Q2_K and Q3_K: sixteen groups of 16, two low bits per byte shift ----

/// Chunk `t = 4h + k` of Q2_K's or Q3_K's two-bit codes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn two_bits(qs: &[u8; 64], t: usize) -> __m256i {
    shr_mask(load(qs.as_ptr().add(32 * (t / 4))), 2 * (t % 4) as u32, 3)
}

impl SuperBlock for BlockQ2K {
    #[inline(always)]
    unsafe fn step(&self, a: &BlockA8K, acc: &mut __m256, accm: &mut __m256) {
        let s = _mm_loadu_si128(self.scales.as_ptr() as *const __m128i);
        let sc = _mm_and_si128(s, _mm_set1_epi8(15));
        let m = _mm_and_si128(_mm_srli_epi16::<4>(s), _mm_set1_epi8(15));
        let mut isum = _mm256_setzero_si256();
        for t in 0..8 {
            isum = _mm256_add_epi32(
                isum,
                scaled_dot(two_bits(&self.qs, t), a.qs.as_ptr().add(32 * t), pair_scales(sc, t)),
            );
        }
        add_scaled(acc, isum, a.d * scale(self.d));
        add_scaled(accm, bsum_dot(a, _mm256_cvtepu8_epi16(m)), a.d * scale(self.dmin));
    }
}
entry_points!(BlockQ2K, dot_q2k, rows4_q2k);

/// Q2_K blocks to f32.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequantize_q2k(src: &[BlockQ2K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(256)) {
        let (d, dmin) = (scale(b.d), scale(b.dmin));
        for t in 0..8 {
            for (i, part) in halves(two_bits(&b.qs, t)).into_iter().enumerate() {
                let g = 2 * t + i;
                let s = b.scales[g];
                store16::<true>(part, d * (s & 15) as f32, dmin * (s >> 4) as f32, y.as_mut_ptr().add(16 * g));
            }
        }
    }
}

/// Chunk `t` of a Q3_K block as `q + 4` (0..8): two bits, and 4 where its
/// `hmask` bit `t` is set.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q3k_chunk(b: &BlockQ3K, hm: __m256i, t: usize) -> __m256i {
    _mm256_or_si256(two_bits(&b.qs, t), bit_as(hm, t as u32, 4))
}

impl SuperBlock for BlockQ3K {
    #[inline(always)]
    unsafe fn step(&self, a: &BlockA8K, acc: &mut __m256, _accm: &mut __m256) {
        let sc = self.group_scales();
        let s = _mm_loadu_si128(sc.as_ptr() as *const __m128i);
        let hm = load(self.hmask.as_ptr());
        // Σ_g s_g · (Σ (q + 4)·x − 4 · Σ x).
        let mut isum =
            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<2>(bsum_dot(a, _mm256_cvtepi8_epi16(s))));
        for t in 0..8 {
            isum = _mm256_add_epi32(
                isum,
                scaled_dot(q3k_chunk(self, hm, t), a.qs.as_ptr().add(32 * t), pair_scales(s, t)),
            );
        }
        add_scaled(acc, isum, a.d * scale(self.d));
    }
}
entry_points!(BlockQ3K, dot_q3k, rows4_q3k);

/// Q3_K blocks to f32.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequantize_q3k(src: &[BlockQ3K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(256)) {
        let d = scale(b.d);
        let sc = b.group_scales();
        let hm = load(b.hmask.as_ptr());
        for t in 0..8 {
            let q = _mm256_sub_epi8(q3k_chunk(b, hm, t), bytes(4));
            for (i, part) in halves(q).into_iter().enumerate() {
                let g = 2 * t + i;
                store16::<false>(part, d * sc[g] as f32, 0.0, y.as_mut_ptr().add(16 * g));
            }
        }
    }
}
