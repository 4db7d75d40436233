//! SGLang's `ebnf` grammars, in llama.cpp's GBNF notation, translated into the Lark dialect
//! llguidance reads: [`gbnf_to_lark`].
//!
//! GBNF matches one character at a time. llguidance first cuts its input into lexemes (the
//! strings and regular expressions of the Lark text) and cuts greedily: a lexeme goes on while
//! the next byte can extend it. A translation rule for rule would lose outputs: with
//! `ws ::= [ \n]*` as one lexeme, `ws "\n"` never matches `"\n"`, the lexeme having taken the
//! newline. Here every lexeme is one character (a literal's characters one by one, a class or
//! `.` one character each) and every GBNF rule a Lark rule: a one-character lexeme cannot be
//! extended, so the cut is never wrong and the Lark grammar matches exactly the strings the
//! GBNF grammar matches. The price is a parser step per character rather than per lexeme.
//!
//! The notation: rules `name ::= alternatives` (names of letters, digits, `-` and `_`; a rule
//! runs until the next `name ::=`), `|`, sequences, `( ... )`, string literals `"..."` and
//! classes `[a-z]` / `[^...]` with the escapes `\n \r \t \\ \" \' \[ \] \- \xHH \uHHHH
//! \UHHHHHHHH`, `.` (any character), postfix `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`, comments
//! from `#` to the end of the line. `root` is the start rule.

use std::collections::HashMap;

/// The most repetitions `{m,n}` may ask for (llama.cpp's limit).
const MAX_REPEAT: u32 = 2000;
/// How deeply groups `( ... )` may nest: each may take a postfix operator, which the Lark
/// text wraps in one more group, and llguidance refuses Lark nested about 30 deep.
const MAX_NESTING: usize = 12;
/// How long a chain of rules each using the next may be: llguidance's compiler recurses once
/// per rule of a chain and overflows its thread's stack (aborting the server) somewhere between
/// 500 and 1000.
const MAX_RULE_DEPTH: usize = 100;

/// The Lark text (llguidance's dialect) of the GBNF grammar `src`. A grammar that does not
/// parse, has no `root` rule, uses a rule it does not define or defines one twice is an error
/// saying what and where (`line:column`).
pub fn gbnf_to_lark(src: &str) -> Result<String, String> {
    let mut p = Parser {
        s: src.chars().collect(),
        i: 0,
        names: HashMap::new(),
        used: vec![],
        uses: HashMap::new(),
        current: String::new(),
    };
    let mut rules: Vec<(String, String, usize)> = vec![];
    p.skip();
    while p.i < p.s.len() {
        let at = p.i;
        let name = p.name().ok_or_else(|| p.error("a rule name"))?;
        p.skip();
        if !p.eat("::=") {
            return Err(p.error("`::=` after the rule name"));
        }
        p.current = name.clone();
        let body = p.alternatives(0)?;
        if rules.iter().any(|(n, _, _)| *n == name) {
            return Err(format!("{}: rule `{name}` is defined twice", p.line_col(at)));
        }
        rules.push((name, body, at));
    }
    if !rules.iter().any(|(n, _, _)| n == "root") {
        return Err("the grammar has no `root` rule".into());
    }
    if let Some((name, at)) = p.used.iter().find(|(n, _)| !rules.iter().any(|(r, _, _)| r == n)) {
        return Err(format!("{}: rule `{name}` is used but not defined", p.line_col(*at)));
    }
    if rule_depth(&p.uses) > MAX_RULE_DEPTH {
        return Err(format!("rules nest more than {MAX_RULE_DEPTH} deep (a chain of rules each using the next)"));
    }
    let mut out = String::new();
    for (name, body, _) in &rules {
        out += &format!("{}: {body}\n", p.lark_name(name));
    }
    Ok(out)
}

struct Parser {
    s: Vec<char>,
    i: usize,
    /// GBNF rule name to Lark rule name.
    names: HashMap<String, String>,
    /// Rules referenced, with where.
    used: Vec<(String, usize)>,
    /// The rules each rule uses, by rule name.
    uses: HashMap<String, Vec<String>>,
    /// The rule being parsed.
    current: String,
}

