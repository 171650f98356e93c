//! What a generation is asked for: [`GenerateOptions`] (limits, sampler,
//! stop strings, log-probabilities, cancellation), the model's defaults for
//! them, and [`CancelToken`].

use crate::config::GenerationConfig;
use crate::model::Model;
use ember_sample::SamplerConfig;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What to generate and when to stop.
///
/// [`GenerateOptions::default`] is greedy decoding of up to 256 tokens
/// (reproducible, and what parity with transformers' `do_sample=False` is
/// checked with); [`GenerateOptions::from_model`] samples as the model's
/// `generation_config.json` says. The chainable setters change one field:
///
/// ```
/// use ember_model::GenerateOptions;
///
/// let options = GenerateOptions::default().max_tokens(32).stop("\n\n").logprobs(3).seed(7);
/// assert_eq!((options.max_tokens, options.top_logprobs), (32, 3));
/// ```
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// At most this many new tokens (the EOS token counts).
    pub max_tokens: usize,
    /// The sampling chain's settings (greedy when `temperature == 0`).
    pub sampler: SamplerConfig,
    /// Stop on the model's EOS ids ([`Model::eos_token_ids`]).
    pub stop_at_eos: bool,
    /// Stop when the text contains any of these; the text streamed stops just
    /// before it (text that might begin one is held back until it cannot).
    pub stop_strings: Vec<String>,
    /// Give each [`Token`](crate::Token) its log-probability under the
    /// model ([`Token::logprob`](crate::Token::logprob)).
    pub logprobs: bool,
    /// Give each token this many most likely alternatives with their
    /// log-probabilities ([`Token::top_logprobs`](crate::Token::top_logprobs)); 0 = none.
    pub top_logprobs: usize,
    /// A token to stop the generation from elsewhere (another thread, a
    /// signal handler); `None`: the generation makes its own, reachable with
    /// [`Generation::cancel_token`](crate::Generation::cancel_token).
    pub cancel: Option<CancelToken>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 256,
            sampler: SamplerConfig::greedy(),
            stop_at_eos: true,
            stop_strings: Vec::new(),
            logprobs: false,
            top_logprobs: 0,
            cancel: None,
        }
    }
}

impl GenerateOptions {
    /// The model's own sampling defaults, from its `generation_config.json`
    /// (for Qwen2.5: temperature 0.7, top-k 20, top-p 0.8, repetition
    /// penalty 1.1), with a seed from the clock; everything else as
    /// [`GenerateOptions::default`]. See [`GenerationConfig::sampler_config`]
    /// for the mapping.
    pub fn from_model(model: &Model) -> GenerateOptions {
        GenerateOptions::from_model_with(model, &SamplerOverrides::default())
    }

    /// [`GenerateOptions::from_model`] with the settings of `overrides`
    /// taking precedence over the model's.
    pub fn from_model_with(model: &Model, overrides: &SamplerOverrides) -> GenerateOptions {
        GenerateOptions { sampler: model.generation_config().sampler_config(overrides), ..GenerateOptions::default() }
    }

    /// Sets [`GenerateOptions::max_tokens`].
    pub fn max_tokens(mut self, n: usize) -> Self {
        self.max_tokens = n;
        self
    }

    /// Sets [`GenerateOptions::sampler`].
    pub fn sampler(mut self, sampler: SamplerConfig) -> Self {
        self.sampler = sampler;
        self
    }

    /// Sets the sampler's seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.sampler.seed = seed;
        self
    }

    /// Sets [`GenerateOptions::stop_at_eos`].
    pub fn stop_at_eos(mut self, stop: bool) -> Self {
        self.stop_at_eos = stop;
        self
    }

    /// Adds a stop string.
    pub fn stop(mut self, text: impl Into<String>) -> Self {
        self.stop_strings.push(text.into());
        self
    }

    /// Asks for log-probabilities: each token's own, and its `top` most
    /// likely alternatives (0 for none).
    pub fn logprobs(mut self, top: usize) -> Self {
        self.logprobs = true;
        self.top_logprobs = top;
        self
    }

    /// Sets [`GenerateOptions::cancel`].
    pub fn cancel(mut self, token: CancelToken) -> Self {
        self.cancel = Some(token);
        self
    }
}

/// Sampler settings a caller chose; the ones left `None` come from the
/// model's `generation_config.json` ([`GenerationConfig::sampler_config`]).
/// A command line or a server request maps onto this one to one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplerOverrides {
    /// Softmax temperature; 0 is greedy.
    pub temperature: Option<f32>,
    /// Keep only the K most likely tokens (0 = off).
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches P (1 = off).
    pub top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one (0 = off).
    pub min_p: Option<f32>,
    /// Divide positive (multiply negative) logits of recent tokens by this (1 = off).
    pub repetition_penalty: Option<f32>,
    /// Subtract this from the logit of every recent token (0 = off).
    pub presence_penalty: Option<f32>,
    /// Subtract this times its count from each recent token's logit (0 = off).
    pub frequency_penalty: Option<f32>,
    /// How many recent tokens the penalties look at.
    pub penalty_last_n: Option<usize>,
    /// The random seed (default: from the clock).
    pub seed: Option<u64>,
}

