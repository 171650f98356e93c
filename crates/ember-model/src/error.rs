//! Errors of loading and running a model. Each names the file, tensor or
//! field at fault, so a user can act on the message alone.

use std::path::PathBuf;

/// Result with ember-model's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("model folder {0} does not exist")]
    MissingModelDir(PathBuf),

    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },

    #[error("{}: not a valid file: {source}", path.display())]
    Json { path: PathBuf, source: serde_json::Error },

    #[error("{}: field `{field}`: {message}", path.display())]
    Config { path: PathBuf, field: &'static str, message: String },

    #[error("{}: unsupported architecture {found}; ember runs Qwen2ForCausalLM (model_type \"qwen2\")", path.display())]
    UnknownArchitecture { path: PathBuf, found: String },

    #[error("{}: no weights: expected model.safetensors or model.safetensors.index.json", dir.display())]
    MissingWeights { dir: PathBuf },

    #[error("{}: invalid safetensors file: {message}", path.display())]
    Safetensors { path: PathBuf, message: String },

    #[error("{}: tensor `{name}` is missing", path.display())]
    MissingTensor { path: PathBuf, name: String },

    #[error("{}: tensor `{name}` has shape {found:?}, expected {expected:?}", path.display())]
    Shape { path: PathBuf, name: String, found: Vec<usize>, expected: Vec<usize> },

    #[error("{}: tensor `{name}` has dtype {dtype}; ember reads BF16, F16 and F32", path.display())]
    Dtype { path: PathBuf, name: String, dtype: String },

    #[error("{}: tokenizer: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },

    #[error("tokenizer: {0}")]
    Encode(String),

    #[error("chat template: {0}")]
    Template(String),

    #[error("the prompt has {prompt} tokens but the context holds {context} (the model allows up to {max})")]
    PromptTooLong { prompt: usize, context: usize, max: usize },

    #[error("the prompt is empty: at least one token is needed")]
    EmptyPrompt,

    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },

    #[error("context of {context} tokens is full")]
    ContextFull { context: usize },

    #[error("invalid batch: {0}")]
    InvalidBatch(String),

    #[error("invalid option: {0}")]
    Option(String),

    #[error("sampler: {0}")]
    Sampler(#[from] ember_sample::SamplerError),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io { path: path.into(), source }
    }
}
