//! The reference interpreter: runs a [`Plan`] in plain f32 Rust, one sequence at a time, with
//! a KV cache. It is the oracle every backend is tested against, so it is written to be
//! obviously right, not fast: one loop nest per op, exactly as [`Op`] documents it.

use crate::op::Op;
use crate::plan::Plan;
use crate::DType;
use crate::IrError;

/// The KV cache of one sequence: per layer, K and V rows (`kv_heads * head_dim` floats) for
/// every position seen so far.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    /// Number of positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Where a step's attention stores the new K and V rows and finds those of earlier positions.
/// [`KvCache`] keeps them in one vector per layer; a runtime's paged pool implements it over
/// its token slots.
pub trait KvStore {
    /// Positions cached before this step.
    fn start(&self) -> usize;
    /// Stores the step's K and V rows (positions `start()..`, `kv_heads * head_dim` floats
    /// each) for `layer`, and returns K and V of every position `0..start() + n`, row-major.
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(Vec<f32>, Vec<f32>), IrError>;
    /// Called after a successful step of `n` tokens.
    fn commit(&mut self, n: usize);
}

impl KvStore for KvCache {
    fn start(&self) -> usize {
        self.len
    }

    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(Vec<f32>, Vec<f32>), IrError> {
        let (kc, vc) = (&mut self.k[layer], &mut self.v[layer]);
        kc.extend_from_slice(k);
        vc.extend_from_slice(v);
        Ok((kc.clone(), vc.clone()))
    }

    fn commit(&mut self, n: usize) {
        self.len += n;
    }
}

enum Val {
    Ids(Vec<i32>),
    /// Row-major floats.
    F(Vec<f32>),
}

/// A plan with its weights, converted to f32.
pub struct Interpreter {
    plan: Plan,
    weights: Vec<Option<Vec<f32>>>,
}

impl Interpreter {
    /// Prepares `plan`; `load(name, shape, dtype)` returns a weight's values as f32, row-major
    /// (a block type dequantized: [`crate::quant::dequantize`]).
    pub fn new(
        plan: Plan,
        mut load: impl FnMut(&str, &[usize], DType) -> Result<Vec<f32>, String>,
    ) -> Result<Interpreter, IrError> {
        if plan.tp != 1 {
            return Err(IrError::Unsupported(format!(
                "the reference interpreter runs one rank; this plan has tp={}",
                plan.tp
            )));
        }
        let mut weights = Vec::with_capacity(plan.nodes.len());
        for n in &plan.nodes {
            weights.push(match &n.op {
                Op::Weight { name, shape, dtype, .. } => {
                    let w =
                        load(name, shape, *dtype).map_err(|m| IrError::Weight { name: name.clone(), message: m })?;
                    let want: usize = shape.iter().product();
                    if w.len() != want {
                        return Err(IrError::Weight {
                            name: name.clone(),
                            message: format!("has {} values, expected {want} for shape {shape:?}", w.len()),
                        });
                    }
                    Some(w)
                }
                _ => None,
            });
        }
        Ok(Interpreter { plan, weights })
    }

