//! The model's hyper-parameters, read from `config.json` and
//! `generation_config.json`. Field names mirror HuggingFace's exactly; nothing
//! here is hard-coded for a particular checkpoint.

use crate::error::{Error, Result};
use serde::Deserialize;
use std::path::Path;

/// Bounds on `config.json`'s sizes, far above any released model (the largest
/// have about 130 layers, widths of 50k, 128 heads of 256, vocabularies of
/// 260k and contexts of 10M) and far below what would overflow or exhaust
/// memory: a value past one is a corrupt or hostile file, refused before
/// anything is allocated for it.
pub(crate) mod limits {
    /// `num_hidden_layers`.
    pub const LAYERS: usize = 1 << 12;
    /// `hidden_size` and `intermediate_size`.
    pub const WIDTH: usize = 1 << 20;
    /// `num_attention_heads` and `num_key_value_heads`.
    pub const HEADS: usize = 1 << 12;
    /// `head_dim`.
    pub const HEAD_DIM: usize = 1 << 12;
    /// `vocab_size`.
    pub const VOCAB: usize = 1 << 24;
    /// `max_position_embeddings`.
    pub const POSITIONS: usize = 1 << 24;
    /// Elements of any one weight matrix the config implies (2^40: 2 TB in BF16).
    pub const MATRIX_ELEMENTS: usize = 1 << 40;
}

/// One token id or a list of them, as HF config files allow for `eos_token_id`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum TokenIds {
    /// A single id.
    One(u32),
    /// A list of ids.
    Many(Vec<u32>),
}

impl TokenIds {
    /// The ids as a list.
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

/// `rope_parameters` (transformers 5) or `rope_scaling` (4.x).
#[derive(Clone, Debug, Deserialize)]
struct RopeParameters {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    rope_theta: Option<f64>,
}

/// The fields of `config.json` as written, before validation.
#[derive(Clone, Debug, Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_parameters: Option<RopeParameters>,
    rope_scaling: Option<RopeParameters>,
    max_position_embeddings: usize,
    vocab_size: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    hidden_act: Option<String>,
    eos_token_id: Option<TokenIds>,
    bos_token_id: Option<TokenIds>,
    #[serde(default)]
    use_sliding_window: bool,
}

/// A validated Qwen2 configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's gate and up projections.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); `num_attention_heads` unless given.
    pub num_key_value_heads: usize,
    /// Per-head width; `hidden_size / num_attention_heads` unless given.
    pub head_dim: usize,
    /// The RMSNorms' epsilon.
    pub rms_norm_eps: f32,
    /// RoPE's base (`rope_theta`, or `rope_parameters.rope_theta`; 10000 unless given).
    pub rope_theta: f32,
    /// The longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// Rows of the embedding and the LM head.
    pub vocab_size: usize,
    /// Whether the LM head is the embedding matrix.
    pub tie_word_embeddings: bool,
    /// End-of-sequence ids from `config.json` (see [`GenerationConfig`] for
    /// the list generation actually stops on).
    pub eos_token_ids: Vec<u32>,
    /// The beginning-of-sequence id, if any (Qwen2 prompts do not start with it).
    pub bos_token_id: Option<u32>,
}

