//! Prefill products over INT8 and INT4 weights at integer speed, for
//! [`Precision::Fast`](crate::matmul::Precision::Fast): the activations are
//! quantized once per product to int8 blocks ([`BlockA8`], as decoding
//! does), and blocks of weights meet them in integer dot products on every
//! x86 tier.
//!
//! Each weight block is read through its row's [`Format::codes`]: 32
//! unsigned codes `u` with `w = d · (u − offset)` (INT8: `q + 128`, INT4: the
//! nibble, offset 8). The instructions multiply unsigned by signed bytes, so
//! `Σ u·x` is exact in i32 and `Σ w·x = d · (Σ u·x − offset · Σ x)`, the
//! activation block's sum being stored with it. Per block and token, the
//! integer sum is scaled by `d_w · d_x` into an f32 accumulator: the same
//! arithmetic as the decoding kernels, so a prompt processed in one block
//! gives what token-by-token decoding gives, up to f32 summation order.
//!
//! **Kernels**, one per instruction, chosen by tier name (`Kernel::of`):
//!
//! | kernel | tiers | instructions (byte products into i32) | panel rows × tokens |
//! |---|---|---|---|
//! | `Avx512Vnni` | `avx512vnni`, `avx512bf16`, `amx` | `vpdpbusd` zmm (64) | 32 × 6 |
//! | `AvxVnni` | `avxvnni` | `vpdpbusd` ymm, VEX-encoded (32) | 16 × 3 |
//! | `Avx512Maddubs` | `avx512` | `vpmaddubsw` then `vpmaddwd` zmm (64 per pair) | 32 × 6 |
//! | `Maddubs` | `avx2` | `vpmaddubsw` then `vpmaddwd` ymm (32 per pair) | 16 × 2 |
//!
//! (`vpdpbusd` on zmm measured 4.3× the f32 FMA's multiply-adds on this
//! project's Xeon. `Maddubs`, measured end to end on it with `ember bench
//! -p 128` at 2 threads, beat the exact path on `avx2`, INT8 176 tok/s
//! against 164 and INT4 207 against 168, but not on `avx512`, whose f32
//! kernel is twice as wide: INT8 161 against 247, INT4 202 against 222. So
//! `avx512` has its own 512-bit kernel, with 32-row panels like VNNI's;
//! `Avx512Maddubs` and `AvxVnni` have not been timed yet.)
//!
//! `vpmaddubsw` adds each pair of u8 · i8 products into an i16 that
//! saturates: INT4's codes are safe (2 · 15 · 127 < 2¹⁵), INT8's (u up to 255)
//! are not. So the `vpmaddubsw` panels hold INT8 codes signed, `q = u − 128`
//! (offset 0), and the kernels multiply `|q|` by `x` with `q`'s sign moved
//! onto it: `|q| ≤ 128` and `|x| ≤ 127` keep each pair within ±32 512. On
//! ymm `vpsignb` moves it; zmm has no `vpsignb`, so the 512-bit kernel takes
//! `q`'s sign bits as a mask (`vpmovb2m`) and negates `x` under it (a masked
//! subtract from zero, which LLVM makes a negation and two blends). Unlike
//! `vpsignb`, that keeps `x` where `q = 0`, where `|q| = 0` makes the
//! product 0 all the same. The integer sums are exact in every kernel, and
//! each is scaled and added to its row's f32 in block order, so the kernels
//! agree bit for bit (a test checks it).
//!
//! **Layout.** Like [`crate::gemm_bf16`]: each thread packs a panel of weight
//! rows (two registers of i32 lanes: 32 rows for zmm, 16 for ymm), per block
//! 9 slots of one 32-bit word per row, in row order: 8 groups of 4
//! codes, then the scales. It then runs the kernel's micro-kernel over every
//! token: per block and group, one multiply-add per register and token into
//! integer accumulators started at `−offset · Σx`, then one conversion and
//! one FMA per register and token. A panel is packed a block at a time
//! through a tile on the stack, from rows that the micro-kernel calls on the
//! panel before it have prefetched into L2, a share per call: packing
//! reads memory only once per product and is a few percent of its time.

use crate::cpu::{Isa, Tier};
use crate::formats::{quantize_activations, ActType, BlockA8, BlockQ8, Format, MatRef, QK_A8};
use crate::gemm_bf16::Line;
use crate::matmul::Out;
use crate::pool::ThreadPool;
use std::cell::RefCell;

/// Slots per block in a panel: 8 groups of 4 codes, then the scales.
const SLOTS: usize = QK_A8 / 4 + 1;
/// Rows of a 256-bit kernel's panel: two 8-lane registers.
const YMM_ROWS: usize = 16;
/// Rows of the 512-bit kernel's panel: two 16-lane registers.
const ZMM_ROWS: usize = 32;

/// The micro-kernels, one per instruction that multiplies bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// `vpmaddubsw` + `vpmaddwd` on 8-lane registers (AVX2).
    Maddubs,
    /// `vpmaddubsw` + `vpmaddwd` on 16-lane registers (AVX-512BW).
    Avx512Maddubs,
    /// `vpdpbusd` on 8-lane registers (AVX-VNNI).
    AvxVnni,
    /// `vpdpbusd` on 16-lane registers (AVX512-VNNI).
    Avx512Vnni,
}

impl Kernel {
    /// The kernel of a tier, by name: the VNNI one it has, else its widest
    /// `vpmaddubsw`.
    fn of(tier: Tier) -> Option<Kernel> {
        let x86 = |k| cfg!(target_arch = "x86_64").then_some(k);
        match tier {
            Tier::Scalar => None,
            Tier::Avx2 => x86(Kernel::Maddubs),
            Tier::Avx512 => x86(Kernel::Avx512Maddubs),
            Tier::AvxVnni => x86(Kernel::AvxVnni),
            Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => x86(Kernel::Avx512Vnni),
        }
    }

