//! Text in and out: the HuggingFace tokenizer (`tokenizer.json`) and the chat
//! template (`tokenizer_config.json` or `chat_template.jinja`), rendered with
//! minijinja the way transformers renders it with jinja2.

use crate::chat::{Message, Tool};
use crate::error::{Error, Result};
use minijinja::value::Value;
use std::path::Path;

/// The tokenizer and chat template of a model folder.
///
/// [`Model`](crate::Model) holds one ([`Model::tokenizer`](crate::Model::tokenizer)); loading one alone
/// ([`Tokenizer::from_dir`]) needs no weights.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    template: Option<ChatTemplate>,
}

impl Tokenizer {
    /// Loads `tokenizer.json`, and the chat template from `chat_template.jinja`
    /// or `tokenizer_config.json` when present. `dir` may also be a GGUF
    /// file, or a folder holding one `.gguf` file and no `config.json`: then
    /// both come from the file ([`Tokenizer::from_gguf`]).
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        if let crate::model::Source::Gguf(file) = crate::model::Source::resolve(dir)? {
            return Tokenizer::from_gguf(&crate::gguf::Gguf::open(&file)?);
        }
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(Error::Tokenizer { path, message: "file not found".into() });
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::Tokenizer { path: path.clone(), message: e.to_string() })?;
        let template = ChatTemplate::from_dir(dir)?;
        Ok(Tokenizer { inner, template })
    }

    /// The tokenizer and chat template a GGUF file carries: `tokenizer.ggml.*`
    /// built into the `tokenizer.json` transformers would have (byte-level
    /// BPE over the pre-tokenizer `tokenizer.ggml.pre` names; tokens of type
    /// 3, control, and 4, user-defined, as added tokens, special and not),
    /// and `tokenizer.chat_template`.
    pub fn from_gguf(g: &crate::gguf::Gguf) -> Result<Tokenizer> {
        let json = crate::gguf_tokenizer::tokenizer_json(g)?;
        let inner: tokenizers::Tokenizer = json
            .to_string()
            .parse()
            .map_err(|e: tokenizers::Error| Error::Tokenizer { path: g.path.clone(), message: e.to_string() })?;
        let template = match g.get("tokenizer.chat_template") {
            None => None,
            Some(v) => {
                let source = v.as_str().ok_or_else(|| g.err("`tokenizer.chat_template` is not a string"))?;
                Some(ChatTemplate::new(source.to_string(), crate::gguf_tokenizer::special_tokens(g))?)
            }
        };
        Ok(Tokenizer { inner, template })
    }

    /// Token ids of `text`. Special tokens written in the text (such as
    /// `<|im_start|>`) become their ids, as with transformers' tokenizers.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, true).map_err(|e| Error::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; special tokens are left out when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| Error::Encode(e.to_string()))
    }

    /// The id of a token written as text, such as `<|im_end|>`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Size of the tokenizer's vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Renders `messages` with the chat template, ending with the assistant's
    /// header when `add_generation_prompt`.
    pub fn apply_chat_template(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let t = self.template.as_ref().ok_or_else(|| Error::Template("this model has no chat template".into()))?;
        t.render(messages, add_generation_prompt)
    }

    /// [`Tokenizer::apply_chat_template`] with tool definitions, for
    /// templates that render them (no tools renders as without).
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[Message],
        tools: &[Tool],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let t = self.template.as_ref().ok_or_else(|| Error::Template("this model has no chat template".into()))?;
        t.render_with_tools(messages, tools, add_generation_prompt)
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("chat_template", &self.template.is_some())
            .finish_non_exhaustive()
    }
}

