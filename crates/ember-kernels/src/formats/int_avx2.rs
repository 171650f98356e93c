//! AVX2 integer kernels of the INT8, INT4, INT5, Q4_0 and Q5_0 rows: `maddubs` (u8 × i8 → i16
//! pairs) then `madd` with ones (→ i32), or AVX-VNNI's `vpdpbusd`; the i32
//! sums of two INT8 blocks, or of four 32-weight sub-blocks, folded into one
//! register for one f32 conversion and FMA with their scales (`q8`, `x4`);
//! and the int8 activation quantizer. Each requires AVX2, FMA and F16C (and
//! AVX-VNNI for the `vnni` kernels); an `Isa` of the matching tier is the proof.
use super::act::QK_A8 as QK;
use super::act::{BlockA8, BlockA8K, QK_A8K};
use super::int4::{Group4, NibbleBlock, QK4};
use super::int5::planes;
use super::int8::BlockQ8;
use super::q4_0::BlockQ4_0;
use super::PREFETCH_AHEAD;
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

/// The 32 nibbles of a block as bytes, weight j in lane j: the 16 bytes
/// in both halves, the upper half shifted right by 4, then masked.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn nibbles(qs: *const u8) -> __m256i {
    let b = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs as *const __m128i));
    let shifted = _mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4));
    _mm256_and_si256(shifted, _mm256_set1_epi8(15))
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    super::float::avx2::hsum(v)
}

/// A block's F16 scale, widened by the F16C unit.
#[inline]
#[target_feature(enable = "f16c")]
pub(super) unsafe fn scale(d: half::f16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(d.to_bits() as i32)))
}

/// Prefetches into L1, [`PREFETCH_AHEAD`] bytes on, the cache lines of one
/// step of a row: the line of `at` and the line after it. Called once for
/// each of a row's consecutive steps of `step` bytes (at most two lines'
/// worth, 128), that covers every line of the row: a step starts in the
/// line after the last one's first or in the one after that, and both
/// were prefetched. The INT8 and INT4 kernels consume 68 and 72 bytes a
/// step; one prefetch at each step's start advanced 68 or 72 bytes at a
/// time and so jumped over one line in 17 or in 9, which the kernel then
/// waited for from memory. (Prefetching a step's first and last byte is
/// not enough: 68 bytes starting in a line's last three span three lines.)
/// Emerald Rapids with AMX, one thread, 1 GB of 896-column INT4 rows:
/// 86–89% of a plain read of the same bytes with one prefetch a step,
/// 90–96% with two.
///
/// `on` is [`crate::cpu::software_prefetch`], read once per row group by
/// the caller (read here, at every step, it cost up to 14% in cache): where
/// the hardware is left the streams, nothing.
#[inline(always)]
pub(super) fn prefetch_step(at: *const u8, step: usize, on: bool) {
    debug_assert!((1..=128).contains(&step));
    if !on {
        return;
    }
    let ahead = at.wrapping_add(PREFETCH_AHEAD) as *const i8;
    // SAFETY: a prefetch is a hint that never faults (any address); SSE is
    // baseline on x86-64.
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(ahead);
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
    }
}

/// INT8 decoding on the 256-bit tiers, two blocks of a row a step: each
/// block's integer products fill a register of eight i32 partial sums; one
/// horizontal add folds the two into one register (block i's sums in
/// lanes 0, 1, 4, 5, block j's in 2, 3, 6, 7), so a step costs each row one
/// conversion, one scale permute and one FMA for 64 weights. The four rows'
/// F16 scales of both blocks widen in one conversion ([`scale_pairs`]).
/// One block a step, as before, spent on each block a conversion, an FMA and
/// four operations on its scale (load, widen, multiply by the activation's,
/// broadcast) beside the six of its dot product. Emerald Rapids, one
/// thread, 896 × 896 in L2 (criterion, three runs each): `avx2` 16.1,
/// 15.2, 15.9 → 25.5, 23.7, 23.0 GiB/s; `avxvnni` (which had no INT8
/// kernel of its own) 16.4, 16.0, 16.5 → 27.9, 27.5, 26.3.
pub mod q8 {
    use super::*;

