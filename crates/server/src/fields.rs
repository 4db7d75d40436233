//! Which top-level fields of a request body the server takes: each field is used, accepted as
//! harmless (`user`, `metadata`, `store`, `service_tier`: they do not change the answer), or
//! refused with a 400 naming it. A field that would change the result and is not implemented
//! is refused, never accepted and ignored; so is a field the endpoint does not know.

use crate::error::ApiError;
use serde_json::{Map, Value};

/// The endpoint a body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
    /// SGLang's `POST /generate`.
    Generate,
}

/// The sampling and stopping fields (`api::Sampling`): at the top level of the OpenAI
/// endpoints, in `sampling_params` of `/generate`.
const SAMPLING: [&str; 16] = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "regex",
    "json_schema",
    "ebnf",
    "guided_grammar",
];

/// `/generate`'s top-level fields; its `sampling_params` takes [`SAMPLING`] and
/// `max_new_tokens` (SGLang's names).
const GENERATE: [&str; 4] = ["text", "input_ids", "sampling_params", "stream"];

/// The other fields of both OpenAI endpoints that the server implements.
const USED: [&str; 8] =
    ["model", "max_tokens", "n", "stream", "stream_options", "logprobs", "logit_bias", "response_format"];

/// The JSON type a field takes (null is always accepted: the default).
#[derive(Clone, Copy)]
enum Ty {
    Number,
    Integer,
    Bool,
    String,
    Object,
    /// A string or a list of strings (`stop`).
    Strings,
    /// A list of non-negative integers (`stop_token_ids`).
    Ids,
    /// A boolean or an integer (`logprobs`: chat's flag, completions' count).
    BoolOrInt,
}

/// The types of the fields the server reads, checked before the body is typed so that a
/// wrong type is a 400 naming its field.
const TYPES: [(&str, Ty); 26] = [
    ("regex", Ty::String),
    ("ebnf", Ty::String),
    ("guided_grammar", Ty::String),
    ("response_format", Ty::Object),
    ("model", Ty::String),
    ("max_tokens", Ty::Integer),
    ("max_completion_tokens", Ty::Integer),
    ("temperature", Ty::Number),
    ("top_p", Ty::Number),
    ("top_k", Ty::Integer),
    ("min_p", Ty::Number),
    ("frequency_penalty", Ty::Number),
    ("presence_penalty", Ty::Number),
    ("repetition_penalty", Ty::Number),
    ("seed", Ty::Integer),
    ("stop", Ty::Strings),
    ("stop_token_ids", Ty::Ids),
    ("ignore_eos", Ty::Bool),
    ("n", Ty::Integer),
    ("stream", Ty::Bool),
    ("stream_options", Ty::Object),
    ("logprobs", Ty::BoolOrInt),
    ("top_logprobs", Ty::Integer),
    ("logit_bias", Ty::Object),
    ("min_tokens", Ty::Integer),
    ("suffix", Ty::String),
];

impl Ty {
    fn admits(self, v: &Value) -> bool {
        let ids = |a: &Vec<Value>| a.iter().all(|x| x.as_u64().is_some_and(|t| t <= u32::MAX as u64));
        match (self, v) {
            (Ty::Number, Value::Number(_)) | (Ty::Bool, Value::Bool(_)) | (Ty::String, Value::String(_)) => true,
            (Ty::Integer, Value::Number(n)) => n.is_i64() || n.is_u64(),
            (Ty::Object, Value::Object(_)) | (Ty::Strings, Value::String(_)) => true,
            (Ty::Strings, Value::Array(a)) => a.iter().all(Value::is_string),
            (Ty::Ids, Value::Array(a)) => ids(a),
            (Ty::BoolOrInt, Value::Bool(_)) => true,
            (Ty::BoolOrInt, Value::Number(n)) => n.is_i64(),
            _ => false,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Ty::Number => "a number",
            Ty::Integer => "an integer",
            Ty::Bool => "a boolean",
            Ty::String => "a string",
            Ty::Object => "an object",
            Ty::Strings => "a string or a list of strings",
            Ty::Ids => "a list of token ids",
            Ty::BoolOrInt => "a boolean or an integer",
        }
    }
}

/// Fields accepted without effect on the answer.
const HARMLESS: [&str; 4] = ["user", "metadata", "store", "service_tier"];

