//! Routes, middleware and the two generation endpoints' responses (one JSON
//! body, or server-sent events).

use crate::api::{prepare_chat, prepare_completion, ApiError, ChatRequest, CompletionRequest, Prepared};
use crate::engine::{Engine, Event, Finish, Job};
use crate::metrics::{Metrics, StatusLabel};
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use ember_model::{Message, Model, StopReason, Token};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// Largest request body accepted (413 above).
pub const BODY_LIMIT: usize = 8 << 20;

/// What the handlers share.
pub struct AppState {
    /// Set once the model is loaded (503 before).
    pub ready: OnceLock<Ready>,
    /// Set on SIGTERM: `/health` answers 503 so balancers stop sending
    /// requests here, while those in flight finish.
    pub draining: AtomicBool,
    /// The model's id in `/v1/models` and responses.
    pub model_id: String,
    /// SHA-256 of the API key, if one is required.
    pub key_digest: Option<[u8; 32]>,
    /// Requests waiting beyond this are refused.
    pub max_queue: usize,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// For ids.
    pub counter: AtomicU64,
    /// Seconds since the epoch at start (`created` of the model).
    pub started: u64,
}

type Shared = Arc<AppState>;

/// The loaded model and its scheduler.
pub struct Ready {
    /// The model.
    pub model: Arc<Model>,
    /// Its scheduler.
    pub engine: Engine,
    /// Positions of one sequence (`--ctx`, at most the model's maximum).
    pub context: usize,
}

/// The router.
pub fn router(state: Shared) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/health", get(health))
        .route("/health/live", get(live))
        .route("/metrics", get(metrics))
        .merge(v1)
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), request_id))
        .with_state(state)
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Echoes or assigns `x-request-id`, counts responses by status, and
/// turns axum's own plain-text rejections (405 ...) into OpenAI's shape.
async fn request_id(State(s): State<Shared>, mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 200)
        .map(str::to_string)
        .unwrap_or_else(|| format!("req-{:x}-{}", s.started, s.counter.fetch_add(1, Ordering::Relaxed)));
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut r = next.run(req).await;
    if r.status() == StatusCode::METHOD_NOT_ALLOWED {
        r = ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method not allowed on this path")
            .into_response();
    }
    s.metrics.requests.get_or_create(&StatusLabel { status: r.status().as_u16() }).inc();
    if let Ok(v) = HeaderValue::from_str(&id) {
        r.headers_mut().insert("x-request-id", v);
    }
    r
}

/// The request's id, from [`request_id`].
#[derive(Clone)]
struct RequestId(String);

/// `Authorization: Bearer KEY` on `/v1/*` when a key is set, compared in
/// constant time (as SHA-256 digests, so the length leaks nothing either).
async fn auth(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(want) = &s.key_digest {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|k| crate::digest(k.trim()));
        let ok = given.is_some_and(|g| constant_time_eq(&g, want));
        if !ok {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "missing or wrong API key (send `Authorization: Bearer KEY`)",
            )
            .into_response();
        }
    }
    next.run(req).await
}

/// Equal without an early exit.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(req: Request) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
    .into_response()
}

/// Readiness: 200 `ok` when this replica should get requests; 503
/// `loading` before the model is loaded and `draining` after SIGTERM.
async fn health(State(s): State<Shared>) -> Response {
    let status = match (s.ready.get(), s.draining.load(Ordering::SeqCst)) {
        (_, true) => "draining",
        (None, false) => "loading",
        (Some(_), false) => return (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response(),
    };
    (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": status}))).into_response()
}

/// Liveness: 200 whenever the process answers at all (loading, ready or
/// draining); an orchestrator restarts the replica only when this fails.
async fn live() -> Response {
    (StatusCode::OK, axum::Json(json!({"status": "live"}))).into_response()
}

async fn metrics(State(s): State<Shared>) -> Response {
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], s.metrics.encode())
        .into_response()
}

async fn models(State(s): State<Shared>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": s.model_id, "object": "model", "created": s.started, "owned_by": "ember"}],
    }))
    .into_response()
}

/// The loaded model and engine, or 503 while loading.
fn ready(s: &AppState) -> Result<(Arc<Model>, Engine, usize), ApiError> {
    let r = s.ready.get().ok_or_else(|| {
        let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the model is still loading");
        e.retry_after = Some(1);
        e
    })?;
    Ok((Arc::clone(&r.model), r.engine.clone(), r.context))
}

/// Reads the body up to [`BODY_LIMIT`] (413 above).
async fn read_body(req: Request) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(req.into_body(), BODY_LIMIT).await.map_err(|_| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is larger than {BODY_LIMIT} bytes"),
        )
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat(State(s): State<Shared>, req: Request) -> Response {
    generate(s, req, Kind::Chat).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(s): State<Shared>, req: Request) -> Response {
    generate(s, req, Kind::Completion).await.unwrap_or_else(IntoResponse::into_response)
}

