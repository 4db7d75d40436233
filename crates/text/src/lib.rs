//! `text`: everything between strings and token ids. The tokenizer (HF `tokenizers`, no
//! default features, `fancy-regex`), an incremental detokenizer that never emits a broken UTF-8
//! character, and chat templates rendered exactly as HF's `apply_chat_template` does. The CLI
//! and (later) the server's tokenizer threads use it; it touches no device.
#![deny(missing_docs)]

pub mod chat;
pub mod detok;

pub use chat::{python_json, ChatTemplate};
pub use detok::IncrementalDecoder;

use serde_json::Value as Json;
use std::path::Path;

/// Errors of tokenization and templating.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A tokenizer file is missing or malformed.
    #[error("{path}: {message}")]
    Load {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// Encoding or decoding failed.
    #[error("tokenizer: {0}")]
    Tokenize(String),
    /// The chat template failed to compile or render, or there is none.
    #[error("{0}")]
    Template(String),
}

/// A tokenizer with its chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat: Option<ChatTemplate>,
    chat_source: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("chat", &self.chat.is_some()).finish()
    }
}

fn load_err(path: &Path, e: impl std::fmt::Display) -> TextError {
    TextError::Load { path: path.display().to_string(), message: e.to_string() }
}

/// The chat template source: `chat_template.jinja` if present, else tokenizer_config.json's
/// `chat_template` (a string, or a list of named templates of which `default` is used).
fn template_source(dir: &Path, config: &Json) -> Result<Option<String>, TextError> {
    let file = dir.join("chat_template.jinja");
    if file.is_file() {
        return std::fs::read_to_string(&file).map(Some).map_err(|e| load_err(&file, e));
    }
    Ok(match config.get("chat_template") {
        Some(Json::String(s)) => Some(s.clone()),
        Some(Json::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(Json::as_str)
            .map(String::from),
        _ => None,
    })
}

impl Tokenizer {
    /// Loads `tokenizer.json`, `tokenizer_config.json` and the chat template from `dir`.
    pub fn load(dir: &Path) -> Result<Tokenizer, TextError> {
        let tpath = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&tpath).map_err(|e| load_err(&tpath, e))?;
        let cpath = dir.join("tokenizer_config.json");
        let config: Json = if cpath.is_file() {
            let text = std::fs::read_to_string(&cpath).map_err(|e| load_err(&cpath, e))?;
            serde_json::from_str(&text).map_err(|e| load_err(&cpath, e))?
        } else {
            Json::Null
        };
        let chat_source = template_source(dir, &config)?;
        let chat = match &chat_source {
            Some(src) => Some(ChatTemplate::new(src, &config)?),
            None => None,
        };
        Ok(Tokenizer { inner, chat, chat_source })
    }

    /// Token ids of `text`; `add_special` adds what the tokenizer's post-processor adds (BOS).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TextError> {
        let enc = self.inner.encode(text, add_special).map_err(|e| TextError::Tokenize(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, optionally without special tokens.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TextError> {
        self.inner.decode(ids, skip_special).map_err(|e| TextError::Tokenize(e.to_string()))
    }

    /// Number of tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of the token spelled `token` (an added token or one of the model's vocabulary),
    /// if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The chat template's Jinja source, if there is one.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat_source.as_deref()
    }

    /// Renders the chat template for `messages` (JSON `[{role, content}, ...]`).
    pub fn apply_chat_template(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
        extra: Option<&Json>,
    ) -> Result<String, TextError> {
        let chat =
            self.chat.as_ref().ok_or_else(|| TextError::Template("this tokenizer has no chat template".into()))?;
        chat.render(messages, add_generation_prompt, extra)
    }

    /// Renders the chat template and tokenizes it as HF does (no special tokens added: the
    /// template writes them).
    pub fn encode_chat(&self, messages: &Json, add_generation_prompt: bool) -> Result<Vec<u32>, TextError> {
        self.encode_chat_with(messages, add_generation_prompt, None)
    }

    /// [`Tokenizer::encode_chat`] with `extra` template variables (such as `tools`).
    pub fn encode_chat_with(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
        extra: Option<&Json>,
    ) -> Result<Vec<u32>, TextError> {
        let text = self.apply_chat_template(messages, add_generation_prompt, extra)?;
        self.encode(&text, false)
    }
}
