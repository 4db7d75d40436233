//! Tool calling in Llama's and Mistral's dialects, with their real tokenizers and chat templates
//! (Llama 3.2's and Mistral Nemo's, fetched by scripts/fetch-tokenizer.sh): the server's
//! rendering of tools and tool-calling turns equals Hugging Face's
//! (tests/fixtures/tool-templates, made by scripts/make-tool-fixtures.py), and through
//! `engrun serve` on the random-weight tiny-vocab131k checkpoint (sampled at temperature 1)
//! `tool_choice: required` or a named function always gives calls in the dialect, read back
//! into `tool_calls` whose arguments follow the schema, streamed as the whole answer's.

use e2e::*;
use serde_json::{json, Value};
use server::dialect::{Dialect, ToolSyntax};

const DIALECTS: [(&str, Dialect); 2] = [("llama3_2", Dialect::Llama), ("mistral_nemo", Dialect::Mistral)];

fn cases(name: &str) -> Vec<Value> {
    let path = fixture("tool-templates").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).unwrap();
    v["cases"].as_array().unwrap().clone()
}

/// A case's messages as a client sends them: call arguments as JSON strings.
fn openai_messages(case: &Value) -> Value {
    let mut m = case["messages"].clone();
    for msg in m.as_array_mut().unwrap() {
        for c in msg.get_mut("tool_calls").and_then(Value::as_array_mut).into_iter().flatten() {
            let args = c["function"]["arguments"].to_string();
            c["function"]["arguments"] = Value::String(args);
        }
    }
    m
}

fn case<'a>(cases: &'a [Value], name: &str) -> &'a Value {
    cases.iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no case {name}"))
}

#[test]
fn tools_and_turns_render_as_hugging_face_does() {
    for (name, dialect) in DIALECTS {
        let tok = text::Tokenizer::load(&real_tokenizer(name)).unwrap();
        let syntax = ToolSyntax::of_template(tok.chat_template_source());
        assert_eq!(syntax, ToolSyntax::Native(dialect), "{name}");
        for c in cases(name) {
            let tools = server::tools::parse(Some(&c["tools"]), None, None).unwrap().unwrap();
            let req: server::api::ChatRequest =
                serde_json::from_value(json!({"messages": openai_messages(&c)})).unwrap();
            let (messages, extra) = req.template_input(syntax, Some(&tools)).unwrap();
            let mut extra = extra.unwrap();
            extra["date_string"] = json!("26 Jul 2024");
            let text = tok.apply_chat_template(&messages, true, Some(&extra)).unwrap();
            assert_eq!(text, c["text"].as_str().unwrap(), "{name} {}", c["name"]);
            let ids = tok.encode_chat_with(&messages, true, Some(&extra)).unwrap();
            let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
            assert_eq!(ids, want, "{name} {}", c["name"]);
        }
    }
    // Mistral's template wants 9-character ids: the client's are made so, a call and its
    // result alike.
    let tok = text::Tokenizer::load(&real_tokenizer("mistral_nemo")).unwrap();
    let c = case(&cases("mistral_nemo"), "round_trip").clone();
    let mut m = openai_messages(&c);
    m[1]["tool_calls"][0]["id"] = json!("call_7f3a-b2c4d5e6");
    m[2]["tool_call_id"] = json!("call_7f3a-b2c4d5e6");
    let tools = server::tools::parse(Some(&c["tools"]), None, None).unwrap().unwrap();
    let req: server::api::ChatRequest = serde_json::from_value(json!({"messages": m})).unwrap();
    let (messages, extra) = req.template_input(ToolSyntax::Native(Dialect::Mistral), Some(&tools)).unwrap();
    let text = tok.apply_chat_template(&messages, true, extra.as_ref()).unwrap();
    assert_eq!(text, c["text"].as_str().unwrap().replace("call00001", "ab2c4d5e6"));
}

/// A bundle of the tiny-vocab131k checkpoint with `name`'s real tokenizer.
fn bundle(name: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let out = dir.join(format!("{name}.bundle"));
    let opts = compiler::CompileOptions {
        model: repo().join("models/llama.yaml"),
        checkpoint: fixture("tiny-vocab131k"),
        tp: 1,
        dtype: None,
        tokenizer: Some(real_tokenizer(name)),
        out: out.clone(),
        dump_after: None,
        quant: None,
        lm_head: compiler::LmHead::default(),
    };
    compiler::compile(&opts).unwrap_or_else(|e| panic!("compiling tiny-vocab131k with {name}: {e}"));
    out
}

/// Whether arguments follow the fixtures' schemas.
fn validates(name: &str, arguments: &str) -> bool {
    let Ok(Value::Object(a)) = serde_json::from_str::<Value>(arguments) else { return false };
    let known = |keys: &[&str]| a.keys().all(|k| keys.contains(&k.as_str()));
    match name {
        "get_weather" => {
            known(&["city", "unit", "days"])
                && a.get("city").is_some_and(|c| c.as_str().is_some_and(|c| c.chars().count() <= 10))
                && a.get("unit").is_none_or(|u| u == "celsius" || u == "fahrenheit")
                && a.get("days").is_none_or(|d| json_int_in(d, 1, 7))
        }
        "get_time" => {
            known(&["zone"]) && a.get("zone").is_some_and(|z| z.as_str().is_some_and(|z| z.chars().count() <= 10))
        }
        _ => false,
    }
}

