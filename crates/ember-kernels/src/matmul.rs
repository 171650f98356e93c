//! Matrix-matrix products for prefill and batched decode: a block of tokens
//! through one weight matrix. `Y (T, rows) = X (T, cols) @ Wᵀ`, `W (rows,
//! cols)` in its stored precision.
//!
//! Prompt processing is compute-bound: each weight read from memory is used
//! for every token of the block. Each thread takes a contiguous share of W's
//! rows (so W is streamed once per token block). Which kernel multiplies
//! depends on the weight type, the tier and the [`Precision`]
//! (`product_rows` is the dispatch):
//!
//! | weights | kernel |
//! |---|---|
//! | INT8 at fast precision, 2–4 tokens; INT4, INT5, Q4_0, Q5_0 2–16 (several sequences decoding) | `matvec::each_token_rows`: each token's mat-vec over blocks of rows in L2 |
//! | INT8/INT4 at fast precision otherwise | [`gemm_int8`]: int8 activations, integer dot products |
//! | BF16, F16 on AMX, from `AMX_MIN_TOKENS` (32) tokens on | [`amx`]: BF16 tiles, activations as exact BF16 terms |
//! | BF16 on AMX, 9–16 tokens (several sequences decoding) | `amx::few_rows`: weight tiles loaded in place, one token tile |
//! | BF16 at fast precision where `vdpbf16ps` pays off, 2–8 tokens (several sequences decoding) | `dot_rows`: rows streamed like a mat-vec, activations rounded to BF16 |
//! | BF16 at fast precision where `vdpbf16ps` pays off, 9 tokens or more | [`gemm_bf16::matmul_rows`] |
//! | BF16, 9–16 tokens, AVX2 tiers | `lanes_rows`: the tokens in the vector lanes, each weight broadcast |
//! | BF16, ≤ 8 tokens, x86 (in column blocks that fit L1; on AVX2 in passes of 4 tokens over each pair of rows) | `few_tokens_rows`: rows streamed like a mat-vec |
//! | BF16 otherwise, x86 | [`gemm_bf16::matmul_rows_f32`]: packed 32-row panels, f32 FMA, no horizontal sums |
//! | the rest | `matmul_rows`: rows widened to an f32 panel, a register-tiled micro-kernel (4 × 3 AVX2, 8 × 3 AVX-512) |
//!
//! In the last, tokens go in blocks of [`TOKEN_BLOCK`] so the activations a
//! panel meets stay in L2.

use crate::amx;
use crate::cpu::{prefetch, Cache, Isa, Tier};
use crate::dot::dot_f32_scalar;
use crate::formats::bf16;
use crate::formats::with_weights;
use crate::formats::{MatRef, Weights};
use crate::pool::{Chunks, SharedMut, ThreadPool};
use crate::{gemm_bf16, gemm_int8};
use std::cell::RefCell;

/// Tokens per block: `TOKEN_BLOCK × cols` f32 activations should fit in L2
/// next to the weight panel (64 × 4864 × 4 B = 1.2 MB for down_proj).
pub const TOKEN_BLOCK: usize = 64;
/// Most rows of W per panel (the micro-kernel's height).
const MR: usize = 8;
/// Most tokens per micro-kernel call (its width).
const NR: usize = 3;
/// Threads' shares of rows start at multiples of this: whole AMX row-tile
/// pairs (32), which are also whole f32 panels (8).
const ALIGN: usize = 32;

/// The shortest chunk of rows a thread takes from a product ([`Chunks`]):
/// threads take chunks that shrink as rows run out, so they finish together.
const MIN_CHUNK: usize = 64;

/// The micro-kernel's (rows, tokens) for a tier: 4 × 3 for AVX2 (12 of 16
/// registers accumulate), 8 × 3 for AVX-512 (24 of 32). Taller rather than
/// wider: each activation row read from L2 then serves more weight rows.
/// (VNNI adds nothing to f32 products: those tiers run the kernels of the
/// tier below them.)
fn shape_for(isa: Isa) -> (usize, usize) {
    match isa.tier() {
        Tier::Scalar | Tier::Avx2 | Tier::AvxVnni => (4, 3),
        Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => (8, 3),
    }
}

/// A register-tiled micro-kernel: `acc[i][j] = panel[i] · xs[j]` for a fixed
/// (rows, tokens) tile. Requires its tier's features.
type TileKernel = unsafe fn(&[f32], &[f32], usize, &mut [[f32; NR]; MR]);

/// The micro-kernel a tier runs for a panel of `mr` rows and `nr` tokens, if
/// it has one of that shape (partial panels at a share's end may be shorter;
/// the last tokens of a block may be fewer than 3).
fn tile_kernel(isa: Isa, mr: usize, nr: usize) -> Option<TileKernel> {
    match isa.tier() {
        Tier::Scalar => None,
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 | Tier::AvxVnni => (mr == 4).then(|| avx2::tile_4xn(nr)).flatten(),
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => match mr {
            8 => avx512::tile_8xn(nr),
            4 => avx2::tile_4xn(nr),
            _ => None,
        },
        #[cfg(not(target_arch = "x86_64"))]
        Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
            unreachable!("x86 tiers are only detected on x86")
        }
    }
}

/// An output matrix `(T, rows)` written at `y[t * stride + offset + r]`.
pub struct Out<'a> {
    pub(crate) data: SharedMut<'a, f32>,
    pub(crate) stride: usize,
}

impl<'a> Out<'a> {
    /// `y (T, stride)`, row-major.
    pub fn new(y: &'a mut [f32], stride: usize) -> Self {
        Out { data: SharedMut::new(y), stride }
    }
}

/// Reference: `y[t][r] = W[r] · x[t]`, one plain dot product at a time.
/// `w (rows, cols)`, `x (T, cols)`, `y (T, rows)`.
pub fn matmul_scalar(w: MatRef, x: &[f32], y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let t = x.len() / cols;
    assert_eq!(x.len(), t * cols);
    assert_eq!(y.len(), t * rows);
    let mut row = vec![0.0f32; cols];
    for r in 0..rows {
        w.row_to_f32(r, &mut row);
        for i in 0..t {
            y[i * rows + r] = dot_f32_scalar(&row, &x[i * cols..(i + 1) * cols]);
        }
    }
}

