//! `cargo xtask parity`: the engine against transformers on the real model.
//!
//! For each line of a reference file (the format of
//! `fixtures/reference/greedy.jsonl`, made by `scripts/reference_logits.py`),
//! runs the release `ember` binary greedily and checks:
//! 1. the prompt's token ids equal the reference's (for chat prompts listed in
//!    a `prompts.json` beside the reference, the prompt goes through ember's
//!    own chat template, so the template is checked too);
//! 2. the greedy ids equal the reference up to the first step whose reference
//!    top-1/top-2 margin is below [`MARGIN`] (past such a near-tie, a correct
//!    engine may take the other branch);
//! 3. the ten best logits at the prompt's last position are within
//!    [`LOGIT_TOLERANCE`] of the reference;
//! 4. those logits after batched prefill (the default) equal those of the
//!    token-by-token path (`--prefill-chunk 1`) within a relative
//!    [`BATCH_TOLERANCE`].
//!
//! Each prompt is checked at both precisions of the batched products (the
//! exact one twice: weights as mapped, and copied into huge pages as `serve`,
//! `chat` and `bench` hold them, float o and down in column parts), each
//! against its own bar ([`BARS`]): `exact` (f32-class) as above, and `fast`
//! (activations rounded to BF16 where the CPU has BF16 dot products), which
//! rounds by design: greedy ids up to the first reference margin below 0.25
//! and top-10 logits within 0.1 (point 4 does not apply: token by token is
//! exact).

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What one precision must meet.
struct Bar {
    /// How the results name it.
    name: &'static str,
    precision: &'static str,
    /// Whether ember copies the weights into huge pages as `serve`, `chat`
    /// and `bench` do (`EMBER_HUGE_PAGES=1`), laying float o and down out in
    /// column parts.
    huge_pages: bool,
    /// Steps whose reference margin is below this are where comparison ends.
    margin: f64,
    /// Largest allowed |ember - transformers| of a top-10 logit.
    logits: f64,
    /// Largest allowed max|batched - token by token| / max|token by token|
    /// of the 20 best last-position logits, if checked.
    batch: Option<f64>,
}

/// The exact bar (weights as mapped, then as the long-running commands hold
/// them), then the fast one.
const BARS: [Bar; 3] = [
    Bar {
        name: "exact",
        precision: "exact",
        huge_pages: false,
        margin: 0.02,
        logits: 2e-3,
        batch: Some(BATCH_TOLERANCE),
    },
    Bar {
        name: "exact, huge pages",
        precision: "exact",
        huge_pages: true,
        margin: 0.02,
        logits: 2e-3,
        batch: Some(BATCH_TOLERANCE),
    },
    Bar { name: "fast", precision: "fast", huge_pages: false, margin: 0.25, logits: 0.1, batch: None },
];
/// Exact precision's batched-vs-token-by-token bar.
const BATCH_TOLERANCE: f64 = 1e-4;
/// The reference files `cargo xtask parity` checks by default.
const DEFAULT_REFERENCES: [&str; 2] = ["fixtures/reference/greedy.jsonl", "fixtures/reference/long.jsonl"];

#[derive(Deserialize)]
struct Reference {
    name: String,
    #[serde(default)]
    chat: bool,
    prompt_text: String,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    margins: Vec<f64>,
    last_top10: Top,
}

#[derive(Deserialize)]
struct Top {
    ids: Vec<u32>,
    logits: Vec<f64>,
}

/// A prompt as `prompts.json` lists it.
#[derive(Deserialize, Clone)]
struct Prompt {
    name: String,
    prompt: String,
    #[serde(default)]
    system: Option<String>,
}

#[derive(Deserialize)]
struct EmberOut {
    prompt_ids: Vec<u32>,
    ids: Vec<u32>,
    text: String,
    top_logits: Top,
}

