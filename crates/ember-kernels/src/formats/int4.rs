//! The INT4 row: blocks of 32 weights as nibbles with one F16 scale, read by
//! int8 activations ([`BlockA8`]).
//!
//! | block | bytes / 32 weights | value of weight j |
//! |---|---|---|
//! | [`BlockQ4`] `d: f16, qs: [u8; 16]` | 18 | `d · (nibble_j − 8)`: low nibbles are j = 0..16, high nibbles j = 16..32 |
//!
//! **Scales.** The quantizer searches: for each block it tries scales around
//! `max|w| / 8` (both signs of the extreme, so the asymmetric code range
//! −8..=7 is used where it helps), rounds, refits `d` by least squares for the
//! chosen codes, and keeps the scale with the smallest squared error. That
//! costs a few microseconds per block at load and removes a good part of the
//! error of the fixed `max / −8` rule.

use super::act::{BlockA8, QK_A8};
use super::{reference_kernels, Codes, Format, Kernels, WeightType, Weights};
use crate::cpu::Tier;
use half::f16;

/// Weights per block.
pub const QK4: usize = 32;
const _: () = assert!(QK4 == QK_A8, "INT4 blocks pair with activation blocks of the same length");
const QK: usize = QK4;

/// 32 weights as `d · (nibble − 8)`; byte i holds weight i (low nibble) and
/// weight i + 16 (high nibble).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockQ4 {
    /// The scale.
    pub d: f16,
    /// Byte `i`: weight `i` in the low nibble, weight `i + 16` in the high one.
    pub qs: [u8; QK4 / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ4>() == 18 && std::mem::align_of::<BlockQ4>() == 2);

impl BlockQ4 {
    /// A block of zeros (every nibble 8).
    pub const ZERO: BlockQ4 = BlockQ4 { d: f16::ZERO, qs: [0x88; QK4 / 2] };
}

/// The INT4 row of the format table.
pub struct Int4;

impl Format for Int4 {
    const TYPE: WeightType = WeightType::Int4;
    const NAME: &'static str = "int4";
    type Block = BlockQ4;
    const BLOCK_LEN: usize = QK4;
    type Act = BlockA8;
    const ZERO: BlockQ4 = BlockQ4::ZERO;
    const QUANTIZED: bool = true;

    fn wrap(data: &[BlockQ4]) -> Weights<'_> {
        Weights::Int4(data)
    }

    fn quantize_row(src: &[f32], dst: &mut [BlockQ4]) {
        quantize_q4_row(src, dst)
    }

    fn dequantize_reference(src: &[BlockQ4], dst: &mut [f32]) {
        assert_eq!(dst.len(), src.len() * QK, "row length");
        for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
            let d = b.d.to_f32();
            for i in 0..QK / 2 {
                y[i] = d * ((b.qs[i] & 15) as f32 - 8.0);
                y[i + QK / 2] = d * ((b.qs[i] >> 4) as f32 - 8.0);
            }
        }
    }

    /// `Σ_blocks d_w · d_x · (Σ n·q − 8·Σ q)`, integer products per block.
    fn dot_reference(w: &[BlockQ4], x: &[BlockA8]) -> f32 {
        assert_eq!(w.len(), x.len());
        let mut s = 0.0f32;
        for (b, a) in w.iter().zip(x) {
            let mut dot = 0i32;
            for i in 0..QK / 2 {
                dot += (b.qs[i] & 15) as i32 * a.qs[i] as i32 + (b.qs[i] >> 4) as i32 * a.qs[i + QK / 2] as i32;
            }
            s += b.d.to_f32() * a.d * (dot - 8 * a.sum) as f32;
        }
        s
    }

    /// The nibbles themselves, offset 8.
    #[inline]
    fn codes(b: &BlockQ4, _sub: usize) -> Option<Codes> {
        // Sixteen bytes at once: the low nibbles are weights 0..16, the high
        // ones 16..32 (byte by byte, LLVM kept this scalar, a fifth of an
        // INT4 pp128's time in the prefill's packing).
        let q = u128::from_le_bytes(b.qs);
        let nibbles = 0x0f0f_0f0f_0f0f_0f0f_0f0f_0f0f_0f0f_0f0fu128;
        let mut u = [0u8; QK];
        u[..QK / 2].copy_from_slice(&(q & nibbles).to_le_bytes());
        u[QK / 2..].copy_from_slice(&((q >> 4) & nibbles).to_le_bytes());
        Some(Codes { d: b.d.to_f32(), u, offset: 8 })
    }

    fn kernels(tier: Tier) -> Kernels<Int4> {
        match tier {
            Tier::Scalar => reference_kernels(),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                use super::int_avx2::pairs::avx2 as k;
                Kernels {
                    dot: k::dot_q4,
                    rows4: k::rows4_q4,
                    rows4_quads: Some(k::rows4_q4_quads),
                    dequantize: super::int_avx2::dequantize_q4,
                }
            }
            #[cfg(target_arch = "x86_64")]
            Tier::AvxVnni => {
                use super::int_avx2::pairs::vnni as k;
                Kernels {
                    dot: k::dot_q4,
                    rows4: k::rows4_q4,
                    rows4_quads: Some(k::rows4_q4_quads),
                    dequantize: super::int_avx2::dequantize_q4,
                }
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 => {
                use super::int_avx512::bw as k;
                Kernels {
                    dot: k::dot_q4,
                    rows4: k::rows4_q4,
                    rows4_quads: Some(k::rows4_q4_quads),
                    dequantize: super::int_avx2::dequantize_q4,
                }
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
                use super::int_avx512::vnni as k;
                Kernels {
                    dot: k::dot_q4,
                    rows4: k::rows4_q4,
                    rows4_quads: Some(k::rows4_q4_quads),
                    dequantize: super::int_avx2::dequantize_q4,
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
                unreachable!("x86 tiers are only detected on x86")
            }
        }
    }
}

