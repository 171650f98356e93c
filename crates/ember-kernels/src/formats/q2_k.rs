//! The Q2_K row (ggml's `block_q2_K`): super-blocks of 256 weights of two
//! bits in sixteen groups of 16, each with a four-bit scale and minimum,
//! read by 256-wide int8 activations ([`BlockA8K`]).
//!
//! | block | bytes / 256 weights | value of weight j in group g = j / 16 |
//! |---|---|---|
//! | [`BlockQ2K`] `scales: [u8; 16], qs: [u8; 64], d, dmin: f16` | 84 | `(d · (s_g & 15)) · q_j − dmin · (s_g >> 4)` |
//!
//! Weight `128 h + 32 k + l` (k in 0..4, l in 0..32) is bits `2k, 2k + 1`
//! of `qs[32 h + l]`.

use super::act::BlockA8K;
use super::kq::{codes_min, fit_min, level, QK_K};
use super::{x86_kernels, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::f16;

/// 256 weights of two bits in sixteen groups of 16.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ2K {
    /// Group `g`'s scale (low nibble) and minimum (high nibble).
    pub scales: [u8; QK_K / 16],
    /// The codes, four per byte (see the module docs).
    pub qs: [u8; QK_K / 4],
    /// The scale of the group scales.
    pub d: f16,
    /// The scale of the group minimums.
    pub dmin: f16,
}

const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84 && std::mem::align_of::<BlockQ2K>() == 2);

impl BlockQ2K {
    /// A block of zeros.
    pub const ZERO: BlockQ2K = BlockQ2K { scales: [0; QK_K / 16], qs: [0; QK_K / 4], d: f16::ZERO, dmin: f16::ZERO };

    /// Weight `j`'s two-bit code.
    #[inline]
    pub fn code(&self, j: usize) -> u8 {
        let (h, k, l) = (j / 128, (j % 128) / 32, j % 32);
        (self.qs[32 * h + l] >> (2 * k)) & 3
    }
}

/// The Q2_K row of the format table.
pub struct Q2K;

impl Format for Q2K {
    const TYPE: WeightType = WeightType::Q2K;
    const NAME: &'static str = "q2_k";
    type Block = BlockQ2K;
    const BLOCK_LEN: usize = QK_K;
    type Act = BlockA8K;
    const ZERO: BlockQ2K = BlockQ2K::ZERO;
    const QUANTIZED: bool = false;

    fn wrap(data: &[BlockQ2K]) -> Weights<'_> {
        Weights::Q2K(data)
    }

    /// A simple correct quantizer: each group fitted by `fit_min`, its
    /// scale and minimum rounded to four bits.
    fn quantize_row(src: &[f32], dst: &mut [BlockQ2K]) {
        assert_eq!(src.len(), dst.len() * QK_K, "row length");
        for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
            let fits: Vec<(f32, f32)> = x.chunks_exact(16).map(|g| fit_min(g, 3)).collect();
            let d = f16::from_f32(fits.iter().fold(0.0f32, |a, f| a.max(f.0)) / 15.0);
            let dmin = f16::from_f32(fits.iter().fold(0.0f32, |a, f| a.max(f.1)) / 15.0);
            let (df, mf) = (d.to_f32(), dmin.to_f32());
            *b = BlockQ2K { d, dmin, ..BlockQ2K::ZERO };
            let mut q = [0u8; QK_K];
            for (g, fit) in fits.iter().enumerate() {
                let (s, m) = (level(fit.0, df, 15), level(fit.1, mf, 15));
                b.scales[g] = s | (m << 4);
                let r = 16 * g..16 * g + 16;
                codes_min(&x[r.clone()], df * s as f32, mf * m as f32, 3, &mut q[r]);
            }
            for (j, &v) in q.iter().enumerate() {
                let (h, k, l) = (j / 128, (j % 128) / 32, j % 32);
                b.qs[32 * h + l] |= v << (2 * k);
            }
        }
    }

    /// ggml's `dequantize_row_q2_K`: `(d · s) · q − (dmin · m)`.
    fn dequantize_reference(src: &[BlockQ2K], dst: &mut [f32]) {
        assert_eq!(dst.len(), src.len() * QK_K, "row length");
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
            let (d, dmin) = (b.d.to_f32(), b.dmin.to_f32());
            for (j, o) in y.iter_mut().enumerate() {
                let s = b.scales[j / 16];
                *o = d * (s & 15) as f32 * b.code(j) as f32 - dmin * (s >> 4) as f32;
            }
        }
    }

    /// `Σ_blocks d_x · (d · Σ_g s_g Σ q·x − dmin · Σ_g m_g Σ x)`, in integers.
    fn dot_reference(w: &[BlockQ2K], x: &[BlockA8K]) -> f32 {
        assert_eq!(w.len(), x.len());
        let mut s = 0.0f32;
        for (b, a) in w.iter().zip(x) {
            let (mut isum, mut msum) = (0i32, 0i32);
            for g in 0..16 {
                let dot: i32 = (16 * g..16 * g + 16).map(|j| b.code(j) as i32 * a.qs[j] as i32).sum();
                isum += (b.scales[g] & 15) as i32 * dot;
                msum += (b.scales[g] >> 4) as i32 * a.bsums[g] as i32;
            }
            s += a.d * (b.d.to_f32() * isum as f32 - b.dmin.to_f32() * msum as f32);
        }
        s
    }

    fn kernels(tier: Tier) -> Kernels<Q2K> {
        x86_kernels!(tier, k_avx2, dot_q2k, rows4_q2k, dequantize_q2k)
    }
}