pub fn run(args: &[String]) -> Result<()> {
    let root = crate::root();
    let mut model = None;
    let mut references = Vec::new();
    let mut quant = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--model" => model = Some(PathBuf::from(it.next().context("--model needs a folder")?)),
            "--reference" => references.push(PathBuf::from(it.next().context("--reference needs a file")?)),
            "--quant" => quant = Some(it.next().context("--quant needs int8 or int4")?.clone()),
            other => {
                bail!("unknown option `{other}` (parity takes --model DIR, --reference FILE and --quant Q)")
            }
        }
    }
    let model = model.unwrap_or_else(crate::fetch::model_dir);
    if !model.join("config.json").is_file() {
        bail!("no model in {} (run `cargo xtask fetch` first)", model.display());
    }
    if references.is_empty() {
        references = DEFAULT_REFERENCES.iter().map(|f| root.join(f)).collect();
    }
    let mut refs = Vec::new();
    for reference in &references {
        let text = std::fs::read_to_string(reference).with_context(|| format!("reading {}", reference.display()))?;
        let prompts = load_prompts(reference)?;
        let before = refs.len();
        for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let r: Reference = serde_json::from_str(l).with_context(|| format!("{}:{}", reference.display(), i + 1))?;
            let prompt = prompts.iter().position(|p| p.name == r.name).map(|i| prompts[i].clone());
            refs.push((r, prompt));
        }
        if refs.len() == before {
            bail!("{} holds no reference", reference.display());
        }
    }
    let ember = crate::build_ember()?;
    if let Some(q) = quant {
        return report_quantized(&ember, &model, &refs, &q);
    }

    let mut failures = 0;
    for bar in &BARS {
        let (mut passed, mut failed) = (0, 0);
        for (r, prompt) in &refs {
            match check(&ember, &model, r, prompt.as_ref(), bar) {
                Ok(summary) => {
                    passed += 1;
                    println!("ok    {:<17} {:<14} {summary}", bar.name, r.name);
                }
                Err(e) => {
                    failed += 1;
                    println!("FAIL  {:<17} {:<14} {e:#}", bar.name, r.name);
                }
            }
        }
        println!("parity ({}): {passed} passed, {failed} failed", bar.name);
        failures += failed;
    }
    match check_sequences(&model, &refs) {
        Ok(summary) => println!("ok    sequences decoded together: {summary}"),
        Err(e) => {
            failures += 1;
            println!("FAIL  sequences decoded together: {e:#}");
        }
    }
    if failures > 0 {
        bail!("{failures} checks of {} prompts differ from transformers", refs.len());
    }
    Ok(())
}

/// With `--quant`: a report, not a gate. A quantized model is a different
/// model, so its greedy text may leave transformers' late; this prints, per
/// prompt, how many greedy tokens agree and the text it generated.
fn report_quantized(ember: &Path, model: &Path, refs: &[(Reference, Option<Prompt>)], quant: &str) -> Result<()> {
    for (r, prompt) in refs {
        let max_tokens = r.greedy_ids.len().max(1).to_string();
        let (got, via) =
            run_ember(ember, model, r, prompt.as_ref(), &["--max-tokens", &max_tokens, "--quant", quant], false)?;
        let same = got.ids.iter().zip(&r.greedy_ids).take_while(|(a, b)| a == b).count();
        let at = if same < r.greedy_ids.len() {
            format!(" (first difference at step {same}, transformers' margin there {:.3})", r.margins[same])
        } else {
            String::new()
        };
        println!("{quant} {:<14} ({via}) greedy {same}/{} equal{at}", r.name, r.greedy_ids.len());
        println!("      {:?}", got.text);
    }
    Ok(())
}

