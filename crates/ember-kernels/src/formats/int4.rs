//! The INT4 row: ember's 4-bit blocks, four 32-weight blocks of Q4_0's
//! numbers laid out as the decoding kernels read them, read by int8
//! activations ([`BlockA8`]).
//!
//! | block | bytes / 128 weights | value of weight j of sub-block b |
//! |---|---|---|
//! | [`BlockQ4`] `d: [f16; 4], qs: [u8; 64]` | 72 | `d[b] · (n − 8)`, `n` = the low nibble of byte `16b + j` (j < 16) or the high nibble of byte `16b + j − 16` (j ≥ 16) |
//!
//! **Why a format of its own.** Each sub-block is a ggml Q4_0 block in
//! value ([`BlockQ4::from_q4_0`] and [`BlockQ4::to_q4_0`] convert without
//! loss, and GGUF files carry INT4 matrices as Q4_0), but Q4_0's 18-byte
//! blocks put each block's scale and nibbles at another place of a 512-bit
//! register: the AVX-512 kernel gathered four blocks' nibbles with four
//! broadcast loads and three blends, and their scales with a 64-byte load
//! and a word permute, each step. Here four sub-blocks' 64 nibble bytes are
//! one load, already one sub-block per 128-bit lane (the lanes of the
//! activations' [`BlockA8x4`](super::BlockA8x4)), and the four scales are 8
//! bytes, widened in one conversion. INT5 ([`super::BlockQ5`]) is this
//! block plus two planes of fifth bits, and the kernels are written once
//! for both ([`NibbleBlock`]). Emerald Rapids, `avx512vnni`, one thread,
//! 896 × 896 in L2: Q4_0's kernel streams 41 G weights/s, this layout's 59.
//!
//! **Scales.** The quantizer searches: for each sub-block it tries scales
//! around `max|w| / 8` (both signs of the extreme, so the asymmetric code
//! range −8..=7 is used where it helps), rounds, refits `d` by least squares
//! for the chosen codes, and keeps the scale with the smallest squared
//! error. That costs a few microseconds per block at load and removes a
//! good part of the error of Q4_0's fixed `max / −8` rule.
//!
//! Rows are whole blocks of 128 weights; the quantization policy gives a
//! matrix whose rows are not (none in Qwen2.5's sizes) INT8 instead.

