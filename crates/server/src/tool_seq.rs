//! Llama's and Mistral's calls: a sequence of JSON objects, read as they complete.
//!
//! - Llama: an answer whose first non-blank text is `{` (or `<|python_tag|>`, where the output
//!   keeps special tokens) is calls, `{...}; {...}`; any other answer is content (vLLM's
//!   `llama3_json` parser reads the same).
//! - Mistral: content, then `[TOOL_CALLS]` and a list `[{...}, {...}]`.
//!
//! Each complete object that is a call goes out as one; where the sequence stops being calls,
//! the rest (from the last call on) is content, as written.

use crate::dialect::{Dialect, LLAMA_PYTHON_TAG, MISTRAL_CALLS};
use crate::tool_parse::{call, marker_prefix, Content, Piece};

/// Where the parser is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the calls: Llama's blank start, Mistral's content.
    Before,
    /// Mistral: after the marker, before the list's `[`.
    List,
    /// An object expected next.
    Item,
    /// After an object: a separator or the list's end.
    After,
    /// Content to the end (no calls, or the calls stopped).
    Text,
    /// After Mistral's list.
    Done,
}

/// The parser of one choice's output in Llama's or Mistral's dialect.
#[derive(Debug)]
pub struct Seq {
    dialect: Dialect,
    state: State,
    /// Text not yet given out.
    buf: String,
    /// What the sequence consumed since its last call (given out as content if it stops).
    since: String,
    content: Content,
    calls: usize,
}

