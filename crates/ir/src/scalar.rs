//! Elementwise math, declared once. A [`Scalar`] is the expression of an [`crate::Op::Map`]:
//! a tree of calls to the functions of [`FUNCTIONS`] over the op's inputs (`x0`, `x1`, ...)
//! and f32 constants. The reference interpreter evaluates it with each function's `eval`; the
//! CPU backend calls the same `eval` (or emits the native instruction named by `native`); the
//! CUDA backend renders it as C with each function's `cuda` template. Adding a function is one
//! row of [`FUNCTIONS`] (`docs/adding-an-op.md`).
//!
//! Every function is computed in f32, as HF computes these activations in a float32 model.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A native instruction a JIT backend may emit instead of calling [`Function::eval`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Native {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b`
    Div,
    /// `-a`
    Neg,
    /// `sqrt(a)`
    Sqrt,
    /// The smaller of `a` and `b`.
    Min,
    /// The larger of `a` and `b`.
    Max,
}

/// One elementwise function: its name in model YAML, its arity, and its meaning for each
/// backend.
#[derive(Debug)]
pub struct Function {
    /// The name a model YAML calls it by (operators have their symbol: `+ - * /`, `neg`).
    pub name: &'static str,
    /// Number of arguments: 1, 2 or 3.
    pub arity: usize,
    /// The reference semantics, in f32 (unused arguments are 0). Also what the CPU backend
    /// calls when `native` is `None`.
    pub eval: extern "C" fn(f32, f32, f32) -> f32,
    /// CUDA C for the function, `{0}`, `{1}`, `{2}` standing for its (parenthesised) arguments.
    pub cuda: &'static str,
    /// The instruction a JIT may use instead of calling `eval` (the same result).
    pub native: Option<Native>,
}

macro_rules! f {
    ($name:literal, $arity:literal, |$a:ident, $b:ident, $c:ident| $body:expr, $cuda:literal, $native:expr) => {{
        #[allow(unused_variables)]
        extern "C" fn eval($a: f32, $b: f32, $c: f32) -> f32 {
            $body
        }
        Function { name: $name, arity: $arity, eval, cuda: $cuda, native: $native }
    }};
}

/// √(2/π), of the tanh approximation of GeLU.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// The elementwise functions. The first five are the arithmetic operators.
pub const FUNCTIONS: &[Function] = &[
    f!("+", 2, |a, b, c| a + b, "{0} + {1}", Some(Native::Add)),
    f!("-", 2, |a, b, c| a - b, "{0} - {1}", Some(Native::Sub)),
    f!("*", 2, |a, b, c| a * b, "{0} * {1}", Some(Native::Mul)),
    f!("/", 2, |a, b, c| a / b, "{0} / {1}", Some(Native::Div)),
    f!("neg", 1, |a, b, c| -a, "-{0}", Some(Native::Neg)),
    f!("sqrt", 1, |a, b, c| a.sqrt(), "sqrtf({0})", Some(Native::Sqrt)),
    f!("rsqrt", 1, |a, b, c| 1.0 / a.sqrt(), "(1.0f / sqrtf({0}))", None),
    f!("exp", 1, |a, b, c| a.exp(), "expf({0})", None),
    f!("tanh", 1, |a, b, c| a.tanh(), "tanhf({0})", None),
    f!("sigmoid", 1, |a, b, c| 1.0 / (1.0 + (-a).exp()), "(1.0f / (1.0f + expf(-{0})))", None),
    f!("silu", 1, |a, b, c| a / (1.0 + (-a).exp()), "({0} / (1.0f + expf(-{0})))", None),
    f!(
        "gelu",
        1,
        |a, b, c| 0.5 * a * (1.0 + erf(a * std::f32::consts::FRAC_1_SQRT_2)),
        "(0.5f * {0} * (1.0f + erff({0} * 0.70710678f)))",
        None
    ),
    f!(
        "gelu_tanh",
        1,
        |a, b, c| 0.5 * a * (1.0 + (SQRT_2_OVER_PI * (a + 0.044715 * a * a * a)).tanh()),
        "(0.5f * {0} * (1.0f + tanhf(0.7978846f * ({0} + 0.044715f * {0} * {0} * {0}))))",
        None
    ),
    f!("min", 2, |a, b, c| a.min(b), "fminf({0}, {1})", Some(Native::Min)),
    f!("max", 2, |a, b, c| a.max(b), "fmaxf({0}, {1})", Some(Native::Max)),
    f!("clamp", 3, |a, b, c| a.max(b).min(c), "fminf(fmaxf({0}, {1}), {2})", None),
];

