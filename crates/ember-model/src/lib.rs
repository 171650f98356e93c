//! # ember-model
//!
//! Run Qwen2-architecture language models (Qwen2.5 Instruct and Coder, 0.5B
//! and up) on the CPU from a HuggingFace model folder: `config.json`,
//! safetensors weights (BF16, F16, F32, or ember's INT8/INT4/INT5, memory-mapped
//! in their stored precision), `tokenizer.json` and the chat template. No ML
//! framework; the kernels are ember's own (`ember-kernels`).
//!
//! This crate knows nothing of terminals: it returns values and errors, and
//! the caller prints.
//!
//! ## A first generation
//!
//! ```
//! # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chat");
//! use ember_model::{GenerateOptions, Message, Model};
//! use std::io::Write;
//!
//! let model = Model::load(dir)?; // an Arc<Model>, shared by every session
//! let prompt = model.chat_prompt(&[Message::user("name three primes .")])?;
//! let mut session = model.session(); // a conversation: its own KV cache
//! let options = GenerateOptions::from_model(&model).max_tokens(16); // generation_config.json's sampling
//! let mut out = std::io::stdout();
//! for token in session.generate(&model.encode(&prompt)?, options)? {
//!     out.write_all(token?.text.as_bytes())?; // UTF-8-safe text deltas
//!     out.flush()?; // stdout is line-buffered: flush to see tokens as they come
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! (The examples here run on a tiny random model with a word-level tokenizer
//! that ships with the crate's tests, so their text is nonsense; with a real
//! folder such as the one `cargo xtask fetch` fills, [`default_model_dir`],
//! the same code answers.)
//!
//! ## Loading
//!
//! [`Model::load`] reads a folder with the defaults; [`Model::builder`]
//! chooses quantization at load ([`WeightType::Int8`], [`WeightType::Int4`]),
//! worker threads, the context of new sessions, the prompt chunk and the
//! [`Precision`] of batched products. Both return an `Arc<Model>`: a loaded
//! model is immutable, and every [`Session`] holds a clone of the `Arc`.
//!
//! ## Generating
//!
//! A [`Session`] is one conversation: its KV cache and tokens.
//! [`Session::generate`] continues after what the session holds and returns
//! a [`Generation`], an iterator of [`Token`]s (id, text delta, EOS flag,
//! optional log-probabilities) whose [`Stats`] tell why it stopped
//! ([`StopReason`]) and how fast it ran. [`GenerateOptions`] says how to
//! sample and when to stop: [`GenerateOptions::default`] is greedy,
//! [`GenerateOptions::from_model`] samples as the model's
//! `generation_config.json` says, and [`SamplerOverrides`] layers a caller's
//! settings over that (it is what the `ember` command line maps its flags to).
//!
//! ## Conversations
//!
//! A chat is a list of [`Message`]s rendered by the model's template
//! ([`Model::chat_prompt`]). Render the whole conversation each turn and hand
//! it to [`Session::generate_from`]: it keeps the cache of the longest
//! common prefix and runs only what is new.
//!
//! ```
//! # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chat");
//! use ember_model::{GenerateOptions, Message, Model};
//!
//! let model = Model::load(dir)?;
//! let mut session = model.session();
//! let mut chat = vec![Message::system("you are a helpful model ."), Message::user("hello !")];
//! for question in ["what is the capital of france ?", "and of italy ?"] {
//!     let ids = model.encode(&model.chat_prompt(&chat)?)?;
//!     let mut generation = session.generate_from(&ids, GenerateOptions::default().max_tokens(8))?;
//!     let reply: String = (&mut generation).map(|t| t.map(|t| t.text)).collect::<Result<_, _>>()?;
//!     // Turn 2 re-runs nothing of turn 1.
//!     assert!(generation.stats().reused_tokens > 0 || chat.len() == 2);
//!     drop(generation);
//!     chat.push(Message::assistant(reply));
//!     chat.push(Message::user(question));
//! }
//! # Ok::<(), ember_model::Error>(())
//! ```
//!
//! ## Owned handles and threads
//!
//! Nothing borrows the model: a [`Session`] owns an `Arc<Model>` and its
//! cache, so a model and its conversations can live in one struct, be
//! returned from functions and move between threads.
//! [`Session::into_generation`] even gives a token stream that owns its
//! session (`Generation<'static>`), handed back by
//! [`Generation::into_session`].
//!
//! ```
//! # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chat");
//! use ember_model::{GenerateOptions, Model, Session};
//! use std::sync::Arc;
//!
//! struct Assistant {
//!     model: Arc<Model>,
//!     session: Session,
//! }
//!
//! fn assistant(dir: &str) -> ember_model::Result<Assistant> {
//!     let model = Model::load(dir)?;
//!     let session = model.session();
//!     Ok(Assistant { model, session })
//! }
//!
//! let mut a = assistant(dir)?;
//! let ids = a.model.encode("the sun is")?;
//! let worker = std::thread::spawn(move || {
//!     let reply = a.session.generate(&ids, GenerateOptions::default().max_tokens(4))?.collect_text()?;
//!     Ok::<_, ember_model::Error>((a, reply))
//! });
//! let (a, _reply) = worker.join().unwrap()?;
//! assert!(a.session.len() > 0);
//! # Ok::<(), ember_model::Error>(())
//! ```
//!
//! **Thread safety.** [`Model`] is `Send + Sync` (share it as an
//! `Arc<Model>`); [`Session`], [`Generation`] (`'static` or borrowing a
//! session that is), [`Token`], [`GenerateOptions`], [`CancelToken`],
//! [`Message`] and the other values are `Send + Sync`. A session is used by
//! one thread at a time (generating takes `&mut`); several sessions may
//! generate on several threads at once. Their forward passes share one
//! process-wide pool of worker threads ([`ModelBuilder::threads`]), whose
//! parallel sections take turns, so two conversations on two threads each
//! run at about half speed rather than contending for cores.
//!
//! ## Cancelling
//!
//! A [`CancelToken`] stops a generation from elsewhere, checked before every
//! forward pass: between the chunks of a long prompt and between tokens.
//!
//! ```
//! # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chat");
//! use ember_model::{GenerateOptions, Model, StopReason};
//!
//! let model = Model::load(dir)?;
//! let mut session = model.session();
//! let mut generation = session.generate(&model.encode("once upon a time")?, GenerateOptions::default())?;
//! let cancel = generation.cancel_token(); // clone it into a Ctrl-C handler, another thread...
//! let mut n = 0;
//! while let Some(token) = generation.next() {
//!     token?;
//!     n += 1;
//!     if n == 3 {
//!         cancel.cancel();
//!     }
//! }
//! assert_eq!(n, 3);
//! assert_eq!(generation.stats().stop, Some(StopReason::Cancelled));
//! # Ok::<(), ember_model::Error>(())
//! ```
//!
//! ## Log-probabilities
//!
//! [`GenerateOptions::logprobs`] gives each token its log-probability under
//! the model and the most likely alternatives:
//!
//! ```
//! # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chat");
//! use ember_model::{GenerateOptions, Model};
//!
//! let model = Model::load(dir)?;
//! let mut session = model.session();
//! let options = GenerateOptions::default().max_tokens(3).logprobs(2);
//! for token in session.generate(&model.encode("the sea is")?, options)? {
//!     let token = token?;
//!     let (lp, best) = (token.logprob.unwrap(), &token.top_logprobs);
//!     assert!(lp <= 0.0 && best.len() == 2);
//!     assert_eq!(best[0].id, token.id); // greedy picks the most likely
//!     println!("{:?} {lp:.3} (then {:?} {:.3})", token.text, model.decode(&[best[1].id])?, best[1].logprob);
//! }
//! # Ok::<(), ember_model::Error>(())
//! ```
//!
//! ## Tools
//!
//! [`Tool`]s are rendered by the chat template ([`Model::chat_prompt_with_tools`]);
//! the model answers with `<tool_call>{json}</tool_call>` blocks, which
//! [`Message::parse_assistant`] (or [`parse_tool_calls`]) turns into
//! [`ToolCall`]s; the tool's answer goes back as a [`Role::Tool`] message.
//! Arguments and schemas are [`serde_json::Value`]s, re-exported with the
//! [`json!`] macro so no other dependency is needed.
//!
//! ```
//! # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chat");
//! use ember_model::{json, Message, Model, Tool};
//!
//! let model = Model::load(dir)?;
//! let weather = Tool::new(
//!     "get_weather",
//!     "The current weather in a city.",
//!     json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
//! );
//! let mut chat = vec![Message::user("what is the weather in paris ?")];
//! let prompt = model.chat_prompt_with_tools(&chat, &[weather.clone()])?;
//! assert!(prompt.contains("\"name\": \"get_weather\""));
//!
//! // What a real model replies here (the tiny one cannot), read back:
//! let reply = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
//! let call = Message::parse_assistant(reply)?;
//! assert_eq!(call.tool_calls[0].arguments["city"], "Paris");
//! chat.push(call);
//! chat.push(Message::tool(json!({"sky": "sunny", "celsius": 21}).to_string()));
//! // The next prompt shows the model its call and the result.
//! let prompt = model.chat_prompt_with_tools(&chat, &[weather])?;
//! assert!(prompt.contains("<tool_response>"));
//! # Ok::<(), ember_model::Error>(())
//! ```
//!
//! ## Advanced
//!
//! [`advanced`] holds the layer below: the decoder and its batch-first
//! forward pass over several sequences' KV caches, [`advanced::step`] for
//! decoding many sequences in one pass per token (a server's scheduler),
//! weights, quantization, evaluation and benchmarks. The `ember` command
//! line, `cargo xtask` and the benches use it; it changes more freely than
//! the top level.

#![warn(missing_docs)]

mod alloc;
mod bench;
mod chat;
mod config;
mod error;
mod eval;
mod generate;
mod gguf;
mod gguf_tokenizer;
mod gguf_write;
mod kv_cache;
mod model;
mod options;
mod quantize;
mod qwen2;
mod session;
mod stream;
mod tokenizer;
mod weights;

pub use chat::{parse_tool_calls, Message, Role, Tool, ToolCall};
pub use config::{Config, GenerationConfig, TokenIds};
pub use ember_kernels::{Precision, WeightType};
pub use ember_sample::{SamplerConfig, SamplerError};
pub use error::{Error, Result};
pub use generate::{Stats, StopReason, Token, TopLogprob, DEFAULT_CONTEXT, DEFAULT_PREFILL_CHUNK};
pub use model::{Model, ModelBuilder};
pub use options::{CancelToken, GenerateOptions, SamplerOverrides};
pub use serde_json::{self, json};
pub use session::{Generation, Session};
pub use tokenizer::Tokenizer;

pub mod advanced {
    //! The layer below the top level, for the `ember` command line, `cargo
    //! xtask`, the benches and a future server: the decoder and its forward pass
    //! over a batch of tokens from several sequences, KV caches, the
    //! multi-sequence [`step`], weights and quantization, the chat template and
    //! text stream on their own, evaluation and benchmarks.
    //!
    //! These are ember's working parts; they change more freely than the top
    //! level.
    //!
    //! **Several sequences at once.** [`Qwen2::forward`] takes a batch of
    //! [`BatchToken`]s, each tagged with its sequence (an index into the
    //! [`KvCache`]s passed with it) and position, and returns the logits of the
    //! tokens that ask for them; every weight is read once per pass for the
    //! whole batch. [`step`] builds on it: each sequence a [`Context`] (cache and
    //! tokens) and a [`Decoding`] (sampler, text stream, stop strings, stats),
    //! stepped together, they produce what each produces alone.
    //!
    //! ```
    //! # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chat");
    //! use ember_model::advanced::{step, Context, Decoding, Scratch};
    //! use ember_model::{GenerateOptions, Model};
    //!
    //! let model = Model::load(dir)?;
    //! let prompts = [model.encode("the sea is")?, model.encode("hello")?];
    //! let options = GenerateOptions::default().max_tokens(4).stop_at_eos(false);
    //! let mut contexts: Vec<Context> = prompts.iter().map(|_| Context::new(model.decoder().new_cache(64))).collect();
    //! let mut decodings = prompts
    //!     .iter()
    //!     .map(|p| Decoding::new(&model, options.clone(), p.clone(), 0))
    //!     .collect::<Result<Vec<_>, _>>()?;
    //! let mut scratch = Scratch::default();
    //! let mut ids = vec![Vec::new(); prompts.len()];
    //! while decodings.iter().any(|d| !d.is_done()) {
    //!     let mut seqs: Vec<_> = contexts.iter_mut().zip(decodings.iter_mut()).collect();
    //!     step(&model, &mut scratch, 512, &mut seqs)?; // one forward pass for both
    //!     for (d, out) in decodings.iter_mut().zip(&mut ids) {
    //!         out.extend(d.take_token().map(|t| t.id));
    //!     }
    //! }
    //! assert!(ids.iter().all(|i| i.len() == 4));
    //! # Ok::<(), ember_model::Error>(())
    //! ```

    pub use crate::generate::{advance, step, Context, Decoding};
    pub use crate::kv_cache::KvCache;
    pub use crate::model::{init_threads, load_qwen2, physical_cores};
    pub use crate::qwen2::{
        Attention, BatchToken, Layer, Linear, Mlp, Phase, PhaseTimes, QuantPolicy, Qwen2, Scratch, State, WeightRole,
        INT4_MIX,
    };
    pub use crate::stream::TextStream;
    pub use crate::tokenizer::ChatTemplate;
    pub use crate::weights::{
        quant_key, safetensors_dtype, transparent_huge_pages, write_safetensors, Tensor, TensorStore,
    };

    /// What `ember bench` times: prompt processing, generation, several
    /// sequences decoding together, and the memory read bandwidth.
    pub mod bench {
        pub use crate::bench::*;
    }

    /// GGUF files (llama.cpp's format): the reader, its metadata values and
    /// tensor infos, and llama.cpp's tensor names.
    pub mod gguf {
        pub use crate::gguf::{
            gguf_name, hf_name, Array, GgmlType, Gguf, Header, TensorInfo, Value, DEFAULT_ALIGNMENT, MAX_DIMS,
        };
    }

    /// Quality of a model variant on a text, llama-perplexity style:
    /// perplexity, KL divergence and top-1 agreement against a base model.
    pub mod eval {
        pub use crate::eval::*;
    }

    /// Writing a quantized model (`ember quantize`): a folder
    /// ([`write_folder`](crate::quantize::write_folder)) or a GGUF file
    /// llama.cpp also runs ([`write_gguf`](crate::gguf_write::write_gguf)).
    pub mod quantize {
        pub use crate::gguf_write::write_gguf;
        pub use crate::quantize::*;
    }
}

/// The folder `cargo xtask fetch` fills: `$EMBER_MODELS/qwen2.5-coder-0.5b-instruct`,
/// with `EMBER_MODELS` defaulting to `~/.cache/ember-models`. `None` if
/// neither `EMBER_MODELS` nor `HOME` is set.
pub fn default_model_dir() -> Option<std::path::PathBuf> {
    let base = match std::env::var_os("EMBER_MODELS") {
        Some(d) if !d.is_empty() => std::path::PathBuf::from(d),
        _ => std::path::PathBuf::from(std::env::var_os("HOME")?).join(".cache/ember-models"),
    };
    Some(base.join("qwen2.5-coder-0.5b-instruct"))
}

// The README's library example compiles as written (the file is the
// workspace README; it ships in the package as the crate's readme).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
