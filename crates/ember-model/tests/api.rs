//! The library's public API as a user meets it, on the model that ships
//! with the crate (`testdata/tiny-chat`: the tiny-tied weights, a word-level
//! tokenizer, Qwen2.5's chat template and sampling defaults), so these tests
//! run from the packaged crate too: owned handles, the builder and the
//! model's defaults, cancellation, log-probabilities, forks, chat types.

use ember_model::{
    CancelToken, Error, GenerateOptions, Generation, Message, Model, Session, StopReason, Token, WeightType,
};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chat"))
}

fn model() -> Arc<Model> {
    Model::load(dir()).unwrap()
}

/// Greedy, ignoring EOS, `n` tokens.
fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions::default().max_tokens(n).stop_at_eos(false)
}

fn ids(g: Generation<'_>) -> Vec<u32> {
    g.map(|t| t.unwrap().id).collect()
}

/// A prompt of `n` known words.
fn words(model: &Model, n: usize) -> Vec<u32> {
    let text = ["the", "sea", "is", "blue", "and", "the", "sky", "is", "red"].iter().cycle().take(n);
    model.encode(&text.copied().collect::<Vec<_>>().join(" ")).unwrap()
}

// ---------------------------------------------------------------------------
// Owned handles

/// A model and a conversation in one struct, made by a function and
/// returned: what `Session<'m>` borrowing the model used to forbid.
struct Bot {
    model: Arc<Model>,
    session: Session,
}

fn make_bot() -> ember_model::Result<Bot> {
    let model = Model::load(dir())?;
    let session = model.session();
    Ok(Bot { model, session })
}

/// A token stream that owns its session, returned from a function.
fn ask(model: &Arc<Model>, text: &str) -> ember_model::Result<Generation<'static>> {
    let ids = model.encode(text)?;
    model.session().into_generation(&ids, greedy(5))
}

#[test]
fn a_model_and_its_session_live_in_a_struct_and_move_across_threads() {
    let mut bot = make_bot().unwrap();
    let prompt = bot.model.encode("hello").unwrap();
    let first = ids(bot.session.generate(&prompt, greedy(3)).unwrap());
    // The whole bot moves to another thread and keeps talking there.
    let handle = std::thread::spawn(move || {
        let more = bot.model.encode("and you").unwrap();
        let second = ids(bot.session.generate(&more, greedy(3)).unwrap());
        (bot, second)
    });
    let (bot, second) = handle.join().unwrap();
    assert_eq!((first.len(), second.len()), (3, 3));
    assert_eq!(bot.session.len(), 1 + 3 + 2 + 3);
}

#[test]
fn an_owned_generation_is_static_and_gives_its_session_back() {
    let model = model();
    let g = ask(&model, "the sun is").unwrap();
    // 'static: it can go to another thread on its own.
    let (tokens, session) = std::thread::spawn(move || {
        let mut g = g;
        let tokens: Vec<u32> = (&mut g).map(|t| t.unwrap().id).collect();
        (tokens, g.into_session().unwrap())
    })
    .join()
    .unwrap();
    let mut borrowed = model.session();
    let want = ids(borrowed.generate(&model.encode("the sun is").unwrap(), greedy(5)).unwrap());
    assert_eq!(tokens, want);
    // The conversation continues in the returned session as in the borrowed one.
    let (mut session, next) = (session, model.encode("yes").unwrap());
    assert_eq!(session.cached_tokens(), borrowed.cached_tokens());
    assert_eq!(ids(session.generate(&next, greedy(4)).unwrap()), ids(borrowed.generate(&next, greedy(4)).unwrap()));
    // A borrowed generation has no session to give.
    assert!(borrowed.generate(&next, greedy(1)).unwrap().into_session().is_none());
}

#[test]
fn two_sessions_on_two_threads_share_one_model() {
    let model = model();
    let prompts = [words(&model, 4), words(&model, 7)];
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| ids(model.session().generate(p, greedy(6)).unwrap())).collect();
    let threads: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|p| {
            let model = Arc::clone(&model);
            std::thread::spawn(move || ids(model.session().generate(&p, greedy(6)).unwrap()))
        })
        .collect();
    let together: Vec<Vec<u32>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(together, alone);
}

#[test]
fn public_types_are_send_sync_and_debug() {
    fn send_sync<T: Send + Sync + std::fmt::Debug>() {}
    send_sync::<Model>();
    send_sync::<Arc<Model>>();
    send_sync::<Session>();
    send_sync::<Generation<'static>>();
    send_sync::<Token>();
    send_sync::<GenerateOptions>();
    send_sync::<CancelToken>();
    send_sync::<Message>();
    send_sync::<ember_model::Tool>();
    send_sync::<ember_model::ModelBuilder>();
    send_sync::<Error>();
    send_sync::<ember_model::advanced::Context>();
    send_sync::<ember_model::advanced::Decoding>();
    let model = model();
    let mut session = model.session();
    let g = session.generate(&[7], greedy(1)).unwrap();
    for s in [format!("{model:?}"), format!("{g:?}"), format!("{:?}", model.tokenizer())] {
        assert!(s.len() < 2000, "Debug output stays short: {s}");
    }
}

