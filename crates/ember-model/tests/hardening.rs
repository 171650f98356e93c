//! Loading validates before it allocates, and refuses what would run
//! silently wrong (issue 15): each test is one case of the issue, on copies
//! of `testdata/tiny-chat` (3 layers, hidden 64, 4 heads of 16, 2 KV heads,
//! vocabulary 96, BF16).

use ember_model::advanced::eval::evaluate;
use ember_model::advanced::{load_qwen2, write_safetensors, BatchToken, Qwen2, Scratch, TensorStore};
use ember_model::{Config, Error, GenerateOptions, Model};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh folder under the temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("ember-hardening-{}-{n}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tiny_chat() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tiny-chat")
}

/// A copy of tiny-chat in `<tmp>/model` (so the test can put files beside it).
fn tiny_copy(tag: &str) -> (TempDir, PathBuf) {
    let t = TempDir::new(tag);
    let dir = t.path().join("model");
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(tiny_chat()).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    (t, dir)
}

fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, v.to_string()).unwrap();
}

/// The header and data of a safetensors file.
fn split(bytes: &[u8]) -> (Value, &[u8]) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), &bytes[8 + n..])
}

/// A safetensors file of `header` (its JSON padded with spaces to `len`
/// bytes, when given) and `data`.
fn join(header: &Value, data: &[u8], len: Option<usize>) -> Vec<u8> {
    let mut h = header.to_string().into_bytes();
    if let Some(len) = len {
        assert!(h.len() <= len);
        h.resize(len, b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    out
}

fn edit_header(path: &Path, f: impl FnOnce(&mut Value)) {
    let bytes = std::fs::read(path).unwrap();
    let (mut header, data) = split(&bytes);
    f(&mut header);
    let len = header.to_string().len().next_multiple_of(8);
    std::fs::write(path, join(&header, data, Some(len))).unwrap();
}

fn logits(m: &Qwen2, ids: &[u32]) -> Vec<f32> {
    let mut cache = m.new_cache(16);
    let batch: Vec<BatchToken> =
        ids.iter().enumerate().map(|(p, &token)| BatchToken { token, seq: 0, pos: p, logits: true }).collect();
    m.forward(&batch, &mut [&mut cache], &mut Scratch::default()).unwrap().to_vec()
}

fn load_err(dir: &Path) -> String {
    match load_qwen2(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// A valid file whose header length is odd puts every tensor at an odd
/// offset of the file: the model still loads, and computes what the
/// original computes (the data is copied into aligned memory, not read
/// misaligned, and not copied with the misalignment kept).
#[test]
fn odd_header_length_loads_and_computes_the_same() {
    let want = logits(&load_qwen2(&tiny_chat()).unwrap(), &[1, 5, 9, 2]);
    let (_t, dir) = tiny_copy("odd");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let (header, data) = split(&bytes);
    let len = header.to_string().len() | 1;
    std::fs::write(&path, join(&header, data, Some(len))).unwrap();
    let m = load_qwen2(&dir).unwrap();
    assert_eq!(logits(&m, &[1, 5, 9, 2]), want);
}

/// Safetensors does not align tensors within the data: a BF16 tensor after
/// a 3-byte one starts at an odd offset, and reads correctly.
#[test]
fn misaligned_tensor_in_the_data_reads_correctly() {
    let t = TempDir::new("misaligned");
    let values = [1.5f32, -2.0, 0.25];
    let bf16: Vec<u8> = values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
    let header = json!({
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "BF16", "shape": [3], "data_offsets": [3, 9]},
    });
    let mut data = vec![7u8, 8, 9];
    data.extend(&bf16);
    let path = t.path().join("x.safetensors");
    std::fs::write(&path, join(&header, &data, Some(header.to_string().len().next_multiple_of(8)))).unwrap();
    let store = TensorStore::open_files(std::slice::from_ref(&path), path.clone()).unwrap();
    assert_eq!(store.get("b", &[3]).unwrap().to_f32_vec(), values);
}

fn config_with(field: &str, value: Value) -> Result<Config, Error> {
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny_chat().join("config.json")).unwrap()).unwrap();
    c[field] = value;
    Config::from_json(&c.to_string(), Path::new("config.json"))
}

/// Huge or overflowing values are errors naming the field, before anything
/// is allocated for them (they aborted or panicked: 1e15 layers, 2^62
/// layers, a head_dim whose products overflow, 1e13 positions).
#[test]
fn huge_config_values_are_errors_naming_the_field() {
    let cases: &[(&str, Value)] = &[
        ("num_hidden_layers", json!(1_000_000_000_000_000u64)),
        ("num_hidden_layers", json!(1u64 << 62)),
        ("head_dim", json!((1u64 << 63) - 2)),
        ("head_dim", json!(1u64 << 40)),
        ("max_position_embeddings", json!(10_000_000_000_000u64)),
        ("vocab_size", json!(1u64 << 40)),
        ("hidden_size", json!(1u64 << 40)),
        ("intermediate_size", json!(1u64 << 40)),
        ("num_attention_heads", json!(1u64 << 40)),
        ("num_key_value_heads", json!(1u64 << 40)),
    ];
    for (field, value) in cases {
        match config_with(field, value.clone()) {
            Ok(c) => panic!("{field} = {value} was accepted: {c:?}"),
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains("config.json") && e.contains(field), "{field} = {value}: {e}");
            }
        }
    }
}

