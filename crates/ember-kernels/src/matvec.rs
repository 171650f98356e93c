//! Matrix-vector products: `W (rows, cols) @ x (cols,) -> y (rows,)`.
//!
//! This is the hot loop of decoding: one token reads every weight once, so a
//! mat-vec streams the matrix from memory exactly once and the speed of the
//! whole engine is the speed of this loop. Rows are split into one coarse,
//! contiguous share per thread of a [`ThreadPool`].

use crate::cpu::{prefetch, Cache, Isa};
use crate::formats::{
    quads_of, quantize_activations, quantize_activations_k, with_weights, ActType, Activation, Acts, BlockA8, BlockA8K,
    BlockA8x4, Format, MatRef, PREFETCH_AHEAD, QK_A8, QK_A8K,
};
use crate::ops::silu_mul_with;
use crate::pool::{self, Chunks, SharedMut, ThreadPool};
use std::cell::RefCell;

thread_local! {
    /// The caller's int8 activations, reused across calls.
    static XQ: RefCell<Vec<BlockA8>> = const { RefCell::new(Vec::new()) };
    /// The caller's 256-wide int8 activations (K rows), reused across calls.
    static XQK: RefCell<Vec<BlockA8K>> = const { RefCell::new(Vec::new()) };
    /// The caller's int8 activations four blocks at a time, reused across calls.
    static XQ4: RefCell<Vec<BlockA8x4>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with `x` in every activation format some matrix of `mats` reads:
/// quantized once per mat-vec, shared by all rows and threads.
fn with_acts<R>(isa: Isa, x: &[f32], mats: &[MatRef], f: impl FnOnce(&Acts) -> R) -> R {
    let wants = |t: ActType| mats.iter().any(|m| m.weights.ty().act() == t);
    let (a8, a8k) = (wants(ActType::A8), wants(ActType::A8K));
    let quads = mats.iter().any(|m| m.weights.ty().reads_quads(isa.tier()));
    if a8 {
        assert!(x.len().is_multiple_of(QK_A8), "int8 activations are whole blocks of {QK_A8}");
    }
    if a8k {
        assert!(x.len().is_multiple_of(QK_A8K), "K activations are whole blocks of {QK_A8K}");
    }
    let blocks = |q: usize| x.len() / q;
    with_buffer(
        &XQ,
        a8,
        blocks(QK_A8),
        BlockA8::ZERO,
        |b| quantize_activations(isa, x, b),
        |a8| {
            with_buffer(
                &XQK,
                a8k,
                blocks(QK_A8K),
                BlockA8K::ZERO,
                |b| quantize_activations_k(isa, x, b),
                |a8k| {
                    if !quads {
                        return f(&Acts { f32: x, a8, a8k, a8x4: &[] });
                    }
                    XQ4.with(|buf| {
                        let mut buf = buf.borrow_mut();
                        quads_of(a8, &mut buf);
                        f(&Acts { f32: x, a8, a8k, a8x4: &buf })
                    })
                },
            )
        },
    )
}

/// Runs `f` with `n` blocks filled by `fill` in the thread's buffer `key`,
/// or with no blocks (and no borrow) when not `wanted`.
fn with_buffer<T: Copy + 'static, R>(
    key: &'static std::thread::LocalKey<RefCell<Vec<T>>>,
    wanted: bool,
    n: usize,
    zero: T,
    fill: impl FnOnce(&mut [T]),
    f: impl FnOnce(&[T]) -> R,
) -> R {
    if !wanted {
        return f(&[]);
    }
    key.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.resize(n, zero);
        fill(&mut buf);
        f(&buf)
    })
}

/// `y = W @ x` on the calling thread with the given tier.
/// `w (rows, cols)`, `x (cols,)`, `y (rows,)`.
pub fn matvec_with(isa: Isa, w: MatRef, x: &[f32], y: &mut [f32]) {
    with_acts(isa, x, &[w], |acts| matvec_rows(isa, w, acts, y))
}