/// The nibble codes of `x` at scale `d` (`inv = 1/d`): `round(x / d) + 8`,
/// clamped to 0..=15.
#[cfg(test)]
fn q4_codes(x: &[f32], inv: f32) -> [u8; QK] {
    Symmetric::INT4.codes(x, inv)
}

/// The squared error of a block at scale `d` with its codes.
#[cfg(test)]
fn q4_error(x: &[f32], d: f32, codes: &[u8; QK]) -> f32 {
    x.iter().zip(codes).map(|(&v, &n)| (v - d * (n as f32 - 8.0)).powi(2)).sum()
}

/// A symmetric block format's codes: weight = `d · (code − offset)`, codes
/// 0..=`top`. INT4 (offset 8, top 15) and INT5 (16, 31) share the scale
/// search ([`Symmetric::quantize_block`]).
#[derive(Clone, Copy)]
pub(super) struct Symmetric {
    offset: f32,
    top: f32,
    /// Candidate divisors of a block's signed extreme: around `−offset` (the
    /// extreme on code 0, Q4_0's and Q5_0's rule) and around `top − offset`
    /// (the extreme on the top code).
    ks: &'static [f32],
}

impl Symmetric {
    /// INT4: codes 0..=15 about 8.
    pub(super) const INT4: Symmetric = Symmetric {
        offset: 8.0,
        top: 15.0,
        ks: &[-8.5, -8.25, -8.0, -7.75, -7.5, -7.25, -7.0, 6.5, 6.75, 7.0, 7.25, 7.5, 7.75, 8.0],
    };
    /// INT5: codes 0..=31 about 16.
    pub(super) const INT5: Symmetric = Symmetric {
        offset: 16.0,
        top: 31.0,
        ks: &[
            -16.5, -16.25, -16.0, -15.75, -15.5, -15.25, -15.0, -14.5, 14.0, 14.5, 14.75, 15.0, 15.25, 15.5, 15.75,
            16.0,
        ],
    };

    /// The codes of `x` at scale `d` (`inv = 1/d`): `round(x / d) + offset`,
    /// clamped to 0..=top.
    #[inline]
    fn codes(self, x: &[f32], inv: f32) -> [u8; QK] {
        std::array::from_fn(|j| ((x[j] * inv).round() + self.offset).clamp(0.0, self.top) as u8)
    }

    /// The squared error of a block at scale `d` (`inv = 1/d`), its codes
    /// rounded as [`Symmetric::codes`] does, in one pass.
    #[inline]
    fn error_at(self, x: &[f32], d: f32, inv: f32) -> f32 {
        let mut err = 0.0;
        for &v in x {
            let n = ((v * inv).round() + self.offset).clamp(0.0, self.top);
            err += (v - d * (n - self.offset)).powi(2);
        }
        err
    }

