//! Opening a bundle: version and checksum checks, the plan, weights through mmap.

use crate::writer::hex;
use crate::{io_err, BundleError, Manifest, FORMAT_VERSION};
use ir::{DType, Plan};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};

/// An opened, verified bundle.
#[derive(Debug)]
pub struct Bundle {
    /// Its directory.
    pub root: PathBuf,
    /// `manifest.json`.
    pub manifest: Manifest,
    /// `plan.json`.
    pub plan: Plan,
}

/// The eos/bos ids a generation stops at / starts with (`tokenizer/generation_config.json`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GenerationConfig {
    /// Token ids that end generation.
    #[serde(default)]
    pub eos_token_id: Vec<u32>,
    /// The beginning-of-sequence id, if the model has one.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
}

/// BLAKE3 of a file, on all cores over its mmap.
fn blake3_file(path: &Path) -> Result<String, BundleError> {
    let mut h = blake3::Hasher::new();
    h.update_mmap_rayon(path).map_err(|e| io_err(path, e))?;
    Ok(h.finalize().to_hex().to_string())
}

fn sha256_file(path: &Path) -> Result<String, BundleError> {
    let mut f = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| io_err(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

/// Checks `root`'s files against the manifest (see [`Bundle::open`]).
fn verify_files(root: &Path, shown: &str, manifest: &Manifest) -> Result<(), BundleError> {
    let present = bundle_files(root, shown)?;
    if let Some(file) = manifest.files.keys().find(|f| !present.contains(*f)) {
        return Err(integrity(shown, file, "is listed in manifest.json but missing from the bundle"));
    }
    if let Some(file) = present.iter().find(|f| !manifest.files.contains_key(*f)) {
        return Err(integrity(shown, file, "is in the bundle but not listed in manifest.json"));
    }
    check_required(shown, manifest)?;
    for (file, want) in &manifest.files {
        let path = root.join(file);
        let got = if manifest.format_version >= 2 { blake3_file(&path)? } else { sha256_file(&path)? };
        if &got != want {
            return Err(BundleError::Checksum { path: shown.to_string(), file: file.clone() });
        }
    }
    Ok(())
}

/// The manifest must list the files no bundle runs without: `plan.json` and the weights of
/// every rank.
fn check_required(shown: &str, manifest: &Manifest) -> Result<(), BundleError> {
    if manifest.tp == 0 {
        return Err(BundleError::Malformed {
            path: format!("{shown}/manifest.json"),
            message: "tp is 0, but a bundle has at least one rank; re-run `engc compile`".into(),
        });
    }
    let ranks = (0..manifest.tp).map(|r| format!("weights/rank{r}.safetensors"));
    match std::iter::once("plan.json".to_string()).chain(ranks).find(|f| !manifest.files.contains_key(f)) {
        Some(file) => Err(integrity(shown, &file, "is required but not listed in manifest.json")),
        None => Ok(()),
    }
}

/// The regular files under `root` by `/`-joined relative path, `manifest.json` excepted.
/// Directories are walked (empty ones are fine); anything else (a symlink, a socket) is refused,
/// since a symlink could point anywhere.
fn bundle_files(root: &Path, shown: &str) -> Result<BTreeSet<String>, BundleError> {
    let mut files = BTreeSet::new();
    let mut dirs = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, prefix)) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).map_err(|e| io_err(&dir, e))? {
            let entry = entry.map_err(|e| io_err(&dir, e))?;
            let rel = format!("{prefix}{}", entry.file_name().to_string_lossy());
            let kind = entry.file_type().map_err(|e| io_err(&entry.path(), e))?;
            if kind.is_dir() {
                dirs.push((entry.path(), format!("{rel}/")));
            } else if !kind.is_file() {
                return Err(integrity(shown, &rel, "is not a regular file (symlinks and special files are refused)"));
            } else if rel != "manifest.json" {
                files.insert(rel);
            }
        }
    }
    Ok(files)
}

fn integrity(shown: &str, file: &str, problem: &str) -> BundleError {
    BundleError::Integrity { path: shown.to_string(), file: file.to_string(), problem: problem.to_string() }
}