/// Rows `rows` of `Y (T, ·) = X @ Wᵀ` for a few tokens on the calling
/// thread: a block of rows at a time (about [`FEW_BLOCK_BYTES`]), each
/// token's mat-vec over it, so the weights come from memory once, for the
/// first token, and from L2 for the others. `x (T, cols)`, `acts` its int8
/// activations as [`crate::gemm_int8::prepare`] quantizes them (with
/// [`quantize_activations`], as a mat-vec does), so each token gets the
/// bits its own mat-vec gives; `w` a type read by them.
pub(crate) fn each_token_rows(
    isa: Isa,
    w: MatRef,
    rows: std::ops::Range<usize>,
    x: &[f32],
    acts: &crate::gemm_int8::Acts,
    out: &crate::matmul::Out,
) {
    let cols = w.cols;
    assert_eq!(w.weights.ty().act(), ActType::A8, "int8 activations");
    assert_eq!(x.len(), acts.tokens() * cols, "x is (T, cols)");
    let row_bytes = (w.bytes() / w.rows.max(1)).max(1);
    let block = (FEW_BLOCK_BYTES / row_bytes).next_multiple_of(ROW_ALIGN);
    for r0 in rows.clone().step_by(block) {
        let r1 = (r0 + block).min(rows.end);
        let wb = w.rows(r0, r1);
        for i in 0..acts.tokens() {
            let a = Acts { f32: &x[i * cols..(i + 1) * cols], a8: acts.token(i), a8k: &[], a8x4: &[] };
            // SAFETY: the calling thread owns rows `rows` of every token's
            // output.
            let y = unsafe { out.data.range(i * out.stride + r0, i * out.stride + r1) };
            matvec_rows(isa, wb, &a, y);
        }
    }
}

/// Bytes of weights [`each_token_rows`] takes at a time: they stay in L2
/// (2 MiB a core on the Xeons measured, 1 MiB on Zen 4, 512 KiB on Zen 3)
/// while every token passes.
const FEW_BLOCK_BYTES: usize = 256 << 10;

/// [`matvec_with`] with the activations prepared.
fn matvec_rows(isa: Isa, w: MatRef, acts: &Acts, y: &mut [f32]) {
    assert_eq!(acts.f32.len(), w.cols, "x length");
    assert_eq!(y.len(), w.rows, "y length");
    with_weights!(w.weights, |F, data| rows_of::<F>(isa, data, w.cols, <F as Format>::Act::pick(acts), acts.a8x4, y))
}

/// `y = W @ x` for one weight type: the hot loop of decoding.
///
/// Rows j, j+q, j+2q, j+3q go together: x is loaded once for four rows, and
/// the four quarters of the matrix stream from memory at once, which was
/// measured to use the memory bus better than four adjacent rows (one
/// stream). `data (rows * cols / BLOCK_LEN,)`, `x` in the row's activation
/// format, `quads` the same four blocks at a time where the tier's kernel
/// reads them ([`crate::formats::Kernels::rows4_quads`]; empty otherwise).
fn rows_of<F: Format>(isa: Isa, data: &[F::Block], cols: usize, x: &[F::Act], quads: &[BlockA8x4], y: &mut [f32]) {
    let rows = y.len();
    let per_row = cols / F::BLOCK_LEN;
    assert_eq!(data.len(), rows * per_row, "matrix size");
    let k = RowKernels::<F>::new(isa, per_row, x, quads);
    let q = rows / 4;
    let row = |i: usize| &data[i * per_row..(i + 1) * per_row];
    if q > 0 {
        warm_streams([0, q, 2 * q, 3 * q].map(|i| &data[i * per_row..(i + q) * per_row]));
    }
    for j in 0..q {
        let idx = [j, j + q, j + 2 * q, j + 3 * q];
        for (i, v) in idx.into_iter().zip(k.four(idx.map(row))) {
            y[i] = v;
        }
    }
    for (i, out) in y.iter_mut().enumerate().skip(4 * q) {
        *out = k.one(row(i));
    }
}

