//! The Qwen2 decoder: weights named as in HuggingFace's `modeling_qwen2.py`
//! and one forward pass over a batch of tokens, each tagged with its sequence
//! and position (a prompt block, one token of each of several sequences, or
//! the single token of a decode step), against the sequences' KV caches.
//!
//! ```text
//! x = embed_tokens[token]                        for every token of the batch
//! for each layer:
//!     h = input_layernorm(x)
//!     q, k, v = q_proj(h) + bq, k_proj(h) + bk, v_proj(h) + bv
//!     q, k = rope(q, pos), rope(k, pos)          rotate-half
//!     cache[seq][layer, pos] = k, v
//!     x = x + o_proj(attention(q, cache[seq][layer, ..=pos]))
//!     h = post_attention_layernorm(x)
//!     x = x + down_proj(silu(gate_proj(h)) * up_proj(h))
//! logits = lm_head(norm(x))                      tokens that want logits; lm_head = embed_tokens when tied
//! ```

use crate::alloc;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::weights::{Tensor, TensorStore};
use ember_kernels::attention::{attention, AttnShape};
use ember_kernels::ops::{add_assign, add_bias, rmsnorm, rope_rotate_half, Rope};
use ember_kernels::pool;
use ember_kernels::{
    matmul, matmul_parts, matmul_swiglu, matmuls, matvec, matvec_parts, matvec_swiglu, matvecs, Isa, MatRef, Precision,
    WeightType,
};
use std::time::{Duration, Instant};

/// `values` of tensor `name`, or [`Error::NonFiniteWeight`]: the small
/// tensors (norms, biases) are checked at load, the cheap part of "no NaN
/// runs silently" (a NaN in a matrix shows in the logits, which decoding
/// checks).
fn finite(name: &str, values: Vec<f32>) -> Result<Vec<f32>> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(values),
        Some(index) => Err(Error::NonFiniteWeight { name: name.into(), index, value: values[index] }),
    }
}

/// A projection `y = W x (+ b)`, `W (out, in)`.
pub struct Linear {
    /// `W (out, in)` in its stored (or quantized) type.
    pub weight: Tensor,
    /// `(out,)`, widened to f32 at load.
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    fn load(store: &TensorStore, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
        let weight = store.get(&format!("{prefix}.weight"), &[out, inp])?;
        let bias = match bias {
            true => {
                let name = format!("{prefix}.bias");
                Some(finite(&name, store.get(&name, &[out])?.to_f32_vec())?)
            }
            false => None,
        };
        Ok(Linear { weight, bias })
    }

    fn matrix(&self) -> MatRef<'_> {
        self.weight.matrix()
    }

    /// Adds the bias to each row of `y (T, out)`.
    fn add_bias(&self, y: &mut [f32]) {
        if let Some(b) = &self.bias {
            y.chunks_exact_mut(b.len()).for_each(|row| add_bias(row, b));
        }
    }
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Linear").field("weight", &self.weight).field("bias", &self.bias.as_ref().map(Vec::len)).finish()
    }
}

/// Which matrix of the model a weight is, for choosing its precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightRole {
    /// `self_attn.q_proj`.
    Q,
    /// `self_attn.k_proj`.
    K,
    /// `self_attn.v_proj`.
    V,
    /// `self_attn.o_proj`.
    O,
    /// `mlp.gate_proj`.
    Gate,
    /// `mlp.up_proj`.
    Up,
    /// `mlp.down_proj`.
    Down,
    /// The token embedding and the LM head (one matrix when tied).
    Vocabulary,
}

impl WeightRole {
    /// Every role.
    pub const ALL: [WeightRole; 8] = [
        WeightRole::Q,
        WeightRole::K,
        WeightRole::V,
        WeightRole::O,
        WeightRole::Gate,
        WeightRole::Up,
        WeightRole::Down,
        WeightRole::Vocabulary,
    ];

    /// The short name: `q`, `k`, `v`, `o`, `gate`, `up`, `down`, `vocab`.
    pub fn name(self) -> &'static str {
        match self {
            WeightRole::Q => "q",
            WeightRole::K => "k",
            WeightRole::V => "v",
            WeightRole::O => "o",
            WeightRole::Gate => "gate",
            WeightRole::Up => "up",
            WeightRole::Down => "down",
            WeightRole::Vocabulary => "vocab",
        }
    }

    /// Parses [`WeightRole::name`].
    pub fn from_name(s: &str) -> Option<WeightRole> {
        WeightRole::ALL.into_iter().find(|r| r.name() == s.trim())
    }
}

