//! The tool-calling turns of a chat history: an assistant message's `tool_calls` and `tool`
//! messages with their results, passed to the model's chat template as vLLM and SGLang pass
//! them (arguments as JSON objects, not strings), where the template renders them; a history
//! the template cannot render is refused rather than silently dropped.

use crate::error::ApiError;
use serde_json::Value;

/// What the model's chat template renders of tool-calling turns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ToolTurns {
    /// Assistant messages' `tool_calls`.
    pub calls: bool,
    /// `tool` messages (results).
    pub results: bool,
}

impl ToolTurns {
    /// Read from the template's source: it renders calls if it reads `tool_calls`, results if it
    /// compares a role with `tool`.
    pub fn of_template(source: Option<&str>) -> ToolTurns {
        let s = source.unwrap_or_default();
        ToolTurns { calls: s.contains("tool_calls"), results: s.contains("\"tool\"") || s.contains("'tool'") }
    }
}

fn bad(message: String) -> ApiError {
    ApiError::bad(message, Some("messages"))
}

/// Message `i`'s `tool_calls` (OpenAI's shape: `[{id, type: "function", function: {name,
/// arguments}}]`, arguments a JSON string), checked, with the arguments parsed into objects.
pub fn tool_calls(i: usize, calls: &Value, turns: ToolTurns) -> Result<Value, ApiError> {
    if !turns.calls {
        return Err(bad(format!("messages[{i}]: this model's chat template does not render tool calls")));
    }
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

/// Checks a `tool` message (`i`) before its content is read: the template renders results and
/// the message names the call it answers.
pub fn tool_result(i: usize, m: &Value, turns: ToolTurns) -> Result<(), ApiError> {
    if !turns.results {
        return Err(bad(format!("messages[{i}]: this model's chat template does not render tool results")));
    }
    if !m.get("tool_call_id").is_some_and(Value::is_string) {
        return Err(bad(format!("messages[{i}] (tool) needs a `tool_call_id` string")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const BOTH: ToolTurns = ToolTurns { calls: true, results: true };

    #[test]
    fn arguments_become_objects() {
        let calls = json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]);
        let got = tool_calls(0, &calls, BOTH).unwrap();
        assert_eq!(got[0]["function"]["arguments"], json!({"x": 1}));
        for (bad_calls, want) in [
            (json!([]), "non-empty list"),
            (json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]), "is not JSON"),
            (json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]), "JSON object"),
            (json!([{"id": "c", "type": "tool", "function": {"name": "f", "arguments": "{}"}}]), ".type must be"),
            (json!([{"type": "function", "function": {"name": "f", "arguments": "{}"}}]), "tool_calls[0].id"),
        ] {
            let e = tool_calls(2, &bad_calls, BOTH).unwrap_err();
            assert!(e.message.contains(want) && e.message.contains("messages[2]"), "{}", e.message);
        }
        let e = tool_calls(0, &calls, ToolTurns { calls: false, results: true }).unwrap_err();
        assert!(e.message.contains("does not render tool calls"), "{}", e.message);
    }

    #[test]
    fn templates_say_what_they_render() {
        let qwen = "{%- for tool_call in message.tool_calls %}{%- elif message.role == \"tool\" %}";
        assert_eq!(ToolTurns::of_template(Some(qwen)), BOTH);
        assert_eq!(ToolTurns::of_template(Some("{{ message.content }}")), ToolTurns::default());
        assert_eq!(ToolTurns::of_template(None), ToolTurns::default());
    }
}
