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
    // ChatML-like: the generation prompt (w5) begins the assistant's turn as
    // rendered later, so a conversation's renderings extend each other.
    let template = "{% for m in messages %}{% if m.role == 'assistant' %}w5 {{ m.content }} w4 {% else %}w3 {{ m.content }} w4 {% endif %}{% endfor %}{% if add_generation_prompt %}w5{% endif %}";
    let config = serde_json::json!({ "chat_template": template });
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
fn negative_numbers_are_values_out_of_range() {
    let model = tiny_model();
    for (flag, value, names) in
        [("--temperature", "-1", "temperature"), ("--top-k", "-3", "top-k"), ("--seed", "-1", "seed")]
    {
        let out = ember(&["--model", model.to_str().unwrap(), "--prompt", "w1", flag, value]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value}: {err}");
        assert!(!err.contains("unexpected argument"), "{flag} {value}: {err}");
        assert!(err.contains(names) && err.contains(value), "{flag} {value}: {err}");
        // Each cause once.
        let first = err.lines().next().unwrap_or("");
        let words: Vec<&str> = first.split(": ").collect();
        let mut seen = std::collections::HashSet::new();
        assert!(words.iter().all(|w| seen.insert(*w)), "a cause printed twice: {first}");
        let out = ember(&["chat", "--model", model.to_str().unwrap(), flag, value]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("unexpected argument"), "chat {flag} {value}: {err}");
    }
}

#[test]
fn lengths_beyond_the_models_positions_are_refused_before_allocating() {
    let model = tiny_model();
    let m = model.to_str().unwrap();
    let corpus = model.with_file_name(format!("ember-cli-corpus-{}.txt", std::process::id()));
    // More tokens than the tiny model's 256 positions: the corpus is not
    // what stops a long --ctx.
    std::fs::write(&corpus, "w1 w2 w3 ".repeat(400)).unwrap();
    let cases: [&[&str]; 5] = [
        &["bench", "--model", m, "-p", "100000000", "-n", "0", "-r", "1"],
        &["bench", "--model", m, "-p", "0", "-n", "100000000", "-r", "1"],
        &["bench", "--model", m, "-p", "0", "-n", "8", "-r", "1", "--sequences", "2", "--sequence-prompt", "100000"],
        &["eval", "--model", m, "--corpus", corpus.to_str().unwrap(), "--ctx", "300"],
        &["eval", "--model", m, "--corpus", corpus.to_str().unwrap(), "--ctx", "1000"],
    ];
    for args in cases {
        let out = ember(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("positions"), "{args:?}: {err}");
        assert!(!err.contains("panicked") && !err.contains("memory allocation"), "{args:?}: {err}");
    }
    let _ = std::fs::remove_file(corpus);
}

