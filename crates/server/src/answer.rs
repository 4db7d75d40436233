//! A request's answer as its choices' deltas arrive: accumulated into the whole response, or
//! streamed as server-sent events in the endpoint's shape. Chat with tools reads the calls
//! back from each choice's text ([`crate::tool_parse`]) into `message.tool_calls` and
//! streamed `delta.tool_calls`.

use crate::detok::{Delta, TokenLogprob};
use crate::drain::Ticket;
use crate::routes::{AppState, Guard, Kind};
use crate::tool_parse::{Call, CallParser, Piece};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;

/// One choice as it accumulates.
#[derive(Default)]
pub(crate) struct Choice {
    /// The text (the content, for chat with tools: calls are not part of it).
    pub(crate) text: String,
    logprobs: Vec<TokenLogprob>,
    finish: Option<&'static str>,
    usage: (usize, usize, usize),
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
    role_sent: bool,
    /// Chat with tools: reads the calls back.
    parser: Option<CallParser>,
    /// The dialect they are written in (it makes their ids).
    dialect: crate::dialect::Dialect,
    /// The calls so far, with their ids.
    calls: Vec<(String, Call)>,
}

impl Choice {
    /// A choice whose calls are read back in `tool_calls`' dialect, if any.
    pub(crate) fn new(tool_calls: Option<crate::dialect::Dialect>) -> Choice {
        let dialect = tool_calls.unwrap_or_default();
        Choice { parser: tool_calls.map(CallParser::new), dialect, ..Choice::default() }
    }

    /// Takes the parser's pieces: text into `step`, calls into the choice (their indices
    /// into `step`).
    fn take(&mut self, pieces: Vec<Piece>, step: &mut Step) {
        for p in pieces {
            match p {
                Piece::Text(t) => step.text += &t,
                Piece::Call(c) => {
                    step.calls.push(self.calls.len());
                    self.calls.push((self.dialect.call_id(), c));
                }
            }
        }
    }
}

/// What one delta adds to a choice.
#[derive(Default)]
pub(crate) struct Step {
    /// New text (content).
    pub(crate) text: String,
    /// Its tokens' logprobs.
    logprobs: Vec<TokenLogprob>,
    /// Calls completed (indices into the choice's calls).
    calls: Vec<usize>,
    /// The finish reason, if the choice ended.
    finish: Option<&'static str>,
    /// Nothing to send (text held back by the call parser).
    quiet: bool,
}

/// The request's choices, its guard, and what the format needs.
pub(crate) struct Answer {
    pub(crate) rx: UnboundedReceiver<(usize, Delta)>,
    pub(crate) guard: Guard,
    pub(crate) choices: Vec<Choice>,
    pub(crate) kind: Kind,
    pub(crate) n: usize,
    pub(crate) id: String,
    pub(crate) model: String,
    pub(crate) created: u64,
    pub(crate) start: Instant,
    pub(crate) st: Arc<AppState>,
    /// Counts the request as in flight until the response (or its stream) is dropped.
    pub(crate) _ticket: Ticket,
}

impl Step {
    /// A step of text alone (completions' echo).
    pub(crate) fn text(text: String) -> Step {
        Step { text, ..Step::default() }
    }
}

impl Answer {
    /// Records a delta; returns what it adds.
    pub(crate) fn apply(&mut self, i: usize, d: Delta) -> Step {
        let now = Instant::now();
        let c = &mut self.choices[i];
        let mut step = Step::default();
        match d {
            Delta::Text { text, tokens, logprobs } => {
                c.first.get_or_insert(now);
                c.last = Some(now);
                c.tokens += tokens;
                match c.parser.as_mut().map(|p| p.push(&text)) {
                    Some(pieces) => {
                        c.take(pieces, &mut step);
                        step.quiet = step.text.is_empty() && step.calls.is_empty() && logprobs.is_empty();
                    }
                    None => step.text = text,
                }
                c.text += &step.text;
                c.logprobs.extend(logprobs.iter().cloned());
                step.logprobs = logprobs;
            }
            Delta::Done { reason, prompt_tokens, completion_tokens, cached_tokens } => {
                if let Some(pieces) = c.parser.as_mut().map(CallParser::finish) {
                    c.take(pieces, &mut step);
                    c.text += &step.text;
                }
                // OpenAI's reason for an answer that ends in calls.
                let reason = if reason == "stop" && !c.calls.is_empty() { "tool_calls" } else { reason };
                c.finish = Some(reason);
                c.usage = (prompt_tokens, completion_tokens, cached_tokens);
                let ttft = c.first.map(|f| (f - self.start).as_secs_f64());
                let tpot = match (c.first, c.last) {
                    (Some(f), Some(l)) if c.tokens > 1 => Some((l - f).as_secs_f64() / (c.tokens - 1) as f64),
                    _ => None,
                };
                self.st.metrics.finished(ttft, tpot);
                self.guard.close(i);
                step.finish = Some(reason);
            }
        }
        step
    }

