//! Real GGUF files of the test model: the one `cargo xtask fetch` downloads
//! (beside the default model folder, `<models>/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`)
//! and llama.cpp-made copies (`../shared/peers/ggufs.sh`: BF16, Q8_0, Q4_0,
//! Q4_1, Q5_0, Q5_1, Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K) in `$EMBER_PEERS_GGUF`
//! (default `~/.cache/ember-peers/gguf`). A file that is absent is skipped
//! with a message; a file that is present is checked in full.
//!
//! - ember's in-place rows of every type it runs (BF16, Q8_0, Q4_0, Q4_1,
//!   Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K in real files; Q2_K, which no file
//!   of this model holds, and all the ggml rows on random blocks) equal the
//!   `gguf` Python package's numpy dequantizers (`fixtures/gguf/oracle.json`,
//!   made by `scripts/gguf_oracle.py`) bit for bit: Q8_0 is ember's INT8
//!   block and Q4_0 its INT4 block, byte for byte.
//! - The tokenizer built from `tokenizer.ggml.*` gives the ids of
//!   `tokenizer.json`, and the file's chat template renders byte for byte
//!   what transformers renders.
//! - The fetched Q4_K_M file (Q5_0, Q8_0, Q4_K, Q6_K) runs in place.

mod common;

use ember_kernels::formats::{BlockQ4, BlockQ5};
use ember_model::advanced::gguf::Gguf;
use ember_model::advanced::{Tensor, TensorStore};
use ember_model::{Model, Tokenizer, WeightType};
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

fn oracle() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(common::fixtures().join("gguf/oracle.json")).unwrap()).unwrap()
}

