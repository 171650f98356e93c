//! Scaled dot-product attention over KV caches.
//!
//! Grouped-query attention: `n_heads` query heads share `n_kv_heads` key/value
//! heads, query head `h` reading KV head `h / (n_heads / n_kv_heads)`.
//!
//! [`attention`] takes a batch of query rows, each tagged with its sequence
//! and the number of cached positions it sees (its own position + 1), so one
//! call serves a prompt block of one sequence (causal: row i sees one more
//! key than row i − 1), one decoded token of each of several sequences, or a
//! mix. Consecutive rows of one sequence whose visible lengths grow by one
//! form a *run*: a run of many rows is done as matrix products per KV head
//! and block of queries (each key is then read for many queries), a run of one
//! row as dot products per head.

use crate::cpu::Isa;
use crate::dot::{axpy, dot_f32};
use crate::formats::{MatRef, Weights};
use crate::matmul::{matmul_with, Precision};
use crate::ops::softmax;
use crate::pool::{self, SharedMut, ThreadPool};
use std::cell::RefCell;

/// Shapes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (each serves `n_heads / n_kv_heads` query heads).
    pub n_kv_heads: usize,
    /// Dimensions per head.
    pub head_dim: usize,
}

impl AttnShape {
    /// Width of one cached key or value row: `n_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// `out (n_heads * head_dim,) = softmax(q · Kᵀ / sqrt(head_dim)) · V` over
/// every cached position given (causal by construction: the caller passes
/// positions up to the current one only).
///
/// `q (n_heads * head_dim,)`, `keys` and `values (len, kv_dim)` row-major,
/// `scores (len..,)` scratch.
pub fn attend(
    isa: Isa,
    shape: AttnShape,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    scores: &mut [f32],
    out: &mut [f32],
) {
    assert_eq!(out.len(), shape.n_heads * shape.head_dim);
    attend_heads(isa, shape, 0..shape.n_heads, q, keys, values, scores, out);
}

/// [`attend`] for query heads `heads` only, so threads can split the heads.
/// `out (heads.len() * head_dim,)` receives those heads' outputs.
#[allow(clippy::too_many_arguments)]
pub fn attend_heads(
    isa: Isa,
    shape: AttnShape,
    heads: std::ops::Range<usize>,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    scores: &mut [f32],
    out: &mut [f32],
) {
    attend_heads_ahead(isa, shape, heads, q, keys, values, scores, out, &[])
}

/// [`attend_heads`], bringing `next` (the keys and values the thread
/// attends over next) into L2 a few lines per step of its passes, so that
/// the next row's reads overlap this row's arithmetic.
///
/// A decoded token's attention over a context of a few hundred positions
/// reads its cache from memory (the weights streamed since its last use
/// evicted it), one thread at a time, in one stream per pass: on Zen 4
/// (Qwen2.5-0.5B's heads, 160 positions, 160 KB of keys and values) 12–15 µs
/// of arithmetic from L2 took 26–29 µs a row from memory, the reads (about
/// 12 GB/s from one thread) not overlapping the arithmetic; fetching the
/// next row's lines a few per step, 19–21 µs (192 rows, one thread, the
/// caches evicted first, eight alternations). In the model, 8 sequences
/// decoding together spent 2.7–3.0 ms of a step in attention against
/// 3.1–3.8 (three alternations).
#[allow(clippy::too_many_arguments)]
fn attend_heads_ahead(
    isa: Isa,
    shape: AttnShape,
    heads: std::ops::Range<usize>,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    scores: &mut [f32],
    out: &mut [f32],
    next: &[&[f32]],
) {
    let AttnShape { n_heads, n_kv_heads, head_dim: hd } = shape;
    let kv_dim = shape.kv_dim();
    let len = keys.len() / kv_dim;
    assert!(heads.end <= n_heads);
    assert_eq!(q.len(), n_heads * hd);
    assert_eq!(out.len(), heads.len() * hd);
    assert!(keys.len() == len * kv_dim && values.len() == len * kv_dim, "keys and values are (len, kv_dim)");
    assert!(len > 0 && scores.len() >= len);
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let scores = &mut scores[..len];
    #[cfg(not(target_arch = "x86_64"))]
    let _ = next;
    #[cfg(target_arch = "x86_64")]
    if isa.tier() != crate::cpu::Tier::Scalar && hd.is_multiple_of(8) {
        // The heads of one KV head together, so its keys and values are
        // read from memory once for all of them.
        GROUP_SCORES.with(|buf| {
            let buf = &mut *buf.borrow_mut();
            // Steps of the passes below: per KV head, the scores' steps of
            // 8 positions and the weighted sum's of 16.
            let groups = match heads.is_empty() {
                true => 0,
                false => (heads.end - 1) / group - heads.start / group + 1,
            };
            let mut ahead = avx2::Ahead::new(next, groups * (len.div_ceil(8) + len.div_ceil(16)));
            let mut h = heads.start;
            while h < heads.end {
                let end = ((h / group + 1) * group).min(heads.end);
                let (kv, g) = ((h / group) * hd, end - h);
                buf.resize(g * len, 0.0);
                let o = &mut out[(h - heads.start) * hd..(end - heads.start) * hd];
                // SAFETY: every tier above scalar has AVX2 and FMA (`isa` is
                // the proof); `hd` is whole vectors, `kv + hd ≤ kv_dim`, and
                // `keys`, `values` hold `len` rows of `kv_dim`.
                unsafe {
                    avx2::scores(&q[h * hd..end * hd], keys, kv, kv_dim, scale, &mut buf[..g * len], &mut ahead);
                    for row in buf.chunks_exact_mut(len) {
                        avx2::softmax(row);
                    }
                    avx2::weighted_sum(&buf[..g * len], values, kv, kv_dim, o, &mut ahead);
                }
                h = end;
            }
        });
        return;
    }
    for (i, h) in heads.enumerate() {
        let kv = (h / group) * hd;
        let qh = &q[h * hd..(h + 1) * hd];
        let oh = &mut out[i * hd..(i + 1) * hd];
        for (t, s) in scores.iter_mut().enumerate() {
            *s = dot_f32(isa, qh, &keys[t * kv_dim + kv..t * kv_dim + kv + hd]) * scale;
        }
        softmax(scores);
        oh.fill(0.0);
        for (t, &p) in scores.iter().enumerate() {
            axpy(isa, p, &values[t * kv_dim + kv..t * kv_dim + kv + hd], oh);
        }
    }
}

/// A KV head's query heads' two passes over its cache, with the AVX2 tiers'
/// FMA: the scores eight positions at a time (eight keys against each
/// query, one horizontal sum for the eight), and the value-weighted sum with
/// each head's output held in registers over a step of positions, rather
/// than a dot product and an axpy call per head and position; every head of
/// the group meets a block of keys or values while it is in L1. Each output
/// element adds its positions in order with one FMA each, as [`axpy`] does.
/// Between them, the softmax eight scores at a time
/// ([`ops::softmax`](crate::ops::softmax) is its twin).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::formats::float::avx2::{hsum, reduce8};
    use std::arch::x86_64::*;

