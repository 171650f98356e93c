//! Fuzz targets of ember-model's inputs: safetensors headers and the shard
//! index, `config.json` and `generation_config.json`, the `ember.quant.*`
//! metadata of quantized folders, GGUF files, tokenizer input and chat
//! messages. Each target takes structured but hostile inputs (real files of
//! `testdata/tiny-chat` mutated field by field and byte by byte, random JSON,
//! arbitrary text and ids) through the public loading and running paths.
//!
//! The invariant of every target: no panic, no abort, no single allocation
//! above `FUZZ_ALLOC_LIMIT` (tests/fuzzing/mod.rs, which also says how the
//! environment sets the number of cases, a time budget and the seed). Where
//! a result can be checked it is: a model that loads holds exactly the
//! tensors it uses, shard names that load are plain file names, a tokenizer
//! round-trips ASCII text, a tool call written as Qwen writes it parses back.
//!
//! `cargo test` runs 128 cases per target; `cargo xtask fuzz` runs them
//! optimised, with overflow checks, for longer (`--list`, `--target`,
//! `--time`, `--cases`, `--seed`).

mod common;
mod fuzzing;

use ember_model::advanced::quantize::{write_folder, write_gguf};
use ember_model::advanced::{
    load_qwen2, BatchToken, ChatTemplate, QuantPolicy, Scratch as Buffers, TensorStore, TextStream,
};
use ember_model::{
    parse_tool_calls, Config, GenerateOptions, GenerationConfig, Message, Model, Role, Tokenizer, Tool, ToolCall,
    WeightType,
};
use fuzzing::hostile;
use proptest::prelude::*;
use serde_json::{json, Map, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

#[global_allocator]
static ALLOCATOR: fuzzing::Noting = fuzzing::Noting;

/// Cases per target under plain `cargo test` (CI runs the workspace tests
/// once per CPU tier, so this stays small; `cargo xtask fuzz` runs more).
const DEFAULT_CASES: u32 = 128;

fn tiny_chat() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tiny-chat")
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// Copies the files of `from` into the new folder `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
    }
}

/// A safetensors file as its header (in order) and its data.
#[derive(Clone)]
struct SafeFile {
    header: Map<String, Value>,
    data: Vec<u8>,
}

