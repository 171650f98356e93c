//! `ember quantize`: writes a quantized copy of a model folder that loads
//! instantly (memory-mapped, no quantization at load): a folder, or with
//! `--out FILE.gguf` a GGUF file llama.cpp runs too.

use crate::{init_threads, model_dir};
use anyhow::{bail, Context, Result};
use ember_model::advanced::{load_qwen2, TensorStore};
use ember_model::{Config, WeightType};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model folder (HF layout). Default: the folder `cargo xtask fetch` fills.
    #[arg(short, long)]
    model: Option<PathBuf>,

    /// `int8`, `int4` or `int5` (with `int4`, the embedding / LM head and o
    /// get INT5, k, v and down INT8: the measured mix).
    #[arg(long, value_parser = crate::runtime::parse_quant)]
    quant: WeightType,

    /// The folder to write (created; must not be the model folder), or a
    /// file ending in `.gguf`: a GGUF file (INT8 matrices as Q8_0, INT4 as
    /// Q4_0, INT5 as Q5_0) that ember and llama.cpp both run.
    #[arg(long)]
    out: PathBuf,

    /// Worker threads (default: the number of physical CPU cores).
    #[arg(short, long)]
    threads: Option<usize>,
}

pub fn run(args: Args) -> Result<()> {
    init_threads(args.threads)?;
    let dir = model_dir(args.model.clone())?;
    if dir.is_file() || is_gguf(&dir) {
        bail!(
            "`ember quantize` reads a safetensors model folder, not the file {} (quantizing from a GGUF file is \
             not supported yet; llama.cpp's `llama-quantize` converts between GGUF types, and ember runs the \
             result with --model FILE.gguf)",
            dir.display()
        );
    }
    if args.out.exists() && std::fs::canonicalize(&args.out).ok() == std::fs::canonicalize(&dir).ok() {
        bail!("--out must be another folder than the model's");
    }
    writable_beside(&args.out)?;
    let start = Instant::now();
    Config::from_file(&dir.join("config.json")).with_context(|| format!("reading {}", dir.display()))?;
    let mut model = load_qwen2(&dir).with_context(|| format!("loading the model in {}", dir.display()))?;
    model.quantize(&crate::runtime::quant_policy(args.quant)?)?;
    let quantized = start.elapsed();
    let store = TensorStore::open_dir(&dir)?;
    let gguf = is_gguf(&args.out);
    if gguf {
        // llama.cpp's LLAMA_FTYPE_MOSTLY_Q8_0 and _Q4_0.
        let file_type = if args.quant == WeightType::Int4 { 2 } else { 7 };
        ember_model::advanced::quantize::write_gguf(&dir, &store, &model, file_type, &args.out)
    } else {
        ember_model::advanced::quantize::write_folder(&dir, &store, &model, &args.out)
    }
    .with_context(|| format!("writing {}", args.out.display()))?;
    let file = if gguf { args.out.clone() } else { args.out.join("model.safetensors") };
    let size = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "quantized to {} in {:.1} s, written in {:.1} s: {} ({:.0} MB)",
        args.quant.name(),
        quantized.as_secs_f64(),
        (start.elapsed() - quantized).as_secs_f64(),
        args.out.display(),
        size as f64 / 1e6
    );
    println!("{}", args.out.display());
    Ok(())
}

/// Fails at once, before seconds of quantizing, when nothing can be written
/// where `out` goes: its parent folder is made if missing and a probe file
/// created there and removed.
fn writable_beside(out: &std::path::Path) -> Result<()> {
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let fail = |e: std::io::Error| anyhow::anyhow!("cannot write {}: {e}", out.display());
    std::fs::create_dir_all(&parent).map_err(fail)?;
    let probe = parent.join(format!(".ember-write-probe-{}", std::process::id()));
    std::fs::File::create(&probe).map_err(fail)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Whether `path` names a GGUF file (by its extension).
fn is_gguf(path: &std::path::Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}