use super::act::{BlockA8, QK_A8};
use super::q4_0::{codes4, pack4, BlockQ4_0};
use super::{reference_kernels, Codes, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::f16;

const QK: usize = QK_A8;
/// Sub-blocks of 32 per block.
const SUBS: usize = 4;
/// Weights per block.
pub const QK4: usize = SUBS * QK;

/// 128 weights as four 32-weight sub-blocks `d[b] · (n − 8)` (see the
/// module docs for the layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4 {
    /// The sub-blocks' scales.
    pub d: [f16; SUBS],
    /// Byte `16b + i`: sub-block `b`'s weight `i` in the low nibble, its
    /// weight `i + 16` in the high one.
    pub qs: [u8; SUBS * QK / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ4>() == 72 && std::mem::align_of::<BlockQ4>() == 2);

impl BlockQ4 {
    /// A block of zeros (every nibble 8).
    pub const ZERO: BlockQ4 = BlockQ4 { d: [f16::ZERO; SUBS], qs: [0x88; SUBS * QK / 2] };

    /// Sub-block `b`'s 16 bytes.
    #[inline]
    fn sub(&self, b: usize) -> &[u8; QK / 2] {
        self.qs[16 * b..16 * b + 16].try_into().unwrap()
    }

    /// Sub-block `b`'s 32 codes (0..=15), weight `j` in `[j]`.
    #[inline]
    pub fn codes(&self, b: usize) -> [u8; QK] {
        codes4(self.sub(b))
    }

    /// A block from four sub-blocks' scales and codes (each code 0..=15).
    pub fn from_codes(d: [f16; SUBS], codes: &[[u8; QK]; SUBS]) -> BlockQ4 {
        let mut qs = [0u8; SUBS * QK / 2];
        for (b, c) in codes.iter().enumerate() {
            qs[16 * b..16 * b + 16].copy_from_slice(&pack4(c));
        }
        BlockQ4 { d, qs }
    }

    /// Four ggml Q4_0 blocks (the same numbers) as one block.
    pub fn from_q4_0(q: &[BlockQ4_0; SUBS]) -> BlockQ4 {
        let mut qs = [0u8; SUBS * QK / 2];
        for (b, block) in q.iter().enumerate() {
            qs[16 * b..16 * b + 16].copy_from_slice(&block.qs);
        }
        BlockQ4 { d: q.map(|b| b.d), qs }
    }

    /// The block as four ggml Q4_0 blocks (the same numbers: GGUF files
    /// carry INT4 matrices as Q4_0).
    pub fn to_q4_0(&self) -> [BlockQ4_0; SUBS] {
        std::array::from_fn(|b| BlockQ4_0 { d: self.d[b], qs: *self.sub(b) })
    }

    /// Stored INT4 bytes (whole blocks, any alignment) as the bytes of the
    /// Q4_0 blocks of the same numbers, in order.
    pub fn q4_0_bytes(bytes: &[u8]) -> Vec<u8> {
        ggml_bytes(bytes, BlockQ4::to_q4_0)
    }
}

/// Stored blocks of ember's 128-weight layouts (whole, any alignment) as
/// the bytes of the four ggml blocks each holds in value, in order:
/// [`BlockQ4::q4_0_bytes`] and [`super::BlockQ5::q5_0_bytes`].
pub(super) fn ggml_bytes<B: bytemuck::Pod, Q: bytemuck::Pod>(bytes: &[u8], split: impl Fn(&B) -> [Q; SUBS]) -> Vec<u8> {
    let size = std::mem::size_of::<B>();
    assert!(bytes.len().is_multiple_of(size), "{} data holds whole blocks", std::any::type_name::<B>());
    let mut out = Vec::with_capacity(bytes.len() / size * SUBS * std::mem::size_of::<Q>());
    for b in bytes.chunks_exact(size) {
        out.extend_from_slice(bytemuck::cast_slice(&split(&bytemuck::pod_read_unaligned::<B>(b))));
    }
    out
}

/// ember's 128-weight blocks of nibbles, INT4's [`BlockQ4`] and INT5's
/// [`super::BlockQ5`]: four sub-blocks' F16 scales together, their 64
/// nibble bytes (sub-block `b` in bytes `16b..16b + 16`, one per 128-bit
/// lane of the activations' quad), and for INT5 two planes of fifth bits.
/// The AVX-512 and AVX2 decoding kernels are written once over this.
pub(crate) trait NibbleBlock: bytemuck::Pod {
    /// The code that means zero: 8 for four bits, 16 for five.
    const OFFSET: i32;
    /// The four sub-blocks' scales.
    fn scales(&self) -> &[f16; SUBS];
    /// The 64 nibble bytes.
    fn nibbles(&self) -> &[u8; SUBS * QK / 2];
    /// The fifth bits (INT5's `qh`: bytes 0..8 for the low nibbles, 8..16
    /// for the high ones), or `None` for four-bit codes.
    fn fifth_bits(&self) -> Option<&[u8; 16]>;
}

impl NibbleBlock for BlockQ4 {
    const OFFSET: i32 = 8;
    #[inline(always)]
    fn scales(&self) -> &[f16; SUBS] {
        &self.d
    }
    #[inline(always)]
    fn nibbles(&self) -> &[u8; SUBS * QK / 2] {
        &self.qs
    }
    #[inline(always)]
    fn fifth_bits(&self) -> Option<&[u8; 16]> {
        None
    }
}

/// Four 32-weight sub-blocks of a row, as a step of the AVX2 decoding
/// kernels (`int_avx2::x4`) reads them: one block of ember's 128-weight layouts ([`NibbleBlock`]: INT4,
/// INT5), or four consecutive ggml blocks holding the same numbers (Q4_0,
/// Q5_0, as GGUF files carry them). Both take the same step, so a ggml
/// row gives its ember twin's bits to the last one (a GGUF ember writes
/// computes what the model it was written from does), as on the AVX-512
/// tiers, whose kernels share their step in their own way.
pub(crate) trait Group4: bytemuck::Pod {
    /// The code that means zero: 8 for four bits, 16 for five.
    const OFFSET: i32;
    /// Blocks of `Self` per group of four sub-blocks.
    const BLOCKS: usize;
    /// A block that reads as zeros, padding a row's last group.
    const ZERO: Self;
    /// The four sub-blocks' F16 scales' bits, sub-block `b`'s in bits `16b..16b + 16`.
    ///
    /// # Safety
    /// `g` points at a whole group (`BLOCKS` blocks).
    unsafe fn scales(g: *const Self) -> u64;
    /// The 16 nibble bytes of sub-blocks `2r` and `2r + 1` (`r` 0 or 1): one
    /// 32-byte run, or two runs of 16.
    ///
    /// # Safety
    /// As [`Group4::scales`].
    unsafe fn nibbles(g: *const Self, r: usize) -> [*const u8; 2];
    /// The fifth bits of the same two sub-blocks, for their low nibbles
    /// (weights 0..16) and their high ones (16..32): 32 bits each,
    /// sub-block `2r`'s 16 first; `None` for four-bit codes.
    ///
    /// # Safety
    /// As [`Group4::scales`].
    unsafe fn fifth(g: *const Self, r: usize) -> Option<[u32; 2]>;
}

macro_rules! nibble_group {
    ($block:ty) => {
        impl Group4 for $block {
            const OFFSET: i32 = <$block as NibbleBlock>::OFFSET;
            const BLOCKS: usize = 1;
            const ZERO: Self = <$block>::ZERO;
            #[inline(always)]
            unsafe fn scales(g: *const Self) -> u64 {
                ((*g).scales().as_ptr() as *const u64).read_unaligned()
            }
            #[inline(always)]
            unsafe fn nibbles(g: *const Self, r: usize) -> [*const u8; 2] {
                let p = (*g).nibbles().as_ptr().add(32 * r);
                [p, p.add(16)]
            }
            #[inline(always)]
            unsafe fn fifth(g: *const Self, r: usize) -> Option<[u32; 2]> {
                // Each plane's bits of sub-blocks 2r and 2r + 1 are its 32-bit word r.
                (*g).fifth_bits().map(|qh| {
                    let planes = qh.as_ptr() as *const u32;
                    [planes.add(r).read_unaligned(), planes.add(2 + r).read_unaligned()]
                })
            }
        }
    };
}
nibble_group!(BlockQ4);
nibble_group!(super::BlockQ5);

/// Four consecutive ggml blocks (`d`, `qs` and, for five bits, `qh`) as a
/// group: their scales gathered, their nibbles two runs of 16 bytes, their
/// fifth bits by `fifth`.
macro_rules! ggml_group {
    ($block:ty, $offset:literal, |$g:ident, $r:ident| $fifth:expr) => {
        impl Group4 for $block {
            const OFFSET: i32 = $offset;
            const BLOCKS: usize = 4;
            const ZERO: Self = <$block>::ZERO;
            #[inline(always)]
            unsafe fn scales(g: *const Self) -> u64 {
                (0..4).fold(0, |a, b| a | ((*g.add(b)).d.to_bits() as u64) << (16 * b))
            }
            #[inline(always)]
            unsafe fn nibbles(g: *const Self, r: usize) -> [*const u8; 2] {
                [(*g.add(2 * r)).qs.as_ptr(), (*g.add(2 * r + 1)).qs.as_ptr()]
            }
            #[inline(always)]
            unsafe fn fifth($g: *const Self, $r: usize) -> Option<[u32; 2]> {
                $fifth
            }
        }
    };
}
ggml_group!(super::BlockQ4_0, 8, |_g, _r| None);
// A block's bit j is weight j's: its low 16 bits go with the low nibbles.
ggml_group!(super::BlockQ5_0, 16, |g, r| {
    let (a, b) = (u32::from_le_bytes((*g.add(2 * r)).qh), u32::from_le_bytes((*g.add(2 * r + 1)).qh));
    Some([(a & 0xffff) | (b << 16), (a >> 16) | (b & 0xffff_0000)])
});

/// The INT4 row of the format table.
pub struct Int4;

impl Format for Int4 {
    const TYPE: WeightType = WeightType::Int4;
    const NAME: &'static str = "int4";
    type Block = BlockQ4;
    const BLOCK_LEN: usize = QK4;
    type Act = BlockA8;
    const ZERO: BlockQ4 = BlockQ4::ZERO;
    const QUANTIZED: bool = true;

    fn wrap(data: &[BlockQ4]) -> Weights<'_> {
        Weights::Int4(data)
    }

    /// Per sub-block, the scale search of the module docs.
    fn quantize_row(src: &[f32], dst: &mut [BlockQ4]) {
        assert_eq!(src.len(), dst.len() * QK4, "row length");
        for (x, b) in src.chunks_exact(QK4).zip(dst.iter_mut()) {
            let mut d = [f16::ZERO; SUBS];
            let mut codes = [[8u8; QK]; SUBS];
            for (s, xs) in x.chunks_exact(QK).enumerate() {
                if let Some((ds, cs)) = Symmetric::INT4.quantize_block(xs) {
                    (d[s], codes[s]) = (ds, cs);
                }
            }
            *b = BlockQ4::from_codes(d, &codes);
        }
    }

    fn dequantize_reference(src: &[BlockQ4], dst: &mut [f32]) {
        assert_eq!(dst.len(), src.len() * QK4, "row length");
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK4)) {
            for (s, ys) in y.chunks_exact_mut(QK).enumerate() {
                let d = b.d[s].to_f32();
                for (o, c) in ys.iter_mut().zip(b.codes(s)) {
                    *o = d * (c as i32 - 8) as f32;
                }
            }
        }
    }

    /// `Σ_sub-blocks d·d_x·(Σ n·q − 8·Σ q)`, integer products per sub-block.
    fn dot_reference(w: &[BlockQ4], x: &[BlockA8]) -> f32 {
        assert_eq!(w.len() * SUBS, x.len());
        let mut s = 0.0f32;
        for (b, a4) in w.iter().zip(x.chunks_exact(SUBS)) {
            for (sub, a) in a4.iter().enumerate() {
                let dot: i32 = b.codes(sub).iter().zip(&a.qs).map(|(&c, &q)| c as i32 * q as i32).sum();
                s += b.d[sub].to_f32() * a.d * (dot - 8 * a.sum) as f32;
            }
        }
        s
    }

    /// Sub-block `sub`'s nibbles, offset 8.
    #[inline]
    fn codes(b: &BlockQ4, sub: usize) -> Option<Codes> {
        Some(Codes { d: b.d[sub].to_f32(), u: b.codes(sub), offset: 8 })
    }

    fn kernels(tier: Tier) -> Kernels<Int4> {
        nibble_kernels(tier)
    }
}

