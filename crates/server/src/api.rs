//! The request bodies of the OpenAI and SGLang endpoints, and their translation into engine
//! requests.

use crate::error::ApiError;
use runtime::{Request, SamplingParams};
use serde::Deserialize;
use serde_json::Value;

/// Most choices one request may ask for.
pub const MAX_N: usize = 16;

/// Most prompts one completions request may carry (OpenAI's limit is 2048; each becomes an
/// engine request per choice).
pub const MAX_PROMPTS: usize = 256;

/// OpenAI's default `max_tokens` of `/v1/completions`.
pub const COMPLETIONS_MAX_TOKENS: usize = 16;

/// A seed for a request that gives none: from the process's random hash keys (fresh per call)
/// and the clock, so that unseeded sampling differs from request to request.
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// A string or a list of them (`stop`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling and stopping parameters, under the same names in the OpenAI endpoints and in
/// `/generate`'s `sampling_params`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Sampling {
    /// Sampling temperature (default 1).
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    pub top_p: Option<f32>,
    /// Top-k (-1 or 0: off).
    pub top_k: Option<i64>,
    /// Min-p.
    pub min_p: Option<f32>,
    /// OpenAI's frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// OpenAI's presence penalty.
    pub presence_penalty: Option<f32>,
    /// HF's repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// Seed of the sampler.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<OneOrMany>,
    /// Stop token ids.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Do not stop at eos.
    #[serde(default)]
    pub ignore_eos: bool,
    /// No eos or stop id before this many tokens (vLLM's and SGLang's `min_tokens`).
    pub min_tokens: Option<i64>,
    /// SGLang's: the output is text this regular expression matches whole.
    pub regex: Option<String>,
    /// SGLang's: the output is JSON valid under this schema (a JSON string or the object).
    pub json_schema: Option<Value>,
    /// SGLang's: the output follows this grammar (llama.cpp's GBNF notation).
    pub ebnf: Option<String>,
    /// vLLM's: the output follows this grammar (GBNF, or Lark in llguidance's dialect).
    pub guided_grammar: Option<String>,
}

/// Parameters shared by the chat and completion endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Params {
    /// The model name (checked against the served name).
    pub model: Option<String>,
    /// Most new tokens.
    pub max_tokens: Option<i64>,
    /// Most new tokens (the chat API's newer name).
    pub max_completion_tokens: Option<i64>,
    /// Sampling and stopping.
    #[serde(flatten)]
    pub sampling: Sampling,
    /// Choices per prompt.
    pub n: Option<i64>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Chat: `true` for logprobs; completions: the number of top logprobs.
    pub logprobs: Option<Value>,
    /// Chat: top logprobs per token.
    pub top_logprobs: Option<i64>,
    /// Token id (as a string) to a bias added to its logit, in [-100, 100].
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// OpenAI's output format: text, `json_object` or `json_schema` ([`crate::format`]).
    pub response_format: Option<Value>,
}

/// What a request is checked against: the served model's context length and vocabulary.
#[derive(Debug, Clone, Copy)]
pub struct ModelLimits {
    /// Context length in tokens.
    pub max_context: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

/// What the endpoints turn into engine requests.
#[derive(Debug, Clone)]
pub struct Job {
    /// Engine requests (one per prompt and choice), with their choice index.
    pub requests: Vec<Request>,
    /// Stop strings.
    pub stops: Vec<String>,
    /// Choices per prompt.
    pub n: usize,
    /// Stream the answer.
    pub stream: bool,
    /// Send a usage chunk at the end of a stream.
    pub include_usage: bool,
    /// Completions' `echo`: each prompt's text, which its choices' text starts with (empty:
    /// no echo).
    pub echo: Vec<String>,
    /// What every choice's output must follow (compiled per choice when it is submitted).
    pub format: Option<crate::format::Format>,
    /// Chat with tools: tool calls are read back from each choice's output in this dialect
    /// ([`crate::tool_parse`]).
    pub tool_calls: Option<crate::dialect::Dialect>,
}

fn int(v: Option<i64>, name: &'static str, lo: i64, hi: i64) -> Result<Option<usize>, ApiError> {
    match v {
        Some(x) if x < lo || x > hi => {
            Err(ApiError::bad(format!("{name} must be in [{lo}, {hi}], got {x}"), Some(name)))
        }
        Some(x) => Ok(Some(x as usize)),
        None => Ok(None),
    }
}

/// A request's `model` (when it names one) must be the served model: else 404.
pub fn check_model(model: Option<&str>, served: &str) -> Result<(), ApiError> {
    match model {
        Some(m) if m != served => Err(ApiError::unknown_model(m, served)),
        _ => Ok(()),
    }
}

/// OpenAI's `logit_bias` map (`{"1234": -100}`) as (token, bias) pairs.
fn logit_bias(m: Option<&serde_json::Map<String, Value>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::bad(m, Some("logit_bias"));
    let mut out = Vec::new();
    for (k, v) in m.into_iter().flatten() {
        let t: u32 = k.parse().map_err(|_| bad(format!("logit_bias keys must be token ids, got `{k}`")))?;
        let b = v.as_f64().ok_or_else(|| bad(format!("logit_bias of token {t} must be a number, got {v}")))?;
        out.push((t, b as f32));
    }
    Ok(out)
}

impl Params {
    /// Checks the model name.
    pub fn check_model(&self, served: &str) -> Result<(), ApiError> {
        check_model(self.model.as_deref(), served)
    }

