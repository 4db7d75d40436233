//! One request, start to finish: prefill the prompt, then decode token by token until an eos
//! id or the token limit.

use crate::{Backend, RuntimeError, Sampler, SamplingParams, SeqId};
use std::time::{Duration, Instant};

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most new tokens.
    pub max_tokens: usize,
    /// Token ids that end generation (not included in the output).
    pub stop_ids: Vec<u32>,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Context length of the model (prompt + new tokens may not exceed it).
    pub max_context: usize,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An eos/stop id was sampled.
    Stop,
    /// `max_tokens` was reached.
    Length,
}

/// The result of [`generate`].
#[derive(Debug, Clone)]
pub struct GenerateOutput {
    /// New token ids (without the stop id).
    pub ids: Vec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
    /// Time of the prefill step (time to first token).
    pub prefill: Duration,
    /// Time of all decode steps.
    pub decode: Duration,
}

/// Runs `req` on `backend` as sequence `seq`, calling `on_token` for each new token.
pub fn generate(
    backend: &mut dyn Backend,
    seq: SeqId,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32),
) -> Result<GenerateOutput, RuntimeError> {
    if req.prompt.is_empty() {
        return Err(RuntimeError::Invalid("the prompt is empty".into()));
    }
    if req.prompt.len() + req.max_tokens > req.max_context {
        return Err(RuntimeError::Invalid(format!(
            "the prompt ({} tokens) plus max_tokens ({}) exceeds the context length {}",
            req.prompt.len(),
            req.max_tokens,
            req.max_context
        )));
    }
    let mut sampler = Sampler::new(req.sampling.clone())?;
    let start = Instant::now();
    let result = (|| {
        let mut logits = backend.forward(seq, &req.prompt, &[req.prompt.len() - 1])?;
        let prefill = start.elapsed();
        let mut ids = Vec::new();
        let mut finish = FinishReason::Length;
        while ids.len() < req.max_tokens {
            let next = sampler.sample(&logits);
            if req.stop_ids.contains(&next) {
                finish = FinishReason::Stop;
                break;
            }
            ids.push(next);
            on_token(next);
            if ids.len() == req.max_tokens {
                break;
            }
            logits = backend.forward(seq, &[next], &[0])?;
        }
        Ok(GenerateOutput { ids, finish, prefill, decode: start.elapsed() - prefill })
    })();
    backend.release(seq);
    result
}
