//! The small expression language shared by parameter bindings (`hidden / heads`), weight
//! shapes (`[heads * head_dim, hidden]`) and the graph statements of a model YAML
//! (`x = x + linear(h, o)`).
//!
//! Grammar (lowest precedence first):
//! `or` → `and` → `not` → comparison (`== != < <= > >=`) → `+ -` → `* / // %` → unary `-` →
//! primary: number, `true`/`false`/`null`, `"string"`, identifier (dotted: `a.b`),
//! call `f(arg, ..., key=value, ...)`, parenthesised expression.

use std::fmt;

/// A parsed expression.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    /// An integer literal.
    Int(i64),
    /// A floating-point literal.
    Float(f64),
    /// `true` or `false`.
    Bool(bool),
    /// `null`.
    Null,
    /// A quoted string literal.
    Str(String),
    /// A (possibly dotted) identifier.
    Ident(String),
    /// A unary operation.
    Unary(UnOp, Box<Expr>),
    /// A binary operation.
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// A call `name(args..., key=value...)`.
    Call {
        /// The callee's name.
        name: String,
        /// Positional arguments.
        args: Vec<Expr>,
        /// Keyword arguments, in source order.
        kwargs: Vec<(String, Expr)>,
    },
}

/// Unary operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnOp {
    /// Arithmetic negation.
    Neg,
    /// Boolean negation.
    Not,
}

/// Binary operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinOp {
    /// `+`
    Add,
    /// `-`
    Sub,
    /// `*`
    Mul,
    /// `/` (true division; integral when both sides are integers and it divides exactly)
    Div,
    /// `//` (floor division)
    FloorDiv,
    /// `%`
    Rem,
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
    /// `and`
    And,
    /// `or`
    Or,
}

impl BinOp {
    fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::FloorDiv => "//",
            BinOp::Rem => "%",
            BinOp::Eq => "==",
            BinOp::Ne => "!=",
            BinOp::Lt => "<",
            BinOp::Le => "<=",
            BinOp::Gt => ">",
            BinOp::Ge => ">=",
            BinOp::And => "and",
            BinOp::Or => "or",
        }
    }
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Int(v) => write!(f, "{v}"),
            Expr::Float(v) => write!(f, "{v:?}"),
            Expr::Bool(v) => write!(f, "{v}"),
            Expr::Null => write!(f, "null"),
            Expr::Str(s) => write!(f, "{s:?}"),
            Expr::Ident(s) => write!(f, "{s}"),
            Expr::Unary(UnOp::Neg, e) => write!(f, "-{e}"),
            Expr::Unary(UnOp::Not, e) => write!(f, "not {e}"),
            Expr::Binary(op, a, b) => write!(f, "({a} {} {b})", op.symbol()),
            Expr::Call { name, args, kwargs } => {
                write!(f, "{name}(")?;
                let mut first = true;
                for a in args {
                    if !first {
                        write!(f, ", ")?;
                    }
                    first = false;
                    write!(f, "{a}")?;
                }
                for (k, v) in kwargs {
                    if !first {
                        write!(f, ", ")?;
                    }
                    first = false;
                    write!(f, "{k}={v}")?;
                }
                write!(f, ")")
            }
        }
    }
}

/// A syntax error in an expression, with the byte column where it was found.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("syntax error at column {column} of `{source_text}`: {message}")]
pub struct ParseError {
    /// What is wrong.
    pub message: String,
    /// 1-based column (in characters) in the expression text.
    pub column: usize,
    /// The expression text.
    pub source_text: String,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Int(i64),
    Float(f64),
    Str(String),
    Ident(String),
    Sym(&'static str),
}

const SYMBOLS: [&str; 17] = ["//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "<", ">", "(", ")", ",", "=", ":"];

fn tokenize(src: &str) -> Result<Vec<(Tok, usize)>, ParseError> {
    let chars: Vec<char> = src.chars().collect();
    let err = |message: String, at: usize| ParseError { message, column: at + 1, source_text: src.to_string() };
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() || (c == '.' && chars.get(i + 1).is_some_and(|d| d.is_ascii_digit())) {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric()
                    || chars[i] == '.'
                    || chars[i] == '_'
                    || ((chars[i] == '-' || chars[i] == '+') && matches!(chars[i - 1], 'e' | 'E')))
            {
                i += 1;
            }
            let text: String = chars[start..i].iter().filter(|c| **c != '_').collect();
            let tok = if text.contains(['.', 'e', 'E']) {
                Tok::Float(text.parse().map_err(|_| err(format!("bad number `{text}`"), start))?)
            } else {
                Tok::Int(text.parse().map_err(|_| err(format!("bad number `{text}`"), start))?)
            };
            out.push((tok, start));
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_' || chars[i] == '.') {
                i += 1;
            }
            out.push((Tok::Ident(chars[start..i].iter().collect()), start));
        } else if c == '"' || c == '\'' {
            let start = i;
            i += 1;
            let mut s = String::new();
            while i < chars.len() && chars[i] != c {
                s.push(chars[i]);
                i += 1;
            }
            if i == chars.len() {
                return Err(err("unterminated string".into(), start));
            }
            i += 1;
            out.push((Tok::Str(s), start));
        } else {
            let rest: String = chars[i..chars.len().min(i + 2)].iter().collect();
            let sym = SYMBOLS
                .iter()
                .find(|s| rest.starts_with(**s))
                .ok_or_else(|| err(format!("unexpected character `{c}`"), i))?;
            out.push((Tok::Sym(sym), i));
            i += sym.len();
        }
    }
    Ok(out)
}

