//! The tool-call syntaxes models are trained on, and which one a chat template speaks.
//!
//! - [`Dialect::Hermes`] (Qwen2.5, Qwen3, Hermes and most fine-tunes): each call is a block
//!   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` after any text.
//! - [`Dialect::Llama`] (Llama 3.1, 3.2, 3.3): the whole answer is the calls, JSON objects
//!   `{"name": ..., "parameters": {...}}` separated by `; ` (optionally after the special token
//!   `<|python_tag|>`); tool results come back in `ipython` turns, which the template writes.
//! - [`Dialect::Mistral`] (Mistral 7B v0.3, Nemo, Small; tokenizers up to v7): text, then the
//!   special token `[TOOL_CALLS]` and a JSON list `[{"name": ..., "arguments": {...}}, ...]`;
//!   call ids are 9 letters and digits (its templates refuse others).
//!
//! A template that speaks none of them gets Hermes's, written by the server
//! ([`crate::history::generic`]).

use serde_json::Value;

/// A tool-call syntax.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Dialect {
    /// `<tool_call>` blocks.
    #[default]
    Hermes,
    /// JSON objects with `parameters`, the whole answer.
    Llama,
    /// `[TOOL_CALLS]` and a JSON list.
    Mistral,
}

/// How the model's chat template takes tools and tool-calling turns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ToolSyntax {
    /// It renders `tools`, assistant `tool_calls` and `tool` messages itself, in this dialect.
    Native(Dialect),
    /// It renders none of them (or in no syntax known here): the server writes them as text,
    /// in Hermes's syntax.
    #[default]
    Generic,
}

/// Hermes's block open and close.
pub const HERMES_OPEN: &str = "<tool_call>";
/// Hermes's block close.
pub const HERMES_CLOSE: &str = "</tool_call>";
/// What opens Mistral's list of calls.
pub const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
/// What may open Llama's calls.
pub const LLAMA_PYTHON_TAG: &str = "<|python_tag|>";

impl ToolSyntax {
    /// Read from the template's source: a template that reads `tool_calls` and writes one of
    /// the dialects' call syntaxes (and, for Hermes, renders `tool` messages) is native.
    pub fn of_template(source: Option<&str>) -> ToolSyntax {
        let s = source.unwrap_or_default();
        if !s.contains("tool_calls") {
            return ToolSyntax::Generic;
        }
        let results = s.contains("\"tool\"") || s.contains("'tool'");
        if s.contains(MISTRAL_CALLS) {
            ToolSyntax::Native(Dialect::Mistral)
        } else if s.contains("ipython") && s.contains("parameters") {
            ToolSyntax::Native(Dialect::Llama)
        } else if s.contains(HERMES_OPEN) && results {
            ToolSyntax::Native(Dialect::Hermes)
        } else {
            ToolSyntax::Generic
        }
    }

    /// The dialect the model is asked to write and its answers are read in.
    pub fn dialect(self) -> Dialect {
        match self {
            ToolSyntax::Native(d) => d,
            ToolSyntax::Generic => Dialect::Hermes,
        }
    }
}

