//! The Q5_K row (ggml's `block_q5_K`): Q4_K's super-blocks with a fifth bit
//! per weight, read by 256-wide int8 activations ([`BlockA8K`]).
//!
//! | block | bytes / 256 weights | value of weight j in group g = j / 32 |
//! |---|---|---|
//! | [`BlockQ5K`] `d, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]` | 176 | `(d · sc_g) · c_j − dmin · m_g`, `c_j` = Q4_K's nibble + 16 · bit g of `qh[j % 32]` |

use super::act::BlockA8K;
use super::kq::{pack_scale_min_k4, scale_min_k4, QK_K};
use super::q4_k::quantize_k4;
use super::{x86_kernels, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::f16;

/// 256 weights of five bits in eight groups of 32.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ5K {
    /// The scale of the group scales.
    pub d: f16,
    /// The scale of the group minimums.
    pub dmin: f16,
    /// Eight six-bit scales and eight six-bit minimums (`scale_min_k4`).
    pub scales: [u8; 12],
    /// Bit `g` of byte `l`: the fifth bit of weight `32 g + l`.
    pub qh: [u8; QK_K / 8],
    /// The low four bits, laid out as Q4_K's nibbles.
    pub qs: [u8; QK_K / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176 && std::mem::align_of::<BlockQ5K>() == 2);

impl BlockQ5K {
    /// A block of zeros.
    pub const ZERO: BlockQ5K =
        BlockQ5K { d: f16::ZERO, dmin: f16::ZERO, scales: [0; 12], qh: [0; QK_K / 8], qs: [0; QK_K / 2] };

    /// Weight `j`'s five-bit code.
    #[inline]
    pub fn code(&self, j: usize) -> u8 {
        let (c, r) = (j / 64, j % 64);
        let b = self.qs[32 * c + r % 32];
        let low = if r < 32 { b & 15 } else { b >> 4 };
        low | (((self.qh[j % 32] >> (j / 32)) & 1) << 4)
    }
}

/// The Q5_K row of the format table.
pub struct Q5K;

impl Format for Q5K {
    const TYPE: WeightType = WeightType::Q5K;
    const NAME: &'static str = "q5_k";
    type Block = BlockQ5K;
    const BLOCK_LEN: usize = QK_K;
    type Act = BlockA8K;
    const ZERO: BlockQ5K = BlockQ5K::ZERO;
    const QUANTIZED: bool = false;

    fn wrap(data: &[BlockQ5K]) -> Weights<'_> {
        Weights::Q5K(data)
    }

    /// Q4_K's simple quantizer with five-bit codes.
    fn quantize_row(src: &[f32], dst: &mut [BlockQ5K]) {
        assert_eq!(src.len(), dst.len() * QK_K, "row length");
        for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
            let (d, dmin, sc, m, q) = quantize_k4(x, 31);
            let qs = std::array::from_fn(|i| {
                let (c, l) = (i / 32, i % 32);
                (q[64 * c + l] & 15) | ((q[64 * c + 32 + l] & 15) << 4)
            });
            let qh = std::array::from_fn(|l| (0..8).fold(0u8, |h, g| h | ((q[32 * g + l] >> 4) << g)));
            *b = BlockQ5K { d, dmin, scales: pack_scale_min_k4(&sc, &m), qh, qs };
        }
    }

    /// ggml's `dequantize_row_q5_K`: `(d · sc) · c − (dmin · m)`.
    fn dequantize_reference(src: &[BlockQ5K], dst: &mut [f32]) {
        assert_eq!(dst.len(), src.len() * QK_K, "row length");
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
            let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
            let (sc, m) = scale_min_k4(&b.scales);
            for (j, o) in y.iter_mut().enumerate() {
                let g = j / 32;
                *o = d * sc[g] as f32 * b.code(j) as f32 - dmin * m[g] as f32;
            }
        }
    }

    /// As Q4_K's, with five-bit codes.
    fn dot_reference(w: &[BlockQ5K], x: &[BlockA8K]) -> f32 {
        assert_eq!(w.len(), x.len());
        let mut s = 0.0f32;
        for (b, a) in w.iter().zip(x) {
            let (sc, m) = scale_min_k4(&b.scales);
            let (mut isum, mut msum) = (0i32, 0i32);
            for g in 0..8 {
                let dot: i32 = (32 * g..32 * g + 32).map(|j| b.code(j) as i32 * a.qs[j] as i32).sum();
                isum += sc[g] as i32 * dot;
                msum += m[g] as i32 * (a.bsums[2 * g] as i32 + a.bsums[2 * g + 1] as i32);
            }
            s += a.d * (b.d.to_f32() * isum as f32 - b.dmin.to_f32() * msum as f32);
        }
        s
    }

    fn kernels(tier: Tier) -> Kernels<Q5K> {
        x86_kernels!(tier, k_avx2, dot_q5k, rows4_q5k, dequantize_q5k)
    }
}
