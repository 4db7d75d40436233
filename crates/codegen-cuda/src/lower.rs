//! Lowering of plan nodes and fusions to launches (the schedule module says which).

use crate::keys::{intern, DecAttention, HeadNorm, KernelKey, Mask, NormIn, RopeShape, MAP_INPUTS};
use crate::schedule::{
    dec_splits, dec_warps_rows, gemv_rows, launch, moe_rows_max, one, per_token, skinny_takes, to_h16, Arg, Builder,
    Count, Dim, FusedNorm, Input, Launch, Step, DEC_WARPS, DEC_WARPS_PAST_WAVE, FA_ROWS, FA_WARPS, MOE_DIRECT_TOKENS,
    MOE_TILE, NORM_IN_GEMV_ROWS, ONE, SKINNY_ROWS,
};
use crate::{CodegenError, WFormat};
use ir::{DType, FusionKind, Op};

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
    if !norm_fuses(b, c) {
        b.steps.push(one(l));
        return;
    }
    let key = NormIn { w: b.wdtype(w), add: add.is_some() };
    b.fused_norm[c] = Some(FusedNorm { args: [Arg::Buf(x), y, s, Arg::Weight(w), Arg::F32(eps)], key });
    b.steps
        .push(Step::Kernels { by: Count::Tokens, variants: vec![(NORM_IN_GEMV_ROWS, vec![]), (usize::MAX, vec![l])] });
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

