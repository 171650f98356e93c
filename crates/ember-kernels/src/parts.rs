//! Matrices stored in column parts, for mat-vecs whose f32 activations do
//! not fit in L1 beside the weights streaming past them.
//!
//! A mat-vec over float weights reads `x (cols,)` once for every four rows
//! ([`crate::matvec`](mod@crate::matvec)), from L1 if it is still there. Between two uses of a
//! line of `x`, the four row streams bring in `4 × cols × weight bytes` of
//! weights, and the rest of `x` comes in too: for Qwen2.5-0.5B's down
//! projection in BF16 (4864 columns) that is 38 KB of weights and 19 KB of
//! activations, more than a 32 KB L1, so `x` is evicted by the weights and
//! read again from L2 for every four rows. The product then runs at 57–63%
//! of the machine's read bandwidth where the others run at 83–88% (Zen 4,
//! 2 threads, `ember bench --phases`); with loads of `x` confined to 8 KB
//! (a wrong answer, as an experiment), down ran at 90–91% on one thread.
//!
//! Cutting each row into column blocks at run time broke the weights'
//! streams (42–45%: the prefetchers overshoot every block's end). What
//! works is to store the matrix as `parts` column blocks, each a row-major
//! matrix of its own, one after another: `W = [W_0 | W_1 | … ]`, and
//! `W @ x = Σ_k W_k @ x_k`. Each part streams as one long matrix and its
//! slice of `x` stays in L1. Measured on Zen 4 (2 cores, `avx512bf16`),
//! BF16 down as 4 parts of 1216 columns, one thread: 57–58% → 84–86% of
//! the read ceiling; 2 parts: 61–78%.
//!
//! [`parts_for`] is the layout policy (float weights whose f32 activations
//! exceed [`PART_X_BYTES`]); the model stores such matrices split when it
//! copies its weights into memory of its own, and [`matvec_parts`] and
//! [`matmul_parts`] compute with either layout. The sums of parts add in a
//! different order than a whole row's, so a split matrix gives results
//! within f32 rounding of the row-major one, not the same bits.

use crate::formats::{with_weights, Format, MatRef, WeightType, Weights};
use crate::matmul::{dot_parts, matmul, ColumnBlock, Precision};
use crate::matvec::matvecs;
use crate::pool::ThreadPool;
use std::cell::RefCell;
use std::ops::Range;

/// The most bytes of f32 activations a part's mat-vec reads: 6 KB leaves
/// room in a 32 KB L1 (Zen 3/4; 48 KB on recent Intel cores) for the four
/// row streams of weights between two uses of the same line of `x`.
pub const PART_X_BYTES: usize = 6 << 10;

/// Parts start on multiples of this many columns (whole cache lines of
/// every float type, whole steps of every tier's kernels).
pub const PART_ALIGN: usize = 64;

/// How many column parts a `(·, cols)` matrix of type `ty` is best stored in
/// for decoding: 1 (row-major) for quantized types, whose int8 activations
/// are a quarter of f32's, and for float matrices whose f32 activations fit
/// in [`PART_X_BYTES`]; otherwise enough parts that each one's do.
pub fn parts_for(ty: WeightType, cols: usize) -> usize {
    if !ty.is_float() || cols < 2 * PART_ALIGN {
        return 1;
    }
    (cols * 4).div_ceil(PART_X_BYTES).min(cols / PART_ALIGN)
}

/// The columns of part `k` of `parts` of a `cols`-column matrix: boundaries
/// at `k * cols / parts` rounded up to [`PART_ALIGN`], the last part taking
/// the rest. Panics unless `parts` is between 1 and `cols / PART_ALIGN` (or
/// 1), so that every part has columns.
pub fn part_range(cols: usize, parts: usize, k: usize) -> Range<usize> {
    assert!(parts == 1 || (parts >= 1 && parts * PART_ALIGN <= cols), "{parts} parts of {cols} columns");
    assert!(k < parts, "part {k} of {parts}");
    let bound = |k: usize| if k >= parts { cols } else { (k * cols / parts).next_multiple_of(PART_ALIGN).min(cols) };
    bound(k)..bound(k + 1)
}

/// A borrowed matrix `(rows, cols)` stored as `parts` column parts
/// ([`part_range`]), one after another, each row-major: part `k` is the
/// `(rows, range_k.len())` matrix of columns `range_k`. One part is the
/// plain row-major matrix.
#[derive(Clone, Copy, Debug)]
pub struct ColumnParts<'a> {
    weights: Weights<'a>,
    rows: usize,
    cols: usize,
    parts: usize,
}

