//! The Q4_K row (ggml's `block_q4_K`): super-blocks of 256 weights in eight
//! groups of 32, four bits each, read by 256-wide int8 activations
//! ([`BlockA8K`]).
//!
//! | block | bytes / 256 weights | value of weight j in group g = j / 32 |
//! |---|---|---|
//! | [`BlockQ4K`] `d, dmin: f16, scales: [u8; 12], qs: [u8; 128]` | 144 | `(d · sc_g) · n_j − dmin · m_g`, `sc_g`, `m_g` six bits ([`scale_min_k4`]) |
//!
//! Bytes `32 c .. 32 c + 32` of `qs` hold groups `2c` (low nibbles) and
//! `2c + 1` (high nibbles). The dot product pays the minimums with the
//! activations' sums of 16: `Σ_g m_g · Σ_{j∈g} q_j`.

use super::act::BlockA8K;
use super::kq::{codes_min, fit_min, level, pack_scale_min_k4, scale_min_k4, QK_K};
use super::{x86_kernels, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::f16;

/// 256 weights in eight groups of 32 with six-bit scales and minimums.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4K {
    /// The scale of the group scales.
    pub d: f16,
    /// The scale of the group minimums.
    pub dmin: f16,
    /// Eight six-bit scales and eight six-bit minimums (`scale_min_k4`).
    pub scales: [u8; 12],
    /// The nibbles: byte `32 c + l` holds weight `64 c + l` (low) and `64 c + 32 + l` (high).
    pub qs: [u8; QK_K / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144 && std::mem::align_of::<BlockQ4K>() == 2);

impl BlockQ4K {
    /// A block of zeros.
    pub const ZERO: BlockQ4K = BlockQ4K { d: f16::ZERO, dmin: f16::ZERO, scales: [0; 12], qs: [0; QK_K / 2] };

    /// Weight `j`'s nibble.
    #[inline]
    pub fn code(&self, j: usize) -> u8 {
        let (c, r) = (j / 64, j % 64);
        let b = self.qs[32 * c + r % 32];
        if r < 32 {
            b & 15
        } else {
            b >> 4
        }
    }
}

/// Quantizes `x (256,)` into groups of 32 as `(d · sc_g) · q − dmin · m_g`,
/// `q` in `0..=nmax`: each group fitted by [`fit_min`], the group scales
/// and minimums rounded to six bits. Returns `(d, dmin, sc, m, codes)`.
pub(crate) fn quantize_k4(x: &[f32], nmax: u8) -> (f16, f16, [u8; 8], [u8; 8], [u8; QK_K]) {
    let fits: Vec<(f32, f32)> = x.chunks_exact(32).map(|g| fit_min(g, nmax)).collect();
    let d = f16::from_f32(fits.iter().fold(0.0f32, |a, f| a.max(f.0)) / 63.0);
    let dmin = f16::from_f32(fits.iter().fold(0.0f32, |a, f| a.max(f.1)) / 63.0);
    let (df, mf) = (d.to_f32(), dmin.to_f32());
    let sc: [u8; 8] = std::array::from_fn(|g| level(fits[g].0, df, 63));
    let m: [u8; 8] = std::array::from_fn(|g| level(fits[g].1, mf, 63));
    let mut q = [0u8; QK_K];
    for g in 0..8 {
        let r = 32 * g..32 * g + 32;
        codes_min(&x[r.clone()], df * sc[g] as f32, mf * m[g] as f32, nmax, &mut q[r]);
    }
    (d, dmin, sc, m, q)
}

/// The Q4_K row of the format table.
pub struct Q4K;

impl Format for Q4K {
    const TYPE: WeightType = WeightType::Q4K;
    const NAME: &'static str = "q4_k";
    type Block = BlockQ4K;
    const BLOCK_LEN: usize = QK_K;
    type Act = BlockA8K;
    const ZERO: BlockQ4K = BlockQ4K::ZERO;
    const QUANTIZED: bool = false;

    fn wrap(data: &[BlockQ4K]) -> Weights<'_> {
        Weights::Q4K(data)
    }

    /// `quantize_k4` with four-bit codes: a simple correct quantizer
    /// (llama.cpp's searches for better scales; tests only need data).
    fn quantize_row(src: &[f32], dst: &mut [BlockQ4K]) {
        assert_eq!(src.len(), dst.len() * QK_K, "row length");
        for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
            let (d, dmin, sc, m, q) = quantize_k4(x, 15);
            let qs = std::array::from_fn(|i| {
                let (c, l) = (i / 32, i % 32);
                q[64 * c + l] | (q[64 * c + 32 + l] << 4)
            });
            *b = BlockQ4K { d, dmin, scales: pack_scale_min_k4(&sc, &m), qs };
        }
    }

    /// ggml's `dequantize_row_q4_K`: `(d · sc) · n − (dmin · m)`, each
    /// product and the difference rounded to f32.
    fn dequantize_reference(src: &[BlockQ4K], dst: &mut [f32]) {
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

    /// `Σ_blocks d_x · (d · Σ_g sc_g Σ n·q − dmin · Σ_g m_g Σ q)`, the sums in
    /// integers.
    fn dot_reference(w: &[BlockQ4K], x: &[BlockA8K]) -> f32 {
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

    fn kernels(tier: Tier) -> Kernels<Q4K> {
        x86_kernels!(tier, k_avx2, dot_q4k, rows4_q4k, dequantize_q4k)
    }
}
