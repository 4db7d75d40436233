//! GGUF v3 checkpoints (llama.cpp's format): the header, metadata, tensor infos, and
//! dequantization of F32 / F16 / BF16 / Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K
//! tensors to f32.
//!
//! A GGUF file is turned into what the rest of the compiler expects from a HF checkpoint: a
//! `config.json`-like object built from the metadata ([`Gguf::hf_config`]) and tensors under HF
//! names ([`hf_name`]) with HF shapes (GGUF lists dimensions fastest first, so they are
//! reversed) and HF layouts (llama.cpp's converter permutes the rows of Q and K for its RoPE
//! layout; [`Gguf::read_f32`] undoes that).

use crate::CompileError;
use ir::DType;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// Any integer type.
    Int(i64),
    /// f32 or f64.
    Float(f64),
    /// bool.
    Bool(bool),
    /// string.
    Str(String),
    /// array (of any one type).
    Array(Vec<MetaValue>),
}

impl MetaValue {
    fn to_json(&self) -> serde_json::Value {
        match self {
            MetaValue::Int(i) => (*i).into(),
            MetaValue::Float(f) => serde_json::Number::from_f64(*f).map_or(serde_json::Value::Null, Into::into),
            MetaValue::Bool(b) => (*b).into(),
            MetaValue::Str(s) => s.clone().into(),
            MetaValue::Array(a) => a.iter().map(MetaValue::to_json).collect(),
        }
    }
}

/// The element type of GGUF type id `id`, when the engine reads it: F32, F16, BF16 and the
/// block types of [`ir::quant`].
fn dtype_of_id(id: u32) -> Option<DType> {
    Some(match id {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        6 => DType::Q5_0,
        7 => DType::Q5_1,
        8 => DType::Q8_0,
        12 => DType::Q4_K,
        13 => DType::Q5_K,
        14 => DType::Q6_K,
        30 => DType::BF16,
        _ => return None,
    })
}

/// A type's name as llama.cpp spells it (`Q4_1`, `F32`).
pub fn ggml_name(d: DType) -> String {
    d.to_string().to_uppercase()
}

/// A tensor of the file.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    /// Its GGUF name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions as HF orders them (slowest first).
    pub shape: Vec<usize>,
    /// Element type.
    pub ty: DType,
    offset: usize,
}

/// A parsed GGUF file, memory-mapped.
pub struct Gguf {
    path: PathBuf,
    map: memmap2::Mmap,
    /// Metadata key/values.
    pub meta: BTreeMap<String, MetaValue>,
    /// Tensors by GGUF name.
    pub tensors: BTreeMap<String, GgufTensor>,
    data_start: usize,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl Reader<'_> {
    fn err(&self, message: impl Into<String>) -> CompileError {
        CompileError::Checkpoint {
            path: self.path.display().to_string(),
            message: format!("malformed GGUF at byte {}: {}", self.pos, message.into()),
        }
    }