/// The depth of the walk from `root` through the rules each rule uses, first uses first, each
/// rule entered once (how a compiler that recurses per rule reaches them).
fn rule_depth(uses: &HashMap<String, Vec<String>>) -> usize {
    let none = vec![];
    let mut seen: std::collections::HashSet<&str> = std::collections::HashSet::from(["root"]);
    let mut stack: Vec<(&str, usize)> = vec![("root", 0)];
    let mut deepest = 0;
    loop {
        deepest = deepest.max(stack.len());
        let Some((rule, next)) = stack.last_mut() else { break };
        let children = uses.get(*rule).unwrap_or(&none);
        match children.get(*next) {
            Some(child) => {
                *next += 1;
                if seen.insert(child.as_str()) {
                    stack.push((child.as_str(), 0));
                }
            }
            None => {
                stack.pop();
            }
        }
    }
    deepest
}

fn is_name(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

impl Parser {
    fn line_col(&self, at: usize) -> String {
        let before = &self.s[..at.min(self.s.len())];
        let line = before.iter().filter(|&&c| c == '\n').count() + 1;
        let col = before.iter().rev().take_while(|&&c| c != '\n').count() + 1;
        format!("{line}:{col}")
    }

    fn error(&self, wanted: &str) -> String {
        match self.s.get(self.i) {
            Some(c) => format!("{}: expected {wanted}, found `{c}`", self.line_col(self.i)),
            None => format!("{}: expected {wanted}, found the end", self.line_col(self.i)),
        }
    }

    fn peek(&self) -> Option<char> {
        self.s.get(self.i).copied()
    }

    /// Skips whitespace (newlines included) and comments.
    fn skip(&mut self) {
        while let Some(c) = self.peek() {
            if c == '#' {
                while self.peek().is_some_and(|c| c != '\n') {
                    self.i += 1;
                }
            } else if c.is_whitespace() {
                self.i += 1;
            } else {
                break;
            }
        }
    }

    fn eat(&mut self, t: &str) -> bool {
        let n = t.chars().count();
        if self.s.len() >= self.i + n && self.s[self.i..self.i + n].iter().copied().eq(t.chars()) {
            self.i += n;
            return true;
        }
        false
    }

    fn name(&mut self) -> Option<String> {
        let start = self.i;
        while self.peek().is_some_and(is_name) {
            self.i += 1;
        }
        (self.i > start).then(|| self.s[start..self.i].iter().collect())
    }

    /// Whether a rule definition (`name ::=`) starts here.
    fn at_definition(&mut self) -> bool {
        let start = self.i;
        let found = self.name().is_some() && {
            self.skip();
            self.eat("::=")
        };
        self.i = start;
        found
    }

    /// The Lark name of GBNF rule `name`: `start` for root, else `r<n>_<name>` (lowercase,
    /// `-` as `_`), unique by its number.
    fn lark_name(&mut self, name: &str) -> String {
        let n = self.names.len();
        self.names
            .entry(name.to_string())
            .or_insert_with(|| match name {
                "root" => "start".to_string(),
                _ => format!("r{n}_{}", name.to_ascii_lowercase().replace('-', "_")),
            })
            .clone()
    }

    /// Alternatives up to the end of a group (`depth` > 0: a `)`) or of the rule.
    fn alternatives(&mut self, depth: usize) -> Result<String, String> {
        let mut alts = vec![self.sequence(depth)?];
        while self.peek() == Some('|') {
            self.i += 1;
            alts.push(self.sequence(depth)?);
        }
        Ok(alts.join(" | "))
    }

    fn sequence(&mut self, depth: usize) -> Result<String, String> {
        let mut items: Vec<String> = vec![];
        loop {
            self.skip();
            match self.peek() {
                None | Some('|') => break,
                Some(')') if depth > 0 => break,
                _ if depth == 0 && self.at_definition() => break,
                _ => {}
            }
            let term = self.term(depth)?;
            let term = self.postfix(term)?;
            if !term.is_empty() {
                items.push(term);
            }
        }
        Ok(items.join(" "))
    }

    fn term(&mut self, depth: usize) -> Result<String, String> {
        let at = self.i;
        match self.peek() {
            Some('"') => {
                self.i += 1;
                let mut chars = vec![];
                loop {
                    match self.peek() {
                        None => return Err(format!("{}: unterminated string", self.line_col(at))),
                        Some('"') => break,
                        Some('\\') => chars.push(self.escape()?),
                        Some(c) => {
                            self.i += 1;
                            chars.push(c);
                        }
                    }
                }
                self.i += 1;
                Ok(chars.iter().map(|c| lark_char(*c)).collect::<Vec<_>>().join(" "))
            }
            Some('[') => self.class(),
            Some('.') => {
                self.i += 1;
                Ok("/(?s:.)/".into())
            }
            Some('(') => {
                if depth >= MAX_NESTING {
                    return Err(format!("{}: groups nest more than {MAX_NESTING} deep", self.line_col(at)));
                }
                self.i += 1;
                let inner = self.alternatives(depth + 1)?;
                if self.peek() != Some(')') {
                    return Err(format!("{}: unclosed `(`", self.line_col(at)));
                }
                self.i += 1;
                Ok(format!("({inner})"))
            }
            Some(c) if is_name(c) => {
                let name = self.name().unwrap_or_default();
                self.used.push((name.clone(), at));
                self.uses.entry(self.current.clone()).or_default().push(name.clone());
                Ok(self.lark_name(&name))
            }
            _ => Err(self.error("a string, a class, `.`, `(` or a rule name")),
        }
    }

    /// `[...]` as a one-character regex.
    fn class(&mut self) -> Result<String, String> {
        let at = self.i;
        self.i += 1;
        let negated = self.peek() == Some('^');
        if negated {
            self.i += 1;
        }
        let mut out = String::new();
        loop {
            let c = match self.peek() {
                None => return Err(format!("{}: unterminated character class", self.line_col(at))),
                Some(']') => break,
                Some('\\') => self.escape()?,
                Some(c) => {
                    self.i += 1;
                    c
                }
            };
            out += &format!("\\x{{{:X}}}", c as u32);
            if self.peek() == Some('-') && self.s.get(self.i + 1).is_some_and(|&c| c != ']') {
                self.i += 1;
                let hi = match self.peek() {
                    Some('\\') => self.escape()?,
                    Some(c) => {
                        self.i += 1;
                        c
                    }
                    None => return Err(format!("{}: unterminated character class", self.line_col(at))),
                };
                if hi < c {
                    return Err(format!("{}: the range {c:?}-{hi:?} is empty", self.line_col(at)));
                }
                out += &format!("-\\x{{{:X}}}", hi as u32);
            }
        }
        self.i += 1;
        if out.is_empty() {
            return Err(format!("{}: an empty character class", self.line_col(at)));
        }
        Ok(format!("/[{}{out}]/", if negated { "^" } else { "" }))
    }

    /// The character a `\` escape stands for.
    fn escape(&mut self) -> Result<char, String> {
        let at = self.i;
        self.i += 1;
        let c = self.peek().ok_or_else(|| format!("{}: `\\` at the end", self.line_col(at)))?;
        self.i += 1;
        let hex = |p: &mut Parser, n: usize| -> Result<char, String> {
            let digits: String = p.s.iter().skip(p.i).take(n).collect();
            let v = u32::from_str_radix(&digits, 16).ok().filter(|_| digits.len() == n);
            p.i += n;
            v.and_then(char::from_u32).ok_or_else(|| format!("{}: a bad `\\{c}` escape", p.line_col(at)))
        };
        match c {
            'n' => Ok('\n'),
            'r' => Ok('\r'),
            't' => Ok('\t'),
            'x' => hex(self, 2),
            'u' => hex(self, 4),
            'U' => hex(self, 8),
            '\\' | '"' | '\'' | '[' | ']' | '-' | '^' => Ok(c),
            _ => Err(format!("{}: an unknown escape `\\{c}`", self.line_col(at))),
        }
    }

    /// `term` with its postfix operators.
    fn postfix(&mut self, mut term: String) -> Result<String, String> {
        loop {
            let at = self.i;
            let op = match self.peek() {
                Some(c @ ('*' | '+' | '?')) => {
                    self.i += 1;
                    c.to_string()
                }
                Some('{') => {
                    self.i += 1;
                    let (m, n) = self.bounds().ok_or_else(|| format!("{}: a bad `{{m,n}}`", self.line_col(at)))?;
                    if m > MAX_REPEAT || n.is_some_and(|n| n > MAX_REPEAT || n < m) {
                        return Err(format!(
                            "{}: repetitions must be within 0..={MAX_REPEAT}, m <= n",
                            self.line_col(at)
                        ));
                    }
                    match n {
                        Some(n) if n == m => format!("{{{m}}}"),
                        Some(n) => format!("{{{m},{n}}}"),
                        None => format!("{{{m},}}"),
                    }
                }
                _ => return Ok(term),
            };
            // An empty term repeated is empty, and so is any term repeated at most 0 times
            // (which llguidance does not take).
            if op == "{0}" || op == "{0,0}" {
                term.clear();
            }
            if !term.is_empty() {
                term = format!("({term}){op}");
            }
        }
    }

    /// `m}`, `m,}` or `m,n}` after a `{`.
    fn bounds(&mut self) -> Option<(u32, Option<u32>)> {
        let number = |p: &mut Parser| {
            p.skip();
            let start = p.i;
            while p.peek().is_some_and(|c| c.is_ascii_digit()) {
                p.i += 1;
            }
            let n = p.s[start..p.i].iter().collect::<String>().parse::<u32>().ok();
            p.skip();
            n
        };
        let m = number(self)?;
        let n = if self.peek() == Some(',') {
            self.i += 1;
            number(self)
        } else {
            Some(m)
        };
        (self.peek() == Some('}')).then(|| self.i += 1)?;
        Some((m, n))
    }
}

/// One character as a Lark string literal (JSON's escapes).
fn lark_char(c: char) -> String {
    serde_json::Value::String(c.to_string()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_become_rules_and_literals_characters() {
        let lark = gbnf_to_lark(
            "root ::= greeting (\" \" name){0,2}\ngreeting ::= \"hi\" | \"yo\\n\" # hello\nname ::= [a-zA-Z_-]+ .?",
        )
        .unwrap();
        assert_eq!(
            lark,
            "start: r0_greeting ((\" \" r1_name)){0,2}\n\
             r0_greeting: \"h\" \"i\" | \"y\" \"o\" \"\\n\"\n\
             r1_name: (/[\\x{61}-\\x{7A}\\x{41}-\\x{5A}\\x{5F}\\x{2D}]/)+ (/(?s:.)/)?\n"
        );
        // Multi-line rules, nested groups, a negated class with escapes, an empty alternative.
        let lark = gbnf_to_lark("root ::=\n  \"[\" (\n [^\"\\\\\\x7F] | \n) \"]\"\nws ::= | \" \"").unwrap();
        assert!(lark.starts_with("start: \"[\" (/[^\\x{22}\\x{5C}\\x{7F}]/ | ) \"]\"\n"), "{lark}");
    }

    /// `root ::= r1`, `r1 ::= r2`, ... `rN ::= "a"`.
    fn deep_chain(n: usize) -> String {
        let mut g = String::from("root ::= r1\n");
        for i in 1..n {
            g += &format!("r{i} ::= r{} | \"x\"\n", i + 1);
        }
        g + &format!("r{n} ::= \"a\" r1?\n")
    }

    #[test]
    fn deep_but_allowed_chains_and_zero_repetitions_translate() {
        assert!(gbnf_to_lark(&deep_chain(99)).is_ok());
        let lark = gbnf_to_lark("root ::= \"a\"{0} \"b\" (\"c\"){0,0} \"d\"{1}").unwrap();
        assert_eq!(lark, "start: \"b\" (\"d\"){1}\n");
    }

    #[test]
    fn errors_say_what_and_where() {
        for (src, want) in [
            ("root ::= \"a", "1:10: unterminated string"),
            ("root ::= [a-", "1:10: unterminated character class"),
            ("root ::= (\"a\"", "1:10: unclosed `(`"),
            ("item ::= \"a\"", "no `root` rule"),
            ("root ::= item", "1:10: rule `item` is used but not defined"),
            ("root ::= \"a\"\nroot ::= \"b\"", "2:1: rule `root` is defined twice"),
            ("root ::= \"a\"{3,2}", "1:13: repetitions must be"),
            ("root ::= \"\\q\"", "1:11: an unknown escape"),
            ("root = \"a\"", "1:6: expected `::=`"),
            ("root ::= [z-a]", "1:10: the range"),
            ("root ::= []", "1:10: an empty character class"),
            (&format!("root ::= {}\"a\"{}", "(".repeat(13), ")".repeat(13)), "groups nest more than 12"),
            (&deep_chain(120), "rules nest more than 100 deep"),
        ] {
            let e = gbnf_to_lark(src).unwrap_err();
            assert!(e.contains(want), "{src:?}: {e}");
        }
    }
}
