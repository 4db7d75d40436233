//! Incremental detokenization: text is released only once it is complete UTF-8 and stable, so
//! the pieces concatenate to the full decode and never contain a broken character.

use crate::{TextError, Tokenizer};

/// Turns a growing list of token ids into text pieces.
///
/// It decodes a window that starts a few tokens back (so that merges across token boundaries
/// decode as they would in the full text) and releases the new suffix unless it ends in the
/// replacement character, which means a character is split across tokens.
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
    skip_special: bool,
}

impl IncrementalDecoder {
    /// A decoder; `skip_special` leaves special tokens out of the text.
    pub fn new(skip_special: bool) -> Self {
        IncrementalDecoder { skip_special, ..Default::default() }
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TextError> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let after = tok.decode(&self.ids[self.prefix..], self.skip_special)?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') && after.is_char_boundary(before.len()) {
            let piece = after[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }

    /// The text still held back (an incomplete character at the end of generation).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String, TextError> {
        let before = tok.decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let after = tok.decode(&self.ids[self.prefix..], self.skip_special)?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(after.get(before.len()..).unwrap_or_default().to_string())
    }
}
