//! A loaded model and text generation with streaming.

use crate::config::{eos_ids, Config, GenerationConfig};
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::qwen2::{BatchToken, QuantPolicy, Qwen2, Scratch};
use crate::stream::TextStream;
use crate::tokenizer::{Message, Tokenizer};
use crate::weights::TensorStore;
use ember_sample::{Sampler, SamplerConfig};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Context used when the caller does not choose one: enough for long chats,
/// small enough that the KV cache stays modest (it grows only as used).
pub const DEFAULT_CONTEXT: usize = 4096;

/// Prompt tokens run through the model together (one matrix-matrix pass per
/// layer). Larger blocks reuse each weight more but need more scratch memory
/// (about 45 KB per token for the 0.5B model); 512 is where llama.cpp's
/// micro-batch sits too.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// A model folder, loaded: weights, tokenizer, chat template, generation defaults.
pub struct Model {
    pub qwen2: Qwen2,
    pub tokenizer: Tokenizer,
    pub generation_config: GenerationConfig,
    eos: Vec<u32>,
    dir: PathBuf,
}

impl Model {
    /// Loads `config.json`, the safetensors weights (memory-mapped),
    /// `tokenizer.json`, the chat template and `generation_config.json`.
    pub fn load(dir: impl AsRef<Path>) -> Result<Model> {
        Model::load_quantized(dir, None)
    }

    /// [`Model::load`], then the weight matrices quantized as `policy` says
    /// if given ([`Qwen2::quantize`]; a few seconds for a 0.5B model).
    pub fn load_quantized(dir: impl AsRef<Path>, policy: Option<QuantPolicy>) -> Result<Model> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(Error::MissingModelDir(dir.to_path_buf()));
        }
        let mut qwen2 = load_qwen2(dir)?;
        if let Some(policy) = &policy {
            qwen2.quantize(policy);
        }
        let tokenizer = Tokenizer::from_dir(dir)?;
        let generation_config = GenerationConfig::from_file(&dir.join("generation_config.json"))?;
        let eos = eos_ids(&qwen2.config, &generation_config);
        Ok(Model { qwen2, tokenizer, generation_config, eos, dir: dir.to_path_buf() })
    }

    pub fn config(&self) -> &Config {
        &self.qwen2.config
    }

    /// The folder the model was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The ids generation stops on.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Token ids of `text` (special tokens written in it are recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode(text)
    }

    /// The prompt for a chat: the model's template applied to `messages`,
    /// ending with the assistant's turn header.
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<String> {
        self.tokenizer.apply_chat_template(messages, true)
    }

    /// A new conversation with room for `context` tokens (prompt and output).
    pub fn session(&self, context: usize) -> Result<Session<'_>> {
        let max = self.config().max_position_embeddings;
        if context == 0 || context > max {
            return Err(Error::Option(format!(
                "context must be between 1 and the model's {max} tokens, not {context}"
            )));
        }
        Ok(Session {
            model: self,
            context: Context::new(self.qwen2.new_cache(context)),
            scratch: Scratch::default(),
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
        })
    }
}

/// Loads just the decoder (config and weights) from a folder: no tokenizer.
pub fn load_qwen2(dir: &Path) -> Result<Qwen2> {
    if !dir.is_dir() {
        return Err(Error::MissingModelDir(dir.to_path_buf()));
    }
    let config = Config::from_file(&dir.join("config.json"))?;
    let store = TensorStore::open_dir(dir)?;
    Qwen2::from_store(config, &store)
}

/// What to generate and when to stop.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// At most this many new tokens (the EOS token counts).
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Stop on the model's EOS ids.
    pub stop_at_eos: bool,
    /// Stop when the text contains any of these; the text streamed stops just
    /// before it (text that might begin one is held back until it cannot).
    pub stop_strings: Vec<String>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 256,
            sampler: SamplerConfig::greedy(),
            stop_at_eos: true,
            stop_strings: Vec::new(),
        }
    }
}

/// A conversation: its [`Context`] and the buffers to run the model on it.
pub struct Session<'m> {
    model: &'m Model,
    context: Context,
    scratch: Scratch,
    /// Prompt tokens per forward pass.
    prefill_chunk: usize,
}

/// What one sequence holds between forward passes: its KV cache, the tokens
/// in it, and tokens waiting to be run.
pub struct Context {
    cache: KvCache,
    /// Tokens whose keys and values are cached, in order.
    tokens: Vec<u32>,
    /// Tokens generated but not yet run through the model (the last sampled
    /// token of a reply); they run before the next prompt.
    pending: Vec<u32>,
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