/// Prefetches into L1 the first [`PREFETCH_AHEAD`] bytes of each of four
/// row streams (at most their length) when a run of rows starts. The INT8
/// and INT4 kernels prefetch that far ahead as they go, so without it the
/// first stretch of every stream is read on demand (a small section's share
/// starts three runs, q, k and v; a big product's guided chunks each start
/// one). Emerald Rapids with AMX, 2 threads, `ember bench -p 0 -n 64 -r 5`
/// with and without, alternated: INT4 tg64 20 pairs, median ratio 1.015
/// (ahead in 12), shares of read 92% vs 91.5%; INT8 5 pairs 1.035; BF16 4
/// pairs 1.00 (its kernels prefetch 4 KB ahead). Small, but never behind
/// over the pairs' medians.
#[inline]
fn warm_streams<T: bytemuck::Pod>(streams: [&[T]; 4]) {
    for s in streams {
        let bytes: &[u8] = bytemuck::cast_slice(s);
        prefetch(&bytes[..bytes.len().min(PREFETCH_AHEAD)], Cache::L1);
    }
}

/// A tier's row kernels for one weight type, bound to the activations of
/// one mat-vec: safe to call with rows of `per_row` blocks (checked). Made
/// only from an [`Isa`], the proof that the CPU has the tier's features.
struct RowKernels<'a, F: Format> {
    kernels: crate::formats::Kernels<F>,
    /// The tier's four-row kernel over `quads`, where it has one and the
    /// activations were laid out for it ([`crate::formats::Kernels::rows4_quads`]).
    rows4_quads: Option<crate::formats::Rows4QuadsKernel<F>>,
    per_row: usize,
    x: &'a [F::Act],
    /// `x` four blocks at a time (empty where no kernel reads them).
    quads: &'a [BlockA8x4],
}

impl<'a, F: Format> RowKernels<'a, F> {
    fn new(isa: Isa, per_row: usize, x: &'a [F::Act], quads: &'a [BlockA8x4]) -> Self {
        assert_eq!(per_row * F::BLOCK_LEN, x.len() * F::Act::BLOCK_LEN, "x length");
        let kernels = F::kernels(isa.tier());
        let rows4_quads = kernels.rows4_quads.filter(|_| !quads.is_empty());
        if rows4_quads.is_some() {
            assert_eq!(quads.len(), (per_row * F::BLOCK_LEN).div_ceil(4 * crate::formats::QK_A8), "quads length");
        }
        RowKernels { kernels, rows4_quads, per_row, x, quads }
    }

    /// Four rows against the activations.
    #[inline]
    fn four(&self, rows: [&[F::Block]; 4]) -> [f32; 4] {
        assert!(rows.iter().all(|r| r.len() == self.per_row), "row length");
        // SAFETY: the kernels are those of an `Isa`'s tier (the CPU has its
        // features); every row has `per_row` blocks, matching x and quads
        // (checked).
        unsafe {
            match self.rows4_quads {
                Some(kernel) => kernel(rows, self.quads),
                None => (self.kernels.rows4)(rows, self.x),
            }
        }
    }

    /// One row against the activations.
    #[inline]
    fn one(&self, row: &[F::Block]) -> f32 {
        assert_eq!(row.len(), self.per_row, "row length");
        // SAFETY: as in `four`.
        unsafe { (self.kernels.dot)(row, self.x) }
    }
}

/// Below this many weights a mat-vec stays on one thread: waking the pool
/// costs more than it saves.
const PARALLEL_MIN_WEIGHTS: usize = 1 << 15;

/// Chunks of rows start on a multiple of this (cache-line friendly output
/// writes).
const ROW_ALIGN: usize = 16;

