//! The shapes of the attention kernels' instances: how an attention masks its scores
//! ([`Mask`]), a decode attention's shape ([`DecAttention`]), how RoPE and the cache write apply
//! ([`RopeShape`], [`HeadNorm`]), and the parameter lists and template arguments they render.

use super::{ctype, n3, opt_ctype, rot_suffix};
use crate::CodegenError;
#[cfg(doc)]
use crate::KernelKey;
use ir::DType;

/// How an attention masks and caps its scores (`ir::Op::Attention`'s `window` and `softcap`),
/// template arguments of the attention kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Mask {
    /// Sliding window in positions (0: none).
    pub window: usize,
    /// The soft-capping constant's f32 bits (0: none).
    pub cap: u32,
    /// The dtype of the per-head sink logits, where the attention has them.
    pub sink: Option<DType>,
}

impl Mask {
    /// Suffix of kernel names (empty without a mask).
    pub(super) fn suffix(self) -> String {
        let w = if self.window > 0 { format!("_w{}", self.window) } else { String::new() };
        let c = if self.cap != 0 { format!("_c{:08x}", self.cap) } else { String::new() };
        let s = self.sink.map_or(String::new(), |d| format!("_s{d}"));
        w + &c + &s
    }

    /// The template arguments `WIN, CAP, SW` (SW: the sinks' type, float without them).
    pub(super) fn args(self) -> Result<String, CodegenError> {
        Ok(format!("{}, {}u, {}", self.window, self.cap, opt_ctype(self.sink)?))
    }

    /// The sinks parameter (`SW` as [`Mask::args`]).
    pub(super) fn sinks_param(self) -> Result<String, CodegenError> {
        Ok(format!("const {}* sinks", opt_ctype(self.sink)?))
    }
}

/// The shape of a decode attention ([`KernelKey::AttentionDec`]) and of the merge of its splits
/// ([`KernelKey::AttentionDecMerge`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecAttention {
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head size (a multiple of 16, at most 128).
    pub d: usize,
    /// Output dtype.
    pub out: DType,
    /// Only the rows [`KernelKey::AttentionFa`] leaves (groups of 16 spanning sequences).
    pub mixed_only: bool,
    /// Sliding window, score soft-capping and sinks.
    pub mask: Mask,
    /// Blocks a row's keys may split into (`dec_splits`); above 1, each split's state goes to a
    /// scratch buffer that the merge combines.
    pub splits: usize,
    /// Warps of a decode attention block (`crate::schedule::DEC_WARPS`, or fewer where the
    /// step's blocks would not fit the GPU at once).
    pub warps: usize,
    /// The RoPE and cache write the kernel applies itself to rows alone in their sequence (decode
    /// rows), so a decode step needs no `rope_kv` before it; `None`: `rope_kv` ran for every row.
    /// The merge ([`KernelKey::AttentionDecMerge`]) has none.
    pub rope: Option<RopeShape>,
}

impl DecAttention {
    /// Where the rotated queries (`rope_kv`'s, `qo`) are among the arguments of a decode
    /// attention with a rope: after `rope_kv`'s eleven inputs and the two caches.
    pub const ROTATED_Q_ARG: usize = 13;

    /// The part of both kernels' names after their kind.
    pub(super) fn suffix(self) -> String {
        let DecAttention { heads, kv_heads, d, out, mixed_only, mask, splits, warps, rope } = self;
        let mixed = if mixed_only { "_mixed" } else { "" };
        let rope = rope.map_or(String::new(), |r| format!("_rope{}", r.suffix(heads, kv_heads, d)));
        format!("h{heads}_kv{kv_heads}_d{d}_to_{out}{mixed}{}_x{splits}_w{warps}{rope}", mask.suffix())
    }

    /// The decode attention's parameters and its call of `attention_dec`: the attention's
    /// (`attention_params`), the sinks and the split states; with a rope, `rope_kv`'s inputs
    /// first ([`HeadNorm::rope_head_params`]), the caches writable and the rotated queries `qo`.
    pub(super) fn params_and_call(self) -> Result<(String, String), CodegenError> {
        let DecAttention { heads, kv_heads, d, out, mixed_only, mask, splits, warps, rope } = self;
        let o = ctype(out)?;
        let tmpl = format!("{heads}, {kv_heads}, {d}, {o}, {mixed_only}, {}, {splits}, {warps}", mask.args()?);
        let tail = format!("{o}* out, int T, {}, float* part", mask.sinks_param()?);
        Ok(match rope {
            None => (
                format!("{}, {}, float* part", attention_params(o), mask.sinks_param()?),
                format!("attention_dec<{tmpl}, NoRope>(q, kc, vc, slots, seq_off, pos, scale, out, T, sinks, part, {{}})"),
            ),
            Some(r) => (
                format!(
                    "{}, h16_t* kc, h16_t* vc, const float* qo, const int* slots, const int* seq_off, float scale, {tail}",
                    r.norm.rope_head_params()?
                ),
                format!(
                    "attention_dec<{tmpl}, DecRope<{0}>>(qo, kc, vc, slots, seq_off, pos, scale, out, T, sinks, part, \
                     DecRope<{0}>{{{ROPE_HEAD_ARGS}, kc, vc}})",
                    r.args()?
                ),
            ),
        })
    }
}

