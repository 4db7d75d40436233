//! `Bundle::open` refuses a bundle whose files differ from its manifest in any way, naming the
//! file and saying to re-run `engc compile`. Each test writes a tiny bundle with `BundleWriter`
//! and tampers with it.

use bundle::{Bundle, BundleWriter, Manifest, TensorEntry};
use ir::{DType, KvLayout, Plan};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Every file a compiled bundle has, besides the weights.
const FILES: [&str; 5] = [
    "plan.json",
    "kernels/model.cu",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer/generation_config.json",
];

/// A tiny bundle of `tp` ranks in its own temporary directory.
struct Tiny {
    dir: tempfile::TempDir,
    root: PathBuf,
}

impl Tiny {
    fn new(tp: usize) -> Tiny {
        let dir = tempfile::tempdir().unwrap();
        let mut w = BundleWriter::create(&dir.path().join("tiny.bundle")).unwrap();
        let plan = Plan {
            nodes: vec![],
            output: 0,
            act_dtype: DType::F32,
            kv: KvLayout::default(),
            tp,
            vocab: 4,
            fusions: vec![],
        };
        w.write_file("plan.json", serde_json::to_string_pretty(&plan).unwrap().as_bytes()).unwrap();
        w.write_file("kernels/model.cu", b"extern \"C\" __global__ void k() {}\n").unwrap();
        w.write_file("tokenizer/tokenizer.json", br#"{"version": "1.0"}"#).unwrap();
        w.write_file("tokenizer/tokenizer_config.json", br#"{"eos_token": "</s>"}"#).unwrap();
        w.write_file("tokenizer/generation_config.json", br#"{"eos_token_id": [2]}"#).unwrap();
        let t = [TensorEntry { name: "w".into(), dtype: DType::F32, shape: vec![2, 2] }];
        for r in 0..tp {
            w.write_safetensors(&format!("weights/rank{r}.safetensors"), &t, |_| Ok(vec![r as u8; 16])).unwrap();
        }
        let root = w.finish("tiny", BTreeMap::new(), tp, DType::F32).unwrap();
        Tiny { dir, root }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    /// A path outside the bundle.
    fn outside(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn manifest(&self) -> Manifest {
        serde_json::from_str(&std::fs::read_to_string(self.path("manifest.json")).unwrap()).unwrap()
    }

    fn edit_manifest(&self, edit: impl FnOnce(&mut Manifest)) {
        let mut m = self.manifest();
        edit(&mut m);
        std::fs::write(self.path("manifest.json"), serde_json::to_string_pretty(&m).unwrap()).unwrap();
    }

    /// Flips the bits of one byte of `rel` (its middle byte).
    fn flip(&self, rel: &str) {
        let mut bytes = std::fs::read(self.path(rel)).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x55;
        std::fs::write(self.path(rel), bytes).unwrap();
    }

    /// Writes `rel` inside the bundle, creating its directory.
    fn add(&self, rel: &str) {
        let p = self.path(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"extra").unwrap();
    }

    fn opens(&self) {
        if let Err(e) = Bundle::open(&self.root) {
            panic!("a good bundle was refused: {e}");
        }
    }

    /// `Bundle::open` fails with a message holding every needle and the remedy.
    fn refused(&self, needles: &[&str]) {
        let err = match Bundle::open(&self.root) {
            Ok(_) => panic!("a bundle that should be refused ({needles:?}) opened"),
            Err(e) => e.to_string(),
        };
        for n in needles.iter().chain(&["engc compile", self.root.to_str().unwrap()]) {
            assert!(err.contains(n), "message lacks `{n}`: {err}");
        }
    }
}

/// The manifest lists every file the writer wrote, so a fresh bundle opens.
#[test]
fn written_bundles_open() {
    for tp in [1, 2] {
        let b = Tiny::new(tp);
        let listed: Vec<String> = b.manifest().files.keys().cloned().collect();
        let mut want: Vec<String> = FILES.iter().map(|f| f.to_string()).collect();
        want.extend((0..tp).map(|r| format!("weights/rank{r}.safetensors")));
        want.sort();
        assert_eq!(listed, want);
        b.opens();
    }
}

#[test]
fn altered_files_are_refused() {
    for file in FILES.iter().copied().chain(["weights/rank0.safetensors"]) {
        let b = Tiny::new(1);
        b.flip(file);
        b.refused(&["checksum mismatch", &format!("`{file}`")]);
    }
}

/// The case of issue 23: a file's manifest entry removed and the file altered.
#[test]
fn unlisted_altered_files_are_refused() {
    for file in ["weights/rank0.safetensors", "tokenizer/tokenizer.json"] {
        let b = Tiny::new(1);
        b.edit_manifest(|m| {
            m.files.remove(file);
        });
        b.flip(file);
        b.refused(&[&format!("`{file}` is in the bundle but not listed in manifest.json")]);
    }
}

#[test]
fn added_files_are_refused() {
    for file in ["notes.txt", "kernels/extra.cu", "tokenizer/deeper/vocab.txt", "weights/manifest.json"] {
        let b = Tiny::new(1);
        b.add(file);
        b.refused(&[&format!("`{file}` is in the bundle but not listed in manifest.json")]);
    }
}

#[test]
fn deleted_files_are_refused() {
    for file in FILES.iter().copied().chain(["weights/rank0.safetensors"]) {
        let b = Tiny::new(1);
        std::fs::remove_file(b.path(file)).unwrap();
        b.refused(&[&format!("`{file}` is listed in manifest.json but missing")]);
    }
}

/// A manifest that lists something outside the bundle is refused without reading it.
#[test]
fn listed_paths_outside_the_bundle_are_refused() {
    let b = Tiny::new(1);
    std::fs::write(b.outside("elsewhere.txt"), b"x").unwrap();
    let sum = blake3::hash(b"x").to_hex().to_string();
    b.edit_manifest(|m| {
        m.files.insert("../elsewhere.txt".into(), sum);
    });
    b.refused(&["`../elsewhere.txt` is listed in manifest.json but missing"]);
}

/// Removing a file together with its entry leaves a consistent manifest; it is still refused
/// when the file is one no bundle runs without.
#[test]
fn required_files_must_be_listed() {
    for (tp, file) in [(1, "plan.json"), (1, "weights/rank0.safetensors"), (2, "weights/rank1.safetensors")] {
        let b = Tiny::new(tp);
        std::fs::remove_file(b.path(file)).unwrap();
        b.edit_manifest(|m| {
            m.files.remove(file);
        });
        b.refused(&[&format!("`{file}` is required but not listed in manifest.json")]);
    }
    // Optional files may be absent: a bundle without CUDA kernels or a tokenizer opens.
    let b = Tiny::new(1);
    for file in &FILES[1..] {
        std::fs::remove_file(b.path(file)).unwrap();
        b.edit_manifest(|m| {
            m.files.remove(*file);
        });
    }
    b.opens();
}

#[test]
fn zero_ranks_are_refused() {
    let b = Tiny::new(1);
    b.edit_manifest(|m| m.tp = 0);
    b.refused(&["manifest.json", "tp is 0"]);
}

/// A symlink could point anywhere, even at an identical copy; sockets and the like are refused
/// as well.
#[test]
fn non_regular_files_are_refused() {
    const NOT_REGULAR: &str = "is not a regular file";
    // A listed file replaced by a symlink to an identical copy (so its checksum matches).
    for file in ["tokenizer/tokenizer.json", "manifest.json"] {
        let b = Tiny::new(1);
        let copy = b.outside("copy");
        std::fs::rename(b.path(file), &copy).unwrap();
        std::os::unix::fs::symlink(&copy, b.path(file)).unwrap();
        b.refused(&[&format!("`{file}` {NOT_REGULAR}")]);
    }
    // A directory symlink, even to an empty directory.
    let b = Tiny::new(1);
    std::fs::create_dir(b.outside("empty")).unwrap();
    std::os::unix::fs::symlink(b.outside("empty"), b.path("kernels/more")).unwrap();
    b.refused(&[&format!("`kernels/more` {NOT_REGULAR}")]);
    // A socket.
    let b = Tiny::new(1);
    let _socket = std::os::unix::net::UnixListener::bind(b.path("tokenizer/sock")).unwrap();
    b.refused(&[&format!("`tokenizer/sock` {NOT_REGULAR}")]);
}

#[test]
fn empty_directories_are_fine() {
    let b = Tiny::new(1);
    std::fs::create_dir_all(b.path("empty/nested")).unwrap();
    std::fs::create_dir(b.path("kernels/cache")).unwrap();
    b.opens();
}

fn sha256_hex(path: &Path) -> String {
    Sha256::digest(std::fs::read(path).unwrap()).iter().map(|b| format!("{b:02x}")).collect()
}

/// Format version 1 (sha256) bundles are still read and get the same checks.
#[test]
fn version_1_bundles_are_verified() {
    let v1 = |b: &Tiny| {
        b.edit_manifest(|m| {
            m.format_version = 1;
            for (file, sum) in m.files.iter_mut() {
                *sum = sha256_hex(&b.root.join(file));
            }
        })
    };
    let b = Tiny::new(1);
    v1(&b);
    b.opens();
    b.flip("tokenizer/tokenizer_config.json");
    b.refused(&["checksum mismatch", "`tokenizer/tokenizer_config.json`"]);
    let b = Tiny::new(1);
    v1(&b);
    b.add("kernels/extra.cu");
    b.refused(&["`kernels/extra.cu` is in the bundle but not listed"]);
}

/// The writer only writes files a reader finds under the name the manifest lists.
#[test]
fn writer_refuses_paths_outside_the_listing() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = BundleWriter::create(&dir.path().join("b.bundle")).unwrap();
    for rel in ["manifest.json", "../x", "/abs", "a//b", "./a", "a/", "", "a\\b"] {
        match w.write_file(rel, b"x") {
            Ok(()) => panic!("the writer wrote `{rel}`"),
            Err(e) => assert!(e.to_string().contains("plain relative path"), "{rel}: {e}"),
        }
    }
    assert!(!dir.path().join("x").exists());
    w.write_file("a/b.txt", b"x").unwrap();
}