/// `rope_theta` and `rms_norm_eps` are used as f32: values that are finite
/// and positive as f64 but become infinite or zero as f32 are errors.
#[test]
fn rope_theta_and_eps_must_survive_f32() {
    for (field, value) in [("rope_theta", json!(1e300)), ("rms_norm_eps", json!(1e-60)), ("rms_norm_eps", json!(1e300))]
    {
        let e = config_with(field, value.clone()).map(|_| ()).expect_err(field).to_string();
        assert!(e.contains(field), "{field} = {value}: {e}");
    }
}

/// `num_hidden_layers: 2` on a 3-layer checkpoint ran 2 layers and ignored
/// the third: garbage, silently. Now an error naming the field and the
/// first layer that would be ignored.
#[test]
fn fewer_layers_in_the_config_than_in_the_weights_is_an_error() {
    let (_t, dir) = tiny_copy("fewer");
    edit_json(&dir.join("config.json"), |c| c["num_hidden_layers"] = 2.into());
    let e = load_err(&dir);
    assert!(e.contains("num_hidden_layers") && e.contains("model.layers.2"), "{e}");
    assert!(Model::load(&dir).is_err());
}

#[test]
fn more_layers_in_the_config_than_in_the_weights_is_an_error() {
    let (_t, dir) = tiny_copy("more");
    edit_json(&dir.join("config.json"), |c| c["num_hidden_layers"] = 4.into());
    let e = load_err(&dir);
    assert!(e.contains("num_hidden_layers") && e.contains("3 layers"), "{e}");
}

/// A tensor the model does not use means the checkpoint is not what the
/// config describes.
#[test]
fn an_unused_tensor_is_an_error_naming_it() {
    let (_t, dir) = tiny_copy("unused");
    let path = dir.join("model.safetensors");
    let store = TensorStore::open_dir(&dir).unwrap();
    let mut names: Vec<String> = store.names().map(String::from).collect();
    names.sort();
    let tensors: Vec<_> = names.iter().map(|n| store.get_any(n).unwrap()).collect();
    let extra = [0u8; 8];
    let mut list: Vec<(String, String, Vec<usize>, &[u8])> =
        tensors.iter().map(|t| (t.name.clone(), "BF16".to_string(), t.shape.clone(), t.as_bytes())).collect();
    list.push(("model.layers.0.self_attn.rotary_emb.inv_freq".into(), "F32".into(), vec![2], &extra));
    write_safetensors(&path, &list, &BTreeMap::new()).unwrap();
    drop(store);
    let e = load_err(&dir);
    assert!(e.contains("model.layers.0.self_attn.rotary_emb.inv_freq") && e.contains("not used"), "{e}");
}

