//! Plans as text, read back: [`parse`] rebuilds the [`Graph`] that [`crate::Plan::to_text`]
//! printed, so a compiler pass test can be a pair of small text files (the graph before and
//! after). For every text the compiler prints, `parse(t)?.to_plan()?.to_text() == t`.
//!
//! The format, line by line (blank lines are skipped):
//! - `plan tp=N act=DTYPE vocab=N kv(layers=N, kv_heads=N, head_dim=N)`, first;
//! - `@NAME : [d, ...] DTYPE` declares a weight, `@NAME : [d] f32 = map{expr=EXPR}(@SOURCE)` a
//!   derived one ([`crate::Derived`]); NAME runs up to ` : ` and may hold spaces and
//!   parentheses; a weight is declared before its first use;
//! - `%N = OP{ATTRS}(ARGS) : TYPE  # LABEL`, with `  (output)` after the label on the logits
//!   node: ATTRS is [`Op::attrs`] (`key=value, ...`, omitted with the braces when empty),
//!   ARGS are `%N` of earlier lines and `@NAME` of declared weights, TYPE is the type the
//!   printer wrote, which must equal the one [`Graph::add`] infers; a linear has a bias when
//!   it has three arguments. The numbers only name values: they must be unique, not
//!   consecutive;
//! - `fuse KIND {`, node lines, `}`: a fusion ([`FusionKind::parse`]) of the lines between,
//!   checked against its kind's rule ([`fusion::check`]) once the whole graph is read.
//!
//! Node `i` of the graph is the `i`-th weight or node line, so the graph's topological order
//! is the text's. The header's vocabulary and KV layout must agree with the output node and
//! the attention nodes. What only the whole graph can say (attention layers numbered 0..L,
//! one logits op) is left to [`Graph::verify`]. Errors are [`IrError::Input`] naming the line.
//! Weights get their name as label (the text does not carry weights' labels).

use crate::fusion::{self, Fusion, FusionKind};
use crate::op::Op;
use crate::plan::KvLayout;
use crate::types::{DType, Dim, TensorType};
use crate::{Graph, IrError, NodeIndex};
use std::collections::HashMap;
use std::fmt::Display;
use std::str::FromStr;

mod attrs;
mod expr;

use attrs::{derived, op};
pub use expr::parse_scalar;

/// Parses a printed plan back into a graph (see the module's documentation for the format).
pub fn parse(text: &str) -> Result<Graph, IrError> {
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l)).filter(|(_, l)| !l.trim().is_empty());
    let (header_line, header_text) = lines.next().ok_or_else(|| at(1, "the text is empty (no `plan ...` header)"))?;
    let header = header(header_text).map_err(|e| at(header_line, e))?;
    let mut r = Reader {
        g: Graph::new(header.act),
        line: header_line,
        weights: HashMap::new(),
        values: HashMap::new(),
        open: None,
        fusions: Vec::new(),
        output: None,
    };
    r.g.tp = header.tp;
    for (n, line) in lines {
        r.line = n;
        r.read(line).map_err(|e| at(n, e))?;
    }
    if let Some((kind, n, _)) = r.open {
        return Err(at(n, format!("the `fuse {}` block opened here is not closed with `}}`", kind.name())));
    }
    let Some((out, out_line)) = r.output else {
        return Err(at(header_line, "no node is marked `(output)`"));
    };
    r.g.output = Some(out);
    for (kind, n, members) in r.fusions {
        if let Some(&m) = members.iter().find(|&&m| r.g.inputs(m).is_empty()) {
            let what = r.g.node(m).op.name();
            return Err(at(n, format!("bad fusion: {}: a {what} node takes no inputs", kind.name())));
        }
        let f = Fusion { kind, nodes: kind_order(&r.g, kind, members) };
        fusion::check(&r.g, &f).map_err(|e| at(n, format!("bad fusion: {e}")))?;
        r.g.fusions.push(f);
    }
    let vocab = r.g.node(out).ty.last().unwrap_or(0);
    if vocab != header.vocab {
        return Err(at(
            header_line,
            format!("the header says vocab={} but the output (line {out_line}) has {vocab} columns", header.vocab),
        ));
    }
    let kv = kv_layout(&r.g);
    if kv != header.kv {
        return Err(at(
            header_line,
            format!("the header says {} but the attention nodes give {}", kv_text(header.kv), kv_text(kv)),
        ));
    }
    Ok(r.g)
}

fn at(line: usize, what: impl Display) -> IrError {
    IrError::Input(format!("line {line}: {what}"))
}

struct Header {
    tp: usize,
    act: DType,
    vocab: usize,
    kv: KvLayout,
}

