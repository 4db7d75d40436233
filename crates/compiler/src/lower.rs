//! Lowering: the bound model's graph statements become IR nodes. Each call in a statement is
//! one op; `a + b` is `add`, `a * b` is `mul`. Names resolve to, in order: variables assigned
//! by earlier statements, weights (per-layer ones at the current layer), and the step inputs
//! `tokens` and `positions`. Keyword arguments are op attributes, evaluated over the params.

use crate::CompileError;
use ir::{DType, Graph, NodeIndex, Op, RopeScaling};
use ir::{Fun, Scalar};
use spec::expr::{BinOp, UnOp};
use spec::{BoundModel, Expr, GraphItem, Guarded, Located, Statement, Value};
use std::collections::{BTreeMap, HashMap};

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
    kept: &'a BTreeMap<String, DType>,
    vars: HashMap<String, NodeIndex>,
    weights: HashMap<String, NodeIndex>,
    inputs: HashMap<&'static str, NodeIndex>,
    layer: Option<usize>,
    next_kv_layer: usize,
}

/// Lowers `model` into a graph with activations in `act` and weights stored in `weight_dtype`,
/// except those `kept` in their checkpoint's block type (by weight name).
pub fn lower(
    model: &BoundModel,
    act: DType,
    weight_dtype: DType,
    kept: &BTreeMap<String, DType>,
) -> Result<Graph, CompileError> {
    let mut l = Lowerer {
        model,
        g: Graph::new(act),
        weight_dtype,
        kept,
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
                        if l.runs(s)? {
                            l.statement(&s.stmt)?;
                        }
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
    /// Whether a per-layer statement's condition holds at the current layer.
    fn runs(&self, s: &Guarded) -> Result<bool, CompileError> {
        let Some(cond) = &s.when else { return Ok(true) };
        let err = |message: String| graph_err(self.model, &s.stmt, message);
        let e = spec::parse_expr(cond).map_err(|e| err(format!("`if: {cond}`: {e}")))?;
        let lookup = |n: &str| layer_value(self.model, self.layer, n);
        let v = spec::value::eval(&e, &lookup).map_err(|m| err(format!("`if: {cond}`: {m}")))?;
        v.as_bool().ok_or_else(|| err(format!("`if: {cond}` is {v}, not a bool")))
    }

    fn statement(&mut self, s: &Located<Statement>) -> Result<(), CompileError> {
        let model = self.model;
        let err = |message: String| graph_err(model, s, message);
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
            Expr::Ident(name) if self.is_tensor(name) || self.model.param(name).is_none() => self.resolve(name),
            Expr::Call { name, args, kwargs } if Op::CALLABLE.contains(&name.as_str()) => {
                self.call(name, args, kwargs, label)
            }
            _ => self.elementwise(e, label).map(Term::Node),
        }
    }

    /// Whether `name` names a tensor (a variable, a declared weight or a step input) rather
    /// than a param.
    fn is_tensor(&self, name: &str) -> bool {
        self.vars.contains_key(name) || self.model.declares_weight(name) || matches!(name, "tokens" | "positions")
    }

    /// Whether `e` computes a tensor (reads one, or calls an op).
    fn has_tensor(&self, e: &Expr) -> bool {
        match e {
            Expr::Ident(name) => self.is_tensor(name),
            Expr::Unary(_, a) => self.has_tensor(a),
            Expr::Binary(_, a, b) => self.has_tensor(a) || self.has_tensor(b),
            Expr::Call { name, args, .. } => {
                Op::CALLABLE.contains(&name.as_str()) || args.iter().any(|a| self.has_tensor(a))
            }
            _ => false,
        }
    }

    /// One elementwise operation (an operator or a function of `ir::scalar`) over tensors and
    /// constants: an `add`, `mul` or `silu` node where it is one of those over same-shaped
    /// activations, else a `map` (chains of maps are fused by the `fuse_elementwise` pass).
    fn elementwise(&mut self, e: &Expr, label: &str) -> Result<NodeIndex, String> {
        if !self.has_tensor(e) {
            return Err(format!("`{e}` is a constant, not a tensor expression"));
        }
        let (fun, operands): (Fun, Vec<&Expr>) = match e {
            Expr::Binary(op, a, b) => (binary_fun(*op).ok_or_else(|| not_tensor(e))?, vec![a, b]),
            Expr::Unary(UnOp::Neg, a) => (fun("neg")?, vec![a]),
            Expr::Call { name, args, kwargs } => (function(name, args, kwargs)?, args.iter().collect()),
            _ => return Err(not_tensor(e)),
        };
        let mut nodes: Vec<NodeIndex> = Vec::new();
        let mut args = Vec::new();
        for o in operands {
            if !self.has_tensor(o) {
                args.push(Scalar::Const(self.constant(o)?));
                continue;
            }
            let n = self.node(o, label)?;
            args.push(Scalar::Arg(crate::fuse::input_slot(&mut nodes, n)));
        }
        let expr = Scalar::call(fun, args);
        let acts = nodes.iter().all(|&n| self.g.node(n).ty.shape.first() == Some(&ir::Dim::T));
        let same = nodes.windows(2).all(|w| self.g.node(w[0]).ty == self.g.node(w[1]).ty);
        let op = match (fun.def().name, &expr, nodes.len()) {
            ("+", Scalar::Call(_, a), 2) if acts && same && a == &[Scalar::Arg(0), Scalar::Arg(1)] => Op::Add,
            ("*", Scalar::Call(_, a), 2) if acts && same && a == &[Scalar::Arg(0), Scalar::Arg(1)] => Op::Mul,
            ("silu", Scalar::Call(..), 1) if acts => Op::Silu,
            _ => Op::Map { expr },
        };
        self.g.add(op, &nodes, label).map_err(|e| e.to_string())
    }

    /// The value of an expression without tensors: params, numbers, operators and
    /// elementwise functions, in f32.
    fn constant(&self, e: &Expr) -> Result<f32, String> {
        let lookup = |n: &str| self.model.param(n).cloned();
        let v = match e {
            Expr::Call { name, args, kwargs } => {
                let f = function(name, args, kwargs)?;
                let vals =
                    args.iter().map(|a| Ok(Scalar::Const(self.constant(a)?))).collect::<Result<Vec<_>, String>>()?;
                Scalar::call(f, vals).eval(&[])
            }
            Expr::Unary(UnOp::Neg, a) => -self.constant(a)?,
            Expr::Binary(op, a, b) if has_call(e) => {
                let f = binary_fun(*op).ok_or_else(|| format!("`{e}`: only + - * / combine function calls"))?;
                Scalar::call(f, vec![Scalar::Const(self.constant(a)?), Scalar::Const(self.constant(b)?)]).eval(&[])
            }
            _ => {
                let v = spec::value::eval(e, &lookup)?;
                v.as_f64().ok_or_else(|| format!("`{e}` is {v}, not a number"))? as f32
            }
        };
        if !v.is_finite() {
            return Err(format!("`{e}` is {v}"));
        }
        Ok(v)
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
            let dtype = self.kept.get(&w.name).copied().unwrap_or(self.weight_dtype);
            let op = Op::Weight { name: w.name.clone(), shape: w.shape.clone(), dtype, derived: None };
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
            "embedding" | "all_reduce" | "logits" | "linear" => &[],
            "rms_norm" => &["eps"],
            "rope" => &["head_dim", "rotary_dim", "theta", "scaling", "max_positions", "original_max_positions"],
            "attention" => &["heads", "kv_heads", "head_dim", "scale", "window", "softcap"],
            "moe" => &["top_k", "norm_topk", "act"],
            _ => return Err(unknown_call(name)),
        };
        // `act` is an expression of the gate and up values, not a value of the params.
        let act = kwargs.iter().find(|(k, _)| name == "moe" && k == "act").map(|(_, e)| e);
        let kwargs: Vec<(String, Expr)> = kwargs.iter().filter(|(k, _)| name != "moe" || k != "act").cloned().collect();
        let attrs = Attrs::new(name, &kwargs, self.model, self.layer)?;
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
                let rotary_dim = attrs.opt_usize("rotary_dim")?.filter(|&r| r != head_dim);
                let scaling = match attrs.opt("scaling") {
                    Some(v) => {
                        // A config may give the original context beside the scaling (Phi-3's
                        // 4.x configs) rather than in it.
                        let mut cfg = v.to_json();
                        if let (Some(o), Some(map)) = (attrs.opt("original_max_positions"), cfg.as_object_mut()) {
                            map.entry("original_max_position_embeddings").or_insert(o.to_json());
                        }
                        let dim = rotary_dim.unwrap_or(head_dim);
                        RopeScaling::from_config(&cfg, max_positions, dim).map_err(|e| e.to_string())?
                    }
                    None => RopeScaling::Default,
                };
                Op::Rope { head_dim, theta: attrs.f64("theta")?, scaling, rotary_dim }
            }
            "attention" => {
                let head_dim = attrs.usize("head_dim")?;
                let scale = match attrs.opt("scale") {
                    Some(v) => v.as_f64().ok_or("`scale` must be a number")?,
                    None => 1.0 / (head_dim as f64).sqrt(),
                };
                arity(3, 4)?;
                let mut ins = args[..3].iter().map(|a| self.node(a, label)).collect::<Result<Vec<_>, _>>()?;
                if let Some(Term::Node(n)) = args.get(3).map(|a| self.expr(a, label)).transpose()? {
                    ins.push(n);
                }
                let op = Op::Attention {
                    heads: attrs.usize("heads")?,
                    kv_heads: attrs.usize("kv_heads")?,
                    head_dim,
                    scale: scale as f32,
                    layer: self.next_kv_layer,
                    window: attrs.opt_usize("window")?,
                    softcap: attrs.opt_f64("softcap")?.map(|c| c as f32),
                    sinks: ins.len() == 4,
                };
                self.next_kv_layer += 1;
                return self.add(op, &ins, label);
            }
            "moe" => {
                arity(5, 8)?;
                let mut ins = args[..5].iter().map(|a| self.node(a, label)).collect::<Result<Vec<_>, _>>()?;
                for b in &args[5..] {
                    if let Term::Node(n) = self.expr(b, label)? {
                        ins.push(n);
                    }
                }
                if ins.len() != 5 && ins.len() != 8 {
                    return Err("`moe` takes the gate, up and down biases all three or none".into());
                }
                let act = act.ok_or("`moe` needs the attribute `act=EXPR` (of `gate` and `up`)")?;
                let op = Op::Moe {
                    top_k: attrs.usize("top_k")?,
                    norm_topk: attrs.get("norm_topk")?.as_bool().ok_or("`moe` attribute `norm_topk` must be a bool")?,
                    act: self.act(act).map_err(|m| format!("`moe` attribute `act`: {m}"))?,
                    bias: ins.len() == 8,
                };
                return self.add(op, &ins, label);
            }
            _ => unreachable!("unknown ops are rejected above"),
        };
        arity(op.arity(), op.arity())?;
        let ins = args.iter().map(|a| self.node(a, label)).collect::<Result<Vec<_>, _>>()?;
        self.add(op, &ins, label)
    }
}