/// The tiny model split into two shards with an index naming them as
/// `names[0]`, `names[1]` (written where `write_to` says, relative to the
/// model folder).
fn shard(dir: &Path, names: [&str; 2], write_to: [PathBuf; 2]) {
    let store = TensorStore::open_dir(dir).unwrap();
    let mut all: Vec<String> = store.names().map(String::from).collect();
    all.sort();
    let tensors: Vec<_> = all.iter().map(|n| store.get_any(n).unwrap()).collect();
    let mut map = serde_json::Map::new();
    for (i, half) in tensors.chunks(tensors.len().div_ceil(2)).enumerate() {
        let list: Vec<(String, String, Vec<usize>, &[u8])> =
            half.iter().map(|t| (t.name.clone(), "BF16".to_string(), t.shape.clone(), t.as_bytes())).collect();
        write_safetensors(&write_to[i], &list, &BTreeMap::new()).unwrap();
        for t in half {
            map.insert(t.name.clone(), names[i].into());
        }
    }
    drop(store);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let index = json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

/// Shard names in the index are plain file names inside the folder: `..`,
/// absolute paths and sub-folders are refused, naming the index and the
/// shard (they opened files anywhere, and loaded valid ones). Symbolic
/// links in the folder are followed (HuggingFace's cache is made of them).
#[test]
fn index_shard_names_outside_the_folder_are_refused() {
    let (t, dir) = tiny_copy("shards");
    let outside = t.path().join("outside.safetensors");
    let abs = outside.to_str().unwrap().to_string();
    shard(&dir, ["a.safetensors", "../outside.safetensors"], [dir.join("a.safetensors"), outside.clone()]);
    let e = load_err(&dir);
    assert!(e.contains("model.safetensors.index.json") && e.contains("../outside.safetensors"), "{e}");
    for bad in [abs.as_str(), "sub/b.safetensors", "", ".", "..", "a\\b.safetensors"] {
        edit_json(&dir.join("model.safetensors.index.json"), |v| {
            for (_, shard) in v["weight_map"].as_object_mut().unwrap() {
                if shard != "a.safetensors" {
                    *shard = bad.into();
                }
            }
        });
        let e = load_err(&dir);
        assert!(e.contains("model.safetensors.index.json") && e.contains("not a file name"), "{bad:?}: {e}");
    }

    // The same shards by plain names (one a symbolic link to the file
    // outside) load.
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(&outside, dir.join("b.safetensors")).unwrap();
        edit_json(&dir.join("model.safetensors.index.json"), |v| {
            for (_, shard) in v["weight_map"].as_object_mut().unwrap() {
                if shard != "a.safetensors" {
                    *shard = "b.safetensors".into();
                }
            }
        });
        let m = load_qwen2(&dir).unwrap();
        assert_eq!(logits(&m, &[1, 2]), logits(&load_qwen2(&tiny_chat()).unwrap(), &[1, 2]));
    }
}

/// `ember.quant.<name>` metadata on a tensor that is not U8 is a corrupt
/// quantized file, said so (it said "has dtype BF16; ember reads BF16 ..."
/// or loaded the floats as if unquantized); so is metadata naming no tensor.
#[test]
fn quant_metadata_on_a_float_tensor_is_named() {
    let (_t, dir) = tiny_copy("quantmeta");
    let path = dir.join("model.safetensors");
    edit_header(&path, |h| {
        h["__metadata__"] = json!({"format": "pt", "ember.quant.model.layers.0.mlp.up_proj.weight": "int8"});
    });
    let e = load_err(&dir);
    assert!(
        e.contains("model.layers.0.mlp.up_proj.weight") && e.contains("int8") && e.contains("BF16") && e.contains("U8"),
        "{e}"
    );
    let (_t, dir) = tiny_copy("quantmeta2");
    edit_header(&dir.join("model.safetensors"), |h| {
        h["__metadata__"] = json!({"ember.quant.model.layers.9.mlp.up_proj.weight": "int4"});
    });
    let e = load_err(&dir);
    assert!(e.contains("ember.quant.model.layers.9.mlp.up_proj.weight") && e.contains("no tensor"), "{e}");
}

