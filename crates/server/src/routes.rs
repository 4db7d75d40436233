//! The HTTP routes: OpenAI's chat and completions, SGLang's `/generate`, models, health and
//! metrics. Tokenization runs on tokio's blocking pool, detokenization on its own thread;
//! handlers only move JSON.

use crate::answer::{stream, Answer, Choice, Step};
use crate::api::{
    check_model, ChatRequest, CompletionRequest, DetokenizeRequest, GenerateRequest, Job, ModelLimits, Prompt,
    TokenizeRequest, COMPLETIONS_MAX_TOKENS,
};
use crate::detok::Detokenizer;
use crate::drain::{Drain, Ticket};
use crate::error::ApiError;
use crate::fields::{self, Endpoint};
use crate::fim::{self, Fim};
use crate::metrics::Metrics;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use runtime::{EngineHandle, ReqId};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use text::Tokenizer;
use tokio::sync::mpsc::unbounded_channel;

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
    /// How the chat template takes tools and tool-calling turns.
    pub tool_syntax: crate::dialect::ToolSyntax,
    /// The ids of the tool dialect's markers, where each is a token of its own
    /// ([`crate::tools::Tools::grammar`]).
    pub tool_tokens: Option<Vec<u32>>,
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
        let tools =
            crate::tools::parse(req.tools.as_ref(), req.tool_choice.as_ref(), req.parallel_tool_calls.as_ref())?;
        let (messages, extra) = req.template_input(st.tool_syntax, tools.as_ref())?;
        let top = req.top_logprobs()?;
        let tok = st.tok.clone();
        let ids = blocking(move || tok.encode_chat_with(&messages, true, extra.as_ref()))
            .await?
            .map_err(|e| ApiError::bad(format!("chat template: {e}"), Some("messages")))?;
        let mut job = req.params.job(vec![ids], top, st.limits(), "messages", None)?;
        if let Some(t) = &tools {
            t.apply(&mut job, &req.params.sampling, st.tool_syntax.dialect(), st.tool_tokens.as_deref())?;
        }
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
pub(crate) enum Kind {
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

async fn run(st: &Arc<AppState>, job: Job, kind: Kind, ticket: Ticket) -> Result<Response, ApiError> {
    let start = Instant::now();
    let (tx, rx) = unbounded_channel();
    let mut guard = Guard::new(st.engine.clone());
    for (i, mut r) in job.requests.into_iter().enumerate() {
        if let Some(f) = job.format.clone() {
            let g = st.grammars.clone();
            r.constraint = Some(blocking(move || f.compile(g.as_deref())).await??);
        }
        let keep_special = job.tool_calls.is_some_and(|d| d.keeps_special());
        let sink = st.detok.open(i, job.stops.clone(), r.prompt.len(), keep_special, tx.clone());
        let engine = st.engine.clone();
        let id = blocking(move || engine.submit(r, sink)).await??;
        guard.push(id);
    }
    drop(tx);
    let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
    let mut a = Answer {
        choices: (0..guard.len()).map(|_| Choice::new(job.tool_calls)).collect(),
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
            let step = Step::text(prompt.clone());
            first.extend(a.chunks(i, step).iter().map(Value::to_string));
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
