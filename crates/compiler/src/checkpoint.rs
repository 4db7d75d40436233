//! Reading a Hugging Face checkpoint directory: `config.json` and safetensors weights, single
//! file or sharded (`model-0000K-of-0000N.safetensors` + `model.safetensors.index.json`).

use crate::CompileError;
use ir::DType;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A tensor's description in the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Element type as safetensors spells it (`BF16`, `F8_E4M3`, ...).
    pub dtype_name: String,
    /// Shape.
    pub shape: Vec<usize>,
    file: usize,
}

impl TensorInfo {
    /// The dtype, when it is one the engine reads (bf16, f16, f32).
    pub fn dtype(&self) -> Option<DType> {
        DType::from_safetensors_name(&self.dtype_name).filter(|d| d.is_float())
    }
}

/// An opened checkpoint.
pub struct Checkpoint {
    /// The directory.
    pub dir: PathBuf,
    /// Parsed `config.json`.
    pub config: serde_json::Value,
    files: Vec<(PathBuf, memmap2::Mmap)>,
    tensors: BTreeMap<String, TensorInfo>,
}

fn ckpt_err(path: &Path, message: impl Into<String>) -> CompileError {
    CompileError::Checkpoint { path: path.display().to_string(), message: message.into() }
}

impl Checkpoint {
    /// Opens `dir`, reading config.json and every safetensors header.
    pub fn open(dir: &Path) -> Result<Checkpoint, CompileError> {
        if !dir.is_dir() {
            return Err(ckpt_err(dir, "checkpoint directory does not exist"));
        }
        let cpath = dir.join("config.json");
        let text =
            std::fs::read_to_string(&cpath).map_err(|e| ckpt_err(&cpath, format!("cannot read config.json: {e}")))?;
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ckpt_err(&cpath, format!("malformed JSON: {e}")))?;
        let mut ck = Checkpoint { dir: dir.to_path_buf(), config, files: Vec::new(), tensors: BTreeMap::new() };
        for path in weight_files(dir)? {
            ck.add_file(&path)?;
        }
        if ck.files.is_empty() {
            return Err(ckpt_err(dir, "no *.safetensors weights found"));
        }
        Ok(ck)
    }

    fn add_file(&mut self, path: &Path) -> Result<(), CompileError> {
        let f = std::fs::File::open(path).map_err(|e| ckpt_err(path, e.to_string()))?;
        // SAFETY: read-only mapping of a checkpoint file that is not modified while compiling.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| ckpt_err(path, e.to_string()))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| ckpt_err(path, format!("not a valid safetensors file: {e}")))?;
        let idx = self.files.len();
        for (name, info) in meta.tensors() {
            let t = TensorInfo { dtype_name: format!("{:?}", info.dtype), shape: info.shape.clone(), file: idx };
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
        let info = self.tensors.get(name).ok_or_else(|| ckpt_err(&self.dir, format!("tensor `{name}` is missing")))?;
        let (path, map) = &self.files[info.file];
        let st = safetensors::SafeTensors::deserialize(map).map_err(|e| ckpt_err(path, e.to_string()))?;
        let view = st.tensor(name).map_err(|e| ckpt_err(path, format!("tensor `{name}`: {e}")))?;
        let dtype = info
            .dtype()
            .ok_or_else(|| CompileError::UnsupportedDtype { name: name.to_string(), dtype: info.dtype_name.clone() })?;
        Ok(dtype.to_f32(view.data()))
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
