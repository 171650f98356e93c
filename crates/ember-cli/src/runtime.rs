//! Flags shared by `ember`, `ember chat` and `ember serve`: which model, how
//! much context, how prompts are batched, how many threads. Each also reads
//! an `EMBER_*` variable (the flag wins), so an orchestrator can set them.

use crate::model_dir;
use anyhow::{bail, Context, Result};
use ember_model::advanced::{QuantPolicy, WeightRole};
use ember_model::{Model, Precision, WeightType, DEFAULT_CONTEXT, DEFAULT_PREFILL_CHUNK};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args, Debug)]
pub struct RuntimeArgs {
    /// Model folder (HF layout) or GGUF file (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K tensors). Default: the folder `cargo xtask fetch` fills.
    #[arg(short, long, env = "EMBER_MODEL")]
    pub model: Option<PathBuf>,

    /// Context size in tokens (prompt and output; for chat, the whole conversation).
    #[arg(long, default_value_t = DEFAULT_CONTEXT, env = "EMBER_CTX")]
    pub ctx: usize,

    /// Prompt tokens run through the model at once (1 = token by token).
    #[arg(long, default_value_t = DEFAULT_PREFILL_CHUNK, value_name = "N", env = "EMBER_PREFILL_CHUNK")]
    pub prefill_chunk: usize,

    /// Worker threads (default: the number of physical CPU cores).
    #[arg(short, long, env = "EMBER_THREADS")]
    pub threads: Option<usize>,

    /// Quantize the weights at load: `int8`, `int4` or `int5` (with `int4`
    /// the embedding / LM head and o get INT5, k, v and down INT8).
    #[arg(long, value_parser = parse_quant, env = "EMBER_QUANT")]
    pub quant: Option<WeightType>,

    /// Arithmetic of the batched products (prompts): `fast` (BF16 dot
    /// products where the CPU has them) or `exact` (f32-class).
    #[arg(long, value_parser = parse_precision, default_value = "fast", env = "EMBER_PRECISION")]
    pub precision: Precision,
}

/// Parses `--precision`.
pub fn parse_precision(s: &str) -> std::result::Result<Precision, String> {
    Precision::from_name(s).ok_or_else(|| {
        let names: Vec<&str> = Precision::ALL.iter().map(|p| p.name()).collect();
        format!("unknown precision `{s}` (expected {})", names.join(" or "))
    })
}

/// Parses `--quant`: a quantized weight type.
pub fn parse_quant(s: &str) -> std::result::Result<WeightType, String> {
    let names: Vec<&str> = WeightType::ALL.iter().filter(|t| t.is_quantized()).map(|t| t.name()).collect();
    WeightType::from_name(s)
        .filter(|t| t.is_quantized())
        .ok_or_else(|| format!("unknown format `{s}` (expected {})", names.join(" or ")))
}

/// Which matrix gets which type for `--quant q`: the library's measured
/// default, or, with `EMBER_QUANT_MIX` set (comma-separated `role:type`,
/// roles q, k, v, o, gate, up, down, vocab; types int8, int4, int5), those
/// matrices given those types instead and the others `q`, for measuring
/// other choices.
pub fn quant_policy(q: WeightType) -> Result<QuantPolicy> {
    let mut policy = QuantPolicy::new(q);
    if let Ok(list) = std::env::var("EMBER_QUANT_MIX") {
        policy.overrides = list
            .split(',')
            .filter(|r| !r.trim().is_empty())
            .map(|item| {
                let (role, ty) =
                    item.split_once(':').with_context(|| format!("EMBER_QUANT_MIX: `{item}` is not role:type"))?;
                let role =
                    WeightRole::from_name(role).with_context(|| format!("EMBER_QUANT_MIX: unknown matrix `{role}`"))?;
                let ty = parse_quant(ty).map_err(|e| anyhow::anyhow!("EMBER_QUANT_MIX: {e}"))?;
                Ok((role, ty))
            })
            .collect::<Result<_>>()?;
    }
    Ok(policy)
}

/// `EMBER_HUGE_PAGES=0` or `1` if set, else the command's `default`.
pub fn huge_pages_or(default: bool) -> bool {
    match std::env::var("EMBER_HUGE_PAGES").as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => default,
    }
}

impl RuntimeArgs {
    /// Loads the model with the library's builder, these flags its settings
    /// (`--ctx` is capped at the model's maximum there); returns it and its
    /// folder. `huge_pages`: whether this command copies the weights into
    /// huge pages ([`ember_model::ModelBuilder::huge_pages`]: worth it for a
    /// model that runs a while), unless `EMBER_HUGE_PAGES` is `0` or `1`.
    pub fn load(&self, huge_pages: bool) -> Result<(Arc<Model>, PathBuf)> {
        if self.prefill_chunk == 0 {
            bail!("--prefill-chunk must be at least 1");
        }

        if self.ctx == 0 {
            bail!("--ctx must be at least 1");
        }
        let dir = model_dir(self.model.clone())?;
        let mut builder =
            Model::builder(&dir).context(self.ctx).prefill_chunk(self.prefill_chunk).precision(self.precision);
        if let Some(t) = crate::cap_threads(self.threads)? {
            builder = builder.threads(t);
        }
        if let Some(q) = self.quant {
            builder = builder.quantize(quant_policy(q)?);
        }
        builder = builder.huge_pages(huge_pages_or(huge_pages));
        let model = builder.load().with_context(|| format!("loading the model in {}", dir.display()))?;
        Ok((model, dir))
    }
}
