//! Generation of one or several sequences: what a sequence holds between
//! forward passes ([`Context`]), how it is being generated ([`Decoding`]),
//! and [`step`], one forward pass for several sequences followed by a sample
//! each. [`Session`](crate::Session) and [`Generation`](crate::Generation)
//! drive one sequence with these.

use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::Model;
use crate::options::{CancelToken, GenerateOptions};
use crate::qwen2::{BatchToken, Scratch};
use crate::stream::TextStream;
use ember_sample::Sampler;
use std::fmt;
use std::time::{Duration, Instant};

/// Context used when the caller does not choose one: enough for long chats,
/// small enough that the KV cache stays modest (it grows only as used).
pub const DEFAULT_CONTEXT: usize = 4096;

/// Prompt tokens run through the model together (one matrix-matrix pass per
/// layer). Larger blocks reuse each weight more but need more scratch memory
/// (about 45 KB per token for the 0.5B model); 512 is where llama.cpp's
/// micro-batch sits too.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// What one sequence holds between forward passes: its KV cache, the tokens
/// in it, and tokens waiting to be run.
///
/// Cloning copies the cached positions (not the unused capacity): a fork
/// that continues independently from the same prefix.
#[derive(Clone)]
pub struct Context {
    pub(crate) cache: KvCache,
    /// Tokens whose keys and values are cached, in order.
    pub(crate) tokens: Vec<u32>,
    /// Tokens generated but not yet run through the model (the last sampled
    /// token of a reply); they run before the next prompt.
    pub(crate) pending: Vec<u32>,
}

impl Context {
    /// An empty context over `cache`.
    pub fn new(mut cache: KvCache) -> Context {
        cache.clear();
        Context { cache, tokens: Vec::new(), pending: Vec::new() }
    }

    /// Tokens whose keys and values are cached.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Tokens waiting to run before the next prompt (the last sampled token
    /// of a reply).
    pub fn pending(&self) -> &[u32] {
        &self.pending
    }

    /// Positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.cache.capacity()
    }

    /// A new context holding a copy of the first `len` cached tokens of
    /// this one (at most those cached) and nothing pending: a continuation
    /// from a shared prefix that copies only the prefix's keys and values
    /// (a server's prefix cache forks its entries so).
    /// An error if the memory for another cache is not there.
    pub fn fork_prefix(&self, len: usize) -> Result<Context> {
        let len = len.min(self.tokens.len());
        Ok(Context { cache: self.cache.copy_prefix(len)?, tokens: self.tokens[..len].to_vec(), pending: Vec::new() })
    }

    /// Forgets every token after the first `len` (cached or pending).
    pub fn rewind(&mut self, len: usize) {
        if len <= self.tokens.len() {
            self.tokens.truncate(len);
            self.cache.truncate(len);
            self.pending.clear();
        } else {
            self.pending.truncate(len - self.tokens.len());
        }
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("cached", &self.tokens.len())
            .field("pending", &self.pending)
            .field("capacity", &self.capacity())
            .finish()
    }
}

/// Why generation ended.
///
/// `Display` writes [`StopReason::name`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StopReason {
    /// The model produced one of its EOS ids.
    Eos,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The context is full.
    ContextFull,
    /// The text reached one of the stop strings.
    StopString,
    /// The generation's [`CancelToken`] was cancelled.
    Cancelled,
}

impl StopReason {
    /// A short, stable name: `eos`, `max_tokens`, `context_full`,
    /// `stop_string`, `cancelled` (as `ember --json` reports it).
    pub fn name(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::MaxTokens => "max_tokens",
            StopReason::ContextFull => "context_full",
            StopReason::StopString => "stop_string",
            StopReason::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Timings and counts of one generation.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Tokens run through the model before the first new token.
    pub prompt_tokens: usize,
    /// Time from the start to the first new token: the prompt's forward
    /// passes and the first draw.
    pub prefill: Duration,
    /// Forward passes after the first new token.
    pub decode_tokens: usize,
    /// Time of those passes and their draws.
    pub decode: Duration,
    /// New tokens produced (including an EOS).
    pub generated: usize,
    /// Cached tokens reused from earlier turns (see [`Session::generate_from`](crate::Session::generate_from)).
    pub reused_tokens: usize,
    /// Why it ended, once it has.
    pub stop: Option<StopReason>,
}

impl Stats {
    /// Prompt tokens per second of prefill.
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill)
    }

    /// Tokens per second after the first.
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.decode_tokens, self.decode)
    }
}