impl Lowerer<'_> {
    /// An expression of a MoE's `gate` (`x0`) and `up` (`x1`) values; the parts without them
    /// fold to constants.
    fn act(&self, e: &Expr) -> Result<Scalar, String> {
        let reads = |e: &Expr| expr_names(e).iter().any(|n| n == "gate" || n == "up");
        if !reads(e) {
            return Ok(Scalar::Const(self.constant(e)?));
        }
        let (fun, operands): (Fun, Vec<&Expr>) = match e {
            Expr::Ident(n) if n == "gate" => return Ok(Scalar::Arg(0)),
            Expr::Ident(n) if n == "up" => return Ok(Scalar::Arg(1)),
            Expr::Binary(op, a, b) => (binary_fun(*op).ok_or_else(|| not_tensor(e))?, vec![a, b]),
            Expr::Unary(UnOp::Neg, a) => (fun("neg")?, vec![a]),
            Expr::Call { name, args, kwargs } => (function(name, args, kwargs)?, args.iter().collect()),
            _ => return Err(not_tensor(e)),
        };
        Ok(Scalar::call(fun, operands.into_iter().map(|o| self.act(o)).collect::<Result<_, _>>()?))
    }
}

/// The names an expression reads.
fn expr_names(e: &Expr) -> Vec<String> {
    match e {
        Expr::Ident(n) => vec![n.clone()],
        Expr::Unary(_, a) => expr_names(a),
        Expr::Binary(_, a, b) => [expr_names(a), expr_names(b)].concat(),
        Expr::Call { args, .. } => args.iter().flat_map(expr_names).collect(),
        _ => vec![],
    }
}

