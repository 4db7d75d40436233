//! Tool calls read back from what the model writes, as it streams: text outside
//! `<tool_call>...</tool_call>` blocks is content, each block whose body is
//! `{"name": ..., "arguments": {...}}` is a call (`arguments` as the JSON string OpenAI's API
//! sends). A block that is not a call stays content, as the model wrote it. Text that may be
//! the start of a block is held back until it is known not to be.

use serde_json::Value;

/// What opens a call.
pub const OPEN: &str = "<tool_call>";
/// What closes it.
pub const CLOSE: &str = "</tool_call>";

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
#[derive(Debug, Default)]
pub struct CallParser {
    /// Text not yet given out: a possible start of [`OPEN`], or a block's body so far.
    buf: String,
    /// Inside a block.
    inside: bool,
    /// Whitespace given out only if text (not a call) follows it.
    space: String,
    /// Calls given out so far.
    pub calls: usize,
}

/// The body of a block as a call, if it is one.
fn call(body: &str) -> Option<Call> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters"))? {
        Value::Object(m) => Value::Object(m.clone()).to_string(),
        // Some models write the arguments as a JSON string, as the API sends them.
        Value::String(s) if serde_json::from_str::<Value>(s).is_ok_and(|a| a.is_object()) => s.clone(),
        _ => return None,
    };
    Some(Call { name, arguments })
}

/// The length of the longest end of `s` that starts [`OPEN`].
fn open_prefix(s: &str) -> usize {
    (1..OPEN.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && OPEN.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

impl CallParser {
    /// Feeds new text; returns the pieces it completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
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
                self.text(&before[..start], &mut out);
                self.inside = true;
            } else {
                let keep = open_prefix(&self.buf);
                let done: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.text(&done, &mut out);
                break;
            }
        }
        out
    }

    /// The end of the output: an unclosed block is a call if its body is one (the output
    /// ended right after it), else content.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = vec![];
        let rest = std::mem::take(&mut self.buf);
        if std::mem::take(&mut self.inside) {
            self.block(&rest, false, &mut out);
        } else {
            self.text(&rest, &mut out);
        }
        if self.calls == 0 && !self.space.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut self.space)));
        }
        out
    }

    fn text(&mut self, t: &str, out: &mut Vec<Piece>) {
        if t.trim().is_empty() {
            self.space.push_str(t);
            return;
        }
        let lead = std::mem::take(&mut self.space);
        let trimmed = t.trim_end();
        self.space.push_str(&t[trimmed.len()..]);
        out.push(Piece::Text(lead + trimmed));
    }

    fn block(&mut self, body: &str, closed: bool, out: &mut Vec<Piece>) {
        match call(body) {
            Some(c) => {
                self.space.clear();
                self.calls += 1;
                out.push(Piece::Call(c));
            }
            None => {
                let close = if closed { CLOSE } else { "" };
                self.text(&format!("{OPEN}{body}{close}"), out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces of `text` fed in chunks of `n` bytes (at char boundaries), merged.
    fn parse(text: &str, n: usize) -> Vec<Piece> {
        let mut p = CallParser::default();
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

    fn call(name: &str, arguments: &str) -> Piece {
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
                assert_eq!(parse(text, n), want, "{text:?} in chunks of {n}");
            }
        }
    }

    #[test]
    fn text_that_may_open_a_block_waits() {
        let mut p = CallParser::default();
        assert_eq!(p.push("Hi <tool"), vec![Piece::Text("Hi".into())]);
        assert_eq!(p.push("box>"), vec![Piece::Text(" <toolbox>".into())]);
        assert_eq!(p.push("<tool_call>{\"name\": \"f\", \"arguments\": {}}"), vec![]);
        assert_eq!(p.push("</tool_call>"), vec![call("f", "{}")]);
        assert_eq!(p.calls, 1);
    }
}