    /// Row `k`'s two scales from [`scale_pairs`]' lanes `[i: rows 0..4 | j:
    /// rows 0..4]` as `[i, i, j, j, i, i, j, j]`, where the horizontal add
    /// put each block's sums.
    #[inline(always)]
    unsafe fn row_scales(d: __m256, k: usize) -> __m256 {
        let k = k as i32;
        _mm256_permutevar8x32_ps(d, _mm256_setr_epi32(k, k, 4 + k, 4 + k, k, k, 4 + k, 4 + k))
    }

    macro_rules! kernels {
        ($module:ident, $features:literal, $doc:literal, |$w:ident, $x:ident, $start:ident| $dot:expr) => {
            #[doc = $doc]
            pub mod $module {
                use super::*;

                /// `R` INT8 rows against the same activations, two blocks a
                /// step; an odd last block pairs with zero activations.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn rows<const R: usize>(w: [&[BlockQ8]; R], x: &[BlockA8]) -> [f32; R] {
                    const { assert!(R <= 4, "scale_pairs() packs 4 rows' F16 scales in 64 bits") };
                    let n = x.len();
                    debug_assert!(w.iter().all(|row| row.len() == n));
                    let ahead = crate::cpu::software_prefetch();
                    let mut acc = [_mm256_setzero_ps(); R];
                    let mut i = 0;
                    while i < n {
                        let a = x.get_unchecked(i);
                        let (j, xj, sj, dj) = match x.get(i + 1) {
                            Some(b) => (i + 1, _mm256_loadu_si256(b.qs.as_ptr() as *const __m256i), b.sum, b.d),
                            None => (i, _mm256_setzero_si256(), 0, 0.0),
                        };
                        let xi = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                        let d = scale_pairs(&w, i, j, _mm256_setr_m128(_mm_set1_ps(a.d), _mm_set1_ps(dj)));
                        for k in 0..R {
                            let (bi, bj) = (w[k].get_unchecked(i), w[k].get_unchecked(j));
                            prefetch_step(bi as *const BlockQ8 as *const u8, 2 * std::mem::size_of::<BlockQ8>(), ahead);
                            let pi = {
                                let ($w, $x, $start) =
                                    (_mm256_loadu_si256(bi.qs.as_ptr() as *const __m256i), xi, a.sum);
                                $dot
                            };
                            let pj = {
                                let ($w, $x, $start) = (_mm256_loadu_si256(bj.qs.as_ptr() as *const __m256i), xj, sj);
                                $dot
                            };
                            let s = _mm256_hadd_epi32(pi, pj);
                            acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), row_scales(d, k), acc[k]);
                        }
                        i += 2;
                    }
                    acc.map(|v| hsum(v))
                }

                /// Four INT8 rows against the same activations.
                #[target_feature(enable = $features)]
                pub unsafe fn rows4_q8(w: [&[BlockQ8]; 4], x: &[BlockA8]) -> [f32; 4] {
                    rows(w, x)
                }

                /// One INT8 row.
                #[target_feature(enable = $features)]
                pub unsafe fn dot_q8(w: &[BlockQ8], x: &[BlockA8]) -> f32 {
                    rows([w], x)[0]
                }
            }
        };
    }

    kernels!(
        avx2,
        "avx2,fma,f16c",
        "With `vpmaddubsw` + `vpmaddwd`, the weights' signs moved onto the activations.",
        |w, x, _start| dot_i8(w, x)
    );

    kernels!(
        vnni,
        "avx2,fma,f16c,avxvnni",
        "With `vpdpbusd` (AVX-VNNI): the codes made unsigned (`q + 128`), the \
         accumulator starting at `−128 · Σx` in its first lane.",
        |w, x, start| _mm256_dpbusd_avx_epi32(
            _mm256_zextsi128_si256(_mm_cvtsi32_si128(-128 * start)),
            _mm256_xor_si256(w, _mm256_set1_epi8(-128)),
            x
        )
    );
}