    /// Weight rows per panel.
    fn rows(self) -> usize {
        match self {
            Kernel::Maddubs | Kernel::AvxVnni => YMM_ROWS,
            Kernel::Avx512Maddubs | Kernel::Avx512Vnni => ZMM_ROWS,
        }
    }

    /// Most tokens per micro-kernel call: as many as the registers hold.
    /// Each token takes two integer and two f32 accumulators (one per
    /// register of rows); the group's two weight registers and the
    /// broadcast activations take the rest. Two registers of rows rather
    /// than one: each broadcast activation then serves twice the rows, and
    /// a 256-bit VNNI group is 2 + 3 loads per 6 `vpdpbusd` (one register of
    /// rows × 6 tokens would be 1 + 6).
    fn tokens(self) -> usize {
        match self {
            // 16 ymm: 4N accumulators, 2 weights, their absolute values,
            // the broadcast, its signed copy and `vpmaddwd`'s ones: N = 2
            // (15 registers).
            Kernel::Maddubs => 2,
            // 16 ymm: 4N accumulators, 2 weights, the broadcast: N = 3 (15).
            Kernel::AvxVnni => 3,
            // 32 zmm: 4N accumulators; the group's 2 absolute values (its
            // signs go to mask registers); the broadcast, its negation and
            // one signed copy at a time; `vpmaddwd`'s ones and the zero:
            // N = 6 (31 registers; at 6 tokens the release build spills
            // none). As many tokens as VNNI's: each group's absolute values
            // and sign masks, 4 instructions, serve 6 tokens.
            Kernel::Avx512Maddubs => 6,
            // 32 zmm: 4N accumulators, 2 weights, the broadcast: N = 6 (27).
            Kernel::Avx512Vnni => 6,
        }
    }

    /// Whether the panel holds codes signed (`u − offset`, the kernel then
    /// subtracting no offset): where codes up to `2 · offset − 1` times
    /// activations up to 127 would overflow `vpmaddubsw`'s i16 pair sums.
    fn signed(self, offset: i32) -> bool {
        match self {
            Kernel::Maddubs | Kernel::Avx512Maddubs => 2 * (2 * offset - 1) * 127 > i16::MAX as i32,
            Kernel::AvxVnni | Kernel::Avx512Vnni => false,
        }
    }
}

/// Whether the integer kernels can run on `isa`: every x86 tier above
/// scalar, by name.
pub fn available(isa: Isa) -> bool {
    Kernel::of(isa.tier()).is_some()
}

/// Activations `X (T, cols)` as int8 blocks, `cols / 32` per token.
pub struct Acts<'a> {
    blocks: &'a [BlockA8],
    tokens: usize,
    per_token: usize,
}

impl<'a> Acts<'a> {
    /// Tokens quantized.
    pub(crate) fn tokens(&self) -> usize {
        self.tokens
    }

    /// Token `i`'s blocks `(cols / 32,)`.
    pub(crate) fn token(&self, i: usize) -> &'a [BlockA8] {
        &self.blocks[i * self.per_token..(i + 1) * self.per_token]
    }
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

/// How a panel's codes are to be read: the offset the kernel subtracts, and
/// whether they are stored signed ([`Kernel::signed`]).
#[derive(Clone, Copy)]
struct Coding {
    offset: i32,
    signed: bool,
}

/// Packs rows `rows` (at most `kernel.rows()`) of `w (·, blocks)` into
/// `panel (blocks, SLOTS, kernel.rows())` words; rows past the end are zero.
///
/// Block by block: each row's codes are shifted and laid into a block-sized
/// tile on the stack (one block of the panel, 9 slots × the panel's rows),
/// which is then copied into place whole. (Row by row, each word stored
/// straight into the panel through a computed index, the packing took 19%
/// of an INT8 pp128 on Zen 3, about 100 cycles per row and block.)
fn pack_panel<F: Format>(
    kernel: Kernel,
    w: &[F::Block],
    blocks: usize,
    rows: std::ops::Range<usize>,
    panel: &mut [Line],
) -> Coding {
    #[cfg(target_arch = "x86_64")]
    if F::TYPE == crate::formats::WeightType::Int8 && rows.len() == kernel.rows() {
        let w: &[BlockQ8] = bytemuck::cast_slice(w);
        let signed = kernel.signed(128);
        // SAFETY: a kernel exists only on the x86 tiers, all of which have
        // AVX2; the panel holds `blocks` blocks of `kernel.rows()` rows and
        // the rows exist (`rows.end * blocks <= w.len()`, checked by the
        // caller).
        unsafe { pack_q8_avx2(w, blocks, rows, signed, panel) };
        return Coding { offset: if signed { 0 } else { 128 }, signed };
    }
    let height = kernel.rows();
    debug_assert!(rows.len() <= height && height <= ZMM_ROWS && panel.len() * 16 == blocks * SLOTS * height);
    let mut coding = Coding { offset: 0, signed: false };
    // Rows past the end stay zero: a zero code times any activation adds
    // nothing, and a zero scale keeps the offset term out too.
    let mut tile = [[0u32; ZMM_ROWS]; SLOTS];
    for (b, dst) in panel.chunks_exact_mut(SLOTS * height / 16).enumerate() {
        for (i, r) in rows.clone().enumerate() {
            // Block `b` of 32 of row `r`: sub-block `at % per` of stored block `at / per`.
            let (at, per) = (r * blocks + b, F::BLOCK_LEN / QK_A8);
            let c = F::codes(&w[at / per], at % per).expect("integer rows have codes");
            let signed = kernel.signed(c.offset);
            coding = Coding { offset: if signed { 0 } else { c.offset }, signed };
            // Signed codes as i8 bytes: `u − offset` is in −128..=127.
            // Each word holds 4 codes in memory order, as the kernels read
            // them. Subtracting 128 from a byte is flipping its top bit,
            // a word at a time (byte by byte, LLVM kept it scalar).
            let quads: [u32; QK_A8 / 4] = match c.offset - coding.offset {
                0 => bytemuck::cast(c.u),
                128 => bytemuck::cast::<_, [u32; QK_A8 / 4]>(c.u).map(|q| q ^ 0x8080_8080),
                shift => bytemuck::cast(c.u.map(|u| u.wrapping_sub(shift as u8))),
            };
            for (slot, quad) in tile.iter_mut().zip(quads) {
                slot[i] = quad;
            }
            tile[SLOTS - 1][i] = c.d.to_bits();
        }
        for (lines, t) in dst.chunks_exact_mut(height / 16).zip(&tile) {
            for (line, part) in lines.iter_mut().zip(t.chunks_exact(16)) {
                line.0.copy_from_slice(part);
            }
        }
    }
    coding
}

