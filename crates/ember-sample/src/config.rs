//! Sampler settings and their validation.

use std::fmt;

/// Sampling settings.
///
/// Defaults (see [`Default`]): temperature 1.0, top_k 0 (off), top_p 1.0
/// (off), min_p 0.0 (off), repetition_penalty 1.0 (off), presence_penalty
/// 0.0, frequency_penalty 0.0, penalty_last_n 64, seed 0.
///
/// The order in which the settings are applied is described in the crate
/// docs.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// Softmax temperature. `0.0` means greedy (argmax). Must be finite, `>= 0`.
    pub temperature: f32,
    /// Keep only the `top_k` highest logits. `0` = off.
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose
    /// probability mass reaches `top_p`. In `(0, 1]`; `1.0` = off.
    pub top_p: f32,
    /// Keep tokens whose probability is at least `min_p` times the most
    /// likely token's probability. In `[0, 1]`; `0.0` = off.
    pub min_p: f32,
    /// Repetition penalty (HF / llama.cpp / CTRL style): a positive logit of a
    /// recently seen token is divided by it, a negative one multiplied.
    /// Finite, `> 0`; `1.0` = off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every distinct recently seen token
    /// (OpenAI style). Finite, may be negative; `0.0` = off.
    pub presence_penalty: f32,
    /// Subtracted `count` times from the logit of a token seen `count` times
    /// recently (OpenAI style). Finite, may be negative; `0.0` = off.
    pub frequency_penalty: f32,
    /// How many of the most recent history ids the penalties look at.
    /// `0` disables the penalties; `usize::MAX` means the whole history.
    pub penalty_last_n: usize,
    /// Seed of the sampler's [`Rng`](crate::Rng).
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Greedy decoding: the defaults with `temperature = 0`.
    pub fn greedy() -> Self {
        SamplerConfig { temperature: 0.0, ..Default::default() }
    }

    /// True when the sampler takes the argmax instead of drawing
    /// (`temperature <= 0`; validation only lets `0` through).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// True when any penalty would change a logit.
    pub fn has_penalties(&self) -> bool {
        self.penalty_last_n > 0
            && (self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0)
    }

    /// Checks every field's range; the error names the first bad field.
    /// NaN is rejected everywhere.
    pub fn validate(&self) -> Result<(), SamplerError> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(SamplerError::Temperature(t));
        }
        // Written so that NaN fails: comparisons with NaN are false.
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplerError::TopP(self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(SamplerError::MinP(self.min_p));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(SamplerError::RepetitionPenalty(r));
        }
        if !self.presence_penalty.is_finite() {
            return Err(SamplerError::PresencePenalty(self.presence_penalty));
        }
        if !self.frequency_penalty.is_finite() {
            return Err(SamplerError::FrequencyPenalty(self.frequency_penalty));
        }
        Ok(())
    }
}

/// An invalid [`SamplerConfig`] field, carrying the rejected value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SamplerError {
    /// `temperature` must be finite and `>= 0`.
    Temperature(f32),
    /// `top_p` must be in `(0, 1]`.
    TopP(f32),
    /// `min_p` must be in `[0, 1]`.
    MinP(f32),
    /// `repetition_penalty` must be finite and `> 0`.
    RepetitionPenalty(f32),
    /// `presence_penalty` must be finite.
    PresencePenalty(f32),
    /// `frequency_penalty` must be finite.
    FrequencyPenalty(f32),
}

impl SamplerError {
    /// Name of the offending [`SamplerConfig`] field, e.g. `"top_p"`.
    pub fn field(&self) -> &'static str {
        match self {
            SamplerError::Temperature(_) => "temperature",
            SamplerError::TopP(_) => "top_p",
            SamplerError::MinP(_) => "min_p",
            SamplerError::RepetitionPenalty(_) => "repetition_penalty",
            SamplerError::PresencePenalty(_) => "presence_penalty",
            SamplerError::FrequencyPenalty(_) => "frequency_penalty",
        }
    }

    /// The rejected value.
    pub fn value(&self) -> f32 {
        match *self {
            SamplerError::Temperature(v)
            | SamplerError::TopP(v)
            | SamplerError::MinP(v)
            | SamplerError::RepetitionPenalty(v)
            | SamplerError::PresencePenalty(v)
            | SamplerError::FrequencyPenalty(v) => v,
        }
    }

    /// Human-readable allowed range.
    fn expected(&self) -> &'static str {
        match self {
            SamplerError::Temperature(_) => "a finite value >= 0 (0 = greedy)",
            SamplerError::TopP(_) => "a value in (0, 1] (1 = off)",
            SamplerError::MinP(_) => "a value in [0, 1] (0 = off)",
            SamplerError::RepetitionPenalty(_) => "a finite value > 0 (1 = off)",
            SamplerError::PresencePenalty(_) | SamplerError::FrequencyPenalty(_) => "a finite value (0 = off)",
        }
    }
}

impl fmt::Display for SamplerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid sampler setting `{}` = {}: expected {}", self.field(), self.value(), self.expected())
    }
}

impl std::error::Error for SamplerError {}
