//! The real Qwen2.5 tokenizer and chat template (committed under fixtures/):
//! renderings and ids equal transformers' for the reference prompts, and
//! streaming never splits a character.

mod common;

use ember_model::advanced::TextStream;
use ember_model::{Message, Tokenizer};

fn qwen() -> Tokenizer {
    Tokenizer::from_dir(&common::fixtures().join("qwen2.5-coder-0.5b-instruct")).unwrap()
}

#[derive(serde::Deserialize)]
struct Prompt {
    name: String,
    prompt: String,
    #[serde(default)]
    chat: bool,
    system: Option<String>,
}

#[test]
fn chat_template_and_ids_match_transformers() {
    let t = qwen();
    let dir = common::fixtures().join("reference");
    let prompts: Vec<Prompt> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("prompts.json")).unwrap()).unwrap();
    let refs: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("greedy.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut checked = 0;
    for p in &prompts {
        let r = refs.iter().find(|r| r["name"] == p.name.as_str()).unwrap();
        let text = if p.chat {
            let mut m = Vec::new();
            if let Some(s) = &p.system {
                m.push(Message::system(s.clone()));
            }
            m.push(Message::user(p.prompt.clone()));
            t.apply_chat_template(&m, true).unwrap()
        } else {
            p.prompt.clone()
        };
        assert_eq!(text, r["prompt_text"].as_str().unwrap(), "{}", p.name);
        let want: Vec<u32> = r["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(t.encode(&text).unwrap(), want, "{}", p.name);
        checked += 1;
    }
    assert_eq!(checked, 6);
}

#[test]
fn streaming_never_splits_a_character() {
    let t = qwen();
    for text in ["用一句话介绍长城。", "emoji 🦀🔥 and accents: café naïve", "日本語のテキスト", "plain ascii"]
    {
        let ids = t.encode(text).unwrap();
        let mut stream = TextStream::new();
        let mut out = String::new();
        for &id in &ids {
            let delta = stream.push(&t, id).unwrap();
            assert!(!delta.contains('\u{FFFD}'), "{text:?}: partial character emitted");
            out.push_str(&delta);
        }
        out.push_str(&stream.finish(&t).unwrap());
        assert_eq!(out, text);
    }
}

#[test]
fn special_tokens_in_text_become_their_ids() {
    let t = qwen();
    let ids = t.encode("<|im_start|>user\nhi<|im_end|>").unwrap();
    assert_eq!(ids.first(), Some(&151644));
    assert_eq!(ids.last(), Some(&151645));
    assert_eq!(t.token_id("<|im_end|>"), Some(151645));
}