/// The types `int4` gives some matrices instead of INT4 by default. Measured
/// with `ember eval` on fixtures/eval/gpl-3.0.txt, Qwen2.5-Coder-0.5B, KLD
/// against BF16 / top-1. With the others at INT8: all at 4 bits but the
/// embedding 0.180 / 80.3%; + k, v (2% of the weights) 0.123 / 83.1%; +
/// down 0.094 / 85.7%; + o 0.078 / 87.5% (+ q as well: 0.072 / 87.9%, not
/// worth its bytes). The embedding / LM head is a quarter of this model and
/// every logit passes through it; k and v are tiny and feed every later
/// position; down and o write into the residual stream, down from the
/// SiLU-gated products whose outliers 4 bits round worst. Then, from INT8
/// to INT5 (5.5 bits a weight against 8.5), same corpus: the LM head 0.082
/// / 87.3% (0.079 / 87.5% before, 12% fewer bytes a token); + o 0.082 /
/// 86.9% (this mix, 14% fewer: 0.353 GB a token, Q4_0's file 0.346); +
/// down too 0.087 / 86.1% (0.314 GB), left at INT8 for its quality.
pub const INT4_MIX: [(WeightRole, WeightType); 5] = [
    (WeightRole::Vocabulary, WeightType::Int5),
    (WeightRole::K, WeightType::Int8),
    (WeightRole::V, WeightType::Int8),
    (WeightRole::O, WeightType::Int5),
    (WeightRole::Down, WeightType::Int8),
];

/// Which weight type each matrix gets when a model is quantized: `format`,
/// except the matrices `overrides` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantPolicy {
    /// The type most matrices get.
    pub format: WeightType,
    /// Matrices (by role) that get another type.
    pub overrides: Vec<(WeightRole, WeightType)>,
}

impl QuantPolicy {
    /// The measured default for `format`: with `int4`, [`INT4_MIX`]; other
    /// formats apply to every matrix.
    pub fn new(format: WeightType) -> QuantPolicy {
        let overrides = if format == WeightType::Int4 { INT4_MIX.to_vec() } else { Vec::new() };
        QuantPolicy { format, overrides }
    }

    /// The type the matrix of `role`, rows of `cols` weights, gets: its
    /// override or `format`; INT8 where the rows are not whole blocks of
    /// that type (INT4's and INT5's are 128 weights; Qwen2.5's sizes are all
    /// multiples of 128).
    pub fn format_for(&self, role: WeightRole, cols: usize) -> WeightType {
        let ty = self.overrides.iter().find(|(r, _)| *r == role).map_or(self.format, |&(_, t)| t);
        if cols.is_multiple_of(ty.block_len()) {
            ty
        } else {
            WeightType::Int8
        }
    }
}

impl From<WeightType> for QuantPolicy {
    fn from(format: WeightType) -> QuantPolicy {
        QuantPolicy::new(format)
    }
}

/// The attention half of a layer, named as in HF (`self_attn`).
#[derive(Debug)]
pub struct Attention {
    /// `(heads * head_dim, hidden)`, with a bias.
    pub q_proj: Linear,
    /// `(kv_heads * head_dim, hidden)`, with a bias.
    pub k_proj: Linear,
    /// `(kv_heads * head_dim, hidden)`, with a bias.
    pub v_proj: Linear,
    /// `(hidden, heads * head_dim)`.
    pub o_proj: Linear,
}

/// The SwiGLU MLP of a layer: `down(silu(gate(h)) * up(h))`.
#[derive(Debug)]
pub struct Mlp {
    /// `(intermediate, hidden)`.
    pub gate_proj: Linear,
    /// `(intermediate, hidden)`.
    pub up_proj: Linear,
    /// `(hidden, intermediate)`.
    pub down_proj: Linear,
}

/// One decoder layer's weights.
pub struct Layer {
    /// RMSNorm weight `(hidden,)` before attention.
    pub input_layernorm: Vec<f32>,
    /// q, k, v and o.
    pub self_attn: Attention,
    /// RMSNorm weight `(hidden,)` before the MLP.
    pub post_attention_layernorm: Vec<f32>,
    /// gate, up and down.
    pub mlp: Mlp,
}

impl std::fmt::Debug for Layer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Layer").field("self_attn", &self.self_attn).field("mlp", &self.mlp).finish_non_exhaustive()
    }
}