    /// `(len, g, hd)` of a group's pass over `cache (len, kv_dim)` at column
    /// `kv`: `g` heads of `per_position = g · len` scores and `per_head = g ·
    /// hd` query or output values, `hd` whole vectors within a row.
    fn group_shape(
        cache: usize,
        kv_dim: usize,
        kv: usize,
        per_position: usize,
        per_head: usize,
    ) -> (usize, usize, usize) {
        let len = cache / kv_dim;
        assert!(len > 0 && cache == len * kv_dim && per_position.is_multiple_of(len));
        let g = per_position / len;
        assert!(g > 0 && per_head.is_multiple_of(g));
        let hd = per_head / g;
        assert!(hd > 0 && hd.is_multiple_of(8) && kv + hd <= kv_dim);
        (len, g, hd)
    }

    /// Regions to bring into L2 over the steps of one row's passes
    /// ([`super::attend_heads_ahead`]): each step issues its share of their
    /// lines, as evenly as the steps allow.
    pub struct Ahead<'a> {
        regions: &'a [&'a [f32]],
        /// Region and byte offset of the next line to fetch.
        region: usize,
        at: usize,
        per_step: usize,
    }

    impl<'a> Ahead<'a> {
        /// `regions` over `steps` steps.
        pub fn new(regions: &'a [&'a [f32]], steps: usize) -> Self {
            let lines: usize = regions.iter().map(|r| (4 * r.len()).div_ceil(64)).sum();
            Ahead { regions, region: 0, at: 0, per_step: lines.div_ceil(steps.max(1)) }
        }

        /// Issues one step's lines.
        #[inline(always)]
        pub fn step(&mut self) {
            for _ in 0..self.per_step {
                let Some(r) = self.regions.get(self.region) else { return };
                // SAFETY: `at` is within the region (checked below before
                // it is used again); prefetching has no other effect.
                unsafe { _mm_prefetch::<_MM_HINT_T1>((r.as_ptr() as *const i8).add(self.at)) };
                self.at += 64;
                if self.at >= 4 * r.len() {
                    (self.region, self.at) = (self.region + 1, 0);
                }
            }
        }
    }

    /// Positions per step of [`weighted_sum`]: their values (16 × 64 floats
    /// at Qwen2.5-0.5B's head width, 4 KB) stay in L1 for every head.
    const VALUE_STEP: usize = 16;

    /// `scores[i · len + t] = (q_i · keys[t · kv_dim + kv..][..hd]) · scale`
    /// for the `g` query heads `q_i = q[i · hd..][..hd]` (`q.len() = g · hd`,
    /// `scores.len() = g · len`) and every position `t < len`. Eight
    /// positions at a time for every head (their keys stay in L1), one
    /// horizontal sum for the eight.
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores(
        q: &[f32],
        keys: &[f32],
        kv: usize,
        kv_dim: usize,
        scale: f32,
        scores: &mut [f32],
        ahead: &mut Ahead,
    ) {
        let (len, g, hd) = group_shape(keys.len(), kv_dim, kv, scores.len(), q.len());
        let k = keys.as_ptr().add(kv);
        let mut t = 0;
        while t + 8 <= len {
            ahead.step();
            let base = k.add(t * kv_dim);
            for i in 0..g {
                let qp = q.as_ptr().add(i * hd);
                let mut acc = [_mm256_setzero_ps(); 8];
                for d in (0..hd).step_by(8) {
                    let qv = _mm256_loadu_ps(qp.add(d));
                    for (j, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(base.add(j * kv_dim + d)), *a);
                    }
                }
                let s = _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale));
                _mm256_storeu_ps(scores.as_mut_ptr().add(i * len + t), s);
            }
            t += 8;
        }
        if t < len {
            ahead.step();
        }
        for t in t..len {
            let base = k.add(t * kv_dim);
            for i in 0..g {
                let qp = q.as_ptr().add(i * hd);
                let mut a = _mm256_setzero_ps();
                for d in (0..hd).step_by(8) {
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(d)), _mm256_loadu_ps(base.add(d)), a);
                }
                scores[i * len + t] = hsum(a) * scale;
            }
        }
    }

    /// `x = softmax(x)` in place: the maximum, `e^(x - max)` and their sum,
    /// then the scale, eight lanes at a time.
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax(x: &mut [f32]) {
        let len = x.len();
        let whole = len / 8 * 8;
        let p = x.as_mut_ptr();
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        for i in (0..whole).step_by(8) {
            m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(i)));
        }
        let lanes: [f32; 8] = std::mem::transmute(m);
        let max = x[whole..].iter().chain(&lanes).copied().fold(f32::NEG_INFINITY, f32::max);
        let (mv, mut sum) = (_mm256_set1_ps(max), _mm256_setzero_ps());
        for i in (0..whole).step_by(8) {
            let e = crate::ops::avx2::exp(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv));
            _mm256_storeu_ps(p.add(i), e);
            sum = _mm256_add_ps(sum, e);
        }
        let mut total = hsum(sum);
        for v in &mut x[whole..] {
            *v = (*v - max).exp();
            total += *v;
        }
        let inv = 1.0 / total;
        for i in (0..whole).step_by(8) {
            _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), _mm256_set1_ps(inv)));
        }
        for v in &mut x[whole..] {
            *v *= inv;
        }
    }

    /// `out[i · hd..][..hd] = Σ_t p[i · len + t] · values[t · kv_dim + kv..][..hd]`
    /// for the `g` heads (`p.len() = g · len`, `out.len() = g · hd`). The
    /// positions go [`VALUE_STEP`] at a time through every head (their
    /// values stay in L1), a head's output in registers for a step; each
    /// element adds its positions in order, one FMA each.
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_sum(
        p: &[f32],
        values: &[f32],
        kv: usize,
        kv_dim: usize,
        out: &mut [f32],
        ahead: &mut Ahead,
    ) {
        let (len, g, hd) = group_shape(values.len(), kv_dim, kv, p.len(), out.len());
        out.fill(0.0);
        for t0 in (0..len).step_by(VALUE_STEP) {
            ahead.step();
            let t1 = (t0 + VALUE_STEP).min(len);
            for i in 0..g {
                let pi = &p[i * len + t0..i * len + t1];
                // The output in chunks of up to 8 vectors.
                let mut c = 0;
                while c < hd {
                    let w = ((hd - c) / 8).min(8);
                    let (v, o) = (values.as_ptr().add(t0 * kv_dim + kv + c), out.as_mut_ptr().add(i * hd + c));
                    match w {
                        8 => chunk::<8>(pi, v, kv_dim, o),
                        7 => chunk::<7>(pi, v, kv_dim, o),
                        6 => chunk::<6>(pi, v, kv_dim, o),
                        5 => chunk::<5>(pi, v, kv_dim, o),
                        4 => chunk::<4>(pi, v, kv_dim, o),
                        3 => chunk::<3>(pi, v, kv_dim, o),
                        2 => chunk::<2>(pi, v, kv_dim, o),
                        _ => chunk::<1>(pi, v, kv_dim, o),
                    }
                    c += 8 * w;
                }
            }
        }
    }

    /// `W` vectors of a head's output: `out[..8W] += Σ_t p[t] · v[t · kv_dim..][..8W]`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn chunk<const W: usize>(p: &[f32], v: *const f32, kv_dim: usize, out: *mut f32) {
        let mut acc: [__m256; W] = std::array::from_fn(|j| _mm256_loadu_ps(out.add(8 * j)));
        for (t, &pt) in p.iter().enumerate() {
            let (pv, row) = (_mm256_set1_ps(pt), v.add(t * kv_dim));
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(row.add(8 * j)), *a);
            }
        }
        for (j, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(8 * j), *a);
        }
    }
}

