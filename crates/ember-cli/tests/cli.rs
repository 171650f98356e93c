//! The `ember` binary end to end on a tiny fixture model: output format, and
//! bad input giving a message and a non-zero exit, never a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// tiny-tied plus a word-level tokenizer (ids 0..96 are the words w0..w95).
fn tiny_model() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(make_tiny_model).clone()
}

fn make_tiny_model() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ember-cli-tiny-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    for entry in std::fs::read_dir(fixtures().join("tiny-tied")).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.join(p.file_name().unwrap())).unwrap();
    }
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..96).map(|i| (format!("w{i}"), serde_json::Value::from(i))).collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
    });
    std::fs::write(tmp.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = serde_json::json!({"chat_template": "{% for m in messages %}w3 {{ m.content }} w4 {% endfor %}w5"});
    std::fs::write(tmp.join("tokenizer_config.json"), config.to_string()).unwrap();
    tmp
}

fn ember(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ember")).args(args).output().unwrap()
}

fn assert_clean_failure(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "should fail: {err}");
    assert!(!err.contains("panicked"), "panic instead of an error: {err}");
    assert!(err.contains("error:") && err.contains(needle), "message should mention {needle:?}: {err}");
}

#[test]
fn json_output_has_the_documented_fields() {
    let model = tiny_model();
    let out = ember(&[
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "w17 w42 w5",
        "--temperature",
        "0",
        "-n",
        "5",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["prompt_ids"], serde_json::json!([17, 42, 5]));
    assert_eq!(v["ids"].as_array().unwrap().len(), 5);
    assert!(v["text"].is_string());
    assert!(v["prefill_tok_s"].as_f64().unwrap() > 0.0);
    assert!(v["decode_tok_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn streams_text_and_reports_speed_on_stderr() {
    let model = tiny_model();
    let out = ember(&["--model", model.to_str().unwrap(), "--prompt", "w17 w42", "--seed", "3", "-n", "4"]);
    assert!(out.status.success());
    assert!(!out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("prefill:") && err.contains("decode:") && err.contains("tok/s"), "{err}");
}

#[test]
fn same_seed_same_text() {
    let model = tiny_model();
    let run = |seed: &str| {
        let out = ember(&[
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "w1 w2",
            "--temperature",
            "0.8",
            "--seed",
            seed,
            "-n",
            "12",
            "--json",
        ]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["ids"].clone()
    };
    assert_eq!(run("11"), run("11"));
    assert_ne!(run("11"), run("12"));
}

#[test]
fn missing_model_folder() {
    let out = ember(&["--model", "/nonexistent/model", "--prompt", "hi"]);
    assert_clean_failure(&out, "/nonexistent/model");
}

#[test]
fn prompt_longer_than_context() {
    let model = tiny_model();
    let out = ember(&["--model", model.to_str().unwrap(), "--prompt", "w1 w2 w3 w4 w5 w6", "--ctx", "4"]);
    assert_clean_failure(&out, "context");
}

#[test]
fn invalid_sampling_settings() {
    let model = tiny_model();
    let out = ember(&["--model", model.to_str().unwrap(), "--prompt", "w1", "--top-p", "1.5"]);
    assert_clean_failure(&out, "top_p");
    let out = ember(&["--model", model.to_str().unwrap(), "--prompt", "w1", "--threads", "0"]);
    assert_clean_failure(&out, "threads");
}

#[test]
fn corrupt_weights() {
    let model = tiny_model();
    let broken = model.with_file_name(format!("ember-cli-broken-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&broken);
    std::fs::create_dir_all(&broken).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(model.join(f), broken.join(f)).unwrap();
    }
    let bytes = std::fs::read(model.join("model.safetensors")).unwrap();
    std::fs::write(broken.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let out = ember(&["--model", broken.to_str().unwrap(), "--prompt", "w1"]);
    let _ = std::fs::remove_dir_all(&broken);
    assert_clean_failure(&out, "model.safetensors");
}
