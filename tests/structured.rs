//! Structured outputs through `engrun serve` on the CPU: a model that would never write the
//! format by itself (the random-weight tiny-qwen2 fixture, sampled at temperature 1) answers
//! JSON valid under the schema (`response_format` of chat, SGLang's `json_schema` of
//! `/generate`), text the regular expression matches whole (SGLang's `regex`, an extra field of
//! `/v1/completions`), any JSON object (`json_object`); invalid schemas, expressions and
//! combinations are 400s naming their field.

use e2e::*;
use serde_json::{json, Value};

/// Strings of at most 8 characters, an enum, bounded integers, an array of at most 3 short
/// strings, a nested object: everything bounded, so every output ends.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "minimum": 1, "maximum": 99},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
            "inner": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "level": {"type": "integer", "minimum": -5, "maximum": 5}},
                "required": ["ok", "level"],
                "additionalProperties": false
            }
        },
        "required": ["name", "color", "size", "tags", "inner"],
        "additionalProperties": false
    })
}

/// Whether `text` is JSON valid under [`schema`] (checked field by field); the reason if not.
fn validates(text: &str) -> Result<(), String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON ({e})"))?;
    let o = v.as_object().ok_or("not an object")?;
    let keys: Vec<&str> = o.keys().map(String::as_str).collect();
    let mut sorted = keys.clone();
    sorted.sort();
    if sorted != ["color", "inner", "name", "size", "tags"] {
        return Err(format!("keys {keys:?}"));
    }
    let short = |v: &Value, n: usize| v.as_str().is_some_and(|s| s.chars().count() <= n);
    let tags = o["tags"].as_array().ok_or("tags is not an array")?;
    let inner = o["inner"].as_object().ok_or("inner is not an object")?;
    let checks = [
        ("name", short(&o["name"], 8)),
        ("color", ["red", "green", "blue"].iter().any(|c| o["color"] == *c)),
        ("size", json_int_in(&o["size"], 1, 99)),
        ("tags", tags.len() <= 3 && tags.iter().all(|t| short(t, 5))),
        ("inner", inner.len() == 2 && inner.get("ok").is_some_and(Value::is_boolean)),
        ("inner.level", inner.get("level").is_some_and(|l| json_int_in(l, -5, 5))),
    ];
    match checks.iter().find(|(_, ok)| !ok) {
        Some((what, _)) => Err(format!("{what} breaks the schema")),
        None => Ok(()),
    }
}

fn post(server: &Server, path: &str, body: &Value) -> (u16, Value) {
    post_json(&server.addr, path, body)
}

/// Every choice's text and finish reason.
fn choices(r: &Value, key: &str) -> Vec<(String, String)> {
    r["choices"]
        .as_array()
        .unwrap_or_else(|| panic!("no choices: {r}"))
        .iter()
        .map(|c| {
            let text = if key == "message" { &c["message"]["content"] } else { &c["text"] };
            (text.as_str().unwrap_or_default().to_string(), c["finish_reason"].as_str().unwrap_or_default().to_string())
        })
        .collect()
}