async fn generate(s: Shared, req: Request, kind: Kind) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let rid = req.extensions().get::<RequestId>().map_or_else(String::new, |r| r.0.clone());
    let (model, engine, context) = ready(&s)?;
    let body = read_body(req).await?;
    // Templates and tokenizers are CPU work: off the async threads.
    let m = Arc::clone(&model);
    let prepared = tokio::task::spawn_blocking(move || match kind {
        Kind::Chat => prepare_chat(&m, &ChatRequest::parse(&body)?, context),
        Kind::Completion => prepare_completion(&m, &CompletionRequest::parse(&body)?, context),
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", e.to_string()))??;
    let (tx, rx) = mpsc::unbounded_channel();
    let Prepared { prompt, options, stream, include_usage, logprobs, tools } = prepared;
    let job = Job { id: rid.clone(), prompt, options, events: tx, arrived };
    if engine.submit(job, s.max_queue).is_err() {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            format!("the server is busy: {} requests are already waiting; retry later", s.max_queue),
        );
        e.retry_after = Some(1);
        return Err(e);
    }
    let n = s.counter.fetch_add(1, Ordering::Relaxed);
    let reply = Reply {
        id: match kind {
            Kind::Chat => format!("chatcmpl-{:x}{n:x}", s.started),
            Kind::Completion => format!("cmpl-{:x}{n:x}", s.started),
        },
        created: now_secs(),
        model_id: s.model_id.clone(),
        kind,
        logprobs,
        text: TextState::new(tools),
        model,
        rid,
        offset: 0,
    };
    if stream {
        Ok(stream_response(reply, rx, include_usage))
    } else {
        whole_response(reply, rx).await
    }
}

/// What one response is building.
struct Reply {
    id: String,
    created: u64,
    model_id: String,
    kind: Kind,
    logprobs: Option<usize>,
    text: TextState,
    model: Arc<Model>,
    rid: String,
    /// Characters of completion text so far (`text_offset`).
    offset: usize,
}

/// The reply's text as it comes, with tool calls held back: once the reply
/// may be a `<tool_call>` block (or a bare JSON call), its text is held
/// until the end and parsed there; other text is released as it comes.
struct TextState {
    tools: bool,
    /// All text so far.
    all: String,
    /// Bytes of `all` released as content.
    released: usize,
    /// A tool call has begun at `released`: hold everything after it.
    holding: bool,
}

const OPEN: &str = "<tool_call>";

impl TextState {
    fn new(tools: bool) -> TextState {
        TextState { tools, all: String::new(), released: 0, holding: false }
    }

    /// Adds a delta; returns the content that can be released now.
    fn push(&mut self, delta: &str) -> String {
        self.all.push_str(delta);
        if !self.tools {
            return self.release(self.all.len());
        }
        if self.holding {
            return String::new();
        }
        let rest = &self.all[self.released..];
        if self.released == 0 {
            let t = rest.trim_start();
            if t.is_empty() || t.starts_with('{') || t.starts_with(OPEN) || OPEN.starts_with(t) {
                self.holding = t.starts_with('{') || t.starts_with(OPEN);
                return String::new();
            }
        }
        if let Some(i) = rest.find(OPEN) {
            self.holding = true;
            return self.release(self.released + i);
        }
        // Hold a tail that may begin `<tool_call>`.
        let keep = (1..OPEN.len()).rev().find(|&k| rest.ends_with(&OPEN[..k])).unwrap_or(0);
        self.release(self.all.len() - keep)
    }

    fn release(&mut self, to: usize) -> String {
        let out = self.all[self.released..to].to_string();
        self.released = to;
        out
    }

    /// At the end: the remaining content and the tool calls.
    fn finish(&mut self) -> (String, Vec<ember_model::ToolCall>) {
        let rest = self.all[self.released..].to_string();
        self.released = self.all.len();
        if !self.tools || rest.trim().is_empty() {
            return (rest, Vec::new());
        }
        match Message::parse_assistant(&rest) {
            Ok(m) if !m.tool_calls.is_empty() => (m.content, m.tool_calls),
            _ => (rest, Vec::new()),
        }
    }
}

fn finish_reason(stop: Option<StopReason>, tool_calls: bool) -> &'static str {
    if tool_calls {
        return "tool_calls";
    }
    match stop {
        Some(StopReason::MaxTokens) | Some(StopReason::ContextFull) => "length",
        _ => "stop",
    }
}

fn usage(f: &Finish) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
    })
}

fn tool_calls_json(calls: &[ember_model::ToolCall], id: &str, streamed: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({
                    "id": c.id.clone().unwrap_or_else(|| format!("call_{id}_{i}")),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments.to_string()},
                });
                if streamed {
                    v["index"] = json!(i);
                }
                v
            })
            .collect(),
    )
}

