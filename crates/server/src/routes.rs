//! The HTTP routes: OpenAI's chat and completions, SGLang's `/generate`, models, health and
//! metrics. Tokenization runs on tokio's blocking pool, detokenization on its own thread;
//! handlers only move JSON.

use crate::api::{
    check_model, ChatRequest, CompletionRequest, DetokenizeRequest, GenerateRequest, Job, ModelLimits, Prompt,
    TokenizeRequest, COMPLETIONS_MAX_TOKENS,
};
use crate::detok::{Delta, Detokenizer, TokenLogprob};
use crate::drain::{Drain, Ticket};
use crate::error::ApiError;
use crate::fields::{self, Endpoint};
use crate::fim::{self, Fim};
use crate::metrics::Metrics;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use runtime::{EngineHandle, ReqId};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use text::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// What every handler shares.
pub struct AppState {
    /// The engine thread.
    pub engine: Arc<EngineHandle>,
    /// The detokenizer thread.
    pub detok: Detokenizer,
    /// The tokenizer (and chat template).
    pub tok: Arc<Tokenizer>,
    /// The model's fill-in-the-middle tokens, if its tokenizer has them (`suffix`).
    pub fim: Option<Fim>,
    /// What the chat template renders of tool-calling turns.
    pub tool_turns: crate::history::ToolTurns,
    /// The served model name.
    pub model: String,
    /// Required bearer token, if any.
    pub api_key: Option<String>,
    /// Context length of the model.
    pub max_context: usize,
    /// Vocabulary size of the model.
    pub vocab: usize,
    /// Features of the model's final hidden state (an embedding's dimensions).
    pub hidden: usize,
    /// How `/v1/embeddings` pools an input's hidden states.
    pub pooling: runtime::Pooling,
    /// Constrained decoding against the served tokenizer (`None`: it could not be loaded).
    pub grammars: Option<Arc<grammar::Grammars>>,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// Unix time the server started (the model's `created`).
    pub created: u64,
    /// Response ids.
    pub next_id: AtomicU64,
    /// Shutdown: requests in flight, 503 for new ones.
    pub drain: Arc<Drain>,
}

type St = State<Arc<AppState>>;

impl AppState {
    fn limits(&self) -> ModelLimits {
        ModelLimits { max_context: self.max_context, vocab: self.vocab }
    }
}

/// Unix time now, in seconds (each response's `created`).
fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/generate", post(generate))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/tokenize", post(tokenize_route))
        .route("/detokenize", post(detokenize_route))
        .route("/v1/embeddings", post(embeddings))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|method: Method, uri: Uri| async move { ApiError::no_route(StatusCode::NOT_FOUND, &method, &uri) })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            ApiError::no_route(StatusCode::METHOD_NOT_ALLOWED, &method, &uri)
        })
        .with_state(state)
}

fn auth(st: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &st.api_key else { return Ok(()) };
    let given =
        headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    if given == Some(key.as_str()) {
        Ok(())
    } else {
        Err(ApiError::unauthorized())
    }
}

/// The body as JSON; a body that could not be read keeps axum's status in OpenAI's shape. A
/// value of the wrong type is a 400 naming its field.
fn parse<T: serde::de::DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    typed(json(body)?)
}

fn json(body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    serde_json::from_slice(&body?).map_err(|e| ApiError::bad(format!("invalid JSON body: {e}"), None))
}

/// A body for `endpoint`: every top-level field checked (`fields::check`), then typed.
fn parse_for<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Result<T, ApiError> {
    let v = json(body)?;
    let Value::Object(map) = &v else {
        return Err(ApiError::bad("the request body must be a JSON object", None));
    };
    fields::check(map, endpoint)?;
    typed(v)
}

fn typed<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let field = e.path().iter().next().map(|s| s.to_string()).filter(|f| !f.is_empty() && f != "?");
        let inner = e.into_inner().to_string();
        match field.as_deref() {
            Some("prompt") => ApiError::bad(
                "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
                Some("prompt"),
            ),
            Some(f) => ApiError::bad_field(format!("`{f}`: {inner}"), f),
            None => ApiError::bad(format!("invalid request body: {inner}"), None),
        }
    })
}

/// Runs `f` on the blocking pool (tokenization, chat templates).
pub(crate) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(format!("worker task failed: {e}")))
}

/// The served model as OpenAI lists it.
fn model_card(st: &AppState) -> Value {
    json!({"id": st.model, "object": "model", "created": st.created, "owned_by": "engine", "max_model_len": st.max_context})
}

async fn models(State(st): St, headers: HeaderMap) -> Response {
    if let Err(e) = auth(&st, &headers) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": [model_card(&st)]})).into_response()
}