fn header(s: &str) -> Result<Header, String> {
    const FORM: &str = "expected the header `plan tp=N act=DTYPE vocab=N kv(layers=N, kv_heads=N, head_dim=N)`";
    let parts = (|| {
        let s = s.trim().strip_prefix("plan tp=")?;
        let (tp, s) = s.split_once(" act=")?;
        let (act, s) = s.split_once(" vocab=")?;
        let (vocab, s) = s.split_once(" kv(layers=")?;
        let (layers, s) = s.split_once(", kv_heads=")?;
        let (kv_heads, s) = s.split_once(", head_dim=")?;
        let head_dim = s.strip_suffix(')')?;
        Some([tp, act, vocab, layers, kv_heads, head_dim])
    })()
    .ok_or(FORM)?;
    let [tp, act, vocab, layers, kv_heads, head_dim] = parts;
    let n = |key: &str, v: &str| number::<usize>(key, v);
    Ok(Header {
        tp: n("tp", tp)?,
        act: dtype(act)?,
        vocab: n("vocab", vocab)?,
        kv: KvLayout {
            layers: n("layers", layers)?,
            kv_heads: n("kv_heads", kv_heads)?,
            head_dim: n("head_dim", head_dim)?,
        },
    })
}

fn kv_text(kv: KvLayout) -> String {
    format!("kv(layers={}, kv_heads={}, head_dim={})", kv.layers, kv.kv_heads, kv.head_dim)
}

/// The KV layout [`Graph::to_plan`] derives: one layer per attention, the last one's heads.
fn kv_layout(g: &Graph) -> KvLayout {
    let mut kv = KvLayout::default();
    for n in g.nodes() {
        if let Op::Attention { kv_heads, head_dim, .. } = g.node(n).op {
            kv = KvLayout { layers: kv.layers + 1, kv_heads, head_dim };
        }
    }
    kv
}

/// The state of a parse after the header.
struct Reader {
    g: Graph,
    /// The line being read.
    line: usize,
    /// Weight name → node and the line that declared it.
    weights: HashMap<String, (NodeIndex, usize)>,
    /// `%N` → node and its line.
    values: HashMap<usize, (NodeIndex, usize)>,
    /// The fusion block being read: kind, line of `fuse`, members so far.
    open: Option<(FusionKind, usize, Vec<NodeIndex>)>,
    /// Closed fusion blocks, as `open`.
    fusions: Vec<(FusionKind, usize, Vec<NodeIndex>)>,
    /// The node marked `(output)` and its line.
    output: Option<(NodeIndex, usize)>,
}

impl Reader {
    fn read(&mut self, line: &str) -> Result<(), String> {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix("fuse ") {
            return self.open_fusion(rest);
        }
        if t.trim_end() == "}" {
            let (kind, n, members) = self.open.take().ok_or("`}` closes no `fuse KIND {` block")?;
            if members.is_empty() {
                return Err(format!("the `fuse {}` block opened on line {n} has no nodes", kind.name()));
            }
            self.fusions.push((kind, n, members));
            return Ok(());
        }
        if let Some(rest) = t.strip_prefix('@') {
            if let Some((kind, n, _)) = &self.open {
                return Err(format!("a weight declaration inside the `fuse {}` block opened on line {n}", kind.name()));
            }
            return self.weight(rest);
        }
        if let Some(rest) = t.strip_prefix('%') {
            let n = self.node(rest)?;
            if let Some((_, _, members)) = &mut self.open {
                members.push(n);
            }
            return Ok(());
        }
        Err(format!(
            "expected a node `%N = OP(ARGS) : TYPE  # LABEL`, a weight `@NAME : TYPE`, `fuse KIND {{` or `}}`, got `{}`",
            line.trim()
        ))
    }

    fn open_fusion(&mut self, rest: &str) -> Result<(), String> {
        let name = rest.trim_end().strip_suffix('{').ok_or("expected `fuse KIND {`")?.trim();
        if let Some((kind, n, _)) = &self.open {
            return Err(format!("`fuse {name} {{` inside the `fuse {}` block opened on line {n}", kind.name()));
        }
        let kind = FusionKind::parse(name).ok_or_else(|| format!("unknown fusion kind `{name}`"))?;
        self.open = Some((kind, self.line, Vec::new()));
        Ok(())
    }

    /// `NAME : TYPE` or `NAME : TYPE = map{expr=EXPR}(@SOURCE)` (after the `@`).
    fn weight(&mut self, s: &str) -> Result<(), String> {
        let (name, rest) = s.split_once(" : ").ok_or("expected `@NAME : TYPE`")?;
        if let Some((_, first)) = self.weights.get(name) {
            return Err(format!("weight `@{name}` is declared twice (first on line {first})"));
        }
        let (ty, rest) = tensor_type(rest)?;
        let shape = ty
            .shape
            .iter()
            .map(|d| match d {
                Dim::N(n) => Ok(*n),
                _ => Err(format!("weight `@{name}` has the shape {ty}; a weight's dimensions are numbers")),
            })
            .collect::<Result<Vec<usize>, String>>()?;
        let derived = match rest.trim_end() {
            "" => None,
            d => Some(derived(d).map_err(|e| format!("weight `@{name}`: {e}"))?),
        };
        let op = Op::Weight { name: name.to_string(), shape, dtype: ty.dtype, derived };
        let n = self.g.add(op, &[], name).map_err(|e| e.to_string())?;
        self.weights.insert(name.to_string(), (n, self.line));
        Ok(())
    }