#[test]
fn outputs_follow_schemas_and_expressions_at_temperature_1() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "structured");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let server = Server::start(&b, &[]);
    let msgs = json!([{"role": "user", "content": "Describe a thing."}]);
    let rf = json!({"type": "json_schema", "json_schema": {"name": "thing", "strict": true, "schema": schema()}});
    let mut replies = vec![];
    for seed in [1, 2] {
        let body = json!({"messages": msgs, "response_format": rf, "temperature": 1.0, "n": 16, "seed": seed, "max_tokens": 300});
        let (status, r) = post(&server, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{r}");
        replies.extend(choices(&r, "message"));
    }
    // SGLang's /generate with `json_schema` as a string.
    let body = json!({"text": "A thing:", "sampling_params": {"json_schema": schema().to_string(), "temperature": 1.0, "max_new_tokens": 300}});
    let (status, r) = post(&server, "/generate", &body);
    assert_eq!(status, 200, "{r}");
    replies.push((r["text"].as_str().unwrap_or_default().to_string(), "stop".into()));
    for (text, finish) in &replies {
        assert_eq!(finish, "stop", "{text}");
        validates(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    }
    let distinct: std::collections::HashSet<&String> = replies.iter().map(|r| &r.0).collect();
    assert!(distinct.len() > 16, "sampling still varies inside the schema: {distinct:?}");

    // A regular expression, as an extra field of /v1/completions.
    let rx = regex::Regex::new("^[a-z]{3,6}-[0-9]{2}( [A-Z]{1,4})?$").unwrap();
    let body = json!({"prompt": "Code:", "regex": "[a-z]{3,6}-[0-9]{2}( [A-Z]{1,4})?", "temperature": 1.0, "n": 16, "max_tokens": 64, "seed": 3});
    let (status, r) = post(&server, "/v1/completions", &body);
    assert_eq!(status, 200, "{r}");
    for (text, finish) in choices(&r, "text") {
        assert!(rx.is_match(&text) && finish == "stop", "{text:?} ({finish})");
    }
    // A grammar in GBNF (SGLang's `ebnf`, on /generate) and one in Lark (vLLM's
    // `guided_grammar`, on /v1/completions).
    let gbnf = "root ::= item (\",\" item){0,3}\nitem ::= [a-c]{1,4} \"=\" [0-9]{1,2} # a comment\n";
    let rx = regex::Regex::new("^[a-c]{1,4}=[0-9]{1,2}(,[a-c]{1,4}=[0-9]{1,2}){0,3}$").unwrap();
    for seed in 0..8 {
        let body = json!({"text": "Pairs:", "sampling_params": {"ebnf": gbnf, "temperature": 1.0, "seed": seed, "max_new_tokens": 64}});
        let (status, r) = post(&server, "/generate", &body);
        let text = r["text"].as_str().unwrap_or_default();
        assert!(status == 200 && rx.is_match(text), "{status} {text:?}: {r}");
    }
    let lark = "start: \"(\" NUM (\"+\" NUM)? (\"+\" NUM)? \")\"\nNUM: /[0-9]{1,3}/\n";
    let rx = regex::Regex::new(r"^\([0-9]{1,3}(\+[0-9]{1,3}){0,2}\)$").unwrap();
    let body =
        json!({"prompt": "Sum:", "guided_grammar": lark, "temperature": 1.0, "n": 8, "max_tokens": 32, "seed": 5});
    let (status, r) = post(&server, "/v1/completions", &body);
    assert_eq!(status, 200, "{r}");
    for (text, finish) in choices(&r, "text") {
        assert!(rx.is_match(&text) && finish == "stop", "{text:?} ({finish})");
    }
    // Any JSON object; one that runs out of tokens ends by length with what it has.
    let body = json!({"messages": msgs, "response_format": {"type": "json_object"}, "temperature": 1.0, "n": 4, "max_tokens": 400});
    let (_, r) = post(&server, "/v1/chat/completions", &body);
    for (text, finish) in choices(&r, "message") {
        match finish.as_str() {
            // Well-formed JSON (IgnoredAny reads numbers by their syntax: JSON has no range, and
            // a random model writes exponents past f64's), an object.
            "stop" => {
                assert!(text.starts_with('{') && serde_json::from_str::<serde::de::IgnoredAny>(&text).is_ok(), "{text}")
            }
            "length" => assert!(text.starts_with('{'), "{text}"),
            other => panic!("finish {other}: {text}"),
        }
    }
}

#[test]
fn invalid_formats_are_400s_naming_their_field() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "structured-errors");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let server = Server::start(&b, &[]);
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let chat = |extra: Value| {
        let mut body = json!({"messages": msgs, "max_tokens": 4});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        post(&server, "/v1/chat/completions", &body)
    };
    let cases = [
        (json!({"response_format": {"type": "json_schema"}}), "response_format"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}),
            "response_format",
        ),
        (json!({"response_format": {"type": "bogus"}}), "response_format"),
        (json!({"regex": "(unclosed"}), "regex"),
        (json!({"json_schema": "{not json"}), "json_schema"),
        (json!({"regex": "a+", "response_format": {"type": "json_object"}}), "regex"),
        (json!({"regex": "a+", "ignore_eos": true}), "ignore_eos"),
        (json!({"regex": "a+", "min_tokens": 3}), "min_tokens"),
        (json!({"ebnf": "root ::= ( \"a\""}), "ebnf"),
        (json!({"ebnf": "item ::= \"a\""}), "ebnf"),
        (json!({"guided_grammar": "start: undefined_rule"}), "guided_grammar"),
        (json!({"ebnf": "root ::= \"a\"", "regex": "a"}), "ebnf"),
    ];
    for (extra, param) in cases {
        let (status, r) = chat(extra.clone());
        assert_eq!((status, r["error"]["param"].as_str()), (400, Some(param)), "{extra}: {r}");
    }
    // Still serving, and text needs no format.
    let (status, r) = chat(json!({"response_format": {"type": "text"}}));
    assert_eq!(status, 200, "{r}");
}
