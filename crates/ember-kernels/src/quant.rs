//! INT8 and INT4 weights: block formats, quantizers, and the integer dot
//! products that read them without ever expanding a matrix to f32.
//!
//! Both formats are symmetric with one F16 scale per block of [`QK`] = 32
//! weights along a row (a row of 896 has 28 blocks):
//!
//! | format | block | bytes / 32 weights | value of weight j |
//! |---|---|---|---|
//! | [`BlockQ8`] (`int8`) | `d: f16, qs: [i8; 32]` | 34 | `d · qs[j]`, `qs` in −127..=127 |
//! | [`BlockQ4`] (`int4`) | `d: f16, qs: [u8; 16]` | 18 | `d · (nibble_j − 8)`: low nibbles are j = 0..16, high nibbles j = 16..32 |
//!
//! **Activations** are quantized once per mat-vec to [`BlockA8`] (int8 with
//! an f32 scale and the block's sum of quants) and reused for every row, so
//! the inner loop is integer multiply-adds: `Σ_blocks d_w·d_x·Σ q_w·q_x`
//! (for INT4 `Σ (n − 8)·q_x = Σ n·q_x − 8·Σ q_x`, the sum coming with the
//! activation block).
//!
//! **Scales.** INT8 takes `d = max|w| / 127`. INT4 searches: for each block it
//! tries scales around `max|w| / 8` (both signs of the extreme, so the
//! asymmetric code range −8..=7 is used where it helps), rounds, refits `d` by
//! least squares for the chosen codes, and keeps the scale with the smallest
//! squared error. That costs a few microseconds per block at load and removes
//! a good part of the error of the fixed `max / −8` rule.
//!
//! Each format is a [`Format`] table ([`Int8`], [`Int4`]): quantize a row,
//! dequantize a row, the reference dot (`dot_*_scalar`, the specification) and
//! the fast dot; the mat-vec uses the four-row kernels in `avx2`, pinned to
//! the reference by tests.

use half::f16;

/// Weights per block.
pub const QK: usize = 32;

/// 32 weights as `d · qs[j]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8 {
    pub d: f16,
    pub qs: [i8; QK],
}

/// 32 weights as `d · (nibble − 8)`; byte i holds weight i (low nibble) and
/// weight i + 16 (high nibble).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ4 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

/// 32 activations as `d · qs[j]`, with `sum = Σ qs[j]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockA8 {
    pub d: f32,
    pub sum: i32,
    pub qs: [i8; QK],
}

const _: () = assert!(std::mem::size_of::<BlockQ8>() == 34 && std::mem::align_of::<BlockQ8>() == 2);
const _: () = assert!(std::mem::size_of::<BlockQ4>() == 18 && std::mem::align_of::<BlockQ4>() == 2);
const _: () = assert!(std::mem::size_of::<BlockA8>() == 40);

impl BlockQ8 {
    pub const ZERO: BlockQ8 = BlockQ8 { d: f16::ZERO, qs: [0; QK] };
}

impl BlockQ4 {
    pub const ZERO: BlockQ4 = BlockQ4 { d: f16::ZERO, qs: [0x88; QK / 2] };
}

impl BlockA8 {
    pub const ZERO: BlockA8 = BlockA8 { d: 0.0, sum: 0, qs: [0; QK] };
}

/// A quantized weight format, as chosen on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Quant {
    Int8,
    Int4,
}

impl Quant {
    /// `int8` / `int4`.
    pub fn name(self) -> &'static str {
        match self {
            Quant::Int8 => "int8",
            Quant::Int4 => "int4",
        }
    }

    pub fn from_name(s: &str) -> Option<Quant> {
        match s.trim().to_ascii_lowercase().as_str() {
            "int8" | "q8" => Some(Quant::Int8),
            "int4" | "q4" => Some(Quant::Int4),
            _ => None,
        }
    }

    /// Bytes of one block of [`QK`] weights.
    pub fn block_bytes(self) -> usize {
        match self {
            Quant::Int8 => std::mem::size_of::<BlockQ8>(),
            Quant::Int4 => std::mem::size_of::<BlockQ4>(),
        }
    }
}