    /// One block of 32 (see the module docs): the scale with the smallest
    /// squared error among the candidates and the least-squares refit of
    /// the best one, and its codes. `None` for a block of zeros.
    pub(super) fn quantize_block(self, x: &[f32]) -> Option<(f16, [u8; QK])> {
        debug_assert_eq!(x.len(), QK);
        let max = x.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        if max == 0.0 {
            return None;
        }
        let mut best = (f32::INFINITY, 0.0f32);
        let consider = |d: f32, best: &mut (f32, f32)| {
            let d = f16::from_f32(d).to_f32();
            if d != 0.0 && d.is_finite() {
                let err = self.error_at(x, d, 1.0 / d);
                if err < best.0 {
                    *best = (err, d);
                }
            }
        };
        for &k in self.ks {
            consider(max / k, &mut best);
        }
        // Refit the winner by least squares for its codes: Σ x·q / Σ q².
        let codes = self.codes(x, 1.0 / best.1);
        let (mut xq, mut qq) = (0.0f32, 0.0f32);
        for (&v, &n) in x.iter().zip(&codes) {
            let q = n as f32 - self.offset;
            xq += v * q;
            qq += q * q;
        }
        if qq > 0.0 {
            consider(xq / qq, &mut best);
        }
        let d = best.1;
        Some((f16::from_f32(d), self.codes(x, 1.0 / d)))
    }
}

