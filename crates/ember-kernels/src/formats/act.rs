//! Int8 activations: the input of the integer rows' dot products, made once
//! per mat-vec and read by every row and thread. Blocks of 32 ([`BlockA8`])
//! for the 32-weight rows (INT8, INT4, Q4_1, Q5_0, Q5_1), blocks of 256
//! ([`BlockA8K`]) for the K rows' super-blocks (Q2_K .. Q6_K).

use crate::cpu::{Isa, Tier};

/// Activations per [`BlockA8`].
pub const QK_A8: usize = 32;

/// 32 activations as `d · qs[j]`, with `sum = Σ qs[j]` (INT4's offset of 8
/// is paid with it: `Σ (n − 8)·q = Σ n·q − 8·Σ q`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockA8 {
    /// The scale: activation `j` is `d · qs[j]`.
    pub d: f32,
    /// The sum of the codes, `Σ qs[j]`.
    pub sum: i32,
    /// The 32 codes, in −127..=127.
    pub qs: [i8; QK_A8],
}

const _: () = assert!(std::mem::size_of::<BlockA8>() == 40);

impl BlockA8 {
    /// A block of zeros.
    pub const ZERO: BlockA8 = BlockA8 { d: 0.0, sum: 0, qs: [0; QK_A8] };
}

/// Four [`BlockA8`]s laid out as one step of the AVX-512 INT4 kernel reads
/// them: each 128-bit lane of `lo` holds bytes 0..16 of one block, of `hi`
/// bytes 16..32, `start` holds `−8 · sum` in the first i32 of each lane,
/// `d` the four scales. Made once per mat-vec ([`quads_of`]) beside the
/// blocks and shared by every row and thread: built inside the kernel, for
/// every four rows, the layout cost a third of its time.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockA8x4 {
    /// Bytes 0..16 of blocks 0..4, one block per 16 bytes.
    pub lo: [i8; 64],
    /// Bytes 16..32 of the same blocks.
    pub hi: [i8; 64],
    /// `−8 · Σ qs` of block `b` at index `4b`, zero elsewhere (INT4's offset).
    pub start: [i32; 16],
    /// The blocks' scales.
    pub d: [f32; 4],
}

impl BlockA8x4 {
    /// Four blocks of zeros.
    pub const ZERO: BlockA8x4 = BlockA8x4 { lo: [0; 64], hi: [0; 64], start: [0; 16], d: [0.0; 4] };
}

/// `a8`'s blocks four at a time as [`BlockA8x4`] (`dst` gets `⌈n / 4⌉`
/// quads; blocks past the end are zeros, so they add nothing).
pub fn quads_of(a8: &[BlockA8], dst: &mut Vec<BlockA8x4>) {
    dst.clear();
    dst.extend(a8.chunks(4).map(quad_at));
}

/// Up to four blocks as one [`BlockA8x4`] (missing ones zeros).
#[inline]
pub fn quad_at(blocks: &[BlockA8]) -> BlockA8x4 {
    debug_assert!(blocks.len() <= 4);
    let mut q = BlockA8x4::ZERO;
    for (b, a) in blocks.iter().enumerate() {
        q.lo[16 * b..16 * b + 16].copy_from_slice(&a.qs[..16]);
        q.hi[16 * b..16 * b + 16].copy_from_slice(&a.qs[16..]);
        q.start[4 * b] = -8 * a.sum;
        q.d[b] = a.d;
    }
    q
}

/// Quantizes activations `x (32 n,)` to `dst (n,)` with `isa`'s kernel (bit
/// for bit the reference).
pub fn quantize_activations(isa: Isa, x: &[f32], dst: &mut [BlockA8]) {
    assert_eq!(x.len(), dst.len() * QK_A8, "activation length");
    match isa.tier() {
        Tier::Scalar => quantize_activations_scalar(x, dst),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier's features are present (`isa` is the proof).
        Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => unsafe {
            super::int_avx2::quantize_activations(x, dst)
        },
        #[cfg(not(target_arch = "x86_64"))]
        Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
            unreachable!("x86 tiers are only detected on x86")
        }
    }
}

