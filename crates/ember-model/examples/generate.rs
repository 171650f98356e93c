//! The smallest program that embeds ember: load a model folder, chat-format a
//! question, stream the answer.
//!
//!     cargo run --release -p ember-model --example generate -- MODEL_DIR "Why is the sky blue?"

use ember_model::{GenerateOptions, Message, Model, SamplerConfig};
use std::io::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(dir), Some(question)) = (args.next(), args.next()) else {
        eprintln!("usage: generate MODEL_DIR QUESTION");
        std::process::exit(2);
    };
    let model = Model::load(&dir)?;
    let prompt = model.chat_prompt(&[Message::user(question)])?;
    let ids = model.encode(&prompt)?;

    let options = GenerateOptions {
        max_tokens: 200,
        sampler: SamplerConfig { temperature: 0.7, top_p: 0.8, top_k: 20, seed: 42, ..Default::default() },
        stop_at_eos: true,
        stop_strings: vec![],
    };
    let mut session = model.session(2048)?;
    let mut generation = session.generate(&ids, options)?;
    let mut out = std::io::stdout();
    for token in &mut generation {
        out.write_all(token?.text.as_bytes())?;
        out.flush()?;
    }
    let stats = generation.stats();
    eprintln!("\n{} tokens, {:.1} tok/s", stats.generated, stats.decode_tok_s());
    Ok(())
}