/// A Jinja chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    /// `bos_token`, `eos_token`, ... from `tokenizer_config.json`.
    special: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("special", &self.special).finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// `chat_template.jinja` wins over `tokenizer_config.json`'s
    /// `chat_template`, as in transformers. `Ok(None)` if neither exists.
    pub fn from_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => {
                serde_json::from_str(&text).map_err(|source| Error::Json { path: config_path.clone(), source })?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => return Err(Error::io(config_path, e)),
        };
        let jinja_path = dir.join("chat_template.jinja");
        let source = if jinja_path.is_file() {
            std::fs::read_to_string(&jinja_path).map_err(|e| Error::io(&jinja_path, e))?
        } else {
            match &config["chat_template"] {
                serde_json::Value::String(s) => s.clone(),
                // A list of named templates: use the one called "default".
                serde_json::Value::Array(list) => {
                    match list.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str()) {
                        Some(s) => s.to_string(),
                        None => return Ok(None),
                    }
                }
                _ => return Ok(None),
            }
        };
        let mut special = Vec::new();
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            // A special token is a string or an AddedToken object with "content".
            let v = &config[key];
            if let Some(s) = v.as_str().or_else(|| v["content"].as_str()) {
                special.push((key.to_string(), s.to_string()));
            }
        }
        ChatTemplate::new(source, special).map(Some)
    }

    /// Compiles `source`; `special` are extra variables (`eos_token`, ...).
    pub fn new(source: String, special: Vec<(String, String)>) -> Result<ChatTemplate> {
        let mut env = minijinja::Environment::new();
        // transformers renders with jinja2's trim_blocks and lstrip_blocks.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source).map_err(|e| Error::Template(describe(&e)))?;
        Ok(ChatTemplate { env, special })
    }

    /// Renders `messages`, ending with the assistant's header when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// Renders `messages` with tool definitions (the template's `tools`, as
    /// transformers passes them; none are passed when `tools` is empty).
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: &[Tool],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self.env.get_template("chat").map_err(|e| Error::Template(describe(&e)))?;
        let mut ctx: std::collections::BTreeMap<String, Value> =
            self.special.iter().map(|(k, v)| (k.clone(), Value::from(v.as_str()))).collect();
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        if !tools.is_empty() {
            ctx.insert("tools".into(), Value::from_serialize(tools));
        }
        // minijinja panics on a few inputs (`""[::-1]` indexes an empty
        // string, 2.24): the template comes from a model file and the
        // messages from a user, so a panic is caught and said as an error.
        // Rendering mutates nothing the environment keeps.
        let rendered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tmpl.render(ctx)));
        match rendered {
            Ok(r) => r.map_err(|e| Error::Template(describe(&e))),
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Err(Error::Template(format!("the template engine panicked rendering this conversation: {what}")))
            }
        }
    }
}

fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(&format!(": {inner}"));
        src = inner.source();
    }
    s
}

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False)`, whose
/// separators are `", "` and `": "` (minijinja's own filter writes compact,
/// HTML-escaped JSON, which would change the prompt).
fn tojson(value: Value, indent: Option<usize>) -> std::result::Result<Value, minijinja::Error> {
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    write_py_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_py_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_py_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::to_string(k).expect("strings serialize"));
                out.push_str(": ");
                write_py_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&serde_json::to_string(other).expect("JSON values serialize")),
    }
}

/// `strftime_now(format)`: today's date for templates that print it. Only the
/// common directives are supported; others are kept as written.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_matches_python_json_dumps() {
        let v = Value::from_serialize(serde_json::json!({"name": "f", "args": [1, "<a&b>", {"x": null}], "e": {}}));
        let s = tojson(v, None).unwrap().to_string();
        assert_eq!(s, r#"{"name": "f", "args": [1, "<a&b>", {"x": null}], "e": {}}"#);
        let v = Value::from_serialize(serde_json::json!({"a": [1, 2]}));
        assert_eq!(tojson(v, Some(2)).unwrap().to_string(), "{\n  \"a\": [\n    1,\n    2\n  ]\n}");
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_454), (2026, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }

    #[test]
    fn template_trims_blocks_like_transformers() {
        let src = "{% for m in messages %}\n  {{ m.role }}: {{ m.content }}\n{% endfor %}\n{% if add_generation_prompt %}A:{% endif %}\n";
        let t = ChatTemplate::new(src.into(), vec![]).unwrap();
        let out = t.render(&[Message::user("hi"), Message::assistant("yo")], true).unwrap();
        // As jinja2 renders it: lstrip_blocks strips before `{%` only.
        assert_eq!(out, "  user: hi\n  assistant: yo\nA:");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}".into(), vec![]).unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
    }
}