/// The end of the JSON value at the start of `s` (an object or list), if it is complete.
fn json_end(s: &str) -> Option<usize> {
    let (mut depth, mut string, mut escape) = (0usize, false, false);
    for (i, b) in s.bytes().enumerate() {
        if string {
            match b {
                _ if escape => escape = false,
                b'\\' => escape = true,
                b'"' => string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => string = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

impl Seq {
    /// A parser of `dialect` (Llama or Mistral).
    pub fn new(dialect: Dialect) -> Seq {
        Seq {
            dialect,
            state: State::Before,
            buf: String::new(),
            since: String::new(),
            content: Content::default(),
            calls: 0,
        }
    }

    /// Moves `n` bytes of the buffer into what the sequence consumed.
    fn consume(&mut self, n: usize) -> String {
        let s: String = self.buf.drain(..n).collect();
        self.since.push_str(&s);
        s
    }

    /// Feeds new text; returns the pieces it completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = vec![];
        while self.step(&mut out) {}
        out
    }

    /// One move; false when more text is needed.
    fn step(&mut self, out: &mut Vec<Piece>) -> bool {
        let blank = self.buf.len() - self.buf.trim_start().len();
        let rest = &self.buf[blank..];
        match self.state {
            State::Text | State::Done => {
                let t = std::mem::take(&mut self.buf);
                self.content.text(&t, out);
                false
            }
            State::Before if self.dialect == Dialect::Mistral => {
                if let Some(at) = self.buf.find(MISTRAL_CALLS) {
                    let before: String = self.buf.drain(..at).collect();
                    self.content.text(&before, out);
                    self.consume(MISTRAL_CALLS.len());
                    self.state = State::List;
                    return true;
                }
                let keep = marker_prefix(&self.buf, MISTRAL_CALLS);
                let done: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.content.text(&done, out);
                false
            }
            State::Before => {
                if rest.is_empty() || (LLAMA_PYTHON_TAG.starts_with(rest) && rest.len() < LLAMA_PYTHON_TAG.len()) {
                    return false;
                }
                if rest.starts_with(LLAMA_PYTHON_TAG) {
                    self.consume(blank + LLAMA_PYTHON_TAG.len());
                    self.state = State::Item;
                } else if rest.starts_with('{') {
                    self.consume(blank);
                    self.state = State::Item;
                } else {
                    self.state = State::Text;
                }
                true
            }
            _ if rest.is_empty() => false,
            State::List => {
                self.state = if rest.starts_with('[') { State::Item } else { State::Text };
                if self.state == State::Item {
                    self.consume(blank + 1);
                } else {
                    self.stop();
                }
                true
            }
            State::Item => {
                let Some(end) = rest.starts_with('{').then(|| json_end(rest)) else {
                    self.stop();
                    return true;
                };
                let Some(end) = end else { return false };
                let object = self.consume(blank + end);
                match call(&object) {
                    Some(c) => {
                        self.since.clear();
                        self.calls += 1;
                        self.content.call(c, out);
                        self.state = State::After;
                    }
                    None => self.stop(),
                }
                true
            }
            State::After => {
                let (sep, close) = match self.dialect {
                    Dialect::Mistral => (',', Some(']')),
                    _ => (';', None),
                };
                let c = rest.chars().next().unwrap_or(' ');
                if c == sep {
                    self.consume(blank + 1);
                    self.state = State::Item;
                } else if Some(c) == close {
                    self.consume(blank + 1);
                    self.since.clear();
                    self.state = State::Done;
                } else {
                    self.stop();
                }
                true
            }
        }
    }

    /// The sequence stopped being calls: what it consumed since its last call, and the rest,
    /// are content.
    fn stop(&mut self) {
        let since = std::mem::take(&mut self.since);
        self.buf.insert_str(0, &since);
        self.state = State::Text;
    }

    /// The end of the output: what is held is content (an unfinished object, a list cut off
    /// before its `]` after its last call is not).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = vec![];
        if matches!(self.state, State::After | State::Item | State::List)
            && self.calls > 0
            && self.buf.trim().is_empty()
            && self.since.trim().trim_matches([',', ';']).is_empty()
        {
            self.buf.clear();
            self.since.clear();
        }
        if self.state != State::Text {
            self.stop();
        }
        let rest = std::mem::take(&mut self.buf);
        self.content.text(&rest, &mut out);
        self.content.finish(self.calls, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool_parse::tests::{call, parse_in};

    fn text(t: &str) -> Piece {
        Piece::Text(t.into())
    }

    #[test]
    fn json_ends_where_its_value_closes() {
        assert_eq!(json_end("{\"a\": \"}\\\"{\", \"b\": [1, {}]} tail"), Some(27));
        assert_eq!(json_end("{\"a\": 1"), None);
        assert_eq!(json_end("[1, 2]"), Some(6));
        assert_eq!(json_end("}"), None);
    }

    #[test]
    fn llama_calls_and_content_in_any_chunking() {
        let f = "{\"name\": \"f\", \"parameters\": {\"x\": 1}}";
        let cases = [
            (format!("  {f}"), vec![call("f", "{\"x\":1}")]),
            (
                format!("<|python_tag|>{f}; {{\"name\": \"g\", \"arguments\": {{}}}}"),
                vec![call("f", "{\"x\":1}"), call("g", "{}")],
            ),
            // Content: not starting with an object, or objects that are not calls.
            (format!("Sure. {f}"), vec![text(&format!("Sure. {f}"))]),
            ("{\"a\": 1} and more".to_string(), vec![text("{\"a\": 1} and more")]),
            ("{ not json".to_string(), vec![text("{ not json")]),
            ("<|python".to_string(), vec![text("<|python")]),
            // The calls stop: from the last call on is content.
            (format!("{f}; then text"), vec![call("f", "{\"x\":1}"), text("; then text")]),
            (format!("{f};"), vec![call("f", "{\"x\":1}")]),
            ("\n".to_string(), vec![text("\n")]),
        ];
        for (t, want) in cases {
            for n in [1, 2, 3, 7, 1000] {
                assert_eq!(parse_in(Dialect::Llama, &t, n), want, "{t:?} in chunks of {n}");
            }
        }
    }

    #[test]
    fn mistral_calls_and_content_in_any_chunking() {
        let f = "{\"name\": \"f\", \"arguments\": {\"x\": \"]\"}}";
        let g = "{\"name\": \"g\", \"arguments\": {}}";
        let cases = [
            (format!("[TOOL_CALLS][{f}, {g}]"), vec![call("f", "{\"x\":\"]\"}"), call("g", "{}")]),
            (format!("Let me check. [TOOL_CALLS] [{f}]"), vec![text("Let me check."), call("f", "{\"x\":\"]\"}")]),
            // Cut off after a call (length): the call stands.
            (format!("[TOOL_CALLS][{f}, "), vec![call("f", "{\"x\":\"]\"}")]),
            // Not calls: content as written.
            ("[TOOL_CALLS] nope".to_string(), vec![text("[TOOL_CALLS] nope")]),
            ("[TOOL_CALLS][{\"name\": 1}]".to_string(), vec![text("[TOOL_CALLS][{\"name\": 1}]")]),
            (format!("[TOOL_CALLS][{f}, 7]"), vec![call("f", "{\"x\":\"]\"}"), text(", 7]")]),
            ("a [TOOL_CA".to_string(), vec![text("a [TOOL_CA")]),
            (format!("[TOOL_CALLS][{f}] after"), vec![call("f", "{\"x\":\"]\"}"), text(" after")]),
        ];
        for (t, want) in cases {
            for n in [1, 2, 3, 7, 1000] {
                assert_eq!(parse_in(Dialect::Mistral, &t, n), want, "{t:?} in chunks of {n}");
            }
        }
    }
}
