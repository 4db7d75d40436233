//! A mixture of experts on the CPU backend ([`ir::Op::Moe`]): rows routed on the host by
//! `ir::moe::route`, then grouped by expert, so that each chosen expert's weights are read
//! once per step (and experts no row chose are not read at all) by the JIT linear kernels;
//! the activation is the op's own expression (`MapKernel`).

use codegen_cpu::{BinaryKernel, LinearKernel, MapKernel, Pool};
use ir::DType;
use std::sync::Arc;

/// The kernels and sizes of one MoE node.
pub(crate) struct MoeKernels {
    /// `x [n, H] → [n, I]` (the gate and up projections).
    pub gate: Arc<LinearKernel>,
    /// `[n, I] → [n, H]`.
    pub down: Arc<LinearKernel>,
    /// `act(gate, up)` over `[n, I]`.
    pub act: Arc<MapKernel>,
    /// How many of (gate, up) `act` reads.
    pub act_inputs: usize,
    /// Adds a bias row.
    pub add: Arc<BinaryKernel>,
    /// Experts per row and whether the softmax is over them only.
    pub top_k: usize,
    pub norm_topk: bool,
    /// Experts, intermediate size, hidden size.
    pub sizes: (usize, usize, usize),
    /// The experts' weight dtype.
    pub wdtype: DType,
}

/// What one MoE node reads: x, router logits, the gate/up/down stacks and their biases.
pub(crate) struct MoeInputs<'a> {
    pub x: &'a [f32],
    pub logits: &'a [f32],
    pub weights: [&'a [u8]; 3],
    pub bias: Option<[&'a [f32]; 3]>,
}

impl MoeKernels {
    /// Writes the MoE's output for every row of `inp.x` into `out` (zeroed here).
    pub fn run(&self, pool: &Pool, inp: &MoeInputs, out: &mut [f32]) {
        let (experts, inter, hidden) = self.sizes;
        let rows = inp.x.len() / hidden.max(1);
        let mut chosen: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts];
        for t in 0..rows {
            for (e, w) in ir::moe::route(&inp.logits[t * experts..(t + 1) * experts], self.top_k, self.norm_topk) {
                chosen[e].push((t, w));
            }
        }
        out.fill(0.0);
        let bytes = |n: usize| self.wdtype.bytes(n).unwrap_or(0);
        let (up_size, down_size) = (bytes(inter * hidden), bytes(hidden * inter));
        for (e, picked) in chosen.iter().enumerate().filter(|(_, p)| !p.is_empty()) {
            let n = picked.len();
            let xs: Vec<f32> =
                picked.iter().flat_map(|&(t, _)| &inp.x[t * hidden..(t + 1) * hidden]).copied().collect();
            let part = |k: usize, size: usize| &inp.weights[k][e * size..(e + 1) * size];
            let bias = |k: usize, len: usize| inp.bias.map(|b| &b[k][e * len..(e + 1) * len]);
            let (mut g, mut u) = (vec![0.0; n * inter], vec![0.0; n * inter]);
            self.gate.run(pool, &xs, part(0, up_size), &mut g);
            self.gate.run(pool, &xs, part(1, up_size), &mut u);
            self.add_rows(&mut g, bias(0, inter));
            self.add_rows(&mut u, bias(1, inter));
            let mut a = vec![0.0; n * inter];
            self.act.run(&[&g[..], &u[..]][..self.act_inputs], &mut a);
            let mut y = vec![0.0; n * hidden];
            self.down.run(pool, &a, part(2, down_size), &mut y);
            self.add_rows(&mut y, bias(2, hidden));
            for (r, &(t, w)) in picked.iter().enumerate() {
                for (o, v) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(&y[r * hidden..(r + 1) * hidden]) {
                    *o += w * v;
                }
            }
        }
    }

    fn add_rows(&self, v: &mut [f32], bias: Option<&[f32]>) {
        if let Some(b) = bias {
            for row in v.chunks_mut(b.len()) {
                self.add.run_in_place(row, b);
            }
        }
    }
}
