//! The weight-format table: one row per weight type.
//!
//! Like ggml's type traits, each row says everything the engine needs to
//! know about a type: its stored block and how many weights it holds, the
//! activation format its dot products read (f32, or int8 blocks quantized once
//! per mat-vec), how to round a row of f32 into it (the reference), how to
//! widen it back (reference and per-tier kernels), the reference dot product
//! (the specification) and the per-tier dot and four-row kernels the mat-vec
//! streams with.
//!
//! | row | [`WeightType`] | block | weights / block | activations |
//! |---|---|---|---|---|
//! | [`F32`] | `f32` | `f32` | 1 | f32 |
//! | [`Bf16`] | `bf16` | [`bf16`] | 1 | f32 |
//! | [`F16`] | `f16` | [`f16`](struct@f16) | 1 | f32 |
//! | [`Int8`] | `int8` | [`BlockQ8`] (34 B) | 32 | [`BlockA8`] |
//! | [`Int4`] | `int4` | [`BlockQ4`] (72 B) | 128 | [`BlockA8`] |
//! | [`Int5`] | `int5` | [`BlockQ5`] (88 B) | 128 | [`BlockA8`] |
//! | [`Q4_0`] | `q4_0` | [`BlockQ4_0`] (18 B) | 32 | [`BlockA8`] |
//! | [`Q4_1`] | `q4_1` | [`BlockQ4_1`] (20 B) | 32 | [`BlockA8`] |
//! | [`Q5_0`] | `q5_0` | [`BlockQ5_0`] (22 B) | 32 | [`BlockA8`] |
//! | [`Q5_1`] | `q5_1` | [`BlockQ5_1`] (24 B) | 32 | [`BlockA8`] |
//! | [`Q2K`] | `q2_k` | [`BlockQ2K`] (84 B) | 256 | [`BlockA8K`] |
//! | [`Q3K`] | `q3_k` | [`BlockQ3K`] (110 B) | 256 | [`BlockA8K`] |
//! | [`Q4K`] | `q4_k` | [`BlockQ4K`] (144 B) | 256 | [`BlockA8K`] |
//! | [`Q5K`] | `q5_k` | [`BlockQ5K`] (176 B) | 256 | [`BlockA8K`] |
//! | [`Q6K`] | `q6_k` | [`BlockQ6K`] (210 B) | 256 | [`BlockA8K`] |
//!
//! INT8 is ggml's Q8_0 byte for byte; INT4 and INT5 are four of ggml's
//! Q4_0 and Q5_0 blocks in value, laid out for the kernels; the rows from
//! Q4_0 on are ggml's types of the same names, read from GGUF files in
//! place (their `dequantize_reference` is ggml's `dequantize_row_*`, checked
//! against the `gguf` Python package on real tensors). Like llama.cpp, the
//! 32-weight types pair with 32-wide int8 activations and the K types
//! (256-weight super-blocks) with 256-wide ones carrying sums of 16.
//!
//! The rest of the engine never matches on the type: [`Weights`] (a typed,
//! borrowed slice) and [`WeightType`] are turned into a row by the two
//! dispatch macros of this module, written once. Adding a type is adding a
//! row: a file with its block and kernels, one variant in [`WeightType`] and
//! [`Weights`], one line in each macro.

mod act;

/// How far ahead the block formats' mat-vec kernels (INT8, INT4, the GGUF
/// types) prefetch each row as they go, in bytes.
pub(crate) const PREFETCH_AHEAD: usize = 2048;
pub(crate) mod float;
mod int4;
mod int5;
mod int8;
#[cfg(target_arch = "x86_64")]
mod int_avx2;
#[cfg(target_arch = "x86_64")]
mod int_avx512;
#[cfg(target_arch = "x86_64")]
mod k_avx2;
mod kq;
#[cfg(target_arch = "x86_64")]
mod legacy_avx2;
mod q2_k;
mod q3_k;
mod q4_0;
mod q4_1;
mod q4_k;
mod q5_0;
mod q5_1;
mod q5_k;
mod q6_k;

pub use act::{
    quad_at, quads_of, quantize_activations, quantize_activations_k, quantize_activations_k_scalar,
    quantize_activations_scalar, BlockA8, BlockA8K, BlockA8x4, QK_A8, QK_A8K,
};
pub use float::{Bf16, F16, F32};
pub use half::{bf16, f16};
pub use int4::{BlockQ4, Int4, QK4};
pub use int5::{BlockQ5, Int5, QK5};
pub use int8::{BlockQ8, Int8};
pub use kq::QK_K;
pub use q2_k::{BlockQ2K, Q2K};
pub use q3_k::{BlockQ3K, Q3K};
pub use q4_0::{BlockQ4_0, Q4_0};
pub use q4_1::{BlockQ4_1, Q4_1};
pub use q4_k::{BlockQ4K, Q4K};
pub use q5_0::{BlockQ5_0, Q5_0};
pub use q5_1::{BlockQ5_1, Q5_1};
pub use q5_k::{BlockQ5K, Q5K};
pub use q6_k::{BlockQ6K, Q6K};

use crate::cpu::{Isa, Tier};

