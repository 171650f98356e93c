//! Sampling flags shared by `ember` and `ember chat`: the library's
//! [`SamplerOverrides`], which it resolves against the model's
//! `generation_config.json`.

use ember_model::SamplerOverrides;

/// Sampling settings. Unset flags take the model's `generation_config.json`
/// values (for Qwen2.5: temperature 0.7, top-k 20, top-p 0.8, repetition
/// penalty 1.1), else the neutral value.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy (argmax). Default: generation_config.json, else 1.0.
    #[arg(long)]
    pub temperature: Option<f32>,

    /// Keep only the K most likely tokens (0 = off). Default: generation_config.json, else 0.
    #[arg(long)]
    pub top_k: Option<usize>,

    /// Keep the smallest set of tokens whose probability reaches P (1 = off). Default: generation_config.json, else 1.
    #[arg(long)]
    pub top_p: Option<f32>,

    /// Drop tokens less likely than P times the most likely one (0 = off). Default: generation_config.json, else 0.
    #[arg(long)]
    pub min_p: Option<f32>,

    /// Divide positive logits of recent tokens by this (1 = off). Default when sampling: generation_config.json, else 1.
    #[arg(long)]
    pub repetition_penalty: Option<f32>,

    /// Subtract this from the logit of every token seen recently (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,

    /// Subtract this times its count from each recent token's logit (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,

    /// How many recent tokens the penalties look at.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,

    /// Random seed (default: from the clock; printed with the stats).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// These flags, one to one; the library fills in the rest from the
    /// model (`GenerateOptions::from_model_with`).
    pub fn overrides(&self) -> SamplerOverrides {
        SamplerOverrides {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: Some(self.presence_penalty),
            frequency_penalty: Some(self.frequency_penalty),
            penalty_last_n: Some(self.repeat_last_n),
            seed: self.seed,
        }
    }
}
