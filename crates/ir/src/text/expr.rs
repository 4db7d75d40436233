//! Elementwise expressions as `Scalar`'s `Display` prints them, read back.

use crate::scalar::{Fun, Scalar};

/// Parses an elementwise expression as [`Scalar`]'s `Display` prints it (`(x0 + (tanh(x0) *
/// x1))`: binary operators parenthesised, calls `f(a, b)`, inputs `x{i}`, constants as Rust
/// prints an f32). Unparenthesised `+ - * /` are read with the usual precedence, left to
/// right, and a `-` before anything but a number is `neg`. Constants are not folded.
pub fn parse_scalar(s: &str) -> Result<Scalar, String> {
    let mut p = Expr { s, i: 0 };
    let e = p.sum()?;
    p.ws();
    if p.i < s.len() {
        return Err(p.err("expected the end of the expression"));
    }
    Ok(e)
}

/// A recursive-descent reader of [`Scalar`] text.
struct Expr<'a> {
    s: &'a str,
    i: usize,
}

impl Expr<'_> {
    fn err(&self, what: &str) -> String {
        format!("{what} at column {} of `{}`", self.i + 1, self.s)
    }

    fn ws(&mut self) {
        self.i += self.s[self.i..].len() - self.s[self.i..].trim_start().len();
    }

    fn peek(&mut self) -> Option<char> {
        self.ws();
        self.s[self.i..].chars().next()
    }

    fn fun(name: &str) -> Fun {
        Fun::named(name).unwrap_or_else(|| unreachable!("`{name}` is a function of FUNCTIONS"))
    }

    /// `product (('+' | '-') product)*`
    fn sum(&mut self) -> Result<Scalar, String> {
        let mut a = self.product()?;
        while let Some(c @ ('+' | '-')) = self.peek() {
            self.i += 1;
            let b = self.product()?;
            a = Scalar::Call(Self::fun(&c.to_string()), vec![a, b]);
        }
        Ok(a)
    }

    /// `unary (('*' | '/') unary)*`
    fn product(&mut self) -> Result<Scalar, String> {
        let mut a = self.unary()?;
        while let Some(c @ ('*' | '/')) = self.peek() {
            self.i += 1;
            let b = self.unary()?;
            a = Scalar::Call(Self::fun(&c.to_string()), vec![a, b]);
        }
        Ok(a)
    }

    /// A negative number, `-unary` (`neg`), or a primary.
    fn unary(&mut self) -> Result<Scalar, String> {
        if self.peek() == Some('-') {
            let next = self.s[self.i + 1..].chars().next();
            if !next.is_some_and(|c| c.is_ascii_digit() || c == '.') {
                self.i += 1;
                return Ok(Scalar::Call(Self::fun("neg"), vec![self.unary()?]));
            }
        }
        self.primary()
    }

    /// A number, `x{i}`, `f(args)` or `(sum)`.
    fn primary(&mut self) -> Result<Scalar, String> {
        let rest = &self.s[self.i..];
        match self.peek() {
            Some('(') => {
                self.i += 1;
                let e = self.sum()?;
                if self.peek() != Some(')') {
                    return Err(self.err("expected `)`"));
                }
                self.i += 1;
                Ok(e)
            }
            Some(c) if c.is_ascii_digit() || c == '.' || c == '-' => {
                let rest = &self.s[self.i..];
                let mut len = usize::from(c == '-');
                let mut prev = c;
                for ch in rest[len..].chars() {
                    let sign_of_exponent = matches!(ch, '+' | '-') && matches!(prev, 'e' | 'E');
                    if !(ch.is_ascii_digit() || matches!(ch, '.' | 'e' | 'E') || sign_of_exponent) {
                        break;
                    }
                    len += ch.len_utf8();
                    prev = ch;
                }
                let word = &rest[..len];
                let v: f32 = word.parse().map_err(|_| self.err(&format!("`{word}` is not a number")))?;
                if !v.is_finite() {
                    return Err(self.err(&format!("the constant `{word}` is not a finite f32")));
                }
                self.i += len;
                Ok(Scalar::Const(v))
            }
            Some(c) if c.is_ascii_alphabetic() || c == '_' => {
                let rest = &self.s[self.i..];
                let len = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
                let word = &rest[..len];
                if let Some(i) =
                    word.strip_prefix('x').filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
                {
                    self.i += len;
                    return i.parse().map(Scalar::Arg).map_err(|_| self.err(&format!("`{word}` is too large")));
                }
                let f = Fun::named(word).ok_or_else(|| {
                    self.err(&format!("unknown function `{word}` (the functions are {})", Fun::callable().join(", ")))
                })?;
                self.i += len;
                if self.peek() != Some('(') {
                    return Err(self.err(&format!("expected `(` after `{word}`")));
                }
                self.i += 1;
                let mut args = Vec::new();
                if self.peek() == Some(')') {
                    self.i += 1;
                } else {
                    loop {
                        args.push(self.sum()?);
                        match self.peek() {
                            Some(',') => self.i += 1,
                            Some(')') => {
                                self.i += 1;
                                break;
                            }
                            _ => return Err(self.err("expected `,` or `)`")),
                        }
                    }
                }
                if args.len() != f.def().arity {
                    return Err(format!("`{word}` takes {} arguments, got {}", f.def().arity, args.len()));
                }
                Ok(Scalar::Call(f, args))
            }
            _ => Err(self.err(&format!("expected a number, `x{{i}}`, a call or `(`, got `{}`", rest.trim_start()))),
        }
    }
}