/// FNV-1a 64 over the f32 values' little-endian bytes, as `scripts/gguf_oracle.py` hashes rows.
fn fnv1a64(row: &[f32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in row.iter().flat_map(|v| v.to_le_bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    format!("{h:016x}")
}

/// ember's type for a ggml type name of the oracle.
fn ember_type(ggml: &str) -> &'static str {
    match ggml {
        "Q8_0" => "int8",
        "Q4_0" => "q4_0",
        "BF16" => "bf16",
        "F16" => "f16",
        "F32" => "f32",
        "Q4_1" => "q4_1",
        "Q5_0" => "q5_0",
        "Q5_1" => "q5_1",
        "Q2_K" => "q2_k",
        "Q3_K" => "q3_k",
        "Q4_K" => "q4_k",
        "Q5_K" => "q5_k",
        "Q6_K" => "q6_k",
        other => panic!("the oracle holds a type ember does not run: {other}"),
    }
}

/// Every real tensor row of the oracle, read in place by ember's row
/// kernels (the active tier's dequantize, which equals the reference bit for
/// bit; the reference itself too), equals the `gguf` package's numpy
/// dequantizer's bit for bit (the row's FNV-1a 64 hash over its f32 bytes).
#[test]
fn in_place_rows_equal_the_gguf_package_dequantizers() {
    let oracle = oracle();
    let files = [
        "bf16",
        "q8_0",
        "q4_0",
        "q4_1",
        "q5_0",
        "q5_1",
        "q2_k",
        "q3_k_m",
        "q4_k_m",
        "q5_k_m",
        "q6_k",
        "fetched_q4_k_m",
    ];
    let mut seen = std::collections::BTreeSet::new();
    for kind in files {
        let path = if kind == "fetched_q4_k_m" { fetched() } else { peers(kind) };
        let Some(path) = path else { continue };
        let store = TensorStore::open_gguf(Gguf::open(&path).unwrap()).unwrap();
        let tensors = oracle[kind]["tensors"].as_object().unwrap();
        assert!(tensors.len() >= 3, "{kind}");
        for (name, t) in tensors {
            let tensor = store.get_any(&ember_model::advanced::gguf::hf_name(name)).unwrap();
            let ty = t["type"].as_str().unwrap();
            assert_eq!(tensor.dtype.name(), ember_type(ty), "{kind} {name}");
            seen.insert(ty.to_string());
            let m = tensor.matrix();
            assert_eq!(m.cols as u64, t["cols"].as_u64().unwrap());
            let (mut row, mut reference) = (vec![0.0f32; m.cols], vec![0.0f32; m.cols]);
            for (r, want) in t["row_ids"].as_array().unwrap().iter().zip(t["rows"].as_array().unwrap()) {
                let r = r.as_u64().unwrap() as usize;
                m.row_to_f32(r, &mut row);
                m.row_to_f32_with(ember_kernels::Isa::scalar(), r, &mut reference);
                assert!(row.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{kind} {name} row {r}");
                let head: Vec<f32> =
                    want["head"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
                let sum: f64 = row.iter().map(|&v| v as f64).sum();
                assert_eq!(
                    fnv1a64(&row),
                    want["fnv1a64"].as_str().unwrap(),
                    "{kind} {name} ({ty}) row {r}: first values {:?} vs {head:?}, sum {sum} vs {}",
                    &row[..8],
                    want["sum"]
                );
            }
        }
    }
    eprintln!("checked real tensors of types {seen:?}");
}

/// Random blocks of every ggml row (any scale sign, any code): ember's
/// reference dequantize and every tier's kernel equal the `gguf` package's
/// numpy dequantizers bit for bit. Needs no model file.
#[test]
fn random_blocks_equal_the_gguf_package_dequantizers() {
    let oracle = oracle();
    let random = oracle["random"].as_object().unwrap();
    assert_eq!(random.len(), 8);
    for (ty, case) in random {
        let hex = case["bytes"].as_str().unwrap();
        let bytes: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        // Blocks hold F16 fields: copy to 2-byte-aligned memory.
        let mut aligned = vec![0u16; bytes.len() / 2];
        bytemuck::cast_slice_mut::<u16, u8>(&mut aligned).copy_from_slice(&bytes);
        let wt = ember_kernels::WeightType::from_name(ember_type(ty)).unwrap();
        let w = ember_kernels::Weights::from_bytes(wt, bytemuck::cast_slice(&aligned)).unwrap();
        let want: Vec<f32> = case["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(w.len(), want.len(), "{ty}");
        let m = ember_kernels::MatRef::new(w, 1, w.len());
        for isa in ember_kernels::Isa::supported() {
            let mut got = vec![f32::NAN; w.len()];
            m.row_to_f32_with(isa, 0, &mut got);
            for (j, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{ty} {isa:?} weight {j}: {a} vs {b}");
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

/// The fetched Q4_K_M file loads in place: its matrices in their stored
/// ggml types (Q5_0, Q8_0, Q4_K, Q6_K), and the model it makes gives, at the
/// last position of each reference prompt, the top token of the BF16 folder
/// made from it (its weights rounded to BF16) with logits close to it.
#[test]
fn the_fetched_q4_k_m_file_runs_in_place() {
    let Some(path) = fetched() else { return };
    let m = ember_model::advanced::load_qwen2(&path).unwrap();
    let mut types = std::collections::BTreeMap::new();
    for l in &m.layers {
        for w in
            [&l.self_attn.q_proj.weight, &l.self_attn.k_proj.weight, &l.mlp.gate_proj.weight, &l.mlp.down_proj.weight]
        {
            *types.entry(w.dtype.name()).or_insert(0) += 1;
        }
    }
    assert!(["q5_0", "q4_k", "q6_k"].iter().all(|t| types.contains_key(t)), "{types:?}");
    let Some(dir) = ember_model::default_model_dir() else { return };
    let Some(_) = present(dir.join("model.safetensors")) else { return };
    let folder = ember_model::advanced::load_qwen2(&dir).unwrap();
    let refs = std::fs::read_to_string(common::fixtures().join("reference/greedy.jsonl")).unwrap();
    for line in refs.lines().take(3) {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        let ids: Vec<u32> = r["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let (a, b) = (last_logits(&m, &ids), last_logits(&folder, &ids));
        let top = |v: &[f32]| (0..v.len()).max_by(|&i, &j| v[i].total_cmp(&v[j])).unwrap();
        let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        eprintln!("{}: top {} vs {}, max |logit difference| {diff}", r["name"], top(&a), top(&b));
        assert_eq!(top(&a), top(&b), "{}", r["name"]);
        assert!(diff < 0.75, "{}: {diff}", r["name"]);
        // Greedy ids equal transformers' on the BF16 folder up to the first
        // step where either model's top-2 margin is within the logit
        // differences BF16 rounding of the weights makes (0.75, as above).
        let want: Vec<u32> = r["greedy_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let margins: Vec<f64> = r["margins"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        let (got, ours) = greedy_with_margins(&m, &ids, 12.min(want.len()));
        eprintln!("{}: greedy {got:?} margins {ours:?}", r["name"]);
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            if ours[i] < 0.75 || margins[i] < 0.75 {
                break;
            }
            assert_eq!(g, w, "{} step {i}", r["name"]);
        }
    }
}

/// `n` greedy ids after `ids`, each with its top-2 logit margin (the
/// prompt in one block, then one token at a time on the cache).
fn greedy_with_margins(m: &ember_model::advanced::Qwen2, ids: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    use ember_model::advanced::{BatchToken, Scratch};
    let mut cache = m.new_cache(ids.len() + n);
    let mut scratch = Scratch::default();
    let (mut out, mut margins) = (Vec::new(), Vec::new());
    let mut batch: Vec<BatchToken> = ids
        .iter()
        .enumerate()
        .map(|(p, &token)| BatchToken { token, seq: 0, pos: p, logits: p + 1 == ids.len() })
        .collect();
    for step in 0..n {
        let l = m.forward(&batch, &mut [&mut cache], &mut scratch).unwrap().to_vec();
        let a = (0..l.len()).max_by(|&i, &j| l[i].total_cmp(&l[j])).unwrap();
        let b = (0..l.len()).filter(|&i| i != a).max_by(|&i, &j| l[i].total_cmp(&l[j])).unwrap();
        margins.push(l[a] - l[b]);
        out.push(a as u32);
        batch = vec![BatchToken { token: a as u32, seq: 0, pos: ids.len() + step, logits: true }];
    }
    (out, margins)
}

/// The logits at the last position of `ids`.
fn last_logits(m: &ember_model::advanced::Qwen2, ids: &[u32]) -> Vec<f32> {
    use ember_model::advanced::{BatchToken, Scratch};
    let mut cache = m.new_cache(ids.len());
    let batch: Vec<BatchToken> = ids
        .iter()
        .enumerate()
        .map(|(p, &token)| BatchToken { token, seq: 0, pos: p, logits: p + 1 == ids.len() })
        .collect();
    let mut scratch = Scratch::default();
    m.forward(&batch, &mut [&mut cache], &mut scratch).unwrap().to_vec()
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

/// `ember quantize --out FILE.gguf`'s writer on the real folder, at INT4
/// (whose policy gives some matrices INT8 and INT5: a file of Q4_0, Q8_0
/// and Q5_0 tensors): read back, every tensor is the in-memory quantized one
/// byte for byte (INT4's and INT5's as the Q4_0 and Q5_0 blocks of the same
/// numbers, vectors as F32 of the same values), the model it loads gives the same logits, and the tokenizer and chat template built from its metadata
/// give `tokenizer.json`'s ids and transformers' renderings.
#[test]
fn quantize_writes_a_gguf_that_loads_as_the_quantized_model() {
    let Some(dir) = ember_model::default_model_dir() else { return };
    let Some(_) = present(dir.join("model.safetensors")) else { return };
    let mut m = ember_model::advanced::load_qwen2(&dir).unwrap();
    m.quantize(&ember_model::WeightType::Int4.into()).unwrap();
    let store = TensorStore::open_dir(&dir).unwrap();
    let out = common::Scratch::new("quantize-gguf");
    let path = out.path().join("int4.gguf");
    ember_model::advanced::quantize::write_gguf(&dir, &store, &m, 2, &path).unwrap();

    let back = ember_model::advanced::load_qwen2(&path).unwrap();
    // INT4 and INT5 matrices come back as the Q4_0 and Q5_0 blocks of the
    // same numbers (no ggml type holds their layouts); the others byte for
    // byte.
    let same = |p: &Tensor, q: &Tensor| {
        assert_eq!(p.shape, q.shape, "{}", p.name);
        if p.dtype == WeightType::Int4 {
            assert_eq!(q.dtype, WeightType::Q4_0, "{}", p.name);
            assert!(BlockQ4::q4_0_bytes(p.as_bytes()) == q.as_bytes(), "{} differs", p.name);
        } else if p.dtype == WeightType::Int5 {
            assert_eq!(q.dtype, WeightType::Q5_0, "{}", p.name);
            assert!(BlockQ5::q5_0_bytes(p.as_bytes()) == q.as_bytes(), "{} differs", p.name);
        } else {
            assert_eq!(p.dtype, q.dtype, "{}", p.name);
            assert!(p.as_bytes() == q.as_bytes(), "{} differs", p.name);
        }
    };
    let mut types = std::collections::BTreeSet::new();
    for (a, b) in m.layers.iter().zip(&back.layers) {
        for (p, q) in a.matrices().into_iter().zip(b.matrices()) {
            same(&p.weight, &q.weight);
            types.insert(p.weight.dtype.name());
        }
    }
    assert_eq!(types.len(), 3, "{types:?}");
    same(&m.embed_tokens, &back.embed_tokens);
    assert_eq!(back.config.tie_word_embeddings, m.config.tie_word_embeddings);
    assert_eq!(back.norm, m.norm);
    let refs = std::fs::read_to_string(common::fixtures().join("reference/greedy.jsonl")).unwrap();
    let hf = Tokenizer::from_dir(&dir).unwrap();
    let g = Tokenizer::from_gguf(&Gguf::open(&path).unwrap()).unwrap();
    assert_eq!(g.vocab_size(), hf.vocab_size());
    for (i, line) in refs.lines().enumerate() {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        let ids: Vec<u32> = r["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(g.encode(r["prompt_text"].as_str().unwrap()).unwrap(), ids, "{}", r["name"]);
        if i < 2 {
            // The same numbers through Q4_0's and Q5_0's kernels instead
            // of INT4's and INT5's: the same integer sums per block, added in f32 in another order on
            // some tiers, so equal up to f32 rounding.
            let (got, want) = (last_logits(&back, &ids), last_logits(&m, &ids));
            let scale = want.iter().fold(1.0f32, |a, v| a.max(v.abs()));
            let worst = got.iter().zip(&want).fold(0.0f32, |a, (g, w)| a.max((g - w).abs()));
            assert!(worst <= 1e-4 * scale, "{}: logits differ by {worst}", r["name"]);
        }
    }
    for c in &common::template_cases() {
        let tools = c.tools.as_deref().unwrap_or_default();
        let got = g.apply_chat_template_with_tools(&c.messages, tools, c.add_generation_prompt).unwrap();
        assert_eq!(got, c.rendered, "case {}", c.name);
    }
    let text = "用一句话介绍长城。 emoji 🦀 <|im_start|>user\n<tool_call>{\"a\": 1}</tool_call><|endoftext|> 3.14";
    assert_eq!(g.encode(text).unwrap(), hf.encode(text).unwrap());
    // Generation stops on the same tokens (the file's EOS first).
    let sorted = |m: std::sync::Arc<Model>| {
        let mut v = m.eos_token_ids().to_vec();
        v.sort();
        v
    };
    assert_eq!(sorted(Model::load(&path).unwrap()), sorted(Model::load(&dir).unwrap()));
}