impl Dialect {
    /// The strings that must be tokens of their own for the grammar to name them as the model
    /// writes them (special tokens): Hermes's open and close, Mistral's `[TOOL_CALLS]`.
    pub fn markers(self) -> &'static [&'static str] {
        match self {
            Dialect::Hermes => &[HERMES_OPEN, HERMES_CLOSE],
            Dialect::Llama => &[],
            Dialect::Mistral => &[MISTRAL_CALLS],
        }
    }

    /// The key of a call's arguments in what the model writes.
    pub fn arguments_key(self) -> &'static str {
        match self {
            Dialect::Llama => "parameters",
            Dialect::Hermes | Dialect::Mistral => "arguments",
        }
    }

    /// Whether the output must keep special tokens as text for its calls to be read back
    /// (Mistral's `[TOOL_CALLS]` is one; vLLM turns `skip_special_tokens` off for it too).
    pub fn keeps_special(self) -> bool {
        self == Dialect::Mistral
    }

    /// A new call id: Mistral's 9 letters and digits, else `call_` and 16 hex digits.
    pub fn call_id(self) -> String {
        let r = crate::api::random_seed();
        match self {
            Dialect::Mistral => mistral_id(&format!("{r:016x}")),
            _ => format!("call_{r:016x}"),
        }
    }

    /// Rewrites the ids of a history's calls and results as the template needs them
    /// (Mistral's: 9 letters and digits, the same id on a call and its result).
    pub fn history_ids(self, messages: &mut [Value]) {
        if self != Dialect::Mistral {
            return;
        }
        for m in messages {
            if let Some(id) = m.get("tool_call_id").and_then(Value::as_str) {
                m["tool_call_id"] = Value::String(mistral_id(id));
            }
            for c in m.get_mut("tool_calls").and_then(Value::as_array_mut).into_iter().flatten() {
                if let Some(id) = c.get("id").and_then(Value::as_str) {
                    c["id"] = Value::String(mistral_id(id));
                }
            }
        }
    }
}

/// `id` as Mistral's templates take it: its last 9 letters and digits, zero-padded in front
/// (vLLM keeps the last 9 characters too).
fn mistral_id(id: &str) -> String {
    let alnum: Vec<char> = id.chars().filter(char::is_ascii_alphanumeric).collect();
    let tail: String = alnum[alnum.len().saturating_sub(9)..].iter().collect();
    format!("{tail:0>9}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn templates_say_what_they_render() {
        let qwen = "{{ '<tool_call>' }}{%- for tool_call in message.tool_calls %}{%- elif message.role == \"tool\" %}";
        assert_eq!(ToolSyntax::of_template(Some(qwen)), ToolSyntax::Native(Dialect::Hermes));
        let llama = "{%- elif 'tool_calls' in message %}{{- '\"parameters\": ' }}{{- \"<|start_header_id|>ipython\" }}";
        assert_eq!(ToolSyntax::of_template(Some(llama)), ToolSyntax::Native(Dialect::Llama));
        let mistral = "{%- elif message.tool_calls is defined %}{{- \"[TOOL_CALLS][\" }}";
        assert_eq!(ToolSyntax::of_template(Some(mistral)), ToolSyntax::Native(Dialect::Mistral));
        // Calls read but written in no syntax known here.
        let other = "{%- for tool_call in message.tool_calls %}{%- elif message.role == \"tool\" %}";
        assert_eq!(ToolSyntax::of_template(Some(other)), ToolSyntax::Generic);
        assert_eq!(ToolSyntax::of_template(Some("{{ message.content }}")), ToolSyntax::Generic);
        assert_eq!(ToolSyntax::of_template(None), ToolSyntax::Generic);
        assert_eq!(ToolSyntax::Generic.dialect(), Dialect::Hermes);
    }

    #[test]
    fn mistral_ids_are_nine_alphanumerics_on_calls_and_results_alike() {
        assert_eq!(mistral_id("call_0123456789abcdef"), "789abcdef");
        assert_eq!(mistral_id("c1"), "0000000c1");
        let id = Dialect::Mistral.call_id();
        assert!(id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()), "{id}");
        assert!(Dialect::Hermes.call_id().starts_with("call_"));
        let mut h = vec![
            json!({"role": "assistant", "tool_calls": [{"id": "call_a-b", "type": "function"}]}),
            json!({"role": "tool", "tool_call_id": "call_a-b", "content": "x"}),
        ];
        let before = h.clone();
        Dialect::Llama.history_ids(&mut h);
        assert_eq!(h, before);
        Dialect::Mistral.history_ids(&mut h);
        assert_eq!(h[0]["tool_calls"][0]["id"], "000callab");
        assert_eq!(h[1]["tool_call_id"], "000callab");
    }
}
