//! The graph: ops as petgraph nodes, edges carrying the input slot. Passes in `compiler`
//! rewrite it; [`Graph::verify`] checks it after each one; [`Graph::to_plan`] linearises it.

use crate::fusion::{self, Fusion};
use crate::op::Op;
use crate::plan::{KvLayout, Plan, PlanNode};
use crate::types::{DType, Dim, TensorType};
use crate::IrError;
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::{EdgeRef, IntoEdgeReferences};
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
    /// Sets of nodes one kernel computes (the fusion passes make them; [`crate::fusion`]).
    pub fusions: Vec<Fusion<NodeIndex>>,
}

impl Graph {
    /// An empty graph.
    pub fn new(act_dtype: DType) -> Graph {
        Graph { g: StableDiGraph::new(), output: None, act_dtype, tp: 1, fusions: Vec::new() }
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

    /// Whether `n` is a node of the graph (not removed).
    pub fn contains(&self, n: NodeIndex) -> bool {
        self.g.node_weight(n).is_some()
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

    /// Removes node `n` and its edges (a node a pass made dead), and `n` from its fusion.
    pub fn remove(&mut self, n: NodeIndex) {
        self.g.remove_node(n);
        for f in &mut self.fusions {
            f.nodes.retain(|&m| m != n);
        }
        self.fusions.retain(|f| !f.nodes.is_empty());
    }

    /// The fusion node `n` belongs to, if any.
    pub fn fusion_of(&self, n: NodeIndex) -> Option<&Fusion<NodeIndex>> {
        self.fusions.iter().find(|f| f.nodes.contains(&n))
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
    /// The members of a fusion come out together (the fusion is one unit of the sort, ordered
    /// by its first member), so a fusion whose members depend on each other through a node
    /// outside it (not convex: no one kernel could compute it) is reported as a cycle.
    fn topo(&self) -> Result<Vec<NodeIndex>, IrError> {
        use std::cmp::Reverse;
        if self.fusions.iter().any(|f| f.nodes.is_empty()) {
            return Err(IrError::Verify("a fusion has no nodes".into()));
        }
        let unit_of: HashMap<NodeIndex, usize> =
            self.fusions.iter().enumerate().flat_map(|(u, f)| f.nodes.iter().map(move |&n| (n, u))).collect();
        // A unit is a fusion (its index) or a lone node (`fusions.len()` + its index).
        let lone = self.fusions.len();
        let unit = |n: NodeIndex| unit_of.get(&n).copied().unwrap_or(lone + n.index());
        let members = |u: usize| -> Vec<NodeIndex> {
            if u < lone {
                let mut m = self.fusions[u].nodes.clone();
                m.sort();
                m
            } else {
                vec![NodeIndex::new(u - lone)]
            }
        };
        let mut indegree: HashMap<usize, usize> = self.g.node_indices().map(|n| (unit(n), 0)).collect();
        for e in self.g.edge_references() {
            let (a, b) = (unit(e.source()), unit(e.target()));
            if a != b {
                *indegree.get_mut(&b).expect("every unit has an in-degree") += 1;
            }
        }
        let first = |u: usize| match self.fusions.get(u).and_then(|f| f.nodes.iter().min()) {
            Some(&n) => n,
            None => NodeIndex::new(u - lone),
        };
        let mut ready: std::collections::BinaryHeap<Reverse<(NodeIndex, usize)>> =
            indegree.iter().filter(|(_, &d)| d == 0).map(|(&u, _)| Reverse((first(u), u))).collect();
        let mut order = Vec::with_capacity(self.g.node_count());
        while let Some(Reverse((_, u))) = ready.pop() {
            let ms = members(u);
            order.extend(self.inner_order(&ms)?);
            for &n in &ms {
                for e in self.g.edges_directed(n, Direction::Outgoing) {
                    let t = unit(e.target());
                    if t == u {
                        continue;
                    }
                    let d = indegree.get_mut(&t).expect("every unit has an in-degree");
                    *d -= 1;
                    if *d == 0 {
                        ready.push(Reverse((first(t), t)));
                    }
                }
            }
        }
        if order.len() != self.g.node_count() {
            let stuck =
                indegree.iter().find(|(_, &d)| d > 0).map(|(&u, _)| self.g[first(u)].label.clone()).unwrap_or_default();
            return Err(IrError::Verify(format!(
                "the graph has a cycle through `{stuck}` (or a fusion that depends on itself through another node)"
            )));
        }
        Ok(order)
    }

    /// The members of one fusion (sorted by index) in an order that respects their edges.
    fn inner_order(&self, ms: &[NodeIndex]) -> Result<Vec<NodeIndex>, IrError> {
        let mut left: Vec<NodeIndex> = ms.to_vec();
        let mut order = Vec::with_capacity(ms.len());
        while !left.is_empty() {
            let pos = left
                .iter()
                .position(|&n| self.inputs(n).iter().all(|i| !left.contains(i)))
                .ok_or_else(|| IrError::Verify(format!("a fusion has a cycle through `{}`", self.g[left[0]].label)))?;
            order.push(left.remove(pos));
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
        self.verify_fusions()?;
        let n_logits = order.iter().filter(|&&n| matches!(self.g[n].op, Op::Logits)).count();
        if n_logits != 1 {
            return Err(IrError::Verify(format!("{n_logits} logits ops; the graph needs exactly one")));
        }
        Ok(())
    }

    /// Every fusion fits its kind's rule and no node is in two.
    fn verify_fusions(&self) -> Result<(), IrError> {
        let mut seen = std::collections::HashSet::new();
        for f in &self.fusions {
            if let Some(&n) = f.nodes.iter().find(|&&n| !seen.insert(n) || self.g.node_weight(n).is_none()) {
                let what = self.g.node_weight(n).map_or("a removed node".into(), |w| format!("`{}`", w.label));
                return Err(IrError::Verify(format!("{what} is in two fusions, or a fusion names a removed node")));
            }
            fusion::check(self, f).map_err(|e| {
                let at = f.nodes.first().map_or(String::new(), |&n| self.g[n].label.clone());
                IrError::Verify(format!("fusion at `{at}`: {e}"))
            })?;
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
        let mut fusions = Vec::new();
        for f in &self.fusions {
            let nodes: Vec<usize> = f.nodes.iter().filter_map(|n| ids.get(n).copied()).collect();
            match nodes.len() {
                0 => {}
                n if n == f.nodes.len() => fusions.push(Fusion { kind: f.kind, nodes }),
                _ => {
                    return Err(IrError::Verify(format!("a {} fusion is partly dead", f.kind.name())));
                }
            }
        }
        Ok(Plan { output: ids[&out], nodes, act_dtype: self.act_dtype, kv, tp: self.tp, vocab, fusions })
    }
}

impl fusion::View<NodeIndex> for Graph {
    fn op(&self, n: NodeIndex) -> &Op {
        &self.g[n].op
    }

    fn ins(&self, n: NodeIndex) -> Vec<NodeIndex> {
        self.inputs(n)
    }

    fn width(&self, n: NodeIndex) -> usize {
        self.g[n].ty.last().unwrap_or(0)
    }

    fn readers(&self, n: NodeIndex) -> Vec<NodeIndex> {
        let mut r = self.users(n);
        r.sort();
        r.dedup();
        r
    }
}
