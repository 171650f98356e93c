//! Prefill products over BF16 weights at BF16 speed, for
//! [`Precision::Fast`](crate::matmul::Precision::Fast) on the AVX512-BF16 tier.
//!
//! `vdpbf16ps` multiplies 32 BF16 pairs and adds them into 16 f32 lanes (two
//! products per lane): twice the multiply-adds of an f32 FMA per
//! instruction. BF16 weights are BF16 already; the activations are rounded
//! once per product to one or two BF16 terms ([`FAST_TERMS`] at fast
//! precision), `x ≈ x0 + x1`, each term the
//! remainder so far rounded to nearest-even (one term keeps 8 significant
//! bits, two keep 16). Products of BF16 numbers are exact in f32 and are
//! accumulated in f32, so the rounding of `x` is the only loss: what the
//! precision policy in ARCHITECTURE.md measures.
//!
//! **Layout** (a GEMM in the BLIS style, vectorised over weight rows). Each
//! thread packs [`PANEL`] = 32 weight rows at a time into a panel of column
//! pairs (`panel[p][r]` = row `r`'s columns `2p, 2p+1` as one 32-bit word:
//! the pair `vdpbf16ps` multiplies in one lane), then runs a 32-row ×
//! (up to) 12-token micro-kernel over every token: per column pair, two
//! panel loads, one broadcast per token and term, and `2 · 12 · terms`
//! `vdpbf16ps` into 24 accumulators that hold outputs, so there are no
//! horizontal sums and each tile is stored as rows of 16 floats. The panel
//! (32 × cols × 2 bytes, 311 KB for down_proj) stays in L2 while all tokens
//! pass; the activations stream from L2/L3, each 32-bit word serving 64
//! multiply-adds.
//!
//! The reference twin ([`matmul_reference`]) computes the same sums one
//! product at a time, in f32, from the same rounded terms.

use crate::cpu::{Isa, Tier};
use crate::matmul::Out;
use crate::pool::ThreadPool;
use half::bf16;
use std::cell::RefCell;

/// Most BF16 terms per activation: one keeps 8 significant bits, two 16
/// (within 2⁻¹⁶ of f32), at twice the instructions.
pub const MAX_TERMS: usize = 2;
/// BF16 terms per activation at [`Precision::Fast`](crate::matmul::Precision).
pub const FAST_TERMS: usize = 1;
/// Weight rows per panel: two 16-lane registers.
pub const PANEL: usize = 32;
/// Most tokens per micro-kernel call: 2 × 12 accumulators of 32 registers.
const NR: usize = 12;

/// `x` rounded to the nearest BF16 (ties to even), as bits. Finite inputs.
#[inline]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// A BF16 value from its bits, as f32 (exact).
#[inline]
pub fn bf16_value(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// `x` as `N` BF16 terms, largest first: each term is what the earlier ones
/// left over, rounded to BF16.
#[inline]
pub fn terms<const N: usize>(x: f32) -> [u16; N] {
    let mut rest = x;
    std::array::from_fn(|_| {
        let b = bf16_bits(rest);
        rest -= bf16_value(b);
        b
    })
}

/// Activations `X (T, cols)` rounded for the kernel: for each token, `terms`
/// rows of `pairs` words, word `p` of term row `k` holding term `k` of
/// columns `2p` (low half) and `2p + 1` (high half; zero past an odd `cols`).
pub struct Acts<'a> {
    words: &'a [u32],
    tokens: usize,
    pairs: usize,
    terms: usize,
}

impl Acts<'_> {
    fn token(&self, t: usize) -> &[u32] {
        let n = self.pairs * self.terms;
        &self.words[t * n..(t + 1) * n]
    }

    /// BF16 terms per activation.
    pub fn terms(&self) -> usize {
        self.terms
    }
}

/// Whether the fast BF16 kernels can run on `isa`: the tiers with
/// `vdpbf16ps`, by name.
pub fn available(isa: Isa) -> bool {
    match isa.tier() {
        Tier::Scalar | Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni => false,
        Tier::Avx512Bf16 | Tier::Amx => cfg!(target_arch = "x86_64"),
    }
}

/// Whether the f32 kernel over the same panels ([`matmul_rows_f32`]) can
/// run on `isa`: every x86 tier (a 256-bit kernel on `avx2` and `avxvnni`,
/// a 512-bit one on the AVX-512 tiers), by name.
pub fn f32_available(isa: Isa) -> bool {
    match isa.tier() {
        Tier::Scalar => false,
        Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
            cfg!(target_arch = "x86_64")
        }
    }
}

/// Whether `isa` runs the 512-bit forms of this module's kernels (else the
/// 256-bit ones), by name.
fn wide(isa: Isa) -> bool {
    match isa.tier() {
        Tier::Scalar | Tier::Avx2 | Tier::AvxVnni => false,
        Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => true,
    }
}

/// Whether [`matmul_rows_f32`] takes products with `cols` columns: whole
/// column pairs (each token's pair is read as two floats).
pub fn f32_handles(cols: usize) -> bool {
    cols.is_multiple_of(2)
}

/// Activation bytes a block of tokens may take, so that it stays in L2
/// (2 MB per core on the Xeons measured, 1 MB on Zen 4) beside the panel.
/// (On Zen 3, 512 KB of L2, half of it measured slower, pp512 141-145
/// against 147-150 tok/s, and twice it the same.)
const TOKEN_BLOCK_BYTES: usize = 768 * 1024;

