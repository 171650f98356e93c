//! The Qwen2 decoder: weights named as in HuggingFace's `modeling_qwen2.py`
//! and a forward pass of one token against the KV cache.
//!
//! ```text
//! x = embed_tokens[token]
//! for each layer:
//!     h = input_layernorm(x)
//!     q, k, v = q_proj(h) + bq, k_proj(h) + bk, v_proj(h) + bv
//!     q, k = rope(q, pos), rope(k, pos)          rotate-half
//!     cache[layer, pos] = k, v
//!     x = x + o_proj(attention(q, cache[layer, ..=pos]))
//!     h = post_attention_layernorm(x)
//!     x = x + down_proj(silu(gate_proj(h)) * up_proj(h))
//! logits = lm_head(norm(x))                      lm_head = embed_tokens when tied
//! ```

use crate::config::Config;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::weights::{Tensor, TensorStore};
use ember_kernels::attention::{attend_heads, AttnShape};
use ember_kernels::ops::softmax;
use ember_kernels::ops::{add_assign, add_bias, rmsnorm, rope_rotate_half, Rope};
use ember_kernels::pool::{self, SharedMut};
use ember_kernels::{
    matmul, matmul_swiglu, matmul_with, matmuls, matvec, matvec_swiglu, matvecs, Isa, MatRef, Quant, Weights,
};
use std::cell::RefCell;

/// Below this many cached positions attention stays on one thread: it is a
/// few microseconds, less than a wake-up of the pool.
const PARALLEL_ATTENTION_MIN_LEN: usize = 128;

/// A projection `y = W x (+ b)`, `W (out, in)`.
pub struct Linear {
    pub weight: Tensor,
    /// `(out,)`, widened to f32 at load.
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    fn load(store: &TensorStore, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
        let weight = store.get(&format!("{prefix}.weight"), &[out, inp])?;
        let bias = match bias {
            true => Some(store.get(&format!("{prefix}.bias"), &[out])?.to_f32_vec()),
            false => None,
        };
        Ok(Linear { weight, bias })
    }

    /// `y (out,) = W x (in,) + b`.
    pub fn forward(&self, x: &[f32], y: &mut [f32]) {
        matvec(self.weight.matrix(), x, y);
        self.add_bias(y);
    }

    fn add_bias(&self, y: &mut [f32]) {
        if let Some(b) = &self.bias {
            add_bias(y, b);
        }
    }
}

/// Which matrix of the model a weight is, for choosing its precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightRole {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
    /// The token embedding and the LM head (one matrix when tied).
    Vocabulary,
}

impl WeightRole {
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
}

/// The matrices `int4` keeps at INT8 (measured with `ember eval` on
/// fixtures/eval/gpl-3.0.txt, Qwen2.5-Coder-0.5B, KLD against BF16 / top-1):
/// all at 4 bits but the embedding 0.180 / 80.3%; + k, v (2% of the weights)
/// 0.123 / 83.1%; + down 0.094 / 85.7%; + o 0.078 / 87.5% (+ q as well:
/// 0.072 / 87.9%, not worth its bytes). The embedding / LM head is a quarter
/// of this model and every logit passes through it; k and v are tiny and feed
/// every later position; down and o write into the residual stream, down from
/// the SiLU-gated products whose outliers 4 bits round worst.
pub const INT4_KEEPS_INT8: [WeightRole; 5] =
    [WeightRole::Vocabulary, WeightRole::K, WeightRole::V, WeightRole::O, WeightRole::Down];

/// The format a matrix gets when the model is quantized to `q`: `q` itself,
/// except the [`INT4_KEEPS_INT8`] matrices with `int4`. `EMBER_INT4_KEEP`
/// (comma-separated role names: q, k, v, o, gate, up, down, vocab) replaces
/// that list, for measuring other choices.
pub fn precision(q: Quant, role: WeightRole) -> Quant {
    if q != Quant::Int4 {
        return q;
    }
    let keep = match std::env::var("EMBER_INT4_KEEP") {
        Ok(list) => list.split(',').any(|k| k.trim() == role.name()),
        Err(_) => INT4_KEEPS_INT8.contains(&role),
    };
    if keep {
        Quant::Int8
    } else {
        Quant::Int4
    }
}