impl SafeFile {
    fn read(path: &Path) -> SafeFile {
        let bytes = std::fs::read(path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        SafeFile { header, data: bytes[8 + n..].to_vec() }
    }

    /// Tensor names, sorted.
    fn names(&self) -> Vec<String> {
        let mut n: Vec<String> = self.header.keys().filter(|k| *k != "__metadata__").cloned().collect();
        n.sort();
        n
    }

    /// The file's bytes: the header padded with spaces to a multiple of 8,
    /// then `pad` more.
    fn bytes(&self, pad: usize) -> Vec<u8> {
        let mut h = Value::Object(self.header.clone()).to_string().into_bytes();
        let len = h.len().next_multiple_of(8) + pad;
        h.resize(len, b' ');
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        out.extend(&self.data);
        out
    }
}

/// One edit of a safetensors header. Tensors are picked by an index into
/// the sorted names (modulo their count).
#[derive(Clone, Debug)]
enum HeaderEdit {
    Dtype(usize, String),
    Shape(usize, Vec<u64>),
    Offsets(usize, u64, u64),
    Shift(usize, i64),
    Remove(usize),
    Rename(usize, String),
    Duplicate(usize, String),
    Metadata(String, String),
    /// Spaces after the JSON: 1, 3, ... make the header length odd.
    Pad(usize),
}

const DTYPES: &[&str] = &[
    "F32", "F16", "BF16", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F64", "BOOL", "F8_E4M3", "F8_E5M2",
    "F4", "E8M0", "bf16", "Q4", "",
];

/// Tensor names a checkpoint might hold: the model's own, extra layers,
/// other architectures' and written oddly.
fn tensor_name() -> impl Strategy<Value = String> {
    let suffix = prop::sample::select(
        &[
            "input_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.q_proj.bias",
            "mlp.up_proj.weight",
            "self_attn.rotary_emb.inv_freq",
            "mlp.experts.0.up_proj.weight",
        ][..],
    );
    prop_oneof![
        (hostile::integer(), suffix.clone()).prop_map(|(n, s)| format!("model.layers.{n}.{s}")),
        (prop::sample::select(&["01", "+1", "-1", "1e0", " 1", ""][..]), suffix)
            .prop_map(|(n, s)| format!("model.layers.{n}.{s}")),
        prop::sample::select(&["lm_head.weight", "model.norm.weight", "model.embed_tokens.weight", "__metadata__"][..])
            .prop_map(String::from),
        hostile::string(),
    ]
}

fn header_edit() -> impl Strategy<Value = HeaderEdit> {
    let index = 0usize..64;
    prop_oneof![
        (index.clone(), prop::sample::select(DTYPES)).prop_map(|(i, d)| HeaderEdit::Dtype(i, d.into())),
        (index.clone(), prop::collection::vec(hostile::integer(), 0..4)).prop_map(|(i, s)| HeaderEdit::Shape(i, s)),
        (index.clone(), hostile::integer(), hostile::integer()).prop_map(|(i, a, b)| HeaderEdit::Offsets(i, a, b)),
        (index.clone(), prop_oneof![-8i64..8, Just(i64::MIN), Just(i64::MAX)])
            .prop_map(|(i, d)| HeaderEdit::Shift(i, d)),
        index.clone().prop_map(HeaderEdit::Remove),
        (index.clone(), tensor_name()).prop_map(|(i, n)| HeaderEdit::Rename(i, n)),
        (index.clone(), tensor_name()).prop_map(|(i, n)| HeaderEdit::Duplicate(i, n)),
        (
            prop_oneof![
                tensor_name().prop_map(|n| format!("ember.quant.{n}")),
                Just("format".to_string()),
                hostile::string()
            ],
            prop_oneof![
                prop::sample::select(&["int8", "int4", "q4_k", "bf16", "f32", "pt"][..]).prop_map(String::from),
                hostile::string()
            ]
        )
            .prop_map(|(k, v)| HeaderEdit::Metadata(k, v)),
        (0usize..16).prop_map(HeaderEdit::Pad),
    ]
}

/// Applies `edits` to `file`; returns the padding asked for.
fn apply_header(file: &mut SafeFile, edits: &[HeaderEdit]) -> usize {
    let mut pad = 0;
    for edit in edits {
        let names = file.names();
        let pick = |i: &usize| names.get(i % names.len().max(1)).cloned();
        match edit {
            HeaderEdit::Dtype(i, d) => {
                if let Some(n) = pick(i) {
                    file.header[&n]["dtype"] = d.as_str().into();
                }
            }
            HeaderEdit::Shape(i, s) => {
                if let Some(n) = pick(i) {
                    file.header[&n]["shape"] = json!(s);
                }
            }
            HeaderEdit::Offsets(i, a, b) => {
                if let Some(n) = pick(i) {
                    file.header[&n]["data_offsets"] = json!([a, b]);
                }
            }
            HeaderEdit::Shift(i, d) => {
                if let Some(n) = pick(i) {
                    let o = &mut file.header[&n]["data_offsets"];
                    if let (Some(a), Some(b)) = (o[0].as_u64(), o[1].as_u64()) {
                        *o = json!([a.wrapping_add_signed(*d), b.wrapping_add_signed(*d)]);
                    }
                }
            }
            HeaderEdit::Remove(i) => {
                if let Some(n) = pick(i) {
                    file.header.shift_remove(&n);
                }
            }
            HeaderEdit::Rename(i, to) => {
                if let Some(n) = pick(i) {
                    if let Some(v) = file.header.shift_remove(&n) {
                        file.header.insert(to.clone(), v);
                    }
                }
            }
            HeaderEdit::Duplicate(i, to) => {
                if let Some(n) = pick(i) {
                    let v = file.header[&n].clone();
                    file.header.insert(to.clone(), v);
                }
            }
            HeaderEdit::Metadata(k, v) => {
                let meta = file.header.entry("__metadata__").or_insert_with(|| json!({}));
                if let Some(m) = meta.as_object_mut() {
                    m.insert(k.clone(), v.as_str().into());
                }
            }
            HeaderEdit::Pad(p) => pad = *p,
        }
    }
    pad
}

/// One edit of a file's bytes; positions are taken modulo the length (the
/// `head` ones within the first 4 KB, where the headers are).
#[derive(Clone, Debug)]
enum ByteEdit {
    Flip { at: usize, bit: u8, head: bool },
    Put64 { at: usize, value: u64, head: bool },
    Truncate(usize),
    Insert { at: usize, bytes: Vec<u8> },
}

fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    prop_oneof![
        (any::<usize>(), 0u8..8, any::<bool>()).prop_map(|(at, bit, head)| ByteEdit::Flip { at, bit, head }),
        (any::<usize>(), hostile::integer(), any::<bool>()).prop_map(|(at, value, head)| ByteEdit::Put64 {
            at,
            value,
            head
        }),
        any::<usize>().prop_map(ByteEdit::Truncate),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 0..16))
            .prop_map(|(at, bytes)| ByteEdit::Insert { at, bytes }),
    ]
}

fn apply_bytes(b: &mut Vec<u8>, edits: &[ByteEdit]) {
    for edit in edits {
        if b.is_empty() {
            return;
        }
        let len = b.len();
        let pos = |at: usize, head: bool| at % if head { len.min(4096) } else { len };
        match edit {
            ByteEdit::Flip { at, bit, head } => {
                let i = pos(*at, *head);
                b[i] ^= 1 << bit;
            }
            ByteEdit::Put64 { at, value, head } => {
                let i = pos(*at, *head);
                let end = (i + 8).min(b.len());
                b[i..end].copy_from_slice(&value.to_le_bytes()[..end - i]);
            }
            ByteEdit::Truncate(at) => {
                let n = at % (b.len() + 1);
                b.truncate(n);
            }
            ByteEdit::Insert { at, bytes } => {
                let i = at % (b.len() + 1);
                b.splice(i..i, bytes.iter().copied());
            }
        }
    }
}

/// Two tokens through the decoder: the tensors a loaded model holds are
/// usable (lengths, alignment), whatever their values.
fn forward(m: &ember_model::advanced::Qwen2) {
    let mut cache = m.new_cache(4);
    let batch =
        [BatchToken { token: 1, seq: 0, pos: 0, logits: true }, BatchToken { token: 2, seq: 0, pos: 1, logits: true }];
    m.forward(&batch, &mut [&mut cache], &mut Buffers::default()).expect("a loaded model runs");
}

/// Generates from `prompt` until done or the first error (an error is a
/// fine outcome; a panic is not).
fn generate(model: &std::sync::Arc<Model>, prompt: &[u32], options: GenerateOptions) {
    if let Ok(g) = model.session().into_generation(prompt, options) {
        for t in g {
            if t.is_err() {
                break;
            }
        }
    }
}

