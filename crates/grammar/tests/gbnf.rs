//! GBNF grammars (SGLang's `ebnf`) translated by `gbnf_to_lark` and run through llguidance's
//! masks, with SmolLM2's tokenizer and Qwen's cut one. Every walk (tokens taken at random
//! among the allowed until end-of-sequence) must be an output of the GBNF grammar, as judged
//! by a checker written apart from the translation: a regular expression for the grammars
//! that are one, serde_json plus the grammar's own layout rules for llama.cpp's JSON grammar,
//! a hand-written parser for its arithmetic grammar. Strings the GBNF grammars match, among
//! them ones a rule-for-rule translation loses to llguidance's greedy lexer, must be accepted
//! through the masks; strings they do not match must not.

mod common;
use common::{fixture, Rng};

use grammar::ebnf::gbnf_to_lark;
use grammar::{Grammars, Spec};
use regex::Regex;
use serde_json::Value;
use std::collections::HashMap;

/// llama.cpp's `grammars/json.gbnf`.
const JSON: &str = r#"root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"#;

/// llama.cpp's `grammars/arithmetic.gbnf`.
const ARITHMETIC: &str = r#"root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
"#;

/// llama.cpp's `grammars/list.gbnf`, with bounds.
const LIST: &str = r#"root ::= item{2,4}

# Excludes various line break characters
item ::= "- " [^\r\n\x0b\x0c\x85\u2028\u2029]{1,20} "\n"
"#;
const LIST_RX: &str = "- [^\r\n\x0b\x0c\u{85}\u{2028}\u{2029}]{1,20}\n";

/// llama.cpp's `grammars/chess.gbnf`.
const CHESS: &str = r#"# Specifies chess moves as a list in algebraic notation, using PGN conventions