/// Blocks as raw bytes (for writing files).
pub fn q8_bytes(b: &[BlockQ8]) -> &[u8] {
    // SAFETY: BlockQ8 is repr(C) of f16 + i8s with no padding (size checked).
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u8, std::mem::size_of_val(b)) }
}

/// Blocks as raw bytes (for writing files).
pub fn q4_bytes(b: &[BlockQ4]) -> &[u8] {
    // SAFETY: as above.
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u8, std::mem::size_of_val(b)) }
}

/// Raw bytes as blocks; `None` if the length or alignment (2) is wrong.
pub fn q8_from_bytes(b: &[u8]) -> Option<&[BlockQ8]> {
    let size = std::mem::size_of::<BlockQ8>();
    if !b.len().is_multiple_of(size) || !(b.as_ptr() as usize).is_multiple_of(2) {
        return None;
    }
    // SAFETY: length and alignment checked; every bit pattern is a valid block.
    Some(unsafe { std::slice::from_raw_parts(b.as_ptr() as *const BlockQ8, b.len() / size) })
}

/// Raw bytes as blocks; `None` if the length or alignment (2) is wrong.
pub fn q4_from_bytes(b: &[u8]) -> Option<&[BlockQ4]> {
    let size = std::mem::size_of::<BlockQ4>();
    if !b.len().is_multiple_of(size) || !(b.as_ptr() as usize).is_multiple_of(2) {
        return None;
    }
    // SAFETY: as above.
    Some(unsafe { std::slice::from_raw_parts(b.as_ptr() as *const BlockQ4, b.len() / size) })
}

/// One weight format as a table: its block, quantizing and dequantizing a
/// row, the reference dot product (the specification) and the fast one, and
/// the activation format it pairs with (always [`BlockA8`], made by
/// [`quantize_activations`]).
pub trait Format {
    type Block: Copy + std::fmt::Debug + PartialEq;
    /// The command-line name.
    const QUANT: Quant;
    /// An all-zero block.
    const ZERO: Self::Block;
    fn quantize_row(src: &[f32], dst: &mut [Self::Block]);
    fn dequantize_row(src: &[Self::Block], dst: &mut [f32]);
    /// [`Format::dequantize_row`] with the given tier's kernel (bit for bit).
    fn dequantize(isa: crate::isa::Isa, src: &[Self::Block], dst: &mut [f32]);
    /// `Σ w·x` over the blocks, integer products per block.
    fn dot_reference(w: &[Self::Block], x: &[BlockA8]) -> f32;
    /// [`Format::dot_reference`] with the given tier's kernel.
    fn dot(isa: crate::isa::Isa, w: &[Self::Block], x: &[BlockA8]) -> f32;
}

/// The INT8 format ([`BlockQ8`]).
pub struct Int8;
/// The INT4 format ([`BlockQ4`]).
pub struct Int4;

/// The [`Format`] table of one format from its functions.
macro_rules! format_table {
    ($format:ty, $block:ty, $quant:expr, $quantize:ident, $dequantize:ident, $fast_dequantize:ident, $reference:ident, $fast:ident) => {
        impl Format for $format {
            type Block = $block;
            const QUANT: Quant = $quant;
            const ZERO: $block = <$block>::ZERO;
            fn quantize_row(src: &[f32], dst: &mut [$block]) {
                $quantize(src, dst)
            }
            fn dequantize_row(src: &[$block], dst: &mut [f32]) {
                $dequantize(src, dst)
            }
            fn dequantize(isa: crate::isa::Isa, src: &[$block], dst: &mut [f32]) {
                #[cfg(target_arch = "x86_64")]
                if isa >= crate::isa::Isa::Avx2 {
                    // SAFETY: callers pass supported tiers.
                    return unsafe { avx2::$fast_dequantize(src, dst) };
                }
                let _ = isa;
                $dequantize(src, dst)
            }
            fn dot_reference(w: &[$block], x: &[BlockA8]) -> f32 {
                $reference(w, x)
            }
            fn dot(isa: crate::isa::Isa, w: &[$block], x: &[BlockA8]) -> f32 {
                #[cfg(target_arch = "x86_64")]
                if isa >= crate::isa::Isa::Avx2 {
                    // SAFETY: callers pass supported tiers.
                    return unsafe { avx2::$fast(w, x) };
                }
                let _ = isa;
                $reference(w, x)
            }
        }
    };
}