/// The shortest chunk of rows a thread takes ([`Chunks`]): long enough for
/// the four memory streams of [`rows_of`] to get going.
const MIN_CHUNK: usize = 64;

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

/// `y = W @ x` over a matrix stored in column parts, as one parallel
/// section: the parts' rows are one list handed out in guided [`Chunks`]
/// (as [`matvecs`] does with several matrices), part 0's products written
/// to `y` and part k's to row k-1 of `sums (parts - 1, rows)`, which are
/// added to `y` when all are done. No thread waits for another between
/// parts, and a thread slowed by the machine's neighbours hands rows over.
/// `w (rows, cols)` of a float type, `x (cols,)`, `y (rows,)`.
pub(crate) fn matvec_in_parts(
    pool: &ThreadPool,
    w: crate::parts::ColumnParts,
    x: &[f32],
    y: &mut [f32],
    sums: &mut [f32],
) {
    let (rows, parts) = (w.rows(), w.parts());
    assert_eq!(x.len(), w.cols(), "x length");
    assert_eq!(y.len(), rows, "y length");
    assert_eq!(sums.len(), (parts - 1) * rows, "sums length");
    assert!(w.part(0).1.weights.ty().is_float(), "f32 activations");
    let isa = Isa::active();
    let threads = threads_for(pool, rows * w.cols());
    let chunks = Chunks::new(parts * rows, threads, ROW_ALIGN, MIN_CHUNK);
    {
        let (y, sums) = (SharedMut::new(&mut *y), SharedMut::new(&mut *sums));
        let work = |_t: usize, _n: usize| {
            while let Some(r) = chunks.next_chunk() {
                for k in 0..parts {
                    let (lo, hi) = (r.start.max(k * rows), r.end.min((k + 1) * rows));
                    if lo >= hi {
                        continue;
                    }
                    let (c, m) = w.part(k);
                    let acts = Acts { f32: &x[c], a8: &[], a8k: &[], a8x4: &[] };
                    // SAFETY: chunks of the row list are disjoint, and part
                    // k's rows are `y`'s (k = 0) or row k-1 of `sums`.
                    let out = unsafe {
                        match k {
                            0 => y.range(lo, hi),
                            _ => sums.range(lo - rows, hi - rows),
                        }
                    };
                    matvec_rows(isa, m.rows(lo - k * rows, hi - k * rows), &acts, out);
                }
            }
        };
        match threads {
            1 => work(0, 1),
            _ => pool.run(work),
        }
    }
    for s in sums.chunks_exact(rows) {
        y.iter_mut().zip(s).for_each(|(a, b)| *a += b);
    }
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
    let all: [MatRef; N] = std::array::from_fn(|i| jobs[i].0);
    let threads = threads_for(pool, weights);
    let bytes: usize = all.iter().map(|w| w.bytes()).sum();
    let shares = bytes < SMALL_SECTION_BYTES;
    let chunks = Chunks::new(total, threads, ROW_ALIGN, MIN_CHUNK);
    with_acts(isa, x, &all, |acts| {
        let work = |t: usize, n: usize| {
            let mut share = shares.then(|| byte_share(&all, t, n));
            while let Some(r) = if shares { share.take() } else { chunks.next_chunk() } {
                let mut offset = 0;
                for (w, y) in &jobs {
                    let (lo, hi) = (r.start.max(offset), r.end.min(offset + w.rows));
                    if lo < hi {
                        // SAFETY: chunks of the row list are disjoint.
                        let out = unsafe { y.range(lo - offset, hi - offset) };
                        matvec_rows(isa, w.rows(lo - offset, hi - offset), acts, out);
                    }
                    offset += w.rows;
                }
            }
        };
        match threads {
            1 => work(0, 1),
            _ => pool.run(work),
        }
    })
}

