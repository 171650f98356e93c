//! The batch-first forward pass with several sequences: tokens of different
//! sequences in one batch give each sequence what it gets alone, and
//! `ember_model::advanced::step` drives several generations with one forward pass per
//! step.

mod common;

use common::{reference, tiny_model};
use ember_model::advanced::{load_qwen2, step, BatchToken, Context, Decoding, Scratch};
use ember_model::{Error, GenerateOptions, Model, Precision, SamplerConfig};

const VARIANTS: [&str; 3] = ["tiny-tied", "tiny-untied", "tiny-f16"];

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// A prompt block of one sequence and single tokens of two others, in one
/// batch, give each the logits it gets alone.
#[test]
fn mixed_batches_equal_sequences_alone() {
    // Exact: f32-class. Fast: within its bar (0.1), where a CPU with BF16
    // dot products rounds a batch's activations to BF16 (a sequence alone
    // runs its single tokens as exact mat-vecs).
    for (precision, fast_bar) in [(Precision::Exact, None), (Precision::Fast, Some(0.1f32))] {
        for variant in VARIANTS {
            let r = reference(variant);
            let mut model = load_qwen2(&common::fixtures().join(variant)).unwrap();
            model.precision = precision;
            let ids = &r.ids;
            let (a, b) = (&ids[..3], &ids[3..]);
            // Alone: sequence 0 runs `ids` in two blocks; sequence 1 runs `b` then
            // `a[..1]` token by token.
            let mut alone0 = model.new_state(64);
            alone0.run(&model, a, false).unwrap();
            let want0 = alone0.run(&model, b, true).unwrap().unwrap().to_vec();
            let mut alone1 = model.new_state(64);
            alone1.run(&model, b, false).unwrap();
            let want1 = alone1.run(&model, &a[..1], true).unwrap().unwrap().to_vec();

            // Together: first sequence 0's block `a` with sequence 1's prompt `b`
            // (two runs in one batch), then `b` for 0 with the single `a[0]` for 1.
            let (mut c0, mut c1) = (model.new_cache(64), model.new_cache(64));
            let mut scratch = Scratch::default();
            let mut batch: Vec<BatchToken> =
                a.iter().enumerate().map(|(i, &token)| BatchToken { token, seq: 0, pos: i, logits: false }).collect();
            batch.extend(b.iter().enumerate().map(|(i, &token)| BatchToken { token, seq: 1, pos: i, logits: false }));
            let out = model.forward(&batch, &mut [&mut c0, &mut c1], &mut scratch).unwrap();
            assert!(out.is_empty());
            let mut batch: Vec<BatchToken> = b
                .iter()
                .enumerate()
                .map(|(i, &token)| BatchToken { token, seq: 0, pos: 3 + i, logits: false })
                .collect();
            batch.last_mut().unwrap().logits = true;
            batch.push(BatchToken { token: a[0], seq: 1, pos: b.len(), logits: true });
            let out = model.forward(&batch, &mut [&mut c0, &mut c1], &mut scratch).unwrap();
            let v = model.config.vocab_size;
            assert_eq!(out.len(), 2 * v);
            let scale = want0.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let bar = fast_bar.unwrap_or(1e-5 * scale);
            assert!(max_diff(&out[..v], &want0) <= bar, "{variant} {precision:?}: sequence 0");
            assert!(max_diff(&out[v..], &want1) <= bar, "{variant} {precision:?}: sequence 1");
            assert_eq!((c0.len(), c1.len()), (ids.len(), b.len() + 1));
        }
    }
}

#[test]
fn batches_that_do_not_continue_their_cache_are_errors() {
    let model = load_qwen2(&common::fixtures().join("tiny-tied")).unwrap();
    let mut cache = model.new_cache(4);
    let mut scratch = Scratch::default();
    let tok = |pos, seq| BatchToken { token: 1, seq, pos, logits: true };
    for (batch, what) in [
        (vec![tok(1, 0)], "skips position 0"),
        (vec![tok(0, 0), tok(0, 0)], "repeats a position"),
        (vec![tok(0, 1)], "names a missing cache"),
    ] {
        let err = model.forward(&batch, &mut [&mut cache], &mut scratch).err();
        assert!(matches!(err, Some(Error::InvalidBatch(_))), "{what}: {err:?}");
        assert_eq!(cache.len(), 0, "{what}: nothing ran");
    }
    let full: Vec<_> = (0..5).map(|p| tok(p, 0)).collect();
    assert!(matches!(model.forward(&full, &mut [&mut cache], &mut scratch), Err(Error::ContextFull { .. })));
    let bad = [BatchToken { token: 1 << 30, seq: 0, pos: 0, logits: true }];
    assert!(matches!(model.forward(&bad, &mut [&mut cache], &mut scratch), Err(Error::TokenOutOfRange { .. })));
}

