//! A streaming chat in the terminal, sampling as the model's
//! `generation_config.json` says. Ctrl-C stops the reply being written (the
//! conversation stays, and the next turn reuses its cache); `/reset` starts
//! over; Ctrl-D leaves.
//!
//!     cargo run --release -p ember-model --example chat -- [--model DIR]
//!
//! Ctrl-C reaches the generation through a [`CancelToken`], checked before
//! every forward pass (so it also stops a long prompt mid-way). The signal
//! handler comes from the `ctrlc` crate: small, widely used, already what the
//! `ember` CLI uses, and only a dev-dependency here (the library does not
//! install signal handlers; a program decides what Ctrl-C means).

use ember_model::{CancelToken, GenerateOptions, Message, Model, StopReason};
use std::io::{BufRead, Write};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = Model::load(model_dir()?)?;
    let cancel = CancelToken::new();
    let on_ctrl_c = cancel.clone();
    ctrlc::set_handler(move || on_ctrl_c.cancel())?;
    let options = GenerateOptions::from_model(&model).max_tokens(1024).cancel(cancel.clone());

    let mut session = model.session();
    let mut chat: Vec<Message> = Vec::new();
    eprintln!("{} tokens of context; Ctrl-C stops a reply, /reset starts over, Ctrl-D leaves", session.capacity());
    let mut lines = std::io::stdin().lock();
    let mut out = std::io::stdout();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if lines.read_line(&mut line)? == 0 {
            break;
        }
        match line.trim() {
            "" => continue,
            "/reset" => {
                chat.clear();
                session.reset();
                continue;
            }
            text => chat.push(Message::user(text)),
        }
        let ids = model.encode(&model.chat_prompt(&chat)?)?;
        cancel.reset(); // a Ctrl-C between turns does not stop the next one
        if ids.len() >= session.capacity() {
            eprintln!("(the conversation no longer fits in {} tokens; starting over)", session.capacity());
            chat.clear();
            session.reset();
            continue;
        }
        let mut generation = session.generate_from(&ids, options.clone())?;
        let mut reply = String::new();
        for token in &mut generation {
            let token = token?;
            out.write_all(token.text.as_bytes())?;
            out.flush()?;
            reply.push_str(&token.text);
        }
        writeln!(out)?;
        let stats = generation.stats();
        if stats.stop == Some(StopReason::Cancelled) {
            eprintln!("(stopped)");
        }
        eprintln!(
            "[{} new prompt tokens, {} reused | {} tokens at {:.1} tok/s | stop: {}]",
            stats.prompt_tokens,
            stats.reused_tokens,
            stats.generated,
            stats.decode_tok_s(),
            stats.stop.map_or("none", StopReason::name)
        );
        drop(generation);
        chat.push(Message::assistant(reply));
    }
    Ok(())
}

/// `--model DIR`, else the folder `cargo xtask fetch` fills.
fn model_dir() -> Result<std::path::PathBuf, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == "--model") {
        Some(i) => args.get(i + 1).map(Into::into).ok_or_else(|| "--model needs a folder".into()),
        None => ember_model::default_model_dir().ok_or_else(|| "no model folder: pass --model DIR".into()),
    }
}
