//! # ember-model
//!
//! The Qwen2 decoder and everything needed to run it from a HuggingFace model
//! folder: [`Config`] from `config.json`, memory-mapped safetensors weights in
//! their stored precision, the KV cache, the tokenizer and chat template, and
//! streaming generation.
//!
//! This crate knows nothing of terminals: it returns values and errors, and
//! the caller prints.
//!
//! ```no_run
//! use ember_model::{GenerateOptions, Message, Model};
//!
//! # fn main() -> ember_model::Result<()> {
//! let model = Model::load("path/to/qwen2.5-0.5b-instruct")?;
//! let prompt = model.chat_prompt(&[Message::user("Name three primes.")])?;
//! let ids = model.encode(&prompt)?;
//! let mut session = model.session(2048)?;
//! let mut generation = session.generate(&ids, GenerateOptions::default())?;
//! for token in &mut generation {
//!     print!("{}", token?.text);
//! }
//! println!("\n{:.1} tokens/s", generation.stats().decode_tok_s());
//! # Ok(())
//! # }
//! ```

pub mod bench;
pub mod config;
pub mod error;
pub mod generate;
pub mod kv_cache;
pub mod qwen2;
pub mod stream;
pub mod tokenizer;
pub mod weights;

pub mod eval;
pub mod quantize;
pub use config::{Config, GenerationConfig};
pub use ember_kernels::{Precision, WeightType};
pub use ember_sample::{Sampler, SamplerConfig};
pub use error::{Error, Result};
pub use generate::{
    load_qwen2, step, Context, Decoding, GenerateOptions, Generation, Model, Session, Stats, StopReason, Token,
    DEFAULT_CONTEXT, DEFAULT_PREFILL_CHUNK,
};
pub use kv_cache::KvCache;
pub use qwen2::{BatchToken, QuantPolicy, Qwen2, Scratch, State, WeightRole, INT4_KEEPS_INT8};
pub use stream::TextStream;
pub use tokenizer::{ChatTemplate, Message, Role, Tokenizer};
pub use weights::{Tensor, TensorStore};

/// The folder `cargo xtask fetch` fills: `$EMBER_MODELS/qwen2.5-coder-0.5b-instruct`,
/// with `EMBER_MODELS` defaulting to `~/.cache/ember-models`.
pub fn default_model_dir() -> Option<std::path::PathBuf> {
    let base = match std::env::var_os("EMBER_MODELS") {
        Some(d) if !d.is_empty() => std::path::PathBuf::from(d),
        _ => std::path::PathBuf::from(std::env::var_os("HOME")?).join(".cache/ember-models"),
    };
    Some(base.join("qwen2.5-coder-0.5b-instruct"))
}