/// 32 signed codes (one per byte) times `d`, to `y[..32]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn store_scaled(q: __m256i, d: f32, y: *mut f32) {
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

/// Q4_0 blocks to f32.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequantize_q4_0(src: &[BlockQ4_0], dst: &mut [f32]) {
    let eight = _mm256_set1_epi8(8);
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        store_scaled(_mm256_sub_epi8(nibbles(b.qs.as_ptr()), eight), scale(b.d), y.as_mut_ptr());
    }
}

/// 32 bits as 32 bytes, byte `j` 16 where bit `j` is set and 0 elsewhere
/// (INT5's fifth bits, for tiers without mask registers): each byte picks
/// its bit's byte, tests its bit, and the all-ones result keeps 16.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn fifth_bits(bits: u32) -> __m256i {
    let v = _mm256_set1_epi32(bits as i32);
    let byte = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(v, byte), bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

/// INT4 and INT5 blocks ([`NibbleBlock`]) to f32: per sub-block its
/// nibbles as a Q4_0 block's and, for INT5, the fifth bits of its 32
/// weights gathered from the two planes into one u32.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequantize_x4<B: NibbleBlock>(src: &[B], dst: &mut [f32]) {
    let offset = _mm256_set1_epi8(B::OFFSET as i8);
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK4)) {
        let planes = b.fifth_bits().map(planes);
        for s in 0..4 {
            let mut codes = nibbles(b.nibbles().as_ptr().add(16 * s));
            if let Some([lo, hi]) = planes {
                let bits = ((lo >> (16 * s)) & 0xffff) as u32 | (((hi >> (16 * s)) & 0xffff) as u32) << 16;
                codes = _mm256_or_si256(codes, fifth_bits(bits));
            }
            store_scaled(_mm256_sub_epi8(codes, offset), scale(b.scales()[s]), y.as_mut_ptr().add(QK * s));
        }
    }
}

/// The largest `|x|` of `x` (a multiple of 32 long).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn abs_max(x: &[f32]) -> f32 {
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for v in x.chunks_exact(8) {
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v.as_ptr())));
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)))
}

/// The 32 codes of `p[..32]` at `inv` (`x · inv` rounded half away from
/// zero, as the scalar quantizers do), in order.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn codes32(p: *const f32, inv: f32) -> __m256i {
    let sign = _mm256_set1_ps(-0.0);
    let iv = _mm256_set1_ps(inv);
    // Half away from zero: add ±0.5, then truncate.
    let half = _mm256_set1_ps(0.5);
    let r = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
    let q = r.map(|v| {
        let s = _mm256_mul_ps(v, iv);
        let h = _mm256_or_ps(half, _mm256_and_ps(sign, s));
        _mm256_cvttps_epi32(_mm256_add_ps(s, h))
    });
    // 32 × i32 → 32 × i8, in order.
    let a = _mm256_packs_epi32(q[0], q[1]);
    let c = _mm256_packs_epi32(q[2], q[3]);
    let bytes = _mm256_packs_epi16(a, c);
    _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// [`super::quantize_activations_scalar`] with AVX2, bit for bit.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_activations(x: &[f32], dst: &mut [BlockA8]) {
    for (v, b) in x.chunks_exact(QK).zip(dst.iter_mut()) {
        let amax = abs_max(v);
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let bytes = codes32(v.as_ptr(), inv);
        _mm256_storeu_si256(b.qs.as_mut_ptr() as *mut __m256i, bytes);
        let sum16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes);
        let sum32 = _mm256_madd_epi16(sum16, _mm256_set1_epi16(1));
        let s = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256::<1>(sum32));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        b.sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s)));
        b.d = amax / 127.0;
    }
}

