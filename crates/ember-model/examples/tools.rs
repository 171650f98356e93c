//! Tool calling: the model sees a tool's description in its prompt, asks for
//! it with a `<tool_call>{json}</tool_call>` block, the program runs it and
//! sends the result back as a `tool` message, and the model answers with it.
//!
//!     cargo run --release -p ember-model --example tools -- [--model DIR] ["What's the weather in Paris?"]
//!
//! Greedy decoding, so a run is reproducible. A small model does not always
//! call the tool, or call it well: a reply that cannot be parsed is shown
//! with the parser's message.

use ember_model::{json, GenerateOptions, Message, Model, Tool, ToolCall};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (dir, question) = args()?;
    let model = Model::load(dir)?;
    let tools = [Tool::new(
        "get_weather",
        "Get the current weather in a city.",
        json!({
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city"]
        }),
    )];
    let mut chat = vec![Message::user(question)];
    let mut session = model.session();
    for _ in 0..3 {
        let prompt = model.encode(&model.chat_prompt_with_tools(&chat, &tools)?)?;
        let reply = session.generate_from(&prompt, GenerateOptions::default().max_tokens(256))?.collect_text()?;
        let message = match Message::parse_assistant(&reply) {
            Ok(m) => m,
            Err(e) => {
                println!("the model's reply has a malformed tool call ({e}):\n{reply}");
                return Ok(());
            }
        };
        if message.tool_calls.is_empty() {
            println!("assistant: {}", message.content);
            return Ok(());
        }
        let results: Vec<String> = message.tool_calls.iter().map(run).collect();
        chat.push(message);
        for result in results {
            println!("tool: {result}");
            chat.push(Message::tool(result));
        }
    }
    println!("(no answer after three rounds of tool calls)");
    Ok(())
}

/// Runs a call (here, a made-up forecast) and returns its result as JSON text.
fn run(call: &ToolCall) -> String {
    println!("assistant calls {}({})", call.name, call.arguments);
    match (call.name.as_str(), call.arguments["city"].as_str()) {
        ("get_weather", Some(city)) => {
            let fahrenheit = call.arguments["unit"] == "fahrenheit";
            let temperature = if fahrenheit { 70 } else { 21 };
            json!({"city": city, "temperature": temperature, "unit": if fahrenheit { "fahrenheit" } else { "celsius" }, "sky": "sunny"})
                .to_string()
        }
        _ => json!({"error": format!("unknown tool or arguments: {}", call.name)}).to_string(),
    }
}

/// `--model DIR` (else the folder `cargo xtask fetch` fills) and the question.
fn args() -> Result<(std::path::PathBuf, String), String> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let dir = match args.iter().position(|a| a == "--model") {
        Some(i) => args.drain(i..(i + 2).min(args.len())).nth(1).ok_or("--model needs a folder")?.into(),
        None => ember_model::default_model_dir().ok_or("no model folder: pass --model DIR")?,
    };
    Ok((dir, args.pop().unwrap_or_else(|| "What's the weather like in Paris today?".into())))
}