    /// `N = OP{ATTRS}(ARGS) : TYPE  # LABEL[  (output)]` (after the `%`); returns the node.
    fn node(&mut self, s: &str) -> Result<NodeIndex, String> {
        let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let number: usize = s[..digits].parse().map_err(|_| "expected `%N = ...` with N a number")?;
        if let Some((_, first)) = self.values.get(&number) {
            return Err(format!("`%{number}` is defined twice (first on line {first})"));
        }
        let s = s[digits..].strip_prefix(" = ").ok_or_else(|| format!("expected ` = ` after `%{number}`"))?;
        let name_len = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
        let (name, s) = s.split_at(name_len);
        let (attrs, s) = match s.strip_prefix('{') {
            Some(_) => {
                let (inner, rest) = balanced(s)?;
                (Some(inner), rest)
            }
            None => (None, s),
        };
        let s = s.strip_prefix('(').ok_or_else(|| format!("expected `(` after the op `{name}`"))?;
        let mut args = Vec::new();
        let s = self.args(s, &mut args)?;
        let (ty, s) = tensor_type(s)?;
        let label = s.trim_start().strip_prefix('#').ok_or("expected `  # LABEL` after the type")?;
        let label = label.strip_prefix(' ').unwrap_or(label);
        let (label, output) = match label.strip_suffix("  (output)") {
            Some(l) => (l, true),
            None => (label, false),
        };
        let op = op(name, attrs, args.len())?;
        let n = self.g.add(op, &args, label).map_err(|e| e.to_string())?;
        let inferred = &self.g.node(n).ty;
        if *inferred != ty {
            return Err(format!("`%{number}` is written as {ty} but its inputs give {name} the type {inferred}"));
        }
        if output {
            if let Some((_, first)) = self.output {
                return Err(format!("a second node marked `(output)` (the first is on line {first})"));
            }
            self.output = Some((n, self.line));
        }
        self.values.insert(number, (n, self.line));
        Ok(n)
    }

    /// The arguments from `s` (just after the `(`) to the `)` before ` : `, into `out`; returns
    /// the text after ` : `. A weight's name may hold `, ` and `)`: every declared name that
    /// fits is tried, shortest first, until the rest of the list parses.
    fn args<'a>(&self, s: &'a str, out: &mut Vec<NodeIndex>) -> Result<&'a str, String> {
        match s.strip_prefix(')') {
            Some(rest) => after_args(rest),
            None => self.arg(s, out),
        }
    }

    fn arg<'a>(&self, s: &'a str, out: &mut Vec<NodeIndex>) -> Result<&'a str, String> {
        if let Some(rest) = s.strip_prefix('%') {
            let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
            let v: usize = rest[..digits].parse().map_err(|_| "expected a number after `%`")?;
            let &(n, _) = self.values.get(&v).ok_or_else(|| format!("`%{v}` is not defined on an earlier line"))?;
            out.push(n);
            return self.next_arg(&rest[digits..], out);
        }
        let Some(body) = s.strip_prefix('@') else {
            return Err(format!("expected an argument `%N` or `@NAME`, got `{}`", s.trim_end()));
        };
        let mut ends: Vec<usize> = body.match_indices(", ").chain(body.match_indices(')')).map(|(i, _)| i).collect();
        ends.sort_unstable();
        let mut first_err = None;
        let len = out.len();
        for e in ends {
            let Some(&(w, _)) = self.weights.get(&body[..e]) else { continue };
            out.push(w);
            match self.next_arg(&body[e..], out) {
                Ok(rest) => return Ok(rest),
                Err(m) => {
                    out.truncate(len);
                    first_err.get_or_insert(m);
                }
            }
        }
        Err(first_err.unwrap_or_else(|| {
            let end = body.find([',', ')']).unwrap_or(body.len());
            format!("`@{}` is not a declared weight", &body[..end])
        }))
    }

    /// After an argument: `, ` and the next, or `)`.
    fn next_arg<'a>(&self, s: &'a str, out: &mut Vec<NodeIndex>) -> Result<&'a str, String> {
        if let Some(rest) = s.strip_prefix(", ") {
            return self.arg(rest, out);
        }
        match s.strip_prefix(')') {
            Some(rest) => after_args(rest),
            None => Err(format!("expected `, ` or `)` after an argument, got `{}`", s.trim_end())),
        }
    }
}

/// The text after the arguments' `)`: ` : TYPE ...`; returns what follows ` : `.
fn after_args(s: &str) -> Result<&str, String> {
    s.strip_prefix(" : ").ok_or_else(|| format!("expected ` : TYPE` after the arguments, got `{}`", s.trim_end()))
}

