//! Values that parameters and expressions evaluate to, and the evaluator.

use crate::expr::{BinOp, Expr, UnOp};
use std::fmt;

/// A parameter value: a number, a boolean, a string, null, or a JSON object/array taken from
/// config.json as it is (for example `rope_scaling`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum Value {
    /// Null / absent.
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// A JSON object or array, kept as it is.
    Json(serde_json::Value),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Null => write!(f, "null"),
            Value::Bool(b) => write!(f, "{b}"),
            Value::Int(i) => write!(f, "{i}"),
            Value::Float(x) => write!(f, "{x:?}"),
            Value::Str(s) => write!(f, "{s:?}"),
            Value::Json(j) => write!(f, "{j}"),
        }
    }
}

impl Value {
    /// Converts a JSON value from config.json.
    pub fn from_json(j: &serde_json::Value) -> Value {
        match j {
            serde_json::Value::Null => Value::Null,
            serde_json::Value::Bool(b) => Value::Bool(*b),
            serde_json::Value::Number(n) => match n.as_i64() {
                Some(i) => Value::Int(i),
                None => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
            },
            serde_json::Value::String(s) => Value::Str(s.clone()),
            other => Value::Json(other.clone()),
        }
    }

    /// The value as a non-negative integer (a float with no fractional part is accepted).
    pub fn as_usize(&self) -> Option<usize> {
        match self {
            Value::Int(i) if *i >= 0 => Some(*i as usize),
            Value::Float(x) if *x >= 0.0 && x.fract() == 0.0 => Some(*x as usize),
            _ => None,
        }
    }

    /// The value as a float.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(i) => Some(*i as f64),
            Value::Float(x) => Some(*x),
            _ => None,
        }
    }

    /// The value as a boolean (null is false).
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            Value::Null => Some(false),
            _ => None,
        }
    }

    /// The value as JSON (for objects such as rope scaling).
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Value::Null => serde_json::Value::Null,
            Value::Bool(b) => (*b).into(),
            Value::Int(i) => (*i).into(),
            Value::Float(x) => serde_json::Number::from_f64(*x).map_or(serde_json::Value::Null, Into::into),
            Value::Str(s) => s.clone().into(),
            Value::Json(j) => j.clone(),
        }
    }

    fn type_name(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "string",
            Value::Json(_) => "object",
        }
    }
}

/// Evaluates `e`, resolving identifiers through `lookup`. The calls are the value functions:
/// `where(cond, a, b)` (`a` if `cond` else `b`; only the branch taken is evaluated),
/// `at(list, i)` (element `i` of a JSON array, such as a config's `layer_types`), `sqrt(x)`.
pub fn eval(e: &Expr, lookup: &dyn Fn(&str) -> Option<Value>) -> Result<Value, String> {
    Ok(match e {
        Expr::Int(i) => Value::Int(*i),
        Expr::Float(x) => Value::Float(*x),
        Expr::Bool(b) => Value::Bool(*b),
        Expr::Null => Value::Null,
        Expr::Str(s) => Value::Str(s.clone()),
        Expr::Ident(name) => lookup(name).ok_or_else(|| format!("unknown name `{name}`"))?,
        Expr::Unary(UnOp::Neg, a) => match eval(a, lookup)? {
            Value::Int(i) => Value::Int(-i),
            Value::Float(x) => Value::Float(-x),
            v => return Err(format!("cannot negate a {}", v.type_name())),
        },
        Expr::Unary(UnOp::Not, a) => {
            let v = eval(a, lookup)?;
            Value::Bool(!v.as_bool().ok_or_else(|| format!("`not` needs a bool, got {v}"))?)
        }
        Expr::Binary(op, a, b) => binary(*op, eval(a, lookup)?, eval(b, lookup)?)?,
        Expr::Call { name, args, kwargs } if kwargs.is_empty() => call(name, args, lookup)?,
        Expr::Call { name, .. } => return Err(format!("`{name}(...)` takes no keyword arguments here")),
    })
}

