//! AMX tiles for prefill's matrix products over BF16 and F16 weights, at
//! f32-class accuracy.
//!
//! Intel AMX (Sapphire Rapids and later) multiplies whole tiles: one
//! `tdpbf16ps` adds a 16×32 BF16 tile times a 32×16 BF16 tile into 16×16 f32
//! accumulators, 8192 multiply-adds in about 16 cycles, against the 16 f32
//! FMAs per cycle of the AVX-512 units. Prompt processing is compute-bound,
//! so this is where its speed comes from.
//!
//! **Accuracy.** Products of two BF16 numbers are exact in f32 and AMX
//! accumulates in f32, so the only loss is in rounding the operands to BF16.
//! BF16 weights are already exact. Activations are not: each f32 activation is
//! split into [`ACT_TERMS`] = 3 BF16 terms, `x = x0 + x1 + x2 + r` with each
//! term the remainder so far rounded to BF16, which leaves `|r| ≤ 2⁻²⁴·|x|`:
//! f32's own precision (one term alone would be 2⁻⁸, two 2⁻¹⁶, which was
//! measured to move the tiny models' logits by 2e-5 of their range). Each
//! term is one more product pass. F16 weights split exactly into two BF16
//! terms (`w0` = the top 8 significant bits, `w1` = the other 3), and the
//! passes whose product is below 2⁻²⁴ of the result are skipped: 5 passes
//! (`w0·x0..2`, `w1·x0..1`) instead of 6.
//!
//! **Layout.** `A` tiles are 16 weight rows × 32 columns, read in place from
//! the BF16 weights (row stride = the matrix's row length), so BF16 weights are
//! never copied; F16 weights are split into two BF16 copies, a block of
//! `ROW_BLOCK` (256) rows × `COL_CHUNK` (1024) columns at a time. `B` tiles are the
//! activations of 16 tokens × 32 columns in AMX's pair-interleaved ("VNNI")
//! layout, packed once per product (a 16 × 16 word transpose per tile) and
//! shared by all threads. The micro-kernel holds 2×2 accumulator tiles (32
//! weight rows × 32 tokens).
//!
//! **Speed.** On this project's machine (a Sapphire Rapids VM) one `tdpbf16ps`
//! takes about 14 cycles but a 1 KB tile load about 45, even from L1, so the
//! kernel is bound by tile loads: 2×2 accumulators with the weight tiles held
//! across the activation terms is the shape that loads least per product
//! (8 loads per 12 products for BF16). Measured with one thread (`cargo bench
//! -p ember-benches -- matmul`), 512 tokens: 110–200 G multiply-adds/s for BF16
//! weights and 67–110 G for F16, against 35–43 G for the AVX-512 f32 kernel.
//!
//! The tier is [`Tier::Amx`]; `EMBER_ISA=avx512` turns it off.

use crate::cpu::{Isa, Tier};
use crate::formats::{MatRef, Weights};
use crate::gemm_bf16::{bf16_bits, bf16_value};
use crate::pool::SharedMut;
use half::f16;
use std::cell::RefCell;

/// BF16 terms per activation.
pub const ACT_TERMS: usize = 3;
/// Rows (and tokens) per tile.
const TILE: usize = 16;
/// BF16 columns per tile row: 64 bytes.
const KSTEP: usize = 32;
/// BF16 elements in a tile.
const TILE_ELEMS: usize = TILE * KSTEP;
/// Weight rows per block: every token pair meets these rows while their
/// column chunk is in L2, so the packed activations stream from L3 once per
/// block.
const ROW_BLOCK: usize = 256;
/// Columns per chunk: 256 rows × 256 columns of A is 128 KB in BF16 (256 KB
/// for F16's two terms).
const COL_CHUNK: usize = 1024;

/// Whether `isa` may run the AVX-512 kernels of this module (packing and
/// splitting); every tier says so by name.
fn avx512(isa: Isa) -> bool {
    match isa.tier() {
        Tier::Scalar | Tier::Avx2 | Tier::AvxVnni => false,
        Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => cfg!(target_arch = "x86_64"),
    }
}

/// Whether products with `w` can run on AMX: BF16, F16, INT8 or INT4 weights
/// with rows a whole number of 32-column tile rows. (F32 weights take the
/// AVX-512 path.) Quantized weights are dequantized a block at a time and
/// split into two BF16 terms like F16 weights: `hi + lo` carries 16
/// significant bits of `d · q`, 256 times finer than the quantization step.
pub fn handles(w: &MatRef) -> bool {
    !matches!(w.weights, Weights::F32(_)) && w.cols.is_multiple_of(KSTEP) && w.cols > 0
}

