//! The smallest program that embeds ember: load a model folder, chat-format a
//! question, stream the answer with the model's own sampling defaults.
//!
//!     cargo run --release -p ember-model --example generate -- [--model DIR] ["Why is the sky blue?"]

use ember_model::{GenerateOptions, Message, Model};
use std::io::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let dir = match args.iter().position(|a| a == "--model") {
        Some(i) => args.drain(i..i + 2).nth(1).ok_or("--model needs a folder")?.into(),
        None => ember_model::default_model_dir().ok_or("no model folder: pass --model DIR")?,
    };
    let question = args.pop().unwrap_or_else(|| "Why is the sky blue?".into());

    let model = Model::load(&dir)?;
    let prompt = model.chat_prompt(&[Message::user(question)])?;
    let options = GenerateOptions::from_model(&model).max_tokens(200);
    let mut session = model.session();
    let mut generation = session.generate(&model.encode(&prompt)?, options)?;
    let mut out = std::io::stdout();
    for token in &mut generation {
        out.write_all(token?.text.as_bytes())?;
        out.flush()?;
    }
    let stats = generation.stats();
    eprintln!("\n{} tokens, {:.1} tok/s, stop: {}", stats.generated, stats.decode_tok_s(), stats.stop.unwrap());
    Ok(())
}