/// [`super::act::quantize_activations_k_scalar`] with AVX2, bit for bit.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_activations_k(x: &[f32], dst: &mut [BlockA8K]) {
    for (v, b) in x.chunks_exact(QK_A8K).zip(dst.iter_mut()) {
        let amax = abs_max(v);
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for (c, q) in v.chunks_exact(QK).zip(b.qs.chunks_exact_mut(QK)) {
            _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, codes32(c.as_ptr(), inv));
        }
        // The sums of 16: 16 i16 pair sums, then pairs of those (`vphaddw`).
        for (g, q) in b.qs.chunks_exact(2 * QK).enumerate() {
            let ones = _mm256_set1_epi8(1);
            let p0 = _mm256_maddubs_epi16(ones, _mm256_loadu_si256(q.as_ptr() as *const __m256i));
            let p1 = _mm256_maddubs_epi16(ones, _mm256_loadu_si256(q.as_ptr().add(QK) as *const __m256i));
            // Within each 128-bit lane: sums of 4 bytes, then of 8, then of 16.
            let s = _mm256_hadd_epi16(p0, p1);
            let s = _mm256_hadd_epi16(s, s);
            let s = _mm256_hadd_epi16(s, s);
            // Lane 0 of each half: [p0 lo, p1 lo] sums; 16-bit words 0, 1 of each 128-bit lane.
            let lo = _mm256_extract_epi16::<0>(s) as i16;
            let lo1 = _mm256_extract_epi16::<1>(s) as i16;
            let hi = _mm256_extract_epi16::<8>(s) as i16;
            let hi1 = _mm256_extract_epi16::<9>(s) as i16;
            // p0's 16-byte halves are groups 4g, 4g + 1; p1's 4g + 2, 4g + 3.
            b.bsums[4 * g] = lo;
            b.bsums[4 * g + 1] = hi;
            b.bsums[4 * g + 2] = lo1;
            b.bsums[4 * g + 3] = hi1;
        }
        b.d = amax / 127.0;
    }
}

/// `d_w · d_x` of blocks `i` and `j` of up to 4 rows: row k's block i in
/// lane k of the low 128-bit lane, its block j in lane k of the high one
/// (`dx` holds the activations' two scales the same way). The F16 scales
/// are gathered by the integer unit (idle here) and widened in one
/// conversion, where converting and spreading each row's pair took six or
/// seven vector operations, most of them shuffles. Used by the AVX-512
/// INT8 kernel. Same bits; on Zen 3 (INT4, one thread, 896 × 896 in
/// L2, both kernels alternated in one process, 200 rounds) 3-6% faster at
/// the median: 9.1 → 9.4 and 9.4 → 9.7 GB/s, the kernel staying
/// compute-bound at about 10 cycles per row and pair of blocks, with the
/// rows in L1 too. On Emerald Rapids (AVX-512 INT8, same harness): 27.4 →
/// 34.9 and 28.3 → 37.2 GB/s while the VM was quiet, equal while it was
/// loaded.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn scale_pairs<const R: usize>(w: &[&[BlockQ8]; R], i: usize, j: usize, dx: __m256) -> __m256 {
    let gather = |b: usize| (0..R).fold(0u64, |a, k| a | (w[k].get_unchecked(b).d.to_bits() as u64) << (16 * k));
    let h = _mm_set_epi64x(gather(j) as i64, gather(i) as i64);
    _mm256_mul_ps(_mm256_cvtph_ps(h), dx)
}

