//! The INT5 row: ember's 5-bit blocks, four 32-weight blocks of Q5_0's
//! numbers laid out as the decoding kernels read them, read by int8
//! activations ([`BlockA8`]).
//!
//! | block | bytes / 128 weights | value of weight j of sub-block b |
//! |---|---|---|
//! | [`BlockQ5`] `d: [f16; 4], qh: [u8; 16], qs: [u8; 64]` | 88 | `d[b] · (c − 16)`, `c` = nibble (byte `16b + j % 16` of `qs`, low for j < 16, high above) + 16 · bit `16b + j % 16` of the little-endian u64 `qh[0..8]` (j < 16) or `qh[8..16]` (j ≥ 16) |
//!
//! **Why a format of its own.** Each sub-block is a ggml Q5_0 block in value
//! (an F16 scale, codes 0..=31 about 16: [`BlockQ5::from_q5_0`] and
//! [`BlockQ5::to_q5_0`] convert without loss), but Q5_0's 22-byte blocks put
//! each block's scale, fifth bits and nibbles in a different place of a
//! 512-bit register, which costs the AVX-512 kernel two word permutes, a
//! byte shuffle and two bit tests a step before any product (75% of a plain
//! read from memory on Emerald Rapids, where INT4 does 91%). Here four
//! blocks' 64 nibble bytes are one load, already one block per 128-bit lane
//! (the lanes of the activations' [`BlockA8x4`](super::BlockA8x4)); their
//! fifth bits are two 64-bit planes, each loaded straight into a mask
//! register (the fifth bits of the low and of the high nibbles); the four
//! scales are 8 bytes, widened in one conversion. INT4's default mix puts
//! two of its most sensitive matrices (the LM head and o) in this format
//! rather than at 8 bits: at 5.5 bits a weight, 35% fewer bytes than
//! INT8's 8.5 (`ember_model`'s `INT4_MIX` has the measurements).
//!
//! **Scales.** As INT4's: per sub-block, a search over scales around
//! `max|w| / 16` (both signs of the extreme), a least-squares refit, the
//! smallest squared error kept.
//!
//! Rows are whole blocks of 128 weights; the quantization policy gives a
//! matrix whose rows are not (none in Qwen2.5's sizes) INT8 instead.