/// Tokens per block for activations of `bytes_per_token`: as many as fit
/// [`TOKEN_BLOCK_BYTES`], in whole micro-kernel calls, at least one call.
/// Every panel meets a block's tokens while they are in L2, and is packed
/// once per block (cheap: one pass over 32 rows against `NR · calls`
/// multiply-adds per weight).
fn token_block(bytes_per_token: usize) -> usize {
    (TOKEN_BLOCK_BYTES / bytes_per_token.max(1) / NR).max(1) * NR
}

/// Whether `vdpbf16ps` multiplies faster than the f32 FMA on this CPU, which
/// differs by microarchitecture, not by feature flags: on Zen 4 it does
/// twice the FMA's multiply-adds, on a Sapphire/Emerald Rapids Xeon
/// measured here half (1.3 G instructions/s against 5.4 G FMAs/s per core),
/// where the exact f32 kernels are the faster ones. Measured once per
/// process (about a millisecond, best of five), with a 1.2× margin;
/// `EMBER_BF16_DOT=on|off` decides instead (the quality of the fast BF16
/// path can then be measured on any CPU that has the instruction).
pub fn pays_off() -> bool {
    static PAYS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PAYS.get_or_init(|| match std::env::var("EMBER_BF16_DOT").as_deref() {
        Ok("on") => true,
        Ok("off") => false,
        _ => measure_pays_off(),
    })
}

fn measure_pays_off() -> bool {
    #[cfg(target_arch = "x86_64")]
    if Isa::supported().into_iter().any(available) {
        let best = |f: unsafe fn(usize) -> f32| {
            (0..5)
                .map(|_| {
                    let start = std::time::Instant::now();
                    // SAFETY: AVX-512F and AVX512-BF16 are present (a tier that
                    // has them was detected).
                    std::hint::black_box(unsafe { f(20_000) });
                    start.elapsed()
                })
                .min()
                .unwrap_or_default()
        };
        // Each loop does 12 × 20 000 instructions: 16 multiply-adds per
        // FMA, 32 per `vdpbf16ps`.
        let (fma, dot) = (best(avx512::fma_loop), best(avx512::dpbf16_loop));
        return 32.0 / dot.as_secs_f64() > 1.2 * 16.0 / fma.as_secs_f64();
    }
    false
}

/// Rounds one token's activations `x (cols,)` into `dst (terms · pairs,)`.
fn round_token(isa: Isa, x: &[f32], dst: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if available(isa) {
        // SAFETY: the tier has AVX-512F and AVX512-BF16 (`isa` is the proof).
        return unsafe { avx512::round_token(x, dst) };
    }
    let _ = isa;
    round_token_reference(x, dst)
}

/// The reference for the SIMD rounding: [`terms`] per value.
fn round_token_reference(x: &[f32], dst: &mut [u32]) {
    round_pairs(x, dst, 0);
}

/// Column pairs `from..` of one token rounded into `dst (terms · pairs,)`,
/// value by value (the reference, and the SIMD kernel's ragged end).
fn round_pairs(x: &[f32], dst: &mut [u32], from: usize) {
    let pairs = x.len().div_ceil(2);
    let n = dst.len() / pairs;
    assert!(dst.len() == n * pairs && (1..=MAX_TERMS).contains(&n));
    for p in from..pairs {
        let lo = terms::<MAX_TERMS>(x[2 * p]);
        let hi = x.get(2 * p + 1).map_or([0; MAX_TERMS], |&v| terms::<MAX_TERMS>(v));
        for k in 0..n {
            dst[k * pairs + p] = lo[k] as u32 | (hi[k] as u32) << 16;
        }
    }
}

/// Rounds `x (T, cols)` to `terms` BF16 terms (1 or 2) into `buf`,
/// spreading tokens over `pool` (or on the calling thread without one), and
/// returns the kernel's view.
pub fn prepare<'b>(
    isa: Isa,
    pool: Option<&ThreadPool>,
    x: &[f32],
    cols: usize,
    terms: usize,
    buf: &'b mut Vec<u32>,
) -> Acts<'b> {
    let t = x.len() / cols;
    assert_eq!(x.len(), t * cols, "x is (T, cols)");
    assert!((1..=MAX_TERMS).contains(&terms), "1 or 2 BF16 terms");
    let pairs = cols.div_ceil(2);
    let per = pairs * terms;
    buf.resize(t * per, 0);
    crate::pool::fill_shares(pool, &mut buf[..], t, |tokens, dst| {
        for (i, d) in tokens.zip(dst.chunks_exact_mut(per)) {
            round_token(isa, &x[i * cols..(i + 1) * cols], d);
        }
    });
    Acts { words: &buf[..], tokens: t, pairs, terms }
}

/// One cache line of a panel (here and in [`crate::gemm_int8`]).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line(pub(crate) [u32; 16]);