/// Every weight type ember computes with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightType {
    /// f32 weights.
    F32,
    /// BF16 weights (the upper half of an f32).
    Bf16,
    /// IEEE F16 weights.
    F16,
    /// ember's INT8 blocks ([`BlockQ8`]).
    Int8,
    /// ember's INT4 blocks ([`BlockQ4`]).
    Int4,
    /// ember's INT5 blocks ([`BlockQ5`]).
    Int5,
    /// ggml's Q4_0 blocks ([`BlockQ4_0`]).
    Q4_0,
    /// ggml's Q4_1 blocks ([`BlockQ4_1`]).
    Q4_1,
    /// ggml's Q5_0 blocks ([`BlockQ5_0`]).
    Q5_0,
    /// ggml's Q5_1 blocks ([`BlockQ5_1`]).
    Q5_1,
    /// ggml's Q2_K super-blocks ([`BlockQ2K`]).
    Q2K,
    /// ggml's Q3_K super-blocks ([`BlockQ3K`]).
    Q3K,
    /// ggml's Q4_K super-blocks ([`BlockQ4K`]).
    Q4K,
    /// ggml's Q5_K super-blocks ([`BlockQ5K`]).
    Q5K,
    /// ggml's Q6_K super-blocks ([`BlockQ6K`]).
    Q6K,
}

/// Runs `$body` with `$F` bound to the [`Format`] row of a [`WeightType`].
macro_rules! with_type {
    ($ty:expr, |$F:ident| $body:expr) => {
        match $ty {
            $crate::formats::WeightType::F32 => {
                type $F = $crate::formats::F32;
                $body
            }
            $crate::formats::WeightType::Bf16 => {
                type $F = $crate::formats::Bf16;
                $body
            }
            $crate::formats::WeightType::F16 => {
                type $F = $crate::formats::F16;
                $body
            }
            $crate::formats::WeightType::Int8 => {
                type $F = $crate::formats::Int8;
                $body
            }
            $crate::formats::WeightType::Int4 => {
                type $F = $crate::formats::Int4;
                $body
            }
            $crate::formats::WeightType::Int5 => {
                type $F = $crate::formats::Int5;
                $body
            }
            $crate::formats::WeightType::Q4_0 => {
                type $F = $crate::formats::Q4_0;
                $body
            }
            $crate::formats::WeightType::Q4_1 => {
                type $F = $crate::formats::Q4_1;
                $body
            }
            $crate::formats::WeightType::Q5_0 => {
                type $F = $crate::formats::Q5_0;
                $body
            }
            $crate::formats::WeightType::Q5_1 => {
                type $F = $crate::formats::Q5_1;
                $body
            }
            $crate::formats::WeightType::Q2K => {
                type $F = $crate::formats::Q2K;
                $body
            }
            $crate::formats::WeightType::Q3K => {
                type $F = $crate::formats::Q3K;
                $body
            }
            $crate::formats::WeightType::Q4K => {
                type $F = $crate::formats::Q4K;
                $body
            }
            $crate::formats::WeightType::Q5K => {
                type $F = $crate::formats::Q5K;
                $body
            }
            $crate::formats::WeightType::Q6K => {
                type $F = $crate::formats::Q6K;
                $body
            }
        }
    };
}

/// Runs `$body` with `$F` bound to the [`Format`] row of a [`Weights`] and
/// `$data` to its typed slice of blocks.
macro_rules! with_weights {
    ($weights:expr, |$F:ident, $data:ident| $body:expr) => {
        match $weights {
            $crate::formats::Weights::F32($data) => {
                type $F = $crate::formats::F32;
                $body
            }
            $crate::formats::Weights::Bf16($data) => {
                type $F = $crate::formats::Bf16;
                $body
            }
            $crate::formats::Weights::F16($data) => {
                type $F = $crate::formats::F16;
                $body
            }
            $crate::formats::Weights::Int8($data) => {
                type $F = $crate::formats::Int8;
                $body
            }
            $crate::formats::Weights::Int4($data) => {
                type $F = $crate::formats::Int4;
                $body
            }
            $crate::formats::Weights::Int5($data) => {
                type $F = $crate::formats::Int5;
                $body
            }
            $crate::formats::Weights::Q4_0($data) => {
                type $F = $crate::formats::Q4_0;
                $body
            }
            $crate::formats::Weights::Q4_1($data) => {
                type $F = $crate::formats::Q4_1;
                $body
            }
            $crate::formats::Weights::Q5_0($data) => {
                type $F = $crate::formats::Q5_0;
                $body
            }
            $crate::formats::Weights::Q5_1($data) => {
                type $F = $crate::formats::Q5_1;
                $body
            }
            $crate::formats::Weights::Q2K($data) => {
                type $F = $crate::formats::Q2K;
                $body
            }
            $crate::formats::Weights::Q3K($data) => {
                type $F = $crate::formats::Q3K;
                $body
            }
            $crate::formats::Weights::Q4K($data) => {
                type $F = $crate::formats::Q4K;
                $body
            }
            $crate::formats::Weights::Q5K($data) => {
                type $F = $crate::formats::Q5K;
                $body
            }
            $crate::formats::Weights::Q6K($data) => {
                type $F = $crate::formats::Q6K;
                $body
            }
        }
    };
}

pub(crate) use with_weights;

