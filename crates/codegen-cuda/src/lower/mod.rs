//! Lowering of plan nodes and fusions to launches (the schedule module says which).

use crate::keys::{intern, KernelKey, NormIn, MAP_INPUTS};
use crate::schedule::{
    gemv_rows, launch, one, per_token, skinny_takes, Arg, Builder, Count, Dim, FusedNorm, Input, Launch, Step,
    MOE_DIRECT_TOKENS, NORM_IN_GEMV_ROWS, ONE, SKINNY_ROWS,
};
use crate::{CodegenError, WFormat};
use attention::{attention, head_norm_fuses};
use ir::{DType, FusionKind, Op};
use moe::moe;

mod attention;
mod moe;

/// Lowers fusion `f` of the plan: one kernel, or its members one by one where the fast path
/// cannot take them.
pub(crate) fn fusion(b: &mut Builder, f: usize) -> Result<(), CodegenError> {
    let nodes = b.plan.fusions[f].nodes.clone();
    match (b.plan.fusions[f].kind, &nodes[..]) {
        (FusionKind::AddNorm, &[a, n]) => {
            let ins = &b.plan.nodes[a].inputs;
            let (x, y) = (b.f32_val(ins[0])?, b.f32_val(ins[1])?);
            let s = b.out(a, DType::F32);
            rms_norm(b, n, x, Some((y, s)));
        }
        (FusionKind::NormAddNorm, &[n1, a, n2]) => norm_add_norm(b, [n1, a, n2])?,
        (FusionKind::Linears, ls) => linears(b, ls)?,
        (FusionKind::Glu, &[g, u, s, m]) => {
            let xn = b.plan.nodes[g].inputs[0];
            let wf = b.fast_format(g).filter(|&f| Some(f) == b.fast_format(u));
            if let Some(wf) = wf.filter(|_| b.feeds_linears(m)) {
                let x = b.half_input(xn)?;
                let norm = b.fused_norm[xn].clone();
                glu(b, x, b.cols(xn), [g, u, s, m], norm.as_ref(), wf)?;
            } else {
                linears(b, &[g, u])?;
                node(b, s)?;
                node(b, m)?;
            }
        }
        (FusionKind::RopeAttention, [pre @ .., a]) => attention(b, *a, pre)?,
        (FusionKind::MoeRouter, &[r, m]) => moe(b, m, Some(r))?,
        (kind, _) => return Err(CodegenError::Unsupported(format!("a malformed {} fusion", kind.name()))),
    }
    Ok(())
}

/// Lowers node `i` alone.
pub(crate) fn node(b: &mut Builder, i: usize) -> Result<(), CodegenError> {
    let n = &b.plan.nodes[i];
    let cols = b.cols(i);
    let elementwise = |key, args: Vec<Arg>| one(launch(key, args, [per_token(cols, 256), ONE], 256));
    match &n.op {
        Op::Tokens | Op::Positions | Op::Weight { .. } => {}
        Op::Embedding => {
            let out = b.out(i, DType::F32);
            let w = b.wdtype(n.inputs[1]);
            let key = match WFormat::gguf_of(w) {
                Some(wf) => {
                    KernelKey::EmbeddingBlocks { h: cols, rows: b.plan.nodes[n.inputs[1]].ty.dim(0).unwrap_or(0), wf }
                }
                None => KernelKey::Embedding { h: cols, w },
            };
            let args = vec![Arg::Input(Input::Ids), Arg::Weight(n.inputs[1]), Arg::Buf(out)];
            b.steps.push(one(launch(key, args, [per_token(1, 1), ONE], 256)));
        }
        Op::Add => {
            let (x, y) = (b.f32_val(n.inputs[0])?, b.f32_val(n.inputs[1])?);
            let s = b.out(i, DType::F32);
            let args = vec![Arg::Buf(x), Arg::Buf(y), Arg::Buf(s), Arg::Elems(Count::Tokens, cols)];
            b.steps.push(elementwise(KernelKey::Add, args));
        }
        Op::RmsNorm { .. } => {
            let x = b.f32_val(n.inputs[0])?;
            rms_norm(b, i, x, None);
        }
        Op::Linear { .. } => linears(b, &[i])?,
        Op::Rope { head_dim, theta, scaling, .. } => {
            let rot = n.op.rotary_dim();
            let (inv, scale) = scaling.inv_freq(rot, *theta);
            b.constants.push(inv.iter().map(|&f| f as f32).collect());
            let c = Arg::Const(b.constants.len() - 1);
            let x = b.f32_val(n.inputs[0])?;
            let out = b.out(i, DType::F32);
            let key = KernelKey::Rope { cols, d: *head_dim, rot };
            let args = vec![Arg::Buf(x), Arg::Input(Input::Pos), c, Arg::F32(scale as f32), Arg::Buf(out)];
            b.steps.push(one(launch(key, args, [per_token(1, 1), ONE], 128)));
        }
        Op::Attention { .. } => attention(b, i, &[])?,
        Op::Silu => {
            let (a, out) = (b.f32_val(n.inputs[0])?, b.out(i, DType::F32));
            b.steps
                .push(elementwise(KernelKey::Silu, vec![Arg::Buf(a), Arg::Buf(out), Arg::Elems(Count::Tokens, cols)]));
        }
        Op::Map { expr } => map(b, i, expr)?,
        Op::Mul => {
            let (x, y) = (b.f32_val(n.inputs[0])?, b.f32_val(n.inputs[1])?);
            let out = b.out(i, DType::F32);
            let args = vec![Arg::Buf(x), Arg::Buf(y), Arg::Buf(out), Arg::Elems(Count::Tokens, cols)];
            b.steps.push(elementwise(KernelKey::Mul, args));
        }
        Op::AllReduce => {
            let v = b.f32_val(n.inputs[0])?;
            b.node_val[i] = Some(v);
            b.steps.push(Step::AllReduce { buf: v, cols });
        }
        Op::Logits => logits(b, i)?,
        Op::Moe { .. } => moe(b, i, None)?,
        Op::AllGather { .. } => {
            let x = n.inputs[0];
            if !matches!(b.plan.nodes[x].op, Op::Logits) {
                return Err(CodegenError::Unsupported(format!("`{}`: an all_gather of anything but logits", n.label)));
            }
            let (src, dst) = (b.val(x)?, b.new_val(cols, DType::F32, Count::Rows));
            b.node_val[i] = Some(dst);
            b.steps.push(Step::AllGather { src, dst, cols: b.cols(x) });
        }
    }
    Ok(())
}

