//! Matrix-vector products: `W (rows, cols) @ x (cols,) -> y (rows,)`.
//!
//! This is the hot loop of decoding: one token reads every weight once, so a
//! mat-vec streams the matrix from memory exactly once and the speed of the
//! whole engine is the speed of this loop. Rows are split into one coarse,
//! contiguous share per thread of a [`ThreadPool`].

use crate::dot;
use crate::isa::Isa;
use crate::ops::silu_mul;
use crate::pool::{self, SharedMut, ThreadPool};
use crate::quant::{self, BlockA8, BlockQ4, BlockQ8, Format, QK};
use half::{bf16, f16};
use std::cell::RefCell;

/// Row-major weights in their stored precision.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
    /// INT8 blocks of 32 along each row ([`crate::quant`]).
    Q8(&'a [BlockQ8]),
    /// INT4 blocks of 32 along each row.
    Q4(&'a [BlockQ4]),
}

impl Weights<'_> {
    /// Number of weights.
    pub fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::Bf16(w) => w.len(),
            Weights::F16(w) => w.len(),
            Weights::Q8(w) => w.len() * QK,
            Weights::Q4(w) => w.len() * QK,
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of storage.
    pub fn bytes(&self) -> usize {
        match self {
            Weights::F32(w) => std::mem::size_of_val(*w),
            Weights::Bf16(w) => std::mem::size_of_val(*w),
            Weights::F16(w) => std::mem::size_of_val(*w),
            Weights::Q8(w) => std::mem::size_of_val(*w),
            Weights::Q4(w) => std::mem::size_of_val(*w),
        }
    }

    /// Whether the mat-vec runs on int8-quantized activations.
    pub fn is_quantized(&self) -> bool {
        matches!(self, Weights::Q8(_) | Weights::Q4(_))
    }
}

/// A borrowed matrix `(rows, cols)`, row-major.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub weights: Weights<'a>,
    pub rows: usize,
    pub cols: usize,
}

impl<'a> MatRef<'a> {
    /// Wraps `weights` as a `(rows, cols)` matrix. Panics if the sizes disagree:
    /// that is a bug in the caller, which validated shapes at load time.
    pub fn new(weights: Weights<'a>, rows: usize, cols: usize) -> Self {
        assert_eq!(weights.len(), rows * cols, "matrix data does not hold {rows}x{cols}");
        if weights.is_quantized() {
            assert!(cols.is_multiple_of(QK), "quantized rows are whole blocks of {QK}");
        }
        MatRef { weights, rows, cols }
    }

    /// Rows `start..end` as a matrix of their own.
    pub fn rows(&self, start: usize, end: usize) -> MatRef<'a> {
        let (a, b) = (start * self.cols, end * self.cols);
        let weights = match self.weights {
            Weights::F32(w) => Weights::F32(&w[a..b]),
            Weights::Bf16(w) => Weights::Bf16(&w[a..b]),
            Weights::F16(w) => Weights::F16(&w[a..b]),
            Weights::Q8(w) => Weights::Q8(&w[a / QK..b / QK]),
            Weights::Q4(w) => Weights::Q4(&w[a / QK..b / QK]),
        };
        MatRef { weights, rows: end - start, cols: self.cols }
    }

    /// Row `r` widened to f32 into `out (cols,)`: an embedding lookup.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        self.row_to_f32_with(Isa::active(), r, out)
    }

    /// [`MatRef::row_to_f32`] with the given tier (prefill widens every
    /// weight once per token block, so this runs at memory speed).
    pub fn row_to_f32_with(&self, isa: Isa, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        let s = r * self.cols..(r + 1) * self.cols;
        match self.weights {
            Weights::F32(w) => out.copy_from_slice(&w[s]),
            Weights::Bf16(w) => dot::widen_bf16(isa, &w[s], out),
            Weights::F16(w) => dot::widen_f16(isa, &w[s], out),
            Weights::Q8(_) | Weights::Q4(_) => self.rows(r, r + 1).row_to_f32_range_with(isa, 0..self.cols, out),
        }
    }

    /// Columns `cols` of row 0 widened to f32 into `out`; for quantized
    /// weights the range must be whole blocks.
    pub fn row_to_f32_range(&self, cols: std::ops::Range<usize>, out: &mut [f32]) {
        self.row_to_f32_range_with(Isa::active(), cols, out)
    }

    /// [`MatRef::row_to_f32_range`] with the given tier.
    pub fn row_to_f32_range_with(&self, isa: Isa, cols: std::ops::Range<usize>, out: &mut [f32]) {
        assert_eq!(out.len(), cols.len());
        match self.weights {
            Weights::F32(w) => out.copy_from_slice(&w[cols]),
            Weights::Bf16(w) => dot::widen_bf16(isa, &w[cols], out),
            Weights::F16(w) => dot::widen_f16(isa, &w[cols], out),
            Weights::Q8(w) => quant::Int8::dequantize(isa, &w[cols.start / QK..cols.end / QK], out),
            Weights::Q4(w) => quant::Int4::dequantize(isa, &w[cols.start / QK..cols.end / QK], out),
        }
    }

    /// `W[r] · x` with the given tier. `x (cols,)`; for quantized weights,
    /// `xq` is `x` quantized ([`quant::quantize_activations`]).
    #[inline]
    pub fn dot_row(&self, isa: Isa, r: usize, x: &[f32], xq: &[BlockA8]) -> f32 {
        let s = r * self.cols..(r + 1) * self.cols;
        let blocks = s.start / QK..s.end / QK;
        match self.weights {
            Weights::F32(w) => dot::dot_f32(isa, &w[s], x),
            Weights::Bf16(w) => dot::dot_bf16(isa, &w[s], x),
            Weights::F16(w) => dot::dot_f16(isa, &w[s], x),
            Weights::Q8(w) => quant::Int8::dot(isa, &w[blocks], xq),
            Weights::Q4(w) => quant::Int4::dot(isa, &w[blocks], xq),
        }
    }

    /// Bytes of weights this matrix streams per mat-vec.
    pub fn bytes(&self) -> usize {
        self.weights.bytes()
    }
}

