//! The tokenizer a GGUF carries (`compiler::gguf_tokenizer`): built from SmolLM2's GGUF it
//! encodes the HF tokenizer goldens exactly (and every line of this repository's docs as HF's
//! `tokenizer.json` does); built from the Qwen2 vocabulary converted as llama.cpp converts it,
//! the Qwen goldens; `engc compile X.gguf` without `--tokenizer` writes it into the bundle and
//! `engrun` chats with it; an unknown tokenizer model type is a clear error.

use e2e::*;
use std::path::Path;

/// A GGUF metadata value.
enum V {
    Str(String),
    U32(u32),
    F32(f32),
    Bool(bool),
    Strs(Vec<String>),
    I32s(Vec<i32>),
    F32s(Vec<f32>),
}

fn s(x: &str) -> V {
    V::Str(x.to_string())
}

/// A GGUF v3 file with metadata `meta` and F32 tensors (name, HF shape, values).
fn write_gguf(path: &Path, meta: &[(&str, V)], tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
    fn string(b: &mut Vec<u8>, t: &str) {
        b.extend((t.len() as u64).to_le_bytes());
        b.extend(t.as_bytes());
    }
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        string(&mut b, k);
        let array = |b: &mut Vec<u8>, ty: u32, n: usize| {
            b.extend(9u32.to_le_bytes());
            b.extend(ty.to_le_bytes());
            b.extend((n as u64).to_le_bytes());
        };
        match v {
            V::Str(x) => {
                b.extend(8u32.to_le_bytes());
                string(&mut b, x);
            }
            V::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            V::F32(x) => {
                b.extend(6u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            V::Bool(x) => {
                b.extend(7u32.to_le_bytes());
                b.push(*x as u8);
            }
            V::Strs(xs) => {
                array(&mut b, 8, xs.len());
                xs.iter().for_each(|x| string(&mut b, x));
            }
            V::I32s(xs) => {
                array(&mut b, 5, xs.len());
                xs.iter().for_each(|x| b.extend(x.to_le_bytes()));
            }
            V::F32s(xs) => {
                array(&mut b, 6, xs.len());
                xs.iter().for_each(|x| b.extend(x.to_le_bytes()));
            }
        }
    }
    let mut offset = 0u64;
    for (name, shape, data) in tensors {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "{name}");
        string(&mut b, name);
        b.extend((shape.len() as u32).to_le_bytes());
        shape.iter().rev().for_each(|d| b.extend((*d as u64).to_le_bytes()));
        b.extend(0u32.to_le_bytes()); // F32
        b.extend(offset.to_le_bytes());
        offset += (data.len() * 4).next_multiple_of(32) as u64;
    }
    for (_, _, data) in tensors {
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        data.iter().for_each(|x| b.extend(x.to_le_bytes()));
    }
    std::fs::write(path, b).unwrap();
}

/// A 1-layer Llama GGUF (hidden 32, 2 heads of 16) with small deterministic weights and the
/// tokenizer metadata `tokenizer` (whose `tokenizer.ggml.tokens` sets the vocabulary size).
fn tiny_llama_gguf(path: &Path, tokenizer: Vec<(&str, V)>, vocab: usize) {
    let mut meta = vec![
        ("general.architecture", s("llama")),
        ("llama.block_count", V::U32(1)),
        ("llama.context_length", V::U32(256)),
        ("llama.embedding_length", V::U32(32)),
        ("llama.feed_forward_length", V::U32(64)),
        ("llama.attention.head_count", V::U32(2)),
        ("llama.attention.head_count_kv", V::U32(2)),
        ("llama.rope.freq_base", V::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
    ];
    meta.extend(tokenizer);
    let mut seed = 1u32;
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
                (seed >> 8) as f32 / (1 << 24) as f32 * 0.2 - 0.1
            })
            .collect()
    };
    let t = |name: &'static str, shape: Vec<usize>, v: Vec<f32>| (name, shape, v);
    let tensors = vec![
        t("token_embd.weight", vec![vocab, 32], values(vocab * 32)),
        t("output_norm.weight", vec![32], vec![1.0; 32]),
        t("blk.0.attn_norm.weight", vec![32], vec![1.0; 32]),
        t("blk.0.attn_q.weight", vec![32, 32], values(32 * 32)),
        t("blk.0.attn_k.weight", vec![32, 32], values(32 * 32)),
        t("blk.0.attn_v.weight", vec![32, 32], values(32 * 32)),
        t("blk.0.attn_output.weight", vec![32, 32], values(32 * 32)),
        t("blk.0.ffn_norm.weight", vec![32], vec![1.0; 32]),
        t("blk.0.ffn_gate.weight", vec![64, 32], values(64 * 32)),
        t("blk.0.ffn_up.weight", vec![64, 32], values(64 * 32)),
        t("blk.0.ffn_down.weight", vec![32, 64], values(32 * 64)),
    ];
    write_gguf(path, &meta, &tensors);
}

