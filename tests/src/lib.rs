//! Helpers shared by the end-to-end tests: fixture paths, compiling fixtures into bundles,
//! running the CLIs, reading reference logits and comparing them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// The fixtures: `$ENGINE_FIXTURES` if set, else the repository's `tests/fixtures` (see its
/// README: what is committed, what scripts made it, what is fetched at test time).
pub fn fixtures() -> PathBuf {
    std::env::var_os("ENGINE_FIXTURES").map_or_else(|| repo().join("tests/fixtures"), PathBuf::from)
}

/// A fixture directory by name (`tiny-qwen2`).
pub fn fixture(name: &str) -> PathBuf {
    let p = fixtures().join(name);
    assert!(p.is_dir(), "fixture {} is missing", p.display());
    p
}

/// The model YAML for a fixture.
pub fn model_yaml(fixture: &str) -> PathBuf {
    repo().join(if fixture.contains("qwen") { "models/qwen2.yaml" } else { "models/llama.yaml" })
}

/// Compiles a fixture into a bundle inside `dir`. The tiny-llama checkpoint has no tokenizer of
/// its own: it is given `tiny-llama/tokenizer` (SmolLM2's, cut to the model's 1024 ids).
pub fn compile_fixture(name: &str, dir: &Path, tp: usize, dtype: Option<ir::DType>) -> PathBuf {
    compile_fixture_with(name, dir, tp, dtype, compiler::LmHead::default())
}

/// [`compile_fixture`] with the lm_head layout of a tensor-parallel bundle chosen.
pub fn compile_fixture_with(
    name: &str,
    dir: &Path,
    tp: usize,
    dtype: Option<ir::DType>,
    lm_head: compiler::LmHead,
) -> PathBuf {
    // The bundle's directory name is the served model name: plain for the default layout.
    let layout = if lm_head == compiler::LmHead::default() { String::new() } else { format!("-{lm_head:?}") };
    let out = dir.join(format!("{name}-tp{tp}{layout}.bundle"));
    let tokenizer = (name == "tiny-llama").then(|| fixture("tiny-llama").join("tokenizer"));
    let opts = compiler::CompileOptions {
        model: model_yaml(name),
        checkpoint: fixture(name),
        tp,
        dtype,
        tokenizer,
        out: out.clone(),
        dump_after: None,
        quant: None,
        lm_head,
    };
    compiler::compile(&opts).unwrap_or_else(|e| panic!("compiling {name}: {e}"));
    out
}

/// Path of a release or debug binary built by `cargo build --bins` (the README's test command
/// builds them first).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let p = exe.parent().and_then(Path::parent).expect("target dir").join(name);
    assert!(
        p.is_file(),
        "{} is not built: run `cargo build --bins` before the tests (the README's test command does)",
        p.display()
    );
    p
}

/// Runs a CLI with arguments.
pub fn run(name: &str, args: &[&str]) -> Output {
    Command::new(bin(name)).args(args).output().unwrap_or_else(|e| panic!("running {name}: {e}"))
}

/// stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Reads an f32 tensor from a safetensors file.
pub fn read_f32(path: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name} in {}: {e}", path.display()));
    (t.shape().to_vec(), ir::DType::F32.to_f32(t.data()))
}

/// max |a - b| / max |b|: the relative error the acceptance criteria use.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    let scale = want.iter().map(|b| b.abs()).fold(0.0f32, f32::max);
    diff / scale.max(f32::MIN_POSITIVE)
}