/// Every tensor of a store that opens reads as its type says, without panics.
fn read_all(store: &TensorStore) {
    let mut names: Vec<String> = store.names().map(String::from).collect();
    names.sort();
    for n in names {
        if let Ok(t) = store.get_any(&n) {
            let w = t.weights();
            assert_eq!(w.bytes(), t.size_bytes(), "{n}");
            if t.shape.len() == 2 {
                let _ = t.matrix();
            }
        }
    }
}

#[derive(Clone, Debug)]
struct SafetensorsCase {
    header: Vec<HeaderEdit>,
    bytes: Vec<ByteEdit>,
}

/// `model.safetensors` of the tiny model, its header edited and its bytes
/// mutated, loaded with the tiny model's config.
#[test]
fn fuzz_safetensors() {
    let scratch = fuzzing::Scratch::new("safetensors");
    let dir = scratch.path().join("model");
    copy_dir(&tiny_chat(), &dir);
    let original = SafeFile::read(&tiny_chat().join("model.safetensors"));
    let all_names: BTreeSet<String> = original.names().into_iter().collect();
    let strategy = (prop::collection::vec(header_edit(), 0..4), prop::collection::vec(byte_edit(), 0..3))
        .prop_map(|(header, bytes)| SafetensorsCase { header, bytes });
    fuzzing::run("safetensors", DEFAULT_CASES, strategy, |case| {
        let mut file = original.clone();
        let pad = apply_header(&mut file, &case.header);
        let mut bytes = file.bytes(pad);
        apply_bytes(&mut bytes, &case.bytes);
        std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
        if let Ok(store) = TensorStore::open_dir(&dir) {
            read_all(&store);
        }
        let loaded = load_qwen2(&dir);
        fuzzing::outcome(fuzzing::kind(&loaded));
        if let Ok(m) = loaded {
            // What loads is the model: exactly the original tensors (under
            // their names), none unused.
            let store = TensorStore::open_dir(&dir).unwrap();
            let names: BTreeSet<String> = store.names().map(String::from).collect();
            prop_assert_eq!(names, all_names.clone());
            forward(&m);
        }
        Ok(())
    });
}

#[derive(Clone, Debug)]
enum IndexEdit {
    Shard(usize, String),
    Add(String, String),
    Remove(usize),
}

#[derive(Clone, Debug)]
enum IndexCase {
    Edits(Vec<IndexEdit>),
    Json(Value),
}

/// `model.safetensors.index.json` over the tiny model split in two shards
/// (`a.safetensors`, `b.safetensors`, and a copy of `b` outside the folder):
/// shard names edited to `..`, absolute paths, sub-folders, missing files.
#[test]
fn fuzz_index() {
    let scratch = fuzzing::Scratch::new("index");
    let dir = scratch.path().join("model");
    copy_dir(&tiny_chat(), &dir);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let store = TensorStore::open_dir(&tiny_chat()).unwrap();
    let mut names: Vec<String> = store.names().map(String::from).collect();
    names.sort();
    let tensors: Vec<_> = names.iter().map(|n| store.get_any(n).unwrap()).collect();
    let mut map = Map::new();
    for (half, shard) in tensors.chunks(tensors.len().div_ceil(2)).zip(["a.safetensors", "b.safetensors"]) {
        let list: Vec<(String, String, Vec<usize>, &[u8])> = half
            .iter()
            .map(|t| (t.name.clone(), ember_model::advanced::safetensors_dtype(t.dtype), t.shape.clone(), t.as_bytes()))
            .collect();
        ember_model::advanced::write_safetensors(&dir.join(shard), &list, &Default::default()).unwrap();
        for t in half {
            map.insert(t.name.clone(), shard.into());
        }
    }
    std::fs::copy(dir.join("b.safetensors"), scratch.path().join("outside.safetensors")).unwrap();
    let outside = scratch.path().join("outside.safetensors").to_str().unwrap().to_string();
    let shard_name = prop_oneof![
        prop::sample::select(vec![
            "a.safetensors".to_string(),
            "b.safetensors".into(),
            "../outside.safetensors".into(),
            outside.clone(),
            "./b.safetensors".into(),
            "model/../b.safetensors".into(),
            "sub/b.safetensors".into(),
            "missing.safetensors".into(),
            "config.json".into(),
            "".into(),
            ".".into(),
            "..".into(),
            "/".into(),
        ]),
        hostile::string(),
    ];
    let edit = prop_oneof![
        (0usize..64, shard_name.clone()).prop_map(|(i, s)| IndexEdit::Shard(i, s)),
        (tensor_name(), shard_name).prop_map(|(t, s)| IndexEdit::Add(t, s)),
        (0usize..64).prop_map(IndexEdit::Remove),
    ];
    let strategy = prop_oneof![
        4 => prop::collection::vec(edit, 0..4).prop_map(IndexCase::Edits),
        1 => hostile::json().prop_map(|v| IndexCase::Json(json!({"weight_map": v}))),
        1 => hostile::json().prop_map(IndexCase::Json),
    ];
    fuzzing::run("index", DEFAULT_CASES, strategy, |case| {
        let index = match case {
            IndexCase::Json(v) => v,
            IndexCase::Edits(edits) => {
                let mut m = map.clone();
                for e in &edits {
                    let keys: Vec<String> = m.keys().cloned().collect();
                    let pick = |i: &usize| keys.get(i % keys.len().max(1)).cloned();
                    match e {
                        IndexEdit::Shard(i, s) => {
                            if let Some(k) = pick(i) {
                                m.insert(k, s.as_str().into());
                            }
                        }
                        IndexEdit::Add(t, s) => {
                            m.insert(t.clone(), s.as_str().into());
                        }
                        IndexEdit::Remove(i) => {
                            if let Some(k) = pick(i) {
                                m.shift_remove(&k);
                            }
                        }
                    }
                }
                json!({"metadata": {}, "weight_map": m})
            }
        };
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let loaded = load_qwen2(&dir);
        fuzzing::outcome(fuzzing::kind(&loaded));
        if let Ok(m) = loaded {
            // Only the two shards inside the folder, by their plain names.
            let shards: BTreeSet<&str> =
                index["weight_map"].as_object().unwrap().values().filter_map(Value::as_str).collect();
            prop_assert!(shards.iter().all(|s| ["a.safetensors", "b.safetensors"].contains(s)), "{:?}", shards);
            forward(&m);
        }
        Ok(())
    });
}

