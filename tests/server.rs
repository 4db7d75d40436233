//! `engrun serve` end to end on the CPU: the official `openai` package drives it (SmolLM2's
//! chat golden over HTTP, streaming, n, stop strings, logprobs; CJK and emoji with the Qwen
//! tokenizer), every error case answers its status and message in OpenAI's shape, 200
//! concurrent streaming clients with a third disconnecting, and SIGTERM.

use e2e::*;
use serde_json::Value;
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

#[test]
fn cjk_and_emoji_stream_without_broken_characters() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-qwen");
    let b = compile_fixture("tiny-qwen2", &dir, 1, None);
    let server = Server::start(&b, &["--api-key", "test-key"]);
    client(&server, &["tiny-qwen2-tp1", "unicode"]);
}

fn error_of(body: &str) -> (String, String) {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    let e = &v["error"];
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{body}");
    (e["message"].as_str().unwrap().to_string(), e["type"].as_str().unwrap().to_string())
}

#[test]
fn errors_have_status_and_message() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-errors");
    let b = compile_fixture("tiny-llama", &dir, 1, None);
    let server = Server::start(&b, &["--api-key", "k", "--served-model-name", "tiny"]);
    let auth = [("Authorization", "Bearer k")];
    let msgs = r#""messages": [{"role": "user", "content": "hi"}]"#;
    let long: Vec<String> = (0..8200).map(|_| "7".to_string()).collect();
    let long_prompt = format!(r#"{{"prompt": [{}], "max_tokens": 1}}"#, long.join(","));
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("/v1/chat/completions", "{not json".into(), 400, "invalid request body"),
        ("/v1/chat/completions", r#"{"model": "tiny"}"#.into(), 400, "missing field `messages`"),
        ("/v1/chat/completions", r#"{"messages": []}"#.into(), 400, "messages must not be empty"),
        ("/v1/chat/completions", r#"{"messages": [{"content": "x"}]}"#.into(), 400, "has no `role`"),
        ("/v1/chat/completions", format!(r#"{{"model": "gpt-9", {msgs}}}"#), 404, "`gpt-9` does not exist"),
        ("/v1/completions", long_prompt, 400, "context length"),
        ("/v1/chat/completions", format!(r#"{{{msgs}, "max_tokens": 100000}}"#), 400, "exceeds the context length"),
        ("/v1/chat/completions", format!(r#"{{{msgs}, "max_tokens": -3}}"#), 400, "max_tokens must be"),
        ("/v1/chat/completions", format!(r#"{{{msgs}, "temperature": -0.5}}"#), 400, "temperature must be"),
        ("/v1/chat/completions", format!(r#"{{{msgs}, "top_p": 1.5}}"#), 400, "top_p must be"),
        ("/v1/chat/completions", format!(r#"{{{msgs}, "n": 17}}"#), 400, "n must be in [1, 16]"),
        ("/v1/completions", r#"{"prompt": [99999999]}"#.into(), 400, "outside the vocabulary"),
        ("/generate", r#"{"sampling_params": {}}"#.into(), 400, "exactly one of `text` and `input_ids`"),
    ];
    for (path, body, status, msg) in cases {
        let (got, text) = http(&server.addr, "POST", path, Some(&body), &auth);
        let (m, _) = error_of(&text);
        assert_eq!(got, status, "{path} {}: {text}", &body[..body.len().min(80)]);
        assert!(m.contains(msg), "{path}: `{m}` does not mention `{msg}`");
    }
    for headers in [vec![], vec![("Authorization", "Bearer wrong")]] {
        let (got, text) = http(&server.addr, "POST", "/v1/chat/completions", Some(&format!("{{{msgs}}}")), &headers);
        assert_eq!(got, 401, "{text}");
        assert!(error_of(&text).0.contains("API key"));
    }
    // Still serving.
    let (got, text) =
        http(&server.addr, "POST", "/v1/chat/completions", Some(&format!(r#"{{{msgs}, "max_tokens": 3}}"#)), &auth);
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
    use std::io::{Read, Write};
    let body = format!(
        r#"{{"prompt": "client {i} says", "max_tokens": 24, "temperature": 0.7, "seed": {i}, "ignore_eos": true, "stream": true}}"#
    );
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

#[test]
fn sigterm_finishes_requests_in_flight_and_exits() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "server-sigterm");
    let b = compile_fixture("tiny-llama", &dir, 1, None);
    let mut server = Server::start(&b, &[]);
    let addr = server.addr.clone();
    let t = std::thread::spawn(move || stream_client(&addr, 1, false));
    std::thread::sleep(std::time::Duration::from_millis(300));
    let status = server.terminate(60).expect("the server exits after SIGTERM");
    assert!(t.join().unwrap(), "the request in flight completes");
    assert!(status.success(), "{status:?}: {}", server.log());
    assert!(server.log().contains("shut down"), "{}", server.log());
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
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while metric(&server, "engine_running_requests") != 1.0 {
        assert!(std::time::Instant::now() < deadline, "the request never runs");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    drop(s);
    let t = std::time::Instant::now();
    wait_idle(&server);
    assert!(t.elapsed() < std::time::Duration::from_secs(2), "abort took {:?}", t.elapsed());
    assert_eq!(metric(&server, "engine_kv_pages_private"), 0.0);
}
