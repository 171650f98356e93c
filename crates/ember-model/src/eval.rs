//! Quality of a model variant on a text: perplexity, and against a base
//! model (the BF16 weights), the KL divergence of the next-token
//! distributions and how often both pick the same top token.
//!
//! Done as llama.cpp's `llama-perplexity` does it, so the figures compare:
//! the token stream is cut into windows of `ctx` tokens, each window runs
//! from an empty cache, and only the second half of each window is scored
//! (every scored prediction has at least `ctx / 2` tokens of context): for
//! `j` in `ctx/2 .. ctx-1`, the logits after token `j` predict token `j + 1`.

use crate::alloc;
use crate::error::{Error, Result};
use crate::qwen2::Qwen2;
use ember_kernels::pool::{self, SharedMut};

/// What [`evaluate`] measured.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct EvalReport {
    /// Perplexity of the evaluated model: `exp(mean NLL)` over scored tokens.
    pub ppl: f64,
    /// Perplexity of the base model on the same tokens.
    pub base_ppl: f64,
    /// Mean of `KL(base ‖ model)` over scored tokens, in nats.
    pub kld_mean: f64,
    /// 99th percentile of the per-token KL divergence.
    pub kld_p99: f64,
    /// Fraction of scored tokens where both models' most likely token agree.
    pub top1: f64,
    /// Tokens scored.
    pub tokens: usize,
    /// Windows run.
    pub windows: usize,
    /// Tokens per window.
    pub ctx: usize,
}

/// Per scored position: the variant's NLL, the base's NLL, KL, top-1 agreement.
#[derive(Clone, Copy, Default)]
struct Score {
    nll: f64,
    base_nll: f64,
    kld: f64,
    same_top: bool,
}

/// How the evaluated model runs each window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// The whole window as one batched prefill (matrix products).
    #[default]
    Batched,
    /// One token at a time, as decoding runs (for quantized weights: the
    /// integer kernels on int8 activations).
    TokenByToken,
}

/// Evaluates `model` on `tokens` in windows of `ctx` against `base` (`None`:
/// the model is its own base, so KL is 0 and top-1 agreement 1).
/// `progress(done, total)` is called after each window.
pub fn evaluate(
    model: &Qwen2,
    base: Option<&Qwen2>,
    tokens: &[u32],
    ctx: usize,
    progress: impl FnMut(usize, usize),
) -> Result<EvalReport> {
    evaluate_with(model, base, tokens, ctx, Mode::Batched, progress)
}