/// Every reference prompt decoded greedily alone and all together in shared
/// forward passes (`ember_model::advanced::step`, through the `sequences` example):
/// the ids must agree up to the first step where transformers' margin is
/// below the exact bar's (past a near-tie, either branch is right). Each
/// prompt goes in twice, so that more than 8 sequences decode together
/// (with the 6–7 reference prompts: the products of 9–16 tokens, which run
/// on their own kernel on AMX, as well as those of 8 and fewer once some
/// sequences have stopped).
fn check_sequences(model: &Path, refs: &[(Reference, Option<Prompt>)]) -> Result<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(&cargo)
        .current_dir(crate::root())
        .args(["build", "--release", "--quiet", "-p", "ember-model", "--example", "sequences"])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("building the sequences example failed");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| crate::root().join("target"), PathBuf::from);
    let exe = target.join("release").join("examples").join(format!("sequences{}", std::env::consts::EXE_SUFFIX));
    let steps = refs.iter().map(|(r, _)| r.greedy_ids.len()).max().unwrap_or(1);
    let mut cmd = Command::new(&exe);
    cmd.arg(model).arg(steps.to_string());
    let twice: Vec<&Reference> = refs.iter().chain(refs).map(|(r, _)| r).collect();
    for r in &twice {
        cmd.arg(serde_json::to_string(&r.prompt_ids)?);
    }
    let out = cmd.output().with_context(|| format!("running {}", exe.display()))?;
    if !out.status.success() {
        bail!("the sequences example failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    #[derive(Deserialize)]
    struct Pair {
        alone: Vec<u32>,
        together: Vec<u32>,
    }
    let pairs: Vec<Pair> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .context("reading the sequences example's output")?;
    if pairs.len() != twice.len() {
        bail!("{} results for {} prompts", pairs.len(), twice.len());
    }
    let mut compared = 0;
    for (r, p) in twice.iter().zip(&pairs) {
        let margin = BARS[0].margin;
        let stop = r.margins.iter().position(|&m| m < margin).unwrap_or(r.greedy_ids.len()).min(p.alone.len());
        if p.together.get(..stop) != Some(&p.alone[..stop]) {
            bail!("{}: together {:?} vs alone {:?} (compared to step {stop})", r.name, p.together, p.alone);
        }
        compared += stop;
    }
    Ok(format!("{} sequences ({} prompts twice), {compared} greedy ids equal to each alone", twice.len(), refs.len()))
}

/// `prompts.json` beside the reference file, if there is one.
fn load_prompts(reference: &Path) -> Result<Vec<Prompt>> {
    let path = reference.with_file_name("prompts.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text).with_context(|| format!("reading {}", path.display())),
        Err(_) => Ok(Vec::new()),
    }
}

/// Runs ember greedily on the reference's prompt and returns its output and
/// how the prompt was given (raw or through the chat template).
fn run_ember(
    ember: &Path,
    model: &Path,
    r: &Reference,
    prompt: Option<&Prompt>,
    extra: &[&str],
    huge_pages: bool,
) -> Result<(EmberOut, &'static str)> {
    let mut cmd = Command::new(ember);
    cmd.env("EMBER_HUGE_PAGES", if huge_pages { "1" } else { "0" });
    cmd.arg("--model").arg(model);
    cmd.args(["--temperature", "0", "--json", "--top-logits", "20", "--seed", "0"]);
    cmd.args(extra);
    let via = match (r.chat, prompt) {
        (true, Some(p)) => {
            cmd.args(["--chat", "--prompt", &p.prompt]);
            if let Some(s) = &p.system {
                cmd.args(["--system", s]);
            }
            "chat template"
        }
        _ => {
            cmd.args(["--prompt", &r.prompt_text]);
            "raw text"
        }
    };
    let out = cmd.output().with_context(|| format!("running {}", ember.display()))?;
    if !out.status.success() {
        bail!("ember failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok((serde_json::from_slice(&out.stdout).context("reading ember's --json output")?, via))
}

fn check(ember: &Path, model: &Path, r: &Reference, prompt: Option<&Prompt>, bar: &Bar) -> Result<String> {
    let max_tokens = r.greedy_ids.len().max(1).to_string();
    let precision = ["--precision", bar.precision];
    let (got, via) =
        run_ember(ember, model, r, prompt, &[&["--max-tokens", &max_tokens][..], &precision].concat(), bar.huge_pages)?;
    if got.prompt_ids != r.prompt_ids {
        bail!("prompt ids ({via}) differ:\n  ember        {:?}\n  transformers {:?}", got.prompt_ids, r.prompt_ids);
    }

    let mut worst: f64 = 0.0;
    for (id, want) in r.last_top10.ids.iter().zip(&r.last_top10.logits) {
        let Some(i) = got.top_logits.ids.iter().position(|g| g == id) else {
            bail!("reference top-10 token {id} is not among ember's 20 best logits");
        };
        let diff = (got.top_logits.logits[i] - want).abs();
        worst = worst.max(diff);
        if diff > bar.logits {
            bail!(
                "logit of token {id}: ember {} vs transformers {want} (|diff| {diff:.2e} > {:.0e})",
                got.top_logits.logits[i],
                bar.logits
            );
        }
    }

    // Compare up to (and including) the first near-tie step: at that step
    // either branch is acceptable, so the comparison covers the steps before it.
    let stop = r.margins.iter().position(|&m| m < bar.margin).unwrap_or(r.greedy_ids.len()).min(r.greedy_ids.len());
    for step in 0..stop {
        match got.ids.get(step) {
            Some(g) if *g == r.greedy_ids[step] => {}
            g => bail!(
                "greedy token {step} differs: ember {g:?} vs transformers {} (margin {:.4})\n  ember        {:?}\n  transformers {:?}",
                r.greedy_ids[step],
                r.margins.get(step).copied().unwrap_or(f64::NAN),
                got.ids,
                r.greedy_ids
            ),
        }
    }
    // The batched prompt path against the token-by-token one.
    let mut batched = String::new();
    if let Some(tolerance) = bar.batch {
        let one_by_one = [&["--max-tokens", "1", "--prefill-chunk", "1"][..], &precision].concat();
        let (one, _) = run_ember(ember, model, r, prompt, &one_by_one, bar.huge_pages)?;
        let scale = one.top_logits.logits.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let mut batch_diff: f64 = 0.0;
        for (id, want) in one.top_logits.ids.iter().zip(&one.top_logits.logits) {
            let Some(i) = got.top_logits.ids.iter().position(|g| g == id) else {
                bail!("token {id} is among the 20 best logits token by token but not after batched prefill");
            };
            batch_diff = batch_diff.max((got.top_logits.logits[i] - want).abs() / scale);
        }
        if batch_diff > tolerance {
            bail!("batched prefill differs from token by token: relative {batch_diff:.2e} > {tolerance:.0e}");
        }
        batched = format!(" | batched vs 1-by-1 {batch_diff:.1e}");
    }
    let tail = if stop < r.greedy_ids.len() {
        format!(" (stopped at a near-tie, margin {:.4})", r.margins[stop])
    } else {
        String::new()
    };
    Ok(format!(
        "prompt {} ids ({via}) | greedy {stop}/{} equal{tail} | top-10 max |diff| {worst:.1e}{batched}",
        r.prompt_ids.len(),
        r.greedy_ids.len()
    ))
}