/// RMS norm node `c` of the f32 value `x` (plus `y`, the sum written to `s`, for a residual
/// add): one launch, over rows or, for a norm in groups of its weight's size (per head), over
/// the groups as rows; except in steps of at most [`NORM_IN_GEMV_ROWS`] tokens where a norm of
/// whole rows only feeds the GEMVs of one launch, which apply it themselves.
fn rms_norm(b: &mut Builder, c: usize, x: usize, add: Option<(usize, usize)>) {
    let Op::RmsNorm { eps } = b.plan.nodes[c].op else { unreachable!("an RMS norm") };
    let w = b.plan.nodes[c].inputs[1];
    let out = b.out(c, b.act_dtype(c));
    let (y, s) = add.map_or((Arg::Null, Arg::Null), |(y, s)| (Arg::Buf(y), Arg::Buf(s)));
    let group = b.cols(w);
    let key = KernelKey::AddRmsNorm { h: group, w: b.wdtype(w), add: add.is_some(), out: b.vals_dtype(out) };
    let args = vec![Arg::Buf(x), y, s, Arg::Weight(w), Arg::Buf(out), Arg::F32(eps)];
    let l = launch(key, args, [per_token(b.cols(c) / group, 1), ONE], 256);
    let rows = if norm_fuses(b, c) {
        NORM_IN_GEMV_ROWS
    } else if moe_norm_fuses(b, c) {
        MOE_DIRECT_TOKENS
    } else {
        b.steps.push(one(l));
        return;
    };
    let key = NormIn { w: b.wdtype(w), add: add.is_some() };
    b.fused_norm[c] = Some(FusedNorm { args: [Arg::Buf(x), y, s, Arg::Weight(w), Arg::F32(eps)], key });
    b.steps.push(Step::Kernels { by: Count::Tokens, variants: vec![(rows, vec![]), (usize::MAX, vec![l])] });
}

/// `s = x + rms_norm(y); rms_norm(s)` in one launch (a `norm_add_norm` fusion).
fn norm_add_norm(b: &mut Builder, [n1, a, n2]: [usize; 3]) -> Result<(), CodegenError> {
    let (Op::RmsNorm { eps: peps }, Op::RmsNorm { eps }) = (&b.plan.nodes[n1].op, &b.plan.nodes[n2].op) else {
        unreachable!("norm_add_norm fusions start and end with RMS norms")
    };
    let (peps, eps) = (*peps, *eps);
    let ins = &b.plan.nodes[a].inputs;
    let xn = if ins[0] == n1 { ins[1] } else { ins[0] };
    let (pn, wn) = (&b.plan.nodes[n1].inputs, b.plan.nodes[n2].inputs[1]);
    let (yn, pw) = (pn[0], pn[1]);
    let (x, y) = (b.f32_val(xn)?, b.f32_val(yn)?);
    let s = b.out(a, DType::F32);
    let out = b.out(n2, b.act_dtype(n2));
    let key = KernelKey::NormAddRmsNorm { h: b.cols(n2), w: b.wdtype(wn), pw: b.wdtype(pw), out: b.vals_dtype(out) };
    let args = vec![
        Arg::Buf(x),
        Arg::Buf(y),
        Arg::Buf(s),
        Arg::Weight(wn),
        Arg::Buf(out),
        Arg::F32(eps),
        Arg::Weight(pw),
        Arg::F32(peps),
    ];
    b.steps.push(one(launch(key, args, [per_token(1, 1), ONE], 256)));
    Ok(())
}

/// Shared memory a GEMV may give its normalised rows (`XNorm` in `kernels/fast.cuh`).
const NORM_SMEM: usize = 32 << 10;

/// The most weight bytes of a launch that applies a norm itself. A launch streaming more runs
/// several waves of blocks, and every wave pays the norm's prologue: on an H200, fusing the
/// Qwen2.5-7B shape's QKV (33 MB) and gate/up (271 MB) cost 7% of a batch-1 step, while the
/// 0.5B shape's (2 and 17 MB, one wave) saved 2% (docs/perf.md).
const NORM_MAX_WEIGHT_BYTES: usize = 24 << 20;

/// The fusion of the first reader of norm node `c`, where norms may fuse into their readers
/// (`fuse_norms`) and `c` normalises whole rows (not groups of them: `XNorm` and `RouterNorm`
/// take whole rows): what [`norm_fuses`] and [`moe_norm_fuses`] look at.
fn readers_fusion<'a>(b: &'a Builder, c: usize) -> Option<&'a ir::Fusion<usize>> {
    let f = b.consumers[c].first().and_then(|&r| b.fusion_of[r])?;
    (b.fuse_norms && b.cols(b.plan.nodes[c].inputs[1]) == b.cols(c)).then(|| &b.plan.fusions[f])
}

/// Whether norm node `c` normalises whole rows (not groups of them: the GEMVs' `XNorm` takes
/// whole rows), only feeds the fast linears of one fusion that runs as one launch (the linears
/// of one input, or the gate and up of a GLU) of at most [`NORM_MAX_WEIGHT_BYTES`], reading
/// its 16-bit output, and its rows fit in [`NORM_SMEM`].
fn norm_fuses(b: &Builder, c: usize) -> bool {
    let readers = &b.consumers[c];
    let Some(fusion) = readers_fusion(b, c) else { return false };
    let one_launch = match fusion.kind {
        FusionKind::Linears => true,
        FusionKind::Glu => b.feeds_linears(fusion.nodes[3]),
        FusionKind::AddNorm | FusionKind::NormAddNorm | FusionKind::RopeAttention | FusionKind::MoeRouter => false,
    };
    let mut linears: Vec<usize> =
        fusion.nodes.iter().copied().filter(|&j| matches!(b.plan.nodes[j].op, Op::Linear { .. })).collect();
    linears.sort();
    // One weight format: linears of two formats run as two launches.
    let format = readers.first().and_then(|&j| b.fast_format(j));
    let all_read_c = readers.iter().all(|&j| b.plan.nodes[j].inputs[0] == c && b.fast_format(j) == format);
    let bytes: usize = readers.iter().map(|&j| b.cols(j) * b.cols(c) * b.half.size()).sum();
    bytes <= NORM_MAX_WEIGHT_BYTES
        && one_launch
        && linears == *readers
        && format.is_some()
        && all_read_c
        && NORM_IN_GEMV_ROWS * b.cols(c) * b.half.size() <= NORM_SMEM
        && b.node_val[c].is_some_and(|v| b.vals_dtype(v) == b.half)
}

