//! The scheduler without HTTP: jobs in, events out. Under a KV budget that
//! holds only a few sequences, every job completes, kept prefixes are evicted
//! to make room (never beyond the budget), and a prompt that shares a kept
//! prefix reuses it.

use ember_model::{GenerateOptions, Model, SamplerConfig};
use ember_server::engine::{Engine, Event, Job, Limits};
use ember_server::metrics::Metrics;
use std::sync::Arc;
use std::time::Instant;

fn tiny() -> Arc<Model> {
    Model::builder(concat!(env!("CARGO_MANIFEST_DIR"), "/../ember-model/testdata/tiny-chat"))
        .threads(1)
        .precision(ember_model::Precision::Exact)
        .load()
        .unwrap()
}

/// Runs a job to its end: (tokens, cached prompt tokens).
fn run(engine: &Engine, model: &Model, text: &str, max_tokens: usize) -> (Vec<u32>, usize) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let options =
        GenerateOptions { max_tokens, sampler: SamplerConfig::greedy(), stop_at_eos: false, ..Default::default() };
    let job = Job { id: "t".into(), prompt: model.encode(text).unwrap(), options, events: tx, arrived: Instant::now() };
    assert!(engine.submit(job, 16).is_ok());
    let mut ids = Vec::new();
    // A deadline, not a blocking wait: a job the scheduler never starts fails.
    let deadline = Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match rx.try_recv() {
            Ok(Event::Token(t)) => ids.push(t.id),
            Ok(Event::Done(f)) => {
                assert!(f.error.is_none(), "{f:?}");
                assert_eq!(f.completion_tokens, ids.len());
                return (ids, f.cached_tokens);
            }
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                assert!(Instant::now() < deadline, "the job was never finished");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Err(e) => panic!("the scheduler dropped the job: {e}"),
        }
    }
}

fn gauge(metrics: &Metrics, name: &str) -> i64 {
    let text = metrics.encode();
    let line = text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name} in {text}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn a_small_budget_evicts_kept_prefixes_and_reuse_gives_the_same_tokens() {
    let model = tiny();
    let metrics = Arc::new(Metrics::new());
    let limits = Limits { parallel: 2, context: 64, kv_budget: 128, prefill_chunk: 8 };
    let engine = Engine::start(Arc::clone(&model), limits, Arc::clone(&metrics));
    let prompts = ["the sun is", "once upon a time there", "hello ! how are you", "what is the capital of france ?"];
    let mut first = Vec::new();
    for p in prompts {
        let (ids, cached) = run(&engine, &model, p, 30);
        assert_eq!(ids.len(), 30);
        assert_eq!(cached, 0, "no earlier prompt shares a prefix with {p:?}");
        first.push(ids);
        assert!(gauge(&metrics, "ember_kv_tokens_used") <= 128);
    }
    // Four sequences of about 35 positions each do not all fit in 128:
    // some were evicted.
    assert!(gauge(&metrics, "ember_kept_sequences") < 4);
    // The latest is still kept: the same prompt again reuses it and gives
    // the same tokens.
    let (again, cached) = run(&engine, &model, prompts[3], 30);
    assert!(cached > 0);
    assert_eq!(again, first[3]);
    // A longer prompt that starts with a kept one's whole context takes it over.
    let long = format!("{} and", prompts[3]);
    let (_, cached) = run(&engine, &model, &long, 4);
    assert!(cached >= model.encode(prompts[3]).unwrap().len() - 1);
    assert!(gauge(&metrics, "ember_kv_tokens_used") <= 128);
}

/// A job that fits the budget only without the kept context it shares a
/// prefix with starts afresh, rather than waiting for room that nothing
/// running would return (it once waited forever).
#[test]
fn a_job_needing_the_room_of_its_own_prefix_starts_afresh() {
    let model = tiny();
    let metrics = Arc::new(Metrics::new());
    let limits = Limits { parallel: 1, context: 64, kv_budget: 64, prefill_chunk: 8 };
    let engine = Engine::start(Arc::clone(&model), limits, Arc::clone(&metrics));
    let prompt = "once upon a time there";
    let (short, _) = run(&engine, &model, prompt, 20);
    // The scheduler keeps the context after it has sent the last event.
    let deadline = Instant::now() + std::time::Duration::from_secs(30);
    while gauge(&metrics, "ember_kept_sequences") != 1 {
        assert!(Instant::now() < deadline, "the finished context was never kept");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // The same prompt with room for 60 more tokens needs the whole budget:
    // the kept context (its prefix's source) must go.
    assert!(model.encode(prompt).unwrap().len() + 60 > 64, "the job needs the whole budget");
    let (got, cached) = run(&engine, &model, prompt, 60);
    assert_eq!(cached, 0);
    // 60 tokens: the last is sampled from the 64th position, never stored.
    assert_eq!(got.len(), 60);
    // Greedy: the same start as the shorter run.
    assert_eq!(got[..short.len()], short[..]);
    assert!(gauge(&metrics, "ember_kv_tokens_used") <= 64);
}
