//! What a request's output must follow: OpenAI's `response_format` (`json_object`, or
//! `json_schema` with its `schema`), SGLang's `regex`, `json_schema` (a schema as a JSON
//! string or object) and `ebnf` (a grammar in llama.cpp's GBNF notation), vLLM's
//! `guided_grammar` (GBNF, or a Lark grammar in llguidance's dialect), at most one of them,
//! turned into a [`grammar::Spec`] and compiled per choice against the served tokenizer (a
//! schema, expression or grammar that does not compile is a 400 naming the field).

use crate::error::ApiError;
use grammar::{Grammars, Spec};
use runtime::Constraint;
use serde_json::Value;

/// A request's output format and the field that gave it.
#[derive(Debug, Clone, PartialEq)]
pub struct Format {
    /// What the output must be.
    pub spec: Spec,
    /// The request field it came from (errors name it).
    pub field: &'static str,
}

/// The formats a request may give (each field is optional).
#[derive(Debug, Clone, Copy, Default)]
pub struct Fields<'a> {
    /// OpenAI's `response_format`.
    pub response_format: Option<&'a Value>,
    /// SGLang's `regex`.
    pub regex: Option<&'a str>,
    /// SGLang's `json_schema`.
    pub json_schema: Option<&'a Value>,
    /// SGLang's `ebnf`.
    pub ebnf: Option<&'a str>,
    /// vLLM's `guided_grammar`.
    pub guided_grammar: Option<&'a str>,
}

/// The format of a request with these fields (`None`: free text).
pub fn parse(fields: Fields) -> Result<Option<Format>, ApiError> {
    let Fields { response_format, regex, json_schema, ebnf, guided_grammar } = fields;
    let mut found = vec![];
    if let Some(rf) = response_format.filter(|v| !v.is_null()) {
        if let Some(spec) = response(rf)? {
            found.push(Format { spec, field: "response_format" });
        }
    }
    if let Some(rx) = regex {
        found.push(Format { spec: Spec::Regex(rx.to_string()), field: "regex" });
    }
    if let Some(s) = json_schema.filter(|v| !v.is_null()) {
        found.push(Format { spec: Spec::JsonSchema(schema_value(s)?), field: "json_schema" });
    }
    for (text, field) in [(ebnf, "ebnf"), (guided_grammar, "guided_grammar")] {
        if let Some(t) = text {
            found.push(Format { spec: Spec::Lark(lark(t, field)?), field });
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|f| f.field).collect();
        return Err(ApiError::bad(
            format!(
                "give at most one of response_format, regex, json_schema, ebnf and guided_grammar, got {}",
                names.join(" and ")
            ),
            Some(found[1].field),
        ));
    }
    Ok(found.pop())
}

/// The longest grammar text a request may give: llguidance's compiler recurses once per nested
/// rule, and this bounds a Lark grammar's chains to what the server's 64 MiB stacks hold (GBNF
/// is bounded by `grammar::ebnf` itself).
const MAX_GRAMMAR_BYTES: usize = 64 << 10;

/// A grammar's text as llguidance's Lark: GBNF (it defines rules with `::=`, as llama.cpp's and
/// SGLang's grammars do) translated, anything else taken as Lark (vLLM tells the two apart the
/// same way).
fn lark(text: &str, field: &'static str) -> Result<String, ApiError> {
    if text.len() > MAX_GRAMMAR_BYTES {
        let n = text.len();
        return Err(ApiError::bad(
            format!("{field}: at most {MAX_GRAMMAR_BYTES} bytes of grammar, got {n}"),
            Some(field),
        ));
    }
    if text.contains("::=") {
        grammar::ebnf::gbnf_to_lark(text).map_err(|e| ApiError::bad(format!("{field}: {e}"), Some(field)))
    } else {
        Ok(text.to_string())
    }
}