/// The kernels of a row of 128-weight nibble blocks (INT4, INT5) on `tier`:
/// one family for both ([`NibbleBlock`]).
pub(super) fn nibble_kernels<F>(tier: Tier) -> Kernels<F>
where
    F: Format<Act = BlockA8>,
    F::Block: NibbleBlock + Group4,
{
    #[cfg(target_arch = "x86_64")]
    let k = |dot, rows4, rows4_quads| Kernels {
        dot,
        rows4,
        rows4_quads: Some(rows4_quads),
        dequantize: super::int_avx2::dequantize_x4::<F::Block>,
    };
    match tier {
        Tier::Scalar => reference_kernels(),
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => {
            use super::int_avx2::x4::avx2 as m;
            k(m::dot_x4::<F::Block>, m::rows4_x4::<F::Block>, m::rows4_x4_quads::<F::Block>)
        }
        #[cfg(target_arch = "x86_64")]
        Tier::AvxVnni => {
            use super::int_avx2::x4::vnni as m;
            k(m::dot_x4::<F::Block>, m::rows4_x4::<F::Block>, m::rows4_x4_quads::<F::Block>)
        }
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512 => {
            use super::int_avx512::bw as m;
            k(m::dot_x4::<F::Block>, m::rows4_x4::<F::Block>, m::rows4_x4_quads::<F::Block>)
        }
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
            use super::int_avx512::vnni as m;
            k(m::dot_x4::<F::Block>, m::rows4_x4::<F::Block>, m::rows4_x4_quads::<F::Block>)
        }
        #[cfg(not(target_arch = "x86_64"))]
        Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
            unreachable!("x86 tiers are only detected on x86")
        }
    }
}

