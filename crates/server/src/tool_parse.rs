//! Tool calls read back from what the model writes, as it streams, in its dialect
//! ([`Dialect`]): text outside the calls is content; each call is `{"name": ..., "arguments":
//! {...}}` (Llama's `parameters`), its `arguments` given out as the JSON string OpenAI's API
//! sends. What looked like calls but is not stays content, as the model wrote it. Text that may
//! be the start of calls is held back until it is known not to be.
//!
//! Hermes's blocks are read by [`Tagged`], Llama's and Mistral's sequences by
//! [`crate::tool_seq::Seq`].

use crate::dialect::{Dialect, HERMES_CLOSE as CLOSE, HERMES_OPEN as OPEN};
use crate::tool_seq::Seq;
use serde_json::Value;

/// One parsed call.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The function's name.
    pub name: String,
    /// Its arguments, a JSON object as a string.
    pub arguments: String,
}

/// A piece of the model's output.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Content text.
    Text(String),
    /// A call.
    Call(Call),
}

/// The parser of one choice's output.
#[derive(Debug)]
pub enum CallParser {
    /// Hermes's blocks.
    Tagged(Tagged),
    /// Llama's or Mistral's sequence.
    Seq(Seq),
}

impl CallParser {
    /// A parser of `dialect`.
    pub fn new(dialect: Dialect) -> CallParser {
        match dialect {
            Dialect::Hermes => CallParser::Tagged(Tagged::default()),
            d => CallParser::Seq(Seq::new(d)),
        }
    }

    /// Feeds new text; returns the pieces it completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        match self {
            CallParser::Tagged(p) => p.push(text),
            CallParser::Seq(p) => p.push(text),
        }
    }

    /// The end of the output: what is held back, as calls or content.
    pub fn finish(&mut self) -> Vec<Piece> {
        match self {
            CallParser::Tagged(p) => p.finish(),
            CallParser::Seq(p) => p.finish(),
        }
    }
}

/// A JSON object as a call, if it is one: a string `name` and object `arguments` (or
/// `parameters`, Llama's key; or a string holding an object, as some models write them).
pub(crate) fn call(body: &str) -> Option<Call> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters"))? {
        Value::Object(m) => Value::Object(m.clone()).to_string(),
        Value::String(s) if serde_json::from_str::<Value>(s).is_ok_and(|a| a.is_object()) => s.clone(),
        _ => return None,
    };
    Some(Call { name, arguments })
}

/// The length of the longest end of `s` that starts `marker` (held back: it may be one).
pub(crate) fn marker_prefix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && marker.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// Content as it is given out around calls: whitespace alone is held, and given out only if
/// text follows it (or the output ends with no call); text's trailing whitespace waits too.
#[derive(Debug, Default)]
pub(crate) struct Content {
    space: String,
}

impl Content {
    /// Gives out `t` (less what it holds back).
    pub(crate) fn text(&mut self, t: &str, out: &mut Vec<Piece>) {
        if t.trim().is_empty() {
            self.space.push_str(t);
            return;
        }
        let lead = std::mem::take(&mut self.space);
        let trimmed = t.trim_end();
        self.space.push_str(&t[trimmed.len()..]);
        out.push(Piece::Text(lead + trimmed));
    }

    /// Gives out a call: the whitespace before it is dropped.
    pub(crate) fn call(&mut self, c: Call, out: &mut Vec<Piece>) {
        self.space.clear();
        out.push(Piece::Call(c));
    }

    /// The end: held whitespace goes out if there was no call.
    pub(crate) fn finish(&mut self, calls: usize, out: &mut Vec<Piece>) {
        if calls == 0 && !self.space.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut self.space)));
        }
    }
}

/// Hermes's parser: `<tool_call>...</tool_call>` blocks among text.
#[derive(Debug, Default)]
pub struct Tagged {
    /// Text not yet given out: a possible start of [`OPEN`], or a block's body so far.
    buf: String,
    /// Inside a block.
    inside: bool,
    content: Content,
    /// Calls given out so far.
    calls: usize,
}

