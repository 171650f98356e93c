//! OpenAI's wire format: request bodies, their validation into a prompt and
//! [`GenerateOptions`], and the errors in OpenAI's shape.
//!
//! Field names and ranges follow OpenAI's API reference for
//! `/v1/chat/completions` and `/v1/completions`, plus the extensions
//! llama-server and vLLM accept (`top_k`, `min_p`, `repetition_penalty`).
//! Unknown fields are ignored, as OpenAI does; a known field of the wrong
//! type or out of range is a 400 naming it.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use ember_model::{GenerateOptions, Message, Model, Role, SamplerOverrides, Tool, ToolCall};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

/// An error as OpenAI returns it: `{"error": {"message", "type", "param",
/// "code"}}` with its HTTP status.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, ...).
    pub kind: &'static str,
    /// The request field at fault.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, ...).
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
            retry_after: None,
        }
    }

    /// Another status.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }

    fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// Parses a JSON body into `T`: malformed JSON and wrong types are 400s
/// that say where (the field path becomes `param`).
pub fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(&mut de);
    match parsed {
        Ok(v) => {
            de.end().map_err(|e| ApiError::invalid(None, format!("the body is not valid JSON: {e}")))?;
            Ok(v)
        }
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.is_syntax() || inner.is_eof() {
                Err(ApiError::invalid(None, format!("the body is not valid JSON: {inner}")))
            } else if path == "." {
                Err(ApiError::invalid(None, format!("invalid request body: {inner}")))
            } else {
                Err(ApiError::invalid(Some(&path), format!("invalid value for `{path}`: {inner}")))
            }
        }
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// A message's content: a string or text parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// `[{"type": "text", "text": ...}]`.
    Parts(Vec<Part>),
}

/// One content part.
#[derive(Debug, Deserialize)]
pub struct Part {
    /// Only `text` is supported.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// A chat message on the wire.
#[derive(Debug, Deserialize)]
pub struct WireMessage {
    /// `system`, `developer` (as system), `user`, `assistant` or `tool`.
    pub role: String,
    /// Text (absent or null for an assistant message with tool calls).
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant's tool calls.
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// Which call a tool message answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

/// `stream_options`.
#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    /// Send a last chunk with the usage.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The sampling fields both endpoints share.
#[derive(Debug, Deserialize, Default)]
pub struct Sampling {
    /// Accepted and ignored: one model is served.
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f64>,
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<WireMessage>,
    /// Read from the same body by [`ChatRequest::parse`] (not flattened:
    /// serde's flatten loses the path of a field's error).
    #[serde(skip)]
    pub sampling: Sampling,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u64>,
    #[serde(default)]
    pub tools: Option<Vec<Tool>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub response_format: Option<Value>,
}

/// A completion prompt: text or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
    /// Several prompts (not supported: one choice per request).
    Batch(Vec<Value>),
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// As in [`ChatRequest::sampling`].
    #[serde(skip)]
    pub sampling: Sampling,
    /// Top alternatives per token (0 = only the chosen token's).
    #[serde(default)]
    pub logprobs: Option<u64>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub suffix: Option<String>,
    #[serde(default)]
    pub best_of: Option<u64>,
}

impl ChatRequest {
    /// Parses a body: the chat fields and the sampling fields.
    pub fn parse(body: &[u8]) -> Result<ChatRequest, ApiError> {
        let sampling = parse_body::<Sampling>(body)?;
        Ok(ChatRequest { sampling, ..parse_body(body)? })
    }
}

impl CompletionRequest {
    /// Parses a body: the completion fields and the sampling fields.
    pub fn parse(body: &[u8]) -> Result<CompletionRequest, ApiError> {
        let sampling = parse_body::<Sampling>(body)?;
        Ok(CompletionRequest { sampling, ..parse_body(body)? })
    }
}

/// A validated request, ready for the scheduler.
#[derive(Debug)]
pub struct Prepared {
    /// The prompt's ids.
    pub prompt: Vec<u32>,
    /// How to generate.
    pub options: GenerateOptions,
    /// Server-sent events.
    pub stream: bool,
    /// A last chunk with the usage (streaming).
    pub include_usage: bool,
    /// `Some(top)` when log-probabilities were asked for.
    pub logprobs: Option<usize>,
    /// Tool calls in the reply are parsed (chat with tools).
    pub tools: bool,
}

/// Most log-probability alternatives per token.
const MAX_TOP_LOGPROBS: u64 = 20;

fn check_range(name: &str, v: Option<f64>, lo: f64, hi: f64) -> Result<(), ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => {
            Err(ApiError::invalid(Some(name), format!("`{name}` must be between {lo} and {hi}, got {x}")))
        }
        _ => Ok(()),
    }
}

