//! A mixture of experts lowered to launches: the router, then the direct path for one token or
//! the grouped kernels over the (token, expert) pairs sorted by expert.

use crate::keys::{intern, KernelKey};
use crate::schedule::{
    launch, moe_rows_max, moe_up_direct_blocks, one, per_token, to_h16, Arg, Builder, Count, Dim, Launch, Step,
    MOE_DIRECT_TOKENS, MOE_TILE, MOE_UP_ROWS_WARPS, ONE,
};
use crate::CodegenError;
use ir::{DType, Op};

/// A mixture of experts (`kernels/moe.cuh`): the routing (from the router logits, or with
/// the fused router linear `router` its logits computed in f32 from the f32 input, the same
/// for every batch), the chosen experts' gate and up with the activation per (token, expert),
/// their down projections weighted and summed per token (f32 out).
pub(super) fn moe(b: &mut Builder, i: usize, router: Option<usize>) -> Result<(), CodegenError> {
    let n = &b.plan.nodes[i];
    let Op::Moe { top_k: k, norm_topk, act, bias } = &n.op else { unreachable!("a moe") };
    let (k, norm, bias, ins) = (*k, *norm_topk, *bias, n.inputs.clone());
    let act = intern(act.to_cuda());
    let x = b.f32_val(ins[0])?;
    let (e, h, inter) = (b.cols(ins[1]), b.cols(i), b.plan.nodes[ins[2]].ty.dim(1).unwrap_or(0));
    let w = b.wdtype(ins[2]);
    if [ins[3], ins[4]].iter().any(|&j| b.wdtype(j) != w) {
        return Err(CodegenError::Unsupported(format!(
            "`{}`: experts' gate, up and down of different dtypes",
            n.label
        )));
    }
    let bias_of = |j: usize| bias.then(|| b.wdtype(ins[j]));
    let bias_arg = |j: usize| if bias { Arg::Weight(ins[j]) } else { Arg::Null };
    let (up_bias, down_bias) = (bias_of(5), bias_of(7));
    if bias && bias_of(6) != up_bias {
        return Err(CodegenError::Unsupported(format!("`{}`: gate and up biases of different dtypes", n.label)));
    }
    let (ids, weights) = (b.new_val(k, DType::I32, Count::Tokens), b.new_val(k, DType::F32, Count::Tokens));
    let out = b.out(i, DType::F32);
    // The router logits: the fused router linear's, in f32 from the f32 input, or the plan's;
    // where the input's norm was left to this launch (`moe_norm_fuses`), the router applies it
    // at one token (`normed`) and each variant starts with its router launch.
    let (logits, normed) = match router {
        Some(r) => {
            let rin = &b.plan.nodes[r].inputs;
            let (w, rb) = (rin[1], rin.get(2).copied());
            let logits = b.new_val(e, DType::F32, Count::Tokens);
            let key = |norm| KernelKey::MoeRouterLogits { h, e, w: b.wdtype(w), bias: rb.map(|j| b.wdtype(j)), norm };
            let args = vec![Arg::Buf(x), Arg::Weight(w), rb.map_or(Arg::Null, Arg::Weight), Arg::Buf(logits)];
            let grid = [per_token(1, 1), Dim::Fixed(e.div_ceil(8))];
            let plain = launch(key(None), args.clone(), grid, 256);
            let normed = b.fused_norm[ins[0]].clone().map(|n| {
                let args = [&n.args[..], &args[..]].concat();
                [launch(key(Some(n.key)), args, grid, 256), plain.clone()]
            });
            if normed.is_none() {
                b.steps.push(one(plain));
            }
            (logits, normed)
        }
        None => (b.f32_val(ins[1])?, None),
    };
    let route = KernelKey::MoeRoute { e, k, norm, logits: DType::F32 };
    let route = launch(route, vec![Arg::Buf(logits), Arg::Buf(ids), Arg::Buf(weights)], [per_token(1, 1), ONE], 32);
    // 16-bit experts: up to MOE_DIRECT_TOKENS tokens the pairs in token order, the routing in
    // the gate/up launch; above, the grouped kernels over the pairs sorted by expert (faster
    // than per pair from one token, docs/perf.md); others per pair.
    let mut variants = if direct(b, i) {
        let a = b.new_val(k * inter, b.half, Count::Tokens);
        let groups = Grouped { x, ids, weights, out, e, h, inter, k, a, up_bias, down_bias, act };
        let direct = direct_moe(logits, &ins, &groups, norm, &bias_arg);
        let [rows, tiles] = grouped_moe(b, &ins, &groups, &bias_arg);
        let rows_max = moe_rows_max(e, k);
        let mut v = vec![(MOE_DIRECT_TOKENS, direct)];
        if rows_max > MOE_DIRECT_TOKENS {
            v.push((rows_max, [vec![route.clone()], rows].concat()));
        }
        v.push((usize::MAX, [vec![route], tiles].concat()));
        v
    } else {
        let a = b.new_val(k * inter, DType::F32, Count::Tokens);
        let up = KernelKey::MoeUp { h, i: inter, k, w, bias: up_bias, act };
        let up_args = [&[Arg::Buf(x), Arg::Buf(ids)][..], &gate_up_args(&ins, &bias_arg), &[Arg::Buf(a)]].concat();
        let up = launch(up, up_args, [per_token(k, 1), Dim::Fixed(inter.div_ceil(8))], 256);
        let down = KernelKey::MoeDown { h, i: inter, k, w, bias: down_bias };
        let down_args =
            vec![Arg::Buf(a), Arg::Buf(ids), Arg::Buf(weights), Arg::Weight(ins[4]), bias_arg(7), Arg::Buf(out)];
        let down = launch(down, down_args, [per_token(1, 1), Dim::Fixed(h.div_ceil(8))], 256);
        vec![(usize::MAX, vec![route, up, down])]
    };
    if let Some([normed, plain]) = normed {
        for (rows, ls) in &mut variants {
            ls.insert(0, if *rows <= MOE_DIRECT_TOKENS { normed.clone() } else { plain.clone() });
        }
    }
    b.steps.push(Step::Kernels { by: Count::Tokens, variants });
    Ok(())
}

