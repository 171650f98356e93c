//! Fuzz target of the server's request bodies: hostile JSON for
//! `/v1/chat/completions` and `/v1/completions` (every field with values of
//! the wrong type, out of range, huge; messages and tools of any shape; raw
//! bytes) through the parsers and the validation that turns a body into a
//! prompt and options (`ember_server::api`), on the tiny model; what
//! validates is generated from. No HTTP: the body parser is the target (the
//! routes around it are `tests/http.rs`).
//!
//! The invariant: no panic, no single allocation above `FUZZ_ALLOC_LIMIT`;
//! every refusal is a 4xx `ApiError` in OpenAI's shape; what is accepted
//! fits the context. The harness (cases, time budget, seed) is ember-model's
//! `tests/fuzzing`.

#[path = "../../ember-model/tests/fuzzing/mod.rs"]
mod fuzzing;

use ember_model::Model;
use ember_server::api::{prepare_chat, prepare_completion, ApiError, ChatRequest, CompletionRequest, Prepared};
use fuzzing::hostile;
use proptest::prelude::*;
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::sync::Arc;

#[global_allocator]
static ALLOCATOR: fuzzing::Noting = fuzzing::Noting;

/// Cases under plain `cargo test` (`cargo xtask fuzz` runs more).
const DEFAULT_CASES: u32 = 128;

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../ember-model/testdata/tiny-chat")
}

const SAMPLING: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "n",
    "top_k",
    "min_p",
    "repetition_penalty",
];

const CHAT: &[&str] =
    &["max_completion_tokens", "logprobs", "top_logprobs", "tool_choice", "response_format", "unknown"];

const COMPLETION: &[&str] = &["logprobs", "echo", "suffix", "best_of", "unknown"];

/// A value for a field: numbers at the edges (negative and fractional too),
/// the small in-range ones, or anything.
fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => hostile::integer().prop_map(|n| json!(n)),
        2 => (0u32..40).prop_map(|n| json!(n)),
        2 => hostile::float().prop_map(|f| json!(f)),
        1 => (0.0f64..2.0).prop_map(|f| json!(f)),
        1 => any::<bool>().prop_map(Value::Bool),
        1 => prop::collection::vec(hostile::string(), 0..20).prop_map(|v| json!(v)),
        1 => Just(json!({"include_usage": true})),
        1 => prop::sample::select(&["none", "auto", "required", "text"][..]).prop_map(|s| json!(s)),
        1 => hostile::string().prop_map(|s| json!({"type": s, "function": {"name": "f"}})),
        2 => hostile::json(),
    ]
}

fn content() -> impl Strategy<Value = Value> {
    prop_oneof![
        8 => hostile::string().prop_map(Value::String),
        1 => Just(Value::Null),
        1 => prop::collection::vec(
            (prop::sample::select(&["text", "image_url", ""][..]), prop::option::of(hostile::string())),
            0..3
        )
        .prop_map(|parts| json!(parts.into_iter().map(|(t, x)| json!({"type": t, "text": x})).collect::<Vec<_>>())),
        1 => hostile::json(),
    ]
}

fn tool_call() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => (hostile::string(), hostile::json())
            .prop_map(|(n, a)| json!({"id": "c", "type": "function", "function": {"name": n, "arguments": a}})),
        2 => (hostile::string(), hostile::string())
            .prop_map(|(n, a)| json!({"type": "function", "function": {"name": n, "arguments": a}})),
        1 => hostile::json(),
    ]
}

fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        8 => prop::sample::select(&["system", "developer", "user", "assistant", "tool"][..]).prop_map(|r| json!(r)),
        1 => hostile::json(),
    ];
    let calls = prop_oneof![3 => Just(None), 1 => prop::collection::vec(tool_call(), 0..3).prop_map(Some)];
    let id = prop_oneof![6 => Just(None), 3 => hostile::string().prop_map(|s| Some(json!(s))), 1 => hostile::json().prop_map(Some)];
    (role, prop::option::weighted(0.9, content()), calls, id).prop_map(|(role, content, calls, id)| {
        let mut m = Map::new();
        m.insert("role".into(), role);
        if let Some(c) = content {
            m.insert("content".into(), c);
        }
        if let Some(c) = calls {
            m.insert("tool_calls".into(), json!(c));
        }
        if let Some(id) = id {
            m.insert("tool_call_id".into(), id);
        }
        Value::Object(m)
    })
}

