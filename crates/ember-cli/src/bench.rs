//! `ember bench`: llama-bench's counterpart. Prompt processing (`ppN`) and
//! generation (`tgN`) speed as mean ± sd over repetitions, timed around the
//! forward passes only, plus the weight bytes each decoded token streams and
//! the memory read bandwidth measured over the same weights in the same run.

use crate::{init_threads, model_dir};
use anyhow::{bail, Context, Result};
use ember_model::advanced::bench;
use std::path::PathBuf;
use std::process::Command;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model folder (HF layout) or GGUF file (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K tensors). Default: the folder `cargo xtask fetch` fills.
    #[arg(short, long)]
    model: Option<PathBuf>,

    /// Prompt lengths to measure, comma-separated (0 = none).
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_value = "512")]
    prompt: Vec<usize>,

    /// Generation lengths to measure, comma-separated (0 = none).
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_value = "128")]
    generate: Vec<usize>,

    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,

    /// Thread counts, comma-separated (default: the number of physical CPU cores).
    #[arg(short = 't', long, value_delimiter = ',')]
    threads: Vec<usize>,

    /// Prompt tokens per forward pass in ppN tests (1 = token by token).
    #[arg(short = 'b', long, default_value_t = ember_model::DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,

    /// Quantize the weights at load (`int8` or `int4`) and measure that.
    #[arg(long, value_parser = crate::runtime::parse_quant)]
    quant: Option<ember_model::WeightType>,

    /// Arithmetic of the batched products: `fast` or `exact` (see `ember --help`).
    #[arg(long, value_parser = crate::runtime::parse_precision, default_value = "fast")]
    precision: ember_model::Precision,

    /// Also measure decoding with this many sequences together (aggregate
    /// tok/s over all of them, one forward pass per step), comma-separated,
    /// each sequence after its own prompt of --sequence-prompt tokens.
    #[arg(long, value_delimiter = ',')]
    sequences: Vec<usize>,

    /// Prompt tokens each sequence has before --sequences decoding starts.
    #[arg(long, default_value_t = 128, value_name = "N")]
    sequence_prompt: usize,

    /// After each tgN test, one more generation timed phase by phase (q/k/v,
    /// attention, o, gate/up, down, LM head): time per token, and for the
    /// products the weight bytes they stream against the read ceiling
    /// measured right after. With --sequences, the same for each number of
    /// sequences, per step (a token of each).
    #[arg(long)]
    phases: bool,

    /// Print one JSON array, an object per test.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize, serde::Deserialize, Clone, Debug)]
struct Row {
    test: String,
    /// For decoding with several sequences together: how many.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    sequences: Option<usize>,
    threads: usize,
    /// The kernel tier in use.
    isa: String,
    /// The batched products' precision.
    precision: String,
    /// Whether the weights were read from memory backed by huge pages
    /// (`EMBER_HUGE_PAGES=0` reads them from the mapped file).
    #[serde(default)]
    huge_pages: bool,
    tok_s: f64,
    sd: f64,
    /// For tgN: weight bytes streamed per second while generating.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    gb_s: Option<f64>,
    /// For tgN: the machine's read bandwidth over the same weights, same run
    /// (the median over repetitions of the fastest of two reads each).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    read_gb_s: Option<f64>,
    /// For tgN: `gb_s` as a percentage of `read_gb_s`, the median over
    /// repetitions of each generation against the reads right after it.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    read_pct: Option<f64>,
    /// With 2 threads or more: a cache line's round trip between the thread
    /// running the passes and a worker, measured after each repetition
    /// (the median), in ns ([`ember_kernels::pool::handoff`]): on a virtual
    /// machine it tells which placement of the threads a row met.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    handoff_ns: Option<f64>,
    /// For ppN: time to first token for an N-token prompt (median), in ms.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    ttft_ms: Option<f64>,
    /// With --phases: the part of the tgN test's forward passes this row
    /// times (`tok_s` is then tokens per second of that part alone, and
    /// `gb_s`, `read_pct` its weights' rate).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    phase: Option<String>,
    /// With --phases: microseconds per decoded token spent in `phase` (on a
    /// row of several sequences, a step's time over its tokens).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    us_per_token: Option<f64>,
    /// With --phases and 2 threads or more: of `us_per_token`, the work
    /// outside the thread pool's parallel sections, on the thread running
    /// the pass (norms, RoPE, residual adds, quantizing activations,
    /// products too small to split).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    serial_us_per_token: Option<f64>,
    /// With --phases and 2 threads or more: of `us_per_token`, that thread's
    /// wait at the end of each parallel section, its own share done, for
    /// the other threads.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    wait_us_per_token: Option<f64>,
    /// With --phases, on the products' rows: the read bandwidth over the
    /// same weights read one forward-pass section at a time (each layer's
    /// q/k/v, o, gate/up, down, then the LM head), what the sections
    /// themselves leave of `read_gb_s`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    read_by_section_gb_s: Option<f64>,
}

