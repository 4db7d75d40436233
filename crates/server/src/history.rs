//! The tool-calling turns of a chat history: an assistant message's `tool_calls` and `tool`
//! messages with their results. A chat template that speaks a tool-call dialect
//! ([`crate::dialect`]) gets them as vLLM and SGLang pass them (arguments as JSON objects,
//! not strings); for any other template they are written into the messages' text in Hermes's
//! syntax ([`generic`]), as Qwen's template would have, so no turn is dropped.

use crate::dialect::{HERMES_CLOSE as CLOSE, HERMES_OPEN as OPEN};
use crate::error::ApiError;
use serde_json::{json, Value};

fn bad(message: String) -> ApiError {
    ApiError::bad(message, Some("messages"))
}

/// Message `i`'s `tool_calls` (OpenAI's shape: `[{id, type: "function", function: {name,
/// arguments}}]`, arguments a JSON string), checked, with the arguments parsed into objects.
pub fn tool_calls(i: usize, calls: &Value) -> Result<Value, ApiError> {
    let calls = calls
        .as_array()
        .filter(|a| !a.is_empty())
        .ok_or_else(|| bad(format!("messages[{i}].tool_calls must be a non-empty list of calls")))?;
    let mut out = Vec::with_capacity(calls.len());
    for (j, c) in calls.iter().enumerate() {
        let at = format!("messages[{i}].tool_calls[{j}]");
        let text = |v: Option<&Value>, what: &str| -> Result<String, ApiError> {
            v.and_then(Value::as_str).map(str::to_string).ok_or_else(|| bad(format!("{at}.{what} must be a string")))
        };
        let id = text(c.get("id"), "id")?;
        if c.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(format!("{at}.type must be \"function\"")));
        }
        let f = c.get("function");
        let name = text(f.and_then(|f| f.get("name")), "function.name")?;
        let args = text(f.and_then(|f| f.get("arguments")), "function.arguments")?;
        let args: Value =
            serde_json::from_str(&args).map_err(|e| bad(format!("{at}.function.arguments is not JSON: {e}")))?;
        if !args.is_object() {
            return Err(bad(format!("{at}.function.arguments must be a JSON object")));
        }
        out.push(serde_json::json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}));
    }
    Ok(Value::Array(out))
}

/// Checks a `tool` message (`i`) before its content is read: it names the call it answers.
pub fn tool_result(i: usize, m: &Value) -> Result<(), ApiError> {
    if !m.get("tool_call_id").is_some_and(Value::is_string) {
        return Err(bad(format!("messages[{i}] (tool) needs a `tool_call_id` string")));
    }
    Ok(())
}

/// One call as Qwen's template writes it after an assistant's text.
fn call_text(call: &Value) -> String {
    let f = &call["function"];
    let body = json!({"name": f["name"], "arguments": f["arguments"]});
    format!("{OPEN}\n{}\n{CLOSE}", text::python_json(&body))
}

/// `messages` (checked, arguments parsed) for a template that does not render tool-calling
/// turns: each call written after its assistant message's text, each run of `tool` messages
/// one user message of `<tool_response>` blocks; `system` (the tools' description, if any)
/// appended to the first system message or sent as one.
pub fn generic(messages: Vec<Value>, system: Option<String>) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::with_capacity(messages.len() + 1);
    // The last message written is a user turn of tool results (the next result joins it).
    let mut in_results = false;
    for mut m in messages {
        let role = m["role"].as_str().unwrap_or_default().to_string();
        let content = m["content"].as_str().unwrap_or_default().to_string();
        if let Some(calls) = m.as_object_mut().and_then(|o| o.remove("tool_calls")) {
            let mut text = content.clone();
            for c in calls.as_array().into_iter().flatten() {
                if !text.is_empty() {
                    text.push('\n');
                }
                text += &call_text(c);
            }
            m["content"] = Value::String(text);
        }
        if role == "tool" {
            let block = format!("<tool_response>\n{content}\n</tool_response>");
            match out.last_mut() {
                Some(prev) if in_results => {
                    let joined = format!("{}\n{block}", prev["content"].as_str().unwrap_or_default());
                    prev["content"] = Value::String(joined);
                }
                _ => out.push(json!({"role": "user", "content": block})),
            }
            in_results = true;
            continue;
        }
        in_results = false;
        out.push(m);
    }
    if let Some(sys) = system {
        match out.first_mut() {
            Some(first) if first["role"] == "system" => {
                let joined = format!("{}\n\n{sys}", first["content"].as_str().unwrap_or_default());
                first["content"] = Value::String(joined);
            }
            _ => out.insert(0, json!({"role": "system", "content": sys})),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_become_objects() {
        let calls = json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]);
        let got = tool_calls(0, &calls).unwrap();
        assert_eq!(got[0]["function"]["arguments"], json!({"x": 1}));
        for (bad_calls, want) in [
            (json!([]), "non-empty list"),
            (json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]), "is not JSON"),
            (json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]), "JSON object"),
            (json!([{"id": "c", "type": "tool", "function": {"name": "f", "arguments": "{}"}}]), ".type must be"),
            (json!([{"type": "function", "function": {"name": "f", "arguments": "{}"}}]), "tool_calls[0].id"),
        ] {
            let e = tool_calls(2, &bad_calls).unwrap_err();
            assert!(e.message.contains(want) && e.message.contains("messages[2]"), "{}", e.message);
        }
    }

    #[test]
    fn generic_writes_turns_as_text() {
        let call =
            |id: &str, x: i64| json!({"id": id, "type": "function", "function": {"name": "f", "arguments": {"x": x}}});
        let messages = vec![
            json!({"role": "user", "content": "q"}),
            json!({"role": "assistant", "content": "", "tool_calls": [call("a", 1), call("b", 2)]}),
            json!({"role": "tool", "content": "r1", "tool_call_id": "a"}),
            json!({"role": "tool", "content": "r2", "tool_call_id": "b"}),
            json!({"role": "assistant", "content": "done"}),
        ];
        let out = generic(messages.clone(), Some("TOOLS".into()));
        let want = json!([
            {"role": "system", "content": "TOOLS"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 2}}\n</tool_call>"},
            {"role": "user", "content": "<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response>"},
            {"role": "assistant", "content": "done"},
        ]);
        assert_eq!(Value::Array(out), want);
        let mut with_system = vec![json!({"role": "system", "content": "Be brief."})];
        with_system.extend(messages);
        let out = generic(with_system, Some("TOOLS".into()));
        assert_eq!(out[0], json!({"role": "system", "content": "Be brief.\n\nTOOLS"}));
        assert_eq!(out.len(), 5);
    }
}
