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
        }
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
        if self.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
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
        if let Some(n) = self.logprobs.filter(|&n| n > 20) {
            return bad(format!("top logprobs must be at most 20, got {n}"));
        }
        self.sampling.validate()
    }
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
    /// How it ended.
    pub finish: Finish,
}