/// The `kernels(tier)` of a row whose x86 tiers all run its AVX2 kernels
/// (every tier above scalar has AVX2's features): `module::{dot, rows4,
/// dequantize}`. Every tier is named.
macro_rules! x86_kernels {
    ($tier:expr, $module:ident, $dot:ident, $rows4:ident, $dequantize:ident) => {
        match $tier {
            $crate::cpu::Tier::Scalar => $crate::formats::reference_kernels(),
            #[cfg(target_arch = "x86_64")]
            $crate::cpu::Tier::Avx2
            | $crate::cpu::Tier::AvxVnni
            | $crate::cpu::Tier::Avx512
            | $crate::cpu::Tier::Avx512Vnni
            | $crate::cpu::Tier::Avx512Bf16
            | $crate::cpu::Tier::Amx => {
                use $crate::formats::$module as k;
                $crate::formats::Kernels {
                    dot: k::$dot,
                    rows4: k::$rows4,
                    rows4_quads: None,
                    dequantize: k::$dequantize,
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            $crate::cpu::Tier::Avx2
            | $crate::cpu::Tier::AvxVnni
            | $crate::cpu::Tier::Avx512
            | $crate::cpu::Tier::Avx512Vnni
            | $crate::cpu::Tier::Avx512Bf16
            | $crate::cpu::Tier::Amx => unreachable!("x86 tiers are only detected on x86"),
        }
    };
}

pub(crate) use x86_kernels;

/// Row-major weights in their stored type, borrowed.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    /// f32 weights.
    F32(&'a [f32]),
    /// BF16 weights.
    Bf16(&'a [bf16]),
    /// F16 weights.
    F16(&'a [f16]),
    /// ember's INT8 blocks.
    Int8(&'a [BlockQ8]),
    /// ember's INT4 blocks.
    Int4(&'a [BlockQ4]),
    /// ember's INT5 blocks.
    Int5(&'a [BlockQ5]),
    /// ggml's Q4_0 blocks.
    Q4_0(&'a [BlockQ4_0]),
    /// ggml's Q4_1 blocks.
    Q4_1(&'a [BlockQ4_1]),
    /// ggml's Q5_0 blocks.
    Q5_0(&'a [BlockQ5_0]),
    /// ggml's Q5_1 blocks.
    Q5_1(&'a [BlockQ5_1]),
    /// ggml's Q2_K super-blocks.
    Q2K(&'a [BlockQ2K]),
    /// ggml's Q3_K super-blocks.
    Q3K(&'a [BlockQ3K]),
    /// ggml's Q4_K super-blocks.
    Q4K(&'a [BlockQ4K]),
    /// ggml's Q5_K super-blocks.
    Q5K(&'a [BlockQ5K]),
    /// ggml's Q6_K super-blocks.
    Q6K(&'a [BlockQ6K]),
}

/// One weight type as a row of the table. See the module docs.
pub trait Format: Sized + 'static {
    /// The row's name in [`WeightType`].
    const TYPE: WeightType;
    /// The file and command-line name (`bf16`, `int8`, ...).
    const NAME: &'static str;
    /// The stored unit: a number, or a block of [`Format::BLOCK_LEN`] weights.
    type Block: bytemuck::Pod + PartialEq + std::fmt::Debug + Send + Sync;
    /// Weights per block (rows are whole blocks).
    const BLOCK_LEN: usize;
    /// The activation format dot products read.
    type Act: Activation;
    /// A block of zeros.
    const ZERO: Self::Block;
    /// Whether the engine rounds f32 weights into this type when asked to
    /// quantize (`--quant`).
    const QUANTIZED: bool;

    /// `data` as type-erased weights.
    fn wrap(data: &[Self::Block]) -> Weights<'_>;
    /// Rounds `src (n * BLOCK_LEN,)` into `dst (n,)`: the reference quantizer.
    fn quantize_row(src: &[f32], dst: &mut [Self::Block]);
    /// `src (n,)` widened to `dst (n * BLOCK_LEN,)`: the specification.
    fn dequantize_reference(src: &[Self::Block], dst: &mut [f32]);
    /// `Σ w·x` over a row: the specification the fast kernels are tested against.
    fn dot_reference(w: &[Self::Block], x: &[Self::Act]) -> f32;
    /// The kernels a tier runs for this type. Matches every tier by name.
    fn kernels(tier: Tier) -> Kernels<Self>;

    /// For rows read by int8 activations: 32 weights of a block (sub-block
    /// `sub` of the `BLOCK_LEN / 32`; 0 for the 32-weight rows) as unsigned
    /// byte codes, weight `j` = `d · (u[j] − offset)`, the operand the
    /// integer matrix products ([`crate::gemm_int8`]) multiply with int8
    /// activations. `None` for the float rows.
    fn codes(_block: &Self::Block, _sub: usize) -> Option<Codes> {
        None
    }

    /// [`Format::dot_reference`] with `isa`'s kernel.
    fn dot(isa: Isa, w: &[Self::Block], x: &[Self::Act]) -> f32 {
        assert_eq!(w.len() * Self::BLOCK_LEN, x.len() * Self::Act::BLOCK_LEN, "row and activation lengths");
        // SAFETY: `isa` exists only if the CPU has its tier's features; the
        // lengths agree.
        unsafe { (Self::kernels(isa.tier()).dot)(w, x) }
    }

    /// [`Format::dequantize_reference`] with `isa`'s kernel (bit for bit).
    fn dequantize(isa: Isa, src: &[Self::Block], dst: &mut [f32]) {
        assert_eq!(src.len() * Self::BLOCK_LEN, dst.len(), "row length");
        // SAFETY: as above.
        unsafe { (Self::kernels(isa.tier()).dequantize)(src, dst) }
    }
}

/// A block of 32 weights as unsigned codes: weight `j` = `d · (u[j] − offset)`.
/// The formats are symmetric about their offset, codes below `2 · offset`
/// (INT8: 0..=255 about 128, INT4: 0..=15 about 8, Q5_0: 0..=31 about 16),
/// so `u − offset` is an i8.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Codes {
    /// The block's scale.
    pub d: f32,
    /// The 32 unsigned codes, weight `j` in `u[j]`.
    pub u: [u8; QK_A8],
    /// The code that means zero.
    pub offset: i32,
}

/// A row kernel: `w (n,) · x`.
pub type DotKernel<F> = unsafe fn(&[<F as Format>::Block], &[<F as Format>::Act]) -> f32;
/// A four-row kernel: four rows against the same activations.
pub type Rows4Kernel<F> = unsafe fn([&[<F as Format>::Block]; 4], &[<F as Format>::Act]) -> [f32; 4];
/// A four-row kernel over int8 activations laid out four blocks at a time
/// ([`BlockA8x4`], `⌈cols / 128⌉` of them for rows of `cols` weights).
pub type Rows4QuadsKernel<F> = unsafe fn([&[<F as Format>::Block]; 4], &[BlockA8x4]) -> [f32; 4];

/// One tier's kernels for a weight type. Each requires the CPU to have the
/// tier's features, hence `unsafe`; an [`Isa`] is the proof.
pub struct Kernels<F: Format> {
    /// `w (n,) · x`, the lengths agreeing.
    pub dot: DotKernel<F>,
    /// Four rows against the same activations: `[w0 · x, w1 · x, w2 · x, w3 · x]`.
    /// The mat-vec passes rows from the four quarters of a matrix, so four
    /// memory streams are in flight.
    pub rows4: Rows4Kernel<F>,
    /// [`Kernels::rows4`] with the int8 activations as [`BlockA8x4`], where
    /// the tier has such a kernel (the same bits as `rows4`); the mat-vec
    /// then lays them out once for all rows.
    pub rows4_quads: Option<Rows4QuadsKernel<F>>,
    /// Blocks widened to f32 (`dst.len() == src.len() * BLOCK_LEN`).
    pub dequantize: unsafe fn(&[F::Block], &mut [f32]),
}

impl<F: Format> Clone for Kernels<F> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<F: Format> Copy for Kernels<F> {}

/// The scalar tier of any row: its reference functions.
pub(crate) fn reference_kernels<F: Format>() -> Kernels<F> {
    Kernels {
        dot: F::dot_reference,
        rows4: rows4_reference::<F>,
        rows4_quads: None,
        dequantize: F::dequantize_reference,
    }
}

fn rows4_reference<F: Format>(w: [&[F::Block]; 4], x: &[F::Act]) -> [f32; 4] {
    w.map(|row| F::dot_reference(row, x))
}

/// The activation formats dot products read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActType {
    /// The f32 activations as they are.
    F32,
    /// Int8 blocks of 32 with an f32 scale ([`BlockA8`]).
    A8,
    /// Int8 blocks of 256 with an f32 scale and sums of 16 ([`BlockA8K`]).
    A8K,
}

/// An activation format: how a row's dot product reads the input vector.
pub trait Activation: Copy + Send + Sync + 'static {
    /// Which format this is.
    const TYPE: ActType;
    /// Inputs per element.
    const BLOCK_LEN: usize;
    /// This format's view of an input prepared by [`Acts`].
    fn pick<'a>(acts: &Acts<'a>) -> &'a [Self];
    /// The inputs as the dot products see them, `out (blocks.len() * BLOCK_LEN,)`.
    fn values(blocks: &[Self], out: &mut [f32]);
}

impl Activation for f32 {
    const TYPE: ActType = ActType::F32;
    const BLOCK_LEN: usize = 1;
    fn pick<'a>(acts: &Acts<'a>) -> &'a [f32] {
        acts.f32
    }
    fn values(blocks: &[f32], out: &mut [f32]) {
        out.copy_from_slice(blocks)
    }
}

impl Activation for BlockA8 {
    const TYPE: ActType = ActType::A8;
    const BLOCK_LEN: usize = QK_A8;
    fn pick<'a>(acts: &Acts<'a>) -> &'a [BlockA8] {
        acts.a8
    }
    fn values(blocks: &[BlockA8], out: &mut [f32]) {
        for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_A8)) {
            o.iter_mut().zip(&b.qs).for_each(|(o, &q)| *o = b.d * q as f32);
        }
    }
}

impl Activation for BlockA8K {
    const TYPE: ActType = ActType::A8K;
    const BLOCK_LEN: usize = QK_A8K;
    fn pick<'a>(acts: &Acts<'a>) -> &'a [BlockA8K] {
        acts.a8k
    }
    fn values(blocks: &[BlockA8K], out: &mut [f32]) {
        for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_A8K)) {
            o.iter_mut().zip(&b.qs).for_each(|(o, &q)| *o = b.d * q as f32);
        }
    }
}

/// One input vector in every activation format some matrix needs (the
/// others empty): quantized once per mat-vec, read by every row and thread.
#[derive(Clone, Copy)]
pub struct Acts<'a> {
    /// The activations as f32 `(cols,)`.
    pub f32: &'a [f32],
    /// The activations as int8 blocks `(cols / 32,)`, or empty when no matrix reads them.
    pub a8: &'a [BlockA8],
    /// The activations as 256-wide int8 blocks `(cols / 256,)`, or empty when no matrix reads them.
    pub a8k: &'a [BlockA8K],
    /// `a8` four blocks at a time (`⌈cols / 128⌉`), or empty when no
    /// matrix's kernel reads them ([`Kernels::rows4_quads`]).
    pub a8x4: &'a [BlockA8x4],
}

