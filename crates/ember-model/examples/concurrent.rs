//! Two conversations at once on two threads, sharing one loaded model (an
//! `Arc<Model>`: the weights are mapped once). Each thread owns its
//! `Session`; their forward passes share the process's worker pool, taking
//! turns for its parallel sections. The tokens are tagged with their
//! conversation and printed as they arrive, so the interleaving shows.
//!
//!     cargo run --release -p ember-model --example concurrent -- [--model DIR]

use ember_model::{GenerateOptions, Message, Model};
use std::sync::{mpsc, Arc};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = Model::load(model_dir()?)?;
    let questions = ["Write a haiku about the sea.", "Name three sorting algorithms and their complexity."];
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let workers: Vec<_> = questions
        .iter()
        .enumerate()
        .map(|(i, question)| {
            let model = Arc::clone(&model);
            let tx = tx.clone();
            let question = question.to_string();
            std::thread::spawn(move || -> ember_model::Result<String> {
                let mut session = model.session();
                let prompt = model.encode(&model.chat_prompt(&[Message::user(question)])?)?;
                let options = GenerateOptions::from_model(&model).max_tokens(96);
                let mut generation = session.generate(&prompt, options)?;
                for token in &mut generation {
                    let _ = tx.send((i, token?.text));
                }
                let s = generation.stats();
                Ok(format!("{} tokens, {:.1} tok/s, stop: {}", s.generated, s.decode_tok_s(), s.stop.unwrap()))
            })
        })
        .collect();
    drop(tx);
    let mut texts = vec![String::new(); questions.len()];
    for (i, delta) in rx {
        println!("[{i}] {delta:?}");
        texts[i].push_str(&delta);
    }
    for ((worker, question), text) in workers.into_iter().zip(questions).zip(texts) {
        let summary = worker.join().expect("the thread finished")?;
        println!("\n{question}\n{text}\n({summary})");
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
