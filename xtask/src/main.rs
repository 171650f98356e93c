//! ember's task runner (`cargo xtask <task>`): the build system glue that is
//! not Rust compilation. See `cargo xtask help`.

mod convert;
mod e2e;
mod fetch;
mod fleet;
mod fuzz;
mod library;
mod load;
mod parity;
mod serve_e2e;
mod test;

use anyhow::{bail, Context};
use std::path::{Path, PathBuf};

use std::process::ExitCode;

const HELP: &str = "\
cargo xtask <task> [options]

tasks:
  fetch [--force]           download the test model (Qwen2.5-Coder-0.5B-Instruct) into
                            $EMBER_MODELS (default ~/.cache/ember-models) and print its folder
  parity [--model DIR] [--reference FILE] [--quant int8|int4]
                            greedy ids and top-10 logits against transformers' reference
                            (default fixtures/reference/greedy.jsonl); with --quant, a report
                            of the quantized model's greedy text instead of a gate
  e2e                       the ember binary end to end on the real model: seeded
                            sampling, a piped two-turn chat
  serve-e2e                 `ember serve` on the real model with the official openai Python
                            client and curl (scripts/serve_e2e.py, pinned venv made here)
  load [--url http://HOST:PORT] [--clients 1,4,8] [--max-tokens N] [--system-tokens N]
       [--temperature T] [--requests N] [--rounds N] [--api-key KEY] [--json]
       [--conversations N [--turns N] [--session conversation|request|off] [--stream-share F] [--think-ms MS] [--seconds S]]
                            a bounded load test of an OpenAI-compatible server: concurrent
                            streaming chats, aggregate tok/s and time to first token; with
                            --conversations, multi-turn conversations (X-Session-Id each,
                            streamed and whole replies mixed): completed, failed, retried,
                            cached share of later turns
  fleet [--replicas 3] [--conversations 12] [--turns 3] [--clients 6] [--max-tokens 12]
        [--kill-after S] [--seconds 240] [--json] [--keep]
                            replicas of `ember serve` behind nginx (deploy/nginx/ember.conf) on
                            127.0.0.1: affinity against none, a replica SIGKILLed and one
                            SIGTERMed mid-load and restarted; fails unless nothing is lost
  fuzz [--list] [--target NAME|all] [--time SECONDS] [--cases N] [--seed S] [--debug]
                            the fuzz targets (hostile safetensors, index, configs, quantized
                            metadata, GGUF, tokenizer input, chat messages, server bodies, CLI
                            arguments): no panic, no abort, no allocation past the named bound;
                            10000 cases each by default, or SECONDS each
  readme                    the README's library example in a fresh `cargo new` project
                            depending on ember-model by path, run on the real model
  package                   `cargo package` of the three library crates, and the packaged
                            ember-sample and ember-model tested from their .crate files
  test                      the whole suite: fetch, `cargo test --workspace` under every
                            instruction-set tier this CPU has, the fuzz targets, then
                            parity, e2e, serve-e2e, fleet, readme and package
  help                      this text
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (task, rest) = match args.split_first() {
        Some((t, r)) => (t.as_str(), r),
        None => ("help", &[][..]),
    };
    let result = match task {
        "fetch" => fetch::run(rest),
        "parity" => parity::run(rest),
        "e2e" => e2e::run(rest),
        "serve-e2e" => serve_e2e::run(rest),
        "load" => load::run(rest),
        "fleet" => fleet::run(rest),
        "fuzz" => fuzz::run(rest),
        "readme" => library::readme(rest),
        "package" => library::package(rest),
        "test" => test::run(rest),
        "help" | "-h" | "--help" => {
            print!("{HELP}");
            Ok(())
        }
        other => Err(anyhow::anyhow!("unknown task `{other}`\n\n{HELP}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask {task}: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// Builds the release `ember` binary and returns its path.
pub fn build_ember() -> anyhow::Result<PathBuf> {
    let status = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(root())
        .args(["build", "--release", "--quiet", "-p", "ember-cli"])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("cargo build --release -p ember-cli failed");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from);
    Ok(target.join("release").join(format!("ember{}", std::env::consts::EXE_SUFFIX)))
}