use super::act::{BlockA8, QK_A8};
use super::int4::{ggml_bytes, nibble_kernels, NibbleBlock, Symmetric};
use super::q5_0::{codes5, pack5, BlockQ5_0};
use super::{Codes, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::f16;

const QK: usize = QK_A8;
/// Sub-blocks of 32 per block.
const SUBS: usize = 4;
/// Weights per block.
pub const QK5: usize = SUBS * QK;

/// 128 weights as four 32-weight sub-blocks `d[b] · (c − 16)`, `c` five
/// bits (see the module docs for the layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ5 {
    /// The sub-blocks' scales.
    pub d: [f16; SUBS],
    /// The fifth bits: bytes 0..8 (a little-endian u64) hold bit `16b + i`
    /// for weight `i` of sub-block `b`, bytes 8..16 for its weight `16 + i`
    /// (`i` in 0..16).
    pub qh: [u8; 16],
    /// Byte `16b + i`: sub-block `b`'s weight `i` in the low nibble, its
    /// weight `i + 16` in the high one.
    pub qs: [u8; SUBS * QK / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ5>() == 88 && std::mem::align_of::<BlockQ5>() == 2);

impl BlockQ5 {
    /// A block of zeros (every code 16).
    pub const ZERO: BlockQ5 = BlockQ5 { d: [f16::ZERO; SUBS], qh: [0xff; 16], qs: [0; SUBS * QK / 2] };

    /// Sub-block `b`'s 32 codes (0..=31), weight `j` in `[j]`.
    #[inline]
    pub fn codes(&self, b: usize) -> [u8; QK] {
        let [lo, hi] = planes(&self.qh);
        let qs = &self.qs[16 * b..16 * b + 16];
        std::array::from_fn(|j| {
            let (nibble, plane) = if j < QK / 2 { (qs[j] & 15, lo) } else { (qs[j - QK / 2] >> 4, hi) };
            nibble | ((((plane >> (16 * b + j % 16)) & 1) as u8) << 4)
        })
    }

    /// A block from four sub-blocks' scales and codes (each code 0..=31).
    pub fn from_codes(d: [f16; SUBS], codes: &[[u8; QK]; SUBS]) -> BlockQ5 {
        let mut planes = [0u64; 2];
        let mut qs = [0u8; SUBS * QK / 2];
        for (b, c) in codes.iter().enumerate() {
            for i in 0..QK / 2 {
                qs[16 * b + i] = (c[i] & 15) | ((c[i + QK / 2] & 15) << 4);
                planes[0] |= ((c[i] >> 4) as u64 & 1) << (16 * b + i);
                planes[1] |= ((c[i + QK / 2] >> 4) as u64 & 1) << (16 * b + i);
            }
        }
        let mut qh = [0u8; 16];
        qh[..8].copy_from_slice(&planes[0].to_le_bytes());
        qh[8..].copy_from_slice(&planes[1].to_le_bytes());
        BlockQ5 { d, qh, qs }
    }

    /// Four ggml Q5_0 blocks (the same numbers) as one block.
    pub fn from_q5_0(q: &[BlockQ5_0; SUBS]) -> BlockQ5 {
        BlockQ5::from_codes(q.map(|b| b.d), &q.map(|b| codes5(b.qh, &b.qs)))
    }

    /// The block as four ggml Q5_0 blocks (the same numbers: GGUF files
    /// carry INT5 matrices as Q5_0).
    pub fn to_q5_0(&self) -> [BlockQ5_0; SUBS] {
        std::array::from_fn(|b| {
            let (qh, qs) = pack5(&self.codes(b));
            BlockQ5_0 { d: self.d[b], qh, qs }
        })
    }

    /// Stored INT5 bytes (whole blocks, any alignment) as the bytes of the
    /// Q5_0 blocks of the same numbers, in order.
    pub fn q5_0_bytes(bytes: &[u8]) -> Vec<u8> {
        ggml_bytes(bytes, BlockQ5::to_q5_0)
    }
}

/// The two fifth-bit planes of a block's `qh` as u64: weights 0..16 of
/// each sub-block, then 16..32.
#[inline]
pub(crate) fn planes(qh: &[u8; 16]) -> [u64; 2] {
    let (lo, hi) = qh.split_at(8);
    [u64::from_le_bytes(lo.try_into().unwrap()), u64::from_le_bytes(hi.try_into().unwrap())]
}

impl NibbleBlock for BlockQ5 {
    const OFFSET: i32 = 16;
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
        Some(&self.qh)
    }
}

/// The INT5 row of the format table.
pub struct Int5;

impl Format for Int5 {
    const TYPE: WeightType = WeightType::Int5;
    const NAME: &'static str = "int5";
    type Block = BlockQ5;
    const BLOCK_LEN: usize = QK5;
    type Act = BlockA8;
    const ZERO: BlockQ5 = BlockQ5::ZERO;
    const QUANTIZED: bool = true;