thread_local! {
    /// Each thread's f32 panel of `MR` widened weight rows, reused across calls.
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Rows `rows` of `Y = X @ Wᵀ` on the calling thread with the given tier.
/// `x (T, cols)`; writes `out[t][r]` for `r` in `rows`.
fn matmul_rows(isa: Isa, w: MatRef, rows: std::ops::Range<usize>, x: &[f32], out: &Out) {
    let cols = w.cols;
    let t = x.len() / cols;
    let (height, width) = shape_for(isa);
    let bytes = w.weights.as_bytes();
    let row_bytes = bytes.len() / w.rows.max(1);
    PANEL.with(|panel| {
        let mut panel = panel.borrow_mut();
        panel.resize(MR * cols, 0.0);
        for tb in (0..t).step_by(TOKEN_BLOCK) {
            let te = (tb + TOKEN_BLOCK).min(t);
            let calls = (te - tb).div_ceil(width);
            for r0 in rows.clone().step_by(height) {
                let mr = height.min(rows.end - r0);
                for i in 0..mr {
                    w.row_to_f32_with(isa, r0 + i, &mut panel[i * cols..(i + 1) * cols]);
                }
                // The next panel's weights, a share after each tile: their
                // reads from memory overlap this panel's arithmetic.
                let ahead = (r0 + height).min(rows.end);
                let next = &bytes[ahead * row_bytes..(ahead + height).min(rows.end) * row_bytes];
                let share = next.len().div_ceil(calls).next_multiple_of(64);
                let mut t0 = tb;
                let mut call = 0;
                while t0 < te {
                    let nr = width.min(te - t0);
                    let xs = &x[t0 * cols..(t0 + nr) * cols];
                    let mut acc = [[0.0f32; NR]; MR];
                    tile(isa, &panel[..mr * cols], mr, xs, nr, cols, &mut acc);
                    for (i, row) in acc.iter().enumerate().take(mr) {
                        for (j, &v) in row.iter().enumerate().take(nr) {
                            // SAFETY: each thread owns the columns `rows` of
                            // every output row; tiles do not overlap.
                            unsafe {
                                out.data.range((t0 + j) * out.stride + r0 + i, (t0 + j) * out.stride + r0 + i + 1)[0] =
                                    v
                            };
                        }
                    }
                    prefetch(next.get(call * share..((call + 1) * share).min(next.len())).unwrap_or(&[]), Cache::L2);
                    call += 1;
                    t0 += nr;
                }
            }
        }
    });
}

/// Most tokens for which products over BF16 weights stream the weights
/// like a mat-vec ([`few_tokens_rows`]): decoding a batch of sequences.
/// More tokens go to the panel kernel, faster from 16 on (measured, 2
/// threads, Xeon with AVX512-BF16: 8 tokens 127 against 109 tok/s, 16
/// tokens 136 against 157). With the activations on a cache line and in
/// column blocks, 16 tokens as two passes of 8 over each pair of rows (the
/// second from L1) were still slower than the panels (Emerald Rapids, 2
/// threads, alternated: 117, 123, 120 against 131, 154, 150 tok/s).
const SMALL_BATCH: usize = 8;
/// Most bytes of activations [`few_tokens_rows`] takes in one pass over the
/// rows: they are read for every row, so they should stay in L1 (48 KB
/// here) beside the streaming weights. Past that (8 tokens of down_proj's
/// 4864 columns: 152 KB), read from L2, the panel kernel was faster (89.5
/// against 54.8 GMAC/s); the AVX-512 kernel now takes such products in
/// column blocks ([`few_block`]), and so does the AVX2 one.
const SMALL_BATCH_BYTES: usize = 40 * 1024;

/// Columns per block of [`few_tokens_rows`] for `t` tokens of `cols`
/// columns: all of them when the activations fit [`SMALL_BATCH_BYTES`], else
/// blocks of whole `width`s whose activations fit [`FEW_BLOCK_BYTES`].
fn few_block(t: usize, cols: usize, width: usize) -> usize {
    column_block(cols, 4 * t, SMALL_BATCH_BYTES, FEW_BLOCK_BYTES, width)
}

/// Columns per block for activations of `bytes` a column (all tokens'):
/// all of them when they fit `whole`, else blocks of whole `width`s whose
/// activations fit `most`, as even as that allows.
fn column_block(cols: usize, bytes: usize, whole: usize, most: usize, width: usize) -> usize {
    if bytes * cols <= whole {
        return cols;
    }
    let most = (most / bytes / width).max(1) * width;
    let blocks = cols.div_ceil(most);
    cols.div_ceil(blocks).next_multiple_of(width)
}

/// Most bytes of activations one column block of [`few_tokens_rows`] holds
/// when they all together would not stay in L1 ([`SMALL_BATCH_BYTES`]).
const FEW_BLOCK_BYTES: usize = 24 * 1024;

/// Rows `rows` of `Y = X @ Wᵀ` for a few tokens (≤ [`SMALL_BATCH`]) over
/// BF16 weights, as a mat-vec of several vectors: each pair of weight rows
/// is read from memory once, widened in registers, and multiplied with
/// every token (up to 16 accumulators on AVX-512, both rows at once; on
/// AVX2 8, for 4 tokens a pass, the pair read again from L1 by a second
/// pass for tokens 5–8), the tokens staying in L1. No panel is widened
/// first, so the memory reads and the arithmetic overlap. The rows go in
/// [`stream_pairs`]' four streams.
///
/// On the AVX2 tiers 5–8 tokens went to [`lanes_rows`] until the two
/// passes were measured against it again (Zen 3, family 25 model 1, 2
/// threads, `ember bench -p 0 -n 32 -r 3 -t 2 --sequences 8`, the two
/// builds alternated five times, 2026-12-07): 8 sequences 64.0, 57.2,
/// 73.2, 61.3, 69.4 → 76.7, 78.5, 89.4, 75.9, 73.8 tok/s, every pair
/// faster. Per step (`--phases`) the lanes kernel had made 8 tokens
/// slower per token than 4 (a step 121 against 53 ms). The column blocks
/// on AVX2 came with it (before, activations past L1, such as 4 tokens of
/// down_proj's 4864 columns, went to the packed panels): 4 sequences, five
/// alternations, 61.8, 66.2, 67.1, 63.8, 84.0 → 61.8, 75.3, 63.8, 74.2,
/// 82.1.
///
/// Activations too large for L1 (8 tokens of down_proj's 4864 columns:
/// 152 KB) are taken in column blocks that fit ([`few_block`]): each block
/// passes over all of the share's rows, reading their columns of the block
/// (every weight is still read from memory once), and adds its partial sums
/// to the outputs. The activations come split once per product
/// ([`FewActs`], made where [`on_few`] says this kernel takes the product).
fn few_tokens_rows(w: &[bf16], cols: usize, rows: std::ops::Range<usize>, few: &FewActs, out: &Out) {
    let t = few.tokens;
    stream_pairs(&blocks_of(w, cols, few.block), rows, t, out, |b, k0, k1, segs, ahead, y| {
        // The kernel splits each `width` weights into even and odd columns;
        // the activations were split the same way once for the product.
        let xs = &few.data[few.starts[b]..few.starts[b] + t * (k1 - k0)];
        if few.wide {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512F is present (`FewActs::wide` is set only on
            // the AVX-512 tiers); both segments hold `k1 - k0` values, `xs`
            // `t` tokens of them split for `width`.
            unsafe {
                *y = avx512::rows2_bf16(t, segs, xs, ahead)
            };
        } else {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 and FMA are present (`FewActs` exists only on the
            // x86 tiers); both segments hold `k1 - k0` values, `xs` `t`
            // tokens split for `width`, taken `PASS` at a time.
            unsafe {
                for first in (0..t).step_by(avx2::PASS) {
                    let n = (t - first).min(avx2::PASS);
                    let part = avx2::rows2_pass(segs, xs, t, first, n, ahead);
                    for (yi, pi) in y.iter_mut().zip(&part) {
                        yi[first..first + n].copy_from_slice(&pi[..n]);
                    }
                }
            }
        }
    })
}

/// Most tokens a kernel of [`stream_pairs`] returns sums for.
const PAIR_TOKENS: usize = SMALL_BATCH;

/// One column block of a BF16 matrix as [`stream_pairs`] reads it: columns
/// `cols` of the product, row `r`'s weights for them at `w[r · stride +
/// start..][..cols.len()]`. A block of a row-major matrix has the matrix's
/// width as its stride; a part of a matrix in column parts
/// ([`crate::parts::ColumnParts`]) is a row-major matrix of its own.
#[derive(Clone)]
pub(crate) struct ColumnBlock<'w> {
    cols: std::ops::Range<usize>,
    w: &'w [bf16],
    stride: usize,
    start: usize,
}

impl<'w> ColumnBlock<'w> {
    /// Columns `cols` of the row-major `w (·, width)`.
    fn of(w: &'w [bf16], width: usize, cols: std::ops::Range<usize>) -> Self {
        ColumnBlock { start: cols.start, cols, w, stride: width }
    }

    /// The columns `cols` of a product stored as the row-major `w (·,
    /// cols.len())` (a column part).
    pub(crate) fn part(w: &'w [bf16], cols: std::ops::Range<usize>) -> Self {
        ColumnBlock { stride: cols.len(), cols, w, start: 0 }
    }

    /// Row `r`'s weights of the block.
    fn row(&self, r: usize) -> &'w [bf16] {
        let at = r * self.stride + self.start;
        &self.w[at..at + self.cols.len()]
    }
}

/// Rows `rows` of `Y = X @ Wᵀ` for `t` tokens, streamed like a mat-vec of
/// several vectors, one column block of `blocks` ([`ColumnBlock`]) after
/// another (each block passes over all the rows; every weight is still read
/// from memory once). For each pair of rows and block, `kernel(b, k0, k1,
/// segments, ahead, y)` multiplies the two rows' segments (columns `k0..k1`
/// of block `b`) with every token into `y[row][token]`, while `ahead`, the
/// rows it meets later, are read from memory; this adds the sums into `out`.
///
/// The rows go in four interleaved streams (the share's quarters), as the
/// mat-vec's do: the hardware prefetcher follows each stream separately, so
/// four keep four times the reads in flight of one. With the rows taken in
/// order (one stream), the f32 kernel read 20.5 GB/s at 8 tokens on the LM
/// head where the mat-vec reads 28.
fn stream_pairs(
    blocks: &[ColumnBlock],
    rows: std::ops::Range<usize>,
    t: usize,
    out: &Out,
    mut kernel: impl FnMut(usize, usize, usize, [&[bf16]; 2], [*const bf16; 2], &mut [[f32; PAIR_TOKENS]; 2]),
) {
    assert!((1..=PAIR_TOKENS).contains(&t));
    if rows.is_empty() {
        return;
    }
    // Pair n: for n < 2q, rows i of streams 0 and 1 (n even) or 2 and 3 (n
    // odd), i = n / 2; then the ragged rest two by two.
    let q = rows.len() / 4;
    let rest = rows.start + 4 * q;
    let pairs = 2 * q + (rows.len() - 4 * q).div_ceil(2);
    let pair = |n: usize| -> [usize; 2] {
        if n < 2 * q {
            let first = rows.start + 2 * (n % 2) * q + n / 2;
            [first, first + q]
        } else {
            let r = rest + 2 * (n - 2 * q);
            [r, (r + 1).min(rows.end - 1)]
        }
    };
    // SAFETY: this thread owns columns `rows` of every output row; only
    // those are written through `base`, whose range is checked here.
    let base = unsafe { out.data.ptr(0, (t - 1) * out.stride + rows.end) };
    // The kernel's sums for each pair: it writes the first `t` of each row.
    let mut y = [[0.0f32; PAIR_TOKENS]; 2];
    for (b, block) in blocks.iter().enumerate() {
        let (k0, k1) = (block.cols.start, block.cols.end);
        // The rows two pairs on in each stream (past the block's last pair,
        // the next block's first), read from memory while pair `n`'s are
        // multiplied.
        let ahead = |n: usize| -> [*const bf16; 2] {
            match (n + 4 < pairs, blocks.get(b + 1)) {
                (true, _) => pair(n + 4).map(|r| block.row(r).as_ptr()),
                // (Fewer than four pairs: the next block's last.)
                (false, Some(next)) => pair((n + 4 - pairs).min(pairs - 1)).map(|r| next.row(r).as_ptr()),
                (false, None) => pair(n).map(|r| block.row(r).as_ptr()),
            }
        };
        for n in 0..pairs {
            let [r0, r1] = pair(n);
            kernel(b, k0, k1, [block.row(r0), block.row(r1)], ahead(n), &mut y);
            for (i, &r) in [r0, r1].iter().enumerate().take(if r1 == r0 { 1 } else { 2 }) {
                // Token j's output at `j · stride` from `at`.
                let at = base.wrapping_add(r);
                for (j, &v) in y[i].iter().take(t).enumerate() {
                    // SAFETY: this thread owns columns `rows` of every
                    // output row, `r` among them, and `base` reaches the
                    // last token's.
                    unsafe {
                        let o = at.add(j * out.stride);
                        *o = if b == 0 { v } else { *o + v };
                    }
                }
            }
        }
    }
}

/// A row-major `w (·, cols)`'s columns as blocks of `block` for
/// [`stream_pairs`].
fn blocks_of(w: &[bf16], cols: usize, block: usize) -> Vec<ColumnBlock<'_>> {
    (0..cols).step_by(block).map(|k0| ColumnBlock::of(w, cols, k0..(k0 + block).min(cols))).collect()
}

/// Most tokens whose products over BF16 weights [`dot_rows`] takes, in one
/// pass; more go to the packed panels ([`gemm_bf16::matmul_rows`]), which
/// were faster than two passes ([`FAST_BF16_MIN_TOKENS`] has the figures).
const DOT_TOKENS: usize = PAIR_TOKENS;

/// Most bytes of rounded activations one column block of [`dot_rows`]
/// holds, so that they stay in L1 (32 KB on Zen 4) beside the streaming
/// weights: 8 tokens of 896 columns (14 KB) in one block, of down_proj's
/// 4864 in five. Zen 4, 2 threads, 8 sequences decoding (`ember bench -p 0
/// -n 32 -r 2 --sequences 8`, three rounds alternated): 16 KB 227–246
/// tok/s, 8 KB (896 columns in two blocks) 183–189, 90 KB (down_proj in
/// one, its activations in L2) 214–216.
const DOT_BLOCK_BYTES: usize = 16 * 1024;

/// Rows `rows` of `Y = X @ Wᵀ` for a few tokens (≤ [`DOT_TOKENS`]) over
/// BF16 weights at fast precision, the activations rounded to one BF16
/// term ([`DotActs`]), streamed in pairs of rows like [`few_tokens_rows`]
/// ([`stream_pairs`]). Per 32 columns, one load of a row's weights meets
/// one load of each token's rounded activations in one `vdpbf16ps` (16
/// lanes of two products each): no panel packed, nothing widened, half the
/// instructions of the f32 kernel's shift, mask and two FMAs per 16
/// columns; the horizontal sums come once per pair and column block (16
/// accumulators: two rows, eight tokens).
///
/// On Zen 4, one thread, weights in cache (criterion's `batched decode`
/// group, 896 × 896, 4864 × 896 and 896 × 4864), 8 tokens run at 96–99 G
/// multiply-adds/s against 71–73 for the panels; a loop of the same
/// instructions on data in L1 makes 103.
fn dot_rows(w: &[bf16], cols: usize, rows: std::ops::Range<usize>, acts: &DotActs, out: &Out) {
    let block = column_block(cols, 2 * acts.tokens, DOT_BLOCK_BYTES, DOT_BLOCK_BYTES, 32);
    dot_blocks(&blocks_of(w, cols, block), rows, acts, out)
}

/// [`dot_rows`] over `blocks` of the product's columns, each starting on a
/// whole 32 columns (a chunk of the activations).
fn dot_blocks(blocks: &[ColumnBlock], rows: std::ops::Range<usize>, acts: &DotActs, out: &Out) {
    let t = acts.tokens;
    let cols = blocks.last().map_or(0, |b| b.cols.end);
    assert!((1..=DOT_TOKENS).contains(&t) && acts.data.len() == cols.div_ceil(32) * t * 16);
    assert!(blocks.iter().all(|b| b.cols.start.is_multiple_of(32)), "blocks start on a chunk");
    stream_pairs(blocks, rows, t, out, |_, k0, _, segs, ahead, y| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F/BW and AVX512-BF16 are present (the fast BF16
        // kernels run only on those tiers); the kernel checks that the
        // activations cover the segments' columns, and each block's start
        // (a whole number of 64-byte chunks from a cache line) is aligned.
        unsafe {
            avx512::rows2_dot(t, segs, &acts.data[k0 / 32 * t * 16..], ahead, y)
        };
    })
}

/// `Y (T, rows) = X (T, cols) @ Wᵀ` for a BF16 matrix stored in column
/// parts (`parts`, each part's weights a row-major matrix of its own, the
/// whole described by `whole` for the choice of kernel), when [`dot_rows`]
/// takes its product: 2 to [`DOT_TOKENS`] tokens at fast precision on a
/// tier with `vdpbf16ps`. Then the parts are [`dot_blocks`]' column blocks
/// and the product one parallel section, each thread's rows meeting every
/// part in turn, the activations rounded once for all parts; returns
/// whether it ran (else nothing was done).
///
/// Part by part (four products of a quarter of the columns, each its own
/// section, and three sums), down_proj of 8 sequences decoding together
/// took 8.5 ms of a 37 ms step on Zen 4 (2 threads, its weights streamed at
/// 80% of gate/up's rate in the same steps); in one section, 6.9–8.0 ms
/// (79–95%).
pub(crate) fn dot_parts(
    pool: &ThreadPool,
    precision: Precision,
    whole: &MatRef,
    parts: &[ColumnBlock],
    x: &[f32],
    y: &mut [f32],
) -> bool {
    let isa = Isa::active();
    let (rows, cols) = (whole.rows, whole.cols);
    let t = x.len() / cols;
    if !(fast_bf16(isa, precision, whole, t) && t <= DOT_TOKENS) {
        return false;
    }
    assert_eq!(x.len(), t * cols, "x is (T, cols)");
    assert_eq!(y.len(), t * rows, "y is (T, rows)");
    let out = Out::new(y, rows);
    ROUNDED.with(|rounded| {
        let mut rounded = rounded.borrow_mut();
        let acts = prepare_dot(isa, x, cols, &mut rounded);
        let chunks = Chunks::new(rows, pool.threads(), ALIGN, MIN_CHUNK);
        pool.run(|_, _| {
            while let Some(r) = chunks.next_chunk() {
                dot_blocks(parts, r, &acts, &out);
            }
        })
    });
    true
}

