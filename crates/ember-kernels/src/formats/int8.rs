//! The INT8 row: symmetric blocks of 32 weights with one F16 scale,
//! `d = max|w| / 127`, read by int8 activations ([`BlockA8`]).
//!
//! | block | bytes / 32 weights | value of weight j |
//! |---|---|---|
//! | [`BlockQ8`] `d: f16, qs: [i8; 32]` | 34 | `d · qs[j]`, `qs` in −127..=127 |

use super::act::{BlockA8, QK_A8};
use super::{reference_kernels, Codes, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::f16;

/// Weights per block.
pub const QK8: usize = 32;
const _: () = assert!(QK8 == QK_A8, "INT8 blocks pair with activation blocks of the same length");

/// 32 weights as `d · qs[j]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ8 {
    /// The scale.
    pub d: f16,
    /// The 32 codes: weight `j` is `d · qs[j]`.
    pub qs: [i8; QK8],
}

const _: () = assert!(std::mem::size_of::<BlockQ8>() == 34 && std::mem::align_of::<BlockQ8>() == 2);

impl BlockQ8 {
    /// A block of zeros.
    pub const ZERO: BlockQ8 = BlockQ8 { d: f16::ZERO, qs: [0; QK8] };
}

/// The INT8 row of the format table.
pub struct Int8;

impl Format for Int8 {
    const TYPE: WeightType = WeightType::Int8;
    const NAME: &'static str = "int8";
    type Block = BlockQ8;
    const BLOCK_LEN: usize = QK8;
    type Act = BlockA8;
    const ZERO: BlockQ8 = BlockQ8::ZERO;
    const QUANTIZED: bool = true;

    fn wrap(data: &[BlockQ8]) -> Weights<'_> {
        Weights::Int8(data)
    }

    /// `d = max|w| / 127` rounded to F16, codes rounded to nearest.
    fn quantize_row(src: &[f32], dst: &mut [BlockQ8]) {
        assert_eq!(src.len(), dst.len() * QK8, "row length");
        for (x, b) in src.chunks_exact(QK8).zip(dst.iter_mut()) {
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

    fn dequantize_reference(src: &[BlockQ8], dst: &mut [f32]) {
        assert_eq!(dst.len(), src.len() * QK8, "row length");
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK8)) {
            let d = b.d.to_f32();
            for (o, &q) in y.iter_mut().zip(&b.qs) {
                *o = d * q as f32;
            }
        }
    }

    /// `Σ_blocks d_w · d_x · Σ q_w · q_x`, integer products per block.
    fn dot_reference(w: &[BlockQ8], x: &[BlockA8]) -> f32 {
        assert_eq!(w.len(), x.len());
        let mut s = 0.0f32;
        for (b, a) in w.iter().zip(x) {
            let dot: i32 = b.qs.iter().zip(&a.qs).map(|(&p, &q)| p as i32 * q as i32).sum();
            s += b.d.to_f32() * a.d * dot as f32;
        }
        s
    }

    /// `u = q + 128` (the sign bit flipped), offset 128.
    #[inline]
    fn codes(b: &BlockQ8, _sub: usize) -> Option<Codes> {
        Some(Codes { d: b.d.to_f32(), u: b.qs.map(|q| (q as u8) ^ 0x80), offset: 128 })
    }

    fn kernels(tier: Tier) -> Kernels<Int8> {
        #[cfg(target_arch = "x86_64")]
        let k = |dot, rows4| Kernels { dot, rows4, rows4_quads: None, dequantize: super::int_avx2::dequantize_q8 };
        match tier {
            Tier::Scalar => reference_kernels(),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 | Tier::Avx512 => {
                use super::int_avx2::q8::avx2 as m;
                k(m::dot_q8, m::rows4_q8)
            }
            #[cfg(target_arch = "x86_64")]
            Tier::AvxVnni => {
                use super::int_avx2::q8::vnni as m;
                k(m::dot_q8, m::rows4_q8)
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
                use super::int_avx512::vnni8 as m;
                k(m::dot_q8, m::rows4_q8)
            }
            #[cfg(not(target_arch = "x86_64"))]
            Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
                unreachable!("x86 tiers are only detected on x86")
            }
        }
    }
}
