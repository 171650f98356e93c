//! Sampling flags shared by `ember` and `ember chat`, resolved against the
//! model's `generation_config.json`.

use ember_model::{Model, SamplerConfig};

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
    /// The sampler settings: these flags over the model's defaults.
    pub fn config(&self, model: &Model) -> SamplerConfig {
        let g = &model.generation_config;
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
        c.temperature = self.temperature.unwrap_or(c.temperature);
        c.top_k = self.top_k.unwrap_or(c.top_k);
        c.top_p = self.top_p.unwrap_or(c.top_p);
        c.min_p = self.min_p.unwrap_or(c.min_p);
        // `--temperature 0` is plain greedy decoding, as transformers'
        // `do_sample=False` reference: the model's default penalty applies only
        // when sampling, or when asked for explicitly.
        if c.temperature == 0.0 {
            c.repetition_penalty = 1.0;
        }
        c.repetition_penalty = self.repetition_penalty.unwrap_or(c.repetition_penalty);
        c.presence_penalty = self.presence_penalty;
        c.frequency_penalty = self.frequency_penalty;
        c.penalty_last_n = self.repeat_last_n;
        c.seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
        });
        c
    }
}
