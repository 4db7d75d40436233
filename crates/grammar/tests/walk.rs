//! Random walks through the masks, as a property test: from each state any allowed token is
//! taken (seeded), which is what a model the grammar must hold against may do. Every walk must
//! end (the formats are bounded), every token the mask allowed must be accepted (a refused one
//! leaves only end-of-sequence, and the output breaks the format), and the text must be an
//! output of the format. SmolLM2's tokenizer (byte-level, with an unusual decoder sequence) and
//! Qwen's cut one.

mod common;
use common::{fixture, Rng};

use grammar::{Grammars, Spec};
use serde_json::{json, Value};

/// One walk's text: tokens chosen at random among the allowed until end-of-sequence.
fn walk(g: &Grammars, spec: &Spec, tok: &text::Tokenizer, eos: u32, vocab: usize, rng: &mut Rng) -> String {
    let c = g.compile(spec).unwrap();
    let mut out = vec![];
    loop {
        let mut logits = vec![0.0f32; vocab];
        c.mask(&mut logits);
        let allowed: Vec<u32> = (0..vocab as u32).filter(|&t| logits[t as usize].is_finite()).collect();
        assert!(!allowed.is_empty(), "{spec:?}: nothing allowed after {out:?}");
        let t = allowed[rng.below(allowed.len())];
        if t == eos {
            return tok.decode(&out, false).unwrap();
        }
        c.accept(t);
        out.push(t);
        assert!(out.len() < 400, "{spec:?}: no end after {:?}", tok.decode(&out, false));
    }
}

fn person() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "kind": {"enum": ["cat", "dog", "a b"]},
            "n": {"type": "integer", "minimum": -3, "maximum": 50},
            "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
            "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}
        },
        "required": ["name", "kind", "n", "tags", "inner"],
        "additionalProperties": false
    })
}

fn valid_person(text: &str) -> bool {
    let Ok(v) = serde_json::from_str::<Value>(text) else { return false };
    let tags = v["tags"].as_array();
    v.as_object().is_some_and(|o| o.len() == 5)
        && v["name"].as_str().is_some_and(|s| s.chars().count() <= 6)
        && ["cat", "dog", "a b"].iter().any(|k| v["kind"] == *k)
        // -0 is an integer too (serde_json reads it as a float)
        && v["n"].as_f64().is_some_and(|n| n.fract() == 0.0 && (-3.0..=50.0).contains(&n))
        && tags.is_some_and(|t| t.len() <= 3 && t.iter().all(|x| x.as_u64().is_some_and(|x| x <= 9)))
        && v["inner"]["ok"].is_boolean()
        && v["inner"].as_object().is_some_and(|o| o.len() == 1)
}

#[test]
fn every_walk_ends_in_the_format() {
    let rx = "[a-z]{2,5}(-[0-9]{1,3})?( [A-Z]{1,2}){0,2}";
    let full = regex::Regex::new(&format!("^(?:{rx})$")).unwrap();
    // fixture, eos, vocabulary (the model's, at least the tokenizer's)
    for (name, eos, vocab) in [("smollm2-135m", 2, 49152), ("tiny-qwen2", 976, 1024)] {
        let dir = fixture(name);
        let json = std::fs::read(dir.join("tokenizer.json")).unwrap();
        let tok = text::Tokenizer::load(&dir).unwrap();
        let g = Grammars::load(&json, &[eos], vocab).unwrap();
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for i in 0..30 {
            let text = walk(&g, &Spec::JsonSchema(person()), &tok, eos, vocab, &mut rng);
            assert!(valid_person(&text), "{name} walk {i}: {text}");
            let text = walk(&g, &Spec::Regex(rx.into()), &tok, eos, vocab, &mut rng);
            assert!(full.is_match(&text), "{name} walk {i}: {text:?}");
        }
    }
}

#[test]
fn what_does_not_compile_is_an_error() {
    let json = std::fs::read(fixture("tiny-qwen2").join("tokenizer.json")).unwrap();
    let g = Grammars::load(&json, &[976], 1024).unwrap();
    for bad in [
        Spec::Regex("(unclosed".into()),
        Spec::JsonSchema(json!({"type": "nonsense"})),
        Spec::Lark("start: undefined_rule".into()),
    ] {
        assert!(g.compile(&bad).is_err(), "{bad:?}");
    }
    assert!(g.compile(&Spec::Lark("start: \"a\" | \"b\"".into())).is_ok());
}

/// A Lark grammar with literals around an embedded JSON schema (the shape of the server's
/// tool-call grammar): walks write the literals, then JSON of the schema, then end.
#[test]
fn lark_with_embedded_json_walks_to_its_end() {
    let dir = fixture("tiny-qwen2");
    let json = std::fs::read(dir.join("tokenizer.json")).unwrap();
    let tok = text::Tokenizer::load(&dir).unwrap();
    let g = Grammars::load(&json, &[976], 1024).unwrap();
    let schema = grammar::json_layout(person());
    // `<tool_call>` is a token of its own: llguidance reads it as a special token (by name).
    let lark = format!("start: call (\"\\n\" call)*\ncall: <tool_call> \"\\n\" %json {schema} \"\\n\" </tool_call>\n");
    // SmolLM2 has no such token: the same text, as a string.
    let smol = fixture("smollm2-135m");
    let smol_g = Grammars::load(&std::fs::read(smol.join("tokenizer.json")).unwrap(), &[2], 49152).unwrap();
    let smol_tok = text::Tokenizer::load(&smol).unwrap();
    let smol_lark = lark
        .replace("<tool_call> \"\\n\"", "\"<tool_call>\\n\"")
        .replace("\"\\n\" </tool_call>", "\"\\n</tool_call>\"");
    assert_ne!(smol_lark, lark);
    let mut rng = Rng(11);
    for i in 0..24 {
        let text = match i % 3 {
            0 => walk(&smol_g, &Spec::Lark(smol_lark.clone()), &smol_tok, 2, 49152, &mut rng),
            _ => walk(&g, &Spec::Lark(lark.clone()), &tok, 976, 1024, &mut rng),
        };
        for block in text.split("\n<tool_call>\n").map(|b| b.trim_start_matches("<tool_call>\n")) {
            let body = block.strip_suffix("\n</tool_call>").unwrap_or_else(|| panic!("{text:?}"));
            assert!(valid_person(body), "{text:?}");
        }
    }
}