/// Whether mixture of experts `i` runs its experts of the program's 16-bit float through the
/// direct kernels at up to [`MOE_DIRECT_TOKENS`] tokens (and the grouped ones above).
pub(super) fn direct(b: &Builder, i: usize) -> bool {
    let ins = &b.plan.nodes[i].inputs;
    let inter = b.plan.nodes[ins[2]].ty.dim(1).unwrap_or(0);
    ins[2..5].iter().all(|&j| b.wdtype(j) == b.half) && b.cols(i).is_multiple_of(32) && inter.is_multiple_of(32)
}

/// What the grouped MoE kernels share with the per-token ones: buffers and sizes.
struct Grouped {
    x: usize,
    ids: usize,
    weights: usize,
    out: usize,
    e: usize,
    h: usize,
    inter: usize,
    k: usize,
    /// Each pair's activations (16-bit), gate/up's output and down's input.
    a: usize,
    up_bias: Option<DType>,
    down_bias: Option<DType>,
    act: &'static str,
}

/// The experts' gate and up weights and biases, as every gate/up kernel takes them.
fn gate_up_args(ins: &[usize], bias_arg: &impl Fn(usize) -> Arg) -> [Arg; 4] {
    [Arg::Weight(ins[2]), Arg::Weight(ins[3]), bias_arg(5), bias_arg(6)]
}

/// The direct MoE launches of a step of few tokens (`kernels/moe.cuh`): the routing with gate
/// and up a warp per (pair, feature) in turn ([`moe_up_direct_blocks`]), then each token's down
/// projections weighted and summed a warp per output feature, its routing chosen again from the
/// logits so that its first rows load before it waits for the gate/up launch.
fn direct_moe(logits: usize, ins: &[usize], g: &Grouped, norm: bool, bias_arg: &impl Fn(usize) -> Arg) -> Vec<Launch> {
    let Grouped { x, out, e, h, inter, k, a, .. } = *g;
    let up = KernelKey::MoeUpDirect { h, i: inter, k, e, norm, bias: g.up_bias, act: g.act };
    let up_args = [&[Arg::Buf(x), Arg::Buf(logits)][..], &gate_up_args(ins, bias_arg), &[Arg::Buf(a)]].concat();
    let up = launch(up, up_args, [Dim::Fixed(moe_up_direct_blocks(inter, k)), per_token(k, 1)], 256);
    let down = KernelKey::MoeDownDirect { h, i: inter, k, e, norm, bias: g.down_bias };
    let down_args = vec![Arg::Buf(logits), Arg::Buf(a), Arg::Weight(ins[4]), bias_arg(7), Arg::Buf(out)];
    vec![up, launch(down, down_args, [Dim::Fixed(h / 8), per_token(1, 1)], 256)]
}