/// Argmax of a row and the gap between its top two values.
pub fn top2(row: &[f32]) -> (u32, f32) {
    let (mut best, mut second) = ((0usize, f32::NEG_INFINITY), f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate() {
        if v > best.1 {
            second = best.1;
            best = (i, v);
        } else if v > second {
            second = v;
        }
    }
    (best.0 as u32, best.1 - second)
}

/// The fixture's reference goldens.
pub fn goldens(name: &str) -> serde_json::Value {
    let p = fixture(name).join("reference/goldens.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("goldens.json")).expect("valid JSON")
}

/// A list of ids from JSON.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// `backend` with a KV pool of 4096 token slots, for single-sequence tests.
pub fn seqs(backend: impl runtime::Backend + 'static) -> runtime::Sequences {
    runtime::Sequences::new(Box::new(backend), 4096).expect("KV pool")
}

/// The bundle at `path` loaded on the CPU backend (every rank of a `--tp N` bundle).
pub fn cpu_sequences(path: &Path) -> runtime::Sequences {
    let b = bundle::Bundle::open(path).unwrap();
    runtime::Sequences::new(runtime::load(&b, runtime::Device::Cpu, &[]).unwrap(), 1024).unwrap()
}

/// The logits of a prefill of `prompt` (every position), then of one decode step per token of
/// `decode`.
pub fn prefill_then_decode(s: &mut runtime::Sequences, prompt: &[u32], decode: &[u32]) -> Vec<Vec<f32>> {
    let rows: Vec<usize> = (0..prompt.len()).collect();
    let mut out = vec![s.forward(0, prompt, &rows).unwrap()];
    for &t in decode {
        out.push(s.forward(0, &[t], &[0]).unwrap());
    }
    out
}

/// Checks a backend against a fixture's HF reference: logits of the last position of every
/// prompt and of every position of the 5-token prompt within `tol` relative; argmax per
/// position and the greedy continuation where the top-2 margin is clear.
pub fn check_backend_against_hf(name: &str, b: &mut runtime::Sequences, tol: f32) {
    let vocab = b.vocab();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap();
    let eos: Vec<u32> = match &config["eos_token_id"] {
        serde_json::Value::Array(a) => a.iter().map(|v| v.as_u64().unwrap() as u32).collect(),
        v => v.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
    };
    let g = goldens(name);
    let refs = fixture(name).join("reference/logits.safetensors");
    for (i, p) in g["prompts"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&p["ids"]);
        let rows: Vec<usize> = (0..prompt.len()).collect();
        let logits = b.forward(i as u64, &prompt, &rows).unwrap();
        let (_, last) = read_f32(&refs, &format!("last_logits.{i}"));
        let got_last = &logits[(prompt.len() - 1) * vocab..];
        let err = rel_err(got_last, &last);
        assert!(err < tol, "{name} prompt {i}: last-position logits rel err {err}");
        eprintln!("{name} prompt {i} ({} tokens): last-position rel err {err:.2e}", prompt.len());
        if prompt.len() == 5 {
            let (shape, all) = read_f32(&refs, "all_logits.5");
            assert_eq!(shape, vec![5, vocab]);
            let err = rel_err(&logits, &all);
            assert!(err < tol, "{name}: all-position logits rel err {err}");
        }
        // argmax per position where the top-2 margin is clear
        let scale = last.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (pos, want) in ids(&p["argmax_each_position"]).iter().enumerate() {
            let (got, margin) = top2(&logits[pos * vocab..(pos + 1) * vocab]);
            if margin > tol * scale {
                assert_eq!(got, *want, "{name} prompt {i} position {pos}");
            }
        }
        // Greedy continuation, compared while every step's margin is clear. The reference
        // generated 16 tokens with eos suppressed (as `min_new_tokens` does), so eos is masked.
        let mut next_logits = got_last.to_vec();
        let mut compared = 0;
        for (step, want) in ids(&p["greedy_16"]).iter().enumerate() {
            for &e in &eos {
                next_logits[e as usize] = f32::NEG_INFINITY;
            }
            let (got, margin) = top2(&next_logits);
            if margin <= tol * scale {
                break;
            }
            compared += 1;
            let want_logit = next_logits[*want as usize];
            assert_eq!(got, *want, "{name} prompt {i} greedy step {step}: margin {margin}, scale {scale}, logit of HF's token {want_logit}, ours {}", next_logits[got as usize]);
            next_logits = b.forward(i as u64, &[got], &[0]).unwrap();
        }
        eprintln!("{name} prompt {i}: {compared} of 16 greedy tokens compared (clear margins)");
        assert!(compared > 0 || i > 0, "no greedy token had a clear margin");
        b.release(i as u64);
    }
}

/// Runs `scripts/{script}` (a fetch script that caches under `$ENGINE_CACHE` and prints a path)
/// with `args` and returns the path it printed.
fn fetched_with(script: &str, args: &[&str]) -> PathBuf {
    let o = Command::new("bash")
        .arg(repo().join("scripts").join(script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running scripts/{script}: {e}"));
    assert!(o.status.success(), "scripts/{script} failed: {}", String::from_utf8_lossy(&o.stderr));
    PathBuf::from(String::from_utf8(o.stdout).expect("a path").trim())
}

/// SmolLM2-135M-Instruct's Q4_1 GGUF, fetched once by scripts/fetch-smollm2.sh.
pub fn smollm2_gguf() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| fetched_with("fetch-smollm2.sh", &[])).clone()
}

/// A folder with Qwen's real tokenizer (`tokenizer.json`, `tokenizer_config.json` with its chat
/// template), fetched once by scripts/fetch-tokenizer.sh. Its HF goldens are
/// `fixture("qwen-tokenizer")/reference/tokenizer_goldens.json`.
pub fn qwen_tokenizer() -> PathBuf {
    real_tokenizer("qwen3")
}

/// A folder with a model family's real tokenizer (`qwen3`, `llama3_2` or `mistral_nemo`: its
/// `tokenizer.json` and `tokenizer_config.json` with the chat template), fetched once by
/// scripts/fetch-tokenizer.sh.
pub fn real_tokenizer(name: &str) -> PathBuf {
    fetched_with("fetch-tokenizer.sh", &[name])
}

/// Compiles SmolLM2 (f32, with its tokenizer) into `dir`.
pub fn smollm2_bundle(dir: &Path) -> PathBuf {
    smollm2_bundle_as(dir, Some(ir::DType::F32))
}

/// Compiles SmolLM2 (with its tokenizer) into `dir`: dequantized to `dtype`, or with `None`
/// kept in the GGUF's blocks.
pub fn smollm2_bundle_as(dir: &Path, dtype: Option<ir::DType>) -> PathBuf {
    let out = dir.join(format!("smollm2-{}.bundle", dtype.map_or("blocks".into(), |d| d.to_string())));
    let opts = compiler::CompileOptions {
        model: repo().join("models/llama.yaml"),
        checkpoint: smollm2_gguf(),
        tp: 1,
        dtype,
        tokenizer: Some(fixture("smollm2-135m")),
        out: out.clone(),
        dump_after: None,
        quant: None,
        lm_head: compiler::LmHead::default(),
    };
    let report = compiler::compile(&opts).unwrap_or_else(|e| panic!("{e}"));
    assert!(report.warnings.iter().all(|w| !w.contains("unused")), "{:?}", report.warnings);
    out
}

/// A running `engrun serve`, stopped with SIGTERM when dropped.
pub struct Server {
    child: std::process::Child,
    /// `host:port` it listens on.
    pub addr: String,
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Server {
    /// Starts `engrun serve BUNDLE --port 0 ARGS...` and waits until it listens.
    pub fn start(bundle: &Path, args: &[&str]) -> Server {
        use std::io::BufRead;
        let mut child = Command::new(bin("engrun"))
            .arg("serve")
            .arg(bundle)
            .args(["--port", "0"])
            .args(args)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start engrun serve");
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().expect("stderr");
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.split("http://").nth(1) {
                    let _ = tx.send(addr.trim().to_string());
                }
                sink.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let addr = rx.recv_timeout(std::time::Duration::from_secs(120)).unwrap_or_else(|_| {
            let _ = child.kill();
            panic!("the server did not start: {}", log.lock().unwrap())
        });
        Server { child, addr, log }
    }

    /// What the server wrote to stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The base URL of the OpenAI API.
    pub fn base(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Sends SIGTERM and waits (at most `secs`) for the exit status.
    pub fn terminate(&mut self, secs: u64) -> Option<std::process::ExitStatus> {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        if self.terminate(10).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One HTTP/1.1 request over a fresh connection; returns the status and the body (chunked
/// bodies are returned raw).
pub fn http(addr: &str, method: &str, path: &str, body: Option<&str>, headers: &[(&str, &str)]) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    let body = body.unwrap_or("");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    req += "\r\n";
    s.write_all(req.as_bytes()).expect("send");
    s.write_all(body.as_bytes()).expect("send body");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read response");
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or(String::new(), |(_, b)| b.to_string());
    (status, body)
}

/// An empty directory `name` under `tmp` (a test binary's `CARGO_TARGET_TMPDIR`), emptied first.
pub fn scratch(tmp: &str, name: &str) -> PathBuf {
    let dir = PathBuf::from(tmp).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a scratch directory");
    dir
}

/// A fixture committed in the repository (`tests/fixtures/NAME`, made by
/// scripts/make-references.py), whatever `$ENGINE_FIXTURES` says.
pub fn repo_fixture(name: &str) -> PathBuf {
    let p = repo().join("tests/fixtures").join(name);
    assert!(p.is_dir(), "fixture {} is missing", p.display());
    p
}

/// Compiles the checkpoint in `checkpoint` (config.json and safetensors, no tokenizer) with
/// `models/{model}.yaml` at `tp` ranks into `dir`, named after the checkpoint's directory
/// (with `-tpN` above one rank).
pub fn compile_checkpoint(model: &str, checkpoint: &Path, dir: &Path, tp: usize, dtype: Option<ir::DType>) -> PathBuf {
    let name = checkpoint.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
    let ranks = if tp == 1 { String::new() } else { format!("-tp{tp}") };
    compile_to(model, checkpoint, &dir.join(format!("{name}{ranks}.bundle")), |o| {
        o.tp = tp;
        o.dtype = dtype;
    })
}

/// The options compiling `checkpoint` with `models/{model}.yaml` and no tokenizer into the
/// bundle `out`: one rank, the checkpoint's dtype, nothing quantized.
pub fn compile_options(model: &str, checkpoint: &Path, out: &Path) -> compiler::CompileOptions {
    compiler::CompileOptions {
        model: repo().join(format!("models/{model}.yaml")),
        checkpoint: checkpoint.to_path_buf(),
        tp: 1,
        dtype: None,
        tokenizer: None,
        out: out.to_path_buf(),
        dump_after: None,
        quant: None,
        lm_head: compiler::LmHead::default(),
    }
}

/// Compiles `checkpoint` with `models/{model}.yaml` and no tokenizer into the bundle `out`: one
/// rank, the checkpoint's dtype, nothing quantized, except what `with` changes.
pub fn compile_to(
    model: &str,
    checkpoint: &Path,
    out: &Path,
    with: impl FnOnce(&mut compiler::CompileOptions),
) -> PathBuf {
    let mut opts = compile_options(model, checkpoint, out);
    with(&mut opts);
    compiler::compile(&opts).unwrap_or_else(|e| panic!("compiling {}: {e}", checkpoint.display()));
    out.to_path_buf()
}

/// The `data:` payloads of a chunked server-sent-events body.
pub fn sse_data(raw: &str) -> Vec<String> {
    let mut body = String::new();
    let mut rest = raw;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or_else(|e| panic!("chunk size `{size}`: {e}"));
        if n == 0 {
            break;
        }
        body += &after[..n];
        rest = after[n..].strip_prefix("\r\n").expect("CRLF after a chunk");
    }
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(String::from).collect()
}

/// Whether `v` is a JSON integer in `[lo, hi]`: a number without a fraction (JSON Schema's
/// integer; `-0` is one, and serde_json reads it as a float).
pub fn json_int_in(v: &serde_json::Value, lo: i64, hi: i64) -> bool {
    v.as_f64().is_some_and(|x| x.fract() == 0.0 && (lo as f64..=hi as f64).contains(&x))
}

/// POSTs `body` to `path` of the server at `addr`: the status and the JSON answer.
pub fn post_json(addr: &str, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let (status, text) = http(addr, "POST", path, Some(&body.to_string()), &[]);
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
}
