//! Logit parity with transformers on tiny random Qwen2 models (tied BF16,
//! untied sharded F32, F16), at every position of a sequence.

mod common;

use common::{reference, tiny_model};
use ember_model::advanced::load_qwen2;
use ember_model::{GenerateOptions, Model, Precision, SamplerConfig};

const VARIANTS: [&str; 3] = ["tiny-tied", "tiny-untied", "tiny-f16"];
/// Largest allowed |ember - transformers| of any logit.
const TOLERANCE: f32 = 1e-4;

/// Greedy decoding of `n` tokens that ignores EOS.
fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions { max_tokens: n, sampler: SamplerConfig::greedy(), stop_at_eos: false, ..Default::default() }
}

#[test]
fn logits_match_transformers_at_every_position() {
    for variant in VARIANTS {
        let r = reference(variant);
        let model = load_qwen2(&common::fixtures().join(variant)).unwrap();
        let mut state = model.new_state(64);
        let mut worst = 0.0f32;
        for (pos, (&id, want)) in r.ids.iter().zip(&r.logits).enumerate() {
            let got = state.run(&model, &[id], true).unwrap().unwrap();
            assert_eq!(got.len(), want.len());
            for (v, (a, b)) in got.iter().zip(want).enumerate() {
                let d = (a - b).abs();
                worst = worst.max(d);
                assert!(d <= TOLERANCE, "{variant} position {pos} token {v}: ember {a} vs transformers {b}");
            }
        }
        eprintln!("{variant}: max |diff| {worst:.2e}");
    }
}

#[test]
fn greedy_generation_matches_transformers() {
    for variant in VARIANTS {
        let r = reference(variant);
        let dir = tiny_model(variant);
        let model = Model::load(dir.path()).unwrap();
        let mut session = model.session_with_context(64).unwrap();
        let options = greedy(r.greedy_ids.len());
        let ids: Vec<u32> = session.generate(&r.ids, options).unwrap().map(|t| t.unwrap().id).collect();
        assert_eq!(ids, r.greedy_ids, "{variant}");
    }
}

#[test]
fn a_session_continues_where_it_left_off() {
    // Two generate calls on one session equal one call over the joined tokens:
    // the cache is reused, and the last sampled token is run before the new prompt.
    let r = reference("tiny-tied");
    let dir = tiny_model("tiny-tied");
    let model = Model::load(dir.path()).unwrap();

    let mut s = model.session_with_context(128).unwrap();
    let first: Vec<u32> = s.generate(&r.ids[..10], greedy(3)).unwrap().map(|t| t.unwrap().id).collect();
    let mut g = s.generate(&r.ids[10..], greedy(4)).unwrap();
    let second: Vec<u32> = (&mut g).map(|t| t.unwrap().id).collect();
    assert_eq!(g.stats().prompt_tokens, 1 + r.ids.len() - 10, "only new tokens are prefilled");
    drop(g);

    let mut joined: Vec<u32> = r.ids[..10].to_vec();
    joined.extend(&first);
    joined.extend(&r.ids[10..]);
    let mut fresh = model.session_with_context(128).unwrap();
    let again: Vec<u32> = fresh.generate(&joined, greedy(4)).unwrap().map(|t| t.unwrap().id).collect();
    assert_eq!(second, again);
}

#[test]
fn seeded_sampling_is_reproducible() {
    let dir = tiny_model("tiny-tied");
    let model = Model::load(dir.path()).unwrap();
    let run = |seed| {
        let sampler = SamplerConfig { temperature: 0.9, top_k: 40, top_p: 0.95, seed, ..Default::default() };
        let options = GenerateOptions { max_tokens: 24, sampler, stop_at_eos: false, ..Default::default() };
        let mut s = model.session_with_context(64).unwrap();
        s.generate(&[17, 42, 5], options).unwrap().map(|t| t.unwrap().id).collect::<Vec<u32>>()
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8), "different seeds should give different draws");
}

#[test]
fn stops_on_eos_from_generation_config() {
    // tiny-tied's generation_config.json lists [1, 2]; config.json says 2.
    let dir = tiny_model("tiny-tied");
    let model = Model::load(dir.path()).unwrap();
    assert_eq!(model.eos_token_ids(), &[1, 2]);
    // tiny-untied has no generation_config.json: config.json's id is used.
    let dir = tiny_model("tiny-untied");
    assert_eq!(Model::load(dir.path()).unwrap().eos_token_ids(), &[3]);
}

#[test]
fn generation_ends_when_the_context_is_full() {
    let dir = tiny_model("tiny-tied");
    let model = Model::load(dir.path()).unwrap();
    let mut s = model.session_with_context(8).unwrap();
    let options = greedy(100);
    let mut g = s.generate(&[17, 42, 5], options).unwrap();
    let tokens: Vec<_> = (&mut g).collect::<Result<_, _>>().unwrap();
    let n = tokens.len();
    // 3 prompt tokens + 5 generated fill 8 positions; the 6th token is sampled
    // from the last position's logits and cannot be run.
    assert_eq!(n, 6);
    assert_eq!(g.stats().stop, Some(ember_model::StopReason::ContextFull));
}