thread_local! {
    /// The caller's quantized activations, reused across calls.
    static XQ: RefCell<Vec<BlockA8>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with `x` quantized to int8 blocks if any of `weights` needs it
/// (once per mat-vec, shared by all rows and threads), else with `&[]`.
fn with_quantized<R>(x: &[f32], weights: &[&Weights], f: impl FnOnce(&[BlockA8]) -> R) -> R {
    if weights.iter().any(|w| w.is_quantized()) {
        assert!(x.len().is_multiple_of(QK), "quantized weights need whole blocks of {QK} inputs");
        XQ.with(|buf| {
            let mut buf = buf.borrow_mut();
            buf.resize(x.len() / QK, BlockA8::ZERO);
            quant::quantize_activations(x, &mut buf);
            f(&buf)
        })
    } else {
        f(&[])
    }
}

/// `y = W @ x` on the calling thread with the given tier.
/// `w (rows, cols)`, `x (cols,)`, `y (rows,)`.
pub fn matvec_with(isa: Isa, w: MatRef, x: &[f32], y: &mut [f32]) {
    with_quantized(x, &[&w.weights], |xq| matvec_rows(isa, w, x, xq, y))
}

/// [`matvec_with`] with `x` already quantized when W is (`xq`).
fn matvec_rows(isa: Isa, w: MatRef, x: &[f32], xq: &[BlockA8], y: &mut [f32]) {
    assert_eq!(x.len(), w.cols, "x length");
    assert_eq!(y.len(), w.rows, "y length");
    let mut r = 0;
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        // Rows j, j+q, j+2q, j+3q together: x is loaded once for four rows,
        // and the four quarters of the matrix stream from memory at once,
        // which was measured to use the memory bus better than four adjacent
        // rows (one stream).
        let (q, c) = (w.rows / 4, w.cols);
        for j in 0..q {
            let idx = [j, j + q, j + 2 * q, j + 3 * q];
            // SAFETY: Avx2 is only chosen on CPUs that have it.
            let out = unsafe {
                match w.weights {
                    Weights::F32(m) => dot::avx2::rows4_f32(quad(m, c, idx), x),
                    Weights::Bf16(m) => dot::avx2::rows4_bf16(quad(m, c, idx), x),
                    Weights::F16(m) => dot::avx2::rows4_f16(quad(m, c, idx), x),
                    Weights::Q8(m) => quant::avx2::rows4_q8(quad(m, c / QK, idx), xq),
                    Weights::Q4(m) => quant::avx2::rows4_q4(quad(m, c / QK, idx), xq),
                }
            };
            for (i, v) in idx.into_iter().zip(out) {
                y[i] = v;
            }
        }
        r = 4 * q;
    }
    for (i, out) in y.iter_mut().enumerate().skip(r) {
        *out = w.dot_row(isa, i, x, xq);
    }
}