thread_local! {
    /// Each thread's scores of one KV head's query heads `(group, len)` in
    /// [`attend_heads`]' vector path.
    static GROUP_SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Below this many cached positions a single query's attention stays on one
/// thread. The pool's workers spin between sections, so splitting the heads
/// pays from the first position: INT4 decoding on Emerald Rapids, 2 threads,
/// `ember bench -p 0 -n 64 --phases`, the attention phase (RoPE, the cache
/// store and attention, 24 layers) 173–184 µs a token on one thread, 137–144
/// split (it was 128 positions before).
const PARALLEL_MIN_LEN: usize = 1;

/// Queries per work item of a run's block attention.
const QUERY_BLOCK: usize = 32;

/// Attention for a batch of query rows.
///
/// Row `i` belongs to sequence `seqs[i]` and sees that sequence's cached
/// positions `0..visible[i]` (its own key and value already stored);
/// `kv(seq)` gives a sequence's keys and values `(≥ visible, kv_dim)` for the
/// layer at hand. `q`, `out (T, n_heads * head_dim)`.
///
/// Work is spread over `pool`: a single row splits its heads across threads
/// once the context is long enough to pay for it; otherwise items (a run's
/// KV head × block of queries, or a lone row) are dealt out to threads in turn.
#[allow(clippy::too_many_arguments)]
pub fn attention<'c>(
    pool: &ThreadPool,
    isa: Isa,
    shape: AttnShape,
    q: &[f32],
    seqs: &[usize],
    visible: &[usize],
    kv: &(dyn Fn(usize) -> (&'c [f32], &'c [f32]) + Sync),
    out: &mut [f32],
) {
    let width = shape.n_heads * shape.head_dim;
    let t = seqs.len();
    assert_eq!(visible.len(), t, "one visible length per row");
    assert_eq!(q.len(), t * width, "q is (T, heads * head_dim)");
    assert_eq!(out.len(), t * width, "out is (T, heads * head_dim)");
    assert!(visible.iter().all(|&v| v > 0), "every row sees at least its own position");
    if t == 1 {
        let len = visible[0];
        let (keys, values) = kv(seqs[0]);
        let kv_len = len * shape.kv_dim();
        return single(pool, isa, shape, q, &keys[..kv_len], &values[..kv_len], out);
    }
    // Work items, dealt out to threads in turn: a lone row, or a run's KV
    // head × block of queries (later blocks see more keys, so consecutive
    // items go to different threads).
    let mut items = Vec::new();
    for run in runs(seqs, visible) {
        if run.len() == 1 {
            items.push(Item::Row(run.start));
            continue;
        }
        let blocks = run.len().div_ceil(QUERY_BLOCK);
        items.extend((0..shape.n_kv_heads * blocks).map(|b| Item::Block(run.clone(), b)));
    }
    // A lone row's keys and values, as far as it sees.
    let row_kv = |i: usize| {
        let (keys, values) = kv(seqs[i]);
        let kv_len = visible[i] * shape.kv_dim();
        (&keys[..kv_len], &values[..kv_len])
    };
    let out = SharedMut::new(out);
    pool.run(|th, n| {
        for (at, item) in items.iter().enumerate().skip(th).step_by(n) {
            match item {
                Item::Row(i) => {
                    let (keys, values) = row_kv(*i);
                    // The thread's next row's cache, fetched while this one
                    // computes.
                    let next = match items.get(at + n) {
                        Some(Item::Row(j)) => {
                            let (k, v) = row_kv(*j);
                            [k, v]
                        }
                        _ => [&[][..], &[][..]],
                    };
                    // SAFETY: each row belongs to exactly one item.
                    let o = unsafe { out.range(i * width, (i + 1) * width) };
                    SCRATCH.with(|sc| {
                        let sc = &mut *sc.borrow_mut();
                        sc.s.resize(visible[*i], 0.0);
                        let q = &q[i * width..(i + 1) * width];
                        attend_heads_ahead(isa, shape, 0..shape.n_heads, q, keys, values, &mut sc.s, o, &next);
                    });
                }
                Item::Block(run, b) => {
                    let (keys, values) = kv(seqs[run.start]);
                    let (kvh, blk) = (b % shape.n_kv_heads, b / shape.n_kv_heads);
                    let rows = run.start + blk * QUERY_BLOCK..(run.start + (blk + 1) * QUERY_BLOCK).min(run.end);
                    block(isa, shape, kvh, q, rows, visible, keys, values, &out);
                }
            }
        }
    });
}