impl Bundle {
    /// Opens the bundle at `root`, checking its format version and its files: every file under
    /// `root` (`manifest.json` excepted) must be a regular file listed in the manifest with a
    /// matching checksum, every listed file must exist, and `plan.json` and each rank's weights
    /// must be listed.
    pub fn open(root: &Path) -> Result<Bundle, BundleError> {
        let shown = root.display().to_string();
        if !root.is_dir() {
            return Err(BundleError::NotABundle { path: shown, message: "no such directory".into() });
        }
        let mpath = root.join("manifest.json");
        let text = std::fs::read_to_string(&mpath)
            .map_err(|e| BundleError::NotABundle { path: shown.clone(), message: format!("manifest.json: {e}") })?;
        let raw: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| BundleError::Malformed { path: mpath.display().to_string(), message: e.to_string() })?;
        let found = raw.get("format_version").and_then(|v| v.as_u64()).unwrap_or(0) as u32;
        if found > FORMAT_VERSION {
            return Err(BundleError::NewerFormat { path: shown, found, supported: FORMAT_VERSION });
        }
        let manifest: Manifest = serde_json::from_value(raw)
            .map_err(|e| BundleError::Malformed { path: mpath.display().to_string(), message: e.to_string() })?;
        verify_files(root, &shown, &manifest)?;
        let ppath = root.join("plan.json");
        let ptext = std::fs::read_to_string(&ppath).map_err(|e| io_err(&ppath, e))?;
        let plan: Plan = serde_json::from_str(&ptext)
            .map_err(|e| BundleError::Malformed { path: ppath.display().to_string(), message: e.to_string() })?;
        Ok(Bundle { root: root.to_path_buf(), manifest, plan })
    }

    /// Maps the weights of `rank`.
    pub fn weights(&self, rank: usize) -> Result<WeightFile, BundleError> {
        WeightFile::open(&self.root.join(format!("weights/rank{rank}.safetensors")))
    }

    /// The CUDA source `engc compile` wrote (`kernels/model.cu`), when the bundle has one.
    pub fn kernel_source(&self) -> Result<Option<String>, BundleError> {
        let path = self.root.join("kernels/model.cu");
        if !self.manifest.files.contains_key("kernels/model.cu") {
            return Ok(None);
        }
        std::fs::read_to_string(&path).map(Some).map_err(|e| io_err(&path, e))
    }

    /// The tokenizer directory, when the bundle has a tokenizer.
    pub fn tokenizer_dir(&self) -> Option<PathBuf> {
        let d = self.root.join("tokenizer");
        d.join("tokenizer.json").is_file().then_some(d)
    }

    /// The generation config (eos ids); empty when absent.
    pub fn generation_config(&self) -> Result<GenerationConfig, BundleError> {
        let path = self.root.join("tokenizer/generation_config.json");
        if !path.is_file() {
            return Ok(GenerationConfig::default());
        }
        let text = std::fs::read_to_string(&path).map_err(|e| io_err(&path, e))?;
        serde_json::from_str(&text)
            .map_err(|e| BundleError::Malformed { path: path.display().to_string(), message: e.to_string() })
    }
}

/// A memory-mapped safetensors file.
pub struct WeightFile {
    path: PathBuf,
    map: memmap2::Mmap,
}

impl WeightFile {
    /// Maps `path` and checks that its header parses.
    pub fn open(path: &Path) -> Result<WeightFile, BundleError> {
        let f = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
        // SAFETY: the file is opened read-only and bundles are not modified while in use (their
        // checksums were verified when opened).
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| io_err(path, e))?;
        let w = WeightFile { path: path.to_path_buf(), map };
        w.tensors()?;
        Ok(w)
    }

    fn tensors(&self) -> Result<safetensors::SafeTensors<'_>, BundleError> {
        safetensors::SafeTensors::deserialize(&self.map)
            .map_err(|e| BundleError::Malformed { path: self.path.display().to_string(), message: e.to_string() })
    }

    /// Names of the tensors in the file.
    pub fn names(&self) -> Result<Vec<String>, BundleError> {
        Ok(self.tensors()?.names().into_iter().cloned().collect())
    }

    /// A tensor's dtype, shape and raw bytes.
    pub fn raw(&self, name: &str) -> Result<(DType, Vec<usize>, &[u8]), BundleError> {
        let st = self.tensors()?;
        let view = st.tensor(name).map_err(|e| BundleError::Malformed {
            path: self.path.display().to_string(),
            message: format!("tensor `{name}`: {e}"),
        })?;
        let dtype =
            DType::from_safetensors_name(&format!("{:?}", view.dtype())).ok_or_else(|| BundleError::Malformed {
                path: self.path.display().to_string(),
                message: format!("tensor `{name}` has unsupported dtype {:?}", view.dtype()),
            })?;
        Ok((dtype, view.shape().to_vec(), self.in_map(view.data())))
    }

    /// `data` (a view's bytes) re-borrowed from the map, so that it outlives the view.
    fn in_map(&self, data: &[u8]) -> &[u8] {
        let start = data.as_ptr() as usize - self.map.as_ptr() as usize;
        &self.map[start..start + data.len()]
    }

    /// A tensor's bytes, checked against the plan's dtype and shape: a dense tensor is stored
    /// as its dtype and shape, a block type's as `U8` rows of its blocks (`[.., row bytes]`).
    pub fn bytes_as(&self, name: &str, dtype: DType, shape: &[usize]) -> Result<&[u8], BundleError> {
        let st = self.tensors()?;
        let bad = |message: String| BundleError::Malformed { path: self.path.display().to_string(), message };
        let view = st.tensor(name).map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
        let row = shape.last().and_then(|&k| dtype.bytes(k));
        let want = match (dtype.is_block(), row) {
            (false, _) => shape.to_vec(),
            (true, Some(row)) => [&shape[..shape.len() - 1], &[row]].concat(),
            (true, None) => {
                let len = dtype.block().map_or(1, |(len, _)| len);
                return Err(bad(format!("tensor `{name}`: {shape:?} is not whole {dtype} blocks of {len}")));
            }
        };
        let stored = format!("{:?}", view.dtype());
        if stored != dtype.safetensors_name() || view.shape() != want {
            return Err(bad(format!(
                "tensor `{name}` is {stored} {:?}; the plan's {dtype} {shape:?} is stored as {} {want:?}",
                view.shape(),
                dtype.safetensors_name()
            )));
        }
        Ok(self.in_map(view.data()))
    }

    /// A tensor as f32 values (a block type dequantized), checked against the plan's dtype
    /// and shape.
    pub fn f32(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Vec<f32>, BundleError> {
        Ok(dtype.to_f32(self.bytes_as(name, dtype, shape)?))
    }
}