/// `x` as `ACT_TERMS` BF16 terms, largest first.
#[inline]
pub fn split(x: f32) -> [u16; ACT_TERMS] {
    crate::gemm_bf16::terms::<ACT_TERMS>(x)
}

/// Activations `X (T, cols)` packed for the `B` operand: for each tile of 16
/// tokens (zero-padded to an even number of tiles) and each 32-column step,
/// `ACT_TERMS` tiles of 16 rows (column pairs) × 16 tokens × 2.
pub struct Packed<'a> {
    data: &'a [u16],
    tokens: usize,
    cols: usize,
}

impl<'a> Packed<'a> {
    /// Elements of the packed form of `tokens` tokens of `cols` columns.
    pub fn len(tokens: usize, cols: usize) -> usize {
        token_tiles(tokens) * cols / KSTEP * ACT_TERMS * TILE_ELEMS
    }

    fn tile_stride(&self) -> usize {
        self.cols / KSTEP * ACT_TERMS * TILE_ELEMS
    }
}

/// Token tiles after padding to whole pairs.
fn token_tiles(tokens: usize) -> usize {
    tokens.div_ceil(2 * TILE) * 2
}

/// Packs token tiles `tiles` of `x (T, cols)` into `dst`, which holds exactly
/// those tiles.
fn pack_tiles(isa: Isa, x: &[f32], cols: usize, tiles: std::ops::Range<usize>, dst: &mut [u16]) {
    let t = x.len() / cols;
    let ksteps = cols / KSTEP;
    let per_tile = ksteps * ACT_TERMS * TILE_ELEMS;
    debug_assert_eq!(dst.len(), tiles.len() * per_tile);
    for (ti, tile) in tiles.enumerate() {
        let dst = &mut dst[ti * per_tile..(ti + 1) * per_tile];
        // Tokens of this tile that exist; the rest are zero padding, whose
        // outputs are zero and never written out.
        let valid = t.saturating_sub(tile * TILE).min(TILE);
        let first = (tile * TILE).min(t);
        let rows = &x[first * cols..(first + valid) * cols];
        #[cfg(target_arch = "x86_64")]
        if avx512(isa) {
            // SAFETY: AVX-512F is present (`isa` is the proof).
            unsafe { avx512::pack_tile(rows, cols, dst) };
            continue;
        }
        pack_tile_scalar(rows, cols, dst);
    }
}

/// The reference for `avx512::pack_tile`: one tile of up to 16 tokens.
fn pack_tile_scalar(rows: &[f32], cols: usize, dst: &mut [u16]) {
    dst.fill(0);
    for (n, row) in rows.chunks_exact(cols).enumerate() {
        for (k, &v) in row.iter().enumerate() {
            let (ks, kk) = (k / KSTEP, k % KSTEP);
            let at = ks * ACT_TERMS * TILE_ELEMS + (kk / 2) * 2 * TILE + 2 * n + kk % 2;
            for (term, bits) in split(v).into_iter().enumerate() {
                dst[at + term * TILE_ELEMS] = bits;
            }
        }
    }
}

/// Packs `x (T, cols)` into `buf` with the pool's threads (or on the calling
/// thread without a pool) and returns the packed view.
pub fn pack<'b>(
    isa: Isa,
    pool: Option<&crate::ThreadPool>,
    x: &[f32],
    cols: usize,
    buf: &'b mut Vec<u16>,
) -> Packed<'b> {
    let t = x.len() / cols;
    assert!(cols.is_multiple_of(KSTEP) && x.len() == t * cols);
    let tiles = token_tiles(t);
    let per_tile = cols / KSTEP * ACT_TERMS * TILE_ELEMS;
    buf.resize(tiles * per_tile, 0);
    crate::pool::fill_shares(pool, &mut buf[..], tiles, |range, dst| pack_tiles(isa, x, cols, range, dst));
    Packed { data: &buf[..], tokens: t, cols }
}

/// The 64-byte tile configuration: palette 1, eight 16-row × 64-byte tiles.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const _: () = assert!(std::mem::size_of::<TileConfig>() == 64);

/// Loads the tile configuration on this thread for its lifetime and releases
/// the tiles when dropped.
struct Tiles;

impl Tiles {
    fn configure() -> Tiles {
        let mut cfg = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for i in 0..8 {
            cfg.colsb[i] = (KSTEP * 2) as u16;
            cfg.rows[i] = TILE as u8;
        }
        // SAFETY: only reached on the AMX tier, whose detection asked the OS
        // for the tile state.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly))
        };
        Tiles
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: tiles were configured by `configure`.
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem))
        };
    }
}