/// `[d, ...] DTYPE` at the start of `s`; returns the type and the rest.
fn tensor_type(s: &str) -> Result<(TensorType, &str), String> {
    let body =
        s.strip_prefix('[').ok_or_else(|| format!("expected a type `[d, ...] DTYPE`, got `{}`", s.trim_end()))?;
    let (dims, rest) = body.split_once(']').ok_or("expected `]` closing the shape")?;
    let shape = if dims.trim().is_empty() {
        Vec::new()
    } else {
        dims.split(',')
            .map(|d| match d.trim() {
                "T" => Ok(Dim::T),
                "R" => Ok(Dim::R),
                n => n.parse().map(Dim::N).map_err(|_| format!("`{n}` is not a dimension (a number, `T` or `R`)")),
            })
            .collect::<Result<Vec<Dim>, String>>()?
    };
    let rest = rest.strip_prefix(' ').ok_or("expected ` DTYPE` after the shape")?;
    let len = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
    Ok((TensorType::new(shape, dtype(&rest[..len])?), &rest[len..]))
}

fn dtype(s: &str) -> Result<DType, String> {
    DType::ALL.into_iter().find(|d| d.to_string() == s).ok_or_else(|| {
        let names: Vec<String> = DType::ALL.iter().map(DType::to_string).collect();
        format!("unknown dtype `{s}` ({})", names.join(", "))
    })
}

fn number<T: FromStr>(key: &str, v: &str) -> Result<T, String> {
    v.trim().parse().map_err(|_| format!("`{key}={v}`: `{v}` is not a {}", std::any::type_name::<T>()))
}

/// `s` starts with an opening bracket; returns what is inside its match and what follows it.
/// Brackets of every kind nest; JSON strings are skipped.
fn balanced(s: &str) -> Result<(&str, &str), String> {
    let mut depth = 0usize;
    for (i, c) in outside_strings(s) {
        match c {
            '{' | '(' | '[' => depth += 1,
            '}' | ')' | ']' => {
                depth = depth.checked_sub(1).ok_or("unbalanced brackets")?;
                if depth == 0 {
                    return Ok((&s[1..i], &s[i + 1..]));
                }
            }
            _ => {}
        }
    }
    Err(format!("`{}` is not closed", s.chars().next().unwrap_or('{')))
}

/// The characters of `s` (with their byte offsets) outside JSON strings, the quotes left out:
/// what [`balanced`] and the attribute splitter walk.
fn outside_strings(s: &str) -> impl Iterator<Item = (usize, char)> + '_ {
    let (mut in_string, mut escaped) = (false, false);
    s.char_indices().filter(move |&(_, c)| {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            return false;
        }
        in_string = c == '"';
        !in_string
    })
}

/// A fusion's members in the order its kind lists them ([`FusionKind`]), from the text's
/// (topological) order: a GLU's gate before its up (the text has the gate's activation
/// between them), a rope-attention's ropes in the order of the attention's inputs. Members that do not have the kind's shape stay as written, for
/// [`fusion::check`] to reject.
fn kind_order(g: &Graph, kind: FusionKind, members: Vec<NodeIndex>) -> Vec<NodeIndex> {
    let find = |pred: fn(&Op) -> bool| members.iter().copied().filter(|&n| pred(&g.node(n).op)).collect::<Vec<_>>();
    match kind {
        FusionKind::Glu => {
            let (mul, lin) = (find(|o| matches!(o, Op::Mul)), find(|o| matches!(o, Op::Linear { .. })));
            let act: Vec<NodeIndex> =
                members.iter().copied().filter(|n| !mul.contains(n) && !lin.contains(n)).collect();
            if let ([m], [a, b], [s]) = (&mul[..], &lin[..], &act[..]) {
                let gate = g.inputs(*s).first().copied();
                if gate == Some(*a) {
                    return vec![*a, *b, *s, *m];
                }
                if gate == Some(*b) {
                    return vec![*b, *a, *s, *m];
                }
            }
            members
        }
        FusionKind::RopeAttention => {
            let att = find(|o| matches!(o, Op::Attention { .. }));
            if let [a] = att[..] {
                let mut order: Vec<NodeIndex> =
                    g.inputs(a).into_iter().take(2).filter(|i| members.contains(i)).collect();
                order.dedup();
                order.push(a);
                if order.len() == members.len() {
                    return order;
                }
            }
            members
        }
        FusionKind::AddNorm | FusionKind::NormAddNorm | FusionKind::Linears | FusionKind::MoeRouter => members,
    }
}

#[cfg(test)]
mod tests {
    use super::attrs::rope_scaling;
    use super::*;
    use crate::op::Derived;
    use crate::rope::RopeScaling;
    use crate::scalar::{Fun, Scalar};
    use crate::Plan;