/// A layer's matrices: HF name under `model.layers.N.`, role, `(rows, cols)`
/// from the config, and whether it has a bias. The one list of them.
fn layer_matrices(c: &Config) -> [(&'static str, WeightRole, [usize; 2], bool); 7] {
    let (h, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    [
        ("self_attn.q_proj", WeightRole::Q, [q, h], true),
        ("self_attn.k_proj", WeightRole::K, [kv, h], true),
        ("self_attn.v_proj", WeightRole::V, [kv, h], true),
        ("self_attn.o_proj", WeightRole::O, [h, q], false),
        ("mlp.gate_proj", WeightRole::Gate, [ff, h], false),
        ("mlp.up_proj", WeightRole::Up, [ff, h], false),
        ("mlp.down_proj", WeightRole::Down, [h, ff], false),
    ]
}

impl Layer {
    /// The matrices in HF order: q, k, v, o, gate, up, down.
    pub fn matrices(&self) -> [&Linear; 7] {
        let (a, m) = (&self.self_attn, &self.mlp);
        [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj, &m.gate_proj, &m.up_proj, &m.down_proj]
    }

    pub(crate) fn matrices_mut(&mut self) -> [&mut Linear; 7] {
        let (a, m) = (&mut self.self_attn, &mut self.mlp);
        [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj, &mut m.gate_proj, &mut m.up_proj, &mut m.down_proj]
    }
}

/// The whole model's weights and the tables derived from its config.
pub struct Qwen2 {
    /// The validated `config.json`.
    pub config: Config,
    /// `model.embed_tokens.weight (vocab, hidden)`.
    pub embed_tokens: Tensor,
    /// `model.layers.N`.
    pub layers: Vec<Layer>,
    /// `model.norm.weight (hidden,)`, the final RMSNorm.
    pub norm: Vec<f32>,
    /// `lm_head.weight`, or the embedding itself when tied or absent.
    pub lm_head: Tensor,
    /// How the matrix products of a batch (prefill, several sequences)
    /// round activations: [`Precision::Fast`] by default, whose loss is
    /// measured against [`Precision::Exact`] (ARCHITECTURE.md, precision
    /// policy). Single-token decode is unaffected.
    pub precision: Precision,
    rope: Rope,
}

impl std::fmt::Debug for Qwen2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qwen2")
            .field("config", &self.config)
            .field("layers", &self.layers.len())
            .field("embed_tokens", &self.embed_tokens)
            .field("lm_head", &self.lm_head)
            .field("precision", &self.precision)
            .finish_non_exhaustive()
    }
}

impl Qwen2 {
    /// Copies the weight matrices and the embedding (once when tied) into
    /// anonymous memory backed by transparent huge pages, where the kernel
    /// offers them ([`transparent_huge_pages`](crate::advanced::transparent_huge_pages));
    /// returns the bytes copied, 0 where it does not. Decoding reads the same
    /// bytes faster from huge pages (fewer TLB misses, page walks and
    /// restarts of the hardware prefetchers, which stop at 4 KiB pages): 4–5%
    /// more tokens a second measured on Emerald Rapids.
    ///
    /// The copy also lays each float `o_proj` and `down_proj` whose f32
    /// activations would not stay in L1 out in column parts
    /// ([`ember_kernels::parts`]; BF16 down at 4864 columns: 4 parts): on
    /// Zen 4, 2 threads, that took BF16 down from 64–65% of the read ceiling
    /// to 75–82% with the memory at 54–60 GB/s (84–92% → 96% at 33 GB/s).
    /// Those products then sum their parts, so the logits agree with the
    /// file's layout to f32 rounding rather than bit for bit; everything
    /// else computes the same bits.
    ///
    /// [`ModelBuilder::huge_pages`](crate::ModelBuilder::huge_pages) asks for
    /// it at load (and says what it costs); an error (no memory for the
    /// copy) leaves the weights where they were.
    pub fn copy_to_huge_pages(&mut self) -> Result<usize> {
        if !crate::weights::transparent_huge_pages() {
            return Ok(0);
        }
        self.copy_with_parts(ember_kernels::parts::parts_for)
    }

    /// [`Qwen2::copy_to_huge_pages`] with the column parts `policy` gives
    /// (type, columns) for o and down.
    pub(crate) fn copy_with_parts(&mut self, policy: fn(WeightType, usize) -> usize) -> Result<usize> {
        let mut tensors: Vec<(&mut Tensor, bool)> = vec![(&mut self.embed_tokens, false), (&mut self.lm_head, false)];
        for layer in &mut self.layers {
            // o and down go through `project`, which reads column parts;
            // the fused q/k/v and gate/up products read whole rows.
            let (a, m) = (&mut layer.self_attn, &mut layer.mlp);
            tensors.extend([
                (&mut a.q_proj.weight, false),
                (&mut a.k_proj.weight, false),
                (&mut a.v_proj.weight, false),
                (&mut a.o_proj.weight, true),
                (&mut m.gate_proj.weight, false),
                (&mut m.up_proj.weight, false),
                (&mut m.down_proj.weight, true),
            ]);
        }
        crate::weights::copy_to_huge_pages(&mut tensors, policy)
    }