/// Activations `X (T, cols)` rounded to BF16 for [`dot_rows`], token by
/// token in each 32 columns: chunk `c`'s 16 words (column pairs, the even
/// column in the low half) of token `j` at `(c · T + j) · 16`, so that a
/// kernel reaches every token from one pointer; a ragged last chunk padded
/// with zeros. From a cache line on: no load straddles two.
struct DotActs<'a> {
    tokens: usize,
    data: &'a [u32],
}

/// `x (T, cols)` rounded to the nearest BF16 (ties to even, as
/// [`gemm_bf16::bf16_bits`]) and laid out for [`dot_rows`] in `buf`.
fn prepare_dot<'b>(isa: Isa, x: &[f32], cols: usize, buf: &'b mut Vec<u32>) -> DotActs<'b> {
    let t = x.len() / cols;
    let chunks = cols.div_ceil(32);
    buf.clear();
    buf.resize(chunks * t * 16 + 15, 0);
    let start = buf.as_ptr().align_offset(64).min(15);
    let data = &mut buf[start..start + chunks * t * 16];
    #[cfg(target_arch = "x86_64")]
    if gemm_bf16::available(isa) {
        for (j, xj) in x.chunks_exact(cols).enumerate() {
            // SAFETY: the tier has AVX-512F/BW and AVX512-BF16 (`isa` is
            // the proof); `data` holds `chunks` chunks of `t` tokens.
            unsafe { avx512::round_for_dot(xj, t, j, data) };
        }
        return DotActs { tokens: t, data };
    }
    let _ = isa;
    for (j, xj) in x.chunks_exact(cols).enumerate() {
        for (k, &v) in xj.iter().enumerate() {
            let word = &mut data[(k / 32 * t + j) * 16 + k % 32 / 2];
            *word |= (gemm_bf16::bf16_bits(v) as u32) << (16 * (k % 2));
        }
    }
    DotActs { tokens: t, data }
}

/// Whether [`few_tokens_rows`] has kernels for `t` tokens of `cols`
/// columns on `isa`'s tier, and their shape: `(wide, width)`, whether the
/// kernels are 512 bits wide and how many columns they widen per load (the
/// width of the even/odd split of the activations). The 256-bit kernel
/// takes 4 tokens a pass over each pair of rows.
fn few_layout(isa: Isa, t: usize) -> Option<(bool, usize)> {
    if !(1..=SMALL_BATCH).contains(&t) || !cfg!(target_arch = "x86_64") {
        return None;
    }
    match isa.tier() {
        Tier::Scalar => None,
        Tier::Avx2 | Tier::AvxVnni => Some((false, 16)),
        Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => Some((true, 32)),
    }
}

/// Whether `w`'s product for `t` tokens goes to [`few_tokens_rows`]: BF16
/// weights, a few tokens, no faster kernel taking them first (AMX,
/// `vdpbf16ps`, [`lanes_rows`]), and a kernel on this tier.
fn on_few(isa: Isa, precision: Precision, w: &MatRef, t: usize) -> bool {
    matches!(w.weights, Weights::Bf16(_))
        && !on_amx(isa, precision, w, t)
        && !on_amx_few(isa, w, t)
        && !fast_bf16(isa, precision, w, t)
        && !on_lanes(isa, precision, w, t)
        && few_layout(isa, t).is_some()
}

/// The activations of a product for [`few_tokens_rows`], split once by the
/// calling thread and read by every thread (each chunk of rows split them
/// anew before: 7168 values for 8 tokens of 896 columns, for each of the
/// ~8 chunks of every section, 24 in gate/up's).
struct FewActs<'a> {
    tokens: usize,
    /// 512-bit kernels (else 256-bit, whose split is for 16 columns a load
    /// where the 512-bit one's is for 32).
    wide: bool,
    /// Columns per block ([`few_block`]).
    block: usize,
    /// Each block's activations laid out by [`split_for_few`], block `b`
    /// from `starts[b]` (on a cache line).
    data: &'a [f32],
    starts: &'a [usize],
}

/// `x (T, cols)` split for [`few_tokens_rows`] into `buf`, one column
/// block after another, each from a cache line; `None` where the tier has
/// no such kernels.
fn prepare_few<'a>(isa: Isa, x: &[f32], cols: usize, buf: &'a mut (Vec<f32>, Vec<usize>)) -> Option<FewActs<'a>> {
    let t = x.len() / cols;
    let (wide, width) = few_layout(isa, t)?;
    let block = few_block(t, cols, width);
    let (data, starts) = buf;
    data.clear();
    starts.clear();
    // Room for every block and its alignment, so the buffer never moves
    // while it is filled (the alignment is of addresses).
    data.reserve(t * cols + 16 * (cols.div_ceil(block) + 1));
    let mut k0 = 0;
    while k0 < cols {
        let k1 = (k0 + block).min(cols);
        starts.push(split_for_few(x, cols, k0..k1, width, data));
        k0 = k1;
    }
    Some(FewActs { tokens: t, wide, block, data, starts })
}

/// Token counts whose products over BF16 weights [`lanes_rows`] takes on
/// the 256-bit tiers: a few sequences decoding together. From 17 tokens on,
/// the packed panels ([`gemm_bf16::matmul_rows_f32`]) amortise their packing.
const LANES: std::ops::RangeInclusive<usize> = 9..=16;

/// Whether [`lanes_rows`] takes `w`'s product for `t` tokens: BF16 weights
/// on AVX2 and AVX-VNNI (the AVX-512 tiers keep their own kernels), where
/// no faster kernel (AMX, `vdpbf16ps`) takes them.
fn on_lanes(isa: Isa, precision: Precision, w: &MatRef, t: usize) -> bool {
    matches!(w.weights, Weights::Bf16(_))
        && matches!(isa.tier(), Tier::Avx2 | Tier::AvxVnni)
        && cfg!(target_arch = "x86_64")
        && LANES.contains(&t)
        && !fast_bf16(isa, precision, w, t)
        && !on_amx(isa, precision, w, t)
}

/// `x (T, cols)` transposed to `(cols, 16)` for [`lanes_rows`] (`T` ≤ 16),
/// the lanes past `T` zero.
fn transpose_for_lanes<'b>(x: &[f32], cols: usize, buf: &'b mut Vec<f32>) -> &'b [f32] {
    let l = 16;
    debug_assert!(x.len() / cols <= l);
    buf.clear();
    buf.resize(cols * l, 0.0);
    for (j, xj) in x.chunks_exact(cols).enumerate() {
        for (k, &v) in xj.iter().enumerate() {
            buf[k * l + j] = v;
        }
    }
    buf
}

/// Rows `rows` of `Y = X @ Wᵀ` for a few tokens over BF16 weights, the
/// tokens in the vector lanes: `xt` is `X` transposed ([`transpose_for_lanes`]),
/// so one load gives 8 tokens' activations of a column, and each weight is
/// broadcast to all lanes. A group of rows is read from memory once for
/// every token, with no packing and no horizontal sums; each output is its
/// columns' fused multiply-adds in order, so the result has
/// [`gemm_bf16::matmul_f32_reference`]'s bits.
///
/// The row-streaming kernel ([`few_tokens_rows`]) loads an activation
/// vector for every 2 multiply-adds and takes 8 tokens in two passes, with
/// the activations (28 KB at 8 tokens of 896 columns) falling out of L1;
/// here one activation load serves a group of 10 rows (5 at 16 tokens).
/// Measured on Zen 3, 2 threads, the real model: 8 sequences 71-76 → 79-87
/// tok/s, 16 sequences (before on the packed panels) 87-96 → 91-112 (alternated).
///
/// The other orientation was tried too (2026-12-01, same machine): rows in
/// the lanes, 16-row panels packed per product as column pairs (an 8 × 8
/// transpose of 32-bit pairs; a shift widens the even column, a mask the odd
/// one) and each token's activation broadcast, 2 × 4 or 2 × 6 accumulators.
/// Its inner loop alone, on a packed panel, runs at 33-39 GMAC/s a thread
/// against this kernel's 25-29 (8 tokens, `matmul_with`, one thread), but
/// packing on the fly costs about half as much again and serialises the
/// weight reads with the arithmetic: 17-31 GMAC/s, and 43-51 against 61-92
/// tok/s at 8 sequences end to end. Stored packed at load (2026-12-01,
/// 22:10 UTC, same CPU model, one thread, 8 tokens), that kernel on ready
/// panels ran at 32-33 GMAC/s against this kernel's 20-23 with the weights
/// in L2, but both at 17-21 with 66 MB streamed from memory, neither
/// overlapping the stream with its arithmetic (prefetching 1-4 panels ahead
/// changed nothing): packing at load pays only once that is solved.
///
/// And the dot form from the stored order (2026-12-01, 17:30-18:00 UTC, same
/// CPU model): 16-row slabs × 1024-column blocks, each pair of rows widened
/// by a shift and a mask and met by 4 tokens' split activations
/// ([`few_tokens_rows`]' kernel, a pass per 4 tokens, the later passes
/// reading the slab from L2). One thread, weights in L3: 1.1-2.2× this
/// kernel (896 × 896 at 8 tokens 22-32 against 16-17 GMAC/s). End to end, 2
/// threads, alternated: 8 sequences 61-76 against 56-80 tok/s (equal within
/// the noise), 16 sequences 72-85 against 87-120 (worse: 4 passes). Why
/// both stay far below the FMA peak there: that VM sustained about one
/// 256-bit load per cycle (4.3-4.8 G/s a thread, 8 independent loads per
/// iteration) against 9.2 G FMA/s, so a kernel above 0.5 loads per FMA is
/// bound by its loads; this one makes 1.1 (10 broadcasts and a column's
/// activations per 10 FMAs), the dot form 0.63.
///
/// Blocked, the dot form was tried once more (2026-12-02, same CPU model):
/// pairs of rows in order, 256-column blocks (8 tokens' activations, 8 KB,
/// stay in L1; the pair's block is read again from L1 by the second pass of
/// 4 tokens), activations split once per product, the pair 2 on
/// prefetched. In a standalone harness streaming 400 MB it ran at 36-39 G
/// multiply-adds/s on 2 threads against 24-29 for a copy of this kernel;
/// through `matmuls` over the model's 24 layers and LM head it was no
/// faster than this kernel (22-35 against 25-37, alternated), and 8
/// sequences end to end decoded 50-54 against 59-67 tok/s. What bounds both
/// there: an ideal kernel (two 256-bit loads of streamed weights per 32
/// FMAs, nothing else, asm) streamed 14.7-15.3 GB/s on 2 threads at 3.7-3.8
/// G FMA/s a thread, and 10 GB/s at 2.5 an hour later; at 8 tokens that is
/// 60, then 40 G multiply-adds/s for the whole machine; this kernel made
/// 25-37 through `matmuls` in the hour of the first figure.
///
/// And one row at a time (2026-12-02, 14:20-14:40 UTC, same CPU model):
/// per 16 columns one load widened by a shift and a mask, then 16 FMAs
/// whose 8 tokens' split activations are memory operands (1.7 operations
/// per FMA with the loop, against this kernel's 3.9; this VM sustained
/// about 3 vector operations a cycle, and this kernel runs at that). It did
/// not run faster: one thread, 8 tokens, 17-19 against 16-18 GMAC/s
/// (4864 × 896, 128 × 4864, 512 × 256), 0.8 FMA a cycle where a loop of
/// FMAs with loads from L1 makes 1.8; in column blocks of 6-24 KB of
/// activations (to keep them in L1) slower still; 8 sequences end to end
/// 66-72 against 65-72 tok/s (alternated). What bounds both near 0.8 FMA
/// a cycle is not the operation count alone: that kernel's accumulators
/// took two FMAs a step, and with 4 tokens a pass, even and odd columns in
/// their own accumulators (8 chains one FMA deep, 2 operations per FMA with
/// the loop unrolled to 32 columns), a C copy streaming 4864 × 896 ran
/// 1.2-1.5× a C copy of this kernel alternated in one process; in ember
/// (pairs of rows in four streams, 8 tokens as two passes, down_proj in
/// column blocks) it ran equal to this kernel: one thread, 4864 × 896,
/// medians of 12 alternations 17.4 against 17.5 GMAC/s, and 8 sequences
/// 58-71 against 61-78 tok/s end to end. Not kept; without hardware
/// counters here the difference between the two stays open.
fn lanes_rows(w: &[crate::formats::bf16], cols: usize, rows: std::ops::Range<usize>, t: usize, xt: &[f32], out: &Out) {
    debug_assert!(LANES.contains(&t) && xt.len() == cols * 16);
    let mut y = [0.0f32; LANE_ROWS * 16];
    let mut r = rows.start;
    while r < rows.end {
        let n = (rows.end - r).min(LANE_ROWS);
        // The next group, to be read from memory while this one is
        // multiplied (when it is whole).
        let ahead = (r + 2 * LANE_ROWS <= rows.end).then(|| w[(r + LANE_ROWS) * cols..].as_ptr());
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier has AVX2 and FMA (`on_lanes` checked it); rows
        // `r..r + n` hold `cols` values each, `xt` is `(cols, 16)`, `y` has
        // room for `LANE_ROWS × 16` floats.
        unsafe {
            avx2::lanes(&w[r * cols..(r + n) * cols], n, cols, xt, ahead, &mut y)
        };
        for j in 0..t {
            // SAFETY: this thread owns columns `rows` of every output row.
            let dst = unsafe { out.data.range(j * out.stride + r, j * out.stride + r + n) };
            for (i, d) in dst.iter_mut().enumerate() {
                *d = y[i * 16 + j];
            }
        }
        r += n;
    }
}

