//! The chat types: messages, tool definitions and tool calls, as a chat
//! template renders them and as a model's reply is parsed into them.
//!
//! Their serde form is the OpenAI / HuggingFace one, so a conversation can be
//! stored as JSON and read back, and the template sees what transformers'
//! `apply_chat_template` would pass it: `{"role", "content", "tool_calls":
//! [{"type": "function", "function": {"name", "arguments"}}]}` and tools as
//! `{"type": "function", "function": {"name", "description", "parameters"}}`.

use crate::error::{Error, Result};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use std::fmt;

/// Who said a chat message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Role {
    /// Instructions that frame the conversation.
    System,
    /// The person talking to the model.
    User,
    /// The model.
    Assistant,
    /// The result of a tool call, sent back to the model.
    Tool,
}

impl Role {
    /// The role's name as chat templates spell it: `"system"`, `"user"`,
    /// `"assistant"`, `"tool"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One message of a conversation.
///
/// Build one with [`Message::system`], [`Message::user`],
/// [`Message::assistant`], [`Message::tool`] or
/// [`Message::parse_assistant`] (a model's raw reply, tool calls included).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Message {
    /// Who said it.
    pub role: Role,
    /// The text (empty for an assistant message that only calls tools; JSON
    /// `null` reads as empty).
    #[serde(default, deserialize_with = "null_as_default")]
    pub content: String,
    /// Tools the assistant called in this message (rendered by the chat
    /// template after the content).
    #[serde(default, skip_serializing_if = "Vec::is_empty", deserialize_with = "null_as_default")]
    pub tool_calls: Vec<ToolCall>,
    /// For a [`Role::Tool`] message: the [`ToolCall::id`] it answers, if the
    /// calls carry ids (Qwen's template does not use it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A message of `role` with `content`.
    pub fn new(role: Role, content: impl Into<String>) -> Message {
        Message { role, content: content.into(), tool_calls: Vec::new(), tool_call_id: None }
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Message {
        Message::new(Role::System, content)
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Message {
        Message::new(Role::User, content)
    }

    /// An assistant message (text only).
    pub fn assistant(content: impl Into<String>) -> Message {
        Message::new(Role::Assistant, content)
    }

    /// A tool's result, sent back to the model.
    pub fn tool(content: impl Into<String>) -> Message {
        Message::new(Role::Tool, content)
    }

    /// This message with `calls` as its tool calls.
    pub fn with_tool_calls(mut self, calls: Vec<ToolCall>) -> Message {
        self.tool_calls = calls;
        self
    }

    /// This message answering the tool call with id `id`.
    pub fn with_tool_call_id(mut self, id: impl Into<String>) -> Message {
        self.tool_call_id = Some(id.into());
        self
    }

    /// The assistant message for a model's raw reply: every
    /// `<tool_call>{json}</tool_call>` block becomes a [`ToolCall`] (see
    /// [`parse_tool_calls`]) and the text around them, trimmed, the content.
    ///
    /// ```
    /// use ember_model::{Message, Role};
    ///
    /// let reply = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    /// let m = Message::parse_assistant(reply)?;
    /// assert_eq!(m.role, Role::Assistant);
    /// assert_eq!(m.content, "Let me check.");
    /// assert_eq!(m.tool_calls[0].name, "get_weather");
    /// assert_eq!(m.tool_calls[0].arguments["city"], "Paris");
    /// # Ok::<(), ember_model::Error>(())
    /// ```
    pub fn parse_assistant(reply: &str) -> Result<Message> {
        let (content, calls) = split_tool_calls(reply)?;
        Ok(Message::assistant(content).with_tool_calls(calls))
    }
}

/// A tool the model may call: a function's name, what it does, and its
/// parameters as a JSON schema.
///
/// ```
/// use ember_model::{json, Tool};
///
/// let tool = Tool::new(
///     "get_weather",
///     "The current weather in a city.",
///     json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
/// );
/// // What the chat template sees (the OpenAI / transformers form):
/// let v = ember_model::serde_json::to_value(&tool).unwrap();
/// assert_eq!(v["type"], "function");
/// assert_eq!(v["function"]["name"], "get_weather");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "ToolWire", from = "ToolWire")]
pub struct Tool {
    /// The function's name, as the model will write it in a call.
    pub name: String,
    /// What the function does (the model reads it).
    pub description: String,
    /// A JSON schema of the arguments object.
    pub parameters: Value,
}

impl Tool {
    /// A function tool.
    pub fn new(name: impl Into<String>, description: impl Into<String>, parameters: Value) -> Tool {
        Tool { name: name.into(), description: description.into(), parameters }
    }
}

/// The serde form of [`Tool`]: `{"type": "function", "function": {...}}`,
/// or, read leniently, the bare function object.
#[derive(Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum ToolWire {
    Wrapped {
        #[serde(rename = "type")]
        kind: String,
        function: FunctionSpec,
    },
    Bare(FunctionSpec),
}

#[derive(Clone, Serialize, Deserialize)]
struct FunctionSpec {
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default = "empty_object")]
    parameters: Value,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