/// The error function in f32 (erf of the f64 value, rounded once: what a correctly rounded
/// `erff` returns, and within an ulp of torch's).
fn erf(x: f32) -> f32 {
    erf64(x as f64) as f32
}

/// erf in f64 by its Taylor series near 0 and its continued fraction (via erfc) further out;
/// accurate to about 1e-15, far below f32's resolution.
fn erf64(x: f64) -> f64 {
    let a = x.abs();
    let r = if a < 2.5 {
        // erf(a) = 2/√π Σ (-1)^n a^(2n+1) / (n! (2n+1))
        let (mut term, mut sum, mut n) = (a, a, 0.0);
        while term.abs() > 1e-17 * sum.abs() {
            n += 1.0;
            term *= -a * a / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * std::f64::consts::FRAC_2_SQRT_PI
    } else {
        // erfc(a) = exp(-a²)/√π · 1/(a + 1/2/(a + 1/(a + 3/2/(a + 2/(a + ...)))))
        let mut f = a;
        for k in (1..60).rev() {
            f = a + (k as f64 / 2.0) / f;
        }
        1.0 - (-a * a).exp() / (f * std::f64::consts::PI.sqrt())
    };
    r.copysign(x)
}

/// A function of [`FUNCTIONS`], by index; printed and serialised by name.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fun(u8);

impl Fun {
    /// The function named `name`.
    pub fn named(name: &str) -> Option<Fun> {
        FUNCTIONS.iter().position(|f| f.name == name).map(|i| Fun(i as u8))
    }

    /// Its definition.
    pub fn def(self) -> &'static Function {
        &FUNCTIONS[self.0 as usize]
    }

    /// The names model YAML may call (not the operators), for error messages.
    pub fn callable() -> Vec<&'static str> {
        FUNCTIONS.iter().map(|f| f.name).filter(|n| n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')).collect()
    }
}

impl fmt::Debug for Fun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.def().name)
    }
}

impl Serialize for Fun {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.def().name)
    }
}

impl<'de> Deserialize<'de> for Fun {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Fun, D::Error> {
        let name = String::deserialize(d)?;
        Fun::named(&name).ok_or_else(|| serde::de::Error::custom(format!("unknown elementwise function `{name}`")))
    }
}

/// An elementwise expression over the inputs of a map.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scalar {
    /// Input `i` of the op (`x{i}`).
    Arg(usize),
    /// A constant (finite).
    Const(f32),
    /// A function applied to arguments (as many as its arity).
    Call(Fun, Vec<Scalar>),
}

impl Scalar {
    /// `f(args)`, folded to a constant when every argument is one.
    pub fn call(f: Fun, args: Vec<Scalar>) -> Scalar {
        let consts: Vec<f32> =
            args.iter().filter_map(|a| if let Scalar::Const(c) = a { Some(*c) } else { None }).collect();
        if consts.len() == args.len() {
            let at = |i: usize| consts.get(i).copied().unwrap_or(0.0);
            return Scalar::Const((f.def().eval)(at(0), at(1), at(2)));
        }
        Scalar::Call(f, args)
    }

    /// The value at one element, `x[i]` being input `i`'s.
    pub fn eval(&self, x: &[f32]) -> f32 {
        match self {
            Scalar::Arg(i) => x[*i],
            Scalar::Const(c) => *c,
            Scalar::Call(f, args) => {
                let at = |i: usize| args.get(i).map_or(0.0, |a| a.eval(x));
                (f.def().eval)(at(0), at(1), at(2))
            }
        }
    }

    /// The largest input index used, plus one.
    pub fn arity(&self) -> usize {
        match self {
            Scalar::Arg(i) => i + 1,
            Scalar::Const(_) => 0,
            Scalar::Call(_, args) => args.iter().map(Scalar::arity).max().unwrap_or(0),
        }
    }

    /// Checks arities and constants; returns what is wrong.
    pub fn check(&self) -> Result<(), String> {
        match self {
            Scalar::Arg(_) => Ok(()),
            Scalar::Const(c) if c.is_finite() => Ok(()),
            Scalar::Const(c) => Err(format!("the constant {c} is not finite")),
            Scalar::Call(f, args) if args.len() != f.def().arity => {
                Err(format!("`{}` takes {} arguments, got {}", f.def().name, f.def().arity, args.len()))
            }
            Scalar::Call(_, args) => args.iter().try_for_each(Scalar::check),
        }
    }

