//! Kernel benchmarks at the real shapes of Qwen2.5-0.5B: mat-vec reported as
//! bytes of weights streamed per second (what bounds decoding), prefill's
//! matrix products as multiply-adds per second (what bounds prompts).
//!
//!     cargo bench -p ember-benches
//!     cargo bench -p ember-benches -- matmul   # only the prefill products
//!     cargo bench -p ember-benches -- "batched decode"   # 4, 8 and 16 sequences' products
//!     cargo bench -p ember-benches -- attention          # one query row over 256-4096 positions

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ember_kernels::parts::{parts_for, split_columns};
use ember_kernels::{
    bf16, f16, matmul_with, matvec, matvec_parts, matvec_with, pool, ColumnParts, Isa, MatRef, Precision, Tier, Weights,
};

/// (rows, cols) of the model's matrices: q/o, k/v, gate/up, down, LM head.
const SHAPES: [(usize, usize); 5] = [(896, 896), (128, 896), (4864, 896), (896, 4864), (151936, 896)];

fn values(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 2654435761usize) % 1000) as f32 / 1000.0 - 0.5).collect()
}

fn bench_matvec(c: &mut Criterion) {
    use ember_kernels::formats::{
        BlockQ4, BlockQ4_0, BlockQ5, BlockQ5_0, BlockQ8, Format, Int4, Int5, Int8, Q4_0, Q5_0,
    };
    for (rows, cols) in SHAPES {
        let w = values(rows * cols);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        let x = values(cols);
        let mut y = vec![0.0; rows];
        // The quantized rows read int8 activations, quantized once per call.
        // INT4 and INT5 are 128-weight blocks (every shape here is whole blocks).
        let (mut q8, mut q4) = (vec![BlockQ8::ZERO; rows * cols / 32], vec![BlockQ4::ZERO; rows * cols / 128]);
        Int8::quantize_row(&w, &mut q8);
        Int4::quantize_row(&w, &mut q4);
        // ggml's Q4_0, as GGUF files carry it: INT4's numbers before its own layout.
        let mut q4_0 = vec![BlockQ4_0::ZERO; rows * cols / 32];
        Q4_0::quantize_row(&w, &mut q4_0);
        // ggml's Q5_0, as GGUF files carry it (Q4_K_M files of this model too,
        // for the matrices whose rows are not whole 256-weight super-blocks).
        let mut q5 = vec![BlockQ5_0::ZERO; rows * cols / 32];
        Q5_0::quantize_row(&w, &mut q5);
        // ember's INT5: the same numbers as Q5_0 laid out for the kernels
        // (rows of whole 128-weight blocks: every shape here).
        let mut q5x4 = vec![BlockQ5::ZERO; rows * cols / 128];
        Int5::quantize_row(&w, &mut q5x4);
        let mut group = c.benchmark_group(format!("matvec {rows}x{cols}"));
        for (name, weights) in [
            ("f32", Weights::F32(&w)),
            ("bf16", Weights::Bf16(&wb)),
            ("f16", Weights::F16(&wh)),
            ("int8", Weights::Int8(&q8)),
            ("int4", Weights::Int4(&q4)),
            ("q4_0", Weights::Q4_0(&q4_0)),
            ("q5_0", Weights::Q5_0(&q5)),
            ("int5", Weights::Int5(&q5x4)),
        ] {
            let m = MatRef::new(weights, rows, cols);
            group.throughput(Throughput::Bytes(m.bytes() as u64));
            group.bench_function(format!("{name} threaded"), |b| b.iter(|| matvec(m, &x, &mut y)));
            // A float matrix whose activations overflow L1 as the model
            // stores it: in column parts.
            let parts = parts_for(m.weights.ty(), cols);
            if parts > 1 {
                let mut split = vec![0u32; m.bytes().div_ceil(4)];
                let bytes = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut split)[..m.bytes()];
                split_columns(m.weights.ty(), rows, cols, parts, m.weights.as_bytes(), bytes);
                let w = ColumnParts::new(Weights::from_bytes(m.weights.ty(), bytes).unwrap(), rows, cols, parts);
                group.bench_function(format!("{name} in {parts} column parts threaded"), |b| {
                    b.iter(|| matvec_parts(pool::global(), w, &x, &mut y))
                });
            }
            for isa in Isa::supported() {
                group.bench_function(format!("{name} {} 1 thread", isa.name()), |b| {
                    b.iter(|| matvec_with(isa, m, &x, &mut y))
                });
            }
        }
        group.finish();
    }
}

/// Tokens per prefill product: the default prompt chunk.
const PREFILL_TOKENS: usize = 512;