/// Rows per call of [`lanes_rows`]' kernel: 5 rows × 2 vectors of 8
/// tokens' accumulators, beside a column's activations, the mask and two
/// widened weights, fit the 16 registers (with 6 × 2, one accumulator went
/// to the stack, and the loop ran at half speed). (With 8 tokens, before
/// [`few_tokens_rows`] took them, 10 × 1.)
const LANE_ROWS: usize = 5;

/// Columns `span` of `x (T, cols)` laid out for [`few_tokens_rows`]'
/// kernels, which widen `width` BF16 weights per load into even and odd
/// columns: for each whole `width` columns, every token's `width / 2` even
/// columns then its odd ones (the tokens side by side, so a kernel reaches
/// each at a fixed offset); then every token's ragged end as it is.
/// Appended to `xp`, from its first cache line boundary on; returns where
/// it starts. `xp` must have the room reserved (it must not move).
fn split_for_few(x: &[f32], cols: usize, span: std::ops::Range<usize>, width: usize, xp: &mut Vec<f32>) -> usize {
    let (t, len, half) = (x.len() / cols, span.len(), width / 2);
    let whole = len / width * width;
    // The layout starts on a cache line, so that no load of a whole vector
    // of it straddles two (the kernels make 8 such loads per weight load).
    debug_assert!(xp.capacity() - xp.len() >= t * len + 16, "room reserved");
    let start = xp.len() + xp[xp.len()..].as_ptr().align_offset(64).min(15);
    xp.resize(start, 0.0);
    for c in (0..whole).step_by(width) {
        for j in 0..t {
            let chunk = &x[j * cols + span.start + c..][..width];
            xp.extend((0..half).map(|i| chunk[2 * i]).chain((0..half).map(|i| chunk[2 * i + 1])));
        }
    }
    for j in 0..t {
        xp.extend_from_slice(&x[j * cols + span.start + whole..j * cols + span.end]);
    }
    start
}

/// `acc[i][j] = panel[i] · xs[j]` for `i < mr`, `j < nr`.
fn tile(isa: Isa, panel: &[f32], mr: usize, xs: &[f32], nr: usize, cols: usize, acc: &mut [[f32; NR]; MR]) {
    if let Some(kernel) = tile_kernel(isa, mr, nr) {
        debug_assert!(panel.len() >= mr * cols && xs.len() >= nr * cols);
        // SAFETY: `isa` proves the CPU has the kernel's features; the panel
        // holds `mr` rows and xs `nr` tokens of `cols` columns.
        return unsafe { kernel(panel, xs, cols, acc) };
    }
    for i in 0..mr {
        for j in 0..nr {
            acc[i][j] = crate::dot::dot_f32(isa, &panel[i * cols..(i + 1) * cols], &xs[j * cols..(j + 1) * cols]);
        }
    }
}

/// How prefill's matrix products (and batched decode's) treat activations.
///
/// Decoding one token is a memory stream and always runs at
/// [`Exact`](Precision::Exact) for float weights; products over many tokens
/// are compute-bound, and [`Fast`](Precision::Fast) lets a CPU that
/// multiplies narrower numbers faster do so. ARCHITECTURE.md's precision
/// policy says what each tier does and what it measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// f32-class: every product as if in f32 (float weights widened, or split
    /// into exact BF16 terms on AMX); quantized weights meet f32 activations.
    Exact,
    /// Where the CPU has BF16 dot products (AVX512-BF16) that outrun its f32
    /// FMA ([`gemm_bf16::pays_off`]), BF16 weights meet
    /// activations rounded to [`gemm_bf16::FAST_TERMS`] BF16 terms; on every
    /// x86 tier, INT8 and INT4 weights meet int8 activation blocks in integer
    /// dot products (as decoding does; VNNI where the tier has it).
    /// Elsewhere, and for other weight types, the exact path.
    #[default]
    Fast,
}

impl Precision {
    /// Both precisions, exact first.
    pub const ALL: [Precision; 2] = [Precision::Exact, Precision::Fast];

    /// The name `--precision` takes.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Exact => "exact",
            Precision::Fast => "fast",
        }
    }

    /// The precision named `exact` or `fast`.
    pub fn from_name(s: &str) -> Option<Precision> {
        Precision::ALL.into_iter().find(|p| p.name().eq_ignore_ascii_case(s))
    }
}

/// A product's activations, prepared once for every thread: packed for AMX,
/// rounded to BF16 terms for the fast BF16 kernels, quantized to int8 blocks
/// for the integer kernels, or none of these.
struct Prepared<'a> {
    amx: Option<amx::Packed<'a>>,
    amx_few: Option<amx::FewPacked<'a>>,
    /// `x` transposed for [`lanes_rows`]: `(cols, 16)`.
    lanes: Option<&'a [f32]>,
    bf16: Option<gemm_bf16::Acts<'a>>,
    /// Rounded for [`dot_rows`].
    dot: Option<DotActs<'a>>,
    int8: Option<gemm_int8::Acts<'a>>,
    few: Option<FewActs<'a>>,
}