/// A recursive-descent parser over the token stream.
struct Parser<'a> {
    toks: Vec<(Tok, usize)>,
    pos: usize,
    src: &'a str,
}

impl Parser<'_> {
    fn err(&self, message: impl Into<String>) -> ParseError {
        let column = self.toks.get(self.pos).map_or(self.src.chars().count(), |t| t.1) + 1;
        ParseError { message: message.into(), column, source_text: self.src.to_string() }
    }

    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|t| &t.0)
    }

    fn peek_at(&self, k: usize) -> Option<&Tok> {
        self.toks.get(self.pos + k).map(|t| &t.0)
    }

    fn eat_sym(&mut self, s: &str) -> bool {
        if matches!(self.peek(), Some(Tok::Sym(x)) if *x == s) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn eat_word(&mut self, w: &str) -> bool {
        if matches!(self.peek(), Some(Tok::Ident(x)) if x == w) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect_sym(&mut self, s: &str) -> Result<(), ParseError> {
        if self.eat_sym(s) {
            Ok(())
        } else {
            Err(self.err(format!("expected `{s}`")))
        }
    }

    fn expr(&mut self) -> Result<Expr, ParseError> {
        let mut lhs = self.and()?;
        while self.eat_word("or") {
            lhs = Expr::Binary(BinOp::Or, Box::new(lhs), Box::new(self.and()?));
        }
        Ok(lhs)
    }

    fn and(&mut self) -> Result<Expr, ParseError> {
        let mut lhs = self.not()?;
        while self.eat_word("and") {
            lhs = Expr::Binary(BinOp::And, Box::new(lhs), Box::new(self.not()?));
        }
        Ok(lhs)
    }

    fn not(&mut self) -> Result<Expr, ParseError> {
        if self.eat_word("not") {
            return Ok(Expr::Unary(UnOp::Not, Box::new(self.not()?)));
        }
        self.comparison()
    }

    fn comparison(&mut self) -> Result<Expr, ParseError> {
        let lhs = self.additive()?;
        let ops = [
            ("==", BinOp::Eq),
            ("!=", BinOp::Ne),
            ("<=", BinOp::Le),
            (">=", BinOp::Ge),
            ("<", BinOp::Lt),
            (">", BinOp::Gt),
        ];
        for (s, op) in ops {
            if self.eat_sym(s) {
                return Ok(Expr::Binary(op, Box::new(lhs), Box::new(self.additive()?)));
            }
        }
        Ok(lhs)
    }

    fn additive(&mut self) -> Result<Expr, ParseError> {
        let mut lhs = self.term()?;
        loop {
            let op = if self.eat_sym("+") {
                BinOp::Add
            } else if self.eat_sym("-") {
                BinOp::Sub
            } else {
                return Ok(lhs);
            };
            lhs = Expr::Binary(op, Box::new(lhs), Box::new(self.term()?));
        }
    }

    fn term(&mut self) -> Result<Expr, ParseError> {
        let mut lhs = self.unary()?;
        loop {
            let op = if self.eat_sym("*") {
                BinOp::Mul
            } else if self.eat_sym("//") {
                BinOp::FloorDiv
            } else if self.eat_sym("/") {
                BinOp::Div
            } else if self.eat_sym("%") {
                BinOp::Rem
            } else {
                return Ok(lhs);
            };
            lhs = Expr::Binary(op, Box::new(lhs), Box::new(self.unary()?));
        }
    }

    fn unary(&mut self) -> Result<Expr, ParseError> {
        if self.eat_sym("-") {
            return Ok(Expr::Unary(UnOp::Neg, Box::new(self.unary()?)));
        }
        self.primary()
    }

    fn primary(&mut self) -> Result<Expr, ParseError> {
        let Some(tok) = self.peek().cloned() else {
            return Err(self.err("unexpected end of expression"));
        };
        self.pos += 1;
        match tok {
            Tok::Int(v) => Ok(Expr::Int(v)),
            Tok::Float(v) => Ok(Expr::Float(v)),
            Tok::Str(s) => Ok(Expr::Str(s)),
            Tok::Sym("(") => {
                let e = self.expr()?;
                self.expect_sym(")")?;
                Ok(e)
            }
            Tok::Ident(name) => match name.as_str() {
                "true" | "True" => Ok(Expr::Bool(true)),
                "false" | "False" => Ok(Expr::Bool(false)),
                "null" | "None" => Ok(Expr::Null),
                _ if self.eat_sym("(") => self.call_rest(name),
                _ => Ok(Expr::Ident(name)),
            },
            Tok::Sym(s) => {
                self.pos -= 1;
                Err(self.err(format!("unexpected `{s}`")))
            }
        }
    }

    fn call_rest(&mut self, name: String) -> Result<Expr, ParseError> {
        let mut args = Vec::new();
        let mut kwargs = Vec::new();
        if !self.eat_sym(")") {
            loop {
                let is_kw =
                    matches!(self.peek(), Some(Tok::Ident(_))) && matches!(self.peek_at(1), Some(Tok::Sym("=")));
                if is_kw {
                    let Some(Tok::Ident(k)) = self.peek().cloned() else { unreachable!("checked above") };
                    self.pos += 2;
                    kwargs.push((k, self.expr()?));
                } else if !kwargs.is_empty() {
                    return Err(self.err("positional argument after keyword argument"));
                } else {
                    args.push(self.expr()?);
                }
                if self.eat_sym(")") {
                    break;
                }
                self.expect_sym(",")?;
            }
        }
        Ok(Expr::Call { name, args, kwargs })
    }

    fn finish(&self) -> Result<(), ParseError> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(self.err("unexpected text after the end of the expression")),
        }
    }
}