fn rate(n: usize, d: Duration) -> f64 {
    if n == 0 || d.is_zero() {
        0.0
    } else {
        n as f64 / d.as_secs_f64()
    }
}

/// One generated token and the text it completed (UTF-8 safe; may be empty
/// while a multi-token character is still incomplete, or while text that
/// may begin a stop string is held back).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Token {
    /// The token id.
    pub id: u32,
    /// The text this token completed.
    pub text: String,
    /// Whether it is one of the model's EOS ids (generation stops after it).
    pub is_eos: bool,
    /// With [`GenerateOptions::logprobs`]: `ln p(id)` under the model's
    /// distribution at this step, `log_softmax` of the raw logits (before
    /// penalties, temperature or truncation).
    pub logprob: Option<f32>,
    /// With [`GenerateOptions::top_logprobs`]: the most likely tokens at
    /// this step and their log-probabilities, most likely first (ties by
    /// lower id); the sampled token may or may not be among them.
    pub top_logprobs: Vec<TopLogprob>,
}

/// A likely token at one step, with its log-probability.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopLogprob {
    /// The token id ([`Model::decode`](crate::Model::decode) gives its text).
    pub id: u32,
    /// `ln p(id)`.
    pub logprob: f32,
}

/// The generation state of one sequence, apart from the model: what is
/// still to run, the sampler and its history, the text stream and stop
/// strings, and the counts and timings. [`step`] drives several at once.
pub struct Decoding {
    /// Checked before every forward pass.
    cancel: CancelToken,
    sampler: Sampler,
    options: GenerateOptions,
    /// Tokens to run before sampling the next one.
    todo: Vec<u32>,
    /// How many of `todo` ran in earlier forward passes (a long prompt runs
    /// in chunks).
    done_todo: usize,
    /// Logits `(vocab,)` the latest token was sampled from, unmodified.
    logits: Vec<f32>,
    /// The sampler's working copy of the logits `(vocab,)`.
    scratch: Vec<f32>,
    /// Tokens of the context plus those generated, for penalties.
    history: Vec<u32>,
    stream: TextStream,
    /// Text held back because it may begin a stop string.
    held: String,
    stats: Stats,
    /// The token sampled by the latest [`step`], if any.
    sampled: Option<Token>,
    /// Token ids `(vocab,)` reordered to find the most likely ones (only
    /// with `top_logprobs`).
    order: Vec<u32>,
    done: bool,
}