impl WeightType {
    /// Every type, in table order.
    pub const ALL: [WeightType; 15] = [
        WeightType::F32,
        WeightType::Bf16,
        WeightType::F16,
        WeightType::Int8,
        WeightType::Int4,
        WeightType::Int5,
        WeightType::Q4_0,
        WeightType::Q4_1,
        WeightType::Q5_0,
        WeightType::Q5_1,
        WeightType::Q2K,
        WeightType::Q3K,
        WeightType::Q4K,
        WeightType::Q5K,
        WeightType::Q6K,
    ];

    /// The file and command-line name: `f32`, `bf16`, `f16`, `int8`, `int4`, `int5`,
    /// and ggml's names in lower case for its types (`q4_0`, ..., `q6_k`).
    pub fn name(self) -> &'static str {
        with_type!(self, |F| F::NAME)
    }

    /// Parses [`WeightType::name`] (any case).
    pub fn from_name(s: &str) -> Option<WeightType> {
        WeightType::ALL.into_iter().find(|t| t.name().eq_ignore_ascii_case(s.trim()))
    }

    /// Whether this is a float type (`f32`, `bf16`, `f16`: one weight per
    /// element, read by f32 activations) rather than blocks.
    pub fn is_float(self) -> bool {
        self.act() == ActType::F32
    }

    /// Whether `--quant` may round weights into this type.
    pub fn is_quantized(self) -> bool {
        with_type!(self, |F| F::QUANTIZED)
    }

    /// Weights per block.
    pub fn block_len(self) -> usize {
        with_type!(self, |F| F::BLOCK_LEN)
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        with_type!(self, |F| std::mem::size_of::<<F as Format>::Block>())
    }

    /// Alignment the stored data needs, in bytes.
    pub fn align(self) -> usize {
        with_type!(self, |F| std::mem::align_of::<<F as Format>::Block>())
    }

    /// The activation format its dot products read.
    pub fn act(self) -> ActType {
        with_type!(self, |F| <<F as Format>::Act as Activation>::TYPE)
    }

    /// Whether this type's mat-vec on `tier` reads the int8 activations
    /// four blocks at a time ([`BlockA8x4`], [`Kernels::rows4_quads`]).
    pub fn reads_quads(self, tier: Tier) -> bool {
        with_type!(self, |F| F::kernels(tier).rows4_quads.is_some())
    }

    /// Whether its blocks read as unsigned codes about an offset
    /// ([`Format::codes`]), which the integer matrix products need.
    pub fn has_codes(self) -> bool {
        with_type!(self, |F| F::codes(&F::ZERO, 0).is_some())
    }

    /// Rounds `src` (whole blocks) into this type's blocks, written as bytes
    /// to `dst` (`src.len() / block_len * block_bytes`). The reference
    /// quantizer.
    pub fn quantize_row(self, src: &[f32], dst: &mut [u8]) {
        with_type!(self, |F| {
            let blocks: &mut [<F as Format>::Block] =
                bytemuck::try_cast_slice_mut(dst).expect("destination holds whole blocks");
            F::quantize_row(src, blocks)
        })
    }
}