/// `GET /v1/models/{id}` (`client.models.retrieve`): the served model, or 404.
async fn model(State(st): St, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let r = auth(&st, &headers).and_then(|()| match id == st.model {
        true => Ok(Json(model_card(&st)).into_response()),
        false => Err(ApiError { status: StatusCode::NOT_FOUND, ..ApiError::unknown_model(&id, &st.model) }),
    });
    r.unwrap_or_else(IntoResponse::into_response)
}

/// SGLang's `POST /tokenize`: `{"prompt": text, "add_special_tokens"?: bool}` →
/// `{"tokens": [...], "count": n, "max_model_len": ...}`.
async fn tokenize_route(State(st): St, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        auth(&st, &headers)?;
        let req: TokenizeRequest = parse(body)?;
        check_model(req.model.as_deref(), &st.model)?;
        let tok = st.tok.clone();
        let special = req.add_special_tokens.unwrap_or(true);
        let ids = blocking(move || tok.encode(&req.prompt, special))
            .await?
            .map_err(|e| ApiError::bad(format!("tokenizing the prompt: {e}"), Some("prompt")))?;
        Ok(Json(json!({"tokens": ids, "count": ids.len(), "max_model_len": st.max_context})).into_response())
    }
    .await;
    answer(&st, r)
}

/// SGLang's `POST /detokenize`: `{"tokens": [...]}` → `{"text": ...}`.
async fn detokenize_route(State(st): St, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        auth(&st, &headers)?;
        let req: DetokenizeRequest = parse(body)?;
        check_model(req.model.as_deref(), &st.model)?;
        if let Some(t) = req.tokens.iter().find(|&&t| t as usize >= st.vocab) {
            return Err(ApiError::bad(
                format!("token id {t} is outside the vocabulary (size {})", st.vocab),
                Some("tokens"),
            ));
        }
        let tok = st.tok.clone();
        let text = blocking(move || tok.decode(&req.tokens, false))
            .await?
            .map_err(|e| ApiError::bad(format!("detokenizing: {e}"), Some("tokens")))?;
        Ok(Json(json!({"text": text})).into_response())
    }
    .await;
    answer(&st, r)
}

/// OpenAI's `POST /v1/embeddings` ([`crate::embeddings`]).
async fn embeddings(State(st): St, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let _ticket = st.drain.enter()?;
        auth(&st, &headers)?;
        let v = crate::embeddings::embed(&st, json(body)?).await?;
        Ok(Json(v).into_response())
    }
    .await;
    answer(&st, r)
}

/// 200 `ok`, or 503 while the server shuts down.
async fn health(State(st): St) -> Response {
    match st.drain.check() {
        Ok(()) => "ok".into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(st): St) -> Response {
    let text = st.metrics.render(&st.engine.snapshot());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// Counts the request and its failure.
fn answer(st: &AppState, r: Result<Response, ApiError>) -> Response {
    st.metrics.request();
    r.unwrap_or_else(|e| {
        st.metrics.error();
        e.into_response()
    })
}

async fn chat(State(st): St, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let ticket = st.drain.enter()?;
        auth(&st, &headers)?;
        let req: ChatRequest = parse_for(body, Endpoint::Chat)?;
        req.params.check_model(&st.model)?;
        let messages = req.template_messages(st.tool_turns)?;
        let top = req.top_logprobs()?;
        let tok = st.tok.clone();
        let ids = blocking(move || tok.encode_chat(&messages, true))
            .await?
            .map_err(|e| ApiError::bad(format!("chat template: {e}"), Some("messages")))?;
        let job = req.params.job(vec![ids], top, st.limits(), "messages", None)?;
        run(&st, job, Kind::Chat, ticket).await
    }
    .await;
    answer(&st, r)
}

async fn completions(State(st): St, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let ticket = st.drain.enter()?;
        auth(&st, &headers)?;
        let req: CompletionRequest = parse_for(body, Endpoint::Completions)?;
        req.params.check_model(&st.model)?;
        let top = req.top_logprobs()?;
        let echo = req.echo == Some(true);
        let given = match &req.prompt {
            Prompt::Text(t) if echo => Some(vec![t.clone()]),
            Prompt::Texts(t) if echo => Some(t.clone()),
            _ => None,
        };
        let prompt = match req.suffix.filter(|s| !s.is_empty()) {
            None => req.prompt,
            // Fill-in-the-middle (`fields::check` refused it with `echo`).
            Some(suffix) => {
                let fim = st.fim.ok_or_else(fim::no_fim)?;
                let suffix_ids = match req.prompt {
                    Prompt::Ids(_) | Prompt::IdLists(_) => {
                        let (tok, s) = (st.tok.clone(), suffix.clone());
                        blocking(move || tok.encode(&s, false))
                            .await?
                            .map_err(|e| ApiError::bad(format!("tokenizing the suffix: {e}"), Some("suffix")))?
                    }
                    Prompt::Text(_) | Prompt::Texts(_) => vec![],
                };
                fim.prompt(req.prompt, &suffix, &suffix_ids)
            }
        };
        let prompts = tokenize(&st, prompt).await?;
        let echo = match (echo, given) {
            (false, _) => vec![],
            (true, Some(texts)) => texts,
            // Token-id prompts echo as their decoded text.
            (true, None) => {
                let (tok, ids) = (st.tok.clone(), prompts.clone());
                blocking(move || ids.iter().map(|p| tok.decode(p, false)).collect::<Result<Vec<_>, _>>())
                    .await?
                    .map_err(|e| ApiError::bad(format!("detokenizing the prompt: {e}"), Some("prompt")))?
            }
        };
        let job = req.params.job(prompts, top, st.limits(), "prompt", Some(COMPLETIONS_MAX_TOKENS))?;
        run(&st, Job { echo, ..job }, Kind::Completion, ticket).await
    }
    .await;
    answer(&st, r)
}