/// A shape that disagrees with the byte count of its data offsets names the
/// tensor (safetensors' own message did not).
#[test]
fn byte_count_mismatch_names_the_tensor() {
    let (_t, dir) = tiny_copy("bytes");
    edit_header(&dir.join("model.safetensors"), |h| h["model.norm.weight"]["shape"] = json!([65]));
    let e = load_err(&dir);
    assert!(e.contains("model.norm.weight") && e.contains("[65]"), "{e}");
    let (_t, dir) = tiny_copy("bytes2");
    edit_header(&dir.join("model.safetensors"), |h| h["model.norm.weight"]["shape"] = json!([1u64 << 62, 8]));
    let e = load_err(&dir);
    assert!(e.contains("model.norm.weight"), "{e}");
}

/// A byte-level BPE `tokenizer.json` of `n` single-character tokens and no
/// merges (GGUF files carry only BPE tokenizers).
fn byte_level_bpe(n: usize) -> Value {
    let symbols = ('!'..='~').chain(['Ġ', 'Ċ']);
    let vocab: serde_json::Map<String, Value> =
        symbols.take(n).enumerate().map(|(i, c)| (c.to_string(), i.into())).collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []}
    })
}

/// A GGUF file whose `qwen2.block_count` is below the blocks it holds.
#[test]
fn gguf_block_count_below_its_blocks_is_an_error() {
    let (t, src) = tiny_copy("gguf-layers");
    std::fs::write(src.join("tokenizer.json"), byte_level_bpe(96).to_string()).unwrap();
    let store = TensorStore::open_dir(&src).unwrap();
    let model = load_qwen2(&src).unwrap();
    let file = t.path().join("tiny.gguf");
    ember_model::advanced::quantize::write_gguf(&src, &store, &model, 1, &file).unwrap();
    assert!(load_qwen2(&file).is_ok());
    let mut bytes = std::fs::read(&file).unwrap();
    let key = b"qwen2.block_count";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 4, "a u32 value");
    bytes[at + 4..at + 8].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(&file, bytes).unwrap();
    let e = load_qwen2(&file).unwrap_err().to_string();
    assert!(e.contains("num_hidden_layers") && e.contains("blk.2"), "{e}");
}

/// A prefill chunk near `usize::MAX` (any chunk is valid: it is at most the
/// tokens of a pass) generates like any chunk larger than the prompt. Found
/// by the config fuzz target: `from + chunk` overflows in
/// `generate::run_waiting`.
#[test]
fn huge_prefill_chunk_generates() {
    let m = Model::builder(tiny_chat()).prefill_chunk(usize::MAX).context(16).load().unwrap();
    let text = m.session().into_generation(&[1, 5, 9], ember_model::GenerateOptions::default().max_tokens(2));
    assert_eq!(text.unwrap().count(), 2);
}

/// A `.gguf` path that does not exist is a missing file, not a missing
/// model folder; a file that is neither says so.
#[test]
fn missing_gguf_file_is_not_called_a_folder() {
    let t = TempDir::new("paths");
    let e = Model::load(t.path().join("model.gguf")).unwrap_err().to_string();
    assert!(e.contains("model.gguf") && !e.contains("folder"), "{e}");
    let file = t.path().join("notes.txt");
    std::fs::write(&file, "hi").unwrap();
    let e = Model::load(&file).unwrap_err().to_string();
    assert!(e.contains("notes.txt") && e.contains("not a model"), "{e}");
}