    fn take(&mut self, n: usize) -> Result<&[u8], CompileError> {
        if self.buf.len().saturating_sub(self.pos) < n {
            return Err(
                self.err(format!("the file is truncated (needs {n} more bytes, has {})", self.buf.len() - self.pos))
            );
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, CompileError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64, CompileError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn len(&mut self, what: &str) -> Result<usize, CompileError> {
        let n = self.u64()?;
        if n > self.buf.len() as u64 {
            return Err(self.err(format!("{what} length {n} exceeds the file size")));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String, CompileError> {
        let n = self.len("string")?;
        let bytes = self.take(n)?.to_vec();
        String::from_utf8(bytes).map_err(|_| self.err("a string is not UTF-8"))
    }

    fn value(&mut self, ty: u32) -> Result<MetaValue, CompileError> {
        Ok(match ty {
            0 => MetaValue::Int(self.take(1)?[0] as i64),
            1 => MetaValue::Int(self.take(1)?[0] as i8 as i64),
            2 => MetaValue::Int(u16::from_le_bytes(self.take(2)?.try_into().expect("2")) as i64),
            3 => MetaValue::Int(i16::from_le_bytes(self.take(2)?.try_into().expect("2")) as i64),
            4 => MetaValue::Int(self.u32()? as i64),
            5 => MetaValue::Int(self.u32()? as i32 as i64),
            6 => MetaValue::Float(f32::from_le_bytes(self.take(4)?.try_into().expect("4")) as f64),
            7 => MetaValue::Bool(self.take(1)?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            9 => {
                let inner = self.u32()?;
                let n = self.len("array")?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(inner)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::Int(self.u64()? as i64),
            11 => MetaValue::Int(self.u64()? as i64),
            12 => MetaValue::Float(f64::from_le_bytes(self.take(8)?.try_into().expect("8"))),
            other => return Err(self.err(format!("unknown metadata value type {other}"))),
        })
    }
}

/// The HF tensor name of a GGUF tensor name (llama architecture), if it has one.
pub fn hf_name(gguf: &str) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (stem, suffix) = part.rsplit_once('.')?;
    let hf = match stem {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

impl Gguf {
    /// Opens and parses `path`.
    pub fn open(path: &Path) -> Result<Gguf, CompileError> {
        let f = std::fs::File::open(path)
            .map_err(|e| CompileError::Checkpoint { path: path.display().to_string(), message: e.to_string() })?;
        // SAFETY: read-only mapping of a checkpoint file that is not modified while compiling.
        let map = unsafe { memmap2::Mmap::map(&f) }
            .map_err(|e| CompileError::Checkpoint { path: path.display().to_string(), message: e.to_string() })?;
        let mut r = Reader { buf: &map, pos: 0, path };
        if map.get(..4) != Some(b"GGUF".as_slice()) {
            return Err(r.err("wrong magic: not a GGUF file (expected the bytes `GGUF`)"));
        }
        r.pos = 4;
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(r.err(format!("GGUF version {version} is not supported (2 and 3 are)")));
        }
        let n_tensors = r.len("tensor count")?;
        let n_kv = r.len("metadata count")?;
        let mut meta = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            meta.insert(key, r.value(ty)?);
        }
        let mut tensors = BTreeMap::new();
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()? as usize;
            if n_dims > 4 {
                return Err(r.err(format!("tensor `{name}` has {n_dims} dimensions")));
            }
            let mut dims = (0..n_dims).map(|_| r.u64().map(|d| d as usize)).collect::<Result<Vec<_>, _>>()?;
            dims.reverse();
            let type_id = r.u32()?;
            let ty = dtype_of_id(type_id).ok_or_else(|| {
                r.err(format!("tensor `{name}` has quantization type {type_id}, which is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)"))
            })?;
            let offset = r.u64()? as usize;
            tensors.insert(name.clone(), GgufTensor { name, shape: dims, ty, offset });
        }
        let align = match meta.get("general.alignment") {
            Some(MetaValue::Int(a)) if *a > 0 => *a as usize,
            _ => 32,
        };
        let data_start = r.pos.div_ceil(align) * align;
        let g = Gguf { path: path.to_path_buf(), map, meta, tensors, data_start };
        for t in g.tensors.values() {
            g.bytes(t)?;
        }
        Ok(g)
    }

    fn bytes(&self, t: &GgufTensor) -> Result<&[u8], CompileError> {
        let n: usize = t.shape.iter().product();
        let size = t.ty.bytes(n).ok_or_else(|| {
            let len = t.ty.block().map_or(1, |(len, _)| len);
            self.err(format!("tensor `{}` has {n} elements, not whole {}-element {} blocks", t.name, len, t.ty))
        })?;
        let start = self.data_start + t.offset;
        let end = start + size;
        self.map.get(start..end).ok_or_else(|| {
            self.err(format!(
                "tensor `{}` lies past the end of the file (bytes {start}..{end} of {}): the file is truncated",
                t.name,
                self.map.len()
            ))
        })
    }

    fn err(&self, message: String) -> CompileError {
        CompileError::Checkpoint { path: self.path.display().to_string(), message }
    }

    fn meta_int(&self, key: &str) -> Option<i64> {
        match self.meta.get(key) {
            Some(MetaValue::Int(i)) => Some(*i),
            _ => None,
        }
    }

    /// The architecture (`general.architecture`).
    pub fn architecture(&self) -> Result<String, CompileError> {
        match self.meta.get("general.architecture") {
            Some(MetaValue::Str(s)) => Ok(s.clone()),
            _ => Err(self.err("no `general.architecture` in the metadata".into())),
        }
    }

    /// A HF-style `config.json` object built from the metadata.
    pub fn hf_config(&self) -> Result<serde_json::Value, CompileError> {
        let arch = self.architecture()?;
        let hf_arch = match arch.as_str() {
            "llama" => "LlamaForCausalLM",
            "qwen2" => "Qwen2ForCausalLM",
            "qwen3" => "Qwen3ForCausalLM",
            other => {
                return Err(self.err(format!("GGUF architecture `{other}` is not supported (llama, qwen2, qwen3 are)")))
            }
        };
        let key = |k: &str| format!("{arch}.{k}");
        let mut c = serde_json::Map::new();
        c.insert("architectures".into(), serde_json::json!([hf_arch]));
        let map = [
            ("block_count", "num_hidden_layers"),
            ("embedding_length", "hidden_size"),
            ("feed_forward_length", "intermediate_size"),
            ("attention.head_count", "num_attention_heads"),
            ("attention.head_count_kv", "num_key_value_heads"),
            ("rope.freq_base", "rope_theta"),
            ("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
            ("context_length", "max_position_embeddings"),
            ("vocab_size", "vocab_size"),
            // Qwen3's head size need not be hidden / heads: its key length says it.
            ("attention.key_length", "head_dim"),
            ("rope.dimension_count", "head_dim"),
        ];
        for (g, h) in map {
            if let Some(v) = self.meta.get(&key(g)) {
                c.insert(h.into(), v.to_json());
            }
        }
        if !c.contains_key("vocab_size") {
            if let Some(MetaValue::Array(toks)) = self.meta.get("tokenizer.ggml.tokens") {
                c.insert("vocab_size".into(), toks.len().into());
            } else if let Some(t) = self.tensors.get("token_embd.weight") {
                c.insert("vocab_size".into(), t.shape[0].into());
            }
        }
        c.insert("tie_word_embeddings".into(), (!self.tensors.contains_key("output.weight")).into());
        for (g, h) in [("tokenizer.ggml.eos_token_id", "eos_token_id"), ("tokenizer.ggml.bos_token_id", "bos_token_id")]
        {
            if let Some(v) = self.meta_int(g) {
                c.insert(h.into(), v.into());
            }
        }
        // An end-of-turn token (Llama 3 Instruct's <|eot_id|>) stops generation as eos does.
        if let (Some(eos), Some(eot)) =
            (self.meta_int("tokenizer.ggml.eos_token_id"), self.meta_int("tokenizer.ggml.eot_token_id"))
        {
            if eot != eos {
                c.insert("eos_token_id".into(), serde_json::json!([eos, eot]));
            }
        }
        c.insert("torch_dtype".into(), "float32".into());
        Ok(serde_json::Value::Object(c))
    }

    /// A tensor as f32 values in HF layout (Q and K rows un-permuted for llama).
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, CompileError> {
        let (ty, bytes) = self.read_raw(name)?;
        Ok(ty.to_f32(&bytes))
    }

    /// A tensor's element type and bytes as stored (a block type's blocks), its rows in HF's
    /// order (Q and K rows un-permuted for llama).
    pub fn read_raw(&self, name: &str) -> Result<(DType, Vec<u8>), CompileError> {
        let t = self.tensors.get(name).ok_or_else(|| self.err(format!("tensor `{name}` is missing")))?;
        let mut v = self.bytes(t)?.to_vec();
        let heads = if name.ends_with("attn_q.weight") {
            self.meta_int(&format!("{}.attention.head_count", self.architecture()?))
        } else if name.ends_with("attn_k.weight") {
            let arch = self.architecture()?;
            self.meta_int(&format!("{arch}.attention.head_count_kv"))
                .or(self.meta_int(&format!("{arch}.attention.head_count")))
        } else {
            None
        };
        if let (Some(h), true) = (heads, self.architecture()? == "llama") {
            v = unpermute_rows(&v, t.shape[0], h as usize);
        }
        Ok((t.ty, v))
    }
}

/// Undoes llama.cpp's `permute(w, n_head)`: rows of each head were reordered from
/// `[half, 2]` (interleaved pairs) to `[2, half]`... in reverse, i.e. GGUF stores
/// `w.reshape(h, 2, d/2, ...).swapaxes(1, 2)`; this restores HF's rotate-half row order.
/// `v` holds `rows` rows of equal byte length (whole blocks of a block type).
fn unpermute_rows(v: &[u8], rows: usize, heads: usize) -> Vec<u8> {
    let cols = v.len() / rows;
    let per_head = rows / heads;
    let half = per_head / 2;
    let mut out = vec![0; v.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                // GGUF row (h, i, j) holds HF row (h, j, i).
                let src = h * per_head + i * 2 + j;
                let dst = h * per_head + j * half + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&v[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hf() {
        assert_eq!(hf_name("blk.12.attn_q.weight").unwrap(), "model.layers.12.self_attn.q_proj.weight");
        assert_eq!(hf_name("blk.0.ffn_down.weight").unwrap(), "model.layers.0.mlp.down_proj.weight");
        assert_eq!(hf_name("output.weight").unwrap(), "lm_head.weight");
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // 1 head of 4 rows, 1 column: HF rows [a0, a1, b0, b1] are stored as [a0, b0, a1, b1].
        let stored = [0, 2, 1, 3];
        assert_eq!(unpermute_rows(&stored, 4, 1), vec![0, 1, 2, 3]);
    }
}
