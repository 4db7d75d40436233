//! Lowering: the bound model's graph statements become IR nodes. Each call in a statement is
//! one op; `a + b` is `add`, `a * b` is `mul`. Names resolve to, in order: variables assigned
//! by earlier statements, weights (per-layer ones at the current layer), and the step inputs
//! `tokens` and `positions`. Keyword arguments are op attributes, evaluated over the params.

use crate::CompileError;
use ir::{DType, Graph, NodeIndex, Op, RopeScaling};
use spec::expr::BinOp;
use spec::{BoundModel, Expr, GraphItem, Located, Statement, Value};
use std::collections::HashMap;

/// A value during lowering: a node, or a weight that does not exist for this config.
#[derive(Clone, Copy)]
enum Term {
    Node(NodeIndex),
    Absent,
}

struct Lowerer<'a> {
    model: &'a BoundModel,
    g: Graph,
    weight_dtype: DType,
    vars: HashMap<String, NodeIndex>,
    weights: HashMap<String, NodeIndex>,
    inputs: HashMap<&'static str, NodeIndex>,
    layer: Option<usize>,
    next_kv_layer: usize,
}

/// Lowers `model` into a graph with activations in `act` and weights stored in `weight_dtype`.
pub fn lower(model: &BoundModel, act: DType, weight_dtype: DType) -> Result<Graph, CompileError> {
    let mut l = Lowerer {
        model,
        g: Graph::new(act),
        weight_dtype,
        vars: HashMap::new(),
        weights: HashMap::new(),
        inputs: HashMap::new(),
        layer: None,
        next_kv_layer: 0,
    };
    for item in &model.spec.graph {
        match item {
            GraphItem::Stmt(s) => l.statement(s)?,
            GraphItem::PerLayer(stmts) => {
                for layer in 0..model.layers {
                    l.layer = Some(layer);
                    for s in stmts {
                        l.statement(s)?;
                    }
                }
                l.layer = None;
            }
        }
    }
    let out = l.vars.get("logits").copied().ok_or_else(|| CompileError::Graph {
        at: model.spec.origin.clone(),
        statement: String::new(),
        message: "the graph never assigns `logits`".into(),
    })?;
    l.g.output = Some(out);
    Ok(l.g)
}

