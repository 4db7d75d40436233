//! The op set: every operation a model graph can contain, each with its shape rule
//! ([`Op::infer`]) and reference semantics (documented here, implemented in
//! [`crate::interp`]). Backends match on [`Op`] exhaustively: adding a variant makes the compiler
//! list every place that must learn it (`docs/adding-an-op.md`).
//!
//! Notation: `T` is the number of tokens in the step, `R` the number of logit rows requested.
//! Activations are `[T, features]`, heads laid out head-major (`[T, heads * head_dim]`).

use crate::rope::RopeScaling;
use crate::scalar::Scalar;
use crate::types::{DType, Dim, TensorType};
use crate::IrError;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A weight computed at compile time: `expr` (over `x0`) applied to each value of the
/// checkpoint tensor `source` (this rank's slice of it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Derived {
    /// The checkpoint tensor.
    pub source: String,
    /// The elementwise expression.
    pub expr: Scalar,
}

/// One operation of the graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// The step's token ids: `[T] i32`. No inputs.
    Tokens,
    /// The step's absolute positions: `[T] i32`. No inputs.
    Positions,
    /// A weight tensor of the bundle, stored in `dtype`. No inputs. With `derived`, the
    /// compiler computed it (`SOURCE @ EXPR`: a map over one checkpoint tensor, folded by the
    /// `fold_weights` pass); the runtimes load it by `name` like any other.
    Weight {
        /// Tensor name in the bundle's weight files.
        name: String,
        /// Concrete (per-rank) shape.
        shape: Vec<usize>,
        /// Storage type.
        dtype: DType,
        /// How the compiler made it, when it is not a checkpoint tensor.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        derived: Option<Derived>,
    },
    /// `out[t] = table[tokens[t]]`. Inputs: tokens `[T]`, table `[V, H]` → `[T, H]`.
    Embedding,
    /// `out = x · wᵀ (+ bias)`. Inputs: x `[T, K]`, w `[N, K]`, optional bias `[N]` → `[T, N]`.
    Linear {
        /// Whether a bias input follows the weight.
        bias: bool,
    },
    /// `out = x / sqrt(mean(x²) + eps) * w` over each group of `D` consecutive features of a
    /// row, where `D` is the weight's size: the whole row when `D = N` (a layer norm), each
    /// head when `D` is the head size (Qwen3's q/k norms). Inputs: x `[T, N]`, w `[D]` with `N`
    /// a multiple of `D` → `[T, N]`.
    RmsNorm {
        /// Added to the mean square.
        eps: f32,
    },
    /// Rotary embedding, rotate-half (GPT-NeoX) layout, on the leading `r` features of every
    /// head of x (`r` = `rotary_dim`, the whole head by default; the rest pass through): for
    /// pair `(i, i + r/2)` with angle `pos · inv_freq[i]` (the `r/2` frequencies of a rotary
    /// dimension `r`), `(a, b) → (a cos − b sin, b cos + a sin)`, cos and sin scaled by the
    /// scaling's attention factor. Inputs: x `[T, h·d]`, positions `[T]` → `[T, h·d]`.
    Rope {
        /// Size of one head.
        head_dim: usize,
        /// Base of the frequencies.
        theta: f64,
        /// Frequency scaling.
        scaling: RopeScaling,
        /// Features rotated at the start of each head (Phi-3's `partial_rotary_factor`); all
        /// when `None`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rotary_dim: Option<usize>,
    },
    /// Causal grouped-query attention over the KV cache of `layer`. The step's k and v rows
    /// are appended to the cache of the sequence at its positions; query row `t` at position
    /// `p` attends to every cached position `s ≤ p` (with a `window` W, only those with
    /// `p − s < W`: the last W positions). Query head `h` reads KV head `h / (heads /
    /// kv_heads)`; scores are `q·k · scale`, soft-capped to `tanh(score / c) · c` with a
    /// `softcap` c ([`crate::scalar::softcap`]), and soft-maxed in f32; with `sinks`, head `h`'s
    /// softmax has one more logit, `sinks[h]`, that takes its share of the mass and adds nothing
    /// to the output (gpt-oss's learned attention sinks). Inputs: q `[T, heads·d]`, k
    /// `[T, kv_heads·d]`, v `[T, kv_heads·d]`, with `sinks` a float `[heads]` → `[T, heads·d]`.
    Attention {
        /// Query heads (on this rank).
        heads: usize,
        /// KV heads (on this rank).
        kv_heads: usize,
        /// Size of one head.
        head_dim: usize,
        /// Score scale, normally `1/sqrt(head_dim)`.
        scale: f32,
        /// Index of the KV cache layer this op owns.
        layer: usize,
        /// Sliding window: how many positions (the query's own included) a query sees.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        window: Option<usize>,
        /// Score soft-capping constant.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        softcap: Option<f32>,
        /// Whether a fourth input gives each head a sink logit.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        sinks: bool,
    },
    /// `x · sigmoid(x)`, elementwise.
    Silu,
    /// Elementwise `expr` (see [`crate::scalar`]) over the inputs, input `i` being `x{i}`,
    /// computed in f32. Inputs all have the first input's shape, except that a `[n]` vector
    /// applies to every row of a `[d, n]` input. Output: that shape; activations (`[T, n]`) in
    /// the graph's activation dtype, logit rows (`[R, n]`) and weights in f32. Elementwise
    /// sums, products and SiLU of two same-shaped activations are written as [`Op::Add`],
    /// [`Op::Mul`] and [`Op::Silu`], the forms the backends' fusions recognise.
    Map {
        /// The expression.
        expr: Scalar,
    },
    /// Elementwise product of two same-shaped inputs.
    Mul,
    /// Elementwise sum of two same-shaped inputs.
    Add,
    /// Sum of x over the tensor-parallel ranks (identity with one rank). Input x → same type.
    AllReduce,
    /// Concatenation of x's last dimension over the tensor-parallel ranks, in rank order
    /// (identity with one rank): a vocab-parallel lm_head's logits made whole. Input x
    /// `[d, n]` → `[d, n · ranks]`, same dtype. The runtime may complete it on rank 0 alone,
    /// the rank that reads the logits.
    AllGather {
        /// The ranks whose parts are joined.
        ranks: usize,
    },
    /// Mixture of experts. Each row picks the `top_k` experts with the largest router logits
    /// (on equal logits the lower index), weighted by the softmax of the logits, taken over the
    /// chosen ones when `norm_topk` and over all `E` otherwise (then the weights sum to less
    /// than 1); each chosen expert `e` computes `down[e] · act(gate[e] · x, up[e] · x)` (with
    /// `bias`, `gate_b[e]`, `up_b[e]` added to its projections and `down_b[e]` to its output),
    /// and the row's output is the weighted sum, in f32. `act` is an expression of the gate
    /// (`x0`) and up (`x1`) values ([`crate::scalar`]). Inputs: x `[T, H]`, router logits
    /// `[T, E]`, gate `[E, I, H]`, up `[E, I, H]`, down `[E, H, I]`, and with `bias` gate_b
    /// `[E, I]`, up_b `[E, I]`, down_b `[E, H]` → `[T, H]`.
    Moe {
        /// Experts per row.
        top_k: usize,
        /// Whether the routing softmax runs over the chosen experts only.
        norm_topk: bool,
        /// The gated activation, `x0` the gate and `x1` the up projection.
        act: Scalar,
        /// Whether the experts' projections have biases.
        bias: bool,
    },
    /// Logits of the requested rows: `out[r] = x[rows[r]] · wᵀ` in f32. Inputs: x `[T, H]`,
    /// w `[V, H]` → `[R, V] f32`. The rows are chosen by the runtime for each step.
    Logits,
}