impl Config {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Config::from_json(&text, path)
    }

    /// Parses and validates the text of a `config.json`; `path` is for messages.
    pub fn from_json(text: &str, path: &Path) -> Result<Config> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|source| Error::Json { path: path.into(), source })?;
        let err = |field: &'static str, message: String| Error::Config { path: path.into(), field, message };

        let arch = raw.architectures.as_ref().and_then(|a| a.first().cloned());
        let known_arch = arch.as_deref().is_none_or(|a| a == "Qwen2ForCausalLM");
        let known_type = raw.model_type.as_deref().is_none_or(|t| t == "qwen2");
        if !known_arch || !known_type || (arch.is_none() && raw.model_type.is_none()) {
            let found = match (&arch, &raw.model_type) {
                (Some(a), Some(t)) => format!("{a} (model_type \"{t}\")"),
                (Some(a), None) => a.clone(),
                (None, Some(t)) => format!("model_type \"{t}\""),
                (None, None) => "(neither `architectures` nor `model_type` is set)".into(),
            };
            return Err(Error::UnknownArchitecture { path: path.into(), found });
        }

        let heads = raw.num_attention_heads;
        let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
        // Every count at least 1 and within its bound, before anything is
        // computed from it.
        for (field, v, max) in [
            ("hidden_size", raw.hidden_size, limits::WIDTH),
            ("intermediate_size", raw.intermediate_size, limits::WIDTH),
            ("num_hidden_layers", raw.num_hidden_layers, limits::LAYERS),
            ("num_attention_heads", heads, limits::HEADS),
            ("num_key_value_heads", kv_heads, limits::HEADS),
            ("max_position_embeddings", raw.max_position_embeddings, limits::POSITIONS),
            ("vocab_size", raw.vocab_size, limits::VOCAB),
        ] {
            if v == 0 {
                return Err(err(field, "must be positive".into()));
            }
            if v > max {
                return Err(err(field, format!("{v} is larger than ember accepts ({max}): a corrupt file?")));
            }
        }
        if !heads.is_multiple_of(kv_heads) {
            return Err(err("num_key_value_heads", format!("{kv_heads} does not divide num_attention_heads {heads}")));
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if raw.hidden_size.is_multiple_of(heads) => raw.hidden_size / heads,
            None => {
                return Err(err(
                    "num_attention_heads",
                    format!("{heads} does not divide hidden_size {}", raw.hidden_size),
                ))
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(err("head_dim", format!("{head_dim} must be positive and even for RoPE")));
        }
        if head_dim > limits::HEAD_DIM {
            return Err(err(
                "head_dim",
                format!("{head_dim} is larger than ember accepts ({}): a corrupt file?", limits::HEAD_DIM),
            ));
        }
        // Each matrix's element count, computed with checked arithmetic (the
        // bounds above keep them far from overflow; this says so in code).
        let (h, ff, vocab) = (raw.hidden_size, raw.intermediate_size, raw.vocab_size);
        for (field, factors) in [
            ("num_attention_heads", [heads, head_dim, h]),
            ("num_key_value_heads", [kv_heads, head_dim, h]),
            ("intermediate_size", [ff, h, 1]),
            ("vocab_size", [vocab, h, 1]),
        ] {
            let n = factors.iter().try_fold(1usize, |n, &f| n.checked_mul(f));
            if n.is_none_or(|n| n > limits::MATRIX_ELEMENTS) {
                return Err(err(
                    field,
                    format!(
                        "a {} matrix of the model would have more than {} elements: a corrupt file?",
                        factors.iter().filter(|&&f| f != 1).map(|f| f.to_string()).collect::<Vec<_>>().join(" × "),
                        limits::MATRIX_ELEMENTS
                    ),
                ));
            }
        }
        // Used as f32: a value that is positive and finite only as f64 is refused.
        let eps = raw.rms_norm_eps as f32;
        if !(eps > 0.0 && eps.is_finite()) {
            return Err(err("rms_norm_eps", format!("{} must be a positive number (as f32)", raw.rms_norm_eps)));
        }
        // RoPE: plain rotate-half RoPE only; scaled variants would silently
        // give wrong answers at long contexts.
        let mut rope_theta = raw.rope_theta;
        for (field, p) in [("rope_parameters", &raw.rope_parameters), ("rope_scaling", &raw.rope_scaling)] {
            if let Some(p) = p {
                let kind = p.rope_type.as_deref().or(p.kind.as_deref()).unwrap_or("default");
                if kind != "default" {
                    return Err(err(field, format!("RoPE type \"{kind}\" is not supported (only \"default\")")));
                }
                rope_theta = rope_theta.or(p.rope_theta);
            }
        }
        let rope_theta = rope_theta.unwrap_or(10_000.0);
        if !(rope_theta as f32 > 0.0 && (rope_theta as f32).is_finite()) {
            return Err(err("rope_theta", format!("{rope_theta} must be a positive number (as f32)")));
        }
        if let Some(act) = raw.hidden_act.as_deref() {
            if act != "silu" {
                return Err(err("hidden_act", format!("\"{act}\" is not supported (Qwen2 uses \"silu\")")));
            }
        }
        if raw.use_sliding_window {
            return Err(err("use_sliding_window", "sliding-window attention is not supported".into()));
        }
        let eos_token_ids = raw.eos_token_id.map(|t| t.to_vec()).unwrap_or_default();
        if let Some(&id) = eos_token_ids.iter().find(|&&id| id as usize >= raw.vocab_size) {
            return Err(err("eos_token_id", format!("{id} is outside the vocabulary of {}", raw.vocab_size)));
        }
        Ok(Config {
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: eps,
            rope_theta: rope_theta as f32,
            max_position_embeddings: raw.max_position_embeddings,
            vocab_size: raw.vocab_size,
            tie_word_embeddings: raw.tie_word_embeddings,
            eos_token_ids,
            bos_token_id: raw.bos_token_id.and_then(|t| t.to_vec().first().copied()),
        })
    }

    /// Width of all query heads together: `num_attention_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Width of all key (or value) heads together: `num_key_value_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Query heads per key/value head (grouped-query attention).
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}

