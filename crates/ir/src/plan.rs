//! The plan: the verified graph as a flat program in topological order, serialised into the
//! bundle as `plan.json`. The runtime executes plans; it never sees graphs or passes.

use crate::fusion::Fusion;
use crate::op::Op;
use crate::types::{DType, TensorType};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// Shape of the KV cache the plan's attention ops use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// Number of attention layers.
    pub layers: usize,
    /// KV heads per rank.
    pub kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
}

impl KvLayout {
    /// Floats of K (or of V) per token per layer.
    pub fn row(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// One step of the program.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanNode {
    /// The operation.
    #[serde(flatten)]
    pub op: Op,
    /// Indices of earlier nodes, in slot order.
    pub inputs: Vec<usize>,
    /// Output type.
    pub ty: TensorType,
    /// Where it came from in the model YAML.
    pub label: String,
}

/// A forward step as a flat program.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Nodes in topological order.
    pub nodes: Vec<PlanNode>,
    /// Index of the logits node.
    pub output: usize,
    /// Element type of activations.
    pub act_dtype: DType,
    /// KV cache layout (per rank).
    pub kv: KvLayout,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Vocabulary size (columns of the logits).
    pub vocab: usize,
    /// Sets of consecutive nodes one kernel computes ([`crate::fusion`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fusions: Vec<Fusion<usize>>,
}