/// The reference for [`quantize_activations`]: `d = max|x| / 127`, codes
/// `x · 127 / max|x|` rounded half away from zero.
pub fn quantize_activations_scalar(x: &[f32], dst: &mut [BlockA8]) {
    assert_eq!(x.len(), dst.len() * QK_A8, "activation length");
    for (v, b) in x.chunks_exact(QK_A8).zip(dst.iter_mut()) {
        let amax = v.iter().fold(0.0f32, |m, a| m.max(a.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0;
        for (q, &a) in b.qs.iter_mut().zip(v) {
            // Half away from zero, computed as the SIMD twin does.
            let s = a * inv;
            *q = (s + 0.5f32.copysign(s)) as i32 as i8;
            sum += *q as i32;
        }
        b.d = d;
        b.sum = sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::synth;

    #[test]
    fn every_tier_quantizes_bit_for_bit() {
        for n in [32, 96, 896, 4864] {
            let x = synth(n, 7);
            let mut want = vec![BlockA8::ZERO; n / QK_A8];
            quantize_activations_scalar(&x, &mut want);
            for isa in Isa::supported() {
                let mut got = vec![BlockA8::ZERO; n / QK_A8];
                quantize_activations(isa, &x, &mut got);
                assert_eq!(got, want, "{isa:?} n={n}");
            }
        }
    }

    #[test]
    fn every_tier_quantizes_k_blocks_bit_for_bit() {
        for n in [256, 512, 4864] {
            let mut x = synth(n, 9);
            x[3] = 0.0;
            x[300 % n] = -1.5;
            let mut want = vec![BlockA8K::ZERO; n / QK_A8K];
            quantize_activations_k_scalar(&x, &mut want);
            for b in &want {
                let amax = b.qs.iter().map(|q| q.unsigned_abs()).max().unwrap();
                assert_eq!(amax, 127, "the largest value takes the full code range");
                for (g, s) in b.bsums.iter().enumerate() {
                    assert_eq!(*s as i32, b.qs[16 * g..16 * g + 16].iter().map(|&q| q as i32).sum::<i32>());
                }
            }
            for isa in Isa::supported() {
                let mut got = vec![BlockA8K::ZERO; n / QK_A8K];
                quantize_activations_k(isa, &x, &mut got);
                assert_eq!(got, want, "{isa:?} n={n}");
            }
        }
        let mut z = [BlockA8K::ZERO];
        quantize_activations_k_scalar(&[0.0; QK_A8K], &mut z);
        assert_eq!(z[0], BlockA8K::ZERO);
    }
}

/// Activations per [`BlockA8K`]: one K-quant super-block.
pub const QK_A8K: usize = 256;

/// 256 activations as `d · qs[j]`, with the sums of each 16 codes (the K
/// rows' minimums and offsets are paid with them: `Σ (q − o)·x = Σ q·x −
/// o·Σ x` over a group of 16). ggml's `block_q8_K`, to which the K types
/// pair, has the same fields; the rounding here is ember's, the one of
/// [`BlockA8`] (half away from zero, `d = max|x| / 127`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct BlockA8K {
    /// The scale: activation `j` is `d · qs[j]`.
    pub d: f32,
    /// The 256 codes, in −127..=127.
    pub qs: [i8; QK_A8K],
    /// `bsums[g] = Σ qs[16 g .. 16 g + 16]`.
    pub bsums: [i16; QK_A8K / 16],
}

const _: () = assert!(std::mem::size_of::<BlockA8K>() == 292);

impl BlockA8K {
    /// A block of zeros.
    pub const ZERO: BlockA8K = BlockA8K { d: 0.0, qs: [0; QK_A8K], bsums: [0; QK_A8K / 16] };
}

/// Quantizes activations `x (256 n,)` to `dst (n,)` with `isa`'s kernel (bit
/// for bit the reference).
pub fn quantize_activations_k(isa: Isa, x: &[f32], dst: &mut [BlockA8K]) {
    assert_eq!(x.len(), dst.len() * QK_A8K, "activation length");
    match isa.tier() {
        Tier::Scalar => quantize_activations_k_scalar(x, dst),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier's features are present (`isa` is the proof).
        Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => unsafe {
            super::int_avx2::quantize_activations_k(x, dst)
        },
        #[cfg(not(target_arch = "x86_64"))]
        Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
            unreachable!("x86 tiers are only detected on x86")
        }
    }
}

/// The reference for [`quantize_activations_k`]: [`quantize_activations_scalar`]'s
/// rounding over 256 values with one scale, then the sums of 16.
pub fn quantize_activations_k_scalar(x: &[f32], dst: &mut [BlockA8K]) {
    assert_eq!(x.len(), dst.len() * QK_A8K, "activation length");
    for (v, b) in x.chunks_exact(QK_A8K).zip(dst.iter_mut()) {
        let amax = v.iter().fold(0.0f32, |m, a| m.max(a.abs()));
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for (q, &a) in b.qs.iter_mut().zip(v) {
            let s = a * inv;
            *q = (s + 0.5f32.copysign(s)) as i32 as i8;
        }
        b.d = amax / 127.0;
        fill_bsums(b);
    }
}

/// `b.bsums` from `b.qs`.
pub(crate) fn fill_bsums(b: &mut BlockA8K) {
    for (s, g) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
        *s = g.iter().map(|&q| q as i16).sum();
    }
}
