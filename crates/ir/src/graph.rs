//! The graph: ops as petgraph nodes, edges carrying the input slot. Passes in `compiler`
//! rewrite it; [`Graph::verify`] checks it after each one; [`Graph::to_plan`] linearises it.

use crate::op::Op;
use crate::plan::{KvLayout, Plan, PlanNode};
use crate::types::{DType, Dim, TensorType};
use crate::IrError;
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::collections::{BTreeMap, HashMap};

/// A node: an op, its inferred output type, and a label for people (`L3.q`).
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// The operation.
    pub op: Op,
    /// Output type.
    pub ty: TensorType,
    /// Where it came from in the model YAML (variable name, layer).
    pub label: String,
}

/// A model's forward step as a dataflow graph.
#[derive(Debug, Clone)]
pub struct Graph {
    g: StableDiGraph<Node, usize>,
    /// The logits node.
    pub output: Option<NodeIndex>,
    /// Element type of activations.
    pub act_dtype: DType,
    /// Number of tensor-parallel ranks the graph is written for.
    pub tp: usize,
}

impl Graph {
    /// An empty graph.
    pub fn new(act_dtype: DType) -> Graph {
        Graph { g: StableDiGraph::new(), output: None, act_dtype, tp: 1 }
    }

    /// Adds a node after checking and inferring its type.
    pub fn add(&mut self, op: Op, inputs: &[NodeIndex], label: impl Into<String>) -> Result<NodeIndex, IrError> {
        let tys: Vec<&TensorType> = inputs.iter().map(|&i| &self.g[i].ty).collect();
        let label = label.into();
        let ty = op.infer(&tys, self.act_dtype).map_err(|e| e.at(&label))?;
        let n = self.g.add_node(Node { op, ty, label });
        for (slot, &i) in inputs.iter().enumerate() {
            self.g.add_edge(i, n, slot);
        }
        Ok(n)
    }

    /// The node at `n`.
    pub fn node(&self, n: NodeIndex) -> &Node {
        &self.g[n]
    }

    /// Mutable access to the node at `n` (call [`Graph::reinfer`] after changing its op).
    pub fn node_mut(&mut self, n: NodeIndex) -> &mut Node {
        &mut self.g[n]
    }

    /// Inputs of `n` in slot order.
    pub fn inputs(&self, n: NodeIndex) -> Vec<NodeIndex> {
        let mut e: Vec<(usize, NodeIndex)> =
            self.g.edges_directed(n, Direction::Incoming).map(|e| (*e.weight(), e.source())).collect();
        e.sort();
        e.into_iter().map(|(_, s)| s).collect()
    }

    /// All node indices, in insertion order.
    pub fn nodes(&self) -> Vec<NodeIndex> {
        self.g.node_indices().collect()
    }

    /// Removes node `n` and its edges (a node a pass made dead).
    pub fn remove(&mut self, n: NodeIndex) {
        self.g.remove_node(n);
    }

    /// The nodes that read `n`, once per input slot.
    pub fn users(&self, n: NodeIndex) -> Vec<NodeIndex> {
        self.g.edges_directed(n, Direction::Outgoing).map(|e| e.target()).collect()
    }

    /// Points every use of `old` (except by `except`) at `new`.
    pub fn replace_uses(&mut self, old: NodeIndex, new: NodeIndex, except: NodeIndex) {
        let uses: Vec<_> = self
            .g
            .edges_directed(old, Direction::Outgoing)
            .filter(|e| e.target() != except)
            .map(|e| (e.id(), e.target(), *e.weight()))
            .collect();
        for (id, target, slot) in uses {
            self.g.remove_edge(id);
            self.g.add_edge(new, target, slot);
        }
        if self.output == Some(old) {
            self.output = Some(new);
        }
    }

    /// Re-infers the types of every node in topological order (after a pass changed shapes).
    pub fn reinfer(&mut self) -> Result<(), IrError> {
        for n in self.topo()? {
            let ins = self.inputs(n);
            let tys: Vec<&TensorType> = ins.iter().map(|&i| &self.g[i].ty).collect();
            let node = &self.g[n];
            let ty = node.op.infer(&tys, self.act_dtype).map_err(|e| e.at(&node.label))?;
            self.g[n].ty = ty;
        }
        Ok(())
    }

