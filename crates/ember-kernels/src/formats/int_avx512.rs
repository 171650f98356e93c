//! AVX-512 decoding kernels of the INT4, INT5, INT8, Q4_0 and Q5_0 rows:
//! several blocks of a row per 512-bit register.
//!
//! A kernel that takes one 32-weight block at a time spends most of its
//! instructions on per-block work that is not the dot product itself:
//! widening one F16 scale, multiplying it by the activation block's,
//! broadcasting it, converting the block's integer sum and adding it in
//! (about 7 of 11 instructions for a Q4_0 block). At 18 bytes per block
//! that bounded a thread at ~8 GB/s even in L2, below the memory's share
//! (`cargo bench -p ember-benches -- "matvec .*/q4_0"`). Here a register
//! holds four 32-weight blocks (`Quad`; INT8 two, `Pair`), and:
//! - the products land in i32 lanes already offset: the accumulator starts
//!   at `−offset · Σx` for each block, so `vpdpbusd` (or `vpmaddubsw` +
//!   `vpmaddwd` without VNNI) gives `Σ (u − offset)·x` with no subtraction;
//! - the blocks' F16 scales widen in one conversion, meet the activation
//!   scales in one multiply and spread over their lanes in one permute
//!   (INT8 converts four rows' scales at once: [`scale_pairs`]);
//! - one conversion and one FMA per register.
//!
//! ember's INT4 and INT5 blocks ([`NibbleBlock`]) are four sub-blocks laid
//! out for this step: the nibbles are one 64-byte load, one sub-block per
//! 128-bit lane, the scales one 8-byte load; INT5's fifth bits are two
//! planes loaded straight into mask registers. ggml's Q4_0 and Q5_0 (as GGUF
//! files carry them) take the same step from 18- and 22-byte blocks: Q4_0's
//! nibbles by four broadcast loads and three blends and its scales by a
//! word permute; Q5_0's whole step (88 bytes) by two loads and two word
//! permutes, its fifth bits turned into a mask register by a byte shuffle
//! and a bit test. Emerald Rapids, one thread, 4864 × 896 in cache:
//! INT4 33.8 GiB/s against Q4_0's 24.0 (`avx512vnni`).
//!
//! The activations' side (bytes, starts and scales) is built once per step
//! and shared by the four rows. Blocks past a row's end pair with zero
//! activations. Each function requires AVX-512F and BW (and VNNI for the
//! `vnni` ones); an `Isa` of the matching tier is the proof.
use super::act::{BlockA8, BlockA8x4};
use super::int4::NibbleBlock;
use super::int8::BlockQ8;
use super::int_avx2::{prefetch_step, scale_pairs};
use super::q4_0::BlockQ4_0;
use super::q5_0::BlockQ5_0;
use std::arch::x86_64::*;

/// Two activation blocks as one step's operands for INT8, whose codes the
/// kernel makes unsigned (`q + 128`: offset 128).
struct Pair {
    /// Both blocks' 32 bytes: block i in the low half, i + 1 in the high.
    x: __m512i,
    /// `−128 · Σx` in lane 0 of each half, zero elsewhere.
    start: __m512i,
    /// Block i's activation scale in lanes 0..4, block i + 1's in 4..8 (to
    /// meet [`scale_pairs`]' layout of four rows' weight scales).
    d: __m256,
}

/// The activation pair at block `i` (`i + 1` may be past the end: zeros).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pair(x: &[BlockA8], i: usize) -> Pair {
    let a = x.get_unchecked(i);
    let lo = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
    let (hi, s1, d1) = match x.get(i + 1) {
        Some(b) => (_mm256_loadu_si256(b.qs.as_ptr() as *const __m256i), b.sum, b.d),
        None => (_mm256_setzero_si256(), 0, 0.0),
    };
    let start = _mm512_maskz_set1_epi32(1, -128 * a.sum);
    let start = _mm512_mask_set1_epi32(start, 1 << 8, -128 * s1);
    Pair {
        x: _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi),
        start,
        d: _mm256_setr_m128(_mm_set1_ps(a.d), _mm_set1_ps(d1)),
    }
}

