//! Tool calling through `engrun serve` on the CPU. The random-weight tiny-qwen2 fixture, sampled
//! at temperature 1, would never call a tool by itself: with `tool_choice: required` or a named
//! function every answer is calls whose arguments follow the function's schema
//! (`finish_reason: tool_calls`), streamed as `delta.tool_calls` equal to the whole answer's.
//! The tools reach the model through its chat template (Qwen's takes them); a template that
//! does not take them (SmolLM2's, in tiny-llama) gets the same text, written by the server, as
//! Qwen's template writes it.

use e2e::*;
use serde_json::{json, Value};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "unit", "days"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "plan_trip",
            "parameters": {"type": "object", "properties": {
                "stops": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
                    "name": {"type": "string", "maxLength": 8}, "nights": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["name", "nights"], "additionalProperties": false}},
                "budget": {"type": "integer", "minimum": 0, "maximum": 5000},
                "direct": {"type": "boolean"}},
            "required": ["stops", "budget", "direct"], "additionalProperties": false}}},
    ])
}

/// Whether a call's arguments (a JSON string) follow its function's schema; the reason if not.
fn validates(name: &str, arguments: &str) -> Result<(), String> {
    let a: Value = serde_json::from_str(arguments).map_err(|e| format!("arguments are not JSON ({e})"))?;
    let o = a.as_object().ok_or("arguments are not an object")?;
    let short = |v: &Value, n: usize| v.as_str().is_some_and(|s| s.chars().count() <= n);
    let keys = |o: &serde_json::Map<String, Value>| {
        let mut k: Vec<String> = o.keys().cloned().collect();
        k.sort();
        k
    };
    let ok = match name {
        "get_weather" => {
            keys(o) == ["city", "days", "unit"]
                && short(&o["city"], 12)
                && (o["unit"] == "celsius" || o["unit"] == "fahrenheit")
                && json_int_in(&o["days"], 1, 7)
        }
        "plan_trip" => {
            let stops = o.get("stops").and_then(Value::as_array);
            keys(o) == ["budget", "direct", "stops"]
                && json_int_in(&o["budget"], 0, 5000)
                && o["direct"].is_boolean()
                && stops.is_some_and(|s| {
                    s.len() <= 3
                        && s.iter().all(|x| {
                            x.as_object().is_some_and(|x| {
                                keys(x) == ["name", "nights"] && short(&x["name"], 8) && json_int_in(&x["nights"], 1, 9)
                            })
                        })
                })
        }
        other => return Err(format!("a call of `{other}`, not a declared function")),
    };
    if ok {
        Ok(())
    } else {
        Err(format!("{name}'s arguments break its schema"))
    }
}

fn post(server: &Server, body: &Value) -> (u16, Value) {
    post_json(&server.addr, "/v1/chat/completions", body)
}

