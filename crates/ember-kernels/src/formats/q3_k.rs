//! The Q3_K row (ggml's `block_q3_K`): super-blocks of 256 weights of three
//! bits in sixteen groups of 16 with six-bit signed scales, read by
//! 256-wide int8 activations ([`BlockA8K`]).
//!
//! | block | bytes / 256 weights | value of weight j in group g = j / 16 |
//! |---|---|---|
//! | [`BlockQ3K`] `hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16` | 110 | `(d · (s_g − 32)) · (q_j − 4 · (1 − h_j))` |
//!
//! Weight `j = 128 h + 32 k + l` has its low two bits as Q2_K's (bits
//! `2k, 2k + 1` of `qs[32 h + l]`) and `h_j` = bit `4 h + k` of `hmask[l]`
//! (a set bit means no offset). The sixteen scales: group `g`'s low four
//! bits are the low (g < 8) or high nibble of byte `g % 8`, its top two bits
//! bits `2 (g / 4)` of byte `8 + g % 4`.

use super::act::BlockA8K;
use super::kq::QK_K;
use super::{x86_kernels, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::f16;

/// 256 weights of three bits in sixteen groups of 16.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ3K {
    /// The third bits (see the module docs).
    pub hmask: [u8; QK_K / 8],
    /// The low two bits, four per byte.
    pub qs: [u8; QK_K / 4],
    /// Sixteen six-bit scales, offset 32 (see the module docs).
    pub scales: [u8; 12],
    /// The scale of the group scales.
    pub d: f16,
}

const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110 && std::mem::align_of::<BlockQ3K>() == 2);

impl BlockQ3K {
    /// A block of zeros.
    pub const ZERO: BlockQ3K = BlockQ3K { hmask: [0; QK_K / 8], qs: [0; QK_K / 4], scales: [0; 12], d: f16::ZERO };

    /// Weight `j`'s code plus 4: `q + 4` in 0..8 (low two bits, and 4 when its
    /// `hmask` bit is set).
    #[inline]
    pub fn code(&self, j: usize) -> u8 {
        let (h, k, l) = (j / 128, (j % 128) / 32, j % 32);
        ((self.qs[32 * h + l] >> (2 * k)) & 3) | (((self.hmask[l] >> (4 * h + k)) & 1) << 2)
    }

    /// The sixteen group scales, `s_g − 32`.
    #[inline]
    pub fn group_scales(&self) -> [i8; 16] {
        let s = &self.scales;
        std::array::from_fn(|g| {
            let low = if g < 8 { s[g] & 15 } else { s[g - 8] >> 4 };
            let high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
            (low | (high << 4)) as i8 - 32
        })
    }
}

/// The Q3_K row of the format table.
pub struct Q3K;

impl Format for Q3K {
    const TYPE: WeightType = WeightType::Q3K;
    const NAME: &'static str = "q3_k";
    type Block = BlockQ3K;
    const BLOCK_LEN: usize = QK_K;
    type Act = BlockA8K;
    const ZERO: BlockQ3K = BlockQ3K::ZERO;
    const QUANTIZED: bool = false;

    fn wrap(data: &[BlockQ3K]) -> Weights<'_> {
        Weights::Q3K(data)
    }

    /// A simple correct quantizer: each group's scale `extreme / −4`, the
    /// scales rounded to steps of `d = max|scale| / 32` in −32..=31, codes
    /// `round(x / (d · s))` clamped to −4..=3.
    fn quantize_row(src: &[f32], dst: &mut [BlockQ3K]) {
        assert_eq!(src.len(), dst.len() * QK_K, "row length");
        for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
            let scales: Vec<f32> = x
                .chunks_exact(16)
                .map(|g| g.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m }) / -4.0)
                .collect();
            let d = f16::from_f32(scales.iter().fold(0.0f32, |a, s| a.max(s.abs())) / 32.0);
            let df = d.to_f32();
            let sc: [i8; 16] =
                std::array::from_fn(|g| if df > 0.0 { (scales[g] / df).round().clamp(-32.0, 31.0) as i8 } else { 0 });
            *b = BlockQ3K { d, ..BlockQ3K::ZERO };
            for (g, &sg) in sc.iter().enumerate() {
                let u = (sg as i32 + 32) as u8;
                b.scales[g % 8] |= (u & 15) << if g < 8 { 0 } else { 4 };
                b.scales[8 + g % 4] |= (u >> 4) << (2 * (g / 4));
            }
            for (j, &v) in x.iter().enumerate() {
                let step = df * sc[j / 16] as f32;
                let q = if step != 0.0 { (v / step).round().clamp(-4.0, 3.0) as i32 } else { 0 };
                let u = (q + 4) as u8;
                let (h, k, l) = (j / 128, (j % 128) / 32, j % 32);
                b.qs[32 * h + l] |= (u & 3) << (2 * k);
                b.hmask[l] |= (u >> 2) << (4 * h + k);
            }
        }
    }

    /// ggml's `dequantize_row_q3_K`: `(d · (s − 32)) · q`.
    fn dequantize_reference(src: &[BlockQ3K], dst: &mut [f32]) {
        assert_eq!(dst.len(), src.len() * QK_K, "row length");
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
            let d = b.d.to_f32();
            let sc = b.group_scales();
            for (j, o) in y.iter_mut().enumerate() {
                *o = d * sc[j / 16] as f32 * (b.code(j) as i32 - 4) as f32;
            }
        }
    }

    /// `Σ_blocks d_x · d · Σ_g s_g · (Σ (q + 4)·x − 4 · Σ x)`, in integers.
    fn dot_reference(w: &[BlockQ3K], x: &[BlockA8K]) -> f32 {
        assert_eq!(w.len(), x.len());
        let mut s = 0.0f32;
        for (b, a) in w.iter().zip(x) {
            let sc = b.group_scales();
            let mut isum = 0i32;
            for (g, &sg) in sc.iter().enumerate() {
                let dot: i32 = (16 * g..16 * g + 16).map(|j| b.code(j) as i32 * a.qs[j] as i32).sum();
                isum += sg as i32 * (dot - 4 * a.bsums[g] as i32);
            }
            s += a.d * (b.d.to_f32() * isum as f32);
        }
        s
    }

    fn kernels(tier: Tier) -> Kernels<Q3K> {
        x86_kernels!(tier, k_avx2, dot_q3k, rows4_q3k, dequantize_q3k)
    }
}
