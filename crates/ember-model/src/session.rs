//! One conversation ([`Session`]) and its token stream ([`Generation`]).

use crate::error::{Error, Result};
use crate::generate::{step, Context, Decoding, Stats, Token};
use crate::model::Model;
use crate::options::{CancelToken, GenerateOptions};
use crate::qwen2::{BatchToken, Scratch};
use std::fmt;
use std::sync::Arc;

/// A conversation: the model it runs on (shared, an `Arc<Model>`), its KV
/// cache and tokens, and the buffers of its forward passes.
///
/// A session owns everything it needs (`'static`, `Send`, `Sync`): it can be
/// stored in a struct beside its model, returned from a function, or moved to
/// another thread. Each [`Session::generate`] continues after what the
/// session holds; [`Session::generate_from`] takes the whole conversation
/// and runs only what changed. Cloning ([`Session::fork`]) copies the cached
/// positions, so two continuations can share a prefix without running it
/// twice.
///
/// ```
/// # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chat");
/// use ember_model::{GenerateOptions, Model};
///
/// let model = Model::load(dir)?;
/// let mut session = model.session();
/// let ids = model.encode("the sky is")?;
/// let reply = session.generate(&ids, GenerateOptions::default().max_tokens(4))?.collect_text()?;
/// assert_eq!(session.len(), ids.len() + 4); // the prompt and the reply (its last token pending)
/// # let _ = reply;
/// # Ok::<(), ember_model::Error>(())
/// ```
pub struct Session {
    model: Arc<Model>,
    context: Context,
    scratch: Scratch,
    /// Prompt tokens per forward pass.
    prefill_chunk: usize,
}

impl Session {
    pub(crate) fn with_context(model: Arc<Model>, context: Context) -> Session {
        let prefill_chunk = model.prefill_chunk();
        Session { model, context, scratch: Scratch::default(), prefill_chunk }
    }

    /// The model this session runs on.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Tokens in the context (cached and pending).
    pub fn len(&self) -> usize {
        self.context.tokens.len() + self.context.pending.len()
    }

    /// Whether the context holds no token.
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

    /// Tokens waiting to run first in the next generation: the last sampled
    /// token of a reply, or the rest of a cancelled prompt.
    pub fn pending_tokens(&self) -> &[u32] {
        &self.context.pending
    }

    /// Prompt tokens per forward pass.
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
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

    /// A new session holding a copy of this one's context (the cached
    /// positions are copied, not re-run): continuations of a shared prefix,
    /// such as one system prompt for many conversations, or several samples
    /// of one reply. The two are independent afterwards.
    ///
    /// ```
    /// # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chat");
    /// use ember_model::{GenerateOptions, Model};
    ///
    /// let model = Model::load(dir)?;
    /// let mut base = model.session();
    /// base.prefill(&model.encode("you are a helpful model .")?)?;
    /// let mut a = base.fork();
    /// let mut b = base.fork();
    /// let greedy = GenerateOptions::default().max_tokens(3);
    /// let x = a.generate(&model.encode("the sea is")?, greedy.clone())?.collect_text()?;
    /// let y = b.generate(&model.encode("the sea is")?, greedy)?.collect_text()?;
    /// assert_eq!(x, y); // same prefix, same prompt, greedy: same text
    /// # Ok::<(), ember_model::Error>(())
    /// ```
    pub fn fork(&self) -> Session {
        Session {
            model: Arc::clone(&self.model),
            context: self.context.clone(),
            scratch: Scratch::default(),
            prefill_chunk: self.prefill_chunk,
        }
    }

