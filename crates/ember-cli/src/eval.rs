//! `ember eval`: perplexity, KL divergence and top-1 agreement of a
//! (quantized) model against its unquantized weights on a text corpus, in
//! windows like llama-perplexity's (see `ember_model::eval`).

use crate::{init_threads, model_dir};
use anyhow::{bail, Context, Result};
use ember_model::advanced::{eval, load_qwen2, Qwen2};
use ember_model::{Precision, Tokenizer, WeightType};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model folder (HF layout) or GGUF file (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K tensors). Default: the folder `cargo xtask fetch` fills.
    #[arg(short, long)]
    model: Option<PathBuf>,

    /// Quantize to `int8` or `int4` at load and compare with the weights as
    /// stored (without it, the model is measured against itself).
    #[arg(long, value_parser = crate::runtime::parse_quant)]
    quant: Option<WeightType>,

    /// Arithmetic of the evaluated model's batched products: `fast` or
    /// `exact` (see `ember --help`). The reference always runs `exact`.
    #[arg(long, value_parser = crate::runtime::parse_precision, default_value = "fast")]
    precision: Precision,

    /// What to compare with: `stored` (the weights as stored, unquantized)
    /// or `exact` (the same weights, quantized the same way, at exact
    /// precision: the cost of `--precision fast` alone).
    #[arg(long, value_parser = ["stored", "exact"], default_value = "stored")]
    against: String,

    /// A UTF-8 text file; its tokens are cut into windows of --ctx.
    #[arg(long)]
    corpus: PathBuf,

    /// Tokens per window; the second half of each is scored.
    #[arg(long, default_value_t = 512)]
    ctx: usize,

    /// Run the evaluated model one token at a time, as decoding does (for
    /// quantized weights: integer kernels on int8 activations), instead of
    /// one batched prefill per window. Slower.
    #[arg(long)]
    token_by_token: bool,

    /// Worker threads (default: the number of physical CPU cores).
    #[arg(short, long)]
    threads: Option<usize>,

    /// Print `{"ppl", "kld_mean", "kld_p99", "top1", ...}` (top1 as a fraction).
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Json<'a> {
    ppl: f64,
    kld_mean: f64,
    kld_p99: f64,
    top1: f64,
    base_ppl: f64,
    quant: Option<&'a str>,
    precision: &'a str,
    against: &'a str,
    tokens: usize,
    windows: usize,
    ctx: usize,
}

pub fn run(args: Args) -> Result<()> {
    init_threads(args.threads)?;
    if args.ctx < 4 {
        bail!("invalid option: --ctx must be at least 4, not {}", args.ctx);
    }
    let dir = model_dir(args.model.clone())?;
    let text = std::fs::read_to_string(&args.corpus)
        .with_context(|| format!("reading the corpus {}", args.corpus.display()))?;
    let tokenizer = Tokenizer::from_dir(&dir).with_context(|| format!("loading the tokenizer in {}", dir.display()))?;
    let tokens = tokenizer.encode(&text)?;
    if tokens.len() < args.ctx {
        bail!("the corpus has {} tokens, fewer than one window of --ctx {}", tokens.len(), args.ctx);
    }
    let against_exact = args.against == "exact";
    let load = |quant: Option<WeightType>, precision: Precision| -> Result<Qwen2> {
        let start = Instant::now();
        let mut m = load_qwen2(&dir).with_context(|| format!("loading the model in {}", dir.display()))?;
        if let Some(q) = quant {
            m.quantize(&crate::runtime::quant_policy(q)?)?;
            eprintln!("quantized to {} in {:.1} s", q.name(), start.elapsed().as_secs_f64());
        }
        m.precision = precision;
        Ok(m)
    };
    // The reference: the stored weights, or the same weights as the
    // evaluated model; always at exact precision.
    let base = load(if against_exact { args.quant } else { None }, Precision::Exact)?;
    let positions = base.config.max_position_embeddings;
    if args.ctx > positions {
        bail!("--ctx {} is more than the model's {positions} positions; lower --ctx", args.ctx);
    }
    let variant = if args.quant.is_some() || against_exact || args.precision != Precision::Exact {
        Some(load(args.quant, args.precision)?)
    } else {
        None
    };
    let (model, base) = match &variant {
        Some(v) => (v, Some(&base)),
        None => (&base, None),
    };
    let start = Instant::now();
    let mode = if args.token_by_token { eval::Mode::TokenByToken } else { eval::Mode::Batched };
    let report = eval::evaluate_with(model, base, &tokens, args.ctx, mode, |done, total| {
        eprint!("\reval: window {done}/{total}, {:.0} s", start.elapsed().as_secs_f64());
        let _ = std::io::stderr().flush();
    })?;
    eprintln!();
    if args.json {
        let j = Json {
            ppl: report.ppl,
            kld_mean: report.kld_mean,
            kld_p99: report.kld_p99,
            top1: report.top1,
            base_ppl: report.base_ppl,
            quant: args.quant.map(|q| q.name()),
            precision: args.precision.name(),
            against: &args.against,
            tokens: report.tokens,
            windows: report.windows,
            ctx: report.ctx,
        };
        println!("{}", serde_json::to_string(&j)?);
    } else {
        let name = format!("{}, {} precision", args.quant.map_or("as stored", |q| q.name()), args.precision.name());
        let base_name = if against_exact { "same weights, exact" } else { "as stored, exact" };
        println!(
            "{} tokens scored in {} windows of {} ({} corpus tokens)",
            report.tokens,
            report.windows,
            report.ctx,
            tokens.len()
        );
        println!("PPL ({name}): {:.4}", report.ppl);
        if variant.is_some() {
            println!("PPL ({base_name}): {:.4}", report.base_ppl);
            println!(
                "KLD mean: {:.6}   KLD p99: {:.6}   top-1 agreement: {:.2}%",
                report.kld_mean,
                report.kld_p99,
                100.0 * report.top1
            );
        }
    }
    Ok(())
}
