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
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..96).map(|i| (format!("w{i}"), serde_json::Value::from(i))).collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
    });
    std::fs::write(s.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = serde_json::json!({
        "chat_template": "{% for m in messages %}w3 {{ m.content }} w4 {% endfor %}{% if add_generation_prompt %}w5{% endif %}",
        "eos_token": "w2"
    });
    std::fs::write(s.path().join("tokenizer_config.json"), config.to_string()).unwrap();
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
