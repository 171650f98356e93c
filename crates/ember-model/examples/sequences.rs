//! Several sequences decoded together, as a server's scheduler would step
//! them: each prompt is generated greedily alone (a `Session`), then all of
//! them together through `ember_model::advanced::step`, and both id lists are printed,
//! one JSON line per prompt. `cargo xtask parity` compares them.
//!
//!     cargo run --release -p ember-model --example sequences -- MODEL_DIR MAX_TOKENS PROMPT_IDS_JSON...

use ember_model::advanced::{step, Context, Decoding, Scratch};
use ember_model::{GenerateOptions, Model, SamplerConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(dir), Some(max_tokens)) = (args.next(), args.next()) else {
        eprintln!("usage: sequences MODEL_DIR MAX_TOKENS PROMPT_IDS_JSON...");
        std::process::exit(2);
    };
    let max_tokens: usize = max_tokens.parse()?;
    let prompts: Vec<Vec<u32>> = args.map(|a| serde_json::from_str(&a)).collect::<Result<_, _>>()?;
    // As a server loads it: weights copied into huge pages, o and down in
    // column parts where the type calls for them.
    let model = Model::builder(&dir).huge_pages(true).load()?;
    let options =
        GenerateOptions { max_tokens, sampler: SamplerConfig::greedy(), stop_at_eos: false, ..Default::default() };
    let context = prompts.iter().map(Vec::len).max().unwrap_or(0) + max_tokens;

    let mut alone = Vec::new();
    for p in &prompts {
        let mut session = model.session_with_context(context)?;
        let ids: Result<Vec<u32>, _> = session.generate(p, options.clone())?.map(|t| t.map(|t| t.id)).collect();
        alone.push(ids?);
    }

    let mut contexts: Vec<Context> = prompts.iter().map(|_| Context::new(model.decoder().new_cache(context))).collect();
    let mut decodings: Vec<Decoding> =
        prompts.iter().map(|p| Decoding::new(&model, options.clone(), p.clone(), 0)).collect::<Result<_, _>>()?;
    let mut together = vec![Vec::new(); prompts.len()];
    let mut scratch = Scratch::default();
    while decodings.iter().any(|d| !d.is_done()) {
        let mut seqs: Vec<(&mut Context, &mut Decoding)> = contexts.iter_mut().zip(decodings.iter_mut()).collect();
        step(&model, &mut scratch, 512, &mut seqs)?;
        for (d, out) in decodings.iter_mut().zip(&mut together) {
            out.extend(d.take_token().map(|t| t.id));
        }
    }
    for (a, t) in alone.iter().zip(&together) {
        println!("{}", serde_json::json!({ "alone": a, "together": t }));
    }
    Ok(())
}
