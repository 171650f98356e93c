//! The Q5_0 row (ggml's `block_q5_0`): 32 weights of 5 bits with an F16
//! scale, read by int8 activations ([`BlockA8`]).
//!
//! | block | bytes / 32 weights | value of weight j |
//! |---|---|---|
//! | [`BlockQ5_0`] `d: f16, qh: [u8; 4], qs: [u8; 16]` | 22 | `d · (c_j − 16)`, `c_j` = nibble j (low nibbles j = 0..16, high 16..32) + 16 · bit j of `qh` (little-endian u32) |
//!
//! Its codes are unsigned about an offset of 16, so the integer matrix
//! products of prefill ([`crate::gemm_int8`]) take it as they take INT4.

use super::act::{BlockA8, QK_A8};
use super::{reference_kernels, Codes, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::f16;

const QK: usize = QK_A8;

/// 32 weights as `d · (c − 16)`, `c` five bits: four in `qs` (as Q4_0's
/// nibbles), the fifth in bit j of `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ5_0 {
    /// The scale.
    pub d: f16,
    /// Bit `j` (of the little-endian u32): weight `j`'s fifth bit.
    pub qh: [u8; 4],
    /// Byte `i`: weight `i`'s low four bits in the low nibble, weight `i + 16`'s in the high one.
    pub qs: [u8; QK / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22 && std::mem::align_of::<BlockQ5_0>() == 2);

impl BlockQ5_0 {
    /// A block of zeros (every code 16).
    pub const ZERO: BlockQ5_0 = BlockQ5_0 { d: f16::ZERO, qh: [0xff; 4], qs: [0; QK / 2] };
}

/// The 32 five-bit codes of `qh` and `qs` (Q5_0's and Q5_1's layout).
#[inline]
pub(crate) fn codes5(qh: [u8; 4], qs: &[u8; QK / 2]) -> [u8; QK] {
    let h = u32::from_le_bytes(qh);
    std::array::from_fn(|j| {
        let low = if j < QK / 2 { qs[j] & 15 } else { qs[j - QK / 2] >> 4 };
        low | ((((h >> j) & 1) as u8) << 4)
    })
}

/// Packs 32 five-bit codes into `(qh, qs)`.
pub(crate) fn pack5(c: &[u8; QK]) -> ([u8; 4], [u8; QK / 2]) {
    let h = c.iter().enumerate().fold(0u32, |h, (j, &v)| h | (((v >> 4) as u32 & 1) << j));
    (h.to_le_bytes(), std::array::from_fn(|i| (c[i] & 15) | ((c[i + QK / 2] & 15) << 4)))
}

/// The Q5_0 row of the format table.
#[allow(non_camel_case_types)]
pub struct Q5_0;

impl Format for Q5_0 {
    const TYPE: WeightType = WeightType::Q5_0;
    const NAME: &'static str = "q5_0";
    type Block = BlockQ5_0;
    const BLOCK_LEN: usize = QK;
    type Act = BlockA8;
    const ZERO: BlockQ5_0 = BlockQ5_0::ZERO;
    const QUANTIZED: bool = false;

    fn wrap(data: &[BlockQ5_0]) -> Weights<'_> {
        Weights::Q5_0(data)
    }

    /// ggml's rule: `d = extreme / −16` (F16), codes `round(x / d) + 16`
    /// clamped to 0..=31.
    fn quantize_row(src: &[f32], dst: &mut [BlockQ5_0]) {
        assert_eq!(src.len(), dst.len() * QK, "row length");
        for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
            let max = x.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            let d = f16::from_f32(max / -16.0);
            let df = d.to_f32();
            let inv = if df != 0.0 { 1.0 / df } else { 0.0 };
            let c: [u8; QK] = std::array::from_fn(|j| ((x[j] * inv).round() + 16.0).clamp(0.0, 31.0) as u8);
            let (qh, qs) = pack5(&c);
            *b = BlockQ5_0 { d, qh, qs };
        }
    }

    /// ggml's `dequantize_row_q5_0`: `d · (c − 16)`.
    fn dequantize_reference(src: &[BlockQ5_0], dst: &mut [f32]) {
        assert_eq!(dst.len(), src.len() * QK, "row length");
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
            let d = b.d.to_f32();
            for (o, c) in y.iter_mut().zip(codes5(b.qh, &b.qs)) {
                *o = d * (c as i32 - 16) as f32;
            }
        }
    }

    /// `Σ_blocks d·d_x·(Σ c·q − 16·Σ q)`, integer products per block.
    fn dot_reference(w: &[BlockQ5_0], x: &[BlockA8]) -> f32 {
        assert_eq!(w.len(), x.len());
        let mut s = 0.0f32;
        for (b, a) in w.iter().zip(x) {
            let dot: i32 = codes5(b.qh, &b.qs).iter().zip(&a.qs).map(|(&c, &q)| c as i32 * q as i32).sum();
            s += b.d.to_f32() * a.d * (dot - 16 * a.sum) as f32;
        }
        s
    }

    /// The five-bit codes themselves, offset 16.
    #[inline]
    fn codes(b: &BlockQ5_0, _sub: usize) -> Option<Codes> {
        Some(Codes { d: b.d.to_f32(), u: codes5(b.qh, &b.qs), offset: 16 })
    }

    /// INT5's steps from four blocks at a time: on the AVX2 tiers through
    /// `Group4` (`int_avx2::x4`), on the AVX-512 tiers four blocks per
    /// register (`int_avx512`). So a Q5_0 row gives the bits of the INT5 row
    /// of the same numbers on every tier.
    fn kernels(tier: Tier) -> Kernels<Q5_0> {
        #[cfg(target_arch = "x86_64")]
        let k = |dot, rows4, rows4_quads| Kernels {
            dot,
            rows4,
            rows4_quads: Some(rows4_quads),
            dequantize: super::legacy_avx2::dequantize_q5_0,
        };
        match tier {
            Tier::Scalar => reference_kernels(),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                use super::int_avx2::x4::avx2 as m;
                k(m::dot_x4::<BlockQ5_0>, m::rows4_x4::<BlockQ5_0>, m::rows4_x4_quads::<BlockQ5_0>)
            }
            #[cfg(target_arch = "x86_64")]
            Tier::AvxVnni => {
                use super::int_avx2::x4::vnni as m;
                k(m::dot_x4::<BlockQ5_0>, m::rows4_x4::<BlockQ5_0>, m::rows4_x4_quads::<BlockQ5_0>)
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 => {
                use super::int_avx512::bw as m;
                k(m::dot_q5_0, m::rows4_q5_0, m::rows4_q5_0_quads)
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
                use super::int_avx512::vnni as m;
                k(m::dot_q5_0, m::rows4_q5_0, m::rows4_q5_0_quads)
            }
            #[cfg(not(target_arch = "x86_64"))]
            Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
                unreachable!("x86 tiers are only detected on x86")
            }
        }
    }
}