/// The fields of `config.json` ember reads, and a few it does not.
const CONFIG_FIELDS: &[&str] = &[
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "hidden_act",
    "eos_token_id",
    "bos_token_id",
    "use_sliding_window",
    "sliding_window",
    "torch_dtype",
];

const GENERATION_FIELDS: &[&str] = &[
    "eos_token_id",
    "bos_token_id",
    "pad_token_id",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
];

/// A hostile value for a field: mostly numbers at the edges (what the
/// fields hold), sometimes anything.
fn field_value() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        1 => Just(None),
        4 => hostile::integer().prop_map(|n| Some(json!(n))),
        2 => hostile::float().prop_map(|f| Some(json!(f))),
        1 => prop::collection::vec(hostile::integer(), 0..4).prop_map(|v| Some(json!(v))),
        1 => prop::sample::select(&["default", "linear", "yarn", "silu", "gelu", "qwen2", "Qwen2ForCausalLM"][..])
            .prop_map(|t| Some(json!({"rope_type": t, "type": t, "rope_theta": 1e4}))),
        2 => hostile::json().prop_map(Some),
    ]
}

#[derive(Clone, Debug)]
struct ConfigCase {
    /// `(field, value)`; `None` removes the field.
    config: Vec<(&'static str, Option<Value>)>,
    generation: Vec<(&'static str, Option<Value>)>,
    context: u64,
    prefill_chunk: u64,
}

/// `config.json` and `generation_config.json` of the tiny model with fields
/// set to hostile values (huge, negative, fractional, of the wrong type, or
/// removed), and hostile context and prefill sizes: the config is checked
/// before anything is allocated from it, and what loads generates.
#[test]
fn fuzz_config() {
    let scratch = fuzzing::Scratch::new("config");
    let dir = scratch.path().join("model");
    copy_dir(&tiny_chat(), &dir);
    let read = |f: &str| {
        serde_json::from_str::<Map<String, Value>>(&std::fs::read_to_string(tiny_chat().join(f)).unwrap()).unwrap()
    };
    let (config, generation) = (read("config.json"), read("generation_config.json"));
    let edits =
        |fields: &'static [&'static str]| prop::collection::vec((prop::sample::select(fields), field_value()), 0..4);
    let size = prop_oneof![1u64..600, hostile::integer()];
    let chunk = prop_oneof![1u64..600, hostile::integer()];
    let strategy = (edits(CONFIG_FIELDS), edits(GENERATION_FIELDS), size, chunk).prop_map(
        |(config, generation, context, prefill_chunk)| ConfigCase { config, generation, context, prefill_chunk },
    );
    fuzzing::run("config", DEFAULT_CASES, strategy, |case| {
        let edit = |base: &Map<String, Value>, edits: &[(&str, Option<Value>)]| {
            let mut m = base.clone();
            for (k, v) in edits {
                match v {
                    Some(v) => m.insert(k.to_string(), v.clone()),
                    None => m.shift_remove(*k),
                };
            }
            Value::Object(m).to_string()
        };
        let config_text = edit(&config, &case.config);
        let generation_text = edit(&generation, &case.generation);
        std::fs::write(dir.join("config.json"), &config_text).unwrap();
        std::fs::write(dir.join("generation_config.json"), &generation_text).unwrap();
        let parsed = Config::from_json(&config_text, Path::new("config.json"));
        fuzzing::outcome(format!("config {}", fuzzing::kind(&parsed)));
        if let Ok(c) = parsed {
            // What validates can be computed with: every count positive and
            // every product in range.
            for v in [c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim] {
                prop_assert!(v >= 1);
            }
            prop_assert!(c
                .num_attention_heads
                .checked_mul(c.head_dim)
                .and_then(|q| q.checked_mul(c.hidden_size))
                .is_some());
            prop_assert!(c.vocab_size.checked_mul(c.hidden_size).is_some());
            prop_assert!(
                c.rope_theta.is_finite() && c.rope_theta > 0.0 && c.rms_norm_eps > 0.0 && c.rms_norm_eps.is_finite()
            );
        }
        let _ = GenerationConfig::from_file(&dir.join("generation_config.json"));
        let builder = Model::builder(&dir).context(case.context as usize).prefill_chunk(case.prefill_chunk as usize);
        let loaded = builder.load();
        fuzzing::outcome(format!("model {}", fuzzing::kind(&loaded)));
        if let Ok(model) = loaded {
            // The KV cache is as large as the context the caller asks for (a
            // legitimate size, allocated when first used): the session here
            // is kept small, the context's checks ran at load.
            let options = GenerateOptions::from_model(&model).max_tokens(3).seed(7);
            if let Ok(g) = model
                .session_with_context(model.context().min(512))
                .and_then(|s| s.into_generation(&[1, 5, 9], options))
            {
                for t in g {
                    if t.is_err() {
                        break;
                    }
                }
            }
        }
        Ok(())
    });
}

#[derive(Clone, Debug)]
enum QuantEdit {
    /// The format of the i-th `ember.quant.*` key.
    Format(usize, String),
    /// Removes the i-th key.
    Unmark(usize),
    /// Marks another tensor (picked among all) as quantized.
    Mark(usize, String),
    /// A quantized tensor's stored shape, keeping its byte count or not.
    Reshape(usize, ReShape),
    Header(HeaderEdit),
}

#[derive(Clone, Debug)]
enum ReShape {
    Halve,
    Double,
    Transpose,
    Flat,
    Any(Vec<u64>),
}

#[derive(Clone, Debug)]
struct QuantCase {
    int4: bool,
    edits: Vec<QuantEdit>,
    bytes: Vec<ByteEdit>,
    requantize: bool,
}

/// The `ember.quant.*` metadata and U8 block tensors of INT8 and INT4
/// folders written by `ember quantize` (the library's `write_folder`), edited.
/// INT4's folder is of a model with 128-wide rows (INT4's and INT5's blocks;
/// the tiny model's 64-wide rows get INT8): its INT4, INT5 and INT8 tensors.
#[test]
fn fuzz_quant_metadata() {
    let scratch = fuzzing::Scratch::new("quant");
    let wide = scratch.path().join("wide-src");
    copy_dir(&tiny_chat(), &wide);
    common::write_wide_model(&wide);
    let mut files = Vec::new();
    for (fmt, name) in [(WeightType::Int8, "int8"), (WeightType::Int4, "int4")] {
        let src = if fmt == WeightType::Int4 { wide.clone() } else { tiny_chat() };
        let store = TensorStore::open_dir(&src).unwrap();
        let mut m = load_qwen2(&src).unwrap();
        m.quantize(&QuantPolicy::new(fmt)).unwrap();
        let out = scratch.path().join(name);
        write_folder(&src, &store, &m, &out).unwrap();
        assert!(Model::load(&out).is_ok());
        files.push((out.clone(), SafeFile::read(&out.join("model.safetensors"))));
    }
    let format = prop_oneof![
        prop::sample::select(WeightType::ALL.iter().map(|t| t.name().to_string()).collect::<Vec<_>>()),
        hostile::string()
    ];
    let reshape = prop_oneof![
        Just(ReShape::Halve),
        Just(ReShape::Double),
        Just(ReShape::Transpose),
        Just(ReShape::Flat),
        prop::collection::vec(hostile::integer(), 0..4).prop_map(ReShape::Any),
    ];
    let edit = prop_oneof![
        (0usize..64, format.clone()).prop_map(|(i, f)| QuantEdit::Format(i, f)),
        (0usize..64).prop_map(QuantEdit::Unmark),
        (0usize..64, format).prop_map(|(i, f)| QuantEdit::Mark(i, f)),
        (0usize..64, reshape).prop_map(|(i, r)| QuantEdit::Reshape(i, r)),
        header_edit().prop_map(QuantEdit::Header),
    ];
    let strategy =
        (any::<bool>(), prop::collection::vec(edit, 0..4), prop::collection::vec(byte_edit(), 0..2), any::<bool>())
            .prop_map(|(int4, edits, bytes, requantize)| QuantCase { int4, edits, bytes, requantize });
    fuzzing::run("quant", DEFAULT_CASES, strategy, |case| {
        let (dir, original) = &files[usize::from(case.int4)];
        let mut file = original.clone();
        let mut pad = 0;
        for e in &case.edits {
            let meta = file.header.get("__metadata__").and_then(Value::as_object).cloned().unwrap_or_default();
            let keys: Vec<String> = meta.keys().filter(|k| k.starts_with("ember.quant.")).cloned().collect();
            let key = |i: &usize| keys.get(i % keys.len().max(1)).cloned();
            let names = file.names();
            match e {
                QuantEdit::Format(i, f) => {
                    if let Some(k) = key(i) {
                        file.header["__metadata__"][&k] = f.as_str().into();
                    }
                }
                QuantEdit::Unmark(i) => {
                    if let Some(k) = key(i) {
                        file.header["__metadata__"].as_object_mut().unwrap().shift_remove(&k);
                    }
                }
                QuantEdit::Mark(i, f) => {
                    if let Some(n) = names.get(i % names.len().max(1)) {
                        let m = file.header.entry("__metadata__").or_insert_with(|| json!({}));
                        if let Some(m) = m.as_object_mut() {
                            m.insert(format!("ember.quant.{n}"), f.as_str().into());
                        }
                    }
                }
                QuantEdit::Reshape(i, r) => {
                    if let Some(k) = key(i) {
                        let n = k.trim_start_matches("ember.quant.").to_string();
                        if let Some(shape) = file.header.get(&n).and_then(|t| t["shape"].as_array()).cloned() {
                            let d: Vec<u64> = shape.iter().filter_map(Value::as_u64).collect();
                            let new = match (r, &d[..]) {
                                (ReShape::Halve, [a, b]) => vec![a.wrapping_mul(2), b / 2],
                                (ReShape::Double, [a, b]) => vec![a / 2, b.wrapping_mul(2)],
                                (ReShape::Transpose, [a, b]) => vec![*b, *a],
                                (ReShape::Flat, [a, b]) => vec![a.wrapping_mul(*b)],
                                (ReShape::Any(s), _) => s.clone(),
                                _ => d.clone(),
                            };
                            file.header[&n]["shape"] = json!(new);
                        }
                    }
                }
                QuantEdit::Header(h) => pad = apply_header(&mut file, std::slice::from_ref(h)),
            }
        }
        let mut bytes = file.bytes(pad);
        apply_bytes(&mut bytes, &case.bytes);
        let path = dir.join("model.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        let mut builder = Model::builder(dir).context(16);
        if case.requantize {
            builder = builder.quantize(WeightType::Int8);
        }
        let loaded = builder.load();
        fuzzing::outcome(fuzzing::kind(&loaded));
        if let Ok(model) = loaded {
            generate(&model, &[1, 2], GenerateOptions::default().max_tokens(2));
        }
        if let Ok(store) = TensorStore::open_dir(dir) {
            read_all(&store);
        }
        // Put the folder back for the next case.
        std::fs::write(&path, original.bytes(0)).unwrap();
        Ok(())
    });
}

/// A byte-level BPE `tokenizer.json` of `n - 1` single-character tokens, one
/// merge (`ab`) and one special token (GGUF files carry only BPE tokenizers).
fn byte_level_bpe(n: usize) -> Value {
    let symbols = ('!'..='~').chain(['Ġ', 'Ċ']).map(String::from).take(n - 1).chain(["ab".to_string()]);
    let vocab: Map<String, Value> = symbols.enumerate().map(|(i, c)| (c, i.into())).collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
        "added_tokens": [{"id": 0, "content": "!", "single_word": false, "lstrip": false, "rstrip": false,
                          "normalized": false, "special": true}],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab,
                  "merges": [["a", "b"]]}
    })
}