    /// Takes every tensor the config calls for from `store`, checking shapes.
    pub fn from_store(config: Config, store: &TensorStore) -> Result<Qwen2> {
        let c = &config;
        let h = c.hidden_size;
        let norm = |name: String| finite(&name, store.get(&name, &[h])?.to_f32_vec());
        let embed_tokens = store.get("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let mut m = Vec::with_capacity(7);
            for (name, _, [rows, cols], bias) in layer_matrices(c) {
                m.push(Linear::load(store, &format!("{p}.{name}"), rows, cols, bias)?);
            }
            let [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]: [Linear; 7] =
                m.try_into().unwrap_or_else(|_| unreachable!("seven matrices"));
            layers.push(Layer {
                input_layernorm: norm(format!("{p}.input_layernorm.weight"))?,
                self_attn: Attention { q_proj, k_proj, v_proj, o_proj },
                post_attention_layernorm: norm(format!("{p}.post_attention_layernorm.weight"))?,
                mlp: Mlp { gate_proj, up_proj, down_proj },
            });
        }
        let norm = norm("model.norm.weight".into())?;
        // Tied models may still ship lm_head.weight (a copy); an untied model
        // must have it.
        let lm_head = if store.contains("lm_head.weight") {
            store.get("lm_head.weight", &[c.vocab_size, h])?
        } else if c.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            store.get("lm_head.weight", &[c.vocab_size, h])?
        };
        let rope = Rope::new(c.head_dim, c.rope_theta);
        Ok(Qwen2 { config, embed_tokens, layers, norm, lm_head, precision: Precision::default(), rope })
    }

    /// Quantizes the weight matrices in place, each to the type `policy`
    /// gives its role. A matrix already stored in that type stays as it is
    /// (quantizing a quantized folder with its own policy changes nothing);
    /// one stored in another quantized type is [`Error::AlreadyQuantized`]
    /// and nothing changes: rounding twice loses more than once, and
    /// keeping it while reporting the new type would be a lie.
    pub fn quantize(&mut self, policy: &QuantPolicy) -> Result<()> {
        let tied = self.lm_head.same_data(&self.embed_tokens);
        let roles = layer_matrices(&self.config).map(|(name, role, _, _)| (name, role));
        // Check everything first, so an error leaves the model untouched.
        let check = |t: &Tensor, name: String, role: WeightRole| {
            let wanted = policy.format_for(role, t.shape[1]);
            match !t.dtype.is_float() && t.dtype != wanted {
                true => {
                    Err(Error::AlreadyQuantized { name, stored: t.dtype.name().into(), wanted: wanted.name().into() })
                }
                false => Ok(()),
            }
        };
        for (i, layer) in self.layers.iter().enumerate() {
            for (p, (name, role)) in layer.matrices().into_iter().zip(roles) {
                check(&p.weight, format!("model.layers.{i}.{name}.weight"), role)?;
            }
        }
        check(&self.embed_tokens, "model.embed_tokens.weight".into(), WeightRole::Vocabulary)?;
        if !tied {
            check(&self.lm_head, "lm_head.weight".into(), WeightRole::Vocabulary)?;
        }
        let convert = |t: &mut Tensor, role: WeightRole| {
            if t.can_quantize() {
                *t = t.quantize(policy.format_for(role, t.shape[1]));
            }
        };
        for layer in &mut self.layers {
            for (p, (_, role)) in layer.matrices_mut().into_iter().zip(roles) {
                convert(&mut p.weight, role);
            }
        }
        convert(&mut self.embed_tokens, WeightRole::Vocabulary);
        if tied {
            self.lm_head = self.embed_tokens.clone();
        } else {
            convert(&mut self.lm_head, WeightRole::Vocabulary);
        }
        Ok(())
    }

    /// A fresh single-sequence state with room for `context` positions, its
    /// cache in huge pages ([`KvCache::in_huge_pages`]: one sequence driven
    /// a while).
    pub fn new_state(&self, context: usize) -> State {
        State { cache: self.new_cache(context).in_huge_pages(true), scratch: Scratch::default() }
    }

    /// An empty KV cache for one sequence of up to `context` positions.
    pub fn new_cache(&self, context: usize) -> KvCache {
        let c = &self.config;
        KvCache::new(c.num_hidden_layers, context, c.kv_dim())
    }

    /// Bytes of weights one decoded token streams (every matrix once).
    pub fn weight_bytes_per_token(&self) -> usize {
        let per_layer = |l: &Layer| l.matrices().iter().map(|p| p.weight.size_bytes()).sum::<usize>();
        self.layers.iter().map(per_layer).sum::<usize>() + self.lm_head.size_bytes()
    }

    /// Weight bytes a single-token forward pass streams in `phase`: its
    /// matrices (none for [`Phase::Embed`], a lookup of one row, nor for
    /// [`Phase::Attention`], whose reads are the KV cache). Over every phase
    /// they add up to [`Qwen2::weight_bytes_per_token`].
    pub fn phase_bytes(&self, phase: Phase) -> usize {
        let layers = |pick: fn(&Layer) -> Vec<&Linear>| {
            self.layers.iter().flat_map(pick).map(|p| p.weight.size_bytes()).sum::<usize>()
        };
        match phase {
            Phase::Embed | Phase::Attention => 0,
            Phase::Qkv => layers(|l| vec![&l.self_attn.q_proj, &l.self_attn.k_proj, &l.self_attn.v_proj]),
            Phase::O => layers(|l| vec![&l.self_attn.o_proj]),
            Phase::GateUp => layers(|l| vec![&l.mlp.gate_proj, &l.mlp.up_proj]),
            Phase::Down => layers(|l| vec![&l.mlp.down_proj]),
            Phase::Head => self.lm_head.size_bytes(),
        }
    }

    /// One forward pass over a batch of tokens: the whole model.
    ///
    /// Each token is tagged with its sequence (an index into `caches`) and its
    /// position there: a prompt block is many tokens of one sequence at
    /// consecutive positions, decoding several sequences is one token of
    /// each, and single-token decode is the batch of one. A sequence's tokens
    /// must continue its cache: the first at `caches[seq].len()`, the next
    /// one after it, and so on. Their keys and values are appended to the
    /// caches. Returns the logits `(n, vocab)` of the `n` tokens with
    /// `logits: true`, in batch order.
    ///
    /// Every projection reads each weight once for the whole batch (a
    /// mat-vec for one token, matrix-matrix products for more); attention
    /// gives each token its own sequence's keys up to its own position.
    pub fn forward<'s>(
        &self,
        batch: &[BatchToken],
        caches: &mut [&mut KvCache],
        scratch: &'s mut Scratch,
    ) -> Result<&'s [f32]> {
        let c = &self.config;
        let t = batch.len();
        self.check_batch(batch, caches)?;
        for b in batch {
            caches[b.seq].allocate()?;
        }
        let (h, hd, vocab) = (c.hidden_size, c.head_dim, c.vocab_size);
        let isa = Isa::active();
        let pool = pool::global();
        let shape = AttnShape { n_heads: c.num_attention_heads, n_kv_heads: c.num_key_value_heads, head_dim: hd };
        let eps = c.rms_norm_eps;
        let s = scratch;
        s.reserve(c, t)?;
        // Batch buffers, row i for token i:
        let x = &mut s.x[..t * h]; // (T, hidden) residual stream
        let hb = &mut s.h[..t * h]; // (T, hidden) normalised input, or a block's output
        let qb = &mut s.q[..t * c.q_dim()]; // (T, heads * head_dim)
        let kb = &mut s.k[..t * c.kv_dim()]; // (T, kv_heads * head_dim)
        let vb = &mut s.v[..t * c.kv_dim()];
        let att = &mut s.att[..t * c.q_dim()]; // (T, heads * head_dim)
        let gate = &mut s.gate[..t * c.intermediate_size]; // (T, intermediate): silu(gate) * up
        let up = &mut s.up[..t * c.intermediate_size];
        let (cos, sin) = (&mut s.cos[..t * hd / 2], &mut s.sin[..t * hd / 2]); // (T, head_dim / 2)
        let mut clock = Clock::start(s.phases.as_mut(), t);
        s.seqs.clear();
        s.visible.clear();
        for (i, b) in batch.iter().enumerate() {
            self.embed_tokens.matrix().row_to_f32(b.token as usize, &mut x[i * h..(i + 1) * h]);
            self.rope.cos_sin(b.pos, &mut cos[i * hd / 2..(i + 1) * hd / 2], &mut sin[i * hd / 2..(i + 1) * hd / 2]);
            s.seqs.push(b.seq);
            s.visible.push(b.pos + 1);
        }
        clock.lap(Phase::Embed);

        for (li, layer) in self.layers.iter().enumerate() {
            let (a, m) = (&layer.self_attn, &layer.mlp);
            // Attention block.
            for (xr, hr) in x.chunks_exact(h).zip(hb.chunks_exact_mut(h)) {
                rmsnorm(xr, &layer.input_layernorm, eps, hr);
            }
            // q, k and v read the same input: one parallel pass.
            let qkv =
                [(a.q_proj.matrix(), &mut qb[..]), (a.k_proj.matrix(), &mut kb[..]), (a.v_proj.matrix(), &mut vb[..])];
            match t {
                1 => matvecs(pool, hb, qkv),
                _ => matmuls(pool, self.precision, hb, qkv),
            }
            a.q_proj.add_bias(qb);
            a.k_proj.add_bias(kb);
            a.v_proj.add_bias(vb);
            clock.lap(Phase::Qkv);
            let (qd, kvd) = (c.q_dim(), c.kv_dim());
            for (i, b) in batch.iter().enumerate() {
                let (cs, sn) = (&cos[i * hd / 2..(i + 1) * hd / 2], &sin[i * hd / 2..(i + 1) * hd / 2]);
                let (q0, q1) = (i * qd, (i + 1) * qd);
                let (k0, k1) = (i * kvd, (i + 1) * kvd);
                rope_rotate_half(&mut qb[q0..q1], hd, cs, sn);
                rope_rotate_half(&mut kb[k0..k1], hd, cs, sn);
                caches[b.seq].store(li, b.pos, &kb[k0..k1], &vb[k0..k1]);
            }
            let shared: &[&mut KvCache] = &*caches;
            let kv = |seq: usize| shared[seq].layer(li, shared[seq].capacity());
            attention(pool, isa, shape, qb, &s.seqs, &s.visible, &kv, att);
            clock.lap(Phase::Attention);
            self.project(&a.o_proj, att, hb);
            add_assign(x, hb);
            clock.lap(Phase::O);

            // MLP block: SwiGLU, gate and up in one pass.
            for (xr, hr) in x.chunks_exact(h).zip(hb.chunks_exact_mut(h)) {
                rmsnorm(xr, &layer.post_attention_layernorm, eps, hr);
            }
            let (gp, up_p) = (m.gate_proj.matrix(), m.up_proj.matrix());
            match t {
                1 => matvec_swiglu(pool, gp, up_p, hb, gate),
                _ => matmul_swiglu(pool, self.precision, gp, up_p, hb, up, gate),
            }
            clock.lap(Phase::GateUp);
            self.project(&m.down_proj, gate, hb);
            add_assign(x, hb);
            clock.lap(Phase::Down);
        }
        for b in batch {
            caches[b.seq].advance();
        }

        // The LM head, for the tokens that want logits only.
        let n = batch.iter().filter(|b| b.logits).count();
        let normed = &mut s.h[..n * h]; // (n, hidden)
        for (i, j) in batch.iter().enumerate().filter(|(_, b)| b.logits).map(|(j, _)| j).enumerate() {
            rmsnorm(&x[j * h..(j + 1) * h], &self.norm, eps, &mut normed[i * h..(i + 1) * h]);
        }
        alloc::resize(&mut s.logits, alloc::product(&[n, vocab], LOGITS)?, 0.0, LOGITS)?;
        let logits = &mut s.logits[..n * vocab];
        match n {
            0 => {}
            1 => matvec(self.lm_head.matrix(), normed, logits),
            _ => matmul(pool, self.precision, self.lm_head.matrix(), normed, logits),
        }
        clock.lap(Phase::Head);
        Ok(&s.logits[..n * vocab])
    }

    /// `y (T, out) = x (T, in) @ Wᵀ + b`: a mat-vec for one row, a matrix
    /// product for more.
    /// The weights may be stored in column parts ([`Qwen2::copy_to_huge_pages`]).
    fn project(&self, p: &Linear, x: &[f32], y: &mut [f32]) {
        let w = p.weight.parts();
        if x.len() == w.cols() {
            matvec_parts(pool::global(), w, x, y);
        } else {
            matmul_parts(pool::global(), self.precision, w, x, y);
        }
        p.add_bias(y);
    }

    /// Checks that a batch's tokens are in the vocabulary, name caches that
    /// exist, and continue them at consecutive positions within capacity.
    fn check_batch(&self, batch: &[BatchToken], caches: &[&mut KvCache]) -> Result<()> {
        let vocab = self.config.vocab_size;
        for (i, b) in batch.iter().enumerate() {
            if b.token as usize >= vocab {
                return Err(Error::TokenOutOfRange { id: b.token, vocab });
            }
            let cache = caches.get(b.seq).ok_or_else(|| {
                Error::InvalidBatch(format!(
                    "token {i} names sequence {}, but {} caches were given",
                    b.seq,
                    caches.len()
                ))
            })?;
            let (layers, kv_dim) = cache.shape();
            if (layers, kv_dim) != (self.config.num_hidden_layers, self.config.kv_dim()) {
                return Err(Error::InvalidBatch(format!(
                    "sequence {}'s cache has {layers} layers of {kv_dim} keys, but the model {} of {}",
                    b.seq,
                    self.config.num_hidden_layers,
                    self.config.kv_dim()
                )));
            }
            let before = batch[..i].iter().filter(|o| o.seq == b.seq).count();
            let expected = cache.len() + before;
            if b.pos >= cache.capacity() {
                return Err(Error::ContextFull { context: cache.capacity() });
            }
            if b.pos != expected {
                return Err(Error::InvalidBatch(format!(
                    "token {i} of sequence {} is at position {}, but its cache continues at {expected}",
                    b.seq, b.pos
                )));
            }
        }
        Ok(())
    }
}

