//! Matrix-vector products: `W (rows, cols) @ x (cols,) -> y (rows,)`.
//!
//! This is the hot loop of decoding: one token reads every weight once, so a
//! mat-vec streams the matrix from memory exactly once and the speed of the
//! whole engine is the speed of this loop. Rows are split into one coarse chunk
//! per thread of the current rayon pool.

use crate::dot;
use crate::isa::Isa;
use half::{bf16, f16};
use rayon::prelude::*;

/// Row-major weights in their stored precision.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl Weights<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::Bf16(w) => w.len(),
            Weights::F16(w) => w.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes per element.
    pub fn elem_bytes(&self) -> usize {
        match self {
            Weights::F32(_) => 4,
            Weights::Bf16(_) | Weights::F16(_) => 2,
        }
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
        MatRef { weights, rows, cols }
    }

    /// Rows `start..end` as a matrix of their own.
    pub fn rows(&self, start: usize, end: usize) -> MatRef<'a> {
        let (a, b) = (start * self.cols, end * self.cols);
        let weights = match self.weights {
            Weights::F32(w) => Weights::F32(&w[a..b]),
            Weights::Bf16(w) => Weights::Bf16(&w[a..b]),
            Weights::F16(w) => Weights::F16(&w[a..b]),
        };
        MatRef { weights, rows: end - start, cols: self.cols }
    }

    /// Row `r` widened to f32 into `out (cols,)`: an embedding lookup.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        let s = r * self.cols..(r + 1) * self.cols;
        match self.weights {
            Weights::F32(w) => out.copy_from_slice(&w[s]),
            Weights::Bf16(w) => out.iter_mut().zip(&w[s]).for_each(|(o, v)| *o = v.to_f32()),
            Weights::F16(w) => out.iter_mut().zip(&w[s]).for_each(|(o, v)| *o = v.to_f32()),
        }
    }

    /// Bytes of weights this matrix streams per mat-vec.
    pub fn bytes(&self) -> usize {
        self.weights.len() * self.weights.elem_bytes()
    }
}

/// `y = W @ x` on the calling thread with the given tier.
/// `w (rows, cols)`, `x (cols,)`, `y (rows,)`.
pub fn matvec_with(isa: Isa, w: MatRef, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), w.cols, "x length");
    assert_eq!(y.len(), w.rows, "y length");
    let c = w.cols;
    match w.weights {
        Weights::F32(m) => {
            for (r, out) in y.iter_mut().enumerate() {
                *out = dot::dot_f32(isa, &m[r * c..(r + 1) * c], x);
            }
        }
        Weights::Bf16(m) => {
            for (r, out) in y.iter_mut().enumerate() {
                *out = dot::dot_bf16(isa, &m[r * c..(r + 1) * c], x);
            }
        }
        Weights::F16(m) => {
            for (r, out) in y.iter_mut().enumerate() {
                *out = dot::dot_f16(isa, &m[r * c..(r + 1) * c], x);
            }
        }
    }
}

/// Below this many weights a mat-vec stays on one thread: waking the pool
/// costs more than it saves.
const PARALLEL_MIN_WEIGHTS: usize = 1 << 16;

/// `y = W @ x` with the active tier, rows split across the current rayon pool.
/// `w (rows, cols)`, `x (cols,)`, `y (rows,)`.
pub fn matvec(w: MatRef, x: &[f32], y: &mut [f32]) {
    let isa = Isa::active();
    let threads = rayon::current_num_threads();
    if threads <= 1 || w.rows * w.cols < PARALLEL_MIN_WEIGHTS {
        return matvec_with(isa, w, x, y);
    }
    // One coarse chunk per thread, rounded to a multiple of 8 rows.
    let chunk = w.rows.div_ceil(threads).next_multiple_of(8).max(8);
    y.par_chunks_mut(chunk).enumerate().for_each(|(i, ys)| {
        let start = i * chunk;
        matvec_with(isa, w.rows(start, start + ys.len()), x, ys);
    });
}

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
    fn threaded_path_splits_rows_correctly() {
        // Large enough to take the parallel path, with a ragged last chunk.
        let (rows, cols) = (1001, 128);
        let w = synth(rows * cols, 7);
        let x = synth(cols, 8);
        let m = MatRef::new(Weights::F32(&w), rows, cols);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let mut par = vec![0.0; rows];
        pool.install(|| matvec(m, &x, &mut par));
        let mut serial = vec![0.0; rows];
        matvec_with(Isa::active(), m, &x, &mut serial);
        assert_eq!(serial, par);
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
