//! Writing a bundle atomically, hashing every file as it is written.

use crate::{io_err, BundleError, Manifest, ENGINE_VERSION, FORMAT_VERSION};
use ir::DType;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A tensor to be written: its bytes are produced on demand by the caller, in order.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
}

impl TensorEntry {
    fn bytes(&self) -> usize {
        let n = self.stored_shape().iter().product::<usize>();
        if self.dtype.is_block() {
            n
        } else {
            n * self.dtype.size()
        }
    }

    /// A block type's rows must be whole blocks of its length (32, or a k-quant's 256).
    fn check_blocks(&self, rel: &str) -> Result<(), BundleError> {
        match (self.dtype.block(), self.shape.last()) {
            (Some((len, _)), Some(&k)) if !k.is_multiple_of(len) => Err(BundleError::Malformed {
                path: rel.to_string(),
                message: format!(
                    "tensor `{}` is {} {:?}: its rows of {k} are not whole {len}-element blocks",
                    self.name, self.dtype, self.shape
                ),
            }),
            _ => Ok(()),
        }
    }

    /// The shape in the file: a block type's rows are stored as their bytes (`U8`).
    fn stored_shape(&self) -> Vec<usize> {
        match (self.shape.split_last(), self.dtype.is_block()) {
            (Some((&k, outer)), true) => [outer, &[self.dtype.bytes(k).unwrap_or(0)]].concat(),
            _ => self.shape.clone(),
        }
    }
}

/// Writes a bundle into `<out>.partial-<pid>` and renames it to `<out>` on [`finish`].
/// Dropping an unfinished writer removes the partial directory.
///
/// [`finish`]: BundleWriter::finish
pub struct BundleWriter {
    out: PathBuf,
    tmp: PathBuf,
    files: BTreeMap<String, String>,
    done: bool,
}

struct HashingFile {
    file: std::io::BufWriter<std::fs::File>,
    hash: blake3::Hasher,
    path: PathBuf,
}

impl HashingFile {
    fn write(&mut self, bytes: &[u8]) -> Result<(), BundleError> {
        // On all cores for a large tensor (the same hash; blake3 gains from threads above
        // ~128 KiB).
        if bytes.len() >= 1 << 20 {
            self.hash.update_rayon(bytes);
        } else {
            self.hash.update(bytes);
        }
        self.file.write_all(bytes).map_err(|e| io_err(&self.path, e))
    }
}