/// GGUF files of the tiny model (BF16, Q8_0, Q4_0 matrices: its 64-wide rows
/// are rounded to Q4_0 directly, INT4's blocks being 128) written by ember's
/// writer, with the byte-level tokenizer and the chat template.
fn gguf_seeds(scratch: &Path) -> Vec<Vec<u8>> {
    let src = scratch.join("src");
    copy_dir(&tiny_chat(), &src);
    std::fs::write(src.join("tokenizer.json"), byte_level_bpe(96).to_string()).unwrap();
    let store = TensorStore::open_dir(&src).unwrap();
    let mut seeds = Vec::new();
    for (q, file_type) in [(None, 32), (Some(WeightType::Int8), 7), (Some(WeightType::Q4_0), 2)] {
        let mut m = load_qwen2(&src).unwrap();
        if let Some(q) = q {
            m.quantize(&QuantPolicy { format: q, overrides: Vec::new() }).unwrap();
        }
        let file = scratch.join("seed.gguf");
        write_gguf(&src, &store, &m, file_type, &file).unwrap();
        assert!(Model::load(&file).is_ok());
        seeds.push(std::fs::read(&file).unwrap());
    }
    seeds
}

/// The metadata keys whose values the GGUF target overwrites in place.
const GGUF_KEYS: &[&str] = &[
    "general.alignment",
    "general.architecture",
    "qwen2.block_count",
    "qwen2.context_length",
    "qwen2.embedding_length",
    "qwen2.feed_forward_length",
    "qwen2.attention.head_count",
    "qwen2.attention.head_count_kv",
    "qwen2.rope.freq_base",
    "qwen2.attention.layer_norm_rms_epsilon",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.chat_template",
    "blk.0.attn_q.weight",
    "token_embd.weight",
    "output_norm.weight",
];