impl Reply {
    fn token_text(&self, id: u32) -> String {
        self.model.decode(&[id]).unwrap_or_default()
    }

    /// A chat token's `logprobs.content` entry.
    fn chat_logprob(&self, t: &Token) -> Value {
        let entry = |id: u32, lp: f32| {
            let text = self.token_text(id);
            json!({"token": text, "logprob": lp, "bytes": text.as_bytes()})
        };
        let mut v = entry(t.id, t.logprob.unwrap_or(f32::NEG_INFINITY));
        v["top_logprobs"] = Value::Array(t.top_logprobs.iter().map(|a| entry(a.id, a.logprob)).collect());
        v
    }

    /// A completion's `logprobs` for some tokens.
    fn completion_logprobs(&mut self, tokens: &[Token]) -> Value {
        let mut out = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
        for t in tokens {
            let text = self.token_text(t.id);
            let top: serde_json::Map<String, Value> =
                t.top_logprobs.iter().map(|a| (self.token_text(a.id), json!(a.logprob))).collect();
            out["tokens"].as_array_mut().unwrap().push(json!(text));
            out["token_logprobs"].as_array_mut().unwrap().push(json!(t.logprob));
            out["top_logprobs"].as_array_mut().unwrap().push(Value::Object(top));
            out["text_offset"].as_array_mut().unwrap().push(json!(self.offset));
            self.offset += text.chars().count();
        }
        out
    }

    fn log(&self, f: &Finish, reason: &str) {
        tracing::info!(
            id = %self.rid,
            prompt_tokens = f.prompt_tokens,
            cached_tokens = f.cached_tokens,
            completion_tokens = f.completion_tokens,
            ttft_ms = format_args!("{:.0}", f.ttft * 1e3),
            tok_s = format_args!("{:.1}", f.decode_tok_s),
            finish = reason,
            "request done"
        );
    }
}

fn engine_error(f: &Finish) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        format!("generation failed: {}", f.error.as_deref().unwrap_or("unknown error")),
    )
}