/// Whether norm node `c` normalises whole rows (f32 out, at most [`NORM_SMEM`] a row) whose
/// only readers are the router and the experts of one `moe_router` fusion that takes the direct
/// path: at up to [`MOE_DIRECT_TOKENS`] tokens its router launch applies the norm (`RouterNorm`
/// in `kernels/moe.cuh`) and writes the rows the experts read, one launch less a layer.
fn moe_norm_fuses(b: &Builder, c: usize) -> bool {
    let readers = &b.consumers[c];
    let Some(fusion) = readers_fusion(b, c) else { return false };
    fusion.kind == FusionKind::MoeRouter
        && readers.len() == fusion.nodes.len()
        && fusion.nodes.iter().all(|j| readers.contains(j))
        && readers.iter().all(|&j| b.plan.nodes[j].inputs[0] == c)
        && moe::direct(b, fusion.nodes[1])
        && b.cols(c) * 4 <= NORM_SMEM
        && b.node_val[c].is_some_and(|v| b.vals_dtype(v) == DType::F32)
}

/// One linear of a group: weight, bias, output value, output features.
type Group = (usize, Option<usize>, usize, usize);

/// The GEMV variants' input at `rows` rows: the 16-bit `x`, or the norm they apply themselves.
fn gemv_x(x: usize, norm: Option<&FusedNorm>, rows: usize) -> (Option<NormIn>, Vec<Arg>) {
    match norm {
        Some(f) if rows <= NORM_IN_GEMV_ROWS => (Some(f.key), f.args.to_vec()),
        _ => (None, vec![Arg::Buf(x)]),
    }
}

/// Launch variants of up to three fast linears sharing the 16-bit input `x` (the output of
/// `norm` when the GEMVs apply it), over `by` rows, their weights in format `wf` (with f32
/// biases where `b32`, else 16-bit ones). The kernels
/// write rows of all the linears' columns, so the outputs of more than one linear must be the
/// column ranges `Builder::packed` gives, in order.
fn grouped(
    x: usize,
    k: usize,
    groups: &[Group],
    by: Count,
    norm: Option<&FusedNorm>,
    (wf, b32): (WFormat, bool),
) -> Step {
    let mut n = [0; 3];
    let mut outs = vec![];
    for (g, slot) in n.iter_mut().enumerate() {
        match groups.get(g) {
            Some(&(w, bias, out, cols)) => {
                *slot = cols;
                outs.extend([Arg::Weight(w), bias.map_or(Arg::Null, Arg::Weight), Arg::Buf(out)]);
            }
            None => outs.extend([Arg::Null, Arg::Null, Arg::Null]),
        }
    }
    outs.push(Arg::Count(by));
    let args = [&[Arg::Buf(x)], &outs[..]].concat();
    let total: usize = n.iter().sum();
    let mut variants: Vec<(usize, Vec<Launch>)> = gemv_rows(&n, k, wf)
        .into_iter()
        .map(|rows| {
            let (norm, input) = gemv_x(x, norm, rows);
            let key = KernelKey::Gemv { k, n, rows, norm, wf, b32 };
            let per_block = 8 / crate::keys::gemv_split(k);
            let args = [input, outs.clone()].concat();
            (rows, vec![launch(key, args, [Dim::Fixed(total.div_ceil(per_block)), ONE], 256)])
        })
        .collect();
    if skinny_takes(&n, k, wf) {
        for rows in SKINNY_ROWS {
            let key = KernelKey::GemmSkinny { k, n, tiles: rows / 8, wf, b32 };
            variants.push((rows, vec![launch(key, args.clone(), [Dim::Fixed(total / 16), ONE], 256)]));
        }
    }
    variants.push((usize::MAX, vec![gemm_launch(k, n, (wf, b32), args, by)]));
    Step::Kernels { by, variants }
}

/// The tiled GEMM launch of up to three linears over `by` rows (any row count; 128 x 128 output
/// tiles).
fn gemm_launch(k: usize, n: [usize; 3], (wf, b32): (WFormat, bool), args: Vec<Arg>, by: Count) -> Launch {
    let tiles: usize = n.iter().map(|c| c.div_ceil(128)).sum();
    launch(KernelKey::Gemm { k, n, wf, b32 }, args, [Dim::Fixed(tiles), Dim::Per(by, 1, 128)], 256)
}

/// The tiled GEMM that computes what small-batch launch `l` (`KernelKey::GemmSkinny`) does, at
/// any row count: the schedule's own launch past the last of `SKINNY_ROWS`, and a candidate the
/// runtime times against the small-batch kernel below it. `None` for any other launch.
pub fn tiled(l: &Launch) -> Option<Launch> {
    let KernelKey::Gemm { k, n, wf, b32 } = l.key.tiled()? else { return None };
    let by = l.args.iter().rev().find_map(|a| if let Arg::Count(c) = a { Some(*c) } else { None })?;
    Some(gemm_launch(k, n, (wf, b32), l.args.clone(), by))
}