/// Sampling fields into options, checked. `max_tokens` is the request's
/// limit (either field name); `context` the per-sequence context.
fn options(
    model: &Model,
    s: &Sampling,
    max_tokens: Option<u64>,
    prompt_len: usize,
    context: usize,
) -> Result<GenerateOptions, ApiError> {
    if let Some(n) = s.n {
        if n != 1 {
            return Err(ApiError::invalid(Some("n"), format!("`n` must be 1 (one choice per request), got {n}")));
        }
    }
    check_range("temperature", s.temperature, 0.0, 2.0)?;
    check_range("top_p", s.top_p, 0.0, 1.0)?;
    if s.top_p == Some(0.0) {
        return Err(ApiError::invalid(Some("top_p"), "`top_p` must be greater than 0"));
    }
    check_range("presence_penalty", s.presence_penalty, -2.0, 2.0)?;
    check_range("frequency_penalty", s.frequency_penalty, -2.0, 2.0)?;
    check_range("min_p", s.min_p, 0.0, 1.0)?;
    check_range("repetition_penalty", s.repetition_penalty, 0.0, 10.0)?;
    if s.repetition_penalty == Some(0.0) {
        return Err(ApiError::invalid(Some("repetition_penalty"), "`repetition_penalty` must be greater than 0"));
    }
    if let Some(k) = s.top_k {
        if k < 0 {
            return Err(ApiError::invalid(Some("top_k"), format!("`top_k` must be 0 (off) or more, got {k}")));
        }
    }
    let stops = match &s.stop {
        None => Vec::new(),
        Some(Stop::One(x)) => vec![x.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stops.len() > 16 {
        return Err(ApiError::invalid(Some("stop"), format!("at most 16 stop strings, got {}", stops.len())));
    }
    if prompt_len >= context {
        return Err(ApiError::invalid(
            Some("messages"),
            format!(
                "this model's context is {context} tokens per sequence, and the prompt has {prompt_len} tokens \
                 (at least one must be left for the reply)"
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = context - prompt_len;
    let max_tokens = match max_tokens {
        Some(0) => return Err(ApiError::invalid(Some("max_tokens"), "`max_tokens` must be at least 1")),
        Some(n) => (n.min(room as u64)) as usize,
        None => room,
    };
    let overrides = SamplerOverrides {
        temperature: s.temperature.map(|v| v as f32),
        top_k: s.top_k.map(|v| v as usize),
        top_p: s.top_p.map(|v| v as f32),
        min_p: s.min_p.map(|v| v as f32),
        repetition_penalty: s.repetition_penalty.map(|v| v as f32),
        presence_penalty: s.presence_penalty.map(|v| v as f32),
        frequency_penalty: s.frequency_penalty.map(|v| v as f32),
        penalty_last_n: None,
        seed: s.seed.map(|v| v as u64),
    };
    let mut o = GenerateOptions::from_model_with(model, &overrides).max_tokens(max_tokens);
    o.stop_strings = stops.into_iter().filter(|s| !s.is_empty()).collect();
    Ok(o)
}

/// A chat request into a prompt and options.
pub fn prepare_chat(model: &Model, r: &ChatRequest, context: usize) -> Result<Prepared, ApiError> {
    if r.messages.is_empty() {
        return Err(ApiError::invalid(Some("messages"), "`messages` must hold at least one message"));
    }
    match &r.response_format {
        None | Some(Value::Null) => {}
        Some(f) if f.get("type").and_then(Value::as_str) == Some("text") => {}
        Some(f) => {
            return Err(ApiError::invalid(
                Some("response_format"),
                format!("response_format {f} is not supported yet (only {{\"type\": \"text\"}}): ember has no structured output"),
            ))
        }
    }
    let mut messages = Vec::with_capacity(r.messages.len());
    for (i, m) in r.messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "developer" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            other => {
                return Err(ApiError::invalid(
                    Some(&format!("messages[{i}].role")),
                    format!("unknown role `{other}` (expected system, developer, user, assistant or tool)"),
                ))
            }
        };
        let text = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut t = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(x)) => t.push_str(x),
                        ("text", None) => {
                            return Err(ApiError::invalid(
                                Some(&format!("messages[{i}].content[{j}].text")),
                                "a text part needs `text`",
                            ))
                        }
                        (other, _) => {
                            return Err(ApiError::invalid(
                                Some(&format!("messages[{i}].content[{j}].type")),
                                format!("content parts of type `{other}` are not supported (text only)"),
                            ))
                        }
                    }
                }
                t
            }
        };
        let mut msg = Message::new(role, text);
        if let Some(calls) = &m.tool_calls {
            msg = msg.with_tool_calls(calls.clone());
        }
        if let Some(id) = &m.tool_call_id {
            msg = msg.with_tool_call_id(id.clone());
        }
        messages.push(msg);
    }
    let tools: Vec<Tool> = match (&r.tools, &r.tool_choice) {
        (None, _) => Vec::new(),
        (Some(_), Some(Value::String(s))) if s == "none" => Vec::new(),
        (Some(t), Some(choice @ Value::Object(_))) => {
            let name = choice
                .pointer("/function/name")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid(Some("tool_choice"), "`tool_choice` as an object names a function"))?;
            let picked: Vec<Tool> = t.iter().filter(|x| x.name == name).cloned().collect();
            if picked.is_empty() {
                return Err(ApiError::invalid(Some("tool_choice"), format!("no tool named `{name}` in `tools`")));
            }
            picked
        }
        (Some(_), Some(Value::String(s))) if s != "auto" && s != "required" => {
            return Err(ApiError::invalid(
                Some("tool_choice"),
                format!("unknown tool_choice `{s}` (expected none, auto, required or a function)"),
            ))
        }
        (Some(t), _) => t.clone(),
    };
    let text =
        if tools.is_empty() { model.chat_prompt(&messages) } else { model.chat_prompt_with_tools(&messages, &tools) }
            .map_err(|e| ApiError::invalid(Some("messages"), format!("the chat template failed: {e}")))?;
    let prompt = model.encode(&text).map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?;
    let top = match (r.logprobs, r.top_logprobs) {
        (_, Some(n)) if n > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
            ))
        }
        (Some(true), n) => Some(n.unwrap_or(0) as usize),
        (_, Some(n)) if n > 0 => {
            return Err(ApiError::invalid(Some("top_logprobs"), "`top_logprobs` needs `logprobs: true`"))
        }
        _ => None,
    };
    let max = r.max_completion_tokens.or(r.sampling.max_tokens);
    let mut options = options(model, &r.sampling, max, prompt.len(), context)?;
    if let Some(n) = top {
        options = options.logprobs(n);
    }
    let stream = r.sampling.stream.unwrap_or(false);
    Ok(Prepared {
        prompt,
        options,
        stream,
        include_usage: r.sampling.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false),
        logprobs: top,
        tools: !tools.is_empty(),
    })
}