impl Plan {
    /// Checks a step's inputs against the plan: every token id inside the vocabulary, every
    /// requested logit row inside the step. Backends call it before running anything.
    pub fn check_step(&self, tokens: &[u32], rows: &[usize]) -> Result<(), crate::IrError> {
        let vocab = self.vocab;
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(crate::IrError::Input(format!("token id {t} is outside the vocabulary (size {vocab})")));
        }
        if let Some(r) = rows.iter().find(|&&r| r >= tokens.len()) {
            return Err(crate::IrError::Input(format!(
                "logit row {r} is outside the {} tokens of the step",
                tokens.len()
            )));
        }
        Ok(())
    }

    /// The logits node: the plan's one `logits` op (its input is the final hidden state).
    pub fn logits_node(&self) -> Option<usize> {
        self.nodes.iter().position(|n| matches!(n.op, Op::Logits))
    }

    /// Features of the final hidden state (the `logits` op's input: after the final norm),
    /// what an embedding pools; 0 when the plan has no `logits` op.
    pub fn hidden_size(&self) -> usize {
        self.logits_node().and_then(|i| self.nodes[self.nodes[i].inputs[0]].ty.last()).unwrap_or(0)
    }

    /// The weights the plan reads: (name, shape, dtype).
    pub fn weights(&self) -> impl Iterator<Item = (&str, &[usize], DType)> {
        self.nodes.iter().filter_map(|n| match &n.op {
            Op::Weight { name, shape, dtype, .. } => Some((name.as_str(), shape.as_slice(), *dtype)),
            _ => None,
        })
    }

    /// Bytes of the weights the plan reads per rank, as stored (block types as blocks).
    pub fn weight_bytes(&self) -> usize {
        (0..self.nodes.len()).map(|i| self.bytes_of(i)).sum()
    }

    /// The bytes of node `i` when it is a weight.
    fn bytes_of(&self, i: usize) -> usize {
        match &self.nodes[i].op {
            Op::Weight { shape, dtype, .. } => dtype.bytes(shape.iter().product()).unwrap_or(0),
            _ => 0,
        }
    }

    /// How decode steps read the weights: the experts' stacks of each mixture of experts
    /// apart from the rest; an embedding table that nothing else reads (untied) is left out
    /// (a token reads one row of it).
    pub fn weight_use(&self) -> WeightUse {
        let mut experts = Vec::new();
        let mut stacked = std::collections::HashSet::new();
        for (stacks, k, e) in self.moe_stacks() {
            experts.push((stacks.iter().map(|&i| self.bytes_of(i)).sum(), k, e));
            stacked.extend(stacks.iter().copied());
        }
        // A table only the embedding reads gives one row per token.
        let mut gathered = vec![None; self.nodes.len()];
        for n in &self.nodes {
            for &i in &n.inputs {
                let only = gathered[i].unwrap_or(true) && matches!(n.op, Op::Embedding);
                gathered[i] = Some(only);
            }
        }
        let dense = (0..self.nodes.len())
            .filter(|&i| !stacked.contains(&i) && gathered[i] != Some(true))
            .map(|i| self.bytes_of(i))
            .sum();
        WeightUse { dense, experts }
    }

    /// Each mixture of experts' weight stacks (plan nodes), with its experts per token and its
    /// experts.
    pub fn moe_stacks(&self) -> impl Iterator<Item = (&[usize], usize, usize)> + '_ {
        self.nodes.iter().filter_map(|n| match n.op {
            Op::Moe { top_k, .. } => {
                let e = self.nodes[n.inputs[1]].ty.last().unwrap_or(1);
                Some((&n.inputs[2..], top_k, e))
            }
            _ => None,
        })
    }

    /// Multiply-adds per token of the linears and of the experts a token chooses (2 FLOPs
    /// each): the matmul work of a prefill.
    pub fn matmul_params(&self) -> usize {
        let size = |i| self.weight_size(i);
        self.nodes
            .iter()
            .map(|n| match n.op {
                Op::Linear { .. } => size(n.inputs[1]),
                Op::Moe { top_k, .. } => {
                    let e = self.nodes[n.inputs[1]].ty.last().unwrap_or(1);
                    n.inputs[2..5].iter().map(|&i| size(i)).sum::<usize>() / e * top_k
                }
                _ => 0,
            })
            .sum()
    }

    /// Multiply-adds per logits row (each `logits` node's vocabulary x hidden): the lm_head's
    /// matmul work, which a decode step does once per sequence.
    pub fn logits_params(&self) -> usize {
        self.nodes.iter().filter(|n| matches!(n.op, Op::Logits)).map(|n| self.weight_size(n.inputs[1])).sum()
    }

    /// Elements of node `i` when it is a weight (0 for any other node).
    fn weight_size(&self, i: usize) -> usize {
        match &self.nodes[i].op {
            Op::Weight { shape, .. } => shape.iter().product(),
            _ => 0,
        }
    }

    /// The program as text, one node per line:
    /// `%7 = linear(%5, @model.layers.0.mlp.up_proj.weight) : [T, 192] bf16  # L0.up`.
    /// Weights are declared first (`@name : [64] bf16`; a derived one `@name : [64] f32 =
    /// map{expr=..}(@source)`) and appear inline as `@name`; the members of a
    /// fusion sit indented between `fuse KIND {` and `}`. This is what the compiler's golden
    /// tests compare.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "plan tp={} act={} vocab={} kv(layers={}, kv_heads={}, head_dim={})",
            self.tp, self.act_dtype, self.vocab, self.kv.layers, self.kv.kv_heads, self.kv.head_dim
        );
        for n in &self.nodes {
            if let Op::Weight { name, derived, .. } = &n.op {
                let from =
                    derived.as_ref().map_or(String::new(), |d| format!(" = map{{expr={}}}(@{})", d.expr, d.source));
                let _ = writeln!(s, "@{name} : {}{from}", n.ty);
            }
        }
        let mut number = vec![0usize; self.nodes.len()];
        let mut next = 0;
        for (i, n) in self.nodes.iter().enumerate() {
            if matches!(n.op, Op::Weight { .. }) {
                continue;
            }
            number[i] = next;
            next += 1;
            let args: Vec<String> = n
                .inputs
                .iter()
                .map(|&j| match &self.nodes[j].op {
                    Op::Weight { name, .. } => format!("@{name}"),
                    _ => format!("%{}", number[j]),
                })
                .collect();
            let attrs = n.op.attrs();
            let attrs = if attrs.is_empty() { String::new() } else { format!("{{{attrs}}}") };
            let out = if i == self.output { "  (output)" } else { "" };
            let fusion = self.fusions.iter().find(|f| f.nodes.contains(&i));
            if let Some(f) = fusion.filter(|f| f.nodes.iter().min() == Some(&i)) {
                let _ = writeln!(s, "fuse {} {{", f.kind.name());
            }
            let _ = writeln!(
                s,
                "{}%{} = {}{attrs}({}) : {}  # {}{out}",
                if fusion.is_some() { "  " } else { "" },
                number[i],
                n.op.name(),
                args.join(", "),
                n.ty,
                n.label
            );
            if fusion.is_some_and(|f| f.nodes.iter().max() == Some(&i)) {
                let _ = writeln!(s, "}}");
            }
        }
        s
    }
}

