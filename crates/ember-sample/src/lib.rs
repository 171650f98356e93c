//! # ember-sample: turning logits into the next token
//!
//! A [`Sampler`] maps one row of logits, `(vocab,)` `f32`s, plus the token
//! history to the next token id. It is a pure, ordered chain of steps over
//! the logits, driven by a seeded [`Rng`] so runs are reproducible. No
//! dependencies, no allocation per token after the first call.
//!
//! ## The chain
//!
//! 1. **Penalties**, in place on the logits, over the last `penalty_last_n`
//!    ids of the history. For each distinct id seen `count` times there:
//!    * repetition (HF / llama.cpp): a positive logit is divided by
//!      `repetition_penalty`, a negative one multiplied by it (so `> 1`
//!      always makes the token less likely);
//!    * then frequency and presence (OpenAI style):
//!      `l -= count * frequency_penalty + presence_penalty`.
//!
//!    Nothing else is touched. `penalty_last_n = 0` disables all penalties.
//! 2. **Greedy** (`temperature == 0`): return [`argmax`] of the penalized
//!    logits. A fast path: no sort, no RNG.
//! 3. **Temperature**: the logits are divided by `temperature`.
//! 4. **Top-k** (`top_k > 0`): keep the `k` largest.
//! 5. **Top-p** (`top_p < 1`): with probabilities = softmax over the
//!    survivors *after temperature*, keep the smallest set of most likely
//!    tokens whose mass reaches `top_p` (always at least one).
//! 6. **Min-p** (`min_p > 0`): keep tokens with
//!    `prob >= min_p * max_prob` (probabilities again after temperature).
//! 7. **Draw**: softmax over the survivors, one RNG draw (inverse CDF).
//!
//! This is the order of Hugging Face `transformers`' `generate` (its logits
//! processors run penalties, then temperature, top-k, top-p, min-p), so the
//! same settings mean the same thing as there. In particular temperature
//! changes which tokens top-p and min-p keep: with logits `[2, 1, 0]`,
//! `top_p = 0.6` keeps one token at `temperature = 1` but two at
//! `temperature = 2`. (Some engines, e.g. older llama.cpp chains, apply
//! temperature last instead.)
//!
//! ## Implementation notes
//!
//! * Dividing by `T > 0` preserves order, so top-k runs on the raw logits in
//!   one pass that keeps the k best so far (a logit enters only if it beats
//!   the worst of them: one comparison per logit; 0.35 ms a token over
//!   151,936 logits against 1.2 ms for gathering all and a partial selection,
//!   which remains its reference twin and the path for `+inf` logits), and
//!   the temperature is folded into the softmax weights
//!   `exp((l - l_max) / T)` used by top-p, min-p and the draw.
//! * Top-p needs the candidates in probability order. After top-k only `k`
//!   candidates are sorted; without top-k the order is built lazily in
//!   growing chunks, so a small nucleus never sorts the whole 151,936-token
//!   vocab.
//! * Determinism: ties are broken by lower token id (in [`argmax`], top-k
//!   and top-p). NaN logits and `-inf` never win and are never drawn; if some
//!   logits are `+inf` they share all the probability equally. If no logit
//!   is usable the sampler falls back to [`argmax`].
//! * A non-greedy sampler consumes exactly one RNG draw per call.
//!
//! ## Example
//!
//! ```
//! use ember_sample::{Sampler, SamplerConfig};
//!
//! // Qwen2-style settings.
//! let cfg = SamplerConfig {
//!     temperature: 0.7,
//!     top_k: 20,
//!     top_p: 0.8,
//!     repetition_penalty: 1.05,
//!     seed: 42,
//!     ..Default::default()
//! };
//! let mut sampler = Sampler::new(cfg)?;
//! let mut history: Vec<u32> = vec![1, 2, 3]; // prompt ids
//! for _ in 0..4 {
//!     let mut logits: Vec<f32> = (0..8).map(|i| i as f32 * 0.5).collect(); // (vocab,)
//!     let id = sampler.sample(&mut logits, &history);
//!     assert!(id < 8);
//!     history.push(id);
//! }
//!
//! // Same seed, same tokens.
//! let mut again = Sampler::new(sampler.config().clone())?;
//! let mut replay: Vec<u32> = vec![1, 2, 3];
//! for _ in 0..4 {
//!     let mut logits: Vec<f32> = (0..8).map(|i| i as f32 * 0.5).collect();
//!     let id = again.sample(&mut logits, &replay);
//!     replay.push(id);
//! }
//! assert_eq!(history, replay);
//!
//! // Greedy is the argmax.
//! let mut greedy = Sampler::new(SamplerConfig::greedy())?;
//! assert_eq!(greedy.sample(&mut [0.1, 2.0, -1.0], &[]), 1);
//!
//! // Bad settings are rejected with the field's name.
//! let err = Sampler::new(SamplerConfig { top_p: 0.0, ..Default::default() }).unwrap_err();
//! assert_eq!(err.field(), "top_p");
//! # Ok::<(), ember_sample::SamplerError>(())
//! ```

#![warn(missing_docs)]

mod config;
mod rng;
mod sampler;

pub use config::{SamplerConfig, SamplerError};
pub use rng::Rng;
pub use sampler::Sampler;

/// Index of the maximum of `logits` (`(vocab,)`); the first one on ties.
/// NaN never wins; if every value is NaN the result is 0.
///
/// # Panics
/// If `logits` is empty.
pub fn argmax(logits: &[f32]) -> u32 {
    assert!(!logits.is_empty(), "argmax: empty logits");
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        // Strict `>` keeps the first index among equal maxima.
        match best {
            Some((_, b)) if v <= b => {}
            _ => best = Some((i, v)),
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}
