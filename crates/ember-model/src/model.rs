//! A loaded model folder ([`Model`]) and how it is loaded ([`ModelBuilder`]).

use crate::chat::{Message, Tool};
use crate::config::{eos_ids, Config, GenerationConfig};
use crate::error::{Error, Result};
use crate::generate::{Context, DEFAULT_CONTEXT, DEFAULT_PREFILL_CHUNK};
use crate::gguf::Gguf;
use crate::qwen2::{QuantPolicy, Qwen2};
use crate::session::Session;
use crate::tokenizer::Tokenizer;
use crate::weights::TensorStore;
use ember_kernels::{pool, Precision, WeightType};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A model folder, loaded: weights, tokenizer, chat template and generation
/// defaults. Immutable once loaded, `Send` and `Sync`, and handed out as an
/// `Arc<Model>` that any number of [`Session`]s (on any threads) share.
///
/// ```
/// # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chat");
/// use ember_model::{Message, Model};
///
/// let model = Model::load(dir)?; // an Arc<Model>
/// let prompt = model.chat_prompt(&[Message::user("what is the capital of france ?")])?;
/// let ids = model.encode(&prompt)?;
/// assert!(model.decode(&ids)?.contains("capital"));
/// # Ok::<(), ember_model::Error>(())
/// ```
pub struct Model {
    qwen2: Qwen2,
    tokenizer: Tokenizer,
    generation_config: GenerationConfig,
    eos: Vec<u32>,
    dir: PathBuf,
    /// Context of the sessions [`Model::session`] opens.
    context: usize,
    /// Their prompt tokens per forward pass.
    prefill_chunk: usize,
    /// Bytes of weights copied into huge pages at load (0: none).
    huge_page_bytes: usize,
}

/// How to load a model: [`Model::builder`], the settings, then
/// [`ModelBuilder::load`].
///
/// ```
/// # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tiny-chat");
/// use ember_model::{Model, Precision, WeightType};
///
/// let model = Model::builder(dir)
///     .quantize(WeightType::Int8) // quantize the matrices at load
///     .precision(Precision::Exact) // f32-class prompt products
///     .context(128)               // tokens per session (capped at the model's maximum)
///     .load()?;
/// assert_eq!(model.context(), 128);
/// assert_eq!(model.weight_type(), WeightType::Int8);
/// # Ok::<(), ember_model::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct ModelBuilder {
    dir: PathBuf,
    quantize: Option<QuantPolicy>,
    threads: Option<usize>,
    context: usize,
    prefill_chunk: usize,
    precision: Precision,
    huge_pages: bool,
}

impl ModelBuilder {
    /// Quantizes the weight matrices at load: [`WeightType::Int8`],
    /// [`WeightType::Int4`] (with INT4 the embedding / LM head and o get
    /// INT5, k, v and down INT8: the measured default, [`INT4_MIX`](crate::advanced::INT4_MIX))
    /// or [`WeightType::Int5`], or a
    /// [`QuantPolicy`](crate::advanced::QuantPolicy) saying which matrix gets
    /// which type. About a second (INT8) to seven (INT4) for a 0.5B model; a
    /// folder written quantized (`ember quantize`) loads as it is stored.
    pub fn quantize(mut self, policy: impl Into<QuantPolicy>) -> Self {
        self.quantize = Some(policy.into());
        self
    }

