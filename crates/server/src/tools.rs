//! OpenAI's tool calling, request side: `tools`, `tool_choice` and `parallel_tool_calls`
//! checked into [`Tools`]; how the model is told about the tools (its chat template's `tools`
//! variable where the template speaks the tool-call syntax, else a system message in that
//! syntax, [`Tools::system_text`]); and the grammar that makes `required` and named choices
//! always produce valid calls ([`Tools::grammar`]).
//!
//! The syntax is the model's dialect ([`Dialect`]: Hermes's `<tool_call>` blocks, Llama's JSON
//! objects, Mistral's `[TOOL_CALLS]` list); `tool_parse` reads it back.

use crate::api::{Job, Sampling};
use crate::dialect::{Dialect, HERMES_CLOSE as CLOSE, HERMES_OPEN as OPEN};
use crate::error::ApiError;
use crate::format::Format;
use serde_json::{json, Value};

/// Most tools one request may declare (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// One declared function.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    /// Its name.
    pub name: String,
    /// The JSON schema of its arguments (an object schema).
    pub parameters: Value,
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// The model decides: text, calls, or both (calls are parsed from what it writes).
    Auto,
    /// At least one call, enforced by a grammar.
    Required,
    /// A call of this function, enforced by a grammar.
    Named(String),
}

/// A request's tools.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The functions, in the request's order.
    pub functions: Vec<Function>,
    /// The `tools` list as sent (what chat templates render).
    pub declared: Value,
    /// What the model must do with them.
    pub choice: ToolChoice,
    /// More than one call per answer (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

fn bad(field: &'static str, message: String) -> ApiError {
    ApiError::bad(message, Some(field))
}

/// The request's tools; `None` when it declares none or `tool_choice` is `none` (the model is
/// not told about them and its output is plain text).
pub fn parse(
    tools: Option<&Value>,
    choice: Option<&Value>,
    parallel: Option<&Value>,
) -> Result<Option<Tools>, ApiError> {
    let parallel = match parallel {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(bad("parallel_tool_calls", format!("parallel_tool_calls must be a boolean, got {v}"))),
    };
    let declared = match tools {
        None | Some(Value::Null) => Value::Array(vec![]),
        Some(v) => v.clone(),
    };
    let list = declared.as_array().ok_or_else(|| bad("tools", "tools must be a list of tools".into()))?;
    if list.len() > MAX_TOOLS {
        return Err(bad("tools", format!("at most {MAX_TOOLS} tools, got {}", list.len())));
    }
    let mut functions: Vec<Function> = Vec::with_capacity(list.len());
    let strict = list.iter().any(|t| t.pointer("/function/strict") == Some(&Value::Bool(true)));
    for (i, t) in list.iter().enumerate() {
        let f = function(i, t)?;
        if functions.iter().any(|g| g.name == f.name) {
            return Err(bad("tools", format!("tools[{i}]: a second function named `{}`", f.name)));
        }
        functions.push(f);
    }
    let choice = match choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) if s == "none" => return Ok(None),
        Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
        Some(Value::String(s)) if s == "required" => ToolChoice::Required,
        Some(v) => ToolChoice::Named(named(v)?),
    };
    if functions.is_empty() {
        return match choice {
            ToolChoice::Auto => Ok(None),
            _ => Err(bad("tool_choice", "tool_choice other than none or auto needs tools".into())),
        };
    }
    // `strict` asks that calls follow their schemas: only a grammar of calls alone does that.
    if strict && choice == ToolChoice::Auto {
        return Err(bad(
            "tools",
            "function.strict: true needs tool_choice required or a named function (with auto the \
             model's calls are read back, not enforced)"
                .into(),
        ));
    }
    if let ToolChoice::Named(n) = &choice {
        if !functions.iter().any(|f| &f.name == n) {
            return Err(bad("tool_choice", format!("tool_choice names `{n}`, which is not among the tools")));
        }
    }
    Ok(Some(Tools { functions, declared, choice, parallel }))
}

/// `tools[i]`: `{type: "function", function: {name, description?, parameters?, strict?}}`.
fn function(i: usize, t: &Value) -> Result<Function, ApiError> {
    let at = |what: &str| bad("tools", format!("tools[{i}]{what}"));
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(at(".type must be \"function\""));
    }
    let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| at(".function must be an object"))?;
    let name = f.get("name").and_then(Value::as_str).ok_or_else(|| at(".function.name must be a string"))?;
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if name.is_empty() || name.len() > 64 || !name.chars().all(valid) {
        return Err(at(&format!(".function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got `{name}`")));
    }
    if f.get("description").is_some_and(|d| !d.is_null() && !d.is_string()) {
        return Err(at(".function.description must be a string"));
    }
    if f.get("strict").is_some_and(|d| !d.is_null() && !d.is_boolean()) {
        return Err(at(".function.strict must be a boolean"));
    }
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p) if p.is_object() => p.clone(),
        Some(_) => return Err(at(".function.parameters must be a JSON schema object")),
    };
    Ok(Function { name: name.to_string(), parameters })
}

