//! # ember-kernels
//!
//! The arithmetic of a transformer decoder, written by hand for the CPU.
//!
//! Everything here works on plain slices: no model, no tokenizer, no I/O, and
//! no allocation in the hot paths. The model crate owns buffers and shapes and
//! calls these functions; this crate only knows how to multiply, normalise and
//! rotate numbers quickly and correctly.
//!
//! | module | what |
//! |---|---|
//! | [`isa`] | which instruction-set tier runs (detected once, `EMBER_ISA` overrides) |
//! | [`dot`] | dot products of f32 activations with F32, BF16 and F16 weights |
//! | [`matvec`] | `W (rows, cols) @ x (cols,) -> y (rows,)` over any weight dtype, threaded by rows; fused q/k/v and gate/up forms |
//! | [`amx`] | AMX tiles for prefill over BF16/F16 weights, activations split into BF16 terms for f32-class accuracy |
//! | [`matmul`] | `X (T, cols) @ Wᵀ -> Y (T, rows)` for prefill: packed panels and a register-tiled micro-kernel |
//! | [`quant`] | INT8/INT4 block formats, quantizers, integer dot products on int8 activations |
//! | [`pool`] | the persistent thread pool of the token loop |
//! | [`ops`] | RMSNorm, rotate-half RoPE, softmax, SiLU-gated multiply, residual add |
//! | [`attention`] | one query against a KV cache, grouped-query aware |
//! | [`bandwidth`] | a memory-read probe: the ceiling mat-vec is measured against |
//!
//! Every SIMD kernel has a portable scalar twin with the same signature; tests
//! pin each fast kernel to its twin under every tier the machine supports.

pub mod amx;
pub mod attention;
pub mod bandwidth;
pub mod dot;
pub mod isa;
pub mod matmul;
pub mod matvec;
pub mod ops;
pub mod pool;
pub mod quant;

pub use half::{bf16, f16};
pub use isa::Isa;
pub use matmul::{matmul, matmul_swiglu, matmul_with, matmuls};
pub use matvec::{matvec, matvec_swiglu, matvec_with, matvecs, MatRef, Weights};
pub use pool::ThreadPool;
pub use quant::{BlockQ4, BlockQ8, Format, Quant};