/// One decoder layer's weights.
pub struct Layer {
    pub input_layernorm: Vec<f32>,
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub post_attention_layernorm: Vec<f32>,
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

/// The whole model's weights and the tables derived from its config.
pub struct Qwen2 {
    pub config: Config,
    pub embed_tokens: Tensor,
    pub layers: Vec<Layer>,
    pub norm: Vec<f32>,
    /// `lm_head.weight`, or the embedding itself when tied or absent.
    pub lm_head: Tensor,
    rope: Rope,
}

impl Qwen2 {
    /// Takes every tensor the config calls for from `store`, checking shapes.
    pub fn from_store(config: Config, store: &TensorStore) -> Result<Qwen2> {
        let c = &config;
        let (h, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let norm = |name: String| store.get(&name, &[h]).map(|t| t.to_f32_vec());
        let embed_tokens = store.get("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                input_layernorm: norm(format!("{p}.input_layernorm.weight"))?,
                q_proj: Linear::load(store, &format!("{p}.self_attn.q_proj"), q, h, true)?,
                k_proj: Linear::load(store, &format!("{p}.self_attn.k_proj"), kv, h, true)?,
                v_proj: Linear::load(store, &format!("{p}.self_attn.v_proj"), kv, h, true)?,
                o_proj: Linear::load(store, &format!("{p}.self_attn.o_proj"), h, q, false)?,
                post_attention_layernorm: norm(format!("{p}.post_attention_layernorm.weight"))?,
                gate_proj: Linear::load(store, &format!("{p}.mlp.gate_proj"), ff, h, false)?,
                up_proj: Linear::load(store, &format!("{p}.mlp.up_proj"), ff, h, false)?,
                down_proj: Linear::load(store, &format!("{p}.mlp.down_proj"), h, ff, false)?,
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
        Ok(Qwen2 { config, embed_tokens, layers, norm, lm_head, rope })
    }

    /// Quantizes the weight matrices in place (see [`precision`] for which
    /// matrix gets which format). Matrices already quantized stay as they are.
    pub fn quantize(&mut self, q: Quant) {
        let tied = self.lm_head.same_data(&self.embed_tokens);
        let convert = |t: &mut Tensor, role: WeightRole| {
            if t.can_quantize() {
                *t = t.quantize(precision(q, role));
            }
        };
        for layer in &mut self.layers {
            for (p, role) in [
                (&mut layer.q_proj, WeightRole::Q),
                (&mut layer.k_proj, WeightRole::K),
                (&mut layer.v_proj, WeightRole::V),
                (&mut layer.o_proj, WeightRole::O),
                (&mut layer.gate_proj, WeightRole::Gate),
                (&mut layer.up_proj, WeightRole::Up),
                (&mut layer.down_proj, WeightRole::Down),
            ] {
                convert(&mut p.weight, role);
            }
        }
        convert(&mut self.embed_tokens, WeightRole::Vocabulary);
        if tied {
            self.lm_head = self.embed_tokens.clone();
        } else {
            convert(&mut self.lm_head, WeightRole::Vocabulary);
        }
    }

    /// A fresh state with room for `context` positions.
    pub fn new_state(&self, context: usize) -> State {
        let c = &self.config;
        State {
            cache: KvCache::new(c.num_hidden_layers, context, c.kv_dim()),
            x: vec![0.0; c.hidden_size],
            h: vec![0.0; c.hidden_size],
            q: vec![0.0; c.q_dim()],
            k: vec![0.0; c.kv_dim()],
            v: vec![0.0; c.kv_dim()],
            att: vec![0.0; c.q_dim()],
            ffn: vec![0.0; c.intermediate_size],
            scores: vec![0.0; c.num_attention_heads * context],
            cos: vec![0.0; c.head_dim / 2],
            sin: vec![0.0; c.head_dim / 2],
            logits: vec![0.0; c.vocab_size],
            batch: Batch::default(),
        }
    }

    /// Bytes of weights one decoded token streams (every matrix once).
    pub fn weight_bytes_per_token(&self) -> usize {
        let per_layer = |l: &Layer| {
            [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj]
                .iter()
                .map(|p| p.weight.size_bytes())
                .sum::<usize>()
        };
        self.layers.iter().map(per_layer).sum::<usize>() + self.lm_head.size_bytes()
    }

    /// Runs `token` at the next position of `state` and appends its keys and
    /// values to the cache. With `want_logits`, returns the next-token logits
    /// `(vocab,)`; prompt tokens before the last skip the LM head.
    pub fn forward<'s>(&self, state: &'s mut State, token: u32, want_logits: bool) -> Result<Option<&'s [f32]>> {
        let c = &self.config;
        if token as usize >= c.vocab_size {
            return Err(Error::TokenOutOfRange { id: token, vocab: c.vocab_size });
        }
        let pos = state.cache.len();
        if pos >= state.cache.capacity() {
            return Err(Error::ContextFull { context: state.cache.capacity() });
        }
        let isa = Isa::active();
        let pool = pool::global();
        let shape =
            AttnShape { n_heads: c.num_attention_heads, n_kv_heads: c.num_key_value_heads, head_dim: c.head_dim };
        let eps = c.rms_norm_eps;
        let s = state;
        self.embed_tokens.matrix().row_to_f32(token as usize, &mut s.x);
        self.rope.cos_sin(pos, &mut s.cos, &mut s.sin);

        for (li, layer) in self.layers.iter().enumerate() {
            // Attention block.
            rmsnorm(&s.x, &layer.input_layernorm, eps, &mut s.h);
            // q, k and v read the same input: one parallel pass.
            matvecs(
                pool,
                &s.h,
                [
                    (layer.q_proj.weight.matrix(), &mut s.q[..]),
                    (layer.k_proj.weight.matrix(), &mut s.k[..]),
                    (layer.v_proj.weight.matrix(), &mut s.v[..]),
                ],
            );
            layer.q_proj.add_bias(&mut s.q);
            layer.k_proj.add_bias(&mut s.k);
            layer.v_proj.add_bias(&mut s.v);
            rope_rotate_half(&mut s.q, c.head_dim, &s.cos, &s.sin);
            rope_rotate_half(&mut s.k, c.head_dim, &s.cos, &s.sin);
            s.cache.store(li, pos, &s.k, &s.v);
            let (keys, values) = s.cache.layer(li, pos + 1);
            attention(isa, shape, &s.q, keys, values, &mut s.scores, &mut s.att);
            layer.o_proj.forward(&s.att, &mut s.h);
            add_assign(&mut s.x, &s.h);

            // MLP block: SwiGLU, gate and up in one pass.
            rmsnorm(&s.x, &layer.post_attention_layernorm, eps, &mut s.h);
            matvec_swiglu(pool, layer.gate_proj.weight.matrix(), layer.up_proj.weight.matrix(), &s.h, &mut s.ffn);
            layer.down_proj.forward(&s.ffn, &mut s.h);
            add_assign(&mut s.x, &s.h);
        }
        s.cache.advance();
        if !want_logits {
            return Ok(None);
        }
        rmsnorm(&s.x, &self.norm, eps, &mut s.h);
        matvec(self.lm_head.matrix(), &s.h, &mut s.logits);
        Ok(Some(&s.logits))
    }
}

impl Qwen2 {
    /// Runs a block of tokens at the next positions of `state`, every layer
    /// as matrix-matrix products (each weight read once for the block), and
    /// appends their keys and values to the cache. With `want_logits`, returns
    /// the logits `(vocab,)` after the last token. Equal to calling
    /// [`Qwen2::forward`] on each token in turn, up to rounding.
    pub fn forward_batch<'s>(
        &self,
        state: &'s mut State,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&'s [f32]>> {
        let t = tokens.len();
        if t <= 1 {
            return match tokens.first() {
                Some(&tok) => self.forward(state, tok, want_logits),
                None => Ok(None),
            };
        }
        self.run_block(state, tokens)?;
        if !want_logits {
            return Ok(None);
        }
        let h = self.config.hidden_size;
        let s = state;
        rmsnorm(&s.batch.x[(t - 1) * h..t * h], &self.norm, self.config.rms_norm_eps, &mut s.h);
        matvec(self.lm_head.matrix(), &s.h, &mut s.logits);
        Ok(Some(&s.logits))
    }