fn tool() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => (hostile::string(), hostile::string(), hostile::json())
            .prop_map(|(n, d, p)| json!({"type": "function", "function": {"name": n, "description": d, "parameters": p}})),
        1 => hostile::string().prop_map(|n| json!({"name": n})),
        1 => hostile::json(),
    ]
}

#[derive(Clone, Debug)]
enum Body {
    Chat(Value),
    Completion(Value),
    /// Bytes sent to both endpoints.
    Raw(Vec<u8>),
}

/// A value the field accepts (so that a body gets past its other fields).
fn valid(field: &str) -> BoxedStrategy<Value> {
    let j = |v: Value| Just(v).boxed();
    match field {
        "model" => hostile::string().prop_map(Value::String).boxed(),
        "stream" => any::<bool>().prop_map(|b| json!(b)).boxed(),
        "echo" => j(json!(false)),
        "stream_options" => any::<bool>().prop_map(|b| json!({"include_usage": b})).boxed(),
        "max_tokens" | "max_completion_tokens" => (1u64..100).prop_map(|n| json!(n)).boxed(),
        "temperature" => (0.0f64..=2.0).prop_map(|f| json!(f)).boxed(),
        "top_p" => (0.01f64..=1.0).prop_map(|f| json!(f)).boxed(),
        "min_p" => (0.0f64..=1.0).prop_map(|f| json!(f)).boxed(),
        "presence_penalty" | "frequency_penalty" => (-2.0f64..=2.0).prop_map(|f| json!(f)).boxed(),
        "repetition_penalty" => (0.1f64..=3.0).prop_map(|f| json!(f)).boxed(),
        "stop" => prop_oneof![
            hostile::string().prop_map(Value::String),
            prop::collection::vec(hostile::string(), 0..4).prop_map(|v| json!(v))
        ]
        .boxed(),
        "seed" => any::<i64>().prop_map(|n| json!(n)).boxed(),
        "n" | "best_of" => j(json!(1)),
        "top_k" => (0u64..60).prop_map(|n| json!(n)).boxed(),
        // A bool for chat, a count for completions: each is the other's hostile value.
        "logprobs" => prop_oneof![any::<bool>().prop_map(|b| json!(b)), (0u64..=20).prop_map(|n| json!(n))].boxed(),
        "top_logprobs" => (0u64..=20).prop_map(|n| json!(n)).boxed(),
        "tool_choice" => prop_oneof![
            prop::sample::select(&["none", "auto", "required"][..]).prop_map(|s| json!(s)),
            hostile::string().prop_map(|n| json!({"type": "function", "function": {"name": n}})),
        ]
        .boxed(),
        "response_format" => prop_oneof![Just(Value::Null), Just(json!({"type": "text"}))].boxed(),
        "suffix" => j(json!("")),
        _ => value().boxed(),
    }
}

/// Some of `names`, each with a valid value mostly and a hostile one sometimes.
fn fields(names: &'static [&'static str]) -> impl Strategy<Value = Vec<(&'static str, Value)>> {
    let field = prop::sample::select(names).prop_flat_map(|n| (Just(n), prop_oneof![5 => valid(n), 1 => value()]));
    prop::collection::vec(field, 0..5)
}