/// Linears `ls` of one input: one launch (GEMV / GEMM variants) per weight format the fast
/// kernels take, one simple launch for each of the rest. Linears of one launch write one packed
/// matrix (`Builder::packed`), so only those whose readers all take a row stride share one
/// (`reads_packed`); the others run a launch each.
fn linears(b: &mut Builder, ls: &[usize]) -> Result<(), CodegenError> {
    let xn = b.plan.nodes[ls[0]].inputs[0];
    let k = b.cols(xn);
    let x = b.half_input(xn)?;
    let norm = b.fused_norm[xn].clone();
    for (wf, b32) in WFormat::ALL.into_iter().flat_map(|f| [(f, false), (f, true)]) {
        let of_format = ls.iter().copied().filter(|&c| b.fast_format(c) == Some(wf) && b.bias_f32(c) == b32);
        let (shared, alone): (Vec<usize>, Vec<usize>) = of_format.partition(|&c| reads_packed(b, c));
        let launches = alone.into_iter().map(|c| vec![c]).chain((!shared.is_empty()).then_some(shared));
        for members in launches {
            let outs = match &members[..] {
                &[c] => vec![b.out(c, DType::F32)],
                _ => {
                    let cols: Vec<usize> = members.iter().map(|&c| b.cols(c)).collect();
                    let views = b.packed(&cols);
                    for (&c, &v) in members.iter().zip(&views) {
                        b.node_val[c] = Some(v);
                    }
                    views
                }
            };
            let groups: Vec<Group> = members
                .iter()
                .zip(outs)
                .map(|(&c, out)| {
                    let n = &b.plan.nodes[c];
                    (n.inputs[1], n.inputs.get(2).copied(), out, b.cols(c))
                })
                .collect();
            b.steps.push(grouped(x, k, &groups, Count::Tokens, norm.as_ref(), (wf, b32)));
        }
    }
    let slow: Vec<usize> = ls.iter().copied().filter(|&i| !b.fast_linear(i)).collect();
    for i in slow {
        let n = &b.plan.nodes[i];
        let (w, bias) = (n.inputs[1], n.inputs.get(2).copied());
        let out = b.out(i, DType::F32);
        let key = KernelKey::Linear { k, n: b.cols(i), w: b.wdtype(w), bias: bias.is_some() };
        let args = vec![
            Arg::Buf(x),
            Arg::Weight(w),
            bias.map_or(Arg::Null, Arg::Weight),
            Arg::Buf(out),
            Arg::Count(Count::Tokens),
        ];
        b.steps.push(one(launch(key, args, [Dim::Fixed(b.cols(i).div_ceil(8)), ONE], 256)));
    }
    Ok(())
}

/// Whether every reader of linear `c`'s output takes it with a row stride: an attention step
/// (its rope_kv kernel reads q, k and v with strides, its one-token kernel reads one row), as
/// the attention itself or a rope or head norm fused into it.
fn reads_packed(b: &Builder, c: usize) -> bool {
    let in_attention = |u: usize| match b.fusion_of[u] {
        Some(f) if b.plan.fusions[f].kind == FusionKind::RopeAttention => {
            !matches!(b.plan.nodes[u].op, Op::RmsNorm { .. }) || head_norm_fuses(b, u)
        }
        _ => matches!(b.plan.nodes[u].op, Op::Attention { .. }),
    };
    let users = &b.consumers[c];
    !users.is_empty() && users.iter().all(|&u| in_attention(u))
}

/// act(x·gateᵀ) * (x·upᵀ) in one GEMV for few rows (applying `norm` where it is fused);
/// GEMM + glu_mul above.
fn glu(
    b: &mut Builder,
    x: usize,
    k: usize,
    [g, u, s, m]: [usize; 4],
    norm: Option<&FusedNorm>,
    wf: WFormat,
) -> Result<(), CodegenError> {
    let n = b.cols(g);
    let act = ir::fusion::glu_activation(&b.plan.nodes[s].op).ok_or_else(|| {
        CodegenError::Unsupported(format!("`{}`: a glu fusion without an activation", b.plan.nodes[s].label))
    })?;
    let act = intern(act.to_cuda());
    let out = b.out(m, b.half);
    let (wg, wu) = (b.plan.nodes[g].inputs[1], b.plan.nodes[u].inputs[1]);
    let gemv = gemv_rows(&[n, n], k, wf);
    let most = gemv.last().copied().unwrap_or(0);
    let mut variants: Vec<(usize, Vec<Launch>)> = gemv
        .into_iter()
        .map(|rows| {
            let (norm, input) = gemv_x(x, norm, rows);
            let outs = [Arg::Weight(wg), Arg::Weight(wu), Arg::Buf(out), Arg::Count(Count::Tokens)];
            let args = [input, outs.to_vec()].concat();
            let per_block = 8 / crate::keys::gemv_split(k);
            (
                rows,
                vec![launch(
                    KernelKey::GemvGlu { k, n, rows, norm, act, wf },
                    args,
                    [Dim::Fixed(n.div_ceil(per_block)), ONE],
                    256,
                )],
            )
        })
        .collect();
    let [tg, tu] = b.packed(&[n, n])[..] else { unreachable!("two column ranges") };
    let Step::Kernels { variants: big, .. } =
        grouped(x, k, &[(wg, None, tg, n), (wu, None, tu, n)], Count::Tokens, None, (wf, false))
    else {
        unreachable!("grouped gives kernels")
    };
    let args = vec![Arg::Buf(tg), Arg::Buf(tu), Arg::Buf(out), Arg::Elems(Count::Tokens, n)];
    for (bound, mut launches) in big.into_iter().filter(|(bound, _)| *bound > most) {
        launches.push(launch(KernelKey::GluMul { act, n }, args.clone(), [per_token(n, 1024), ONE], 256));
        variants.push((bound, launches));
    }
    b.steps.push(Step::Kernels { by: Count::Tokens, variants });
    Ok(())
}

