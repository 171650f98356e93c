//! Prefill products over INT8 and INT4 weights at integer speed, for
//! [`Precision::Fast`](crate::matmul::Precision::Fast): the activations are
//! quantized once per product to int8 blocks ([`BlockA8`], as decoding
//! does), and blocks of weights meet them in integer dot products
//! (`vpdpbusd`, AVX512-VNNI: 64 byte products per instruction, four times
//! the f32 FMA's multiply-adds; measured 4.3× on this project's Xeon).
//!
//! Each weight block is read through its row's [`Format::codes`]: 32
//! unsigned codes `u` with `w = d · (u − offset)` (INT8: `q + 128`, INT4: the
//! nibble, offset 8). `vpdpbusd` multiplies unsigned by signed bytes, so
//! `Σ u·x` is exact in i32 and `Σ w·x = d · (Σ u·x − offset · Σ x)`, the
//! activation block's sum being stored with it. Per block and token, the
//! integer sum is scaled by `d_w · d_x` into an f32 accumulator: the same
//! arithmetic as the decoding kernels, so a prompt processed in one block
//! gives what token-by-token decoding gives, up to f32 summation order.
//!
//! **Layout.** Like [`crate::gemm_bf16`]: each thread packs 32 weight rows
//! into a panel, per block 8 groups of 4 codes × 32 rows (two lines each)
//! and the 32 scales (two lines), then runs a 32-row × (up to) 6-token
//! micro-kernel over every token: per block, 16 `vpdpbusd` per token into
//! integer accumulators started at `−offset · Σx`, then one conversion and
//! one FMA per 16 rows and token.

use crate::cpu::{Isa, Tier};
use crate::formats::{quantize_activations, ActType, BlockA8, Format, MatRef, QK_A8};
use crate::gemm_bf16::{mask, Line};
use crate::matmul::Out;
use crate::pool::ThreadPool;
use std::cell::RefCell;

/// Weight rows per panel: two 16-lane registers.
pub const PANEL: usize = 32;
/// Most tokens per micro-kernel call: 2 × 6 integer and 2 × 6 float
/// accumulators of 32 registers.
const NR: usize = 6;
/// Lines per block in a panel: 8 groups of 4 codes and the scales, each as
/// two 16-row lines.
const LINES_PER_BLOCK: usize = 2 * (QK_A8 / 4) + 2;

/// Whether the integer kernels can run on `isa`: the tiers with
/// AVX512-VNNI, by name.
pub fn available(isa: Isa) -> bool {
    match isa.tier() {
        Tier::Scalar | Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 => false,
        Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => cfg!(target_arch = "x86_64"),
    }
}

/// Activations `X (T, cols)` as int8 blocks, `cols / 32` per token.
pub struct Acts<'a> {
    blocks: &'a [BlockA8],
    tokens: usize,
    per_token: usize,
}

/// Quantizes `x (T, cols)` into `buf` (with `isa`'s quantizer, bit for bit
/// the reference), spreading tokens over `pool` (or on the calling thread
/// without one). `cols` must be a multiple of 32.
pub fn prepare<'b>(isa: Isa, pool: Option<&ThreadPool>, x: &[f32], cols: usize, buf: &'b mut Vec<BlockA8>) -> Acts<'b> {
    let t = x.len() / cols;
    assert!(x.len() == t * cols && cols.is_multiple_of(QK_A8), "x is (T, cols), cols whole blocks");
    let per_token = cols / QK_A8;
    buf.resize(t * per_token, BlockA8::ZERO);
    crate::pool::fill_shares(pool, &mut buf[..], t, |tokens, dst| {
        quantize_activations(isa, &x[tokens.start * cols..tokens.end * cols], dst)
    });
    Acts { blocks: &buf[..], tokens: t, per_token }
}