impl fmt::Debug for Decoding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decoding")
            .field("options", &self.options)
            .field("waiting", &(self.todo.len() - self.done_todo))
            .field("stats", &self.stats)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl Decoding {
    /// Generation of `options` after `todo` (the prompt, with any pending
    /// tokens first) on a context holding `reused` cached tokens.
    pub fn new(model: &Model, options: GenerateOptions, todo: Vec<u32>, reused: usize) -> Result<Decoding> {
        let sampler = Sampler::new(options.sampler.clone())?;
        let vocab = model.config().vocab_size;
        Ok(Decoding {
            cancel: options.cancel.clone().unwrap_or_default(),
            sampler,
            options,
            todo,
            done_todo: 0,
            logits: vec![0.0; vocab],
            scratch: vec![0.0; vocab],
            history: Vec::new(),
            stream: TextStream::new(),
            held: String::new(),
            stats: Stats { reused_tokens: reused, ..Stats::default() },
            sampled: None,
            order: Vec::new(),
            done: false,
        })
    }

    /// Whether generation has ended (see [`Stats::stop`]).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Counts and timings so far.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The logits `(vocab,)` the most recent token was drawn from.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// The token the latest [`step`] sampled, taken.
    pub fn take_token(&mut self) -> Option<Token> {
        self.sampled.take()
    }

    /// The token [`step`] checks before each forward pass of this sequence.
    pub fn cancel_token(&self) -> &CancelToken {
        &self.cancel
    }

    /// Checks the limits before a step; ends the generation if one is reached.
    fn ready(&mut self, ctx: &mut Context) {
        if self.done {
            return;
        }
        if self.stats.generated >= self.options.max_tokens {
            self.stop(ctx, StopReason::MaxTokens);
        } else if ctx.tokens.len() + (self.todo.len() - self.done_todo) > ctx.capacity() {
            // (Tokens of a prompt that ran in earlier passes are in the context.)
            self.stop(ctx, StopReason::ContextFull);
        }
    }

    /// Samples the next token from `self.logits` and updates the text, stop
    /// strings and limits.
    fn sample(&mut self, model: &Model, ctx: &mut Context) -> Result<Token> {
        // Never a token drawn from NaN: the sampler would pick an arbitrary one.
        if let Some(i) = first_non_finite(&self.logits) {
            let position = ctx.tokens.len().saturating_sub(1);
            return Err(Error::NonFinite { position, token: i, value: self.logits[i] });
        }
        self.scratch.copy_from_slice(&self.logits);
        let id = self.sampler.sample(&mut self.scratch, &self.history);
        self.history.push(id);
        self.stats.generated += 1;
        let is_eos = self.options.stop_at_eos && model.eos_token_ids().contains(&id);
        let (logprob, top_logprobs) = self.logprobs(id);
        let delta = self.stream.push(model.tokenizer(), id)?;
        // The sampled token runs at the next step (or waits in the context).
        self.todo.clear();
        self.todo.push(id);
        self.done_todo = 0;
        let end = if is_eos {
            Some(StopReason::Eos)
        } else if self.stats.generated >= self.options.max_tokens {
            Some(StopReason::MaxTokens)
        } else if ctx.tokens.len() + self.todo.len() > ctx.capacity() {
            Some(StopReason::ContextFull)
        } else {
            None
        };
        let mut delta = delta;
        if end.is_some() {
            delta.push_str(&self.stream.finish(model.tokenizer())?);
        }
        let (text, hit) = self.stop_filter(delta, end.is_some());
        match (hit, end) {
            (true, _) => self.stop(ctx, StopReason::StopString),
            (false, Some(reason)) => self.stop(ctx, reason),
            (false, None) => {}
        }
        Ok(Token { id, text, is_eos, logprob, top_logprobs })
    }

    /// What the options ask for of `ln softmax(logits)`: the sampled token's
    /// value and the most likely tokens'. Nothing is computed when neither
    /// is asked for.
    fn logprobs(&mut self, id: u32) -> (Option<f32>, Vec<TopLogprob>) {
        let top = self.options.top_logprobs.min(self.logits.len());
        if !self.options.logprobs && top == 0 {
            return (None, Vec::new());
        }
        let l = &self.logits;
        // log-sum-exp in f64, shifted by the maximum.
        let max = l.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max) as f64;
        let sum: f64 = l.iter().filter(|v| !v.is_nan()).map(|&v| (v as f64 - max).exp()).sum();
        let lse = max + sum.ln();
        let logprob = |i: u32| (l[i as usize] as f64 - lse) as f32;
        let mut best = Vec::with_capacity(top);
        if top > 0 {
            // Descending logit, ties by lower id, NaN last.
            let order = |a: &u32, b: &u32| {
                let (x, y) = (l[*a as usize], l[*b as usize]);
                y.partial_cmp(&x).unwrap_or_else(|| x.is_nan().cmp(&y.is_nan())).then(a.cmp(b))
            };
            self.order.clear();
            self.order.extend(0..l.len() as u32);
            self.order.select_nth_unstable_by(top - 1, order);
            self.order[..top].sort_unstable_by(order);
            best.extend(self.order[..top].iter().map(|&i| TopLogprob { id: i, logprob: logprob(i) }));
        }
        (self.options.logprobs.then(|| logprob(id)), best)
    }

    /// Applies the stop strings to a text delta: returns the text safe to
    /// emit and whether a stop string was reached. Text that could be the
    /// start of a stop string is held back until it is not (or `last`).
    fn stop_filter(&mut self, delta: String, last: bool) -> (String, bool) {
        if self.options.stop_strings.is_empty() {
            return (delta, false);
        }
        self.held.push_str(&delta);
        let hit =
            self.options.stop_strings.iter().filter(|s| !s.is_empty()).filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(i) = hit {
            let out = self.held[..i].to_string();
            self.held.clear();
            return (out, true);
        }
        if last {
            return (std::mem::take(&mut self.held), false);
        }
        // The longest tail of the held text that some stop string starts with.
        let keep = self
            .options
            .stop_strings
            .iter()
            .flat_map(|s| (1..s.len()).filter(|&k| s.is_char_boundary(k) && self.held.ends_with(&s[..k])))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let rest = self.held.split_off(cut);
        (std::mem::replace(&mut self.held, rest), false)
    }

    /// Ends a generation its caller stopped reading: what did not run
    /// waits in `ctx`, with no stop reason.
    pub(crate) fn abandon(&mut self, ctx: &mut Context) {
        if !self.done {
            self.done = true;
            ctx.pending = self.todo[self.done_todo..].to_vec();
            self.todo.clear();
        }
    }

    /// Ends a generation after an error.
    pub(crate) fn fail(&mut self) {
        self.done = true;
    }

    /// Ends the generation; the sampled-but-unrun token waits in `ctx`.
    fn stop(&mut self, ctx: &mut Context, reason: StopReason) {
        if !self.done {
            self.done = true;
            self.stats.stop = Some(reason);
            ctx.pending = self.todo[self.done_todo..].to_vec();
            self.todo.clear();
        }
    }
}

