//! Writing a GGUF file (`ember quantize --out FILE.gguf`): a model folder
//! quantized in memory, as llama.cpp and ember both load it.
//!
//! ember's INT8 blocks are ggml's Q8_0 byte for byte
//! ([`GgmlType::weight_type`]), so each such matrix is written as it is
//! held, with ember's per-tensor choice of precision (INT4's policy gives
//! some matrices INT8 and INT5: Q8_0 and Q5_0 tensors of a Q4_0 file).
//! INT4's and INT5's blocks are four Q4_0 or Q5_0 blocks in value, laid
//! out for ember's kernels; they are written as those blocks, without loss. Matrices
//! ember kept in their stored precision stay BF16, F16 or F32; vectors
//! (norms, biases) are written as F32, as llama.cpp's converter writes them.
//!
//! The metadata is what llama.cpp's converter writes for Qwen2: the
//! `qwen2.*` hyperparameters from `config.json`, and the tokenizer as
//! `tokenizer.ggml.*` from `tokenizer.json` (tokens in their byte-level
//! spelling, the vocabulary padded to the embedding's rows with `[PADn]`
//! tokens of type unused, added tokens as control or user-defined, merges)
//! and `tokenizer_config.json` (special ids, chat template).

use crate::error::{Error, Result};
use crate::gguf::{gguf_name, GgmlType, DEFAULT_ALIGNMENT};
use crate::quantize::{held_tensors, stored_tensors};
use crate::qwen2::Qwen2;
use crate::weights::TensorStore;
use ember_kernels::formats::{BlockQ4, BlockQ5};
use ember_kernels::WeightType;
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// GGUF metadata value types (the format's numbering).
const U32: u32 = 4;
const I32: u32 = 5;
const F32: u32 = 6;
const BOOL: u32 = 7;
const STRING: u32 = 8;
const ARRAY: u32 = 9;

/// llama.cpp's token types.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

/// One metadata value, as written.
enum Meta {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strings(Vec<String>),
    I32s(Vec<i32>),
}

/// Bytes of a GGUF file being built: little-endian numbers, strings as a
/// u64 length then UTF-8.
#[derive(Default)]
struct Bytes(Vec<u8>);