    fn usage(&self) -> Value {
        // A prompt counts once however many choices it has.
        let prompt: usize = self.choices.iter().step_by(self.n.max(1)).map(|c| c.usage.0).sum();
        let completion: usize = self.choices.iter().map(|c| c.usage.1).sum();
        let cached: usize = self.choices.iter().step_by(self.n.max(1)).map(|c| c.usage.2).sum();
        json!({
            "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    fn logprobs(&self, lps: &[TokenLogprob], asked: bool) -> Value {
        if !asked {
            return Value::Null;
        }
        let bytes = |t: &str| t.as_bytes().to_vec();
        match self.kind {
            Kind::Chat => json!({"content": lps.iter().map(|l| json!({
                "token": l.token, "logprob": l.logprob, "bytes": bytes(&l.token),
                "top_logprobs": l.top.iter().map(|(t, p)| json!({"token": t, "logprob": p, "bytes": bytes(t)})).collect::<Vec<_>>(),
            })).collect::<Vec<_>>()}),
            _ => {
                let mut offset = 0;
                let offsets: Vec<usize> = lps
                    .iter()
                    .map(|l| {
                        let o = offset;
                        offset += l.token.len();
                        o
                    })
                    .collect();
                json!({
                    "tokens": lps.iter().map(|l| &l.token).collect::<Vec<_>>(),
                    "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                    "top_logprobs": lps.iter().map(|l| l.top.iter().map(|(t, p)| (t.clone(), json!(p))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
        }
    }

    /// Calls `which` of choice `i` in OpenAI's shape (`index` their position in the choice).
    fn tool_calls(&self, i: usize, which: impl Iterator<Item = usize>) -> Vec<Value> {
        let calls = &self.choices[i].calls;
        which
            .map(|k| {
                let (id, c) = &calls[k];
                json!({"index": k, "id": id, "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect()
    }

    /// The chat message of choice `i`: its content (null when it only calls tools) and calls.
    fn message(&self, i: usize) -> Value {
        let c = &self.choices[i];
        if c.calls.is_empty() {
            return json!({"role": "assistant", "content": c.text});
        }
        let mut calls = self.tool_calls(i, 0..c.calls.len());
        for call in &mut calls {
            call.as_object_mut().map(|o| o.remove("index"));
        }
        let content = if c.text.is_empty() { Value::Null } else { Value::String(c.text.clone()) };
        json!({"role": "assistant", "content": content, "tool_calls": calls})
    }

    /// The non-streamed response.
    pub(crate) fn whole(&self) -> Value {
        let asked = self.choices.iter().any(|c| !c.logprobs.is_empty());
        if self.kind == Kind::Generate {
            let c = &self.choices[0];
            return json!({"text": c.text, "meta_info": self.meta(c)});
        }
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let lp = self.logprobs(&c.logprobs, asked);
                match self.kind {
                    Kind::Chat => json!({"index": i, "message": self.message(i), "logprobs": lp,
                        "finish_reason": c.finish}),
                    _ => json!({"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish}),
                }
            })
            .collect();
        let object = if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": choices, "usage": self.usage()})
    }

    fn meta(&self, c: &Choice) -> Value {
        json!({"id": self.id, "prompt_tokens": c.usage.0, "completion_tokens": c.usage.1, "cached_tokens": c.usage.2,
            "finish_reason": c.finish.map(|r| json!({"type": r}))})
    }

    /// A chat chunk of choice `i` with `delta` (the role added to the choice's first).
    fn chat_chunk(&mut self, i: usize, mut delta: Value, logprobs: Value, finish: Option<&'static str>) -> Value {
        if finish.is_none() && !std::mem::replace(&mut self.choices[i].role_sent, true) {
            delta["role"] = json!("assistant");
        }
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})
    }

    /// The streamed chunks of a step: chat sends its text, then its calls, then its end.
    pub(crate) fn chunks(&mut self, i: usize, step: Step) -> Vec<Value> {
        let lps = self.logprobs(&step.logprobs, !step.logprobs.is_empty());
        match self.kind {
            Kind::Generate => {
                let c = &self.choices[i];
                vec![json!({"text": c.text, "meta_info": self.meta(c)})]
            }
            Kind::Chat => {
                let mut out = vec![];
                let ends_only = step.finish.is_some() && step.text.is_empty() && step.logprobs.is_empty();
                if !step.quiet && !ends_only && (!step.text.is_empty() || step.calls.is_empty()) {
                    out.push(self.chat_chunk(i, json!({"content": step.text}), lps, None));
                }
                if !step.calls.is_empty() {
                    let calls = self.tool_calls(i, step.calls.into_iter());
                    out.push(self.chat_chunk(i, json!({"tool_calls": calls}), Value::Null, None));
                }
                if let Some(f) = step.finish {
                    out.push(self.chat_chunk(i, json!({}), Value::Null, Some(f)));
                }
                out
            }
            Kind::Completion => vec![json!({"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [{"index": i, "text": step.text,
                "logprobs": lps, "finish_reason": step.finish}]})],
        }
    }
}

/// Server-sent events: the chunks of each delta, an optional usage chunk, then `[DONE]`.
pub(crate) fn stream(a: Answer, include_usage: bool, first: Vec<String>) -> Response {
    struct S {
        a: Answer,
        usage: bool,
        ended: bool,
        queue: VecDeque<String>,
    }
    let s = S { a, usage: include_usage, ended: false, queue: first.into() };
    let events = futures_util::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(data) = s.queue.pop_front() {
                return Some((Ok::<_, std::convert::Infallible>(SseEvent::default().data(data)), s));
            }
            if s.ended {
                return None;
            }
            match s.a.rx.recv().await {
                Some((i, d)) => {
                    let step = s.a.apply(i, d);
                    let chunks = s.a.chunks(i, step);
                    s.queue.extend(chunks.iter().map(Value::to_string));
                }
                None if s.usage && s.a.kind != Kind::Generate => {
                    s.usage = false;
                    let object = if s.a.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
                    let usage = json!({"id": s.a.id, "object": object, "created": s.a.created, "model": s.a.model,
                        "choices": [], "usage": s.a.usage()});
                    s.queue.push_back(usage.to_string());
                }
                None => {
                    s.ended = true;
                    s.queue.push_back("[DONE]".to_string());
                }
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}