/// [`pack_panel`] for INT8 rows, whole panels: per block, 8 rows' 32 codes
/// at a time are an 8 × 8 transpose of 32-bit words, each result the 8
/// rows' word of one group. INT8's code bytes are `q` itself (signed) or
/// `q ^ 0x80` (`u = q + 128`). (Through [`Format::codes`] the 32 bytes
/// were written as two halves and read back as one, which stalls on store
/// forwarding: 10% of a Q8_0 pp128 on Zen 3.)
///
/// # Safety
/// AVX2; rows `rows` of `w (·, blocks)` exist; `panel` holds `blocks`
/// blocks of `rows.len()` (16 or 32) rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pack_q8_avx2(w: &[BlockQ8], blocks: usize, rows: std::ops::Range<usize>, signed: bool, panel: &mut [Line]) {
    use std::arch::x86_64::*;
    let height = rows.len();
    assert!(height.is_multiple_of(8) && rows.end * blocks <= w.len() && panel.len() * 16 == blocks * SLOTS * height);
    let flip = _mm256_set1_epi8(if signed { 0 } else { 0x80u8 as i8 });
    let words = panel.as_mut_ptr() as *mut u32;
    for b in 0..blocks {
        let dst = words.add(b * SLOTS * height);
        for r8 in (0..height).step_by(8) {
            let row = |i: usize| &w[(rows.start + r8 + i) * blocks + b];
            let codes: [__m256i; 8] = std::array::from_fn(|i| {
                _mm256_xor_si256(_mm256_loadu_si256(row(i).qs.as_ptr() as *const __m256i), flip)
            });
            for (g, v) in crate::gemm_bf16::avx2::transpose8(codes).into_iter().enumerate() {
                _mm256_storeu_si256(dst.add(g * height + r8) as *mut __m256i, v);
            }
            for i in 0..8 {
                *dst.add((SLOTS - 1) * height + r8 + i) = row(i).d.to_f32().to_bits();
            }
        }
    }
}

/// Whether products with `w` can run here: a row read by int8 activations
/// that has [`Format::codes`] (not Q4_1 / Q5_1, whose minimum is no
/// offset), whole blocks per row.
pub fn handles(w: &MatRef) -> bool {
    w.weights.ty().act() == ActType::A8 && w.weights.ty().has_codes() && w.cols.is_multiple_of(QK_A8)
}

/// Whether [`matmul_rows`] packs `w`'s panels with a vector loop (INT8, on
/// x86) rather than a block at a time through [`Format::codes`].
pub fn packs_fast(w: &MatRef) -> bool {
    cfg!(target_arch = "x86_64") && w.weights.ty() == crate::formats::WeightType::Int8
}

/// Rows `rows` of `Y = X @ Wᵀ` on the calling thread, `w (·, cols)` in a row
/// of the format table that [`handles`] takes, `x` from [`prepare`]. Writes
/// `y[t][r]` for `r` in `rows`, every token.
pub fn matmul_rows<F: Format>(isa: Isa, w: &[F::Block], rows: std::ops::Range<usize>, x: &Acts, out: &Out) {
    let kernel = Kernel::of(isa.tier()).expect("the integer kernels need an x86 tier");
    let blocks = x.per_token;
    let per = F::BLOCK_LEN / QK_A8;
    assert!(F::TYPE.act() == ActType::A8 && blocks.is_multiple_of(per) && rows.end * blocks <= w.len() * per);
    let (height, width) = (kernel.rows(), kernel.tokens());
    PANEL_BUF.with(|buf| {
        let mut panel = buf.borrow_mut();
        panel.resize(blocks * SLOTS * height / 16, Line([0; 16]));
        for r0 in rows.clone().step_by(height) {
            let r1 = (r0 + height).min(rows.end);
            let coding = pack_panel::<F>(kernel, w, blocks, r0..r1, &mut panel);
            // The next panel's rows, fetched into L2 a share per call while
            // this one computes, so that packing them does not wait on
            // memory (on Zen 3 the packing was 19% of an INT8 pp128; with
            // the prefetch and `pack_q8_avx2`, 4%).
            let next = &w[r1 * blocks / per..(r1 + height).min(rows.end) * blocks / per];
            let calls = x.tokens.div_ceil(width);
            for (call, t0) in (0..x.tokens).step_by(width).enumerate() {
                prefetch_share(next, call, calls);
                let n = width.min(x.tokens - t0);
                // SAFETY: this thread owns columns `rows` of every output
                // row, and the kernel writes only the lanes at `r0..r1` of
                // rows `t0..t0 + n`.
                let y = unsafe { out.data.ptr(t0 * out.stride + r0, (t0 + n - 1) * out.stride + r1) };
                let (p, xs) = (panel.as_ptr() as *const u32, &x.blocks[t0 * blocks..]);
                let (valid, stride) = (r1 - r0, out.stride);
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `kernel` is the tier's, whose features `isa` proves
                // present; the panel holds `blocks` blocks of `height` rows,
                // the activations `n ≤ width` tokens from `t0`, and `y`
                // reaches the last lane written.
                unsafe {
                    match kernel {
                        Kernel::Maddubs => {
                            avx2::maddubs(n, coding.signed, p, blocks, xs, coding.offset, y, stride, valid)
                        }
                        Kernel::AvxVnni => avx2::vnni(n, p, blocks, xs, coding.offset, y, stride, valid),
                        Kernel::Avx512Maddubs => {
                            avx512::maddubs(n, coding.signed, p, blocks, xs, coding.offset, y, stride, valid)
                        }
                        Kernel::Avx512Vnni => avx512::vnni(n, p, blocks, xs, coding.offset, y, stride, valid),
                    }
                };
                #[cfg(not(target_arch = "x86_64"))]
                let _ = (coding, p, xs, y, valid, stride);
            }
        }
    });
}