    /// Positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.cache.capacity()
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

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced one of its EOS ids.
    Eos,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The context is full.
    ContextFull,
    /// The text reached one of the stop strings.
    StopString,
}

/// Timings and counts of one `generate` call.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Tokens run through the model before the first new token.
    pub prompt_tokens: usize,
    pub prefill: Duration,
    /// Forward passes after the first new token.
    pub decode_tokens: usize,
    pub decode: Duration,
    /// New tokens produced (including an EOS).
    pub generated: usize,
    /// Cached tokens reused from earlier turns (see [`Session::generate_from`]).
    pub reused_tokens: usize,
    pub stop: Option<StopReason>,
}

impl Stats {
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill)
    }
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
/// while a multi-token character is still incomplete).
#[derive(Clone, Debug, PartialEq)]
pub struct Token {
    pub id: u32,
    pub text: String,
    pub is_eos: bool,
}

impl<'m> Session<'m> {
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Tokens in the context (cached and pending).
    pub fn len(&self) -> usize {
        self.context.tokens.len() + self.context.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The context's capacity in tokens.
    pub fn capacity(&self) -> usize {
        self.context.capacity()
    }

    /// Tokens whose keys and values are cached.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.context.tokens
    }

    /// Sets how many prompt tokens go through the model at once (at least 1;
    /// 1 means token by token). Memory for the block's activations grows with it.
    pub fn set_prefill_chunk(&mut self, tokens: usize) {
        self.prefill_chunk = tokens.max(1);
    }

    /// Forgets the conversation.
    pub fn reset(&mut self) {
        self.context.rewind(0);
    }

    /// Forgets every token after the first `len` of the context (cached or
    /// pending); their cache entries are overwritten later.
    pub fn rewind(&mut self, len: usize) {
        self.context.rewind(len);
    }

    /// Starts generating after `all`, the whole conversation so far (say, a
    /// chat template rendered again with the new user message). Only the
    /// tokens that differ from what the session holds are run: the longest
    /// common prefix is kept, the rest of the cache is discarded. The reused
    /// count is in [`Stats::reused_tokens`].
    pub fn generate_from<'s>(&'s mut self, all: &[u32], options: GenerateOptions) -> Result<Generation<'s, 'm>> {
        let held = self.context.tokens.iter().chain(&self.context.pending);
        let mut common = held.zip(all).take_while(|(a, b)| a == b).count();
        if common == all.len() {
            // Nothing new: run the last token again to get its logits.
            common = common.saturating_sub(1);
        }
        if all.len() > self.capacity() {
            return Err(Error::PromptTooLong {
                prompt: all.len(),
                context: self.capacity(),
                max: self.model.config().max_position_embeddings,
            });
        }
        self.rewind(common);
        self.generate(&all[common..], options)
    }

    /// Starts generating after `prompt`, which continues what the session
    /// already holds. Tokens stream from the returned iterator.
    pub fn generate<'s>(&'s mut self, prompt: &[u32], options: GenerateOptions) -> Result<Generation<'s, 'm>> {
        let vocab = self.model.config().vocab_size;
        if let Some(&id) = prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::TokenOutOfRange { id, vocab });
        }
        let ctx = &mut self.context;
        if ctx.pending.is_empty() && prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let total = ctx.tokens.len() + ctx.pending.len() + prompt.len();
        if total > ctx.capacity() {
            // Nothing was run: keep the session as it was.
            return Err(Error::PromptTooLong {
                prompt: total,
                context: ctx.capacity(),
                max: self.model.config().max_position_embeddings,
            });
        }
        let mut todo = std::mem::take(&mut ctx.pending);
        todo.extend_from_slice(prompt);
        let decoding = Decoding::new(self.model, options, todo, ctx.tokens.len())?;
        Ok(Generation { session: self, decoding })
    }
}

/// The generation state of one sequence, apart from the model: what is
/// still to run, the sampler and its history, the text stream and stop
/// strings, and the counts and timings. [`step`] drives several at once.
pub struct Decoding {
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
    done: bool,
}