/// A symmetric block format's codes: weight = `d · (code − offset)`, codes
/// 0..=`top`. INT4 (offset 8, top 15) and INT5 (16, 31) share the scale
/// search ([`Symmetric::quantize_block`]).
#[derive(Clone, Copy)]
pub(super) struct Symmetric {
    offset: f32,
    top: f32,
    /// Candidate divisors of a block's signed extreme: around `−offset` (the
    /// extreme on code 0, Q4_0's and Q5_0's rule) and around `top − offset`
    /// (the extreme on the top code).
    ks: &'static [f32],
}

impl Symmetric {
    /// INT4: codes 0..=15 about 8.
    pub(super) const INT4: Symmetric = Symmetric {
        offset: 8.0,
        top: 15.0,
        ks: &[-8.5, -8.25, -8.0, -7.75, -7.5, -7.25, -7.0, 6.5, 6.75, 7.0, 7.25, 7.5, 7.75, 8.0],
    };
    /// INT5: codes 0..=31 about 16.
    pub(super) const INT5: Symmetric = Symmetric {
        offset: 16.0,
        top: 31.0,
        ks: &[
            -16.5, -16.25, -16.0, -15.75, -15.5, -15.25, -15.0, -14.5, 14.0, 14.5, 14.75, 15.0, 15.25, 15.5, 15.75,
            16.0,
        ],
    };