format_table!(Int8, BlockQ8, Quant::Int8, quantize_q8_row, dequantize_q8_row, dequantize_q8, dot_q8_scalar, dot_q8);
format_table!(Int4, BlockQ4, Quant::Int4, quantize_q4_row, dequantize_q4_row, dequantize_q4, dot_q4_scalar, dot_q4);

// ---------------------------------------------------------------- INT8

/// Quantizes `src` (a multiple of 32 long) into INT8 blocks.
pub fn quantize_q8_row(src: &[f32], dst: &mut [BlockQ8]) {
    assert_eq!(src.len(), dst.len() * QK, "row length");
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = f16::from_f32(amax / 127.0);
        let df = d.to_f32();
        let inv = if df > 0.0 { 1.0 / df } else { 0.0 };
        b.d = d;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = (v * inv).round().clamp(-127.0, 127.0) as i8;
        }
    }
}

/// INT8 blocks back to f32.
pub fn dequantize_q8_row(src: &[BlockQ8], dst: &mut [f32]) {
    assert_eq!(dst.len(), src.len() * QK, "row length");
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (o, &q) in y.iter_mut().zip(&b.qs) {
            *o = d * q as f32;
        }
    }
}

/// Reference: `Σ_j w_j · x_j` over the blocks, integer products per block.
pub fn dot_q8_scalar(w: &[BlockQ8], x: &[BlockA8]) -> f32 {
    assert_eq!(w.len(), x.len());
    let mut s = 0.0f32;
    for (b, a) in w.iter().zip(x) {
        let dot: i32 = b.qs.iter().zip(&a.qs).map(|(&p, &q)| p as i32 * q as i32).sum();
        s += b.d.to_f32() * a.d * dot as f32;
    }
    s
}

// ---------------------------------------------------------------- INT4

/// The nibble codes of `x` at scale `d` (`inv = 1/d`): `round(x / d) + 8`,
/// clamped to 0..=15.
#[inline]
fn q4_codes(x: &[f32], inv: f32) -> [u8; QK] {
    std::array::from_fn(|j| ((x[j] * inv).round() + 8.0).clamp(0.0, 15.0) as u8)
}

/// The squared error of a block at scale `d` with its codes.
#[cfg(test)]
fn q4_error(x: &[f32], d: f32, codes: &[u8; QK]) -> f32 {
    x.iter().zip(codes).map(|(&v, &n)| (v - d * (n as f32 - 8.0)).powi(2)).sum()
}

/// The squared error of a block at scale `d` (`inv = 1/d`), its codes
/// rounded as [`q4_codes`] does, in one pass.
#[inline]
fn q4_error_at(x: &[f32], d: f32, inv: f32) -> f32 {
    let mut err = 0.0;
    for &v in x {
        let n = ((v * inv).round() + 8.0).clamp(0.0, 15.0);
        err += (v - d * (n - 8.0)).powi(2);
    }
    err
}