thread_local! {
    /// Each thread's scratch: F16 weights split into BF16 `hi` and `lo`
    /// rows, and the accumulators of a row block between column chunks.
    static SCRATCH: RefCell<(Vec<u16>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Where the output goes: `y[t * stride + r]`.
pub(crate) struct OutRef<'o, 'a> {
    pub data: &'o SharedMut<'a, f32>,
    pub stride: usize,
}

/// Accumulator floats per micro-kernel call: 2 × 2 tiles of 16 × 16.
const C_BLOCK: usize = 4 * TILE * TILE;

/// Rows `rows` of `Y = X @ Wᵀ` on the calling thread, `rows.len()` a multiple
/// of 32. Writes `y[t][r]` for `r` in `rows`, every token.
///
/// Blocking: [`ROW_BLOCK`] weight rows × [`COL_CHUNK`] columns of A stay in
/// L2 while every token pair passes (each B chunk then serves 8 row pairs
/// from L1/L2); the accumulators of the row block live in a scratch between
/// column chunks, so neither operand's whole rows need to fit in cache.
pub(crate) fn matmul_rows(isa: Isa, w: MatRef, rows: std::ops::Range<usize>, x: &Packed, out: &OutRef) {
    assert!(
        isa.tier() == Tier::Amx
            && handles(&w)
            && x.cols == w.cols
            && rows.len().is_multiple_of(2 * TILE)
            && rows.end <= w.rows
    );
    let cols = w.cols;
    let pairs = token_tiles(x.tokens) / 2;
    let _tiles = Tiles::configure();
    SCRATCH.with(|scratch| {
        let (split, acc) = &mut *scratch.borrow_mut();
        acc.resize(ROW_BLOCK / (2 * TILE) * pairs * C_BLOCK, 0.0);
        for r0 in rows.clone().step_by(ROW_BLOCK) {
            let r1 = (r0 + ROW_BLOCK).min(rows.end);
            for k0 in (0..cols).step_by(COL_CHUNK) {
                let k1 = (k0 + COL_CHUNK).min(cols);
                // The A operand: one pointer per weight term at (r0, k0), and
                // the byte stride between its rows.
                let (a, terms, stride): ([*const u16; 2], usize, usize) = match w.weights {
                    Weights::Bf16(v) => {
                        let p = v[r0 * cols + k0..].as_ptr() as *const u16;
                        ([p, p], 1, cols * 2)
                    }
                    Weights::F16(v) => {
                        let kc = k1 - k0;
                        split.resize(2 * ROW_BLOCK * COL_CHUNK, 0);
                        let (hi, lo) = split.split_at_mut(ROW_BLOCK * COL_CHUNK);
                        for r in r0..r1 {
                            let o = (r - r0) * kc;
                            split_f16(isa, &v[r * cols + k0..r * cols + k1], &mut hi[o..o + kc], &mut lo[o..o + kc]);
                        }
                        ([hi.as_ptr(), lo.as_ptr()], 2, kc * 2)
                    }
                    Weights::F32(_) => unreachable!("handles() rejects F32"),
                    // Any other type: widened by its row's kernel, a block
                    // of columns at a time, and split into two BF16 terms.
                    _ => {
                        let kc = k1 - k0;
                        split.resize(2 * ROW_BLOCK * COL_CHUNK, 0);
                        let (hi, lo) = split.split_at_mut(ROW_BLOCK * COL_CHUNK);
                        let mut row = [0.0f32; COL_CHUNK];
                        for r in r0..r1 {
                            let o = (r - r0) * kc;
                            w.rows(r, r + 1).row_to_f32_range_with(isa, k0..k1, &mut row[..kc]);
                            split_f32(isa, &row[..kc], &mut hi[o..o + kc], &mut lo[o..o + kc]);
                        }
                        ([hi.as_ptr(), lo.as_ptr()], 2, kc * 2)
                    }
                };
                for tp in 0..pairs {
                    let b = x.data[2 * tp * x.tile_stride() + k0 / KSTEP * ACT_TERMS * TILE_ELEMS..].as_ptr();
                    for rp in (r0..r1).step_by(2 * TILE) {
                        let c = &mut acc[((rp - r0) / (2 * TILE) * pairs + tp) * C_BLOCK..][..C_BLOCK];
                        let off = (rp - r0) * stride / 2;
                        // SAFETY: tiles configured; A rows rp..rp+32 over
                        // columns k0..k1 and B tiles 2tp, 2tp+1 lie inside
                        // their buffers (shapes checked above).
                        unsafe {
                            kernel(
                                [a[0].add(off), a[1].add(off)],
                                terms,
                                stride,
                                b,
                                x.tile_stride(),
                                (k1 - k0) / KSTEP,
                                k0 > 0,
                                c,
                            )
                        };
                    }
                }
            }
            for tp in 0..pairs {
                for rp in (r0..r1).step_by(2 * TILE) {
                    let c = &acc[((rp - r0) / (2 * TILE) * pairs + tp) * C_BLOCK..][..C_BLOCK];
                    scatter(c, rp, 2 * tp * TILE, x.tokens, out);
                }
            }
        }
    });
}

/// Most tokens `few_rows` takes: one token tile.
pub const FEW_TOKENS: usize = TILE;

/// Weight row tiles [`few_rows`] accumulates at once (48 rows): three of the
/// eight tiles hold accumulators, two the weights (alternately), three the
/// activation terms. (Four accumulators and one weight tile, each load
/// waiting for the products that read the tile before: 16 sequences
/// 177 tok/s against 192.)
const FEW_ROW_TILES: usize = 3;

/// Up to [`FEW_TOKENS`] tokens packed for `few_rows` (the kernel of
/// `matmul`'s products of 9–16 tokens on AMX): one token tile per
/// 32-column step, its [`ACT_TERMS`] terms (the layout of [`pack`]'s first
/// tile), all of which the product uses (with one, f32-class accuracy given
/// up, 16 sequences decoded 15% faster).
pub struct FewPacked<'a> {
    data: &'a [u16],
    tokens: usize,
    cols: usize,
}

/// Packs `x (T, cols)`, `T ≤ FEW_TOKENS`, for `few_rows`. On the calling
/// thread: 16 tokens of 4864 columns is 78 k values.
pub fn pack_few<'b>(isa: Isa, x: &[f32], cols: usize, buf: &'b mut Vec<u16>) -> FewPacked<'b> {
    let t = x.len() / cols;
    assert!(cols.is_multiple_of(KSTEP) && x.len() == t * cols && t <= FEW_TOKENS);
    buf.resize(cols / KSTEP * ACT_TERMS * TILE_ELEMS, 0);
    pack_tiles(isa, x, cols, 0..1, &mut buf[..]);
    FewPacked { data: &buf[..], tokens: t, cols }
}

