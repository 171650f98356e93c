//! NaN or infinite numbers in the weights are errors, never a silently
//! sampled token (issue 15): generation stops with [`Error::NonFinite`]
//! naming the position, perplexity is an error rather than `NaN`, and the
//! multi-sequence API says the same. On copies of `testdata/tiny-chat` with
//! one matrix overwritten by non-finite BF16 values.

use ember_model::advanced::eval::evaluate;
use ember_model::{Error, GenerateOptions, Model};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh folder under the temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("ember-nonfinite-{}-{n}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A copy of tiny-chat whose tensor `name` (BF16) holds `bits` everywhere.
fn poisoned(tag: &str, name: &str, bits: u16) -> TempDir {
    let t = TempDir::new(tag);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tiny-chat");
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, t.0.join(p.file_name().unwrap())).unwrap();
    }
    let path = t.0.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let info = &header[name];
    assert_eq!(info["dtype"], "BF16", "{name}");
    let [a, b] = [0, 1].map(|i| info["data_offsets"][i].as_u64().unwrap() as usize + 8 + n);
    for w in bytes[a..b].chunks_exact_mut(2) {
        w.copy_from_slice(&bits.to_le_bytes());
    }
    std::fs::write(&path, bytes).unwrap();
    t
}

const BF16_NAN: u16 = 0x7fc0;
const BF16_INF: u16 = 0x7f80;

#[test]
fn generation_stops_with_an_error_naming_the_position() {
    for (tag, bits) in [("nan", BF16_NAN), ("inf", BF16_INF)] {
        let t = poisoned(tag, "model.layers.1.mlp.down_proj.weight", bits);
        let model = Model::load(&t.0).unwrap();
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
    let t = poisoned("eval", "model.layers.0.self_attn.o_proj.weight", BF16_NAN);
    let model = Model::load(&t.0).unwrap();
    let tokens: Vec<u32> = (0..32).map(|i| i % 90).collect();
    match evaluate(model.decoder(), None, &tokens, 16, |_, _| {}) {
        Err(Error::NonFinite { position, .. }) => assert_eq!(position, 8, "the first scored position of window 0"),
        other => panic!("expected a NonFinite error, got {:?}", other.map(|r| r.ppl)),
    }
}

#[test]
fn finite_weights_generate_as_before() {
    let model = Model::load(Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tiny-chat")).unwrap();
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
        let t = poisoned("load", name, BF16_INF);
        match Model::load(&t.0) {
            Err(Error::NonFiniteWeight { name: n, index: 0, .. }) => assert_eq!(n, name),
            other => panic!("{name}: expected NonFiniteWeight, got {:?}", other.map(|_| ())),
        }
    }
}
