//! Shared helpers of the integration tests: fixture paths and scratch copies.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// A fresh empty folder under the system temp dir, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ember-test-{}-{}-{tag}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A copy of fixture `variant` plus a word-level tokenizer (`w0`..`w95`, one
/// word per id) and a tiny chat template, so the whole `Model` API runs on it.
pub fn tiny_model(variant: &str) -> Scratch {
    let s = Scratch::new(variant);
    for entry in std::fs::read_dir(fixtures().join(variant)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, s.path().join(p.file_name().unwrap())).unwrap();
    }
    write_word_tokenizer(s.path());
    s
}

/// The word-level tokenizer of [`tiny_model`] and its chat template, into `dir`.
pub fn write_word_tokenizer(dir: &Path) {
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..96).map(|i| (format!("w{i}"), serde_json::Value::from(i))).collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = serde_json::json!({
        "chat_template": "{% for m in messages %}w3 {{ m.content }} w4 {% endfor %}{% if add_generation_prompt %}w5{% endif %}",
        "eos_token": "w2"
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

/// A random untied F32 Qwen2 whose rows are whole 128-weight blocks (hidden
/// 128, intermediate 256, 2 layers, 4 heads of 32, 2 KV heads, vocabulary
/// 96), so INT4 and INT5 take every matrix their policy gives them (the
/// fixtures' 64-weight rows are too short and get INT8). Deterministic:
/// `config.json` and `model.safetensors` into `dir`. No transformers
/// reference: the quantization tests compare it with itself.
pub fn write_wide_model(dir: &Path) {
    let (h, inter, layers, heads, kv_heads, vocab) = (128usize, 256usize, 2usize, 4usize, 2usize, 96usize);
    let hd = h / heads;
    let config = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "float32"
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut values = |n: usize, scale: f32, base: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                base + scale * ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
            })
            .collect()
    };
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, v: Vec<f32>| tensors.push((name, shape, v));
    add("model.embed_tokens.weight".into(), vec![vocab, h], values(vocab * h, 0.5, 0.0));
    add("lm_head.weight".into(), vec![vocab, h], values(vocab * h, 0.2, 0.0));
    add("model.norm.weight".into(), vec![h], values(h, 0.1, 1.0));
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        let w = 1.0 / (h as f32).sqrt();
        add(format!("{p}.input_layernorm.weight"), vec![h], values(h, 0.1, 1.0));
        add(format!("{p}.post_attention_layernorm.weight"), vec![h], values(h, 0.1, 1.0));
        for (m, rows) in [("q_proj", heads * hd), ("k_proj", kv_heads * hd), ("v_proj", kv_heads * hd)] {
            add(format!("{p}.self_attn.{m}.weight"), vec![rows, h], values(rows * h, 2.0 * w, 0.0));
            add(format!("{p}.self_attn.{m}.bias"), vec![rows], values(rows, 0.1, 0.0));
        }
        add(format!("{p}.self_attn.o_proj.weight"), vec![h, heads * hd], values(h * heads * hd, 2.0 * w, 0.0));
        add(format!("{p}.mlp.gate_proj.weight"), vec![inter, h], values(inter * h, 2.0 * w, 0.0));
        add(format!("{p}.mlp.up_proj.weight"), vec![inter, h], values(inter * h, 2.0 * w, 0.0));
        let wd = 1.0 / (inter as f32).sqrt();
        add(format!("{p}.mlp.down_proj.weight"), vec![h, inter], values(h * inter, 2.0 * wd, 0.0));
    }
    let bytes: Vec<Vec<u8>> =
        tensors.iter().map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let list: Vec<(String, String, Vec<usize>, &[u8])> =
        tensors.iter().zip(&bytes).map(|((n, s, _), b)| (n.clone(), "F32".to_string(), s.clone(), &b[..])).collect();
    ember_model::advanced::write_safetensors(&dir.join("model.safetensors"), &list, &Default::default()).unwrap();
}

/// [`write_wide_model`] with [`tiny_model`]'s tokenizer: a model folder for
/// the whole `Model` API.
pub fn wide_model() -> Scratch {
    let s = Scratch::new("wide");
    write_wide_model(s.path());
    write_word_tokenizer(s.path());
    s
}

/// `fixtures/<variant>/reference.json`.
pub struct Reference {
    pub ids: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
    pub greedy_ids: Vec<u32>,
}

pub fn reference(variant: &str) -> Reference {
    let text = std::fs::read_to_string(fixtures().join(variant).join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| v[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    Reference {
        ids: ids("ids"),
        greedy_ids: ids("greedy_ids"),
        logits: v["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
            .collect(),
    }
}

/// A case of `fixtures/templates/cases.json` (made by
/// `fixtures/templates/make_cases.py`): messages, tools and what
/// transformers' `apply_chat_template` rendered.
#[derive(serde::Deserialize)]
pub struct TemplateCase {
    pub name: String,
    pub messages: Vec<ember_model::Message>,
    pub tools: Option<Vec<ember_model::Tool>>,
    pub add_generation_prompt: bool,
    pub rendered: String,
}

/// Every case of `fixtures/templates/cases.json`.
pub fn template_cases() -> Vec<TemplateCase> {
    let text = std::fs::read_to_string(fixtures().join("templates/cases.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}