thread_local! {
    /// The caller's activations packed for AMX, reused across calls.
    static PACKED: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
    /// The caller's activations rounded for the fast BF16 kernels.
    static ROUNDED: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    /// The caller's activations quantized for the integer kernels.
    static QUANTIZED: RefCell<Vec<crate::formats::BlockA8>> = const { RefCell::new(Vec::new()) };
    /// The caller's activations transposed for [`lanes_rows`].
    static TRANSPOSED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The caller's activations split for [`few_tokens_rows`], and where
    /// each column block starts.
    static FEW: RefCell<(Vec<f32>, Vec<usize>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The most tokens whose integer products ([`fast_int8`]) run as each
/// token's mat-vec over blocks of rows ([`crate::matvec::each_token_rows`]:
/// the weights read from memory once, then from L2) rather than through
/// [`gemm_int8`]'s packed panels, whose packing is paid per product. INT8,
/// packed by a vector loop, takes panels from 5 tokens on; the other
/// integer types, packed a block at a time through [`Format::codes`], from
/// 17. Measured on 2 cores of a Xeon with AMX (family 6 model 167,
/// 2026-12-06, `ember bench -p 0 -n 32 --sequences …`, aggregate tok/s,
/// mat-vecs against panels): INT4 2 sequences 120 against 18.5, 4 136 against
/// 36, 8 152 against 67, 16 139–159 against 122–123, 24 151 against 164;
/// INT8 2 92 against 51, 4 100–112 against 92–95, 6 112 against 128, 8
/// 116–129 against 155–162.
fn few_int8_tokens(w: &MatRef) -> usize {
    if gemm_int8::packs_fast(w) {
        4
    } else {
        16
    }
}

/// Whether the integer kernels take `w`'s products.
fn fast_int8(isa: Isa, precision: Precision, w: &MatRef) -> bool {
    precision == Precision::Fast && gemm_int8::available(isa) && gemm_int8::handles(w)
}

/// The fewest tokens whose products AMX takes. Below it, AMX's tile loads
/// and packing cost more than they save and the AVX-512 kernels (a few
/// tokens streamed like a mat-vec, else the f32 panels) are faster:
/// measured on 2 cores of a Xeon with AMX (family 6 model 167, 2026-12-02,
/// `ember bench -p 16,32,64,128 -n 0`, `EMBER_ISA=amx` against
/// `avx512bf16`, two alternations) prompts of 16 tokens ran at 89–97 tok/s
/// on AMX against 140–143, 32 tokens level (173–181 against 173–176), 64
/// and 128 ahead on AMX (199–207 and 222–228 against 182–186 and 191); 8
/// sequences decoding together ran at 40 tok/s through AMX against 103.
const AMX_MIN_TOKENS: usize = 32;

/// Whether AMX's tier and types would take `w`'s product over `t` tokens.
fn amx_takes(isa: Isa, w: &MatRef, t: usize) -> bool {
    isa.tier() == Tier::Amx && amx::handles(w) && t >= AMX_MIN_TOKENS
}

/// Whether AMX's few-token kernel ([`amx::few_rows`]) takes `w`'s product
/// over `t` tokens: BF16 weights in whole 32-column steps, more tokens than
/// the row-streaming f32 kernel takes ([`SMALL_BATCH`]) and up to
/// [`amx::FEW_TOKENS`], on the AMX tier. Measured on 2 cores of a Xeon with
/// AMX (family 6 model 167, 2026-12-04, `ember bench -p 0 -n 32
/// --sequences 8,16`, BF16): 16 sequences decoding together ran at 192 tok/s
/// on it against 134 on the f32 panels, 8 at 106 against 126 on
/// `few_tokens_rows` (its cost barely depends on the tokens: a 16-row tile
/// product costs the same for 8 tokens as for 16).
fn on_amx_few(isa: Isa, w: &MatRef, t: usize) -> bool {
    isa.tier() == Tier::Amx
        && matches!(w.weights, Weights::Bf16(_))
        && amx::handles(w)
        && (SMALL_BATCH + 1..=amx::FEW_TOKENS).contains(&t)
}

/// Fewest tokens the fast BF16 kernels take: a single token (one sequence
/// decoding, or a one-token prompt) stays exact, as the mat-vec is. From 2
/// to [`DOT_TOKENS`] tokens [`dot_rows`] takes them, more the packed panels
/// ([`gemm_bf16::matmul_rows`]).
///
/// Measured on Zen 4 (2 threads, BF16, `ember bench -p 0 -n 32 -r 2
/// --sequences …`, aggregate tok/s, three rounds alternated, 2026-12-07):
/// - against the exact rows-streamed kernel ([`few_tokens_rows`]), which
///   took 2–7 tokens before: 2 sequences 72–75 against 56–69, 3: 102–106
///   against 85–115, 4: 99–137 against 127–134, 5: 129–177 against
///   133–137, 6: 153–214 against 142–145, 8 (against the panels, which
///   took 8): 230–245 against 177–205;
/// - against the panels from 9 tokens on, [`dot_rows`] taking 16 in two
///   passes of 8 and two column blocks: 10 sequences 169–173 against 213,
///   12: 184–197 against 219–240, 16: 219–223 against 251–281.
const FAST_BF16_MIN_TOKENS: usize = 2;

// The two AMX kernels take disjoint token counts, so they share one buffer.
const _: () = assert!(amx::FEW_TOKENS < AMX_MIN_TOKENS);

/// Whether the fast BF16 kernels take `w`'s products over `t` tokens (AMX,
/// where it runs, takes them first; one token stays exact,
/// [`FAST_BF16_MIN_TOKENS`]).
fn fast_bf16(isa: Isa, precision: Precision, w: &MatRef, t: usize) -> bool {
    precision == Precision::Fast
        && t >= FAST_BF16_MIN_TOKENS
        && matches!(w.weights, Weights::Bf16(_))
        && gemm_bf16::available(isa)
        && gemm_bf16::pays_off()
        && !amx_takes(isa, w, t)
        && !on_amx_few(isa, w, t)
}

/// Whether AMX takes `w`'s products over `t` tokens: on its tier, for the
/// types it handles, from [`AMX_MIN_TOKENS`] on, except those the integer
/// kernels take at fast precision.
fn on_amx(isa: Isa, precision: Precision, w: &MatRef, t: usize) -> bool {
    amx_takes(isa, w, t) && !fast_int8(isa, precision, w)
}

/// Runs `f` with `x (T, cols)` prepared for the kernels `weights` will use on
/// this tier at this precision. Preparing is spread over `pool`, or done on
/// the calling thread without one.
fn with_prepared<R>(
    pool: Option<&ThreadPool>,
    isa: Isa,
    precision: Precision,
    x: &[f32],
    cols: usize,
    weights: &[MatRef],
    f: impl FnOnce(&Prepared) -> R,
) -> R {
    let t = x.len() / cols;
    let want_amx = weights.iter().any(|w| on_amx(isa, precision, w, t));
    let want_amx_few = weights.iter().any(|w| on_amx_few(isa, w, t));
    let want_bf16 = weights.iter().any(|w| fast_bf16(isa, precision, w, t));
    let want_int8 = weights.iter().any(|w| fast_int8(isa, precision, w));
    let want_lanes = weights.iter().any(|w| on_lanes(isa, precision, w, t));
    let want_few = weights.iter().any(|w| on_few(isa, precision, w, t));
    PACKED.with(|packed| {
        ROUNDED.with(|rounded| {
            QUANTIZED.with(|quantized| {
                TRANSPOSED.with(|transposed| {
                    FEW.with(|few| {
                        let (mut packed, mut rounded, mut quantized, mut transposed, mut few) = (
                            packed.borrow_mut(),
                            rounded.borrow_mut(),
                            quantized.borrow_mut(),
                            transposed.borrow_mut(),
                            few.borrow_mut(),
                        );
                        // AMX's prompt and few-token packings never both
                        // apply (their token counts are disjoint).
                        let (amx, amx_few) = if want_amx {
                            (Some(amx::pack(isa, pool, x, cols, &mut packed)), None)
                        } else if want_amx_few {
                            (None, Some(amx::pack_few(isa, x, cols, &mut packed)))
                        } else {
                            (None, None)
                        };
                        // The fast BF16 kernels' two layouts never both
                        // apply (by the tokens), so they share one buffer.
                        let (bf16, dot) = if !want_bf16 {
                            (None, None)
                        } else if t <= DOT_TOKENS {
                            (None, Some(prepare_dot(isa, x, cols, &mut rounded)))
                        } else {
                            (Some(gemm_bf16::prepare(isa, pool, x, cols, gemm_bf16::FAST_TERMS, &mut rounded)), None)
                        };
                        let prepared = Prepared {
                            amx,
                            amx_few,
                            lanes: want_lanes.then(|| transpose_for_lanes(x, cols, &mut transposed)),
                            bf16,
                            dot,
                            int8: want_int8.then(|| gemm_int8::prepare(isa, pool, x, cols, &mut quantized)),
                            few: if want_few { prepare_few(isa, x, cols, &mut few) } else { None },
                        };
                        f(&prepared)
                    })
                })
            })
        })
    })
}

/// Rows `rows` of `Y = X @ Wᵀ` on the calling thread: whole 32-row pairs on
/// INT8/INT4 weights on the integer kernels at fast precision, whole 32-row
/// pairs on AMX when packed and W's type allows, BF16 weights on the fast
/// BF16 kernels when prepared for them or, for a few tokens, streamed like a
/// mat-vec; the rest (and everything on other tiers) with the f32
/// micro-kernel.
fn product_rows(
    isa: Isa,
    precision: Precision,
    w: MatRef,
    rows: std::ops::Range<usize>,
    x: &[f32],
    prepared: &Prepared,
    out: &Out,
) {
    let t = x.len() / w.cols;
    if let Some(acts) = prepared.int8.as_ref().filter(|_| fast_int8(isa, precision, &w)) {
        if t <= few_int8_tokens(&w) {
            return crate::matvec::each_token_rows(isa, w, rows, x, acts, out);
        }
        return with_weights!(w.weights, |F, data| gemm_int8::matmul_rows::<F>(isa, data, rows, acts, out));
    }
    if let Some(packed) = prepared.amx.as_ref().filter(|_| on_amx(isa, precision, &w, t)) {
        let end = rows.start + rows.len() / 32 * 32;
        if end > rows.start {
            amx::matmul_rows(isa, w, rows.start..end, packed, &amx::OutRef { data: &out.data, stride: out.stride });
        }
        if end < rows.end {
            matmul_rows(isa, w, end..rows.end, x, out);
        }
        return;
    }
    if let (Some(packed), Weights::Bf16(v)) = (prepared.amx_few.as_ref(), w.weights) {
        if on_amx_few(isa, &w, t) {
            let end = rows.start + rows.len() / 16 * 16;
            if end > rows.start {
                amx::few_rows(
                    isa,
                    v,
                    w.cols,
                    rows.start..end,
                    packed,
                    &amx::OutRef { data: &out.data, stride: out.stride },
                );
            }
            if end < rows.end {
                matmul_rows(isa, w, end..rows.end, x, out);
            }
            return;
        }
    }
    if let Weights::Bf16(v) = w.weights {
        if fast_bf16(isa, precision, &w, t) {
            if let Some(acts) = prepared.dot.as_ref() {
                return dot_rows(v, w.cols, rows, acts, out);
            }
            if let Some(acts) = prepared.bf16.as_ref() {
                return gemm_bf16::matmul_rows(isa, v, w.cols, rows, acts, out);
            }
        }
    }
    if let (Some(xt), Weights::Bf16(v)) = (prepared.lanes, w.weights) {
        if on_lanes(isa, precision, &w, x.len() / w.cols) {
            return lanes_rows(v, w.cols, rows, x.len() / w.cols, xt, out);
        }
    }
    if let (Some(few), Weights::Bf16(v)) = (prepared.few.as_ref(), w.weights) {
        if on_few(isa, precision, &w, t) {
            return few_tokens_rows(v, w.cols, rows, few, out);
        }
    }
    if let Weights::Bf16(v) = w.weights {
        if gemm_bf16::f32_available(isa) && gemm_bf16::f32_handles(w.cols) {
            return gemm_bf16::matmul_rows_f32(isa, v, w.cols, rows, x, out);
        }
    }
    matmul_rows(isa, w, rows, x, out)
}

/// Several products with the same input as one parallel section (q/k/v):
/// `Y_i (T, rows_i) = X (T, cols) @ W_iᵀ`, each thread taking a contiguous
/// share of the concatenated rows.
pub fn matmuls<const N: usize>(pool: &ThreadPool, precision: Precision, x: &[f32], jobs: [(MatRef, &mut [f32]); N]) {
    let isa = Isa::active();
    let mut total = 0;
    for (w, y) in &jobs {
        let t = x.len() / w.cols;
        assert_eq!(x.len(), t * w.cols, "x is (T, cols)");
        assert_eq!(y.len(), t * w.rows, "y is (T, rows)");
        total += w.rows;
    }
    let cols = jobs[0].0.cols;
    let jobs = jobs.map(|(w, y)| (w, Out::new(y, w.rows)));
    let weights: [MatRef; N] = std::array::from_fn(|i| jobs[i].0);
    with_prepared(Some(pool), isa, precision, x, cols, &weights, |prepared| {
        let chunks = Chunks::new(total, pool.threads(), ALIGN, MIN_CHUNK);
        pool.run(|_, _| {
            while let Some(r) = chunks.next_chunk() {
                let mut offset = 0;
                for (w, out) in &jobs {
                    let (lo, hi) = (r.start.max(offset), r.end.min(offset + w.rows));
                    if lo < hi {
                        product_rows(isa, precision, *w, lo - offset..hi - offset, x, prepared, out);
                    }
                    offset += w.rows;
                }
            }
        })
    });
}

/// `Y (T, rows) = X (T, cols) @ Wᵀ` with the active tier, rows split across `pool`.
pub fn matmul(pool: &ThreadPool, precision: Precision, w: MatRef, x: &[f32], y: &mut [f32]) {
    matmuls(pool, precision, x, [(w, y)]);
}

/// `Y (T, rows) = X @ Wᵀ` on the calling thread with the given tier.
pub fn matmul_with(isa: Isa, precision: Precision, w: MatRef, x: &[f32], y: &mut [f32]) {
    let t = x.len() / w.cols;
    assert_eq!(x.len(), t * w.cols, "x is (T, cols)");
    assert_eq!(y.len(), t * w.rows, "y is (T, rows)");
    let out = Out::new(y, w.rows);
    with_prepared(None, isa, precision, x, w.cols, &[w], |prepared| {
        product_rows(isa, precision, w, 0..w.rows, x, prepared, &out)
    });
}

/// SwiGLU's first half for a block: `out = silu(X @ gateᵀ) * (X @ upᵀ)`.
/// `x (T, cols)`, `out` and `up_scratch (T, rows)`. Each thread computes the
/// same share of rows of both products, then gates its own columns, so the
/// pool runs once.
pub fn matmul_swiglu(
    pool: &ThreadPool,
    precision: Precision,
    gate: MatRef,
    up: MatRef,
    x: &[f32],
    up_scratch: &mut [f32],
    out: &mut [f32],
) {
    assert_eq!((gate.rows, gate.cols), (up.rows, up.cols), "gate and up shapes");
    let (rows, cols) = (gate.rows, gate.cols);
    let t = x.len() / cols;
    assert_eq!(x.len(), t * cols, "x is (T, cols)");
    assert_eq!(out.len(), t * rows, "out is (T, rows)");
    assert_eq!(up_scratch.len(), t * rows, "up_scratch is (T, rows)");
    let isa = Isa::active();
    let (g, u) = (Out::new(out, rows), Out::new(up_scratch, rows));
    with_prepared(Some(pool), isa, precision, x, cols, &[gate, up], |prepared| {
        let chunks = Chunks::new(rows, pool.threads(), ALIGN, MIN_CHUNK);
        pool.run(|_, _| {
            while let Some(r) = chunks.next_chunk() {
                let (a, b) = (r.start, r.end);
                product_rows(isa, precision, gate, a..b, x, prepared, &g);
                product_rows(isa, precision, up, a..b, x, prepared, &u);
                for i in 0..t {
                    // SAFETY: this thread owns columns a..b of every row (its chunk).
                    let (gs, us) =
                        unsafe { (g.data.range(i * rows + a, i * rows + b), u.data.range(i * rows + a, i * rows + b)) };
                    crate::ops::silu_mul_with(isa, gs, us);
                }
            }
        })
    });
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{TileKernel, LANE_ROWS, MR, NR};
    use crate::formats::bf16;
    use crate::formats::float::avx2::{hsum, reduce8};
    use std::arch::x86_64::*;

    /// Most tokens per pass of [`rows2_pass`]: 2 rows × 4 tokens of
    /// accumulators, the 4 widened weight registers, a token's two
    /// activation registers and the mask make 15 of 16 registers.
    pub const PASS: usize = 4;

    /// Two BF16 rows against `n ≤ PASS` of the `tokens` tokens of `xs`
    /// (from token `first` on), laid out by [`super::split_for_few`] with
    /// width 16: `y[i][j] = w[i] · x[first + j]`. Per 16 columns, one load per row widened by a shift (even
    /// columns) and a mask (odd ones), each token's even and odd activations
    /// loaded once for both rows. Prefetches `ahead` as far as `w` reaches.
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn rows2_pass(
        w: [&[bf16]; 2],
        xs: &[f32],
        tokens: usize,
        first: usize,
        n: usize,
        ahead: [*const bf16; 2],
    ) -> [[f32; PASS]; 2] {
        let len = w[0].len();
        assert!(w[1].len() == len && xs.len() == tokens * len && (1..=PASS).contains(&n) && first + n <= tokens);
        match n {
            1 => rows2_n::<1>(w, xs, tokens, first, ahead),
            2 => rows2_n::<2>(w, xs, tokens, first, ahead),
            3 => rows2_n::<3>(w, xs, tokens, first, ahead),
            4 => rows2_n::<4>(w, xs, tokens, first, ahead),
            _ => unreachable!("1..=4 tokens"),
        }
    }

    /// `y[i · 16 + j] = w_i · x_j` for the `n` rows of `w` (each `cols`
    /// long, `n ≤ LANE_ROWS`) and the 16 tokens of `xt (cols, 16)`. Per
    /// column, two loads give every token's activation, and per row one
    /// 32-bit broadcast from the weight's address less 2 bytes puts the
    /// weight in the high half of every lane, the previous one in the low
    /// half, which a mask clears; each accumulator adds its columns in order.
    /// (Broadcasting a pair of weights once for both columns, the even one
    /// widened by a shift, halves the broadcasts but measured no faster: 28
    /// GMAC/s a thread at 8 tokens either way in `cargo bench -p
    /// ember-benches -- "batched decode"`, Zen 3.)
    /// Prefetches `ahead` (the rows a group after `w`'s) as `w` is read.
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn lanes(w: &[bf16], n: usize, cols: usize, xt: &[f32], ahead: Option<*const bf16>, y: &mut [f32]) {
        assert!(w.len() == n * cols && cols >= 1 && xt.len() == cols * 16);
        assert!((1..=LANE_ROWS).contains(&n) && y.len() >= LANE_ROWS * 16);
        lanes_n::<2, LANE_ROWS>(w, n, cols, xt, ahead, y)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn lanes_n<const V: usize, const R: usize>(
        w: &[bf16],
        n: usize,
        cols: usize,
        xt: &[f32],
        ahead: Option<*const bf16>,
        y: &mut [f32],
    ) {
        // Opaque to the compiler, so that the mask stays an `and` (any of the
        // four vector pipes) rather than becoming a blend (two of them).
        let high = _mm256_castsi256_ps(std::hint::black_box(_mm256_set1_epi32(0xffff_0000u32 as i32)));
        // Rows past `n` repeat the last one; their sums are not stored.
        let row: [*const bf16; R] = std::array::from_fn(|i| w.as_ptr().add(i.min(n - 1) * cols));
        let x = xt.as_ptr();
        // Column 0: its weight is the low half of the first pair.
        let mut c: [[__m256; V]; R] = std::array::from_fn(|i| {
            let first = _mm256_set1_epi32(std::ptr::read_unaligned(row[i] as *const u16) as i32);
            let wk = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(first));
            std::array::from_fn(|j| _mm256_fmadd_ps(wk, _mm256_loadu_ps(x.add(8 * j)), _mm256_setzero_ps()))
        });
        let mut k = 1;
        while k < cols {
            if let Some(a) = ahead {
                // A cache line of each row of the group ahead per 32 columns.
                for i in 0..R {
                    _mm_prefetch::<_MM_HINT_T2>(a.wrapping_add(i * cols + k) as *const i8);
                }
            }
            let end = (k + 32).min(cols);
            while k < end {
                let xk: [__m256; V] = std::array::from_fn(|j| _mm256_loadu_ps(x.add(8 * (V * k + j))));
                for (ci, ri) in c.iter_mut().zip(&row) {
                    let pair = _mm256_set1_epi32(std::ptr::read_unaligned(ri.add(k - 1) as *const i32));
                    let wk = _mm256_and_ps(_mm256_castsi256_ps(pair), high);
                    for j in 0..V {
                        ci[j] = _mm256_fmadd_ps(wk, xk[j], ci[j]);
                    }
                }
                k += 1;
            }
        }
        for (i, ci) in c.iter().enumerate().take(n) {
            for (j, cij) in ci.iter().enumerate() {
                _mm256_storeu_ps(y.as_mut_ptr().add(8 * (V * i + j)), *cij);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows2_n<const N: usize>(
        w: [&[bf16]; 2],
        xs: &[f32],
        tokens: usize,
        first: usize,
        ahead: [*const bf16; 2],
    ) -> [[f32; PASS]; 2] {
        let len = w[0].len();
        let high = _mm256_set1_epi32(0xffff_0000u32 as i32);
        // c[j][i]: token j, row i.
        let mut c = [[_mm256_setzero_ps(); 2]; N];
        let mut k = 0;
        let mut x = xs.as_ptr().add(16 * first);
        while k + 16 <= len {
            if k % 32 == 0 {
                // One cache line of each row every 32 columns.
                _mm_prefetch::<_MM_HINT_T2>(ahead[0].wrapping_add(k) as *const i8);
                _mm_prefetch::<_MM_HINT_T2>(ahead[1].wrapping_add(k) as *const i8);
            }
            let v = [
                _mm256_loadu_si256(w[0].as_ptr().add(k) as *const __m256i),
                _mm256_loadu_si256(w[1].as_ptr().add(k) as *const __m256i),
            ];
            let even = v.map(|v| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v)));
            let odd = v.map(|v| _mm256_castsi256_ps(_mm256_and_si256(v, high)));
            for (j, cj) in c.iter_mut().enumerate() {
                let (xe, xo) = (_mm256_loadu_ps(x.add(16 * j)), _mm256_loadu_ps(x.add(16 * j + 8)));
                cj[0] = _mm256_fmadd_ps(odd[0], xo, _mm256_fmadd_ps(even[0], xe, cj[0]));
                cj[1] = _mm256_fmadd_ps(odd[1], xo, _mm256_fmadd_ps(even[1], xe, cj[1]));
            }
            x = x.add(16 * tokens);
            k += 16;
        }
        // The ragged ends, token after token (each `rest` long, after the
        // whole groups of every token).
        let rest = len - k;
        let tail = xs.as_ptr().add(k * tokens + first * rest);
        let sums: [f32; 8] = std::mem::transmute(reduce8(std::array::from_fn(|v| {
            let (i, j) = (v / PASS, v % PASS);
            if j < N {
                c[j][i]
            } else {
                _mm256_setzero_ps()
            }
        })));
        let mut y = [[0.0f32; PASS]; 2];
        for (i, yi) in y.iter_mut().enumerate() {
            for (j, yij) in yi.iter_mut().enumerate().take(N) {
                let mut s = sums[PASS * i + j];
                for kk in 0..rest {
                    s += w[i][k + kk].to_f32() * *tail.add(j * rest + kk);
                }
                *yij = s;
            }
        }
        y
    }

    /// The 4 × `n` kernel (`n` ≤ 3), if any.
    pub fn tile_4xn(n: usize) -> Option<TileKernel> {
        match n {
            1 => Some(tile_4x::<1> as TileKernel),
            2 => Some(tile_4x::<2> as TileKernel),
            3 => Some(tile_4x::<3> as TileKernel),
            _ => None,
        }
    }

    /// The 4 × N micro-kernel: 4N 8-lane accumulators over the columns.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_4x<const N: usize>(panel: &[f32], xs: &[f32], cols: usize, acc: &mut [[f32; NR]; MR]) {
        // This kernel fills the first 4 × N entries of `acc`.
        const M4: usize = 4;
        debug_assert!(panel.len() >= M4 * cols && xs.len() >= N * cols);
        let w: [*const f32; M4] = std::array::from_fn(|i| panel.as_ptr().add(i * cols));
        let x: [*const f32; N] = std::array::from_fn(|j| xs.as_ptr().add(j * cols));
        let mut c = [[_mm256_setzero_ps(); N]; M4];
        let mut k = 0;
        while k + 8 <= cols {
            let xv: [__m256; N] = std::array::from_fn(|j| _mm256_loadu_ps(x[j].add(k)));
            for i in 0..M4 {
                let wv = _mm256_loadu_ps(w[i].add(k));
                for j in 0..N {
                    c[i][j] = _mm256_fmadd_ps(wv, xv[j], c[i][j]);
                }
            }
            k += 8;
        }
        for i in 0..M4 {
            for j in 0..N {
                let mut s = hsum(c[i][j]);
                for kk in k..cols {
                    s += *w[i].add(kk) * *x[j].add(kk);
                }
                acc[i][j] = s;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{TileKernel, MR, NR};
    use std::arch::x86_64::*;

    /// The 8 × `n` kernel (`n` ≤ 3), if any.
    pub fn tile_8xn(n: usize) -> Option<TileKernel> {
        match n {
            1 => Some(tile_8x::<1> as TileKernel),
            2 => Some(tile_8x::<2> as TileKernel),
            3 => Some(tile_8x::<3> as TileKernel),
            _ => None,
        }
    }

    /// Two BF16 rows against `n ≤ 8` tokens laid out by
    /// [`super::split_for_few`]: `y[i][j] = w[i] · x[j]`, the rows widened
    /// in registers as they stream in; `ahead` are prefetched as far as `w`
    /// reaches.
    ///
    /// # Safety
    /// AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn rows2_bf16(
        n: usize,
        w: [&[crate::formats::bf16]; 2],
        xs: &[f32],
        ahead: [*const crate::formats::bf16; 2],
    ) -> [[f32; super::SMALL_BATCH]; 2] {
        macro_rules! by_n {
            ($($n:literal)*) => {
                match n {
                    $($n => rows2_n::<$n>(w, xs, ahead),)*
                    _ => unreachable!("1..=8 tokens"),
                }
            };
        }
        let len = w[0].len();
        assert!(w[1].len() == len && xs.len() == n * len);
        by_n!(1 2 3 4 5 6 7 8)
    }

    /// One token's activations `x (cols,)`, token `j` of `t`, rounded to
    /// BF16 into [`super::DotActs`]' layout: 32 columns a `vcvtne2ps2bf16`,
    /// the ragged end read masked (zeros past it).
    ///
    /// # Safety
    /// AVX-512F, AVX-512BW and AVX512-BF16; `data` holds `cols.div_ceil(32)
    /// · t · 16` words.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn round_for_dot(x: &[f32], t: usize, j: usize, data: &mut [u32]) {
        let cols = x.len();
        assert!(j < t && data.len() == cols.div_ceil(32) * t * 16);
        for (c, k) in (0..cols).step_by(32).enumerate() {
            let m = |from: usize| -> __mmask16 {
                let n = cols.saturating_sub(k + from).min(16);
                ((1u32 << n) - 1) as __mmask16
            };
            let lo = _mm512_maskz_loadu_ps(m(0), x.as_ptr().add(k));
            let hi = _mm512_maskz_loadu_ps(m(16), x.as_ptr().wrapping_add(k + 16));
            let words: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(data.as_mut_ptr().add((c * t + j) * 16) as *mut _, words);
        }
    }

    /// Two BF16 rows against `n ≤ 8` tokens' activations in
    /// [`super::DotActs`]' layout (`x` from the segments' first chunk):
    /// `y[i][j] = w[i] · x[j]` for `j < n` by `vdpbf16ps`. `ahead` are
    /// prefetched as far as `w` reaches.
    ///
    /// # Safety
    /// AVX-512F, AVX-512BW and AVX512-BF16; `x` on a 64-byte boundary (the
    /// activations are read with aligned loads, as `DotActs` lays them out).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn rows2_dot(
        n: usize,
        w: [&[crate::formats::bf16]; 2],
        x: &[u32],
        ahead: [*const crate::formats::bf16; 2],
        y: &mut [[f32; super::PAIR_TOKENS]; 2],
    ) {
        let len = w[0].len();
        assert!(w[1].len() == len && (1..=8).contains(&n));
        assert!(x.len() >= len.div_ceil(32) * n * 16);
        macro_rules! by_n {
            ($($n:literal)*) => {
                match n {
                    $($n => rows2_dot_n::<$n>(w, x.as_ptr(), ahead),)*
                    _ => unreachable!("1..=8 tokens"),
                }
            };
        }
        // Lanes 0..8 are row 0's tokens, 8..16 row 1's.
        let sums = by_n!(1 2 3 4 5 6 7 8);
        _mm256_storeu_ps(y[0].as_mut_ptr(), _mm512_castps512_ps256(sums));
        _mm256_storeu_ps(y[1].as_mut_ptr(), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(sums))));
    }

    /// [`rows2_dot`] for `N` tokens, whose words for a chunk are at `x`, the
    /// next chunk's `16 N` words on: lane `8i + j` of the result is row `i`'s
    /// sum for token `j`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn rows2_dot_n<const N: usize>(
        w: [&[crate::formats::bf16]; 2],
        mut x: *const u32,
        ahead: [*const crate::formats::bf16; 2],
    ) -> __m512 {
        let len = w[0].len();
        // c[j][i]: token j, row i.
        let mut c = [[_mm512_setzero_ps(); 2]; N];
        // One step: 32 columns from `k` (fewer, zeros past the mask).
        macro_rules! step {
            ($k:expr, $wmask:expr) => {
                let k = $k;
                let v: [__m512bh; 2] =
                    w.map(|r| std::mem::transmute(_mm512_maskz_loadu_epi16($wmask, r.as_ptr().add(k) as *const i16)));
                for (j, cj) in c.iter_mut().enumerate() {
                    let xj: __m512bh = std::mem::transmute(_mm512_load_si512(x.add(16 * j) as *const _));
                    cj[0] = _mm512_dpbf16_ps(cj[0], v[0], xj);
                    cj[1] = _mm512_dpbf16_ps(cj[1], v[1], xj);
                }
            };
        }
        let mut k = 0;
        while k + 32 <= len {
            // Into L2, as [`rows2_n`] (into L1, `T0`, 8 sequences decoded
            // at 160-168 against 226-249 tok/s; without, 122-124).
            _mm_prefetch::<_MM_HINT_T2>(ahead[0].wrapping_add(k) as *const i8);
            _mm_prefetch::<_MM_HINT_T2>(ahead[1].wrapping_add(k) as *const i8);
            step!(k, !0);
            x = x.add(16 * N);
            k += 32;
        }
        if k < len {
            // The ragged end: zero weights past the row (and zero
            // activations past the columns).
            step!(k, (1u32 << (len - k)) - 1);
        }
        // Lane `l = 4 (v % 4) + v / 4` of the sums is `v`'s: fed row `l / 8`,
        // token `l % 8` there, the lanes come in that order.
        reduce16(std::array::from_fn(|v| {
            let l = 4 * (v % 4) + v / 4;
            if l % 8 < N {
                c[l % 8][l / 8]
            } else {
                _mm512_setzero_ps()
            }
        }))
    }

    /// Lane `4j + k` of the result is the sum of `v[4k + j]`'s lanes: 16
    /// horizontal sums in 45 operations instead of 16 × 8.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn reduce16(v: [__m512; 16]) -> __m512 {
        // Halves of pairs: a[i]'s 128-bit lanes hold 4-lane partial sums of
        // v[2i] (lanes 0, 1) and v[2i + 1] (lanes 2, 3).
        let a: [__m512; 8] = std::array::from_fn(|i| {
            let (x, y) = (v[2 * i], v[2 * i + 1]);
            _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(x, y), _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y))
        });
        // b[k]'s 128-bit lane j: 4 partial sums of v[4k + j].
        let b: [__m512; 4] = std::array::from_fn(|k| {
            let (x, y) = (a[2 * k], a[2 * k + 1]);
            _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(x, y), _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y))
        });
        // Within 128-bit lanes: a 4 × 4 transpose with adds.
        let c0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
        let c1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
        _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(c0, c1), _mm512_shuffle_ps::<0b11_10_11_10>(c0, c1))
    }

    /// Two BF16 rows against `N` tokens: per 32 columns, one load per row
    /// widened by a shift (even columns) and a mask (odd ones), no
    /// shuffles; `xs` split to match ([`super::split_even_odd`]).
    #[target_feature(enable = "avx512f")]
    unsafe fn rows2_n<const N: usize>(
        w: [&[crate::formats::bf16]; 2],
        xs: &[f32],
        ahead: [*const crate::formats::bf16; 2],
    ) -> [[f32; super::SMALL_BATCH]; 2] {
        let len = w[0].len();
        let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
        // c[j][i]: token j, row i.
        let mut c = [[_mm512_setzero_ps(); 2]; N];
        let mut k = 0;
        let mut x = xs.as_ptr();
        while k + 32 <= len {
            // Into L2 (the `T2` hint): at 8 tokens, 23.3 GB/s on the LM head
            // against 22.1 with `T0` (which holds an L1 fill buffer per line).
            _mm_prefetch::<_MM_HINT_T2>(ahead[0].wrapping_add(k) as *const i8);
            _mm_prefetch::<_MM_HINT_T2>(ahead[1].wrapping_add(k) as *const i8);
            let v = [
                _mm512_loadu_si512(w[0].as_ptr().add(k) as *const _),
                _mm512_loadu_si512(w[1].as_ptr().add(k) as *const _),
            ];
            let even = v.map(|v| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)));
            let odd = v.map(|v| _mm512_castsi512_ps(_mm512_and_si512(v, high)));
            for (j, cj) in c.iter_mut().enumerate() {
                let (xe, xo) = (_mm512_loadu_ps(x.add(32 * j)), _mm512_loadu_ps(x.add(32 * j + 16)));
                cj[0] = _mm512_fmadd_ps(odd[0], xo, _mm512_fmadd_ps(even[0], xe, cj[0]));
                cj[1] = _mm512_fmadd_ps(odd[1], xo, _mm512_fmadd_ps(even[1], xe, cj[1]));
            }
            x = x.add(32 * N);
            k += 32;
        }
        // The ragged ends, token after token.
        let rest = len - k;
        let sums: [f32; 16] = std::mem::transmute(reduce16(std::array::from_fn(|i| {
            if i % 8 < N {
                c[i % 8][i / 8]
            } else {
                _mm512_setzero_ps()
            }
        })));
        let mut y = [[0.0f32; super::SMALL_BATCH]; 2];
        for (i, yi) in y.iter_mut().enumerate() {
            for (j, yij) in yi.iter_mut().enumerate().take(N) {
                // v[8i + j] is lane 4 · ((8i + j) % 4) + (8i + j) / 4.
                let v = 8 * i + j;
                let mut s = sums[4 * (v % 4) + v / 4];
                for kk in 0..rest {
                    s += w[i][k + kk].to_f32() * *x.add(j * rest + kk);
                }
                *yij = s;
            }
        }
        y
    }

    /// The 8 × N micro-kernel: 8N 16-lane accumulators.
    #[target_feature(enable = "avx512f")]
    unsafe fn tile_8x<const N: usize>(panel: &[f32], xs: &[f32], cols: usize, acc: &mut [[f32; NR]; MR]) {
        debug_assert!(panel.len() >= MR * cols && xs.len() >= N * cols);
        let w: [*const f32; MR] = std::array::from_fn(|i| panel.as_ptr().add(i * cols));
        let x: [*const f32; N] = std::array::from_fn(|j| xs.as_ptr().add(j * cols));
        let mut c = [[_mm512_setzero_ps(); N]; MR];
        let mut k = 0;
        while k + 16 <= cols {
            let xv: [__m512; N] = std::array::from_fn(|j| _mm512_loadu_ps(x[j].add(k)));
            for i in 0..MR {
                let wv = _mm512_loadu_ps(w[i].add(k));
                for j in 0..N {
                    c[i][j] = _mm512_fmadd_ps(wv, xv[j], c[i][j]);
                }
            }
            k += 16;
        }
        for i in 0..MR {
            for j in 0..N {
                let mut s = _mm512_reduce_add_ps(c[i][j]);
                for kk in k..cols {
                    s += *w[i].add(kk) * *x[j].add(kk);
                }
                acc[i][j] = s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{bf16, f16, BlockQ4, BlockQ4_0, BlockQ8, Format, Int4, Int8, Q4_0};
    use crate::testutil::synth;
    const QK: usize = 32;

    #[test]
    fn every_tier_and_dtype_matches_the_reference() {
        // Shapes with ragged edges in rows (mod 4), tokens (mod 3, and past a
        // token block) and columns (mod 8).
        for (rows, cols, t) in [
            (1, 1, 1),
            (5, 9, 2),
            (17, 33, 7),
            (64, 128, 70),
            (13, 896, 4),
            (112, 64, 33),
            (208, 96, 3),
            (21, 2500, 8),
            (37, 1700, 6),
            // Several sequences over BF16 at fast precision: ragged columns
            // across the rows-streamed kernel's column blocks.
            (70, 1201, 5),
            // AMX's few-token kernel: whole and ragged row groups, 1 to 16 tokens.
            (48, 64, 9),
            (80, 192, 16),
            (200, 160, 12),
        ] {
            let w = synth(rows * cols, rows as u64);
            let x = synth(t * cols, t as u64 + 99);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let mut all = vec![Weights::F32(&w), Weights::Bf16(&wb), Weights::F16(&wh)];
            // Quantized weights where rows are whole blocks.
            let (mut q8, mut q4) = (vec![BlockQ8::ZERO; w.len() / QK], vec![BlockQ4_0::ZERO; w.len() / QK]);
            let mut q4x4 = vec![BlockQ4::ZERO; w.len() / (4 * QK)];
            if cols % QK == 0 {
                Int8::quantize_row(&w, &mut q8);
                Q4_0::quantize_row(&w, &mut q4);
                all.extend([Weights::Int8(&q8), Weights::Q4_0(&q4)]);
            }
            if cols % (4 * QK) == 0 {
                Int4::quantize_row(&w, &mut q4x4);
                all.push(Weights::Int4(&q4x4));
            }
            for weights in all {
                let m = MatRef::new(weights, rows, cols);
                let mut exact = vec![0.0; t * rows];
                matmul_scalar(m, &x, &mut exact);
                for isa in Isa::supported() {
                    for precision in Precision::ALL {
                        // What this tier computes at this precision: the exact
                        // product, or the fast BF16 kernels' twin.
                        let want = match weights {
                            Weights::Int8(q) if fast_int8(isa, precision, &m) => {
                                int8_reference::<crate::formats::Int8>(q, &x, cols, rows)
                            }
                            Weights::Int4(q) if fast_int8(isa, precision, &m) => {
                                int8_reference::<crate::formats::Int4>(q, &x, cols, rows)
                            }
                            Weights::Q4_0(q) if fast_int8(isa, precision, &m) => {
                                int8_reference::<crate::formats::Q4_0>(q, &x, cols, rows)
                            }
                            Weights::Bf16(v) if fast_bf16(isa, precision, &m, t) => {
                                let mut buf = Vec::new();
                                let acts =
                                    gemm_bf16::prepare(Isa::scalar(), None, &x, cols, gemm_bf16::FAST_TERMS, &mut buf);
                                let mut want = vec![0.0; t * rows];
                                gemm_bf16::matmul_reference(v, cols, &acts, &mut want);
                                want
                            }
                            _ => exact.clone(),
                        };
                        let mut y = vec![f32::NAN; t * rows];
                        matmul_with(isa, precision, m, &x, &mut y);
                        for (a, b) in y.iter().zip(&want) {
                            assert!(
                                (a - b).abs() <= 1e-5 * (cols as f32).max(1.0),
                                "{isa:?} {precision:?} {rows}x{cols} t={t}: {a} vs {b}"
                            );
                        }
                    }
                }
                for threads in [1, 2, 3] {
                    for precision in Precision::ALL {
                        let mut y = vec![f32::NAN; t * rows];
                        matmul(&ThreadPool::new(threads), precision, m, &x, &mut y);
                        let mut serial = vec![0.0; t * rows];
                        matmul_with(Isa::active(), precision, m, &x, &mut serial);
                        assert_eq!(y, serial, "threads={threads} {precision:?}");
                    }
                }
            }
        }
    }

    /// The integer kernels' specification: int8 activations, the decoding
    /// kernels' reference dot product.
    fn int8_reference<F: Format<Act = crate::formats::BlockA8>>(
        q: &[F::Block],
        x: &[f32],
        cols: usize,
        rows: usize,
    ) -> Vec<f32> {
        let mut buf = Vec::new();
        let acts = gemm_int8::prepare(Isa::scalar(), None, x, cols, &mut buf);
        let mut want = vec![0.0; x.len() / cols * rows];
        gemm_int8::matmul_reference::<F>(q, &acts, &mut want);
        want
    }

    /// A few rows streamed in several column blocks (activations past L1):
    /// fewer than four pairs of rows to look ahead to in the next block.
    /// Each row's sums are those of the same row in a taller matrix (the
    /// same blocks and kernel).
    #[test]
    fn a_few_rows_in_several_column_blocks() {
        let (tall, cols) = (64, 1600);
        let w: Vec<bf16> = synth(tall * cols, 21).iter().map(|&v| bf16::from_f32(v)).collect();
        for t in [2, 5, 8] {
            let x = synth(t * cols, 22 + t as u64);
            for isa in Isa::supported() {
                for precision in Precision::ALL {
                    let mut want = vec![0.0; t * tall];
                    matmul_with(isa, precision, MatRef::new(Weights::Bf16(&w), tall, cols), &x, &mut want);
                    for rows in [1, 2, 3, 5, 7] {
                        let mut y = vec![f32::NAN; t * rows];
                        matmul_with(
                            isa,
                            precision,
                            MatRef::new(Weights::Bf16(&w[..rows * cols]), rows, cols),
                            &x,
                            &mut y,
                        );
                        for j in 0..t {
                            assert_eq!(
                                y[j * rows..(j + 1) * rows],
                                want[j * tall..j * tall + rows],
                                "{isa:?} {precision:?} t={t} rows={rows}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// On the AVX2 tiers 5–8 tokens are two passes over each pair of rows:
    /// each token's sums are those it gets in a product of 4 (the same
    /// kernel, one pass, the same column blocks), bit for bit, whatever
    /// pass and place in it the token has.
    #[test]
    fn avx2_tokens_past_four_are_a_second_pass() {
        for (rows, cols) in [(9, 33), (21, 896), (6, 1201)] {
            let w: Vec<bf16> = synth(rows * cols, cols as u64).iter().map(|&v| bf16::from_f32(v)).collect();
            let m = MatRef::new(Weights::Bf16(&w), rows, cols);
            for t in 5..=8 {
                let x = synth(t * cols, t as u64);
                for isa in Isa::supported().into_iter().filter(|i| matches!(i.tier(), Tier::Avx2 | Tier::AvxVnni)) {
                    for precision in Precision::ALL {
                        assert!(on_few(isa, precision, &m, t) && few_block(t, cols, 16) == cols);
                        let mut y = vec![f32::NAN; t * rows];
                        matmul_with(isa, precision, m, &x, &mut y);
                        // The first four tokens, then the rest, as products
                        // of their own.
                        for (first, n) in [(0, 4), (4, t - 4)] {
                            let mut part = vec![f32::NAN; n * rows];
                            matmul_with(isa, precision, m, &x[first * cols..(first + n) * cols], &mut part);
                            for j in 0..n {
                                let (got, want) = (&y[(first + j) * rows..][..rows], &part[j * rows..][..rows]);
                                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                                assert_eq!(
                                    bits(got),
                                    bits(want),
                                    "{isa:?} {precision:?} {rows}x{cols} t={t} j={}",
                                    first + j
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn few_token_blocks_cover_the_columns_in_whole_widths() {
        for (t, cols) in [(1, 896), (8, 896), (8, 4864), (5, 4864), (8, 2500), (3, 100_000)] {
            let block = few_block(t, cols, 32);
            if 4 * t * cols <= SMALL_BATCH_BYTES {
                assert_eq!(block, cols);
                continue;
            }
            assert!(block.is_multiple_of(32) && 4 * t * block <= FEW_BLOCK_BYTES, "t={t} cols={cols}: {block}");
            // As even as whole widths allow: no block is a width short of
            // the others but the last.
            let blocks = cols.div_ceil(block);
            assert!(cols > (blocks - 1) * block && cols.div_ceil(blocks) + 32 > block, "t={t} cols={cols}: {block}");
        }
    }

    #[test]
    fn few_token_activations_start_on_a_cache_line() {
        let x = synth(8 * 300, 5);
        // Appended one after another into room reserved for all of them, as
        // a product's column blocks are.
        let mut xp = Vec::with_capacity(8 * (300 + 136 + 12) + 3 * 16);
        for span in [0..300, 64..200, 288..300] {
            let start = split_for_few(&x, 300, span.clone(), 32, &mut xp);
            assert_eq!(xp[start..].as_ptr() as usize % 64, 0);
            assert_eq!(xp.len() - start, 8 * span.len());
            // Token 1's even columns of the span's first width.
            if span.len() >= 32 {
                assert_eq!(xp[start + 32], x[300 + span.start]);
                assert_eq!(xp[start + 33], x[300 + span.start + 2]);
            }
        }
    }

    #[test]
    fn dot_activations_are_rounded_and_laid_out_alike_on_every_tier() {
        // Ragged columns (mod 32, mod 16, odd) and 1 to 8 tokens.
        for (t, cols) in [(1, 7), (2, 33), (3, 64), (5, 95), (8, 896), (8, 1001)] {
            let x = synth(t * cols, cols as u64);
            let mut buf = Vec::new();
            let want = prepare_dot(Isa::scalar(), &x, cols, &mut buf).data.to_vec();
            // Token j's column k is half k % 2 of word k % 32 / 2 of its
            // slot in chunk k / 32, rounded as `bf16_bits` does.
            for j in 0..t {
                for k in 0..cols {
                    let word = want[(k / 32 * t + j) * 16 + k % 32 / 2];
                    let bits = (word >> (16 * (k % 2))) as u16;
                    assert_eq!(bits, gemm_bf16::bf16_bits(x[j * cols + k]), "t={t} cols={cols} j={j} k={k}");
                }
            }
            for isa in Isa::supported() {
                let mut buf = Vec::new();
                let got = prepare_dot(isa, &x, cols, &mut buf);
                assert_eq!(got.data.as_ptr() as usize % 64, 0, "{isa:?}");
                assert_eq!(got.data, &want[..], "{isa:?} t={t} cols={cols}");
            }
        }
    }

    #[test]
    fn lanes_kernel_gives_the_reference_bits() {
        // Rows past one group (10 or 5) and ragged, columns odd and even.
        for (rows, cols) in [(1, 1), (3, 2), (11, 37), (23, 96), (64, 130), (37, 898)] {
            let w: Vec<bf16> = synth(rows * cols, cols as u64).iter().map(|&v| bf16::from_f32(v)).collect();
            let m = MatRef::new(Weights::Bf16(&w), rows, cols);
            for t in LANES {
                let x = synth(t * cols, t as u64 + 7);
                let mut want = vec![0.0; t * rows];
                gemm_bf16::matmul_f32_reference(&w, cols, &x, &mut want);
                for isa in Isa::supported().into_iter().filter(|i| matches!(i.tier(), Tier::Avx2 | Tier::AvxVnni)) {
                    for precision in Precision::ALL {
                        assert!(on_lanes(isa, precision, &m, t));
                        let mut y = vec![f32::NAN; t * rows];
                        matmul_with(isa, precision, m, &x, &mut y);
                        let (got, want): (Vec<u32>, Vec<u32>) =
                            (y.iter().map(|v| v.to_bits()).collect(), want.iter().map(|v| v.to_bits()).collect());
                        assert_eq!(got, want, "{isa:?} {precision:?} {rows}x{cols} t={t}");
                    }
                }
            }
        }
    }

    #[test]
    fn swiglu_block_matches_separate_steps() {
        let (rows, cols, t) = (21, 48, 5);
        let (g, u) = (synth(rows * cols, 11), synth(rows * cols, 12));
        let (g16, u16): (Vec<bf16>, Vec<bf16>) =
            (g.iter().map(|&v| bf16::from_f32(v)).collect(), u.iter().map(|&v| bf16::from_f32(v)).collect());
        let x = synth(t * cols, 13);
        // F32 weights, and BF16 ones (the BF16 dot kernel's few tokens
        // where it runs).
        for (gw, uw) in [(Weights::F32(&g), Weights::F32(&u)), (Weights::Bf16(&g16), Weights::Bf16(&u16))] {
            let (gm, um) = (MatRef::new(gw, rows, cols), MatRef::new(uw, rows, cols));
            let (mut gy, mut uy) = (vec![0.0; t * rows], vec![0.0; t * rows]);
            matmul_with(Isa::active(), Precision::Fast, gm, &x, &mut gy);
            matmul_with(Isa::active(), Precision::Fast, um, &x, &mut uy);
            // The gate as the active tier computes it alone.
            let mut want = gy.clone();
            crate::ops::silu_mul_with(Isa::active(), &mut want, &uy);
            for threads in [1, 2, 4] {
                let (mut out, mut scratch) = (vec![0.0; t * rows], vec![0.0; t * rows]);
                matmul_swiglu(&ThreadPool::new(threads), Precision::Fast, gm, um, &x, &mut scratch, &mut out);
                assert_eq!(out, want, "{} threads={threads}", gw.ty());
            }
        }
    }

    #[test]
    fn one_token_equals_the_matvec() {
        let (rows, cols) = (37, 100);
        let w = synth(rows * cols, 3);
        let x = synth(cols, 4);
        let m = MatRef::new(Weights::F32(&w), rows, cols);
        let mut a = vec![0.0; rows];
        let mut b = vec![0.0; rows];
        matmul_scalar(m, &x, &mut a);
        crate::matvec::matvec_with(Isa::scalar(), m, &x, &mut b);
        assert_eq!(a, b);
    }

    /// A few tokens' integer products are each token's mat-vec, bit for
    /// bit, on every tier: sequences decoded together get the numbers each
    /// gets alone. Rows enough for several of the blocks the mat-vecs pass
    /// over, and a ragged last one.
    #[test]
    fn a_few_tokens_integer_products_are_their_matvecs() {
        let (rows, cols) = (1100, 512);
        let w = synth(rows * cols, 7);
        let (mut q8, mut q4) = (vec![BlockQ8::ZERO; w.len() / QK], vec![BlockQ4_0::ZERO; w.len() / QK]);
        let mut q4x4 = vec![BlockQ4::ZERO; w.len() / (4 * QK)];
        Int8::quantize_row(&w, &mut q8);
        Q4_0::quantize_row(&w, &mut q4);
        Int4::quantize_row(&w, &mut q4x4);
        for weights in [Weights::Int8(&q8), Weights::Q4_0(&q4), Weights::Int4(&q4x4)] {
            let m = MatRef::new(weights, rows, cols);
            for t in [2, 3, 4, 9, 16] {
                if t > few_int8_tokens(&m) {
                    continue;
                }
                let x = synth(t * cols, t as u64);
                for isa in Isa::supported().into_iter().filter(|&isa| fast_int8(isa, Precision::Fast, &m)) {
                    let mut y = vec![f32::NAN; t * rows];
                    matmul_with(isa, Precision::Fast, m, &x, &mut y);
                    for i in 0..t {
                        let mut alone = vec![f32::NAN; rows];
                        crate::matvec::matvec_with(isa, m, &x[i * cols..(i + 1) * cols], &mut alone);
                        assert_eq!(
                            &y[i * rows..(i + 1) * rows],
                            &alone[..],
                            "{isa:?} {:?} t={t} token {i}",
                            m.weights.ty()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn fused_products_equal_separate_ones() {
        let cols = 40;
        let t = 5;
        let (wa, wb) = (synth(12 * cols, 1), synth(8 * cols, 2));
        let (wa16, wb16): (Vec<bf16>, Vec<bf16>) =
            (wa.iter().map(|&v| bf16::from_f32(v)).collect(), wb.iter().map(|&v| bf16::from_f32(v)).collect());
        let x = synth(t * cols, 3);
        for (a, b) in [(Weights::F32(&wa), Weights::F32(&wb)), (Weights::Bf16(&wa16), Weights::Bf16(&wb16))] {
            let (ma, mb) = (MatRef::new(a, 12, cols), MatRef::new(b, 8, cols));
            for threads in [2, 3] {
                let pool = ThreadPool::new(threads);
                let (mut ya, mut yb) = (vec![0.0; t * 12], vec![0.0; t * 8]);
                matmuls(&pool, Precision::Fast, &x, [(ma, &mut ya[..]), (mb, &mut yb[..])]);
                let (mut ra, mut rb) = (vec![0.0; t * 12], vec![0.0; t * 8]);
                matmul_with(Isa::active(), Precision::Fast, ma, &x, &mut ra);
                matmul_with(Isa::active(), Precision::Fast, mb, &x, &mut rb);
                assert_eq!((ya, yb), (ra, rb), "{} threads={threads}", a.ty());
            }
        }
    }
}
