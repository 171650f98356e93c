//! Log-probabilities: how sure the model was of each token it chose, and
//! what it nearly chose instead. Greedy decoding of a plain-text prompt;
//! each line is a token, its probability, and the runners-up.
//!
//!     cargo run --release -p ember-model --example logprobs -- [--model DIR] ["The capital of France is"]

use ember_model::{GenerateOptions, Model};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let dir = match args.iter().position(|a| a == "--model") {
        Some(i) => args.drain(i..(i + 2).min(args.len())).nth(1).ok_or("--model needs a folder")?.into(),
        None => ember_model::default_model_dir().ok_or("no model folder: pass --model DIR")?,
    };
    let prompt = args.pop().unwrap_or_else(|| "The capital of France is".into());

    let model = Model::load(dir)?;
    let options = GenerateOptions::default().max_tokens(16).logprobs(3);
    let mut session = model.session();
    let mut total = 0.0f64;
    let mut n = 0;
    println!("{prompt:?} continues with:");
    for token in session.generate(&model.encode(&prompt)?, options)? {
        let token = token?;
        let logprob = token.logprob.expect("asked for");
        total += logprob as f64;
        n += 1;
        let others: Vec<String> = token
            .top_logprobs
            .iter()
            .filter(|alt| alt.id != token.id)
            .map(|alt| Ok(format!("{:?} {:.1}%", model.decode(&[alt.id])?, 100.0 * alt.logprob.exp())))
            .collect::<ember_model::Result<_>>()?;
        println!("{:>16} {:5.1}%   then {}", format!("{:?}", token.text), 100.0 * logprob.exp(), others.join(", "));
    }
    println!("perplexity of the continuation: {:.3}", (-total / n.max(1) as f64).exp());
    Ok(())
}
