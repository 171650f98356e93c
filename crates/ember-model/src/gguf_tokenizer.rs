//! A GGUF file's tokenizer as the `tokenizer.json` HuggingFace's tokenizers
//! library reads: llama.cpp's converter writes the vocabulary, merges and
//! token types of the original `tokenizer.json` into `tokenizer.ggml.*`
//! keys and names its pre-tokenizer (`tokenizer.ggml.pre`); this puts them
//! back together.

use crate::error::Result;
use crate::gguf::{Array, Gguf, Value};
use serde_json::{json, Value as Json};

/// llama.cpp's token types (`llama_token_type`): normal, control (special
/// tokens such as `<|im_end|>`), user-defined (added tokens that are not
/// special, such as Qwen2.5's `<tool_call>`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The pre-tokenizer of Qwen2's `tokenizer.json` (`tokenizer.ggml.pre` =
/// `qwen2`): its split regex, then byte-level mapping without a regex of its
/// own.
fn qwen2_pre_tokenizer() -> Json {
    json!({
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"},
                "behavior": "Isolated",
                "invert": false
            },
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
        ]
    })
}

fn strings<'a>(g: &'a Gguf, key: &str) -> Result<&'a [String]> {
    match g.get(key).and_then(Value::as_array) {
        Some(Array::String(v)) => Ok(v),
        Some(_) => Err(g.err(format!("`{key}` is not an array of strings"))),
        None => Err(g.err(format!("metadata key `{key}` is missing"))),
    }
}

fn token_id(g: &Gguf, key: &str, vocab: usize) -> Result<Option<u32>> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64().filter(|&id| id < vocab as u64) {
            Some(id) => Ok(Some(id as u32)),
            None => Err(g.err(format!("`{key}` is {v:?}, not a token id below {vocab}"))),
        },
    }
}

/// The `tokenizer.json` of `g`.
pub(crate) fn tokenizer_json(g: &Gguf) -> Result<Json> {
    let model = g.get("tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("(none)");
    if model != "gpt2" {
        return Err(g.err(format!(
            "tokenizer.ggml.model is \"{model}\"; ember builds byte-level BPE tokenizers (\"gpt2\") only"
        )));
    }
    let pre = g.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("(none)");
    let pre_tokenizer = match pre {
        "qwen2" => qwen2_pre_tokenizer(),
        other => {
            return Err(
                g.err(format!("tokenizer.ggml.pre is \"{other}\"; ember knows the pre-tokenizer \"qwen2\" only"))
            )
        }
    };
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let merges = strings(g, "tokenizer.ggml.merges")?;
    let types = match g.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
        None => vec![1; tokens.len()],
        Some(a) => a.to_i64_vec().ok_or_else(|| g.err("`tokenizer.ggml.token_type` is not an array of integers"))?,
    };
    if types.len() != tokens.len() {
        return Err(g.err(format!(
            "`tokenizer.ggml.token_type` has {} entries for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
        if vocab.insert(t.clone(), id.into()).is_some() {
            return Err(g.err(format!("token {t:?} appears twice in `tokenizer.ggml.tokens`")));
        }
        if ty == CONTROL || ty == USER_DEFINED {
            added.push(json!({
                "id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": ty == CONTROL,
            }));
        }
    }
    let add_bos = g.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(false);
    let bos = token_id(g, "tokenizer.ggml.bos_token_id", tokens.len())?;
    let post_processor = match (add_bos, bos) {
        (true, Some(id)) => {
            let t = &tokens[id as usize];
            json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": t, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": t, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {t.clone(): {"id": t, "ids": [id], "tokens": [t]}}
            })
        }
        _ => Json::Null,
    };
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        }
    }))
}

/// `bos_token`, `eos_token`, ... for the chat template: the texts of the ids
/// the file names.
pub(crate) fn special_tokens(g: &Gguf) -> Vec<(String, String)> {
    let Ok(tokens) = strings(g, "tokenizer.ggml.tokens") else { return Vec::new() };
    let mut out = Vec::new();
    for (name, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ] {
        if let Ok(Some(id)) = token_id(g, key, tokens.len()) {
            out.push((name.to_string(), tokens[id as usize].clone()));
        }
    }
    out
}