/// One step of several sequences together: every sequence's waiting tokens
/// run through the model in shared forward passes (at most `chunk` tokens of
/// each sequence per pass; a prompt longer than that takes several), then
/// each sequence samples its next token, found afterwards with
/// [`Decoding::take_token`]. Sequences that have ended are skipped; a
/// sequence whose [`CancelToken`] is cancelled before one of its passes ends
/// there ([`StopReason::Cancelled`]) and samples nothing.
///
/// This is the multi-sequence API a server's scheduler uses: each sequence
/// is a [`Context`] (its KV cache and tokens) and a [`Decoding`], stepped
/// together they produce what each produces alone, and a step costs about
/// one forward pass, not one per sequence.
pub fn step(
    model: &Model,
    scratch: &mut Scratch,
    chunk: usize,
    seqs: &mut [(&mut Context, &mut Decoding)],
) -> Result<()> {
    passes_then_sample(model, scratch, chunk, seqs, usize::MAX)
}

/// One forward pass of several sequences together: every live sequence runs
/// its next waiting tokens (at most `chunk` of them), and those whose
/// waiting tokens have all run sample their next token (found with
/// [`Decoding::take_token`]); a sequence still in the middle of a long
/// prompt samples nothing this time.
///
/// [`step`] runs a long prompt to its end before anyone samples; `advance`
/// is the same work cut at every pass, for a scheduler that keeps other
/// sequences' tokens flowing while a long prompt arrives: each call costs
/// one forward pass, whose size is the sequences' next tokens plus at most
/// `chunk` tokens of each prompt. Called until every sequence is done, it
/// produces the same tokens as [`step`].
pub fn advance(
    model: &Model,
    scratch: &mut Scratch,
    chunk: usize,
    seqs: &mut [(&mut Context, &mut Decoding)],
) -> Result<()> {
    passes_then_sample(model, scratch, chunk, seqs, 1)
}

/// [`step`] and [`advance`]: at most `passes` forward passes of the waiting
/// tokens, then a sample from every sequence that ran all of them.
fn passes_then_sample(
    model: &Model,
    scratch: &mut Scratch,
    chunk: usize,
    seqs: &mut [(&mut Context, &mut Decoding)],
    passes: usize,
) -> Result<()> {
    let start = Instant::now();
    // Sequences at a limit end here; the others stay live until they sample.
    for (ctx, d) in seqs.iter_mut() {
        d.ready(ctx);
    }
    // The batch buffer lives in the scratch, reused from step to step.
    let mut batch = std::mem::take(&mut scratch.batch);
    let ran = run_waiting(model, scratch, chunk.max(1), seqs, &mut batch, passes);
    scratch.batch = batch;
    ran?;
    sample_ready(model, seqs, start.elapsed())
}

