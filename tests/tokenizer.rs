//! Tokenizer and chat-template goldens from HF (tokenizer_goldens.json).

use e2e::*;

/// Checks the tokenizer in `dir` against the goldens of fixture `name`.
fn check(name: &str, dir: &std::path::Path) {
    let tok = text::Tokenizer::load(dir).unwrap();
    let goldens = fixture(name).join("reference/tokenizer_goldens.json");
    let g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(goldens).unwrap()).unwrap();
    for case in g["encode"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tok.encode(text, false).unwrap(), ids(&case["ids"]), "{name}: encode {text:?}");
        assert_eq!(tok.decode(&ids(&case["ids"]), false).unwrap(), text, "{name}: decode round trip");
    }
    for case in g["chat"].as_array().unwrap() {
        let add = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = tok.apply_chat_template(&case["messages"], add, None).unwrap();
        assert_eq!(rendered, case["text"].as_str().unwrap(), "{name}: chat text");
        assert_eq!(tok.encode_chat(&case["messages"], add).unwrap(), ids(&case["ids"]), "{name}: chat ids");
    }
}

#[test]
fn qwen_tokenizer_goldens() {
    check("qwen-tokenizer", &qwen_tokenizer());
}

#[test]
fn smollm2_tokenizer_goldens() {
    check("smollm2-135m", &fixture("smollm2-135m"));
}

#[test]
fn smollm2_chat_golden_prompt_ids() {
    let dir = fixture("smollm2-135m");
    let tok = text::Tokenizer::load(&dir).unwrap();
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference/chat_goldens.json")).unwrap()).unwrap();
    let case = &g[0];
    let messages = serde_json::json!([{"role": "user", "content": case["question"]}]);
    assert_eq!(tok.encode_chat(&messages, true).unwrap(), ids(&case["prompt_ids"]));
    assert_eq!(tok.decode(&ids(&case["greedy_ids"]), true).unwrap(), case["greedy_text"].as_str().unwrap());
}

/// Streaming pieces concatenate to the full decode and never hold a broken character.
#[test]
fn incremental_decode_is_lossless() {
    let tok = text::Tokenizer::load(&qwen_tokenizer()).unwrap();
    let s = "数学很有趣 🤖🚀 é à ü, done.";
    let all = tok.encode(s, false).unwrap();
    let mut d = text::IncrementalDecoder::new(true);
    let mut out = String::new();
    for &id in &all {
        let piece = d.push(&tok, id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "broken character in {piece:?}");
        out.push_str(&piece);
    }
    out.push_str(&d.flush(&tok).unwrap());
    assert_eq!(out, s);
}