/// [`evaluate`] with the evaluated model run as `mode` says (the base always
/// runs batched).
pub fn evaluate_with(
    model: &Qwen2,
    base: Option<&Qwen2>,
    tokens: &[u32],
    ctx: usize,
    mode: Mode,
    mut progress: impl FnMut(usize, usize),
) -> Result<EvalReport> {
    if ctx < 4 {
        return Err(Error::Option(format!("windows must be at least 4 tokens, not {ctx}")));
    }
    let windows = tokens.len() / ctx;
    if windows == 0 {
        return Err(Error::Option(format!("the corpus has {} tokens, fewer than one window of {ctx}", tokens.len())));
    }
    let vocab = model.config.vocab_size;
    if let Some(b) = base {
        if b.config.vocab_size != vocab {
            return Err(Error::Option("the base model has another vocabulary".into()));
        }
    }
    let first = ctx / 2;
    let scored = ctx - 1 - first;
    const LOGITS: &str = "the logits of a window's scored positions";
    let per_window = alloc::product(&[ctx - first, vocab], LOGITS)?;
    let mut logits: Vec<f32> = alloc::zeroed(per_window, LOGITS)?;
    let mut base_logits: Vec<f32> = alloc::zeroed(if base.is_some() { per_window } else { 0 }, LOGITS)?;
    let mut scores = Vec::with_capacity(windows * scored);
    for w in 0..windows {
        let window = &tokens[w * ctx..(w + 1) * ctx];
        let mut state = model.new_state(ctx);
        match mode {
            Mode::Batched => logits.copy_from_slice(state.run_scored(model, window, first)?),
            Mode::TokenByToken => {
                for (j, &id) in window.iter().enumerate() {
                    let out = state.run(model, &[id], j >= first)?;
                    if let Some(l) = out {
                        logits[(j - first) * vocab..(j - first + 1) * vocab].copy_from_slice(l);
                    }
                }
            }
        }
        check_finite(&logits, vocab, w * ctx + first)?;
        if let Some(b) = base {
            let mut state = b.new_state(ctx);
            base_logits.copy_from_slice(state.run_scored(b, window, first)?);
            check_finite(&base_logits, vocab, w * ctx + first)?;
        }
        let mut out = vec![Score::default(); scored];
        {
            let shared = SharedMut::new(&mut out);
            let (logits, base_logits) = (&logits, &base_logits);
            pool::global().run(|t, n| {
                let (a, b) = pool::share(scored, t, n, 1);
                // SAFETY: threads take disjoint positions.
                let out = unsafe { shared.range(a, b) };
                for (i, o) in (a..b).zip(out.iter_mut()) {
                    let next = window[first + i + 1] as usize;
                    let q = &logits[i * vocab..(i + 1) * vocab];
                    let p = if base.is_some() { Some(&base_logits[i * vocab..(i + 1) * vocab]) } else { None };
                    *o = score(q, p, next);
                }
            });
        }
        scores.extend(out);
        progress(w + 1, windows);
    }
    let n = scores.len() as f64;
    let mean = |f: &dyn Fn(&Score) -> f64| scores.iter().map(f).sum::<f64>() / n;
    let mut klds: Vec<f64> = scores.iter().map(|s| s.kld).collect();
    klds.sort_by(f64::total_cmp);
    Ok(EvalReport {
        ppl: mean(&|s| s.nll).exp(),
        base_ppl: mean(&|s| s.base_nll).exp(),
        kld_mean: mean(&|s| s.kld),
        kld_p99: percentile(&klds, 0.99),
        top1: mean(&|s| if s.same_top { 1.0 } else { 0.0 }),
        tokens: scores.len(),
        windows,
        ctx,
    })
}

/// [`Error::NonFinite`] for the first non-finite value of `logits`
/// `(positions, vocab)`, whose first row is the logits after the token at
/// `position`.
fn check_finite(logits: &[f32], vocab: usize, position: usize) -> Result<()> {
    match crate::generate::first_non_finite(logits) {
        None => Ok(()),
        Some(i) => Err(Error::NonFinite { position: position + i / vocab, token: i % vocab, value: logits[i] }),
    }
}

/// `log softmax(x)[i]` for every i, in f64.
fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    x.iter().map(|&v| v as f64 - lse).collect()
}

fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) }).0
}

fn score(q: &[f32], p: Option<&[f32]>, next: usize) -> Score {
    let lq = log_softmax(q);
    match p {
        None => Score { nll: -lq[next], base_nll: -lq[next], kld: 0.0, same_top: true },
        Some(p) => {
            let lp = log_softmax(p);
            let kld = lp.iter().zip(&lq).map(|(&a, &b)| a.exp() * (a - b)).sum::<f64>().max(0.0);
            Score { nll: -lq[next], base_nll: -lp[next], kld, same_top: argmax(p) == argmax(q) }
        }
    }
}

/// The `q` quantile of sorted values (nearest rank).
fn percentile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_distributions_have_zero_divergence() {
        let x = [1.0f32, 2.0, 3.0, -1.0];
        let s = score(&x, Some(&x), 2);
        assert!(s.kld.abs() < 1e-12 && s.same_top);
        assert!((s.nll - s.base_nll).abs() < 1e-12);
    }

    #[test]
    fn divergence_matches_the_formula() {
        let (p, q) = ([0.0f32, 1.0, 2.0], [2.0f32, 1.0, 0.0]);
        let s = score(&q, Some(&p), 0);
        let (lp, lq) = (log_softmax(&p), log_softmax(&q));
        let want: f64 = (0..3).map(|i| lp[i].exp() * (lp[i] - lq[i])).sum();
        assert!((s.kld - want).abs() < 1e-12 && want > 0.0);
        assert!(!s.same_top);
        assert!((s.nll + lq[0]).abs() < 1e-12);
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(|i| i as f64).collect();
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
        assert_eq!(percentile(&[5.0], 0.99), 5.0);
    }
}