/// The index of the first NaN or infinite value of `x`, if any. A pass of
/// lane-wise `v · 0` sums first (0 for finite values, NaN otherwise), which
/// vectorises: the check costs a few microseconds over a vocabulary.
pub(crate) fn first_non_finite(x: &[f32]) -> Option<usize> {
    let mut lanes = [0.0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v * 0.0;
        }
    }
    let tail = chunks.remainder().iter().fold(0.0f32, |a, &v| a + v * 0.0);
    if lanes.iter().fold(tail, |a, &l| a + l) == 0.0 {
        return None;
    }
    x.iter().position(|v| !v.is_finite())
}

/// Samples the next token of every live sequence whose waiting tokens have
/// all run, charging `elapsed` to its prompt or decode time.
fn sample_ready(model: &Model, seqs: &mut [(&mut Context, &mut Decoding)], elapsed: Duration) -> Result<()> {
    for (ctx, d) in seqs.iter_mut() {
        if d.done {
            continue;
        }
        if d.done_todo < d.todo.len() {
            // Part of a long prompt ran; the rest runs at the next pass.
            d.stats.prefill += elapsed;
            continue;
        }
        if d.stats.generated == 0 {
            d.stats.prompt_tokens = d.todo.len();
            d.stats.prefill += elapsed;
            d.history.extend_from_slice(&ctx.tokens);
        } else {
            d.stats.decode_tokens += d.todo.len();
            d.stats.decode += elapsed;
        }
        d.sampled = Some(d.sample(model, ctx)?);
    }
    Ok(())
}

/// Runs every live sequence's waiting tokens, at most `chunk` of each per
/// forward pass and at most `passes` passes, leaving the logits after the
/// last token of each sequence that ran all of them.
fn run_waiting(
    model: &Model,
    scratch: &mut Scratch,
    chunk: usize,
    seqs: &mut [(&mut Context, &mut Decoding)],
    batch: &mut Vec<BatchToken>,
    passes: usize,
) -> Result<()> {
    let vocab = model.config().vocab_size;
    for _ in 0..passes {
        batch.clear();
        for (s, (ctx, d)) in seqs.iter_mut().enumerate().filter(|(_, (_, d))| !d.done) {
            let from = d.done_todo;
            if from < d.todo.len() && d.cancel.is_cancelled() {
                // What ran stays cached; the rest waits in the context.
                d.stop(ctx, StopReason::Cancelled);
                continue;
            }
            let to = from.saturating_add(chunk).min(d.todo.len());
            let pos0 = ctx.tokens.len();
            for (k, &token) in d.todo[from..to].iter().enumerate() {
                let last = from + k + 1 == d.todo.len();
                batch.push(BatchToken { token, seq: s, pos: pos0 + k, logits: last });
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        let mut caches: Vec<&mut KvCache> = seqs.iter_mut().map(|(ctx, _)| &mut ctx.cache).collect();
        let logits = model.decoder().forward(batch, &mut caches, scratch)?;
        let mut row = 0;
        for (s, (ctx, d)) in seqs.iter_mut().enumerate() {
            let ran = batch.iter().filter(|b| b.seq == s).count();
            if ran == 0 {
                continue;
            }
            ctx.tokens.extend_from_slice(&d.todo[d.done_todo..d.done_todo + ran]);
            d.done_todo += ran;
            if d.done_todo == d.todo.len() {
                d.logits.copy_from_slice(&logits[row * vocab..(row + 1) * vocab]);
                row += 1;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::first_non_finite;

    #[test]
    fn non_finite_values_are_found_wherever_they_are() {
        let mut x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 1e30).collect();
        x[3] = -0.0;
        assert_eq!(first_non_finite(&x), None);
        for (i, bad) in [(0, f32::NAN), (17, f32::INFINITY), (998, f32::NEG_INFINITY), (999, f32::NAN)] {
            let mut y = x.clone();
            y[i] = bad;
            assert_eq!(first_non_finite(&y), Some(i), "{bad} at {i}");
        }
        let mut y = x.clone();
        y[500] = f32::NAN;
        y[20] = f32::INFINITY;
        assert_eq!(first_non_finite(&y), Some(20), "the first one");
        assert_eq!(first_non_finite(&[]), None);
        assert_eq!(first_non_finite(&[f32::MAX, f32::MIN]), None);
    }
}