// ---------------------------------------------------------------------------
// The builder and the model's defaults

#[test]
fn from_model_defaults_equal_generation_config_json() {
    let model = model();
    let text = std::fs::read_to_string(dir().join("generation_config.json")).unwrap();
    let file: ember_model::serde_json::Value = ember_model::serde_json::from_str(&text).unwrap();
    let options = GenerateOptions::from_model(&model);
    let s = &options.sampler;
    assert_eq!(file["do_sample"], true);
    assert_eq!(s.temperature as f64, file["temperature"].as_f64().unwrap() as f32 as f64);
    assert_eq!(s.top_p as f64, file["top_p"].as_f64().unwrap() as f32 as f64);
    assert_eq!(s.top_k as u64, file["top_k"].as_u64().unwrap());
    assert_eq!(s.repetition_penalty as f64, file["repetition_penalty"].as_f64().unwrap() as f32 as f64);
    assert_eq!((s.min_p, s.presence_penalty, s.frequency_penalty, s.penalty_last_n), (0.0, 0.0, 0.0, 64));
    let eos: Vec<u32> = file["eos_token_id"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(model.eos_token_ids(), &eos[..]);
    assert!(options.stop_at_eos);
    // A caller's settings win; greedy drops the file's penalty.
    let o = ember_model::SamplerOverrides { temperature: Some(0.0), seed: Some(9), ..Default::default() };
    let greedy = GenerateOptions::from_model_with(&model, &o);
    assert_eq!((greedy.sampler.temperature, greedy.sampler.repetition_penalty, greedy.sampler.seed), (0.0, 1.0, 9));
    // Sampling with the model's defaults runs, and a seed reproduces it.
    let run = |seed| {
        ids(model
            .session()
            .generate(&words(&model, 3), GenerateOptions::from_model(&model).seed(seed).max_tokens(8))
            .unwrap())
    };
    assert_eq!(run(5), run(5));
}

#[test]
fn the_builder_sets_context_chunk_precision_and_quantization() {
    let max = model().config().max_position_embeddings;
    let m = Model::builder(dir()).context(100).prefill_chunk(3).load().unwrap();
    assert_eq!((m.context(), m.prefill_chunk()), (100, 3));
    assert_eq!((m.session().capacity(), m.session().prefill_chunk()), (100, 3));
    // Capped at the model's maximum, as its default is.
    assert_eq!(Model::builder(dir()).context(1 << 20).load().unwrap().context(), max);
    assert_eq!(model().context(), max.min(ember_model::DEFAULT_CONTEXT));
    assert!(matches!(Model::builder(dir()).context(0).load(), Err(Error::Option(_))));
    assert!(matches!(Model::builder(dir()).prefill_chunk(0).load(), Err(Error::Option(_))));
    let exact = Model::builder(dir()).precision(ember_model::Precision::Exact).load().unwrap();
    assert_eq!(exact.precision(), ember_model::Precision::Exact);
    let q = Model::builder(dir()).quantize(WeightType::Int8).load().unwrap();
    assert_eq!(q.weight_type(), WeightType::Int8);
    assert_eq!(ids(q.session().generate(&words(&q, 5), greedy(4)).unwrap()).len(), 4);
    // The pool is sized once per process: asking for another size is an error.
    let running = model().threads();
    assert!(Model::builder(dir()).threads(running).load().is_ok());
    match Model::builder(dir()).threads(running + 1).load() {
        Err(e @ Error::Threads { .. }) => assert!(!e.to_string().contains("--"), "no flag names: {e}"),
        other => panic!("expected Error::Threads, got {other:?}"),
    }
    assert!(matches!(Model::builder("/nonexistent/ember").load(), Err(Error::MissingModelDir(_))));
}

#[test]
fn encode_decode_and_stop_reasons_print() {
    let model = model();
    let text = "the capital of france is paris .";
    assert_eq!(model.decode(&model.encode(text).unwrap()).unwrap(), text);
    for (reason, name) in [
        (StopReason::Eos, "eos"),
        (StopReason::MaxTokens, "max_tokens"),
        (StopReason::ContextFull, "context_full"),
        (StopReason::StopString, "stop_string"),
        (StopReason::Cancelled, "cancelled"),
    ] {
        assert_eq!(reason.to_string(), name);
    }
}

// ---------------------------------------------------------------------------
// Cancellation

#[test]
fn cancelling_stops_before_the_next_decode_step() {
    let model = model();
    let prompt = words(&model, 5);
    let mut session = model.session();
    let mut g = session.generate(&prompt, greedy(50)).unwrap();
    let cancel = g.cancel_token();
    let mut got = Vec::new();
    for t in &mut g {
        got.push(t.unwrap().id);
        if got.len() == 4 {
            cancel.cancel();
        }
    }
    assert_eq!(got.len(), 4, "no token after the cancel");
    assert_eq!(g.stats().stop, Some(StopReason::Cancelled));
    drop(g);
    // Nothing ran after the cancel: the 4th token waits, unrun.
    assert_eq!(session.cached_tokens().len(), prompt.len() + 3);
    assert_eq!(session.pending_tokens(), &got[3..]);
    // The conversation goes on as if it had not been interrupted.
    let next = ids(session.generate(&[], greedy(3)).unwrap());
    let want = ids(model.session().generate(&prompt, greedy(7)).unwrap());
    assert_eq!([got, next].concat(), want);
}

#[test]
fn cancelling_stops_a_prompt_between_chunks() {
    let model = model();
    let prompt = words(&model, 10);
    let checks = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&checks);
    // Cancelled at the third check: after two chunks of 3 tokens.
    let token = CancelToken::from_fn(move || seen.fetch_add(1, Ordering::SeqCst) + 1 >= 3);
    let mut session = model.session();
    session.set_prefill_chunk(3);
    let mut g = session.generate(&prompt, greedy(5).cancel(token)).unwrap();
    assert!(g.next().is_none(), "no token: the prompt did not finish");
    assert_eq!(g.stats().stop, Some(StopReason::Cancelled));
    drop(g);
    assert_eq!(checks.load(Ordering::SeqCst), 3, "one check per forward pass");
    assert_eq!(session.cached_tokens(), &prompt[..6]);
    assert_eq!(session.pending_tokens(), &prompt[6..]);
    // The rest of the prompt runs first next time: the same text as uncancelled.
    let rest = ids(session.generate(&[], greedy(5)).unwrap());
    assert_eq!(rest, ids(model.session().generate(&prompt, greedy(5)).unwrap()));
    // A token cancelled before the first pass: nothing runs at all.
    let cancelled = CancelToken::new();
    cancelled.cancel();
    let mut fresh = model.session();
    assert!(fresh.generate(&prompt, greedy(5).cancel(cancelled.clone())).unwrap().next().is_none());
    assert_eq!((fresh.cached_tokens().len(), fresh.pending_tokens().len()), (0, prompt.len()));
    cancelled.reset();
    assert_eq!(ids(fresh.generate(&[], greedy(5).cancel(cancelled)).unwrap()).len(), 5);
}