/// The value functions of [`eval`].
fn call(name: &str, args: &[Expr], lookup: &dyn Fn(&str) -> Option<Value>) -> Result<Value, String> {
    let want = |n: usize| -> Result<(), String> {
        match args.len() == n {
            true => Ok(()),
            false => Err(format!("`{name}` takes {n} arguments, got {}", args.len())),
        }
    };
    match name {
        "where" => {
            want(3)?;
            let c = eval(&args[0], lookup)?;
            let c = c.as_bool().ok_or_else(|| format!("`where` needs a bool condition, got {c}"))?;
            eval(&args[if c { 1 } else { 2 }], lookup)
        }
        "at" => {
            want(2)?;
            let (list, i) = (eval(&args[0], lookup)?, eval(&args[1], lookup)?);
            let idx = i.as_usize().ok_or_else(|| format!("`at` needs an index, got {i}"))?;
            match &list {
                Value::Json(serde_json::Value::Array(a)) => a
                    .get(idx)
                    .map(Value::from_json)
                    .ok_or_else(|| format!("`at`: index {idx} is past the {} entries of {list}", a.len())),
                _ => Err(format!("`at` needs a list, got {list}")),
            }
        }
        "contains" => {
            want(2)?;
            let (list, x) = (eval(&args[0], lookup)?, eval(&args[1], lookup)?);
            match &list {
                Value::Json(serde_json::Value::Array(a)) => Ok(Value::Bool(a.iter().any(|v| Value::from_json(v) == x))),
                Value::Null => Ok(Value::Bool(false)),
                _ => Err(format!("`contains` needs a list, got {list}")),
            }
        }
        "sqrt" => {
            want(1)?;
            let x = eval(&args[0], lookup)?;
            Ok(Value::Float(x.as_f64().ok_or_else(|| format!("`sqrt` needs a number, got {x}"))?.sqrt()))
        }
        _ => Err(format!("`{name}(...)` is not a value function (where, at, sqrt)")),
    }
}

fn binary(op: BinOp, a: Value, b: Value) -> Result<Value, String> {
    use BinOp::*;
    if matches!(op, And | Or) {
        let (x, y) = (a.as_bool(), b.as_bool());
        let (Some(x), Some(y)) = (x, y) else {
            return Err(format!("`{op:?}` needs bools, got {a} and {b}"));
        };
        return Ok(Value::Bool(if op == And { x && y } else { x || y }));
    }
    if matches!(op, Eq | Ne) {
        let same = match (a.as_f64(), b.as_f64()) {
            (Some(x), Some(y)) => x == y,
            _ => a == b,
        };
        return Ok(Value::Bool(same == (op == Eq)));
    }
    if let (Value::Int(x), Value::Int(y)) = (&a, &b) {
        let (x, y) = (*x, *y);
        let zero = || format!("division by zero in `{x} {op:?} {y}`");
        return Ok(match op {
            Add => Value::Int(x + y),
            Sub => Value::Int(x - y),
            Mul => Value::Int(x * y),
            Div if y == 0 => return Err(zero()),
            Div if x % y == 0 => Value::Int(x / y),
            Div => Value::Float(x as f64 / y as f64),
            FloorDiv if y == 0 => return Err(zero()),
            FloorDiv => Value::Int(x.div_euclid(y)),
            Rem if y == 0 => return Err(zero()),
            Rem => Value::Int(x.rem_euclid(y)),
            Lt => Value::Bool(x < y),
            Le => Value::Bool(x <= y),
            Gt => Value::Bool(x > y),
            Ge => Value::Bool(x >= y),
            Eq | Ne | And | Or => unreachable!("handled above"),
        });
    }
    let (Some(x), Some(y)) = (a.as_f64(), b.as_f64()) else {
        return Err(format!("arithmetic needs numbers, got {} and {}", a.type_name(), b.type_name()));
    };
    Ok(match op {
        Add => Value::Float(x + y),
        Sub => Value::Float(x - y),
        Mul => Value::Float(x * y),
        Div => Value::Float(x / y),
        FloorDiv => Value::Float((x / y).floor()),
        Rem => Value::Float(x.rem_euclid(y)),
        Lt => Value::Bool(x < y),
        Le => Value::Bool(x <= y),
        Gt => Value::Bool(x > y),
        Ge => Value::Bool(x >= y),
        Eq | Ne | And | Or => unreachable!("handled above"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::expr::parse_expr;

    fn ev(s: &str) -> Result<Value, String> {
        let env = |n: &str| match n {
            "hidden" => Some(Value::Int(64)),
            "heads" => Some(Value::Int(2)),
            "tie" => Some(Value::Bool(true)),
            _ => None,
        };
        eval(&parse_expr(s).unwrap(), &env)
    }

    #[test]
    fn arithmetic() {
        assert_eq!(ev("hidden / heads").unwrap(), Value::Int(32));
        assert_eq!(ev("hidden / 3 * 3").unwrap().as_f64().unwrap().round(), 64.0);
        assert_eq!(ev("hidden // 3").unwrap(), Value::Int(21));
        assert_eq!(ev("not tie").unwrap(), Value::Bool(false));
        assert_eq!(ev("heads == 2.0 and tie").unwrap(), Value::Bool(true));
        assert!(ev("hidden / 0").unwrap_err().contains("division by zero"));
        assert!(ev("nope + 1").unwrap_err().contains("unknown name `nope`"));
    }
}