/// Generation defaults from `generation_config.json` (all optional), as
/// HuggingFace names them; [`GenerationConfig::sampler_config`] turns them
/// into sampler settings.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct GenerationConfig {
    /// The ids generation stops on (wins over `config.json`'s).
    pub eos_token_id: Option<TokenIds>,
    /// The beginning-of-sequence id.
    pub bos_token_id: Option<TokenIds>,
    /// Whether the model's authors sample by default (else greedy).
    pub do_sample: Option<bool>,
    /// Default temperature.
    pub temperature: Option<f32>,
    /// Default top-p.
    pub top_p: Option<f32>,
    /// Default top-k.
    pub top_k: Option<usize>,
    /// Default min-p.
    pub min_p: Option<f32>,
    /// Default repetition penalty.
    pub repetition_penalty: Option<f32>,
}

impl GenerationConfig {
    /// Reads `generation_config.json`; a missing file is an empty config.
    pub fn from_file(path: &Path) -> Result<GenerationConfig> {
        match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str(&text).map_err(|source| Error::Json { path: path.into(), source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(GenerationConfig::default()),
            Err(e) => Err(Error::io(path, e)),
        }
    }
}

/// The ids generation stops on: `generation_config.json`'s `eos_token_id`
/// list when present, else `config.json`'s.
pub(crate) fn eos_ids(config: &Config, generation: &GenerationConfig) -> Vec<u32> {
    match &generation.eos_token_id {
        Some(ids) => ids.to_vec(),
        None => config.eos_token_ids.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN: &str = r#"{
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "max_position_embeddings": 32768, "vocab_size": 151936,
        "tie_word_embeddings": true, "hidden_act": "silu", "eos_token_id": 151645,
        "bos_token_id": 151643, "use_sliding_window": false, "sliding_window": 32768
    }"#;

    fn parse(text: &str) -> Result<Config> {
        Config::from_json(text, Path::new("config.json"))
    }

    #[test]
    fn reads_qwen_and_derives_gqa_shapes() {
        let c = parse(QWEN).unwrap();
        assert_eq!((c.head_dim, c.q_dim(), c.kv_dim(), c.group_size()), (64, 896, 128, 7));
        assert_eq!(c.rms_norm_eps, 1e-6);
        assert_eq!(c.rope_theta, 1e6);
        assert!(c.tie_word_embeddings);
        assert_eq!(c.eos_token_ids, vec![151645]);
    }

    #[test]
    fn generation_config_eos_list_wins() {
        let c = parse(QWEN).unwrap();
        let g: GenerationConfig = serde_json::from_str(r#"{"eos_token_id": [151645, 151643]}"#).unwrap();
        assert_eq!(eos_ids(&c, &g), vec![151645, 151643]);
        assert_eq!(eos_ids(&c, &GenerationConfig::default()), vec![151645]);
    }

    #[test]
    fn errors_name_the_field() {
        let bad = QWEN.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3");
        let e = parse(&bad).unwrap_err().to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
        let bad = QWEN.replace("\"hidden_size\": 896,", "");
        let e = parse(&bad).unwrap_err().to_string();
        assert!(e.contains("hidden_size") && e.contains("config.json"), "{e}");
        let bad = QWEN.replace("Qwen2ForCausalLM", "LlamaForCausalLM");
        assert!(matches!(parse(&bad), Err(Error::UnknownArchitecture { .. })));
        let bad =
            QWEN.replace("\"rope_theta\": 1000000.0,", "\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0},");
        let e = parse(&bad).unwrap_err().to_string();
        assert!(e.contains("rope_scaling") && e.contains("yarn"), "{e}");
        assert!(matches!(parse("{not json"), Err(Error::Json { .. })));
    }

    #[test]
    fn rope_theta_from_transformers5_rope_parameters() {
        let t = QWEN.replace(
            "\"rope_theta\": 1000000.0,",
            "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 500000.0},",
        );
        assert_eq!(parse(&t).unwrap().rope_theta, 5e5);
    }
}