    /// A small plan with a derived weight (a name with spaces and parentheses), each kind of
    /// node line, two fusions and a soft-capped output. Line numbers matter to the error tests.
    const SMALL: &str = r#"plan tp=1 act=f32 vocab=16 kv(layers=1, kv_heads=1, head_dim=16)
@table : [16, 32] f32
@norm @ (1 + x0) : [32] f32 = map{expr=(1 + x0)}(@norm)
@q : [32, 32] f32
@k : [16, 32] f32
@v : [16, 32] f32
%0 = tokens() : [T] i32  # tokens
%1 = embedding(%0, @table) : [T, 32] f32  # x
%2 = rms_norm{eps=1e-6}(%1, @norm @ (1 + x0)) : [T, 32] f32  # h
fuse linears {
  %3 = linear(%2, @q) : [T, 32] f32  # q
  %4 = linear(%2, @k) : [T, 16] f32  # k
  %5 = linear(%2, @v) : [T, 16] f32  # v
}
%6 = positions() : [T] i32  # positions
fuse rope_attention {
  %7 = rope{head_dim=16, theta=10000, scaling={"type":"default"}}(%3, %6) : [T, 32] f32  # q
  %8 = attention{heads=2, kv_heads=1, head_dim=16, scale=0.25, layer=0}(%7, %4, %5) : [T, 32] f32  # a
}
%9 = add(%1, %8) : [T, 32] f32  # x
%10 = silu(%9) : [T, 32] f32  # s
%11 = logits(%10, @table) : [R, 16] f32  # logits
%12 = map{expr=(tanh((x0 / 30)) * 30)}(%11) : [R, 16] f32  # logits  (output)
"#;

    fn round_trip(text: &str) -> String {
        let g = parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        g.to_plan().unwrap_or_else(|e| panic!("{e}\n{text}")).to_text()
    }

    #[test]
    fn a_small_plan_reads_back_as_printed() {
        assert_eq!(round_trip(SMALL), SMALL);
        let g = parse(SMALL).unwrap();
        let w = g.nodes().into_iter().find(|&n| matches!(g.node(n).op, Op::Weight { derived: Some(_), .. })).unwrap();
        let Op::Weight { name, derived: Some(d), dtype, .. } = &g.node(w).op else { unreachable!() };
        assert_eq!(
            (name.as_str(), d.source.as_str(), d.expr.to_string(), *dtype),
            ("norm @ (1 + x0)", "norm", "(1 + x0)".into(), DType::F32)
        );
        assert_eq!(g.fusions.len(), 2);
        assert_eq!(g.node(g.output.unwrap()).label, "logits");
    }

    /// A weight name holding `, %1, ` and another weight's name: the shorter name is tried
    /// first, and when the rest of the arguments then fails to parse, the longer one.
    /// The k-quant weight types read back, and a dtype the parser does not know is named.
    #[test]
    fn k_quant_weights_read_back() {
        let text = r#"plan tp=1 act=f32 vocab=16 kv(layers=0, kv_heads=0, head_dim=0)
@table : [16, 256] q5_k
@up : [512, 256] q4_k
@down : [256, 512] q6_k
%0 = tokens() : [T] i32  # tokens
%1 = embedding(%0, @table) : [T, 256] f32  # x
%2 = linear(%1, @up) : [T, 512] f32  # u
%3 = linear(%2, @down) : [T, 256] f32  # d
%4 = logits(%3, @table) : [R, 16] f32  # logits  (output)
"#;
        assert_eq!(round_trip(text), text);
        let e = parse(&text.replace("q6_k", "q3_k")).unwrap_err().to_string();
        assert!(e.contains("unknown dtype `q3_k`") && e.contains("q4_k, q5_k, q6_k"), "{e}");
    }

    #[test]
    fn weight_names_may_look_like_arguments() {
        let text = SMALL
            .replace("@v : [16, 32] f32\n", "@v : [16, 32] f32\n@q, %1, x : [32, 32] f32\n")
            .replace("linear(%2, @q)", "linear(%2, @q, %1, x)");
        let g = parse(&text).unwrap();
        let q = g.nodes().into_iter().find(|&n| g.node(n).label == "q" && matches!(g.node(n).op, Op::Linear { .. }));
        let ins = g.inputs(q.unwrap());
        assert_eq!(ins.len(), 2);
        assert!(matches!(&g.node(ins[1]).op, Op::Weight { name, .. } if name == "q, %1, x"));
    }