/// One product on one thread for every tier above scalar the CPU has, at
/// both precisions.
fn bench_every_tier(
    group: &mut criterion::BenchmarkGroup<criterion::measurement::WallTime>,
    name: &str,
    m: MatRef,
    x: &[f32],
    y: &mut [f32],
) {
    for isa in Isa::supported().into_iter().filter(|i| i.tier() != Tier::Scalar) {
        for p in Precision::ALL {
            group.bench_function(format!("{name} {} {} 1 thread", isa.name(), p.name()), |b| {
                b.iter(|| matmul_with(isa, p, m, x, y))
            });
        }
    }
}

fn bench_matmul(c: &mut Criterion) {
    // The four products of a layer (q/o share a shape; gate/up too).
    for (rows, cols) in [(896, 896), (128, 896), (4864, 896), (896, 4864)] {
        let w = values(rows * cols);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        let x = values(PREFILL_TOKENS * cols);
        let mut y = vec![0.0; PREFILL_TOKENS * rows];
        let mut group = c.benchmark_group(format!("matmul {PREFILL_TOKENS}x{cols} @ {rows}x{cols}T"));
        group.throughput(Throughput::Elements((rows * cols * PREFILL_TOKENS) as u64));
        for (name, weights) in [("bf16", Weights::Bf16(&wb)), ("f16", Weights::F16(&wh))] {
            bench_every_tier(&mut group, name, MatRef::new(weights, rows, cols), &x, &mut y);
        }
        group.finish();
    }
}

/// Prefill products over INT8 and INT4 weights at both precisions on every
/// tier the CPU has (fast: int8 activations, with `vpmaddubsw` on AVX2 and
/// AVX-512, `vpdpbusd` on the VNNI tiers), and BF16 products for the few
/// tokens of batched decoding (4, 8 and 16 sequences; on `amx`, 16 take
/// `amx::few_rows`).
fn bench_quantized_and_batched(c: &mut Criterion) {
    use ember_kernels::formats::{BlockQ4, BlockQ8, Format, Int4, Int8};
    for (rows, cols) in [(896, 896), (4864, 896), (896, 4864)] {
        let w = values(rows * cols);
        let (mut q8, mut q4) = (vec![BlockQ8::ZERO; rows * cols / 32], vec![BlockQ4::ZERO; rows * cols / 128]);
        Int8::quantize_row(&w, &mut q8);
        Int4::quantize_row(&w, &mut q4);
        let x = values(PREFILL_TOKENS * cols);
        let mut y = vec![0.0; PREFILL_TOKENS * rows];
        let mut group = c.benchmark_group(format!("matmul {PREFILL_TOKENS}x{cols} @ {rows}x{cols}T quantized"));
        group.throughput(Throughput::Elements((rows * cols * PREFILL_TOKENS) as u64));
        for (name, weights) in [("int8", Weights::Int8(&q8)), ("int4", Weights::Int4(&q4))] {
            bench_every_tier(&mut group, name, MatRef::new(weights, rows, cols), &x, &mut y);
        }
        group.finish();

        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        for seqs in [4, 8, 16] {
            let x = values(seqs * cols);
            let mut y = vec![0.0; seqs * rows];
            let mut group = c.benchmark_group(format!("batched decode {seqs}x{cols} @ {rows}x{cols}T"));
            group.throughput(Throughput::Elements((rows * cols * seqs) as u64));
            let m = MatRef::new(Weights::Bf16(&wb), rows, cols);
            for isa in Isa::supported().into_iter().filter(|i| i.tier() != Tier::Scalar) {
                group.bench_function(format!("bf16 {} 1 thread", isa.name()), |b| {
                    b.iter(|| matmul_with(isa, Precision::Fast, m, &x, &mut y))
                });
            }
            group.finish();
        }
    }
}

/// One query row's attention over a cached context, Qwen2.5-0.5B's heads
/// (14 query heads sharing 2 KV heads of 64): what each decoded token of
/// each sequence costs per layer.
fn bench_attention(c: &mut Criterion) {
    use ember_kernels::attention::{attend, AttnShape};
    let shape = AttnShape { n_heads: 14, n_kv_heads: 2, head_dim: 64 };
    for len in [256, 1024, 4096] {
        let q = values(shape.n_heads * shape.head_dim);
        let (k, v) = (values(len * shape.kv_dim()), values(len * shape.kv_dim()));
        let (mut scores, mut out) = (vec![0.0; len], vec![0.0; q.len()]);
        let mut group = c.benchmark_group(format!("attention 1 row over {len}"));
        group.throughput(Throughput::Elements((2 * shape.n_heads * shape.head_dim * len) as u64));
        for isa in Isa::supported() {
            group.bench_function(format!("{} 1 thread", isa.name()), |b| {
                b.iter(|| attend(isa, shape, &q, &k, &v, &mut scores, &mut out))
            });
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(std::time::Duration::from_millis(300)).measurement_time(std::time::Duration::from_secs(1));
    targets = bench_matvec, bench_matmul, bench_quantized_and_batched, bench_attention
}
criterion_main!(benches);