impl<'a> ColumnParts<'a> {
    /// Wraps `weights` stored as `parts` column parts of a `(rows, cols)`
    /// matrix. Panics if the sizes disagree or a part is not whole blocks of
    /// the type: a bug in the caller, which laid the parts out.
    pub fn new(weights: Weights<'a>, rows: usize, cols: usize, parts: usize) -> Self {
        assert_eq!(weights.len(), rows * cols, "matrix data does not hold {rows}x{cols}");
        let block = weights.ty().block_len();
        for k in 0..parts {
            let r = part_range(cols, parts, k);
            assert!(r.start.is_multiple_of(block) && r.end.is_multiple_of(block), "part {k} is whole blocks");
        }
        ColumnParts { weights, rows, cols, parts }
    }

    /// Rows (outputs of a product).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (inputs of a product).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// How many parts.
    pub fn parts(&self) -> usize {
        self.parts
    }

    /// Part `k`: its columns, and the matrix of them.
    pub fn part(&self, k: usize) -> (Range<usize>, MatRef<'a>) {
        let r = part_range(self.cols, self.parts, k);
        let block = self.weights.ty().block_len();
        let (start, end) = (self.rows * r.start / block, self.rows * r.end / block);
        let weights = with_weights!(self.weights, |F, d| F::wrap(&d[start..end]));
        (r.clone(), MatRef::new(weights, self.rows, r.len()))
    }

    /// Row `r` widened to f32 into `out (cols,)`.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols, "out length");
        for k in 0..self.parts {
            let (c, m) = self.part(k);
            m.row_to_f32(r, &mut out[c]);
        }
    }

    /// Bytes of weights a mat-vec streams.
    pub fn bytes(&self) -> usize {
        self.weights.bytes()
    }
}

/// Lays the row-major `(rows, cols)` matrix `src` (bytes of type `ty`) out
/// as `parts` column parts ([`ColumnParts`]) in `dst`, as many bytes.
/// Panics if the sizes disagree.
pub fn split_columns(ty: WeightType, rows: usize, cols: usize, parts: usize, src: &[u8], dst: &mut [u8]) {
    check_sizes(ty, rows, cols, src, dst);
    for (row_major, parted) in part_rows(ty, rows, cols, parts) {
        dst[parted].copy_from_slice(&src[row_major]);
    }
}

/// The inverse of [`split_columns`]: the `parts` column parts `src` laid
/// back out row-major in `dst`.
pub fn join_columns(ty: WeightType, rows: usize, cols: usize, parts: usize, src: &[u8], dst: &mut [u8]) {
    check_sizes(ty, rows, cols, src, dst);
    for (row_major, parted) in part_rows(ty, rows, cols, parts) {
        dst[row_major].copy_from_slice(&src[parted]);
    }
}

fn check_sizes(ty: WeightType, rows: usize, cols: usize, src: &[u8], dst: &[u8]) {
    assert_eq!(src.len(), rows * cols / ty.block_len() * ty.block_bytes(), "source size");
    assert_eq!(dst.len(), src.len(), "destination size");
}

/// Each part's rows, part by part: the bytes of one row's columns of the
/// part in the row-major layout, and the same bytes in the parts layout.
fn part_rows(
    ty: WeightType,
    rows: usize,
    cols: usize,
    parts: usize,
) -> impl Iterator<Item = (Range<usize>, Range<usize>)> {
    let bytes = move |c: usize| c / ty.block_len() * ty.block_bytes();
    (0..parts).flat_map(move |k| {
        let c = part_range(cols, parts, k);
        let (start, len) = (bytes(c.start), bytes(c.len()));
        (0..rows).map(move |r| {
            let row_major = r * bytes(cols) + start;
            let parted = rows * start + r * len;
            (row_major..row_major + len, parted..parted + len)
        })
    })
}

