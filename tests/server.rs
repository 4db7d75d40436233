//! `engrun serve` end to end on the CPU: the official `openai` package drives it (SmolLM2's
//! chat golden over HTTP, streaming, n, stop strings, logprobs; CJK and emoji with the Qwen
//! tokenizer); SGLang's `/generate` and the sampling fields each change the output as the
//! engine does; `suffix` (fill-in-the-middle) gives the engine the PSM prompt; concurrent requests with different sampling settings each equal the same
//! request alone; `--max-running-requests`; every error case answers its status, type, param
//! and message in OpenAI's shape; 200 concurrent streaming clients with a third disconnecting;
//! SIGTERM (503 for new requests while the ones in flight finish).

use e2e::*;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;

fn python() -> String {
    let o = Command::new("bash").arg(repo().join("scripts/pyenv.sh")).output().expect("run scripts/pyenv.sh");
    assert!(o.status.success(), "installing the openai package failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap().trim().to_string()
}

fn client(server: &Server, args: &[&str]) {
    let o = Command::new(python())
        .arg(repo().join("tests/openai_client.py"))
        .arg(server.base())
        .args(args)
        .output()
        .expect("run the openai client");
    assert!(
        o.status.success(),
        "openai client failed:\n{}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
        server.log()
    );
}

#[test]
fn openai_package_drives_smollm2() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-smollm2");
    let b = smollm2_bundle(&dir);
    let g: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("smollm2-135m").join("reference/chat_goldens.json")).unwrap(),
    )
    .unwrap();
    let server = Server::start(&b, &["--api-key", "test-key", "--served-model-name", "smol"]);
    let (q, a) = (g[0]["question"].as_str().unwrap(), g[0]["greedy_text"].as_str().unwrap());
    client(&server, &["smol", "smollm2", q, a]);
}

/// Also the error cases as the `openai` package reads them (type, param, code).
#[test]
fn cjk_and_emoji_stream_without_broken_characters() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-qwen");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let server = Server::start(&b, &["--api-key", "test-key"]);
    client(&server, &["tiny-qwen2-tp1", "unicode"]);
}

/// The error object of a response body in OpenAI's shape: message, type and param.
fn error_of(body: &str) -> (String, String, Option<String>) {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    let e = &v["error"];
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{body}");
    let text = |k: &str| e[k].as_str().unwrap_or_else(|| panic!("no `{k}` string in {body}")).to_string();
    (text("message"), text("type"), e["param"].as_str().map(String::from))
}

/// Method, path, body, then the status, `type`, `param` and a part of the message expected.
type ErrorCase<'a> = (&'a str, &'a str, String, u16, &'a str, Option<&'a str>, &'a str);