/// One token of a batch for [`Qwen2::forward`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchToken {
    /// The token id.
    pub token: u32,
    /// Which of the caches passed with the batch this token extends.
    pub seq: usize,
    /// Its position in that sequence.
    pub pos: usize,
    /// Whether to compute its next-token logits.
    pub logits: bool,
}

/// The buffers of a forward pass, sized for the largest batch seen (about
/// 45 KB per token for the 0.5B model) and reused; see [`Qwen2::forward`]
/// for their shapes.
#[derive(Default)]
pub struct Scratch {
    tokens: usize,
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// Per row: its sequence and how many positions it sees `(T,)`.
    seqs: Vec<usize>,
    visible: Vec<usize>,
    /// `(n, vocab)` for the rows that want logits.
    logits: Vec<f32>,
    /// A batch being built by [`State`] or `generate::step`.
    pub(crate) batch: Vec<BatchToken>,
    /// Time per phase, while timing is on ([`Scratch::time_phases`]).
    phases: Option<PhaseTimes>,
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scratch").field("tokens", &self.tokens).finish_non_exhaustive()
    }
}

impl Scratch {
    /// Starts timing the phases of the forward passes that use these buffers
    /// from zero (`true`), or stops (`false`). Off by default: a pass then
    /// reads no clock.
    ///
    /// The pool's sections are timed too ([`pool::time_sections`]), for
    /// the thread that runs a timed pass, while it runs.
    pub fn time_phases(&mut self, on: bool) {
        self.phases = on.then(PhaseTimes::default);
    }