/// [`scale_pairs`]' eight lanes as 128-bit lanes `[i, i, j, j]` (block i's
/// four rows twice, then block j's): one shuffle shared by the rows, so each
/// row spreads its two scales with one in-lane permute ([`row_scales`]).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn widen_scales(s: __m256) -> __m512 {
    let s = _mm512_castps256_ps512(s);
    _mm512_shuffle_f32x4::<0b01_01_00_00>(s, s)
}

/// Row `k`'s two scales from [`widen_scales`], block i's over lanes 0..8
/// and block j's over 8..16: one in-lane permute. (A full permute by an
/// index vector became two shuffles in LLVM's hands.)
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn row_scales(s: __m512, k: usize) -> __m512 {
    match k {
        0 => _mm512_permute_ps::<0x00>(s),
        1 => _mm512_permute_ps::<0x55>(s),
        2 => _mm512_permute_ps::<0xaa>(s),
        _ => _mm512_permute_ps::<0xff>(s),
    }
}

/// Four activation blocks as one step's operands: each 128-bit lane
/// of a register holds one block's half, so the low nibbles of four weight
/// blocks (weights 0..16 of each) meet `lo` and the high nibbles (16..32)
/// meet `hi` with no reordering of the weights.
struct Quad {
    /// Bytes 0..16 of blocks i..i+4, one block per 128-bit lane.
    lo: __m512i,
    /// Bytes 16..32 of the same blocks.
    hi: __m512i,
    /// `−8 · Σx` in lane 0 of each 128-bit lane, zero elsewhere.
    start: __m512i,
    /// The four activation scales.
    d: __m128,
}

/// The activation quad at block `i`; blocks past the end are zeros.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quad(x: &[BlockA8], i: usize) -> Quad {
    let get = |j: usize| match x.get(i + j) {
        Some(a) => (_mm256_loadu_si256(a.qs.as_ptr() as *const __m256i), a.sum, a.d),
        None => (_mm256_setzero_si256(), 0, 0.0),
    };
    let (x0, s0, d0) = get(0);
    let (x1, s1, d1) = get(1);
    let (x2, s2, d2) = get(2);
    let (x3, s3, d3) = get(3);
    let a = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x0), x1);
    let b = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x2), x3);
    Quad {
        // 128-bit lanes [a0, a2, b0, b2] and [a1, a3, b1, b3].
        lo: _mm512_shuffle_i64x2::<0b10_00_10_00>(a, b),
        hi: _mm512_shuffle_i64x2::<0b11_01_11_01>(a, b),
        start: _mm512_setr_epi32(-8 * s0, 0, 0, 0, -8 * s1, 0, 0, 0, -8 * s2, 0, 0, 0, -8 * s3, 0, 0, 0),
        d: _mm_setr_ps(d0, d1, d2, d3),
    }
}

/// Four Q4_0 blocks' 16 packed bytes, one block per 128-bit lane: by
/// 128-bit broadcast loads, which take only the load ports, and three
/// blends (three inserts would take the shuffle port).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn qs4(b: [&BlockQ4_0; 4]) -> __m512i {
    lanes4(b.map(|b| b.qs.as_ptr()))
}

/// The 16 bytes at each of `at`, one per 128-bit lane (see [`qs4`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn lanes4(at: [*const u8; 4]) -> __m512i {
    let load = |k: usize| _mm512_broadcast_i32x4(_mm_loadu_si128(at[k] as *const __m128i));
    let (b02, b13) =
        (_mm512_mask_blend_epi32(0xff00, load(0), load(2)), _mm512_mask_blend_epi32(0xff00, load(1), load(3)));
    _mm512_mask_blend_epi32(0xf0f0, b02, b13)
}

