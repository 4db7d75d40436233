//! OpenAI's `POST /v1/embeddings`: each input's final hidden state (after the model's final
//! norm), pooled over its tokens as the server was told (`--pooling last|mean`, last by
//! default) and L2-normalised. The inputs run through the same engine as generation, as
//! embedding requests ([`runtime::Request::embedding`]) that it batches together.

use crate::api::{check_model, Prompt, MAX_PROMPTS};
use crate::error::ApiError;
use crate::routes::{AppState, Guard};
use runtime::{Event, FinishReason, Request};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use tokio::sync::mpsc::unbounded_channel;

/// The fields the endpoint takes; any other is a 400 naming it.
const FIELDS: [&str; 5] = ["input", "model", "encoding_format", "dimensions", "user"];

/// How the vectors are written in the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    /// A JSON array of numbers.
    Float,
    /// The little-endian f32 bytes in base64 (what OpenAI's Python client asks for).
    Base64,
}

/// A checked `/v1/embeddings` body.
#[derive(Debug)]
struct EmbeddingRequest {
    input: Prompt,
    encoding: Encoding,
}

/// Checks the body's fields: known ones only, each of its type, `dimensions` (when given)
/// equal to the model's (the server does not truncate).
fn check(body: &Value, served: &str, hidden: usize) -> Result<EmbeddingRequest, ApiError> {
    let Value::Object(map) = body else {
        return Err(ApiError::bad("the request body must be a JSON object", None));
    };
    if let Some(k) = map.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(ApiError::bad_field(format!("unknown field `{k}` for /v1/embeddings"), k));
    }
    let model = string(map, "model")?;
    check_model(model.as_deref(), served)?;
    let _user = string(map, "user")?;
    let encoding = match string(map, "encoding_format")?.as_deref() {
        None | Some("float") => Encoding::Float,
        Some("base64") => Encoding::Base64,
        Some(other) => {
            return Err(ApiError::bad(
                format!("encoding_format must be `float` or `base64`, got `{other}`"),
                Some("encoding_format"),
            ))
        }
    };
    match map.get("dimensions") {
        None | Some(Value::Null) => {}
        Some(d) if d.as_u64() == Some(hidden as u64) => {}
        Some(d) => {
            return Err(ApiError::bad(
                format!("this model's embeddings have {hidden} dimensions (no truncation), got dimensions {d}"),
                Some("dimensions"),
            ))
        }
    }
    let input = map.get("input").cloned().unwrap_or(Value::Null);
    let input: Prompt = serde_json::from_value(input).map_err(|_| {
        ApiError::bad(
            "input must be a string, a list of strings, a list of token ids or a list of lists of token ids",
            Some("input"),
        )
    })?;
    Ok(EmbeddingRequest { input, encoding })
}

/// A string field, or `None` when absent or null.
fn string(map: &Map<String, Value>, key: &'static str) -> Result<Option<String>, ApiError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::bad(format!("`{key}` must be a string"), Some(key))),
    }
}

/// The inputs as token ids: texts tokenized as prompts are (special tokens added); each one
/// non-empty, inside the vocabulary and the context, at most [`MAX_PROMPTS`] of them.
async fn inputs(st: &AppState, input: Prompt) -> Result<Vec<Vec<u32>>, ApiError> {
    let bad = |m: String| Err(ApiError::bad(m, Some("input")));
    // Token ids as given, texts to tokenize.
    let given: Vec<Result<Vec<u32>, String>> = match input {
        Prompt::Ids(ids) => vec![Ok(ids)],
        Prompt::IdLists(l) => l.into_iter().map(Ok).collect(),
        Prompt::Text(t) => vec![Err(t)],
        Prompt::Texts(t) => t.into_iter().map(Err).collect(),
    };
    if given.is_empty() || given.len() > MAX_PROMPTS {
        return bad(format!("input must hold 1 to {MAX_PROMPTS} inputs, got {}", given.len()));
    }
    let tok = st.tok.clone();
    let ids: Vec<Vec<u32>> = crate::routes::blocking(move || {
        given
            .into_iter()
            .map(|g| g.or_else(|text| tok.encode(&text, true).map_err(|e| e.to_string())))
            .collect::<Result<Vec<_>, String>>()
    })
    .await?
    .map_err(|e: String| ApiError::bad(format!("tokenizing the input: {e}"), Some("input")))?;
    for (i, p) in ids.iter().enumerate() {
        if p.is_empty() {
            return bad(format!("input {i} is empty"));
        }
        if let Some(t) = p.iter().find(|&&t| t as usize >= st.vocab) {
            return bad(format!("input {i}: token id {t} is outside the vocabulary (size {})", st.vocab));
        }
        if p.len() > st.max_context {
            return bad(format!("input {i} has {} tokens; the context length is {}", p.len(), st.max_context));
        }
    }
    Ok(ids)
}

/// `POST /v1/embeddings` after authentication: the body checked, every input submitted as an
/// embedding request, the vectors in input order.
pub(crate) async fn embed(st: &Arc<AppState>, body: Value) -> Result<Value, ApiError> {
    let req = check(&body, &st.model, st.hidden)?;
    let prompts = inputs(st, req.input).await?;
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    let (tx, mut rx) = unbounded_channel();
    let mut guard = Guard::new(st.engine.clone());
    for (i, p) in prompts.into_iter().enumerate() {
        let tx = tx.clone();
        let sink = Box::new(move |e: Event| {
            let _ = tx.send((i, e));
        });
        let (engine, pooling) = (st.engine.clone(), st.pooling);
        let id = crate::routes::blocking(move || engine.submit(Request::embedding(p, pooling), sink)).await??;
        guard.push(id);
    }
    drop(tx);
    let mut vectors: Vec<Option<Vec<f32>>> = vec![None; guard.len()];
    while let Some((i, e)) = rx.recv().await {
        match e {
            Event::Embedding(v) => vectors[i] = Some(v),
            Event::Finished(f) => {
                guard.close(i);
                if f.reason == FinishReason::Abort {
                    return Err(ApiError::internal(format!("input {i} was aborted (the server is shutting down)")));
                }
            }
            Event::Token { .. } => {}
        }
    }
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let v = v.ok_or_else(|| ApiError::internal(format!("input {i} ended without an embedding")))?;
            Ok(json!({"object": "embedding", "index": i, "embedding": encode(&v, req.encoding)}))
        })
        .collect::<Result<Vec<Value>, ApiError>>()?;
    Ok(json!({
        "object": "list",
        "data": data,
        "model": st.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
}

/// One vector as the response writes it.
fn encode(v: &[f32], encoding: Encoding) -> Value {
    match encoding {
        Encoding::Float => json!(v),
        Encoding::Base64 => {
            use base64::Engine as _;
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
        }
    }
}