thread_local! {
    /// Each thread's packed panel, reused across calls.
    static PANEL_BUF: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// Packs rows `rows` (at most [`PANEL`]) of `w (rows, cols)` into `panel`:
/// two lines per column pair, rows past the end zero. 16 whole rows × 16
/// pairs at a time are a 16 × 16 word transpose in registers.
fn pack_panel(isa: Isa, w: &[bf16], cols: usize, rows: std::ops::Range<usize>, panel: &mut [Line]) {
    let pairs = cols.div_ceil(2);
    debug_assert!(rows.len() <= PANEL && panel.len() == 2 * pairs);
    let mut done = [0usize; 2]; // pairs packed by SIMD, per line
    #[cfg(target_arch = "x86_64")]
    if f32_available(isa) && cols.is_multiple_of(2) {
        for (line, d) in done.iter_mut().enumerate() {
            let first = rows.start + 16 * line;
            if first + 16 <= rows.end {
                let src = w[first * cols..].as_ptr() as *const u32;
                if wide(isa) {
                    *d = pairs / 16 * 16;
                    // SAFETY: AVX-512F is present (`wide`); rows
                    // `first..first + 16` exist and have `pairs` words each.
                    unsafe { avx512::pack_line(src, pairs, *d, panel, line) };
                } else {
                    *d = pairs / 8 * 8;
                    // SAFETY: AVX2 is present (`f32_available`); as above.
                    unsafe { avx2::pack_line(src, pairs, *d, panel, line) };
                }
            }
        }
    }
    let _ = isa;
    for (i, r) in rows.clone().enumerate() {
        let row = &w[r * cols..(r + 1) * cols];
        let (line, lane) = (i / 16, i % 16);
        for p in done[line]..pairs {
            let lo = row[2 * p].to_bits() as u32;
            let hi = row.get(2 * p + 1).map_or(0, |v| v.to_bits() as u32);
            panel[2 * p + line].0[lane] = lo | hi << 16;
        }
    }
    for i in rows.len()..PANEL {
        let (line, lane) = (i / 16, i % 16);
        for p in 0..pairs {
            panel[2 * p + line].0[lane] = 0;
        }
    }
}

/// One micro-kernel call's work: tokens `t0..t0 + n` against the packed
/// rows `r0..r1`, and the raw bytes of the next panel to prefetch meanwhile.
struct Tile<'p> {
    panel: &'p [Line],
    r0: usize,
    r1: usize,
    t0: usize,
    n: usize,
    ahead: &'p [u8],
}

/// Runs `tile` for every panel of `rows` and every call of at most [`NR`]
/// tokens, tokens in blocks of `block` (the outer loop), each panel packed
/// once per block. The first call on each panel prefetches the next
/// panel's weights into L2 as it goes, so that reading them from memory
/// overlaps this panel's arithmetic (for a few tokens, one call is all the
/// arithmetic a panel gets).
fn for_each_tile(
    isa: Isa,
    w: &[bf16],
    cols: usize,
    rows: std::ops::Range<usize>,
    tokens: usize,
    block: usize,
    mut tile: impl FnMut(Tile),
) {
    let pairs = cols.div_ceil(2);
    let bytes: &[u8] = bytemuck::cast_slice(w);
    PANEL_BUF.with(|buf| {
        let mut panel = buf.borrow_mut();
        panel.resize(2 * pairs, Line([0; 16]));
        for tb in (0..tokens).step_by(block) {
            let te = (tb + block).min(tokens);
            for r0 in rows.clone().step_by(PANEL) {
                let r1 = (r0 + PANEL).min(rows.end);
                pack_panel(isa, w, cols, r0..r1, &mut panel);
                let next = &bytes[r1 * cols * 2..(r1 + PANEL).min(rows.end) * cols * 2];
                for t0 in (tb..te).step_by(NR) {
                    let ahead = if t0 == tb { next } else { &[] };
                    tile(Tile { panel: &panel, r0, r1, t0, n: NR.min(te - t0), ahead });
                }
            }
        }
    });
}

/// Rows `rows` of `Y = X @ Wᵀ` on the calling thread, `w (·, cols)` BF16,
/// `x` from [`prepare`]. Writes `y[t][r]` for `r` in `rows`, every token.
pub fn matmul_rows(isa: Isa, w: &[bf16], cols: usize, rows: std::ops::Range<usize>, x: &Acts, out: &Out) {
    assert!(available(isa), "the fast BF16 kernels need the AVX512-BF16 tier");
    assert!(x.pairs == cols.div_ceil(2) && rows.end * cols <= w.len());
    let pairs = x.pairs;
    let block = token_block(4 * pairs * x.terms);
    for_each_tile(isa, w, cols, rows, x.tokens, block, |Tile { panel, r0, r1, t0, n, ahead }| {
        let y_end = (t0 + n - 1) * out.stride + r1;
        // SAFETY: this thread owns columns `rows` of every output row, and
        // the kernel writes only the `valid` lanes at `r0..r1` of rows
        // `t0..t0 + n`.
        let y = unsafe { out.data.ptr(t0 * out.stride + r0, y_end) };
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F and AVX512-BF16 are present (`available`); the
        // panel holds `pairs` pairs of 32 rows, the activations `n` tokens
        // from `t0`, and `y` reaches the last lane written.
        unsafe {
            avx512::tile(
                n,
                x.terms,
                panel.as_ptr() as *const u32,
                pairs,
                &x.words[t0 * pairs * x.terms..],
                y,
                out.stride,
                row_masks(r1 - r0),
                ahead,
            )
        };
    })
}

