//! Reading a checkpoint: a Hugging Face directory (`config.json` and safetensors weights,
//! single file or sharded as `model-0000K-of-0000N.safetensors` + `model.safetensors.index.json`)
//! or a GGUF file (see [`crate::gguf`]), presented alike: a config and tensors under HF names.

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
    /// Whether the engine can read this element type.
    pub readable: bool,
    /// Safetensors file index, or the GGUF tensor name.
    location: Location,
}

#[derive(Debug, Clone, PartialEq)]
enum Location {
    File(usize),
    Gguf(String),
}

impl TensorInfo {
    /// The safetensors dtype, when it is one the engine reads (bf16, f16, f32).
    pub fn dtype(&self) -> Option<DType> {
        DType::from_safetensors_name(&self.dtype_name).filter(|d| d.is_float())
    }

    /// The GGUF block type (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) a GGUF tensor is stored in, if
    /// any (a safetensors tensor has none: its F8_E4M3 is not a block of ours).
    pub fn block(&self) -> Option<DType> {
        let gguf = matches!(self.location, Location::Gguf(_));
        DType::ALL.into_iter().filter(|d| gguf && d.is_block()).find(|d| ggml_name(*d) == self.dtype_name)
    }
}

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
        let mut ck = Checkpoint {
            dir: dir.to_path_buf(),
            path: dir.to_path_buf(),
            config,
            files: Vec::new(),
            gguf: None,
            tensors: BTreeMap::new(),
        };
        for path in weight_files(dir)? {
            ck.add_file(&path)?;
        }
        if ck.files.is_empty() {
            return Err(ckpt_err(dir, "no *.safetensors weights found"));
        }
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
        })
    }

    fn add_file(&mut self, path: &Path) -> Result<(), CompileError> {
        let f = std::fs::File::open(path).map_err(|e| ckpt_err(path, e.to_string()))?;
        // SAFETY: read-only mapping of a checkpoint file that is not modified while compiling.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| ckpt_err(path, e.to_string()))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| ckpt_err(path, format!("not a valid safetensors file: {e}")))?;
        let idx = self.files.len();
        for (name, info) in meta.tensors() {
            let dtype_name = format!("{:?}", info.dtype);
            let readable = DType::from_safetensors_name(&dtype_name).is_some_and(DType::is_float);
            let t = TensorInfo { dtype_name, shape: info.shape.clone(), readable, location: Location::File(idx) };
            self.tensors.insert(name, t);
        }
        self.files.push((path.to_path_buf(), map));
        Ok(())
    }

    /// Description of a tensor, if present.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Names of every tensor.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// A tensor as f32 values.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, CompileError> {
        let info = self.tensors.get(name).ok_or_else(|| ckpt_err(&self.path, format!("tensor `{name}` is missing")))?;
        let file = match (&info.location, &self.gguf) {
            (Location::Gguf(gname), Some(g)) => return g.read_f32(gname),
            (Location::File(i), _) => *i,
            (Location::Gguf(_), None) => unreachable!("GGUF locations come only from a GGUF file"),
        };
        let (path, map) = &self.files[file];
        let st = safetensors::SafeTensors::deserialize(map).map_err(|e| ckpt_err(path, e.to_string()))?;
        let view = st.tensor(name).map_err(|e| ckpt_err(path, format!("tensor `{name}`: {e}")))?;
        let dtype = info
            .dtype()
            .ok_or_else(|| CompileError::UnsupportedDtype { name: name.to_string(), dtype: info.dtype_name.clone() })?;
        Ok(dtype.to_f32(view.data()))
    }

    /// A GGUF tensor's blocks (its rows in HF's order), when it is stored in a block type.
    pub fn read_blocks(&self, name: &str) -> Result<(DType, Vec<u8>), CompileError> {
        match (self.tensors.get(name).map(|t| &t.location), &self.gguf) {
            (Some(Location::Gguf(gname)), Some(g)) => g.read_raw(gname),
            _ => Err(ckpt_err(&self.path, format!("tensor `{name}` is not a GGUF tensor"))),
        }
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
/// every `*.safetensors` in the directory.
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
    let rd = std::fs::read_dir(dir).map_err(|e| ckpt_err(dir, e.to_string()))?;
    let mut files: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    Ok(files)
}