/// One work item of [`attention`].
enum Item {
    /// A row alone in its run (a decoded token).
    Row(usize),
    /// Block `b / n_kv_heads` of [`QUERY_BLOCK`] queries of a run, for KV
    /// head `b % n_kv_heads`.
    Block(std::ops::Range<usize>, usize),
}

/// Maximal runs of rows `i..j` of one sequence with `visible` growing by one.
fn runs<'a>(seqs: &'a [usize], visible: &'a [usize]) -> impl Iterator<Item = std::ops::Range<usize>> + 'a {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= seqs.len() {
            return None;
        }
        let mut end = start + 1;
        while end < seqs.len() && seqs[end] == seqs[start] && visible[end] == visible[end - 1] + 1 {
            end += 1;
        }
        let run = start..end;
        start = end;
        Some(run)
    })
}

/// One query row over `keys`, `values (len, kv_dim)`, heads split across the
/// pool when the context is long enough.
fn single(pool: &ThreadPool, isa: Isa, shape: AttnShape, q: &[f32], keys: &[f32], values: &[f32], out: &mut [f32]) {
    let len = keys.len() / shape.kv_dim();
    let threads = if len < PARALLEL_MIN_LEN { 1 } else { pool.threads().min(shape.n_heads) };
    let hd = shape.head_dim;
    let out = SharedMut::new(out);
    let work = |t: usize, n: usize| {
        let (a, b) = pool::share(shape.n_heads, t, n, 1);
        if a < b {
            // SAFETY: threads take disjoint head ranges of `out`.
            let o = unsafe { out.range(a * hd, b * hd) };
            SCRATCH.with(|sc| {
                let sc = &mut *sc.borrow_mut();
                sc.s.resize(len, 0.0);
                attend_heads(isa, shape, a..b, q, keys, values, &mut sc.s, o);
            });
        }
    };
    match threads {
        1 => work(0, 1),
        _ => pool.run(work),
    }
}