/// Rows `rows` of `Y = X @ Wᵀ` on the calling thread in f32, `w (·, cols)`
/// BF16 packed into the same panels, `x (T, cols)` f32 as it is: the exact
/// precision's product on every x86 tier, and the fast one where
/// `vdpbf16ps` is missing or does not pay off.
///
/// Per column pair the 512-bit kernel widens the panel's two lines into four
/// 16-row vectors of f32 (a shift and a mask: BF16 is f32's upper half),
/// then each token's two activations, broadcast, meet them in 4 FMAs: 48
/// FMAs per 2 loads and 4 integer operations, 24 accumulators holding
/// outputs, so no horizontal sums. The 256-bit kernel (16 registers) takes
/// one line (16 rows) and 6 tokens at a time: per pair, the line's even
/// columns widened into two 8-row vectors meet 6 broadcasts in 12 FMAs,
/// then its odd columns in 12 more, 12 accumulators holding outputs. Each
/// output is summed over its columns in order, in f32 with fused
/// multiply-adds, so both kernels give the reference's bits.
pub fn matmul_rows_f32(isa: Isa, w: &[bf16], cols: usize, rows: std::ops::Range<usize>, x: &[f32], out: &Out) {
    assert!(f32_available(isa), "the f32 panel kernel needs an AVX-512 tier");
    assert!(f32_handles(cols) && rows.end * cols <= w.len() && x.len().is_multiple_of(cols.max(1)));
    let tokens = x.len() / cols.max(1);
    let pairs = cols / 2;
    for_each_tile(isa, w, cols, rows, tokens, token_block(4 * cols), |Tile { panel, r0, r1, t0, n, ahead }| {
        // SAFETY: as in `matmul_rows`.
        let y = unsafe { out.data.ptr(t0 * out.stride + r0, (t0 + n - 1) * out.stride + r1) };
        let (p, xs) = (panel.as_ptr() as *const u32, &x[t0 * cols..(t0 + n) * cols]);
        #[cfg(target_arch = "x86_64")]
        if wide(isa) {
            // SAFETY: AVX-512F is present (`wide`); the panel holds `pairs`
            // pairs of 32 rows, `x` `n` tokens of `cols` from `t0`, and `y`
            // reaches the last lane written.
            unsafe { avx512::tile_f32(n, p, pairs, xs, y, out.stride, row_masks(r1 - r0), ahead) };
        } else {
            // SAFETY: AVX2 and FMA are present (`f32_available`); as above.
            unsafe { avx2::tile_f32(n, p, pairs, xs, y, out.stride, r1 - r0, ahead) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (p, xs, y, ahead);
    })
}

/// The reference for [`matmul_rows_f32`]: each output summed over its
/// columns in order with fused multiply-adds. `w (rows, cols)`, `x (T, cols)`,
/// `y (T, rows)`.
pub fn matmul_f32_reference(w: &[bf16], cols: usize, x: &[f32], y: &mut [f32]) {
    let rows = w.len() / cols;
    let t = x.len() / cols;
    assert_eq!(y.len(), t * rows);
    for i in 0..t {
        for r in 0..rows {
            let xs = &x[i * cols..(i + 1) * cols];
            y[i * rows + r] =
                w[r * cols..(r + 1) * cols].iter().zip(xs).fold(0.0f32, |s, (wk, xk)| wk.to_f32().mul_add(*xk, s));
        }
    }
}

/// The store masks of a panel's two lines when `valid` rows are real.
pub(crate) fn row_masks(valid: usize) -> [u16; 2] {
    [mask(valid.min(16)), mask(valid.saturating_sub(16))]
}

/// The store mask of the first `n` (≤ 16) lanes.
pub(crate) fn mask(n: usize) -> u16 {
    ((1u32 << n) - 1) as u16
}

/// The reference: `y[t][r] = Σ_k w[r][k] · Σ_term x_term[t][k]`, one
/// product at a time in f32, from the same rounded activations.
/// `w (rows, cols)`, `y (T, rows)`.
pub fn matmul_reference(w: &[bf16], cols: usize, x: &Acts, y: &mut [f32]) {
    let rows = w.len() / cols;
    assert_eq!(y.len(), x.tokens * rows);
    for t in 0..x.tokens {
        let xt = x.token(t);
        for r in 0..rows {
            let row = &w[r * cols..(r + 1) * cols];
            let mut s = 0.0f32;
            for (k, wk) in row.iter().enumerate() {
                for term in 0..x.terms {
                    let word = xt[term * x.pairs + k / 2];
                    let bits = if k % 2 == 0 { word as u16 } else { (word >> 16) as u16 };
                    s += wk.to_f32() * bf16_value(bits);
                }
            }
            y[t * rows + r] = s;
        }
    }
}

/// At column pair `p` of a panel (32 rows: 128 bytes of BF16), the same
/// share of the next panel's bytes, into L2 (both kernels' prefetch).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(ahead: &[u8], p: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    if let Some(line) = ahead.get(128 * p..) {
        // SAFETY: a prefetch never faults; SSE is baseline on x86-64.
        unsafe {
            _mm_prefetch::<_MM_HINT_T1>(line.as_ptr() as *const i8);
            _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().wrapping_add(64) as *const i8);
        }
    }
}