impl BundleWriter {
    /// Starts a bundle at `out`. An existing bundle there is replaced on success; any other
    /// existing path is an error.
    pub fn create(out: &Path) -> Result<BundleWriter, BundleError> {
        if out.exists() && !out.join("manifest.json").exists() {
            return Err(BundleError::Io {
                path: out.display().to_string(),
                message: "exists and is not a bundle; refusing to overwrite it".into(),
            });
        }
        let name = out.file_name().map_or("bundle".into(), |n| n.to_string_lossy().to_string());
        let tmp = out.with_file_name(format!(".{name}.partial-{}", std::process::id()));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
        }
        std::fs::create_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
        Ok(BundleWriter { out: out.to_path_buf(), tmp, files: BTreeMap::new(), done: false })
    }

    fn open(&self, rel: &str) -> Result<HashingFile, BundleError> {
        check_rel(rel)?;
        let path = self.tmp.join(rel);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        }
        let file = std::fs::File::create(&path).map_err(|e| io_err(&path, e))?;
        Ok(HashingFile { file: std::io::BufWriter::new(file), hash: blake3::Hasher::new(), path })
    }

    fn close(&mut self, rel: &str, mut f: HashingFile) -> Result<(), BundleError> {
        f.file.flush().map_err(|e| io_err(&f.path, e))?;
        self.files.insert(rel.to_string(), f.hash.finalize().to_hex().to_string());
        Ok(())
    }

    /// Writes a file at `rel` (a path relative to the bundle root).
    pub fn write_file(&mut self, rel: &str, bytes: &[u8]) -> Result<(), BundleError> {
        let mut f = self.open(rel)?;
        f.write(bytes)?;
        self.close(rel, f)
    }

    /// Writes a safetensors file at `rel`, streaming tensor data: `data(i)` returns the bytes
    /// of `tensors[i]`, called once per tensor in order.
    pub fn write_safetensors(
        &mut self,
        rel: &str,
        tensors: &[TensorEntry],
        mut data: impl FnMut(usize) -> Result<Vec<u8>, BundleError>,
    ) -> Result<(), BundleError> {
        let mut header = serde_json::Map::new();
        let mut offset = 0usize;
        for t in tensors {
            t.check_blocks(rel)?;
            let end = offset + t.bytes();
            header.insert(
                t.name.clone(),
                serde_json::json!({"dtype": t.dtype.safetensors_name(), "shape": t.stored_shape(), "data_offsets": [offset, end]}),
            );
            offset = end;
        }
        let mut text = serde_json::to_string(&header).map_err(|e| io_err(Path::new(rel), e))?;
        while text.len() % 8 != 0 {
            text.push(' ');
        }
        let mut f = self.open(rel)?;
        f.write(&(text.len() as u64).to_le_bytes())?;
        f.write(text.as_bytes())?;
        for (i, t) in tensors.iter().enumerate() {
            let bytes = data(i)?;
            if bytes.len() != t.bytes() {
                return Err(BundleError::Malformed {
                    path: rel.to_string(),
                    message: format!("tensor `{}` has {} bytes, expected {}", t.name, bytes.len(), t.bytes()),
                });
            }
            f.write(&bytes)?;
        }
        self.close(rel, f)
    }

    /// Writes `manifest.json` (with the checksums of every file written) and moves the bundle
    /// into place.
    pub fn finish(
        mut self,
        model: &str,
        params: BTreeMap<String, serde_json::Value>,
        tp: usize,
        dtype: DType,
    ) -> Result<PathBuf, BundleError> {
        let manifest = Manifest {
            format_version: FORMAT_VERSION,
            engine_version: ENGINE_VERSION.to_string(),
            model: model.to_string(),
            params,
            tp,
            dtype: dtype.to_string(),
            files: std::mem::take(&mut self.files),
        };
        let text = serde_json::to_string_pretty(&manifest).map_err(|e| io_err(&self.tmp, e))?;
        let path = self.tmp.join("manifest.json");
        std::fs::write(&path, text).map_err(|e| io_err(&path, e))?;
        if self.out.exists() {
            std::fs::remove_dir_all(&self.out).map_err(|e| io_err(&self.out, e))?;
        }
        std::fs::rename(&self.tmp, &self.out).map_err(|e| io_err(&self.out, e))?;
        self.done = true;
        Ok(self.out.clone())
    }
}

impl Drop for BundleWriter {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

/// A file's path must be plain names joined by `/` (no `.`, `..`, empty or absolute parts) and
/// not `manifest.json`, so that the manifest lists it under the name a reader finds it by.
fn check_rel(rel: &str) -> Result<(), BundleError> {
    let plain = rel.split('/').all(|c| !c.is_empty() && c != "." && c != ".." && !c.contains('\\'));
    if plain && rel != "manifest.json" {
        return Ok(());
    }
    Err(BundleError::Malformed {
        path: rel.to_string(),
        message: "a bundle file must be a plain relative path (names joined by `/`) other than manifest.json".into(),
    })
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WeightFile;

    /// A k-quant's rows are stored as the bytes of their super-blocks of 256 and read back as
    /// the plan's shape; rows that are not whole super-blocks are refused on both sides.
    #[test]
    fn k_quant_rows_are_stored_as_their_super_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = BundleWriter::create(&dir.path().join("b")).unwrap();
        let entry = |shape: &[usize]| TensorEntry { name: "w".into(), dtype: DType::Q4_K, shape: shape.to_vec() };
        let err = w.write_safetensors("bad.safetensors", &[entry(&[2, 128])], |_| Ok(vec![])).unwrap_err();
        assert!(err.to_string().contains("not whole 256-element blocks"), "{err}");
        let data: Vec<u8> = (0..2 * 288).map(|v| v as u8).collect();
        w.write_safetensors("w.safetensors", &[entry(&[2, 512])], |_| Ok(data.clone())).unwrap();
        let out = w.finish("m", BTreeMap::new(), 1, DType::F32).unwrap();
        let f = WeightFile::open(&out.join("w.safetensors")).unwrap();
        assert_eq!(f.bytes_as("w", DType::Q4_K, &[2, 512]).unwrap(), data);
        let err = f.bytes_as("w", DType::Q6_K, &[2, 512]).unwrap_err().to_string();
        assert!(err.contains("U8 [2, 420]"), "{err}");
        let err = f.bytes_as("w", DType::Q4_K, &[2, 500]).unwrap_err().to_string();
        assert!(err.contains("not whole q4_k blocks of 256"), "{err}");
    }
}
