//! The tokenizer a GGUF carries, as the files of a Hugging Face tokenizer directory.
//!
//! llama.cpp's converter stores the tokenizer in the metadata: `tokenizer.ggml.model` (the
//! model type), `.tokens` (the vocabulary, by id), `.merges`, `.scores`, `.token_type`, the
//! special ids and `add_bos_token` / `add_eos_token`, and the chat template in
//! `tokenizer.chat_template`. [`build`] turns them into a `tokenizers` [`Tokenizer`] (saved as
//! `tokenizer.json`) and a `tokenizer_config.json` (special tokens, `add_bos_token`, the chat
//! template), so that `engc compile X.gguf` without `--tokenizer` writes a bundle that looks as
//! if `--tokenizer` had pointed at the model's HF files. Two model types:
//!
//! - `gpt2`: byte-level BPE. The pre-tokenizer is the one `tokenizer.ggml.pre` names (llama.cpp's
//!   `llama-vocab.cpp` keeps one regex list per name), written as the HF `tokenizer.json` of
//!   such models writes it (`smollm`: individual digits, then GPT-2's regex; `llama-bpe`: Llama
//!   3's split regex and `ignore_merges`; `qwen2`: Qwen2's split regex and NFC).
//! - `llama`: SentencePiece-style BPE with byte fallback (Llama 2, Mistral, TinyLlama): merges
//!   derived from the scores as transformers' `SentencePieceExtractor` derives them, spaces as
//!   `▁`, a `▁` prefix on each piece of text when `tokenizer.ggml.add_space_prefix` (default
//!   true) says so (HF's "legacy" normalizer, which is what llama.cpp does too).
//!
//! Control and unknown tokens (`token_type` 3 and 2) become special added tokens, user-defined
//! ones (4) added tokens that are not special. Any other model type, or a `gpt2` model whose
//! `pre` is not in the table, is an error that names it.