/// A SentencePiece vocabulary (`<unk> <s> </s>`, the 256 byte pieces, pieces that merge into
/// `▁Hi` and `▁there`) as `tokenizer.ggml.*` metadata of model type `model`.
fn spm_tokenizer(model: &str) -> (Vec<(&'static str, V)>, usize) {
    let words = ["▁", "H", "i", "t", "h", "e", "r", "▁H", "▁Hi", "▁t", "th", "▁th", "er", "ere", "▁there"];
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    tokens.extend(words.map(String::from));
    let mut types = vec![2, 3, 3];
    types.extend(std::iter::repeat_n(6, 256));
    types.extend(std::iter::repeat_n(1, words.len()));
    let mut scores = vec![0.0; 259];
    scores.extend((0..words.len()).map(|i| -(i as f32)));
    let n = tokens.len();
    let meta = vec![
        ("tokenizer.ggml.model", s(model)),
        ("tokenizer.ggml.tokens", V::Strs(tokens)),
        ("tokenizer.ggml.token_type", V::I32s(types)),
        ("tokenizer.ggml.scores", V::F32s(scores)),
        ("tokenizer.ggml.bos_token_id", V::U32(1)),
        ("tokenizer.ggml.eos_token_id", V::U32(2)),
        ("tokenizer.ggml.unknown_token_id", V::U32(0)),
        ("tokenizer.chat_template", s("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")),
    ];
    (meta, n)
}

/// The tokenizer built from the GGUF at `gguf`, written into `dir` and loaded as the runtime
/// loads a bundle's.
fn gguf_tokenizer(gguf: &Path, dir: &Path) -> text::Tokenizer {
    let tok = compiler::gguf_tokenizer::build(gguf).unwrap().expect("the GGUF has a tokenizer");
    tok.write(dir).unwrap();
    text::Tokenizer::load(dir).unwrap()
}

/// Checks `tok` against the fixture's tokenizer goldens: every encode string's ids and decode,
/// and every chat's rendered text and ids.
fn check_goldens(fixture_name: &str, tok: &text::Tokenizer) {
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(fixture_name).join("reference/tokenizer_goldens.json")).unwrap(),
    )
    .unwrap();
    let encode = g["encode"].as_array().unwrap();
    assert!(!encode.is_empty());
    for case in encode {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tok.encode(text, false).unwrap(), ids(&case["ids"]), "{fixture_name}: encode {text:?}");
        assert_eq!(tok.decode(&ids(&case["ids"]), false).unwrap(), text, "{fixture_name}: decode {text:?}");
    }
    let chat = g["chat"].as_array().unwrap();
    assert!(!chat.is_empty());
    for case in chat {
        let add = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = tok.apply_chat_template(&case["messages"], add, None).unwrap();
        assert_eq!(rendered, case["text"].as_str().unwrap(), "{fixture_name}: chat text");
        assert_eq!(tok.encode_chat(&case["messages"], add).unwrap(), ids(&case["ids"]), "{fixture_name}: chat ids");
    }
}

/// Every line of the repository's README and module map, and some tricky strings, encode
/// (with and without special tokens) and decode alike with `ours` and HF's `theirs`.
fn check_against_hf(name: &str, ours: &text::Tokenizer, theirs: &text::Tokenizer) {
    assert_eq!(ours.vocab_size(), theirs.vocab_size(), "{name}: vocabulary size");
    let mut corpus: Vec<String> = ["README.md", "docs/modules.md"]
        .iter()
        .flat_map(|f| std::fs::read_to_string(repo().join(f)).unwrap().lines().map(String::from).collect::<Vec<_>>())
        .collect();
    corpus.extend(
        [
            "don't WE'LL you've I'M it's THEY'D",
            "   three spaces, then\ttab\r\nCRLF  ",
            "x = 1234567 + 0.89e-3; y=[1,22,333]",
            "Ünïcödé ñ ß 東京 Ελληνικά русский 😀👍🏽",
            "decomposed: Cafe\u{301} n\u{303} A\u{30A}",
            "<|im_start|>user\nhi<|im_end|><|endoftext|>",
            "",
            " ",
        ]
        .map(String::from),
    );
    for line in &corpus {
        for add in [false, true] {
            let want = theirs.encode(line, add).unwrap();
            assert_eq!(ours.encode(line, add).unwrap(), want, "{name}: encode {line:?} (add_special {add})");
            assert_eq!(ours.decode(&want, false).unwrap(), theirs.decode(&want, false).unwrap(), "{name}: decode");
            assert_eq!(ours.decode(&want, true).unwrap(), theirs.decode(&want, true).unwrap(), "{name}: decode");
        }
    }
}