/// A completion request into a prompt and options.
pub fn prepare_completion(model: &Model, r: &CompletionRequest, context: usize) -> Result<Prepared, ApiError> {
    if r.echo == Some(true) {
        return Err(ApiError::invalid(Some("echo"), "`echo` is not supported"));
    }
    if r.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(Some("suffix"), "`suffix` is not supported"));
    }
    if r.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(Some("best_of"), "`best_of` must be 1"));
    }
    let prompt = match &r.prompt {
        Prompt::Text(t) => model.encode(t).map_err(|e| ApiError::invalid(Some("prompt"), e.to_string()))?,
        Prompt::Ids(ids) => {
            let vocab = model.config().vocab_size;
            if let Some(id) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::invalid(
                    Some("prompt"),
                    format!("token id {id} is outside the vocabulary of {vocab}"),
                ));
            }
            ids.clone()
        }
        Prompt::Batch(_) => {
            return Err(ApiError::invalid(
                Some("prompt"),
                "`prompt` must be one string or one list of token ids (one prompt per request)",
            ))
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid(Some("prompt"), "`prompt` is empty"));
    }
    let top = match r.logprobs {
        Some(n) if n > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid(
                Some("logprobs"),
                format!("`logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
            ))
        }
        Some(n) => Some(n as usize),
        None => None,
    };
    let mut options = options(model, &r.sampling, r.sampling.max_tokens, prompt.len(), context)?;
    // A completion continues text: the model's EOS still ends it.
    if let Some(n) = top {
        options = options.logprobs(n);
    }
    Ok(Prepared {
        prompt,
        options,
        stream: r.sampling.stream.unwrap_or(false),
        include_usage: r.sampling.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false),
        logprobs: top,
        tools: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_json_and_wrong_types_are_400s_naming_the_field() {
        let e = ChatRequest::parse(b"{\"messages\": [").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        let e = ChatRequest::parse(br#"{"messages": "hi"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"), "{e:?}");
        let e = ChatRequest::parse(br#"{"messages": [], "temperature": "hot"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"), "{e:?}");
        let e = ChatRequest::parse(br#"{"messages": [{"role": "user", "content": 3}]}"#).unwrap_err();
        assert!(e.param.as_deref().unwrap_or("").starts_with("messages[0]"), "{e:?}");
        let e = ChatRequest::parse(b"{} trailing").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let ok = ChatRequest::parse(br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "stop": ["x"], "extra": 1}"#);
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[test]
    fn errors_have_openai_shape() {
        let e = ApiError::invalid(Some("n"), "bad").with_code("x");
        let b = e.body();
        assert_eq!(b["error"]["message"], "bad");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["param"], "n");
        assert_eq!(b["error"]["code"], "x");
    }
}
