//! Streaming detokenization that never splits a character.
//!
//! Byte-level BPE tokens are byte sequences: a Chinese character or an emoji
//! may span two or three tokens, and decoding a prefix of them yields U+FFFD.
//! [`TextStream`] holds text back until it is complete, and decodes a short
//! window of recent tokens (not the whole output) at each step.

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Turns token ids into text deltas, one id at a time.
#[derive(Clone, Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    /// Start of the decoding window: tokens before it are never re-decoded.
    prefix: usize,
    /// Tokens up to here have been emitted as text.
    read: usize,
}

impl TextStream {
    /// An empty stream.
    pub fn new() -> TextStream {
        TextStream::default()
    }

    /// Adds `id` and returns the text that became complete (maybe empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tokenizer.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tokenizer.decode(&self.ids[self.prefix..], true)?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.is_char_boundary(before.len()) {
            let delta = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Whatever is still held back (an incomplete character at the end of
    /// generation is emitted as U+FFFD, as transformers would decode it).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let before = tokenizer.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tokenizer.decode(&self.ids[self.prefix..], true)?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(if now.len() > before.len() && now.is_char_boundary(before.len()) {
            now[before.len()..].to_string()
        } else {
            String::new()
        })
    }
}
