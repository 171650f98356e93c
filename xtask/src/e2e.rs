//! `cargo xtask e2e`: the `ember` binary end to end on the real model, for
//! what needs real weights to mean anything:
//! 1. sampling is reproducible: the same seed gives the same text at
//!    temperature 0.7, a different seed a different text;
//! 2. a piped two-turn `ember chat`: the second turn runs only the tokens new
//!    since the first (the engine's own count), and its answer uses what the
//!    first turn said.

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

pub fn run(args: &[String]) -> Result<()> {
    if let Some(a) = args.first() {
        bail!("unknown option `{a}` (e2e takes none)");
    }
    let model = crate::fetch::model_dir();
    if !model.join("config.json").is_file() {
        bail!("no model in {} (run `cargo xtask fetch` first)", model.display());
    }
    let ember = crate::build_ember()?;
    let mut failed = 0;
    for (name, check) in [("seeded sampling", seeded as fn(&Path, &Path) -> Result<String>), ("two-turn chat", chat)] {
        match check(&ember, &model) {
            Ok(s) => println!("ok    {name:<16} {s}"),
            Err(e) => {
                failed += 1;
                println!("FAIL  {name:<16} {e:#}");
            }
        }
    }
    println!("e2e: {} passed, {failed} failed", 2 - failed);
    ensure!(failed == 0, "{failed} end-to-end checks failed");
    Ok(())
}

fn seeded(ember: &Path, model: &Path) -> Result<String> {
    let run = |seed: &str| -> Result<Value> {
        let out = Command::new(ember)
            .arg("--model")
            .arg(model)
            .args(["--chat", "--prompt", "Write a short poem about the sea.", "--temperature", "0.7"])
            .args(["--seed", seed, "--max-tokens", "32", "--json"])
            .output()
            .context("running ember")?;
        ensure!(out.status.success(), "ember failed: {}", String::from_utf8_lossy(&out.stderr));
        Ok(serde_json::from_slice(&out.stdout)?)
    };
    let (a, b, c) = (run("1")?, run("1")?, run("2")?);
    ensure!(a["ids"] == b["ids"], "seed 1 twice gave different tokens:\n{}\n{}", a["text"], b["text"]);
    ensure!(a["ids"] != c["ids"], "seeds 1 and 2 gave the same tokens: {}", a["text"]);
    Ok(format!("seed 1 twice equal, seed 2 differs ({:?} / {:?})", short(&a["text"]), short(&c["text"])))
}

fn short(v: &Value) -> String {
    v.as_str().unwrap_or("").chars().take(40).collect()
}

fn chat(ember: &Path, model: &Path) -> Result<String> {
    let mut child = Command::new(ember)
        .arg("chat")
        .arg("--model")
        .arg(model)
        .args(["--temperature", "0", "--max-tokens", "64", "--json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running ember chat")?;
    child.stdin.take().context("no stdin")?.write_all(
        b"My name is Alice and my favourite colour is blue. Please remember that.\nWhat is my favourite colour?\n",
    )?;
    let out = child.wait_with_output()?;
    ensure!(out.status.success(), "ember chat failed: {}", String::from_utf8_lossy(&out.stderr));
    let turns: Vec<Value> = String::from_utf8(out.stdout)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .context("reading ember chat --json")?;
    ensure!(turns.len() == 2, "expected two turns, got {}", turns.len());
    let n = |t: &Value, k: &str| t[k].as_u64().unwrap_or(u64::MAX);
    let (first, second) = (&turns[0], &turns[1]);
    // Turn 2 reuses the first prompt and reply; only the rest is run.
    let first_len = n(first, "prompt_tokens") + first["ids"].as_array().map_or(0, |a| a.len() as u64);
    ensure!(
        n(second, "reused_tokens") + n(second, "prefill_tokens") == n(second, "prompt_tokens"),
        "reused + prefilled != prompt tokens: {second}"
    );
    ensure!(
        n(second, "reused_tokens") + 1 >= first_len,
        "turn 2 reused {} tokens, but turn 1 left {first_len} in the context",
        n(second, "reused_tokens")
    );
    ensure!(
        n(second, "prefill_tokens") < 40,
        "turn 2 ran {} tokens: more than the new message",
        n(second, "prefill_tokens")
    );
    let answer = second["text"].as_str().unwrap_or("");
    ensure!(answer.to_lowercase().contains("blue"), "turn 2 does not recall turn 1: {answer:?}");
    Ok(format!(
        "turn 2 ran {} new tokens of {} (reused {}); answer {:?}",
        n(second, "prefill_tokens"),
        n(second, "prompt_tokens"),
        n(second, "reused_tokens"),
        answer
    ))
}