impl std::fmt::Display for WeightType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl<'a> Weights<'a> {
    /// Stored bytes as weights of type `ty`; `None` if the length or the
    /// alignment does not fit the type's blocks.
    pub fn from_bytes(ty: WeightType, bytes: &'a [u8]) -> Option<Weights<'a>> {
        with_type!(ty, |F| bytemuck::try_cast_slice::<u8, <F as Format>::Block>(bytes).ok().map(F::wrap))
    }

    /// The stored bytes.
    pub fn as_bytes(&self) -> &'a [u8] {
        with_weights!(*self, |F, d| bytemuck::cast_slice::<<F as Format>::Block, u8>(d))
    }

    /// The weight type of this slice.
    pub fn ty(&self) -> WeightType {
        with_weights!(self, |F, _d| F::TYPE)
    }

    /// Number of weights.
    pub fn len(&self) -> usize {
        with_weights!(self, |F, d| d.len() * F::BLOCK_LEN)
    }

    /// Whether there are no weights.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of storage.
    pub fn bytes(&self) -> usize {
        self.as_bytes().len()
    }

    /// Every weight widened to f32 (for small tensors: norms, biases).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        with_weights!(*self, |F, d| F::dequantize_reference(d, &mut out));
        out
    }
}

/// A borrowed matrix `(rows, cols)`, row-major, rows whole blocks.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    /// The weights, row after row.
    pub weights: Weights<'a>,
    /// Rows (outputs of a product).
    pub rows: usize,
    /// Columns (inputs of a product), whole blocks.
    pub cols: usize,
}

impl<'a> MatRef<'a> {
    /// Wraps `weights` as a `(rows, cols)` matrix. Panics if the sizes disagree:
    /// that is a bug in the caller, which validated shapes at load time.
    pub fn new(weights: Weights<'a>, rows: usize, cols: usize) -> Self {
        assert_eq!(weights.len(), rows * cols, "matrix data does not hold {rows}x{cols}");
        let block = weights.ty().block_len();
        assert!(cols.is_multiple_of(block), "{} rows are whole blocks of {block}", weights.ty());
        MatRef { weights, rows, cols }
    }

