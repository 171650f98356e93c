//! Errors of loading and running a model. Each names the file, tensor or
//! field at fault, so a user can act on the message alone; none names a
//! command-line flag (a program adds its own hints).

use std::path::PathBuf;

/// Result with ember-model's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, with the file, tensor or field at fault.
///
/// The enum is `non_exhaustive`: match the variants you act on and keep a
/// wildcard arm. `Display` gives a complete sentence for a user.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The model folder does not exist.
    #[error("model folder {0} does not exist")]
    MissingModelDir(PathBuf),

    /// Reading a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },

    /// A JSON file (`config.json`, `tokenizer_config.json`, ...) does not parse.
    #[error("{}: not a valid file: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        source: serde_json::Error,
    },

    /// A field of `config.json` has a value ember cannot run.
    #[error("{}: field `{field}`: {message}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// The field, as HuggingFace names it.
        field: &'static str,
        /// What is wrong with its value.
        message: String,
    },

    /// `config.json` names another architecture than Qwen2.
    #[error("{}: unsupported architecture {found}; ember runs Qwen2ForCausalLM (model_type \"qwen2\")", path.display())]
    UnknownArchitecture {
        /// The file.
        path: PathBuf,
        /// The architecture and model type found.
        found: String,
    },

    /// The folder has neither `model.safetensors` nor an index of shards.
    #[error("{}: no weights: expected model.safetensors or model.safetensors.index.json", dir.display())]
    MissingWeights {
        /// The model folder.
        dir: PathBuf,
    },

    /// A safetensors file is truncated or malformed.
    #[error("{}: invalid safetensors file: {message}", path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },

    /// A GGUF file is truncated or malformed, or lacks a metadata key ember
    /// needs.
    #[error("{}: invalid GGUF file: {message}", path.display())]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong, and where.
        message: String,
    },

    /// A GGUF tensor the model needs is stored in a ggml type ember does not
    /// compute with yet.
    #[error("{}: tensor `{name}` has GGUF type {ty}; ember runs F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K", path.display())]
    GgufType {
        /// The file.
        path: PathBuf,
        /// The tensor's name in the file (llama.cpp's).
        name: String,
        /// ggml's name of its type (`IQ4_XS`, ...).
        ty: String,
    },

    /// A path given as a model is neither a folder nor a `.gguf` file, or a
    /// folder holds several `.gguf` files and no `config.json`; or an output
    /// path that would overwrite the model.
    #[error("{}: {message}", path.display())]
    ModelPath {
        /// The path.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },

    /// A tensor the config calls for is not in the weights.
    #[error("{}: tensor `{name}` is missing", path.display())]
    MissingTensor {
        /// The weights file (or index) searched.
        path: PathBuf,
        /// The tensor's HuggingFace name.
        name: String,
    },

    /// `model.safetensors.index.json` maps a tensor to a shard that is not a
    /// plain file name of the model folder (`..`, an absolute path, a
    /// sub-folder).
    #[error("{}: tensor `{tensor}` is mapped to shard `{shard}`, which is not a file name inside the model folder (folders, `..` and absolute paths are refused)", path.display())]
    ShardName {
        /// The index file.
        path: PathBuf,
        /// A tensor mapped to it.
        tensor: String,
        /// The shard's name as written.
        shard: String,
    },

    /// The weights hold a tensor the model as configured does not use: the
    /// checkpoint is not the model its config describes, and running
    /// without the tensor would be silently wrong.
    #[error("{}: tensor `{name}` is not used by a Qwen2 model of this configuration{}; the weights are not the model the config describes", path.display(), if *more > 0 { format!(" (nor are {more} more)") } else { String::new() })]
    UnusedTensor {
        /// The weights file holding it.
        path: PathBuf,
        /// The tensor's name in the file.
        name: String,
        /// How many other tensors are unused.
        more: usize,
    },

    /// A tensor's shape differs from what the config implies.
    #[error("{}: tensor `{name}` has shape {found:?}, expected {expected:?}", path.display())]
    Shape {
        /// The weights file.
        path: PathBuf,
        /// The tensor's name.
        name: String,
        /// Its shape in the file.
        found: Vec<usize>,
        /// The shape the config implies.
        expected: Vec<usize>,
    },

    /// A tensor is stored in a type ember does not read.
    #[error("{}: tensor `{name}` has dtype {dtype}; ember reads BF16, F16 and F32", path.display())]
    Dtype {
        /// The weights file.
        path: PathBuf,
        /// The tensor's name.
        name: String,
        /// Its safetensors dtype.
        dtype: String,
    },

    /// `tokenizer.json` is missing or does not load.
    #[error("{}: tokenizer: {message}", path.display())]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// The tokenizers library's message.
        message: String,
    },

    /// Encoding or decoding text failed.
    #[error("tokenizer: {0}")]
    Encode(String),

    /// The chat template is missing, does not compile, or failed to render
    /// (templates raise errors for conversations they refuse).
    #[error("chat template: {0}")]
    Template(String),

    /// The prompt does not fit in the session's context.
    #[error("the prompt has {prompt} tokens but the context holds {context} (the model allows up to {max})")]
    PromptTooLong {
        /// Tokens the context would need to hold (what it holds plus the prompt).
        prompt: usize,
        /// The session's context.
        context: usize,
        /// The model's `max_position_embeddings`.
        max: usize,
    },

    /// A generation was asked for with no token to start from.
    #[error("the prompt is empty: at least one token is needed")]
    EmptyPrompt,

    /// A token id is not in the model's vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// The model's `vocab_size`.
        vocab: usize,
    },

    /// A forward pass would write past a KV cache's capacity.
    #[error("context of {context} tokens is full")]
    ContextFull {
        /// The cache's capacity.
        context: usize,
    },

    /// A batch of the multi-sequence API does not continue its caches.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),

    /// A setting is out of range (a context of 0 tokens, ...).
    #[error("invalid option: {0}")]
    Option(String),

    /// The process-wide worker pool already runs another number of threads.
    #[error("the worker pool already runs {running} threads; it is sized once per process, so {requested} cannot be set now")]
    Threads {
        /// The threads asked for.
        requested: usize,
        /// The threads the pool has.
        running: usize,
    },

    /// A sampler setting is out of range.
    #[error("sampler: {0}")]
    Sampler(#[from] ember_sample::SamplerError),

    /// A forward pass produced a NaN or infinite logit: the weights (or
    /// activations computed from them) are not finite numbers. Generation
    /// stops here rather than sample from a meaningless distribution.
    #[error("the forward pass produced a non-finite logit ({value}) for token {token} at position {position}: the model's weights hold NaN or infinite values, or its activations overflowed")]
    NonFinite {
        /// The position (0-based) of the token whose logits are not finite.
        position: usize,
        /// The vocabulary index of the first non-finite logit.
        token: usize,
        /// That logit (NaN, inf or −inf).
        value: f32,
    },

    /// Quantization was asked for a matrix already stored in another
    /// quantized type (`--quant int4` on an INT8 folder, or on a GGUF
    /// file's Q4_K weights).
    #[error("tensor `{name}` is stored as {stored}, not {wanted}; ember does not quantize quantized weights again (rounding twice loses more than once): quantize from the BF16, F16 or F32 weights")]
    AlreadyQuantized {
        /// The tensor's HuggingFace name.
        name: String,
        /// Its type (`int8`, `q4_k`, ...).
        stored: String,
        /// The type asked for.
        wanted: String,
    },

    /// A small tensor checked at load (a norm's weights, a bias) holds NaN
    /// or infinity.
    #[error("tensor `{name}` holds a non-finite value ({value}) at index {index}")]
    NonFiniteWeight {
        /// The tensor's HuggingFace name.
        name: String,
        /// The index of the first such value.
        index: usize,
        /// That value.
        value: f32,
    },

    /// A large buffer (a KV cache, logits of many positions, ...) could not
    /// be allocated: the machine does not have the memory asked for.
    #[error("could not allocate {} for {what}", gib(*bytes))]
    OutOfMemory {
        /// What the buffer is for.
        what: &'static str,
        /// Bytes asked for (`usize::MAX` when the size itself overflowed).
        bytes: usize,
    },

    /// A model's tool call could not be read (see [`parse_tool_calls`](crate::parse_tool_calls)).
    #[error("{0}")]
    ToolCall(String),
}

/// `bytes` as GiB for a message (or "more memory than can be addressed").
fn gib(bytes: usize) -> String {
    if bytes == usize::MAX {
        "more memory than can be addressed".into()
    } else {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    }
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io { path: path.into(), source }
    }
}