use crate::gguf::{Gguf, MetaValue};
use crate::CompileError;
use std::collections::BTreeMap;
use std::path::Path;
use tokenizers::decoders::{
    byte_fallback::ByteFallback, fuse::Fuse, sequence::Sequence as DecoderSequence, strip::Strip,
};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::{SpecialToken, TemplateProcessing};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
    Tokenizer,
};

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TYPE_UNKNOWN: i64 = 2;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's split regex, as its HF tokenizer.json has it.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex (Llama 3's with single digits), as its HF tokenizer.json has it.
const QWEN2_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a byte-level BPE model splits text before the BPE.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Pre {
    /// GPT-2's regex (the `ByteLevel` pre-tokenizer's own).
    Gpt2,
    /// Each digit alone, then GPT-2's regex (StarCoder, SmolLM).
    DigitsGpt2,
    /// A split regex, then the byte-level mapping; `nfc` normalises first (Qwen2).
    Regex { regex: &'static str, nfc: bool },
}

/// The pre-tokenizer, `ignore_merges`, and whether a BOS is added by default, for a
/// `tokenizer.ggml.pre` value (names as in llama.cpp's `llama-vocab.cpp`).
fn pre_for(pre: &str) -> Option<(Pre, bool, bool)> {
    Some(match pre {
        "default" | "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "exaone4" | "mellum" => (Pre::Gpt2, false, false),
        "smollm" | "starcoder" | "refact" | "codeshell" | "command-r" | "exaone" | "minerva-7b" | "mellum2" => {
            (Pre::DigitsGpt2, false, false)
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => {
            (Pre::Regex { regex: LLAMA3_REGEX, nfc: false }, true, true)
        }
        "dbrx" | "smaug-bpe" => (Pre::Regex { regex: LLAMA3_REGEX, nfc: false }, false, false),
        "qwen2" | "deepseek-r1-qwen" | "megrez" => (Pre::Regex { regex: QWEN2_REGEX, nfc: true }, false, false),
        _ => return None,
    })
}

/// The `tokenizer.ggml.pre` values [`build`] knows.
const KNOWN_PRE: &str = "gpt-2, smollm, starcoder, llama-bpe, llama3, qwen2, deepseek-r1-qwen, and their aliases";

/// A GGUF's tokenizer: `tokenizer.json` and `tokenizer_config.json` of a HF tokenizer directory.
pub struct GgufTokenizer {
    /// The tokenizer (`tokenizer.json`).
    pub tokenizer: Tokenizer,
    /// `tokenizer_config.json`: special tokens, `add_bos_token`, `add_eos_token`, `chat_template`.
    pub config: serde_json::Value,
}

impl GgufTokenizer {
    /// Writes `tokenizer.json` and `tokenizer_config.json` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), CompileError> {
        let io = |p: &Path, e: &dyn std::fmt::Display| CompileError::Checkpoint {
            path: p.display().to_string(),
            message: format!("writing the tokenizer built from the GGUF: {e}"),
        };
        let tj = dir.join("tokenizer.json");
        let text = self.tokenizer.to_string(true).map_err(|e| io(&tj, &e))?;
        std::fs::write(&tj, text).map_err(|e| io(&tj, &e))?;
        let tc = dir.join("tokenizer_config.json");
        let text = serde_json::to_string_pretty(&self.config).map_err(|e| io(&tc, &e))?;
        std::fs::write(&tc, text).map_err(|e| io(&tc, &e))
    }
}

/// The tokenizer files of the GGUF checkpoint `checkpoint`, written into a new temporary
/// directory; `None` when `checkpoint` is not a file (a HF directory) or its metadata has no
/// `tokenizer.ggml.model`.
pub fn for_checkpoint(checkpoint: &Path) -> Result<Option<tempfile::TempDir>, CompileError> {
    if !checkpoint.is_file() {
        return Ok(None);
    }
    let Some(tok) = build(checkpoint)? else { return Ok(None) };
    let dir = tempfile::tempdir().map_err(|e| CompileError::Checkpoint {
        path: checkpoint.display().to_string(),
        message: format!("cannot create a temporary directory for its tokenizer: {e}"),
    })?;
    tok.write(dir.path())?;
    Ok(Some(dir))
}

/// The tokenizer of the GGUF file at `path`; `None` when its metadata has no
/// `tokenizer.ggml.model`.
pub fn build(path: &Path) -> Result<Option<GgufTokenizer>, CompileError> {
    let g = Gguf::open(path)?;
    from_metadata(&g.meta, path)
}

/// Typed reads of the metadata, with errors that name the file and the key.
struct Meta<'a> {
    meta: &'a BTreeMap<String, MetaValue>,
    path: &'a Path,
}