    /// The phases' times since [`Scratch::time_phases`] turned timing on.
    pub fn phase_times(&self) -> Option<&PhaseTimes> {
        self.phases.as_ref()
    }

    /// Makes room for `t` tokens (never shrinks); an error, and no change,
    /// if the memory is not there.
    fn reserve(&mut self, c: &Config, t: usize) -> Result<()> {
        if t <= self.tokens {
            return Ok(());
        }
        const WHAT: &str = "a forward pass's buffers";
        let size = |width: usize| alloc::product(&[t, width], WHAT).and_then(|n| alloc::zeroed(n, WHAT));
        let (x, h) = (size(c.hidden_size)?, size(c.hidden_size)?);
        let (q, k, v, att) = (size(c.q_dim())?, size(c.kv_dim())?, size(c.kv_dim())?, size(c.q_dim())?);
        let (gate, up) = (size(c.intermediate_size)?, size(c.intermediate_size)?);
        let (cos, sin) = (size(c.head_dim / 2)?, size(c.head_dim / 2)?);
        *self = Scratch { tokens: t, x, h, q, k, v, att, gate, up, cos, sin, ..std::mem::take(self) };
        Ok(())
    }
}

/// The parts of a forward pass that [`PhaseTimes`] times: where a decoded
/// token's time goes (`ember bench --phases`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The embedding rows and RoPE's angles of the batch's tokens.
    Embed,
    /// Every layer's input norm, q/k/v products and biases.
    Qkv,
    /// Every layer's RoPE, KV store and attention.
    Attention,
    /// Every layer's o product and residual add.
    O,
    /// Every layer's post-attention norm, gate/up products and SiLU gate.
    GateUp,
    /// Every layer's down product and residual add.
    Down,
    /// The final norm and the LM head.
    Head,
}