/// INT4, INT5, Q4_0 and Q5_0 decoding two 32-weight sub-blocks per 256-bit
/// register, for the AVX2 and AVX-VNNI tiers (the AVX-512 tiers hold four:
/// `int_avx512`). A step takes a group of four sub-blocks ([`Group4`]: an
/// INT4 or INT5 block, or four Q4_0 or Q5_0 blocks). Register `r` holds
/// sub-blocks `2r` and `2r + 1`, one per 128-bit lane, as the activations'
/// quad lays out its blocks ([`BlockA8x4`]): each lane's low nibbles
/// (weights 0..16) meet the activations' first halves and its high nibbles
/// the second, so no nibble moves across lanes. Fifth bits are spread to
/// bytes by [`fifth_bits`]. Each row keeps its own accumulator: its two
/// registers' i32 sums are folded into one by a horizontal add (each
/// sub-block's sums in two lanes), which takes the step's offset term,
/// one conversion and one FMA, with one permute spreading the four scales.
/// (A conversion, a permute, an offset add and an FMA per register before:
/// Emerald Rapids pinned to `avx2`, one thread, INT4 896 × 896 in L2,
/// criterion, two runs each: 15.5, 15.4 → 18.5, 18.0 GiB/s; `avxvnni`
/// 19.7, 19.1 → 20.3, 21.2. The whole groups then got a loop of their own,
/// away from the padded one, and the activations are read where they are
/// used: the rows' pointers and accumulators had gone to the stack; `avx2`
/// 16.8, 17.6 → 20.5, 21.0.) The activations come as blocks (a
/// quad built per step, [`crate::formats::quad_at`]) or laid out once per
/// mat-vec: the same steps, so the same bits.
///
/// Q4_0 had a kernel of its own here that folded four rows' integer sums
/// into one register by horizontal adds (one conversion and one FMA per
/// four rows and two blocks). It added the blocks in another f32 order
/// than INT4's, so an INT4 model and its GGUF twin (the same numbers as
/// Q4_0) differed by 0.27 in a 5-token prompt's last logits on these tiers
/// (int8 activations turn a last-bit difference into a whole code now and
/// then), where the AVX-512 tiers, sharing one step, agree to the bit.
pub mod x4 {
    use super::*;
    use crate::formats::act::{quad_at, BlockA8x4};

    macro_rules! kernels {
        ($module:ident, $features:literal, $doc:literal, |$lo:ident, $hi:ident, $xlo:ident, $xhi:ident| $dot:expr) => {
            #[doc = $doc]
            pub mod $module {
                use super::*;

                /// Group `m` of `R` rows against the quad `q`. Always
                /// inlined (into [`steps`], whose features it then has):
                /// Q5_0's four rows were a call per step otherwise.
                #[inline(always)]
                unsafe fn step<B: Group4, const R: usize>(
                    w: &[&[B]; R],
                    m: usize,
                    q: &BlockA8x4,
                    acc: &mut [__m256; R],
                    ahead: bool,
                ) {
                    debug_assert!(w.iter().all(|row| row.len() >= (m + 1) * B::BLOCKS));
                    let nibble = _mm256_set1_epi8(15);
                    // After the horizontal add of registers 0 and 1, lanes 0, 1 hold
                    // sub-block 0's sums, 2, 3 sub-block 2's, 4, 5 sub-block 1's, 6, 7 sub-block 3's.
                    let spread = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
                    let dx = _mm_loadu_ps(q.d.as_ptr());
                    // −8 · Σx of each sub-block in its first lane there (doubled for offset 16).
                    let start = _mm256_hadd_epi32(
                        _mm256_load_si256(q.start.as_ptr() as *const __m256i),
                        _mm256_load_si256(q.start.as_ptr().add(8) as *const __m256i),
                    );
                    let start = if B::OFFSET == 16 { _mm256_add_epi32(start, start) } else { start };
                    let (lo, hi) = (q.lo.as_ptr() as *const __m256i, q.hi.as_ptr() as *const __m256i);
                    for k in 0..R {
                        let g = w[k].as_ptr().add(m * B::BLOCKS);
                        prefetch_step(g as *const u8, B::BLOCKS * std::mem::size_of::<B>(), ahead);
                        let d4 = _mm256_castps128_ps256(_mm_mul_ps(
                            _mm_cvtph_ps(_mm_cvtsi64_si128(B::scales(g) as i64)),
                            dx,
                        ));
                        let mut sums = [_mm256_setzero_si256(); 2];
                        for r in 0..2 {
                            let [p0, p1] = B::nibbles(g, r);
                            let bytes = if p1 == p0.add(16) {
                                _mm256_loadu_si256(p0 as *const __m256i)
                            } else {
                                _mm256_loadu2_m128i(p1 as *const __m128i, p0 as *const __m128i)
                            };
                            let mut $lo = _mm256_and_si256(bytes, nibble);
                            let mut $hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), nibble);
                            if let Some([low, high]) = B::fifth(g, r) {
                                $lo = _mm256_or_si256($lo, fifth_bits(low));
                                $hi = _mm256_or_si256($hi, fifth_bits(high));
                            }
                            let ($xlo, $xhi) = (_mm256_load_si256(lo.add(r)), _mm256_load_si256(hi.add(r)));
                            sums[r] = $dot;
                        }
                        let s = _mm256_add_epi32(_mm256_hadd_epi32(sums[0], sums[1]), start);
                        let d = _mm256_permutevar8x32_ps(d4, spread);
                        acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, acc[k]);
                    }
                }

