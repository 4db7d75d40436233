//! Fill-in-the-middle: `/v1/completions`' `suffix`. OpenAI's `suffix` asks for the text that
//! goes between `prompt` and `suffix`; code models trained for it read the prompt in PSM order,
//! `PREFIX prompt SUFFIX suffix MIDDLE`, and generate the middle (as vLLM and llama.cpp build
//! it). The model's three tokens are found once, at startup, in its tokenizer's vocabulary
//! ([`Fim::detect`]); a model without them answers a non-empty `suffix` with a 400 naming it
//! ([`no_fim`]).

use crate::api::Prompt;
use crate::error::ApiError;

/// The spellings of the prefix, suffix and middle tokens, one style per row, tried in order.
/// CodeLlama's `▁<PRE>` / `▁<SUF>` / `▁<MID>` are not here: they are written with a space that
/// its tokenizer adds and strips around them, which string concatenation does not reproduce.
pub const STYLES: [[&str; 3]; 3] = [
    // StarCoder, SantaCoder, StarCoder2, Refact, ...
    ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"],
    // Qwen2.5-Coder (and every Qwen2.5 / Qwen3 vocabulary).
    ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"],
    // DeepSeek-Coder: begin (prefix), hole (suffix), end (middle).
    ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"],
];

/// One of the model's fill-in-the-middle tokens: its spelling and id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FimToken {
    /// The token as written in text (the tokenizer recognises it there).
    pub text: &'static str,
    /// Its id.
    pub id: u32,
}

/// The model's fill-in-the-middle tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fim {
    /// Before the prompt.
    pub prefix: FimToken,
    /// Before the suffix.
    pub suffix: FimToken,
    /// After the suffix: the model continues with the middle.
    pub middle: FimToken,
}

impl Fim {
    /// The first style of [`STYLES`] whose three tokens `token_to_id` knows (the tokenizer's
    /// vocabulary: `text::Tokenizer::token_to_id`); `None` when no style is complete.
    pub fn detect(token_to_id: impl Fn(&str) -> Option<u32>) -> Option<Fim> {
        STYLES.iter().find_map(|&[p, s, m]| {
            let token = |text: &'static str| token_to_id(text).map(|id| FimToken { text, id });
            Some(Fim { prefix: token(p)?, suffix: token(s)?, middle: token(m)? })
        })
    }

    /// `prompt` with `suffix` in PSM order. A text prompt becomes the text
    /// `PREFIX prompt SUFFIX suffix MIDDLE`, tokenized later as any text prompt (the special
    /// tokens recognised, the tokenizer's BOS added where it adds one); a token-id prompt
    /// becomes the ids `PREFIX ids SUFFIX suffix_ids MIDDLE` (`suffix_ids`: the suffix's
    /// tokens, no special tokens added). A list of prompts: each one so.
    pub fn prompt(&self, prompt: Prompt, suffix: &str, suffix_ids: &[u32]) -> Prompt {
        let text = |t: String| format!("{}{t}{}{suffix}{}", self.prefix.text, self.suffix.text, self.middle.text);
        let ids = |p: Vec<u32>| {
            let mut out = Vec::with_capacity(p.len() + suffix_ids.len() + 3);
            out.push(self.prefix.id);
            out.extend(p);
            out.push(self.suffix.id);
            out.extend_from_slice(suffix_ids);
            out.push(self.middle.id);
            out
        };
        match prompt {
            Prompt::Text(t) => Prompt::Text(text(t)),
            Prompt::Texts(ts) => Prompt::Texts(ts.into_iter().map(text).collect()),
            Prompt::Ids(p) => Prompt::Ids(ids(p)),
            Prompt::IdLists(ps) => Prompt::IdLists(ps.into_iter().map(ids).collect()),
        }
    }
}

/// The 400 of a non-empty `suffix` for a model without fill-in-the-middle tokens.
pub fn no_fim() -> ApiError {
    let styles: Vec<String> = STYLES.iter().map(|s| s.join(" ")).collect();
    ApiError::bad(
        format!(
            "`suffix` needs fill-in-the-middle, and this model's tokenizer has no fill-in-the-middle tokens ({})",
            styles.join("; ")
        ),
        Some("suffix"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of `tokens`, ids from 100 on.
    fn vocab(tokens: &[&str]) -> impl Fn(&str) -> Option<u32> {
        let v: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
        move |t| v.iter().position(|x| x == t).map(|i| 100 + i as u32)
    }

    #[test]
    fn detects_each_style_and_needs_all_three_tokens() {
        for style in STYLES {
            let f = Fim::detect(vocab(&["<|endoftext|>", style[2], style[0], style[1]])).expect("detected");
            assert_eq!((f.prefix.text, f.suffix.text, f.middle.text), (style[0], style[1], style[2]));
            assert_eq!((f.prefix.id, f.suffix.id, f.middle.id), (102, 103, 101));
            // Any one missing: none.
            for i in 0..3 {
                let partial: Vec<&str> = (0..3).filter(|&j| j != i).map(|j| style[j]).collect();
                assert_eq!(Fim::detect(vocab(&partial)), None, "{style:?} without {}", style[i]);
            }
        }
        // SmolLM2's added tokens: no fill-in-the-middle.
        assert_eq!(Fim::detect(vocab(&["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>"])), None);
        // Styles are not mixed.
        assert_eq!(Fim::detect(vocab(&["<fim_prefix>", "<|fim_suffix|>", "<fim_middle>"])), None);
    }

    #[test]
    fn builds_the_psm_prompt_from_text_and_from_ids() {
        let f = Fim::detect(vocab(&["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])).unwrap();
        let text = |p| match f.prompt(p, " return c", &[7, 8]) {
            Prompt::Text(t) => vec![t],
            Prompt::Texts(t) => t,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            text(Prompt::Text("def add(a, b):".into())),
            ["<|fim_prefix|>def add(a, b):<|fim_suffix|> return c<|fim_middle|>"]
        );
        assert_eq!(
            text(Prompt::Texts(vec!["a".into(), "b".into()])),
            [
                "<|fim_prefix|>a<|fim_suffix|> return c<|fim_middle|>",
                "<|fim_prefix|>b<|fim_suffix|> return c<|fim_middle|>"
            ]
        );
        match f.prompt(Prompt::Ids(vec![1, 2, 3]), "ignored: the ids are given", &[7, 8]) {
            Prompt::Ids(ids) => assert_eq!(ids, [100, 1, 2, 3, 101, 7, 8, 102]),
            other => panic!("{other:?}"),
        }
        match f.prompt(Prompt::IdLists(vec![vec![5], vec![]]), "x", &[9]) {
            Prompt::IdLists(l) => assert_eq!(l, [vec![100, 5, 101, 9, 102], vec![100, 101, 9, 102]]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn no_fim_is_a_400_naming_suffix() {
        let e = no_fim();
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("suffix"));
        assert!(e.message.contains("no fill-in-the-middle tokens"), "{}", e.message);
    }
}
