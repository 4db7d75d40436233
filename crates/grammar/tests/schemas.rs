//! Property test: for random JSON schemas from a generator (strings with length bounds, bounded
//! integers, booleans, null, enums, arrays with item bounds, nested objects with optional and
//! required properties, unions), every walk through the masks (any allowed token, at random,
//! until end-of-sequence: what a model the grammar must hold against may do) ends with text
//! that is JSON valid under the schema, checked by a validator of its own.

use grammar::{Grammars, Spec};
use proptest::prelude::*;
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::sync::OnceLock;

/// A schema of the generator.
#[derive(Debug, Clone)]
enum S {
    Str { min: usize, max: usize },
    Int { lo: i64, hi: i64 },
    Bool,
    Null,
    Enum(Vec<String>),
    Array { items: Box<S>, min: usize, max: usize },
    Object(Vec<(String, S, bool)>),
    AnyOf(Box<S>, Box<S>),
}

impl S {
    fn schema(&self) -> Value {
        match self {
            S::Str { min, max } => json!({"type": "string", "minLength": min, "maxLength": max}),
            S::Int { lo, hi } => json!({"type": "integer", "minimum": lo, "maximum": hi}),
            S::Bool => json!({"type": "boolean"}),
            S::Null => json!({"type": "null"}),
            S::Enum(v) => json!({"enum": v}),
            S::Array { items, min, max } => {
                json!({"type": "array", "items": items.schema(), "minItems": min, "maxItems": max})
            }
            S::Object(props) => {
                let p: Map<String, Value> = props.iter().map(|(k, s, _)| (k.clone(), s.schema())).collect();
                let req: Vec<&String> = props.iter().filter(|(_, _, r)| *r).map(|(k, _, _)| k).collect();
                json!({"type": "object", "properties": p, "required": req, "additionalProperties": false})
            }
            S::AnyOf(a, b) => json!({"anyOf": [a.schema(), b.schema()]}),
        }
    }

    /// Whether `v` is valid under this schema; the path and reason if not.
    fn check(&self, v: &Value, at: &str) -> Result<(), String> {
        let fail = |why: &str| Err(format!("{at}: {why} ({v})"));
        match self {
            S::Str { min, max } => match v.as_str().map(|s| s.chars().count()) {
                Some(n) if (*min..=*max).contains(&n) => Ok(()),
                _ => fail("not a string of the bounds"),
            },
            // An integer is a number without a fraction (JSON Schema): -0 is one, and serde_json
            // reads it as a float.
            S::Int { lo, hi } => match v.as_f64() {
                Some(x) if x.fract() == 0.0 && (*lo as f64..=*hi as f64).contains(&x) => Ok(()),
                _ => fail("not an integer in the bounds"),
            },
            S::Bool if v.is_boolean() => Ok(()),
            S::Null if v.is_null() => Ok(()),
            S::Enum(opts) if opts.iter().any(|o| v == o) => Ok(()),
            S::Array { items, min, max } => {
                let a = v.as_array().ok_or_else(|| format!("{at}: not an array ({v})"))?;
                if !(*min..=*max).contains(&a.len()) {
                    return fail("array length out of bounds");
                }
                a.iter().enumerate().try_for_each(|(i, x)| items.check(x, &format!("{at}[{i}]")))
            }
            S::Object(props) => {
                let o = v.as_object().ok_or_else(|| format!("{at}: not an object ({v})"))?;
                if let Some(k) = o.keys().find(|k| !props.iter().any(|(p, _, _)| p == *k)) {
                    return fail(&format!("unknown property {k}"));
                }
                for (k, s, required) in props {
                    match o.get(k) {
                        Some(x) => s.check(x, &format!("{at}.{k}"))?,
                        None if *required => return fail(&format!("missing {k}")),
                        None => {}
                    }
                }
                Ok(())
            }
            S::AnyOf(a, b) => a.check(v, at).or_else(|_| b.check(v, at)),
            _ => fail("wrong type"),
        }
    }
}