/// The wanted rows gathered (in 16 bits), then the LM head over them.
/// An elementwise map: one launch of its rendered kernel over the node's activations or logit
/// rows; weight inputs are read where they are.
fn map(b: &mut Builder, i: usize, expr: &ir::Scalar) -> Result<(), CodegenError> {
    let n = &b.plan.nodes[i];
    if n.inputs.len() > MAP_INPUTS {
        return Err(CodegenError::Unsupported(format!("`{}`: a map of more than {MAP_INPUTS} inputs", n.label)));
    }
    let per = if n.ty.shape.first() == Some(&ir::Dim::R) { Count::Rows } else { Count::Tokens };
    let cols = b.cols(i);
    let (mut args, mut ins, mut bcast) = (Vec::new(), [DType::F32; MAP_INPUTS], 0u8);
    for (j, &x) in n.inputs.iter().enumerate() {
        let x_node = &b.plan.nodes[x];
        if x_node.ty.shape.len() == 1 {
            bcast |= 1 << j;
        }
        if matches!(x_node.op, Op::Weight { .. }) {
            ins[j] = b.wdtype(x);
            args.push(Arg::Weight(x));
        } else {
            args.push(Arg::Buf(b.f32_val(x)?));
        }
    }
    let key = KernelKey::Map {
        expr: intern(expr.to_cuda()),
        ins,
        arity: n.inputs.len(),
        bcast,
        cols: if bcast == 0 { 0 } else { cols },
    };
    let out = b.new_val(cols, DType::F32, per);
    b.node_val[i] = Some(out);
    args.extend([Arg::Buf(out), Arg::Elems(per, cols)]);
    b.steps.push(Step::Kernels {
        by: per,
        variants: vec![(usize::MAX, vec![launch(key, args, [Dim::Per(per, cols, 256), ONE], 256)])],
    });
    Ok(())
}