#[test]
fn smollm2_gguf_tokenizer_encodes_as_hf() {
    let dir = tempfile::tempdir().unwrap();
    let tok = gguf_tokenizer(&smollm2_gguf(), dir.path());
    check_goldens("smollm2-135m", &tok);
    let hf = text::Tokenizer::load(&fixture("smollm2-135m")).unwrap();
    check_against_hf("smollm2", &tok, &hf);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(config["bos_token"], "<|im_start|>");
    assert_eq!(config["eos_token"], "<|im_end|>");
    assert_eq!(config["add_bos_token"], false);
}

/// The Qwen2 tokenizer (a `qwen2` pre-tokenizer: its split regex and NFC) converted to GGUF
/// metadata as llama.cpp's converter does (tokens by id, special added tokens as control,
/// other added tokens as user-defined, merges as "a b"), then built back.
#[test]
fn qwen2_vocabulary_through_gguf_metadata_encodes_as_hf() {
    let fx = qwen_tokenizer();
    let tj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fx.join("tokenizer.json")).unwrap()).unwrap();
    let tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fx.join("tokenizer_config.json")).unwrap()).unwrap();
    let mut by_id: std::collections::BTreeMap<u64, (String, i32)> = tj["model"]["vocab"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(t, id)| (id.as_u64().unwrap(), (t.clone(), 1)))
        .collect();
    for a in tj["added_tokens"].as_array().unwrap() {
        let ty = if a["special"].as_bool().unwrap() { 3 } else { 4 };
        by_id.insert(a["id"].as_u64().unwrap(), (a["content"].as_str().unwrap().to_string(), ty));
    }
    assert_eq!(*by_id.keys().last().unwrap() as usize + 1, by_id.len(), "ids are contiguous");
    let merges: Vec<String> = tj["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => s.clone(),
            pair => format!("{} {}", pair[0].as_str().unwrap(), pair[1].as_str().unwrap()),
        })
        .collect();
    let id_of = |t: &str| by_id.iter().find(|(_, (x, _))| x == t).map(|(i, _)| *i as u32).unwrap();
    let meta = vec![
        ("general.architecture", s("qwen2")),
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.pre", s("qwen2")),
        ("tokenizer.ggml.tokens", V::Strs(by_id.values().map(|(t, _)| t.clone()).collect())),
        ("tokenizer.ggml.token_type", V::I32s(by_id.values().map(|(_, ty)| *ty).collect())),
        ("tokenizer.ggml.merges", V::Strs(merges)),
        ("tokenizer.ggml.eos_token_id", V::U32(id_of("<|im_end|>"))),
        ("tokenizer.ggml.padding_token_id", V::U32(id_of("<|endoftext|>"))),
        ("tokenizer.ggml.bos_token_id", V::U32(id_of("<|endoftext|>"))),
        ("tokenizer.ggml.add_bos_token", V::Bool(false)),
        ("tokenizer.chat_template", s(tc["chat_template"].as_str().unwrap())),
    ];
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("qwen2-tokenizer.gguf");
    write_gguf(&gguf, &meta, &[]);
    let out = dir.path().join("tok");
    std::fs::create_dir(&out).unwrap();
    let tok = gguf_tokenizer(&gguf, &out);
    check_goldens("qwen-tokenizer", &tok);
    check_against_hf("qwen2", &tok, &text::Tokenizer::load(&fx).unwrap());
}