/// Below this many bytes of weights, a mat-vec's rows are cut into one
/// contiguous share per thread, balanced by bytes, instead of handed out in
/// guided [`Chunks`]. Every chunk a thread starts restarts its four memory
/// streams, and a small product is over before they pay off. 2 threads of a
/// Xeon (family 6 model 167), `ember bench --phases`, builds alternated
/// three times: decoding INT4, o (0.85 MB of INT8) 696–744 → 667–677 µs a
/// token and q/k/v (0.69 MB: INT4 q, INT8 k and v, hence shares by bytes)
/// 672–690 → 637–671; INT8's o 735–740 → 690–701; BF16's o (1.6 MB) the
/// same. The chunks' minimum at 32 or 128 rows instead was slower. The big
/// products keep the chunks, which let a thread slowed by the machine's
/// neighbours hand rows to the other.
const SMALL_SECTION_BYTES: usize = 2 << 20;

/// Rows `[start, end)` of the joint row list of `mats` that thread `t` of
/// `n` takes: contiguous, starting on multiples of [`ROW_ALIGN`], cut where
/// the bytes of weights before them are `t / n` of all (matrices of
/// different types have rows of different sizes: INT4 q and INT8 k/v).
fn byte_share(mats: &[MatRef], t: usize, n: usize) -> std::ops::Range<usize> {
    let total: usize = mats.iter().map(|m| m.rows).sum();
    let bytes: usize = mats.iter().map(|m| m.bytes()).sum();
    let bound = |i: usize| {
        if i >= n {
            return total;
        }
        let target = bytes * i / n;
        let (mut before, mut offset) = (0, 0);
        for m in mats {
            let row_bytes = m.bytes() / m.rows.max(1);
            if before + m.bytes() > target {
                let row = offset + (target - before) / row_bytes.max(1);
                return row.next_multiple_of(ROW_ALIGN).min(total);
            }
            before += m.bytes();
            offset += m.rows;
        }
        total
    };
    bound(t)..bound(t + 1)
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
    let threads = threads_for(pool, 2 * rows * gate.cols);
    let chunks = Chunks::new(rows, threads, ROW_ALIGN, MIN_CHUNK);
    with_acts(isa, x, &[gate, up], |acts| {
        let work = |_t: usize, _n: usize| {
            let mut u = [0.0f32; SWIGLU_BLOCK];
            while let Some(r) = chunks.next_chunk() {
                // SAFETY: chunks are disjoint.
                let o = unsafe { out.range(r.start, r.end) };
                for (start, o) in r.clone().step_by(SWIGLU_BLOCK).zip(o.chunks_mut(SWIGLU_BLOCK)) {
                    let (end, u) = (start + o.len(), &mut u[..o.len()]);
                    gate_up_rows(isa, gate.rows(start, end), up.rows(start, end), acts, o, u);
                    silu_mul_with(isa, o, u);
                }
            }
        };
        match threads {
            1 => work(0, 1),
            _ => pool.run(work),
        }
    })
}

/// Rows of gate and up computed together by [`matvec_swiglu`] (the
/// intermediate values of one block of rows live on the stack).
const SWIGLU_BLOCK: usize = 2048;

/// `g = gate @ x`, `u = up @ x` for the same rows of both matrices.
/// `gate`, `up (n, cols)`, `g`, `u (n,)`.
///
/// Of one weight type (as the quantization policies make them), they go
/// through the four-row kernel together: rows of the two halves of gate and
/// of the two halves of up, four memory streams that run over the whole
/// block. Computing gate's rows and then up's in blocks of 256 (each with
/// its own four streams) restarted the streams 38 times a layer; the joint
/// form measured 2.4% faster over a layer's mat-vecs (one thread) and 4.6%
/// on INT4 decoding (2 threads, alternated in one process, Emerald Rapids).
fn gate_up_rows(isa: Isa, gate: MatRef, up: MatRef, acts: &Acts, g: &mut [f32], u: &mut [f32]) {
    if gate.weights.ty() != up.weights.ty() {
        matvec_rows(isa, gate, acts, g);
        matvec_rows(isa, up, acts, u);
        return;
    }
    let up_bytes = up.weights.as_bytes();
    with_weights!(gate.weights, |F, gate_data| {
        // Same type: up's bytes are blocks of F, aligned as they were stored.
        let up_data: &[<F as Format>::Block] = bytemuck::cast_slice(up_bytes);
        let x = <F as Format>::Act::pick(acts);
        gate_up_rows_of::<F>(isa, gate_data, up_data, gate.cols, x, acts.a8x4, g, u)
    })
}