// ---------------------------------------------------------------------------
// Log-probabilities

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let lse = max + x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    x.iter().map(|&v| v as f64 - lse).collect()
}

#[test]
fn logprobs_are_the_log_softmax_of_the_logits() {
    let model = model();
    for options in [greedy(6).logprobs(5), GenerateOptions::from_model(&model).seed(3).max_tokens(6).logprobs(5)] {
        let mut session = model.session();
        let mut g = session.generate(&words(&model, 4), options.clone()).unwrap();
        while let Some(t) = g.next() {
            let t = t.unwrap();
            let want = log_softmax(g.logits());
            assert!((t.logprob.unwrap() as f64 - want[t.id as usize]).abs() < 1e-5);
            assert_eq!(t.top_logprobs.len(), 5);
            let mut order: Vec<usize> = (0..want.len()).collect();
            order.sort_by(|&a, &b| want[b].total_cmp(&want[a]).then(a.cmp(&b)));
            for (alt, &i) in t.top_logprobs.iter().zip(&order) {
                assert_eq!(alt.id as usize, i);
                assert!((alt.logprob as f64 - want[i]).abs() < 1e-5);
            }
            if options.sampler.temperature == 0.0 {
                assert_eq!(t.top_logprobs[0].id, t.id, "greedy takes the most likely");
            }
        }
    }
    // Not asked for: not computed.
    let t = model.session().generate(&[7], greedy(1)).unwrap().next().unwrap().unwrap();
    assert_eq!((t.logprob, t.top_logprobs.len()), (None, 0));
    let t = model.session().generate(&[7], greedy(1).logprobs(0)).unwrap().next().unwrap().unwrap();
    assert!(t.logprob.is_some() && t.top_logprobs.is_empty());
}

// ---------------------------------------------------------------------------
// Forks