impl From<Tool> for ToolWire {
    fn from(t: Tool) -> ToolWire {
        ToolWire::Wrapped {
            kind: "function".into(),
            function: FunctionSpec { name: t.name, description: t.description, parameters: t.parameters },
        }
    }
}

impl From<ToolWire> for Tool {
    fn from(w: ToolWire) -> Tool {
        let (ToolWire::Wrapped { function: f, .. } | ToolWire::Bare(f)) = w;
        Tool { name: f.name, description: f.description, parameters: f.parameters }
    }
}

/// A call of a [`Tool`] the model asked for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "ToolCallWire", from = "ToolCallWire")]
pub struct ToolCall {
    /// An id to answer it with ([`Message::with_tool_call_id`]); Qwen's
    /// output carries none, so the parser leaves it `None`.
    pub id: Option<String>,
    /// The tool's name.
    pub name: String,
    /// The arguments, a JSON object (read from a JSON string too, as the
    /// OpenAI API sends them).
    pub arguments: Value,
}

impl ToolCall {
    /// A call of `name` with `arguments`.
    pub fn new(name: impl Into<String>, arguments: Value) -> ToolCall {
        ToolCall { id: None, name: name.into(), arguments }
    }
}

/// The serde form of [`ToolCall`]: `{"id"?, "type": "function", "function":
/// {"name", "arguments"}}`, or, read leniently, `{"name", "arguments"}` (the
/// form Qwen writes inside `<tool_call>`).
#[derive(Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum ToolCallWire {
    Wrapped {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        #[serde(rename = "type", default = "function_kind")]
        kind: String,
        function: FunctionCallWire,
    },
    Bare {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        #[serde(flatten)]
        function: FunctionCallWire,
    },
}

fn function_kind() -> String {
    "function".into()
}

#[derive(Clone, Serialize, Deserialize)]
struct FunctionCallWire {
    name: String,
    #[serde(default = "empty_object", deserialize_with = "json_or_json_string")]
    arguments: Value,
}

impl From<ToolCall> for ToolCallWire {
    fn from(c: ToolCall) -> ToolCallWire {
        ToolCallWire::Wrapped {
            id: c.id,
            kind: function_kind(),
            function: FunctionCallWire { name: c.name, arguments: c.arguments },
        }
    }
}

impl From<ToolCallWire> for ToolCall {
    fn from(w: ToolCallWire) -> ToolCall {
        let (ToolCallWire::Wrapped { id, function: f, .. } | ToolCallWire::Bare { id, function: f }) = w;
        ToolCall { id, name: f.name, arguments: f.arguments }
    }
}

/// `null` as the type's default (OpenAI sends `"content": null` beside tool calls).
fn null_as_default<'de, D: Deserializer<'de>, T: Default + Deserialize<'de>>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// Arguments as an object, or as a string holding JSON (the OpenAI API's form).
fn json_or_json_string<'de, D: Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::String(s) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
        v => v,
    })
}

