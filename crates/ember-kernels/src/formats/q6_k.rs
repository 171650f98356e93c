//! The Q6_K row (ggml's `block_q6_K`): super-blocks of 256 weights of six
//! bits in sixteen groups of 16 with int8 scales, read by 256-wide int8
//! activations ([`BlockA8K`]).
//!
//! | block | bytes / 256 weights | value of weight j in group g = j / 16 |
//! |---|---|---|
//! | [`BlockQ6K`] `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16` | 210 | `(d · sc_g) · (c_j − 32)` |
//!
//! Each half `h` of 128 weights has 64 bytes of `ql` and 32 of `qh`; weight
//! `128 h + 32 k + l` (k in 0..4, l in 0..32) takes the low (k = 0, 1) or high
//! (k = 2, 3) nibble of `ql[64 h + 32 (k % 2) + l]` and bits `2k, 2k + 1` of
//! `qh[32 h + l]` as its top two bits.

use super::act::BlockA8K;
use super::kq::QK_K;
use super::{x86_kernels, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::f16;

/// 256 weights of six bits in sixteen groups of 16.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ6K {
    /// The low four bits (see the module docs).
    pub ql: [u8; QK_K / 2],
    /// The top two bits (see the module docs).
    pub qh: [u8; QK_K / 4],
    /// The group scales.
    pub scales: [i8; QK_K / 16],
    /// The scale of the group scales.
    pub d: f16,
}

const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210 && std::mem::align_of::<BlockQ6K>() == 2);

impl BlockQ6K {
    /// A block of zeros.
    pub const ZERO: BlockQ6K = BlockQ6K { ql: [0; QK_K / 2], qh: [0; QK_K / 4], scales: [0; QK_K / 16], d: f16::ZERO };

    /// Weight `j`'s six-bit code (0..64, the value's offset 32 included).
    #[inline]
    pub fn code(&self, j: usize) -> u8 {
        let (h, k, l) = (j / 128, (j % 128) / 32, j % 32);
        let b = self.ql[64 * h + 32 * (k % 2) + l];
        let low = if k < 2 { b & 15 } else { b >> 4 };
        low | (((self.qh[32 * h + l] >> (2 * k)) & 3) << 4)
    }
}

/// The Q6_K row of the format table.
pub struct Q6K;

impl Format for Q6K {
    const TYPE: WeightType = WeightType::Q6K;
    const NAME: &'static str = "q6_k";
    type Block = BlockQ6K;
    const BLOCK_LEN: usize = QK_K;
    type Act = BlockA8K;
    const ZERO: BlockQ6K = BlockQ6K::ZERO;
    const QUANTIZED: bool = false;

    fn wrap(data: &[BlockQ6K]) -> Weights<'_> {
        Weights::Q6K(data)
    }

    /// A simple correct quantizer: each group's scale `extreme / −32`, the
    /// group scales rounded to int8 steps of `d = max|scale| / 127`, codes
    /// `round(x / (d · sc)) + 32` clamped to 0..=63.
    fn quantize_row(src: &[f32], dst: &mut [BlockQ6K]) {
        assert_eq!(src.len(), dst.len() * QK_K, "row length");
        for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
            let scales: Vec<f32> = x
                .chunks_exact(16)
                .map(|g| g.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m }) / -32.0)
                .collect();
            let d = f16::from_f32(scales.iter().fold(0.0f32, |a, s| a.max(s.abs())) / 127.0);
            let df = d.to_f32();
            let sc: [i8; 16] =
                std::array::from_fn(|g| if df > 0.0 { (scales[g] / df).round().clamp(-127.0, 127.0) as i8 } else { 0 });
            let c: [u8; QK_K] = std::array::from_fn(|j| {
                let step = df * sc[j / 16] as f32;
                if step != 0.0 {
                    ((x[j] / step).round() + 32.0).clamp(0.0, 63.0) as u8
                } else {
                    32
                }
            });
            *b = BlockQ6K { scales: sc, d, ..BlockQ6K::ZERO };
            for (j, &v) in c.iter().enumerate() {
                let (h, k, l) = (j / 128, (j % 128) / 32, j % 32);
                b.ql[64 * h + 32 * (k % 2) + l] |= (v & 15) << if k < 2 { 0 } else { 4 };
                b.qh[32 * h + l] |= (v >> 4) << (2 * k);
            }
        }
    }

    /// ggml's `dequantize_row_q6_K`: `(d · sc) · (c − 32)`.
    fn dequantize_reference(src: &[BlockQ6K], dst: &mut [f32]) {
        assert_eq!(dst.len(), src.len() * QK_K, "row length");
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
            let d = b.d.to_f32();
            for (j, o) in y.iter_mut().enumerate() {
                *o = d * b.scales[j / 16] as f32 * (b.code(j) as i32 - 32) as f32;
            }
        }
    }

    /// `Σ_blocks d_x · d · Σ_g sc_g · (Σ c·q − 32 · Σ q)`, the sums in integers.
    fn dot_reference(w: &[BlockQ6K], x: &[BlockA8K]) -> f32 {
        assert_eq!(w.len(), x.len());
        let mut s = 0.0f32;
        for (b, a) in w.iter().zip(x) {
            let mut isum = 0i32;
            for g in 0..16 {
                let dot: i32 = (16 * g..16 * g + 16).map(|j| b.code(j) as i32 * a.qs[j] as i32).sum();
                isum += b.scales[g] as i32 * (dot - 32 * a.bsums[g] as i32);
            }
            s += a.d * (b.d.to_f32() * isum as f32);
        }
        s
    }

    fn kernels(tier: Tier) -> Kernels<Q6K> {
        x86_kernels!(tier, k_avx2, dot_q6k, rows4_q6k, dequantize_q6k)
    }
}
