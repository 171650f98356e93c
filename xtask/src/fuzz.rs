//! `cargo xtask fuzz`: the fuzz targets, longer than `cargo test` runs them.
//!
//! Each target is a property test (proptest, on stable Rust) of one input
//! the project reads: hostile files, JSON, text, argument vectors and
//! request bodies, checked for no panic, no abort and no single allocation
//! above a named bound (`FUZZ_ALLOC_LIMIT`, ember-model's
//! `tests/fuzzing/mod.rs`, which is the harness of all of them). They live
//! with the code they test, so plain `cargo test` runs each a little; here
//! each runs alone with a case count or a time budget, in the `fuzz` profile
//! (optimised like release, with overflow checks and debug assertions, and
//! without release's fat LTO so it builds in a fraction of the time).
//!
//! ```text
//! cargo xtask fuzz --list
//! cargo xtask fuzz                          # every target, 10000 cases each
//! cargo xtask fuzz --target gguf --time 600 # one target for ten minutes
//! cargo xtask fuzz --cases 3000 --debug     # the test profile (what `cargo xtask test` runs)
//! cargo xtask fuzz --seed 42                # replay a run's printed seed
//! ```

use anyhow::{bail, Context, Result};
use std::process::Command;
use std::time::Instant;

/// A target: its name, and the test binary and test function it is.
struct Target {
    name: &'static str,
    /// `--test fuzz` or `--bin ember` (built across the workspace, so the
    /// features are those `cargo test --workspace` built with: running a
    /// target rebuilds nothing after it).
    binary: [&'static str; 2],
    test: &'static str,
    what: &'static str,
}

const TARGETS: &[Target] = &[
    Target {
        name: "safetensors",
        binary: ["--test", "fuzz"],
        test: "fuzz_safetensors",
        what: "model.safetensors headers (dtypes, shapes, offsets, names, metadata, length) and bytes, loaded and run",
    },
    Target {
        name: "index",
        binary: ["--test", "fuzz"],
        test: "fuzz_index",
        what: "model.safetensors.index.json: shard names (.., absolute, folders), maps, any JSON",
    },
    Target {
        name: "config",
        binary: ["--test", "fuzz"],
        test: "fuzz_config",
        what: "config.json and generation_config.json fields, context and prefill sizes; loaded models generate",
    },
    Target {
        name: "quant",
        binary: ["--test", "fuzz"],
        test: "fuzz_quant_metadata",
        what: "ember.quant.* metadata and U8 block shapes of INT8/INT4 folders from `ember quantize`",
    },
    Target {
        name: "gguf",
        binary: ["--test", "fuzz"],
        test: "fuzz_gguf",
        what: "GGUF files (BF16, Q8_0, Q4_0): metadata values, counts, lengths, tensor infos, bytes; load and run",
    },
    Target {
        name: "tokenizer",
        binary: ["--test", "fuzz"],
        test: "fuzz_tokenizer",
        what: "arbitrary text, bytes and ids into encode, decode and the text stream of three tokenizers",
    },
    Target {
        name: "chat",
        binary: ["--test", "fuzz"],
        test: "fuzz_chat",
        what: "messages and tools through chat templates, replies through the tool-call parser, random templates",
    },
    Target {
        name: "server",
        binary: ["--test", "fuzz"],
        test: "fuzz_server_bodies",
        what: "request bodies of /v1/chat/completions and /v1/completions: parsing and validation",
    },
    Target {
        name: "cli",
        binary: ["--bin", "ember"],
        test: "fuzz::fuzz_cli",
        what: "argument vectors of every command into the parser",
    },
];

/// Cases per target when neither `--cases` nor `--time` is given.
const DEFAULT_CASES: u64 = 10_000;

pub fn run(args: &[String]) -> Result<()> {
    let mut targets: Vec<&Target> = TARGETS.iter().collect();
    let (mut cases, mut seconds, mut seed, mut debug) = (None, None, None, false);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().with_context(|| format!("{name} needs a value"));
        match a.as_str() {
            "--list" => {
                for t in TARGETS {
                    println!("{:<12} {}", t.name, t.what);
                }
                return Ok(());
            }
            "--target" => {
                let name = value("--target")?;
                if name != "all" {
                    let t = TARGETS.iter().find(|t| t.name == name).with_context(|| {
                        let names: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
                        format!("unknown target `{name}` (targets: {}, or all)", names.join(", "))
                    })?;
                    targets = vec![t];
                }
            }
            "--time" => seconds = Some(value("--time")?.parse::<f64>().context("--time takes seconds")?),
            "--cases" => cases = Some(value("--cases")?.parse::<u64>().context("--cases takes a number")?),
            "--seed" => seed = Some(value("--seed")?.parse::<u64>().context("--seed takes a number")?),
            "--debug" => debug = true,
            other => bail!(
                "unknown option `{other}` (fuzz takes --list, --target NAME|all, --time SECONDS, --cases N, --seed S, --debug)"
            ),
        }
    }
    if seconds.is_some_and(|s| s.is_nan() || s <= 0.0) || cases == Some(0) {
        bail!("--time and --cases must be positive");
    }
    let cases = cases.unwrap_or(DEFAULT_CASES);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let profile = if debug { "test" } else { "fuzz" };
    let budget = match seconds {
        Some(s) => format!("{s} s"),
        None => format!("{cases} cases"),
    };
    eprintln!("xtask fuzz: {} target(s), {budget} each, profile {profile}", targets.len());
    let start = Instant::now();
    // Build every target's binary once. Per package (`-p`) each would be
    // built with that package's own feature set: in CI that rebuilt the
    // crates three times over, 14 minutes against half a minute of cases.
    let status = Command::new(&cargo)
        .current_dir(crate::root())
        .args(["test", "--quiet", "--profile", profile, "--workspace", "--test", "fuzz", "--bin", "ember", "--no-run"])
        .status()
        .context("building the fuzz targets")?;
    if !status.success() {
        bail!("building the fuzz targets failed");
    }
    let mut summary = Vec::new();
    for t in targets {
        let mut cmd = Command::new(&cargo);
        cmd.current_dir(crate::root())
            .args(["test", "--quiet", "--profile", profile, "--workspace"])
            .args(t.binary)
            .args(["--", "--exact", t.test, "--nocapture", "--test-threads", "1"])
            .env("EMBER_FUZZ_CASES", cases.to_string())
            // The harness reports a failure's input, seed and panic location.
            .env("RUST_BACKTRACE", "0");
        match seconds {
            Some(s) => cmd.env("EMBER_FUZZ_SECONDS", s.to_string()),
            None => cmd.env_remove("EMBER_FUZZ_SECONDS"),
        };
        match seed {
            Some(s) => cmd.env("EMBER_FUZZ_SEED", s.to_string()),
            None => cmd.env_remove("EMBER_FUZZ_SEED"),
        };
        let out = cmd.output().with_context(|| format!("running cargo test for fuzz target {}", t.name))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        // The harness prints one summary line (and the outcomes) per target.
        let lines: Vec<&str> =
            stderr.lines().filter(|l| l.starts_with("fuzz target ") || l.starts_with("  outcomes:")).collect();
        if !out.status.success() || !lines.iter().any(|l| l.starts_with("fuzz target ")) {
            eprintln!("{stdout}{stderr}");
            bail!("fuzz target {} failed (its input and seed are above)", t.name);
        }
        for l in &lines {
            eprintln!("{l}");
        }
        summary.extend(lines.iter().filter(|l| l.starts_with("fuzz target ")).map(|l| l.to_string()));
    }
    eprintln!("xtask fuzz: {} target(s) clean in {:.0} s", summary.len(), start.elapsed().as_secs_f64());
    Ok(())
}
