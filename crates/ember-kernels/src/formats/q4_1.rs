//! The Q4_1 row (ggml's `block_q4_1`): 32 weights as nibbles with an F16
//! scale and an F16 minimum, read by int8 activations ([`BlockA8`]).
//!
//! | block | bytes / 32 weights | value of weight j |
//! |---|---|---|
//! | [`BlockQ4_1`] `d: f16, m: f16, qs: [u8; 16]` | 20 | `d · n_j + m`: low nibbles are j = 0..16, high nibbles j = 16..32 |
//!
//! The dot product against `d_x · q` pays the minimum with the activation
//! block's sum: `Σ (d·n + m)·d_x·q = d·d_x·Σ n·q + m·d_x·Σ q`.

use super::act::{BlockA8, QK_A8};
use super::{x86_kernels, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::f16;

const QK: usize = QK_A8;

/// 32 weights as `d · n + m`; byte i holds weight i (low nibble) and weight
/// i + 16 (high nibble).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4_1 {
    /// The scale.
    pub d: f16,
    /// The minimum (the value of code 0).
    pub m: f16,
    /// Byte `i`: weight `i` in the low nibble, weight `i + 16` in the high one.
    pub qs: [u8; QK / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20 && std::mem::align_of::<BlockQ4_1>() == 2);

impl BlockQ4_1 {
    /// A block of zeros.
    pub const ZERO: BlockQ4_1 = BlockQ4_1 { d: f16::ZERO, m: f16::ZERO, qs: [0; QK / 2] };

    /// Weight `j`'s nibble.
    #[inline]
    pub fn code(&self, j: usize) -> u8 {
        if j < QK / 2 {
            self.qs[j] & 15
        } else {
            self.qs[j - QK / 2] >> 4
        }
    }
}

/// The Q4_1 row of the format table.
#[allow(non_camel_case_types)]
pub struct Q4_1;

impl Format for Q4_1 {
    const TYPE: WeightType = WeightType::Q4_1;
    const NAME: &'static str = "q4_1";
    type Block = BlockQ4_1;
    const BLOCK_LEN: usize = QK;
    type Act = BlockA8;
    const ZERO: BlockQ4_1 = BlockQ4_1::ZERO;
    const QUANTIZED: bool = false;

    fn wrap(data: &[BlockQ4_1]) -> Weights<'_> {
        Weights::Q4_1(data)
    }

    /// `d = (max − min) / 15`, `m = min` (both rounded to F16), codes
    /// `round((x − m) / d)`.
    fn quantize_row(src: &[f32], dst: &mut [BlockQ4_1]) {
        assert_eq!(src.len(), dst.len() * QK, "row length");
        for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
            let (lo, hi) = x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| (l.min(v), h.max(v)));
            let d = f16::from_f32((hi - lo) / 15.0);
            let m = f16::from_f32(lo);
            let (df, mf) = (d.to_f32(), m.to_f32());
            let inv = if df > 0.0 { 1.0 / df } else { 0.0 };
            let q: [u8; QK] = std::array::from_fn(|j| ((x[j] - mf) * inv).round().clamp(0.0, 15.0) as u8);
            *b = BlockQ4_1 { d, m, qs: std::array::from_fn(|i| q[i] | (q[i + QK / 2] << 4)) };
        }
    }

    /// ggml's `dequantize_row_q4_1`: `(d · n) + m`, two roundings.
    fn dequantize_reference(src: &[BlockQ4_1], dst: &mut [f32]) {
        assert_eq!(dst.len(), src.len() * QK, "row length");
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
            let (d, m) = (b.d.to_f32(), b.m.to_f32());
            for (j, o) in y.iter_mut().enumerate() {
                *o = d * b.code(j) as f32 + m;
            }
        }
    }

    /// `Σ_blocks d·d_x·Σ n·q + m·(d_x·Σ q)`, integer products per block.
    fn dot_reference(w: &[BlockQ4_1], x: &[BlockA8]) -> f32 {
        assert_eq!(w.len(), x.len());
        let mut s = 0.0f32;
        for (b, a) in w.iter().zip(x) {
            let dot: i32 = (0..QK).map(|j| b.code(j) as i32 * a.qs[j] as i32).sum();
            s += b.d.to_f32() * a.d * dot as f32 + b.m.to_f32() * (a.d * a.sum as f32);
        }
        s
    }

    fn kernels(tier: Tier) -> Kernels<Q4_1> {
        x86_kernels!(tier, legacy_avx2, dot_q4_1, rows4_q4_1, dequantize_q4_1)
    }
}