/// Every error case of docs/server.md's list: status, OpenAI's `type`, `param` and message.
#[test]
fn errors_have_status_type_param_and_message() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-errors");
    let b = compile_fixture("tiny-llama", &dir, 1, None);
    let server = Server::start(&b, &["--api-key", "k", "--served-model-name", "tiny"]);
    let auth = [("Authorization", "Bearer k")];
    let msgs = r#""messages": [{"role": "user", "content": "hi"}]"#;
    let long: Vec<String> = (0..8200).map(|_| "7".to_string()).collect();
    let long_prompt = format!(r#"{{"prompt": [{}], "max_tokens": 1}}"#, long.join(","));
    let long_ids = format!(r#"{{"input_ids": [{}]}}"#, long.join(","));
    let stops: Vec<String> = (0..17).map(|i| format!("\"s{i}\"")).collect();
    let huge = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(3 << 20));
    let bad = "invalid_request_error";
    let chat = "/v1/chat/completions";
    #[rustfmt::skip]
    let cases: Vec<ErrorCase> = vec![
        ("POST", chat, "{not json".into(), 400, bad, None, "invalid JSON body"),
        ("POST", chat, "[1, 2]".into(), 400, bad, None, "must be a JSON object"),
        ("POST", chat, r#"{"messages": [{"role": "wizard", "content": "x"}]}"#.into(), 400, bad, Some("messages"), "role must be system, developer, user, assistant or tool"),
        ("POST", chat, r#"{"messages": [{"role": "user", "content": null}]}"#.into(), 400, bad, Some("messages"), "(user) has no content"),
        ("POST", chat, r#"{"messages": [{"role": "user"}]}"#.into(), 400, bad, Some("messages"), "(user) has no content"),
        // Malformed tool-calling turns (tests/tools.rs renders good ones).
        ("POST", chat, r#"{"messages": [{"role": "tool", "content": "1"}]}"#.into(), 400, bad, Some("messages"), "needs a `tool_call_id`"),
        ("POST", chat, r#"{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "a"}]}]}"#.into(), 400, bad, Some("messages"), "tool_calls[0].type"),
        ("POST", chat, r#"{"messages": [{"role": "user", "content": "x", "tool_calls": []}]}"#.into(), 400, bad, Some("messages"), "only assistant messages have tool_calls"),
        ("POST", chat, r#"{"messages": [{"role": "function", "content": "1"}]}"#.into(), 400, bad, Some("messages"), "user, assistant or tool"),
        ("POST", chat, format!(r#"{{{msgs}, "model": null}}"#), 400, bad, Some("model"), "model must be a string"),
        ("POST", chat, format!(r#"{{{msgs}, "logit_bias": {{"five": -100}}}}"#), 400, bad, Some("logit_bias"), "keys must be token ids"),
        ("POST", chat, format!(r#"{{{msgs}, "logit_bias": {{"5": 300}}}}"#), 400, bad, Some("logit_bias"), "must be in [-100, 100]"),
        ("POST", chat, format!(r#"{{{msgs}, "logit_bias": {{"99999999": 1}}}}"#), 400, bad, Some("logit_bias"), "outside the vocabulary"),
        ("POST", chat, format!(r#"{{{msgs}, "logit_bias": [1]}}"#), 400, bad, Some("logit_bias"), "must be an object"),
        ("POST", chat, format!(r#"{{{msgs}, "response_format": {{"type": "bogus"}}}}"#), 400, bad, Some("response_format"), "must be text, json_object or json_schema"),
        ("POST", chat, format!(r#"{{{msgs}, "response_format": {{"type": "json_schema", "json_schema": {{}}}}}}"#), 400, bad, Some("response_format"), "needs `json_schema.schema`"),
        ("POST", chat, format!(r#"{{{msgs}, "tool_choice": "required"}}"#), 400, bad, Some("tool_choice"), "needs tools"),
        ("POST", chat, format!(r#"{{{msgs}, "tools": [{{"type": "function", "function": {{"name": "f"}}}}], "tool_choice": {{"type": "function", "function": {{"name": "g"}}}}}}"#), 400, bad, Some("tool_choice"), "not among the tools"),
        ("POST", chat, format!(r#"{{{msgs}, "functions": [{{"name": "f"}}]}}"#), 400, bad, Some("functions"), "send `tools`"),
        ("POST", chat, format!(r#"{{{msgs}, "top_logprobs": 2}}"#), 400, bad, Some("top_logprobs"), "needs logprobs: true"),
        ("POST", chat, format!(r#"{{{msgs}, "stop_token_ids": [99999999]}}"#), 400, bad, Some("stop_token_ids"), "outside the vocabulary"),
        ("POST", chat, format!(r#"{{{msgs}, "frobnicate": 1}}"#), 400, bad, Some("frobnicate"), "unrecognized request argument"),
        ("POST", chat, format!(r#"{{{msgs}, "temperature": "hot"}}"#), 400, bad, Some("temperature"), "`temperature` must be a number"),
        ("POST", chat, format!(r#"{{{msgs}, "stop_token_ids": [-1]}}"#), 400, bad, Some("stop_token_ids"), "must be a list of token ids"),
        ("POST", chat, format!(r#"{{{msgs}, "n": 1.5}}"#), 400, bad, Some("n"), "`n` must be an integer"),
        ("POST", "/v1/completions", r#"{"prompt": {"x": 1}}"#.into(), 400, bad, Some("prompt"), "prompt must be a string, a list of strings"),
        ("POST", "/v1/completions", r#"{"prompt": "x", "echo": true, "logprobs": 2}"#.into(), 400, bad, Some("echo"), "`echo` with `logprobs`"),
        ("POST", "/v1/completions", r#"{"prompt": "x", "suffix": "y"}"#.into(), 400, bad, Some("suffix"), "no fill-in-the-middle tokens"),
        ("POST", "/v1/completions", r#"{"prompt": [1, 2], "suffix": "y"}"#.into(), 400, bad, Some("suffix"), "no fill-in-the-middle tokens"),
        ("POST", "/v1/completions", r#"{"prompt": "x", "suffix": 5}"#.into(), 400, bad, Some("suffix"), "`suffix` must be a string"),
        ("POST", "/v1/completions", r#"{"prompt": "x", "suffix": "y", "echo": true}"#.into(), 400, bad, Some("suffix"), "`suffix` with `echo`"),
        ("POST", "/v1/completions", r#"{"prompt": "x", "best_of": 3}"#.into(), 400, bad, Some("best_of"), "not supported"),
        ("POST", "/v1/completions", format!(r#"{{"prompt": [{}]}}"#, vec![r#""a""#; 257].join(",")), 400, bad, Some("prompt"), "at most 256 prompts"),
        ("GET", "/v1/models/gpt-9", String::new(), 404, bad, Some("model"), "`gpt-9` does not exist"),
        ("POST", "/detokenize", r#"{"tokens": [99999999]}"#.into(), 400, bad, Some("tokens"), "outside the vocabulary"),
        ("POST", "/tokenize", r#"{"prompt": "x", "model": "gpt-9"}"#.into(), 404, bad, Some("model"), "`gpt-9` does not exist"),
        ("POST", "/detokenize", r#"{"tokens": [1], "model": "gpt-9"}"#.into(), 404, bad, Some("model"), "`gpt-9` does not exist"),
        ("POST", "/tokenize", r#"{"text": "x"}"#.into(), 400, bad, Some("text"), "unknown field `text`"),
        ("POST", "/generate", r#"{"text": "x", "return_logprob": true}"#.into(), 400, bad, Some("return_logprob"), "unrecognized"),
        ("POST", "/generate", r#"{"text": "x", "sampling_params": {"return_logprob": true}}"#.into(), 400, bad, Some("sampling_params.return_logprob"), "not supported"),
        ("POST", "/generate", r#"{"text": "x", "sampling_params": {"temperature": "0"}}"#.into(), 400, bad, Some("temperature"), "must be a number"),
        ("POST", chat, r#"{"model": "tiny"}"#.into(), 400, bad, None, "missing field `messages`"),
        ("POST", "/v1/completions", r#"{"model": "tiny"}"#.into(), 400, bad, None, "missing field `prompt`"),
        ("POST", chat, r#"{"messages": []}"#.into(), 400, bad, Some("messages"), "messages must not be empty"),
        ("POST", chat, r#"{"messages": [{"content": "x"}]}"#.into(), 400, bad, Some("messages"), "has no `role`"),
        ("POST", chat, r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#.into(), 400, bad, Some("messages"), "only text parts"),
        ("POST", chat, r#"{"messages": [{"role": "user", "content": 7}]}"#.into(), 400, bad, Some("messages"), "a string or a list of text parts"),
        ("POST", chat, format!(r#"{{"model": "gpt-9", {msgs}}}"#), 404, bad, Some("model"), "`gpt-9` does not exist"),
        ("POST", "/v1/completions", long_prompt, 400, bad, Some("prompt"), "fills the context length"),
        ("POST", "/generate", long_ids, 400, bad, Some("input_ids"), "fills the context length"),
        ("POST", chat, format!(r#"{{{msgs}, "max_tokens": 100000}}"#), 400, bad, Some("max_tokens"), "exceeds the context length"),
        ("POST", chat, format!(r#"{{{msgs}, "max_tokens": -3}}"#), 400, bad, Some("max_tokens"), "max_tokens must be"),
        ("POST", chat, format!(r#"{{{msgs}, "temperature": -0.5}}"#), 400, bad, Some("temperature"), "temperature must be"),
        ("POST", chat, format!(r#"{{{msgs}, "top_p": 1.5}}"#), 400, bad, Some("top_p"), "top_p must be"),
        ("POST", chat, format!(r#"{{{msgs}, "top_k": -2}}"#), 400, bad, Some("top_k"), "top_k must be"),
        ("POST", chat, format!(r#"{{{msgs}, "min_p": 1.5}}"#), 400, bad, Some("min_p"), "min_p must be"),
        ("POST", chat, format!(r#"{{{msgs}, "repetition_penalty": 0}}"#), 400, bad, Some("repetition_penalty"), "repetition_penalty must be"),
        ("POST", chat, format!(r#"{{{msgs}, "frequency_penalty": 3}}"#), 400, bad, Some("frequency_penalty"), "frequency_penalty must be"),
        ("POST", chat, format!(r#"{{{msgs}, "presence_penalty": -3}}"#), 400, bad, Some("presence_penalty"), "presence_penalty must be"),
        ("POST", chat, format!(r#"{{{msgs}, "n": 17}}"#), 400, bad, Some("n"), "n must be in [1, 16]"),
        ("POST", chat, format!(r#"{{{msgs}, "stop": [{}]}}"#, stops.join(",")), 400, bad, Some("stop"), "at most 16 non-empty"),
        ("POST", chat, format!(r#"{{{msgs}, "stop": ""}}"#), 400, bad, Some("stop"), "at most 16 non-empty"),
        ("POST", chat, format!(r#"{{{msgs}, "logprobs": 3}}"#), 400, bad, Some("logprobs"), "logprobs must be a boolean"),
        ("POST", chat, format!(r#"{{{msgs}, "logprobs": true, "top_logprobs": 21}}"#), 400, bad, Some("top_logprobs"), "top_logprobs must be in [0, 20]"),
        ("POST", "/v1/completions", r#"{"prompt": "x", "logprobs": 21}"#.into(), 400, bad, Some("logprobs"), "logprobs must be in [0, 20]"),
        ("POST", "/v1/completions", r#"{"prompt": "x", "logprobs": true}"#.into(), 400, bad, Some("logprobs"), "logprobs must be an integer"),
        ("POST", "/v1/completions", r#"{"prompt": [99999999]}"#.into(), 400, bad, Some("prompt"), "outside the vocabulary"),
        ("POST", "/v1/completions", r#"{"prompt": []}"#.into(), 400, bad, Some("prompt"), "prompt must not be empty"),
        ("POST", "/v1/completions", r#"{"prompt": [[]]}"#.into(), 400, bad, Some("prompt"), "the prompt is empty"),
        ("POST", "/generate", r#"{"sampling_params": {}}"#.into(), 400, bad, Some("text"), "exactly one of `text` and `input_ids`"),
        ("POST", "/generate", r#"{"text": "a", "input_ids": [1]}"#.into(), 400, bad, Some("text"), "exactly one of `text` and `input_ids`"),
        ("POST", "/generate", r#"{"text": "a", "sampling_params": {"max_new_tokens": 0}}"#.into(), 400, bad, Some("max_new_tokens"), "max_new_tokens must be"),
        ("POST", "/v1/completions", huge, 413, bad, None, "reading the request body"),
        ("POST", "/v1/no-such-route", "{}".into(), 404, bad, None, "Invalid URL (POST /v1/no-such-route)"),
        ("GET", "/", String::new(), 404, bad, None, "Invalid URL (GET /)"),
        ("GET", chat, String::new(), 405, bad, None, "Invalid URL (GET /v1/chat/completions)"),
    ];
    for (method, path, body, status, kind, param, msg) in cases {
        let (got, text) = http(&server.addr, method, path, Some(&body), &auth);
        let what = format!("{method} {path} {}", &body[..body.len().min(80)]);
        assert_eq!(got, status, "{what}: {text}");
        let (m, t, p) = error_of(&text);
        assert!(m.contains(msg), "{what}: `{m}` does not mention `{msg}`");
        assert_eq!((t.as_str(), p.as_deref()), (kind, param), "{what}: type and param of {text}");
    }
    for headers in [vec![], vec![("Authorization", "Bearer wrong")]] {
        let (got, text) = http(&server.addr, "POST", chat, Some(&format!("{{{msgs}}}")), &headers);
        assert_eq!(got, 401, "{text}");
        let (m, t, _) = error_of(&text);
        assert!(m.contains("API key") && t == bad, "{text}");
        assert!(text.contains(r#""code":"invalid_api_key""#), "{text}");
    }
    // Still serving.
    let (got, text) = http(&server.addr, "POST", chat, Some(&format!(r#"{{{msgs}, "max_tokens": 3}}"#)), &auth);
    assert_eq!(got, 200, "{text}");
    assert_eq!(http(&server.addr, "GET", "/health", None, &[]).0, 200);
}

fn metric(server: &Server, name: &str) -> f64 {
    let (_, text) = http(&server.addr, "GET", "/metrics", None, &[]);
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
}

/// One streaming client: reads until `[DONE]`, or disconnects after its first chunk.
fn stream_client(addr: &str, i: usize, disconnect: bool) -> bool {
    let body = format!(
        r#"{{"prompt": "client {i} says", "max_tokens": 24, "temperature": 0.7, "seed": {i}, "ignore_eos": true, "stream": true}}"#
    );
    stream_completion(addr, &body, disconnect)
}

/// Streams a completion: reads until `[DONE]` (then: whether the answer was a 200 that ended
/// by length), or disconnects after its first chunk (then: true).
fn stream_completion(addr: &str, body: &str, disconnect: bool) -> bool {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).unwrap_or(0);
        if n == 0 {
            return false;
        }
        seen += &String::from_utf8_lossy(&buf[..n]);
        if disconnect && seen.contains("data: {") {
            return true;
        }
        if seen.contains("data: [DONE]") {
            return seen.starts_with("HTTP/1.1 200") && seen.contains(r#""finish_reason":"length""#);
        }
    }
}

fn wait_idle(server: &Server) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while metric(server, "engine_running_requests") + metric(server, "engine_queue_requests") > 0.0 {
        assert!(std::time::Instant::now() < deadline, "the engine does not become idle");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn load_200_streaming_clients_a_third_disconnecting() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-load");
    let b = compile_fixture("tiny-llama", &dir, 1, None);
    let server = Server::start(&b, &["--max-total-tokens", "8192"]);
    let round = |server: &Server| {
        let addr = server.addr.clone();
        let threads: Vec<_> = (0..200)
            .map(|i| {
                let addr = addr.clone();
                std::thread::spawn(move || stream_client(&addr, i, i % 3 == 0))
            })
            .collect();
        let ok = threads.into_iter().map(|t| t.join().unwrap()).filter(|&ok| ok).count();
        assert_eq!(ok, 200, "every client completes (or disconnects) cleanly: {}", server.log());
        wait_idle(server);
        assert_eq!(metric(server, "engine_kv_pages_private"), 0.0);
        assert_eq!(metric(server, "engine_step_errors_total"), 0.0, "integrity check failed: {}", server.log());
        metric(server, "process_resident_memory_bytes")
    };
    let first = round(&server);
    let second = round(&server);
    assert!(second <= first + 32e6, "memory grows round after round: {first} then {second}");
    assert!(metric(&server, "engine_requests_total") >= 400.0);
}

/// Waits (at most 10 s) until the engine runs `n` requests.
fn wait_running(server: &Server, n: f64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while metric(server, "engine_running_requests") != n {
        assert!(std::time::Instant::now() < deadline, "the engine never runs {n} requests: {}", server.log());
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// SIGTERM while a request streams: new requests (and /health) get 503 in OpenAI's shape, the
/// request in flight streams to its end, then the server exits 0.
#[test]
fn sigterm_answers_503_while_requests_in_flight_finish_then_exits() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-sigterm");
    let b = compile_fixture("tiny-llama", &dir, 1, None);
    let mut server = Server::start(&b, &[]);
    let addr = server.addr.clone();
    // About 4 s of decoding at the tiny model's speed: long enough to be in flight throughout.
    let body = r#"{"prompt": "go on", "max_tokens": 4000, "ignore_eos": true, "stream": true}"#;
    let t = std::thread::spawn(move || stream_completion(&addr, body, false));
    wait_running(&server, 1.0);
    assert!(server.terminate(0).is_none(), "the server exited at once: {}", server.log());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let health = loop {
        let (status, text) = http(&server.addr, "GET", "/health", None, &[]);
        if status != 200 || std::time::Instant::now() > deadline {
            break (status, text);
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    let requests = [
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": 2}"#),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}"#),
        ("/generate", r#"{"text": "hi"}"#),
    ];
    for (path, (status, text)) in std::iter::once(("/health", health))
        .chain(requests.iter().map(|(path, body)| (*path, http(&server.addr, "POST", path, Some(body), &[]))))
    {
        assert_eq!(status, 503, "{path} during shutdown: {text}\n{}", server.log());
        let (m, t, _) = error_of(&text);
        assert!(m.contains("shutting down") && t == "server_error", "{path}: {text}");
    }
    assert_eq!(metric(&server, "engine_running_requests"), 1.0, "the request in flight ended early");
    assert!(t.join().unwrap(), "the request in flight completes: {}", server.log());
    let status = server.terminate(60).expect("the server exits after SIGTERM");
    assert!(status.success(), "{status:?}: {}", server.log());
    assert!(server.log().contains("shut down"), "{}", server.log());
}

/// With `--graceful-shutdown-timeout 1`, a request still streaming a second after SIGTERM is
/// aborted: its stream ends with `finish_reason: "abort"` long before its 8000 tokens, and the
/// server exits 0.
#[test]
fn shutdown_timeout_aborts_the_requests_in_flight() {
    use std::io::{Read, Write};
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-shutdown-timeout");
    let b = compile_fixture("tiny-llama", &dir, 1, None);
    let mut server = Server::start(&b, &["--graceful-shutdown-timeout", "1"]);
    let body = r#"{"prompt": "go on", "max_tokens": 8000, "ignore_eos": true, "stream": true}"#;
    let mut s = std::net::TcpStream::connect(&server.addr).unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    wait_running(&server, 1.0);
    let t0 = std::time::Instant::now();
    assert!(server.terminate(0).is_none(), "the server exited at once: {}", server.log());
    let mut seen = String::new();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    let _ = s.read_to_string(&mut seen);
    let took = t0.elapsed().as_secs_f64();
    assert!(
        seen.contains(r#""finish_reason":"abort""#),
        "no abort in the stream: {}",
        &seen[seen.len().saturating_sub(400)..]
    );
    assert!(seen.contains("[DONE]"), "the stream did not end properly");
    assert!((0.8..10.0).contains(&took), "aborted after {took:.1} s, not about 1 s");
    let status = server.terminate(30).expect("the server exits");
    assert!(status.success(), "{status:?}: {}", server.log());
    assert!(server.log().contains("aborting the 1 requests still in flight"), "{}", server.log());
}

/// A client that disconnects mid-stream has its request aborted at once, pages freed.
#[test]
fn disconnect_aborts_at_once() {
    use std::io::{Read, Write};
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-disconnect");
    let b = compile_fixture("tiny-llama", &dir, 1, None);
    let server = Server::start(&b, &[]);
    let body = r#"{"prompt": "go on", "max_tokens": 6000, "ignore_eos": true, "stream": true}"#;
    let mut s = std::net::TcpStream::connect(&server.addr).unwrap();
    let req = format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    s.write_all(req.as_bytes()).unwrap();
    let mut buf = [0u8; 1024];
    let n = s.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    wait_running(&server, 1.0);
    drop(s);
    let t = std::time::Instant::now();
    wait_idle(&server);
    assert!(t.elapsed() < std::time::Duration::from_secs(2), "abort took {:?}", t.elapsed());
    assert_eq!(metric(&server, "engine_kv_pages_private"), 0.0);
    // The tokens it generated before the disconnect count.
    let generated = metric(&server, "engine_generation_tokens_total");
    assert!(generated >= 1.0, "the aborted request's tokens are not counted: {generated}");
    assert!(metric(&server, "engine_prompt_tokens_total") >= 2.0);
}

/// POSTs `body` as JSON and returns the 200 answer as JSON.
fn post(server: &Server, path: &str, body: &Value) -> Value {
    let (status, text) = http(&server.addr, "POST", path, Some(&body.to_string()), &[]);
    assert_eq!(status, 200, "{path} {body}: {text}\n{}", server.log());
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}"))
}

/// The engine itself (in this process, on the CPU) and the bundle's tokenizer: what the server
/// must match.
struct Reference {
    engine: runtime::Engine,
    tok: text::Tokenizer,
}

impl Reference {
    fn new(bundle: &Path) -> Reference {
        let b = bundle::Bundle::open(bundle).expect("bundle opens");
        let tok = text::Tokenizer::load(&b.tokenizer_dir().expect("a tokenizer")).expect("tokenizer loads");
        let backend = runtime::load(&b, runtime::Device::Cpu, &[]).expect("CPU backend");
        let cfg = runtime::EngineConfig { kv_slots: Some(4096), ..runtime::EngineConfig::for_bundle(&b).unwrap() };
        Reference { engine: runtime::Engine::new(backend, cfg).expect("engine"), tok }
    }

    /// The tokens of `prompt` continued with `sampling`, eos ignored.
    fn tokens(&mut self, prompt: &[u32], sampling: runtime::SamplingParams, max_tokens: usize) -> Vec<u32> {
        let req =
            runtime::Request { ignore_eos: true, sampling, ..runtime::Request::greedy(prompt.to_vec(), max_tokens) };
        self.engine.generate(vec![req]).expect("generate").remove(0).tokens
    }

    fn text(&self, tokens: &[u32]) -> String {
        self.tok.decode(tokens, true).expect("decode")
    }
}

/// `sampling_params` of `/generate`: `max_new_tokens`, eos ignored, and `extra`.
fn sampling_params(max_new_tokens: usize, extra: Value) -> Value {
    let mut v = json!({"max_new_tokens": max_new_tokens, "ignore_eos": true});
    v.as_object_mut().unwrap().extend(extra.as_object().expect("an object").clone());
    v
}

/// A penalty field, a value, and the engine's parameters with it.
type Penalty = (&'static str, f32, fn(f32) -> runtime::SamplingParams);

/// SGLang's `/generate` (text, input_ids, stream) and the sampling fields over HTTP: each
/// checked where ignoring it would show (top_k = 1 and min_p = 1 at temperature 2 are greedy
/// while the same seed without them is not; stop_token_ids ends the text where that token
/// comes; penalties change the greedy text as the engine does with the same setting).
#[test]
fn generate_endpoint_and_sampling_fields() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-fields");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let server = Server::start(&b, &[]);
    let mut r = Reference::new(&b);
    let text = "The quick brown fox";
    let prompt = r.tok.encode(text, true).unwrap();
    let n = 24;
    let greedy = r.tokens(&prompt, runtime::SamplingParams::default(), n);
    let greedy_text = r.text(&greedy);
    let generate = |prompt: Value, extra: Value| {
        let mut body = json!({"sampling_params": sampling_params(n, extra)});
        body.as_object_mut().unwrap().extend(prompt.as_object().unwrap().clone());
        post(&server, "/generate", &body)
    };
    // Text and token ids give the engine's greedy text, with SGLang's meta_info.
    for p in [json!({"text": text}), json!({"input_ids": prompt})] {
        let g = generate(p.clone(), json!({"temperature": 0}));
        assert_eq!(g["text"], greedy_text, "{p}");
        let m = &g["meta_info"];
        assert_eq!(
            (m["prompt_tokens"].as_u64(), m["completion_tokens"].as_u64()),
            (Some(prompt.len() as u64), Some(n as u64))
        );
        assert_eq!(m["finish_reason"]["type"], "length", "{g}");
    }
    // Streamed: the text so far in every event, then [DONE].
    let body =
        json!({"input_ids": prompt, "sampling_params": sampling_params(n, json!({"temperature": 0})), "stream": true});
    let (status, raw) = http(&server.addr, "POST", "/generate", Some(&body.to_string()), &[]);
    assert_eq!(status, 200, "{raw}");
    let events = sse_data(&raw);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{raw}");
    let events: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(events.len() > 2, "{raw}");
    for w in events.windows(2) {
        assert!(w[1]["text"].as_str().unwrap().starts_with(w[0]["text"].as_str().unwrap()), "not cumulative: {raw}");
    }
    let last = events.last().unwrap();
    assert_eq!((&last["text"], &last["meta_info"]["finish_reason"]["type"]), (&json!(greedy_text), &json!("length")));
    // top_k = 1 and min_p = 1 keep only the most likely token: greedy, whatever the temperature.
    let hot = json!({"temperature": 2.0, "seed": 5});
    let sampled = generate(json!({"input_ids": prompt}), hot.clone())["text"].clone();
    assert_ne!(sampled, greedy_text, "temperature 2 gave the greedy text: the checks below prove nothing");
    for (field, v) in [("top_k", json!(1)), ("min_p", json!(1.0))] {
        let mut extra = hot.clone();
        extra[field] = v;
        assert_eq!(generate(json!({"input_ids": prompt}), extra)["text"], greedy_text, "{field}");
    }
    // stop_token_ids: the text ends where the last token's first occurrence would come (on
    // the repetition-penalised greedy tokens: the plain greedy ones repeat one token).
    let rep = json!({"temperature": 0, "repetition_penalty": 1.5});
    let varied = r.tokens(&prompt, runtime::SamplingParams { repetition_penalty: 1.5, ..Default::default() }, n);
    let k = (0..n).rev().find(|&i| !varied[..i].contains(&varied[i])).unwrap();
    assert!(k > 0, "the tokens are one token repeated: {varied:?}");
    let before = r.text(&varied[..k]);
    let mut stop = rep.clone();
    stop["stop_token_ids"] = json!([varied[k]]);
    let g = generate(json!({"input_ids": prompt}), stop.clone());
    assert_eq!((&g["text"], &g["meta_info"]["finish_reason"]["type"]), (&json!(before), &json!("stop")), "{g}");
    let mut body = json!({"prompt": prompt, "max_tokens": n, "ignore_eos": true});
    body.as_object_mut().unwrap().extend(stop.as_object().unwrap().clone());
    let c = post(&server, "/v1/completions", &body);
    assert_eq!((&c["choices"][0]["text"], &c["choices"][0]["finish_reason"]), (&json!(before), &json!("stop")), "{c}");
    // Penalties: the greedy text changes, to what the engine gives with the same setting.
    let penalties: [Penalty; 3] = [
        ("repetition_penalty", 1.5, |v| runtime::SamplingParams { repetition_penalty: v, ..Default::default() }),
        ("frequency_penalty", 1.0, |v| runtime::SamplingParams { frequency_penalty: v, ..Default::default() }),
        ("presence_penalty", 1.0, |v| runtime::SamplingParams { presence_penalty: v, ..Default::default() }),
    ];
    for (field, v, params) in penalties {
        let tokens = r.tokens(&prompt, params(v), n);
        let want = r.text(&tokens);
        assert_ne!(want, greedy_text, "{field} {v} does not change the greedy text");
        let mut body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": true});
        body[field] = json!(v);
        assert_eq!(post(&server, "/v1/completions", &body)["choices"][0]["text"], want, "{field} on /v1/completions");
        let g = generate(json!({"input_ids": prompt}), json!({"temperature": 0, field: v}));
        assert_eq!(g["text"], want, "{field} on /generate");
    }
}

/// `suffix` on `/v1/completions` with a tokenizer that has fill-in-the-middle tokens (tiny-qwen2:
/// Qwen's `<|fim_prefix|>`, `<|fim_middle|>`, `<|fim_suffix|>`, renumbered 990, 991, 992): the
/// engine is given `PREFIX prompt SUFFIX suffix MIDDLE` (usage's prompt tokens count those ids,
/// and the greedy text is the engine's on them), for text and token-id prompts, one or several;
/// the plain completion of that string with the special tokens written out gives the same; the
/// prompt alone gives another text, as does `suffix: ""` (a plain completion). Without such
/// tokens (tiny-llama: SmolLM2's tokenizer) a suffix is a 400 naming it: the error table.
#[test]
fn completions_suffix_fills_in_the_middle() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-fim");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let server = Server::start(&b, &[]);
    let mut r = Reference::new(&b);
    assert_eq!(
        r.tok.decode(&[990, 992, 991], false).unwrap(),
        "<|fim_prefix|><|fim_suffix|><|fim_middle|>",
        "the fixture's fill-in-the-middle ids"
    );
    let (prefix, suffix) = ("def add(a, b):\n    c = ", "\n    return c\n");
    let p = r.tok.encode(prefix, false).unwrap();
    assert_eq!(r.tok.encode(prefix, true).unwrap(), p, "Qwen's tokenizer adds no BOS");
    let fim: Vec<u32> = [vec![990], p.clone(), vec![992], r.tok.encode(suffix, false).unwrap(), vec![991]].concat();
    let n = 16;
    let greedy = runtime::SamplingParams::default();
    let want = r.tokens(&fim, greedy.clone(), n);
    let want = r.text(&want);
    let plain = r.tokens(&p, greedy, n);
    let plain = r.text(&plain);
    assert_ne!(want, plain, "the suffix does not change the greedy text: the checks below prove less");
    let complete = |prompt: Value, suffix: &str| {
        let body = json!({"prompt": prompt, "suffix": suffix, "max_tokens": n, "temperature": 0, "ignore_eos": true});
        let c = post(&server, "/v1/completions", &body);
        let texts: Vec<String> =
            c["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap().to_string()).collect();
        (texts, c["usage"]["prompt_tokens"].as_u64().unwrap() as usize)
    };
    for (prompt, count) in [(json!(prefix), 1), (json!(p), 1), (json!([prefix, prefix]), 2), (json!([p, p]), 2)] {
        let (texts, prompt_tokens) = complete(prompt.clone(), suffix);
        assert_eq!(texts, vec![want.clone(); count], "{prompt} with a suffix");
        assert_eq!(prompt_tokens, count * fim.len(), "{prompt}: the prompt the engine saw is not the FIM one");
    }
    let psm = format!("<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>");
    assert_eq!(complete(json!(psm), ""), (vec![want], fim.len()), "the PSM string written out");
    assert_eq!(complete(json!(prefix), ""), (vec![plain], p.len()), "`suffix: \"\"` is a plain completion");
}

/// Polls `/metrics` every few milliseconds until `done`; returns the largest running and
/// queued counts seen.
fn peak_load(server: &Server, done: &std::sync::atomic::AtomicBool) -> (f64, f64) {
    let (mut running, mut queued) = (0.0f64, 0.0f64);
    while !done.load(std::sync::atomic::Ordering::SeqCst) {
        running = running.max(metric(server, "engine_running_requests"));
        queued = queued.max(metric(server, "engine_queue_requests"));
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    (running, queued)
}

/// Sends every body to `/v1/completions` at once; returns the answers' texts in order, and the
/// peak running and queued counts while they ran.
fn all_at_once(server: &Server, bodies: &[Value]) -> (Vec<String>, (f64, f64)) {
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let load = s.spawn(|| peak_load(server, &done));
        let texts: Vec<_> = bodies
            .iter()
            .map(|b| {
                s.spawn(move || post(server, "/v1/completions", b)["choices"][0]["text"].as_str().unwrap().to_string())
            })
            .collect();
        let texts = texts.into_iter().map(|t| t.join().unwrap()).collect();
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        (texts, load.join().unwrap())
    })
}

/// Requests with different sampling settings sent at once each give what the same request
/// gives alone: a request's seeded draws do not depend on the batch it runs in.
#[test]
fn concurrent_sampling_settings_each_match_the_request_alone() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-concurrent");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let server = Server::start(&b, &[]);
    let settings = [
        json!({"temperature": 0}),
        json!({"temperature": 1.0, "seed": 11}),
        json!({"temperature": 1.5, "top_p": 0.9, "seed": 12}),
        json!({"temperature": 1.5, "top_k": 8, "seed": 13}),
        json!({"temperature": 1.5, "min_p": 0.3, "seed": 14}),
        json!({"temperature": 0.8, "seed": 15, "frequency_penalty": 1.0, "presence_penalty": 0.5}),
        json!({"temperature": 0, "repetition_penalty": 1.3}),
    ];
    let bodies: Vec<Value> = settings
        .iter()
        .map(|s| {
            let mut b = json!({"prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": true});
            b.as_object_mut().unwrap().extend(s.as_object().unwrap().clone());
            b
        })
        .collect();
    let alone: Vec<String> = bodies.iter().map(|b| all_at_once(&server, std::slice::from_ref(b)).0.remove(0)).collect();
    let distinct: std::collections::HashSet<&String> = alone.iter().collect();
    assert_eq!(distinct.len(), alone.len(), "settings that give the same text prove less: {alone:?}");
    // Every request twice, all at once.
    let twice: Vec<Value> = bodies.iter().chain(&bodies).cloned().collect();
    let (together, (running, _)) = all_at_once(&server, &twice);
    assert!(running >= 2.0, "the requests never ran together (peak {running})");
    for (i, (got, s)) in together.iter().zip(settings.iter().cycle()).enumerate() {
        assert_eq!(got, &alone[i % alone.len()], "{s} sent with the others differs from alone");
    }
}

/// `engrun serve --max-running-requests 1`: three requests sent at once all succeed, one at a
/// time (the running gauge never passes 1 while the others queue). Each generates 2000 tokens so
/// that the queue stays non-empty for hundreds of steps: the gauge is sampled over HTTP beside
/// the other tests' load, and 48-token requests once finished between two samples.
#[test]
fn max_running_requests_runs_one_at_a_time() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-max-running");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let server = Server::start(&b, &["--max-running-requests", "1"]);
    let bodies: Vec<Value> = (0..3)
        .map(|i| json!({"prompt": format!("request {i}"), "max_tokens": 2000, "temperature": 0, "ignore_eos": true}))
        .collect();
    let (texts, (running, queued)) = all_at_once(&server, &bodies);
    assert_eq!(texts.len(), 3);
    assert_eq!(running, 1.0, "more than one request ran at once");
    assert!(queued >= 1.0, "no request waited (peak queue {queued})");
    assert_eq!(metric(&server, "engine_generation_tokens_total"), 3.0 * 2000.0);
}

/// A history with tool-calling turns (an assistant message with `tool_calls`, a `tool` result)
/// renders through the model's chat template (tiny-qwen2's, which takes tools): the prompt is
/// the template's rendering of that history, the call's arguments (sent as a JSON string)
/// as an object, as vLLM passes them (`history::tests` checks the parsing itself). Malformed
/// turns are 400s naming `messages`; templates without tool turns: tests/tools.rs.
#[test]
fn chat_history_with_tool_calls_renders_through_the_template() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-tool-turns");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let server = Server::start(&b, &[]);
    let tok = text::Tokenizer::load(&b.join("tokenizer")).unwrap();
    let call =
        |args: Value| json!({"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}});
    let history = |args: Value, result: &str| {
        json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [call(args)]},
            {"role": "tool", "content": result, "tool_call_id": "c1"},
        ])
    };
    let sent = history(json!("{\"city\": \"Paris\"}"), "18 C");
    let mut rendered = history(json!({"city": "Paris"}), "18 C");
    rendered[1]["content"] = json!("");
    let text = tok.apply_chat_template(&rendered, true, None).unwrap();
    assert!(text.contains(r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#), "{text}");
    assert!(text.contains("<tool_response>\n18 C\n</tool_response>"), "{text}");
    let want = tok.encode_chat(&rendered, true).unwrap().len();
    let c = post(&server, "/v1/chat/completions", &json!({"messages": sent, "max_tokens": 2, "temperature": 0}));
    assert_eq!(c["usage"]["prompt_tokens"].as_u64(), Some(want as u64), "the prompt is not the template's rendering");
    for (bad, want) in [
        (history(json!("{city"), "18 C"), "is not JSON"),
        (json!([{"role": "tool", "content": "18 C"}]), "needs a `tool_call_id`"),
    ] {
        let (status, body) =
            http(&server.addr, "POST", "/v1/chat/completions", Some(&json!({"messages": bad}).to_string()), &[]);
        assert_eq!(status, 400, "{body}");
        let (message, _, param) = error_of(&body);
        assert!(message.contains(want) && param.as_deref() == Some("messages"), "{body}");
    }
}
