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
use ember_kernels::ops::{add_assign, add_bias, rmsnorm, rope_rotate_half, Rope};
use ember_kernels::pool::{self, SharedMut};
use ember_kernels::{matvec, matvec_swiglu, matvecs, Isa};

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
