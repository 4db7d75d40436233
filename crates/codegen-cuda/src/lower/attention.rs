//! Attention lowered to launches: the one-token kernel, RoPE + KV write, extend attention on
//! tensor cores and decode attention (`attention_dec`, which rotates and caches the rows alone
//! in their sequence itself) with its key splits, or `attention_gqa` where those do not apply.

use super::node;
use crate::keys::{DecAttention, HeadNorm, KernelKey, Mask, RopeShape};
use crate::schedule::{
    dec_splits, dec_warps_rows, launch, per_token, Arg, Builder, Count, Dim, Input, Launch, Step, DEC_WARPS,
    DEC_WARPS_PAST_WAVE, FA_ROWS, FA_WARPS, ONE,
};
use crate::CodegenError;
use ir::{DType, Op};

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
pub(super) fn head_norm_fuses(b: &Builder, x: usize) -> bool {
    let w = b.plan.nodes[x].inputs[1];
    b.wdtype(w) == DType::F32 || b.wdtype(w) == b.half
}

/// RoPE (of the ropes fused into it, `pre`, and the per-head norms they rotate) + KV write,
/// then attention.
pub(super) fn attention(b: &mut Builder, i: usize, pre: &[usize]) -> Result<(), CodegenError> {
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
    // Few rows of the shapes attention_dec does not take: a block per row and query head.
    let per_head = || (GQA_HEAD_ROWS, vec![rope.clone(), rows(false, 1)]);
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
            variants.extend([per_head(), (usize::MAX, vec![rope, fa, rows(true, group)])]);
        }
    } else {
        variants.extend([per_head(), (usize::MAX, vec![rope, rows(false, group)])]);
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

#[cfg(test)]
mod tests {
    use super::{dec_bounds, dec_launches};
    use crate::{Arg, Count, DecAttention, Dim, HeadNorm, KernelKey, Mask, RopeShape};
    use ir::DType;

    /// Decode attention splits a row's keys while the rows alone make fewer blocks than the GPU
    /// wants: one variant per split count from two rows, the last unbounded with none; a merge
    /// follows each split launch and reads the same scratch buffer; the merge's arguments are
    /// the attention's seq_off, pos, out, T and sinks (the kernel's parameter order).
    #[test]
    fn decode_attention_splits_keys_until_the_rows_fill_the_gpu() {
        // Two kv heads: 64 rows make 128 blocks, under one an SM, so their keys split in two;
        // four kv heads: 256 blocks at 64 rows, none split.
        // Unsplit rows take four warps a block while their blocks fit the GPU at once (264
        // blocks), two past that.
        assert_eq!(dec_bounds(2), [(16, 8, 4), (32, 4, 4), (64, 2, 4), (132, 1, 4), (usize::MAX, 1, 2)]);
        assert_eq!(dec_bounds(4), [(8, 8, 4), (16, 4, 4), (32, 2, 4), (66, 1, 4), (usize::MAX, 1, 2)]);
        assert_eq!(dec_bounds(1), [(32, 8, 4), (64, 4, 4), (128, 2, 4), (264, 1, 4), (usize::MAX, 1, 2)]);
        assert_eq!(dec_bounds(16), [(2, 8, 4), (4, 4, 4), (8, 2, 4), (16, 1, 4), (usize::MAX, 1, 2)]);
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
}
