//! The fetched GGUF turned into the HuggingFace folder transformers reads
//! (`model.safetensors` in BF16 and `config.json`), by ember's own GGUF
//! reader and dequantizers: no Python, no venv.
//!
//! The output is byte for byte what `../shared/models/gguf2hf.py` writes with
//! the `gguf` Python package (its SHA-256 sums are the check), so every rule
//! here is that script's:
//!
//! - each tensor is dequantized to f32 (ggml's `dequantize_row_*`, which is
//!   what ember's format rows implement) and rounded to BF16, nearest even;
//! - the file carries the tied embedding twice (`token_embd` in Q5_0, `output`
//!   in Q8_0); the Q8_0 copy is the more precise one, so it becomes
//!   `model.embed_tokens.weight` and the folder has no `lm_head`, exactly like
//!   Qwen2.5-0.5B-Instruct;
//! - tensors are stored in name order, the safetensors header is compact JSON
//!   (tensor entries in name order with keys `dtype`, `shape`,
//!   `data_offsets`, then `__metadata__` `{"format":"pt"}`), padded with
//!   spaces to a multiple of 8;
//! - `config.json` is Python's `json.dump(indent=2)` of a fixed set of keys,
//!   floats in Python's `repr`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use ember_kernels::{bf16, MatRef, Weights};
use ember_model::advanced::gguf::{hf_name, Gguf, TensorInfo, Value};

/// Writes `model.safetensors` and `config.json` for the GGUF at `gguf` into
/// the existing directory `out`.
pub fn gguf_to_hf(gguf: &Path, out: &Path) -> Result<()> {
    let g = Gguf::open(gguf).with_context(|| format!("cannot read {}", gguf.display()))?;
    let tensors = hf_tensors(&g)?;
    write_safetensors(&g, &tensors, &out.join("model.safetensors"))?;
    let config = config_json(&g, &tensors)?;
    std::fs::write(out.join("config.json"), config)
        .with_context(|| format!("cannot write {}", out.join("config.json").display()))
}

/// The tensors to write, by their HuggingFace names (sorted).
fn hf_tensors(g: &Gguf) -> Result<BTreeMap<String, &TensorInfo>> {
    let mut tensors = BTreeMap::new();
    for t in &g.header.tensors {
        let name = match t.name.as_str() {
            // The Q8_0 `output.weight` is the better copy of the tied matrix.
            "token_embd.weight" => continue,
            "output.weight" => "model.embed_tokens.weight".to_string(),
            other => hf_name(other),
        };
        if !name.starts_with("model.") {
            bail!("unexpected tensor `{}` in {}", t.name, g.path.display());
        }
        if tensors.insert(name.clone(), t).is_some() {
            bail!("two tensors of {} are both `{name}`", g.path.display());
        }
    }
    if !tensors.contains_key("model.embed_tokens.weight") {
        bail!("{} has no `output.weight` to take the embedding from", g.path.display());
    }
    Ok(tensors)
}

/// The safetensors header: compact JSON in the reference script's order,
/// space-padded so the data starts 8-aligned.
fn safetensors_header(tensors: &BTreeMap<String, &TensorInfo>) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, t) in tensors {
        let end = offset + t.shape().iter().product::<usize>() * 2;
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": "BF16", "shape": t.shape(), "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut blob = serde_json::to_vec(&serde_json::Value::Object(header)).expect("plain JSON");
    blob.resize(blob.len().next_multiple_of(8), b' ');
    blob
}

/// Streams every tensor, dequantized row by row and rounded to BF16, into a
/// safetensors file at `path` (written whole to `path`, the caller renames).
fn write_safetensors(g: &Gguf, tensors: &BTreeMap<String, &TensorInfo>, path: &Path) -> Result<()> {
    let io = |e: std::io::Error| anyhow::Error::new(e).context(format!("cannot write {}", path.display()));
    let mut file = BufWriter::with_capacity(1 << 20, File::create(path).map_err(io)?);
    let header = safetensors_header(tensors);
    file.write_all(&(header.len() as u64).to_le_bytes()).map_err(io)?;
    file.write_all(&header).map_err(io)?;

    let mut row = Vec::new();
    let mut bits = Vec::new();
    for t in tensors.values() {
        let ty =
            t.ty.weight_type()
                .with_context(|| format!("`{}` has type {}, which ember cannot read", t.name, t.ty.name()))?;
        let weights = Weights::from_bytes(ty, g.tensor_bytes(t))
            .with_context(|| format!("`{}`'s data does not fit its type {}", t.name, t.ty.name()))?;
        let shape = t.shape();
        let cols = *shape.last().unwrap_or(&1);
        let rows = shape.iter().product::<usize>() / cols.max(1);
        let matrix = MatRef::new(weights, rows, cols);
        row.resize(cols, 0.0f32);
        bits.resize(cols, 0u16);
        for r in 0..rows {
            matrix.row_to_f32(r, &mut row);
            for (b, v) in bits.iter_mut().zip(&row) {
                *b = bf16::from_f32(*v).to_bits();
            }
            file.write_all(bytemuck::cast_slice(&bits)).map_err(io)?;
        }
    }
    file.flush().map_err(io)
}