/// Checks every top-level field of `body` (a JSON object) for `endpoint`.
pub fn check(body: &Map<String, Value>, endpoint: Endpoint) -> Result<(), ApiError> {
    let own: &[&str] = match endpoint {
        Endpoint::Chat => {
            &["messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"]
        }
        Endpoint::Completions => &["prompt", "suffix"],
        Endpoint::Generate => return check_generate(body),
    };
    for (key, v) in body {
        let k = key.as_str();
        if SAMPLING.contains(&k) || USED.contains(&k) || own.contains(&k) || HARMLESS.contains(&k) {
            continue;
        }
        if conditional(k, v, body, endpoint)? {
            return Err(refused(k));
        }
    }
    if body.get("model").is_some_and(|m| !m.is_string()) {
        return Err(ApiError::bad("model must be a string", Some("model")));
    }
    check_types(body)?;
    if endpoint == Endpoint::Chat
        && body.contains_key("top_logprobs")
        && !body.get("logprobs").is_some_and(|l| l == &Value::Bool(true))
    {
        return Err(ApiError::bad("top_logprobs needs logprobs: true", Some("top_logprobs")));
    }
    Ok(())
}

/// `/generate`: only the fields it implements, at the top level and in `sampling_params` (an
/// unknown one is a 400 naming it, `sampling_params.NAME`).
fn check_generate(body: &Map<String, Value>) -> Result<(), ApiError> {
    if let Some(k) = body.keys().find(|k| !GENERATE.contains(&k.as_str())) {
        return Err(refused(k));
    }
    let Some(sp) = body.get("sampling_params").filter(|v| !v.is_null()) else { return Ok(()) };
    let Some(sp) = sp.as_object() else {
        return Err(ApiError::bad("sampling_params must be an object", Some("sampling_params")));
    };
    if let Some(k) = sp.keys().find(|k| !SAMPLING.contains(&k.as_str()) && k.as_str() != "max_new_tokens") {
        let name = format!("sampling_params.{k}");
        return Err(ApiError::bad_field(format!("`{name}`: unrecognized or not supported by this server"), &name));
    }
    check_types(sp)
}

/// The JSON type of every field of [`TYPES`] that `fields` has (null passes).
fn check_types(fields: &Map<String, Value>) -> Result<(), ApiError> {
    for (k, ty) in TYPES {
        if let Some(v) = fields.get(k).filter(|v| !v.is_null() && !ty.admits(v)) {
            return Err(ApiError::bad_field(format!("`{k}` must be {}, got {v}", ty.name()), k));
        }
    }
    Ok(())
}

/// Whether field `k` is refused: fields accepted at their neutral values only give `false`
/// there, `true` where the value asks for something not implemented (and for unknown fields),
/// and an error where the value is invalid.
fn conditional(k: &str, v: &Value, body: &Map<String, Value>, endpoint: Endpoint) -> Result<bool, ApiError> {
    let null_or = |ok: &dyn Fn(&Value) -> bool| v.is_null() || ok(v);
    // Unknown fields fall through to the last arm.
    Ok(match (k, endpoint) {
        ("echo", Endpoint::Completions) => {
            let logprobs = body.get("logprobs").is_some_and(|l| !l.is_null());
            if v == &Value::Bool(true) && logprobs {
                return Err(ApiError::bad(
                    "`echo` with `logprobs` (the prompt's logprobs) is not supported",
                    Some("echo"),
                ));
            }
            if v == &Value::Bool(true) && body.get("suffix").and_then(Value::as_str).is_some_and(|s| !s.is_empty()) {
                return Err(ApiError::bad(
                    "`suffix` with `echo` is not supported: the completion is the middle, which the prompt does \
                     not end with",
                    Some("suffix"),
                ));
            }
            !(v.is_null() || v.is_boolean())
        }
        ("best_of", Endpoint::Completions) => !null_or(&|v| v.as_i64() == Some(1)),
        _ => true,
    })
}

/// Fields of OpenAI's API (or SGLang's / vLLM's extensions) that this server does not
/// implement yet.
const NOT_YET: [&str; 6] = ["echo", "best_of", "functions", "function_call", "prediction", "modalities"];

/// The 400 of a field the server does not implement (or know), naming it.
fn refused(k: &str) -> ApiError {
    let what = match k {
        "functions" | "function_call" => "deprecated by OpenAI and not supported: send `tools` and `tool_choice`",
        _ if NOT_YET.contains(&k) => "this value is not supported by this server",
        _ => "unrecognized request argument",
    };
    ApiError::bad_field(format!("`{k}`: {what}"), k)
}
