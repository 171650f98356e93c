//! The Q4_0 row (ggml's `block_q4_0`): 32 weights as nibbles with one F16
//! scale, read by int8 activations ([`BlockA8`]), as GGUF files carry them
//! (read in place).
//!
//! | block | bytes / 32 weights | value of weight j |
//! |---|---|---|
//! | [`BlockQ4_0`] `d: f16, qs: [u8; 16]` | 18 | `d · (nibble_j − 8)`: low nibbles are j = 0..16, high nibbles j = 16..32 |
//!
//! ember's own INT4 ([`super::Int4`]) holds the same numbers, four of these
//! blocks at a time laid out for its kernels; ember writes INT4 matrices to
//! GGUF files as Q4_0 ([`super::BlockQ4::to_q4_0`]). Its kernels take
//! INT4's step from four blocks at a time (`int_avx512`, and `int_avx2::x4`
//! through `Group4`), so a Q4_0 row gives the bits of the INT4 row of the
//! same numbers on every tier.

use super::act::{BlockA8, QK_A8};
use super::{reference_kernels, Codes, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::f16;

const QK: usize = QK_A8;

/// 32 weights as `d · (nibble − 8)`; byte i holds weight i (low nibble) and
/// weight i + 16 (high nibble).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4_0 {
    /// The scale.
    pub d: f16,
    /// Byte `i`: weight `i` in the low nibble, weight `i + 16` in the high one.
    pub qs: [u8; QK / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18 && std::mem::align_of::<BlockQ4_0>() == 2);

impl BlockQ4_0 {
    /// A block of zeros (every nibble 8).
    pub const ZERO: BlockQ4_0 = BlockQ4_0 { d: f16::ZERO, qs: [0x88; QK / 2] };
}

/// The 32 nibble codes of a Q4_0 block's (or an INT4 sub-block's) 16 bytes,
/// weight `j` in `[j]`: the low nibbles are weights 0..16, the high ones
/// 16..32.
#[inline]
pub(crate) fn codes4(qs: &[u8; QK / 2]) -> [u8; QK] {
    // Sixteen bytes at once (byte by byte, LLVM kept this scalar, a fifth
    // of an INT4 pp128's time in the prefill's packing).
    let q = u128::from_le_bytes(*qs);
    let nibbles = 0x0f0f_0f0f_0f0f_0f0f_0f0f_0f0f_0f0f_0f0fu128;
    let mut u = [0u8; QK];
    u[..QK / 2].copy_from_slice(&(q & nibbles).to_le_bytes());
    u[QK / 2..].copy_from_slice(&((q >> 4) & nibbles).to_le_bytes());
    u
}

/// Packs 32 four-bit codes into Q4_0's 16 bytes.
pub(crate) fn pack4(c: &[u8; QK]) -> [u8; QK / 2] {
    std::array::from_fn(|i| (c[i] & 15) | ((c[i + QK / 2] & 15) << 4))
}

/// The Q4_0 row of the format table.
#[allow(non_camel_case_types)]
pub struct Q4_0;

impl Format for Q4_0 {
    const TYPE: WeightType = WeightType::Q4_0;
    const NAME: &'static str = "q4_0";
    type Block = BlockQ4_0;
    const BLOCK_LEN: usize = QK;
    type Act = BlockA8;
    const ZERO: BlockQ4_0 = BlockQ4_0::ZERO;
    const QUANTIZED: bool = false;

    fn wrap(data: &[BlockQ4_0]) -> Weights<'_> {
        Weights::Q4_0(data)
    }

    /// ggml's rule: `d = extreme / −8` (F16), codes `round(x / d) + 8`
    /// clamped to 0..=15.
    fn quantize_row(src: &[f32], dst: &mut [BlockQ4_0]) {
        assert_eq!(src.len(), dst.len() * QK, "row length");
        for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
            let max = x.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            let d = f16::from_f32(max / -8.0);
            let df = d.to_f32();
            let inv = if df != 0.0 { 1.0 / df } else { 0.0 };
            let c: [u8; QK] = std::array::from_fn(|j| ((x[j] * inv).round() + 8.0).clamp(0.0, 15.0) as u8);
            *b = BlockQ4_0 { d, qs: pack4(&c) };
        }
    }

    /// ggml's `dequantize_row_q4_0`: `d · (n − 8)`.
    fn dequantize_reference(src: &[BlockQ4_0], dst: &mut [f32]) {
        assert_eq!(dst.len(), src.len() * QK, "row length");
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
            let d = b.d.to_f32();
            for (o, n) in y.iter_mut().zip(codes4(&b.qs)) {
                *o = d * (n as i32 - 8) as f32;
            }
        }
    }

    /// `Σ_blocks d_w · d_x · (Σ n·q − 8·Σ q)`, integer products per block.
    fn dot_reference(w: &[BlockQ4_0], x: &[BlockA8]) -> f32 {
        assert_eq!(w.len(), x.len());
        let mut s = 0.0f32;
        for (b, a) in w.iter().zip(x) {
            let dot: i32 = codes4(&b.qs).iter().zip(&a.qs).map(|(&n, &q)| n as i32 * q as i32).sum();
            s += b.d.to_f32() * a.d * (dot - 8 * a.sum) as f32;
        }
        s
    }

    /// The nibbles themselves, offset 8.
    #[inline]
    fn codes(b: &BlockQ4_0, _sub: usize) -> Option<Codes> {
        Some(Codes { d: b.d.to_f32(), u: codes4(&b.qs), offset: 8 })
    }

    fn kernels(tier: Tier) -> Kernels<Q4_0> {
        #[cfg(target_arch = "x86_64")]
        let k = |dot, rows4, rows4_quads| Kernels {
            dot,
            rows4,
            rows4_quads: Some(rows4_quads),
            dequantize: super::int_avx2::dequantize_q4_0,
        };
        match tier {
            Tier::Scalar => reference_kernels(),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                use super::int_avx2::x4::avx2 as m;
                k(m::dot_x4::<BlockQ4_0>, m::rows4_x4::<BlockQ4_0>, m::rows4_x4_quads::<BlockQ4_0>)
            }
            #[cfg(target_arch = "x86_64")]
            Tier::AvxVnni => {
                use super::int_avx2::x4::vnni as m;
                k(m::dot_x4::<BlockQ4_0>, m::rows4_x4::<BlockQ4_0>, m::rows4_x4_quads::<BlockQ4_0>)
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 => {
                use super::int_avx512::bw as m;
                k(m::dot_q4_0, m::rows4_q4_0, m::rows4_q4_0_quads)
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
                use super::int_avx512::vnni as m;
                k(m::dot_q4_0, m::rows4_q4_0, m::rows4_q4_0_quads)
            }
            #[cfg(not(target_arch = "x86_64"))]
            Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
                unreachable!("x86 tiers are only detected on x86")
            }
        }
    }
}