pub fn run(args: Args) -> Result<()> {
    if args.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    if args.threads.contains(&0) {
        bail!("--threads must be at least 1");
    }
    if args.sequences.contains(&0) {
        bail!("--sequences must be at least 1");
    }
    let dir = model_dir(args.model.clone())?;
    // The pool's size is fixed per process: several thread counts run as
    // child processes, one each.
    if args.threads.len() > 1 {
        let mut rows = Vec::new();
        for &t in &args.threads {
            rows.extend(child(&args, &dir, t)?);
        }
        return print(&args, &dir, &rows, None);
    }
    let threads = init_threads(args.threads.first().copied())?;
    let mut model =
        ember_model::advanced::load_qwen2(&dir).with_context(|| format!("loading the model in {}", dir.display()))?;
    if let Some(q) = args.quant {
        model.quantize(&crate::runtime::quant_policy(q)?)?;
    }
    model.precision = args.precision;
    // As `ember serve` and `ember chat` load models, unless
    // `EMBER_HUGE_PAGES=0` (to measure the difference); without memory for
    // the copy, the mapped file.
    let huge_pages = crate::runtime::huge_pages_or(true) && model.copy_to_huge_pages().is_ok_and(|bytes| bytes > 0);
    let bytes_per_token = model.weight_bytes_per_token();
    // Every length within the model's positions, before anything is sized
    // from it.
    let positions = model.config.max_position_embeddings;
    let too_long = |flag: &str, n: usize| {
        anyhow::anyhow!("{flag} {n} is more than the model's {positions} positions; lower {flag}")
    };
    if let Some(&p) = args.prompt.iter().find(|&&p| p > positions) {
        return Err(too_long("-p", p));
    }
    if let Some(&n) = args.generate.iter().find(|&&n| n > positions) {
        return Err(too_long("-n", n));
    }
    if !args.sequences.is_empty() {
        if let Some(&n) = args.generate.iter().find(|&&n| args.sequence_prompt.saturating_add(n) > positions) {
            return Err(too_long("--sequence-prompt + -n", args.sequence_prompt.saturating_add(n)));
        }
    }

    // Warm-up: fault the mapped weights in and wake the pool.
    bench::generation(&model, 2)?;

    let mut rows = Vec::new();
    for &n in args.prompt.iter().filter(|&&n| n > 0) {
        let (mut ttft, mut handoffs) = (Vec::new(), Vec::new());
        let rates = measure(args.repetitions, || {
            let d = bench::prompt_processing(&model, n, args.prefill_chunk)?;
            ttft.push(d.as_secs_f64() * 1e3);
            handoffs.extend(handoff_ns());
            Ok(n as f64 / d.as_secs_f64())
        })?;
        let mut r = row(format!("pp{n}"), threads, &rates);
        r.ttft_ms = Some(median(&ttft));
        r.handoff_ns = median_of(&handoffs);
        rows.push(r);
    }
    for &n in args.generate.iter().filter(|&&n| n > 0) {
        // Each repetition's generation is followed at once by a read of the
        // same weights, and the share of the ceiling is the median of those
        // pairs: on a shared machine the bandwidth drifts within a run, and a
        // pair sees the same conditions.
        let (mut rates, mut reads, mut shares, mut handoffs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..args.repetitions {
            let rate = n as f64 / bench::generation(&model, n)?.as_secs_f64();
            let read = ceiling(&model);
            handoffs.extend(handoff_ns());
            shares.push(100.0 * rate * bytes_per_token as f64 / 1e9 / read);
            rates.push(rate);
            reads.push(read);
        }
        let mut r = row(format!("tg{n}"), threads, &rates);
        r.handoff_ns = median_of(&handoffs);
        r.gb_s = Some(r.tok_s * bytes_per_token as f64 / 1e9);
        r.read_gb_s = Some(median(&reads));
        r.read_pct = Some(median(&shares));
        rows.push(r);
        if args.phases {
            rows.extend(phase_rows(&model, n, threads)?);
        }
    }
    for &s in &args.sequences {
        for &n in args.generate.iter().filter(|&&n| n > 0) {
            let mut handoffs = Vec::new();
            let rates = measure(args.repetitions, || {
                let d = bench::multi_sequence_generation(&model, s, args.sequence_prompt, n)?;
                handoffs.extend(handoff_ns());
                Ok((s * n) as f64 / d.as_secs_f64())
            })?;
            let mut r = row(format!("tg{n}"), threads, &rates);
            r.sequences = Some(s);
            r.handoff_ns = median_of(&handoffs);
            rows.push(r);
            if args.phases {
                rows.extend(sequence_phase_rows(&model, s, args.sequence_prompt, n, threads)?);
            }
        }
    }
    for r in &mut rows {
        r.precision = args.precision.name().to_string();
        r.huge_pages = huge_pages;
    }
    print(&args, &dir, &rows, Some(bytes_per_token))
}

/// One more `n`-token generation timed phase by phase, then a read of the
/// weights: a row per phase.
fn phase_rows(model: &ember_model::advanced::Qwen2, n: usize, threads: usize) -> Result<Vec<Row>> {
    rows_of_phases(model, &bench::generation_phases(model, n)?, n, threads)
}

/// One more step of `s` sequences decoding `n` tokens together, timed phase
/// by phase, then a read of the weights: a row per phase, marked with `s`.
fn sequence_phase_rows(
    model: &ember_model::advanced::Qwen2,
    s: usize,
    prompt: usize,
    n: usize,
    threads: usize,
) -> Result<Vec<Row>> {
    let times = bench::multi_sequence_generation_phases(model, s, prompt, n)?;
    let mut rows = rows_of_phases(model, &times, n, threads)?;
    for r in &mut rows {
        r.sequences = Some(s);
    }
    Ok(rows)
}

/// A row per phase of `times` (decoding `n` tokens a sequence): time per
/// decoded token, and for the products their weights' rate per forward pass
/// (a pass reads them once, whatever its tokens) against the read ceiling,
/// measured now.
fn rows_of_phases(
    model: &ember_model::advanced::Qwen2,
    times: &ember_model::advanced::PhaseTimes,
    n: usize,
    threads: usize,
) -> Result<Vec<Row>> {
    // The one-pass ceiling, and the same bytes read a section at a time:
    // alternated, the fastest of each (as `ceiling`).
    let (mut read, mut read_by_section) = (0.0f64, 0.0f64);
    for _ in 0..SECTION_READS {
        read = read.max(gb_s(bench::weight_read(model)));
        read_by_section = read_by_section.max(gb_s(bench::weight_read_by_section(model)));
    }
    let tokens = times.tokens.max(1) as f64;
    let passes = times.passes.max(1) as f64;
    let rows = ember_model::advanced::Phase::ALL.iter().map(|&p| {
        let per_token = times.get(p).as_secs_f64() / tokens;
        let per_pass = times.get(p).as_secs_f64() / passes;
        let mut r = row(format!("tg{n}"), threads, &[1.0 / per_token.max(f64::MIN_POSITIVE)]);
        r.phase = Some(p.name().to_string());
        r.us_per_token = Some(per_token * 1e6);
        if threads > 1 {
            // One thread has no parallel sections to split the time by.
            let inside = times.in_sections(p).as_secs_f64() / tokens;
            r.serial_us_per_token = Some((per_token - inside).max(0.0) * 1e6);
            r.wait_us_per_token = Some(times.waiting(p).as_secs_f64() / tokens * 1e6);
        }
        let weights = model.phase_bytes(p);
        if weights > 0 && per_pass > 0.0 {
            let gb = weights as f64 / per_pass / 1e9;
            r.gb_s = Some(gb);
            r.read_gb_s = Some(read);
            r.read_pct = Some(100.0 * gb / read);
            r.read_by_section_gb_s = Some(read_by_section);
        }
        r
    });
    Ok(rows.collect())
}

/// Reads of the weights in one pass and a section at a time that
/// `--phases` alternates (the fastest of each is its ceiling).
const SECTION_READS: usize = 3;

/// Runs `ember bench` for one thread count in a child process.
fn child(args: &Args, dir: &std::path::Path, threads: usize) -> Result<Vec<Row>> {
    let join = |v: &[usize]| v.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",");
    let exe = std::env::current_exe().context("finding the ember executable")?;
    let out = Command::new(exe)
        .arg("bench")
        .arg("--model")
        .arg(dir)
        .args(["-p", &join(&args.prompt), "-n", &join(&args.generate)])
        .args(["-r", &args.repetitions.to_string(), "-t", &threads.to_string(), "--json"])
        .args(["-b", &args.prefill_chunk.to_string()])
        .args(args.quant.map(|q| ["--quant", q.name()]).into_iter().flatten())
        .args(["--precision", args.precision.name()])
        .args(["--sequence-prompt", &args.sequence_prompt.to_string()])
        .args(args.phases.then_some("--phases"))
        .args(
            (!args.sequences.is_empty())
                .then(|| ["--sequences".to_string(), join(&args.sequences)])
                .into_iter()
                .flatten(),
        )
        .output()
        .context("running a benchmark child process")?;
    if !out.status.success() {
        bail!("benchmark with {threads} threads failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    serde_json::from_slice(&out.stdout).context("reading the child's JSON")
}

fn measure(reps: usize, mut f: impl FnMut() -> ember_model::Result<f64>) -> Result<Vec<f64>> {
    (0..reps).map(|_| f().map_err(Into::into)).collect()
}

fn row(test: String, threads: usize, rates: &[f64]) -> Row {
    let mean = rates.iter().sum::<f64>() / rates.len() as f64;
    let var = if rates.len() > 1 {
        rates.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (rates.len() - 1) as f64
    } else {
        0.0
    };
    Row {
        test,
        sequences: None,
        threads,
        isa: ember_kernels::Isa::active().name().to_string(),
        precision: String::new(),
        huge_pages: false,
        tok_s: mean,
        sd: var.sqrt(),
        gb_s: None,
        read_gb_s: None,
        read_pct: None,
        handoff_ns: None,
        ttft_ms: None,
        phase: None,
        us_per_token: None,
        serial_us_per_token: None,
        wait_us_per_token: None,
        read_by_section_gb_s: None,
    }
}

/// The global pool's handoff round trip in ns ([`ember_kernels::pool::handoff`]),
/// with 2 threads or more.
fn handoff_ns() -> Option<f64> {
    ember_kernels::pool::handoff(ember_kernels::pool::global()).map(|d| d.as_secs_f64() * 1e9)
}

/// [`median`] of what there is, if anything.
fn median_of(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| median(v))
}

/// The median; of an even count, the mean of the two middle values.
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[m - 1] + v[m]) / 2.0
    } else {
        v[m]
    }
}