#[test]
fn batched_prefill_equals_token_by_token() {
    // Exact: f32-class, and transformers' within TOLERANCE. Fast: within its
    // bar (0.1) of both, where a CPU with BF16 dot products rounds a block's
    // activations to BF16 (single tokens run as exact mat-vecs).
    for (precision, fast_bar) in [(Precision::Exact, None), (Precision::Fast, Some(0.1f32))] {
        for variant in VARIANTS {
            let r = reference(variant);
            let mut model = load_qwen2(&common::fixtures().join(variant)).unwrap();
            model.precision = precision;
            // Token by token: logits after the whole sequence.
            let mut one = model.new_state(64);
            let mut want = Vec::new();
            for &id in &r.ids {
                want = one.run(&model, &[id], true).unwrap().unwrap().to_vec();
            }
            // Blocks of several sizes, ragged last block included.
            for chunk in [2, 3, 7, 20] {
                let mut state = model.new_state(64);
                let mut got = Vec::new();
                for block in r.ids.chunks(chunk) {
                    if let Some(l) = state.run(&model, block, true).unwrap() {
                        got = l.to_vec();
                    }
                }
                assert_eq!(state.len(), r.ids.len());
                let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let (bar, hf_bar) = fast_bar.map_or((1e-5 * scale, TOLERANCE), |b| (b, b));
                for (v, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!((a - b).abs() <= bar, "{variant} {precision:?} chunk {chunk} token {v}: {a} vs {b}");
                }
                // And against transformers at the last position.
                let last = r.logits.last().unwrap();
                for (a, b) in got.iter().zip(last) {
                    assert!((a - b).abs() <= hf_bar, "{variant} {precision:?} chunk {chunk}: {a} vs transformers {b}");
                }
                // The cache a block leaves behind serves the next token.
                let next = state.run(&model, &[7], true).unwrap().unwrap().to_vec();
                let next_one = one.run(&model, &[7], true).unwrap().unwrap().to_vec();
                let _ = one.run(&model, &[], false);
                for (a, b) in next.iter().zip(&next_one) {
                    assert!((a - b).abs() <= bar, "{variant} {precision:?} chunk {chunk}: next token {a} vs {b}");
                }
                one.cache.truncate(r.ids.len());
            }
        }
    }
}

#[test]
fn sessions_prefill_in_chunks() {
    let r = reference("tiny-untied");
    let dir = tiny_model("tiny-untied");
    let model = Model::load(dir.path()).unwrap();
    for chunk in [1, 4, 512] {
        let mut s = model.session_with_context(64).unwrap();
        s.set_prefill_chunk(chunk);
        let options = greedy(r.greedy_ids.len());
        let ids: Vec<u32> = s.generate(&r.ids, options).unwrap().map(|t| t.unwrap().id).collect();
        assert_eq!(ids, r.greedy_ids, "chunk {chunk}");
    }
}

/// The tiny model's word tokenizer decodes ids as "w<id>" joined by spaces.
fn words(ids: &[u32]) -> String {
    ids.iter().map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ")
}

#[test]
fn stop_strings_end_generation_before_the_string() {
    let r = reference("tiny-tied");
    let dir = tiny_model("tiny-tied");
    let model = Model::load(dir.path()).unwrap();
    let greedy = |stop: Vec<String>| GenerateOptions {
        max_tokens: r.greedy_ids.len(),
        sampler: SamplerConfig::greedy(),
        stop_at_eos: false,
        stop_strings: stop,
        ..Default::default()
    };
    // Without stop strings: the full greedy text.
    let mut s = model.session_with_context(64).unwrap();
    let full: String = s.generate(&r.ids, greedy(vec![])).unwrap().map(|t| t.unwrap().text).collect();
    assert_eq!(full.trim(), words(&r.greedy_ids));
    // Stop at the 4th generated word: the text ends just before it, and the
    // pieces streamed never include any of it.
    let target = format!("w{}", r.greedy_ids[3]);
    let expected_end = full.find(&format!(" {target}")).map(|i| i + 1).unwrap_or_else(|| full.find(&target).unwrap());
    let mut s = model.session_with_context(64).unwrap();
    let mut g = s.generate(&r.ids, greedy(vec![target.clone(), "never-appears".into()])).unwrap();
    let mut text = String::new();
    for t in &mut g {
        text.push_str(&t.unwrap().text);
    }
    assert_eq!(g.stats().stop, Some(ember_model::StopReason::StopString));
    assert_eq!(text, full[..expected_end]);
    assert!(!text.contains(&target));
}

#[test]
fn generate_from_reuses_the_common_prefix() {
    let r = reference("tiny-tied");
    let dir = tiny_model("tiny-tied");
    let model = Model::load(dir.path()).unwrap();
    let mut s = model.session_with_context(128).unwrap();
    let first: Vec<u32> = s.generate_from(&r.ids[..12], greedy(3)).unwrap().map(|t| t.unwrap().id).collect();
    // The next "turn" shares the first 10 tokens, then differs.
    let mut all = r.ids[..10].to_vec();
    all.extend([40, 41, 42, 43]);
    let mut g = s.generate_from(&all, greedy(4)).unwrap();
    let second: Vec<u32> = (&mut g).map(|t| t.unwrap().id).collect();
    assert_eq!(g.stats().reused_tokens, 10);
    assert_eq!(g.stats().prompt_tokens, 4);
    drop(g);
    let mut fresh = model.session_with_context(128).unwrap();
    let again: Vec<u32> = fresh.generate(&all, greedy(4)).unwrap().map(|t| t.unwrap().id).collect();
    assert_eq!(second, again);
    assert_eq!(first.len(), 3);
    // Continuing exactly where it stopped reuses everything but the pending token.
    let mut cont = all.clone();
    cont.extend(&second);
    cont.push(5);
    let g = s.generate_from(&cont, greedy(1)).unwrap();
    assert_eq!(g.stats().reused_tokens, all.len() + 3);
}