/// The grouped MoE launches after the routing (`kernels/moe.cuh`): the input in 16 bits, the
/// pairs counted and sorted by expert, gate/up and down over tiles of each expert's pairs, and
/// each token's weighted sum. Two variants over the same buffers: a warp per feature looping
/// over a tile's pairs (few pairs an expert), and tensor-core tiles.
fn grouped_moe(b: &mut Builder, ins: &[usize], g: &Grouped, bias_arg: &impl Fn(usize) -> Arg) -> [Vec<Launch>; 2] {
    let Grouped { x, ids, weights, out, e, h, inter, k, a, .. } = *g;
    let x16 = b.new_val(h, b.half, Count::Tokens);
    let cnt = b.new_val(e, DType::I32, Count::Tokens);
    let (perm, pos_of) = (b.new_val(k, DType::I32, Count::Tokens), b.new_val(k, DType::I32, Count::Tokens));
    // The count, then 3 ints a tile: at most ceil(T k / MOE_TILE) + e tiles, which T (3 k + 3 e
    // + 4) ints hold for any T >= 1 (the bound of `tile_dim`).
    let tiles = b.new_val(3 * (k + e) + 4, DType::I32, Count::Tokens);
    let y = b.new_val(k * h, DType::F32, Count::Tokens);
    let pairs = Arg::Elems(Count::Tokens, k);
    let tile_dim = Dim::Groups(Count::Tokens, k, MOE_TILE, e);
    let to_h16 = to_h16(x, x16, h);
    let count = launch(KernelKey::MoeCount, vec![Arg::Buf(ids), pairs, Arg::Buf(cnt)], [Dim::Fixed(e), ONE], 256);
    let sort_args = vec![Arg::Buf(ids), pairs, Arg::Buf(cnt), Arg::Buf(perm), Arg::Buf(pos_of), Arg::Buf(tiles)];
    let sort = launch(KernelKey::MoeSort { e }, sort_args, [Dim::Fixed(e), ONE], 256);
    let combine = KernelKey::MoeCombine { h, k };
    let combine = launch(combine, vec![Arg::Buf(y), Arg::Buf(pos_of), Arg::Buf(out)], [per_token(1, 1), ONE], 256);
    [true, false].map(|rows| {
        // Tensor-core tiles are 16 features a block; a warp per feature, as many as its warps
        // (down: 8).
        let (up_block, up_threads) = match rows {
            true => (MOE_UP_ROWS_WARPS, 32 * MOE_UP_ROWS_WARPS as u32),
            false => (16, 256),
        };
        let down_block = if rows { 8 } else { 16 };
        let up = KernelKey::MoeUpGrouped { rows, h, i: inter, k, bias: g.up_bias, act: g.act };
        let ins3 = [Arg::Buf(x16), Arg::Buf(perm), Arg::Buf(tiles)];
        let up_args = [&ins3[..], &gate_up_args(ins, bias_arg), &[Arg::Buf(a)]].concat();
        let up = launch(up, up_args, [Dim::Fixed(inter / up_block), tile_dim], up_threads);
        let down = KernelKey::MoeDownGrouped { rows, h, i: inter, bias: g.down_bias };
        let down_args = vec![
            Arg::Buf(a),
            Arg::Buf(perm),
            Arg::Buf(tiles),
            Arg::Buf(weights),
            Arg::Weight(ins[4]),
            bias_arg(7),
            Arg::Buf(y),
        ];
        let down = launch(down, down_args, [Dim::Fixed(h / down_block), tile_dim], 256);
        vec![to_h16.clone(), count.clone(), sort.clone(), up, down, combine.clone()]
    })
}