/// Reads of the weights per repetition of a tgN test, the fastest taken
/// as the ceiling: a neighbour's burst on a shared machine can only slow a
/// read down, and one slowed read made a generation's share of the ceiling
/// 136% (BF16 on `avx2`, a Xeon of family 6 model 167, 2026-12-05, `-r 2`).
const CEILING_READS: usize = 2;

/// The read ceiling over the model's weights, in GB/s: the fastest of
/// [`CEILING_READS`] reads.
fn ceiling(model: &ember_model::advanced::Qwen2) -> f64 {
    (0..CEILING_READS).map(|_| gb_s(bench::weight_read(model))).fold(0.0, f64::max)
}

/// A read probe's (bytes, time) as GB/s.
fn gb_s((bytes, d): (usize, std::time::Duration)) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn print(args: &Args, dir: &std::path::Path, rows: &[Row], bytes_per_token: Option<usize>) -> Result<()> {
    if args.json {
        println!("{}", serde_json::to_string(rows)?);
        return Ok(());
    }
    let name = dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    match args.quant {
        Some(q) => println!("model: {name}, quantized to {} at load", q.name()),
        None => println!("model: {name}"),
    }
    if let Some(b) = bytes_per_token {
        let from = match rows.first().is_some_and(|r| r.huge_pages) {
            true => "memory backed by huge pages",
            false => "the mapped file",
        };
        println!("weights streamed per decoded token: {:.3} GB, from {from}", b as f64 / 1e9);
    }
    if let Some(r) = rows.first() {
        let dot = if !ember_kernels::gemm_bf16::available(ember_kernels::Isa::active()) {
            "not available (no AVX512-BF16 in this tier)"
        } else if ember_kernels::gemm_bf16::pays_off() {
            "used"
        } else {
            "not used (slower than f32 FMA here)"
        };
        println!("kernel tier: {}, precision of batched products: {}, BF16 dot products: {dot}", r.isa, r.precision);
        let ahead = match ember_kernels::cpu::software_prefetch() {
            true => "software prefetches ahead of each row stream",
            false => "the hardware prefetchers only",
        };
        println!("decoding's weight streams: {ahead} (EMBER_PREFETCH=on|off to choose)");
    }
    println!(
        "| {:<8} | {:>4} | {:>7} | {:>16} | {:>10} | {:>20} | {:>10} | {:>10} |",
        "test", "seqs", "threads", "t/s", "TTFT ms", "weights GB/s", "read GB/s", "handoff ns"
    );
    println!(
        "| {:-<8} | {:->4} | {:->7} | {:->16} | {:->10} | {:->20} | {:->10} | {:->10} |",
        "", "", "", "", "", "", "", ""
    );
    let (phases, rows): (Vec<&Row>, Vec<&Row>) = rows.iter().partition(|r| r.phase.is_some());
    for r in rows {
        let seqs = r.sequences.map_or(String::new(), |s| s.to_string());
        let ttft = r.ttft_ms.map_or(String::new(), |t| format!("{t:.0}"));
        let gb = match (r.gb_s, r.read_pct) {
            (Some(g), Some(p)) => format!("{g:.1} ({p:.0}% of read)"),
            (Some(g), _) => format!("{g:.1}"),
            _ => String::new(),
        };
        let read = r.read_gb_s.map_or(String::new(), |g| format!("{g:.1}"));
        let rate = format!("{:.2} ± {:.2}", r.tok_s, r.sd);
        let handoff = r.handoff_ns.map_or(String::new(), |n| format!("{n:.0}"));
        println!(
            "| {:<8} | {:>4} | {:>7} | {:>16} | {:>10} | {:>20} | {:>10} | {:>10} |",
            r.test, seqs, r.threads, rate, ttft, gb, read, handoff
        );
    }
    print_phases(&phases);
    Ok(())
}