/// `y = W @ x` over a matrix in column parts, rows split across `pool` in
/// one parallel section: the parts' rows are handed out as one list, each
/// part's products go to `y` (the first) or a sum of the caller's
/// (reused), added to `y` at the end. `w (rows, cols)`, `x (cols,)`,
/// `y (rows,)`.
///
/// One section, rather than a mat-vec per part each adding to `y`: on Zen 4
/// (2 threads, a harness alternating them over 24 matrices of
/// down's shape), 0.83–0.91 of a read of the same bytes where the memory
/// read 48–57 GB/s, against 0.75–0.81 a part at a time (0.65–0.73 row-major);
/// a part at a time, every part ended with both threads waiting for the
/// slower one. Each thread taking a fixed share through all parts did as
/// well on a quiet machine, 0.67 when a neighbour slowed one thread.
pub fn matvec_parts(pool: &ThreadPool, w: ColumnParts, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), w.cols, "x length");
    if w.parts == 1 {
        return matvecs(pool, x, [(w.part(0).1, y)]);
    }
    PART_Y.with(|sums| {
        let mut sums = sums.borrow_mut();
        sums.resize((w.parts - 1) * w.rows, 0.0);
        crate::matvec::matvec_in_parts(pool, w, x, y, &mut sums)
    })
}