async fn generate(State(st): St, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let ticket = st.drain.enter()?;
        auth(&st, &headers)?;
        let req: GenerateRequest = parse_for(body, Endpoint::Generate)?;
        let (prompt, field) = match (req.text, req.input_ids) {
            (Some(t), None) => (Prompt::Text(t), "text"),
            (None, Some(ids)) => (Prompt::Ids(ids), "input_ids"),
            _ => return Err(ApiError::bad("give exactly one of `text` and `input_ids`", Some("text"))),
        };
        let prompts = tokenize(&st, prompt).await?;
        let job = req.sampling_params.params(req.stream)?.job(prompts, None, st.limits(), field, None)?;
        run(&st, job, Kind::Generate, ticket).await
    }
    .await;
    answer(&st, r)
}

async fn tokenize(st: &AppState, prompt: Prompt) -> Result<Vec<Vec<u32>>, ApiError> {
    let texts = match prompt {
        Prompt::Ids(ids) => return Ok(vec![ids]),
        Prompt::IdLists(l) => return Ok(l),
        Prompt::Text(t) => vec![t],
        Prompt::Texts(t) => t,
    };
    if texts.is_empty() {
        return Err(ApiError::bad("prompt must not be empty", Some("prompt")));
    }
    let tok = st.tok.clone();
    blocking(move || texts.iter().map(|t| tok.encode(t, true)).collect::<Result<Vec<_>, _>>())
        .await?
        .map_err(|e| ApiError::bad(format!("tokenizing the prompt: {e}"), Some("prompt")))
}

/// The response format.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
    Generate,
}

/// Aborts a request's choices (or inputs) that are still running when it goes away (a client
/// that disconnects drops it).
pub(crate) struct Guard {
    engine: Arc<EngineHandle>,
    ids: Vec<ReqId>,
    open: Vec<bool>,
}

impl Guard {
    pub(crate) fn new(engine: Arc<EngineHandle>) -> Guard {
        Guard { engine, ids: vec![], open: vec![] }
    }