/// A named `tool_choice`: `{type: "function", function: {name}}`.
fn named(v: &Value) -> Result<String, ApiError> {
    let name = v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
    match (v.get("type").and_then(Value::as_str), name) {
        (Some("function"), Some(n)) => Ok(n.to_string()),
        _ => Err(bad(
            "tool_choice",
            format!("tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {v}"),
        )),
    }
}

impl Tools {
    /// The functions a call may name: the named one, or all.
    fn callable(&self) -> impl Iterator<Item = &Function> {
        self.functions.iter().filter(|f| match &self.choice {
            ToolChoice::Named(n) => &f.name == n,
            _ => true,
        })
    }

    /// The Lark grammar (llguidance's dialect) of an answer that is only calls in `dialect`,
    /// one call when the choice is named or calls are not parallel; `None` for `auto`. Each
    /// call is JSON whose `name` is a callable function's and whose arguments follow its
    /// schema. `markers`: the token ids of the dialect's markers ([`Dialect::markers`]) where
    /// each is a token of its own, which the grammar names as tokens (models trained on the
    /// syntax write them so; the grammar engine reads them as special tokens); else they are
    /// text.
    pub fn grammar(&self, dialect: Dialect, markers: Option<&[u32]>) -> Option<String> {
        if self.choice == ToolChoice::Auto {
            return None;
        }
        let args = dialect.arguments_key();
        let bodies: Vec<Value> = self
            .callable()
            .map(|f| {
                json!({"type": "object", "properties": {"name": {"const": f.name}, args: f.parameters},
                    "required": ["name", args], "additionalProperties": false})
            })
            .collect();
        let body = grammar::json_layout(json!({"anyOf": bodies}));
        let many = self.parallel && matches!(self.choice, ToolChoice::Required);
        let lit = |s: &str| Value::String(s.to_string()).to_string();
        let token = |i: usize, s: &str| markers.map_or_else(|| lit(s), |ids| format!("<[{}]>", ids[i]));
        let (start, call) = match dialect {
            Dialect::Hermes => {
                let start = if many { "start: call (\"\\n\" call)*" } else { "start: call" };
                let (open, close) = (token(0, OPEN), token(1, CLOSE));
                (start.to_string(), format!("{open} \"\\n\" %json {body} \"\\n\" {close}"))
            }
            Dialect::Llama => {
                let start = if many { "start: call (\"; \" call)*" } else { "start: call" };
                (start.to_string(), format!("%json {body}"))
            }
            Dialect::Mistral => {
                let calls = if many { "call (\", \" call)*" } else { "call" };
                let open = token(0, crate::dialect::MISTRAL_CALLS);
                (format!("start: {open} \"[\" {calls} \"]\""), format!("%json {body}"))
            }
        };
        Some(format!("{start}\ncall: {call}\n"))
    }

    /// Sets `job` up for these tools: its choices' calls are read back, and `required` or a
    /// named choice is enforced by [`Tools::grammar`] (which ends the output: not with
    /// `ignore_eos` or `min_tokens`, nor with another output format).
    /// `dialect` and `markers` as for [`Tools::grammar`].
    pub fn apply(
        &self,
        job: &mut Job,
        sampling: &Sampling,
        dialect: Dialect,
        markers: Option<&[u32]>,
    ) -> Result<(), ApiError> {
        job.tool_calls = Some(dialect);
        if let Some(f) = &job.format {
            return Err(bad(
                f.field,
                format!("{} with tools needs tool_choice none (the answer is either calls or that format)", f.field),
            ));
        }
        let Some(g) = self.grammar(dialect, markers) else { return Ok(()) };
        if sampling.ignore_eos {
            return Err(bad("ignore_eos", "tool_choice required or named ends the output: not with ignore_eos".into()));
        }
        if sampling.min_tokens.is_some_and(|m| m > 0) {
            return Err(bad("min_tokens", "tool_choice required or named ends the output: not with min_tokens".into()));
        }
        job.format = Some(Format { spec: grammar::Spec::Lark(g), field: "tools" });
        Ok(())
    }