    /// Runs `tokens` (after any pending ones) into the cache without
    /// generating: a prefix to [`fork`](Session::fork) from, or a system
    /// prompt prepared ahead of the first question.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.check_prompt(tokens)?;
        let todo: Vec<u32> = self.context.pending.drain(..).chain(tokens.iter().copied()).collect();
        let mut batch = std::mem::take(&mut self.scratch.batch);
        let mut ran = Ok(());
        for block in todo.chunks(self.prefill_chunk) {
            let pos0 = self.context.tokens.len();
            batch.clear();
            batch.extend(block.iter().enumerate().map(|(i, &token)| BatchToken {
                token,
                seq: 0,
                pos: pos0 + i,
                logits: false,
            }));
            ran = self.model.decoder().forward(&batch, &mut [&mut self.context.cache], &mut self.scratch).map(|_| ());
            if ran.is_err() {
                break;
            }
            self.context.tokens.extend_from_slice(block);
        }
        self.scratch.batch = batch;
        ran
    }

    /// Starts generating after `all`, the whole conversation so far (say, a
    /// chat template rendered again with the new user message). Only the
    /// tokens that differ from what the session holds are run: the longest
    /// common prefix is kept, the rest of the cache is discarded. The reused
    /// count is in [`Stats::reused_tokens`].
    pub fn generate_from(&mut self, all: &[u32], options: GenerateOptions) -> Result<Generation<'_>> {
        let common = self.keep_common_prefix(all)?;
        self.generate(&all[common..], options)
    }

    /// Starts generating after `prompt`, which continues what the session
    /// already holds. Tokens stream from the returned iterator, which
    /// borrows the session; see [`Session::into_generation`] for one that
    /// owns it.
    pub fn generate(&mut self, prompt: &[u32], options: GenerateOptions) -> Result<Generation<'_>> {
        let decoding = self.start(prompt, options)?;
        Ok(Generation { seat: Seat::Borrowed(self), decoding })
    }

    /// [`Session::generate`] by value: the token stream owns the session
    /// (`Generation<'static>`), so it can be returned from a function or
    /// sent to another thread; [`Generation::into_session`] gives the
    /// session back to continue the conversation. On error the session is
    /// dropped with it.
    pub fn into_generation(mut self, prompt: &[u32], options: GenerateOptions) -> Result<Generation<'static>> {
        let decoding = self.start(prompt, options)?;
        Ok(Generation { seat: Seat::Owned(Box::new(self)), decoding })
    }

    /// [`Session::generate_from`] by value (see [`Session::into_generation`]).
    pub fn into_generation_from(mut self, all: &[u32], options: GenerateOptions) -> Result<Generation<'static>> {
        let common = self.keep_common_prefix(all)?;
        self.into_generation(&all[common..], options)
    }

    /// Rewinds to the longest common prefix of the context and `all` and
    /// returns its length (at most `all.len() - 1`, so there is a token to
    /// run for the next logits).
    fn keep_common_prefix(&mut self, all: &[u32]) -> Result<usize> {
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
        Ok(common)
    }

    /// Checks that `prompt`'s ids exist and that it fits after what the
    /// context holds; nothing changes on error.
    fn check_prompt(&self, prompt: &[u32]) -> Result<()> {
        let vocab = self.model.config().vocab_size;
        if let Some(&id) = prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::TokenOutOfRange { id, vocab });
        }
        let total = self.len() + prompt.len();
        if total > self.capacity() {
            return Err(Error::PromptTooLong {
                prompt: total,
                context: self.capacity(),
                max: self.model.config().max_position_embeddings,
            });
        }
        Ok(())
    }

    /// The decoding of a generation after `prompt`; the pending tokens move
    /// into it. Nothing changes on error.
    fn start(&mut self, prompt: &[u32], options: GenerateOptions) -> Result<Decoding> {
        self.check_prompt(prompt)?;
        if self.context.pending.is_empty() && prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let mut todo = self.context.pending.clone();
        todo.extend_from_slice(prompt);
        let decoding = Decoding::new(&self.model, options, todo, self.context.tokens.len())?;
        self.context.pending.clear();
        Ok(decoding)
    }
}

impl Clone for Session {
    /// [`Session::fork`].
    fn clone(&self) -> Session {
        self.fork()
    }
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("model", &self.model.dir())
            .field("context", &self.context)
            .field("prefill_chunk", &self.prefill_chunk)
            .finish_non_exhaustive()
    }
}

/// Where a [`Generation`]'s session lives.
enum Seat<'s> {
    Borrowed(&'s mut Session),
    Owned(Box<Session>),
    /// Given back by [`Generation::into_session`].
    Taken,
}