/// An error of statement `s` of `model`'s YAML, located at its line.
fn graph_err(model: &BoundModel, s: &Located<Statement>, message: String) -> CompileError {
    let at = match s.line {
        Some(line) => format!("{}:{line}", model.spec.origin),
        None => model.spec.origin.clone(),
    };
    CompileError::Graph { at, statement: s.text.clone(), message }
}

/// The value of a name in an expression over the params; in a per-layer statement `i` is the
/// layer's index.
fn layer_value(model: &BoundModel, layer: Option<usize>, name: &str) -> Option<Value> {
    match (name, layer) {
        ("i", Some(i)) => Some(Value::Int(i as i64)),
        _ => model.param(name).cloned(),
    }
}

/// Keyword arguments of a call, evaluated over the model's params.
struct Attrs<'a> {
    op: &'a str,
    values: Vec<(String, Value)>,
}

impl<'a> Attrs<'a> {
    /// Evaluates the keyword arguments; in a per-layer statement `i` is the layer's index.
    fn new(
        op: &'a str,
        kwargs: &[(String, Expr)],
        model: &BoundModel,
        layer: Option<usize>,
    ) -> Result<Attrs<'a>, String> {
        let lookup = |n: &str| layer_value(model, layer, n);
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

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, String> {
        self.opt(key)
            .map(|v| v.as_usize().ok_or_else(|| format!("`{}` attribute `{key}` is {v}, not a count", self.op)))
            .transpose()
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>, String> {
        self.opt(key)
            .map(|v| v.as_f64().ok_or_else(|| format!("`{}` attribute `{key}` is {v}, not a number", self.op)))
            .transpose()
    }

    fn f64(&self, key: &str) -> Result<f64, String> {
        let v = self.get(key)?;
        v.as_f64().ok_or_else(|| format!("`{}` attribute `{key}` is {v}, not a number", self.op))
    }
}

/// The function of an arithmetic operator.
fn binary_fun(op: BinOp) -> Option<Fun> {
    let name = match op {
        BinOp::Add => "+",
        BinOp::Sub => "-",
        BinOp::Mul => "*",
        BinOp::Div => "/",
        _ => return None,
    };
    Fun::named(name)
}

/// The elementwise function a call names, its arguments counted and no keyword arguments.
fn function(name: &str, args: &[Expr], kwargs: &[(String, Expr)]) -> Result<Fun, String> {
    let f = fun(name)?;
    if let Some((k, _)) = kwargs.first() {
        return Err(format!("`{name}` takes no keyword arguments (got `{k}`)"));
    }
    if args.len() != f.def().arity {
        return Err(format!("`{name}` takes {} argument(s), got {}", f.def().arity, args.len()));
    }
    Ok(f)
}

fn fun(name: &str) -> Result<Fun, String> {
    Fun::named(name).ok_or_else(|| unknown_call(name))
}

fn has_call(e: &Expr) -> bool {
    match e {
        Expr::Call { .. } => true,
        Expr::Unary(_, a) => has_call(a),
        Expr::Binary(_, a, b) => has_call(a) || has_call(b),
        _ => false,
    }
}

fn not_tensor(e: &Expr) -> String {
    format!("`{e}` is not a tensor expression (use op calls, names, elementwise functions and + - * /)")
}

fn unknown_call(name: &str) -> String {
    format!(
        "unknown op or function `{name}`; the ops are: {}; the elementwise functions: {}",
        Op::CALLABLE.join(", "),
        Fun::callable().join(", ")
    )
}