    /// The system text that tells a model whose chat template does not render tools what
    /// they are and how to call them (the Hermes wording Qwen's templates use).
    pub fn system_text(&self) -> String {
        let tools: Vec<String> = self.declared.as_array().into_iter().flatten().map(text::python_json).collect();
        format!(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with \
             function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\nFor each function call, \
             return a json object with function name and arguments within {OPEN}{CLOSE} XML tags:\n{OPEN}\n\
             {{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CLOSE}",
            tools.join("\n")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> Value {
        json!({"type": "function", "function": {"name": name, "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    #[test]
    fn choices_parse_and_bad_ones_name_their_field() {
        let tools = json!([tool("get_weather"), tool("get_time")]);
        let t = parse(Some(&tools), None, None).unwrap().unwrap();
        assert_eq!((t.choice.clone(), t.parallel, t.functions.len()), (ToolChoice::Auto, true, 2));
        assert_eq!(parse(Some(&tools), Some(&json!("none")), None).unwrap(), None);
        assert_eq!(parse(None, Some(&json!("auto")), None).unwrap(), None);
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        let strict = json!([{"type": "function", "function": {"name": "get_time", "strict": true}}]);
        assert!(parse(Some(&strict), Some(&named), None).unwrap().is_some());
        let t = parse(Some(&tools), Some(&named), Some(&json!(false))).unwrap().unwrap();
        assert_eq!((t.choice, t.parallel), (ToolChoice::Named("get_time".into()), false));
        for (tools, choice, parallel, field, want) in [
            (json!([]), json!("required"), json!(null), "tool_choice", "needs tools"),
            (
                tools.clone(),
                json!({"type": "function", "function": {"name": "nope"}}),
                json!(null),
                "tool_choice",
                "not among",
            ),
            (tools.clone(), json!("always"), json!(null), "tool_choice", "must be none, auto"),
            (tools.clone(), json!(null), json!("yes"), "parallel_tool_calls", "boolean"),
            (json!([tool("a"), tool("a")]), json!(null), json!(null), "tools", "second function named `a`"),
            (json!([tool("has space")]), json!(null), json!(null), "tools", "tools[0].function.name"),
            (json!([{"type": "retrieval"}]), json!(null), json!(null), "tools", "tools[0].type"),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": [1]}}]),
                json!(null),
                json!(null),
                "tools",
                "parameters",
            ),
            (json!({"f": 1}), json!(null), json!(null), "tools", "a list of tools"),
            (
                json!([{"type": "function", "function": {"name": "f", "strict": true}}]),
                json!("auto"),
                json!(null),
                "tools",
                "strict",
            ),
        ] {
            let e = parse(Some(&tools), Some(&choice), Some(&parallel)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{}", e.message);
            assert!(e.message.contains(want), "{}", e.message);
        }
    }

    #[test]
    fn grammar_follows_the_choice_and_the_dialect() {
        let tools = json!([tool("get_weather"), tool("get_time")]);
        let auto = parse(Some(&tools), None, None).unwrap().unwrap();
        assert_eq!(auto.grammar(Dialect::Hermes, Some(&[5, 6])), None);
        let req = parse(Some(&tools), Some(&json!("required")), None).unwrap().unwrap();
        let g = req.grammar(Dialect::Hermes, None).unwrap();
        assert!(g.starts_with("start: call (\"\\n\" call)*\ncall: \"<tool_call>\" \"\\n\" %json {"), "{g}");
        assert!(g.ends_with("} \"\\n\" \"</tool_call>\"\n"), "{g}");
        let g = req.grammar(Dialect::Hermes, Some(&[5, 6])).unwrap();
        assert!(g.contains("\ncall: <[5]> \"\\n\" %json {") && g.ends_with("} \"\\n\" <[6]>\n"), "{g}");
        assert!(g.contains("get_weather") && g.contains("get_time") && g.contains("\"arguments\""), "{g}");
        let g = req.grammar(Dialect::Llama, None).unwrap();
        assert!(g.starts_with("start: call (\"; \" call)*\ncall: %json {") && g.contains("\"parameters\""), "{g}");
        assert!(!g.contains("\"arguments\""), "{g}");
        let g = req.grammar(Dialect::Mistral, Some(&[9])).unwrap();
        assert!(g.starts_with("start: <[9]> \"[\" call (\", \" call)* \"]\"\ncall: %json {"), "{g}");
        let g = req.grammar(Dialect::Mistral, None).unwrap();
        assert!(g.starts_with("start: \"[TOOL_CALLS]\" \"[\" call"), "{g}");
        let one = parse(Some(&tools), Some(&json!("required")), Some(&json!(false))).unwrap().unwrap();
        assert!(one.grammar(Dialect::Hermes, None).unwrap().starts_with("start: call\n"));
        assert!(one.grammar(Dialect::Mistral, None).unwrap().starts_with("start: \"[TOOL_CALLS]\" \"[\" call \"]\"\n"));
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        let g = parse(Some(&tools), Some(&named), None).unwrap().unwrap().grammar(Dialect::Llama, None).unwrap();
        assert!(g.starts_with("start: call\n") && g.contains("get_time") && !g.contains("get_weather"), "{g}");
    }

    #[test]
    fn system_text_lists_the_tools_as_python_writes_them() {
        let tools = json!([tool("get_weather")]);
        let t = parse(Some(&tools), None, None).unwrap().unwrap();
        let s = t.system_text();
        assert!(s.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""), "{s}");
        assert!(
            s.ends_with("<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
        );
    }
}