impl Phase {
    /// Every phase, in the order a forward pass runs them.
    pub const ALL: [Phase; 7] =
        [Phase::Embed, Phase::Qkv, Phase::Attention, Phase::O, Phase::GateUp, Phase::Down, Phase::Head];

    /// Its name in `ember bench --phases`.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Embed => "embed",
            Phase::Qkv => "q/k/v",
            Phase::Attention => "attention",
            Phase::O => "o",
            Phase::GateUp => "gate/up",
            Phase::Down => "down",
            Phase::Head => "lm head",
        }
    }
}

/// Time spent in each [`Phase`] over the forward passes timed
/// ([`Scratch::time_phases`]), and how many passes and tokens they were.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PhaseTimes {
    /// Forward passes timed.
    pub passes: usize,
    /// Tokens in them.
    pub tokens: usize,
    times: [Duration; Phase::ALL.len()],
    inside: [Duration; Phase::ALL.len()],
    waiting: [Duration; Phase::ALL.len()],
}

impl PhaseTimes {
    /// The time spent in `phase`.
    pub fn get(&self, phase: Phase) -> Duration {
        self.times[phase as usize]
    }

    /// Of [`PhaseTimes::get`], the time inside the thread pool's parallel
    /// sections; the rest is serial work between them on the thread running
    /// the pass (norms, RoPE, residual adds, quantizing activations,
    /// products too small to split).
    pub fn in_sections(&self, phase: Phase) -> Duration {
        self.inside[phase as usize]
    }

