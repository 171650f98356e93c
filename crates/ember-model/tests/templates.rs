//! Chat template fidelity: ember's minijinja renderings are byte-equal to
//! transformers' `apply_chat_template` for the committed cases
//! (`fixtures/templates/cases.json`, made by `fixtures/templates/make_cases.py`):
//! multi-turn, explicit system, no generation prompt, tool definitions,
//! Unicode and whitespace.

mod common;

use ember_model::{Message, Role, Tokenizer};

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    messages: Vec<RawMessage>,
    tools: Option<serde_json::Value>,
    add_generation_prompt: bool,
    rendered: String,
}

#[derive(serde::Deserialize)]
struct RawMessage {
    role: String,
    content: String,
}

#[test]
fn renderings_equal_transformers() {
    let t = Tokenizer::from_dir(&common::fixtures().join("qwen2.5-coder-0.5b-instruct")).unwrap();
    let text = std::fs::read_to_string(common::fixtures().join("templates/cases.json")).unwrap();
    let cases: Vec<Case> = serde_json::from_str(&text).unwrap();
    assert!(cases.len() >= 8);
    for case in &cases {
        let messages: Vec<Message> = case
            .messages
            .iter()
            .map(|m| {
                let role = match m.role.as_str() {
                    "system" => Role::System,
                    "user" => Role::User,
                    "assistant" => Role::Assistant,
                    other => panic!("{}: unexpected role {other}", case.name),
                };
                Message { role, content: m.content.clone() }
            })
            .collect();
        let got = t.apply_chat_template_with_tools(&messages, case.tools.as_ref(), case.add_generation_prompt).unwrap();
        assert_eq!(got, case.rendered, "case {}", case.name);
    }
}