#[derive(Clone, Debug)]
enum GgufEdit {
    /// Overwrites the value type (`at` 0) or the bytes after it with `value`
    /// (`width` bytes), right after the key (or tensor name) `key`.
    Patch {
        key: &'static str,
        at: usize,
        value: u64,
        width: usize,
    },
    Bytes(ByteEdit),
}

#[derive(Clone, Debug)]
struct GgufCase {
    seed: usize,
    edits: Vec<GgufEdit>,
}

/// GGUF files of the tiny model, their metadata values, counts, lengths and
/// tensor infos overwritten with boundary values and their bytes mutated,
/// loaded whole (hyper-parameters, tensors, tokenizer, template) and run.
#[test]
fn fuzz_gguf() {
    let scratch = fuzzing::Scratch::new("gguf");
    let seeds = gguf_seeds(scratch.path());
    let file = scratch.path().join("case.gguf");
    let edit = prop_oneof![
        3 => (prop::sample::select(GGUF_KEYS), 0usize..24, hostile::integer(), prop::sample::select(&[1usize, 4, 8][..]))
            .prop_map(|(key, at, value, width)| GgufEdit::Patch { key, at, value, width }),
        2 => byte_edit().prop_map(GgufEdit::Bytes),
    ];
    let strategy =
        (0..seeds.len(), prop::collection::vec(edit, 1..4)).prop_map(|(seed, edits)| GgufCase { seed, edits });
    fuzzing::run("gguf", DEFAULT_CASES, strategy, |case| {
        let mut b = seeds[case.seed].clone();
        for e in &case.edits {
            match e {
                GgufEdit::Patch { key, at, value, width } => {
                    if let Some(i) = b.windows(key.len()).position(|w| w == key.as_bytes()) {
                        let start = i + key.len() + at;
                        let end = (start + width).min(b.len());
                        if start < end {
                            b[start..end].copy_from_slice(&value.to_le_bytes()[..end - start]);
                        }
                    }
                }
                GgufEdit::Bytes(e) => apply_bytes(&mut b, std::slice::from_ref(e)),
            }
        }
        std::fs::write(&file, &b).unwrap();
        let loaded = Model::builder(&file).context(32).load();
        fuzzing::outcome(fuzzing::kind(&loaded));
        if let Ok(model) = loaded {
            if let Ok(prompt) = model.chat_prompt(&[Message::user("ab cd")]) {
                if let Ok(ids) = model.encode(&prompt) {
                    generate(&model, &ids, GenerateOptions::default().max_tokens(2));
                }
            }
        }
        Ok(())
    });
}