    /// The plan being run.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// An empty KV cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache { k: vec![Vec::new(); self.plan.kv.layers], v: vec![Vec::new(); self.plan.kv.layers], len: 0 }
    }

    /// Runs one step: `tokens` at positions `cache.len()..`, appending to the cache. Returns the
    /// logits of the positions `rows` (indices into `tokens`), `rows.len() × vocab` floats.
    pub fn forward(&self, kv: &mut dyn KvStore, tokens: &[u32], rows: &[usize]) -> Result<Vec<f32>, IrError> {
        self.run(kv, tokens, rows, false)
    }

    /// Like [`Interpreter::forward`], but returns the final hidden state (the `logits` op's
    /// input) of the positions `rows`, `rows.len() × hidden` floats: what an embedding pools.
    pub fn forward_hidden(&self, kv: &mut dyn KvStore, tokens: &[u32], rows: &[usize]) -> Result<Vec<f32>, IrError> {
        self.run(kv, tokens, rows, true)
    }

    fn run(&self, kv: &mut dyn KvStore, tokens: &[u32], rows: &[usize], hidden: bool) -> Result<Vec<f32>, IrError> {
        self.plan.check_step(tokens, rows)?;
        let t_len = tokens.len();
        let start = kv.start();
        let mut vals: Vec<Option<Val>> = Vec::with_capacity(self.plan.nodes.len());
        for (i, n) in self.plan.nodes.iter().enumerate() {
            let f = |j: usize| -> &[f32] {
                match (&vals[n.inputs[j]], &self.weights[n.inputs[j]]) {
                    (Some(Val::F(v)), _) => v,
                    (_, Some(w)) => w,
                    _ => &[],
                }
            };
            let cols = n.ty.last().unwrap_or(0);
            let v = match &n.op {
                Op::Tokens => Some(Val::Ids(tokens.iter().map(|&t| t as i32).collect())),
                Op::Positions => Some(Val::Ids((0..t_len).map(|t| (start + t) as i32).collect())),
                Op::Weight { .. } => None,
                Op::Embedding => {
                    let Some(Val::Ids(ids)) = &vals[n.inputs[0]] else { unreachable!("verified: tokens") };
                    Some(Val::F(embedding(ids, f(1), cols)))
                }
                Op::Linear { bias } => {
                    let b = if *bias { Some(f(2)) } else { None };
                    Some(Val::F(linear(f(0), f(1), b, cols)))
                }
                Op::RmsNorm { eps } => Some(Val::F(rms_norm(f(0), f(1), *eps))),
                Op::Rope { head_dim, theta, scaling, .. } => {
                    let Some(Val::Ids(pos)) = &vals[n.inputs[1]] else { unreachable!("verified: positions") };
                    let (inv, scale) = scaling.inv_freq(n.op.rotary_dim(), *theta);
                    Some(Val::F(rope(f(0), pos, *head_dim, &inv, scale)))
                }
                Op::Attention { heads, kv_heads, head_dim, scale, layer, window, softcap, sinks } => {
                    let (k, v) = kv.append(*layer, f(1), f(2))?;
                    if k.len() != (start + t_len) * kv_heads * head_dim || v.len() != k.len() {
                        return Err(IrError::Input(format!(
                            "KV store of layer {layer} returned {} floats, expected {} positions",
                            k.len(),
                            start + t_len
                        )));
                    }
                    let shape = Heads { heads: *heads, kv_heads: *kv_heads, d: *head_dim };
                    let scores = Scores {
                        scale: *scale,
                        window: *window,
                        softcap: softcap.map(crate::scalar::softcap),
                        sinks: if *sinks { Some(f(3)) } else { None },
                    };
                    Some(Val::F(attention(f(0), &k, &v, start, shape, &scores)))
                }
                Op::Silu => Some(Val::F(f(0).iter().map(|&x| x / (1.0 + (-x).exp())).collect())),
                Op::Map { expr } => Some(Val::F(map(expr, &(0..n.inputs.len()).map(f).collect::<Vec<_>>()))),
                Op::Mul => Some(Val::F(f(0).iter().zip(f(1)).map(|(a, b)| a * b).collect())),
                Op::Add => Some(Val::F(f(0).iter().zip(f(1)).map(|(a, b)| a + b).collect())),
                Op::AllReduce | Op::AllGather { .. } => Some(Val::F(f(0).to_vec())),
                Op::Moe { top_k, norm_topk, act, bias } => {
                    let gate = &self.plan.nodes[n.inputs[2]].ty;
                    let inter = gate.dim(1).unwrap_or(0);
                    let moe = Moe { top_k: *top_k, norm_topk: *norm_topk, act, inter, hidden: cols };
                    let w = [f(2), f(3), f(4)];
                    let b = if *bias { Some([f(5), f(6), f(7)]) } else { None };
                    Some(Val::F(moe.forward(f(0), f(1), w, b)))
                }
                Op::Logits => {
                    let h = f(1).len() / cols;
                    let x = f(0);
                    let sel: Vec<f32> = rows.iter().flat_map(|&r| x[r * h..(r + 1) * h].iter().copied()).collect();
                    if hidden {
                        // Every attention comes before the logits: the step's KV is complete.
                        kv.commit(t_len);
                        return Ok(sel);
                    }
                    Some(Val::F(linear(&sel, f(1), None, cols)))
                }
            };
            debug_assert!(i == vals.len());
            vals.push(v);
        }
        kv.commit(t_len);
        match vals.swap_remove(self.plan.output) {
            Some(Val::F(v)) => Ok(v),
            _ => Err(IrError::Verify("the output is not a float tensor".into())),
        }
    }
}

/// `expr` at every element of the largest input; a smaller input (a `[n]` vector) repeats.
fn map(expr: &crate::Scalar, ins: &[&[f32]]) -> Vec<f32> {
    let len = ins.iter().map(|v| v.len()).max().unwrap_or(0);
    let mut x = vec![0.0; ins.len()];
    (0..len)
        .map(|i| {
            for (xj, v) in x.iter_mut().zip(ins) {
                *xj = v[i % v.len()];
            }
            expr.eval(&x)
        })
        .collect()
}

fn embedding(ids: &[i32], table: &[f32], h: usize) -> Vec<f32> {
    ids.iter().flat_map(|&t| table[t as usize * h..(t as usize + 1) * h].iter().copied()).collect()
}

/// `x [T, K] · w [N, K]ᵀ + b [N]`.
fn linear(x: &[f32], w: &[f32], b: Option<&[f32]>, n: usize) -> Vec<f32> {
    let k = w.len() / n;
    let mut out = Vec::with_capacity(x.len() / k * n);
    for row in x.chunks_exact(k) {
        for (j, wr) in w.chunks_exact(k).enumerate() {
            let dot: f32 = row.iter().zip(wr).map(|(a, b)| a * b).sum();
            out.push(dot + b.map_or(0.0, |b| b[j]));
        }
    }
    out
}

