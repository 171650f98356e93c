//! Real GGUF files of the test model: the one `cargo xtask fetch` downloads
//! (beside the default model folder, `<models>/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`)
//! and llama.cpp-made Q8_0 / Q4_0 / BF16 copies in `$EMBER_PEERS_GGUF`
//! (default `~/.cache/ember-peers/gguf`). A file that is absent is skipped
//! with a message; a file that is present is checked in full.
//!
//! - ember's in-place Q8_0, Q4_0 and BF16 rows equal the `gguf` Python
//!   package's numpy dequantizers (`fixtures/gguf/oracle.json`, made by
//!   `scripts/gguf_oracle.py`) exactly: Q8_0 is ember's INT8 block and Q4_0
//!   its INT4 block, byte for byte.
//! - The tokenizer built from `tokenizer.ggml.*` gives the ids of
//!   `tokenizer.json`, and the file's chat template renders byte for byte
//!   what transformers renders.
//! - Unsupported types (the fetched Q4_K_M file's Q5_0, Q4_K, Q6_K) are an
//!   error naming the tensor and its type.

mod common;

use ember_model::advanced::gguf::Gguf;
use ember_model::advanced::TensorStore;
use ember_model::{Error, Model, Tokenizer};
use std::path::PathBuf;

fn peers(kind: &str) -> Option<PathBuf> {
    let dir = match std::env::var_os("EMBER_PEERS_GGUF") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/ember-peers/gguf"),
    };
    let p = dir.join(format!("qwen2.5-coder-0.5b-instruct-{kind}.gguf"));
    present(p)
}