fn logits(b: &mut Builder, i: usize) -> Result<(), CodegenError> {
    let n = &b.plan.nodes[i];
    let (xn, w) = (n.inputs[0], n.inputs[1]);
    let (h, vocab) = (b.cols(xn), b.cols(i));
    let x = b.val(xn)?;
    let sel = b.new_val(h, b.half, Count::Rows);
    b.hidden = Some(sel);
    let key = KernelKey::Gather { h, x: b.vals_dtype(x), out: b.half };
    let args = vec![Arg::Buf(x), Arg::Input(Input::Rows), Arg::Buf(sel)];
    b.steps.push(Step::Kernels {
        by: Count::Rows,
        variants: vec![(usize::MAX, vec![launch(key, args, [Dim::Per(Count::Rows, 1, 1), ONE], 256)])],
    });
    let out = b.new_val(vocab, DType::F32, Count::Rows);
    b.node_val[i] = Some(out);
    // A 16-bit lm_head, or GGUF's blocks (E4M3 weights are linears' only).
    let fast = WFormat::of(b.wdtype(w), b.half).filter(|&f| f != WFormat::E4m3 && h % 32 == 0);
    if let Some(wf) = fast {
        b.steps.push(grouped(sel, h, &[(w, None, out, vocab)], Count::Rows, None, (wf, false)));
    } else {
        let key = KernelKey::Linear { k: h, n: vocab, w: b.wdtype(w), bias: false };
        let args = vec![Arg::Buf(sel), Arg::Weight(w), Arg::Null, Arg::Buf(out), Arg::Count(Count::Rows)];
        let l = launch(key, args, [Dim::Fixed(vocab.div_ceil(8)), ONE], 256);
        b.steps.push(Step::Kernels { by: Count::Rows, variants: vec![(usize::MAX, vec![l])] });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::grouped;
    use crate::{tiled, Count, Dim, KernelKey, Launch, Step, WFormat, SKINNY_ROWS};
    use ir::{DType, Graph, Op};

    /// embedding → rms_norm with a `[norm]` weight → linear → logits, all 64 wide, bf16.
    fn plan(norm: usize) -> ir::Plan {
        plan_of(64, norm, DType::BF16)
    }

    /// [`plan`] `h` wide, the linear's weight in `lin`.
    fn plan_of(h: usize, norm: usize, lin: DType) -> ir::Plan {
        plan_with(h, norm, lin, None)
    }

    /// [`plan_of`], the linear with a bias in `bias` where given.
    fn plan_with(h: usize, norm: usize, lin: DType, bias: Option<DType>) -> ir::Plan {
        let mut g = Graph::new(DType::BF16);
        let w = |g: &mut Graph, name: &str, shape: Vec<usize>, dtype| {
            g.add(Op::Weight { name: name.into(), shape, dtype, derived: None }, &[], name).unwrap()
        };
        let (table, nw, lw) = (
            w(&mut g, "table", vec![64, h], DType::BF16),
            w(&mut g, "norm", vec![norm], DType::BF16),
            w(&mut g, "lin", vec![h, h], lin),
        );
        let bw = bias.map(|d| w(&mut g, "bias", vec![h], d));
        let t = g.add(Op::Tokens, &[], "tokens").unwrap();
        let x = g.add(Op::Embedding, &[t, table], "x").unwrap();
        let h = g.add(Op::RmsNorm { eps: 1e-6 }, &[x, nw], "h").unwrap();
        let ins: Vec<_> = [h, lw].into_iter().chain(bw).collect();
        let y = g.add(Op::Linear { bias: bw.is_some() }, &ins, "y").unwrap();
        // What the compiler's group_linears pass makes of a lone linear.
        g.fusions.push(ir::Fusion { kind: ir::FusionKind::Linears, nodes: vec![y] });
        g.output = Some(g.add(Op::Logits, &[y, table], "logits").unwrap());
        g.to_plan().unwrap()
    }

    /// A step's launch table lists the launches a step of that many tokens runs, in order,
    /// with their blocks, threads and dynamic shared memory: at one token the GEMV applying the
    /// norm (8 outputs a block of 256 threads), at 64 the norm and the small-batch kernel.
    #[test]
    fn the_launch_table_lists_a_steps_launches() {
        let program = crate::emit(&plan(64)).unwrap();
        for t in [1, 64] {
            let table = program.launch_table(t);
            assert_eq!(table.lines().count(), program.launches(t), "{table}");
            assert!(table.lines().all(|l| l.split('\t').count() == 4), "{table}");
        }
        let one = program.launch_table(1);
        assert!(one.contains("gemv_k64_n64_r1_norm_bf16\t8\t256\t0\n"), "{one}");
        let many = program.launch_table(64);
        assert!(many.starts_with("embedding_h64_bf16\t64\t256\t0\nrms_norm_h64_bf16_to_bf16\t64\t256\t0\n"), "{many}");
    }

    /// embedding → (a residual add and) an RMS norm → a router linear and 8 experts of 32
    /// features, 2 a token (a `moe_router` fusion) → logits, 64 wide, bf16.
    fn moe_plan(add: bool) -> ir::Plan {
        let mut g = Graph::new(DType::BF16);
        let mut w = |name: &str, shape: Vec<usize>| {
            g.add(Op::Weight { name: name.into(), shape, dtype: DType::BF16, derived: None }, &[], name).unwrap()
        };
        let (table, nw, rw) = (w("table", vec![64, 64]), w("norm", vec![64]), w("router", vec![8, 64]));
        let (gate, up, down) = (w("gate", vec![8, 32, 64]), w("up", vec![8, 32, 64]), w("down", vec![8, 64, 32]));
        let t = g.add(Op::Tokens, &[], "tokens").unwrap();
        let x = g.add(Op::Embedding, &[t, table], "x").unwrap();
        let src = if add { g.add(Op::Add, &[x, x], "sum").unwrap() } else { x };
        let h = g.add(Op::RmsNorm { eps: 1e-6 }, &[src, nw], "h").unwrap();
        if add {
            g.fusions.push(ir::Fusion { kind: ir::FusionKind::AddNorm, nodes: vec![src, h] });
        }
        let r = g.add(Op::Linear { bias: false }, &[h, rw], "router").unwrap();
        let f = |name| ir::scalar::Fun::named(name).unwrap();
        let silu = ir::scalar::Scalar::call(f("silu"), vec![ir::scalar::Scalar::Arg(0)]);
        let act = ir::scalar::Scalar::call(f("*"), vec![silu, ir::scalar::Scalar::Arg(1)]);
        let moe = Op::Moe { top_k: 2, norm_topk: true, act, bias: false };
        let m = g.add(moe, &[h, r, gate, up, down], "moe").unwrap();
        g.fusions.push(ir::Fusion { kind: ir::FusionKind::MoeRouter, nodes: vec![r, m] });
        g.output = Some(g.add(Op::Logits, &[m, table], "logits").unwrap());
        g.to_plan().unwrap()
    }

    /// The norm before a mixture of experts whose experts take the direct path is applied by the
    /// router's launch at one token (no norm launch there) and runs as its own launch above,
    /// before the plain router; with and without the residual add.
    #[test]
    fn a_direct_moe_router_applies_its_norm_at_one_token() {
        for add in [false, true] {
            let program = crate::emit(&moe_plan(add)).unwrap();
            let variants: Vec<Vec<(usize, Vec<KernelKey>)>> = program
                .steps
                .iter()
                .filter_map(|s| match s {
                    Step::Kernels { variants, .. } => {
                        Some(variants.iter().map(|(r, ls)| (*r, ls.iter().map(|l| l.key).collect())).collect())
                    }
                    _ => None,
                })
                .collect();
            let norm = KernelKey::AddRmsNorm { h: 64, w: DType::BF16, add, out: DType::F32 };
            let norms: Vec<_> = variants.iter().filter(|v| v.iter().any(|(_, ks)| ks.contains(&norm))).collect();
            assert_eq!(norms.len(), 1, "add {add}");
            assert_eq!(norms[0].iter().map(|(r, ks)| (*r, ks.len())).collect::<Vec<_>>(), [(1, 0), (usize::MAX, 1)]);
            let router = |norm| KernelKey::MoeRouterLogits { h: 64, e: 8, w: DType::BF16, bias: None, norm };
            let moe = variants.iter().find(|v| v.iter().any(|(_, ks)| ks.contains(&router(None)))).unwrap();
            let firsts: Vec<_> = moe.iter().map(|(r, ks)| (*r, ks[0])).collect();
            let normed = router(Some(crate::NormIn { w: DType::BF16, add }));
            assert_eq!(firsts[0], (1, normed), "add {add}");
            assert!(firsts[1..].iter().all(|&(r, k)| r > 1 && k == router(None)), "add {add}: {firsts:?}");
            let name = normed.name();
            assert!(program.source.contains(&format!("void {name}(")), "{name}");
        }
    }

    /// A norm over groups of 32 of a 64-wide row runs as the row kernel over 2 groups per token
    /// at every batch size; a whole-row norm is one block per token, and the batch-1 GEMV
    /// reading it applies it itself (`XNorm` takes whole rows only).
    #[test]
    fn a_grouped_norm_runs_per_group_and_never_in_a_gemv() {
        for (norm, blocks, fused) in [(32, 2, false), (64, 1, true)] {
            let program = crate::emit(&plan(norm)).unwrap();
            let launches: Vec<_> = program
                .steps
                .iter()
                .flat_map(|s| match s {
                    Step::Kernels { variants, .. } => variants.iter().flat_map(|(_, ls)| ls.clone()).collect(),
                    _ => vec![],
                })
                .collect();
            let norms: Vec<_> = launches
                .iter()
                .filter(|l| matches!(l.key, KernelKey::AddRmsNorm { .. }))
                .map(|l| (l.key, l.grid[0]))
                .collect();
            let key = KernelKey::AddRmsNorm { h: norm, w: DType::BF16, add: false, out: DType::BF16 };
            assert_eq!(norms, [(key, Dim::Per(Count::Tokens, blocks, 1))], "norm [{norm}]");
            let in_gemv = launches.iter().any(|l| matches!(l.key, KernelKey::Gemv { norm: Some(_), .. }));
            assert_eq!(in_gemv, fused, "norm [{norm}] applied by a GEMV");
        }
    }

    /// Every small-batch variant of a linear has the schedule's own tiled launch as its stand-in
    /// (same arguments, the grid of the variant past the last row count); nothing else has one.
    #[test]
    fn tiled_stand_ins_are_the_schedules_gemm() {
        let groups = [(1, None, 2, 384), (3, Some(4), 5, 128)];
        let Step::Kernels { variants, .. } = grouped(0, 256, &groups, Count::Tokens, None, (WFormat::E4m3, false))
        else {
            panic!("a linear is a kernel step")
        };
        let (max, last) = variants.last().unwrap();
        assert_eq!((*max, last[0].grid[0]), (usize::MAX, Dim::Fixed(4)));
        let skinny: Vec<&Launch> = variants.iter().flat_map(|(_, ls)| ls).filter(|l| tiled(l).is_some()).collect();
        assert_eq!(skinny.len(), SKINNY_ROWS.len());
        assert!(skinny.iter().all(|l| tiled(l).as_ref() == Some(&last[0])));
        assert_eq!(tiled(&last[0]), None);
    }

    /// The `wgmma` stand-in of a small-batch E4M3 or 16-bit launch: up to 64 rows, output counts
    /// multiples of 128, rows of whole 128-byte groups, one kernel for every row count, compiled
    /// for sm_90a; K split so a launch has about two blocks an SM, two groups a part at least,
    /// no part empty.
    #[test]
    fn w8a8_stand_ins_follow_their_layout() {
        let skinny = |n: usize, tiles: usize, w8: bool| {
            let wf = if w8 { WFormat::E4m3 } else { WFormat::H16 };
            KernelKey::GemmSkinny { k: 256, n: [n, 0, 0], tiles, wf, b32: false }
        };
        let a8 = |n: usize| Some(KernelKey::GemmSkinnyA8 { k: 256, n: [n, 0, 0], cl: 0, wf: WFormat::E4m3 });
        assert_eq!(skinny(128, 4, true).a8(), a8(128));
        assert_eq!(skinny(128, 8, true).a8(), a8(128));
        assert_eq!(skinny(128, 9, true).a8(), None);
        assert_eq!(skinny(64, 8, true).a8(), None);
        let w16 = KernelKey::GemmSkinnyA8 { k: 256, n: [128, 0, 0], cl: 0, wf: WFormat::H16 };
        assert_eq!(skinny(128, 8, false).a8(), Some(w16));
        let odd = KernelKey::GemmSkinny { k: 96, n: [128, 0, 0], tiles: 8, wf: WFormat::H16, b32: false };
        assert_eq!(odd.a8(), None, "192-byte rows: not whole 128-byte groups");
        assert!(w16.instance().unwrap().contains("gemm_skinny_w16_k256_n128(const __grid_constant__ TmaMap mx"));
        assert!(w16.instance().unwrap().contains("gemm_skinny_a8<h16_t, 256, 128, 0, 0, 1, 1, 4, 0>("));
        let key = KernelKey::GemmSkinnyA8 { k: 256, n: [128, 0, 0], cl: 0, wf: WFormat::E4m3 };
        assert_eq!(
            (key.arch("sm_90"), key.arch("compute_90"), key.arch("sm_100")),
            ("sm_90a".into(), "compute_90a".into(), "sm_100".into())
        );
        assert_eq!(skinny(128, 8, true).arch("sm_90"), "sm_90");
        // The parameters in the order the runtime's `launch_a8` passes them.
        let params = "(const __grid_constant__ TmaMap mx, const float* xs, const fp8_t* w0, const h16_t* b0, \
                      float* o0, const fp8_t* w1, const h16_t* b1, float* o1, const fp8_t* w2, const h16_t* b2, \
                      float* o2, float* part, unsigned* count, int T, const __grid_constant__ TmaMap mw0, \
                      const __grid_constant__ TmaMap mw1, const __grid_constant__ TmaMap mw2)";
        assert!(key.instance().unwrap().contains(params), "{}", key.instance().unwrap());
        // Qwen2.5-7B: gate/up 296 tiles of 28 groups on 264 blocks (a tile over two blocks at
        // most), down 28 of 148 (five or six blocks a tile); a 0.5B q/k/v: 9 tiles of 7 groups.
        let (blocks, slots) = (crate::a8_blocks, crate::a8_slots);
        assert_eq!((blocks(3584, 37888), slots(3584, 37888)), (264, 2));
        assert_eq!((blocks(18944, 3584), slots(18944, 3584)), (264, 11));
        assert_eq!((blocks(896, 1152), slots(896, 1152)), (15, 3));
        // Clusters where stream-K puts two or more blocks on every tile: the 7B's o and q|k|v
        // (seven a tile), its down projection (nine, capped to eight), the 0.5B's down (nine);
        // not the 7B's gate/up (more tiles than blocks) nor the 0.5B's q/k/v (15 blocks, 9 tiles).
        let (cluster, grid) = (crate::a8_cluster, crate::a8_grid);
        assert_eq!([(3584, 3584), (3584, 4608), (18944, 3584), (4864, 896)].map(|(k, n)| cluster(k, n)), [7, 7, 8, 8]);
        assert_eq!(
            [(3584, 3584, 7), (18944, 3584, 8), (18944, 3584, 0)].map(|(k, n, c)| grid(k, n, c)),
            [196, 224, 264]
        );
        assert_eq!((cluster(3584, 37888), cluster(896, 1152)), (0, 0));
        // Both instances of a shape that has clusters, for the runtime to choose between; one
        // of a shape that has none.
        let o7b = KernelKey::GemmSkinny { k: 3584, n: [3584, 0, 0], tiles: 8, wf: WFormat::E4m3, b32: false };
        let (plain, clustered) = (o7b.a8().unwrap(), o7b.a8_clustered().unwrap());
        assert_eq!(clustered, KernelKey::GemmSkinnyA8 { k: 3584, n: [3584, 0, 0], cl: 7, wf: WFormat::E4m3 });
        let o = clustered.instance().unwrap();
        assert!(
            o.contains("__launch_bounds__(128, 1) __cluster_dims__(7, 1, 1) gemm_skinny_a8_k3584_n3584_cl7("),
            "{o}"
        );
        assert!(o.contains("gemm_skinny_a8<fp8_t, 3584, 3584, 0, 0, 196, 7, 4, 7>("), "{o}");
        let o = plain.instance().unwrap();
        assert!(o.contains("__launch_bounds__(128, 1) gemm_skinny_a8_k3584_n3584("), "{o}");
        assert!(o.contains("gemm_skinny_a8<fp8_t, 3584, 3584, 0, 0, 196, 7, 4, 0>("), "{o}");
        assert_eq!(skinny(128, 8, true).a8_clustered(), None);
        // 16-bit rows are twice the bytes: the 7B's o as 16-bit weights has twice the units, so
        // eight blocks a tile (capped), and its launch the grid and slots of those bytes.
        let o16 = KernelKey::GemmSkinny { k: 3584, n: [3584, 0, 0], tiles: 8, wf: WFormat::H16, b32: false };
        let c16 = o16.a8_clustered().unwrap();
        assert_eq!(c16, KernelKey::GemmSkinnyA8 { k: 3584, n: [3584, 0, 0], cl: 8, wf: WFormat::H16 });
        assert_eq!((c16.a8_split(), o16.a8().unwrap().a8_split()), (Some((224, 11)), Some((264, 11))));
        assert!(c16.instance().unwrap().contains("gemm_skinny_w16_k3584_n3584_cl8("));
        assert_eq!(plain.a8_split(), Some((196, 7)));
    }

    /// An E4M3 linear weight takes the `w8` variants: the GEMV up to `GEMV_MAX_ROWS`, the
    /// small-batch kernel to 64 rows, the tiled GEMM above, and the program the W8A8 input
    /// quantizer; over 64 input features (not a
    /// multiple of 128) it is refused, naming the weight.
    #[test]
    fn e4m3_linears_take_the_w8_variants_or_are_refused() {
        let program = crate::emit(&plan_of(128, 128, DType::F8_E4M3)).unwrap();
        assert_eq!(lin_variants(&program, "_f8"), square_variants(128, "_f8"));
        // Its tensor-core variants may run as W8A8 through cuBLASLt: the program carries the
        // input's quantizer; a 16-bit program does not.
        assert!(program.kernels.contains(&KernelKey::QuantE4M3) && program.source.contains("void quant_e4m3_rows("));
        let h16 = crate::emit(&plan_of(128, 128, DType::BF16)).unwrap();
        assert!(!h16.kernels.contains(&KernelKey::QuantE4M3));
        let refused = crate::emit(&plan_of(64, 64, DType::F8_E4M3)).unwrap_err().to_string();
        assert!(refused.contains("`lin` is f8_e4m3") && refused.contains("multiple of 128"), "{refused}");
    }

    /// The variants of [`plan_of`]'s `h` x `h` linear in the format of name suffix `suffix`: the
    /// GEMV applying the norm at 1 row, at 2, the small-batch kernel to 128 rows, the tiled GEMM.
    fn square_variants(h: usize, suffix: &str) -> Vec<(usize, String)> {
        let mut v =
            vec![(1, format!("gemv_k{h}_n{h}_r1_norm_bf16{suffix}")), (2, format!("gemv_k{h}_n{h}_r2{suffix}"))];
        v.extend(SKINNY_ROWS.map(|r| (r, format!("gemm_skinny_k{h}_n{h}_t{}{suffix}", r / 8))));
        v.push((usize::MAX, format!("gemm_k{h}_n{h}{suffix}")));
        v
    }

    /// The names of the variants of the first launch in `program` with a kernel named `…suffix`,
    /// by row bound.
    fn lin_variants(program: &crate::Program, suffix: &str) -> Vec<(usize, String)> {
        let linear = program.steps.iter().find_map(|s| match s {
            Step::Kernels { variants, .. }
                if variants.iter().any(|(_, ls)| ls.iter().any(|l| l.key.name().ends_with(suffix))) =>
            {
                Some(variants.iter().map(|(rows, ls)| (*rows, ls[0].key.name())).collect::<Vec<_>>())
            }
            _ => None,
        });
        linear.unwrap_or_else(|| panic!("a launch of {suffix} variants"))
    }

    /// A GGUF block linear takes its format's variants: the GEMV, the small-batch kernel where
    /// four chunks divide its rows (Q4's chunk is 32 weights: 256 input features yes, 64 no,
    /// where the GEMV takes up to 8 rows), and the tiled GEMM; no cuBLASLt-only kernel.
    #[test]
    fn gguf_linears_take_their_formats_variants() {
        let names = lin_variants(&crate::emit(&plan_of(256, 256, DType::Q4_K)).unwrap(), "_q4");
        assert_eq!(names, square_variants(256, "_q4"));
        let narrow = lin_variants(&crate::emit(&plan_of(64, 64, DType::Q4_0)).unwrap(), "_q4");
        let rows: Vec<usize> = narrow.iter().map(|(r, _)| *r).collect();
        assert_eq!(rows, [1, 2, 4, 8, usize::MAX], "{narrow:?}");
        for (dtype, h, suffix) in
            [(DType::Q8_0, 64, "_s8"), (DType::Q6_K, 256, "_s8"), (DType::Q5_K, 256, "_u8"), (DType::Q5_0, 64, "_u8")]
        {
            let names = lin_variants(&crate::emit(&plan_of(h, h, dtype)).unwrap(), suffix);
            assert_eq!(names.len(), 8, "{dtype}: {names:?}");
        }
        let program = crate::emit(&plan_of(256, 256, DType::Q4_K)).unwrap();
        assert!(!program.kernels.contains(&KernelKey::QuantE4M3));
        // An f32 bias (as GGUF files store them) beside GGUF weights: the same variants reading
        // it as f32; beside 16-bit weights the fast kernels do not take it.
        let biased = crate::emit(&plan_with(64, 64, DType::Q8_0, Some(DType::F32))).unwrap();
        let names = lin_variants(&biased, "_s8_b32");
        assert_eq!(names.len(), 8, "{names:?}");
        let instance = biased.kernels.iter().find(|k| k.name().ends_with("_b32")).unwrap().instance().unwrap();
        assert!(instance.contains("const float* b0"), "{instance}");
        let dense = crate::emit(&plan_with(64, 64, DType::BF16, Some(DType::F32))).unwrap();
        let names: Vec<String> = dense.kernels.iter().map(|k| k.name()).collect();
        assert!(
            names.iter().any(|n| n.starts_with("linear_k64_n64")) && !names.iter().any(|n| n.contains("_b32")),
            "{names:?}"
        );
    }
}