/// The weight bytes of a plan as decode steps read them ([`Plan::weight_use`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WeightUse {
    /// Bytes every step reads whole.
    pub dense: usize,
    /// Each mixture of experts' stacks: (bytes of all its experts, experts per token, experts).
    pub experts: Vec<(usize, usize, usize)>,
}

impl WeightUse {
    /// The bytes a decode step of `rows` tokens reads: the dense weights, and of each stack the
    /// experts the rows choose: `k` of `E` for one row; for more, the expected number of
    /// distinct experts were each row's choice uniform, `E · (1 − (1 − k/E)^rows)`.
    pub fn at(&self, rows: usize) -> f64 {
        self.dense as f64 + self.experts.iter().map(|&(b, k, e)| b as f64 * chosen_share(k, e, rows)).sum::<f64>()
    }
}

/// The share of a stack of `e` experts that `rows` tokens choosing `k` each read: `k / e` for
/// one row; for more, the expected share of distinct experts were each row's choice uniform,
/// `1 − (1 − k/E)^rows` (what [`WeightUse::at`] and the CUDA profile count).
pub fn chosen_share(k: usize, e: usize, rows: usize) -> f64 {
    1.0 - (1.0 - k as f64 / e.max(1) as f64).powi(rows.min(i32::MAX as usize) as i32)
}

#[cfg(test)]
mod tests {
    /// Tied table, an untied embedding table, a router and 4 experts of 8 x 32 (bf16), 2 per token.
    const MOE: &str = "plan tp=1 act=bf16 vocab=16 kv(layers=0, kv_heads=0, head_dim=0)
@table : [16, 32] bf16
@head : [16, 32] bf16
@router : [4, 32] bf16
@gate : [4, 8, 32] bf16
@up : [4, 8, 32] bf16
@down : [4, 32, 8] bf16
%0 = tokens() : [T] i32  # tokens
%1 = embedding(%0, @table) : [T, 32] bf16  # x
%2 = linear(%1, @router) : [T, 4] bf16  # logits
%3 = moe{top_k=2, norm_topk=true, act=(silu(x0) * x1), bias=false}(%1, %2, @gate, @up, @down) : [T, 32] bf16  # moe
%4 = logits(%3, @head) : [R, 16] f32  # logits  (output)
";

    #[test]
    fn a_token_reads_its_chosen_experts_and_not_the_embedding_table() {
        let plan = crate::text::parse(MOE).unwrap().to_plan().unwrap();
        let u = plan.weight_use();
        // The lm_head and the router; the table only the embedding reads is left out.
        assert_eq!(u.dense, (16 * 32 + 4 * 32) * 2);
        assert_eq!(u.experts, vec![(3 * 4 * 8 * 32 * 2, 2, 4)]);
        assert_eq!(u.at(1), (u.dense + 3 * 2 * 8 * 32 * 2) as f64);
        // Two rows choose 4 · (1 − (1/2)²) = 3 experts on average.
        assert_eq!(u.at(2), u.dense as f64 + 3.0 * (3 * 8 * 32 * 2) as f64);
        assert!(u.at(1000) <= (u.dense + u.experts[0].0) as f64);
        // The stacks the CUDA profile counts by the same share: @gate, @up and @down.
        let stacks: Vec<_> = plan.moe_stacks().map(|(ws, k, e)| (ws.to_vec(), k, e)).collect();
        let name = |w: usize| match &plan.nodes[w].op {
            crate::Op::Weight { name, .. } => name.clone(),
            op => op.name().to_string(),
        };
        let names: Vec<_> = stacks[0].0.iter().map(|&w| name(w)).collect();
        assert_eq!((stacks.len(), stacks[0].1, stacks[0].2), (1, 2, 4));
        assert_eq!(names, ["gate", "up", "down"]);
        assert_eq!((super::chosen_share(2, 4, 1), super::chosen_share(2, 4, 2)), (0.5, 0.75));
        // The router's 4 x 32 and two experts' gate, up and down per token.
        assert_eq!(plan.matmul_params(), 4 * 32 + 2 * 3 * 8 * 32);
        assert_eq!(plan.logits_params(), 16 * 32);
    }
}