impl Bytes {
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
    }
    /// An array value's type, element type and length.
    fn array(&mut self, element: u32, len: usize) {
        self.u32(ARRAY);
        self.u32(element);
        self.u64(len as u64);
    }
    fn meta(&mut self, key: &str, value: &Meta) {
        self.str(key);
        match value {
            Meta::U32(v) => {
                self.u32(U32);
                self.u32(*v);
            }
            Meta::F32(v) => {
                self.u32(F32);
                self.0.extend_from_slice(&v.to_le_bytes());
            }
            Meta::Bool(v) => {
                self.u32(BOOL);
                self.0.push(*v as u8);
            }
            Meta::Str(s) => {
                self.u32(STRING);
                self.str(s);
            }
            Meta::Strings(v) => {
                self.array(STRING, v.len());
                for s in v {
                    self.str(s);
                }
            }
            Meta::I32s(v) => {
                self.array(I32, v.len());
                for x in v {
                    self.0.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
    }
}

/// A tensor to write: its GGUF name, type, dimensions (columns first) and data.
struct Out<'a> {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    data: std::borrow::Cow<'a, [u8]>,
}

/// The ggml type holding `dtype`'s bytes as they are.
fn ggml_type(dtype: WeightType, name: &str, path: &Path) -> Result<GgmlType> {
    (0..=39).map(GgmlType).find(|t| t.weight_type() == Some(dtype)).ok_or_else(|| Error::Gguf {
        path: path.into(),
        message: format!("tensor `{name}`: no GGUF type holds {dtype}"),
    })
}

/// Writes `model` (quantized in memory, loaded from the folder `src` whose
/// tensors `store` holds) as the GGUF file `out`. `file_type` is
/// `general.file_type` (llama.cpp's `LLAMA_FTYPE_*`: 7 for mostly Q8_0, 2
/// for mostly Q4_0).
pub fn write_gguf(src: &Path, store: &TensorStore, model: &Qwen2, file_type: u32, out: &Path) -> Result<()> {
    let held = held_tensors(model);
    let originals = stored_tensors(store)?;
    let mut tensors = Vec::new();
    for t in &originals {
        let t = held.get(&t.name).copied().unwrap_or(t);
        let dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
        let name = gguf_name(&t.name);
        let (ty, data) = if t.shape.len() == 1 {
            let v = t.to_f32_vec();
            (GgmlType(0), std::borrow::Cow::Owned(bytemuck::cast_slice::<f32, u8>(&v).to_vec()))
        } else if t.dtype == WeightType::Int4 {
            // No ggml type holds INT4's layout; each of its sub-blocks is a
            // Q4_0 block in value, so it is written as Q4_0 without loss.
            (ggml_type(WeightType::Q4_0, &t.name, out)?, std::borrow::Cow::Owned(BlockQ4::q4_0_bytes(t.as_bytes())))
        } else if t.dtype == WeightType::Int5 {
            // Likewise INT5, as Q5_0.
            (ggml_type(WeightType::Q5_0, &t.name, out)?, std::borrow::Cow::Owned(BlockQ5::q5_0_bytes(t.as_bytes())))
        } else {
            // The file's layout, gathered where the model stored a matrix in
            // column parts.
            (ggml_type(t.dtype, &t.name, out)?, t.row_major_bytes())
        };
        tensors.push(Out { name, ty, dims, data });
    }

    let mut meta = hyperparameters(model, src, file_type);
    meta.extend(tokenizer(src, model)?);

    let mut b = Bytes::default();
    b.0.extend_from_slice(b"GGUF");
    b.u32(3);
    b.u64(tensors.len() as u64);
    b.u64(meta.len() as u64);
    for (k, v) in &meta {
        b.meta(k, v);
    }
    let align = DEFAULT_ALIGNMENT;
    let mut offset = 0u64;
    for t in &tensors {
        b.str(&t.name);
        b.u32(t.dims.len() as u32);
        for &d in &t.dims {
            b.u64(d);
        }
        b.u32(t.ty.0);
        b.u64(offset);
        offset = (offset + t.data.len() as u64).next_multiple_of(align);
    }
    let header = b.0.len().next_multiple_of(align as usize);
    b.0.resize(header, 0);

    let tmp = out.with_extension("gguf.partial");
    let write = || -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        f.write_all(&b.0)?;
        for t in &tensors {
            f.write_all(&t.data)?;
            let pad = (t.data.len() as u64).next_multiple_of(align) - t.data.len() as u64;
            f.write_all(&vec![0u8; pad as usize])?;
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, out)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(out, e)
    })
}

/// `general.*` and `qwen2.*`.
fn hyperparameters(model: &Qwen2, src: &Path, file_type: u32) -> Vec<(String, Meta)> {
    let c = &model.config;
    let name = src.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned());
    let u = |v: usize| Meta::U32(v as u32);
    vec![
        ("general.architecture".into(), Meta::Str("qwen2".into())),
        ("general.type".into(), Meta::Str("model".into())),
        ("general.name".into(), Meta::Str(name)),
        ("general.file_type".into(), Meta::U32(file_type)),
        ("general.quantization_version".into(), Meta::U32(2)),
        ("qwen2.block_count".into(), u(c.num_hidden_layers)),
        ("qwen2.context_length".into(), u(c.max_position_embeddings)),
        ("qwen2.embedding_length".into(), u(c.hidden_size)),
        ("qwen2.feed_forward_length".into(), u(c.intermediate_size)),
        ("qwen2.attention.head_count".into(), u(c.num_attention_heads)),
        ("qwen2.attention.head_count_kv".into(), u(c.num_key_value_heads)),
        ("qwen2.rope.freq_base".into(), Meta::F32(c.rope_theta)),
        ("qwen2.attention.layer_norm_rms_epsilon".into(), Meta::F32(c.rms_norm_eps)),
    ]
}

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|source| Error::Json { path: path.into(), source })
}