/// Parses one expression.
pub fn parse_expr(src: &str) -> Result<Expr, ParseError> {
    let mut p = Parser { toks: tokenize(src)?, pos: 0, src };
    let e = p.expr()?;
    p.finish()?;
    Ok(e)
}

/// A graph statement: `a, b = expr, expr` (or a single `a = expr`).
#[derive(Debug, Clone, PartialEq)]
pub struct Statement {
    /// The names bound, left to right.
    pub targets: Vec<String>,
    /// The expressions, one per target.
    pub values: Vec<Expr>,
}

/// Parses a graph statement `name[, name...] = expr[, expr...]`.
pub fn parse_statement(src: &str) -> Result<Statement, ParseError> {
    let mut p = Parser { toks: tokenize(src)?, pos: 0, src };
    let mut targets = Vec::new();
    loop {
        match p.peek().cloned() {
            Some(Tok::Ident(name)) => {
                p.pos += 1;
                targets.push(name);
            }
            _ => return Err(p.err("expected a name to assign to")),
        }
        if p.eat_sym("=") {
            break;
        }
        p.expect_sym(",")?;
    }
    let mut values = vec![p.expr()?];
    while p.eat_sym(",") {
        values.push(p.expr()?);
    }
    p.finish()?;
    if values.len() != targets.len() {
        return Err(ParseError {
            message: format!("{} names on the left but {} expressions on the right", targets.len(), values.len()),
            column: 1,
            source_text: src.to_string(),
        });
    }
    Ok(Statement { targets, values })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence_and_calls() {
        let e = parse_expr("x + linear(silu(a) * b, down, bias=c)").unwrap();
        assert_eq!(e.to_string(), "(x + linear((silu(a) * b), down, bias=c))");
        assert_eq!(parse_expr("not a and b or c").unwrap().to_string(), "((not a and b) or c)");
        assert_eq!(parse_expr("a // 2 - -3").unwrap().to_string(), "((a // 2) - -3)");
        assert_eq!(parse_expr("1e-6").unwrap(), Expr::Float(1e-6));
        assert_eq!(parse_expr("rope_parameters.rope_theta").unwrap(), Expr::Ident("rope_parameters.rope_theta".into()));
    }

    #[test]
    fn statements() {
        let s = parse_statement("q, k = rope(q, positions), rope(k, positions)").unwrap();
        assert_eq!(s.targets, vec!["q", "k"]);
        assert_eq!(s.values.len(), 2);
        assert!(parse_statement("a, b = f(x)").is_err());
    }

    #[test]
    fn errors_have_columns() {
        let e = parse_expr("a + * b").unwrap_err();
        assert_eq!(e.column, 5);
        let e = parse_expr("f(a, b").unwrap_err();
        assert!(e.message.contains("expected `,`"), "{e}");
        assert!(parse_expr("a $ b").unwrap_err().message.contains("unexpected character"));
    }
}