/// Quantizes `src` (a multiple of 32 long) into INT4 blocks, choosing each
/// block's scale by a small search (see the module docs).
pub fn quantize_q4_row(src: &[f32], dst: &mut [BlockQ4]) {
    assert_eq!(src.len(), dst.len() * QK, "row length");
    // Candidate divisors of the block's signed extreme: around −8 (Q4_0's
    // rule, the extreme on code 0) and around +7 (the extreme on code 15).
    const KS: [f32; 14] = [-8.5, -8.25, -8.0, -7.75, -7.5, -7.25, -7.0, 6.5, 6.75, 7.0, 7.25, 7.5, 7.75, 8.0];
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let max = x.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        if max == 0.0 {
            *b = BlockQ4::ZERO;
            continue;
        }
        let mut best = (f32::INFINITY, 0.0f32);
        let consider = |d: f32, best: &mut (f32, f32)| {
            let d = f16::from_f32(d).to_f32();
            if d != 0.0 && d.is_finite() {
                let err = q4_error_at(x, d, 1.0 / d);
                if err < best.0 {
                    *best = (err, d);
                }
            }
        };
        for k in KS {
            consider(max / k, &mut best);
        }
        // Refit the winner by least squares for its codes: Σ x·q / Σ q².
        let codes = q4_codes(x, 1.0 / best.1);
        let (mut xq, mut qq) = (0.0f32, 0.0f32);
        for (&v, &n) in x.iter().zip(&codes) {
            let q = n as f32 - 8.0;
            xq += v * q;
            qq += q * q;
        }
        if qq > 0.0 {
            consider(xq / qq, &mut best);
        }
        let d = best.1;
        let codes = q4_codes(x, 1.0 / d);
        b.d = f16::from_f32(d);
        for i in 0..QK / 2 {
            b.qs[i] = codes[i] | (codes[i + QK / 2] << 4);
        }
    }
}

/// INT4 blocks back to f32.
pub fn dequantize_q4_row(src: &[BlockQ4], dst: &mut [f32]) {
    assert_eq!(dst.len(), src.len() * QK, "row length");
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for i in 0..QK / 2 {
            y[i] = d * ((b.qs[i] & 15) as f32 - 8.0);
            y[i + QK / 2] = d * ((b.qs[i] >> 4) as f32 - 8.0);
        }
    }
}

/// Reference: `Σ_j w_j · x_j` over the blocks, integer products per block.
pub fn dot_q4_scalar(w: &[BlockQ4], x: &[BlockA8]) -> f32 {
    assert_eq!(w.len(), x.len());
    let mut s = 0.0f32;
    for (b, a) in w.iter().zip(x) {
        let mut dot = 0i32;
        for i in 0..QK / 2 {
            dot += (b.qs[i] & 15) as i32 * a.qs[i] as i32 + (b.qs[i] >> 4) as i32 * a.qs[i + QK / 2] as i32;
        }
        s += b.d.to_f32() * a.d * (dot - 8 * a.sum) as f32;
    }
    s
}

// ---------------------------------------------------------------- activations

/// Quantizes activations `x` (a multiple of 32 long) to int8 blocks.
pub fn quantize_activations(x: &[f32], dst: &mut [BlockA8]) {
    assert_eq!(x.len(), dst.len() * QK, "activation length");
    #[cfg(target_arch = "x86_64")]
    if crate::isa::Isa::active() >= crate::isa::Isa::Avx2 {
        // SAFETY: AVX2 is present.
        return unsafe { avx2::quantize_activations(x, dst) };
    }
    quantize_activations_scalar(x, dst)
}