    /// Runs a block like [`Qwen2::forward_batch`] and writes the logits after
    /// each of its tokens `from..` into `logits ((T - from), vocab)` (for
    /// perplexity: every position's prediction, the LM head as one matrix
    /// product).
    pub fn forward_batch_logits(
        &self,
        state: &mut State,
        tokens: &[u32],
        from: usize,
        logits: &mut [f32],
    ) -> Result<()> {
        let (t, h, v) = (tokens.len(), self.config.hidden_size, self.config.vocab_size);
        if from >= t {
            return Err(Error::Option(format!("no positions to score: from {from} of {t} tokens")));
        }
        assert_eq!(logits.len(), (t - from) * v, "logits is (T - from, vocab)");
        self.run_block(state, tokens)?;
        // The block's scratch `h` is free once the layers have run.
        let b = &mut state.batch;
        let (x, normed) = (&b.x[from * h..t * h], &mut b.h[..(t - from) * h]);
        for (xr, nr) in x.chunks_exact(h).zip(normed.chunks_exact_mut(h)) {
            rmsnorm(xr, &self.norm, self.config.rms_norm_eps, nr);
        }
        matmul(pool::global(), self.lm_head.matrix(), normed, logits);
        Ok(())
    }

    /// Every layer for a block of tokens at the next positions; leaves the
    /// residual stream `(T, hidden)` in `state.batch.x` and advances the cache.
    fn run_block(&self, state: &mut State, tokens: &[u32]) -> Result<()> {
        let c = &self.config;
        let t = tokens.len();
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(Error::TokenOutOfRange { id, vocab: c.vocab_size });
        }
        let pos0 = state.cache.len();
        if pos0 + t > state.cache.capacity() {
            return Err(Error::ContextFull { context: state.cache.capacity() });
        }
        let (h, q, kv, ff, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size, c.head_dim);
        let isa = Isa::active();
        let pool = pool::global();
        let shape = AttnShape { n_heads: c.num_attention_heads, n_kv_heads: c.num_key_value_heads, head_dim: hd };
        let eps = c.rms_norm_eps;
        let s = state;
        s.batch.reserve(c, t);
        let b = &mut s.batch;
        // Block buffers, row t for token t:
        let x = &mut b.x[..t * h]; // (T, hidden) residual stream
        let hb = &mut b.h[..t * h]; // (T, hidden) normalised input or block output
        let qb = &mut b.q[..t * q]; // (T, heads * head_dim)
        let kb = &mut b.k[..t * kv]; // (T, kv_heads * head_dim)
        let vb = &mut b.v[..t * kv];
        let att = &mut b.att[..t * q]; // (T, heads * head_dim)
        let gate = &mut b.gate[..t * ff]; // (T, intermediate)
        let up = &mut b.up[..t * ff];
        let (cos, sin) = (&mut b.cos[..t * hd / 2], &mut b.sin[..t * hd / 2]); // (T, head_dim / 2)