/// Each choice's calls (name, arguments), checked: finish `tool_calls`, ids of the dialect.
fn calls_of(r: &Value, dialect: Dialect) -> Vec<Vec<(String, String)>> {
    let choices = r["choices"].as_array().unwrap_or_else(|| panic!("no choices: {r}"));
    let id_ok = |id: &str| match dialect {
        Dialect::Mistral => id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()),
        _ => id.starts_with("call_"),
    };
    let mut out = vec![];
    for c in choices {
        assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        assert_eq!(c["message"]["content"], Value::Null, "{c}");
        let calls = c["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("no tool_calls: {c}"));
        let mut got = vec![];
        for t in calls {
            assert!(t["id"].as_str().is_some_and(id_ok), "{t}");
            let (name, args) = (t["function"]["name"].as_str().unwrap(), t["function"]["arguments"].as_str().unwrap());
            assert!(validates(name, args), "{name}: {args}");
            got.push((name.to_string(), args.to_string()));
        }
        out.push(got);
    }
    out
}

/// `tools` with every string argument at most 10 characters and no undeclared argument (a
/// random model would write strings, and keys, to the length limit).
fn bounded(tools: &Value) -> Value {
    let mut t = tools.clone();
    for f in t.as_array_mut().unwrap() {
        f["function"]["parameters"]["additionalProperties"] = json!(false);
        for p in f["function"]["parameters"]["properties"].as_object_mut().unwrap().values_mut() {
            if p["type"] == "string" && p.get("enum").is_none() {
                p["maxLength"] = json!(10);
            }
        }
    }
    t
}

#[test]
fn required_and_named_calls_in_each_dialect() {
    for (name, dialect) in DIALECTS {
        let dir = scratch(env!("CARGO_TARGET_TMPDIR"), &format!("dialect-{name}"));
        let server = Server::start(&bundle(name, &dir), &[]);
        let c = case(&cases(name), "question").clone();
        let tools = bounded(&c["tools"]);
        let post = |extra: Value| {
            let mut body = json!({"messages": c["messages"], "tools": tools, "temperature": 1.0, "max_tokens": 200});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            let (status, r) = post_json(&server.addr, "/v1/chat/completions", &body);
            assert_eq!(status, 200, "{name}: {r}\nserver log:\n{}", server.log());
            r
        };
        let mut names = std::collections::HashSet::new();
        let mut most = 0;
        for calls in calls_of(&post(json!({"tool_choice": "required", "n": 12, "seed": 1})), dialect) {
            most = most.max(calls.len());
            names.extend(calls.into_iter().map(|(n, _)| n));
        }
        assert_eq!(names.len(), 2, "{name}: sampling picks among the tools: {names:?}");
        assert!(most > 1, "{name}: parallel calls are allowed by default");
        let one = post(json!({"tool_choice": "required", "n": 6, "seed": 2, "parallel_tool_calls": false}));
        assert!(calls_of(&one, dialect).iter().all(|c| c.len() == 1), "{name}: {one}");
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        let r = post(json!({"tool_choice": named, "n": 4, "seed": 3}));
        assert!(calls_of(&r, dialect).iter().all(|c| c.len() == 1 && c[0].0 == "get_time"), "{name}: {r}");

        // Streamed: the same calls as the whole answer with the same seed.
        let whole = post(json!({"tool_choice": "required", "seed": 5}));
        let want = calls_of(&whole, dialect).remove(0);
        let mut body = json!({"messages": c["messages"], "tools": tools, "temperature": 1.0, "max_tokens": 200,
            "tool_choice": "required", "seed": 5, "stream": true});
        let (status, raw) = http(&server.addr, "POST", "/v1/chat/completions", Some(&body.to_string()), &[]);
        assert_eq!(status, 200, "{raw}");
        let mut got = vec![];
        for d in sse_data(&raw).iter().filter(|d| *d != "[DONE]") {
            let chunk: Value = serde_json::from_str(d).unwrap();
            for t in chunk["choices"][0]["delta"]["tool_calls"].as_array().into_iter().flatten() {
                got.push((
                    t["function"]["name"].as_str().unwrap().to_string(),
                    t["function"]["arguments"].as_str().unwrap().to_string(),
                ));
            }
        }
        assert_eq!(got, want, "{name}");

        // The round trip's history reaches the model as the template renders it.
        let tok = text::Tokenizer::load(&real_tokenizer(name)).unwrap();
        let rt = case(&cases(name), "round_trip").clone();
        body = json!({"messages": openai_messages(&rt), "tools": rt["tools"], "max_tokens": 2});
        let (status, r) = post_json(&server.addr, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{r}");
        let req: server::api::ChatRequest = serde_json::from_value(body).unwrap();
        let tools = server::tools::parse(Some(&rt["tools"]), None, None).unwrap();
        let (messages, extra) = req.template_input(ToolSyntax::Native(dialect), tools.as_ref()).unwrap();
        let want = tok.encode_chat_with(&messages, true, extra.as_ref()).unwrap().len();
        assert_eq!(r["usage"]["prompt_tokens"].as_u64(), Some(want as u64), "{name}");
    }
}