/// `engc compile SmolLM2.gguf -o B` with no --tokenizer: B's tokenizer is the GGUF's, and
/// `engrun generate --chat` reproduces HF's greedy chat golden with it.
#[test]
fn compile_smollm2_gguf_without_tokenizer_then_chat() {
    let dir = tempfile::tempdir().unwrap();
    let b = dir.path().join("smollm2-gguf-tok.bundle");
    let gguf = smollm2_gguf();
    let args = ["compile", "models/llama.yaml", "--checkpoint", gguf.to_str().unwrap(), "--dtype", "f32"];
    let o = std::process::Command::new(bin("engc")).current_dir(repo()).args(args).arg("-o").arg(&b).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("no tokenizer.json"), "{}", stderr(&o));
    let tdir = b.join("tokenizer");
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        assert!(tdir.join(f).is_file(), "bundle lacks tokenizer/{f}");
    }
    let tok = text::Tokenizer::load(&tdir).unwrap();
    check_goldens("smollm2-135m", &tok);
    assert_eq!(bundle::Bundle::open(&b).unwrap().generation_config().unwrap().eos_token_id, vec![2]);
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("smollm2-135m").join("reference/chat_goldens.json")).unwrap(),
    )
    .unwrap();
    let case = &g[0];
    let q = case["question"].as_str().unwrap();
    let args = ["generate", b.to_str().unwrap(), "--device", "cpu", "--chat", "--temperature", "0"];
    let o = run("engrun", &[&args[..], &["--max-tokens", "48", "--prompt", q]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).unwrap();
    assert_eq!(text.trim_end_matches('\n'), case["greedy_text"].as_str().unwrap());
}

/// A SentencePiece (`llama`) GGUF: the bundle's tokenizer merges by score, falls back to bytes,
/// adds BOS, and `engrun generate` runs with it.
#[test]
fn compile_sentencepiece_gguf_without_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let (mut meta, vocab) = spm_tokenizer("llama");
    // An end-of-turn token besides eos (Llama 3 Instruct's <|eot_id|>) stops generation too.
    meta.push(("tokenizer.ggml.eot_token_id", V::U32(0)));
    let gguf = dir.path().join("spm.gguf");
    tiny_llama_gguf(&gguf, meta, vocab);
    let out = dir.path().join("spm.bundle");
    let o = run("engc", &["compile", "--checkpoint", gguf.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(bundle::Bundle::open(&out).unwrap().generation_config().unwrap().eos_token_id, vec![2, 0]);
    let tok = text::Tokenizer::load(&out.join("tokenizer")).unwrap();
    let hi = 259 + 8;
    let there = 259 + 14;
    assert_eq!(tok.encode("Hi there", true).unwrap(), [1, hi, there]);
    assert_eq!(tok.encode("Hi é", false).unwrap(), [hi, 259, 3 + 0xC3, 3 + 0xA9]);
    assert_eq!(tok.decode(&[1, hi, 259, 3 + 0xC3, 3 + 0xA9, there], true).unwrap(), "Hi é there");
    let chat = serde_json::json!([{"role": "user", "content": "Hi"}]);
    assert_eq!(tok.apply_chat_template(&chat, false, None).unwrap(), "[user] Hi\n");
    let o = run(
        "engrun",
        &["generate", out.to_str().unwrap(), "--device", "cpu", "--prompt", "Hi there", "--max-tokens", "3"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
}

/// A tokenizer model type the compiler cannot build is an error that names the file, the type
/// and the way out; a GGUF with no tokenizer metadata compiles with the old warning.
#[test]
fn unknown_tokenizer_model_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (mut meta, vocab) = spm_tokenizer("bert");
    let gguf = dir.path().join("bert-tok.gguf");
    tiny_llama_gguf(&gguf, std::mem::take(&mut meta), vocab);
    let out = dir.path().join("x.bundle");
    let o = run("engc", &["compile", "--checkpoint", gguf.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(!o.status.success(), "compiling a GGUF with tokenizer model `bert` succeeded");
    let e = stderr(&o);
    for want in ["bert-tok.gguf", "tokenizer model type `bert`", "tokenizer.ggml.model", "--tokenizer DIR"] {
        assert!(e.contains(want), "error lacks {want:?}: {e}");
    }
    assert!(!out.exists(), "a failed compile left {}", out.display());

    // With --tokenizer the GGUF's metadata is not read.
    let o = run(
        "engc",
        &[
            "compile",
            "--checkpoint",
            gguf.to_str().unwrap(),
            "--tokenizer",
            fixture("smollm2-135m").to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));

    let bare = dir.path().join("bare.gguf");
    tiny_llama_gguf(&bare, vec![], vocab);
    let report = compiler::compile(&compiler::CompileOptions {
        model: repo().join("models/llama.yaml"),
        checkpoint: bare,
        tp: 1,
        dtype: None,
        tokenizer: None,
        out: dir.path().join("bare.bundle"),
        dump_after: None,
        quant: None,
        lm_head: compiler::LmHead::default(),
    })
    .unwrap();
    assert!(report.warnings.iter().any(|w| w.contains("no tokenizer.json")), "{:?}", report.warnings);
}