/// The reference for [`quantize_activations`]: `d = max|x| / 127`, codes
/// `x · 127 / max|x|` rounded half away from zero.
pub fn quantize_activations_scalar(x: &[f32], dst: &mut [BlockA8]) {
    for (v, b) in x.chunks_exact(QK).zip(dst.iter_mut()) {
        let amax = v.iter().fold(0.0f32, |m, a| m.max(a.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0;
        for (q, &a) in b.qs.iter_mut().zip(v) {
            // Half away from zero, computed as the SIMD twin does.
            let s = a * inv;
            *q = (s + 0.5f32.copysign(s)) as i32 as i8;
            sum += *q as i32;
        }
        b.d = d;
        b.sum = sum;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    //! AVX2 integer kernels: `maddubs` (u8 × i8 → i16 pairs) then `madd` with
    //! ones (→ i32), one f32 FMA per block for the scales.
    use super::{BlockA8, BlockQ4, BlockQ8, QK};
    use std::arch::x86_64::*;

    /// Σ over 32 lanes of `w · x` as 8 i32 partial sums, signed × signed.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dot_i8(w: __m256i, x: __m256i) -> __m256i {
        // maddubs wants u8 × i8: move w's sign onto x.
        let aw = _mm256_sign_epi8(w, w);
        let sx = _mm256_sign_epi8(x, w);
        _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1))
    }

    /// Σ over 32 lanes of `n · x`, `n` in 0..=15 unsigned.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dot_u4(n: __m256i, x: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(n, x), _mm256_set1_epi16(1))
    }

    /// The 32 nibbles of a block as bytes, weight j in lane j: the 16 bytes
    /// in both halves, the upper half shifted right by 4, then masked.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles(qs: *const u8) -> __m256i {
        let b = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs as *const __m128i));
        let shifted = _mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4));
        _mm256_and_si256(shifted, _mm256_set1_epi8(15))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        crate::dot::avx2::hsum(v)
    }

    /// A block's F16 scale, widened by the F16C unit.
    #[inline]
    #[target_feature(enable = "f16c")]
    unsafe fn scale(d: half::f16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(d.to_bits() as i32)))
    }

    /// How far ahead the next blocks of each row are prefetched, in bytes.
    const PREFETCH_AHEAD: usize = 2048;

    /// Four INT8 rows against the same activations.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows4_q8(w: [&[BlockQ8]; 4], x: &[BlockA8]) -> [f32; 4] {
        let n = x.len();
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in 0..n {
            let a = x.get_unchecked(i);
            let xv = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            for k in 0..4 {
                let b = w[k].get_unchecked(i);
                if i % 2 == 0 {
                    // One prefetch per 68 bytes: about one per cache line.
                    _mm_prefetch::<_MM_HINT_T0>((b as *const BlockQ8 as *const i8).wrapping_add(PREFETCH_AHEAD));
                }
                let p = dot_i8(_mm256_loadu_si256(b.qs.as_ptr() as *const __m256i), xv);
                let s = _mm256_set1_ps(a.d * scale(b.d));
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[k]);
            }
        }
        acc.map(|v| hsum(v))
    }

    /// Four INT4 rows against the same activations.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows4_q4(w: [&[BlockQ4]; 4], x: &[BlockA8]) -> [f32; 4] {
        let n = x.len();
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in 0..n {
            let a = x.get_unchecked(i);
            let xv = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
            // Σ (n − 8)·q = Σ n·q − 8·Σ q: the correction, as 8 lanes.
            let corr = _mm256_setr_epi32(8 * a.sum, 0, 0, 0, 0, 0, 0, 0);
            for k in 0..4 {
                let b = w[k].get_unchecked(i);
                if i % 4 == 0 {
                    // One prefetch per 72 bytes: about one per cache line.
                    _mm_prefetch::<_MM_HINT_T0>((b as *const BlockQ4 as *const i8).wrapping_add(PREFETCH_AHEAD));
                }
                let p = _mm256_sub_epi32(dot_u4(nibbles(b.qs.as_ptr()), xv), corr);
                let s = _mm256_set1_ps(a.d * scale(b.d));
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[k]);
            }
        }
        acc.map(|v| hsum(v))
    }

    /// One INT8 row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8(w: &[BlockQ8], x: &[BlockA8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (b, a) in w.iter().zip(x) {
            let p = dot_i8(
                _mm256_loadu_si256(b.qs.as_ptr() as *const __m256i),
                _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i),
            );
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(a.d * scale(b.d)), acc);
        }
        hsum(acc)
    }

    /// One INT4 row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4(w: &[BlockQ4], x: &[BlockA8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (b, a) in w.iter().zip(x) {
            let p = dot_u4(nibbles(b.qs.as_ptr()), _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i));
            let p = _mm256_sub_epi32(p, _mm256_setr_epi32(8 * a.sum, 0, 0, 0, 0, 0, 0, 0));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(a.d * scale(b.d)), acc);
        }
        hsum(acc)
    }

    /// 32 signed codes (one per byte) times `d`, to `y[..32]`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store_scaled(q: __m256i, d: f32, y: *mut f32) {
        let d = _mm256_set1_ps(d);
        let halves = [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)];
        for (h, part) in halves.into_iter().enumerate() {
            let lo = _mm256_cvtepi8_epi32(part);
            let hi = _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(part));
            _mm256_storeu_ps(y.add(16 * h), _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)));
            _mm256_storeu_ps(y.add(16 * h + 8), _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)));
        }
    }

    /// INT8 blocks to f32 (prefill widens a panel of rows at a time).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequantize_q8(src: &[BlockQ8], dst: &mut [f32]) {
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
            store_scaled(_mm256_loadu_si256(b.qs.as_ptr() as *const __m256i), scale(b.d), y.as_mut_ptr());
        }
    }

    /// INT4 blocks to f32.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequantize_q4(src: &[BlockQ4], dst: &mut [f32]) {
        let eight = _mm256_set1_epi8(8);
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
            store_scaled(_mm256_sub_epi8(nibbles(b.qs.as_ptr()), eight), scale(b.d), y.as_mut_ptr());
        }
    }

    /// [`super::quantize_activations_scalar`] with AVX2, bit for bit.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantize_activations(x: &[f32], dst: &mut [BlockA8]) {
        let sign = _mm256_set1_ps(-0.0);
        for (v, b) in x.chunks_exact(QK).zip(dst.iter_mut()) {
            let p = v.as_ptr();
            let r =
                [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
            let m = r.iter().fold(_mm256_setzero_ps(), |m, &v| _mm256_max_ps(m, _mm256_andnot_ps(sign, v)));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let iv = _mm256_set1_ps(inv);
            // Half away from zero: add ±0.5, then truncate.
            let half = _mm256_set1_ps(0.5);
            let q = r.map(|v| {
                let s = _mm256_mul_ps(v, iv);
                let h = _mm256_or_ps(half, _mm256_and_ps(sign, s));
                _mm256_cvttps_epi32(_mm256_add_ps(s, h))
            });
            // 32 × i32 → 32 × i8, in order.
            let a = _mm256_packs_epi32(q[0], q[1]);
            let c = _mm256_packs_epi32(q[2], q[3]);
            let bytes = _mm256_packs_epi16(a, c);
            let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(b.qs.as_mut_ptr() as *mut __m256i, bytes);
            let sum16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes);
            let sum32 = _mm256_madd_epi16(sum16, _mm256_set1_epi16(1));
            let s = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256::<1>(sum32));
            let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
            b.sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s)));
            b.d = amax / 127.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::tests::synth;

    fn rmse(a: &[f32], b: &[f32]) -> f32 {
        (a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f32>() / a.len() as f32).sqrt()
    }

    fn act(x: &[f32]) -> Vec<BlockA8> {
        let mut a = vec![BlockA8::ZERO; x.len() / QK];
        quantize_activations_scalar(x, &mut a);
        a
    }

    /// Round-trip RMSE limits on uniform data in [-1, 1). ggml tests its
    /// 8-bit types at 0.002 on its own synthetic data; on uniform data the
    /// rounding error of a step `d = 1/127` is `d/√12 = 0.00227`, so 0.0025 is
    /// that bound plus margin. For INT4 (`d ≈ 1/7.5`): `0.0385`, limit 0.045.
    const RT_RMSE_Q8: f32 = 0.0025;
    const RT_RMSE_Q4: f32 = 0.045;
    /// ggml's dot-product bar: |quantized dot − exact| per element below 0.02;
    /// here divided by √n instead of n, which is stricter.
    const DOT_ERROR_Q8: f32 = 0.02;
    const DOT_ERROR_Q4: f32 = 0.2;

    /// The table of a format, exercised generically.
    fn format_contract<F: Format>(rmse_limit: f32, dot_limit: f32) {
        let n = 4096;
        let w = synth(n, 21);
        let x = synth(n, 22);
        let mut q = vec![F::ZERO; n / QK];
        F::quantize_row(&w, &mut q);
        let mut back = vec![0.0; n];
        F::dequantize_row(&q, &mut back);
        let e = rmse(&w, &back);
        assert!(e < rmse_limit, "{} rmse {e}", F::QUANT.name());
        let a = act(&x);
        let reference = F::dot_reference(&q, &a);
        let exact: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
        assert!((reference - exact).abs() / (n as f32).sqrt() < dot_limit, "{}", F::QUANT.name());
        for isa in crate::isa::Isa::supported() {
            let mut fast_back = vec![f32::NAN; n];
            F::dequantize(isa, &q, &mut fast_back);
            assert_eq!(fast_back, back, "{} {isa:?} dequantize", F::QUANT.name());
            let fast = F::dot(isa, &q, &a);
            assert!((fast - reference).abs() <= 1e-5 * n as f32, "{} {isa:?}: {fast} vs {reference}", F::QUANT.name());
        }
    }

    #[test]
    fn each_format_keeps_its_contract() {
        format_contract::<Int8>(RT_RMSE_Q8, DOT_ERROR_Q8);
        format_contract::<Int4>(RT_RMSE_Q4, DOT_ERROR_Q4);
    }

    #[test]
    fn round_trip_error_is_small() {
        let x = synth(4096, 1);
        let mut q8 = vec![BlockQ8::ZERO; 128];
        let mut back = vec![0.0; 4096];
        quantize_q8_row(&x, &mut q8);
        dequantize_q8_row(&q8, &mut back);
        assert!(rmse(&x, &back) < RT_RMSE_Q8, "q8 rmse {}", rmse(&x, &back));
        let mut q4 = vec![BlockQ4::ZERO; 128];
        quantize_q4_row(&x, &mut q4);
        dequantize_q4_row(&q4, &mut back);
        let e4 = rmse(&x, &back);
        assert!(e4 < RT_RMSE_Q4, "q4 rmse {e4}");
    }

    #[test]
    fn q4_search_beats_the_fixed_rule() {
        // Q4_0's rule: d = max / −8, codes rounded.
        let x = synth(32 * 512, 2);
        let mut fixed = 0.0;
        for b in x.chunks_exact(QK) {
            let max = b.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            let d = f16::from_f32(max / -8.0).to_f32();
            fixed += q4_error(b, d, &q4_codes(b, 1.0 / d));
        }
        let mut q = vec![BlockQ4::ZERO; 512];
        quantize_q4_row(&x, &mut q);
        let mut back = vec![0.0; x.len()];
        dequantize_q4_row(&q, &mut back);
        let ours: f32 = x.iter().zip(&back).map(|(a, b)| (a - b).powi(2)).sum();
        assert!(ours < 0.85 * fixed, "search {ours} vs fixed {fixed}");
    }

    #[test]
    fn zero_blocks_stay_zero() {
        let x = vec![0.0; 64];
        let (mut q8, mut q4, mut back) = (vec![BlockQ8::ZERO; 2], vec![BlockQ4::ZERO; 2], vec![1.0; 64]);
        quantize_q8_row(&x, &mut q8);
        dequantize_q8_row(&q8, &mut back);
        assert!(back.iter().all(|&v| v == 0.0));
        quantize_q4_row(&x, &mut q4);
        dequantize_q4_row(&q4, &mut back);
        assert!(back.iter().all(|&v| v == 0.0));
        let a = act(&x);
        assert_eq!(dot_q8_scalar(&q8, &a), 0.0);
    }

    #[test]
    fn integer_dots_match_the_dequantized_product() {
        // The integer dot equals the f32 dot of the dequantized weights with
        // the dequantized activations (up to f32 rounding), and is close to
        // the exact f32 product (ggml's dot bar: 0.02 per unit of scale).
        for n in [32, 64, 896, 4864] {
            let w = synth(n, n as u64);
            let x = synth(n, n as u64 + 1);
            let a = act(&x);
            let xd: Vec<f32> = a.iter().flat_map(|b| b.qs.map(|q| q as f32 * b.d)).collect();
            let exact: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
            let (mut q8, mut q4) = (vec![BlockQ8::ZERO; n / QK], vec![BlockQ4::ZERO; n / QK]);
            quantize_q8_row(&w, &mut q8);
            quantize_q4_row(&w, &mut q4);
            let (mut w8, mut w4) = (vec![0.0; n], vec![0.0; n]);
            dequantize_q8_row(&q8, &mut w8);
            dequantize_q4_row(&q4, &mut w4);
            for (name, got, wd) in [("q8", dot_q8_scalar(&q8, &a), &w8), ("q4", dot_q4_scalar(&q4, &a), &w4)] {
                let want: f32 = wd.iter().zip(&xd).map(|(a, b)| a * b).sum();
                assert!((got - want).abs() <= 1e-4 * (n as f32).sqrt(), "{name} n={n}: {got} vs {want}");
                let bar = if name == "q8" { DOT_ERROR_Q8 } else { DOT_ERROR_Q4 };
                assert!((got - exact).abs() / (n as f32).sqrt() < bar, "{name} n={n}: {got} vs exact {exact}");
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn simd_kernels_equal_the_reference() {
        if !crate::isa::Isa::Avx2.is_supported() {
            return;
        }
        for n in [32, 96, 896] {
            let x = synth(n, 7);
            let mut a = vec![BlockA8::ZERO; n / QK];
            let mut b = vec![BlockA8::ZERO; n / QK];
            quantize_activations_scalar(&x, &mut a);
            unsafe { avx2::quantize_activations(&x, &mut b) };
            assert_eq!(a, b, "activations n={n}");
            let rows: Vec<Vec<f32>> = (0..4).map(|r| synth(n, 10 + r)).collect();
            let q8: Vec<Vec<BlockQ8>> = rows
                .iter()
                .map(|r| {
                    let mut q = vec![BlockQ8::ZERO; n / QK];
                    quantize_q8_row(r, &mut q);
                    q
                })
                .collect();
            let q4: Vec<Vec<BlockQ4>> = rows
                .iter()
                .map(|r| {
                    let mut q = vec![BlockQ4::ZERO; n / QK];
                    quantize_q4_row(r, &mut q);
                    q
                })
                .collect();
            let r8 = unsafe { avx2::rows4_q8([&q8[0], &q8[1], &q8[2], &q8[3]], &a) };
            let r4 = unsafe { avx2::rows4_q4([&q4[0], &q4[1], &q4[2], &q4[3]], &a) };
            for k in 0..4 {
                let (w8, w4) = (dot_q8_scalar(&q8[k], &a), dot_q4_scalar(&q4[k], &a));
                let tol = 1e-5 * (n as f32);
                assert!((r8[k] - w8).abs() <= tol, "rows4_q8 {} vs {}", r8[k], w8);
                assert!((r4[k] - w4).abs() <= tol, "rows4_q4 {} vs {}", r4[k], w4);
                assert!((unsafe { avx2::dot_q8(&q8[k], &a) } - w8).abs() <= tol);
                assert!((unsafe { avx2::dot_q4(&q4[k], &a) } - w4).abs() <= tol);
                let (mut d1, mut d2) = (vec![0.0; n], vec![0.0; n]);
                dequantize_q8_row(&q8[k], &mut d1);
                unsafe { avx2::dequantize_q8(&q8[k], &mut d2) };
                assert_eq!(d1, d2);
                dequantize_q4_row(&q4[k], &mut d1);
                unsafe { avx2::dequantize_q4(&q4[k], &mut d2) };
                assert_eq!(d1, d2);
            }
        }
    }
}
