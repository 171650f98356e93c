//! The default command: generate text from a prompt.

use crate::runtime::RuntimeArgs;
use crate::sampling::SamplingArgs;
use anyhow::{Context, Result};
use ember_model::{GenerateOptions, Message, StopReason};
use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The prompt: raw text, or the user's message with --chat.
    #[arg(short, long, required = true)]
    prompt: Option<String>,

    /// Wrap the prompt in the model's chat template (as a user message).
    #[arg(long)]
    chat: bool,

    /// System message for --chat (default: the template's own default).
    #[arg(long, requires = "chat")]
    system: Option<String>,

    /// Maximum new tokens.
    #[arg(short = 'n', long, default_value_t = 256)]
    max_tokens: usize,

    #[command(flatten)]
    sampling: SamplingArgs,

    #[command(flatten)]
    runtime: RuntimeArgs,

    /// Stop when the output contains this text (repeatable); the text is cut
    /// just before it.
    #[arg(long, value_name = "TEXT")]
    stop: Vec<String>,

    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,

    /// With --json, also report the N highest logits at the prompt's last position.
    #[arg(long, value_name = "N", requires = "json")]
    top_logits: Option<usize>,
}

#[derive(serde::Serialize)]
struct JsonOut {
    prompt_ids: Vec<u32>,
    ids: Vec<u32>,
    text: String,
    prefill_tok_s: f64,
    decode_tok_s: f64,
    /// Time to first token: the prompt's forward passes and the first draw.
    ttft_ms: f64,
    stop: &'static str,
    seed: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_logits: Option<TopLogits>,
}

#[derive(serde::Serialize)]
struct TopLogits {
    ids: Vec<u32>,
    logits: Vec<f32>,
}

fn top_n(logits: &[f32], n: usize) -> TopLogits {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    idx.truncate(n);
    TopLogits { logits: idx.iter().map(|&i| logits[i as usize]).collect(), ids: idx }
}

/// The logits `(vocab,)` after the prompt's last token, by one forward pass
/// of the whole prompt.
fn prompt_logits(model: &ember_model::Model, ids: &[u32]) -> Result<Vec<f32>> {
    let decoder = model.decoder();
    let mut state = decoder.new_state(ids.len());
    let logits = state.run(decoder, ids, true)?.context("the prompt is empty")?.to_vec();
    if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
        return Err(ember_model::Error::NonFinite { position: ids.len() - 1, token: i, value: logits[i] }.into());
    }
    Ok(logits)
}

pub fn run(args: Args) -> Result<()> {
    let user_prompt = args.prompt.clone().context("--prompt is required")?;
    let (model, _) = args.runtime.load(false)?;

    let prompt = if args.chat {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(Message::system(s.clone()));
        }
        messages.push(Message::user(user_prompt));
        model.chat_prompt(&messages)?
    } else {
        user_prompt
    };
    let prompt_ids = model.encode(&prompt)?;
    let options = GenerateOptions {
        max_tokens: args.max_tokens,
        stop_strings: args.stop.clone(),
        ..GenerateOptions::from_model_with(&model, &args.sampling.overrides())
    };
    let seed = options.sampler.seed;
    let mut session = model.session();
    let mut generation = session.generate(&prompt_ids, options)?;

    let mut ids = Vec::new();
    let mut text = String::new();
    let mut top_logits = None;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    while let Some(token) = generation.next() {
        let token = token?;
        if ids.is_empty() {
            top_logits = args.top_logits.map(|n| top_n(generation.logits(), n));
        }
        ids.push(token.id);
        if args.json {
            text.push_str(&token.text);
        } else {
            out.write_all(token.text.as_bytes())?;
            out.flush()?;
        }
    }
    let stats = generation.stats().clone();
    drop(generation);
    if let (None, Some(n)) = (&top_logits, args.top_logits) {
        // Nothing was sampled (--max-tokens 0): the prompt's last position
        // still has its logits; run the prompt for them.
        top_logits = Some(top_n(&prompt_logits(&model, &prompt_ids)?, n));
    }
    let stop = stats.stop.map_or("none", StopReason::name);
    if args.json {
        let json = JsonOut {
            prompt_ids,
            ids,
            text,
            prefill_tok_s: stats.prefill_tok_s(),
            decode_tok_s: stats.decode_tok_s(),
            ttft_ms: stats.prefill.as_secs_f64() * 1e3,
            stop,
            seed,
            top_logits,
        };
        serde_json::to_writer(&mut out, &json)?;
        writeln!(out)?;
    } else {
        writeln!(out)?;
        if stats.stop == Some(StopReason::ContextFull) {
            eprintln!("note: stopped because the context of {} tokens is full (raise --ctx)", session.capacity());
        }
        eprintln!(
            "prefill: {} tokens, {:.1} tok/s, first token after {:.0} ms | decode: {} tokens, {:.1} tok/s | {} threads, seed {seed}, stop: {stop}",
            stats.prompt_tokens,
            stats.prefill_tok_s(),
            stats.prefill.as_secs_f64() * 1e3,
            stats.decode_tokens,
            stats.decode_tok_s(),
            model.threads(),
        );
    }
    Ok(())
}