/// Whether norm node `c` normalises whole rows (not groups of them: the GEMVs' `XNorm` takes
/// whole rows), only feeds the fast linears of one fusion that runs as one launch (the linears
/// of one input, or the gate and up of a GLU) of at most [`NORM_MAX_WEIGHT_BYTES`], reading
/// its 16-bit output, and its rows fit in [`NORM_SMEM`].
fn norm_fuses(b: &Builder, c: usize) -> bool {
    let readers = &b.consumers[c];
    let Some(f) = readers.first().and_then(|&r| b.fusion_of[r]) else { return false };
    let fusion = &b.plan.fusions[f];
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
    b.fuse_norms
        && b.cols(b.plan.nodes[c].inputs[1]) == b.cols(c)
        && bytes <= NORM_MAX_WEIGHT_BYTES
        && one_launch
        && linears == *readers
        && format.is_some()
        && all_read_c
        && NORM_IN_GEMV_ROWS * b.cols(c) * b.half.size() <= NORM_SMEM
        && b.node_val[c].is_some_and(|v| b.vals_dtype(v) == b.half)
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

/// Where attention does not run on tensor cores (head sizes past 128; more than 16 query heads
/// a kv head for the rows `attention_fa` leaves), steps of up to this many tokens run
/// `attention_gqa` a block per row and query head (enough blocks), more a block per row and kv
/// head. Where it does, every step of two tokens or more takes the tensor-core kernels
/// (H200, 4-layer Qwen2.5-7B decode graph: 906 against 986 us at 32 rows, 896 against 917 at
/// 16, against `rope_kv` + `attention_gqa`; docs/perf.md, 2026-11-29, third session).
const GQA_HEAD_ROWS: usize = 32;

/// A fused per-head norm of q or k: its input, the weight and eps (members `pre` of a
/// rope_attention fusion; `None` where `x`, a rope's input, is not one). A norm whose weight
/// the kernels cannot read runs as its own launch.
fn head_norm(b: &mut Builder, x: usize, pre: &[usize]) -> Result<Option<(usize, usize, f32)>, CodegenError> {
    let Op::RmsNorm { eps } = b.plan.nodes[x].op else { return Ok(None) };
    if !pre.contains(&x) {
        return Ok(None);
    }
    if !head_norm_fuses(b, x) {
        node(b, x)?;
        return Ok(None);
    }
    Ok(Some((b.plan.nodes[x].inputs[0], b.plan.nodes[x].inputs[1], eps)))
}

/// Whether the attention kernels apply norm `x` of a rope_attention fusion themselves: they
/// read its weight in f32 or the program's 16-bit float.
fn head_norm_fuses(b: &Builder, x: usize) -> bool {
    let w = b.plan.nodes[x].inputs[1];
    b.wdtype(w) == DType::F32 || b.wdtype(w) == b.half
}

/// RoPE (of the ropes fused into it, `pre`, and the per-head norms they rotate) + KV write,
/// then attention.
fn attention(b: &mut Builder, i: usize, pre: &[usize]) -> Result<(), CodegenError> {
    let ropes: Vec<usize> = pre.iter().copied().filter(|&r| matches!(b.plan.nodes[r].op, Op::Rope { .. })).collect();
    let ropes = &ropes[..];
    let n = &b.plan.nodes[i];
    let Op::Attention { heads, kv_heads, head_dim: d, scale, layer, window, softcap, sinks } = n.op else {
        unreachable!("an attention")
    };
    let sink = sinks.then(|| n.inputs[3]);
    let mask =
        Mask { window: window.unwrap_or(0), cap: softcap.map_or(0, f32::to_bits), sink: sink.map(|w| b.wdtype(w)) };
    let sink_arg = sink.map_or(Arg::Null, Arg::Weight);
    if d % 16 != 0 || d == 0 || d > 512 || heads % kv_heads != 0 {
        return Err(CodegenError::Unsupported(format!(
            "{}: head_dim {d} (the CUDA attention takes multiples of 16 up to 512)",
            n.label
        )));
    }
    let absorbed = |j: usize| ropes.contains(&j);
    let (qn, kn, vn) = (n.inputs[0], n.inputs[1], n.inputs[2]);
    let (freq, rscale, rot) = match ropes.first().map(|&r| &b.plan.nodes[r].op) {
        Some(op @ Op::Rope { theta, scaling, .. }) => {
            let (inv, s) = scaling.inv_freq(op.rotary_dim(), *theta);
            b.constants.push(inv.iter().map(|&f| f as f32).collect());
            (Arg::Const(b.constants.len() - 1), s as f32, op.rotary_dim())
        }
        _ => (Arg::Null, 1.0, d),
    };
    let (rope_q, rope_k) = (absorbed(qn), absorbed(kn));
    let src = |j: usize, roped: bool| if roped { b.plan.nodes[j].inputs[0] } else { j };
    let (qs, ks) = (src(qn, rope_q), src(kn, rope_k));
    let (nq, nk) = (head_norm(b, qs, pre)?, head_norm(b, ks, pre)?);
    let (qs, ks) = (nq.map_or(qs, |n| n.0), nk.map_or(ks, |n| n.0));
    let (q, k, v) = (b.f32_val(qs)?, b.f32_val(ks)?, b.f32_val(vn)?);
    let norm = HeadNorm { q: nq.map(|n| b.wdtype(n.1)), k: nk.map(|n| b.wdtype(n.1)) };
    let qo = b.new_val(heads * d, DType::F32, Count::Tokens);
    let ld = [b.row_stride(q), b.row_stride(k), b.row_stride(v)];
    let shape = RopeShape { rot, rope_q, rope_k, norm, ld };
    let key = KernelKey::RopeKv { heads, kv_heads, d, rope: shape };
    // q, k, v, where the token goes, how it rotates and is normalised: what rope_kv and the
    // one-token kernel read (`HeadNorm::rope_head_params`).
    let weight = |n: Option<(usize, usize, f32)>| n.map_or(Arg::Null, |n| Arg::Weight(n.1));
    let head = [
        Arg::Buf(q),
        Arg::Buf(k),
        Arg::Buf(v),
        Arg::Input(Input::Pos),
        freq,
        Arg::F32(rscale),
        Arg::Input(Input::SlotOf),
        weight(nq),
        weight(nk),
        Arg::F32(nq.map_or(0.0, |n| n.2)),
        Arg::F32(nk.map_or(0.0, |n| n.2)),
    ];
    let args = [&head[..], &[Arg::Buf(qo), Arg::KCache(layer), Arg::VCache(layer)]].concat();
    let rope = launch(key, args, [per_token(1, 1), ONE], 128);
    let out = b.out(i, b.act_dtype(i));
    let o = b.vals_dtype(out);
    let args = vec![
        Arg::Buf(qo),
        Arg::KCache(layer),
        Arg::VCache(layer),
        Arg::Input(Input::Slots),
        Arg::Input(Input::SeqOff),
        Arg::Input(Input::Pos),
        Arg::F32(scale),
        Arg::Buf(out),
        Arg::Count(Count::Tokens),
        sink_arg,
    ];
    // A block per row and query head for few rows (enough blocks), per row and kv head above.
    let rows = |mixed_only, per_block: usize| {
        let key = KernelKey::Attention { heads, kv_heads, d, per_block, out: o, mixed_only, mask };
        launch(key, args.clone(), [per_token(1, 1), Dim::Fixed(heads / per_block)], 128)
    };
    let one = KernelKey::AttentionRope1 { heads, kv_heads, d, rot, out: o, rope_q, rope_k, norm, mask };
    let one_args = [
        &head[..],
        &[
            Arg::KCache(layer),
            Arg::VCache(layer),
            Arg::Input(Input::Slots),
            Arg::Input(Input::SeqOff),
            Arg::F32(scale),
            Arg::Buf(out),
            sink_arg,
        ],
    ]
    .concat();
    let one = launch(one, one_args, [ONE, Dim::Fixed(heads)], 256);
    let group = heads / kv_heads;
    let mut variants = vec![(1, vec![one])];
    let per_head = (GQA_HEAD_ROWS, vec![rope.clone(), rows(false, 1)]);
    if d <= 128 {
        let fa = KernelKey::AttentionFa { heads, kv_heads, d, out: o, mask };
        let mut fa = launch(fa, args.clone(), [per_token(1, FA_ROWS), Dim::Fixed(heads)], (32 * FA_WARPS) as u32);
        fa.idle_in_decode = true;
        // The rows FA leaves (decode rows, mostly) on tensor cores too, a kv head's query
        // heads as the rows of a tile, where they fit one; their keys split over more blocks
        // where the rows alone do not fill the GPU. It rotates the rows alone in their
        // sequence and caches their keys itself, so rope_kv has nothing of a decode step's.
        if group <= 16 {
            let bounds = dec_bounds(kv_heads);
            let most = bounds.iter().map(|b| b.1).max().unwrap_or(1);
            let part = match most {
                1 => Arg::Null,
                _ => Arg::Buf(b.new_val(most * kv_heads * group * (d + 2), DType::F32, Count::Tokens)),
            };
            // Its splits and warps are each row bound's (dec_launches).
            let dec = DecAttention {
                heads,
                kv_heads,
                d,
                out: o,
                mixed_only: true,
                mask,
                splits: 1,
                warps: 1,
                rope: Some(shape),
            };
            // rope_kv's inputs (pos among them), the caches, the rotated q, then the attention's
            // slots, seq_off, scale, out, T and sinks.
            let cache = [Arg::KCache(layer), Arg::VCache(layer), Arg::Buf(qo), args[3], args[4]];
            let dec_args = [&head[..], &cache[..], &args[6..]].concat();
            let rope = Launch { idle_in_decode: true, ..rope.clone() };
            for (bound, dec) in dec_launches(&bounds, dec, &dec_args, &args, part) {
                variants.push((bound, [vec![rope.clone(), fa.clone()], dec].concat()));
            }
        } else {
            variants.extend([per_head, (usize::MAX, vec![rope, fa, rows(true, group)])]);
        }
    } else {
        variants.extend([per_head, (usize::MAX, vec![rope, rows(false, group)])]);
    }
    b.steps.push(Step::Kernels { by: Count::Tokens, variants });
    Ok(())
}

/// The split counts and block warps of decode attention by row bound from two rows: one
/// bound per split count ([`dec_splits`] at powers of two rows), then the unsplit rows with
/// [`DEC_WARPS`] warps a block up to [`dec_warps_rows`] and [`DEC_WARPS_PAST_WAVE`] past it, the
/// last unbounded.
fn dec_bounds(kv_heads: usize) -> Vec<(usize, usize, usize)> {
    let mut bounds: Vec<(usize, usize, usize)> = vec![];
    let mut rows = 2;
    let mut splits = dec_splits(rows, kv_heads);
    while splits > 1 {
        match bounds.last_mut() {
            Some(last) if last.1 == splits => last.0 = rows,
            _ => bounds.push((rows, splits, DEC_WARPS)),
        }
        rows *= 2;
        splits = dec_splits(rows, kv_heads);
    }
    let (split_rows, wave_rows) = (bounds.last().map_or(1, |b| b.0), dec_warps_rows(kv_heads));
    if wave_rows > split_rows {
        bounds.push((wave_rows, 1, DEC_WARPS));
    }
    bounds.push((usize::MAX, 1, DEC_WARPS_PAST_WAVE));
    bounds
}

/// The decode attention launches of each bound of `bounds` ([`dec_bounds`]):
/// [`KernelKey::AttentionDec`] of `dec`'s shape (its splits and warps the bound's) for the rows
/// attention_fa leaves, with `dec_args` (its parameters before the split states) and `part` (the
/// split states: per token, kv head and split, each query head's unnormalised output, then their
/// maxima and sums, f32, room for the most splits; null where none split), then the merge of
/// their splits where there are several (from `args`, the attention's: seq_off, pos, out, T and
/// sinks).
fn dec_launches(
    bounds: &[(usize, usize, usize)],
    dec: DecAttention,
    dec_args: &[Arg],
    args: &[Arg],
    part: Arg,
) -> Vec<(usize, Vec<Launch>)> {
    bounds
        .iter()
        .map(|&(bound, splits, warps)| {
            let a = DecAttention { splits, warps, ..dec };
            let grid = [per_token(dec.kv_heads * splits, 1), ONE];
            let launch_args = [dec_args, &[part]].concat();
            let mut launches = vec![launch(KernelKey::AttentionDec(a), launch_args, grid, (32 * warps) as u32)];
            if splits > 1 {
                // seq_off, pos, out, T and sinks of the attention's arguments, then the splits.
                let merge_args = [4, 5, 7, 8, 9].iter().map(|&a| args[a]).chain([part]).collect();
                let merge = KernelKey::AttentionDecMerge(DecAttention { rope: None, ..a });
                launches.push(launch(merge, merge_args, [per_token(dec.kv_heads, 1), ONE], 128));
            }
            (bound, launches)
        })
        .collect()
}

/// A mixture of experts (`kernels/moe.cuh`): the routing (from the router logits, or with
/// the fused router linear `router` its logits computed in f32 from the f32 input, the same
/// for every batch), the chosen experts' gate and up with the activation per (token, expert),
/// their down projections weighted and summed per token (f32 out).
fn moe(b: &mut Builder, i: usize, router: Option<usize>) -> Result<(), CodegenError> {
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
    // The router logits: the fused router linear's, in f32 from the f32 input, or the plan's.
    let logits = match router {
        Some(r) => {
            let rin = &b.plan.nodes[r].inputs;
            let (w, rb) = (rin[1], rin.get(2).copied());
            let logits = b.new_val(e, DType::F32, Count::Tokens);
            let key = KernelKey::MoeRouterLogits { h, e, w: b.wdtype(w), bias: rb.map(|j| b.wdtype(j)) };
            let args = vec![Arg::Buf(x), Arg::Weight(w), rb.map_or(Arg::Null, Arg::Weight), Arg::Buf(logits)];
            b.steps.push(one(launch(key, args, [per_token(1, 1), Dim::Fixed(e.div_ceil(8))], 256)));
            logits
        }
        None => b.f32_val(ins[1])?,
    };
    let route = KernelKey::MoeRoute { e, k, norm, logits: DType::F32 };
    let route = launch(route, vec![Arg::Buf(logits), Arg::Buf(ids), Arg::Buf(weights)], [per_token(1, 1), ONE], 32);
    // 16-bit experts: up to MOE_DIRECT_TOKENS tokens the pairs in token order, the routing in
    // the gate/up launch; above, the grouped kernels over the pairs sorted by expert (faster
    // than per pair from one token, docs/perf.md); others per pair.
    let variants = if w == b.half && h.is_multiple_of(32) && inter.is_multiple_of(32) {
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
    b.steps.push(Step::Kernels { by: Count::Tokens, variants });
    Ok(())
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
/// and up a warp per (pair, feature), then each token's down projections weighted and summed
/// a warp per output feature.
fn direct_moe(logits: usize, ins: &[usize], g: &Grouped, norm: bool, bias_arg: &impl Fn(usize) -> Arg) -> Vec<Launch> {
    let Grouped { x, ids, weights, out, e, h, inter, k, a, .. } = *g;
    let up = KernelKey::MoeUpDirect { h, i: inter, k, e, norm, bias: g.up_bias, act: g.act };
    let ins4 = [Arg::Buf(x), Arg::Buf(logits), Arg::Buf(ids), Arg::Buf(weights)];
    let up_args = [&ins4[..], &gate_up_args(ins, bias_arg), &[Arg::Buf(a)]].concat();
    let up = launch(up, up_args, [Dim::Fixed(inter / 8), per_token(k, 1)], 256);
    let down = KernelKey::MoeDownDirect { h, i: inter, k, bias: g.down_bias };
    let down_args =
        vec![Arg::Buf(a), Arg::Buf(ids), Arg::Buf(weights), Arg::Weight(ins[4]), bias_arg(7), Arg::Buf(out)];
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
        // Tensor-core tiles are 16 features a block; a warp per feature, 8.
        let per_block = if rows { 8 } else { 16 };
        let up = KernelKey::MoeUpGrouped { rows, h, i: inter, k, bias: g.up_bias, act: g.act };
        let ins3 = [Arg::Buf(x16), Arg::Buf(perm), Arg::Buf(tiles)];
        let up_args = [&ins3[..], &gate_up_args(ins, bias_arg), &[Arg::Buf(a)]].concat();
        let up = launch(up, up_args, [Dim::Fixed(inter / per_block), tile_dim], 256);
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
        let down = launch(down, down_args, [Dim::Fixed(h / per_block), tile_dim], 256);
        vec![to_h16.clone(), count.clone(), sort.clone(), up, down, combine.clone()]
    })
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
    use super::{dec_bounds, dec_launches, grouped};
    use crate::{
        tiled, Arg, Count, DecAttention, Dim, HeadNorm, KernelKey, Launch, Mask, RopeShape, Step, WFormat, SKINNY_ROWS,
    };
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

    /// Decode attention splits a row's keys while the rows alone make fewer blocks than the GPU
    /// wants: one variant per split count from 64 rows, the last unbounded with none; a merge
    /// follows each split launch and reads the same scratch buffer; the merge's arguments are
    /// the attention's seq_off, pos, out, T and sinks (the kernel's parameter order).
    #[test]
    fn decode_attention_splits_keys_until_the_rows_fill_the_gpu() {
        // Two kv heads: 64 rows make 128 blocks, under one an SM, so their keys split in two;
        // four kv heads: 256 blocks at 64 rows, none split.
        // Unsplit rows take four warps a block while their blocks fit the GPU at once (396
        // blocks), two past that.
        assert_eq!(dec_bounds(2), [(16, 8, 4), (32, 4, 4), (64, 2, 4), (198, 1, 4), (usize::MAX, 1, 2)]);
        assert_eq!(dec_bounds(4), [(8, 8, 4), (16, 4, 4), (32, 2, 4), (99, 1, 4), (usize::MAX, 1, 2)]);
        assert_eq!(dec_bounds(1), [(32, 8, 4), (64, 4, 4), (128, 2, 4), (396, 1, 4), (usize::MAX, 1, 2)]);
        assert_eq!(dec_bounds(16), [(2, 8, 4), (4, 4, 4), (8, 2, 4), (24, 1, 4), (usize::MAX, 1, 2)]);
        let args: Vec<Arg> = (0..10).map(Arg::Buf).collect();
        let dec_args: Vec<Arg> = (50..70).map(Arg::Buf).collect();
        let rope = RopeShape { rot: 128, rope_q: true, rope_k: true, norm: HeadNorm::default(), ld: [1024, 128, 128] };
        let shape = |splits, warps| DecAttention {
            heads: 8,
            kv_heads: 1,
            d: 128,
            out: DType::BF16,
            mixed_only: true,
            mask: Mask::default(),
            splits,
            warps,
            rope: Some(rope),
        };
        let v = dec_launches(&dec_bounds(1), shape(1, 1), &dec_args, &args, Arg::Buf(99));
        for ((_, ls), (splits, warps)) in v.iter().zip([(8, 4), (4, 4), (2, 4), (1, 4), (1, 2)]) {
            let key = KernelKey::AttentionDec(shape(splits, warps));
            assert_eq!((ls[0].key, ls[0].block), (key, 32 * warps as u32));
            assert_eq!(key.dyn_smem(), crate::schedule::dec_smem(warps, 128));
            assert_eq!(ls[0].grid, [Dim::Per(Count::Tokens, splits, 1), Dim::Fixed(1)]);
            assert_eq!(ls[0].args, [&dec_args[..], &[Arg::Buf(99)]].concat());
            assert_eq!(ls.len(), if splits > 1 { 2 } else { 1 });
            if splits > 1 {
                // The merge is the same for a decode attention that rotates its rows or not.
                let merge = KernelKey::AttentionDecMerge(DecAttention { rope: None, ..shape(splits, warps) });
                assert_eq!(ls[1].key, merge);
                let want: Vec<Arg> = [4, 5, 7, 8, 9, 99].into_iter().map(Arg::Buf).collect();
                assert_eq!(ls[1].args, want);
            }
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