thread_local! {
    /// Each thread's packed panel, reused across calls.
    static PANEL_BUF: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// Packs rows `rows` (at most [`PANEL`]) of `w (·, blocks)` into `panel`;
/// rows past the end are zero. Returns the rows' code offset.
fn pack_panel<F: Format>(w: &[F::Block], blocks: usize, rows: std::ops::Range<usize>, panel: &mut [Line]) -> i32 {
    debug_assert!(rows.len() <= PANEL && panel.len() == blocks * LINES_PER_BLOCK);
    panel.fill(Line([0; 16]));
    let mut offset = 0;
    for (i, r) in rows.enumerate() {
        let (line, lane) = (i / 16, i % 16);
        for (b, block) in w[r * blocks..(r + 1) * blocks].iter().enumerate() {
            let c = F::codes(block).expect("integer rows have codes");
            offset = c.offset;
            let lines = &mut panel[b * LINES_PER_BLOCK..(b + 1) * LINES_PER_BLOCK];
            for (g, quad) in c.u.chunks_exact(4).enumerate() {
                lines[2 * g + line].0[lane] = u32::from_le_bytes([quad[0], quad[1], quad[2], quad[3]]);
            }
            lines[LINES_PER_BLOCK - 2 + line].0[lane] = c.d.to_bits();
        }
    }
    offset
}

/// Whether products with `w` can run here: a row read by int8 activations
/// (which has [`Format::codes`]), whole blocks per row.
pub fn handles(w: &MatRef) -> bool {
    w.weights.ty().act() == ActType::A8 && w.cols.is_multiple_of(QK_A8)
}

/// Rows `rows` of `Y = X @ Wᵀ` on the calling thread, `w (·, cols)` in a row
/// of the format table that [`handles`] takes, `x` from [`prepare`]. Writes
/// `y[t][r]` for `r` in `rows`, every token.
pub fn matmul_rows<F: Format>(isa: Isa, w: &[F::Block], rows: std::ops::Range<usize>, x: &Acts, out: &Out) {
    assert!(available(isa), "the integer kernels need the AVX512-VNNI tiers");
    let blocks = x.per_token;
    assert!(F::TYPE.act() == ActType::A8 && F::BLOCK_LEN == QK_A8 && rows.end * blocks <= w.len());
    PANEL_BUF.with(|buf| {
        let mut panel = buf.borrow_mut();
        panel.resize(blocks * LINES_PER_BLOCK, Line([0; 16]));
        for r0 in rows.clone().step_by(PANEL) {
            let r1 = (r0 + PANEL).min(rows.end);
            let offset = pack_panel::<F>(w, blocks, r0..r1, &mut panel);
            let valid = r1 - r0;
            let masks = [mask(valid.min(16)), mask(valid.saturating_sub(16))];
            for t0 in (0..x.tokens).step_by(NR) {
                let n = NR.min(x.tokens - t0);
                // SAFETY: this thread owns columns `rows` of every output
                // row, and the kernel writes only the `valid` lanes at
                // `r0..r1` of rows `t0..t0 + n`.
                let y = unsafe { out.data.ptr(t0 * out.stride + r0, (t0 + n - 1) * out.stride + r1) };
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX-512F and AVX512-VNNI are present
                // (`available`); the panel holds `blocks` blocks of 32 rows,
                // the activations `n` tokens from `t0`, and `y` reaches the
                // last lane written.
                unsafe {
                    avx512::tile(
                        n,
                        panel.as_ptr() as *const u32,
                        blocks,
                        &x.blocks[t0 * blocks..],
                        offset,
                        y,
                        out.stride,
                        masks,
                    )
                };
            }
        }
    });
}

/// The reference: `y[t][r] = F::dot_reference(w[r], x[t])`, the decoding
/// kernels' specification. `y (T, rows)`.
pub fn matmul_reference<F: Format<Act = BlockA8>>(w: &[F::Block], x: &Acts, y: &mut [f32]) {
    let blocks = x.per_token;
    let rows = w.len() / blocks;
    assert_eq!(y.len(), x.tokens * rows);
    for t in 0..x.tokens {
        let xt = &x.blocks[t * blocks..(t + 1) * blocks];
        for r in 0..rows {
            y[t * rows + r] = F::dot_reference(&w[r * blocks..(r + 1) * blocks], xt);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{BlockA8, LINES_PER_BLOCK, NR};
    use std::arch::x86_64::*;

    /// The micro-kernel for `n ≤ 6` tokens: `y[j][0..32] (masked) =
    /// panel · x[j]`.
    ///
    /// # Safety
    /// AVX-512F and AVX512-VNNI; `panel` holds `blocks` packed blocks, `x` `n`
    /// tokens of `blocks` blocks, `y` rows `j · y_stride` up to the last
    /// unmasked lane.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub unsafe fn tile(
        n: usize,
        panel: *const u32,
        blocks: usize,
        x: &[BlockA8],
        offset: i32,
        y: *mut f32,
        y_stride: usize,
        masks: [u16; 2],
    ) {
        macro_rules! by_n {
            ($($n:literal)*) => {
                match n {
                    $($n => tile_n::<$n>(panel, blocks, x.as_ptr(), offset, y, y_stride, masks),)*
                    _ => unreachable!("1..=NR tokens"),
                }
            };
        }
        debug_assert!((1..=NR).contains(&n) && x.len() >= n * blocks);
        by_n!(1 2 3 4 5 6)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn tile_n<const N: usize>(
        panel: *const u32,
        blocks: usize,
        x: *const BlockA8,
        offset: i32,
        y: *mut f32,
        y_stride: usize,
        masks: [u16; 2],
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        for b in 0..blocks {
            let p = panel.add(b * LINES_PER_BLOCK * 16);
            let xb: [&BlockA8; N] = std::array::from_fn(|j| &*x.add(j * blocks + b));
            // Σ u·x − offset·Σx, in i32.
            let mut dot: [[__m512i; 2]; N] = std::array::from_fn(|j| {
                let c = _mm512_set1_epi32(-offset * xb[j].sum);
                [c, c]
            });
            for g in 0..LINES_PER_BLOCK / 2 - 1 {
                let w0 = _mm512_load_si512(p.add(32 * g) as *const _);
                let w1 = _mm512_load_si512(p.add(32 * g + 16) as *const _);
                for (j, d) in dot.iter_mut().enumerate() {
                    let q = _mm512_set1_epi32((xb[j].qs.as_ptr().add(4 * g) as *const i32).read_unaligned());
                    d[0] = _mm512_dpbusd_epi32(d[0], w0, q);
                    d[1] = _mm512_dpbusd_epi32(d[1], w1, q);
                }
            }
            let s0 = _mm512_load_ps(p.add(16 * (LINES_PER_BLOCK - 2)) as *const f32);
            let s1 = _mm512_load_ps(p.add(16 * (LINES_PER_BLOCK - 1)) as *const f32);
            for (j, a) in acc.iter_mut().enumerate() {
                let dx = _mm512_set1_ps(xb[j].d);
                a[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j][0]), _mm512_mul_ps(s0, dx), a[0]);
                a[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j][1]), _mm512_mul_ps(s1, dx), a[1]);
            }
        }
        for (j, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(y.add(j * y_stride), masks[0], a[0]);
            _mm512_mask_storeu_ps(y.add(j * y_stride + 16), masks[1], a[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{BlockQ4, BlockQ8, Int4, Int8};
    use crate::testutil::synth;

    fn check<F: Format<Act = BlockA8>>(isa: Isa, rows: usize, cols: usize, t: usize) {
        let w = synth(rows * cols, rows as u64 + 1);
        let mut q = vec![F::ZERO; rows * cols / QK_A8];
        F::quantize_row(&w, &mut q);
        let x = synth(t * cols, t as u64 + 9);
        let mut buf = Vec::new();
        let acts = prepare(isa, Some(&ThreadPool::new(2)), &x, cols, &mut buf);
        let mut want = vec![0.0; t * rows];
        matmul_reference::<F>(&q, &acts, &mut want);
        let mut y = vec![f32::NAN; t * rows];
        let out = Out::new(&mut y, rows);
        let mid = ((rows / 2).div_ceil(PANEL) * PANEL).min(rows);
        matmul_rows::<F>(isa, &q, 0..mid, &acts, &out);
        matmul_rows::<F>(isa, &q, mid..rows, &acts, &out);
        for (a, b) in y.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * (cols as f32), "{} {rows}x{cols} t={t}: {a} vs {b}", F::NAME);
        }
    }

    #[test]
    fn the_kernel_matches_the_decoding_reference() {
        let Some(isa) = Isa::supported().into_iter().find(|&i| available(i)) else {
            eprintln!("no AVX512-VNNI here: the kernel is covered on machines that have it");
            return;
        };
        // Ragged rows (mod 16, mod 32) and tokens (mod 6).
        for (rows, cols, t) in [(1, 32, 1), (5, 64, 2), (17, 96, 7), (64, 128, 13), (40, 896, 6), (33, 32, 20)] {
            check::<Int8>(isa, rows, cols, t);
            check::<Int4>(isa, rows, cols, t);
        }
        // The blocks' codes rebuild the weights.
        let w = synth(64, 3);
        let (mut q8, mut q4) = ([BlockQ8::ZERO; 2], [BlockQ4::ZERO; 2]);
        Int8::quantize_row(&w, &mut q8);
        Int4::quantize_row(&w, &mut q4);
        let (mut d8, mut d4) = (vec![0.0; 64], vec![0.0; 64]);
        Int8::dequantize_reference(&q8, &mut d8);
        Int4::dequantize_reference(&q4, &mut d4);
        for (blocks, want) in [(Int8::codes(&q8[1]), &d8[32..]), (Int4::codes(&q4[1]), &d4[32..])] {
            let c = blocks.unwrap();
            for j in 0..32 {
                assert_eq!(c.d * (c.u[j] as i32 - c.offset) as f32, want[j]);
            }
        }
    }
}