        for (i, &tok) in tokens.iter().enumerate() {
            self.embed_tokens.matrix().row_to_f32(tok as usize, &mut x[i * h..(i + 1) * h]);
            self.rope.cos_sin(pos0 + i, &mut cos[i * hd / 2..(i + 1) * hd / 2], &mut sin[i * hd / 2..(i + 1) * hd / 2]);
        }

        for (li, layer) in self.layers.iter().enumerate() {
            // Attention block.
            for (xr, hr) in x.chunks_exact(h).zip(hb.chunks_exact_mut(h)) {
                rmsnorm(xr, &layer.input_layernorm, eps, hr);
            }
            matmuls(
                pool,
                hb,
                [
                    (layer.q_proj.weight.matrix(), &mut qb[..]),
                    (layer.k_proj.weight.matrix(), &mut kb[..]),
                    (layer.v_proj.weight.matrix(), &mut vb[..]),
                ],
            );
            for i in 0..t {
                let (qr, kr, vr) =
                    (&mut qb[i * q..(i + 1) * q], &mut kb[i * kv..(i + 1) * kv], &mut vb[i * kv..(i + 1) * kv]);
                layer.q_proj.add_bias(qr);
                layer.k_proj.add_bias(kr);
                layer.v_proj.add_bias(vr);
                let (cs, sn) = (&cos[i * hd / 2..(i + 1) * hd / 2], &sin[i * hd / 2..(i + 1) * hd / 2]);
                rope_rotate_half(qr, hd, cs, sn);
                rope_rotate_half(kr, hd, cs, sn);
                s.cache.store(li, pos0 + i, kr, vr);
            }
            causal_attention(isa, shape, &s.cache, li, pos0, qb, att);
            matmul(pool, layer.o_proj.weight.matrix(), att, hb);
            add_assign(x, hb);

            // MLP block.
            for (xr, hr) in x.chunks_exact(h).zip(hb.chunks_exact_mut(h)) {
                rmsnorm(xr, &layer.post_attention_layernorm, eps, hr);
            }
            matmul_swiglu(pool, layer.gate_proj.weight.matrix(), layer.up_proj.weight.matrix(), hb, up, gate);
            matmul(pool, layer.down_proj.weight.matrix(), gate, hb);
            add_assign(x, hb);
        }
        s.cache.advance_by(t);
        Ok(())
    }
}