/// A reply that is only `{"name": string, "arguments": object}` (maybe in a
/// Markdown code fence): a call written without its tags.
fn bare_tool_call(reply: &str) -> Option<ToolCall> {
    let mut body = reply.trim();
    if let Some(fenced) = body.strip_prefix("```") {
        let (_lang, rest) = fenced.split_once('\n')?;
        body = rest.trim_end().strip_suffix("```")?.trim();
    }
    if !(body.starts_with('{') && body.ends_with('}')) {
        return None;
    }
    let value: Value = serde_json::from_str(body).ok()?;
    let object = value.as_object()?;
    match (object.get("name"), object.get("arguments")) {
        (Some(Value::String(name)), Some(arguments @ Value::Object(_))) if !name.is_empty() && object.len() == 2 => {
            Some(ToolCall::new(name.clone(), arguments.clone()))
        }
        _ => None,
    }
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// The tool calls in a model's reply: each `<tool_call>{"name": ...,
/// "arguments": {...}}</tool_call>` block (Qwen2.5's format, which its chat
/// template asks for), in order. Text outside the blocks is ignored (see
/// [`Message::parse_assistant`] to keep it).
///
/// A block that is not closed, is not valid JSON, or has no `name` string is
/// an [`Error::ToolCall`] naming the block, so a caller can tell the model
/// so or retry; a reply without blocks gives an empty list.
///
/// Small models sometimes drop the tags (Qwen2.5-Coder-0.5B answers a tool
/// prompt with the bare JSON): a reply that is nothing but one
/// `{"name": "...", "arguments": {...}}` object, optionally in a ```` ```json ````
/// fence, is read as one call too. Anything else without tags is text.
///
/// ```
/// use ember_model::parse_tool_calls;
///
/// let calls = parse_tool_calls("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>")?;
/// assert_eq!(calls.len(), 1);
/// assert!(parse_tool_calls("<tool_call>{\"name\": \"now\"").is_err()); // cut off
/// # Ok::<(), ember_model::Error>(())
/// ```
pub fn parse_tool_calls(reply: &str) -> Result<Vec<ToolCall>> {
    split_tool_calls(reply).map(|(_, calls)| calls)
}

/// Splits a reply into the text outside `<tool_call>` blocks (trimmed) and
/// the calls inside them.
fn split_tool_calls(reply: &str) -> Result<(String, Vec<ToolCall>)> {
    if !reply.contains(OPEN) && !reply.contains(CLOSE) {
        if let Some(call) = bare_tool_call(reply) {
            return Ok((String::new(), vec![call]));
        }
    }
    let mut text = String::new();
    let mut calls = Vec::new();
    let mut rest = reply;
    while let Some(start) = rest.find(OPEN) {
        let n = calls.len() + 1;
        text.push_str(&rest[..start]);
        let after = &rest[start + OPEN.len()..];
        let end = after.find(CLOSE).ok_or_else(|| Error::ToolCall(format!("tool call {n} has no `{CLOSE}`")))?;
        let body = after[..end].trim();
        if body.contains(OPEN) {
            return Err(Error::ToolCall(format!("tool call {n} has no `{CLOSE}` before the next `{OPEN}`")));
        }
        let value: Value = serde_json::from_str(body)
            .map_err(|e| Error::ToolCall(format!("tool call {n} is not valid JSON ({e}): {body}")))?;
        let name = match value.get("name") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            _ => return Err(Error::ToolCall(format!("tool call {n} has no `name` string: {body}"))),
        };
        let arguments = match value.get("arguments") {
            None | Some(Value::Null) => empty_object(),
            Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
            Some(v) => v.clone(),
        };
        calls.push(ToolCall::new(name, arguments));
        rest = &after[end + CLOSE.len()..];
    }
    if rest.contains(CLOSE) {
        return Err(Error::ToolCall(format!("`{CLOSE}` without a `{OPEN}` before it")));
    }
    text.push_str(rest);
    Ok((text.trim().to_string(), calls))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_several_calls_and_keeps_the_text() {
        let reply = "Checking both.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": \"{\\\"y\\\": [2]}\"}\n</tool_call>";
        let m = Message::parse_assistant(reply).unwrap();
        assert_eq!(m.content, "Checking both.");
        assert_eq!(m.tool_calls, vec![ToolCall::new("a", json!({"x": 1})), ToolCall::new("b", json!({"y": [2]}))]);
        assert_eq!(parse_tool_calls("no calls here").unwrap(), vec![]);
        let bare = parse_tool_calls("<tool_call>{\"name\": \"now\"}</tool_call>").unwrap();
        assert_eq!(bare, vec![ToolCall::new("now", json!({}))]);
    }

    #[test]
    fn a_reply_that_is_only_a_call_is_a_call_without_its_tags() {
        let want = vec![ToolCall::new("w", json!({"city": "Paris"}))];
        for reply in [
            "{\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}",
            "\n  {\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}\n",
            "```json\n{\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}\n```",
        ] {
            let m = Message::parse_assistant(reply).unwrap();
            assert_eq!((m.content.as_str(), &m.tool_calls), ("", &want), "{reply}");
        }
        // Anything else without tags is text, never an error.
        for reply in [
            "Call {\"name\": \"w\", \"arguments\": {}} now",
            "{\"name\": \"w\"}",
            "{\"name\": \"w\", \"arguments\": {}, \"age\": 3}",
            "{\"name\": \"w\", \"arguments\": [1]}",
            "{not json}",
            "```\nplain code\n```",
        ] {
            let m = Message::parse_assistant(reply).unwrap();
            assert!(m.tool_calls.is_empty(), "{reply}");
            assert_eq!(m.content, reply.trim());
        }
    }

    #[test]
    fn malformed_calls_are_errors_naming_the_call() {
        for (reply, needle) in [
            ("<tool_call>\n{\"name\": \"a\", \"arguments\": {}}", "tool call 1 has no `</tool_call>`"),
            (
                "<tool_call>{\"name\": \"a\"}</tool_call><tool_call>{\"name\": }</tool_call>",
                "tool call 2 is not valid JSON",
            ),
            ("<tool_call>{\"arguments\": {}}</tool_call>", "no `name`"),
            ("<tool_call>[1, 2]</tool_call>", "no `name`"),
            ("<tool_call>{\"name\": \"a\"<tool_call>{\"name\": \"b\"}</tool_call>", "before the next"),
            ("text</tool_call>", "without a `<tool_call>`"),
        ] {
            let e = parse_tool_calls(reply).unwrap_err();
            assert!(matches!(e, Error::ToolCall(_)), "{reply}: {e:?}");
            assert!(e.to_string().contains(needle), "{reply}: {e}");
        }
    }

    #[test]
    fn messages_round_trip_through_json() {
        let messages = vec![
            Message::system("Be brief."),
            Message::user("Weather in Zürich?"),
            Message::assistant("").with_tool_calls(vec![ToolCall {
                id: Some("c1".into()),
                ..ToolCall::new("w", json!({"city": "Zürich"}))
            }]),
            Message::tool("{\"temp\": 21}").with_tool_call_id("c1"),
            Message::assistant("21 °C."),
        ];
        let text = serde_json::to_string(&messages).unwrap();
        let back: Vec<Message> = serde_json::from_str(&text).unwrap();
        assert_eq!(back, messages);
        // The wire form is the OpenAI / transformers one.
        let v = serde_json::to_value(&messages[2]).unwrap();
        assert_eq!(
            v,
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"city": "Zürich"}}}
            ]})
        );
        assert!(serde_json::to_value(&messages[1]).unwrap().get("tool_calls").is_none());
    }

    #[test]
    fn reads_openai_messages() {
        let m: Message = serde_json::from_value(json!({
            "role": "assistant", "content": null,
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "w", "arguments": "{\"city\": \"Paris\"}"}}]
        }))
        .unwrap();
        assert_eq!(m.content, "");
        assert_eq!(m.tool_calls[0].arguments, json!({"city": "Paris"}));
        assert_eq!(m.tool_calls[0].id.as_deref(), Some("call_1"));
        let t: Tool = serde_json::from_value(json!({"name": "f", "parameters": {"type": "object"}})).unwrap();
        assert_eq!(t, Tool::new("f", "", json!({"type": "object"})));
        assert!(serde_json::from_value::<Message>(json!({"role": "robot", "content": "x"})).is_err());
    }
}