/// The --phases rows: one table per tgN test, thread count and number of
/// sequences. A table of several sequences gives the time of a step (a token
/// of each), which reads the weights once, as one sequence's token does.
fn print_phases(rows: &[&Row]) {
    let mut tests: Vec<(&str, usize, Option<usize>)> =
        rows.iter().map(|r| (r.test.as_str(), r.threads, r.sequences)).collect();
    tests.dedup();
    for (test, threads, sequences) in tests {
        let of: Vec<&&Row> =
            rows.iter().filter(|r| r.test == test && r.threads == threads && r.sequences == sequences).collect();
        // Microseconds per forward pass: a token of one sequence, or a step.
        let per_pass = |r: &Row| r.us_per_token.map(|us| us * sequences.unwrap_or(1) as f64);
        let total: f64 = of.iter().filter_map(|r| per_pass(r)).sum();
        let read = match (of.iter().find_map(|r| r.read_gb_s), of.iter().find_map(|r| r.read_by_section_gb_s)) {
            (Some(g), Some(s)) => {
                format!(", read ceiling {g:.1} GB/s in one pass, {s:.1} a section at a time ({:.0}%)", 100.0 * s / g)
            }
            (Some(g), None) => format!(", read ceiling {g:.1} GB/s"),
            _ => String::new(),
        };
        println!();
        let plural = if threads == 1 { "" } else { "s" };
        let (of_what, unit) = match sequences {
            Some(1) => ("1 sequence, ".to_string(), "µs/step "),
            Some(s) => (format!("{s} sequences together, "), "µs/step "),
            None => (String::new(), "µs/token"),
        };
        println!("phases of {test}, {of_what}{threads} thread{plural} (one more generation, timed per phase{read}):");
        println!("| phase     | {unit} |  share | serial µs | waiting µs |         weights GB/s |");
        println!("| {:-<9} | {:->8} | {:->6} | {:->9} | {:->10} | {:->20} |", "", "", "", "", "", "");
        let scale = sequences.unwrap_or(1) as f64;
        for r in of {
            let us = per_pass(r).unwrap_or(0.0);
            let share = if total > 0.0 { 100.0 * us / total } else { 0.0 };
            let gb = match (r.gb_s, r.read_pct) {
                (Some(g), Some(p)) => format!("{g:.1} ({p:.0}% of read)"),
                _ => String::new(),
            };
            let us_or_blank = |v: Option<f64>| v.map_or(String::new(), |v| format!("{:.1}", v * scale));
            let (serial, wait) = (us_or_blank(r.serial_us_per_token), us_or_blank(r.wait_us_per_token));
            let phase = r.phase.as_deref().unwrap_or("");
            println!("| {phase:<9} | {us:>8.1} | {share:>5.1}% | {serial:>9} | {wait:>10} | {gb:>20} |");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[7.0]), 7.0);
    }
}