/// Rows `rows` of `Y = X @ Wᵀ` for a few tokens (≤ [`FEW_TOKENS`]) over BF16
/// weights, on the calling thread; `rows.len()` a multiple of 16.
///
/// Decoding several sequences at once reads every weight once per step for
/// all of them, so this is a memory stream like a mat-vec, not a
/// compute-bound product: each 16 × 32 weight tile is loaded once, in place,
/// and multiplied with the one activation tile of its column step (per term),
/// into accumulators that hold 48 rows × 16 tokens for the whole row, so
/// nothing is stored between column steps. The f32 kernels spend an FMA
/// lane on every weight for every token, which for 16 tokens outlasts
/// reading the weights; one `tdpbf16ps` does 8192 multiply-adds. While a group
/// of 48 rows is multiplied, the next group's bytes (contiguous: whole rows)
/// are prefetched into L2, spread over its column steps, since 48 rows read
/// a tile at a time are more streams than the hardware prefetcher follows.
pub(crate) fn few_rows(
    isa: Isa,
    w: &[half::bf16],
    cols: usize,
    rows: std::ops::Range<usize>,
    x: &FewPacked,
    out: &OutRef,
) {
    assert!(
        isa.tier() == Tier::Amx
            && x.cols == cols
            && cols.is_multiple_of(KSTEP)
            && rows.len().is_multiple_of(TILE)
            && rows.end * cols <= w.len()
    );
    let group = FEW_ROW_TILES * TILE;
    let _tiles = Tiles::configure();
    let mut c = [0.0f32; FEW_ROW_TILES * TILE * TILE];
    let stride = cols * 2;
    let base = w.as_ptr() as *const u8;
    for g0 in rows.clone().step_by(group) {
        let g1 = (g0 + group).min(rows.end);
        let n1 = (g1 + group).min(rows.end);
        // SAFETY: tiles configured on this thread; rows g0..g1 and n1 lie in
        // `w` (checked above); `x` holds `cols / 32` steps of ACT_TERMS tiles.
        unsafe {
            few_kernel(
                base.add(g0 * stride),
                stride,
                (g1 - g0) / TILE,
                x.data.as_ptr(),
                cols / KSTEP,
                (base.add(g1 * stride), (n1 - g1) * stride),
                c.as_mut_ptr(),
            )
        };
        for n in 0..x.tokens {
            // SAFETY: this thread owns columns `rows` of every output row.
            let y = unsafe { out.data.range(n * out.stride + g0, n * out.stride + g1) };
            for (r, v) in y.iter_mut().enumerate() {
                *v = c[(r / TILE) * TILE * TILE + (r % TILE) * TILE + n];
            }
        }
    }
}

