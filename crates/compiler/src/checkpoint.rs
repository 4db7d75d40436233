//! Reading a checkpoint: a Hugging Face directory (`config.json` and safetensors weights,
//! single file or sharded as `model-0000K-of-0000N.safetensors` + `model.safetensors.index.json`)
//! or a GGUF file (see [`crate::gguf`]), presented alike: a config and tensors under HF names.
//! An FP8 checkpoint's weights (see [`crate::fp8`]) are tensors like the others, read as f32
//! or kept as `F8_E4M3` blocks; their scale tensors, and static activation scales, belong to
//! them and are not listed among the tensors.

use crate::fp8::{self, Grid};
use crate::gguf::{ggml_name, hf_name, Gguf};
use crate::CompileError;
use ir::DType;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A tensor's description in the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Element type as the file spells it (`BF16`, `F8_E4M3`, `Q4_1`, ...).
    pub dtype_name: String,
    /// Shape (HF order: slowest dimension first).
    pub shape: Vec<usize>,
    /// Whether the engine can read this element type (an FP8 weight: with its scale tensor).
    pub readable: bool,
    /// Where its bytes are: a safetensors file and the byte range in it, or the GGUF tensor name.
    location: Location,
    /// An FP8 weight's scale tensor and the grid of its scales.
    scale: Option<(String, Grid)>,
}

#[derive(Debug, Clone, PartialEq)]
enum Location {
    /// The index of a safetensors file of the checkpoint and the tensor's bytes in it (read
    /// from the header once, at open: a header of ~19k tensors takes milliseconds to parse).
    File(usize, std::ops::Range<usize>),
    Gguf(String),
}

impl TensorInfo {
    /// The safetensors dtype, when it is one the engine reads (bf16, f16, f32).
    pub fn dtype(&self) -> Option<DType> {
        DType::from_safetensors_name(&self.dtype_name).filter(|d| d.is_float())
    }

    /// The block type a tensor can be kept in as it is stored, if any: a GGUF tensor's (Q8_0,
    /// Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), or `F8_E4M3` for an FP8 weight with its scales whose rows
    /// are whole blocks of 32 ([`Checkpoint::read_blocks`]).
    pub fn block(&self) -> Option<DType> {
        if let Some((_, grid)) = &self.scale {
            return grid.k.is_multiple_of(ir::BLOCK).then_some(DType::F8_E4M3);
        }
        let gguf = matches!(self.location, Location::Gguf(_));
        DType::ALL.into_iter().filter(|d| gguf && d.is_block()).find(|d| ggml_name(*d) == self.dtype_name)
    }
}

/// An FP8 weight's codes as stored, its scales as f32, and their grid.
type Fp8Parts<'a> = (&'a [u8], Vec<f32>, Grid);

/// An opened checkpoint.
pub struct Checkpoint {
    /// The directory (for a GGUF file, the directory that holds it).
    pub dir: PathBuf,
    /// The path given: the directory, or the GGUF file.
    pub path: PathBuf,
    /// Parsed `config.json` (for GGUF, built from the metadata).
    pub config: serde_json::Value,
    files: Vec<(PathBuf, memmap2::Mmap)>,
    gguf: Option<Gguf>,
    tensors: BTreeMap<String, TensorInfo>,
    /// The FP8 format `quantization_config` declares.
    fp8: Option<fp8::Scheme>,
    /// Tensors that belong to others: FP8 scales, static activation scales.
    owned: BTreeMap<String, TensorInfo>,
    /// How many of `owned` are static activation scales.
    activation_scales: usize,
}

fn ckpt_err(path: &Path, message: impl Into<String>) -> CompileError {
    CompileError::Checkpoint { path: path.display().to_string(), message: message.into() }
}