    /// The engine requests for `prompts`, `n` choices each. `top_logprobs`: the number of top
    /// logprobs asked for, if any. `model`: its context length and vocabulary. `prompt_field`:
    /// the request field the prompts came from (named by errors). `default_max`: `max_tokens`
    /// when the request gives none (`None`: up to the context length, at most 4096).
    ///
    /// Sampling is seeded: by `seed` plus the choice's index when the request gives one (the
    /// same request gives the same answer), else by a fresh random seed per request.
    pub fn job(
        &self,
        prompts: Vec<Vec<u32>>,
        top_logprobs: Option<usize>,
        model: ModelLimits,
        prompt_field: &'static str,
        default_max: Option<usize>,
    ) -> Result<Job, ApiError> {
        let ModelLimits { max_context, vocab } = model;
        let n = int(self.n, "n", 1, MAX_N as i64)?.unwrap_or(1);
        if prompts.len() > MAX_PROMPTS {
            return Err(ApiError::bad(
                format!("at most {MAX_PROMPTS} prompts per request, got {}", prompts.len()),
                Some(prompt_field),
            ));
        }
        if let Some(t) = self.sampling.stop_token_ids.iter().flatten().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad(
                format!("stop token id {t} is outside the vocabulary (size {vocab})"),
                Some("stop_token_ids"),
            ));
        }
        let p = &self.sampling;
        let format = crate::format::parse(crate::format::Fields {
            response_format: self.response_format.as_ref(),
            regex: p.regex.as_deref(),
            json_schema: p.json_schema.as_ref(),
            ebnf: p.ebnf.as_deref(),
            guided_grammar: p.guided_grammar.as_deref(),
        })?;
        if format.is_some() && p.ignore_eos {
            return Err(ApiError::bad("an output format ends the output: not with ignore_eos", Some("ignore_eos")));
        }
        if format.is_some() && p.min_tokens.is_some_and(|m| m > 0) {
            return Err(ApiError::bad("an output format ends the output: not with min_tokens", Some("min_tokens")));
        }
        let top_k = match p.top_k {
            Some(k) if k < -1 => {
                return Err(ApiError::bad(format!("top_k must be -1, 0 or positive, got {k}"), Some("top_k")))
            }
            Some(k) if k > 0 => k as usize,
            _ => 0,
        };
        let sampling = SamplingParams {
            temperature: p.temperature.unwrap_or(1.0),
            top_k,
            top_p: p.top_p.unwrap_or(1.0),
            min_p: p.min_p.unwrap_or(0.0),
            seed: p.seed.unwrap_or(0),
            repetition_penalty: p.repetition_penalty.unwrap_or(1.0),
            frequency_penalty: p.frequency_penalty.unwrap_or(0.0),
            presence_penalty: p.presence_penalty.unwrap_or(0.0),
            logit_bias: logit_bias(self.logit_bias.as_ref())?,
            min_tokens: int(p.min_tokens, "min_tokens", 0, i64::MAX)?.unwrap_or(0),
            min_tokens_ids: vec![],
        };
        sampling.validate().map_err(ApiError::from)?;
        let asked = self.max_completion_tokens.or(self.max_tokens);
        let max_tokens = int(asked, "max_tokens", 1, i64::MAX)?;
        let stops = match &p.stop {
            None => vec![],
            Some(OneOrMany::One(s)) => vec![s.clone()],
            Some(OneOrMany::Many(v)) => v.clone(),
        };
        if stops.len() > 16 || stops.iter().any(String::is_empty) {
            return Err(ApiError::bad("stop takes at most 16 non-empty strings", Some("stop")));
        }
        let base_seed = p.seed.unwrap_or_else(random_seed);
        let mut requests = Vec::with_capacity(prompts.len() * n);
        for prompt in prompts {
            let left = max_context.saturating_sub(prompt.len());
            if left == 0 {
                return Err(ApiError::bad(
                    format!("the prompt ({} tokens) fills the context length {max_context}", prompt.len()),
                    Some(prompt_field),
                ));
            }
            for i in 0..n {
                let seed = base_seed.wrapping_add(i as u64);
                requests.push(Request {
                    prompt: prompt.clone(),
                    sampling: SamplingParams { seed, ..sampling.clone() },
                    max_tokens: max_tokens.unwrap_or_else(|| default_max.unwrap_or(4096).min(left)),
                    stop_ids: p.stop_token_ids.clone().unwrap_or_default(),
                    ignore_eos: p.ignore_eos,
                    logprobs: top_logprobs,
                    embed: None,
                    constraint: None,
                });
            }
        }
        let include_usage = self.stream_options.as_ref().is_some_and(|o| o.include_usage);
        Ok(Job { requests, stops, n, stream: self.stream, include_usage, echo: vec![], format, tool_calls: None })
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<Value>,
    /// Functions the model may call ([`crate::tools`]).
    pub tools: Option<Value>,
    /// `none`, `auto`, `required` or a named function.
    pub tool_choice: Option<Value>,
    /// More than one call per answer (default true).
    pub parallel_tool_calls: Option<Value>,
    /// Everything else.
    #[serde(flatten)]
    pub params: Params,
}

