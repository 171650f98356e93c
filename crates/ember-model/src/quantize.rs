//! Writing a quantized model folder (`ember quantize`): the weight matrices
//! in ember's INT8/INT4 blocks, everything else as stored, plus the config
//! and tokenizer files, so the folder loads like any other, instantly and
//! memory-mapped.
//!
//! A quantized matrix is stored as a `U8` tensor of shape `[rows, bytes per
//! row]` under its usual name, and the file's metadata maps
//! `ember.quant.<name>` to its format (`int8` / `int4`).

use crate::error::{Error, Result};
use crate::qwen2::Qwen2;
use crate::weights::{quant_key, safetensors_dtype, write_safetensors, Tensor, TensorStore};
use std::collections::BTreeMap;
use std::path::Path;

/// Small files copied next to the weights when present.
const COPIED: [&str; 7] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
];

/// Writes `model` (quantized in memory) to `out`: every tensor of `store` (the
/// folder it was loaded from), the quantized ones replaced by their blocks.
pub fn write_folder(src: &Path, store: &TensorStore, model: &Qwen2, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let mut quantized = held_tensors(model);
    quantized.retain(|_, t| t.dtype.is_quantized());
    let originals = stored_tensors(store)?;
    let mut tensors = Vec::new();
    let mut metadata = BTreeMap::new();
    metadata.insert("format".to_string(), "pt".to_string());
    for t in &originals {
        match quantized.get(&t.name) {
            Some(q) => {
                let format = q.dtype;
                let rows = q.shape[0];
                let row_bytes = q.size_bytes() / rows;
                metadata.insert(quant_key(&t.name), format.name().to_string());
                tensors.push((t.name.clone(), "U8".into(), vec![rows, row_bytes], q.as_bytes()));
            }
            None if t.dtype.is_quantized() => {
                // Already quantized in the source folder: keep its format.
                metadata.insert(quant_key(&t.name), t.dtype.name().to_string());
                let rows = t.shape[0];
                tensors.push((t.name.clone(), "U8".into(), vec![rows, t.size_bytes() / rows], t.as_bytes()));
            }
            None => tensors.push((t.name.clone(), safetensors_dtype(t.dtype), t.shape.clone(), t.as_bytes())),
        }
    }
    write_safetensors(&out.join("model.safetensors"), &tensors, &metadata)?;
    for f in COPIED {
        let from = src.join(f);
        if from.is_file() {
            std::fs::copy(&from, out.join(f)).map_err(|e| Error::io(&from, e))?;
        }
    }
    Ok(())
}

/// The tensors `model` holds by name: each layer's matrices, the embedding
/// and the LM head (quantized in memory, or as loaded).
pub(crate) fn held_tensors(model: &Qwen2) -> BTreeMap<String, &Tensor> {
    let mut held = BTreeMap::new();
    for l in &model.layers {
        for p in l.matrices() {
            held.insert(p.weight.name.clone(), &p.weight);
        }
    }
    held.insert(model.embed_tokens.name.clone(), &model.embed_tokens);
    held.insert(model.lm_head.name.clone(), &model.lm_head);
    held
}

/// Every tensor of `store`, in name order.
pub(crate) fn stored_tensors(store: &TensorStore) -> Result<Vec<Tensor>> {
    let mut names: Vec<&str> = store.names().collect();
    names.sort();
    names.iter().map(|n| store.get_any(n)).collect()
}