#[test]
fn a_fork_continues_like_re_running_the_prefix() {
    let model = model();
    let prefix = words(&model, 9);
    let mut base = model.session();
    base.prefill(&prefix).unwrap();
    assert_eq!(base.cached_tokens(), &prefix[..]);
    let question = words(&model, 3);
    let mut fork = base.fork();
    let from_fork = ids(fork.generate(&question, greedy(6)).unwrap());
    let rerun = ids(model.session().generate(&[prefix.clone(), question.clone()].concat(), greedy(6)).unwrap());
    assert_eq!(from_fork, rerun);
    // The original is untouched and continues the same way.
    assert_eq!(base.cached_tokens(), &prefix[..]);
    assert_eq!(ids(base.clone().generate(&question, greedy(6)).unwrap()), rerun);
    // A fork after a reply carries the pending token too.
    let mut a = model.session();
    let reply = ids(a.generate(&prefix, greedy(3)).unwrap());
    let mut b = a.fork();
    assert_eq!((b.len(), b.pending_tokens()), (a.len(), &reply[2..]));
    assert_eq!(ids(a.generate(&question, greedy(4)).unwrap()), ids(b.generate(&question, greedy(4)).unwrap()));
}

// ---------------------------------------------------------------------------
// Chat types

#[test]
fn a_conversation_read_from_json_renders_like_the_one_built() {
    let model = model();
    let built = vec![
        Message::system("you are a helpful model ."),
        Message::user("what is the weather in paris ?"),
        Message::assistant("")
            .with_tool_calls(vec![ember_model::ToolCall::new("weather", ember_model::json!({"city": "paris"}))]),
        Message::tool("sunny"),
    ];
    let json = ember_model::serde_json::to_string(&built).unwrap();
    let read: Vec<Message> = ember_model::serde_json::from_str(&json).unwrap();
    assert_eq!(read, built);
    assert_eq!(model.chat_prompt(&read).unwrap(), model.chat_prompt(&built).unwrap());
    let prompt = model.chat_prompt(&read).unwrap();
    assert!(prompt.contains("<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"paris\"}}\n</tool_call>"));
    assert!(prompt.contains("<tool_response>\nsunny\n</tool_response>"));
}

#[test]
fn errors_name_no_command_line_flags() {
    let model = model();
    let mut session = model.session_with_context(4).unwrap();
    let errors = [
        session.generate(&words(&model, 6), greedy(1)).unwrap_err(),
        model.session_with_context(0).unwrap_err(),
        Model::load("/nonexistent/ember").unwrap_err(),
        ember_model::parse_tool_calls("<tool_call>{").unwrap_err(),
    ];
    for e in errors {
        let s = e.to_string();
        assert!(!s.contains("--"), "{s}");
    }
}

#[test]
fn phases_are_timed_only_when_asked_and_cover_the_forward_pass() {
    use ember_model::advanced::{load_qwen2, Phase};
    use std::time::{Duration, Instant};
    let model = load_qwen2(&dir()).unwrap();
    let streamed: usize = Phase::ALL.iter().map(|&p| model.phase_bytes(p)).sum();
    assert_eq!(streamed, model.weight_bytes_per_token());
    assert!(Phase::ALL.iter().filter(|&&p| model.phase_bytes(p) > 0).count() == 5, "the five products stream weights");
    // The read probes, in one pass and a section at a time, read those bytes.
    use ember_model::advanced::bench::{weight_read, weight_read_by_section};
    assert_eq!(weight_read(&model).0, streamed);
    assert_eq!(weight_read_by_section(&model).0, streamed);

    let mut state = model.new_state(16);
    state.run(&model, &[1, 2, 3], true).unwrap();
    assert!(state.phase_times().is_none(), "off by default");
    state.time_phases(true);
    let start = Instant::now();
    let timed = state.run(&model, &[4], true).unwrap().unwrap().to_vec();
    state.run(&model, &[5, 6, 7], true).unwrap();
    let wall = start.elapsed();
    let times = state.phase_times().unwrap().clone();
    assert_eq!((times.passes, times.tokens), (2, 4));
    for p in Phase::ALL {
        assert!(times.get(p) > Duration::ZERO, "{p:?} was not timed");
    }
    let sum: Duration = Phase::ALL.iter().map(|&p| times.get(p)).sum();
    assert!(sum <= wall, "phases {sum:?} add up to more than the passes took ({wall:?})");

    // Timing changes no result.
    let mut plain = model.new_state(16);
    plain.run(&model, &[1, 2, 3], true).unwrap();
    assert_eq!(plain.run(&model, &[4], true).unwrap().unwrap(), &timed[..]);
    state.time_phases(false);
    assert!(state.phase_times().is_none());
    state.time_phases(true);
    assert_eq!(state.phase_times().unwrap().passes, 0, "turning it on starts from zero");
}