fn leaf() -> impl Strategy<Value = S> {
    let word = "[a-z]{1,4}( [a-z]{1,3})?";
    prop_oneof![
        (0usize..3, 0usize..6).prop_map(|(min, extra)| S::Str { min, max: min + extra }),
        (-50i64..50, 0i64..200).prop_map(|(lo, span)| S::Int { lo, hi: lo + span }),
        Just(S::Bool),
        Just(S::Null),
        prop::collection::vec(word, 1..4).prop_map(|mut v| {
            v.sort();
            v.dedup();
            S::Enum(v)
        }),
    ]
}

fn schema() -> impl Strategy<Value = S> {
    leaf().prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            (inner.clone(), 0usize..2, 0usize..3).prop_map(|(items, min, extra)| S::Array {
                items: Box::new(items),
                min,
                max: min + extra
            }),
            prop::collection::vec(("[a-z]{1,6}", inner.clone(), any::<bool>()), 1..4).prop_map(|props| {
                let mut seen = std::collections::HashSet::new();
                S::Object(props.into_iter().filter(|(k, _, _)| seen.insert(k.clone())).collect())
            }),
            (inner.clone(), inner).prop_map(|(a, b)| S::AnyOf(Box::new(a), Box::new(b))),
        ]
    })
}

mod common;

fn fixture() -> PathBuf {
    common::fixture("tiny-qwen2")
}

/// tiny-qwen2's tokenizer (a cut of Qwen's), its grammar engine and its eos.
fn engine() -> &'static (Grammars, text::Tokenizer) {
    static E: OnceLock<(Grammars, text::Tokenizer)> = OnceLock::new();
    E.get_or_init(|| {
        let json = std::fs::read(fixture().join("tokenizer.json")).unwrap();
        (Grammars::load(&json, &[EOS], VOCAB).unwrap(), text::Tokenizer::load(&fixture()).unwrap())
    })
}
const EOS: u32 = 976;
const VOCAB: usize = 1024;

/// A walk's text: tokens chosen by `seed` among the allowed until end-of-sequence.
fn walk(spec: &Spec, seed: u64) -> Result<String, String> {
    let mut rng = common::Rng(seed);
    let (g, tok) = engine();
    let c = g.compile(spec)?;
    let mut out = vec![];
    loop {
        let mut logits = vec![0.0f32; VOCAB];
        c.mask(&mut logits);
        let allowed: Vec<u32> = (0..VOCAB as u32).filter(|&t| logits[t as usize].is_finite()).collect();
        if allowed.is_empty() {
            return Err(format!("nothing allowed after {:?}", tok.decode(&out, false)));
        }
        let t = allowed[rng.below(allowed.len())];
        if t == EOS {
            return tok.decode(&out, false).map_err(|e| e.to_string());
        }
        c.accept(t);
        out.push(t);
        if out.len() > 1500 {
            return Err(format!("no end after {:?}", tok.decode(&out, false)));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn every_walk_validates_under_its_random_schema(s in schema(), seed in 1u64..u64::MAX) {
        let spec = Spec::JsonSchema(grammar::json_layout(s.schema()));
        let text = walk(&spec, seed).map_err(|e| TestCaseError::fail(format!("{}: {e}", s.schema())))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| TestCaseError::fail(format!("{}: not JSON ({e}): {text}", s.schema())))?;
        s.check(&v, "$").map_err(|e| TestCaseError::fail(format!("{}: {e}: {text}", s.schema())))?;
    }
}

/// A model whose end token lies past its tokenizer's ids (a random checkpoint's config over a
/// cut tokenizer: Qwen3-MoE's 151645 on 1000 tokens) loads, and once the regex is done that
/// token, and only the end tokens, may follow.
#[test]
fn an_end_token_past_the_tokenizers_ids_ends_the_output() {
    let json = std::fs::read(fixture().join("tokenizer.json")).unwrap();
    let (far, vocab) = (151_645u32, 151_936usize);
    let g = Grammars::load(&json, &[far], vocab).unwrap();
    let c = g.compile(&Spec::Regex("a".into())).unwrap();
    let (_, tok) = engine();
    for t in tok.encode("a", false).unwrap() {
        c.accept(t);
    }
    let mut logits = vec![0.0f32; vocab];
    c.mask(&mut logits);
    let allowed: Vec<usize> = (0..vocab).filter(|&t| logits[t].is_finite()).collect();
    assert!(allowed.contains(&(far as usize)), "{allowed:?}");
    assert!(allowed.len() <= 2, "{allowed:?}");
}