impl Op {
    /// The features of each head a RoPE rotates (`rotary_dim`, or the whole head); 0 for
    /// other ops.
    pub fn rotary_dim(&self) -> usize {
        match self {
            Op::Rope { head_dim, rotary_dim, .. } => rotary_dim.unwrap_or(*head_dim),
            _ => 0,
        }
    }

    /// The op's name as written in model YAML and in printed graphs.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Tokens => "tokens",
            Op::Positions => "positions",
            Op::Weight { .. } => "weight",
            Op::Embedding => "embedding",
            Op::Linear { .. } => "linear",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Rope { .. } => "rope",
            Op::Attention { .. } => "attention",
            Op::Silu => "silu",
            Op::Map { .. } => "map",
            Op::Mul => "mul",
            Op::Add => "add",
            Op::AllReduce => "all_reduce",
            Op::AllGather { .. } => "all_gather",
            Op::Moe { .. } => "moe",
            Op::Logits => "logits",
        }
    }

    /// Names of the ops a model YAML may call (besides the elementwise functions of
    /// [`crate::scalar::FUNCTIONS`], which become `add`, `mul`, `silu` or `map`).
    pub const CALLABLE: [&'static str; 8] =
        ["embedding", "linear", "rms_norm", "rope", "attention", "moe", "logits", "all_reduce"];

    /// The number of inputs the op takes.
    pub fn arity(&self) -> usize {
        match self {
            Op::Tokens | Op::Positions | Op::Weight { .. } => 0,
            Op::Silu | Op::AllReduce | Op::AllGather { .. } => 1,
            Op::Embedding | Op::RmsNorm { .. } | Op::Rope { .. } | Op::Mul | Op::Add | Op::Logits => 2,
            Op::Linear { bias } => 2 + usize::from(*bias),
            Op::Attention { sinks, .. } => 3 + usize::from(*sinks),
            Op::Moe { bias, .. } => 5 + 3 * usize::from(*bias),
            Op::Map { expr } => expr.arity(),
        }
    }

    /// The op's attributes as `key=value` text, for printing.
    pub fn attrs(&self) -> String {
        match self {
            Op::RmsNorm { eps } => format!("eps={eps:e}"),
            Op::Rope { head_dim, theta, scaling, rotary_dim } => format!(
                "head_dim={head_dim}, theta={theta}, scaling={}{}",
                serde_json::to_string(scaling).unwrap_or_default(),
                rotary_dim.map_or(String::new(), |r| format!(", rotary_dim={r}"))
            ),
            Op::Attention { heads, kv_heads, head_dim, scale, layer, window, softcap, sinks } => {
                let mut s =
                    format!("heads={heads}, kv_heads={kv_heads}, head_dim={head_dim}, scale={scale}, layer={layer}");
                if let Some(w) = window {
                    s += &format!(", window={w}");
                }
                if let Some(c) = softcap {
                    s += &format!(", softcap={c}");
                }
                if *sinks {
                    s += ", sinks=true";
                }
                s
            }
            Op::Moe { top_k, norm_topk, act, bias } => {
                format!("top_k={top_k}, norm_topk={norm_topk}, act={act}, bias={bias}")
            }
            Op::AllGather { ranks } => format!("ranks={ranks}"),
            Op::Map { expr } => format!("expr={expr}"),
            Op::Tokens
            | Op::Positions
            | Op::Weight { .. }
            | Op::Embedding
            | Op::Linear { .. }
            | Op::Silu
            | Op::Mul
            | Op::Add
            | Op::AllReduce
            | Op::Logits => String::new(),
        }
    }

    /// Infers the output type from the input types (the shape rule of each variant), checking
    /// that the inputs fit. `act` is the activation dtype of the graph.
    pub fn infer(&self, inputs: &[&TensorType], act: DType) -> Result<TensorType, IrError> {
        if inputs.len() != self.arity() {
            return Err(self.err(format!("takes {} inputs, got {}", self.arity(), inputs.len())));
        }
        let rows = |t: &TensorType, what: &str| -> Result<usize, IrError> {
            match (t.shape.as_slice(), t.dtype.is_float()) {
                ([Dim::T, Dim::N(n)], true) => Ok(*n),
                _ => Err(self.err(format!("{what} must be a float [T, n] activation, got {t}"))),
            }
        };
        // A matrix: dense floats, or whole blocks of a block type along its rows (k a multiple
        // of that type's block length: 32, or a k-quant's 256).
        let mat = |t: &TensorType, what: &str| -> Result<(usize, usize), IrError> {
            let whole = |k: usize| t.dtype.block().is_some_and(|(len, _)| k.is_multiple_of(len));
            match t.shape.as_slice() {
                [Dim::N(a), Dim::N(b)] if t.dtype.is_float() || whole(*b) => Ok((*a, *b)),
                _ => Err(self.err(format!("{what} must be a float (or whole-block quantized) [n, k] weight, got {t}"))),
            }
        };
        let vec = |t: &TensorType, n: usize, what: &str| -> Result<(), IrError> {
            if t.shape == [Dim::N(n)] && t.dtype.is_float() {
                Ok(())
            } else {
                Err(self.err(format!("{what} must be a float [{n}] vector, got {t}")))
            }
        };
        let ids = |t: &TensorType, what: &str| -> Result<(), IrError> {
            if t.shape == [Dim::T] && t.dtype == DType::I32 {
                Ok(())
            } else {
                Err(self.err(format!("{what} must be [T] i32, got {t}")))
            }
        };
        let act2 = |n: usize| TensorType::new(vec![Dim::T, Dim::N(n)], act);
        Ok(match self {
            Op::Tokens | Op::Positions => TensorType::new(vec![Dim::T], DType::I32),
            Op::Weight { shape, dtype, .. } => TensorType::fixed(shape, *dtype),
            Op::Embedding => {
                ids(inputs[0], "tokens")?;
                act2(mat(inputs[1], "table")?.1)
            }
            Op::Linear { bias } => {
                let k = rows(inputs[0], "x")?;
                let (n, wk) = mat(inputs[1], "weight")?;
                if wk != k {
                    return Err(self.err(format!("x has {k} features but the weight is [{n}, {wk}]")));
                }
                if *bias {
                    vec(inputs[2], n, "bias")?;
                }
                act2(n)
            }
            Op::RmsNorm { .. } => {
                let (n, w) = (rows(inputs[0], "x")?, inputs[1]);
                let d = match w.shape.as_slice() {
                    [Dim::N(d)] if w.dtype.is_float() => *d,
                    _ => 0,
                };
                if d == 0 || n % d != 0 {
                    return Err(
                        self.err(format!("weight must be a float [d] vector with {n} a multiple of d, got {w}"))
                    );
                }
                act2(n)
            }
            Op::Rope { head_dim, rotary_dim, .. } => {
                let n = rows(inputs[0], "x")?;
                ids(inputs[1], "positions")?;
                if *head_dim == 0 || head_dim % 2 != 0 || n % head_dim != 0 {
                    return Err(self.err(format!("{n} features are not whole heads of even size {head_dim}")));
                }
                if let Some(r) = rotary_dim.filter(|&r| r == 0 || r % 2 != 0 || r > *head_dim) {
                    return Err(self.err(format!("rotary_dim {r} is not an even size within the head of {head_dim}")));
                }
                act2(n)
            }
            Op::Attention { heads, kv_heads, head_dim, window, softcap, sinks, .. } => {
                if *window == Some(0) || softcap.is_some_and(|c| !(c > 0.0 && c.is_finite())) {
                    return Err(self.err(format!("window {window:?} and softcap {softcap:?} must be positive")));
                }
                let (q, k, v) = (rows(inputs[0], "q")?, rows(inputs[1], "k")?, rows(inputs[2], "v")?);
                if *kv_heads == 0 || heads % kv_heads != 0 {
                    return Err(self.err(format!("{heads} query heads are not a multiple of {kv_heads} kv heads")));
                }
                if q != heads * head_dim || k != kv_heads * head_dim || v != k {
                    return Err(self.err(format!(
                        "q/k/v have {q}/{k}/{v} features; expected {}/{}/{} for {heads} heads, {kv_heads} kv heads of {head_dim}",
                        heads * head_dim,
                        kv_heads * head_dim,
                        kv_heads * head_dim
                    )));
                }
                if *sinks {
                    vec(inputs[3], *heads, "sinks")?;
                }
                act2(q)
            }
            Op::Moe { top_k, act, bias, .. } => {
                act.check().map_err(|m| self.err(m))?;
                if act.arity() > 2 {
                    return Err(self.err(format!("act {act} may read x0 (gate) and x1 (up) only")));
                }
                let (h, e) = (rows(inputs[0], "x")?, rows(inputs[1], "router logits")?);
                let experts = |t: &TensorType, what: &str| -> Result<(usize, usize), IrError> {
                    match t.shape.as_slice() {
                        [Dim::N(n), Dim::N(a), Dim::N(b)] if *n == e && t.dtype.is_float() => Ok((*a, *b)),
                        _ => Err(self.err(format!("{what} must be a float [{e}, n, k] stack of experts, got {t}"))),
                    }
                };
                let (i, gk) = experts(inputs[2], "gate")?;
                let up = experts(inputs[3], "up")?;
                let down = experts(inputs[4], "down")?;
                if gk != h || up != (i, h) || down != (h, i) {
                    return Err(self.err(format!(
                        "gate/up/down are {}/{}/{}: expected [{e}, I, {h}], [{e}, I, {h}], [{e}, {h}, I]",
                        inputs[2], inputs[3], inputs[4]
                    )));
                }
                if *top_k == 0 || *top_k > e {
                    return Err(self.err(format!("top_k {top_k} must be 1 to the {e} experts")));
                }
                if *bias {
                    for (t, n, what) in [(inputs[5], i, "gate_b"), (inputs[6], i, "up_b"), (inputs[7], h, "down_b")] {
                        if t.shape != [Dim::N(e), Dim::N(n)] || !t.dtype.is_float() {
                            return Err(self.err(format!("{what} must be a float [{e}, {n}], got {t}")));
                        }
                    }
                }
                act2(h)
            }
            Op::Silu | Op::AllReduce => act2(rows(inputs[0], "x")?),
            Op::AllGather { ranks } => match inputs[0].shape.as_slice() {
                [d, Dim::N(n)] if *ranks > 0 => TensorType::new(vec![*d, Dim::N(n * ranks)], inputs[0].dtype),
                _ => return Err(self.err(format!("x must be [d, n] over {ranks} ranks, got {}", inputs[0]))),
            },
            Op::Map { expr } => {
                expr.check().map_err(|m| self.err(m))?;
                let main = inputs
                    .iter()
                    .max_by_key(|t| t.shape.len())
                    .copied()
                    .ok_or_else(|| self.err("has no inputs".into()))?;
                let n = main.last().unwrap_or(0);
                for (i, t) in inputs.iter().enumerate() {
                    if !t.dtype.is_float() || (t.shape != main.shape && t.shape != [Dim::N(n)]) {
                        return Err(self.err(format!("x{i} is {t}: not a float of the shape {main} or a [{n}] vector")));
                    }
                }
                let dtype = if main.shape.first() == Some(&Dim::T) { act } else { DType::F32 };
                TensorType::new(main.shape.clone(), dtype)
            }
            Op::Mul | Op::Add => {
                let (a, b) = (rows(inputs[0], "lhs")?, rows(inputs[1], "rhs")?);
                if a != b {
                    return Err(self.err(format!("operands have {a} and {b} features")));
                }
                act2(a)
            }
            Op::Logits => {
                let h = rows(inputs[0], "x")?;
                let (v, wh) = mat(inputs[1], "weight")?;
                if wh != h {
                    return Err(self.err(format!("x has {h} features but the weight is [{v}, {wh}]")));
                }
                TensorType::new(vec![Dim::R, Dim::N(v)], DType::F32)
            }
        })
    }

    fn err(&self, message: String) -> IrError {
        IrError::Shape { op: self.name().to_string(), message }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_gather_joins_the_last_dimension() {
        let x = TensorType::new(vec![Dim::R, Dim::N(100)], DType::F32);
        let out = Op::AllGather { ranks: 4 }.infer(&[&x], DType::F32).unwrap();
        assert_eq!(out, TensorType::new(vec![Dim::R, Dim::N(400)], DType::F32));
        let v = TensorType::fixed(&[100], DType::F32);
        let e = Op::AllGather { ranks: 2 }.infer(&[&v], DType::F32).unwrap_err().to_string();
        assert!(e.contains("must be [d, n] over 2 ranks"), "{e}");
    }

    #[test]
    fn block_weights_are_whole_blocks_of_their_type() {
        let lin = Op::Linear { bias: false };
        for (dtype, k, ok) in [
            (DType::Q4_0, 32, true),
            (DType::Q4_0, 48, false),
            (DType::Q4_K, 512, true),
            (DType::Q5_K, 256, true),
            (DType::Q6_K, 128, false),
            (DType::Q4_K, 288, false),
        ] {
            let x = TensorType::new(vec![Dim::T, Dim::N(k)], DType::F32);
            let w = TensorType::fixed(&[8, k], dtype);
            let r = lin.infer(&[&x, &w], DType::F32);
            assert_eq!(r.is_ok(), ok, "{w}: {r:?}");
        }
    }

    #[test]
    fn rms_norm_takes_whole_rows_or_groups_that_divide_them() {
        let x = TensorType::new(vec![Dim::T, Dim::N(128)], DType::F32);
        let norm = Op::RmsNorm { eps: 1e-6 };
        for d in [128, 32, 1] {
            let w = TensorType::fixed(&[d], DType::BF16);
            assert_eq!(norm.infer(&[&x, &w], DType::F32).unwrap(), x, "weight [{d}]");
        }
        for bad in [
            TensorType::fixed(&[48], DType::F32),
            TensorType::fixed(&[256], DType::F32),
            TensorType::fixed(&[0], DType::F32),
            TensorType::fixed(&[4, 32], DType::F32),
            TensorType::fixed(&[32], DType::I32),
        ] {
            let e = norm.infer(&[&x, &bad], DType::F32).unwrap_err().to_string();
            assert!(e.contains("with 128 a multiple of d"), "{bad}: {e}");
        }
    }
}