/// `tokenizer.ggml.*` and `tokenizer.chat_template` from the folder's
/// `tokenizer.json` and `tokenizer_config.json`.
fn tokenizer(src: &Path, model: &Qwen2) -> Result<Vec<(String, Meta)>> {
    let path = src.join("tokenizer.json");
    let bad = |message: String| Error::Tokenizer { path: path.clone(), message };
    let json = read_json(&path)?;
    if json["model"]["type"].as_str() != Some("BPE") {
        return Err(bad("only BPE tokenizers are written to GGUF".into()));
    }
    let vocab = json["model"]["vocab"].as_object().ok_or_else(|| bad("no model.vocab".into()))?;
    let rows = model.config.vocab_size;
    let mut tokens: Vec<Option<String>> = vec![None; rows];
    let mut types = vec![UNUSED; rows];
    let mut ids: BTreeMap<String, u32> = BTreeMap::new();
    let mut put = |id: u64, text: &str, ty: i32| -> Result<()> {
        let slot = tokens
            .get_mut(id as usize)
            .ok_or_else(|| bad(format!("token {text:?} has id {id}, past the embedding's {rows} rows")))?;
        *slot = Some(text.to_string());
        types[id as usize] = ty;
        ids.insert(text.to_string(), id as u32);
        Ok(())
    };
    for (text, id) in vocab {
        put(id.as_u64().ok_or_else(|| bad(format!("token {text:?} has no integer id")))?, text, NORMAL)?;
    }
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(text)) = (added["id"].as_u64(), added["content"].as_str()) else {
            return Err(bad("an added token without id or content".into()));
        };
        put(id, text, if added["special"].as_bool() == Some(true) { CONTROL } else { USER_DEFINED })?;
    }
    let tokens: Vec<String> =
        tokens.into_iter().enumerate().map(|(i, t)| t.unwrap_or_else(|| format!("[PAD{i}]"))).collect();
    // Merges are "a b" strings (older files) or ["a", "b"] pairs.
    let merges = json["model"]["merges"]
        .as_array()
        .ok_or_else(|| bad("no model.merges".into()))?
        .iter()
        .map(|m| match m {
            Json::String(s) => Some(s.clone()),
            Json::Array(p) => match &p[..] {
                [Json::String(a), Json::String(b)] => Some(format!("{a} {b}")),
                _ => None,
            },
            _ => None,
        })
        .collect::<Option<Vec<String>>>()
        .ok_or_else(|| bad("a merge is neither \"a b\" nor [a, b]".into()))?;

    let config_path = src.join("tokenizer_config.json");
    let config = if config_path.is_file() { read_json(&config_path)? } else { Json::Null };
    // A special token given as its text or as {"content": text}.
    let special = |key: &str| -> Option<u32> {
        let v = &config[key];
        let text = v.as_str().or_else(|| v["content"].as_str())?;
        ids.get(text).copied()
    };
    let eos = special("eos_token").or_else(|| model.config.eos_token_ids.first().copied());
    let pad = special("pad_token");
    let bos = special("bos_token").or(model.config.bos_token_id);

    let mut meta = vec![
        ("tokenizer.ggml.model".into(), Meta::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Meta::Str("qwen2".into())),
        ("tokenizer.ggml.tokens".into(), Meta::Strings(tokens)),
        ("tokenizer.ggml.token_type".into(), Meta::I32s(types)),
        ("tokenizer.ggml.merges".into(), Meta::Strings(merges)),
    ];
    for (key, id) in [("eos", eos), ("padding", pad), ("bos", bos)] {
        if let Some(id) = id {
            meta.push((format!("tokenizer.ggml.{key}_token_id"), Meta::U32(id)));
        }
    }
    meta.push(("tokenizer.ggml.add_bos_token".into(), Meta::Bool(config["add_bos_token"].as_bool().unwrap_or(false))));
    if let Some(template) = config["chat_template"].as_str() {
        meta.push(("tokenizer.chat_template".into(), Meta::Str(template.into())));
    }
    Ok(meta)
}
