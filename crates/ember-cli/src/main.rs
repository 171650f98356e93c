//! `ember`: generate text with a Qwen2 model on the CPU.
//!
//! ```text
//! ember --prompt "The capital of France is" --temperature 0 --max-tokens 16
//! ember --chat --prompt "Write a haiku about Rust."
//! ember chat --system "You are terse."
//! ember bench -p 128,512 -n 64 -r 3 -t 2
//! ember quantize --quant int4 --out /tmp/q4
//! ember quantize --quant int8 --out /tmp/q8.gguf   # a GGUF file llama.cpp runs too
//! ember eval --quant int4 --corpus fixtures/eval/gpl-3.0.txt --json
//! ```
//!
//! Text streams to stdout as it is generated; timings go to stderr.

mod bench;
mod chat;
mod eval;
mod generate;
mod quantize;
mod runtime;
mod sampling;
mod serve;

#[cfg(test)]
mod fuzz;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "ember",
    version,
    about = "Run a Qwen2 language model on the CPU.",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    // `--temperature -1` is a value out of range, not an unknown flag `-1`.
    allow_negative_numbers = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    generate: generate::Args,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Chat with the model: each line you type is a turn; the conversation is kept.
    #[command(allow_negative_numbers = true)]
    Chat(chat::Args),
    /// Measure prompt processing and generation speed (like llama-bench).
    #[command(allow_negative_numbers = true)]
    Bench(bench::Args),
    /// Perplexity, KL divergence and top-1 agreement of a quantized model
    /// against its stored weights, on a text corpus (like llama-perplexity).
    #[command(allow_negative_numbers = true)]
    Eval(eval::Args),
    /// Write a quantized copy of a model folder (loads instantly).
    #[command(allow_negative_numbers = true)]
    Quantize(quantize::Args),
    /// Serve the model over HTTP with OpenAI's API (chat and text
    /// completions, streaming, tools), many users at once.
    #[command(allow_negative_numbers = true)]
    Serve(serve::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let name = match &cli.command {
        Some(Command::Bench(_)) => "bench",
        Some(Command::Chat(_)) => "chat",
        Some(Command::Eval(_)) => "eval",
        Some(Command::Quantize(_)) => "quantize",
        Some(Command::Serve(_)) => "serve",
        None => "generate",
    };
    let result = match cli.command {
        Some(Command::Bench(args)) => bench::run(args),
        Some(Command::Chat(args)) => chat::run(args),
        Some(Command::Eval(args)) => eval::run(args),
        Some(Command::Quantize(args)) => quantize::run(args),
        Some(Command::Serve(args)) => serve::run(args),
        None => generate::run(cli.generate),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}{}", message(&e), hint(&e, name));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, `: `-separated, each cause left out when the
/// message before it already says it (library errors embed their source's
/// text, so `{:#}` printed it twice).
fn message(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// What the user can do about a library error, in terms of the flags of
/// `command` (the library does not know them).
fn hint(e: &anyhow::Error, command: &str) -> &'static str {
    use ember_model::Error as E;
    match (e.chain().find_map(|c| c.downcast_ref::<E>()), command) {
        (Some(E::MissingModelDir(_)), _) => " (run `cargo xtask fetch`, or pass --model DIR)",
        (Some(E::PromptTooLong { .. }), _) => " (raise --ctx)",
        (Some(E::OutOfMemory { .. }), "bench") => " (lower -p, -n or --sequences)",
        (Some(E::OutOfMemory { .. }), "eval") => " (lower --ctx)",
        (Some(E::OutOfMemory { .. }), "serve") => " (lower --ctx, --parallel or --kv-budget)",
        (Some(E::OutOfMemory { .. }), _) => " (lower --ctx)",
        (Some(E::NonFinite { .. } | E::NonFiniteWeight { .. }), _) => {
            " (the weights are damaged or overflow: re-download or re-quantize the model)"
        }
        _ => "",
    }
}

/// The model folder or GGUF file: `--model`, else the folder `cargo xtask fetch` fills.
pub(crate) fn model_dir(arg: Option<PathBuf>) -> Result<PathBuf> {
    match arg {
        Some(dir) => Ok(dir),
        None => {
            let dir = ember_model::default_model_dir()
                .context("cannot find the default model folder: HOME is not set; pass --model DIR")?;
            if !dir.is_dir() {
                bail!("no model at {} (run `cargo xtask fetch` first, or pass --model DIR)", dir.display());
            }
            Ok(dir)
        }
    }
}

/// Starts the kernels' thread pool with `threads` (default: the library's,
/// the physical cores), for the commands that load the decoder alone.
pub(crate) fn init_threads(threads: Option<usize>) -> Result<usize> {
    Ok(ember_model::advanced::init_threads(cap_threads(threads)?)?)
}

/// `--threads` as the library takes it: at least 1, and at most the
/// hardware threads this process may run on (more only slow the kernels
/// down, and beyond a limit cannot even be started), with a warning when
/// capped.
pub(crate) fn cap_threads(threads: Option<usize>) -> Result<Option<usize>> {
    match threads {
        Some(0) => bail!("--threads must be at least 1"),
        Some(n) => {
            let hw = std::thread::available_parallelism().map_or(1, |h| h.get());
            if n > hw {
                eprintln!("warning: --threads {n} is more than the {hw} hardware threads this machine gives ember; using {hw}");
            }
            Ok(Some(n.min(hw)))
        }
        None => Ok(None),
    }
}