thread_local! {
    /// The caller's columns of `X` for one part, reused across calls.
    static PART_X: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The caller's product of one part, reused across calls.
    static PART_Y: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `Y (T, rows) = X (T, cols) @ Wᵀ` over a matrix in column parts. BF16
/// parts for 2 to 8 tokens at fast precision on a tier with `vdpbf16ps`
/// (a few sequences decoding together) are one parallel section, the parts
/// the column blocks of the row-streaming kernel (`matmul::dot_parts`);
/// otherwise each part's columns of `X` are gathered and multiplied by
/// [`matmul`], and the products summed into `y`. One part is [`matmul`]
/// itself.
///
/// Zen 4, 2 threads, 8 sequences decoding together (BF16, `ember bench -p
/// 0 -n 32 -r 2 --sequences 1,8,16`, four alternations): 205–209 tok/s a
/// part at a time, 204–237 in one section (medians 206 and 220).
pub fn matmul_parts(pool: &ThreadPool, precision: Precision, w: ColumnParts, x: &[f32], y: &mut [f32]) {
    let t = x.len() / w.cols;
    assert_eq!(x.len(), t * w.cols, "x is (T, cols)");
    assert_eq!(y.len(), t * w.rows, "y is (T, rows)");
    if w.parts == 1 {
        return matmul(pool, precision, w.part(0).1, x, y);
    }
    if let Weights::Bf16(_) = w.weights {
        let parts: Vec<ColumnBlock> = (0..w.parts)
            .map(|k| match w.part(k) {
                (c, MatRef { weights: Weights::Bf16(v), .. }) => ColumnBlock::part(v, c),
                _ => unreachable!("the parts of a BF16 matrix are BF16"),
            })
            .collect();
        let whole = MatRef::new(w.weights, w.rows, w.cols);
        if dot_parts(pool, precision, &whole, &parts, x, y) {
            return;
        }
    }
    PART_X.with(|xs| {
        PART_Y.with(|ys| {
            let (mut xs, mut ys) = (xs.borrow_mut(), ys.borrow_mut());
            for k in 0..w.parts {
                let (c, m) = w.part(k);
                xs.clear();
                for row in x.chunks_exact(w.cols) {
                    xs.extend_from_slice(&row[c.clone()]);
                }
                if k == 0 {
                    matmul(pool, precision, m, &xs, y);
                    continue;
                }
                ys.resize(y.len(), 0.0);
                matmul(pool, precision, m, &xs, &mut ys);
                y.iter_mut().zip(ys.iter()).for_each(|(a, b)| *a += b);
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{bf16, f16};
    use crate::matmul::matmul_scalar;
    use crate::testutil::synth;

    #[test]
    fn policy_splits_float_matrices_with_big_activations() {
        assert_eq!(parts_for(WeightType::Bf16, 4864), 4);
        assert_eq!(parts_for(WeightType::F32, 4864), 4);
        assert_eq!(parts_for(WeightType::Bf16, 896), 1);
        assert_eq!(parts_for(WeightType::Bf16, 1536), 1);
        assert_eq!(parts_for(WeightType::Bf16, 1600), 2);
        assert_eq!(parts_for(WeightType::Int8, 4864), 1);
        assert_eq!(parts_for(WeightType::Int4, 18944), 1);
        for cols in (64..20000).step_by(64) {
            let parts = parts_for(WeightType::F16, cols);
            let ranges: Vec<_> = (0..parts).map(|k| part_range(cols, parts, k)).collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[parts - 1].end, cols);
            for (k, r) in ranges.iter().enumerate() {
                assert!(!r.is_empty() && r.start.is_multiple_of(PART_ALIGN), "{cols}: {r:?}");
                assert!(r.len() * 4 <= PART_X_BYTES || parts == 1, "{cols}: part {k} {r:?}");
                if k > 0 {
                    assert_eq!(ranges[k - 1].end, r.start);
                }
            }
        }
    }

    /// Products of a few tokens over BF16 parts at fast precision (one
    /// section over the parts as column blocks where `vdpbf16ps` runs, the
    /// panels part by part from 9 tokens on) round the activations as the
    /// row-major product does, so they agree with it up to the order of the
    /// f32 sums; odd rows, a ragged last chunk of 32 columns.
    #[test]
    fn bf16_parts_at_fast_precision_match_the_row_major_product() {
        let (rows, cols) = (37, 1000);
        let w16: Vec<bf16> = synth(rows * cols, 3).iter().map(|&v| bf16::from_f32(v)).collect();
        let whole = MatRef::new(Weights::Bf16(&w16), rows, cols);
        let pool = ThreadPool::new(2);
        for parts in [2, 4, 15] {
            let mut bytes = vec![0u8; whole.bytes()];
            split_columns(WeightType::Bf16, rows, cols, parts, whole.weights.as_bytes(), &mut bytes);
            let split: Vec<bf16> =
                bytemuck::cast_slice::<u8, u16>(&bytes).iter().map(|&b| bf16::from_bits(b)).collect();
            let w = ColumnParts::new(Weights::Bf16(&split), rows, cols, parts);
            for t in [2, 3, 5, 8, 9] {
                let x = synth(t * cols, 4 + t as u64);
                let (mut want, mut y) = (vec![0.0f32; t * rows], vec![f32::NAN; t * rows]);
                matmul(&pool, Precision::Fast, whole, &x, &mut want);
                matmul_parts(&pool, Precision::Fast, w, &x, &mut y);
                // Sums of 1000 products of up to ~30 in all, added in
                // another order: within f32 rounding of each other (on the
                // scalar tier the fast path is exact f32, and a sum near
                // zero differs by ~1e-5 between the orders). A part missed,
                // or read at the wrong columns, is off by whole units.
                approx::assert_relative_eq!(&y[..], &want[..], max_relative = 1e-5, epsilon = 1e-4);
            }
        }
    }

    #[test]
    fn parts_compute_the_row_major_product() {
        let (rows, cols) = (37, 640);
        let wf = synth(rows * cols, 1);
        let x = synth(3 * cols, 2);
        let w16: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
        let h16: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
        let pool = ThreadPool::new(2);
        for whole in [
            MatRef::new(Weights::F32(&wf), rows, cols),
            MatRef::new(Weights::Bf16(&w16), rows, cols),
            MatRef::new(Weights::F16(&h16), rows, cols),
        ] {
            let ty = whole.weights.ty();
            let mut want = vec![0.0f32; 3 * rows];
            matmul_scalar(whole, &x, &mut want);
            for parts in [1, 2, 3, 10] {
                let mut bytes = vec![0u8; whole.bytes()];
                split_columns(ty, rows, cols, parts, whole.weights.as_bytes(), &mut bytes);
                let aligned: Vec<u32> =
                    bytes.chunks_exact(4).map(|c| u32::from_ne_bytes(c.try_into().unwrap())).collect();
                let w = ColumnParts::new(
                    Weights::from_bytes(ty, bytemuck::cast_slice(&aligned)).unwrap(),
                    rows,
                    cols,
                    parts,
                );
                let mut row = vec![0.0f32; cols];
                let mut want_row = vec![0.0f32; cols];
                for r in [0, 17, rows - 1] {
                    w.row_to_f32(r, &mut row);
                    whole.row_to_f32(r, &mut want_row);
                    assert_eq!(row, want_row, "{ty} {parts} parts, row {r}");
                }
                let mut y = vec![f32::NAN; rows];
                matvec_parts(&pool, w, &x[..cols], &mut y);
                approx::assert_relative_eq!(&y[..], &want[..rows], max_relative = 1e-4, epsilon = 1e-4);
                for precision in [Precision::Exact, Precision::Fast] {
                    let mut y = vec![f32::NAN; 3 * rows];
                    matmul_parts(&pool, precision, w, &x, &mut y);
                    let tol = if precision == Precision::Exact || ty == WeightType::F32 { 1e-4 } else { 3e-2 };
                    approx::assert_relative_eq!(&y[..], &want[..], max_relative = tol, epsilon = tol);
                }
            }
        }
    }
}