fn body() -> impl Strategy<Value = Body> {
    let chat = (
        prop_oneof![8 => prop::collection::vec(message(), 1..4).prop_map(|m| json!(m)), 1 => Just(json!([])), 1 => hostile::json()],
        fields(SAMPLING),
        fields(CHAT),
        prop::option::weighted(0.3, prop::collection::vec(tool(), 0..3)),
    )
        .prop_map(|(messages, s, c, tools)| {
            let mut m: Map<String, Value> = s.into_iter().chain(c).map(|(k, v)| (k.to_string(), v)).collect();
            m.insert("messages".into(), messages);
            if let Some(t) = tools {
                m.insert("tools".into(), json!(t));
            }
            Body::Chat(Value::Object(m))
        });
    let prompt = prop_oneof![
        4 => hostile::string().prop_map(Value::String),
        3 => prop::collection::vec(prop_oneof![8 => 0u64..96, 1 => hostile::integer()], 0..70).prop_map(|v| json!(v)),
        1 => hostile::json(),
    ];
    let completion = (prompt, fields(SAMPLING), fields(COMPLETION)).prop_map(|(prompt, s, c)| {
        let mut m: Map<String, Value> = s.into_iter().chain(c).map(|(k, v)| (k.to_string(), v)).collect();
        m.insert("prompt".into(), prompt);
        Body::Completion(Value::Object(m))
    });
    prop_oneof![
        3 => chat,
        2 => completion,
        1 => hostile::bytes().prop_map(Body::Raw),
        1 => hostile::json().prop_map(|v| Body::Raw(v.to_string().into_bytes())),
    ]
}

/// A refusal is a 4xx in OpenAI's shape.
fn check_error(e: &ApiError) -> Result<(), TestCaseError> {
    prop_assert!(e.status.is_client_error(), "{:?}", e);
    let b = e.body();
    prop_assert!(b["error"]["message"].is_string() && b["error"]["type"].is_string(), "{}", b);
    Ok(())
}

/// What validates fits the context, and generates.
fn check_prepared(model: &Arc<Model>, p: Prepared, context: usize) -> Result<(), TestCaseError> {
    prop_assert!(!p.prompt.is_empty() && p.prompt.len() < context);
    prop_assert!(p.options.max_tokens >= 1 && p.prompt.len() + p.options.max_tokens <= context);
    prop_assert!(p.prompt.iter().all(|&id| (id as usize) < model.config().vocab_size));
    let options = p.options.max_tokens(2);
    if let Ok(g) = model.session_with_context(context).unwrap().into_generation(&p.prompt, options) {
        for t in g {
            if t.is_err() {
                break;
            }
        }
    }
    Ok(())
}

/// Request bodies through `ChatRequest::parse` / `CompletionRequest::parse`
/// and `prepare_chat` / `prepare_completion`, for a context of 256 tokens
/// (the tiny model's maximum).
#[test]
fn fuzz_server_bodies() {
    let model = Model::builder(tiny()).threads(1).context(256).load().unwrap();
    let context = 256;
    fuzzing::run("server", DEFAULT_CASES, body(), |b| {
        let (chat, completion) = match &b {
            Body::Chat(v) => (Some(v.to_string().into_bytes()), None),
            Body::Completion(v) => (None, Some(v.to_string().into_bytes())),
            Body::Raw(bytes) => (Some(bytes.clone()), Some(bytes.clone())),
        };
        if let Some(bytes) = chat {
            match ChatRequest::parse(&bytes).and_then(|r| prepare_chat(&model, &r, context)) {
                Ok(p) => {
                    fuzzing::outcome("chat ok");
                    check_prepared(&model, p, context)?;
                }
                Err(e) => {
                    fuzzing::outcome(format!(
                        "chat {}",
                        e.param.as_deref().and_then(|p| p.split(['[', '.']).next()).unwrap_or("body")
                    ));
                    check_error(&e)?;
                }
            }
        }
        if let Some(bytes) = completion {
            match CompletionRequest::parse(&bytes).and_then(|r| prepare_completion(&model, &r, context)) {
                Ok(p) => {
                    fuzzing::outcome("completion ok");
                    check_prepared(&model, p, context)?;
                }
                Err(e) => {
                    fuzzing::outcome(format!(
                        "completion {}",
                        e.param.as_deref().and_then(|p| p.split(['[', '.']).next()).unwrap_or("body")
                    ));
                    check_error(&e)?;
                }
            }
        }
        Ok(())
    });
}