    #[test]
    fn the_golden_plans_read_back_as_printed() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.to_string_lossy().ends_with(".graph.txt") {
                let text = std::fs::read_to_string(&path).unwrap();
                assert_eq!(round_trip(&text), text, "{}", path.display());
                n += 1;
            }
        }
        assert!(n >= 3, "only {n} goldens in {}", dir.display());
    }

    fn w(g: &mut Graph, name: &str, shape: &[usize], dtype: DType) -> NodeIndex {
        g.add(Op::Weight { name: name.into(), shape: shape.to_vec(), dtype, derived: None }, &[], name).unwrap()
    }

    fn call(name: &str, args: Vec<Scalar>) -> Scalar {
        Scalar::Call(Fun::named(name).unwrap(), args)
    }

    /// Every op and attribute, every fusion kind (a GLU whose up comes before its gate, ropes
    /// on k before q), awkward weight names, labels and floats.
    fn everything() -> Graph {
        let mut g = Graph::new(DType::BF16);
        g.tp = 2;
        let table = w(&mut g, "embed", &[8, 32], DType::BF16);
        let n1 = w(&mut g, "n1, (odd) name", &[32], DType::F16);
        let q = w(&mut g, "q", &[32, 32], DType::BF16);
        let qb = w(&mut g, "q), @bias", &[32], DType::F32);
        let k = w(&mut g, "k[0:16]", &[16, 32], DType::BF16);
        let v = w(&mut g, "k[16:32]", &[16, 32], DType::BF16);
        let derived = Op::Weight {
            name: "n2 @ (1 + x0)".into(),
            shape: vec![32],
            dtype: DType::F32,
            derived: Some(Derived { source: "n2".into(), expr: call("+", vec![Scalar::Const(1.0), Scalar::Arg(0)]) }),
        };
        let n2 = g.add(derived, &[], "n2").unwrap();
        let (up, gate, down) = (
            w(&mut g, "up", &[64, 32], DType::BF16),
            w(&mut g, "gate", &[64, 32], DType::BF16),
            w(&mut g, "down", &[32, 64], DType::BF16),
        );
        let t = g.add(Op::Tokens, &[], "tokens").unwrap();
        let p = g.add(Op::Positions, &[], "positions").unwrap();
        let x = g.add(Op::Embedding, &[t, table], "x # with a hash").unwrap();
        let h = g.add(Op::RmsNorm { eps: 1.234_567_9e-7 }, &[x, n1], "").unwrap();
        let q = g.add(Op::Linear { bias: true }, &[h, q, qb], "q").unwrap();
        let k = g.add(Op::Linear { bias: false }, &[h, k], "k").unwrap();
        let v = g.add(Op::Linear { bias: false }, &[h, v], "v").unwrap();
        let factors = vec![1.080_000_042_915_344_2, 0.1 + 0.2, 1e-300, 7.0, 123_456_789.123_456_79, 2.5e10];
        let scaling = RopeScaling::LongRope { factors, attention_factor: 1.190_238_946_620_904_6 };
        let rope = Op::Rope { head_dim: 16, theta: 500_000.5, scaling, rotary_dim: Some(12) };
        let rk = g.add(rope.clone(), &[k, p], "rk").unwrap();
        let rq = g.add(rope, &[q, p], "rq").unwrap();
        let attn = Op::Attention {
            heads: 2,
            kv_heads: 1,
            head_dim: 16,
            scale: 0.0625,
            layer: 0,
            window: Some(4096),
            softcap: Some(50.0),
            sinks: false,
        };
        let a = g.add(attn, &[rq, rk, v], "a").unwrap();
        let r = g.add(Op::AllReduce, &[a], "a.all_reduce").unwrap();
        let x1 = g.add(Op::Add, &[x, r], "x1").unwrap();
        let h2 = g.add(Op::RmsNorm { eps: 1e-5 }, &[x1, n2], "h2").unwrap();
        let u = g.add(Op::Linear { bias: false }, &[h2, up], "up").unwrap();
        let gt = g.add(Op::Linear { bias: false }, &[h2, gate], "gate").unwrap();
        let s = g.add(Op::Silu, &[gt], "s").unwrap();
        let m = g.add(Op::Mul, &[u, s], "m").unwrap();
        let d = g.add(Op::Linear { bias: false }, &[m, down], "d").unwrap();
        let expr = call(
            "+",
            vec![
                call("clamp", vec![call("neg", vec![Scalar::Arg(0)]), Scalar::Const(-1.5), Scalar::Const(2e-9)]),
                call(
                    "*",
                    vec![
                        call("gelu_tanh", vec![Scalar::Arg(1)]),
                        call("-", vec![Scalar::Const(0.1), Scalar::Const(-3e30)]),
                    ],
                ),
            ],
        );
        let x2 = g.add(Op::Map { expr }, &[x1, d], "x2").unwrap();
        let l = g.add(Op::Logits, &[x2, table], "logits").unwrap();
        let l = g.add(Op::AllGather { ranks: 2 }, &[l], "logits").unwrap();
        g.output = Some(g.add(Op::Map { expr: crate::scalar::softcap(30.0) }, &[l], "logits").unwrap());
        g.fusions = vec![
            Fusion { kind: FusionKind::Linears, nodes: vec![q, k, v] },
            Fusion { kind: FusionKind::RopeAttention, nodes: vec![rq, rk, a] },
            Fusion { kind: FusionKind::AddNorm, nodes: vec![x1, h2] },
            Fusion { kind: FusionKind::Glu, nodes: vec![gt, u, s, m] },
        ];
        g
    }

    /// The fusions of `g` as (kind, member labels).
    fn fusions(g: &Graph) -> Vec<(FusionKind, Vec<String>)> {
        g.fusions.iter().map(|f| (f.kind, f.nodes.iter().map(|&n| g.node(n).label.clone()).collect())).collect()
    }

    #[test]
    fn every_op_and_fusion_kind_reads_back() {
        let g = everything();
        let plan = g.to_plan().unwrap();
        let text = plan.to_text();
        for part in
            ["@n1, (odd) name : [32] f16", "@q), @bias)", "rotary_dim=12", "window=4096, softcap=50", "fuse glu {"]
        {
            assert!(text.contains(part), "{part}\n{text}");
        }
        let back = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(back.to_plan().unwrap().to_text(), text);
        // The same ops, attributes, types and labels (weights come first in the text, so the
        // node order differs, and their labels are not printed), and each fusion's members in
        // its kind's order.
        let ops = |p: &Plan| {
            let mut v: Vec<String> = p
                .nodes
                .iter()
                .map(|n| match n.op {
                    Op::Weight { .. } => format!("{:?} {}", n.op, n.ty),
                    _ => format!("{:?} {} {}", n.op, n.ty, n.label),
                })
                .collect();
            v.sort();
            v
        };
        assert_eq!(ops(&back.to_plan().unwrap()), ops(&plan));
        assert_eq!(fusions(&back), fusions(&g));
        assert_eq!(back.tp, 2);
    }

    #[test]
    fn rope_scaling_numbers_read_back_exactly() {
        // f64s from all over the range (a fixed pseudo-random walk over bit patterns).
        let mut bits = 0x3ff0_0000_0000_0001u64;
        let mut factors = Vec::new();
        for _ in 0..2000 {
            bits = bits.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let f = f64::from_bits(bits >> 2 | 0x2000_0000_0000_0000);
            if f.is_finite() {
                factors.push(f);
            }
        }
        factors.extend([0.1 + 0.2, 1.080_000_042_915_344_2, 5e-324, f64::MAX, 0.0]);
        for s in [
            RopeScaling::LongRope { factors, attention_factor: 1.0 },
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_positions: 32768.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: 1.138_629_436_111_989,
                truncate: false,
            },
        ] {
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(rope_scaling(&json).unwrap(), s);
        }
        assert!(rope_scaling(r#"{"type":"linear","factor":2.0} x"#).unwrap_err().contains("trailing characters"));
        assert!(rope_scaling(r#"{"type":"cubic"}"#).is_err());
    }

    #[test]
    fn expressions_read_back_as_printed() {
        for text in [
            "x0",
            "-0.5",
            "(x0 + (tanh(x0) * x1))",
            "(tanh((x0 / 30)) * 30)",
            "(x0 - -30)",
            "neg(neg(x2))",
            "clamp(x0, -1.5, 0.000000002)",
            "((0.5 * x0) * (1 + gelu_tanh(min(x0, max(x1, 100000000000000000000000000000)))))",
            "(rsqrt((x0 + 0.000001)) / sqrt(exp(sigmoid(silu(gelu(x10))))))",
        ] {
            let e = parse_scalar(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(e.to_string(), text);
        }
        // Written by hand: precedence, left to right, unary minus, spaces.
        for (text, want) in [
            ("x0 + tanh(x0) * x1", "(x0 + (tanh(x0) * x1))"),
            ("2 - 3 - x0", "((2 - 3) - x0)"),
            ("x0/x1/2", "((x0 / x1) / 2)"),
            ("-x0 * -2", "(neg(x0) * -2)"),
            (" min( x0 ,1e3 ) ", "min(x0, 1000)"),
        ] {
            assert_eq!(parse_scalar(text).unwrap().to_string(), want, "{text}");
        }
        assert_eq!(parse_scalar("(2 * 3)").unwrap(), call("*", vec![Scalar::Const(2.0), Scalar::Const(3.0)]), "kept");
        for (text, want) in [
            ("tan(x0)", "unknown function `tan`"),
            ("min(x0)", "`min` takes 2 arguments, got 1"),
            ("(x0 + 1", "expected `)`"),
            ("x0 x1", "expected the end of the expression at column 4"),
            ("1e39", "not a finite f32"),
            ("x0 +", "expected a number"),
            ("y0", "unknown function `y0`"),
        ] {
            let e = parse_scalar(text).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    /// Every line of `SMALL` cut short at every character, or given a stray character there:
    /// errors, never panics.
    #[test]
    fn damaged_lines_give_errors_not_panics() {
        let lines: Vec<&str> = SMALL.lines().collect();
        let mut errors = 0;
        for (i, line) in lines.iter().enumerate() {
            for (j, _) in line.char_indices().skip(1) {
                for damaged in [line[..j].to_string(), format!("{}){}", &line[..j], &line[j..])] {
                    let mut l = lines.clone();
                    l[i] = &damaged;
                    let text = l.join("\n") + "\n";
                    let r = std::panic::catch_unwind(|| parse(&text).map(|_| ()));
                    let r = r.unwrap_or_else(|_| panic!("parse panicked on line {}: {damaged}", i + 1));
                    errors += usize::from(r.is_err());
                }
            }
        }
        assert!(errors > 1000, "{errors}");
    }

    /// The error for `SMALL` with `from` replaced by `to`.
    fn error(from: &str, to: &str) -> String {
        assert!(SMALL.contains(from), "{from}");
        parse(&SMALL.replacen(from, to, 1)).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_line_and_what_is_wrong() {
        for (from, to, want) in [
            ("silu(%9)", "swish(%9)", "line 21: unknown op `swish`"),
            ("silu(%9) : [T, 32]", "silu(%9) : [T, 16]", "line 21: `%10` is written as [T, 16] f32 but its inputs give silu the type [T, 32] f32"),
            ("silu(%9)", "silu(%19)", "line 21: `%19` is not defined on an earlier line"),
            ("%12 = map", "%9 = map", "line 23: `%9` is defined twice (first on line 20)"),
            ("(%2, @q)", "(%2, @qq)", "line 11: `@qq` is not a declared weight"),
            ("@k : [16, 32] f32", "@q : [16, 32] f32", "line 5: weight `@q` is declared twice (first on line 4)"),
            ("@k : [16, 32] f32", "@k : [T, 32] f32", "line 5: weight `@k` has the shape [T, 32] f32"),
            ("@k : [16, 32] f32", "@k : [16, 32] f64", "line 5: unknown dtype `f64`"),
            ("(%3, %6) : [T, 32] f32", "(%3, %6, %4) : [T, 32] f32", "line 17: at `q`: rope: takes 2 inputs, got 3"),
            ("(%1, %8) : [T, 32] f32  # x", "(%1, %8) : [T, 32] f32 x", "line 20: expected `  # LABEL`"),
            ("eps=1e-6", "eps=1e-6, foo=1", "line 9: rms_norm takes no attribute `foo`"),
            ("eps=1e-6", "eps=small", "line 9: rms_norm: `eps=small`: `small` is not a f32"),
            ("scale=0.25, ", "", "line 18: attention needs the attribute `scale`"),
            ("tanh((x0", "tan((x0", "line 23: map: expr: unknown function `tan`"),
            ("\"default\"", "\"cubic\"", "line 17: rope: scaling: unknown variant `cubic`"),
            ("expr=(1 + x0)}(@norm)", "expr=(x1 + x0)}(@norm)", "line 3: weight `@norm @ (1 + x0)`: the expression (x1 + x0) of a derived weight may read x0 only"),
            // Fusions.
            ("fuse linears {", "fuse linear {", "line 10: unknown fusion kind `linear`"),
            ("fuse rope_attention {", "fuse glu {", "line 16: bad fusion: glu: wrong number of nodes (2)"),
            (
                "%10 = silu(%9) : [T, 32] f32  # s\n",
                "fuse add_norm {\n%10 = silu(%9) : [T, 32] f32  # s\n}\n",
                "line 21: bad fusion: add_norm: wrong number of nodes (1)",
            ),
            (
                "%9 = add(%1, %8) : [T, 32] f32  # x\n%10 = silu(%9) : [T, 32] f32  # s\n",
                "fuse add_norm {\n%9 = add(%1, %8) : [T, 32] f32  # x\n%10 = silu(%9) : [T, 32] f32  # s\n}\n",
                "line 20: bad fusion: add_norm: needs an add and an rms_norm of it",
            ),
            ("  %5 = linear(%2, @v) : [T, 16] f32  # v\n}\n", "  %5 = linear(%2, @v) : [T, 16] f32  # v\n", "line 15: `fuse rope_attention {` inside the `fuse linears` block opened on line 10"),
            ("%6 = positions() : [T] i32  # positions\n", "fuse linears {\n%6 = positions() : [T] i32  # positions\n}\n", "line 15: bad fusion: linears: a positions node takes no inputs"),
            ("%9 = add", "}\n%9 = add", "line 20: `}` closes no `fuse KIND {` block"),
            ("fuse rope_attention {", "fuse rope_attention {\n}\nfuse rope_attention {", "line 17: the `fuse rope_attention` block opened on line 16 has no nodes"),
            ("  %5 = linear", "@late : [4] f32\n  %5 = linear", "line 13: a weight declaration inside the `fuse linears` block"),
            // Whole-text checks.
            ("  (output)", "", "line 1: no node is marked `(output)`"),
            ("# logits\n", "# logits  (output)\n", "line 23: a second node marked `(output)` (the first is on line 22)"),
            ("vocab=16", "vocab=17", "line 1: the header says vocab=17 but the output (line 23) has 16 columns"),
            ("head_dim=16)", "head_dim=32)", "line 1: the header says kv(layers=1, kv_heads=1, head_dim=32) but the attention nodes give kv(layers=1, kv_heads=1, head_dim=16)"),
            ("plan tp=1", "plan tp=one", "line 1: `tp=one`: `one` is not a usize"),
            ("plan tp=1 act=f32", "graph tp=1 act=f32", "line 1: expected the header"),
            ("%10 = silu", "10 = silu", "line 21: expected a node"),
        ] {
            let e = error(from, to);
            assert!(e.contains(want), "{from} -> {to}:\n  got  {e}\n  want {want}");
        }
        // The last `}` removed: the block runs to the end of the text.
        let open = SMALL.replace("}\n%9", "%9");
        assert!(parse(&open)
            .unwrap_err()
            .to_string()
            .contains("line 16: the `fuse rope_attention` block opened here is not closed"));
        assert!(parse("").unwrap_err().to_string().contains("line 1: the text is empty"));
    }
}