    /// Rows `start..end` as a matrix of their own.
    pub fn rows(&self, start: usize, end: usize) -> MatRef<'a> {
        let per_row = self.cols / self.weights.ty().block_len();
        let weights = with_weights!(self.weights, |F, d| F::wrap(&d[start * per_row..end * per_row]));
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
        self.rows(r, r + 1).row_to_f32_range_with(isa, 0..self.cols, out)
    }

    /// Columns `cols` of row 0 widened to f32 into `out`; the range must be
    /// whole blocks.
    pub fn row_to_f32_range_with(&self, isa: Isa, cols: std::ops::Range<usize>, out: &mut [f32]) {
        assert_eq!(out.len(), cols.len());
        with_weights!(self.weights, |F, d| {
            let b = F::BLOCK_LEN;
            assert!(
                cols.start.is_multiple_of(b) && cols.end.is_multiple_of(b),
                "column range {cols:?} is not whole blocks of {b}"
            );
            F::dequantize(isa, &d[cols.start / b..cols.end / b], out)
        })
    }

    /// Bytes of weights this matrix streams per mat-vec.
    pub fn bytes(&self) -> usize {
        self.weights.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::synth;

    /// Every row keeps its contract on every tier the CPU runs: the fast
    /// dequantize equals the reference bit for bit, the fast dot and four-row
    /// kernels agree with the reference dot, and the byte view round-trips.
    fn row_contract<F: Format>() {
        for n in [32usize, 64, 96, 256, 512, 896, 4864].into_iter().filter(|n| n.is_multiple_of(F::BLOCK_LEN)) {
            let w = synth(4 * n, n as u64);
            let x = synth(n, n as u64 + 1);
            let mut blocks = vec![F::ZERO; 4 * n / F::BLOCK_LEN];
            F::quantize_row(&w, &mut blocks);
            let mut a8 = vec![BlockA8::ZERO; n / QK_A8];
            quantize_activations_scalar(&x, &mut a8);
            let mut a8k = vec![BlockA8K::ZERO; n / QK_A8K];
            quantize_activations_k_scalar(&x[..n / QK_A8K * QK_A8K], &mut a8k);
            let mut a8x4 = Vec::new();
            quads_of(&a8, &mut a8x4);
            let acts = Acts { f32: &x, a8: &a8, a8k: &a8k, a8x4: &a8x4 };
            let xa = F::Act::pick(&acts);
            let rows: Vec<&[F::Block]> = blocks.chunks_exact(n / F::BLOCK_LEN).collect();
            let want: Vec<f32> = rows.iter().map(|r| F::dot_reference(r, xa)).collect();
            let mut back = vec![0.0; 4 * n];
            F::dequantize_reference(&blocks, &mut back);
            let mag: f32 = back[..n].iter().zip(&x).map(|(a, b)| (a * b).abs()).sum::<f32>().max(1.0);
            for isa in Isa::supported() {
                let mut fast_back = vec![f32::NAN; 4 * n];
                F::dequantize(isa, &blocks, &mut fast_back);
                assert!(
                    fast_back.iter().zip(&back).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} {isa:?} dequantize n={n}",
                    F::NAME
                );
                // SAFETY: `isa` is supported.
                let four = unsafe { (F::kernels(isa.tier()).rows4)([rows[0], rows[1], rows[2], rows[3]], xa) };
                if let Some(quads) = F::kernels(isa.tier()).rows4_quads {
                    // SAFETY: as above; `acts.a8x4` holds ⌈n / 4⌉ quads of `a8`.
                    let got = unsafe { quads([rows[0], rows[1], rows[2], rows[3]], acts.a8x4) };
                    let same = got.iter().zip(&four).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{} {isa:?} rows4_quads n={n}: {got:?} vs {four:?}", F::NAME);
                }
                for k in 0..4 {
                    let one = F::dot(isa, rows[k], xa);
                    assert!((one - want[k]).abs() <= 1e-5 * mag, "{} {isa:?} dot n={n}: {one} vs {}", F::NAME, want[k]);
                    assert!((four[k] - want[k]).abs() <= 1e-5 * mag, "{} {isa:?} rows4 n={n}", F::NAME);
                }
            }
            let bytes = F::wrap(&blocks).as_bytes();
            let again = Weights::from_bytes(F::TYPE, bytes).expect("aligned");
            assert_eq!(again.as_bytes(), bytes);
            assert_eq!(again.ty(), F::TYPE);
            assert_eq!(again.len(), 4 * n);
        }
    }

    #[test]
    fn every_row_keeps_its_contract() {
        row_contract::<F32>();
        row_contract::<Bf16>();
        row_contract::<F16>();
        row_contract::<Int8>();
        row_contract::<Int4>();
        row_contract::<Int5>();
        row_contract::<Q4_0>();
        row_contract::<Q4_1>();
        row_contract::<Q5_0>();
        row_contract::<Q5_1>();
        row_contract::<Q2K>();
        row_contract::<Q3K>();
        row_contract::<Q4K>();
        row_contract::<Q5K>();
        row_contract::<Q6K>();
    }

    /// The ggml rows: the reference quantizer's round trip is within a
    /// limit set by the type's step (uniform data in [−1, 1): a code step
    /// `s` gives an RMSE near `s / √12`; the limits are that bound for the
    /// type's bits plus margin for the rounded scales), the integer dot
    /// equals the f32 dot of the dequantized weights with the activations as
    /// the kernel sees them (up to f32 rounding), and on blocks with random
    /// bytes (any scale, any code) the kernels still agree.
    fn ggml_row<F: Format>(rmse_limit: f32) {
        let n = 4864;
        let w = synth(n, 31);
        let x = synth(n, 32);
        let mut q = vec![F::ZERO; n / F::BLOCK_LEN];
        F::quantize_row(&w, &mut q);
        let mut back = vec![0.0; n];
        F::dequantize_reference(&q, &mut back);
        let rmse = (w.iter().zip(&back).map(|(a, b)| (a - b).powi(2)).sum::<f32>() / n as f32).sqrt();
        assert!(rmse < rmse_limit, "{} rmse {rmse}", F::NAME);
        let mut a8 = vec![BlockA8::ZERO; n / QK_A8];
        quantize_activations_scalar(&x, &mut a8);
        let mut a8k = vec![BlockA8K::ZERO; n / QK_A8K];
        quantize_activations_k_scalar(&x, &mut a8k);
        let xa = F::Act::pick(&Acts { f32: &x, a8: &a8, a8k: &a8k, a8x4: &[] });
        let mut xd = vec![0.0; n];
        F::Act::values(xa, &mut xd);
        let want: f32 = back.iter().zip(&xd).map(|(a, b)| a * b).sum();
        let got = F::dot_reference(&q, xa);
        assert!((got - want).abs() <= 1e-4 * (n as f32).sqrt(), "{}: {got} vs {want}", F::NAME);
        // Random bytes, the F16 scales kept finite and small.
        let size = std::mem::size_of::<F::Block>();
        let mut raw: Vec<u8> = synth(n / F::BLOCK_LEN * size, 33).iter().map(|v| (v.to_bits() >> 7) as u8).collect();
        let blocks: &mut [F::Block] = bytemuck::cast_slice_mut(&mut raw);
        for b in blocks.iter_mut() {
            let bytes: &mut [u8] = bytemuck::bytes_of_mut(b);
            // Every F16 field: the last two bytes of the block or its first
            // four (the layouts put them there); exponent kept in range.
            for at in [0, 2, size - 4, size - 2] {
                bytes[at + 1] = (bytes[at + 1] & 0x83) | 0x1c;
            }
        }
        let mut back = vec![0.0; n];
        F::dequantize_reference(blocks, &mut back);
        assert!(back.iter().all(|v| v.is_finite()), "{}", F::NAME);
        let mag: f32 = back.iter().zip(&xd).map(|(a, b)| (a * b).abs()).sum::<f32>().max(1.0);
        let want = F::dot_reference(blocks, xa);
        for isa in Isa::supported() {
            let mut fast = vec![f32::NAN; n];
            F::dequantize(isa, blocks, &mut fast);
            assert!(fast.iter().zip(&back).all(|(a, b)| a.to_bits() == b.to_bits()), "{} {isa:?}", F::NAME);
            let got = F::dot(isa, blocks, xa);
            assert!((got - want).abs() <= 1e-5 * mag, "{} {isa:?} random dot {got} vs {want}", F::NAME);
        }
    }

    #[test]
    fn ggml_rows_round_trip_and_dot() {
        // Steps on [−1, 1): 4 bits ≈ 2/15, 5 bits ≈ 2/31, 2 bits 2/3, 3 bits 2/7, 6 bits 2/63.
        ggml_row::<Q4_0>(0.05);
        ggml_row::<Q4_1>(0.045);
        ggml_row::<Q5_0>(0.022);
        ggml_row::<Q5_1>(0.022);
        ggml_row::<Q2K>(0.21);
        ggml_row::<Q3K>(0.10);
        ggml_row::<Q4K>(0.048);
        ggml_row::<Q5K>(0.024);
        ggml_row::<Q6K>(0.012);
    }

    /// No tier silently runs another tier's kernels: every tier above scalar
    /// has kernels of its own, distinct from the reference ones.
    #[test]
    fn every_declared_tier_has_its_kernels() {
        fn distinct<F: Format>() {
            let reference = F::kernels(Tier::Scalar);
            for tier in Tier::ALL.into_iter().filter(|&t| t != Tier::Scalar) {
                if cfg!(target_arch = "x86_64") {
                    let k = F::kernels(tier);
                    assert_ne!(k.dot as usize, reference.dot as usize, "{} {tier:?} dot", F::NAME);
                    assert_ne!(k.rows4 as usize, reference.rows4 as usize, "{} {tier:?} rows4", F::NAME);
                    assert_ne!(k.dequantize as usize, reference.dequantize as usize, "{} {tier:?} dequantize", F::NAME);
                }
            }
        }
        distinct::<F32>();
        distinct::<Bf16>();
        distinct::<F16>();
        distinct::<Int8>();
        distinct::<Int4>();
        distinct::<Int5>();
        distinct::<Q4_0>();
        distinct::<Q4_1>();
        distinct::<Q5_0>();
        distinct::<Q5_1>();
        distinct::<Q2K>();
        distinct::<Q3K>();
        distinct::<Q4K>();
        distinct::<Q5K>();
        distinct::<Q6K>();
    }

    /// Each format's codes ([`Format::codes`], what the prefill's integer
    /// panels are packed from) give its weights: `d · (u − offset)` equals
    /// the reference dequantization, on blocks of random bytes.
    #[test]
    fn codes_give_the_weights() {
        fn check<F: Format>() {
            let size = std::mem::size_of::<F::Block>();
            let mut raw: Vec<u8> = synth(64 * size, 34).iter().map(|v| (v.to_bits() >> 7) as u8).collect();
            let blocks: &mut [F::Block] = bytemuck::cast_slice_mut(&mut raw);
            for b in blocks.iter_mut() {
                // The scales (the block's first two bytes, or first eight:
                // INT4's and INT5's four) finite.
                let bytes: &mut [u8] = bytemuck::bytes_of_mut(b);
                let scales = if F::BLOCK_LEN == QK5 { 4 } else { 1 };
                for s in 0..scales {
                    bytes[2 * s + 1] = (bytes[2 * s + 1] & 0x83) | 0x1c;
                }
            }
            let mut want = vec![0.0; blocks.len() * F::BLOCK_LEN];
            F::dequantize_reference(blocks, &mut want);
            for (b, want) in blocks.iter().zip(want.chunks_exact(F::BLOCK_LEN)) {
                for (sub, want) in want.chunks_exact(QK_A8).enumerate() {
                    let c = F::codes(b, sub).expect("a format with codes");
                    assert!(c.u.iter().all(|&u| (u as i32) < 2 * c.offset), "{} codes below 2 · offset", F::NAME);
                    for (j, (&u, &w)) in c.u.iter().zip(want).enumerate() {
                        let got = c.d * (u as i32 - c.offset) as f32;
                        assert_eq!(got.to_bits(), w.to_bits(), "{} weight {j} of {sub}: {got} vs {w}", F::NAME);
                    }
                }
            }
        }
        check::<Int8>();
        check::<Int4>();
        check::<Int5>();
        check::<Q4_0>();
        check::<Q5_0>();
    }

    /// The rows with codes at fast precision go through the integer
    /// matrix products (`gemm_int8`) on every x86 tier: each token's
    /// outputs equal the reference dots against that token's int8
    /// activations (scalar, which has no integer kernels, computes in f32:
    /// the dequantized weights' exact products). 40 rows (a panel and a
    /// part), 384 columns (three INT5 blocks), 5 tokens.
    fn integer_products_take<F: Format<Act = BlockA8>>() {
        let (rows, cols, t) = (40, 384, 5);
        let per_row = cols / F::BLOCK_LEN;
        let mut w = vec![F::ZERO; rows * per_row];
        F::quantize_row(&synth(rows * cols, 5), &mut w);
        let x = synth(t * cols, 6);
        let m = MatRef::new(F::wrap(&w), rows, cols);
        assert!(crate::gemm_int8::handles(&m), "{}", F::NAME);
        let mut wf = vec![0.0; rows * cols];
        F::dequantize_reference(&w, &mut wf);
        for isa in Isa::supported() {
            let integer = crate::gemm_int8::available(isa);
            let mut y = vec![f32::NAN; t * rows];
            crate::matmul_with(isa, crate::Precision::Fast, m, &x, &mut y);
            for tok in 0..t {
                let xt = &x[tok * cols..(tok + 1) * cols];
                let mut a = vec![BlockA8::ZERO; cols / QK_A8];
                quantize_activations_scalar(xt, &mut a);
                for r in 0..rows {
                    let want = if integer {
                        F::dot_reference(&w[r * per_row..(r + 1) * per_row], &a)
                    } else {
                        wf[r * cols..(r + 1) * cols].iter().zip(xt).map(|(a, b)| a * b).sum()
                    };
                    let got = y[tok * rows + r];
                    assert!(
                        (got - want).abs() <= 1e-5 * cols as f32,
                        "{} {isa:?} token {tok} row {r}: {got} vs {want}",
                        F::NAME
                    );
                }
            }
        }
    }

    #[test]
    fn integer_products_take_every_row_with_codes() {
        integer_products_take::<Int8>();
        integer_products_take::<Int4>();
        integer_products_take::<Int5>();
        integer_products_take::<Q4_0>();
        integer_products_take::<Q5_0>();
    }

    #[test]
    fn the_table_describes_each_type() {
        for ty in WeightType::ALL {
            assert_eq!(WeightType::from_name(ty.name()), Some(ty));
            assert_eq!(WeightType::from_name(&ty.name().to_uppercase()), Some(ty));
        }
        assert_eq!(WeightType::Int8.block_bytes(), 34);
        assert_eq!((WeightType::Int4.block_len(), WeightType::Int4.block_bytes()), (128, 72));
        assert_eq!((WeightType::Int5.block_len(), WeightType::Int5.block_bytes()), (128, 88));
        assert!(WeightType::Int5.is_quantized() && WeightType::Int5.has_codes());
        // ggml's sizes (`GGML_QUANT_SIZES`).
        for (ty, len, bytes) in [
            (WeightType::Q4_0, 32, 18),
            (WeightType::Q4_1, 32, 20),
            (WeightType::Q5_0, 32, 22),
            (WeightType::Q5_1, 32, 24),
            (WeightType::Q2K, 256, 84),
            (WeightType::Q3K, 256, 110),
            (WeightType::Q4K, 256, 144),
            (WeightType::Q5K, 256, 176),
            (WeightType::Q6K, 256, 210),
        ] {
            assert_eq!((ty.block_len(), ty.block_bytes()), (len, bytes), "{ty}");
            assert!(!ty.is_quantized(), "{ty} is read, not made by --quant");
            let act = if len == 256 { ActType::A8K } else { ActType::A8 };
            assert_eq!(ty.act(), act, "{ty}");
        }
        assert_eq!(WeightType::from_name("Q4_K"), Some(WeightType::Q4K));
        assert!(WeightType::Int8.has_codes() && WeightType::Q5_0.has_codes() && WeightType::Q4_0.has_codes());
        assert!(!WeightType::Q4_1.has_codes() && !WeightType::Q4K.has_codes() && !WeightType::Bf16.has_codes());
        assert_eq!(WeightType::Bf16.block_len(), 1);
        let floats: Vec<WeightType> = WeightType::ALL.into_iter().filter(|t| t.is_float()).collect();
        assert_eq!(floats, [WeightType::F32, WeightType::Bf16, WeightType::F16]);
        assert_eq!(WeightType::Int4.act(), ActType::A8);
        assert!(WeightType::Int4.is_quantized() && !WeightType::Bf16.is_quantized());
        assert!(Weights::from_bytes(WeightType::Int8, &[0u8; 35]).is_none());
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
