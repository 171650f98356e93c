//! Bad input gives an error that names the file, tensor or field, never a panic.

mod common;

use common::{tiny_model, Scratch};
use ember_model::{Error, GenerateOptions, Model};
use std::path::Path;

fn load_err(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, v.to_string()).unwrap();
}

/// Rewrites `model.safetensors` with its header passed through `f`.
fn edit_header(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(&mut header);
    let mut h = header.to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(&bytes[8 + n..]);
    std::fs::write(p, out).unwrap();
}

#[test]
fn missing_folder() {
    let e = load_err(Path::new("/nonexistent/ember-model"));
    assert!(e.contains("/nonexistent/ember-model") && e.contains("does not exist"), "{e}");
}

#[test]
fn missing_config() {
    let d = tiny_model("tiny-tied");
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn invalid_config() {
    let d = tiny_model("tiny-tied");
    std::fs::write(d.path().join("config.json"), "{\"hidden_size\": 64,").unwrap();
    assert!(load_err(d.path()).contains("config.json"));
    let d = tiny_model("tiny-tied");
    edit_config(d.path(), |c| c["num_key_value_heads"] = 3.into());
    let e = load_err(d.path());
    assert!(e.contains("num_key_value_heads"), "{e}");
    let d = tiny_model("tiny-tied");
    edit_config(d.path(), |c| c["hidden_size"] = "wide".into());
    let e = load_err(d.path());
    assert!(e.contains("config.json") && e.contains("hidden_size") || e.contains("invalid type"), "{e}");
}

#[test]
fn unknown_architecture() {
    let d = tiny_model("tiny-tied");
    edit_config(d.path(), |c| {
        c["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        c["model_type"] = "mistral".into();
    });
    let e = load_err(d.path());
    assert!(e.contains("MistralForCausalLM") && e.contains("unsupported architecture"), "{e}");
}

#[test]
fn missing_tensor() {
    let d = tiny_model("tiny-tied");
    edit_header(d.path(), |h| {
        h.as_object_mut().unwrap().remove("model.layers.1.mlp.up_proj.weight");
    });
    // The data no longer lines up with the header: either message is a clear
    // error, but it must name the file.
    let e = load_err(d.path());
    assert!(e.contains("model.safetensors"), "{e}");

    // A model that needs an untied head but has none.
    let d = tiny_model("tiny-tied");
    edit_config(d.path(), |c| c["tie_word_embeddings"] = false.into());
    let e = load_err(d.path());
    assert!(e.contains("lm_head.weight") && e.contains("missing"), "{e}");
}

#[test]
fn missing_tensor_in_shard_index() {
    let d = tiny_model("tiny-untied");
    let p = d.path().join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    v["weight_map"]
        .as_object_mut()
        .unwrap()
        .insert("model.layers.0.extra.weight".into(), "model-00001-of-00003.safetensors".into());
    std::fs::write(&p, v.to_string()).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model.layers.0.extra.weight"), "{e}");
}

#[test]
fn wrong_shape() {
    let d = tiny_model("tiny-tied");
    edit_config(d.path(), |c| c["intermediate_size"] = 128.into());
    let e = load_err(d.path());
    assert!(
        e.contains("model.layers.0.mlp.gate_proj.weight") && e.contains("[160, 64]") && e.contains("[128, 64]"),
        "{e}"
    );
}

#[test]
fn unsupported_dtype() {
    let d = tiny_model("tiny-tied");
    edit_header(d.path(), |h| {
        // Same byte size as BF16, a type ember does not compute with.
        h["model.norm.weight"]["dtype"] = "I16".into();
    });
    let e = load_err(d.path());
    assert!(e.contains("model.norm.weight") && e.contains("I16"), "{e}");
}

#[test]
fn truncated_or_corrupt_safetensors() {
    let d = tiny_model("tiny-tied");
    let p = d.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model.safetensors") && e.contains("truncated"), "{e}");

    std::fs::write(&p, &bytes[..5]).unwrap();
    assert!(load_err(d.path()).contains("model.safetensors"));

    // A header length pointing far past the end of the file.
    let mut corrupt = bytes.clone();
    corrupt[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&p, &corrupt).unwrap();
    assert!(load_err(d.path()).contains("model.safetensors"));

    // A header that is not JSON.
    let mut corrupt = bytes.clone();
    corrupt[8..16].copy_from_slice(b"garbage!");
    std::fs::write(&p, &corrupt).unwrap();
    assert!(load_err(d.path()).contains("model.safetensors"));
}

#[test]
fn missing_weights() {
    let d = tiny_model("tiny-tied");
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn missing_or_invalid_tokenizer() {
    let d = tiny_model("tiny-tied");
    std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("tokenizer.json"), "{e}");
    std::fs::write(d.path().join("tokenizer.json"), "{}").unwrap();
    let e = load_err(d.path());
    assert!(e.contains("tokenizer.json"), "{e}");
}

#[test]
fn prompt_longer_than_the_context() {
    let d = tiny_model("tiny-tied");
    let model = Model::load(d.path()).unwrap();
    let mut s = model.session_with_context(4).unwrap();
    match s.generate(&[1, 2, 3, 4, 5], GenerateOptions::default()) {
        Err(e @ Error::PromptTooLong { .. }) => assert!(e.to_string().contains("5 tokens"), "{e}"),
        other => panic!("expected PromptTooLong, got {:?}", other.err()),
    }
    assert!(model.session_with_context(0).is_err());
    assert!(model.session_with_context(100_000).is_err(), "beyond max_position_embeddings");
}

#[test]
fn token_outside_the_vocabulary() {
    let d = tiny_model("tiny-tied");
    let model = Model::load(d.path()).unwrap();
    let mut s = model.session_with_context(16).unwrap();
    assert!(matches!(s.generate(&[5, 96], GenerateOptions::default()), Err(Error::TokenOutOfRange { id: 96, .. })));
    assert!(matches!(s.generate(&[], GenerateOptions::default()), Err(Error::EmptyPrompt)));
}

#[test]
fn scratch_dirs_are_independent() {
    let a = Scratch::new("a");
    let b = Scratch::new("a");
    assert_ne!(a.path(), b.path());
}