/// Rows `idx` of a row-major matrix with `c` columns.
#[cfg(target_arch = "x86_64")]
fn quad<T>(m: &[T], c: usize, idx: [usize; 4]) -> [&[T]; 4] {
    idx.map(|i| &m[i * c..(i + 1) * c])
}

/// Below this many weights a mat-vec stays on one thread: waking the pool
/// costs more than it saves.
const PARALLEL_MIN_WEIGHTS: usize = 1 << 15;

/// Rows of a thread's share start on a multiple of this (cache-line friendly
/// output writes).
const ROW_ALIGN: usize = 16;

fn threads_for(pool: &ThreadPool, weights: usize) -> usize {
    if weights < PARALLEL_MIN_WEIGHTS {
        1
    } else {
        pool.threads()
    }
}

/// `y = W @ x` with the active tier, rows split across the global pool.
/// `w (rows, cols)`, `x (cols,)`, `y (rows,)`.
pub fn matvec(w: MatRef, x: &[f32], y: &mut [f32]) {
    matvecs(pool::global(), x, [(w, y)]);
}

/// Several mat-vecs of the same input as one parallel section:
/// `y_i = W_i @ x` for each `(W_i (rows_i, cols), y_i (rows_i,))`.
///
/// The rows of all matrices are treated as one list and cut into one
/// contiguous share per thread, so q, k and v (896 + 128 + 128 rows) cost one
/// wake-up of the pool instead of three, and no thread idles on a small matrix.
pub fn matvecs<const N: usize>(pool: &ThreadPool, x: &[f32], jobs: [(MatRef, &mut [f32]); N]) {
    let isa = Isa::active();
    let mut total = 0;
    let mut weights = 0;
    for (w, y) in &jobs {
        assert_eq!(w.cols, x.len(), "x length");
        assert_eq!(w.rows, y.len(), "y length");
        total += w.rows;
        weights += w.rows * w.cols;
    }
    let jobs = jobs.map(|(w, y)| (w, SharedMut::new(y)));
    // An array, not a Vec: this runs for every mat-vec of every token.
    let all: [&Weights; N] = std::array::from_fn(|i| &jobs[i].0.weights);
    with_quantized(x, &all, |xq| {
        let work = |t: usize, n: usize| {
            let (a, b) = pool::share(total, t, n, ROW_ALIGN);
            let mut offset = 0;
            for (w, y) in &jobs {
                let (lo, hi) = (a.max(offset), b.min(offset + w.rows));
                if lo < hi {
                    // SAFETY: thread shares of the row list are disjoint.
                    let out = unsafe { y.range(lo - offset, hi - offset) };
                    matvec_rows(isa, w.rows(lo - offset, hi - offset), x, xq, out);
                }
                offset += w.rows;
            }
        };
        match threads_for(pool, weights) {
            1 => work(0, 1),
            _ => pool.run(work),
        }
    })
}

/// SwiGLU's first half in one pass: `out = silu(gate @ x) * (up @ x)`.
/// `gate`, `up (rows, cols)`, `x (cols,)`, `out (rows,)`. Each thread reads its
/// rows of both matrices, so the intermediate vectors are never written out.
pub fn matvec_swiglu(pool: &ThreadPool, gate: MatRef, up: MatRef, x: &[f32], out: &mut [f32]) {
    assert_eq!((gate.rows, gate.cols), (up.rows, up.cols), "gate and up shapes");
    assert_eq!(gate.cols, x.len(), "x length");
    assert_eq!(gate.rows, out.len(), "out length");
    let isa = Isa::active();
    let rows = gate.rows;
    let out = SharedMut::new(out);
    with_quantized(x, &[&gate.weights, &up.weights], |xq| {
        let work = |t: usize, n: usize| {
            let (a, b) = pool::share(rows, t, n, ROW_ALIGN);
            if a == b {
                return;
            }
            // SAFETY: thread shares are disjoint.
            let o = unsafe { out.range(a, b) };
            // Blocks of rows from each matrix in turn: both weight streams run
            // through the fast multi-row kernel (a row of gate, then a row of
            // up, took a third longer: it defeats the prefetching).
            let mut u = [0.0f32; SWIGLU_BLOCK];
            for (start, o) in (a..b).step_by(SWIGLU_BLOCK).zip(o.chunks_mut(SWIGLU_BLOCK)) {
                let end = start + o.len();
                let u = &mut u[..o.len()];
                matvec_rows(isa, gate.rows(start, end), x, xq, o);
                matvec_rows(isa, up.rows(start, end), x, xq, u);
                silu_mul(o, u);
            }
        };
        match threads_for(pool, 2 * rows * gate.cols) {
            1 => work(0, 1),
            _ => pool.run(work),
        }
    })
}

