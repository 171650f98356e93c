//! The Q5_1 row (ggml's `block_q5_1`): 32 weights of 5 bits with an F16
//! scale and an F16 minimum, read by int8 activations ([`BlockA8`]).
//!
//! | block | bytes / 32 weights | value of weight j |
//! |---|---|---|
//! | [`BlockQ5_1`] `d: f16, m: f16, qh: [u8; 4], qs: [u8; 16]` | 24 | `d · c_j + m`, `c_j` five bits as in [`super::BlockQ5_0`] |

use super::act::{BlockA8, QK_A8};
use super::q5_0::{codes5, pack5};
use super::{x86_kernels, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::f16;

const QK: usize = QK_A8;

/// 32 weights as `d · c + m`, `c` five bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ5_1 {
    /// The scale.
    pub d: f16,
    /// The minimum (the value of code 0).
    pub m: f16,
    /// Bit `j` (of the little-endian u32): weight `j`'s fifth bit.
    pub qh: [u8; 4],
    /// Byte `i`: weight `i`'s low four bits in the low nibble, weight `i + 16`'s in the high one.
    pub qs: [u8; QK / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24 && std::mem::align_of::<BlockQ5_1>() == 2);

impl BlockQ5_1 {
    /// A block of zeros.
    pub const ZERO: BlockQ5_1 = BlockQ5_1 { d: f16::ZERO, m: f16::ZERO, qh: [0; 4], qs: [0; QK / 2] };
}

/// The Q5_1 row of the format table.
#[allow(non_camel_case_types)]
pub struct Q5_1;

impl Format for Q5_1 {
    const TYPE: WeightType = WeightType::Q5_1;
    const NAME: &'static str = "q5_1";
    type Block = BlockQ5_1;
    const BLOCK_LEN: usize = QK;
    type Act = BlockA8;
    const ZERO: BlockQ5_1 = BlockQ5_1::ZERO;
    const QUANTIZED: bool = false;

    fn wrap(data: &[BlockQ5_1]) -> Weights<'_> {
        Weights::Q5_1(data)
    }

    /// `d = (max − min) / 31`, `m = min` (F16), codes `round((x − m) / d)`.
    fn quantize_row(src: &[f32], dst: &mut [BlockQ5_1]) {
        assert_eq!(src.len(), dst.len() * QK, "row length");
        for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
            let (lo, hi) = x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| (l.min(v), h.max(v)));
            let d = f16::from_f32((hi - lo) / 31.0);
            let m = f16::from_f32(lo);
            let (df, mf) = (d.to_f32(), m.to_f32());
            let inv = if df > 0.0 { 1.0 / df } else { 0.0 };
            let c: [u8; QK] = std::array::from_fn(|j| ((x[j] - mf) * inv).round().clamp(0.0, 31.0) as u8);
            let (qh, qs) = pack5(&c);
            *b = BlockQ5_1 { d, m, qh, qs };
        }
    }

    /// ggml's `dequantize_row_q5_1`: `(d · c) + m`, two roundings.
    fn dequantize_reference(src: &[BlockQ5_1], dst: &mut [f32]) {
        assert_eq!(dst.len(), src.len() * QK, "row length");
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
            let (d, m) = (b.d.to_f32(), b.m.to_f32());
            for (o, c) in y.iter_mut().zip(codes5(b.qh, &b.qs)) {
                *o = d * c as f32 + m;
            }
        }
    }

    /// `Σ_blocks d·d_x·Σ c·q + m·(d_x·Σ q)`, integer products per block.
    fn dot_reference(w: &[BlockQ5_1], x: &[BlockA8]) -> f32 {
        assert_eq!(w.len(), x.len());
        let mut s = 0.0f32;
        for (b, a) in w.iter().zip(x) {
            let dot: i32 = codes5(b.qh, &b.qs).iter().zip(&a.qs).map(|(&c, &q)| c as i32 * q as i32).sum();
            s += b.d.to_f32() * a.d * dot as f32 + b.m.to_f32() * (a.d * a.sum as f32);
        }
        s
    }

    fn kernels(tier: Tier) -> Kernels<Q5_1> {
        x86_kernels!(tier, legacy_avx2, dot_q5_1, rows4_q5_1, dequantize_q5_1)
    }
}