impl GenerationConfig {
    /// The sampler settings: `overrides` over this file's values, over
    /// [`SamplerConfig::default`]'s neutral ones.
    ///
    /// - Top-k, top-p, min-p and the temperature come from the file only when
    ///   it samples at all (`do_sample` is absent or true); with
    ///   `do_sample: false` the default is greedy.
    /// - A temperature of 0 is plain greedy decoding, as transformers'
    ///   `do_sample=False`: the file's repetition penalty then applies only
    ///   if given in `overrides`.
    /// - Presence and frequency penalties are never in the file (0 unless
    ///   given); the penalty window is 64 tokens unless given; the seed comes
    ///   from the clock unless given.
    pub fn sampler_config(&self, overrides: &SamplerOverrides) -> SamplerConfig {
        let g = self;
        let o = overrides;
        // generation_config.json's values apply only when it samples at all.
        let sampling = g.do_sample.unwrap_or(true);
        let mut c = SamplerConfig::default();
        if sampling {
            c.temperature = g.temperature.unwrap_or(c.temperature);
            c.top_k = g.top_k.unwrap_or(c.top_k);
            c.top_p = g.top_p.unwrap_or(c.top_p);
            c.min_p = g.min_p.unwrap_or(c.min_p);
        } else {
            c.temperature = 0.0;
        }
        c.repetition_penalty = g.repetition_penalty.unwrap_or(c.repetition_penalty);
        c.temperature = o.temperature.unwrap_or(c.temperature);
        c.top_k = o.top_k.unwrap_or(c.top_k);
        c.top_p = o.top_p.unwrap_or(c.top_p);
        c.min_p = o.min_p.unwrap_or(c.min_p);
        // A temperature of 0 is plain greedy decoding, as transformers'
        // `do_sample=False` reference: the model's default penalty applies
        // only when sampling, or when asked for explicitly.
        if c.temperature == 0.0 {
            c.repetition_penalty = 1.0;
        }
        c.repetition_penalty = o.repetition_penalty.unwrap_or(c.repetition_penalty);
        c.presence_penalty = o.presence_penalty.unwrap_or(c.presence_penalty);
        c.frequency_penalty = o.frequency_penalty.unwrap_or(c.frequency_penalty);
        c.penalty_last_n = o.penalty_last_n.unwrap_or(c.penalty_last_n);
        c.seed = o.seed.unwrap_or_else(seed_from_clock);
        c
    }
}

fn seed_from_clock() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Stops a generation from elsewhere: cloneable, `Send` and `Sync`, cheap to
/// check.
///
/// A generation checks its token before every forward pass: between the
/// chunks of a long prompt and between decoded tokens. Once cancelled, the
/// next check ends it with [`StopReason::Cancelled`](crate::StopReason::Cancelled);
/// what already ran stays in the session's cache and the rest of the prompt
/// waits there (it runs first in the next generation), so the conversation
/// stays consistent. A token stays cancelled until [`CancelToken::reset`].
///
/// ```
/// use ember_model::CancelToken;
///
/// let token = CancelToken::new();
/// let handle = token.clone(); // say, moved into a Ctrl-C handler
/// handle.cancel();
/// assert!(token.is_cancelled());
/// token.reset();
/// assert!(!handle.is_cancelled());
/// ```
#[derive(Clone, Default)]
pub struct CancelToken {
    flag: Arc<AtomicBool>,
    /// Asked at every check too (an abort callback, as llama.cpp has).
    check: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
}

impl CancelToken {
    /// A token not cancelled.
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    /// A token that is also cancelled whenever `check` returns true. `check`
    /// is called at every check point (once per forward pass of the
    /// generation), so it should be quick: a deadline, a closed connection.
    pub fn from_fn(check: impl Fn() -> bool + Send + Sync + 'static) -> CancelToken {
        CancelToken { flag: Arc::default(), check: Some(Arc::new(check)) }
    }

    /// Cancels every generation watching this token (or a clone of it).
    pub fn cancel(&self) {
        self.flag.store(true, Ordering::Release);
    }

    /// Whether the token is cancelled (or its function says so).
    pub fn is_cancelled(&self) -> bool {
        self.flag.load(Ordering::Acquire) || self.check.as_ref().is_some_and(|f| f())
    }

    /// Clears [`CancelToken::cancel`], so the token can serve the next
    /// generation (say, the next turn of a chat).
    pub fn reset(&self) {
        self.flag.store(false, Ordering::Release);
    }
}

impl fmt::Debug for CancelToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CancelToken")
            .field("cancelled", &self.flag.load(Ordering::Acquire))
            .field("has_fn", &self.check.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen() -> GenerationConfig {
        serde_json::from_str(
            r#"{"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}"#,
        )
        .unwrap()
    }

    #[test]
    fn the_file_gives_the_defaults_and_overrides_win() {
        let c = qwen().sampler_config(&SamplerOverrides { seed: Some(1), ..Default::default() });
        let want = SamplerConfig {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.8,
            repetition_penalty: 1.1,
            seed: 1,
            ..Default::default()
        };
        assert_eq!(c, want);
        let o =
            SamplerOverrides { top_k: Some(5), min_p: Some(0.1), presence_penalty: Some(0.5), ..Default::default() };
        let c = qwen().sampler_config(&o);
        assert_eq!((c.top_k, c.min_p, c.presence_penalty, c.top_p), (5, 0.1, 0.5, 0.8));
    }

    #[test]
    fn greedy_drops_the_files_penalty_unless_asked() {
        let greedy = SamplerOverrides { temperature: Some(0.0), ..Default::default() };
        assert_eq!(qwen().sampler_config(&greedy).repetition_penalty, 1.0);
        let asked = SamplerOverrides { repetition_penalty: Some(1.3), ..greedy };
        assert_eq!(qwen().sampler_config(&asked).repetition_penalty, 1.3);
        let no_sample = GenerationConfig { do_sample: Some(false), ..qwen() };
        let c = no_sample.sampler_config(&SamplerOverrides::default());
        assert_eq!((c.temperature, c.top_k, c.repetition_penalty), (0.0, 0, 1.0));
        let empty =
            GenerationConfig::default().sampler_config(&SamplerOverrides { seed: Some(3), ..Default::default() });
        assert_eq!(empty, SamplerConfig { seed: 3, ..Default::default() });
    }
}