    /// Worker threads for the matrix products (default: the physical CPU
    /// cores). The pool is process-wide and sized once: loading fails with
    /// [`Error::Threads`] if it already runs another number.
    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = Some(threads);
        self
    }

    /// Tokens of context (prompt and output, the whole conversation) of the
    /// sessions [`Model::session`] opens; default [`DEFAULT_CONTEXT`], capped
    /// at the model's `max_position_embeddings`. The KV cache is reserved at
    /// this size but only the positions used take memory.
    pub fn context(mut self, tokens: usize) -> Self {
        self.context = tokens;
        self
    }

    /// Prompt tokens per forward pass of those sessions (default
    /// [`DEFAULT_PREFILL_CHUNK`]; 1 = token by token). Scratch memory grows
    /// with it (about 45 KB per token for the 0.5B model).
    pub fn prefill_chunk(mut self, tokens: usize) -> Self {
        self.prefill_chunk = tokens;
        self
    }

    /// How the matrix products of a prompt (and of several sequences
    /// decoding together) round their activations: [`Precision::Fast`] (the
    /// default: narrower products where the CPU multiplies them faster, with
    /// a measured cost) or [`Precision::Exact`] (f32-class). Decoding one
    /// token at a time is the same either way.
    pub fn precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// Whether to copy the weights into memory backed by transparent huge
    /// pages at load, where the kernel offers them (default: no; see
    /// [`Qwen2::copy_to_huge_pages`](crate::advanced::Qwen2::copy_to_huge_pages)).
    /// Decoding is 4–5% faster from the copy, more for BF16 models, whose
    /// o and down the copy lays out in column parts (logits then agree with
    /// the mapped layout's to f32 rounding, not bit for bit); it pays off
    /// for a model that serves or chats for a while. The cost is at load: the copy's time
    /// (0.13 s for 0.41 GB where memory was ready; 1.8 s for the 0.99 GB
    /// BF16 model on a VM whose fresh pages were slow to clear) and, while
    /// it is made, the weights twice in memory (the file's pages stay in the
    /// page cache, which the kernel may reclaim). Without it the weights are
    /// read from the mapped file, and processes loading the same file share
    /// those pages. `ember chat`, `ember serve` and `ember bench` ask for it
    /// (`EMBER_HUGE_PAGES=0` or `1` overrides).
    pub fn huge_pages(mut self, yes: bool) -> Self {
        self.huge_pages = yes;
        self
    }

    /// Loads the folder: `config.json`, the safetensors weights
    /// (memory-mapped, in their stored precision, then copied into huge
    /// pages: [`ModelBuilder::huge_pages`]), `tokenizer.json`, the chat
    /// template and `generation_config.json`. Or a GGUF file (the path of a
    /// `.gguf` file, or of a folder holding exactly one and no
    /// `config.json`): hyper-parameters, weights, tokenizer and chat template
    /// all from the file. Errors name the file, tensor or field at fault.
    ///
    /// Nothing is trusted before it is checked: the config's sizes are
    /// bounded and their products computed with checked arithmetic, and the
    /// weights must be exactly the model the config describes (its layers,
    /// no more; every tensor of the shape the config implies; no tensor
    /// unused), before any buffer is allocated from them.
    pub fn load(self) -> Result<Arc<Model>> {
        if self.context == 0 {
            return Err(Error::Option("a context of 0 tokens holds nothing; it must be at least 1".into()));
        }
        if self.prefill_chunk == 0 {
            return Err(Error::Option("the prefill chunk must be at least 1 token".into()));
        }
        let dir = self.dir.as_path();
        let source = Source::resolve(dir)?;
        init_threads(self.threads)?;
        let (mut qwen2, tokenizer, generation_config, eos) = match &source {
            Source::Folder(dir) => {
                let qwen2 = load_qwen2(dir)?;
                let tokenizer = Tokenizer::from_dir(dir)?;
                let generation_config = GenerationConfig::from_file(&dir.join("generation_config.json"))?;
                let eos = eos_ids(&qwen2.config, &generation_config);
                (qwen2, tokenizer, generation_config, eos)
            }
            Source::Gguf(file) => {
                let g = Gguf::open(file)?;
                let tokenizer = Tokenizer::from_gguf(&g)?;
                let eos = crate::gguf::eos_ids(&g);
                let config = crate::gguf::qwen2_config(&g)?;
                let qwen2 = decoder(config, file, &TensorStore::open_gguf(g)?)?;
                (qwen2, tokenizer, GenerationConfig::default(), eos)
            }
        };
        if let Some(policy) = &self.quantize {
            qwen2.quantize(policy)?;
        }
        qwen2.precision = self.precision;
        // An optimisation only: without memory for the copy, the weights
        // stay in the mapped file.
        let huge_page_bytes = if self.huge_pages { qwen2.copy_to_huge_pages().unwrap_or(0) } else { 0 };
        let context = self.context.min(qwen2.config.max_position_embeddings);
        Ok(Arc::new(Model {
            qwen2,
            tokenizer,
            generation_config,
            eos,
            dir: source.path().to_path_buf(),
            context,
            prefill_chunk: self.prefill_chunk,
            huge_page_bytes,
        }))
    }
}