/// [`gate_up_rows`] for one weight type. `gate`, `up (n * cols / BLOCK_LEN,)`
/// blocks, `x` in the rows' activation format, `quads` as for [`rows_of`].
#[allow(clippy::too_many_arguments)]
fn gate_up_rows_of<F: Format>(
    isa: Isa,
    gate: &[F::Block],
    up: &[F::Block],
    cols: usize,
    x: &[F::Act],
    quads: &[BlockA8x4],
    g: &mut [f32],
    u: &mut [f32],
) {
    let n = g.len();
    let per_row = cols / F::BLOCK_LEN;
    assert_eq!(u.len(), n, "u length");
    assert_eq!(gate.len(), n * per_row, "gate size");
    assert_eq!(up.len(), n * per_row, "up size");
    let k = RowKernels::<F>::new(isa, per_row, x, quads);
    let (g_row, u_row) =
        (|i: usize| &gate[i * per_row..(i + 1) * per_row], |i: usize| &up[i * per_row..(i + 1) * per_row]);
    let h = n / 2;
    if h > 0 {
        warm_streams([
            &gate[..h * per_row],
            &gate[h * per_row..2 * h * per_row],
            &up[..h * per_row],
            &up[h * per_row..2 * h * per_row],
        ]);
    }
    for j in 0..h {
        [g[j], g[j + h], u[j], u[j + h]] = k.four([g_row(j), g_row(j + h), u_row(j), u_row(j + h)]);
    }
    if n % 2 == 1 {
        (g[n - 1], u[n - 1]) = (k.one(g_row(n - 1)), k.one(u_row(n - 1)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{
        bf16, f16, quantize_activations_scalar, BlockQ4, BlockQ4_0, BlockQ5, BlockQ8, Int4, Int5, Int8, Weights, Q4_0,
        QK4, QK5,
    };
    use crate::testutil::{close, synth};

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
        // Odd block counts (3, 5) take the kernels' ragged ends in the four-row form.
        for (rows, cols) in [(1, 32), (7, 64), (9, 96), (8, 160), (64, 896), (301, 256), (5, 384)] {
            let w = synth(rows * cols, rows as u64 + 3);
            let x = synth(cols, 5);
            let mut xq = vec![BlockA8::ZERO; cols / QK_A8];
            quantize_activations_scalar(&x, &mut xq);
            let (mut q8, mut q4) = (vec![BlockQ8::ZERO; rows * cols / 32], vec![BlockQ4_0::ZERO; rows * cols / 32]);
            Int8::quantize_row(&w, &mut q8);
            Q4_0::quantize_row(&w, &mut q4);
            let b = cols / 32;
            let want8: Vec<f32> = (0..rows).map(|r| Int8::dot_reference(&q8[r * b..(r + 1) * b], &xq)).collect();
            let want4: Vec<f32> = (0..rows).map(|r| Q4_0::dot_reference(&q4[r * b..(r + 1) * b], &xq)).collect();
            let mut cases = vec![(Weights::Int8(&q8), want8), (Weights::Q4_0(&q4), want4)];
            // INT4 and INT5 where the rows are whole 128-weight blocks.
            let mut q4x4 = vec![BlockQ4::ZERO; rows * cols / QK4];
            let mut q5 = vec![BlockQ5::ZERO; rows * cols / QK5];
            if cols.is_multiple_of(QK4) {
                Int4::quantize_row(&w, &mut q4x4);
                let b4 = cols / QK4;
                let want4 = (0..rows).map(|r| Int4::dot_reference(&q4x4[r * b4..(r + 1) * b4], &xq)).collect();
                cases.push((Weights::Int4(&q4x4), want4));
            }
            if cols.is_multiple_of(QK5) {
                Int5::quantize_row(&w, &mut q5);
                let b5 = cols / QK5;
                let want5 = (0..rows).map(|r| Int5::dot_reference(&q5[r * b5..(r + 1) * b5], &xq)).collect();
                cases.push((Weights::Int5(&q5), want5));
            }
            for (weights, want) in cases {
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

    /// Q4_0 and Q5_0 rows (as GGUF files carry them) give the bits of the
    /// INT4 and INT5 rows of the same numbers on every tier: a GGUF ember
    /// writes from a quantized model computes what that model does.
    #[test]
    fn ggml_twins_give_their_int4_and_int5_bits() {
        use crate::formats::{BlockQ5_0, Q5_0};
        for (rows, cols) in [(5, 128), (64, 896), (37, 4864)] {
            let w = synth(rows * cols, cols as u64 + 11);
            let mut q4 = vec![BlockQ4::ZERO; rows * cols / QK4];
            let mut q5 = vec![BlockQ5::ZERO; rows * cols / QK5];
            Int4::quantize_row(&w, &mut q4);
            Int5::quantize_row(&w, &mut q5);
            let q4_0: Vec<BlockQ4_0> = q4.iter().flat_map(|b| b.to_q4_0()).collect();
            let q5_0: Vec<BlockQ5_0> = q5.iter().flat_map(|b| b.to_q5_0()).collect();
            let values = |f: &dyn Fn(&mut [f32])| {
                let mut v = vec![f32::NAN; rows * cols];
                f(&mut v);
                v
            };
            assert_eq!(
                values(&|v| Int4::dequantize_reference(&q4, v)),
                values(&|v| Q4_0::dequantize_reference(&q4_0, v))
            );
            assert_eq!(
                values(&|v| Int5::dequantize_reference(&q5, v)),
                values(&|v| Q5_0::dequantize_reference(&q5_0, v))
            );
            for seed in 0..3u64 {
                let x = synth(cols, seed);
                for isa in Isa::supported() {
                    for (ours, ggml) in
                        [(Weights::Int4(&q4), Weights::Q4_0(&q4_0)), (Weights::Int5(&q5), Weights::Q5_0(&q5_0))]
                    {
                        let (mut a, mut b) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
                        matvec_with(isa, MatRef::new(ours, rows, cols), &x, &mut a);
                        matvec_with(isa, MatRef::new(ggml, rows, cols), &x, &mut b);
                        assert_eq!(a, b, "{isa:?} {:?} {rows}x{cols}", ggml.ty());
                        let (mut fa, mut fb) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
                        let ma = MatRef::new(ours, rows, cols);
                        let mb = MatRef::new(ggml, rows, cols);
                        matvec_swiglu(&ThreadPool::new(2), ma, ma, &x, &mut fa);
                        matvec_swiglu(&ThreadPool::new(2), mb, mb, &x, &mut fb);
                        assert_eq!(fa, fb, "swiglu {:?} {rows}x{cols}", ggml.ty());
                    }
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
    fn byte_shares_cover_the_rows_once_balanced_by_bytes() {
        let (q, k) = (vec![BlockQ4::ZERO; 96], vec![BlockQ8::ZERO; 32 * 4]);
        // 96 INT4 rows of 72 bytes, then 32 INT8 rows of 136.
        let mats = [MatRef::new(Weights::Int4(&q), 96, 128), MatRef::new(Weights::Int8(&k), 32, 128)];
        for n in 1..=5 {
            let shares: Vec<_> = (0..n).map(|t| byte_share(&mats, t, n)).collect();
            assert_eq!(shares[0].start, 0);
            assert_eq!(shares[n - 1].end, 128);
            for (a, b) in shares.iter().zip(&shares[1..]) {
                assert_eq!(a.end, b.start, "{n} threads: {shares:?}");
                assert!(b.start.is_multiple_of(ROW_ALIGN) && a.start <= a.end);
            }
        }
        // Two threads: half of the 11264 bytes is row 78 (the INT4 rows'
        // 6912 bytes are more than half), aligned up to 80.
        assert_eq!(byte_share(&mats, 0, 2), 0..80);
        assert_eq!(byte_share(&mats, 1, 2), 80..128);
    }

    #[test]
    fn large_products_take_the_chunks_and_equal_the_serial_product() {
        let (rows, cols) = (1100, 512); // 2.25 MB of f32: above SMALL_SECTION_BYTES
        assert!(rows * cols * 4 >= SMALL_SECTION_BYTES);
        let (w, x) = (synth(rows * cols, 21), synth(cols, 22));
        let m = MatRef::new(Weights::F32(&w), rows, cols);
        let mut serial = vec![0.0; rows];
        matvec_with(Isa::active(), m, &x, &mut serial);
        for threads in [2, 3] {
            let mut par = vec![0.0; rows];
            matvecs(&ThreadPool::new(threads), &x, [(m, &mut par[..])]);
            assert_eq!(serial, par);
        }
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
    fn swiglu_over_blocks_and_mixed_types_matches_separate_steps() {
        // Past two blocks of rows with a ragged, odd end; gate and up of one
        // quantized type (the four-stream form) and of two (one at a time).
        let (rows, cols) = (2 * SWIGLU_BLOCK + 37, 64);
        let (g, u, x) = (synth(rows * cols, 11), synth(rows * cols, 12), synth(cols, 13));
        let (mut g8, mut u8) = (vec![BlockQ8::ZERO; rows * cols / 32], vec![BlockQ8::ZERO; rows * cols / 32]);
        let (mut g4, mut u4) = (vec![BlockQ4_0::ZERO; rows * cols / 32], vec![BlockQ4_0::ZERO; rows * cols / 32]);
        Int8::quantize_row(&g, &mut g8);
        Int8::quantize_row(&u, &mut u8);
        Q4_0::quantize_row(&g, &mut g4);
        Q4_0::quantize_row(&u, &mut u4);
        let (g4, u4) = (MatRef::new(Weights::Q4_0(&g4), rows, cols), MatRef::new(Weights::Q4_0(&u4), rows, cols));
        let (g8, u8) = (MatRef::new(Weights::Int8(&g8), rows, cols), MatRef::new(Weights::Int8(&u8), rows, cols));
        let pairs = [(g4, u4), (g8, u8), (g8, u4)];
        for (gm, um) in pairs {
            let (mut gy, mut uy) = (vec![0.0; rows], vec![0.0; rows]);
            matvec_with(Isa::active(), gm, &x, &mut gy);
            matvec_with(Isa::active(), um, &x, &mut uy);
            crate::ops::silu_mul_with(Isa::active(), &mut gy, &uy);
            for threads in [1, 2, 3] {
                let mut out = vec![0.0; rows];
                matvec_swiglu(&ThreadPool::new(threads), gm, um, &x, &mut out);
                assert_eq!(out, gy, "{} gate, {} up, {threads} threads", gm.weights.ty(), um.weights.ty());
            }
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
        // The gate as the active tier computes it alone.
        let mut want = gy.clone();
        crate::ops::silu_mul_with(Isa::active(), &mut want, &uy);
        for threads in [1, 2, 4] {
            let mut out = vec![0.0; rows];
            matvec_swiglu(&ThreadPool::new(threads), gm, um, &x, &mut out);
            assert_eq!(out, want);
        }
    }
}