/// How RoPE and the KV-cache write apply to a layer's q, k and v, alike in `rope_kv` and in a
/// decode attention that rotates its rows itself (`kernels/attention.cuh`'s `ROT, RQ, RK, NQ,
/// NK, NWQ, NWK, LQ, LK, LV`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RopeShape {
    /// Features rotated at the start of each head.
    pub rot: usize,
    /// Whether q is rotated.
    pub rope_q: bool,
    /// Whether k is rotated.
    pub rope_k: bool,
    /// Per-head norms of q and k before the rotation.
    pub norm: HeadNorm,
    /// Row strides of q, k and v in floats: their widths, or the row of the packed matrix one
    /// launch wrote them into.
    pub ld: [usize; 3],
}

impl RopeShape {
    /// Suffix of kernel names.
    pub(super) fn suffix(self, heads: usize, kv_heads: usize, d: usize) -> String {
        let RopeShape { rot, rope_q, rope_k, norm, ld } = self;
        let ld = if ld == [heads * d, kv_heads * d, kv_heads * d] { String::new() } else { format!("_ld{}", n3(ld)) };
        format!("{}_{}{}{}{ld}", rot_suffix(d, rot), u8::from(rope_q), u8::from(rope_k), norm.suffix())
    }

    /// The template arguments `ROT, RQ, RK, NQ, NK, NWQ, NWK, LQ, LK, LV`.
    pub(super) fn args(self) -> Result<String, CodegenError> {
        let RopeShape { rot, rope_q, rope_k, norm, ld } = self;
        Ok(format!("{rot}, {rope_q}, {rope_k}, {}, {}, {}, {}", norm.args()?, ld[0], ld[1], ld[2]))
    }
}

/// The per-head RMS norms of q and k that a rope_attention fusion applies before RoPE
/// (`kernels/attention.cuh`'s `NQ, NK, NWQ, NWK`): each one's weight dtype, `None` without.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct HeadNorm {
    /// q's norm weight.
    pub q: Option<DType>,
    /// k's norm weight.
    pub k: Option<DType>,
}

impl HeadNorm {
    /// Suffix of kernel names (empty without norms).
    pub(super) fn suffix(self) -> String {
        let tag = |w: Option<DType>| w.map_or("0".to_string(), |d| d.to_string());
        if self == HeadNorm::default() {
            return String::new();
        }
        format!("_n{}_{}", tag(self.q), tag(self.k))
    }

    /// The template arguments `NQ, NK, NWQ, NWK`.
    pub(super) fn args(self) -> Result<String, CodegenError> {
        let (q, k) = self.weight_types()?;
        Ok(format!("{}, {}, {q}, {k}", self.q.is_some(), self.k.is_some()))
    }

    /// The parameters RoPE + KV write kernels share: q, k and v, where the token goes, how it
    /// rotates and how its heads are normalised.
    pub(super) fn rope_head_params(self) -> Result<String, CodegenError> {
        let (q, k) = self.weight_types()?;
        Ok(format!(
            "const float* q, const float* k, const float* v, const int* pos, const float* inv_freq, float rscale, \
             const int* slot_of, const {q}* qnw, const {k}* knw, float qeps, float keps"
        ))
    }

    /// The C types of q's and k's norm weights (`float` for an absent one: never read).
    pub(super) fn weight_types(self) -> Result<(&'static str, &'static str), CodegenError> {
        let ty = |w: Option<DType>| ctype(w.unwrap_or(DType::F32));
        Ok((ty(self.q)?, ty(self.k)?))
    }
}

/// The arguments [`HeadNorm::rope_head_params`] names, in the kernels' calls.
pub(super) const ROPE_HEAD_ARGS: &str = "q, k, v, pos, inv_freq, rscale, slot_of, qnw, knw, qeps, keps";

/// The parameters every attention kernel of the paged cache takes, `o` its output type.
pub(super) fn attention_params(o: &str) -> String {
    format!(
        "const float* q, const h16_t* kc, const h16_t* vc, const int* slots, const int* seq_off, const int* pos, \
         float scale, {o}* out, int T"
    )
}