/// OpenAI's `response_format`: `text` (none), `json_object`, `json_schema`.
fn response(rf: &Value) -> Result<Option<Spec>, ApiError> {
    let bad = |m: String| Err(ApiError::bad(m, Some("response_format")));
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Spec::JsonObject)),
        Some("json_schema") => match rf.get("json_schema").and_then(|j| j.get("schema")) {
            Some(s) if s.is_object() || s.is_boolean() => Ok(Some(Spec::JsonSchema(s.clone()))),
            _ => bad("response_format json_schema needs `json_schema.schema`, a JSON schema object".into()),
        },
        _ => bad(format!(
            "response_format.type must be text, json_object or json_schema, got {}",
            rf.get("type").unwrap_or(&Value::Null)
        )),
    }
}

/// SGLang's `json_schema`: the schema as a JSON string, or the object itself.
fn schema_value(v: &Value) -> Result<Value, ApiError> {
    match v {
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| ApiError::bad(format!("json_schema is not valid JSON: {e}"), Some("json_schema"))),
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        _ => {
            Err(ApiError::bad("json_schema must be a JSON schema (an object, or one as a string)", Some("json_schema")))
        }
    }
}

impl Format {
    /// One choice's constraint; `grammars` is `None` when the served tokenizer could not be
    /// loaded for constrained decoding.
    pub fn compile(&self, grammars: Option<&Grammars>) -> Result<Constraint, ApiError> {
        let g = grammars.ok_or_else(|| {
            ApiError::bad("this server has no grammar engine for its tokenizer (see its log)", Some(self.field))
        })?;
        g.compile(&self.spec).map_err(|e| ApiError::bad(format!("{}: {e}", self.field), Some(self.field)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rf(v: &Value) -> Fields<'_> {
        Fields { response_format: Some(v), ..Fields::default() }
    }

    #[test]
    fn each_field_gives_its_spec_and_two_are_refused() {
        let obj = json!({"type": "object"});
        assert_eq!(parse(Fields::default()).unwrap(), None);
        assert_eq!(parse(rf(&json!({"type": "text"}))).unwrap(), None);
        let f = parse(rf(&json!({"type": "json_object"}))).unwrap().unwrap();
        assert_eq!((f.spec, f.field), (Spec::JsonObject, "response_format"));
        let schema = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": obj}});
        assert_eq!(parse(rf(&schema)).unwrap().unwrap().spec, Spec::JsonSchema(obj.clone()));
        let s = json!(obj.to_string());
        let f = parse(Fields { json_schema: Some(&s), ..Fields::default() }).unwrap().unwrap();
        assert_eq!(f.spec, Spec::JsonSchema(obj.clone()));
        let f = parse(Fields { regex: Some("a+"), ..Fields::default() }).unwrap().unwrap();
        assert_eq!(f.spec, Spec::Regex("a+".into()));
        let e = parse(Fields { regex: Some("a"), ..rf(&json!({"type": "json_object"})) }).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("regex"));
        let e = parse(rf(&json!({"type": "json_schema"}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format"));
        let e = parse(Fields { json_schema: Some(&json!("{not json")), ..Fields::default() }).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("json_schema"));
        // Grammars: GBNF translated, Lark as it is; a GBNF that does not parse names its field.
        let f = parse(Fields { ebnf: Some("root ::= \"yes\" | \"no\""), ..Fields::default() }).unwrap().unwrap();
        assert!(matches!(&f.spec, Spec::Lark(l) if l.contains("start")) && f.field == "ebnf", "{f:?}");
        let f = parse(Fields { guided_grammar: Some("start: \"a\"+"), ..Fields::default() }).unwrap().unwrap();
        assert_eq!((f.spec, f.field), (Spec::Lark("start: \"a\"+".into()), "guided_grammar"));
        let e = parse(Fields { ebnf: Some("root ::= ( \"a\""), ..Fields::default() }).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("ebnf"));
        let long = format!("start: {}", "\"a\" ".repeat(20_000));
        let e = parse(Fields { guided_grammar: Some(&long), ..Fields::default() }).unwrap_err();
        assert!(e.message.contains("at most 65536 bytes") && e.param.as_deref() == Some("guided_grammar"), "{e:?}");
        let e = parse(Fields { ebnf: Some("root ::= \"a\""), regex: Some("a"), ..Fields::default() }).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("ebnf"));
    }
}