thread_local! {
    /// Each thread's attention scratch, reused across calls.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Buffers of one work item.
#[derive(Default)]
struct Scratch {
    /// Queries of the group's heads `(n, head_dim)`, row `(i - i0) * group + g`.
    q: Vec<f32>,
    /// The KV head's keys `(len, head_dim)`, contiguous.
    k: Vec<f32>,
    /// The KV head's values transposed `(head_dim, len)`.
    vt: Vec<f32>,
    /// Scores, then probabilities `(n, len)`.
    s: Vec<f32>,
    /// Outputs `(n, head_dim)`.
    o: Vec<f32>,
}

/// Attention of query rows `rows` (one run, so row `i` sees one more key than
/// row `i - 1`) for the query heads of KV head `kvh`, as matrix products:
/// the group's query rows form one matrix, `S = Q Kᵀ` and `O = softmax(S) V`
/// go through the tiled `matmul` (keys and values gathered contiguous first).
#[allow(clippy::too_many_arguments)]
fn block(
    isa: Isa,
    shape: AttnShape,
    kvh: usize,
    q: &[f32],
    rows: std::ops::Range<usize>,
    visible: &[usize],
    keys: &[f32],
    values: &[f32],
    out: &SharedMut<f32>,
) {
    let hd = shape.head_dim;
    let width = shape.n_heads * hd;
    let kv_dim = shape.kv_dim();
    let group = shape.n_heads / shape.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let (i0, i1) = (rows.start, rows.end);
    let len = visible[i1 - 1]; // keys the last query of the block sees
    let n = (i1 - i0) * group;
    SCRATCH.with(|scratch| {
        let sc = &mut *scratch.borrow_mut();
        sc.q.clear();
        for i in i0..i1 {
            for g in 0..group {
                let h = kvh * group + g;
                sc.q.extend_from_slice(&q[i * width + h * hd..i * width + (h + 1) * hd]);
            }
        }
        sc.k.clear();
        for p in 0..len {
            sc.k.extend_from_slice(&keys[p * kv_dim + kvh * hd..p * kv_dim + (kvh + 1) * hd]);
        }
        sc.vt.resize(hd * len, 0.0);
        for p in 0..len {
            for d in 0..hd {
                sc.vt[d * len + p] = values[p * kv_dim + kvh * hd + d];
            }
        }
        sc.s.resize(n * len, 0.0);
        // S (n, len) = Q (n, hd) @ K (len, hd)ᵀ
        matmul_with(isa, Precision::Exact, MatRef::new(Weights::F32(&sc.k), len, hd), &sc.q, &mut sc.s);
        for (r, srow) in sc.s.chunks_exact_mut(len).enumerate() {
            let (seen, masked) = srow.split_at_mut(visible[i0 + r / group]);
            seen.iter_mut().for_each(|v| *v *= scale);
            softmax(seen);
            masked.fill(0.0);
        }
        sc.o.resize(n * hd, 0.0);
        // O (n, hd) = P (n, len) @ Vᵀ (hd, len)ᵀ
        matmul_with(isa, Precision::Exact, MatRef::new(Weights::F32(&sc.vt), hd, len), &sc.s, &mut sc.o);
        for (r, orow) in sc.o.chunks_exact(hd).enumerate() {
            let (i, g) = (i0 + r / group, r % group);
            let o = i * width + (kvh * group + g) * hd;
            // SAFETY: each (query, head) slot belongs to exactly one item.
            unsafe { out.range(o, o + hd) }.copy_from_slice(orow);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::synth;

    /// Textbook attention in f64, one head at a time.
    fn reference(shape: AttnShape, q: &[f32], k: &[f32], v: &[f32], len: usize) -> Vec<f32> {
        let (hd, kvd) = (shape.head_dim, shape.kv_dim());
        let group = shape.n_heads / shape.n_kv_heads;
        let mut out = vec![0.0f32; shape.n_heads * hd];
        for h in 0..shape.n_heads {
            let kv = (h / group) * hd;
            let s: Vec<f64> = (0..len)
                .map(|t| {
                    (0..hd).map(|i| q[h * hd + i] as f64 * k[t * kvd + kv + i] as f64).sum::<f64>() / (hd as f64).sqrt()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for i in 0..hd {
                out[h * hd + i] = (0..len).map(|t| e[t] / z * v[t * kvd + kv + i] as f64).sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn matches_reference_with_grouped_heads() {
        // Head widths of 1, 2, 3 and 8 vectors (the AVX2 kernels' chunks) and
        // one that is not whole vectors (the dot/axpy loop on every tier);
        // lengths around the scores' 8-position steps.
        for (n_heads, n_kv_heads, hd) in [(6, 2, 16), (14, 2, 64), (4, 4, 8), (2, 1, 24), (3, 1, 12)] {
            let shape = AttnShape { n_heads, n_kv_heads, head_dim: hd };
            for len in [1, 2, 7, 8, 9, 40, 300] {
                let q = synth(n_heads * hd, len as u64);
                let k = synth(len * shape.kv_dim(), 100 + len as u64);
                let v = synth(len * shape.kv_dim(), 200 + len as u64);
                let want = reference(shape, &q, &k, &v, len);
                for isa in Isa::supported() {
                    let mut scores = vec![0.0; len];
                    let mut out = vec![0.0; q.len()];
                    attend(isa, shape, &q, &k, &v, &mut scores, &mut out);
                    for (a, b) in out.iter().zip(&want) {
                        assert!((a - b).abs() < 1e-5, "{isa:?} {shape:?} len={len}: {a} vs {b}");
                    }
                    // Split by heads, the same numbers.
                    let mut split = vec![0.0; q.len()];
                    let cut = n_heads / 2 + 1;
                    let (lo, hi) = split.split_at_mut(cut * hd);
                    attend_heads(isa, shape, 0..cut, &q, &k, &v, &mut scores, lo);
                    attend_heads(isa, shape, cut..n_heads, &q, &k, &v, &mut scores, hi);
                    assert_eq!(split, out);
                }
            }
        }
    }

    /// The AVX2 softmax against its scalar twin ([`softmax`]) and f64: every
    /// probability within a few ulp (beyond the rounding of `x - max`
    /// itself, which moves twin and kernel alike), over scores spread from 0 to −100
    /// (past the exponential's floor) and lengths with ragged ends; NaN
    /// spreads as it does in the twin.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_softmax_matches_its_twin() {
        if Isa::supported().len() < 2 {
            return;
        }
        for len in [1, 3, 8, 13, 64, 1000] {
            for spread in [0.1f32, 5.0, 30.0, 100.0] {
                let x: Vec<f32> = synth(len, len as u64 + spread as u64).iter().map(|v| v * spread).collect();
                let mut twin = x.clone();
                softmax(&mut twin);
                let mut fast = x.clone();
                // SAFETY: a tier above scalar is present, so AVX2 and FMA are.
                unsafe { avx2::softmax(&mut fast) };
                let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum();
                for i in 0..len {
                    let exact = (x[i] as f64 - m).exp() / z;
                    // In ulp, relative: a few for the exponential and the
                    // scale, |x - max| for rounding `x - max` to f32, and the
                    // bound of the f32 sum's rounding: the kernel's 8 lanes
                    // each add len / 8 terms (then 3 adds across lanes), the
                    // twin adds all len in one.
                    let ulp = |sum_terms: f64| {
                        (4.0 + (x[i] as f64 - m).abs() + sum_terms) * f32::EPSILON as f64 * exact + 1e-37
                    };
                    let (a, b) = (fast[i] as f64, twin[i] as f64);
                    let n = len as f64;
                    assert!((a - exact).abs() <= ulp(n / 8.0 + 3.0), "len={len} spread={spread} [{i}]: {a} vs {exact}");
                    assert!((b - exact).abs() <= ulp(n), "twin len={len} spread={spread} [{i}]: {b} vs {exact}");
                }
            }
            // A masked score (−inf) beside others weighs nothing.
            if len > 1 {
                let mut x = synth(len, 6);
                x[len / 2] = f32::NEG_INFINITY;
                let mut twin = x.clone();
                softmax(&mut twin);
                // SAFETY: as above.
                unsafe { avx2::softmax(&mut x) };
                assert_eq!(x[len / 2], 0.0, "len={len}: e^-inf");
                let close = x.iter().zip(&twin).all(|(a, b)| (a - b).abs() <= 1e-6 * b.abs() + 1e-37);
                assert!(close, "len={len}: {x:?} vs {twin:?}");
            }
            let mut x = synth(len, 5);
            x[len / 2] = f32::NAN;
            // SAFETY: as above.
            unsafe { avx2::softmax(&mut x) };
            assert!(x.iter().all(|v| v.is_nan()), "len={len}: NaN spreads");
        }
    }

    /// A batch mixing a prompt block of one sequence and single tokens of
    /// others gives each row what the textbook gives it alone.
    #[test]
    fn batch_rows_each_see_their_own_sequence() {
        let shape = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 8 };
        let (kvd, width) = (shape.kv_dim(), 4 * 8);
        let caches: Vec<(Vec<f32>, Vec<f32>)> =
            (0..3).map(|s| (synth(80 * kvd, 10 + s as u64), synth(80 * kvd, 20 + s as u64))).collect();
        // Sequence 0: a block of 40 rows at positions 5..45; sequence 1: one
        // row at position 70; sequence 2: one row at position 0; then 0 again.
        let mut seqs = vec![0; 40];
        let mut visible: Vec<usize> = (6..46).collect();
        seqs.extend([1, 2, 0]);
        visible.extend([71, 1, 3]);
        let t = seqs.len();
        let q = synth(t * width, 99);
        let kv = |s: usize| (&caches[s].0[..], &caches[s].1[..]);
        for isa in Isa::supported() {
            for threads in [1, 3] {
                let mut out = vec![f32::NAN; t * width];
                attention(&ThreadPool::new(threads), isa, shape, &q, &seqs, &visible, &kv, &mut out);
                for i in 0..t {
                    let (k, v) = kv(seqs[i]);
                    let len = visible[i];
                    let want = reference(shape, &q[i * width..(i + 1) * width], &k[..len * kvd], &v[..len * kvd], len);
                    for (a, b) in out[i * width..(i + 1) * width].iter().zip(&want) {
                        assert!((a - b).abs() < 1e-5, "{isa:?} row {i}: {a} vs {b}");
                    }
                }
            }
        }
        // One row alone takes the single-query path, with the same numbers.
        let mut one = vec![0.0; width];
        let last = t - 1;
        attention(&ThreadPool::new(2), Isa::active(), shape, &q[last * width..], &[0], &[3], &kv, &mut one);
        let mut all = vec![0.0; t * width];
        attention(&ThreadPool::new(2), Isa::active(), shape, &q, &seqs, &visible, &kv, &mut all);
        assert_eq!(&all[last * width..], &one[..]);
    }
}
