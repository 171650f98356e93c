//! Writing a quantized model folder (`ember quantize`): the weight matrices
//! in ember's INT8/INT4/INT5 blocks, everything else as stored, plus the config
//! and tokenizer files, so the folder loads like any other, instantly and
//! memory-mapped.
//!
//! A quantized matrix is stored as a `U8` tensor of shape `[rows, bytes per
//! row]` under its usual name, and the file's metadata maps
//! `ember.quant.<name>` to its format (`int8` / `int4` / `int5`), and
//! `ember.int4` to `128` ([`crate::weights::INT4_LAYOUT_KEY`]: INT4's blocks
//! are 128 weights; files without it are from before, their `int4` Q4_0).

use crate::error::{Error, Result};
use crate::qwen2::Qwen2;
use crate::weights::{
    quant_key, safetensors_dtype, write_safetensors, Tensor, TensorStore, INT4_LAYOUT, INT4_LAYOUT_KEY,
};
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
///
/// The source is never written: everything goes into a new folder beside
/// `out` (so files of `out` that are links to the source's, hard or
/// symbolic, are never written through), which replaces `out` only when
/// complete; on any error it is removed and `out` is as it was. An `out`
/// that is the source folder, or contains it, is refused. Nothing of an
/// earlier `out` (such as a stale `model.safetensors.index.json`) remains.
pub fn write_folder(src: &Path, store: &TensorStore, model: &Qwen2, out: &Path) -> Result<()> {
    let refuse = |message: String| Error::ModelPath { path: out.to_path_buf(), message };
    let src_real = std::fs::canonicalize(src).map_err(|e| Error::io(src, e))?;
    if let Ok(out_real) = std::fs::canonicalize(out) {
        if src_real.starts_with(&out_real) {
            return Err(refuse(format!(
                "the output folder is (or contains) the model folder {}; choose another",
                src.display()
            )));
        }
        if !out_real.is_dir() {
            return Err(refuse("exists and is not a folder".into()));
        }
    }
    let name = out.file_name().ok_or_else(|| refuse("needs a folder name".into()))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
    let tmp = parent.join(format!(".{}.partial-{}", name.to_string_lossy(), std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let written = write_files(src, store, model, &tmp).and_then(|()| replace_dir(&tmp, out));
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written
}

/// Puts the complete folder `new` in place of `out` (which may not exist):
/// the old one moves aside, the new one takes its name, the old one is
/// removed (its links go, never what they point to).
fn replace_dir(new: &Path, out: &Path) -> Result<()> {
    let exists = std::fs::symlink_metadata(out).is_ok();
    if !exists {
        return std::fs::rename(new, out).map_err(|e| Error::io(out, e));
    }
    let aside = new.with_extension("old");
    let _ = std::fs::remove_dir_all(&aside);
    std::fs::rename(out, &aside).map_err(|e| Error::io(out, e))?;
    if let Err(e) = std::fs::rename(new, out) {
        // Put the old folder back.
        let _ = std::fs::rename(&aside, out);
        return Err(Error::io(out, e));
    }
    // A symlink to a folder is removed as a link; a folder's entries are
    // unlinked, not followed.
    let gone = match std::fs::symlink_metadata(&aside) {
        Ok(m) if m.file_type().is_symlink() => std::fs::remove_file(&aside),
        _ => std::fs::remove_dir_all(&aside),
    };
    gone.map_err(|e| Error::io(&aside, e))
}

/// The weights and the small files, into the empty folder `out`.
fn write_files(src: &Path, store: &TensorStore, model: &Qwen2, out: &Path) -> Result<()> {
    let mut quantized = held_tensors(model);
    quantized.retain(|_, t| !t.dtype.is_float());
    let originals = stored_tensors(store)?;
    let mut tensors = Vec::new();
    let mut metadata = BTreeMap::new();
    metadata.insert("format".to_string(), "pt".to_string());
    metadata.insert(INT4_LAYOUT_KEY.to_string(), INT4_LAYOUT.to_string());
    for t in &originals {
        match quantized.get(&t.name) {
            Some(q) => {
                let format = q.dtype;
                let rows = q.shape[0];
                let row_bytes = q.size_bytes() / rows;
                metadata.insert(quant_key(&t.name), format.name().to_string());
                tensors.push((t.name.clone(), "U8".into(), vec![rows, row_bytes], q.as_bytes()));
            }
            None if !t.dtype.is_float() => {
                // Already in blocks in the source folder: keep its format
                // (an INT4 folder from before 128-weight blocks: Q4_0).
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
            // Read and written anew (`fs::copy` too writes a new file here:
            // the folder is new, so no name in it is a link).
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