impl Decoding {
    /// Generation of `options` after `todo` (the prompt, with any pending
    /// tokens first) on a context holding `reused` cached tokens.
    pub fn new(model: &Model, options: GenerateOptions, todo: Vec<u32>, reused: usize) -> Result<Decoding> {
        let sampler = Sampler::new(options.sampler.clone())?;
        let vocab = model.config().vocab_size;
        Ok(Decoding {
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

    /// Checks the limits before a step; ends the generation if one is reached.
    fn ready(&mut self, ctx: &mut Context) {
        if self.done {
            return;
        }
        if self.stats.generated >= self.options.max_tokens {
            self.stop(ctx, StopReason::MaxTokens);
        } else if ctx.tokens.len() + self.todo.len() > ctx.capacity() {
            self.stop(ctx, StopReason::ContextFull);
        }
    }

    /// Samples the next token from `self.logits` and updates the text, stop
    /// strings and limits.
    fn sample(&mut self, model: &Model, ctx: &mut Context) -> Result<Token> {
        self.scratch.copy_from_slice(&self.logits);
        let id = self.sampler.sample(&mut self.scratch, &self.history);
        self.history.push(id);
        self.stats.generated += 1;
        let is_eos = self.options.stop_at_eos && model.eos_token_ids().contains(&id);
        let delta = self.stream.push(&model.tokenizer, id)?;
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
            delta.push_str(&self.stream.finish(&model.tokenizer)?);
        }
        let (text, hit) = self.stop_filter(delta, end.is_some());
        match (hit, end) {
            (true, _) => self.stop(ctx, StopReason::StopString),
            (false, Some(reason)) => self.stop(ctx, reason),
            (false, None) => {}
        }
        Ok(Token { id, text, is_eos })
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
/// [`Decoding::take_token`]. Sequences that have ended are skipped.
pub fn step(
    model: &Model,
    scratch: &mut Scratch,
    chunk: usize,
    seqs: &mut [(&mut Context, &mut Decoding)],
) -> Result<()> {
    let start = Instant::now();
    // Sequences at a limit end here; the others stay live until they sample.
    for (ctx, d) in seqs.iter_mut() {
        d.ready(ctx);
    }
    // The batch buffer lives in the scratch, reused from step to step.
    let mut batch = std::mem::take(&mut scratch.batch);
    let ran = run_waiting(model, scratch, chunk.max(1), seqs, &mut batch);
    scratch.batch = batch;
    ran?;
    let elapsed = start.elapsed();
    for (ctx, d) in seqs.iter_mut() {
        if d.done {
            continue;
        }
        if d.stats.generated == 0 {
            d.stats.prompt_tokens = d.todo.len();
            d.stats.prefill = elapsed;
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
/// forward pass, leaving each one's logits after its last token.
fn run_waiting(
    model: &Model,
    scratch: &mut Scratch,
    chunk: usize,
    seqs: &mut [(&mut Context, &mut Decoding)],
    batch: &mut Vec<BatchToken>,
) -> Result<()> {
    let vocab = model.config().vocab_size;
    loop {
        batch.clear();
        for (s, (ctx, d)) in seqs.iter().enumerate().filter(|(_, (_, d))| !d.done) {
            let from = d.done_todo;
            let to = (from + chunk).min(d.todo.len());
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
        let logits = model.qwen2.forward(batch, &mut caches, scratch)?;
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
}

/// An in-progress generation of a [`Session`]: an iterator of [`Token`]s.
pub struct Generation<'s, 'm> {
    session: &'s mut Session<'m>,
    decoding: Decoding,
}

impl Generation<'_, '_> {
    /// The logits `(vocab,)` the most recent token was drawn from (after the
    /// first `next`, those at the prompt's last position).
    pub fn logits(&self) -> &[f32] {
        self.decoding.logits()
    }

    /// Counts and timings so far.
    pub fn stats(&self) -> &Stats {
        self.decoding.stats()
    }

    fn step(&mut self) -> Result<Option<Token>> {
        let s = &mut *self.session;
        step(s.model, &mut s.scratch, s.prefill_chunk, &mut [(&mut s.context, &mut self.decoding)])?;
        Ok(self.decoding.take_token())
    }
}

impl Iterator for Generation<'_, '_> {
    type Item = Result<Token>;

    fn next(&mut self) -> Option<Result<Token>> {
        match self.step() {
            Ok(Some(t)) => Some(Ok(t)),
            Ok(None) => None,
            Err(e) => {
                self.decoding.done = true;
                Some(Err(e))
            }
        }
    }
}

impl Drop for Generation<'_, '_> {
    fn drop(&mut self) {
        // A generation dropped early (the caller stopped reading) still leaves
        // its sampled-but-unrun token for the next turn.
        if !self.decoding.done {
            let d = &mut self.decoding;
            self.session.context.pending = d.todo[d.done_todo..].to_vec();
            d.done = true;
        }
    }
}
