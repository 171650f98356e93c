//! # ember-kernels
//!
//! The arithmetic of a transformer decoder, written by hand for the CPU.
//!
//! Everything here works on plain slices: no model, no tokenizer, no I/O, and
//! no allocation in the hot paths. The model crate owns buffers and shapes and
//! calls these functions; this crate only knows how to multiply, normalise and
//! rotate numbers quickly and correctly.
//!
//! Two tables organise it:
//! - [`formats`]: one row per weight type (block, paired activation format,
//!   reference and per-tier kernels); the rest of the crate is generic over
//!   the row.
//! - [`cpu`]: the CPU features, detected once, and the kernel tier they allow;
//!   every per-tier choice matches on [`cpu::Tier`] by name.
//!
//! | module | what |
//! |---|---|
//! | [`cpu`] | CPU features and tiers (detected once, `EMBER_ISA` masks them) |
//! | [`formats`] | the weight-format table: F32, BF16, F16, INT8, INT4, INT5 and ggml's Q4_1, Q5_0, Q5_1, Q2_K … Q6_K; [`MatRef`] |
//! | [`matvec`](mod@matvec) | `W (rows, cols) @ x (cols,) -> y (rows,)` over any weight type, threaded by rows; fused q/k/v and gate/up forms |
//! | [`matmul`](mod@matmul) | `X (T, cols) @ Wᵀ -> Y (T, rows)` for blocks of tokens (prefill, batched decode): the dispatch to the kernels below, f32 panels with a register-tiled micro-kernel, and a few tokens (several sequences decoding) over BF16 rows streamed like a mat-vec (`vdpbf16ps` at [`Precision::Fast`] where it pays off, f32 FMA otherwise) |
//! | [`gemm_bf16`] | those products over BF16 weights in packed 32-row panels: `vdpbf16ps` at [`Precision::Fast`] where it pays off (AVX512-BF16), f32 FMA otherwise (AVX-512) |
//! | [`gemm_int8`] | those products over INT8/INT4/INT5 (and Q5_0) weights with int8 activations at [`Precision::Fast`]: `vpdpbusd` on the VNNI tiers, `vpmaddubsw` on AVX2 and AVX-512 |
//! | [`amx`] | AMX tiles for those products, activations split into BF16 terms for f32-class accuracy |
//! | [`attention`] | attention of a batch of query rows, each over its own sequence's cached keys and values |
//! | [`dot`] | f32 vector kernels of attention (`q · k`, `o += p · v`) |
//! | [`pool`] | the persistent thread pool, and [`pool::SharedMut`] for disjoint parallel writes |
//! | [`parts`] | matrices stored in column parts, so a float mat-vec's activations stay in L1; the products over them |
//! | [`ops`] | RMSNorm, rotate-half RoPE, softmax, SiLU-gated multiply, residual add |
//! | [`bandwidth`] | a memory-read probe: the ceiling mat-vec is measured against |
//!
//! Every SIMD kernel has a portable scalar twin with the same signature; tests
//! pin each fast kernel to its twin under every tier the machine supports.

#![warn(missing_docs)]
pub mod amx;
pub mod attention;
pub mod bandwidth;
pub mod cpu;
pub mod dot;
pub mod formats;
pub mod gemm_bf16;
pub mod gemm_int8;
pub mod matmul;
pub mod matvec;
pub mod ops;
pub mod parts;
pub mod pool;
#[cfg(test)]
pub(crate) mod testutil;

pub use cpu::{Isa, Tier};
pub use formats::{bf16, f16, Format, MatRef, WeightType, Weights};
pub use matmul::{matmul, matmul_swiglu, matmul_with, matmuls, Precision};
pub use matvec::{matvec, matvec_swiglu, matvec_with, matvecs};
pub use parts::{matmul_parts, matvec_parts, ColumnParts};
pub use pool::ThreadPool;