/// Fetches share `k` of `n` of `blocks`' bytes into L2, a cache line at a
/// time.
fn prefetch_share<B>(blocks: &[B], k: usize, n: usize) {
    let bytes = std::mem::size_of_val(blocks);
    let (from, to) = (bytes * k / n, bytes * (k + 1) / n);
    let start = blocks.as_ptr() as *const u8;
    for at in (from & !63..to).step_by(64) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch never faults (the address is within `blocks`
        // all the same); SSE is baseline on x86-64.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            _mm_prefetch::<_MM_HINT_T1>(start.wrapping_add(at) as *const i8)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (start, at);
    }
}

/// The reference: `y[t][r] = F::dot_reference(w[r], x[t])`, the decoding
/// kernels' specification. `y (T, rows)`.
pub fn matmul_reference<F: Format<Act = BlockA8>>(w: &[F::Block], x: &Acts, y: &mut [f32]) {
    let blocks = x.per_token;
    // Stored blocks per row (several activation blocks each for INT5).
    let per_row = blocks * QK_A8 / F::BLOCK_LEN;
    let rows = w.len() / per_row;
    assert_eq!(y.len(), x.tokens * rows);
    for t in 0..x.tokens {
        let xt = &x.blocks[t * blocks..(t + 1) * blocks];
        for r in 0..rows {
            y[t * rows + r] = F::dot_reference(&w[r * per_row..(r + 1) * per_row], xt);
        }
    }
}

/// The `vpmaddubsw` kernels' count of groups per block, hidden from the
/// optimizer so that their group loop stays a loop. Knowing it is 8, LLVM
/// unrolls the groups of a block and then computes it token by token: every
/// group's weights and absolute values are made for the first token and kept
/// for the next on the stack. In the release build's assembly that was, per
/// block of the AVX2 kernel at 2 tokens, 36 ymm stores and 36 reloads beside
/// 32 `vpmaddubsw` (INT8; INT4, with no absolute values, 21 of each), and 20
/// of each in the 512-bit kernel at 2 tokens (INT8; none at 3, and from 4 on
/// LLVM kept the loop itself). Rolled, one group's weights are live at a
/// time and no vector register spills in either kernel, for a few scalar
/// instructions per group. (The VNNI kernels stay unrolled: the 512-bit one
/// spills nothing in this build, the 256-bit one two registers per block at
/// 3 tokens.)
#[cfg(target_arch = "x86_64")]
fn rolled(groups: usize) -> usize {
    std::hint::black_box(groups)
}