/// `c[j] = Σ_k A[j] · B` for `tiles` ≤ 3 row tiles of A (row `j·16` at
/// `a + j·16·a_stride` bytes) over `ksteps` 32-column steps, B the packed
/// activations (the `ACT_TERMS` tiles of each step), stored as
/// 16 × 16 f32 tiles at `c + j·256`. Prefetches `next` (a pointer and a byte
/// count) into L2 over the steps.
///
/// # Safety
/// Tiles configured on this thread; `a` valid for `16·tiles` rows of
/// `a_stride` bytes × `ksteps` steps, `b` for `ksteps · ACT_TERMS` tiles, `c`
/// for `tiles · 256` floats.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline(never)]
unsafe fn few_kernel(
    a: *const u8,
    a_stride: usize,
    tiles: usize,
    b: *const u16,
    ksteps: usize,
    next: (*const u8, usize),
    c: *mut f32,
) {
    use std::arch::asm;
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    // The three activation terms live in tmm5, tmm6 and tmm7.
    const _: () = assert!(ACT_TERMS == 3);
    debug_assert!((1..=FEW_ROW_TILES).contains(&tiles));
    asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", options(nostack, nomem));
    let b_row = 2 * TILE * 2; // bytes per B tile row: 16 tokens × 2 bf16
    let lines = next.1.div_ceil(64);
    let mut fetched = 0;
    macro_rules! load_b {
        ($t:literal, $p:expr) => {
            asm!(concat!("tileloadd tmm", $t, ", [{p} + {s} * 1]"), p = in(reg) $p, s = in(reg) b_row, options(nostack, readonly))
        };
    }
    macro_rules! load_a {
        ($t:literal, $p:expr) => {
            asm!(concat!("tileloadd tmm", $t, ", [{p} + {s} * 1]"), p = in(reg) $p, s = in(reg) a_stride, options(nostack, readonly))
        };
    }
    macro_rules! dot3 {
        ($c:literal, $a:literal) => {
            asm!(
                concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm5"),
                concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm6"),
                concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm7"),
                options(nostack, nomem)
            )
        };
    }
    // The weights alternate between tmm3 and tmm4 (tiles are not renamed: a
    // load into one waits only for the products reading it, so the next
    // tile's load overlaps this one's products).
    let mut second = false;
    for ks in 0..ksteps {
        let bp = b.add(ks * ACT_TERMS * TILE_ELEMS);
        load_b!("5", bp);
        load_b!("6", bp.add(TILE_ELEMS));
        load_b!("7", bp.add(2 * TILE_ELEMS));
        // This step's share of the next group's lines.
        let upto = lines * (ks + 1) / ksteps;
        while fetched < upto {
            _mm_prefetch::<_MM_HINT_T1>(next.0.add(fetched * 64) as *const i8);
            fetched += 1;
        }
        for j in 0..tiles {
            let ap = a.add(j * TILE * a_stride + ks * KSTEP * 2);
            if !second {
                load_a!("3", ap);
                match j {
                    0 => dot3!("0", "3"),
                    1 => dot3!("1", "3"),
                    _ => dot3!("2", "3"),
                }
            } else {
                load_a!("4", ap);
                match j {
                    0 => dot3!("0", "4"),
                    1 => dot3!("1", "4"),
                    _ => dot3!("2", "4"),
                }
            }
            second = !second;
        }
    }
    let c_row = TILE * 4;
    asm!("tilestored [{p} + {s} * 1], tmm0", p = in(reg) c, s = in(reg) c_row, options(nostack));
    if tiles > 1 {
        asm!("tilestored [{p} + {s} * 1], tmm1", p = in(reg) c.add(TILE * TILE), s = in(reg) c_row, options(nostack));
    }
    if tiles > 2 {
        asm!("tilestored [{p} + {s} * 1], tmm2", p = in(reg) c.add(2 * TILE * TILE), s = in(reg) c_row, options(nostack));
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn few_kernel(_: *const u8, _: usize, _: usize, _: *const u16, _: usize, _: (*const u8, usize), _: *mut f32) {
    unreachable!("AMX is x86-64 only")
}

/// Writes the 2×2 accumulator tiles (row tile j, token tile m at
/// `c[(2j + m) * 256 + row * 16 + token]`) into `out`.
fn scatter(c: &[f32], r0: usize, t0: usize, tokens: usize, out: &OutRef) {
    for m in 0..2 {
        for n in 0..TILE {
            let t = t0 + m * TILE + n;
            if t >= tokens {
                return;
            }
            // SAFETY: this thread owns columns r0..r0+32 of every output row.
            let y = unsafe { out.data.range(t * out.stride + r0, t * out.stride + r0 + 2 * TILE) };
            for j in 0..2 {
                let tile = &c[(2 * j + m) * TILE * TILE..];
                for r in 0..TILE {
                    y[j * TILE + r] = tile[r * TILE + n];
                }
            }
        }
    }
}

/// F16 weights as BF16 `hi + lo`, exactly.
fn split_f16(isa: Isa, src: &[f16], hi: &mut [u16], lo: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if avx512(isa) {
        // SAFETY: AVX-512F is present (`isa` is the proof).
        return unsafe { avx512::split_f16(src, hi, lo) };
    }
    split_f16_scalar(src, hi, lo)
}

/// f32 as BF16 `hi + lo`, each rounded to nearest: 16 significant bits.
fn split_f32(isa: Isa, src: &[f32], hi: &mut [u16], lo: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if avx512(isa) {
        // SAFETY: AVX-512F is present (`isa` is the proof).
        return unsafe { avx512::split_f32(src, hi, lo) };
    }
    split_f32_scalar(src, hi, lo)
}

fn split_f32_scalar(src: &[f32], hi: &mut [u16], lo: &mut [u16]) {
    for ((&v, h), l) in src.iter().zip(hi.iter_mut()).zip(lo.iter_mut()) {
        *h = bf16_bits(v);
        *l = bf16_bits(v - bf16_value(*h));
    }
}

/// F16 as BF16 `hi + lo`: `hi` is the F16 value truncated to BF16 (its top 8
/// significant bits), `lo` the rest, at most 3 significant bits, so both
/// conversions are exact.
fn split_f16_scalar(src: &[f16], hi: &mut [u16], lo: &mut [u16]) {
    for ((s, h), l) in src.iter().zip(hi.iter_mut()).zip(lo.iter_mut()) {
        let v = s.to_f32();
        *h = (v.to_bits() >> 16) as u16;
        *l = ((v - bf16_value(*h)).to_bits() >> 16) as u16;
    }
}

/// The micro-kernel: `C[j][m] (+)= Σ_k A[j] · B[m]` for row tiles j = 0, 1
/// (rows `a + 16j·a_stride` bytes) and token tiles m = 0, 1 (`b + m·b_tile`),
/// over `ksteps` 32-column steps, summing weight term i × activation term e
/// for `i + e < ACT_TERMS`. C starts from zero, or from `c` if `accumulate`,
/// and is stored into `c` (tile `2j + m`, 16 × 16 f32 each).
///
/// # Safety
/// Tiles configured on this thread; `a[i]` valid for 32 rows of `a_stride`
/// bytes × `ksteps` steps, `b` for two token tiles of `b_tile` elements.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[inline(never)]
unsafe fn kernel(
    a: [*const u16; 2],
    terms: usize,
    a_stride: usize,
    b: *const u16,
    b_tile: usize,
    ksteps: usize,
    accumulate: bool,
    c: &mut [f32],
) {
    use std::arch::asm;
    debug_assert!(c.len() >= C_BLOCK);
    let p = c.as_mut_ptr();
    let c_row = TILE * 4;
    if accumulate {
        asm!(
            "tileloadd tmm0, [{p0} + {s} * 1]",
            "tileloadd tmm1, [{p1} + {s} * 1]",
            "tileloadd tmm2, [{p2} + {s} * 1]",
            "tileloadd tmm3, [{p3} + {s} * 1]",
            p0 = in(reg) p,
            p1 = in(reg) p.add(TILE * TILE),
            p2 = in(reg) p.add(2 * TILE * TILE),
            p3 = in(reg) p.add(3 * TILE * TILE),
            s = in(reg) c_row,
            options(nostack, readonly)
        );
    } else {
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
    }
    let a_next = TILE * a_stride;
    let b_row = 2 * TILE * 2; // bytes per B tile row: 16 tokens × 2 bf16
    for ks in 0..ksteps {
        for (i, &ai) in a.iter().enumerate().take(terms) {
            let ap = ai.add(ks * KSTEP);
            asm!(
                "tileloadd tmm4, [{p} + {s} * 1]",
                "tileloadd tmm5, [{q} + {s} * 1]",
                p = in(reg) ap,
                q = in(reg) (ap as *const u8).add(a_next),
                s = in(reg) a_stride,
                options(nostack, readonly)
            );
            for e in 0..ACT_TERMS - i {
                let bp = b.add((ks * ACT_TERMS + e) * TILE_ELEMS);
                asm!(
                    // Both readers of tmm6 first: its next load can then
                    // overlap the two products that read tmm7 (tiles are
                    // not renamed, so a load waits for the last reader).
                    "tileloadd tmm6, [{p} + {s} * 1]",
                    "tileloadd tmm7, [{q} + {s} * 1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    p = in(reg) bp,
                    q = in(reg) bp.add(b_tile),
                    s = in(reg) b_row,
                    options(nostack, readonly)
                );
            }
        }
    }
    asm!(
        "tilestored [{p0} + {s} * 1], tmm0",
        "tilestored [{p1} + {s} * 1], tmm1",
        "tilestored [{p2} + {s} * 1], tmm2",
        "tilestored [{p3} + {s} * 1], tmm3",
        p0 = in(reg) p,
        p1 = in(reg) p.add(TILE * TILE),
        p2 = in(reg) p.add(2 * TILE * TILE),
        p3 = in(reg) p.add(3 * TILE * TILE),
        s = in(reg) c_row,
        options(nostack)
    );
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel(_: [*const u16; 2], _: usize, _: usize, _: *const u16, _: usize, _: usize, _: bool, _: &mut [f32]) {
    unreachable!("AMX is x86-64 only")
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{ACT_TERMS, KSTEP, TILE, TILE_ELEMS};
    use half::f16;
    use std::arch::x86_64::*;

    /// Sixteen f32 rounded to BF16 (ties to even), kept in the high halves.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn round_bf16(v: __m512) -> __m512i {
        let b = _mm512_castps_si512(v);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
        _mm512_and_si512(r, _mm512_set1_epi32(0xffff_0000u32 as i32))
    }

    /// The high 16 bits of sixteen 32-bit lanes (BF16 bits) to `dst[..16]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store_high_halves(dst: *mut u16, v: __m512i) {
        _mm256_storeu_si256(dst as *mut __m256i, _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(v)));
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn split_f32(src: &[f32], hi: &mut [u16], lo: &mut [u16]) {
        let n = src.len();
        let mut i = 0;
        while i + 16 <= n {
            let v = _mm512_loadu_ps(src.as_ptr().add(i));
            let h = round_bf16(v);
            let l = round_bf16(_mm512_sub_ps(v, _mm512_castsi512_ps(h)));
            store_high_halves(hi.as_mut_ptr().add(i), h);
            store_high_halves(lo.as_mut_ptr().add(i), l);
            i += 16;
        }
        super::split_f32_scalar(&src[i..], &mut hi[i..n], &mut lo[i..n]);
    }

    /// The `ACT_TERMS` BF16 terms of sixteen values (see `super::split`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn split_terms(v: __m512) -> [__m512i; ACT_TERMS] {
        let mut rest = v;
        let mut out = [_mm512_setzero_si512(); ACT_TERMS];
        for term in out.iter_mut() {
            *term = round_bf16(rest);
            rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(*term));
        }
        out
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn split_f16(src: &[f16], hi: &mut [u16], lo: &mut [u16]) {
        let n = src.len();
        let top = _mm512_set1_epi32(0xffff_0000u32 as i32);
        let mut i = 0;
        while i + 16 <= n {
            let v = _mm512_cvtph_ps(_mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i));
            let h = _mm512_and_si512(_mm512_castps_si512(v), top);
            let l = _mm512_castps_si512(_mm512_sub_ps(v, _mm512_castsi512_ps(h)));
            store_high_halves(hi.as_mut_ptr().add(i), h);
            store_high_halves(lo.as_mut_ptr().add(i), l);
            i += 16;
        }
        super::split_f16_scalar(&src[i..], &mut hi[i..n], &mut lo[i..n]);
    }

    /// Transposes a 16 × 16 matrix of 32-bit words held as 16 rows.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        // 4 × 4 blocks of words transposed within each 128-bit lane...
        let t: [__m512i; 16] = std::array::from_fn(|i| {
            let (a, b) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_epi32(a, b)
            } else {
                _mm512_unpackhi_epi32(a, b)
            }
        });
        // ...so that lane L of u[4i + j] holds rows 4i..4i+3 of column 4L + j.
        let u: [__m512i; 16] = std::array::from_fn(|i| {
            let (blk, j) = (i / 4 * 4, i % 4);
            let (a, c) = (t[blk + j / 2], t[blk + 2 + j / 2]);
            if j % 2 == 0 {
                _mm512_unpacklo_epi64(a, c)
            } else {
                _mm512_unpackhi_epi64(a, c)
            }
        });
        // Then the 128-bit lanes move into place.
        let v: [__m512i; 16] = std::array::from_fn(|i| {
            let (half, j) = (i / 8 * 8, i % 4);
            let (a, b) = (u[half + j], u[half + 4 + j]);
            if i % 8 < 4 {
                _mm512_shuffle_i32x4::<0x88>(a, b)
            } else {
                _mm512_shuffle_i32x4::<0xdd>(a, b)
            }
        });
        std::array::from_fn(|c| {
            let (l, j) = (c / 4, c % 4);
            // Lanes 0 and 2 came from the 0x88 shuffles, 1 and 3 from 0xdd.
            let (a, b) = if l % 2 == 0 { (v[j], v[8 + j]) } else { (v[4 + j], v[12 + j]) };
            if l < 2 {
                _mm512_shuffle_i32x4::<0x88>(a, b)
            } else {
                _mm512_shuffle_i32x4::<0xdd>(a, b)
            }
        })
    }

    /// One tile of tokens (`rows`: up to 16 rows of `cols`, the rest zero)
    /// into `dst`: per 32-column step and term, the column pairs (2r, 2r+1)
    /// of token n become the 32-bit word at row r, column n.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pack_tile(rows: &[f32], cols: usize, dst: &mut [u16]) {
        let valid = rows.len() / cols;
        debug_assert!(valid <= TILE && cols.is_multiple_of(KSTEP));
        debug_assert!(dst.len() >= cols / KSTEP * ACT_TERMS * TILE_ELEMS);
        for ks in 0..cols / KSTEP {
            let mut words = [[_mm512_setzero_si512(); TILE]; ACT_TERMS];
            for n in 0..valid {
                let p = rows.as_ptr().add(n * cols + ks * KSTEP);
                let (a, b) = (split_terms(_mm512_loadu_ps(p)), split_terms(_mm512_loadu_ps(p.add(16))));
                for (term, w) in words.iter_mut().enumerate() {
                    // BF16 of columns 0..16 then 16..32, in order: word r
                    // is the pair (2r, 2r+1), low half first.
                    let (lo, hi) = (_mm512_srli_epi32::<16>(a[term]), _mm512_srli_epi32::<16>(b[term]));
                    w[n] = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)),
                        _mm512_cvtepi32_epi16(hi),
                    );
                }
            }
            for (term, w) in words.into_iter().enumerate() {
                let out = dst.as_mut_ptr().add((ks * ACT_TERMS + term) * TILE_ELEMS) as *mut __m512i;
                for (r, row) in transpose16(w).into_iter().enumerate() {
                    _mm512_storeu_si512(out.add(r), row);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn rounding_matches_half() {
        let mut s = 0x1234_5678u32;
        for _ in 0..100_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let x = f32::from_bits(s & 0x7f7f_ffff | (s & 0x8000_0000));
            if x.is_finite() {
                assert_eq!(bf16_bits(x), bf16::from_f32(x).to_bits(), "{x}");
            }
        }
    }

    #[test]
    fn split_is_near_exact() {
        for i in 0..10_000 {
            let x = ((i as f32) * 0.7361).sin() * 10f32.powi(i % 9 - 4);
            let sum: f64 = split(x).iter().map(|&b| bf16_value(b) as f64).sum();
            assert!((sum - x as f64).abs() <= x.abs() as f64 * 2f64.powi(-24), "{x}");
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn simd_packing_equals_the_reference() {
        if Isa::get(Tier::Avx512).is_none() {
            return;
        }
        let cols = 96;
        let x = crate::testutil::synth(16 * cols, 5);
        for valid in [0, 1, 7, 16] {
            let per_tile = cols / KSTEP * ACT_TERMS * TILE_ELEMS;
            let (mut want, mut got) = (vec![0u16; per_tile], vec![7u16; per_tile]);
            pack_tile_scalar(&x[..valid * cols], cols, &mut want);
            unsafe { avx512::pack_tile(&x[..valid * cols], cols, &mut got) };
            assert_eq!(got, want, "{valid} tokens");
        }
    }

    #[test]
    fn f16_splits_exactly() {
        let src: Vec<f16> = (0..1000).map(|i| f16::from_f32(((i as f32) * 0.37).cos() * 3.0)).collect();
        let (mut hs, mut ls) = (vec![0; 1000], vec![0; 1000]);
        split_f16_scalar(&src, &mut hs, &mut ls);
        let (mut hi, mut lo) = (vec![0; 1000], vec![0; 1000]);
        for isa in Isa::supported() {
            split_f16(isa, &src, &mut hi, &mut lo);
            assert_eq!((&hi, &lo), (&hs, &ls), "{isa:?}");
        }
        for i in 0..1000 {
            assert_eq!(bf16_value(hi[i]) + bf16_value(lo[i]), src[i].to_f32());
        }
    }
}