# Force first move to "1. ", then any 1-2 digit number after, relying on model to follow the pattern
root    ::= "1. " move " " move "\n" ([1-9] [0-9]? ". " move " " move "\n")+
move    ::= (pawn | nonpawn | castle) [+#]?

# piece type, optional file/rank, optional capture, dest file & rank
nonpawn ::= [NBKQR] [a-h]? [1-8]? "x"? [a-h] [1-8]

# optional file & capture, dest file & rank, optional promotion
pawn    ::= ([a-h] "x")? [a-h] [1-8] ("=" [NBKQR])?

castle  ::= "O-O" "-O"?
"#;
const MOVE_RX: &str = "(?:(?:[a-h]x)?[a-h][1-8](?:=[NBKQR])?|[NBKQR][a-h]?[1-8]?x?[a-h][1-8]|O-O(?:-O)?)[+#]?";

/// A tokenizer with its grammar engine and the bytes of each token.
struct Model {
    name: &'static str,
    g: Grammars,
    tok: text::Tokenizer,
    eos: u32,
    vocab: usize,
    bytes: Vec<Vec<u8>>,
}

/// The bytes of each token of a byte-level BPE vocabulary (GPT-2's byte-to-character map
/// undone); special tokens get none.
fn token_bytes(tokenizer_json: &[u8], vocab: usize) -> Vec<Vec<u8>> {
    // the printable bytes stand for themselves, the n-th other byte for character 255 + n
    let mut byte_of: HashMap<char, u8> = HashMap::new();
    let mut n = 0;
    for b in 0..256u32 {
        let c = if (b'!' as u32..=b'~' as u32).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
        {
            b
        } else {
            n += 1;
            255 + n
        };
        byte_of.insert(char::from_u32(c).unwrap(), b as u8);
    }
    let t: Value = serde_json::from_slice(tokenizer_json).unwrap();
    let mut out = vec![vec![]; vocab];
    for (piece, id) in t["model"]["vocab"].as_object().unwrap() {
        let id = id.as_u64().unwrap() as usize;
        let bytes: Option<Vec<u8>> = piece.chars().map(|c| byte_of.get(&c).copied()).collect();
        if let Some(b) = bytes {
            out[id] = b;
        }
    }
    for a in t["added_tokens"].as_array().unwrap() {
        out[a["id"].as_u64().unwrap() as usize] = vec![];
    }
    out
}

fn models() -> Vec<Model> {
    [("smollm2-135m", 2, 49152), ("tiny-qwen2", 976, 1024)]
        .into_iter()
        .map(|(name, eos, vocab)| {
            let dir = fixture(name);
            let json = std::fs::read(dir.join("tokenizer.json")).unwrap();
            Model {
                name,
                g: Grammars::load(&json, &[eos], vocab).unwrap(),
                tok: text::Tokenizer::load(&dir).unwrap(),
                eos,
                vocab,
                bytes: token_bytes(&json, vocab),
            }
        })
        .collect()
}

fn translate(gbnf: &str) -> String {
    gbnf_to_lark(gbnf).unwrap_or_else(|e| panic!("{gbnf}: {e}"))
}

fn allowed(m: &Model, c: &runtime::Constraint) -> Vec<u32> {
    let mut logits = vec![0.0f32; m.vocab];
    c.mask(&mut logits);
    (0..m.vocab as u32).filter(|&t| logits[t as usize].is_finite()).collect()
}

/// One walk: tokens at random among the allowed; end-of-sequence with probability 1/2 where
/// allowed. After 40 tokens the walk heads for an end: end-of-sequence where allowed, else
/// one of the `closers` allowed (single-token strings), else any allowed token.
fn walk(m: &Model, lark: &str, closers: &[&str], rng: &mut Rng) -> String {
    let closers: Vec<u32> =
        closers.iter().filter_map(|s| m.bytes.iter().position(|b| b == s.as_bytes()).map(|t| t as u32)).collect();
    let c = m.g.compile(&Spec::Lark(lark.to_string())).unwrap();
    let mut out = vec![];
    loop {
        let allowed = allowed(m, &c);
        assert!(!allowed.is_empty(), "{}: nothing allowed after {:?}", m.name, m.tok.decode(&out, false));
        let late = out.len() >= 40;
        let useful: Vec<u32> = closers.iter().copied().filter(|t| allowed.contains(t)).collect();
        let t = if allowed.contains(&m.eos) && (late || rng.below(2) == 0) {
            m.eos
        } else if late && !useful.is_empty() {
            useful[rng.below(useful.len())]
        } else {
            allowed[rng.below(allowed.len())]
        };
        if t == m.eos {
            return m.tok.decode(&out, false).unwrap();
        }
        c.accept(t);
        out.push(t);
        assert!(out.len() < 1500, "{}: no end after {:?}", m.name, m.tok.decode(&out, false));
    }
}

/// Whether the masks let `s` through whole and then allow end-of-sequence. Each step takes
/// the longest allowed token that spells what comes next in `s` (the engine's state depends
/// on the bytes only, and where bytes are forced it allows only their canonical tokens).
fn accepts(m: &Model, lark: &str, s: &str) -> bool {
    let c = m.g.compile(&Spec::Lark(lark.to_string())).unwrap();
    let mut rest = s.as_bytes();
    while !rest.is_empty() {
        let next = allowed(m, &c)
            .into_iter()
            .filter(|&t| !m.bytes[t as usize].is_empty() && rest.starts_with(&m.bytes[t as usize]))
            .max_by_key(|&t| m.bytes[t as usize].len());
        let Some(t) = next else { return false };
        c.accept(t);
        rest = &rest[m.bytes[t as usize].len()..];
    }
    allowed(m, &c).contains(&m.eos)
}

fn full(rx: &str) -> Regex {
    Regex::new(&format!("^(?:{rx})$")).unwrap()
}

/// Checks for llama.cpp's JSON grammar beyond serde_json's: an object at the top; outside
/// strings, whitespace only as `ws` allows (nothing, one space, or a newline and up to 20
/// spaces and tabs), numbers of at most 16 integer digits; no DEL in strings.
fn json_ok(s: &str) -> bool {
    let Ok(Value::Object(_)) = serde_json::from_str::<Value>(s) else { return false };
    let ws = full("|\\ |\n[ \t]{0,20}");
    let number = full("-?(?:[0-9]|[1-9][0-9]{0,15})(?:\\.[0-9]+)?(?:[eE][-+]?[0-9][1-9]{0,15})?");
    let chars: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let run = |i: usize, f: &dyn Fn(char) -> bool| {
            let mut j = i;
            while j < chars.len() && f(chars[j]) {
                j += 1;
            }
            j
        };
        match chars[i] {
            '"' => {
                i += 1;
                while chars[i] != '"' {
                    if chars[i] == '\u{7f}' {
                        return false;
                    }
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            c if c.is_whitespace() => {
                let j = run(i, &|c| c.is_whitespace());
                if !ws.is_match(&chars[i..j].iter().collect::<String>()) {
                    return false;
                }
                i = j;
            }
            c if c == '-' || c.is_ascii_digit() => {
                let j = run(i, &|c| "+-.eE".contains(c) || c.is_ascii_digit());
                if !number.is_match(&chars[i..j].iter().collect::<String>()) {
                    return false;
                }
                i = j;
            }
            _ => i += 1,
        }
    }
    true
}

/// llama.cpp's arithmetic grammar, by hand: every end each rule can reach from a position.
struct Arith<'a> {
    s: &'a [u8],
    memo: HashMap<(u8, usize), Vec<usize>>,
}

impl Arith<'_> {
    fn ok(s: &str) -> bool {
        let mut a = Arith { s: s.as_bytes(), memo: HashMap::new() };
        // root ::= (expr "=" ws term "\n")+
        let mut cur = vec![0];
        let mut seen = vec![false; s.len() + 1];
        while let Some(i) = cur.pop() {
            for j in a.line(i) {
                if j == s.len() {
                    return true;
                }
                if !std::mem::replace(&mut seen[j], true) {
                    cur.push(j);
                }
            }
        }
        false
    }

    fn then(&mut self, from: Vec<usize>, f: impl Fn(&mut Self, usize) -> Vec<usize>) -> Vec<usize> {
        let mut out: Vec<usize> = from.into_iter().flat_map(|i| f(self, i)).collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    fn byte(&self, i: usize, f: impl Fn(u8) -> bool) -> Vec<usize> {
        if i < self.s.len() && f(self.s[i]) {
            vec![i + 1]
        } else {
            vec![]
        }
    }

    fn line(&mut self, i: usize) -> Vec<usize> {
        let e = self.expr(i);
        let e = self.then(e, |a, j| a.byte(j, |b| b == b'='));
        let e = self.then(e, |a, j| a.ws(j));
        let e = self.then(e, |a, j| a.term(j));
        self.then(e, |a, j| a.byte(j, |b| b == b'\n'))
    }

    /// ws ::= [ \t\n]*
    fn ws(&mut self, i: usize) -> Vec<usize> {
        let mut out = vec![i];
        while out.last().is_some_and(|&j| j < self.s.len() && b" \t\n".contains(&self.s[j])) {
            out.push(out[out.len() - 1] + 1);
        }
        out
    }

    /// expr ::= term ([-+*/] term)*
    fn expr(&mut self, i: usize) -> Vec<usize> {
        if let Some(v) = self.memo.get(&(0, i)) {
            return v.clone();
        }
        let mut all = self.term(i);
        let mut frontier = all.clone();
        while !frontier.is_empty() {
            let op = self.then(frontier, |a, j| a.byte(j, |b| b"-+*/".contains(&b)));
            let next = self.then(op, |a, j| a.term(j));
            frontier = next.into_iter().filter(|j| !all.contains(j)).collect();
            all.extend(frontier.iter().copied());
        }
        all.sort_unstable();
        self.memo.insert((0, i), all.clone());
        all
    }

    /// term ::= ident | num | "(" ws expr ")" ws
    fn term(&mut self, i: usize) -> Vec<usize> {
        if let Some(v) = self.memo.get(&(1, i)) {
            return v.clone();
        }
        let s = self.s;
        let mut out = vec![];
        // ident ::= [a-z] [a-z0-9_]* ws ; num ::= [0-9]+ ws
        type Class = fn(u8) -> bool;
        let classes: [(Class, Class); 2] = [
            (|b| b.is_ascii_lowercase(), |b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
            (|b| b.is_ascii_digit(), |b| b.is_ascii_digit()),
        ];
        for (first, rest) in classes {
            if i < s.len() && first(s[i]) {
                let mut j = i + 1;
                let mut ends = vec![j];
                while j < s.len() && rest(s[j]) {
                    j += 1;
                    ends.push(j);
                }
                out.extend(self.then(ends, |a, k| a.ws(k)));
            }
        }
        let open = self.byte(i, |b| b == b'(');
        let e = self.then(open, |a, j| a.ws(j));
        let e = self.then(e, |a, j| a.expr(j));
        let e = self.then(e, |a, j| a.byte(j, |b| b == b')'));
        out.extend(self.then(e, |a, j| a.ws(j)));
        out.sort_unstable();
        out.dedup();
        self.memo.insert((1, i), out.clone());
        out
    }
}

/// Walks of each grammar, checked by `check`, and strings it must accept and refuse.
fn run(gbnf: &str, walks: usize, closers: &[&str], check: &dyn Fn(&str) -> bool, yes: &[&str], no: &[&str]) {
    let lark = translate(gbnf);
    for y in yes {
        assert!(check(y), "the checker refuses {y:?}");
    }
    for n in no {
        assert!(!check(n), "the checker takes {n:?}");
    }
    for m in models() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for i in 0..walks {
            let text = walk(&m, &lark, closers, &mut rng);
            assert!(check(&text), "{} walk {i}: {text:?} is not an output of\n{gbnf}\ntranslated as\n{lark}", m.name);
        }
        for y in yes {
            assert!(accepts(&m, &lark, y), "{}: {y:?} refused by\n{lark}", m.name);
        }
        for n in no {
            assert!(!accepts(&m, &lark, n), "{}: {n:?} accepted by\n{lark}", m.name);
        }
    }
}

#[test]
fn json_grammar() {
    run(
        JSON,
        12,
        &["\"", "}", "]", ":", "0"],
        &json_ok,
        &[
            "{}",
            "{\"a\": 1}",
            "{\"a\":[1, 2,3], \"b\" : {\"c\": null}, \"d\": [], \"e\": [true, false]}",
            "{\n  \"k\": \"v\\n\\u00e9\\\"\",\n  \"n\": -0.5e+19\n}",
            "{\"x\": \"é中\"} ",
            "{\"n\": 1234567890123456}",
        ],
        &["[1]", "{\"a\": 01}", "{\"a\": 1}  ", "{\"a\": 1,}", "{'a': 1}", "{\"n\": 12345678901234567}", "{\"a\":\t1}"],
    );
}

#[test]
fn arithmetic_grammar() {
    run(
        ARITHMETIC,
        20,
        &["\n", ")", "=", "a", "1"],
        &Arith::ok,
        // "a=b\n": as one lexeme, `ident`'s trailing `ws` would take the newline `root` needs
        &["a=b\n", "x = (y+1) \n", "1=2\n\n", "foo_1 +2*(bar)=3\nz=z\n", "a=b \t\n(c)=d\n"],
        &["a=b", "=b\n", "a=b\nc\n", "A=b\n", "a==b\n"],
    );
}

#[test]
fn list_grammar_with_bounded_repetition() {
    let rx = full(&format!("(?:{LIST_RX}){{2,4}}"));
    let twenty = "x".repeat(20);
    run(
        LIST,
        20,
        &["\n"],
        &|s| rx.is_match(s),
        &["- a\n- b\n", "- é中 x\n- 2\n- 3\n- 4\n", &format!("- {twenty}\n- {twenty}\n")],
        &["- a\n", "- a\n- b\n- c\n- d\n- e\n", "- \n- b\n", &format!("- {twenty}x\n- b\n"), "- a\u{85}\n- b\n"],
    );
}

#[test]
fn yes_no_choice() {
    let rx = full("yes|no");
    run("root ::= \"yes\" | \"no\"", 20, &[], &|s| rx.is_match(s), &["yes", "no"], &["", "y", "yesno", "maybe"]);
    // both answers come out
    let lark = translate("root ::= \"yes\" | \"no\"");
    for m in models() {
        let mut rng = Rng(7);
        let outs: Vec<String> = (0..20).map(|_| walk(&m, &lark, &[], &mut rng)).collect();
        assert!(outs.iter().any(|o| o == "yes") && outs.iter().any(|o| o == "no"), "{}: {outs:?}", m.name);
    }
}

#[test]
fn chess_grammar() {
    let rx = full(&format!("1\\. {MOVE_RX} {MOVE_RX}\n(?:[1-9][0-9]?\\. {MOVE_RX} {MOVE_RX}\n)+"));
    run(
        CHESS,
        20,
        &["1", ".", " ", "e", "4", "\n"],
        &|s| rx.is_match(s),
        &["1. e4 e5\n2. Nf3 Nc6\n", "1. O-O O-O-O+\n10. exd8=Q# Rxa1\n"],
        &["1. e4 e5\n", "1. e4 e5\n2. Nf3\n", "1. e9 e5\n2. a1 a2\n"],
    );
}

#[test]
fn bad_grammars_are_errors_that_say_where() {
    for (src, expected) in [
        ("expr ::= \"a\"\n", "the grammar has no `root` rule"),
        ("root ::= value\n", "1:10: rule `value` is used but not defined"),
        ("root ::= \"abc\n", "1:10: unterminated string"),
        ("root ::=\n  [a-z", "2:3: unterminated character class"),
        ("root ::= (\"a\" | \"b\"\n", "1:10: unclosed `(`"),
        ("root ::= \"a\" \"b\"{2,1}", "1:17: repetitions must be"),
        ("root = \"a\"", "1:6: expected `::=` after the rule name"),
        ("root ::= \"a\" & \"b\"", "1:14: expected a string, a class"),
    ] {
        match gbnf_to_lark(src) {
            Ok(lark) => panic!("{src:?} translated: {lark}"),
            Err(e) => assert!(e.starts_with(expected), "{src:?}: {e:?}"),
        }
    }
}

/// The deepest grammars the translation takes (rule chains 100 deep with root, each rule's
/// groups nested 12 deep and repeated) compile in llguidance on a thread with the 64 MiB stack
/// of the server's threads (its compiler recurses once per nested rule: on 2 MiB this one
/// overflows, which aborts the process).
#[test]
fn the_deepest_grammars_compile_on_the_servers_stack() {
    let mut chain = String::from("root ::= r1\n");
    let groups = |inner: &str| format!("{}{inner}{}", "(\"b\" ".repeat(12), ")?".repeat(12));
    for i in 1..99 {
        chain += &format!("r{i} ::= {} | \"x\"\n", groups(&format!("r{}", i + 1)));
    }
    chain += "r99 ::= \"a\" r1?\n";
    let nested = format!("root ::= {}\"a\"{}", "(\"b\" ".repeat(12), ")?".repeat(12));
    let json = std::fs::read(fixture("tiny-qwen2").join("tokenizer.json")).unwrap();
    std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(move || {
            let g = Grammars::load(&json, &[976], 1024).unwrap();
            for src in [chain, nested] {
                let lark = gbnf_to_lark(&src).unwrap();
                g.compile(&Spec::Lark(lark)).unwrap_or_else(|e| panic!("{e}"));
            }
        })
        .unwrap()
        .join()
        .unwrap();
}