impl Model {
    /// Loads a model folder with the default settings ([`Model::builder`]
    /// to choose them).
    pub fn load(dir: impl AsRef<Path>) -> Result<Arc<Model>> {
        Model::builder(dir).load()
    }

    /// A [`ModelBuilder`] for the folder `dir` (HuggingFace layout), or a
    /// GGUF file (see [`ModelBuilder::load`]).
    pub fn builder(dir: impl AsRef<Path>) -> ModelBuilder {
        ModelBuilder {
            dir: dir.as_ref().to_path_buf(),
            quantize: None,
            threads: None,
            context: DEFAULT_CONTEXT,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            precision: Precision::default(),
            huge_pages: false,
        }
    }

    /// Bytes of weights in memory backed by transparent huge pages (0 when
    /// they are read from the mapped file: [`ModelBuilder::huge_pages`]).
    pub fn huge_page_bytes(&self) -> usize {
        self.huge_page_bytes
    }

    /// The hyper-parameters from `config.json`.
    pub fn config(&self) -> &Config {
        &self.qwen2.config
    }

    /// The defaults from `generation_config.json` (empty if the file is
    /// absent); [`GenerateOptions::from_model`](crate::GenerateOptions::from_model)
    /// turns them into sampler settings.
    pub fn generation_config(&self) -> &GenerationConfig {
        &self.generation_config
    }

    /// The tokenizer and chat template.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The folder the model was loaded from (the file, for a GGUF model).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The ids generation stops on: `generation_config.json`'s
    /// `eos_token_id`, else `config.json`'s.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    /// The context of the sessions [`Model::session`] opens.
    pub fn context(&self) -> usize {
        self.context
    }

    /// The prompt tokens per forward pass of new sessions.
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// The precision of batched products ([`ModelBuilder::precision`]).
    pub fn precision(&self) -> Precision {
        self.qwen2.precision
    }

    /// The weight type of the MLP's gate projection, as representative of
    /// the model's matrices: the stored type, or the quantized one.
    pub fn weight_type(&self) -> WeightType {
        self.qwen2.layers.first().map_or(self.qwen2.lm_head.dtype, |l| l.mlp.gate_proj.weight.dtype)
    }

    /// Threads of the worker pool the forward passes run on.
    pub fn threads(&self) -> usize {
        pool::global().threads()
    }

    /// Token ids of `text` (special tokens written in it, such as
    /// `<|im_start|>`, are recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode(text)
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, true)
    }

    /// The prompt for a chat: the model's template applied to `messages`,
    /// ending with the assistant's turn header.
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<String> {
        self.tokenizer.apply_chat_template(messages, true)
    }

    /// [`Model::chat_prompt`] with tools the model may call: the template
    /// describes them and how to call them (for Qwen2.5, a
    /// `<tool_call>{json}</tool_call>` block, which
    /// [`Message::parse_assistant`] reads back).
    pub fn chat_prompt_with_tools(&self, messages: &[Message], tools: &[Tool]) -> Result<String> {
        self.tokenizer.apply_chat_template_with_tools(messages, tools, true)
    }

    /// A new, empty conversation with [`Model::context`] tokens of room.
    pub fn session(self: &Arc<Self>) -> Session {
        Session::with_context(Arc::clone(self), Context::new(self.session_cache(self.context)))
    }

    /// A session's KV cache: in huge pages when the weights are
    /// ([`ModelBuilder::huge_pages`]: a model that runs a while), so that
    /// its attention does not walk a page table every 8 positions.
    fn session_cache(&self, context: usize) -> crate::advanced::KvCache {
        self.qwen2.new_cache(context).in_huge_pages(self.huge_page_bytes > 0)
    }

    /// A new conversation with room for `context` tokens (at most the
    /// model's `max_position_embeddings`).
    pub fn session_with_context(self: &Arc<Self>, context: usize) -> Result<Session> {
        let max = self.config().max_position_embeddings;
        if context == 0 || context > max {
            return Err(Error::Option(format!(
                "context must be between 1 and the model's {max} tokens, not {context}"
            )));
        }
        Ok(Session::with_context(Arc::clone(self), Context::new(self.session_cache(context))))
    }

    /// The decoder itself, for the multi-sequence API
    /// ([`advanced`](crate::advanced)).
    pub fn decoder(&self) -> &Qwen2 {
        &self.qwen2
    }
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = self.config();
        f.debug_struct("Model")
            .field("dir", &self.dir)
            .field("layers", &c.num_hidden_layers)
            .field("hidden_size", &c.hidden_size)
            .field("vocab_size", &c.vocab_size)
            .field("weight_type", &self.weight_type())
            .field("precision", &self.precision())
            .field("context", &self.context)
            .field("eos_token_ids", &self.eos)
            .finish_non_exhaustive()
    }
}