    /// Topological order that keeps insertion order wherever dependencies allow (Kahn's
    /// algorithm, smallest index first), so plans follow the model YAML's statement order.
    fn topo(&self) -> Result<Vec<NodeIndex>, IrError> {
        use std::cmp::Reverse;
        let mut indegree: HashMap<NodeIndex, usize> =
            self.g.node_indices().map(|n| (n, self.g.edges_directed(n, Direction::Incoming).count())).collect();
        let mut ready: std::collections::BinaryHeap<Reverse<NodeIndex>> =
            indegree.iter().filter(|(_, &d)| d == 0).map(|(&n, _)| Reverse(n)).collect();
        let mut order = Vec::with_capacity(indegree.len());
        while let Some(Reverse(n)) = ready.pop() {
            order.push(n);
            for e in self.g.edges_directed(n, Direction::Outgoing) {
                let d = indegree.get_mut(&e.target()).expect("every node has an in-degree");
                *d -= 1;
                if *d == 0 {
                    ready.push(Reverse(e.target()));
                }
            }
        }
        if order.len() != indegree.len() {
            let stuck =
                indegree.iter().find(|(_, &d)| d > 0).map(|(&n, _)| self.g[n].label.clone()).unwrap_or_default();
            return Err(IrError::Verify(format!("the graph has a cycle through `{stuck}`")));
        }
        Ok(order)
    }

    /// Checks the graph: acyclic; every node's inputs fit its op and its stored type is the
    /// inferred one; one logits output; weight names unique; attention layers numbered
    /// 0..L with one KV layout.
    pub fn verify(&self) -> Result<(), IrError> {
        let order = self.topo()?;
        let mut weights: HashMap<&str, NodeIndex> = HashMap::new();
        let mut layers: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
        for &n in &order {
            let node = &self.g[n];
            let ins = self.inputs(n);
            let tys: Vec<&TensorType> = ins.iter().map(|&i| &self.g[i].ty).collect();
            let ty = node.op.infer(&tys, self.act_dtype).map_err(|e| IrError::Verify(e.at(&node.label).to_string()))?;
            if ty != node.ty {
                return Err(IrError::Verify(format!(
                    "`{}` ({}) is typed {} but its inputs give {ty}",
                    node.label, node.op, node.ty
                )));
            }
            match &node.op {
                Op::Weight { name, .. } if weights.insert(name, n).is_some() => {
                    return Err(IrError::Verify(format!("weight `{name}` appears in two nodes")));
                }
                Op::Attention { kv_heads, head_dim, layer, .. }
                    if layers.insert(*layer, (*kv_heads, *head_dim)).is_some() =>
                {
                    return Err(IrError::Verify(format!("two attention ops use KV layer {layer}")));
                }
                _ => {}
            }
        }
        if !layers.keys().copied().eq(0..layers.len()) {
            return Err(IrError::Verify(format!(
                "attention layers are {:?}, not 0..{}",
                layers.keys().collect::<Vec<_>>(),
                layers.len()
            )));
        }
        if layers.values().any(|l| Some(l) != layers.values().next()) {
            return Err(IrError::Verify("attention layers have different KV layouts".into()));
        }
        let out = self.output.ok_or_else(|| IrError::Verify("the graph has no output (assign `logits`)".into()))?;
        let o = &self.g[out];
        if o.ty.shape.first() != Some(&Dim::R) || o.ty.dtype != DType::F32 {
            return Err(IrError::Verify(format!(
                "the output `{}` is a {} of {}, not logit rows ([R, vocab] f32)",
                o.label, o.op, o.ty
            )));
        }
        let n_logits = order.iter().filter(|&&n| matches!(self.g[n].op, Op::Logits)).count();
        if n_logits != 1 {
            return Err(IrError::Verify(format!("{n_logits} logits ops; the graph needs exactly one")));
        }
        Ok(())
    }

    /// Linearises the verified graph into a [`Plan`], dropping nodes the output does not use.
    pub fn to_plan(&self) -> Result<Plan, IrError> {
        self.verify()?;
        let out = self.output.ok_or_else(|| IrError::Verify("no output".into()))?;
        let mut live = vec![out];
        let mut seen = std::collections::HashSet::from([out]);
        while let Some(n) = live.pop() {
            for i in self.inputs(n) {
                if seen.insert(i) {
                    live.push(i);
                }
            }
        }
        let mut ids = HashMap::new();
        let mut nodes = Vec::new();
        let mut kv = KvLayout::default();
        for n in self.topo()?.into_iter().filter(|n| seen.contains(n)) {
            let node = &self.g[n];
            if let Op::Attention { kv_heads, head_dim, .. } = node.op {
                kv = KvLayout { layers: kv.layers + 1, kv_heads, head_dim };
            }
            ids.insert(n, nodes.len());
            nodes.push(PlanNode {
                op: node.op.clone(),
                inputs: self.inputs(n).iter().map(|i| ids[i]).collect(),
                ty: node.ty.clone(),
                label: node.label.clone(),
            });
        }
        let vocab = self.g[out].ty.last().unwrap_or(0);
        Ok(Plan { output: ids[&out], nodes, act_dtype: self.act_dtype, kv, tp: self.tp, vocab })
    }
}