/// The whole reply as one JSON body.
async fn whole_response(mut r: Reply, mut rx: mpsc::UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    let mut content = String::new();
    let mut tokens = Vec::new();
    let finish = loop {
        match rx.recv().await {
            Some(Event::Token(t)) => {
                content.push_str(&r.text.push(&t.text));
                if r.logprobs.is_some() {
                    tokens.push(t);
                }
            }
            Some(Event::Done(f)) => break f,
            None => {
                return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "the scheduler stopped"))
            }
        }
    };
    if finish.error.is_some() {
        r.log(&finish, "error");
        return Err(engine_error(&finish));
    }
    let (rest, calls) = r.text.finish();
    content.push_str(&rest);
    let reason = finish_reason(finish.stop, !calls.is_empty());
    r.log(&finish, reason);
    let body = match r.kind {
        Kind::Chat => {
            let mut message = json!({"role": "assistant", "content": content});
            if !calls.is_empty() {
                message["tool_calls"] = tool_calls_json(&calls, &r.id, false);
                if content.trim().is_empty() {
                    message["content"] = Value::Null;
                }
            }
            let logprobs = match r.logprobs {
                Some(_) => json!({"content": tokens.iter().map(|t| r.chat_logprob(t)).collect::<Vec<_>>()}),
                None => Value::Null,
            };
            json!({
                "id": r.id, "object": "chat.completion", "created": r.created, "model": r.model_id,
                "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}],
                "usage": usage(&finish),
            })
        }
        Kind::Completion => {
            let logprobs = match r.logprobs {
                Some(_) => r.completion_logprobs(&tokens),
                None => Value::Null,
            };
            json!({
                "id": r.id, "object": "text_completion", "created": r.created, "model": r.model_id,
                "choices": [{"index": 0, "text": content, "logprobs": logprobs, "finish_reason": reason}],
                "usage": usage(&finish),
            })
        }
    };
    Ok(axum::Json(body).into_response())
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The reply as server-sent events: one chunk per token with text (or
/// log-probabilities), a last chunk with the finish reason, the usage chunk
/// if asked for, then `data: [DONE]`. An engine error ends the stream with
/// an error event (OpenAI's error shape) before `[DONE]`.
fn stream_response(mut r: Reply, mut rx: mpsc::UnboundedReceiver<Event>, include_usage: bool) -> Response {
    let (out_tx, out_rx) = mpsc::unbounded_channel::<Result<Bytes, Infallible>>();
    tokio::spawn(async move {
        let chunk = |r: &Reply, choice: Value| -> Value {
            let object = if r.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
            json!({"id": r.id, "object": object, "created": r.created, "model": r.model_id, "choices": [choice]})
        };
        if r.kind == Kind::Chat {
            let first = chunk(
                &r,
                json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
            );
            if out_tx.send(Ok(sse(&first))).is_err() {
                return;
            }
        }
        let finish = loop {
            match rx.recv().await {
                Some(Event::Token(t)) => {
                    let text = r.text.push(&t.text);
                    if text.is_empty() && r.logprobs.is_none() {
                        continue;
                    }
                    let c = match r.kind {
                        Kind::Chat => {
                            let lp = r.logprobs.map_or(Value::Null, |_| json!({"content": [r.chat_logprob(&t)]}));
                            chunk(
                                &r,
                                json!({"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": null}),
                            )
                        }
                        Kind::Completion => {
                            let lp = match r.logprobs {
                                Some(_) => r.completion_logprobs(std::slice::from_ref(&t)),
                                None => Value::Null,
                            };
                            chunk(&r, json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": null}))
                        }
                    };
                    // A closed stream drops `rx`: the scheduler cancels.
                    if out_tx.send(Ok(sse(&c))).is_err() {
                        return;
                    }
                }
                Some(Event::Done(f)) => break Some(f),
                None => break None,
            }
        };
        let Some(finish) = finish.filter(|f| f.error.is_none()) else {
            let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "generation failed");
            let _ = out_tx.send(Ok(sse(&e.body())));
            let _ = out_tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
            return;
        };
        let (rest, calls) = r.text.finish();
        let reason = finish_reason(finish.stop, !calls.is_empty());
        r.log(&finish, reason);
        let mut tail = Vec::new();
        match r.kind {
            Kind::Chat => {
                if !rest.is_empty() {
                    tail.push(chunk(
                        &r,
                        json!({"index": 0, "delta": {"content": rest}, "logprobs": null, "finish_reason": null}),
                    ));
                }
                if !calls.is_empty() {
                    let delta = json!({"tool_calls": tool_calls_json(&calls, &r.id, true)});
                    tail.push(chunk(&r, json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null})));
                }
                tail.push(chunk(&r, json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason})));
            }
            Kind::Completion => {
                tail.push(chunk(&r, json!({"index": 0, "text": rest, "logprobs": null, "finish_reason": reason})));
            }
        }
        if include_usage {
            let mut last = chunk(&r, Value::Null);
            last["choices"] = json!([]);
            last["usage"] = usage(&finish);
            tail.push(last);
        }
        for c in tail {
            if out_tx.send(Ok(sse(&c))).is_err() {
                return;
            }
        }
        let _ = out_tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
    });
    let body = Body::from_stream(tokio_stream::wrappers::UnboundedReceiverStream::new(out_rx));
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // nginx and other proxies: do not buffer the stream.
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    (headers, body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(tools: bool, deltas: &[&str]) -> (String, String, Vec<ember_model::ToolCall>) {
        let mut t = TextState::new(tools);
        let streamed: String = deltas.iter().map(|d| t.push(d)).collect();
        let (rest, calls) = t.finish();
        (streamed, rest, calls)
    }

    #[test]
    fn text_streams_as_it_comes_without_tools() {
        let (s, rest, calls) = run(false, &["<tool", "_call>", "hi"]);
        assert_eq!((s.as_str(), rest.as_str(), calls.len()), ("<tool_call>hi", "", 0));
    }

    #[test]
    fn a_tool_call_is_held_and_parsed() {
        let (s, rest, calls) =
            run(true, &["<tool", "_call>\n{\"name\": \"f\", ", "\"arguments\": {\"a\": 1}}\n</tool_call>"]);
        assert_eq!(s, "");
        assert_eq!(rest, "");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "f");
        assert_eq!(calls[0].arguments["a"], 1);
    }

    #[test]
    fn text_before_a_tool_call_streams_and_plain_text_is_released() {
        let (s, rest, calls) =
            run(true, &["Let me ", "check. <tool", "_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"]);
        assert_eq!(s, "Let me check. ");
        assert_eq!(calls.len(), 1, "{rest:?}");
        let (s, rest, calls) = run(true, &["Hello", " <b>world</b>"]);
        assert_eq!(format!("{s}{rest}"), "Hello <b>world</b>");
        assert!(calls.is_empty());
    }

    #[test]
    fn a_broken_tool_call_comes_back_as_text() {
        let (s, rest, calls) = run(true, &["<tool_call>{not json"]);
        assert_eq!(format!("{s}{rest}"), "<tool_call>{not json");
        assert!(calls.is_empty());
    }

    #[test]
    fn keys_compare_equal_only_when_equal() {
        let a = crate::digest("sk-1");
        assert!(constant_time_eq(&a, &crate::digest("sk-1")));
        assert!(!constant_time_eq(&a, &crate::digest("sk-2")));
    }
}