impl ChatRequest {
    /// The messages and extra variables (`tools`) for the chat template, with the request's
    /// tools: the template takes them itself where it speaks the tool-call syntax (`syntax`),
    /// else they and the history's tool-calling turns are written as text
    /// ([`crate::history::generic`]).
    pub fn template_input(
        &self,
        syntax: crate::dialect::ToolSyntax,
        tools: Option<&crate::tools::Tools>,
    ) -> Result<(Value, Option<Value>), ApiError> {
        let mut messages = self.template_messages()?;
        Ok(match syntax {
            crate::dialect::ToolSyntax::Native(d) => {
                d.history_ids(&mut messages);
                (Value::Array(messages), tools.map(|t| serde_json::json!({"tools": t.declared})))
            }
            crate::dialect::ToolSyntax::Generic => {
                (Value::Array(crate::history::generic(messages, tools.map(|t| t.system_text()))), None)
            }
        })
    }

    /// The messages: roles checked, content as a string (text parts joined), tool-calling
    /// turns checked (`history`), arguments parsed.
    fn template_messages(&self) -> Result<Vec<Value>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad("messages must not be empty", Some("messages")));
        }
        let mut out = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad(format!("messages[{i}] has no `role` string"), Some("messages")))?;
            match role {
                "system" | "developer" | "user" | "assistant" => {}
                "tool" => crate::history::tool_result(i, m)?,
                other => {
                    return Err(ApiError::bad(
                        format!("messages[{i}].role must be system, developer, user, assistant or tool, got `{other}`"),
                        Some("messages"),
                    ))
                }
            }
            if m.get("function_call").is_some_and(|t| !t.is_null()) {
                return Err(ApiError::bad(
                    format!("messages[{i}]: `function_call` is deprecated; send `tool_calls`"),
                    Some("messages"),
                ));
            }
            let calls = match m.get("tool_calls").filter(|t| !t.is_null()) {
                Some(_) if role != "assistant" => {
                    return Err(ApiError::bad(
                        format!("messages[{i}]: only assistant messages have tool_calls"),
                        Some("messages"),
                    ))
                }
                Some(c) => Some(crate::history::tool_calls(i, c)?),
                None => None,
            };
            let content = match m.get("content") {
                // An assistant turn that only calls tools has no text.
                None | Some(Value::Null) if calls.is_some() => String::new(),
                None | Some(Value::Null) => {
                    return Err(ApiError::bad(format!("messages[{i}] ({role}) has no content"), Some("messages")))
                }
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => Ok(t),
                        _ => Err(ApiError::bad(
                            format!("messages[{i}].content: only text parts are supported"),
                            Some("messages"),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .concat(),
                Some(_) => {
                    return Err(ApiError::bad(
                        format!("messages[{i}].content must be a string or a list of text parts"),
                        Some("messages"),
                    ))
                }
            };
            let mut msg = m.clone();
            msg["role"] = Value::String(role.to_string());
            msg["content"] = Value::String(content);
            if let Some(c) = calls {
                msg["tool_calls"] = c;
            }
            out.push(msg);
        }
        Ok(out)
    }

    /// The number of top logprobs asked for (`logprobs: true` with `top_logprobs`).
    pub fn top_logprobs(&self) -> Result<Option<usize>, ApiError> {
        match &self.params.logprobs {
            None | Some(Value::Bool(false)) | Some(Value::Null) => Ok(None),
            Some(Value::Bool(true)) => Ok(Some(int(self.params.top_logprobs, "top_logprobs", 0, 20)?.unwrap_or(0))),
            Some(_) => Err(ApiError::bad("logprobs must be a boolean", Some("logprobs"))),
        }
    }
}

