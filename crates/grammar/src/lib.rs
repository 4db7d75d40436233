//! `grammar`: what a request's output must follow, compiled with llguidance against the served
//! tokenizer into a [`runtime::Constraint`]: a JSON schema (OpenAI's `response_format`,
//! SGLang's `json_schema`), any JSON object (`json_object`), a regular expression (SGLang's
//! `regex`) or a Lark grammar. The token trie is built once per tokenizer ([`Grammars::load`]);
//! each request (each choice) gets its own parser state.
#![deny(missing_docs)]

pub mod ebnf;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use runtime::{Constraint, TokenConstraint};
use serde_json::Value;
use std::sync::Arc;
use toktrie_hf_tokenizers::ByteTokenizer;

/// What an output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Spec {
    /// JSON that validates against this schema.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// Text that the regular expression matches whole.
    Regex(String),
    /// Text of a Lark grammar (llguidance's dialect).
    Lark(String),
}

/// Grammars compiled against one tokenizer.
pub struct Grammars {
    factory: Arc<ParserFactory>,
    /// The end-of-sequence token set, as a mask: all an ended or failed parser allows.
    eos: Vec<u32>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammars")
    }
}

impl Grammars {
    /// The token trie of the tokenizer in `tokenizer_json` (a `tokenizer.json`), with `eos`
    /// the tokens that end a sequence and `vocab` the model's vocabulary size (at least the
    /// tokenizer's; the ids past the tokenizer's are never allowed).
    pub fn load(tokenizer_json: &[u8], eos: &[u32], vocab: usize) -> Result<Grammars, String> {
        let json = byte_level_decoder(tokenizer_json)?;
        let mut bt = ByteTokenizer::from_json_bytes(&json).map_err(|e| format!("the tokenizer: {e}"))?;
        // End tokens past the tokenizer's ids (a model whose vocabulary outgrows its
        // tokenizer) are not the trie's; they join the end-of-sequence mask below.
        let size = bt.tokrx_info().vocab_size;
        let (known, past): (Vec<u32>, Vec<u32>) = eos.iter().partition(|&&t| t < size);
        if !known.is_empty() {
            bt.set_eos_tokens(&known);
        }
        let env = bt.into_tok_env(Some(vocab)).map_err(|e| format!("the token trie: {e}"))?;
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| format!("the grammar engine: {e}"))?;
        factory.quiet();
        let mut eos = env.tok_trie().eos_token_set().as_slice().to_vec();
        for t in past.into_iter().filter(|&t| (t as usize) < vocab) {
            if let Some(w) = eos.get_mut(t as usize / 32) {
                *w |= 1 << (t % 32);
            }
        }
        Ok(Grammars { factory: Arc::new(factory), eos })
    }

    /// A fresh constraint for one output of `spec`; a schema, expression or grammar that does
    /// not compile is an error saying why.
    pub fn compile(&self, spec: &Spec) -> Result<Constraint, String> {
        let grammar = match spec {
            Spec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(json_layout(schema.clone())),
            Spec::JsonObject => TopLevelGrammar::from_json_schema(json_layout(serde_json::json!({"type": "object"}))),
            Spec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Spec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint::new(Llg { matcher, eos: self.eos.clone() }))
    }
}

/// `tokenizer.json` with a decoder sequence that contains `ByteLevel` reduced to that
/// `ByteLevel` (the bytes of a byte-level vocabulary's tokens are what it says they are).
/// SmolLM2's decoder is `[ByteFallback, Fuse, Replace("▁", " "), ByteLevel]`: toktrie reads the
/// byte fallback and the `▁` as a SentencePiece vocabulary's and gets every token that starts
/// with a space (`Ġ`) wrong, so no token could follow `": "` (llguidance's `NoExtensionBias`), and the bytes it forced
/// were tokenized into tokens the parser then refused (`tests/walk.rs`).
fn byte_level_decoder(tokenizer_json: &[u8]) -> Result<Vec<u8>, String> {
    let mut t: Value = serde_json::from_slice(tokenizer_json).map_err(|e| format!("the tokenizer: {e}"))?;
    let decoders = t.pointer("/decoder/decoders").and_then(Value::as_array);
    let byte_level = decoders.and_then(|d| d.iter().find(|d| d["type"] == "ByteLevel")).cloned();
    match byte_level {
        Some(bl) => {
            t["decoder"] = bl;
            serde_json::to_vec(&t).map_err(|e| e.to_string())
        }
        None => Ok(tokenizer_json.to_vec()),
    }
}

/// The JSON layout outputs take unless the schema says otherwise (llguidance's `x-guidance`
/// options): `", "` between items and `": "` after keys, as Python's `json.dumps` writes them,
/// and no other whitespace. llguidance's default allows any whitespace between tokens, which a
/// model may emit without end; this keeps every output of a bounded schema bounded.
pub fn json_layout(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert_with(
            || serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// One output's parser state.
struct Llg {
    matcher: Matcher,
    /// The end-of-sequence tokens: all an ended or failed parser allows.
    eos: Vec<u32>,
}

impl TokenConstraint for Llg {
    fn allowed(&mut self) -> Vec<u32> {
        match self.matcher.compute_mask_or_eos() {
            Ok(mask) => {
                let mut m = mask.as_slice().to_vec();
                // Where the parser may end, every end token may come (those past the
                // tokenizer's ids too).
                if m.iter().zip(&self.eos).any(|(a, e)| a & e != 0) {
                    m.iter_mut().zip(&self.eos).for_each(|(a, e)| *a |= e);
                }
                m
            }
            Err(_) => self.eos.clone(),
        }
    }

    fn accept(&mut self, token: u32) {
        // A rejected token leaves the matcher in its error state: from then on only the
        // end-of-sequence tokens are allowed.
        let _ = self.matcher.consume_token(token);
    }
}