    /// The expression with input `i` replaced by `by[i]` (composition of maps).
    pub fn substitute(&self, by: &[Scalar]) -> Scalar {
        match self {
            Scalar::Arg(i) => by[*i].clone(),
            Scalar::Const(c) => Scalar::Const(*c),
            Scalar::Call(f, args) => Scalar::Call(*f, args.iter().map(|a| a.substitute(by)).collect()),
        }
    }

    /// CUDA C for the expression, input `i` read from the variable `x{i}`. Constants are
    /// written so that they parse back to the same f32.
    pub fn to_cuda(&self) -> String {
        match self {
            Scalar::Arg(i) => format!("x{i}"),
            Scalar::Const(c) => format!("{c:e}f"),
            Scalar::Call(f, args) => {
                let mut s = f.def().cuda.to_string();
                for (i, a) in args.iter().enumerate() {
                    s = s.replace(&format!("{{{i}}}"), &format!("({})", a.to_cuda()));
                }
                format!("({s})")
            }
        }
    }
}

impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::Arg(i) => write!(f, "x{i}"),
            Scalar::Const(c) => write!(f, "{c}"),
            Scalar::Call(fun, args) => {
                let name = fun.def().name;
                match args.as_slice() {
                    [a, b] if !name.starts_with(|c: char| c.is_ascii_alphabetic()) => write!(f, "({a} {name} {b})"),
                    _ => {
                        write!(f, "{name}(")?;
                        for (i, a) in args.iter().enumerate() {
                            write!(f, "{}{a}", if i > 0 { ", " } else { "" })?;
                        }
                        f.write_str(")")
                    }
                }
            }
        }
    }
}

/// Soft-capping, `tanh(x0 / cap) · cap`: Gemma's attention scores and final logits.
pub fn softcap(cap: f32) -> Scalar {
    let f = |name: &str| Fun::named(name).expect("a function of FUNCTIONS");
    let inner = Scalar::Call(f("/"), vec![Scalar::Arg(0), Scalar::Const(cap)]);
    Scalar::Call(f("*"), vec![Scalar::Call(f("tanh"), vec![inner]), Scalar::Const(cap)])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: Vec<Scalar>) -> Scalar {
        Scalar::Call(Fun::named(name).unwrap(), args)
    }

    #[test]
    fn soft_capping_evaluates_and_prints() {
        // tanh(x0 / 30) * 30
        let cap = call(
            "*",
            vec![call("tanh", vec![call("/", vec![Scalar::Arg(0), Scalar::Const(30.0)])]), Scalar::Const(30.0)],
        );
        assert_eq!(cap.to_string(), "(tanh((x0 / 30)) * 30)");
        assert!((cap.eval(&[100.0]) - 30.0 * (100.0f32 / 30.0).tanh()).abs() < 1e-6);
        assert_eq!(cap.arity(), 1);
        let json = serde_json::to_string(&cap).unwrap();
        assert_eq!(serde_json::from_str::<Scalar>(&json).unwrap(), cap);
        assert!(serde_json::from_str::<Scalar>(&json.replace("tanh", "tan")).is_err());
        assert!(cap.to_cuda().contains("tanhf"), "{}", cap.to_cuda());
    }

    #[test]
    fn constants_fold_and_arity_is_checked() {
        let s = Scalar::call(Fun::named("sqrt").unwrap(), vec![Scalar::Const(2304.0)]);
        assert_eq!(s, Scalar::Const(48.0));
        assert!(call("min", vec![Scalar::Arg(0)]).check().unwrap_err().contains("takes 2 arguments"));
        assert!(Scalar::Const(f32::INFINITY).check().is_err());
    }

    /// erf against values of the error function (Abramowitz & Stegun table 7.1 and beyond),
    /// GeLU and its tanh form at points where they differ.
    #[test]
    fn gelu_forms_match_their_definitions() {
        for (x, want) in [
            (0.5f64, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.0, 0.999_977_909_503_001_4),
            (-1.5, -0.966_105_146_475_310_7),
        ] {
            assert!((erf64(x) - want).abs() < 1e-13, "erf({x}) = {}", erf64(x));
        }
        let gelu = |x: f32| call("gelu", vec![Scalar::Arg(0)]).eval(&[x]);
        let tanh = |x: f32| call("gelu_tanh", vec![Scalar::Arg(0)]).eval(&[x]);
        assert!((gelu(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((tanh(1.0) - 0.841_192).abs() < 1e-6);
        assert!((gelu(-3.0) + 0.004_049_835).abs() < 3e-7, "f32 cancellation in 1 + erf");
    }
}