/// The 256-bit kernels: 16-row panels, two 8-lane registers per slot.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{rolled, BlockA8, SLOTS, YMM_ROWS};
    use std::arch::x86_64::*;

    /// The `vpmaddubsw` micro-kernel for `n ≤ 2` tokens: `y[j][0..valid] =
    /// panel · x[j]`. With `signed`, the panel holds `u − offset` as i8
    /// (and `offset` is 0).
    ///
    /// # Safety
    /// AVX2 and FMA; `panel` holds `blocks` packed blocks, `x` `n` tokens of
    /// `blocks` blocks, `y` rows `j · y_stride` up to lane `valid ≤ 16`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn maddubs(
        n: usize,
        signed: bool,
        panel: *const u32,
        blocks: usize,
        x: &[BlockA8],
        offset: i32,
        y: *mut f32,
        y_stride: usize,
        valid: usize,
    ) {
        debug_assert!(x.len() >= n * blocks && valid <= YMM_ROWS);
        let x = x.as_ptr();
        match (n, signed) {
            (1, false) => maddubs_n::<1, false>(panel, blocks, x, offset, y, y_stride, valid),
            (2, false) => maddubs_n::<2, false>(panel, blocks, x, offset, y, y_stride, valid),
            (1, true) => maddubs_n::<1, true>(panel, blocks, x, offset, y, y_stride, valid),
            (2, true) => maddubs_n::<2, true>(panel, blocks, x, offset, y, y_stride, valid),
            _ => unreachable!("1..=2 tokens"),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn maddubs_n<const N: usize, const SIGNED: bool>(
        panel: *const u32,
        blocks: usize,
        x: *const BlockA8,
        offset: i32,
        y: *mut f32,
        y_stride: usize,
        valid: usize,
    ) {
        let groups = rolled(SLOTS - 1);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        if !SIGNED && sums_fit_i16(offset) {
            // Every group's pair sums of a block added in i16, then one
            // `vpmaddwd` per register: 18 multiplying instructions per block
            // and token instead of 32.
            for b in 0..blocks {
                let p = panel.add(b * SLOTS * YMM_ROWS);
                let xb: [&BlockA8; N] = std::array::from_fn(|j| &*x.add(j * blocks + b));
                let mut s16 = [[_mm256_setzero_si256(); 2]; N];
                for g in 0..groups {
                    let w0 = _mm256_load_si256(p.add(YMM_ROWS * g) as *const _);
                    let w1 = _mm256_load_si256(p.add(YMM_ROWS * g + 8) as *const _);
                    for (j, s) in s16.iter_mut().enumerate() {
                        let q = _mm256_set1_epi32((xb[j].qs.as_ptr().add(4 * g) as *const i32).read_unaligned());
                        s[0] = _mm256_add_epi16(s[0], _mm256_maddubs_epi16(w0, q));
                        s[1] = _mm256_add_epi16(s[1], _mm256_maddubs_epi16(w1, q));
                    }
                }
                let mut dot = start(&xb, offset);
                for (d, s) in dot.iter_mut().zip(&s16) {
                    d[0] = _mm256_add_epi32(d[0], _mm256_madd_epi16(s[0], ones));
                    d[1] = _mm256_add_epi32(d[1], _mm256_madd_epi16(s[1], ones));
                }
                scale(&mut acc, &dot, p.add(YMM_ROWS * (SLOTS - 1)), &xb);
            }
            return store(&acc, y, y_stride, valid);
        }
        for b in 0..blocks {
            let p = panel.add(b * SLOTS * YMM_ROWS);
            let xb: [&BlockA8; N] = std::array::from_fn(|j| &*x.add(j * blocks + b));
            let mut dot = start(&xb, offset);
            for g in 0..groups {
                let w0 = _mm256_load_si256(p.add(YMM_ROWS * g) as *const _);
                let w1 = _mm256_load_si256(p.add(YMM_ROWS * g + 8) as *const _);
                // The unsigned operand: the codes, or |q| (|−128| is 128 as
                // a u8).
                let (a0, a1) = if SIGNED { (_mm256_abs_epi8(w0), _mm256_abs_epi8(w1)) } else { (w0, w1) };
                for (j, d) in dot.iter_mut().enumerate() {
                    let q = _mm256_set1_epi32((xb[j].qs.as_ptr().add(4 * g) as *const i32).read_unaligned());
                    // Signed codes' signs move onto the activations.
                    let (q0, q1) = if SIGNED { (_mm256_sign_epi8(q, w0), _mm256_sign_epi8(q, w1)) } else { (q, q) };
                    d[0] = _mm256_add_epi32(d[0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, q0), ones));
                    d[1] = _mm256_add_epi32(d[1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, q1), ones));
                }
            }
            scale(&mut acc, &dot, p.add(YMM_ROWS * (SLOTS - 1)), &xb);
        }
        store(&acc, y, y_stride, valid);
    }

    /// The AVX-VNNI micro-kernel for `n ≤ 3` tokens: `y[j][0..valid] =
    /// panel · x[j]`.
    ///
    /// # Safety
    /// AVX2, FMA and AVX-VNNI; otherwise as [`maddubs`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,avxvnni")]
    pub unsafe fn vnni(
        n: usize,
        panel: *const u32,
        blocks: usize,
        x: &[BlockA8],
        offset: i32,
        y: *mut f32,
        y_stride: usize,
        valid: usize,
    ) {
        macro_rules! by_n {
            ($($n:literal)*) => {
                match n {
                    $($n => vnni_n::<$n>(panel, blocks, x.as_ptr(), offset, y, y_stride, valid),)*
                    _ => unreachable!("1..=3 tokens"),
                }
            };
        }
        debug_assert!(x.len() >= n * blocks && valid <= YMM_ROWS);
        by_n!(1 2 3)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,avxvnni")]
    unsafe fn vnni_n<const N: usize>(
        panel: *const u32,
        blocks: usize,
        x: *const BlockA8,
        offset: i32,
        y: *mut f32,
        y_stride: usize,
        valid: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..blocks {
            let p = panel.add(b * SLOTS * YMM_ROWS);
            let xb: [&BlockA8; N] = std::array::from_fn(|j| &*x.add(j * blocks + b));
            let mut dot = start(&xb, offset);
            for g in 0..SLOTS - 1 {
                let w0 = _mm256_load_si256(p.add(YMM_ROWS * g) as *const _);
                let w1 = _mm256_load_si256(p.add(YMM_ROWS * g + 8) as *const _);
                for (j, d) in dot.iter_mut().enumerate() {
                    let q = _mm256_set1_epi32((xb[j].qs.as_ptr().add(4 * g) as *const i32).read_unaligned());
                    d[0] = _mm256_dpbusd_avx_epi32(d[0], w0, q);
                    d[1] = _mm256_dpbusd_avx_epi32(d[1], w1, q);
                }
            }
            scale(&mut acc, &dot, p.add(YMM_ROWS * (SLOTS - 1)), &xb);
        }
        store(&acc, y, y_stride, valid);
    }

    /// Whether a whole block's `vpmaddubsw` pair sums of unsigned codes
    /// below `2 · offset` add up in an i16: 8 groups × 2 products × the
    /// largest code × 127 (INT4: 8 · 2 · 15 · 127 = 30 480 ≤ 32 767).
    #[inline]
    fn sums_fit_i16(offset: i32) -> bool {
        (SLOTS as i32 - 1) * 2 * (2 * offset - 1) * 127 <= i16::MAX as i32
    }

    /// Each token's integer accumulators for a block, started at
    /// `−offset · Σx`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn start<const N: usize>(xb: &[&BlockA8; N], offset: i32) -> [[__m256i; 2]; N] {
        std::array::from_fn(|j| {
            let c = _mm256_set1_epi32(-offset * xb[j].sum);
            [c, c]
        })
    }

    /// `acc[j] += f32(dot[j]) · (d_w · d_x[j])`, the 16 rows' scales `d_w`
    /// at `scales`: the 512-bit kernel's arithmetic.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scale<const N: usize>(
        acc: &mut [[__m256; 2]; N],
        dot: &[[__m256i; 2]; N],
        scales: *const u32,
        xb: &[&BlockA8; N],
    ) {
        let s0 = _mm256_load_ps(scales as *const f32);
        let s1 = _mm256_load_ps(scales.add(8) as *const f32);
        for (j, a) in acc.iter_mut().enumerate() {
            let dx = _mm256_set1_ps(xb[j].d);
            a[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[j][0]), _mm256_mul_ps(s0, dx), a[0]);
            a[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[j][1]), _mm256_mul_ps(s1, dx), a[1]);
        }
    }

    /// Token `j`'s 16 sums to `y + j · y_stride`, the first `valid` of them.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store<const N: usize>(acc: &[[__m256; 2]; N], y: *mut f32, y_stride: usize, valid: usize) {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid as i32), lane);
        let m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid as i32 - 8), lane);
        for (j, a) in acc.iter().enumerate() {
            _mm256_maskstore_ps(y.add(j * y_stride), m0, a[0]);
            // Past the output's end when `valid ≤ 8`, where nothing is
            // stored (masked lanes are not accessed).
            _mm256_maskstore_ps(y.wrapping_add(j * y_stride + 8), m1, a[1]);
        }
    }
}