/// The 256-bit kernels over the same panels: a line (16 rows of a column
/// pair, 64 bytes) is two 8-lane registers.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{prefetch_ahead, NR};
    use std::arch::x86_64::*;

    /// Most tokens per call of the 16-row kernel: 2 × 6 accumulators, the
    /// two widened weight registers, the broadcast and the mask make 16.
    const NR16: usize = 6;

    #[cfg(test)]
    pub fn transpose_for_test(r: [[u32; 8]; 8]) -> [[u32; 8]; 8] {
        // SAFETY: only called when AVX2 is present.
        unsafe {
            let v = transpose8(std::array::from_fn(|i| std::mem::transmute::<[u32; 8], __m256i>(r[i])));
            v.map(|x| std::mem::transmute::<__m256i, [u32; 8]>(x))
        }
    }

    /// Packs line `line` (rows 16·line..) of a panel from 16 whole rows at
    /// `w` (`pairs` words apart), pairs `0..upto` (a multiple of 8): 8 rows
    /// × 8 pairs at a time, an 8 × 8 word transpose.
    ///
    /// # Safety
    /// AVX2; 16 rows of `pairs` words at `w`; `panel` of `2 · pairs` lines.
    #[target_feature(enable = "avx2")]
    pub unsafe fn pack_line(w: *const u32, pairs: usize, upto: usize, panel: &mut [super::Line], line: usize) {
        debug_assert!(upto.is_multiple_of(8) && upto <= pairs && panel.len() >= 2 * pairs);
        for p0 in (0..upto).step_by(8) {
            for half in 0..2 {
                let r: [__m256i; 8] =
                    std::array::from_fn(|i| _mm256_loadu_si256(w.add((8 * half + i) * pairs + p0) as *const __m256i));
                for (j, v) in transpose8(r).iter().enumerate() {
                    let dst = (panel.as_mut_ptr().add(2 * (p0 + j) + line) as *mut u32).add(8 * half);
                    _mm256_store_si256(dst as *mut __m256i, *v);
                }
            }
        }
    }

    /// An 8 × 8 transpose of 32-bit words: `out[j]` lane `i` = `r[i]` lane
    /// `j`. Words, then pairs of words, are interleaved within 128-bit
    /// lanes; then the 128-bit halves are exchanged.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn transpose8(r: [__m256i; 8]) -> [__m256i; 8] {
        let t: [__m256i; 8] = std::array::from_fn(|i| {
            let (a, b) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm256_unpacklo_epi32(a, b)
            } else {
                _mm256_unpackhi_epi32(a, b)
            }
        });
        // u[4k + c], 128-bit half h: rows 4k..4k+4 of column 4h + c.
        let u: [__m256i; 8] = std::array::from_fn(|i| {
            let (k, c) = (i / 4, i % 4);
            let (a, b) = (t[4 * k + c / 2], t[4 * k + 2 + c / 2]);
            if c % 2 == 0 {
                _mm256_unpacklo_epi64(a, b)
            } else {
                _mm256_unpackhi_epi64(a, b)
            }
        });
        std::array::from_fn(|j| {
            let (a, b) = (u[j % 4], u[4 + j % 4]);
            if j < 4 {
                _mm256_permute2x128_si256::<0x20>(a, b)
            } else {
                _mm256_permute2x128_si256::<0x31>(a, b)
            }
        })
    }

    /// The f32 micro-kernel for `n ≤ NR` tokens of `x` (`2 · pairs` floats
    /// each) against a 32-row panel: `y[j][0..valid] = panel · x[j]`, one
    /// line (16 rows) and up to 6 tokens per pass over the panel.
    ///
    /// # Safety
    /// AVX2 and FMA; `panel` holds `pairs` × 32 words, `x` `n` tokens, `y`
    /// rows `j · y_stride` up to lane `valid ≤ 32`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile_f32(
        n: usize,
        panel: *const u32,
        pairs: usize,
        x: &[f32],
        y: *mut f32,
        y_stride: usize,
        valid: usize,
        ahead: &[u8],
    ) {
        macro_rules! by_n {
            ($m:expr, $line:expr, $x:expr, $y:expr, $stride:expr, $ahead:expr; $($n:literal)*) => {
                match $m {
                    $($n => tile16_n::<$n>(panel.add(16 * $line), pairs, $x, $y, $stride, $ahead),)*
                    _ => unreachable!("1..=6 tokens"),
                }
            };
        }
        debug_assert!((1..=NR).contains(&n) && x.len() == n * 2 * pairs && valid <= 32);
        let cols = 2 * pairs;
        // Passes of equal size (8 tokens: 4 + 4, not 6 + 2): a pass of few
        // tokens is bound by its loads, not its FMAs.
        let passes = n.div_ceil(NR16);
        let mut ahead = ahead;
        for line in 0..valid.div_ceil(16) {
            let rows = (valid - 16 * line).min(16);
            for pass in 0..passes {
                let (j0, j1) = (pass * n / passes, (pass + 1) * n / passes);
                let m = j1 - j0;
                let xs = x.as_ptr().add(j0 * cols);
                let mut buf = [[0.0f32; 16]; NR16];
                let (dst, stride) = if rows == 16 {
                    (y.add(j0 * y_stride + 16 * line), y_stride)
                } else {
                    (buf.as_mut_ptr() as *mut f32, 16)
                };
                by_n!(m, line, xs, dst, stride, ahead; 1 2 3 4 5 6);
                // Only the first pass fetches the next panel. (Spread over
                // every pass, with a counter in the loop, pp512 fell from
                // 186 to 147 tok/s on Zen 3.)
                ahead = &[];
                if rows < 16 {
                    for (j, b) in buf.iter().enumerate().take(m) {
                        std::ptr::copy_nonoverlapping(b.as_ptr(), y.add((j0 + j) * y_stride + 16 * line), rows);
                    }
                }
            }
        }
    }

    /// One line (16 rows at `line`, 32 words apart per pair) against `N`
    /// tokens: `y[j][0..16] = line · x[j]`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile16_n<const N: usize>(
        line: *const u32,
        pairs: usize,
        x: *const f32,
        y: *mut f32,
        y_stride: usize,
        ahead: &[u8],
    ) {
        let cols = 2 * pairs;
        let high = _mm256_set1_epi32(0xffff_0000u32 as i32);
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for p in 0..pairs {
            prefetch_ahead(ahead, p);
            let l = line.add(p * 32) as *const __m256i;
            // Column 2p is each word's low half, 2p + 1 its high half.
            let even = [
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_load_si256(l))),
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_load_si256(l.add(1)))),
            ];
            for (j, a) in acc.iter_mut().enumerate() {
                let x0 = _mm256_broadcast_ss(&*x.add(j * cols + 2 * p));
                a[0] = _mm256_fmadd_ps(even[0], x0, a[0]);
                a[1] = _mm256_fmadd_ps(even[1], x0, a[1]);
            }
            // The line is loaded again, not kept: 12 accumulators, two
            // weight vectors, the broadcast and the mask fill the 16
            // registers, and a kept copy made the compiler spill both
            // vectors to the stack every pair (`read_volatile` keeps it
            // from merging the loads; ~10% on one thread at 6 tokens).
            let odd = [
                _mm256_castsi256_ps(_mm256_and_si256(std::ptr::read_volatile(l), high)),
                _mm256_castsi256_ps(_mm256_and_si256(std::ptr::read_volatile(l.add(1)), high)),
            ];
            for (j, a) in acc.iter_mut().enumerate() {
                let x1 = _mm256_broadcast_ss(&*x.add(j * cols + 2 * p + 1));
                a[0] = _mm256_fmadd_ps(odd[0], x1, a[0]);
                a[1] = _mm256_fmadd_ps(odd[1], x1, a[1]);
            }
        }
        for (j, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(y.add(j * y_stride), a[0]);
            _mm256_storeu_ps(y.add(j * y_stride + 8), a[1]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{prefetch_ahead, MAX_TERMS, NR};
    use std::arch::x86_64::*;

    #[cfg(test)]
    pub fn transpose_for_test(r: [[u32; 16]; 16]) -> [[u32; 16]; 16] {
        // SAFETY: only called when AVX-512F is present.
        unsafe {
            let v = transpose16(std::array::from_fn(|i| std::mem::transmute::<[u32; 16], __m512i>(r[i])));
            v.map(|x| std::mem::transmute::<__m512i, [u32; 16]>(x))
        }
    }

    /// One token's activations: 16 values at a time rounded to BF16 terms
    /// by `vcvtneps2bf16` (nearest-even, as [`super::bf16_bits`]), then
    /// interleaved into (column pair, term) words.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn round_token(x: &[f32], dst: &mut [u32]) {
        let cols = x.len();
        let pairs = cols.div_ceil(2);
        let n = dst.len() / pairs;
        assert!(dst.len() == n * pairs && (1..=MAX_TERMS).contains(&n));
        let mut k = 0;
        while k + 16 <= cols {
            let mut rest = _mm512_loadu_ps(x.as_ptr().add(k));
            for term in 0..n {
                let bits: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(rest));
                rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits))));
                _mm256_storeu_si256(dst.as_mut_ptr().add(term * pairs + k / 2) as *mut __m256i, bits);
            }
            k += 16;
        }
        // The ragged end (cols not a multiple of 16), as the reference does.
        super::round_pairs(x, dst, k / 2);
    }

    /// `n` rounds of 12 independent FMAs, for [`super::pays_off`].
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_loop(n: usize) -> f32 {
        let (x, y) = (_mm512_set1_ps(std::hint::black_box(1.0001)), _mm512_set1_ps(0.9999));
        let mut a = [_mm512_setzero_ps(); 12];
        for _ in 0..n {
            for v in a.iter_mut() {
                *v = _mm512_fmadd_ps(x, y, *v);
            }
        }
        a.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }

    /// `n` rounds of 12 independent `vdpbf16ps`, for [`super::pays_off`].
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dpbf16_loop(n: usize) -> f32 {
        let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(std::hint::black_box(0x3f80_3f80)));
        let mut a = [_mm512_setzero_ps(); 12];
        for _ in 0..n {
            for v in a.iter_mut() {
                *v = _mm512_dpbf16_ps(*v, x, x);
            }
        }
        a.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }

    /// Packs line `line` (rows 16·line..) of a panel from 16 whole rows at
    /// `w` (`pairs` words apart), pairs `0..upto` (a multiple of 16).
    ///
    /// # Safety
    /// AVX-512F; 16 rows of `pairs` words at `w`; `panel` of `2 · pairs` lines.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pack_line(w: *const u32, pairs: usize, upto: usize, panel: &mut [super::Line], line: usize) {
        debug_assert!(upto.is_multiple_of(16) && upto <= pairs && panel.len() >= 2 * pairs);
        for p0 in (0..upto).step_by(16) {
            let r: [__m512i; 16] = std::array::from_fn(|i| _mm512_loadu_si512(w.add(i * pairs + p0) as *const _));
            let out = transpose16(r);
            for (j, v) in out.iter().enumerate() {
                _mm512_store_si512(panel.as_mut_ptr().add(2 * (p0 + j) + line) as *mut _, *v);
            }
        }
    }

    /// A 16 × 16 transpose of 32-bit words: `out[j]` lane `i` = `r[i]` lane
    /// `j`. Words, then pairs of words, are interleaved within 128-bit lanes;
    /// then a 4 × 4 transpose of the 128-bit lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        let mut t = [_mm512_setzero_si512(); 16];
        for k in 0..8 {
            t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
            t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
        }
        // u[4k + c], 128-bit lane l: rows 4k..4k+4 of column 4l + c.
        let mut u = [_mm512_setzero_si512(); 16];
        for k in 0..4 {
            u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
            u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
            u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
            u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
        }
        let mut out = [_mm512_setzero_si512(); 16];
        for c in 0..4 {
            let (a, b, cc, d) = (u[c], u[4 + c], u[8 + c], u[12 + c]);
            let v0 = _mm512_shuffle_i32x4::<0x44>(a, b); // a0 a1 b0 b1
            let v1 = _mm512_shuffle_i32x4::<0xEE>(a, b); // a2 a3 b2 b3
            let v2 = _mm512_shuffle_i32x4::<0x44>(cc, d);
            let v3 = _mm512_shuffle_i32x4::<0xEE>(cc, d);
            out[c] = _mm512_shuffle_i32x4::<0x88>(v0, v2); // a0 b0 c0 d0
            out[4 + c] = _mm512_shuffle_i32x4::<0xDD>(v0, v2);
            out[8 + c] = _mm512_shuffle_i32x4::<0x88>(v1, v3);
            out[12 + c] = _mm512_shuffle_i32x4::<0xDD>(v1, v3);
        }
        out
    }

    /// The micro-kernel for `n ≤ 12` tokens and `terms` BF16 terms:
    /// `y[j][0..32] (masked) = panel · x[j]`.
    ///
    /// # Safety
    /// AVX-512F and AVX512-BF16; `panel` holds `pairs` × 32 words, `x` `n`
    /// tokens of `terms · pairs` words from its start, `y` rows `j · y_stride`
    /// up to the last unmasked lane.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn tile(
        n: usize,
        terms: usize,
        panel: *const u32,
        pairs: usize,
        x: &[u32],
        y: *mut f32,
        y_stride: usize,
        masks: [u16; 2],
        ahead: &[u8],
    ) {
        macro_rules! by_n {
            ($t:literal; $($n:literal)*) => {
                match n {
                    $($n => tile_n::<$n, $t>(panel, pairs, x.as_ptr(), y, y_stride, masks, ahead),)*
                    _ => unreachable!("1..=NR tokens"),
                }
            };
        }
        debug_assert!((1..=NR).contains(&n) && x.len() >= n * terms * pairs);
        match terms {
            1 => by_n!(1; 1 2 3 4 5 6 7 8 9 10 11 12),
            2 => by_n!(2; 1 2 3 4 5 6 7 8 9 10 11 12),
            _ => unreachable!("1 or 2 terms"),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn tile_n<const N: usize, const TERMS: usize>(
        panel: *const u32,
        pairs: usize,
        x: *const u32,
        y: *mut f32,
        y_stride: usize,
        masks: [u16; 2],
        ahead: &[u8],
    ) {
        let stride = TERMS * pairs;
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        for p in 0..pairs {
            prefetch_ahead(ahead, p);
            let w0: __m512bh = std::mem::transmute(_mm512_load_si512(panel.add(p * 32) as *const _));
            let w1: __m512bh = std::mem::transmute(_mm512_load_si512(panel.add(p * 32 + 16) as *const _));
            for (j, a) in acc.iter_mut().enumerate() {
                for term in 0..TERMS {
                    let b: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*x.add(j * stride + term * pairs + p) as i32));
                    a[0] = _mm512_dpbf16_ps(a[0], w0, b);
                    a[1] = _mm512_dpbf16_ps(a[1], w1, b);
                }
            }
        }
        for (j, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(y.add(j * y_stride), masks[0], a[0]);
            _mm512_mask_storeu_ps(y.add(j * y_stride + 16), masks[1], a[1]);
        }
    }

    /// The f32 micro-kernel for `n ≤ 12` tokens of `x` (`2 · pairs` floats
    /// each): `y[j][0..32] (masked) = panel · x[j]`.
    ///
    /// # Safety
    /// AVX-512F; `panel` holds `pairs` × 32 words, `x` `n` tokens, `y` rows
    /// `j · y_stride` up to the last unmasked lane.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_f32(
        n: usize,
        panel: *const u32,
        pairs: usize,
        x: &[f32],
        y: *mut f32,
        y_stride: usize,
        masks: [u16; 2],
        ahead: &[u8],
    ) {
        macro_rules! by_n {
            ($($n:literal)*) => {
                match n {
                    $($n => tile_f32_n::<$n>(panel, pairs, x.as_ptr(), y, y_stride, masks, ahead),)*
                    _ => unreachable!("1..=NR tokens"),
                }
            };
        }
        debug_assert!((1..=NR).contains(&n) && x.len() == n * 2 * pairs);
        by_n!(1 2 3 4 5 6 7 8 9 10 11 12)
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile_f32_n<const N: usize>(
        panel: *const u32,
        pairs: usize,
        x: *const f32,
        y: *mut f32,
        y_stride: usize,
        masks: [u16; 2],
        ahead: &[u8],
    ) {
        let cols = 2 * pairs;
        let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        for p in 0..pairs {
            prefetch_ahead(ahead, p);
            let l0 = _mm512_load_si512(panel.add(p * 32) as *const _);
            let l1 = _mm512_load_si512(panel.add(p * 32 + 16) as *const _);
            // Column 2p is each word's low half, 2p + 1 its high half.
            let even =
                [_mm512_castsi512_ps(_mm512_slli_epi32::<16>(l0)), _mm512_castsi512_ps(_mm512_slli_epi32::<16>(l1))];
            let odd =
                [_mm512_castsi512_ps(_mm512_and_si512(l0, high)), _mm512_castsi512_ps(_mm512_and_si512(l1, high))];
            for (j, a) in acc.iter_mut().enumerate() {
                let xj = x.add(j * cols + 2 * p);
                let (x0, x1) = (_mm512_set1_ps(*xj), _mm512_set1_ps(*xj.add(1)));
                a[0] = _mm512_fmadd_ps(odd[0], x1, _mm512_fmadd_ps(even[0], x0, a[0]));
                a[1] = _mm512_fmadd_ps(odd[1], x1, _mm512_fmadd_ps(even[1], x0, a[1]));
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
    use crate::testutil::synth;

    #[test]
    fn terms_rebuild_the_value() {
        for &x in &[1.0f32, -3.25, 1e-20, 65504.0, 0.0, 123.456e10] {
            let [a, b] = terms::<2>(x);
            let approx = bf16_value(a) + bf16_value(b);
            assert!((approx - x).abs() <= x.abs() * 2f32.powi(-16), "{x}: {approx}");
        }
    }

    #[test]
    fn every_tier_rounds_like_the_reference() {
        for cols in [1, 2, 15, 16, 17, 33, 896] {
            let x = synth(3 * cols, cols as u64);
            let mut want = Vec::new();
            for terms in 1..=MAX_TERMS {
                let want = prepare(Isa::scalar(), None, &x, cols, terms, &mut want).words.to_vec();
                for isa in Isa::supported() {
                    let mut got = Vec::new();
                    let got = prepare(isa, Some(&ThreadPool::new(2)), &x, cols, terms, &mut got).words.to_vec();
                    assert_eq!(got, want, "{isa:?} cols={cols} terms={terms}");
                }
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_transpose_transposes() {
        if !Isa::supported().into_iter().any(available) {
            return;
        }
        let r: [[u32; 16]; 16] = std::array::from_fn(|i| std::array::from_fn(|j| (i * 100 + j) as u32));
        let t = avx512::transpose_for_test(r);
        for i in 0..16 {
            for j in 0..16 {
                assert_eq!(t[j][i], r[i][j]);
            }
        }
    }

    #[test]
    fn the_f32_kernel_matches_its_twin() {
        let isas: Vec<Isa> = Isa::supported().into_iter().filter(|&i| f32_available(i)).collect();
        if isas.is_empty() {
            eprintln!("no x86 tier here: the f32 panel kernels are covered on machines that have one");
        }
        // Ragged rows (mod 16, mod 32), tokens (mod 6, mod 12, and past a
        // token block: 4864 columns take 36 tokens per block), pairs (mod 8,
        // mod 16).
        for isa in isas {
            for (rows, cols, t) in [
                (1, 2, 1),
                (5, 10, 2),
                (17, 34, 13),
                (64, 128, 25),
                (40, 896, 12),
                (33, 4864, 50),
                (48, 46, 7),
                (16, 32, 6),
            ] {
                let w: Vec<bf16> = synth(rows * cols, rows as u64).iter().map(|&v| bf16::from_f32(v)).collect();
                let x = synth(t * cols, t as u64 + 5);
                let mut want = vec![0.0; t * rows];
                matmul_f32_reference(&w, cols, &x, &mut want);
                let mut y = vec![f32::NAN; t * rows];
                let out = Out::new(&mut y, rows);
                let mid = ((rows / 2).div_ceil(PANEL) * PANEL).min(rows);
                matmul_rows_f32(isa, &w, cols, 0..mid, &x, &out);
                matmul_rows_f32(isa, &w, cols, mid..rows, &x, &out);
                for (a, b) in y.iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-6 * (cols as f32), "{isa:?} {rows}x{cols} t={t}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_8x8_transpose_transposes() {
        if !Isa::supported().into_iter().any(f32_available) {
            return;
        }
        let r: [[u32; 8]; 8] = std::array::from_fn(|i| std::array::from_fn(|j| (i * 100 + j) as u32));
        let t = avx2::transpose_for_test(r);
        for i in 0..8 {
            for j in 0..8 {
                assert_eq!(t[j][i], r[i][j]);
            }
        }
    }

    #[test]
    fn the_kernel_matches_its_twin() {
        let Some(isa) = Isa::supported().into_iter().find(|&i| available(i)) else {
            eprintln!("no AVX512-BF16 here: the kernel is covered on machines that have it");
            return;
        };
        // Ragged rows (mod 16, mod 32), tokens (mod 12) and odd columns.
        for (rows, cols, t) in
            [(1, 2, 1), (5, 9, 2), (17, 33, 13), (64, 128, 25), (40, 896, 12), (96, 31, 30), (48, 100, 5)]
        {
            let w: Vec<bf16> = synth(rows * cols, rows as u64).iter().map(|&v| bf16::from_f32(v)).collect();
            let x = synth(t * cols, t as u64 + 5);
            for terms in 1..=MAX_TERMS {
                let mut buf = Vec::new();
                let acts = prepare(isa, None, &x, cols, terms, &mut buf);
                let mut want = vec![0.0; t * rows];
                matmul_reference(&w, cols, &acts, &mut want);
                // Split the rows between two "threads" at a panel boundary.
                let mut y = vec![f32::NAN; t * rows];
                let out = Out::new(&mut y, rows);
                let mid = (rows / 2).div_ceil(PANEL) * PANEL;
                let mid = mid.min(rows);
                matmul_rows(isa, &w, cols, 0..mid, &acts, &out);
                matmul_rows(isa, &w, cols, mid..rows, &acts, &out);
                for (a, b) in y.iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-5 * (cols as f32).max(1.0), "{rows}x{cols} t={t}: {a} vs {b}");
                }
                // The rounding itself: each activation within 2⁻⁹ (one term)
                // or 2⁻¹⁷ (two) of itself, so each product too.
                let mut exact = vec![0.0; t * rows];
                for i in 0..t {
                    for r in 0..rows {
                        exact[i * rows + r] = (0..cols).map(|k| w[r * cols + k].to_f32() * x[i * cols + k]).sum();
                    }
                }
                let bound = 2f32.powi(-8 * terms as i32 - 1);
                for i in 0..t {
                    for r in 0..rows {
                        let mass: f32 = (0..cols).map(|k| (w[r * cols + k].to_f32() * x[i * cols + k]).abs()).sum();
                        let (a, b) = (want[i * rows + r], exact[i * rows + r]);
                        assert!((a - b).abs() <= bound * mass + 1e-6 * cols as f32, "terms={terms}: {a} vs exact {b}");
                    }
                }
            }
        }
    }
}