/// Loads just the decoder (config and weights) from a folder or a GGUF file
/// (as [`ModelBuilder::load`] finds one): no tokenizer.
pub fn load_qwen2(dir: &Path) -> Result<Qwen2> {
    match Source::resolve(dir)? {
        Source::Folder(dir) => {
            let config_path = dir.join("config.json");
            let config = Config::from_file(&config_path)?;
            decoder(config, &config_path, &TensorStore::open_dir(&dir)?)
        }
        Source::Gguf(file) => {
            let g = Gguf::open(&file)?;
            let config = crate::gguf::qwen2_config(&g)?;
            decoder(config, &file, &TensorStore::open_gguf(g)?)
        }
    }
}

/// The decoder `config` describes, from `store`, cross-checked both ways:
/// the weights hold exactly the config's layers (checked before anything is
/// taken), every tensor has the shape the config implies
/// ([`Qwen2::from_store`]), and every tensor is used (so a checkpoint of
/// another size or architecture is an error, not a silently wrong model).
/// `config_path` is where the config came from, for messages.
fn decoder(config: Config, config_path: &Path, store: &TensorStore) -> Result<Qwen2> {
    check_layers(&config, config_path, store)?;
    let qwen2 = Qwen2::from_store(config, store)?;
    if let Some((first, rest)) = store.unused().split_first() {
        return Err(Error::UnusedTensor {
            path: store.file_of(first).to_path_buf(),
            name: store.display_name(first),
            more: rest.len(),
        });
    }
    Ok(qwen2)
}

/// The layers of the weights (`model.layers.N.*`, N written plainly) are
/// exactly `0..num_hidden_layers`.
fn check_layers(config: &Config, config_path: &Path, store: &TensorStore) -> Result<()> {
    let mut layers = std::collections::BTreeMap::new();
    for name in store.names() {
        let Some((n, _)) = name.strip_prefix("model.layers.").and_then(|rest| rest.split_once('.')) else {
            continue;
        };
        // `01` or `+1` is not a layer's name: such a tensor is unused.
        let plain = n == "0" || (!n.starts_with('0') && n.bytes().all(|b| b.is_ascii_digit()));
        if let Some(n) = n.parse::<usize>().ok().filter(|_| plain) {
            let first = layers.entry(n).or_insert(name);
            *first = (*first).min(name);
        }
    }
    let declared = config.num_hidden_layers;
    let err = |message: String| Error::Config { path: config_path.to_path_buf(), field: "num_hidden_layers", message };
    let weights = store.file_of("").display().to_string();
    if let Some((&n, &name)) = layers.range(declared..).next() {
        return Err(err(format!(
            "is {declared}, but {weights} has a layer {n} (`{}`): it and every layer after would be ignored",
            store.display_name(name)
        )));
    }
    if let Some(missing) = (0..declared).find(|i| !layers.contains_key(i)) {
        return Err(err(format!(
            "is {declared}, but {weights} holds {} layers (none of layer {missing}'s tensors, `{}`)",
            layers.len(),
            store.display_name(&format!("model.layers.{missing}.input_layernorm.weight"))
        )));
    }
    Ok(())
}

/// Where a model is: a HuggingFace folder or a GGUF file.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Source {
    Folder(PathBuf),
    Gguf(PathBuf),
}