/// A chat template minijinja panics on (it indexes an empty string reversed
/// with `[::-1]`; found by the chat fuzz target) is a template error, not a
/// panic: the template comes from a model file, the content from a user.
#[test]
fn a_template_that_panics_in_minijinja_is_an_error() {
    let t = ember_model::advanced::ChatTemplate::new(
        "{% for m in messages %}{{ m.content[::-1] }}{% endfor %}".into(),
        Vec::new(),
    )
    .unwrap();
    assert_eq!(t.render(&[ember_model::Message::user("ab")], false).unwrap(), "ba");
    let e = t.render(&[ember_model::Message::user("")], false).unwrap_err();
    assert!(matches!(e, Error::Template(_)) && e.to_string().contains("panicked"), "{e}");
}

// ---------------------------------------------------------------------------
// NaN or infinite numbers in the weights are errors, never a silently
// sampled token: generation stops with `Error::NonFinite` naming the
// position, perplexity is an error rather than `NaN`, norms and biases are
// refused at load.

/// A copy of tiny-chat whose tensor `name` (BF16) holds `bits` everywhere.
fn poisoned(tag: &str, name: &str, bits: u16) -> (TempDir, PathBuf) {
    let (t, dir) = tiny_copy(tag);
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let info = &header[name];
    assert_eq!(info["dtype"], "BF16", "{name}");
    let [a, b] = [0, 1].map(|i| info["data_offsets"][i].as_u64().unwrap() as usize + 8 + n);
    for w in bytes[a..b].chunks_exact_mut(2) {
        w.copy_from_slice(&bits.to_le_bytes());
    }
    std::fs::write(&path, bytes).unwrap();
    (t, dir)
}

const BF16_NAN: u16 = 0x7fc0;
const BF16_INF: u16 = 0x7f80;

#[test]
fn generation_stops_with_an_error_naming_the_position() {
    for (tag, bits) in [("nan", BF16_NAN), ("inf", BF16_INF)] {
        let (_t, dir) = poisoned(tag, "model.layers.1.mlp.down_proj.weight", bits);
        let model = Model::load(&dir).unwrap();
        let prompt = model.encode("the sea is blue").unwrap();
        let mut session = model.session();
        let mut g = session.generate(&prompt, GenerateOptions::default().max_tokens(4)).unwrap();
        match g.next() {
            Some(Err(Error::NonFinite { position, .. })) => {
                assert_eq!(position, prompt.len() - 1, "the prompt's last token gave the logits")
            }
            other => panic!("{tag}: expected a NonFinite error, got {other:?}"),
        }
        let e = Error::NonFinite { position: 3, token: 7, value: f32::NAN };
        assert!(e.to_string().contains("position 3"), "{e}");
    }
}

#[test]
fn perplexity_over_non_finite_logits_is_an_error() {
    let (_t, dir) = poisoned("eval", "model.layers.0.self_attn.o_proj.weight", BF16_NAN);
    let model = Model::load(&dir).unwrap();
    let tokens: Vec<u32> = (0..32).map(|i| i % 90).collect();
    match evaluate(model.decoder(), None, &tokens, 16, |_, _| {}) {
        Err(Error::NonFinite { position, .. }) => assert_eq!(position, 8, "the first scored position of window 0"),
        other => panic!("expected a NonFinite error, got {:?}", other.map(|r| r.ppl)),
    }
}

#[test]
fn finite_weights_generate_as_before() {
    let model = Model::load(tiny_chat()).unwrap();
    let prompt = model.encode("the sea is blue").unwrap();
    let out: Vec<u32> = model
        .session()
        .generate(&prompt, GenerateOptions::default().max_tokens(5).stop_at_eos(false))
        .unwrap()
        .map(|t| t.unwrap().id)
        .collect();
    assert_eq!(out.len(), 5);
}

#[test]
fn non_finite_norms_and_biases_are_refused_at_load() {
    for name in ["model.layers.2.input_layernorm.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.bias"] {
        let (_t, dir) = poisoned("load", name, BF16_INF);
        match Model::load(&dir) {
            Err(Error::NonFiniteWeight { name: n, index: 0, .. }) => assert_eq!(n, name),
            other => panic!("{name}: expected NonFiniteWeight, got {:?}", other.map(|_| ())),
        }
    }
}
