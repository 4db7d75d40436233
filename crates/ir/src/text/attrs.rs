//! Op attributes as `Op::attrs` prints them, read back (one function per op).

use super::expr::parse_scalar;
use super::{balanced, number, outside_strings};
use crate::op::Derived;
use crate::op::Op;
use crate::rope::RopeScaling;
use std::str::FromStr;

/// An op's attributes, `key=value, ...`, split at the commas outside brackets and strings.
struct Attrs<'a> {
    op: &'a str,
    pairs: Vec<(&'a str, &'a str)>,
}

impl<'a> Attrs<'a> {
    fn parse(op: &'a str, text: Option<&'a str>) -> Result<Self, String> {
        let mut pairs: Vec<(&str, &str)> = Vec::new();
        let Some(text) = text else { return Ok(Attrs { op, pairs }) };
        let (mut depth, mut start) = (0i32, 0);
        let mut items = Vec::new();
        for (i, c) in outside_strings(text) {
            match c {
                '{' | '(' | '[' => depth += 1,
                '}' | ')' | ']' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(&text[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        items.push(&text[start..]);
        for item in items {
            let (k, v) =
                item.split_once('=').ok_or_else(|| format!("{op}: expected `key=value`, got `{}`", item.trim()))?;
            let k = k.trim();
            if pairs.iter().any(|(seen, _)| *seen == k) {
                return Err(format!("{op}: the attribute `{k}` is given twice"));
            }
            pairs.push((k, v.trim()));
        }
        Ok(Attrs { op, pairs })
    }

    fn take(&mut self, key: &str) -> Option<&'a str> {
        let i = self.pairs.iter().position(|(k, _)| *k == key)?;
        Some(self.pairs.remove(i).1)
    }

    fn need_str(&mut self, key: &str) -> Result<&'a str, String> {
        self.take(key).ok_or_else(|| format!("{} needs the attribute `{key}`", self.op))
    }

    fn need<T: FromStr>(&mut self, key: &str) -> Result<T, String> {
        let v = self.need_str(key)?;
        number(key, v).map_err(|e| format!("{}: {e}", self.op))
    }

    fn opt<T: FromStr>(&mut self, key: &str) -> Result<Option<T>, String> {
        let op = self.op;
        self.take(key).map(|v| number(key, v).map_err(|e| format!("{op}: {e}"))).transpose()
    }

    /// Fails on attributes the op does not take.
    fn done(self) -> Result<(), String> {
        match self.pairs.first() {
            Some((k, _)) => Err(format!("{} takes no attribute `{k}`", self.op)),
            None => Ok(()),
        }
    }
}

/// The op named `name` with the attributes `attrs` (the text between the braces) and `args`
/// arguments.
pub(super) fn op(name: &str, attrs: Option<&str>, args: usize) -> Result<Op, String> {
    let mut a = Attrs::parse(name, attrs)?;
    let op = match name {
        "tokens" => Op::Tokens,
        "positions" => Op::Positions,
        "embedding" => Op::Embedding,
        "linear" => Op::Linear { bias: args == 3 },
        "rms_norm" => rms_norm(&mut a)?,
        "rope" => rope(&mut a)?,
        "attention" => attention(&mut a)?,
        "silu" => Op::Silu,
        "map" => map(&mut a)?,
        "mul" => Op::Mul,
        "add" => Op::Add,
        "all_reduce" => Op::AllReduce,
        "all_gather" => all_gather(&mut a)?,
        "moe" => moe(&mut a)?,
        "logits" => Op::Logits,
        "weight" => return Err("weights are declared on `@NAME : TYPE` lines, not as nodes".into()),
        _ => {
            return Err(format!(
                "unknown op `{name}` (the ops are tokens, positions, embedding, linear, rms_norm, rope, attention, \
                 silu, map, mul, add, all_reduce, all_gather, moe, logits)"
            ))
        }
    };
    a.done()?;
    Ok(op)
}

fn rms_norm(a: &mut Attrs) -> Result<Op, String> {
    Ok(Op::RmsNorm { eps: a.need("eps")? })
}

fn rope(a: &mut Attrs) -> Result<Op, String> {
    Ok(Op::Rope {
        head_dim: a.need("head_dim")?,
        theta: a.need("theta")?,
        scaling: rope_scaling(a.need_str("scaling")?).map_err(|e| format!("rope: scaling: {e}"))?,
        rotary_dim: a.opt("rotary_dim")?,
    })
}

fn attention(a: &mut Attrs) -> Result<Op, String> {
    Ok(Op::Attention {
        heads: a.need("heads")?,
        kv_heads: a.need("kv_heads")?,
        head_dim: a.need("head_dim")?,
        scale: a.need("scale")?,
        layer: a.need("layer")?,
        window: a.opt("window")?,
        softcap: a.opt("softcap")?,
        sinks: a.opt("sinks")?.unwrap_or(false),
    })
}

fn moe(a: &mut Attrs) -> Result<Op, String> {
    Ok(Op::Moe {
        top_k: a.need("top_k")?,
        norm_topk: a.need("norm_topk")?,
        act: parse_scalar(a.need_str("act")?).map_err(|e| format!("moe: act: {e}"))?,
        bias: a.need("bias")?,
    })
}

fn all_gather(a: &mut Attrs) -> Result<Op, String> {
    Ok(Op::AllGather { ranks: a.need("ranks")? })
}

fn map(a: &mut Attrs) -> Result<Op, String> {
    Ok(Op::Map { expr: parse_scalar(a.need_str("expr")?).map_err(|e| format!("map: expr: {e}"))? })
}

/// A [`RopeScaling`] from its JSON (serde_json with `float_roundtrip`, the workspace's: the
/// numbers read back to the bits they were printed from).
pub(super) fn rope_scaling(s: &str) -> Result<RopeScaling, String> {
    serde_json::from_str(s).map_err(|e| e.to_string())
}

/// `map{expr=EXPR}(@SOURCE)` after a weight's type and ` = `.
pub(super) fn derived(s: &str) -> Result<Derived, String> {
    const FORM: &str = "expected ` = map{expr=EXPR}(@SOURCE)` after the type";
    let s = s.strip_prefix(" = map").ok_or(FORM)?;
    if !s.starts_with('{') {
        return Err(FORM.into());
    }
    let (attrs, s) = balanced(s)?;
    let source = s.strip_prefix("(@").and_then(|s| s.strip_suffix(')')).ok_or(FORM)?;
    let mut a = Attrs::parse("map", Some(attrs))?;
    let expr = parse_scalar(a.need_str("expr")?).map_err(|e| format!("expr: {e}"))?;
    a.done()?;
    expr.check()?;
    if expr.arity() > 1 {
        return Err(format!("the expression {expr} of a derived weight may read x0 only"));
    }
    Ok(Derived { source: source.to_string(), expr })
}