/// Three greedy generations stepped together produce, token for token, what
/// each produces alone in a session.
#[test]
fn stepping_sequences_together_equals_each_alone() {
    let r = reference("tiny-untied");
    let dir = tiny_model("tiny-untied");
    let model = Model::load(dir.path()).unwrap();
    let options =
        GenerateOptions { max_tokens: 8, sampler: SamplerConfig::greedy(), stop_at_eos: false, ..Default::default() };
    let prompts: [&[u32]; 3] = [&r.ids, &r.ids[2..], &[5]];
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut s = model.session_with_context(64).unwrap();
            s.generate(p, options.clone()).unwrap().map(|t| t.unwrap().id).collect()
        })
        .collect();
    let mut contexts: Vec<Context> = (0..3).map(|_| Context::new(model.decoder().new_cache(64))).collect();
    let mut decodings: Vec<Decoding> =
        prompts.iter().map(|p| Decoding::new(&model, options.clone(), p.to_vec(), 0).unwrap()).collect();
    let mut together = vec![Vec::new(); 3];
    let mut scratch = Scratch::default();
    while decodings.iter().any(|d| !d.is_done()) {
        let mut seqs: Vec<(&mut Context, &mut Decoding)> = contexts.iter_mut().zip(decodings.iter_mut()).collect();
        // A prompt chunk of 3: the longest prompt takes several passes.
        step(&model, &mut scratch, 3, &mut seqs).unwrap();
        for (d, out) in decodings.iter_mut().zip(&mut together) {
            out.extend(d.take_token().map(|t| t.id));
        }
    }
    assert_eq!(together, alone);
}

/// A context forked at a prefix (`Context::fork_prefix`) continues as if the
/// prefix had been run afresh: same greedy tokens, and the source is intact.
#[test]
fn a_forked_prefix_continues_like_a_fresh_run() {
    let r = reference("tiny-untied");
    let dir = tiny_model("tiny-untied");
    let model = Model::load(dir.path()).unwrap();
    let prompt: Vec<u32> = r.ids.iter().chain(&r.ids).copied().collect();
    let greedy =
        GenerateOptions { max_tokens: 6, sampler: SamplerConfig::greedy(), stop_at_eos: false, ..Default::default() };
    let generate = |ctx: &mut Context, todo: Vec<u32>, reused: usize| {
        let mut d = Decoding::new(&model, greedy.clone(), todo, reused).unwrap();
        let mut out = Vec::new();
        let mut scratch = Scratch::default();
        while !d.is_done() {
            step(&model, &mut scratch, 4, &mut [(&mut *ctx, &mut d)]).unwrap();
            out.extend(d.take_token().map(|t| t.id));
        }
        out
    };
    let fresh = || Context::new(model.decoder().new_cache(64));
    let mut whole = fresh();
    let want = generate(&mut whole, prompt.clone(), 0);
    let held = whole.tokens().to_vec();
    for k in [1, 3, prompt.len() - 1] {
        let mut fork = whole.fork_prefix(k).unwrap();
        assert_eq!(fork.tokens(), &prompt[..k]);
        assert!(fork.pending().is_empty());
        assert_eq!(generate(&mut fork, prompt[k..].to_vec(), k), want, "fork at {k}");
    }
    assert_eq!(whole.tokens(), &held[..], "the source is unchanged");
    // Past what is cached, a fork holds all of it.
    assert_eq!(whole.fork_prefix(10_000).unwrap().tokens(), &held[..]);
}

/// `advance` cuts a long prompt into passes while the other sequences keep
/// producing a token per pass, and ends with the same tokens as `step`.
#[test]
fn advance_keeps_tokens_flowing_during_a_long_prompt_and_equals_step() {
    let r = reference("tiny-untied");
    let dir = tiny_model("tiny-untied");
    let model = Model::load(dir.path()).unwrap();
    let options =
        GenerateOptions { max_tokens: 6, sampler: SamplerConfig::greedy(), stop_at_eos: false, ..Default::default() };
    let long: Vec<u32> = r.ids.iter().cycle().take(5 * r.ids.len()).copied().collect();
    let prompts: [&[u32]; 3] = [&r.ids[..2], &long, &[5]];
    let run = |one_pass: bool| {
        let mut ctxs: Vec<Context> = prompts.iter().map(|_| Context::new(model.decoder().new_cache(128))).collect();
        let mut decs: Vec<Decoding> =
            prompts.iter().map(|p| Decoding::new(&model, options.clone(), p.to_vec(), 0).unwrap()).collect();
        let mut out = vec![Vec::new(); prompts.len()];
        let mut per_pass = Vec::new();
        let mut scratch = Scratch::default();
        while decs.iter().any(|d| !d.is_done()) {
            let mut seqs: Vec<(&mut Context, &mut Decoding)> = ctxs.iter_mut().zip(decs.iter_mut()).collect();
            if one_pass {
                ember_model::advanced::advance(&model, &mut scratch, 3, &mut seqs).unwrap();
            } else {
                step(&model, &mut scratch, 3, &mut seqs).unwrap();
            }
            let got: Vec<bool> =
                decs.iter_mut().zip(&mut out).map(|(d, o)| d.take_token().map(|t| o.push(t.id)).is_some()).collect();
            per_pass.push(got);
        }
        (out, per_pass)
    };
    let (stepped, _) = run(false);
    let (advanced, passes) = run(true);
    assert_eq!(advanced, stepped);
    // While the long prompt (3 tokens a pass) was running, the short ones
    // already produced a token at every pass.
    let prefill_passes = long.len().div_ceil(3);
    assert!(passes[..prefill_passes - 1].iter().all(|p| !p[1]), "{passes:?}");
    assert!(passes[1..prefill_passes.min(6)].iter().all(|p| p[0] && p[2]), "{passes:?}");
}