/// Quantizes `src` (a multiple of 32 long) into INT4 blocks, choosing each
/// block's scale by a small search (see the module docs).
pub fn quantize_q4_row(src: &[f32], dst: &mut [BlockQ4]) {
    assert_eq!(src.len(), dst.len() * QK, "row length");
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        *b = match Symmetric::INT4.quantize_block(x) {
            None => BlockQ4::ZERO,
            Some((d, codes)) => BlockQ4 { d, qs: std::array::from_fn(|i| codes[i] | (codes[i + QK / 2] << 4)) },
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{
        act::quantize_activations_scalar,
        int8::{BlockQ8, Int8},
        Format,
    };
    use crate::testutil::synth;

    fn rmse(a: &[f32], b: &[f32]) -> f32 {
        (a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f32>() / a.len() as f32).sqrt()
    }

    fn act(x: &[f32]) -> Vec<BlockA8> {
        let mut a = vec![BlockA8::ZERO; x.len() / QK];
        quantize_activations_scalar(x, &mut a);
        a
    }

    /// Round-trip RMSE limits on uniform data in [-1, 1). ggml tests its
    /// 8-bit types at 0.002 on its own synthetic data; on uniform data the
    /// rounding error of a step `d = 1/127` is `d/√12 = 0.00227`, so 0.0025 is
    /// that bound plus margin. For INT4 (`d ≈ 1/7.5`): `0.0385`, limit 0.045.
    const RT_RMSE_Q8: f32 = 0.0025;
    const RT_RMSE_Q4: f32 = 0.045;
    /// ggml's dot-product bar: |quantized dot − exact| per element below 0.02;
    /// here divided by √n instead of n, which is stricter.
    const DOT_ERROR_Q8: f32 = 0.02;
    const DOT_ERROR_Q4: f32 = 0.2;

    /// The table of a format, exercised generically.
    fn format_contract<F: Format<Act = BlockA8>>(rmse_limit: f32, dot_limit: f32) {
        let n = 4096;
        let w = synth(n, 21);
        let x = synth(n, 22);
        let mut q = vec![F::ZERO; n / QK];
        F::quantize_row(&w, &mut q);
        let mut back = vec![0.0; n];
        F::dequantize_reference(&q, &mut back);
        let e = rmse(&w, &back);
        assert!(e < rmse_limit, "{} rmse {e}", F::NAME);
        let a = act(&x);
        let reference = F::dot_reference(&q, &a);
        let exact: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
        assert!((reference - exact).abs() / (n as f32).sqrt() < dot_limit, "{}", F::NAME);
        for isa in crate::cpu::Isa::supported() {
            let mut fast_back = vec![f32::NAN; n];
            F::dequantize(isa, &q, &mut fast_back);
            assert_eq!(fast_back, back, "{} {isa:?} dequantize", F::NAME);
            let fast = F::dot(isa, &q, &a);
            assert!((fast - reference).abs() <= 1e-5 * n as f32, "{} {isa:?}: {fast} vs {reference}", F::NAME);
        }
    }

    #[test]
    fn each_format_keeps_its_contract() {
        format_contract::<Int8>(RT_RMSE_Q8, DOT_ERROR_Q8);
        format_contract::<Int4>(RT_RMSE_Q4, DOT_ERROR_Q4);
    }

    #[test]
    fn round_trip_error_is_small() {
        let x = synth(4096, 1);
        let mut q8 = vec![BlockQ8::ZERO; 128];
        let mut back = vec![0.0; 4096];
        Int8::quantize_row(&x, &mut q8);
        Int8::dequantize_reference(&q8, &mut back);
        assert!(rmse(&x, &back) < RT_RMSE_Q8, "q8 rmse {}", rmse(&x, &back));
        let mut q4 = vec![BlockQ4::ZERO; 128];
        Int4::quantize_row(&x, &mut q4);
        Int4::dequantize_reference(&q4, &mut back);
        let e4 = rmse(&x, &back);
        assert!(e4 < RT_RMSE_Q4, "q4 rmse {e4}");
    }

    #[test]
    fn q4_search_beats_the_fixed_rule() {
        // Q4_0's rule: d = max / −8, codes rounded.
        let x = synth(32 * 512, 2);
        let mut fixed = 0.0;
        for b in x.chunks_exact(QK) {
            let max = b.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            let d = f16::from_f32(max / -8.0).to_f32();
            fixed += q4_error(b, d, &q4_codes(b, 1.0 / d));
        }
        let mut q = vec![BlockQ4::ZERO; 512];
        Int4::quantize_row(&x, &mut q);
        let mut back = vec![0.0; x.len()];
        Int4::dequantize_reference(&q, &mut back);
        let ours: f32 = x.iter().zip(&back).map(|(a, b)| (a - b).powi(2)).sum();
        assert!(ours < 0.85 * fixed, "search {ours} vs fixed {fixed}");
    }

    #[test]
    fn zero_blocks_stay_zero() {
        let x = vec![0.0; 64];
        let (mut q8, mut q4, mut back) = (vec![BlockQ8::ZERO; 2], vec![BlockQ4::ZERO; 2], vec![1.0; 64]);
        Int8::quantize_row(&x, &mut q8);
        Int8::dequantize_reference(&q8, &mut back);
        assert!(back.iter().all(|&v| v == 0.0));
        Int4::quantize_row(&x, &mut q4);
        Int4::dequantize_reference(&q4, &mut back);
        assert!(back.iter().all(|&v| v == 0.0));
        let a = act(&x);
        assert_eq!(Int8::dot_reference(&q8, &a), 0.0);
    }

    #[test]
    fn integer_dots_match_the_dequantized_product() {
        // The integer dot equals the f32 dot of the dequantized weights with
        // the dequantized activations (up to f32 rounding), and is close to
        // the exact f32 product (ggml's dot bar: 0.02 per unit of scale).
        for n in [32, 64, 896, 4864] {
            let w = synth(n, n as u64);
            let x = synth(n, n as u64 + 1);
            let a = act(&x);
            let xd: Vec<f32> = a.iter().flat_map(|b| b.qs.map(|q| q as f32 * b.d)).collect();
            let exact: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
            let (mut q8, mut q4) = (vec![BlockQ8::ZERO; n / QK], vec![BlockQ4::ZERO; n / QK]);
            Int8::quantize_row(&w, &mut q8);
            Int4::quantize_row(&w, &mut q4);
            let (mut w8, mut w4) = (vec![0.0; n], vec![0.0; n]);
            Int8::dequantize_reference(&q8, &mut w8);
            Int4::dequantize_reference(&q4, &mut w4);
            for (name, got, wd) in
                [("q8", Int8::dot_reference(&q8, &a), &w8), ("q4", Int4::dot_reference(&q4, &a), &w4)]
            {
                let want: f32 = wd.iter().zip(&xd).map(|(a, b)| a * b).sum();
                assert!((got - want).abs() <= 1e-4 * (n as f32).sqrt(), "{name} n={n}: {got} vs {want}");
                let bar = if name == "q8" { DOT_ERROR_Q8 } else { DOT_ERROR_Q4 };
                assert!((got - exact).abs() / (n as f32).sqrt() < bar, "{name} n={n}: {got} vs exact {exact}");
            }
        }
    }
}
