//! Chat template fidelity: ember's minijinja renderings are byte-equal to
//! transformers' `apply_chat_template` for the committed cases
//! (`fixtures/templates/cases.json`, made by `fixtures/templates/make_cases.py`):
//! multi-turn, explicit system, no generation prompt, tool definitions,
//! Unicode and whitespace. Tool definitions go through the typed [`Tool`]
//! (read from the cases' JSON), and assistant tool calls and tool results
//! render as Qwen2.5's template writes them.

mod common;

use ember_model::{json, Message, Role, Tokenizer, Tool, ToolCall};

fn qwen() -> Tokenizer {
    Tokenizer::from_dir(&common::fixtures().join("qwen2.5-coder-0.5b-instruct")).unwrap()
}

#[test]
fn renderings_equal_transformers() {
    let t = qwen();
    let cases = common::template_cases();
    assert!(cases.len() >= 8);
    assert!(cases.iter().filter(|c| c.tools.as_ref().is_some_and(|t| !t.is_empty())).count() >= 2, "tool cases");
    for case in &cases {
        assert!(case.messages.iter().all(|m| m.role != Role::Tool), "{}: the cases have no tool role", case.name);
        let tools = case.tools.as_deref().unwrap_or_default();
        let got = t.apply_chat_template_with_tools(&case.messages, tools, case.add_generation_prompt).unwrap();
        assert_eq!(got, case.rendered, "case {}", case.name);
    }
}

/// An assistant's tool calls and the tool's result, as Qwen2.5's template
/// renders them (its `tool_call.function` / `tojson` branch and its
/// `<tool_response>` user turn); the expected text follows the template's
/// source line by line, with Python's `json.dumps` separators.
#[test]
fn tool_calls_and_results_render_as_qwen_writes_them() {
    let t = qwen();
    let tool =
        Tool::new("get_weather", "Weather now.", json!({"type": "object", "properties": {"city": {"type": "string"}}}));
    let messages = vec![
        Message::user("Weather in Paris and Zürich?"),
        Message::assistant("Checking.").with_tool_calls(vec![
            ToolCall::new("get_weather", json!({"city": "Paris"})),
            ToolCall::new("get_weather", json!({"city": "Zürich", "unit": "celsius"})),
        ]),
        Message::tool("{\"celsius\": 21}"),
        Message::tool("{\"celsius\": 14}"),
    ];
    let got = t.apply_chat_template_with_tools(&messages, &[tool], true).unwrap();
    let tail = "<|im_start|>user\nWeather in Paris and Zürich?<|im_end|>\n\
<|im_start|>assistant\nChecking.\n\
<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"unit\": \"celsius\"}}\n</tool_call><|im_end|>\n\
<|im_start|>user\n<tool_response>\n{\"celsius\": 21}\n</tool_response>\n<tool_response>\n{\"celsius\": 14}\n</tool_response><|im_end|>\n\
<|im_start|>assistant\n";
    assert!(got.ends_with(tail), "{got}");
    assert!(got.starts_with("<|im_start|>system\nYou are Qwen"), "{got}");
    assert!(got.contains(
        "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather now.\""
    ));
    // The reply parsed back renders the same way.
    let reply = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"unit\": \"celsius\"}}\n</tool_call>";
    assert_eq!(Message::parse_assistant(reply).unwrap(), messages[1]);
}