/// `config.json` as the reference script writes it.
fn config_json(g: &Gguf, tensors: &BTreeMap<String, &TensorInfo>) -> Result<String> {
    let int = |key: &str| -> Result<String> {
        match g.get(key).and_then(Value::as_u64) {
            Some(v) => Ok(v.to_string()),
            None => bail!("{}: metadata key `{key}` is missing or not an integer", g.path.display()),
        }
    };
    let float = |key: &str| -> Result<f64> {
        match g.get(key) {
            // The script reads f32 keys through numpy's float32, which widens
            // exactly, as `as_f64` does.
            Some(v) => v.as_f64().with_context(|| format!("metadata key `{key}` is {v:?}, not a number")),
            None => bail!("{}: metadata key `{key}` is missing", g.path.display()),
        }
    };
    let vocab = tensors["model.embed_tokens.weight"].shape()[0];
    let entries: Vec<(&str, String)> = vec![
        ("architectures", "[\n    \"Qwen2ForCausalLM\"\n  ]".into()),
        ("model_type", "\"qwen2\"".into()),
        ("hidden_size", int("qwen2.embedding_length")?),
        ("intermediate_size", int("qwen2.feed_forward_length")?),
        ("num_hidden_layers", int("qwen2.block_count")?),
        ("num_attention_heads", int("qwen2.attention.head_count")?),
        ("num_key_value_heads", int("qwen2.attention.head_count_kv")?),
        ("rms_norm_eps", python_float(float("qwen2.attention.layer_norm_rms_epsilon")?)),
        ("rope_theta", python_float(float("qwen2.rope.freq_base")?)),
        ("max_position_embeddings", int("qwen2.context_length")?),
        ("vocab_size", vocab.to_string()),
        ("tie_word_embeddings", "true".into()),
        ("hidden_act", "\"silu\"".into()),
        ("torch_dtype", "\"bfloat16\"".into()),
        ("bos_token_id", "151643".into()),
        ("eos_token_id", "151645".into()),
        ("attention_dropout", "0.0".into()),
        ("initializer_range", "0.02".into()),
        ("max_window_layers", "21".into()),
        ("sliding_window", "32768".into()),
        ("use_sliding_window", "false".into()),
        ("use_cache", "true".into()),
    ];
    let body: Vec<String> = entries.iter().map(|(k, v)| format!("  \"{k}\": {v}")).collect();
    Ok(format!("{{\n{}\n}}", body.join(",\n")))
}

/// A float as Python's `repr` prints it: the shortest digits that round-trip,
/// positional for exponents from -4 to 15 (with `.0` when integral),
/// scientific otherwise with a signed exponent of at least two digits.
fn python_float(v: f64) -> String {
    if !v.is_finite() {
        return if v.is_nan() {
            "NaN".into()
        } else if v > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if v == 0.0 {
        return if v.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // `{:e}` gives the shortest round-trip digits: `d.ddddde±x`.
    let sci = format!("{:e}", v.abs());
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if v < 0.0 { "-" } else { "" };
    let text = if (-4..16).contains(&exp) {
        if exp < 0 {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        } else {
            let point = exp as usize + 1;
            if digits.len() <= point {
                format!("{digits}{}.0", "0".repeat(point - digits.len()))
            } else {
                format!("{}.{}", &digits[..point], &digits[point..])
            }
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let mantissa = if rest.is_empty() { first.to_string() } else { format!("{first}.{rest}") };
        format!("{mantissa}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    };
    format!("{sign}{text}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        let cases = [
            (1e-6, "1e-06"),
            (f64::from(1e-6f32), "9.999999974752427e-07"),
            (1_000_000.0, "1000000.0"),
            (10000.0, "10000.0"),
            (0.02, "0.02"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5, "1.5"),
            (123.456, "123.456"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (-2.5e-7, "-2.5e-07"),
            (0.0, "0.0"),
            (1e100, "1e+100"),
        ];
        for (v, want) in cases {
            assert_eq!(python_float(v), want, "{v:e}");
        }
    }
}