impl Checkpoint {
    /// Opens a checkpoint directory (reading config.json and every safetensors header) or a
    /// `.gguf` file.
    pub fn open(dir: &Path) -> Result<Checkpoint, CompileError> {
        if dir.is_file() {
            return Self::open_gguf(dir);
        }
        if !dir.is_dir() {
            return Err(ckpt_err(dir, "checkpoint directory does not exist"));
        }
        let cpath = dir.join("config.json");
        let text =
            std::fs::read_to_string(&cpath).map_err(|e| ckpt_err(&cpath, format!("cannot read config.json: {e}")))?;
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ckpt_err(&cpath, format!("malformed JSON: {e}")))?;
        let fp8 = fp8::scheme(&config).map_err(|m| ckpt_err(&cpath, m))?;
        let mut ck = Checkpoint {
            dir: dir.to_path_buf(),
            path: dir.to_path_buf(),
            config,
            files: Vec::new(),
            gguf: None,
            tensors: BTreeMap::new(),
            fp8,
            owned: BTreeMap::new(),
            activation_scales: 0,
        };
        for path in weight_files(dir)? {
            ck.add_file(&path)?;
        }
        if ck.files.is_empty() {
            return Err(ckpt_err(dir, "no *.safetensors weights found"));
        }
        ck.attach_scales()?;
        Ok(ck)
    }

    fn open_gguf(path: &Path) -> Result<Checkpoint, CompileError> {
        let g = Gguf::open(path)?;
        let config = g.hf_config()?;
        let mut tensors = BTreeMap::new();
        for t in g.tensors.values() {
            // Tensors with no HF counterpart (e.g. rope_freqs) keep their GGUF name, so that
            // they are reported as unused.
            let name = hf_name(&t.name).unwrap_or_else(|| t.name.clone());
            let info = TensorInfo {
                dtype_name: ggml_name(t.ty),
                shape: t.shape.clone(),
                readable: true,
                location: Location::Gguf(t.name.clone()),
                scale: None,
            };
            tensors.insert(name, info);
        }
        Ok(Checkpoint {
            dir: path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf),
            path: path.to_path_buf(),
            config,
            files: Vec::new(),
            gguf: Some(g),
            tensors,
            fp8: None,
            owned: BTreeMap::new(),
            activation_scales: 0,
        })
    }

    fn add_file(&mut self, path: &Path) -> Result<(), CompileError> {
        let f = std::fs::File::open(path).map_err(|e| ckpt_err(path, e.to_string()))?;
        // SAFETY: read-only mapping of a checkpoint file that is not modified while compiling.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| ckpt_err(path, e.to_string()))?;
        // Validates the header: offsets contiguous, each tensor's bytes its shape's, the data
        // ending with the file.
        let (n, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| ckpt_err(path, format!("not a valid safetensors file: {e}")))?;
        let idx = self.files.len();
        for (name, info) in meta.tensors() {
            let dtype_name = format!("{:?}", info.dtype);
            let readable = DType::from_safetensors_name(&dtype_name).is_some_and(DType::is_float);
            let (start, end) = info.data_offsets;
            let location = Location::File(idx, 8 + n + start..8 + n + end);
            let t = TensorInfo { dtype_name, shape: info.shape.clone(), readable, location, scale: None };
            // Two files holding one name (a stray copy beside the weights): which one is meant
            // is not for us to guess.
            if let Some(Location::File(other, _)) = self.tensors.insert(name.clone(), t).map(|t| t.location) {
                let first = self.files[other].0.display().to_string();
                return Err(ckpt_err(
                    path,
                    format!("tensor `{name}` is also in {first}: one checkpoint tensor per name"),
                ));
            }
        }
        self.files.push((path.to_path_buf(), map));
        Ok(())
    }

    /// Under an FP8 scheme: moves each FP8 weight's scale tensor and every static activation
    /// scale out of the tensors the model may name, the weight readable with its scale grid. An
    /// FP8 weight without its scale tensor, or whose scales do not fit it, is an error.
    fn attach_scales(&mut self) -> Result<(), CompileError> {
        let Some(scheme) = self.fp8.clone() else {
            return Ok(());
        };
        let activation: Vec<String> = self.names().filter(|n| fp8::is_activation_scale(n)).map(String::from).collect();
        self.activation_scales = activation.len();
        let weights: Vec<String> =
            self.tensors.iter().filter(|(_, t)| t.dtype_name == "F8_E4M3").map(|(n, _)| n.clone()).collect();
        for name in activation.into_iter().chain(weights.iter().map(|w| format!("{w}{}", scheme.scale_suffix))) {
            if let Some(t) = self.tensors.remove(&name) {
                self.owned.insert(name, t);
            }
        }
        for name in weights {
            let scale = format!("{name}{}", scheme.scale_suffix);
            let s = self.owned.get(&scale).ok_or_else(|| {
                ckpt_err(&self.path, format!("FP8 weight `{name}` has no scale tensor `{scale}` beside it"))
            })?;
            if s.dtype().is_none() {
                return Err(CompileError::UnsupportedDtype { name: scale, dtype: s.dtype_name.clone() });
            }
            if let Some(t) = self.tensors.get_mut(&name) {
                let grid =
                    fp8::grid(&scheme, (&name, &t.shape), (&scale, &s.shape)).map_err(|m| ckpt_err(&self.path, m))?;
                t.scale = Some((scale, grid));
                t.readable = true;
            }
        }
        Ok(())
    }

    /// Warnings about the checkpoint itself: static activation scales it holds and the engine
    /// does not use.
    pub fn warnings(&self) -> Vec<String> {
        match self.activation_scales {
            0 => vec![],
            n => vec![fp8::activation_scales_note(n)],
        }
    }

    /// Description of a tensor, if present.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Names of every tensor.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// A tensor as f32 values (an FP8 weight's dequantized: code times its scale).
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, CompileError> {
        let info = self.tensors.get(name).ok_or_else(|| ckpt_err(&self.path, format!("tensor `{name}` is missing")))?;
        if let (Location::Gguf(gname), Some(g)) = (&info.location, &self.gguf) {
            return g.read_f32(gname);
        }
        if let Some((codes, scales, grid)) = self.fp8_parts(name, info)? {
            return Ok(fp8::dequantize(codes, &scales, grid));
        }
        self.dense(name, info)
    }

    /// A tensor's blocks (its rows in HF's order), when it can be kept as stored
    /// ([`TensorInfo::block`]): a GGUF block type's, or an FP8 weight's codes and scales as
    /// `F8_E4M3` blocks (exactly those of the checkpoint).
    pub fn read_blocks(&self, name: &str) -> Result<(DType, Vec<u8>), CompileError> {
        let info = self.tensors.get(name).filter(|t| t.block().is_some());
        match (info, &self.gguf) {
            (Some(TensorInfo { location: Location::Gguf(gname), .. }), Some(g)) => g.read_raw(gname),
            (Some(info), _) => match self.fp8_parts(name, info)? {
                Some((codes, scales, grid)) => Ok((DType::F8_E4M3, fp8::blocks(codes, &scales, grid))),
                None => Err(ckpt_err(&self.path, format!("tensor `{name}` is not stored in blocks"))),
            },
            (None, _) => Err(ckpt_err(&self.path, format!("tensor `{name}` is not stored in blocks"))),
        }
    }

    /// An FP8 weight's codes, its scales as f32 and their grid (`None` for other tensors).
    fn fp8_parts<'a>(&'a self, name: &str, info: &TensorInfo) -> Result<Option<Fp8Parts<'a>>, CompileError> {
        let Some((scale, grid)) = &info.scale else {
            return Ok(None);
        };
        let s = self.owned.get(scale).ok_or_else(|| ckpt_err(&self.path, format!("tensor `{scale}` is missing")))?;
        Ok(Some((self.bytes(name, info)?, self.dense(scale, s)?, *grid)))
    }

    /// A bf16, f16 or f32 safetensors tensor as f32 values.
    fn dense(&self, name: &str, info: &TensorInfo) -> Result<Vec<f32>, CompileError> {
        let dtype = info
            .dtype()
            .ok_or_else(|| CompileError::UnsupportedDtype { name: name.to_string(), dtype: info.dtype_name.clone() })?;
        Ok(dtype.to_f32(self.bytes(name, info)?))
    }

    /// A safetensors tensor's bytes, as stored.
    fn bytes(&self, name: &str, info: &TensorInfo) -> Result<&[u8], CompileError> {
        let Location::File(file, range) = &info.location else {
            return Err(ckpt_err(&self.path, format!("tensor `{name}` is a GGUF tensor")));
        };
        let (path, map) = &self.files[*file];
        map.get(range.clone()).ok_or_else(|| ckpt_err(path, format!("tensor `{name}` lies past the file's end")))
    }

    /// A bf16, f16 or f32 tensor's bytes as stored, with their dtype (`None` for FP8, GGUF
    /// and other tensors): what a weight of the same dtype copies as it is.
    pub fn dense_bytes(&self, name: &str) -> Option<(DType, &[u8])> {
        let info = self.tensors.get(name).filter(|t| t.scale.is_none())?;
        Some((info.dtype()?, self.bytes(name, info).ok()?))
    }

    /// The most common float dtype among the tensors (the checkpoint's storage type).
    pub fn main_dtype(&self) -> Option<DType> {
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for t in self.tensors.values() {
            if let Some(d) = t.dtype() {
                *counts.entry(d.to_string()).or_default() += t.shape.iter().product::<usize>();
            }
        }
        counts.into_iter().max_by_key(|(_, n)| *n).and_then(|(d, _)| DType::parse_float(&d))
    }
}

/// The safetensors files of a checkpoint: those named by the index when there is one, else
/// `model.safetensors` when there is one, else every `*.safetensors` in the directory.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, CompileError> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| ckpt_err(&index, e.to_string()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ckpt_err(&index, format!("malformed JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ckpt_err(&index, "has no `weight_map` object"))?;
        let mut files: Vec<String> = map.values().filter_map(|f| f.as_str().map(String::from)).collect();
        files.sort();
        files.dedup();
        return files
            .into_iter()
            .map(|f| {
                let p = dir.join(&f);
                if p.is_file() {
                    Ok(p)
                } else {
                    Err(ckpt_err(&index, format!("names shard `{f}`, which is missing")))
                }
            })
            .collect();
    }
    // HF's single-file checkpoint: other safetensors files beside it (reference outputs, a
    // stray copy) are not part of it, as `from_pretrained` does not read them either.
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let rd = std::fs::read_dir(dir).map_err(|e| ckpt_err(dir, e.to_string()))?;
    let mut files: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    Ok(files)
}