/// A completion prompt: text, token ids, or a list of either.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One text.
    Text(String),
    /// Several texts.
    Texts(Vec<String>),
    /// One token-id prompt.
    Ids(Vec<u32>),
    /// Several token-id prompts.
    IdLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt(s).
    pub prompt: Prompt,
    /// Return each prompt before its completion.
    #[serde(default)]
    pub echo: Option<bool>,
    /// Fill-in-the-middle: the text that follows the completion (`crate::fim`); null or empty: a
    /// plain completion.
    #[serde(default)]
    pub suffix: Option<String>,
    /// Everything else.
    #[serde(flatten)]
    pub params: Params,
}

impl CompletionRequest {
    /// The number of top logprobs asked for (`logprobs: N`).
    pub fn top_logprobs(&self) -> Result<Option<usize>, ApiError> {
        match &self.params.logprobs {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_i64() {
                Some(n) => int(Some(n), "logprobs", 0, 20),
                None => Err(ApiError::bad(format!("logprobs must be an integer, got {v}"), Some("logprobs"))),
            },
        }
    }
}

/// SGLang's native `POST /generate`.
#[derive(Debug, Clone, Deserialize)]
pub struct GenerateRequest {
    /// Prompt text.
    pub text: Option<String>,
    /// Or prompt token ids.
    pub input_ids: Option<Vec<u32>>,
    /// Sampling parameters (SGLang's names: max_new_tokens, temperature, ...).
    #[serde(default)]
    pub sampling_params: GenerateSampling,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
}

/// `sampling_params` of `/generate`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GenerateSampling {
    /// Most new tokens (default 128).
    pub max_new_tokens: Option<i64>,
    /// Sampling and stopping.
    #[serde(flatten)]
    pub sampling: Sampling,
}

impl GenerateSampling {
    /// As the OpenAI parameters.
    pub fn params(&self, stream: bool) -> Result<Params, ApiError> {
        int(self.max_new_tokens, "max_new_tokens", 1, i64::MAX)?;
        Ok(Params {
            max_tokens: Some(self.max_new_tokens.unwrap_or(128)),
            sampling: self.sampling.clone(),
            stream,
            ..Params::default()
        })
    }
}

/// SGLang's `POST /tokenize`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    /// The text.
    pub prompt: String,
    /// Add the tokenizer's special tokens (BOS), as prompts get them (default true).
    pub add_special_tokens: Option<bool>,
    /// The model name (the served one, when given).
    pub model: Option<String>,
}

/// SGLang's `POST /detokenize`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    /// The token ids.
    pub tokens: Vec<u32>,
    /// The model name (the served one, when given).
    pub model: Option<String>,
}