    fn wrap(data: &[BlockQ5]) -> Weights<'_> {
        Weights::Int5(data)
    }

    fn quantize_row(src: &[f32], dst: &mut [BlockQ5]) {
        assert_eq!(src.len(), dst.len() * QK5, "row length");
        for (x, b) in src.chunks_exact(QK5).zip(dst.iter_mut()) {
            let mut d = [f16::ZERO; SUBS];
            let mut codes = [[16u8; QK]; SUBS];
            for (s, xs) in x.chunks_exact(QK).enumerate() {
                if let Some((ds, cs)) = Symmetric::INT5.quantize_block(xs) {
                    (d[s], codes[s]) = (ds, cs);
                }
            }
            *b = BlockQ5::from_codes(d, &codes);
        }
    }

    fn dequantize_reference(src: &[BlockQ5], dst: &mut [f32]) {
        assert_eq!(dst.len(), src.len() * QK5, "row length");
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK5)) {
            for (s, ys) in y.chunks_exact_mut(QK).enumerate() {
                let d = b.d[s].to_f32();
                for (o, c) in ys.iter_mut().zip(b.codes(s)) {
                    *o = d * (c as i32 - 16) as f32;
                }
            }
        }
    }

    /// `Σ_sub-blocks d·d_x·(Σ c·q − 16·Σ q)`, integer products per sub-block.
    fn dot_reference(w: &[BlockQ5], x: &[BlockA8]) -> f32 {
        assert_eq!(w.len() * SUBS, x.len());
        let mut s = 0.0f32;
        for (b, a4) in w.iter().zip(x.chunks_exact(SUBS)) {
            for (sub, a) in a4.iter().enumerate() {
                let dot: i32 = b.codes(sub).iter().zip(&a.qs).map(|(&c, &q)| c as i32 * q as i32).sum();
                s += b.d[sub].to_f32() * a.d * (dot - 16 * a.sum) as f32;
            }
        }
        s
    }

    /// Sub-block `sub`'s five-bit codes, offset 16.
    #[inline]
    fn codes(b: &BlockQ5, sub: usize) -> Option<Codes> {
        Some(Codes { d: b.d[sub].to_f32(), u: b.codes(sub), offset: 16 })
    }

    fn kernels(tier: Tier) -> Kernels<Int5> {
        nibble_kernels(tier)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{Format, Int4, Q5_0};
    use crate::testutil::synth;

    fn sq_error<F: Format>(x: &[f32]) -> f32 {
        let mut q = vec![F::ZERO; x.len() / F::BLOCK_LEN];
        F::quantize_row(x, &mut q);
        let mut back = vec![0.0; x.len()];
        F::dequantize_reference(&q, &mut back);
        x.iter().zip(&back).map(|(a, b)| (a - b).powi(2)).sum()
    }

    /// The scale search beats Q5_0's fixed rule (`d = extreme / −16`) on
    /// the same data, and five bits beat INT4's four by about the factor
    /// one more bit gives (4 in squared error; 3 asked).
    #[test]
    fn int5_search_beats_q5_0_and_int4() {
        let x = synth(QK5 * 256, 3);
        let (int5, q5_0, int4) = (sq_error::<Int5>(&x), sq_error::<Q5_0>(&x), sq_error::<Int4>(&x));
        assert!(int5 < 0.85 * q5_0, "int5 {int5} vs q5_0 {q5_0}");
        assert!(int5 < int4 / 3.0, "int5 {int5} vs int4 {int4}");
    }

    /// Q5_0 blocks and INT5 sub-blocks are the same numbers both ways, and
    /// the codes pack and unpack on random bytes.
    #[test]
    fn q5_0_converts_without_loss() {
        let raw: Vec<u8> = synth(88 * 64, 8).iter().map(|v| (v.to_bits() >> 9) as u8).collect();
        let mut blocks: Vec<BlockQ5> = bytemuck::cast_slice(&raw).to_vec();
        for b in &mut blocks {
            b.d = b.d.map(|d| f16::from_bits((d.to_bits() & 0x83ff) | 0x3000));
        }
        for b in &blocks {
            let q = b.to_q5_0();
            assert_eq!(BlockQ5::from_q5_0(&q), *b);
            let mut want = vec![0.0; QK5];
            Int5::dequantize_reference(std::slice::from_ref(b), &mut want);
            let mut got = vec![0.0; QK5];
            Q5_0::dequantize_reference(&q, &mut got);
            assert_eq!(got, want);
            assert_eq!(BlockQ5::from_codes(b.d, &std::array::from_fn(|s| b.codes(s))), *b);
        }
    }

    #[test]
    fn zero_blocks_stay_zero() {
        let mut q = [BlockQ5::ZERO; 2];
        q[0].d[1] = f16::ONE;
        Int5::quantize_row(&[0.0; 2 * QK5], &mut q);
        assert_eq!(q, [BlockQ5::ZERO; 2]);
        let mut back = vec![1.0; 2 * QK5];
        Int5::dequantize_reference(&q, &mut back);
        assert!(back.iter().all(|&v| v == 0.0));
    }
}