    /// Of [`PhaseTimes::in_sections`], the running thread's wait at the
    /// sections' ends, its own share done, for the pool's other threads.
    pub fn waiting(&self, phase: Phase) -> Duration {
        self.waiting[phase as usize]
    }
}

/// A forward pass's laps: each [`Clock::lap`] adds the time since the last
/// to a phase, and the parallel sections' share of it
/// ([`pool::section_times`], turned on for the running thread). Without
/// timing on, it holds nothing and reads no clock.
struct Clock<'a> {
    on: Option<(&'a mut PhaseTimes, Instant, pool::SectionTimes)>,
}

impl<'a> Clock<'a> {
    fn start(times: Option<&'a mut PhaseTimes>, tokens: usize) -> Clock<'a> {
        let on = times.map(|t| {
            t.passes += 1;
            t.tokens += tokens;
            pool::time_sections(true);
            (t, Instant::now(), pool::SectionTimes::default())
        });
        Clock { on }
    }

    #[inline]
    fn lap(&mut self, phase: Phase) {
        if let Some((times, last, sections)) = &mut self.on {
            let now = Instant::now();
            let s = pool::section_times().unwrap_or_default();
            let i = phase as usize;
            times.times[i] += now - *last;
            times.inside[i] += s.inside.saturating_sub(sections.inside);
            times.waiting[i] += s.waiting.saturating_sub(sections.waiting);
            (*last, *sections) = (now, s);
        }
    }
}

impl Drop for Clock<'_> {
    /// The pass's sections stop being timed with it, however it ends: a
    /// thread times its sections only during timed passes.
    fn drop(&mut self) {
        if self.on.is_some() {
            pool::time_sections(false);
        }
    }
}

/// What the logits buffer is called in an allocation error.
const LOGITS: &str = "the logits";

/// One sequence driven alone: its KV cache and a forward pass's buffers.
#[derive(Debug)]
pub struct State {
    /// The sequence's keys and values.
    pub cache: KvCache,
    scratch: Scratch,
}

impl State {
    /// Times the phases of this sequence's forward passes from now on
    /// (`true`) or stops ([`Scratch::time_phases`]).
    pub fn time_phases(&mut self, on: bool) {
        self.scratch.time_phases(on);
    }

    /// The phases' times since timing was turned on.
    pub fn phase_times(&self) -> Option<&PhaseTimes> {
        self.scratch.phase_times()
    }

    /// Runs `tokens` at the next positions of this sequence in one forward
    /// pass (one token, or a prompt block). With `want_logits`, returns the
    /// next-token logits `(vocab,)` after the last.
    pub fn run<'s>(&'s mut self, model: &Qwen2, tokens: &[u32], want_logits: bool) -> Result<Option<&'s [f32]>> {
        if tokens.is_empty() {
            return Ok(None);
        }
        let last = tokens.len() - 1;
        self.run_scored(model, tokens, if want_logits { last } else { tokens.len() })
            .map(|l| (!l.is_empty()).then_some(l))
    }

    /// Runs `tokens` like [`State::run`] and returns the logits after each of
    /// its tokens `from..` as `((T - from), vocab)` (for perplexity: every
    /// position's prediction, the LM head as one matrix product).
    pub fn run_scored<'s>(&'s mut self, model: &Qwen2, tokens: &[u32], from: usize) -> Result<&'s [f32]> {
        let pos0 = self.cache.len();
        let mut batch = std::mem::take(&mut self.scratch.batch);
        batch.clear();
        batch.extend(tokens.iter().enumerate().map(|(i, &token)| BatchToken {
            token,
            seq: 0,
            pos: pos0 + i,
            logits: i >= from,
        }));
        let result = model.forward(&batch, &mut [&mut self.cache], &mut self.scratch).map(|l| l.len());
        self.scratch.batch = batch;
        Ok(&self.scratch.logits[..result?])
    }

    /// Positions processed so far.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Whether no position has been processed.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// Positions this state can hold.
    pub fn capacity(&self) -> usize {
        self.cache.capacity()
    }
}