impl Source {
    /// A `.gguf` file is GGUF; a folder with `config.json` is a HuggingFace
    /// folder; a folder without one but with exactly one `.gguf` file is
    /// that file (several are an error: which one is meant?); any other
    /// folder is a HuggingFace folder (whose loading says what is missing).
    pub(crate) fn resolve(path: &Path) -> Result<Source> {
        let is_gguf = |p: &Path| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        if path.is_file() {
            return match is_gguf(path) {
                true => Ok(Source::Gguf(path.to_path_buf())),
                false => Err(Error::ModelPath {
                    path: path.to_path_buf(),
                    message: "not a model: expected a folder in HuggingFace layout or a .gguf file".into(),
                }),
            };
        }
        if !path.is_dir() {
            // A `.gguf` path names a file: say the file is missing, not a folder.
            if is_gguf(path) {
                return Err(Error::io(path, std::io::Error::from(std::io::ErrorKind::NotFound)));
            }
            return Err(Error::MissingModelDir(path.to_path_buf()));
        }
        if path.join("config.json").is_file() {
            return Ok(Source::Folder(path.to_path_buf()));
        }
        let entries = std::fs::read_dir(path).map_err(|e| Error::io(path, e))?;
        let mut ggufs: Vec<PathBuf> =
            entries.flatten().map(|e| e.path()).filter(|p| p.is_file() && is_gguf(p)).collect();
        ggufs.sort();
        match ggufs.len() {
            0 => Ok(Source::Folder(path.to_path_buf())),
            1 => Ok(Source::Gguf(ggufs.remove(0))),
            _ => Err(Error::ModelPath {
                path: path.to_path_buf(),
                message: format!(
                    "holds {} .gguf files and no config.json; name the file to load ({})",
                    ggufs.len(),
                    ggufs
                        .iter()
                        .map(|p| p.file_name().unwrap_or_default().to_string_lossy())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }),
        }
    }

    /// The folder or file.
    pub(crate) fn path(&self) -> &Path {
        match self {
            Source::Folder(p) | Source::Gguf(p) => p,
        }
    }
}

/// Sizes the process-wide worker pool the kernels run on, once: `threads`,
/// or by default the physical CPU cores ([`physical_cores`]). Returns the
/// pool's size. More threads than the hardware threads the process may run
/// on is [`Error::Option`]; asking for another size than a running pool's
/// is [`Error::Threads`]; with `None`, a running pool is kept as it is.
pub fn init_threads(threads: Option<usize>) -> Result<usize> {
    match threads {
        Some(0) => Err(Error::Option("the worker pool needs at least 1 thread".into())),
        Some(n) => match pool::global_threads() {
            Some(running) if running != n => Err(Error::Threads { requested: n, running }),
            Some(_) => Ok(n),
            None if n > hardware_threads() => Err(Error::Option(format!(
                "{n} worker threads asked for, but this process may run on {} hardware threads: more only slow \
                 the kernels down",
                hardware_threads()
            ))),
            None if !pool::init_global(n) => Err(Error::Threads { requested: n, running: pool::global().threads() }),
            None => Ok(n),
        },
        None => {
            pool::init_global(physical_cores());
            Ok(pool::global().threads())
        }
    }
}

/// Hardware threads this process may run on.
fn hardware_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Physical cores this process may use: hyper-threads share a core's memory
/// bandwidth and FMA units, so decoding gains nothing from them. Counted from
/// Linux's CPU topology, capped by the CPUs the process may run on (elsewhere:
/// the CPUs it may run on).
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut cores = std::collections::HashSet::new();
    if let Ok(entries) = std::fs::read_dir("/sys/devices/system/cpu") {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.strip_prefix("cpu").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) {
                continue;
            }
            let topo = e.path().join("topology");
            let read = |f: &str| std::fs::read_to_string(topo.join(f)).ok().map(|s| s.trim().to_string());
            if let (Some(pkg), Some(core)) = (read("physical_package_id"), read("core_id")) {
                cores.insert((pkg, core));
            }
        }
    }
    match cores.len() {
        0 => logical,
        n => n.min(logical),
    }
}