/// Rows of gate (then of up) processed together by [`matvec_swiglu`].
const SWIGLU_BLOCK: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::tests::{close, synth};

    fn reference(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
        (0..rows).map(|r| (0..cols).map(|c| w[r * cols + c] as f64 * x[c] as f64).sum::<f64>() as f32).collect()
    }

    #[test]
    fn matches_reference_for_every_dtype_and_tier() {
        for (rows, cols) in [(1, 1), (3, 5), (17, 33), (64, 896), (300, 257)] {
            let w = synth(rows * cols, rows as u64);
            let x = synth(cols, cols as u64);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let wb32: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            let wh32: Vec<f32> = wh.iter().map(|v| v.to_f32()).collect();
            let cases = [
                (Weights::F32(&w), reference(&w, rows, cols, &x)),
                (Weights::Bf16(&wb), reference(&wb32, rows, cols, &x)),
                (Weights::F16(&wh), reference(&wh32, rows, cols, &x)),
            ];
            for (weights, want) in cases {
                let m = MatRef::new(weights, rows, cols);
                for isa in Isa::supported() {
                    let mut y = vec![0.0; rows];
                    matvec_with(isa, m, &x, &mut y);
                    for (a, b) in y.iter().zip(&want) {
                        assert!(close(*a, *b, cols as f32), "{isa:?} {rows}x{cols}: {a} vs {b}");
                    }
                }
                // The threaded entry point gives the same numbers as one thread.
                let mut serial = vec![0.0; rows];
                matvec_with(Isa::active(), m, &x, &mut serial);
                let mut par = vec![0.0; rows];
                matvec(m, &x, &mut par);
                assert_eq!(serial, par);
            }
        }
    }

    #[test]
    fn quantized_matvec_matches_the_integer_reference() {
        use crate::quant::*;
        for (rows, cols) in [(1, 32), (7, 64), (64, 896), (301, 256)] {
            let w = synth(rows * cols, rows as u64 + 3);
            let x = synth(cols, 5);
            let mut xq = vec![BlockA8::ZERO; cols / QK];
            quantize_activations_scalar(&x, &mut xq);
            let (mut q8, mut q4) = (vec![BlockQ8::ZERO; rows * cols / QK], vec![BlockQ4::ZERO; rows * cols / QK]);
            quantize_q8_row(&w, &mut q8);
            quantize_q4_row(&w, &mut q4);
            let b = cols / QK;
            let want8: Vec<f32> = (0..rows).map(|r| dot_q8_scalar(&q8[r * b..(r + 1) * b], &xq)).collect();
            let want4: Vec<f32> = (0..rows).map(|r| dot_q4_scalar(&q4[r * b..(r + 1) * b], &xq)).collect();
            for (weights, want) in [(Weights::Q8(&q8), want8), (Weights::Q4(&q4), want4)] {
                let m = MatRef::new(weights, rows, cols);
                for isa in Isa::supported() {
                    let mut y = vec![0.0; rows];
                    matvec_with(isa, m, &x, &mut y);
                    for (a, b) in y.iter().zip(&want) {
                        assert!((a - b).abs() <= 1e-5 * cols as f32, "{isa:?} {rows}x{cols}: {a} vs {b}");
                    }
                }
                let (mut serial, mut par) = (vec![0.0; rows], vec![0.0; rows]);
                matvec_with(Isa::active(), m, &x, &mut serial);
                matvecs(&ThreadPool::new(3), &x, [(m, &mut par[..])]);
                assert_eq!(serial, par);
                // The fused gate/up form quantizes x once for both.
                let mut fused = vec![0.0; rows];
                matvec_swiglu(&ThreadPool::new(2), m, m, &x, &mut fused);
                for (f, s) in fused.iter().zip(&serial) {
                    assert!((f - crate::ops::silu(*s) * s).abs() <= 1e-6 * (1.0 + f.abs()));
                }
            }
        }
    }

    #[test]
    fn threaded_path_splits_rows_correctly() {
        // Large enough to take the parallel path, with a ragged last chunk.
        let (rows, cols) = (1001, 128);
        let w = synth(rows * cols, 7);
        let x = synth(cols, 8);
        let m = MatRef::new(Weights::F32(&w), rows, cols);
        let pool = ThreadPool::new(3);
        let mut par = vec![0.0; rows];
        matvecs(&pool, &x, [(m, &mut par[..])]);
        let mut serial = vec![0.0; rows];
        matvec_with(Isa::active(), m, &x, &mut serial);
        assert_eq!(serial, par);
    }

    #[test]
    fn fused_matvecs_equal_separate_ones() {
        let cols = 96;
        let shapes = [40, 8, 8];
        let ws: Vec<Vec<f32>> = shapes.iter().enumerate().map(|(i, &r)| synth(r * cols, 50 + i as u64)).collect();
        let x = synth(cols, 9);
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            let mats: Vec<MatRef> = ws.iter().zip(shapes).map(|(w, r)| MatRef::new(Weights::F32(w), r, cols)).collect();
            let (mut a, mut b, mut c) = (vec![0.0; 40], vec![0.0; 8], vec![0.0; 8]);
            // Below the parallel threshold and above it (by repeating columns).
            matvecs(&pool, &x, [(mats[0], &mut a[..]), (mats[1], &mut b[..]), (mats[2], &mut c[..])]);
            for (m, got) in mats.iter().zip([&a, &b, &c]) {
                let mut want = vec![0.0; m.rows];
                matvec_with(Isa::active(), *m, &x, &mut want);
                assert_eq!(&want, got);
            }
        }
        // Large enough to take the threaded path, with uneven matrices.
        let (cols, shapes) = (256, [300, 64, 64]);
        let ws: Vec<Vec<f32>> = shapes.iter().enumerate().map(|(i, &r)| synth(r * cols, 70 + i as u64)).collect();
        let x = synth(cols, 10);
        let mats: Vec<MatRef> = ws.iter().zip(shapes).map(|(w, r)| MatRef::new(Weights::F32(w), r, cols)).collect();
        let pool = ThreadPool::new(3);
        let (mut a, mut b, mut c) = (vec![0.0; 300], vec![0.0; 64], vec![0.0; 64]);
        matvecs(&pool, &x, [(mats[0], &mut a[..]), (mats[1], &mut b[..]), (mats[2], &mut c[..])]);
        for (m, got) in mats.iter().zip([&a, &b, &c]) {
            let mut want = vec![0.0; m.rows];
            matvec_with(Isa::active(), *m, &x, &mut want);
            assert_eq!(&want, got);
        }
    }

    #[test]
    fn swiglu_matches_separate_steps() {
        let (rows, cols) = (333, 200);
        let g = synth(rows * cols, 1);
        let u = synth(rows * cols, 2);
        let gb: Vec<bf16> = g.iter().map(|&v| bf16::from_f32(v)).collect();
        let ub: Vec<bf16> = u.iter().map(|&v| bf16::from_f32(v)).collect();
        let x = synth(cols, 3);
        let (gm, um) = (MatRef::new(Weights::Bf16(&gb), rows, cols), MatRef::new(Weights::Bf16(&ub), rows, cols));
        let (mut gy, mut uy) = (vec![0.0; rows], vec![0.0; rows]);
        matvec_with(Isa::active(), gm, &x, &mut gy);
        matvec_with(Isa::active(), um, &x, &mut uy);
        let want: Vec<f32> = gy.iter().zip(&uy).map(|(g, u)| crate::ops::silu(*g) * u).collect();
        for threads in [1, 2, 4] {
            let mut out = vec![0.0; rows];
            matvec_swiglu(&ThreadPool::new(threads), gm, um, &x, &mut out);
            assert_eq!(out, want);
        }
    }

    #[test]
    fn row_to_f32_widens_exactly() {
        let w: Vec<bf16> = [1.5f32, -2.0, 0.25, 8.0].iter().map(|&v| bf16::from_f32(v)).collect();
        let m = MatRef::new(Weights::Bf16(&w), 2, 2);
        let mut out = [0.0; 2];
        m.row_to_f32(1, &mut out);
        assert_eq!(out, [0.25, 8.0]);
    }
}