/// The 512-bit kernels: 32-row panels, two 16-lane registers per slot.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{rolled, BlockA8, SLOTS, ZMM_ROWS};
    use crate::gemm_bf16::row_masks;
    use std::arch::x86_64::*;

    /// The `vpmaddubsw` micro-kernel for `n ≤ 6` tokens: `y[j][0..valid] =
    /// panel · x[j]`. With `signed`, the panel holds `u − offset` as i8
    /// (and `offset` is 0).
    ///
    /// # Safety
    /// AVX-512F and AVX-512BW; `panel` holds `blocks` packed blocks, `x` `n`
    /// tokens of `blocks` blocks, `y` rows `j · y_stride` up to lane
    /// `valid ≤ 32`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn maddubs(
        n: usize,
        signed: bool,
        panel: *const u32,
        blocks: usize,
        x: &[BlockA8],
        offset: i32,
        y: *mut f32,
        y_stride: usize,
        valid: usize,
    ) {
        let masks = row_masks(valid);
        macro_rules! by_n {
            ($($n:literal)*) => {
                match (n, signed) {
                    $(($n, false) => maddubs_n::<$n, false>(panel, blocks, x.as_ptr(), offset, y, y_stride, masks),)*
                    $(($n, true) => maddubs_n::<$n, true>(panel, blocks, x.as_ptr(), offset, y, y_stride, masks),)*
                    _ => unreachable!("1..=6 tokens"),
                }
            };
        }
        debug_assert!(x.len() >= n * blocks && valid <= ZMM_ROWS);
        by_n!(1 2 3 4 5 6)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn maddubs_n<const N: usize, const SIGNED: bool>(
        panel: *const u32,
        blocks: usize,
        x: *const BlockA8,
        offset: i32,
        y: *mut f32,
        y_stride: usize,
        masks: [u16; 2],
    ) {
        let groups = rolled(SLOTS - 1);
        let (ones, zero) = (_mm512_set1_epi16(1), _mm512_setzero_si512());
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        for b in 0..blocks {
            let p = panel.add(b * SLOTS * ZMM_ROWS);
            let xb: [&BlockA8; N] = std::array::from_fn(|j| &*x.add(j * blocks + b));
            let mut dot = start(&xb, offset);
            for g in 0..groups {
                let w0 = _mm512_load_si512(p.add(ZMM_ROWS * g) as *const _);
                let w1 = _mm512_load_si512(p.add(ZMM_ROWS * g + 16) as *const _);
                // The unsigned operand: the codes, or |q| (|−128| is 128 as
                // a u8); and where q < 0, as a mask (zmm has no `vpsignb`).
                let (a0, a1) = if SIGNED { (_mm512_abs_epi8(w0), _mm512_abs_epi8(w1)) } else { (w0, w1) };
                let (s0, s1) = if SIGNED { (_mm512_movepi8_mask(w0), _mm512_movepi8_mask(w1)) } else { (0, 0) };
                for (j, d) in dot.iter_mut().enumerate() {
                    let q = _mm512_set1_epi32((xb[j].qs.as_ptr().add(4 * g) as *const i32).read_unaligned());
                    // Signed codes' signs move onto the activations: `vpsignb`
                    // but for q = 0, where |q| makes the product 0 anyway.
                    let (q0, q1) = if SIGNED {
                        (_mm512_mask_sub_epi8(q, s0, zero, q), _mm512_mask_sub_epi8(q, s1, zero, q))
                    } else {
                        (q, q)
                    };
                    d[0] = _mm512_add_epi32(d[0], _mm512_madd_epi16(_mm512_maddubs_epi16(a0, q0), ones));
                    d[1] = _mm512_add_epi32(d[1], _mm512_madd_epi16(_mm512_maddubs_epi16(a1, q1), ones));
                }
            }
            scale(&mut acc, &dot, p.add(ZMM_ROWS * (SLOTS - 1)), &xb);
        }
        store(&acc, y, y_stride, masks);
    }

    /// The VNNI micro-kernel for `n ≤ 6` tokens: `y[j][0..valid] = panel ·
    /// x[j]`.
    ///
    /// # Safety
    /// AVX-512F and AVX512-VNNI; otherwise as [`maddubs`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub unsafe fn vnni(
        n: usize,
        panel: *const u32,
        blocks: usize,
        x: &[BlockA8],
        offset: i32,
        y: *mut f32,
        y_stride: usize,
        valid: usize,
    ) {
        let masks = row_masks(valid);
        macro_rules! by_n {
            ($($n:literal)*) => {
                match n {
                    $($n => vnni_n::<$n>(panel, blocks, x.as_ptr(), offset, y, y_stride, masks),)*
                    _ => unreachable!("1..=6 tokens"),
                }
            };
        }
        debug_assert!(x.len() >= n * blocks && valid <= ZMM_ROWS);
        by_n!(1 2 3 4 5 6)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn vnni_n<const N: usize>(
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
            let p = panel.add(b * SLOTS * ZMM_ROWS);
            let xb: [&BlockA8; N] = std::array::from_fn(|j| &*x.add(j * blocks + b));
            let mut dot = start(&xb, offset);
            for g in 0..SLOTS - 1 {
                let w0 = _mm512_load_si512(p.add(ZMM_ROWS * g) as *const _);
                let w1 = _mm512_load_si512(p.add(ZMM_ROWS * g + 16) as *const _);
                for (j, d) in dot.iter_mut().enumerate() {
                    let q = _mm512_set1_epi32((xb[j].qs.as_ptr().add(4 * g) as *const i32).read_unaligned());
                    d[0] = _mm512_dpbusd_epi32(d[0], w0, q);
                    d[1] = _mm512_dpbusd_epi32(d[1], w1, q);
                }
            }
            scale(&mut acc, &dot, p.add(ZMM_ROWS * (SLOTS - 1)), &xb);
        }
        store(&acc, y, y_stride, masks);
    }

    /// Each token's integer accumulators for a block, started at
    /// `−offset · Σx`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn start<const N: usize>(xb: &[&BlockA8; N], offset: i32) -> [[__m512i; 2]; N] {
        std::array::from_fn(|j| {
            let c = _mm512_set1_epi32(-offset * xb[j].sum);
            [c, c]
        })
    }

    /// `acc[j] += f32(dot[j]) · (d_w · d_x[j])`, the 32 rows' scales `d_w`
    /// at `scales`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scale<const N: usize>(
        acc: &mut [[__m512; 2]; N],
        dot: &[[__m512i; 2]; N],
        scales: *const u32,
        xb: &[&BlockA8; N],
    ) {
        let s0 = _mm512_load_ps(scales as *const f32);
        let s1 = _mm512_load_ps(scales.add(16) as *const f32);
        for (j, a) in acc.iter_mut().enumerate() {
            let dx = _mm512_set1_ps(xb[j].d);
            a[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j][0]), _mm512_mul_ps(s0, dx), a[0]);
            a[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j][1]), _mm512_mul_ps(s1, dx), a[1]);
        }
    }

    /// Token `j`'s 32 sums to `y + j · y_stride`, the lanes of `masks`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store<const N: usize>(acc: &[[__m512; 2]; N], y: *mut f32, y_stride: usize, masks: [u16; 2]) {
        for (j, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(y.add(j * y_stride), masks[0], a[0]);
            // Past the output's end when `valid ≤ 16`, where the mask is 0.
            _mm512_mask_storeu_ps(y.wrapping_add(j * y_stride + 16), masks[1], a[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{f16, BlockQ4_0, BlockQ8, Int4, Int8, Q4_0};
    use crate::testutil::synth;

    /// `y (T, rows)` from `isa`'s kernel, checked against the reference.
    fn check<F: Format<Act = BlockA8>>(isa: Isa, rows: usize, cols: usize, t: usize) -> Vec<f32> {
        let w = synth(rows * cols, rows as u64 + 1);
        let mut q = vec![F::ZERO; rows * cols / F::BLOCK_LEN];
        F::quantize_row(&w, &mut q);
        let x = synth(t * cols, t as u64 + 9);
        let mut buf = Vec::new();
        let acts = prepare(isa, Some(&ThreadPool::new(2)), &x, cols, &mut buf);
        let mut want = vec![0.0; t * rows];
        matmul_reference::<F>(&q, &acts, &mut want);
        let mut y = vec![f32::NAN; t * rows];
        let out = Out::new(&mut y, rows);
        // Two shares, the second starting anywhere (not on a panel).
        let mid = (rows / 2 + 3).min(rows);
        matmul_rows::<F>(isa, &q, 0..mid, &acts, &out);
        matmul_rows::<F>(isa, &q, mid..rows, &acts, &out);
        for (a, b) in y.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * (cols as f32), "{isa:?} {} {rows}x{cols} t={t}: {a} vs {b}", F::NAME);
        }
        y
    }

    /// The tiers this machine has that run an integer kernel (all but scalar
    /// on x86), each named with the kernel it runs.
    fn kernels_here() -> Vec<Isa> {
        let isas: Vec<Isa> = Isa::supported().into_iter().filter(|&i| available(i)).collect();
        if isas.is_empty() {
            eprintln!("no x86 tier here: the integer kernels are covered on machines that have one");
        }
        isas
    }

    #[test]
    fn every_x86_tier_has_an_integer_kernel() {
        for tier in Tier::ALL {
            let kernel = Kernel::of(tier);
            assert_eq!(kernel.is_some(), tier != Tier::Scalar && cfg!(target_arch = "x86_64"), "{tier:?}");
            if let Some(k) = kernel {
                // Whole 16-word lines per slot; shares of 32 rows are whole panels.
                assert!(k.rows() % 16 == 0 && 32 % k.rows() == 0);
            }
        }
        // Only the `vpmaddubsw` kernels store INT8's codes signed; INT4's
        // never are.
        for k in [Kernel::Maddubs, Kernel::Avx512Maddubs] {
            assert!(k.signed(128) && !k.signed(8), "{k:?}");
        }
        assert!(!Kernel::AvxVnni.signed(128) && !Kernel::Avx512Vnni.signed(128));
    }

    #[test]
    fn the_kernel_matches_the_decoding_reference() {
        // Ragged rows (mod 8, 16, 32) and tokens (mod 2, 3, 6).
        for (rows, cols, t) in
            [(1, 32, 1), (5, 64, 2), (11, 64, 5), (17, 96, 7), (24, 96, 3), (64, 128, 13), (40, 896, 6), (33, 32, 20)]
        {
            let (mut first8, mut first4, mut first4x4) = (None, None, None);
            for isa in kernels_here() {
                let (y8, y4) = (check::<Int8>(isa, rows, cols, t), check::<Q4_0>(isa, rows, cols, t));
                // Every kernel sums the same integers and adds each block's
                // scaled sum to a row's f32 in the same order: the same bits.
                assert_eq!(&y8, first8.get_or_insert_with(|| y8.clone()), "{isa:?} int8 {rows}x{cols} t={t}");
                assert_eq!(&y4, first4.get_or_insert_with(|| y4.clone()), "{isa:?} q4_0 {rows}x{cols} t={t}");
                // INT4's rows are whole 128-weight blocks.
                if cols % 128 == 0 {
                    let y = check::<Int4>(isa, rows, cols, t);
                    assert_eq!(&y, first4x4.get_or_insert_with(|| y.clone()), "{isa:?} int4 {rows}x{cols} t={t}");
                }
            }
        }
        // The blocks' codes rebuild the weights, and lie below twice the
        // offset (what signed storage relies on).
        let w = synth(64, 3);
        let (mut q8, mut q4) = ([BlockQ8::ZERO; 2], [BlockQ4_0::ZERO; 2]);
        Int8::quantize_row(&w, &mut q8);
        Q4_0::quantize_row(&w, &mut q4);
        let (mut d8, mut d4) = (vec![0.0; 64], vec![0.0; 64]);
        Int8::dequantize_reference(&q8, &mut d8);
        Q4_0::dequantize_reference(&q4, &mut d4);
        for (blocks, want) in [(Int8::codes(&q8[1], 0), &d8[32..]), (Q4_0::codes(&q4[1], 0), &d4[32..])] {
            let c = blocks.unwrap();
            for (&u, &want) in c.u.iter().zip(want) {
                assert_eq!(c.d * (u as i32 - c.offset) as f32, want);
                assert!((u as i32) < 2 * c.offset);
            }
        }
    }

    /// Codes at the ends of their ranges (INT8 −128, −127 and 127; Q4_0's
    /// nibbles 0 and 15, which INT4's sub-blocks share) against activations of ±127, with scales of 1 so
    /// that every sum is an integer f32 holds exactly: the kernels equal the
    /// reference bit for bit, so no 16-bit pair sum of `vpmaddubsw` saturated
    /// (−128 · −127 twice is 32 512, just inside), and zero codes (which
    /// `vpsignb` and the 512-bit kernel's masked negation treat differently)
    /// add nothing. 35 rows and 7 tokens: a full and a ragged panel of
    /// either height, a full call and a single token of every kernel.
    #[test]
    fn extreme_codes_sum_exactly() {
        let (rows, blocks, t) = (35, 3, 7);
        let q8 = [
            [-128i8; 32],
            [127; 32],
            [-127; 32],
            std::array::from_fn(|j| if j % 2 == 0 { -128 } else { 127 }),
            std::array::from_fn(|j| [0, -128, 0, 127, -1, 0, 1, 0][j % 8]),
        ];
        let q4 = [[0x00u8; 16], [0xff; 16], [0x0f; 16], [0xf0; 16]];
        let a8 = [[127i8; 32], [-127; 32], std::array::from_fn(|j| if j % 3 == 0 { -127 } else { 127 })];
        // Rows 0..4 and tokens 0..3 keep one pattern in every block, the
        // others change it from block to block.
        let split = |i: usize| (i / blocks, i % blocks);
        let w8: Vec<BlockQ8> = (0..rows * blocks)
            .map(split)
            .map(|(r, b)| BlockQ8 { d: f16::ONE, qs: q8[(r + b * (r / 4)) % q8.len()] })
            .collect();
        let w4: Vec<BlockQ4_0> = (0..rows * blocks)
            .map(split)
            .map(|(r, b)| BlockQ4_0 { d: f16::ONE, qs: q4[(r + b * (r / 4)) % q4.len()] })
            .collect();
        let xs: Vec<BlockA8> = (0..t * blocks)
            .map(split)
            .map(|(j, b)| {
                let qs = a8[(j + b * (j / 3)) % 3];
                BlockA8 { d: 1.0, sum: qs.iter().map(|&q| q as i32).sum(), qs }
            })
            .collect();
        let acts = Acts { blocks: &xs, tokens: t, per_token: blocks };
        for isa in kernels_here() {
            let (mut want, mut y) = (vec![0.0; t * rows], vec![f32::NAN; t * rows]);
            matmul_reference::<Int8>(&w8, &acts, &mut want);
            // Row 0 (all −128) against token 1 (all −127).
            assert_eq!(want[rows], (blocks * 32 * 128 * 127) as f32);
            matmul_rows::<Int8>(isa, &w8, 0..rows, &acts, &Out::new(&mut y, rows));
            assert_eq!(y, want, "{isa:?} int8");
            matmul_reference::<Q4_0>(&w4, &acts, &mut want);
            matmul_rows::<Q4_0>(isa, &w4, 0..rows, &acts, &Out::new(&mut y, rows));
            assert_eq!(y, want, "{isa:?} q4_0");
        }
    }
}
