//! Choosing the model YAML for a checkpoint: `engc compile --checkpoint DIR` without a YAML
//! takes the one whose `architectures` names an entry of the checkpoint's `config.json`
//! `architectures` (or a GGUF's architecture, mapped to its HF name).

use crate::checkpoint::Checkpoint;
use crate::CompileError;
use spec::ModelSpec;
use std::path::{Path, PathBuf};

/// The directories searched for model YAMLs, in order: `$ENGINE_MODELS_DIR`, `./models`, and
/// the `models/` of the source tree the executable sits in (`target/{debug,release}/engc`).
pub fn model_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("ENGINE_MODELS_DIR").map(PathBuf::from).into_iter().collect();
    dirs.push(PathBuf::from("models"));
    if let Some(root) = std::env::current_exe().ok().and_then(|e| e.ancestors().nth(3).map(Path::to_path_buf)) {
        dirs.push(root.join("models"));
    }
    dirs
}

/// Every model YAML of `dirs` (`*.yaml`, sorted by path) with the spec it holds.
fn specs(dirs: &[PathBuf]) -> Result<Vec<(PathBuf, ModelSpec)>, CompileError> {
    let mut found = Vec::new();
    for dir in dirs.iter().filter(|d| d.is_dir()) {
        let entries = std::fs::read_dir(dir).map_err(|e| CompileError::Usage(format!("{}: {e}", dir.display())))?;
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .collect();
        paths.sort();
        for p in paths {
            let spec = ModelSpec::load(&p)?;
            found.push((p, spec));
        }
    }
    Ok(found)
}

/// The YAML of `dirs` serving the architecture of the checkpoint at `checkpoint`; an error
/// that lists the known architectures when none does.
pub fn find_model(dirs: &[PathBuf], checkpoint: &Path) -> Result<PathBuf, CompileError> {
    let ckpt = Checkpoint::open(checkpoint)?;
    let wanted: Vec<String> = ckpt
        .config
        .get("architectures")
        .and_then(|a| a.as_array())
        .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
        .unwrap_or_default();
    if wanted.is_empty() {
        return Err(CompileError::Usage(format!(
            "{}: config.json names no `architectures`; pass the model YAML (engc compile models/NAME.yaml --checkpoint ...)",
            checkpoint.display()
        )));
    }
    let specs = specs(dirs)?;
    if let Some((path, _)) = specs.iter().find(|(_, s)| s.architectures.iter().any(|a| wanted.contains(a))) {
        return Ok(path.clone());
    }
    let known: Vec<String> =
        specs.iter().flat_map(|(p, s)| s.architectures.iter().map(move |a| format!("{a} ({})", p.display()))).collect();
    let searched: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    Err(CompileError::Usage(format!(
        "{}: no model YAML serves architecture {}; known architectures: {} (searched {}; set ENGINE_MODELS_DIR or pass \
         the YAML)",
        checkpoint.display(),
        wanted.join(", "),
        if known.is_empty() { "none".to_string() } else { known.join(", ") },
        searched.join(", ")
    )))
}