/// Four values over their 128-bit lanes: `v[b]` in lanes `4b..4b + 4`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn spread4(v: __m128) -> __m512 {
    _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_castps128_ps512(v))
}

/// The blocks of the four-block step at block `i` of a row of `n`: past the
/// end, the last block again (its activations are zero, so it adds nothing).
#[inline(always)]
fn step_blocks(i: usize, n: usize) -> [usize; 4] {
    [i, (i + 1).min(n - 1), (i + 2).min(n - 1), (i + 3).min(n - 1)]
}

/// Four blocks' `d_w · d_x`, each over its 128-bit lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn scales4(d: [half::f16; 4], dx: __m128) -> __m512 {
    let h = _mm_cvtsi32_si128(d[0].to_bits() as i32);
    let h = _mm_insert_epi16::<1>(h, d[1].to_bits() as i32);
    let h = _mm_insert_epi16::<2>(h, d[2].to_bits() as i32);
    let h = _mm_insert_epi16::<3>(h, d[3].to_bits() as i32);
    let s = _mm_mul_ps(_mm_cvtph_ps(h), dx);
    spread4(s)
}

/// Two INT8 blocks' bytes as unsigned codes `q + 128`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn codes8(b0: &BlockQ8, b1: &BlockQ8) -> __m512i {
    let lo = _mm256_loadu_si256(b0.qs.as_ptr() as *const __m256i);
    let hi = _mm256_loadu_si256(b1.qs.as_ptr() as *const __m256i);
    _mm512_xor_si512(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi), _mm512_set1_epi8(-128))
}

/// The constants of the Q5_0 step: which byte of a lane's head each code
/// byte reads its fifth bit from (`qh` is bytes 2..6; weights 0..16 take
/// bytes 2 and 3, weights 16..32 bytes 4 and 5), the bit within it, and the
/// word picks that spread the four scales (word 8b of the heads) over
/// their blocks' lanes.
struct Q5Consts {
    lo_bytes: __m512i,
    hi_bytes: __m512i,
    bit: __m512i,
    picks: __m512i,
    /// Word indices for `vpermt2w` over a whole step's 88 bytes (bytes
    /// 0..64, then bytes 24..88): the codes of block b into lane b ...
    qs_words: __m512i,
    /// ... and its scale and `qh` into lane b's first three words (where a
    /// block's first 16 bytes put them).
    head_words: __m512i,
}

/// The Q5_0 step's index and bit tables, computed at compile time and
/// loaded once per call of four rows.
#[repr(C, align(64))]
struct Q5Tables {
    lo_bytes: [u8; 64],
    hi_bytes: [u8; 64],
    bit: [u8; 64],
    picks: [u16; 32],
    qs_words: [u16; 32],
    head_words: [u16; 32],
}

static Q5_TABLES: Q5Tables = {
    let mut t = Q5Tables {
        lo_bytes: [0; 64],
        hi_bytes: [0; 64],
        bit: [0; 64],
        picks: [0; 32],
        qs_words: [0; 32],
        head_words: [0; 32],
    };
    // Word w of a whole step: from the first load below 32, else from the second.
    const fn from(w: usize) -> u16 {
        if w < 32 {
            w as u16
        } else {
            (32 + w - 12) as u16
        }
    }
    let mut i = 0;
    while i < 64 {
        let j = i % 16;
        t.lo_bytes[i] = 2 + (j / 8) as u8;
        t.hi_bytes[i] = 4 + (j / 8) as u8;
        t.bit[i] = 1 << (i % 8);
        i += 1;
    }
    let mut w = 0;
    while w < 32 {
        let (lane, at) = (w / 8, w % 8);
        t.picks[w] = if w < 16 { 8 * (w / 4) as u16 } else { 0 };
        t.qs_words[w] = from(11 * lane + 3 + at);
        t.head_words[w] = from(11 * lane + if at < 3 { at } else { 0 });
        w += 1;
    }
    t
};

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn q5_consts() -> Q5Consts {
    let t = &Q5_TABLES;
    let load = |p: *const u8| _mm512_load_si512(p as *const _);
    Q5Consts {
        qs_words: load(t.qs_words.as_ptr() as *const u8),
        head_words: load(t.head_words.as_ptr() as *const u8),
        lo_bytes: load(t.lo_bytes.as_ptr()),
        hi_bytes: load(t.hi_bytes.as_ptr()),
        bit: load(t.bit.as_ptr()),
        picks: load(t.picks.as_ptr() as *const u8),
    }
}