/// The tokenizers of the tiny model (word level), the real Qwen2.5 (byte-
/// level BPE, from fixtures) and a GGUF file's (built from its metadata).
fn tokenizers() -> &'static [(&'static str, Tokenizer, usize)] {
    static T: OnceLock<Vec<(&'static str, Tokenizer, usize)>> = OnceLock::new();
    T.get_or_init(|| {
        let scratch = fuzzing::Scratch::new("tokenizers");
        let gguf = scratch.path().join("tiny.gguf");
        std::fs::write(&gguf, &gguf_seeds(scratch.path())[0]).unwrap();
        // With its vocabulary size (`vocab_size` builds the whole vocabulary).
        [
            ("tiny-chat", Tokenizer::from_dir(&tiny_chat()).unwrap()),
            ("qwen2.5", Tokenizer::from_dir(&fixtures().join("qwen2.5-coder-0.5b-instruct")).unwrap()),
            ("gguf", Tokenizer::from_dir(&gguf).unwrap()),
        ]
        .into_iter()
        .map(|(n, t)| {
            let v = t.vocab_size();
            (n, t, v)
        })
        .collect()
    })
}

#[derive(Clone, Debug)]
enum TokenizerCase {
    Text(String),
    Bytes(Vec<u8>),
    Ids(Vec<u32>, bool),
}

/// Arbitrary text, bytes (as lossy UTF-8) and ids into encode, decode and
/// the streaming decoder of each tokenizer. Encoded ids are in the
/// vocabulary; the Qwen tokenizer gives ASCII text back exactly.
#[test]
fn fuzz_tokenizer() {
    let toks = tokenizers();
    let id = prop_oneof![
        0u32..100,
        151_600u32..151_700,
        prop::sample::select(vec![u32::MAX, u32::MAX - 1, 1 << 31, 151_936, 151_643, 151_645]),
        any::<u32>(),
    ];
    let strategy = prop_oneof![
        3 => hostile::string().prop_map(TokenizerCase::Text),
        1 => "[ -~\n\t]{0,200}".prop_map(TokenizerCase::Text),
        1 => hostile::bytes().prop_map(TokenizerCase::Bytes),
        2 => (prop::collection::vec(id, 0..24), any::<bool>()).prop_map(|(ids, s)| TokenizerCase::Ids(ids, s)),
    ];
    fuzzing::run("tokenizer", DEFAULT_CASES, strategy, |case| {
        for (name, t, vocab) in toks {
            let ids = match &case {
                TokenizerCase::Text(s) => encode_checked(name, t, *vocab, s)?,
                TokenizerCase::Bytes(b) => encode_checked(name, t, *vocab, &String::from_utf8_lossy(b))?,
                TokenizerCase::Ids(ids, skip) => {
                    let r = t.decode(ids, *skip);
                    fuzzing::outcome(format!("{name} decode {}", fuzzing::kind(&r)));
                    ids.clone()
                }
            };
            let mut stream = TextStream::new();
            for &id in &ids {
                if stream.push(t, id).is_err() {
                    break;
                }
            }
            let _ = stream.finish(t);
        }
        Ok(())
    });
}

fn encode_checked(name: &str, t: &Tokenizer, vocab: usize, text: &str) -> Result<Vec<u32>, TestCaseError> {
    let encoded = t.encode(text);
    fuzzing::outcome(format!("{name} encode {}", fuzzing::kind(&encoded)));
    let Ok(ids) = encoded else { return Ok(Vec::new()) };
    prop_assert!(ids.iter().all(|&id| (id as usize) < vocab), "{}: {:?}", name, ids);
    let back = t.decode(&ids, false);
    if name == "qwen2.5" && text.is_ascii() {
        prop_assert_eq!(back.as_deref().ok(), Some(text), "{} round trip", name);
    }
    Ok(ids)
}

#[derive(Clone, Debug)]
struct WireMessage {
    role: Role,
    content: String,
    calls: Vec<(String, Value)>,
    call_id: Option<String>,
}

#[derive(Clone, Debug)]
enum ChatCase {
    Render { messages: Vec<WireMessage>, tools: Vec<(String, String, Value)>, prompt: bool },
    Parse(String),
    RoundTrip { text: String, name: String, arguments: Map<String, Value> },
    Template { source: String, messages: Vec<WireMessage> },
}

/// Pieces of Jinja for templates assembled at random.
const JINJA: &[&str] = &[
    "{% for m in messages %}",
    "{% endfor %}",
    "{% if add_generation_prompt %}",
    "{% if tools %}",
    "{% endif %}",
    "{% else %}",
    "{{ m.content }}",
    "{{ m['role'] }}",
    "{{ messages[0].content }}",
    "{{ messages[-1] }}",
    "{{ m.tool_calls | tojson }}",
    "{{ tools | tojson(indent=2) }}",
    "{{ raise_exception('no') }}",
    "{{ strftime_now('%Y-%m-%d %B %b %% %q') }}",
    "{{ eos_token }}",
    "{{ m.content.split('<tool_call>')[0].strip() }}",
    "{{ (messages | length) // 0 }}",
    "{% set x = namespace(a=1) %}",
    "{{ x.a }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ range(1000000000) | length }}",
    "{{ 'a' * 1000 }}",
    "{{ m.content[::-1] }}",
    "{{ m.tool_calls[0].function.arguments.items() | list }}",
    "text",
    "{{",
    "{%",
    "}}",
];

/// Chat messages and tools (arbitrary text, roles, calls with arbitrary
/// arguments) through the tiny model's and Qwen2.5's templates; replies
/// through the tool-call parser; templates assembled from Jinja pieces.
#[test]
fn fuzz_chat() {
    let toks = tokenizers();
    let messages = || {
        let message = (
            prop::sample::select(vec![Role::System, Role::User, Role::Assistant, Role::Tool]),
            hostile::string(),
            prop::collection::vec((hostile::string(), hostile::json()), 0..3),
            prop::option::of(hostile::string()),
        )
            .prop_map(|(role, content, calls, call_id)| WireMessage { role, content, calls, call_id });
        prop::collection::vec(message, 0..5)
    };
    let tool = (hostile::string(), hostile::string(), hostile::json());
    let reply = prop::collection::vec(
        prop_oneof![prop::sample::select(hostile::FRAGMENTS).prop_map(String::from), hostile::string()],
        0..8,
    )
    .prop_map(|v| v.concat());
    let object = prop::collection::vec(("[a-z]{1,6}", hostile::json()), 0..4).prop_map(|kv| kv.into_iter().collect());
    let strategy = prop_oneof![
        3 => (messages(), prop::collection::vec(tool, 0..3), any::<bool>())
            .prop_map(|(messages, tools, prompt)| ChatCase::Render { messages, tools, prompt }),
        2 => reply.prop_map(ChatCase::Parse),
        1 => (hostile::string(), hostile::string(), object)
            .prop_map(|(text, name, arguments)| ChatCase::RoundTrip { text, name, arguments }),
        1 => (prop::collection::vec(prop::sample::select(JINJA), 0..8), messages())
            .prop_map(|(s, messages)| ChatCase::Template { source: s.concat(), messages }),
    ];
    let to_messages = |ms: &[WireMessage]| -> Vec<Message> {
        ms.iter()
            .map(|m| {
                let calls = m.calls.iter().map(|(n, a)| ToolCall::new(n.clone(), a.clone())).collect();
                let msg = Message::new(m.role, m.content.clone()).with_tool_calls(calls);
                match &m.call_id {
                    Some(id) => msg.with_tool_call_id(id.clone()),
                    None => msg,
                }
            })
            .collect()
    };
    fuzzing::run("chat", DEFAULT_CASES, strategy, |case| {
        match case {
            ChatCase::Render { messages, tools, prompt } => {
                let messages = to_messages(&messages);
                let tools: Vec<Tool> = tools.into_iter().map(|(n, d, p)| Tool::new(n, d, p)).collect();
                for (name, t, _) in toks {
                    let r = t.apply_chat_template(&messages, prompt);
                    fuzzing::outcome(format!("{name} render {}", fuzzing::kind(&r)));
                    let _ = t.apply_chat_template_with_tools(&messages, &tools, prompt);
                }
            }
            ChatCase::Parse(reply) => {
                fuzzing::outcome(format!("parse {}", fuzzing::kind(&parse_tool_calls(&reply))));
                if let Ok(m) = Message::parse_assistant(&reply) {
                    prop_assert!(m.tool_calls.iter().all(|c| !c.name.is_empty()));
                }
            }
            ChatCase::RoundTrip { text, name, arguments } => {
                // Qwen's form: text, then the call as JSON in its tags.
                let body = json!({"name": name, "arguments": arguments}).to_string();
                let clean = |s: &str| !s.contains("tool_call>");
                fuzzing::outcome(format!("round trip {}", !name.is_empty() && clean(&text) && clean(&body)));
                if !name.is_empty() && clean(&text) && clean(&body) {
                    let reply = format!("{text}\n<tool_call>\n{body}\n</tool_call>");
                    let m = Message::parse_assistant(&reply).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(m.content, text.trim());
                    // As serde_json reads the arguments back (its default float
                    // parsing may move a long float by an ulp).
                    let read: Value = serde_json::from_str(&body).unwrap();
                    prop_assert_eq!(m.tool_calls, vec![ToolCall::new(name, read["arguments"].clone())]);
                }
            }
            ChatCase::Template { source, messages } => {
                if let Ok(t) = ChatTemplate::new(source, vec![("eos_token".into(), "<|im_end|>".into())]) {
                    let r = t.render(&to_messages(&messages), true);
                    fuzzing::outcome(format!("template {}", fuzzing::kind(&r)));
                } else {
                    fuzzing::outcome("template does not compile");
                }
            }
        }
        Ok(())
    });
}