/// A generation in progress: an iterator of [`Token`]s, each produced by
/// one forward pass (the first by the prompt's passes).
///
/// Borrowed from a session ([`Session::generate`], `Generation<'_>`) or
/// owning it ([`Session::into_generation`], `Generation<'static>`). Dropping
/// it early is fine: the session keeps the conversation so far, and the last
/// sampled token waits to run with the next prompt.
///
/// Printing as tokens arrive: the text of each token is a UTF-8-safe delta;
/// flush after writing it, or a line-buffered stdout shows nothing until the
/// end of the line.
///
/// ```
/// # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chat");
/// use ember_model::{GenerateOptions, Model, StopReason};
/// use std::io::Write;
///
/// let model = Model::load(dir)?;
/// let mut session = model.session();
/// let mut generation = session.generate(&model.encode("hello")?, GenerateOptions::default().max_tokens(8))?;
/// let mut out = std::io::stdout();
/// for token in &mut generation {
///     out.write_all(token?.text.as_bytes())?;
///     out.flush()?;
/// }
/// let stats = generation.stats();
/// assert!(stats.generated <= 8);
/// assert!(matches!(stats.stop, Some(StopReason::MaxTokens | StopReason::Eos)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Generation<'s> {
    seat: Seat<'s>,
    decoding: Decoding,
}

impl Generation<'_> {
    /// The logits `(vocab,)` the most recent token was drawn from (after the
    /// first `next`, those at the prompt's last position), before penalties
    /// and temperature.
    pub fn logits(&self) -> &[f32] {
        self.decoding.logits()
    }

    /// Counts and timings so far.
    pub fn stats(&self) -> &Stats {
        self.decoding.stats()
    }

    /// Whether the generation has ended (see [`Stats::stop`]).
    pub fn is_done(&self) -> bool {
        self.decoding.is_done()
    }

    /// A handle that stops this generation from elsewhere: the token of
    /// [`GenerateOptions::cancel`], or one made for this generation.
    pub fn cancel_token(&self) -> CancelToken {
        self.decoding.cancel_token().clone()
    }

    /// The session being generated in.
    pub fn session(&self) -> &Session {
        match &self.seat {
            Seat::Borrowed(s) => s,
            Seat::Owned(s) => s,
            Seat::Taken => unreachable!("a generation's session is only taken by into_session"),
        }
    }

    /// Ends the generation (a stop as if dropped) and gives back its session
    /// if it owns one ([`Session::into_generation`]); `None` if it borrows it.
    pub fn into_session(mut self) -> Option<Session> {
        self.end_early();
        match std::mem::replace(&mut self.seat, Seat::Taken) {
            Seat::Owned(s) => Some(*s),
            _ => None,
        }
    }

    /// Runs the generation to its end and returns its text.
    pub fn collect_text(self) -> Result<String> {
        let mut g = self;
        let mut text = String::new();
        for t in &mut g {
            text.push_str(&t?.text);
        }
        Ok(text)
    }

    fn step(&mut self) -> Result<Option<Token>> {
        let s: &mut Session = match &mut self.seat {
            Seat::Borrowed(s) => s,
            Seat::Owned(s) => s,
            Seat::Taken => return Ok(None),
        };
        step(&s.model, &mut s.scratch, s.prefill_chunk, &mut [(&mut s.context, &mut self.decoding)])?;
        Ok(self.decoding.take_token())
    }

    /// A generation stopped before its end (the caller stopped reading)
    /// still leaves its sampled-but-unrun token for the next turn.
    fn end_early(&mut self) {
        let d = &mut self.decoding;
        if d.is_done() {
            return;
        }
        let s: &mut Session = match &mut self.seat {
            Seat::Borrowed(s) => s,
            Seat::Owned(s) => s,
            Seat::Taken => return,
        };
        d.abandon(&mut s.context);
    }
}

impl Iterator for Generation<'_> {
    type Item = Result<Token>;

    fn next(&mut self) -> Option<Result<Token>> {
        match self.step() {
            Ok(Some(t)) => Some(Ok(t)),
            Ok(None) => None,
            Err(e) => {
                self.decoding.fail();
                Some(Err(e))
            }
        }
    }
}

impl Drop for Generation<'_> {
    fn drop(&mut self) {
        self.end_early();
    }
}

impl fmt::Debug for Generation<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Generation")
            .field("owns_session", &matches!(self.seat, Seat::Owned(_)))
            .field("decoding", &self.decoding)
            .finish()
    }
}