    /// The codes of `x` at scale `d` (`inv = 1/d`): `round(x / d) + offset`,
    /// clamped to 0..=top.
    #[inline]
    fn codes(self, x: &[f32], inv: f32) -> [u8; QK] {
        std::array::from_fn(|j| ((x[j] * inv).round() + self.offset).clamp(0.0, self.top) as u8)
    }

    /// The squared error of a block at scale `d` (`inv = 1/d`), its codes
    /// rounded as [`Symmetric::codes`] does, in one pass.
    #[inline]
    fn error_at(self, x: &[f32], d: f32, inv: f32) -> f32 {
        let mut err = 0.0;
        for &v in x {
            let n = ((v * inv).round() + self.offset).clamp(0.0, self.top);
            err += (v - d * (n - self.offset)).powi(2);
        }
        err
    }

    /// One block of 32 (see the module docs): the scale with the smallest
    /// squared error among the candidates and the least-squares refit of
    /// the best one, and its codes. `None` for a block of zeros.
    pub(super) fn quantize_block(self, x: &[f32]) -> Option<(f16, [u8; QK])> {
        debug_assert_eq!(x.len(), QK);
        let max = x.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        if max == 0.0 {
            return None;
        }
        let mut best = (f32::INFINITY, 0.0f32);
        let consider = |d: f32, best: &mut (f32, f32)| {
            let d = f16::from_f32(d).to_f32();
            if d != 0.0 && d.is_finite() {
                let err = self.error_at(x, d, 1.0 / d);
                if err < best.0 {
                    *best = (err, d);
                }
            }
        };
        for &k in self.ks {
            consider(max / k, &mut best);
        }
        // Refit the winner by least squares for its codes: Σ x·q / Σ q².
        let codes = self.codes(x, 1.0 / best.1);
        let (mut xq, mut qq) = (0.0f32, 0.0f32);
        for (&v, &n) in x.iter().zip(&codes) {
            let q = n as f32 - self.offset;
            xq += v * q;
            qq += q * q;
        }
        if qq > 0.0 {
            consider(xq / qq, &mut best);
        }
        let d = best.1;
        Some((f16::from_f32(d), self.codes(x, 1.0 / d)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{
        act::quantize_activations_scalar,
        int8::{BlockQ8, Int8},
        Format, Q4_0,
    };
    use crate::testutil::synth;

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
    fn format_contract<F: Format<Act = BlockA8>>(rmse_limit: f32, dot_limit: f32) {
        let n = 4096;
        let w = synth(n, 21);
        let x = synth(n, 22);
        let mut q = vec![F::ZERO; n / F::BLOCK_LEN];
        F::quantize_row(&w, &mut q);
        let mut back = vec![0.0; n];
        F::dequantize_reference(&q, &mut back);
        let e = rmse(&w, &back);
        assert!(e < rmse_limit, "{} rmse {e}", F::NAME);
        let a = act(&x);
        let reference = F::dot_reference(&q, &a);
        let exact: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
        assert!((reference - exact).abs() / (n as f32).sqrt() < dot_limit, "{}", F::NAME);
        for isa in crate::cpu::Isa::supported() {
            let mut fast_back = vec![f32::NAN; n];
            F::dequantize(isa, &q, &mut fast_back);
            assert_eq!(fast_back, back, "{} {isa:?} dequantize", F::NAME);
            let fast = F::dot(isa, &q, &a);
            assert!((fast - reference).abs() <= 1e-5 * n as f32, "{} {isa:?}: {fast} vs {reference}", F::NAME);
        }
    }

    #[test]
    fn each_format_keeps_its_contract() {
        format_contract::<Int8>(RT_RMSE_Q8, DOT_ERROR_Q8);
        format_contract::<Int4>(RT_RMSE_Q4, DOT_ERROR_Q4);
        // ggml's fixed rule is a little worse than the search (below).
        format_contract::<Q4_0>(0.05, DOT_ERROR_Q4);
    }

    #[test]
    fn round_trip_error_is_small() {
        let x = synth(4096, 1);
        let mut q8 = vec![BlockQ8::ZERO; 128];
        let mut back = vec![0.0; 4096];
        Int8::quantize_row(&x, &mut q8);
        Int8::dequantize_reference(&q8, &mut back);
        assert!(rmse(&x, &back) < RT_RMSE_Q8, "q8 rmse {}", rmse(&x, &back));
        let mut q4 = vec![BlockQ4::ZERO; 32];
        Int4::quantize_row(&x, &mut q4);
        Int4::dequantize_reference(&q4, &mut back);
        let e4 = rmse(&x, &back);
        assert!(e4 < RT_RMSE_Q4, "q4 rmse {e4}");
    }

    #[test]
    fn q4_search_beats_the_fixed_rule() {
        // Q4_0's rule: d = max / −8, codes rounded.
        let x = synth(128 * 128, 2);
        let mut fixed = vec![BlockQ4_0::ZERO; x.len() / QK];
        Q4_0::quantize_row(&x, &mut fixed);
        let mut q = vec![BlockQ4::ZERO; x.len() / QK4];
        Int4::quantize_row(&x, &mut q);
        let (mut back_fixed, mut back) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        Q4_0::dequantize_reference(&fixed, &mut back_fixed);
        Int4::dequantize_reference(&q, &mut back);
        let error = |b: &[f32]| x.iter().zip(b).map(|(a, b)| (a - b).powi(2)).sum::<f32>();
        let (ours, fixed) = (error(&back), error(&back_fixed));
        assert!(ours < 0.85 * fixed, "search {ours} vs fixed {fixed}");
    }

    #[test]
    fn zero_blocks_stay_zero() {
        let x = vec![0.0; 128];
        let (mut q8, mut q4, mut back) = (vec![BlockQ8::ZERO; 4], vec![BlockQ4::ZERO; 1], vec![1.0; 128]);
        Int8::quantize_row(&x, &mut q8);
        Int8::dequantize_reference(&q8, &mut back);
        assert!(back.iter().all(|&v| v == 0.0));
        Int4::quantize_row(&x, &mut q4);
        assert_eq!(q4[0], BlockQ4::ZERO);
        back.fill(1.0);
        Int4::dequantize_reference(&q4, &mut back);
        assert!(back.iter().all(|&v| v == 0.0));
        let a = act(&x);
        assert_eq!(Int8::dot_reference(&q8, &a), 0.0);
        assert_eq!(Int4::dot_reference(&q4, &a), 0.0);
    }

    #[test]
    fn q4_0_conversions_keep_the_numbers() {
        // Any bytes: four Q4_0 blocks to one INT4 block and back, and the
        // same values either way.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let blocks: Vec<BlockQ4> = (0..64)
            .map(|_| BlockQ4 {
                d: std::array::from_fn(|_| f16::from_f32((next() % 2000) as f32 / 1000.0 - 1.0)),
                qs: std::array::from_fn(|_| next() as u8),
            })
            .collect();
        for b in &blocks {
            let q = b.to_q4_0();
            assert_eq!(BlockQ4::from_q4_0(&q), *b);
            let (mut want, mut got) = (vec![0.0; QK4], vec![0.0; QK4]);
            Int4::dequantize_reference(std::slice::from_ref(b), &mut want);
            Q4_0::dequantize_reference(&q, &mut got);
            assert_eq!(want, got);
        }
        let bytes: &[u8] = bytemuck::cast_slice(&blocks);
        let q: Vec<BlockQ4_0> = blocks.iter().flat_map(|b| b.to_q4_0()).collect();
        assert_eq!(BlockQ4::q4_0_bytes(bytes), bytemuck::cast_slice::<BlockQ4_0, u8>(&q));
        // Unaligned input reads the same.
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(bytes);
        assert_eq!(BlockQ4::q4_0_bytes(&shifted[1..]), BlockQ4::q4_0_bytes(bytes));
    }

    #[test]
    fn integer_dots_match_the_dequantized_product() {
        // The integer dot equals the f32 dot of the dequantized weights with
        // the dequantized activations (up to f32 rounding), and is close to
        // the exact f32 product (ggml's dot bar: 0.02 per unit of scale).
        for n in [128, 896, 4864] {
            let w = synth(n, n as u64);
            let x = synth(n, n as u64 + 1);
            let a = act(&x);
            let xd: Vec<f32> = a.iter().flat_map(|b| b.qs.map(|q| q as f32 * b.d)).collect();
            let exact: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
            let (mut q8, mut q4) = (vec![BlockQ8::ZERO; n / QK], vec![BlockQ4::ZERO; n / QK4]);
            Int8::quantize_row(&w, &mut q8);
            Int4::quantize_row(&w, &mut q4);
            let (mut w8, mut w4) = (vec![0.0; n], vec![0.0; n]);
            Int8::dequantize_reference(&q8, &mut w8);
            Int4::dequantize_reference(&q4, &mut w4);
            for (name, got, wd) in
                [("q8", Int8::dot_reference(&q8, &a), &w8), ("q4", Int4::dot_reference(&q4, &a), &w4)]
            {
                let want: f32 = wd.iter().zip(&xd).map(|(a, b)| a * b).sum();
                assert!((got - want).abs() <= 1e-4 * (n as f32).sqrt(), "{name} n={n}: {got} vs {want}");
                let bar = if name == "q8" { DOT_ERROR_Q8 } else { DOT_ERROR_Q4 };
                assert!((got - exact).abs() / (n as f32).sqrt() < bar, "{name} n={n}: {got} vs exact {exact}");
            }
        }
    }
}