thread_local! {
    /// Each thread's scratch for block attention, reused across calls.
    static ATTN_SCRATCH: RefCell<AttnScratch> = RefCell::new(AttnScratch::default());
}

/// Buffers of one (KV head, query block) item of [`causal_attention`].
#[derive(Default)]
struct AttnScratch {
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

/// Queries per work item of [`causal_attention`].
const ATTN_QUERY_BLOCK: usize = 32;

/// Causal attention for a block of `T` queries at positions `pos0..pos0+T`
/// (their keys and values already cached): query `i` sees positions
/// `0..=pos0+i`.
///
/// Done as matrix products, since a block has many queries per key: for each
/// KV head and block of queries, the grouped query heads' rows form one
/// matrix, `S = Q Kᵀ` and `O = softmax(S) V` go through the same tiled
/// `matmul` as the projections (keys and values gathered contiguous first).
/// Items (KV head, query block) are spread over the pool.
/// `q`, `out (T, heads * head_dim)`.
fn causal_attention(
    isa: Isa,
    shape: AttnShape,
    cache: &KvCache,
    layer: usize,
    pos0: usize,
    q: &[f32],
    out: &mut [f32],
) {
    let hd = shape.head_dim;
    let width = shape.n_heads * hd;
    let kv_dim = shape.kv_dim();
    let group = shape.n_heads / shape.n_kv_heads;
    let t = q.len() / width;
    let blocks = t.div_ceil(ATTN_QUERY_BLOCK);
    let items = shape.n_kv_heads * blocks;
    let scale = 1.0 / (hd as f32).sqrt();
    let out = SharedMut::new(out);
    pool::global().run(|th, n| {
        ATTN_SCRATCH.with(|scratch| {
            let sc = &mut *scratch.borrow_mut();
            // Later blocks see more keys: interleave items across threads.
            for item in (th..items).step_by(n) {
                let (kvh, blk) = (item % shape.n_kv_heads, item / shape.n_kv_heads);
                let (i0, i1) = (blk * ATTN_QUERY_BLOCK, ((blk + 1) * ATTN_QUERY_BLOCK).min(t));
                let len = pos0 + i1; // keys the last query of the block sees
                let rows = (i1 - i0) * group;
                let (keys, values) = cache.layer(layer, len);
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
                sc.s.resize(rows * len, 0.0);
                // S (rows, len) = Q (rows, hd) @ K (len, hd)ᵀ
                matmul_with(isa, MatRef::new(Weights::F32(&sc.k), len, hd), &sc.q, &mut sc.s);
                for (r, srow) in sc.s.chunks_exact_mut(len).enumerate() {
                    let visible = pos0 + i0 + r / group + 1;
                    let (seen, masked) = srow.split_at_mut(visible);
                    seen.iter_mut().for_each(|v| *v *= scale);
                    softmax(seen);
                    masked.fill(0.0);
                }
                sc.o.resize(rows * hd, 0.0);
                // O (rows, hd) = P (rows, len) @ Vᵀ (hd, len)ᵀ
                matmul_with(isa, MatRef::new(Weights::F32(&sc.vt), hd, len), &sc.s, &mut sc.o);
                for (r, orow) in sc.o.chunks_exact(hd).enumerate() {
                    let (i, g) = (i0 + r / group, r % group);
                    let o = i * width + (kvh * group + g) * hd;
                    // SAFETY: each (query, head) slot belongs to exactly one item.
                    unsafe { out.range(o, o + hd) }.copy_from_slice(orow);
                }
            }
        });
    });
}

/// Attention of one query over the cached positions, heads split across the
/// pool when the context is long enough to pay for it.
/// `q`, `out (heads * head_dim,)`, `keys`, `values (len, kv_dim)`, `scores (heads, context)`.
fn attention(isa: Isa, shape: AttnShape, q: &[f32], keys: &[f32], values: &[f32], scores: &mut [f32], out: &mut [f32]) {
    let len = keys.len() / shape.kv_dim();
    let context = scores.len() / shape.n_heads;
    let pool = pool::global();
    let threads = if len < PARALLEL_ATTENTION_MIN_LEN { 1 } else { pool.threads().min(shape.n_heads) };
    let hd = shape.head_dim;
    let (out, scores) = (SharedMut::new(out), SharedMut::new(scores));
    let work = |t: usize, n: usize| {
        let (a, b) = pool::share(shape.n_heads, t, n, 1);
        if a < b {
            // SAFETY: threads take disjoint head ranges of `out` and `scores`.
            let (o, s) = unsafe { (out.range(a * hd, b * hd), scores.range(a * context, (a + 1) * context)) };
            attend_heads(isa, shape, a..b, q, keys, values, s, o);
        }
    };
    match threads {
        1 => work(0, 1),
        _ => pool.run(work),
    }
}

/// Everything that changes while a sequence runs: the KV cache and the
/// scratch buffers of a forward pass (allocated once, reused every token).
pub struct State {
    pub cache: KvCache,
    /// Residual stream `(hidden,)`.
    x: Vec<f32>,
    /// Normalised input of a block, or a block's output `(hidden,)`.
    h: Vec<f32>,
    /// `(heads * head_dim,)`
    q: Vec<f32>,
    /// `(kv_heads * head_dim,)`
    k: Vec<f32>,
    v: Vec<f32>,
    /// Attention output `(heads * head_dim,)`.
    att: Vec<f32>,
    /// `silu(gate) * up`, `(intermediate,)`.
    ffn: Vec<f32>,
    /// Attention weights, one row per head `(heads, context)`.
    scores: Vec<f32>,
    /// RoPE tables of the current position `(head_dim / 2,)`.
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// `(vocab,)`
    logits: Vec<f32>,
    /// Buffers of [`Qwen2::forward_batch`], sized for the largest block seen.
    batch: Batch,
}

/// Scratch of a block of `T` tokens; see [`Qwen2::forward_batch`] for shapes.
#[derive(Default)]
struct Batch {
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
}

impl Batch {
    /// Makes room for `t` tokens (never shrinks).
    fn reserve(&mut self, c: &Config, t: usize) {
        if t <= self.tokens {
            return;
        }
        self.tokens = t;
        let size = |width: usize| vec![0.0; t * width];
        self.x = size(c.hidden_size);
        self.h = size(c.hidden_size);
        self.q = size(c.q_dim());
        self.k = size(c.kv_dim());
        self.v = size(c.kv_dim());
        self.att = size(c.q_dim());
        self.gate = size(c.intermediate_size);
        self.up = size(c.intermediate_size);
        self.cos = size(c.head_dim / 2);
        self.sin = size(c.head_dim / 2);
    }
}

impl State {
    /// Positions processed so far.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// Positions this state can hold.
    pub fn capacity(&self) -> usize {
        self.cache.capacity()
    }
}