/// Each choice's calls as (name, arguments), checked: finish `tool_calls`, no content, ids.
fn calls_of(r: &Value) -> Vec<Vec<(String, String)>> {
    let choices = r["choices"].as_array().unwrap_or_else(|| panic!("no choices: {r}"));
    choices
        .iter()
        .map(|c| {
            assert_eq!(c["finish_reason"], "tool_calls", "{c}");
            assert_eq!(c["message"]["content"], Value::Null, "{c}");
            let calls = c["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("no tool_calls: {c}"));
            assert!(!calls.is_empty(), "{c}");
            calls
                .iter()
                .map(|t| {
                    assert!(
                        t["id"].as_str().is_some_and(|id| id.starts_with("call_")) && t["type"] == "function",
                        "{t}"
                    );
                    let f = &t["function"];
                    (
                        f["name"].as_str().unwrap_or_default().to_string(),
                        f["arguments"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect()
        })
        .collect()
}

#[test]
fn required_and_named_choices_always_call_with_valid_arguments() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "tools");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let server = Server::start(&b, &[]);
    let msgs = json!([{"role": "user", "content": "Plan my week."}]);
    let ask = |choice: Value, extra: Value| {
        let mut body = json!({"messages": msgs, "tools": tools(), "tool_choice": choice, "temperature": 1.0,
            "n": 16, "max_tokens": 400});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, r) = post(&server, &body);
        assert_eq!(status, 200, "{r}");
        calls_of(&r)
    };
    let mut names = std::collections::HashSet::new();
    let mut most = 0;
    for seed in [1, 2] {
        for calls in ask(json!("required"), json!({"seed": seed})) {
            most = most.max(calls.len());
            for (name, args) in calls {
                validates(&name, &args).unwrap_or_else(|e| panic!("{e}: {args}"));
                names.insert(name);
            }
        }
    }
    assert_eq!(names.len(), 2, "sampling picks among the tools: {names:?}");
    assert!(most > 1, "parallel calls are allowed by default");
    // One call each without parallel calls; only the named function when one is named.
    for calls in ask(json!("required"), json!({"parallel_tool_calls": false, "seed": 3})) {
        assert_eq!(calls.len(), 1, "{calls:?}");
        validates(&calls[0].0, &calls[0].1).unwrap_or_else(|e| panic!("{e}"));
    }
    let named = json!({"type": "function", "function": {"name": "plan_trip"}});
    for calls in ask(named, json!({"seed": 4})) {
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert_eq!(calls[0].0, "plan_trip");
        validates(&calls[0].0, &calls[0].1).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The calls of a streamed answer, put together from its `delta.tool_calls`, equal the
/// non-streamed answer with the same seed.
#[test]
fn streamed_calls_equal_the_whole_answer() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "tools-stream");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let server = Server::start(&b, &[]);
    let body = json!({"messages": [{"role": "user", "content": "Go."}], "tools": tools(), "tool_choice": "required",
        "temperature": 1.0, "seed": 7, "max_tokens": 400});
    let (_, whole) = post(&server, &body);
    let want = calls_of(&whole).remove(0);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, raw) = http(&server.addr, "POST", "/v1/chat/completions", Some(&streamed.to_string()), &[]);
    assert_eq!(status, 200, "{raw}");
    let chunks: Vec<Value> =
        sse_data(&raw).iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
    let mut got: Vec<(String, String)> = vec![];
    let mut finish = None;
    for (k, c) in chunks.iter().enumerate() {
        let choice = &c["choices"][0];
        if k == 0 {
            assert_eq!(choice["delta"]["role"], "assistant", "{c}");
        }
        for t in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            assert_eq!(t["index"].as_u64(), Some(got.len() as u64), "{t}");
            assert!(t["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{t}");
            got.push((
                t["function"]["name"].as_str().unwrap().into(),
                t["function"]["arguments"].as_str().unwrap().into(),
            ));
        }
        assert!(choice["delta"].get("content").is_none_or(|t| t == ""), "content in a call-only answer: {c}");
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(got, want);
    assert_eq!(finish.as_deref(), Some("tool_calls"));
}

/// The prompt is the chat template's rendering with `tools` (Qwen's template); a template
/// without tools (SmolLM2's, in tiny-llama) gets the tools and the tool-calling turns as text
/// identical to what Qwen's template writes.
#[test]
fn tools_and_turns_reach_the_prompt() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "tools-prompt");
    let history = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\", \"days\": 1}"}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
    ]);
    let tools = server::tools::parse(Some(&tools()), None, None).unwrap().unwrap();
    let parsed: server::api::ChatRequest = serde_json::from_value(json!({"messages": history})).unwrap();
    let qwen = text::Tokenizer::load(&fixtures().join("tiny-qwen2")).unwrap();
    let plain = text::Tokenizer::load(&fixtures().join("tiny-llama/tokenizer")).unwrap();
    let render = |tok: &text::Tokenizer, syntax| {
        let (messages, extra) = parsed.template_input(syntax, Some(&tools)).unwrap();
        tok.apply_chat_template(&messages, true, extra.as_ref()).unwrap()
    };
    use server::dialect::{Dialect, ToolSyntax};
    assert_eq!(ToolSyntax::of_template(qwen.chat_template_source()), ToolSyntax::Native(Dialect::Hermes));
    assert_eq!(ToolSyntax::of_template(plain.chat_template_source()), ToolSyntax::Generic);
    let native = render(&qwen, ToolSyntax::Native(Dialect::Hermes));
    assert!(
        native.starts_with("<|im_start|>system\n# Tools\n") && native.contains("<tool_response>\n18 C\n"),
        "{native}"
    );
    assert_eq!(render(&plain, ToolSyntax::Generic), native, "the server's text differs from Qwen's template's");

    // Through the servers: the prompt is that rendering.
    for (fixture, tok) in [("tiny-qwen2", &qwen), ("tiny-llama", &plain)] {
        let b = compile_fixture(fixture, &dir.join(fixture), 1, None);
        let server = Server::start(&b, &[]);
        let want = tok.encode(&native, false).unwrap().len();
        let body = json!({"messages": history, "tools": tools.declared, "max_tokens": 2, "temperature": 0});
        let (status, r) = post(&server, &body);
        assert_eq!(status, 200, "{r}");
        assert_eq!(
            r["usage"]["prompt_tokens"].as_u64(),
            Some(want as u64),
            "{fixture}: the prompt is not the rendering"
        );
        // tool_choice none: the model is not told about the tools.
        let (_, r) = post(
            &server,
            &json!({"messages": history, "tools": tools.declared, "tool_choice": "none", "max_tokens": 2}),
        );
        assert!(r["usage"]["prompt_tokens"].as_u64() < Some(want as u64), "{fixture}: {r}");
    }
}

#[test]
fn bad_tool_requests_are_400s_naming_their_field() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "tools-errors");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let server = Server::start(&b, &[]);
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let named = |n: &str| json!({"type": "function", "function": {"name": n}});
    let cases = [
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"tools": tools(), "tool_choice": named("nope")}), "tool_choice"),
        (json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}), "tools"),
        (json!({"tools": tools(), "parallel_tool_calls": "yes"}), "parallel_tool_calls"),
        (json!({"tools": tools(), "response_format": {"type": "json_object"}}), "response_format"),
        (json!({"tools": tools(), "tool_choice": "required", "ignore_eos": true}), "ignore_eos"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            "tool_choice": "required"}),
            "tools",
        ),
        (json!({"functions": [{"name": "f"}]}), "functions"),
    ];
    for (extra, param) in cases {
        let mut body = json!({"messages": msgs, "max_tokens": 4});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, r) = post(&server, &body);
        assert_eq!((status, r["error"]["param"].as_str()), (400, Some(param)), "{extra}: {r}");
    }
    // Still serving; tools with a format are fine when the model may not call them.
    let body = json!({"messages": msgs, "max_tokens": 4, "tools": tools(), "tool_choice": "none",
        "response_format": {"type": "json_object"}});
    assert_eq!(post(&server, &body).0, 200);
}