    /// Guards engine request `id` as the next choice.
    pub(crate) fn push(&mut self, id: ReqId) {
        self.ids.push(id);
        self.open.push(true);
    }

    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    /// Choice `i` is over: the engine needs no abort for it (one is sent if it still runs).
    pub(crate) fn close(&mut self, i: usize) {
        if std::mem::take(&mut self.open[i]) {
            // A stop string ends a choice before the engine knows: stop it there too.
            self.engine.abort(self.ids[i]);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        for i in 0..self.ids.len() {
            self.close(i);
        }
    }
}

/// One choice as it accumulates.
#[derive(Default)]
struct Choice {
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish: Option<&'static str>,
    usage: (usize, usize, usize),
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
    role_sent: bool,
}

/// The request's choices, its guard, and what the format needs.
struct Answer {
    rx: UnboundedReceiver<(usize, Delta)>,
    guard: Guard,
    choices: Vec<Choice>,
    kind: Kind,
    n: usize,
    id: String,
    model: String,
    created: u64,
    start: Instant,
    st: Arc<AppState>,
    /// Counts the request as in flight until the response (or its stream) is dropped.
    _ticket: Ticket,
}

async fn run(st: &Arc<AppState>, job: Job, kind: Kind, ticket: Ticket) -> Result<Response, ApiError> {
    let start = Instant::now();
    let (tx, rx) = unbounded_channel();
    let mut guard = Guard::new(st.engine.clone());
    for (i, mut r) in job.requests.into_iter().enumerate() {
        if let Some(f) = job.format.clone() {
            let g = st.grammars.clone();
            r.constraint = Some(blocking(move || f.compile(g.as_deref())).await??);
        }
        let sink = st.detok.open(i, job.stops.clone(), r.prompt.len(), tx.clone());
        let engine = st.engine.clone();
        let id = blocking(move || engine.submit(r, sink)).await??;
        guard.push(id);
    }
    drop(tx);
    let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
    let mut a = Answer {
        choices: (0..guard.len()).map(|_| Choice::default()).collect(),
        rx,
        guard,
        kind,
        n: job.n,
        id: format!("{prefix}-{:x}{:06x}", st.created, st.next_id.fetch_add(1, Ordering::Relaxed)),
        model: st.model.clone(),
        created: now_secs(),
        start,
        st: st.clone(),
        _ticket: ticket,
    };
    // Echo: each choice's text starts with its prompt (streamed as a first chunk).
    let mut first = Vec::new();
    for (i, prompt) in job.echo.iter().flat_map(|p| std::iter::repeat_n(p, job.n)).enumerate() {
        a.choices[i].text = prompt.clone();
        if job.stream {
            first.push(a.chunk(i, prompt.clone(), vec![], None).to_string());
        }
    }
    if job.stream {
        return Ok(stream(a, job.include_usage, first));
    }
    while let Some((i, d)) = a.rx.recv().await {
        a.apply(i, d);
    }
    Ok(Json(a.whole()).into_response())
}

impl Answer {
    /// Records a delta; returns the text and logprobs it adds, and the finish reason if the
    /// choice ended.
    fn apply(&mut self, i: usize, d: Delta) -> (String, Vec<TokenLogprob>, Option<&'static str>) {
        let now = Instant::now();
        let c = &mut self.choices[i];
        match d {
            Delta::Text { text, tokens, logprobs } => {
                c.first.get_or_insert(now);
                c.last = Some(now);
                c.tokens += tokens;
                c.text += &text;
                c.logprobs.extend(logprobs.iter().cloned());
                (text, logprobs, None)
            }
            Delta::Done { reason, prompt_tokens, completion_tokens, cached_tokens } => {
                c.finish = Some(reason);
                c.usage = (prompt_tokens, completion_tokens, cached_tokens);
                let ttft = c.first.map(|f| (f - self.start).as_secs_f64());
                let tpot = match (c.first, c.last) {
                    (Some(f), Some(l)) if c.tokens > 1 => Some((l - f).as_secs_f64() / (c.tokens - 1) as f64),
                    _ => None,
                };
                self.st.metrics.finished(ttft, tpot);
                self.guard.close(i);
                (String::new(), vec![], Some(reason))
            }
        }
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

    /// The non-streamed response.
    fn whole(&self) -> Value {
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
                    Kind::Chat => json!({"index": i, "message": {"role": "assistant", "content": c.text},
                        "logprobs": lp, "finish_reason": c.finish}),
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

    /// The streamed chunk for a delta.
    fn chunk(&mut self, i: usize, text: String, lps: Vec<TokenLogprob>, finish: Option<&'static str>) -> Value {
        let asked = !lps.is_empty();
        match self.kind {
            Kind::Generate => {
                let c = &self.choices[i];
                json!({"text": c.text, "meta_info": self.meta(c)})
            }
            Kind::Chat => {
                let delta = if finish.is_some() {
                    json!({})
                } else if !std::mem::replace(&mut self.choices[i].role_sent, true) {
                    json!({"role": "assistant", "content": text})
                } else {
                    json!({"content": text})
                };
                json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [{"index": i, "delta": delta, "logprobs": self.logprobs(&lps, asked), "finish_reason": finish}]})
            }
            Kind::Completion => json!({"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [{"index": i, "text": text,
                "logprobs": self.logprobs(&lps, asked), "finish_reason": finish}]}),
        }
    }
}

/// Server-sent events: one chunk per delta, an optional usage chunk, then `[DONE]`.
fn stream(a: Answer, include_usage: bool, first: Vec<String>) -> Response {
    struct S {
        a: Answer,
        usage: bool,
        ended: bool,
        first: std::collections::VecDeque<String>,
    }
    let s = S { a, usage: include_usage, ended: false, first: first.into() };
    let events = futures_util::stream::unfold(s, |mut s| async move {
        if s.ended {
            return None;
        }
        if let Some(data) = s.first.pop_front() {
            return Some((Ok::<_, std::convert::Infallible>(SseEvent::default().data(data)), s));
        }
        let data = match s.a.rx.recv().await {
            Some((i, d)) => {
                let (text, lps, finish) = s.a.apply(i, d);
                s.a.chunk(i, text, lps, finish).to_string()
            }
            None if s.usage && s.a.kind != Kind::Generate => {
                s.usage = false;
                json!({"id": s.a.id, "object": if s.a.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
                    "created": s.a.created, "model": s.a.model, "choices": [], "usage": s.a.usage()})
                .to_string()
            }
            None => {
                s.ended = true;
                "[DONE]".to_string()
            }
        };
        Some((Ok::<_, std::convert::Infallible>(SseEvent::default().data(data)), s))
    });
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}
