//! What a client asks for and what it gets back.

use crate::{Logprobs, RuntimeError, SamplingParams};

/// Identifies a request of an [`crate::Engine`].
pub type ReqId = u64;

/// One generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// How to choose tokens.
    pub sampling: SamplingParams,
    /// Most new tokens.
    pub max_tokens: usize,
    /// Token ids that end the request besides the model's eos ids (not included in the
    /// output).
    pub stop_ids: Vec<u32>,
    /// Do not stop at the model's eos ids.
    pub ignore_eos: bool,
    /// Return the log-probability of each chosen token and of the `n` most likely.
    pub logprobs: Option<usize>,
    /// An embedding request: no tokens are generated (`max_tokens` is 0); the prompt's final
    /// hidden states pooled this way come back as one [`Event::Embedding`].
    pub embed: Option<Pooling>,
    /// What the generated tokens must follow (a JSON schema, a regular expression, a
    /// grammar): tokens it does not allow are never chosen.
    pub constraint: Option<crate::Constraint>,
}

/// How an embedding pools the final hidden states (after the final norm) of its prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The last token's (decoder models' usual choice: Qwen3-Embedding, gte-Qwen2, e5-mistral).
    Last,
    /// The mean over every token.
    Mean,
}

impl std::str::FromStr for Pooling {
    type Err = String;
    fn from_str(s: &str) -> Result<Pooling, String> {
        match s {
            "last" => Ok(Pooling::Last),
            "mean" => Ok(Pooling::Mean),
            other => Err(format!("unknown pooling `{other}` (expected last or mean)")),
        }
    }
}

impl Request {
    /// A greedy request for at most `max_tokens` tokens.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
        Request {
            prompt,
            sampling: SamplingParams::default(),
            max_tokens,
            stop_ids: vec![],
            ignore_eos: false,
            logprobs: None,
            embed: None,
            constraint: None,
        }
    }

    /// An embedding request: `prompt`'s final hidden states pooled by `pooling`.
    pub fn embedding(prompt: Vec<u32>, pooling: Pooling) -> Request {
        Request { embed: Some(pooling), ..Request::greedy(prompt, 0) }
    }

    /// Checks the request against the model's vocabulary and context length.
    pub fn validate(&self, vocab: usize, max_context: usize) -> Result<(), RuntimeError> {
        let bad = |m: String| Err(RuntimeError::Invalid(m));
        if self.prompt.is_empty() {
            return bad("the prompt is empty".into());
        }
        if let Some(t) = self.prompt.iter().find(|&&t| t as usize >= vocab) {
            return bad(format!("prompt token id {t} is outside the vocabulary (size {vocab})"));
        }
        if self.embed.is_some() != (self.max_tokens == 0) {
            return bad(match self.embed {
                Some(_) => "an embedding request generates no tokens: max_tokens must be 0".into(),
                None => "max_tokens must be at least 1".into(),
            });
        }
        if self.prompt.len().saturating_add(self.max_tokens) > max_context {
            return bad(format!(
                "the prompt ({} tokens) plus max_tokens ({}) exceeds the context length {max_context}",
                self.prompt.len(),
                self.max_tokens
            ));
        }
        if let Some((t, _)) = self.sampling.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
            return bad(format!("logit_bias token id {t} is outside the vocabulary (size {vocab})"));
        }
        if self.constraint.is_some() && (self.ignore_eos || self.sampling.min_tokens > 0) {
            return bad("a constrained request ends when its grammar does: not with ignore_eos or min_tokens".into());
        }
        if let Some(n) = self.logprobs.filter(|&n| n > 20) {
            return bad(format!("top logprobs must be at most 20, got {n}"));
        }
        self.sampling.validate()
    }
}

/// `v` scaled to unit L2 norm (in f64; a zero vector stays zero). A mean's sum needs no
/// division first: scaling does not change the direction.
pub(crate) fn normalized(v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
    if norm == 0.0 {
        return v;
    }
    v.into_iter().map(|x| (f64::from(x) / norm) as f32).collect()
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An eos or stop id was sampled (it is not part of the output).
    Stop,
    /// `max_tokens` was reached.
    Length,
    /// The request was aborted.
    Abort,
}

/// A request's last event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finish {
    /// Why it ended.
    pub reason: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens found in the prefix cache at admission.
    pub cached_tokens: usize,
}

/// What the engine reports about a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// An embedding request's pooled, L2-normalised final hidden state (then `Finished`).
    Embedding(Vec<f32>),
    /// A new token.
    Token {
        /// Its id.
        id: u32,
        /// Its log-probabilities, if asked for.
        logprobs: Option<Logprobs>,
    },
    /// The request ended; no event follows.
    Finished(Finish),
}

/// Everything a request produced (the offline form of its events).
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// New token ids.
    pub tokens: Vec<u32>,
    /// Their log-probabilities, if asked for.
    pub logprobs: Vec<Logprobs>,
    /// An embedding request's embedding (empty for the others).
    pub embedding: Vec<f32>,
    /// How it ended.
    pub finish: Finish,
}