impl Meta<'_> {
    fn err(&self, message: impl Into<String>) -> CompileError {
        CompileError::Checkpoint { path: self.path.display().to_string(), message: message.into() }
    }

    fn str(&self, key: &str) -> Result<Option<&str>, CompileError> {
        match self.meta.get(key) {
            None => Ok(None),
            Some(MetaValue::Str(s)) => Ok(Some(s)),
            Some(other) => Err(self.err(format!("metadata `{key}` should be a string, found {other:?}"))),
        }
    }

    fn int(&self, key: &str) -> Result<Option<i64>, CompileError> {
        match self.meta.get(key) {
            None => Ok(None),
            Some(MetaValue::Int(i)) => Ok(Some(*i)),
            Some(other) => Err(self.err(format!("metadata `{key}` should be an integer, found {other:?}"))),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, CompileError> {
        match self.meta.get(key) {
            None => Ok(None),
            Some(MetaValue::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(self.err(format!("metadata `{key}` should be a bool, found {other:?}"))),
        }
    }

    fn array(&self, key: &str) -> Result<Option<&[MetaValue]>, CompileError> {
        match self.meta.get(key) {
            None => Ok(None),
            Some(MetaValue::Array(a)) => Ok(Some(a)),
            Some(_) => Err(self.err(format!("metadata `{key}` should be an array"))),
        }
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<&str>>, CompileError> {
        let Some(a) = self.array(key)? else { return Ok(None) };
        a.iter()
            .map(|v| match v {
                MetaValue::Str(s) => Ok(s.as_str()),
                _ => Err(self.err(format!("metadata `{key}` should be an array of strings"))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    fn numbers(&self, key: &str) -> Result<Option<Vec<f64>>, CompileError> {
        let Some(a) = self.array(key)? else { return Ok(None) };
        a.iter()
            .map(|v| match v {
                MetaValue::Int(i) => Ok(*i as f64),
                MetaValue::Float(f) => Ok(*f),
                _ => Err(self.err(format!("metadata `{key}` should be an array of numbers"))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// A special token id (`tokenizer.ggml.{name}_token_id`) that lies inside the vocabulary.
    fn special_id(&self, name: &str, n_tokens: usize) -> Result<Option<u32>, CompileError> {
        let key = format!("tokenizer.ggml.{name}_token_id");
        match self.int(&key)? {
            Some(id) if id >= 0 && (id as usize) < n_tokens => Ok(Some(id as u32)),
            // llama.cpp writes -1 (as u32: 4294967295) for "none".
            Some(id) if id == -1 || id == u32::MAX as i64 => Ok(None),
            Some(id) => Err(self.err(format!("`{key}` is {id}, outside the vocabulary of {n_tokens} tokens"))),
            None => Ok(None),
        }
    }
}

fn tok_err(path: &Path, what: &str, e: impl std::fmt::Display) -> CompileError {
    CompileError::Checkpoint {
        path: path.display().to_string(),
        message: format!("building the tokenizer from the GGUF metadata: {what}: {e}"),
    }
}

/// The tokenizer described by GGUF metadata `meta` (of the file `path`, for messages); `None`
/// when there is no `tokenizer.ggml.model`, or it says the file has no vocabulary (`no_vocab`
/// or `none`, as llama.cpp reads them).
pub fn from_metadata(meta: &BTreeMap<String, MetaValue>, path: &Path) -> Result<Option<GgufTokenizer>, CompileError> {
    let m = Meta { meta, path };
    let Some(model_type) = m.str("tokenizer.ggml.model")? else { return Ok(None) };
    if model_type == "no_vocab" || model_type == "none" {
        return Ok(None);
    }
    if model_type != "gpt2" && model_type != "llama" {
        return Err(m.err(format!(
            "the GGUF's tokenizer model type `{model_type}` (`tokenizer.ggml.model`) is not supported: \
             the tokenizer can be built for `gpt2` (byte-level BPE) and `llama` (SentencePiece-style BPE); \
             pass --tokenizer DIR with the model's Hugging Face tokenizer files"
        )));
    }
    let tokens =
        m.strings("tokenizer.ggml.tokens")?.ok_or_else(|| m.err("no `tokenizer.ggml.tokens` in the metadata"))?;
    let n = tokens.len();
    let types = match m.numbers("tokenizer.ggml.token_type")? {
        Some(t) if t.len() == n => t.into_iter().map(|x| x as i64).collect(),
        Some(t) => {
            return Err(m.err(format!("`tokenizer.ggml.token_type` has {} entries for {n} tokens", t.len())));
        }
        None => vec![1; n],
    };
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
    let bos = m.special_id("bos", n)?;
    let eos = m.special_id("eos", n)?;
    let unk = m.special_id("unknown", n)?;
    let pad = m.special_id("padding", n)?;

    let spm = model_type == "llama";
    let (mut tokenizer, default_add_bos) = if spm {
        let scores = m.numbers("tokenizer.ggml.scores")?.ok_or_else(|| {
            m.err("no `tokenizer.ggml.scores` in the metadata: a `llama` (SentencePiece) tokenizer needs them")
        })?;
        if scores.len() != n {
            return Err(m.err(format!("`tokenizer.ggml.scores` has {} entries for {n} tokens", scores.len())));
        }
        let merges = spm_merges(&tokens, &scores);
        let mut builder = BPE::builder().vocab_and_merges(vocab, merges).fuse_unk(true).byte_fallback(true);
        if let Some(u) = unk {
            builder = builder.unk_token(tokens[u as usize].to_string());
        }
        let bpe = builder.build().map_err(|e| tok_err(path, "the BPE model", e))?;
        let prefix = m.bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
        let mut t = Tokenizer::new(bpe);
        let replace = Replace::new(" ", "▁").map_err(|e| tok_err(path, "the normalizer", e))?;
        let mut norms: Vec<NormalizerWrapper> = Vec::new();
        if prefix {
            norms.push(Prepend::new("▁".into()).into());
        }
        norms.push(replace.into());
        t.with_normalizer(Some(NormalizerSequence::new(norms)));
        let mut decoders: Vec<DecoderWrapper> = vec![
            Replace::new("▁", " ").map_err(|e| tok_err(path, "the decoder", e))?.into(),
            ByteFallback::new().into(),
            Fuse::new().into(),
        ];
        if prefix {
            decoders.push(Strip::new(' ', 1, 0).into());
        }
        t.with_decoder(Some(DecoderSequence::new(decoders)));
        (t, true)
    } else {
        let pre_name = m.str("tokenizer.ggml.pre")?.unwrap_or("default");
        let (pre, ignore_merges, add_bos) = pre_for(pre_name).ok_or_else(|| {
            m.err(format!(
                "the GGUF's pre-tokenizer `{pre_name}` (`tokenizer.ggml.pre`) is not supported (supported: {KNOWN_PRE}); \
                 pass --tokenizer DIR with the model's Hugging Face tokenizer files"
            ))
        })?;
        let merges = m.strings("tokenizer.ggml.merges")?.ok_or_else(|| {
            m.err("no `tokenizer.ggml.merges` in the metadata: a `gpt2` (byte-level BPE) tokenizer needs them")
        })?;
        let merges = merges
            .iter()
            .map(|s| {
                s.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| m.err(format!("merge `{s}` in `tokenizer.ggml.merges` is not two tokens")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(ignore_merges)
            .build()
            .map_err(|e| tok_err(path, "the BPE model", e))?;
        let mut t = Tokenizer::new(bpe);
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            Pre::Gpt2 => ByteLevel::new(false, true, true).into(),
            Pre::DigitsGpt2 => {
                PreSequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]).into()
            }
            Pre::Regex { regex, nfc } => {
                if nfc {
                    t.with_normalizer(Some(NFC));
                }
                let split = Split::new(SplitPattern::Regex(regex.into()), SplitDelimiterBehavior::Isolated, false)
                    .map_err(|e| tok_err(path, "the pre-tokenizer regex", e))?;
                PreSequence::new(vec![split.into(), ByteLevel::new(false, true, false).into()]).into()
            }
        };
        t.with_pre_tokenizer(Some(pre_tokenizer));
        t.with_decoder(Some(ByteLevel::new(false, false, true)));
        t.with_post_processor(Some(PostProcessorWrapper::from(ByteLevel::new(false, false, true))));
        (t, add_bos)
    };

    let add_bos = m.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos) && bos.is_some();
    let add_eos = m.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false) && eos.is_some();
    if add_bos || add_eos {
        let special = |id: u32| {
            let text = tokens[id as usize];
            // The template names a special token by a key without spaces; HF uses its text.
            let key = if text.contains(char::is_whitespace) { format!("<special {id}>") } else { text.to_string() };
            (key.clone(), SpecialToken::new(key, vec![id], vec![text.to_string()]))
        };
        // HF's templates: "bos $A eos" and "bos $A eos bos:1 $B:1 eos:1", each part as asked.
        let b = bos.filter(|_| add_bos).map(special);
        let e = eos.filter(|_| add_eos).map(special);
        let mut single = Vec::new();
        let mut pair = Vec::new();
        for (seq, type_id) in [("$A", 0), ("$B:1", 1)] {
            let suffix = if type_id == 0 { String::new() } else { ":1".to_string() };
            if let Some((k, _)) = &b {
                pair.push(format!("{k}{suffix}"));
            }
            pair.push(seq.to_string());
            if let Some((k, _)) = &e {
                pair.push(format!("{k}{suffix}"));
            }
        }
        if let Some((k, _)) = &b {
            single.push(k.clone());
        }
        single.push("$A".to_string());
        if let Some((k, _)) = &e {
            single.push(k.clone());
        }
        let specials = b
            .into_iter()
            .chain(e)
            .map(|(_, s)| s)
            .collect::<Result<Vec<SpecialToken>, _>>()
            .map_err(|e| tok_err(path, "the post-processor", e))?;
        let post = TemplateProcessing::builder()
            .try_single(single.join(" "))
            .and_then(|b| b.try_pair(pair.join(" ")))
            .map_err(|e| tok_err(path, "the post-processor", e))?
            .special_tokens(specials)
            .build()
            .map_err(|e| tok_err(path, "the post-processor", e))?;
        tokenizer.with_post_processor(Some(post));
    }

    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &ty)| ty == TYPE_CONTROL || ty == TYPE_UNKNOWN || ty == TYPE_USER_DEFINED)
        .map(|(t, &ty)| AddedToken::from(t.to_string(), ty != TYPE_USER_DEFINED).normalized(false))
        .collect();
    let (special, plain): (Vec<AddedToken>, Vec<AddedToken>) = added.into_iter().partition(|t| t.special);
    tokenizer.add_special_tokens(&special);
    tokenizer.add_tokens(&plain);

    let text = |id: Option<u32>| id.map_or(serde_json::Value::Null, |i| tokens[i as usize].into());
    let mut config = serde_json::json!({
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": text(bos),
        "eos_token": text(eos),
        "unk_token": text(unk),
        "pad_token": text(pad),
        "clean_up_tokenization_spaces": false,
        "tokenizer_class": if spm { "LlamaTokenizerFast" } else { "PreTrainedTokenizerFast" },
    });
    if let Some(arch) = m.str("general.architecture")? {
        if let Some(ctx) = m.int(&format!("{arch}.context_length"))? {
            config["model_max_length"] = ctx.into();
        }
    }
    if let Some(t) = m.str("tokenizer.chat_template")? {
        config["chat_template"] = t.into();
    }
    Ok(Some(GgufTokenizer { tokenizer, config }))
}

/// The BPE merges of a SentencePiece vocabulary, as transformers' `generate_merges` derives
/// them: every split of a piece into two pieces of the vocabulary, ordered by the score of the
/// whole piece (highest first), then the longer left part, then the longer right part (a
/// stable sort over the vocabulary order, each piece's splits ordered by their parts' ids).
fn spm_merges(tokens: &[&str], scores: &[f64]) -> Vec<(String, String)> {
    let ids: std::collections::HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut merges: Vec<(&str, &str, f64)> = Vec::new();
    for (piece, &score) in tokens.iter().zip(scores) {
        let mut local: Vec<(&str, &str, f64)> = piece
            .char_indices()
            .skip(1)
            .map(|(at, _)| piece.split_at(at))
            .filter(|(l, r)| ids.contains_key(l) && ids.contains_key(r))
            .map(|(l, r)| (l, r, score))
            .collect();
        local.sort_by_key(|(l, r, _)| (ids[l], ids[r]));
        merges.extend(local);
    }
    let key = |(l, r, s): &(&str, &str, f64)| (*s, l.chars().count(), r.chars().count());
    merges.sort_by(|a, b| {
        let (ka, kb) = (key(a), key(b));
        kb.0.total_cmp(&ka.0).then(kb.1.cmp(&ka.1)).then(kb.2.cmp(&ka.2))
    });
    merges.into_iter().map(|(l, r, _)| (l.to_string(), r.to_string())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(entries: Vec<(&str, MetaValue)>) -> BTreeMap<String, MetaValue> {
        entries.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    fn strs(v: &[&str]) -> MetaValue {
        MetaValue::Array(v.iter().map(|s| MetaValue::Str(s.to_string())).collect())
    }

    /// A SentencePiece vocabulary: `<unk> <s> </s>`, the 256 byte pieces, then pieces with
    /// scores that make `▁Hi` and `▁there` reachable by merges.
    fn spm_meta(add_space_prefix: Option<bool>) -> BTreeMap<String, MetaValue> {
        let bytes: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        let words = ["▁", "H", "i", "t", "h", "e", "r", "▁H", "▁Hi", "▁t", "th", "▁th", "er", "ere", "▁there"];
        let mut tokens: Vec<&str> = vec!["<unk>", "<s>", "</s>"];
        tokens.extend(bytes.iter().map(String::as_str));
        tokens.extend(words);
        let mut types = vec![2, 3, 3];
        types.extend(std::iter::repeat_n(6, 256));
        types.extend(std::iter::repeat_n(1, words.len()));
        let mut scores = vec![0.0; 259];
        scores.extend((0..words.len()).map(|i| -(i as f64)));
        let mut m = meta(vec![
            ("tokenizer.ggml.model", MetaValue::Str("llama".into())),
            ("tokenizer.ggml.tokens", strs(&tokens)),
            ("tokenizer.ggml.token_type", MetaValue::Array(types.into_iter().map(MetaValue::Int).collect())),
            ("tokenizer.ggml.scores", MetaValue::Array(scores.into_iter().map(MetaValue::Float).collect())),
            ("tokenizer.ggml.bos_token_id", MetaValue::Int(1)),
            ("tokenizer.ggml.eos_token_id", MetaValue::Int(2)),
            ("tokenizer.ggml.unknown_token_id", MetaValue::Int(0)),
        ]);
        if let Some(p) = add_space_prefix {
            m.insert("tokenizer.ggml.add_space_prefix".into(), MetaValue::Bool(p));
        }
        m
    }

    fn pieces(t: &Tokenizer, text: &str, add_special: bool) -> Vec<String> {
        t.encode(text, add_special).unwrap().get_tokens().to_vec()
    }

    #[test]
    fn sentencepiece_bpe_with_byte_fallback() {
        let tok = from_metadata(&spm_meta(None), Path::new("x.gguf")).unwrap().unwrap();
        let t = &tok.tokenizer;
        assert_eq!(pieces(t, "Hi there", false), ["▁Hi", "▁there"]);
        assert_eq!(pieces(t, "Hi there", true), ["<s>", "▁Hi", "▁there"]);
        // é is not a piece: its UTF-8 bytes are.
        assert_eq!(pieces(t, "Hi é", false), ["▁Hi", "▁", "<0xC3>", "<0xA9>"]);
        // A space prefix after a special token too (llama.cpp and HF's legacy normalizer).
        assert_eq!(pieces(t, "</s>Hi", false), ["</s>", "▁Hi"]);
        let ids = t.encode("Hi é there", true).unwrap().get_ids().to_vec();
        assert_eq!(t.decode(&ids, true).unwrap(), "Hi é there");
        assert_eq!(tok.config["bos_token"], "<s>");
        assert_eq!(tok.config["add_bos_token"], true);
        let no_prefix = from_metadata(&spm_meta(Some(false)), Path::new("x.gguf")).unwrap().unwrap();
        assert_eq!(pieces(&no_prefix.tokenizer, "Hi there", false), ["H", "i", "▁there"]);
    }

    #[test]
    fn merges_follow_the_score_of_the_whole_piece() {
        let tokens = ["a", "b", "c", "ab", "bc", "abc"];
        let scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0];
        let got = spm_merges(&tokens, &scores);
        let want = [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")];
        assert_eq!(got, want.map(|(a, b)| (a.to_string(), b.to_string())));
    }

    #[test]
    fn unknown_model_and_pre_are_named() {
        let mut m = spm_meta(None);
        m.insert("tokenizer.ggml.model".into(), MetaValue::Str("bert".into()));
        let e = from_metadata(&m, Path::new("x.gguf")).err().unwrap().to_string();
        assert!(e.contains("x.gguf") && e.contains("`bert`") && e.contains("--tokenizer"), "{e}");
        m.insert("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into()));
        m.insert("tokenizer.ggml.pre".into(), MetaValue::Str("tekken".into()));
        let e = from_metadata(&m, Path::new("x.gguf")).err().unwrap().to_string();
        assert!(e.contains("pre-tokenizer `tekken`"), "{e}");
        m.insert("tokenizer.ggml.model".into(), MetaValue::Str("no_vocab".into()));
        assert!(from_metadata(&m, Path::new("x.gguf")).unwrap().is_none());
        m.remove("tokenizer.ggml.model");
        assert!(from_metadata(&m, Path::new("x.gguf")).unwrap().is_none());
    }
}