impl Lowerer<'_> {
    fn statement(&mut self, s: &Located<Statement>) -> Result<(), CompileError> {
        let err = |message: String| CompileError::Graph {
            at: match s.line {
                Some(line) => format!("{}:{line}", self.model.spec.origin),
                None => self.model.spec.origin.clone(),
            },
            statement: s.text.clone(),
            message,
        };
        let mut results = Vec::new();
        for (target, e) in s.value.targets.iter().zip(&s.value.values) {
            let label = match self.layer {
                Some(i) => format!("L{i}.{target}"),
                None => target.clone(),
            };
            match self.expr(e, &label).map_err(&err)? {
                Term::Node(n) => results.push((target.clone(), n)),
                Term::Absent => {
                    return Err(err(format!("`{target}` would be a weight that does not exist for this config")))
                }
            }
        }
        self.vars.extend(results);
        Ok(())
    }

    fn node(&mut self, e: &Expr, label: &str) -> Result<NodeIndex, String> {
        match self.expr(e, label)? {
            Term::Node(n) => Ok(n),
            Term::Absent => Err(format!("`{e}` is a weight that does not exist for this config (its `when` is false)")),
        }
    }

    fn expr(&mut self, e: &Expr, label: &str) -> Result<Term, String> {
        match e {
            Expr::Ident(name) => self.resolve(name),
            Expr::Binary(op @ (BinOp::Add | BinOp::Mul), a, b) => {
                let (a, b) = (self.node(a, label)?, self.node(b, label)?);
                let op = if *op == BinOp::Add { Op::Add } else { Op::Mul };
                self.add(op, &[a, b], label)
            }
            Expr::Call { name, args, kwargs } => self.call(name, args, kwargs, label),
            other => Err(format!("`{other}` is not a tensor expression (use calls, names, `+` and `*`)")),
        }
    }

    fn add(&mut self, op: Op, inputs: &[NodeIndex], label: &str) -> Result<Term, String> {
        self.g.add(op, inputs, label).map(Term::Node).map_err(|e| e.to_string())
    }

    fn resolve(&mut self, name: &str) -> Result<Term, String> {
        if let Some(&n) = self.vars.get(name) {
            return Ok(Term::Node(n));
        }
        if let Some(w) = self.model.weight(name, self.layer) {
            if let Some(&n) = self.weights.get(&w.name) {
                return Ok(Term::Node(n));
            }
            let op = Op::Weight { name: w.name.clone(), shape: w.shape.clone(), dtype: self.weight_dtype };
            let n = self.g.add(op, &[], w.name.clone()).map_err(|e| e.to_string())?;
            self.weights.insert(w.name.clone(), n);
            return Ok(Term::Node(n));
        }
        if self.model.declares_weight(name) {
            return Ok(Term::Absent);
        }
        let input = match name {
            "tokens" => Op::Tokens,
            "positions" => Op::Positions,
            _ => return Err(format!("unknown name `{name}` (not a variable, a weight, `tokens` or `positions`)")),
        };
        let key = if name == "tokens" { "tokens" } else { "positions" };
        if let Some(&n) = self.inputs.get(key) {
            return Ok(Term::Node(n));
        }
        let n = self.g.add(input, &[], name).map_err(|e| e.to_string())?;
        self.inputs.insert(key, n);
        Ok(Term::Node(n))
    }

    fn call(&mut self, name: &str, args: &[Expr], kwargs: &[(String, Expr)], label: &str) -> Result<Term, String> {
        let allowed: &[&str] = match name {
            "embedding" | "silu" | "all_reduce" | "logits" | "linear" => &[],
            "rms_norm" => &["eps"],
            "rope" => &["head_dim", "theta", "scaling", "max_positions"],
            "attention" => &["heads", "kv_heads", "head_dim", "scale"],
            _ => return Err(format!("unknown op `{name}`; the ops are: {}", Op::CALLABLE.join(", "))),
        };
        let attrs = Attrs::new(name, kwargs, self.model)?;
        attrs.check(allowed)?;
        let arity = |lo: usize, hi: usize| -> Result<(), String> {
            if args.len() < lo || args.len() > hi {
                let want = if lo == hi { lo.to_string() } else { format!("{lo} to {hi}") };
                return Err(format!("`{name}` takes {want} tensor arguments, got {}", args.len()));
            }
            Ok(())
        };
        let op = match name {
            "embedding" => Op::Embedding,
            "silu" => Op::Silu,
            "all_reduce" => Op::AllReduce,
            "logits" => Op::Logits,
            "linear" => {
                arity(2, 3)?;
                let mut ins = vec![self.node(&args[0], label)?, self.node(&args[1], label)?];
                if let Some(b) = args.get(2) {
                    if let Term::Node(n) = self.expr(b, label)? {
                        ins.push(n);
                    }
                }
                return self.add(Op::Linear { bias: ins.len() == 3 }, &ins, label);
            }
            "rms_norm" => Op::RmsNorm { eps: attrs.f64("eps")? as f32 },
            "rope" => {
                let max_positions = attrs.opt("max_positions").and_then(|v| v.as_f64());
                let head_dim = attrs.usize("head_dim")?;
                let scaling = match attrs.opt("scaling") {
                    Some(v) => {
                        RopeScaling::from_config(&v.to_json(), max_positions, head_dim).map_err(|e| e.to_string())?
                    }
                    None => RopeScaling::Default,
                };
                Op::Rope { head_dim, theta: attrs.f64("theta")?, scaling }
            }
            "attention" => {
                let head_dim = attrs.usize("head_dim")?;
                let scale = match attrs.opt("scale") {
                    Some(v) => v.as_f64().ok_or("`scale` must be a number")?,
                    None => 1.0 / (head_dim as f64).sqrt(),
                };
                let op = Op::Attention {
                    heads: attrs.usize("heads")?,
                    kv_heads: attrs.usize("kv_heads")?,
                    head_dim,
                    scale: scale as f32,
                    layer: self.next_kv_layer,
                };
                self.next_kv_layer += 1;
                op
            }
            _ => unreachable!("unknown ops are rejected above"),
        };
        arity(op.arity(), op.arity())?;
        let ins = args.iter().map(|a| self.node(a, label)).collect::<Result<Vec<_>, _>>()?;
        self.add(op, &ins, label)
    }
}

/// Keyword arguments of a call, evaluated over the model's params.
struct Attrs<'a> {
    op: &'a str,
    values: Vec<(String, Value)>,
}

impl<'a> Attrs<'a> {
    fn new(op: &'a str, kwargs: &[(String, Expr)], model: &BoundModel) -> Result<Attrs<'a>, String> {
        let lookup = |n: &str| model.param(n).cloned();
        let values = kwargs
            .iter()
            .map(|(k, e)| {
                spec::value::eval(e, &lookup)
                    .map(|v| (k.clone(), v))
                    .map_err(|m| format!("`{op}` attribute `{k}`: {m}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Attrs { op, values })
    }

    fn check(&self, allowed: &[&str]) -> Result<(), String> {
        match self.values.iter().find(|(k, _)| !allowed.contains(&k.as_str())) {
            Some((k, _)) => Err(format!(
                "`{}` has no attribute `{k}` (it takes: {})",
                self.op,
                if allowed.is_empty() { "none".into() } else { allowed.join(", ") }
            )),
            None => Ok(()),
        }
    }

    fn opt(&self, key: &str) -> Option<Value> {
        self.values.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone()).filter(|v| *v != Value::Null)
    }

    fn get(&self, key: &str) -> Result<Value, String> {
        self.opt(key).ok_or_else(|| format!("`{}` needs the attribute `{key}=...`", self.op))
    }

    fn usize(&self, key: &str) -> Result<usize, String> {
        let v = self.get(key)?;
        v.as_usize().ok_or_else(|| format!("`{}` attribute `{key}` is {v}, not a count", self.op))
    }

    fn f64(&self, key: &str) -> Result<f64, String> {
        let v = self.get(key)?;
        v.as_f64().ok_or_else(|| format!("`{}` attribute `{key}` is {v}, not a number", self.op))
    }
}