macro_rules! kernels {
    ($module:ident, $features:literal, $doc:literal, |$acc:ident, $u:ident, $x:ident| $dot:expr) => {
        #[doc = $doc]
        pub mod $module {
            use super::*;

            /// `acc + Σ u·x` per i32 lane (four adjacent byte pairs), `u`
            /// unsigned, `x` signed.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn dot($acc: __m512i, $u: __m512i, $x: __m512i) -> __m512i {
                $dot
            }

            /// `R` Q4_0 rows against the same activations, four blocks per
            /// step (see [`Quad`]).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn rows_q4_0<const R: usize>(w: [&[BlockQ4_0]; R], x: &[BlockA8]) -> [f32; R] {
                let n = x.len();
                let ahead = crate::cpu::software_prefetch();
                let mut acc = [_mm512_setzero_ps(); R];
                let nibble = _mm512_set1_epi8(15);
                let mut i = 0;
                while i < n {
                    let q = quad(x, i);
                    let b = step_blocks(i, n);
                    for k in 0..R {
                        let row = w[k];
                        let blocks = b.map(|j| row.get_unchecked(j));
                        if i % 4 == 0 {
                            prefetch_step(
                                blocks[0] as *const BlockQ4_0 as *const u8,
                                4 * std::mem::size_of::<BlockQ4_0>(),
                                ahead,
                            );
                        }
                        let bytes = qs4(blocks);
                        let lo = _mm512_and_si512(bytes, nibble);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), nibble);
                        let s = dot(dot(q.start, lo, q.lo), hi, q.hi);
                        acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scales4(blocks.map(|b| b.d), q.d), acc[k]);
                    }
                    i += 4;
                }
                acc.map(|v| _mm512_reduce_add_ps(v))
            }

            /// [`rows_q4_0`] over activations laid out once per mat-vec
            /// ([`BlockA8x4`]): the same products and sums in the same
            /// order, so the same bits, without building each quad again
            /// for every four rows. Two more savings on the weights' side,
            /// each measured alone: the four blocks' bytes by 128-bit
            /// broadcast loads (the load ports only) and three blends, and
            /// on whole steps the four F16 scales picked from one 64-byte
            /// load by one word permute, already spread over their lanes
            /// (the per-row path inserts them one by one and spreads them
            /// after). Measured on Emerald Rapids (2 cores, `avx512bf16`),
            /// alternated in one process, one thread, in L2: the prepared
            /// layout alone 17.1 → 20.8 GB/s at 896 × 896, 17.6 → 22.7 at
            /// 896 × 4864 (the quad built per step spilled registers and
            /// branched on the row's end four times); the loads and scales
            /// on top of it 20.0 → 23.8, 22.5 → 25.2, 16.4 → 18.9 (its
            /// median gain about 10%).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn rows_q4_0_quads<const R: usize>(w: [&[BlockQ4_0]; R], x: &[BlockA8x4]) -> [f32; R] {
                let n = w[0].len();
                debug_assert_eq!(x.len(), n.div_ceil(4));
                let ahead = crate::cpu::software_prefetch();
                let mut acc = [_mm512_setzero_ps(); R];
                let nibble = _mm512_set1_epi8(15);
                // Word 9b of a step's 72 bytes is block b's scale; the
                // scale goes to words 4b..4b + 4 (one per lane of the
                // block's 128-bit lane once widened).
                let picks: [i16; 32] = std::array::from_fn(|t| if t < 16 { 9 * (t / 4) as i16 } else { 0 });
                let picks = _mm512_loadu_si512(picks.as_ptr() as *const _);
                for (m, q) in x.iter().enumerate() {
                    let i = 4 * m;
                    let whole = i + 4 <= n;
                    let (xlo, xhi) =
                        (_mm512_load_si512(q.lo.as_ptr() as *const _), _mm512_load_si512(q.hi.as_ptr() as *const _));
                    let start = _mm512_load_si512(q.start.as_ptr() as *const _);
                    let dx = _mm_loadu_ps(q.d.as_ptr());
                    let dx16 = spread4(dx);
                    let b = step_blocks(i, n);
                    for k in 0..R {
                        let row = w[k];
                        let blocks = b.map(|j| row.get_unchecked(j));
                        prefetch_step(
                            blocks[0] as *const BlockQ4_0 as *const u8,
                            4 * std::mem::size_of::<BlockQ4_0>(),
                            ahead,
                        );
                        let bytes = qs4(blocks);
                        let lo = _mm512_and_si512(bytes, nibble);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), nibble);
                        let s = dot(dot(start, lo, xlo), hi, xhi);
                        let d = if whole {
                            // A whole step's 72 bytes are in the row: the 64-byte read stays inside it.
                            let step = _mm512_loadu_si512(blocks[0] as *const BlockQ4_0 as *const _);
                            let h = _mm512_castsi512_si256(_mm512_permutexvar_epi16(picks, step));
                            _mm512_mul_ps(_mm512_cvtph_ps(h), dx16)
                        } else {
                            scales4(blocks.map(|b| b.d), dx)
                        };
                        acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc[k]);
                    }
                }
                acc.map(|v| _mm512_reduce_add_ps(v))
            }

            /// One step of `R` Q5_0 rows: four blocks of each row against
            /// one activation quad (`xlo`, `xhi` as in [`Quad`], `start`
            /// the quad's `−8 · Σx`, `dx16` its scales spread over their
            /// lanes). Codes: the nibbles as INT4's, plus 16 where the
            /// block's `qh` bit is set (a byte shuffle of the heads spreads
            /// `qh` bytes, a bit test makes the mask, a masked add sets it);
            /// offset 16, so the accumulator starts at twice INT4's start.
            #[inline(always)]
            unsafe fn step_q5<const R: usize>(
                w: &[&[BlockQ5_0]; R],
                b: [usize; 4],
                (xlo, xhi, start, dx16): (__m512i, __m512i, __m512i, __m512),
                c: &Q5Consts,
                acc: &mut [__m512; R],
                ahead: bool,
            ) {
                let nibble = _mm512_set1_epi8(15);
                let sixteen = _mm512_set1_epi8(16);
                let start = _mm512_add_epi32(start, start);
                // Four consecutive blocks: the step's 88 bytes in two
                // loads, laid out by two word permutes (in the stream
                // example 82% and 71% of a read against 75% and 71% for the
                // eight broadcasts and six blends of the general case: no
                // slower, fewer loads).
                let whole = b[3] == b[0] + 3;
                for k in 0..R {
                    let row = w[k];
                    let blocks = b.map(|j| row.get_unchecked(j));
                    let at = blocks[0] as *const BlockQ5_0 as *const u8;
                    prefetch_step(at, 4 * std::mem::size_of::<BlockQ5_0>(), ahead);
                    let (heads, bytes) = if whole {
                        let (first, last) =
                            (_mm512_loadu_si512(at as *const _), _mm512_loadu_si512(at.add(24) as *const _));
                        (
                            _mm512_permutex2var_epi16(first, c.head_words, last),
                            _mm512_permutex2var_epi16(first, c.qs_words, last),
                        )
                    } else {
                        // Each block's first 16 bytes (scale, `qh`, ten code bytes), and its codes.
                        (
                            lanes4(blocks.map(|b| b as *const BlockQ5_0 as *const u8)),
                            lanes4(blocks.map(|b| b.qs.as_ptr())),
                        )
                    };
                    let lo = _mm512_and_si512(bytes, nibble);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), nibble);
                    let lo_set = _mm512_test_epi8_mask(_mm512_shuffle_epi8(heads, c.lo_bytes), c.bit);
                    let hi_set = _mm512_test_epi8_mask(_mm512_shuffle_epi8(heads, c.hi_bytes), c.bit);
                    let lo = _mm512_mask_add_epi8(lo, lo_set, lo, sixteen);
                    let hi = _mm512_mask_add_epi8(hi, hi_set, hi, sixteen);
                    let s = dot(dot(start, lo, xlo), hi, xhi);
                    let h = _mm512_castsi512_si256(_mm512_permutexvar_epi16(c.picks, heads));
                    let d = _mm512_mul_ps(_mm512_cvtph_ps(h), dx16);
                    acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc[k]);
                }
            }

            /// `R` Q5_0 rows against the same activations, four blocks per
            /// step, each step's activation quad built here.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn rows_q5<const R: usize>(w: [&[BlockQ5_0]; R], x: &[BlockA8]) -> [f32; R] {
                let n = x.len();
                let c = q5_consts();
                let ahead = crate::cpu::software_prefetch();
                let mut acc = [_mm512_setzero_ps(); R];
                let mut i = 0;
                while i < n {
                    let q = quad(x, i);
                    let dx16 = spread4(q.d);
                    let b = step_blocks(i, n);
                    step_q5(&w, b, (q.lo, q.hi, q.start, dx16), &c, &mut acc, ahead);
                    i += 4;
                }
                acc.map(|v| _mm512_reduce_add_ps(v))
            }

            /// [`rows_q5`] over activations laid out once per mat-vec
            /// ([`BlockA8x4`]): the same steps, so the same bits.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn rows_q5_quads<const R: usize>(w: [&[BlockQ5_0]; R], x: &[BlockA8x4]) -> [f32; R] {
                let n = w[0].len();
                debug_assert_eq!(x.len(), n.div_ceil(4));
                let c = q5_consts();
                let ahead = crate::cpu::software_prefetch();
                let mut acc = [_mm512_setzero_ps(); R];
                for (m, q) in x.iter().enumerate() {
                    let i = 4 * m;
                    let (xlo, xhi) =
                        (_mm512_load_si512(q.lo.as_ptr() as *const _), _mm512_load_si512(q.hi.as_ptr() as *const _));
                    let start = _mm512_load_si512(q.start.as_ptr() as *const _);
                    let dx16 = spread4(_mm_loadu_ps(q.d.as_ptr()));
                    let b = step_blocks(i, n);
                    step_q5(&w, b, (xlo, xhi, start, dx16), &c, &mut acc, ahead);
                }
                acc.map(|v| _mm512_reduce_add_ps(v))
            }

            /// One step of `R` rows of ember's 128-weight nibble blocks
            /// (INT4, INT5: [`NibbleBlock`]): block `m` of each (four
            /// sub-blocks) against one activation quad (`xlo`, `xhi`,
            /// `start` as in [`Quad`], `dx` its four scales). The 64 nibble
            /// bytes are one load, one sub-block per 128-bit lane; INT5's
            /// fifth-bit planes each load into a mask register and add 16
            /// under it; the four scales widen in one conversion and spread
            /// over their lanes in one permute. The accumulator starts at
            /// `−offset · Σx`: the quad's start (offset 8) doubled for
            /// offset 16.
            #[inline(always)]
            unsafe fn step_x4<B: NibbleBlock, const R: usize>(
                w: &[&[B]; R],
                m: usize,
                (xlo, xhi, start, dx): (__m512i, __m512i, __m512i, __m128),
                acc: &mut [__m512; R],
                ahead: bool,
            ) {
                let nibble = _mm512_set1_epi8(15);
                let sixteen = _mm512_set1_epi8(16);
                let start = if B::OFFSET == 16 { _mm512_add_epi32(start, start) } else { start };
                for k in 0..R {
                    let b = w[k].get_unchecked(m);
                    prefetch_step(b as *const B as *const u8, std::mem::size_of::<B>(), ahead);
                    let bytes = _mm512_loadu_si512(b.nibbles().as_ptr() as *const _);
                    let mut lo = _mm512_and_si512(bytes, nibble);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), nibble);
                    if let Some(qh) = b.fifth_bits() {
                        let planes = qh.as_ptr() as *const __mmask64;
                        lo = _mm512_mask_add_epi8(lo, _load_mask64(planes), lo, sixteen);
                        hi = _mm512_mask_add_epi8(hi, _load_mask64(planes.add(1)), hi, sixteen);
                    }
                    let s = dot(dot(start, lo, xlo), hi, xhi);
                    let h = _mm_loadl_epi64(b.scales().as_ptr() as *const __m128i);
                    let d = spread4(_mm_mul_ps(_mm_cvtph_ps(h), dx));
                    acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc[k]);
                }
            }

            /// `R` rows of 128-weight nibble blocks against the same
            /// activations, each step's activation quad built here.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn rows_x4<B: NibbleBlock, const R: usize>(w: [&[B]; R], x: &[BlockA8]) -> [f32; R] {
                let n = w[0].len();
                debug_assert_eq!(x.len(), 4 * n);
                let ahead = crate::cpu::software_prefetch();
                let mut acc = [_mm512_setzero_ps(); R];
                for m in 0..n {
                    let q = quad(x, 4 * m);
                    step_x4(&w, m, (q.lo, q.hi, q.start, q.d), &mut acc, ahead);
                }
                acc.map(|v| _mm512_reduce_add_ps(v))
            }

            /// [`rows_x4`] over activations laid out once per mat-vec
            /// ([`BlockA8x4`]): the same steps, so the same bits.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn rows_x4_quads<B: NibbleBlock, const R: usize>(w: [&[B]; R], x: &[BlockA8x4]) -> [f32; R] {
                debug_assert_eq!(x.len(), w[0].len());
                let ahead = crate::cpu::software_prefetch();
                let mut acc = [_mm512_setzero_ps(); R];
                for (m, q) in x.iter().enumerate() {
                    let (xlo, xhi) =
                        (_mm512_load_si512(q.lo.as_ptr() as *const _), _mm512_load_si512(q.hi.as_ptr() as *const _));
                    let start = _mm512_load_si512(q.start.as_ptr() as *const _);
                    step_x4(&w, m, (xlo, xhi, start, _mm_loadu_ps(q.d.as_ptr())), &mut acc, ahead);
                }
                acc.map(|v| _mm512_reduce_add_ps(v))
            }

            /// Four INT4 or INT5 rows against activations laid out by [`crate::formats::quads_of`].
            #[target_feature(enable = $features)]
            pub unsafe fn rows4_x4_quads<B: NibbleBlock>(w: [&[B]; 4], x: &[BlockA8x4]) -> [f32; 4] {
                rows_x4_quads(w, x)
            }

            /// Four INT4 or INT5 rows against the same activations.
            #[target_feature(enable = $features)]
            pub unsafe fn rows4_x4<B: NibbleBlock>(w: [&[B]; 4], x: &[BlockA8]) -> [f32; 4] {
                rows_x4(w, x)
            }

            /// One INT4 or INT5 row.
            #[target_feature(enable = $features)]
            pub unsafe fn dot_x4<B: NibbleBlock>(w: &[B], x: &[BlockA8]) -> f32 {
                rows_x4([w], x)[0]
            }

            /// Four Q5_0 rows against activations laid out by [`crate::formats::quads_of`].
            #[target_feature(enable = $features)]
            pub unsafe fn rows4_q5_0_quads(w: [&[BlockQ5_0]; 4], x: &[BlockA8x4]) -> [f32; 4] {
                rows_q5_quads(w, x)
            }

            /// Four Q5_0 rows against the same activations.
            #[target_feature(enable = $features)]
            pub unsafe fn rows4_q5_0(w: [&[BlockQ5_0]; 4], x: &[BlockA8]) -> [f32; 4] {
                rows_q5(w, x)
            }

            /// One Q5_0 row.
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q5_0(w: &[BlockQ5_0], x: &[BlockA8]) -> f32 {
                rows_q5([w], x)[0]
            }

            /// Four Q4_0 rows against activations laid out by [`crate::formats::quads_of`].
            #[target_feature(enable = $features)]
            pub unsafe fn rows4_q4_0_quads(w: [&[BlockQ4_0]; 4], x: &[BlockA8x4]) -> [f32; 4] {
                rows_q4_0_quads(w, x)
            }

            /// Four Q4_0 rows against the same activations.
            #[target_feature(enable = $features)]
            pub unsafe fn rows4_q4_0(w: [&[BlockQ4_0]; 4], x: &[BlockA8]) -> [f32; 4] {
                rows_q4_0(w, x)
            }

            /// One Q4_0 row.
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q4_0(w: &[BlockQ4_0], x: &[BlockA8]) -> f32 {
                rows_q4_0([w], x)[0]
            }
        }
    };
}