/// RMS norm of every group of `w.len()` consecutive values of `x` (a row, or a head of one).
fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(n) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let r = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, g)| v * r * g));
    }
    out
}

/// Rotates the leading `2 · inv_freq.len()` features of each head of `d` (the rest pass through).
fn rope(x: &[f32], pos: &[i32], d: usize, inv_freq: &[f64], scale: f64) -> Vec<f32> {
    let mut out = x.to_vec();
    let cols = x.len() / pos.len();
    let half = inv_freq.len();
    for (t, &p) in pos.iter().enumerate() {
        for head in out[t * cols..(t + 1) * cols].chunks_exact_mut(d) {
            for i in 0..half {
                // f32 angles, as HF computes them (inv_freq and positions in float32).
                let angle = (p as f32) * (inv_freq[i] as f32);
                let (sin, cos) = (angle.sin() * scale as f32, angle.cos() * scale as f32);
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos - b * sin;
                head[i + half] = b * cos + a * sin;
            }
        }
    }
    out
}

/// Head counts and size of an attention.
struct Heads {
    heads: usize,
    kv_heads: usize,
    d: usize,
}

/// How an attention scores and masks.
struct Scores<'a> {
    scale: f32,
    window: Option<usize>,
    softcap: Option<crate::Scalar>,
    sinks: Option<&'a [f32]>,
}

fn attention(q: &[f32], k: &[f32], v: &[f32], start: usize, shape: Heads, sc: &Scores) -> Vec<f32> {
    let Heads { heads, kv_heads, d } = shape;
    let t_len = q.len() / (heads * d);
    let kv_row = kv_heads * d;
    let group = heads / kv_heads;
    let mut out = vec![0.0f32; q.len()];
    for t in 0..t_len {
        let visible = start + t + 1;
        let first = sc.window.map_or(0, |w| visible.saturating_sub(w));
        for h in 0..heads {
            let kvh = h / group;
            let qv = &q[(t * heads + h) * d..(t * heads + h + 1) * d];
            let scores: Vec<f32> = (first..visible)
                .map(|s| {
                    let kv = &k[s * kv_row + kvh * d..s * kv_row + (kvh + 1) * d];
                    let x = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * sc.scale;
                    sc.softcap.as_ref().map_or(x, |c| c.eval(&[x]))
                })
                .collect();
            let sink = sc.sinks.map(|s| s[h]);
            let max = scores.iter().copied().chain(sink).fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f32 = exps.iter().sum::<f32>() + sink.map_or(0.0, |s| (s - max).exp());
            let o = &mut out[(t * heads + h) * d..(t * heads + h + 1) * d];
            for (s, e) in (first..visible).zip(&exps) {
                let vv = &v[s * kv_row + kvh * d..s * kv_row + (kvh + 1) * d];
                for (oi, vi) in o.iter_mut().zip(vv) {
                    *oi += e / sum * vi;
                }
            }
        }
    }
    out
}

/// A mixture of experts' routing and sizes ([`Op::Moe`]).
struct Moe<'a> {
    top_k: usize,
    norm_topk: bool,
    act: &'a crate::Scalar,
    /// Each expert's intermediate size.
    inter: usize,
    /// The row size.
    hidden: usize,
}

impl Moe<'_> {
    /// `x [T, H]`, router logits `[T, E]`, the experts' gate, up and down stacks and biases.
    fn forward(&self, x: &[f32], logits: &[f32], [gate, up, down]: [&[f32]; 3], bias: Option<[&[f32]; 3]>) -> Vec<f32> {
        let (h, i_len) = (self.hidden, self.inter);
        let experts = logits.len() / (x.len() / h).max(1);
        let mut out = vec![0.0f32; x.len()];
        for (t, row) in x.chunks_exact(h).enumerate() {
            let o = &mut out[t * h..(t + 1) * h];
            for (e, weight) in crate::moe::route(&logits[t * experts..(t + 1) * experts], self.top_k, self.norm_topk) {
                let (w_in, w_out) = (e * i_len * h..(e + 1) * i_len * h, e * h * i_len..(e + 1) * h * i_len);
                let b = |k: usize, n: usize| bias.map(|b| &b[k][e * n..(e + 1) * n]);
                let g = linear(row, &gate[w_in.clone()], b(0, i_len), i_len);
                let u = linear(row, &up[w_in], b(1, i_len), i_len);
                let a: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| self.act.eval(&[g, u])).collect();
                let y = linear(&a, &down[w_out], b(2, h), h);
                for (oi, yi) in o.iter_mut().zip(y) {
                    *oi += weight * yi;
                }
            }
        }
        out
    }
}