fn fetched() -> Option<PathBuf> {
    let dir = ember_model::default_model_dir()?;
    present(dir.with_file_name("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
}

fn present(p: PathBuf) -> Option<PathBuf> {
    if p.is_file() {
        Some(p)
    } else {
        eprintln!("skipped: {} is absent", p.display());
        None
    }
}

#[test]
fn in_place_rows_equal_the_gguf_package_dequantizers() {
    let oracle: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(common::fixtures().join("gguf/oracle.json")).unwrap()).unwrap();
    for (kind, want_type) in [("q8_0", "int8"), ("q4_0", "int4"), ("bf16", "bf16")] {
        let Some(path) = peers(kind) else { continue };
        let store = TensorStore::open_gguf(Gguf::open(&path).unwrap()).unwrap();
        let tensors = oracle[kind]["tensors"].as_object().unwrap();
        assert_eq!(tensors.len(), 3);
        for (name, t) in tensors {
            let tensor = store.get_any(&ember_model::advanced::gguf::hf_name(name)).unwrap();
            assert_eq!(tensor.dtype.name(), want_type, "{kind} {name}");
            let m = tensor.matrix();
            let mut row = vec![0.0f32; m.cols];
            for (r, want) in t["row_ids"].as_array().unwrap().iter().zip(t["rows"].as_array().unwrap()) {
                m.row_to_f32(r.as_u64().unwrap() as usize, &mut row);
                let want: Vec<f32> = want.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
                assert_eq!(row, want, "{kind} {name} row {r}");
            }
        }
    }
}

/// The fetched file's tokenizer (or a peer's: the same tokenizer).
fn gguf_tokenizer() -> Option<Tokenizer> {
    let path = fetched().or_else(|| peers("q8_0"))?;
    Some(Tokenizer::from_gguf(&Gguf::open(&path).unwrap()).unwrap())
}

#[test]
fn tokenizer_and_template_equal_the_folder_and_transformers() {
    let Some(g) = gguf_tokenizer() else { return };
    let hf = Tokenizer::from_dir(&common::fixtures().join("qwen2.5-coder-0.5b-instruct")).unwrap();
    assert_eq!(g.vocab_size(), hf.vocab_size());
    // The reference prompts: their text and ids as transformers made them.
    let refs = std::fs::read_to_string(common::fixtures().join("reference/greedy.jsonl")).unwrap();
    let mut texts = Vec::new();
    for line in refs.lines() {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        let text = r["prompt_text"].as_str().unwrap().to_string();
        let want: Vec<u32> = r["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(g.encode(&text).unwrap(), want, "{}", r["name"]);
        texts.push(text);
    }
    assert!(texts.len() >= 6);
    texts.push(std::fs::read_to_string(common::fixtures().join("reference/long_prompt.txt")).unwrap());
    // Template cases: the file's template renders what transformers rendered.
    let cases = common::template_cases();
    for c in &cases {
        let tools = c.tools.as_deref().unwrap_or_default();
        let got = g.apply_chat_template_with_tools(&c.messages, tools, c.add_generation_prompt).unwrap();
        assert_eq!(got, c.rendered, "case {}", c.name);
        texts.push(got);
    }
    // Multilingual, emoji, code, odd whitespace, special and added tokens.
    texts.push(
        "用一句话介绍长城。日本語のテキスト, Ελληνικά, русский, العربية, हिन्दी; emoji 🦀🔥👩‍👩‍👧 café naïve\n\
         fn main() {\n\tlet x: Vec<u8> = vec![0xff; 3];\r\n    println!(\"{x:?}\"); // it's 'quoted' I'll we've\n}\n\n\n   \
         trailing   <|im_start|>user\n<tool_call>{\"a\": 1}</tool_call><|endoftext|> 12345678 3.14159"
            .into(),
    );
    for text in &texts {
        let ids = hf.encode(text).unwrap();
        assert_eq!(g.encode(text).unwrap(), ids, "{text:?}");
        assert_eq!(g.decode(&ids, false).unwrap(), hf.decode(&ids, false).unwrap());
        assert_eq!(g.decode(&ids, true).unwrap(), hf.decode(&ids, true).unwrap());
    }
}

#[test]
fn the_fetched_q4_k_m_file_names_an_unsupported_tensor() {
    let Some(path) = fetched() else { return };
    let e = Model::load(&path).unwrap_err();
    match &e {
        Error::GgufType { name, ty, .. } => {
            assert!(["Q4_K", "Q5_0", "Q6_K"].contains(&ty.as_str()), "{e}");
            assert!(name.starts_with("token_embd") || name.starts_with("blk."), "{e}");
        }
        other => panic!("expected an unsupported-type error, got {other}"),
    }
}

#[test]
fn q8_0_file_loads_with_its_eos_tokens() {
    let Some(path) = peers("q8_0") else { return };
    let m = ember_model::advanced::load_qwen2(&path).unwrap();
    let c = &m.config;
    assert_eq!((c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads), (896, 24, 14, 2));
    assert_eq!((c.intermediate_size, c.vocab_size, c.max_position_embeddings), (4864, 151936, 32768));
    assert_eq!(c.rope_theta, 1e6);
    assert_eq!(c.rms_norm_eps, 1e-6);
    assert!(c.tie_word_embeddings);
    assert_eq!(m.layers[3].mlp.down_proj.weight.dtype, ember_model::WeightType::Int8);
    assert!(m.lm_head.same_data(&m.embed_tokens));
    // No generation_config.json: generation stops on the file's EOS and, as
    // in llama.cpp, on the other end-of-turn control tokens.
    let model = Model::load(&path).unwrap();
    assert_eq!(model.eos_token_ids(), [151643, 151645]);
    assert_eq!(model.dir(), path);
}

/// llama.cpp's BF16 GGUF holds the safetensors folder's tensors byte for
/// byte under llama.cpp's names, dims reversed: in particular q and k are
/// not permuted for Qwen2 (llama.cpp's NEOX RoPE is ember's rotate-half), so
/// the tensors load as they are.
#[test]
fn bf16_file_holds_the_folders_tensors_unpermuted() {
    let (Some(path), Some(dir)) = (peers("bf16"), ember_model::default_model_dir()) else { return };
    let Some(_) = present(dir.join("model.safetensors")) else { return };
    let g = TensorStore::open_gguf(Gguf::open(&path).unwrap()).unwrap();
    let st = TensorStore::open_dir(&dir).unwrap();
    let mut n = 0;
    for name in st.names() {
        let a = st.get_any(name).unwrap();
        let b = g.get_any(name).unwrap();
        assert_eq!(a.shape, b.shape, "{name}");
        if a.shape.len() == 2 {
            assert_eq!(a.dtype, b.dtype, "{name}");
            assert!(a.as_bytes() == b.as_bytes(), "{name} differs");
        } else {
            // llama.cpp stores norms and biases as F32: the same values.
            assert_eq!(a.to_f32_vec(), b.to_f32_vec(), "{name}");
        }
        n += 1;
    }
    assert_eq!(n, g.names().count());
    assert_eq!(n, 24 * 12 + 2);
}