impl Tagged {
    fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = vec![];
        loop {
            if self.inside {
                let Some(end) = self.buf.find(CLOSE) else { break };
                let body: String = self.buf.drain(..end + CLOSE.len()).collect();
                self.inside = false;
                self.block(&body[..end], true, &mut out);
            } else if let Some(start) = self.buf.find(OPEN) {
                let before: String = self.buf.drain(..start + OPEN.len()).collect();
                self.content.text(&before[..start], &mut out);
                self.inside = true;
            } else {
                let keep = marker_prefix(&self.buf, OPEN);
                let done: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.content.text(&done, &mut out);
                break;
            }
        }
        out
    }

    /// An unclosed block is a call if its body is one (the output ended right after it),
    /// else content.
    fn finish(&mut self) -> Vec<Piece> {
        let mut out = vec![];
        let rest = std::mem::take(&mut self.buf);
        if std::mem::take(&mut self.inside) {
            self.block(&rest, false, &mut out);
        } else {
            self.content.text(&rest, &mut out);
        }
        self.content.finish(self.calls, &mut out);
        out
    }

    fn block(&mut self, body: &str, closed: bool, out: &mut Vec<Piece>) {
        match call(body) {
            Some(c) => {
                self.calls += 1;
                self.content.call(c, out);
            }
            None => {
                let close = if closed { CLOSE } else { "" };
                self.content.text(&format!("{OPEN}{body}{close}"), out);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The pieces of `text` in `dialect` fed in chunks of `n` chars, merged.
    pub(crate) fn parse_in(dialect: Dialect, text: &str, n: usize) -> Vec<Piece> {
        let mut p = CallParser::new(dialect);
        let mut out: Vec<Piece> = vec![];
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(n) {
            out.extend(p.push(&chunk.iter().collect::<String>()));
        }
        out.extend(p.finish());
        let mut merged: Vec<Piece> = vec![];
        for piece in out {
            match (merged.last_mut(), piece) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, p) => merged.push(p),
            }
        }
        merged
    }

    pub(crate) fn call(name: &str, arguments: &str) -> Piece {
        Piece::Call(Call { name: name.into(), arguments: arguments.into() })
    }

    #[test]
    fn calls_and_text_in_any_chunking() {
        let cases = [
            ("Hello <tool world>!", vec![Piece::Text("Hello <tool world>!".into())]),
            (
                "Let me look.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>",
                vec![Piece::Text("Let me look.".into()), call("f", "{\"x\":1}"), call("g", "{}")],
            ),
            // A string of arguments; an unclosed last block (the output ended after it).
            ("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 2}\"}</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}", vec![call("f", "{\"a\": 2}"), call("g", "{}")]),
            // Not calls: stays text as written.
            ("<tool_call>\nnot json\n</tool_call> after", vec![Piece::Text("<tool_call>\nnot json\n</tool_call> after".into())]),
            ("<tool_call>{\"name\": \"f\"", vec![Piece::Text("<tool_call>{\"name\": \"f\"".into())]),
            ("ends with <tool_c", vec![Piece::Text("ends with <tool_c".into())]),
            ("plain\n", vec![Piece::Text("plain\n".into())]),
            ("é<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", vec![Piece::Text("é".into()), call("f", "{}")]),
        ];
        for (text, want) in cases {
            for n in [1, 2, 3, 5, 1000] {
                assert_eq!(parse_in(Dialect::Hermes, text, n), want, "{text:?} in chunks of {n}");
            }
        }
    }

    #[test]
    fn text_that_may_open_a_block_waits() {
        let mut p = CallParser::new(Dialect::Hermes);
        assert_eq!(p.push("Hi <tool"), vec![Piece::Text("Hi".into())]);
        assert_eq!(p.push("box>"), vec![Piece::Text(" <toolbox>".into())]);
        assert_eq!(p.push("<tool_call>{\"name\": \"f\", \"arguments\": {}}"), vec![]);
        assert_eq!(p.push("</tool_call>"), vec![call("f", "{}")]);
    }
}