                /// `R` rows over `groups` groups, `quad(m)` group `m`'s
                /// activations. Rows whose sub-blocks are not a multiple of
                /// four (ggml rows) end in a group padded with zeros. One
                /// call of [`step`], so that it is inlined.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn steps<B: Group4, Q: std::borrow::Borrow<BlockA8x4>, const R: usize>(
                    w: &[&[B]; R],
                    groups: usize,
                    quad: impl Fn(usize) -> Q,
                ) -> [f32; R] {
                    let whole = (w[0].len() / B::BLOCKS).min(groups);
                    let mut acc = [_mm256_setzero_ps(); R];
                    let ahead = crate::cpu::software_prefetch();
                    // The whole groups in a loop of their own, so that the
                    // rows' pointers stay in registers (with the padded group
                    // chosen inside the loop, they went to the stack).
                    for m in 0..whole {
                        step(w, m, quad(m).borrow(), &mut acc, ahead);
                    }
                    if whole < groups {
                        debug_assert_eq!(groups, whole + 1, "one padded group at most");
                        let pads: [[B; 4]; R] = std::array::from_fn(|k| {
                            let mut p = [B::ZERO; 4];
                            let rest = &w[k][whole * B::BLOCKS..];
                            p[..rest.len()].copy_from_slice(rest);
                            p
                        });
                        let rows: [&[B]; R] = std::array::from_fn(|k| &pads[k][..]);
                        step(&rows, 0, quad(whole).borrow(), &mut acc, ahead);
                    }
                    acc.map(|v| hsum(v))
                }

                /// `R` rows against the same activations.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn rows<B: Group4, const R: usize>(w: [&[B]; R], x: &[BlockA8]) -> [f32; R] {
                    debug_assert_eq!(x.len() * B::BLOCKS, 4 * w[0].len());
                    steps(&w, x.len().div_ceil(4), |m| quad_at(&x[4 * m..x.len().min(4 * m + 4)]))
                }

                /// Four rows against the same activations.
                #[target_feature(enable = $features)]
                pub unsafe fn rows4_x4<B: Group4>(w: [&[B]; 4], x: &[BlockA8]) -> [f32; 4] {
                    rows(w, x)
                }

                /// Four rows against activations laid out by
                /// [`crate::formats::quads_of`]: [`rows4_x4`]'s bits.
                #[target_feature(enable = $features)]
                pub unsafe fn rows4_x4_quads<B: Group4>(w: [&[B]; 4], x: &[BlockA8x4]) -> [f32; 4] {
                    debug_assert_eq!(x.len(), (4 * w[0].len() / B::BLOCKS).div_ceil(4));
                    steps(&w, x.len(), |m| x.get_unchecked(m))
                }

                /// One row.
                #[target_feature(enable = $features)]
                pub unsafe fn dot_x4<B: Group4>(w: &[B], x: &[BlockA8]) -> f32 {
                    rows([w], x)[0]
                }
            }
        };
    }

    kernels!(
        avx2,
        "avx2,fma,f16c",
        "With `vpmaddubsw`: the low and high halves' pair sums added as i16 (at most 2 · 2 · 31 · 127 = 15748), \
         then one `vpmaddwd`.",
        |lo, hi, xlo, xhi| _mm256_madd_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi)),
            _mm256_set1_epi16(1)
        )
    );

    kernels!(
        vnni,
        "avx2,fma,f16c,avxvnni",
        "With `vpdpbusd` (AVX-VNNI): two instructions per register.",
        |lo, hi, xlo, xhi| _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi)
    );
}