#[test]
fn more_threads_than_the_machine_are_capped_with_a_warning() {
    let model = tiny_model();
    for t in ["1000", "100000", "18446744073709551615"] {
        let out = ember(&["--model", model.to_str().unwrap(), "--prompt", "w1", "--max-tokens", "2", "--threads", t]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "--threads {t}: {err}");
        assert!(err.contains("warning: --threads") && err.contains("hardware threads"), "--threads {t}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
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

#[test]
fn piped_chat_keeps_the_conversation() {
    use std::io::Write;
    let model = tiny_model();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["chat", "--model", model.to_str().unwrap(), "--temperature", "0", "-n", "3", "--json"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"w10 w11 w12\nw13 w14\n/reset\nw15\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let turns: Vec<serde_json::Value> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(turns.len(), 3);
    let n = |t: &serde_json::Value, k: &str| t[k].as_u64().unwrap();
    // Turn 1 runs everything; turn 2 reuses turn 1's prompt and reply.
    assert_eq!(n(&turns[0], "reused_tokens"), 0);
    assert_eq!(n(&turns[1], "reused_tokens") + n(&turns[1], "prefill_tokens"), n(&turns[1], "prompt_tokens"));
    assert!(n(&turns[1], "reused_tokens") >= n(&turns[0], "prompt_tokens"));
    // After /reset nothing is reused.
    assert_eq!(n(&turns[2], "reused_tokens"), 0);
}

#[test]
fn stop_strings_cut_the_output() {
    let model = tiny_model();
    let m = model.to_str().unwrap();
    let full = ember(&["--model", m, "--prompt", "w17 w42 w5", "--temperature", "0", "-n", "6", "--json"]);
    let full: serde_json::Value = serde_json::from_slice(&full.stdout).unwrap();
    let text = full["text"].as_str().unwrap().to_string();
    let third = text.split_whitespace().nth(2).unwrap().to_string();
    let out =
        ember(&["--model", m, "--prompt", "w17 w42 w5", "--temperature", "0", "-n", "6", "--json", "--stop", &third]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["stop"], "stop_string");
    assert_eq!(v["text"].as_str().unwrap(), &text[..text.find(&third).unwrap()]);
}

#[test]
fn quantize_eval_and_generate_with_int4() {
    let model = tiny_model();
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ember-cli-q4-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out_dir);
    let q =
        ember(&["quantize", "--model", model.to_str().unwrap(), "--quant", "int4", "--out", out_dir.to_str().unwrap()]);
    assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    assert!(out_dir.join("model.safetensors").is_file() && out_dir.join("tokenizer.json").is_file());
    let g = ember(&[
        "--model",
        out_dir.to_str().unwrap(),
        "--prompt",
        "w1 w2 w3",
        "--temperature",
        "0",
        "-n",
        "4",
        "--json",
    ]);
    assert!(g.status.success(), "{}", String::from_utf8_lossy(&g.stderr));
    // A corpus of words the tiny tokenizer knows: 4 windows of 16.
    let corpus = out_dir.join("corpus.txt");
    let words: Vec<String> = (0..64).map(|i| format!("w{}", (i * 7) % 96)).collect();
    std::fs::write(&corpus, words.join(" ")).unwrap();
    let e = ember(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--quant",
        "int8",
        "--corpus",
        corpus.to_str().unwrap(),
        "--ctx",
        "16",
        "--json",
    ]);
    assert!(e.status.success(), "{}", String::from_utf8_lossy(&e.stderr));
    let v: serde_json::Value = serde_json::from_slice(&e.stdout).unwrap();
    for k in ["ppl", "kld_mean", "kld_p99", "top1"] {
        assert!(v[k].as_f64().is_some_and(f64::is_finite), "{k} in {v}");
    }
    assert!(v["top1"].as_f64().unwrap() <= 1.0);
    let _ = std::fs::remove_dir_all(&out_dir);
}

#[test]
fn bad_quantization_arguments() {
    let model = tiny_model();
    let m = model.to_str().unwrap();
    assert_clean_failure(&ember(&["--model", m, "--prompt", "w1", "--quant", "int3"]), "int3");
    assert_clean_failure(&ember(&["quantize", "--model", m, "--quant", "int8", "--out", m]), "another folder");
    let gguf = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ember-quantize-source.gguf");
    std::fs::write(&gguf, b"GGUF").unwrap();
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ember-quantize-from-gguf");
    let args = ["quantize", "--model", gguf.to_str().unwrap(), "--quant", "int8", "--out", out.to_str().unwrap()];
    assert_clean_failure(&ember(&args), "safetensors model folder");
    assert!(!out.exists(), "nothing written");
    assert_clean_failure(&ember(&["eval", "--model", m, "--corpus", "/nonexistent/corpus.txt"]), "corpus");
    let short = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ember-short-corpus.txt");
    std::fs::write(&short, "w1 w2 w3").unwrap();
    assert_clean_failure(&ember(&["eval", "--model", m, "--corpus", short.to_str().unwrap()]), "fewer than one window");
}

/// Runs `ember chat ARGS` with `input` piped in; returns the output and the
/// JSON turns it printed.
fn chat(args: &[&str], input: &[u8]) -> (Output, Vec<serde_json::Value>) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_ember"))
        .arg("chat")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    let turns = String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    (out, turns)
}

#[test]
fn a_line_of_invalid_utf8_in_chat_is_skipped_and_the_session_goes_on() {
    let model = tiny_model();
    let m = model.to_str().unwrap();
    let (out, turns) = chat(&["--model", m, "--temperature", "0", "-n", "2", "--json"], b"w10 w11\n\xff\xfe w3\nw12\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("not valid UTF-8"), "{err}");
    assert_eq!(turns.len(), 2, "the lines before and after were both answered: {turns:?}");
    assert!(turns[1]["reused_tokens"].as_u64().unwrap() > 0, "the conversation was kept");
}

#[test]
fn a_message_too_long_to_fit_alone_drops_nothing() {
    let model = tiny_model();
    let m = model.to_str().unwrap();
    let long: Vec<String> = (0..80).map(|i| format!("w{}", 10 + i % 80)).collect();
    let input = format!("w10 w11 w12\n{}\nw13\n", long.join(" "));
    for mode in ["drop", "stop"] {
        let args = ["--model", m, "--temperature", "0", "-n", "2", "--ctx", "48", "--context-full", mode, "--json"];
        let (out, turns) = chat(&args, input.as_bytes());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(err.contains("alone is too long") && err.contains("--ctx"), "{mode}: {err}");
        assert!(!err.contains("--context-full drop"), "{mode}: dropping cannot help, so it is not suggested: {err}");
        assert_eq!(turns.len(), 2, "{mode}: {turns:?}");
        // The first turn is still there when the third comes.
        assert_eq!(turns[1]["dropped_turns"], 0, "{mode}");
        assert!(turns[1]["reused_tokens"].as_u64().unwrap() > 0, "{mode}: {turns:?}");
    }
}

#[test]
fn top_logits_with_no_new_token_are_the_prompts() {
    let model = tiny_model();
    let m = model.to_str().unwrap();
    let run = |n: &str| {
        let out = ember(&["--model", m, "--prompt", "w17 w42 w5", "-n", n, "--json", "--top-logits", "3"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let (zero, one) = (run("0"), run("1"));
    assert_eq!(zero["ids"].as_array().unwrap().len(), 0);
    assert_eq!(zero["top_logits"]["ids"].as_array().unwrap().len(), 3, "{zero}");
    assert_eq!(zero["top_logits"]["ids"], one["top_logits"]["ids"]);
    let (a, b) = (&zero["top_logits"]["logits"], &one["top_logits"]["logits"]);
    for i in 0..3 {
        assert!((a[i].as_f64().unwrap() - b[i].as_f64().unwrap()).abs() < 1e-4, "{a} vs {b}");
    }
}

/// A copy of the tiny model with `tensor` (BF16) all NaN.
fn nan_model(tag: &str, tensor: &str) -> PathBuf {
    let src = tiny_model();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ember-cli-nan-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert_eq!(header[tensor]["dtype"], "BF16");
    let [a, b] = [0, 1].map(|i| header[tensor]["data_offsets"][i].as_u64().unwrap() as usize + 8 + n);
    for w in bytes[a..b].chunks_exact_mut(2) {
        w.copy_from_slice(&0x7fc0u16.to_le_bytes());
    }
    std::fs::write(&path, bytes).unwrap();
    dir
}

#[test]
fn nan_weights_are_an_error_not_a_token() {
    let dir = nan_model("gen", "model.layers.0.mlp.down_proj.weight");
    let d = dir.to_str().unwrap();
    assert_clean_failure(&ember(&["--model", d, "--prompt", "w1 w2", "-n", "3"]), "non-finite");
    let top = ember(&["--model", d, "--prompt", "w1 w2", "-n", "0", "--json", "--top-logits", "3"]);
    assert_clean_failure(&top, "non-finite");
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, (0..64).map(|i| format!("w{}", i % 90)).collect::<Vec<_>>().join(" ")).unwrap();
    let eval = ember(&["eval", "--model", d, "--corpus", corpus.to_str().unwrap(), "--ctx", "16", "--json"]);
    assert_clean_failure(&eval, "non-finite");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn quantizing_an_int8_folder_to_int4_is_refused() {
    // Rows of whole 128-weight blocks, so `--quant int4` wants INT4 (the
    // tiny fixtures' 64-wide rows would get INT8 either way).
    let wide = model_tests::wide_model();
    let model = wide.path();
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let (q8, q4) = (tmp.join(format!("ember-cli-rq8-{}", std::process::id())), tmp.join("ember-cli-rq4"));
    let _ = std::fs::remove_dir_all(&q8);
    let _ = std::fs::remove_dir_all(&q4);
    let out =
        ember(&["quantize", "--model", model.to_str().unwrap(), "--quant", "int8", "--out", q8.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let before = std::fs::read(q8.join("model.safetensors")).unwrap();
    let again = ember(&["quantize", "--model", q8.to_str().unwrap(), "--quant", "int4", "--out", q4.to_str().unwrap()]);
    assert_clean_failure(&again, "quantize from the BF16");
    assert!(!q4.exists(), "nothing written");
    let at_load = ember(&["--model", q8.to_str().unwrap(), "--prompt", "w1", "--quant", "int4"]);
    assert_clean_failure(&at_load, "is stored as int8");
    assert_eq!(std::fs::read(q8.join("model.safetensors")).unwrap(), before, "the source is untouched");
    let _ = std::fs::remove_dir_all(&q8);
}

/// `ember-model`'s test helpers (the wide random model).
#[path = "../../ember-model/tests/common/mod.rs"]
mod model_tests;

#[test]
fn an_unwritable_out_is_refused_before_quantizing() {
    let model = tiny_model();
    let out =
        ember(&["quantize", "--model", model.to_str().unwrap(), "--quant", "int8", "--out", "/proc/ember-out/q8"]);
    assert_clean_failure(&out, "/proc/ember-out/q8");
    assert!(!String::from_utf8_lossy(&out.stderr).contains("quantized to"), "refused before the work");
}

/// A disk that fills while writing (here a file-size limit, with SIGXFSZ
/// ignored so writes fail with an error as on a full disk): an error, and
/// no temporary file or folder left beside the output.
#[test]
fn a_write_that_fails_midway_leaves_nothing_behind() {
    let model = tiny_model();
    let parent = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ember-cli-full-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&parent);
    std::fs::create_dir_all(&parent).unwrap();
    // (A GGUF output goes the same way, `.gguf.partial` removed on error;
    // the tiny model's word-level tokenizer cannot be written to GGUF.)
    let out = parent.join("q8");
    // 16 blocks of 512 bytes: the small files fit, the weights do not.
    let script = format!(
        "trap '' XFSZ; ulimit -f 16; exec '{}' quantize --model '{}' --quant int8 --out '{}'",
        env!("CARGO_BIN_EXE_ember"),
        model.display(),
        out.display()
    );
    let run = Command::new("sh").args(["-c", &script]).output().unwrap();
    assert_clean_failure(&run, "File too large");
    let left: Vec<_> = std::fs::read_dir(&parent).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "{}: left behind {left:?}", out.display());
    let _ = std::fs::remove_dir_all(&parent);
}

#[test]
fn bench_rows_with_two_threads_carry_the_threads_handoff() {
    let model = tiny_model();
    let m = model.to_str().unwrap();
    for threads in ["1", "2"] {
        let args =
            ["bench", "--model", m, "-p", "8", "-n", "4", "-r", "2", "-t", threads, "--sequences", "2", "--json"];
        let out = ember(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(rows.len(), 3, "pp8, tg4 and tg4 of 2 sequences");
        for r in &rows {
            // A round trip between two threads' caches, with two of them.
            let ns = r["handoff_ns"].as_f64();
            assert_eq!(ns.is_some(), threads == "2", "{r}");
            assert!(ns.is_none_or(|ns| ns > 0.0 && ns < 1e6), "{r}");
        }
    }
}

#[test]
fn bench_phases_time_every_part_of_a_decoded_token() {
    let model = tiny_model();
    let m = model.to_str().unwrap();
    let out = ember(&["bench", "--model", m, "-p", "0", "-n", "4", "-r", "1", "-t", "1", "--phases", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert!(rows[0]["phase"].is_null() && rows[0]["test"] == "tg4" && rows[0]["read_pct"].is_number());
    let phases: Vec<&serde_json::Value> = rows.iter().filter(|r| !r["phase"].is_null()).collect();
    let names: Vec<&str> = phases.iter().map(|r| r["phase"].as_str().unwrap()).collect();
    assert_eq!(names, ["embed", "q/k/v", "attention", "o", "gate/up", "down", "lm head"]);
    for r in &phases {
        assert_eq!(r["test"], "tg4");
        assert!(r["us_per_token"].as_f64().unwrap() > 0.0, "{r}");
        // The products stream weights and are rated against the read ceiling.
        let product = !matches!(r["phase"].as_str(), Some("embed" | "attention"));
        assert_eq!(r["read_pct"].is_number(), product, "{r}");
        assert_eq!(r["gb_s"].is_number(), product, "{r}");
        // Beside the one-pass ceiling, the same bytes read a section at a time.
        assert_eq!(r["read_by_section_gb_s"].as_f64().is_some_and(|g| g > 0.0), product, "{r}");
        // One thread: no parallel sections to split the time by.
        assert!(r["serial_us_per_token"].is_null() && r["wait_us_per_token"].is_null(), "{r}");
    }
    // Two threads: the time outside the pool's sections, and the wait at
    // their ends, are parts of each phase's time.
    let out = ember(&["bench", "--model", m, "-p", "0", "-n", "4", "-r", "1", "-t", "2", "--phases", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    for r in rows.iter().filter(|r| !r["phase"].is_null()) {
        let (us, serial, wait) =
            (r["us_per_token"].as_f64(), r["serial_us_per_token"].as_f64(), r["wait_us_per_token"].as_f64());
        let (us, serial, wait) = (us.unwrap(), serial.expect("serial time"), wait.expect("waiting time"));
        assert!(serial >= 0.0 && wait >= 0.0 && serial + wait <= us * 1.0001, "{r}");
    }
    let text = ember(&["bench", "--model", m, "-p", "0", "-n", "4", "-r", "1", "-t", "1", "--phases"]);
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains(" read GB/s | handoff ns |"), "{text}");
    assert!(text.contains("phases of tg4, 1 thread (") && text.contains("| lm head"), "{text}");
    assert!(text.contains(" GB/s in one pass, ") && text.contains(" a section at a time ("), "{text}");
    assert!(text.contains("| serial µs | waiting µs |"), "{text}");
}

#[test]
fn bench_phases_time_a_step_of_several_sequences() {
    let model = tiny_model();
    let m = model.to_str().unwrap();
    let args = ["bench", "--model", m, "-p", "0", "-n", "4", "-r", "1", "-t", "1", "--sequences", "1,3"];
    let out = ember(&[&args[..], &["--sequence-prompt", "5", "--phases", "--json"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    for s in [1, 3] {
        let of: Vec<&serde_json::Value> = rows.iter().filter(|r| r["sequences"] == s).collect();
        assert!(of[0]["phase"].is_null() && of[0]["test"] == "tg4", "{rows:?}");
        let names: Vec<&str> = of[1..].iter().map(|r| r["phase"].as_str().unwrap()).collect();
        assert_eq!(names, ["embed", "q/k/v", "attention", "o", "gate/up", "down", "lm head"], "{s} sequences");
        for r in &of[1..] {
            assert!(r["us_per_token"].as_f64().unwrap() > 0.0, "{r}");
            let product = !matches!(r["phase"].as_str(), Some("embed" | "attention"));
            assert_eq!(r["gb_s"].as_f64().is_some_and(|g| g > 0.0), product, "{r}");
        }
    }
    // The plain tg4 test's phases are per token, the sequences' per step.
    let text = ember(&[&args[..], &["--sequence-prompt", "5", "--phases"]].concat());
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains("phases of tg4, 3 sequences together, 1 thread ("), "{text}");
    assert!(text.contains("phases of tg4, 1 sequence, 1 thread ("), "{text}");
    assert!(text.contains("| phase     | µs/step  |"), "{text}");
    assert!(text.contains("| phase     | µs/token |"), "{text}");
}