kernels!(
    vnni,
    "avx512f,avx512bw,avx512vnni,f16c",
    "With `vpdpbusd` (AVX512-VNNI): one instruction per two blocks.",
    |acc, u, x| _mm512_dpbusd_epi32(acc, u, x)
);

kernels!(
    bw,
    "avx512f,avx512bw,f16c",
    "With `vpmaddubsw` + `vpmaddwd` (AVX-512BW). INT4 only: INT8's unsigned \
     codes (up to 255) would saturate `vpmaddubsw`'s i16 pair sums.",
    |acc, u, x| _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)))
);

/// The INT8 kernels, with `vpdpbusd` (AVX512-VNNI) only: `vpmaddubsw`'s i16
/// pair sums would saturate on INT8's unsigned codes (up to 255).
pub mod vnni8 {
    use super::*;

    /// `R` INT8 rows against the same activations (codes made
    /// unsigned, `q + 128`, so the offset is 128).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    unsafe fn rows_q8<const R: usize>(w: [&[BlockQ8]; R], x: &[BlockA8]) -> [f32; R] {
        const { assert!(R <= 4, "scale_pairs() packs 4 rows' F16 scales in 64 bits") };
        let n = x.len();
        let ahead = crate::cpu::software_prefetch();
        let mut acc = [_mm512_setzero_ps(); R];
        let mut i = 0;
        while i < n {
            let p = pair(x, i);
            let j = if i + 1 < n { i + 1 } else { i };
            let d = widen_scales(scale_pairs(&w, i, j, p.d));
            for k in 0..R {
                let (b0, b1) = (w[k].get_unchecked(i), w[k].get_unchecked(j));
                prefetch_step(b0 as *const BlockQ8 as *const u8, 2 * std::mem::size_of::<BlockQ8>(), ahead);
                let s = _mm512_dpbusd_epi32(p.start, codes8(b0, b1), p.x);
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), row_scales(d, k), acc[k]);
            }
            i += 2;
        }
        acc.map(|v| _mm512_reduce_add_ps(v))
    }

    /// Four INT8 rows against the same activations.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn rows4_q8(w: [&[BlockQ8]; 4], x: &[BlockA8]) -> [f32; 4] {
        rows_q8(w, x)
    }

    /// One INT8 row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn dot_q8(w: &[BlockQ8], x: &[BlockA8]) -> f32 {
        rows_q8([w], x)[0]
    }
}
