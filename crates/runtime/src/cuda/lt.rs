//! The cuBLASLt library (loaded at run time): a handle, its workspace, and matmuls of the
//! engine's linears, `out [t, n] f32 = x [t, k] · w [n, k]ᵀ (+ bias)`, 16-bit or E4M3 (W8A8 with
//! the scales in the epilogue). The algorithm for each matmul shape is the fastest of the
//! heuristic's first [`ALGOS`] and of those found for the shape at other row counts where the
//! load times them (`explore`), else the heuristic's first;
//! the algorithms found are kept in a file beside the GEMM choices, so later loads on the
//! machine run the same ones.

use super::driver;
use super::w8a8::{Fp8In, Fp8Scales};
use crate::RuntimeError;
use codegen_cuda::without_panic;
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt::Write;
use std::sync::Arc;

/// Algorithms of cuBLASLt's heuristic timed per matmul shape at load. With its first alone, its FP8
/// matmul at 64 rows read the 7B down projection at 0.84 TB/s on the H200, where its bf16 one
/// read twice the bytes in half the time (docs/perf.md, 2026-11-25); whether another of its
/// algorithms does better there is what the load's timing finds out.
const ALGOS: usize = 8;

/// The fastest of `algos` for `run` on `stream` (`device::mean_ms` each); the first where none
/// can be timed.
fn fastest(
    stream: &CudaStream,
    algos: &[sys::cublasLtMatmulAlgo_t],
    run: impl Fn(&sys::cublasLtMatmulAlgo_t) -> Result<(), lt::CublasError>,
) -> sys::cublasLtMatmulAlgo_t {
    let time = |algo| super::device::mean_ms(stream, || run(algo).map_err(|_| ()), |_| ()).ok();
    let timed = algos.iter().filter_map(|a| Some((time(a)?, *a)));
    timed.min_by(|x, y| x.0.total_cmp(&y.0)).map_or(algos[0], |(_, a)| a)
}

/// Workspace for cuBLASLt's split-K and stream-K algorithms (NVIDIA's recommendation on Hopper).
const WORKSPACE: usize = 32 << 20;

/// One linear of a GEMM launch: device pointers of its weight `[n, k]`, bias `[n]` (f32, or 16-bit
/// for W8A8; or 0), output `[t, n]` f32 whose rows are `ld` floats apart (the launch's packed
/// output) and, for E4M3 weights, their compact scales.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Part {
    pub w: u64,
    pub bias: u64,
    pub out: u64,
    pub n: usize,
    pub ld: usize,
    pub w_scales: u64,
}

/// What an algorithm is found for: n, t, k, with a bias, the FP8 scale mode (W8A8), and the
/// output's row stride.
type AlgoKey = (usize, usize, usize, bool, Option<Fp8Scales>, usize);

/// A cuBLASLt handle, its workspace and the best algorithm found per shape.
pub(crate) struct Blas {
    handle: sys::cublasLtHandle_t,
    /// The 16-bit type of x and the weights (the program's `half`).
    half: sys::cudaDataType_t,
    workspace: CudaSlice<u8>,
    algos: RefCell<HashMap<AlgoKey, sys::cublasLtMatmulAlgo_t>>,
    /// Time the heuristic's algorithms of a new shape (the load), and whether any was.
    explore: Cell<bool>,
    explored: Cell<bool>,
}

// The handle is used only by the thread that owns the backend.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

impl Blas {
    /// A handle on `stream`'s device; `None` when the cuBLASLt library cannot be loaded.
    pub(crate) fn new(stream: &Arc<CudaStream>, half: ir::DType) -> Result<Option<Blas>, RuntimeError> {
        let Some(Ok(handle)) = without_panic(lt::create_handle) else {
            return Ok(None);
        };
        let workspace = stream.alloc_zeros::<u8>(WORKSPACE).map_err(driver("alloc"))?;
        let half = match half {
            ir::DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
            _ => sys::cudaDataType_t::CUDA_R_16BF,
        };
        Ok(Some(Blas {
            handle,
            half,
            workspace,
            algos: RefCell::default(),
            explore: Cell::default(),
            explored: Cell::default(),
        }))
    }

    /// `out = x · wᵀ (+ bias)` for each part: x `[t, k]` 16-bit, or E4M3 codes with `fp8` for
    /// E4M3 weights; row-major throughout.
    pub(crate) fn gemm(
        &self,
        stream: &CudaStream,
        x: u64,
        fp8: Option<Fp8In>,
        k: usize,
        t: usize,
        parts: &[Part],
    ) -> Result<(), String> {
        for p in parts {
            unsafe { self.one(stream, x, fp8, k, t, p) }.map_err(|e| {
                format!("cuBLASLt matmul {t}x{}x{k}{}: {e:?}", p.n, if fp8.is_some() { " e4m3" } else { "" })
            })?;
        }
        Ok(())
    }

    /// Up to [`ALGOS`] algorithms cuBLASLt's heuristic offers for a matmul, best first.
    unsafe fn heuristics(
        &self,
        desc: sys::cublasLtMatmulDesc_t,
        a: sys::cublasLtMatrixLayout_t,
        b: sys::cublasLtMatrixLayout_t,
        c: sys::cublasLtMatrixLayout_t,
    ) -> Result<Vec<sys::cublasLtMatmulAlgo_t>, lt::CublasError> {
        let pref = lt::create_matmul_pref()?;
        let ws = WORKSPACE as u64;
        let attr = sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES;
        let mut found: Vec<sys::cublasLtMatmulHeuristicResult_t> = vec![std::mem::zeroed(); ALGOS];
        let mut count = 0i32;
        let r = lt::set_matmul_pref_attribute(pref, attr, &ws as *const _ as *const c_void, 8).and_then(|_| {
            sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc,
                a,
                b,
                c,
                c,
                pref,
                ALGOS as i32,
                found.as_mut_ptr(),
                &mut count,
            )
            .result()
        });
        let _ = lt::destroy_matmul_pref(pref);
        r?;
        let ok =
            found.iter().take(count.max(0) as usize).filter(|h| h.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
        let algos: Vec<_> = ok.map(|h| h.algo).collect();
        if algos.is_empty() {
            return Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED));
        }
        Ok(algos)
    }

    /// Whether `algo` can run the matmul of `desc` over layouts `[a, b, c]` (c also the
    /// output) within the workspace.
    unsafe fn applies(
        &self,
        desc: sys::cublasLtMatmulDesc_t,
        [a, b, c]: [sys::cublasLtMatrixLayout_t; 3],
        algo: &sys::cublasLtMatmulAlgo_t,
    ) -> bool {
        let mut r: sys::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
        let status = sys::cublasLtMatmulAlgoCheck(self.handle, desc, a, b, c, c, algo, &mut r);
        status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && r.workspaceSize <= WORKSPACE
    }

    /// While set (the timing at load), a matmul shape seen for the first time times each of
    /// the heuristic's algorithms and keeps the fastest; else (a step's new row count) the
    /// heuristic's first.
    pub(crate) fn explore(&self, on: bool) {
        self.explore.set(on);
    }

    /// Takes the algorithms of a file [`Blas::save_algos`] wrote with this cuBLASLt version
    /// (nothing where it is missing or from another version; unreadable lines are left out).
    pub(crate) fn load_algos(&self, path: &std::path::Path) {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        self.algos.borrow_mut().extend(parse_algos(&text, version()));
    }

    /// Writes every algorithm found to `path` when the load timed any (atomically; a cache that
    /// cannot be written is only a cache).
    pub(crate) fn save_algos(&self, path: &std::path::Path) {
        if self.explored.get() {
            crate::cuda::blas::write_atomically(path, &algos_text(version(), &self.algos.borrow()));
        }
    }

    /// In cuBLASLt's column-major terms: D (n x t) = op(W) (n x k) · X (k x t), W stored as k x n.
    unsafe fn one(
        &self,
        stream: &CudaStream,
        x: u64,
        fp8: Option<Fp8In>,
        k: usize,
        t: usize,
        p: &Part,
    ) -> Result<(), lt::CublasError> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        let f32t = sys::cudaDataType_t::CUDA_R_32F;
        let h16 = if fp8.is_some() { sys::cudaDataType_t::CUDA_R_8F_E4M3 } else { self.half };
        let a = lt::create_matrix_layout(h16, k as u64, p.n as u64, k as i64)?;
        let b = lt::create_matrix_layout(h16, k as u64, t as u64, k as i64)?;
        let c = lt::create_matrix_layout(f32t, p.n as u64, t as u64, p.ld as i64)?;
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32t)?;
        let set = |attr: D, v: *const c_void, size: usize| lt::set_matmul_desc_attribute(desc, attr, v, size);
        // cublasOperation_t: 1 transposes, 0 does not.
        let (op_t, op_n) = (1i32, 0i32);
        let r = (|| {
            set(D::CUBLASLT_MATMUL_DESC_TRANSA, &op_t as *const _ as *const c_void, std::mem::size_of_val(&op_t))?;
            set(D::CUBLASLT_MATMUL_DESC_TRANSB, &op_n as *const _ as *const c_void, std::mem::size_of_val(&op_n))?;
            if p.bias != 0 {
                let epi = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
                set(D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epi as *const _ as *const c_void, std::mem::size_of_val(&epi))?;
                set(D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias as *const _ as *const c_void, 8)?;
                if fp8.is_some() {
                    // FP8 with an f32 D takes a 16-bit bias (cuBLASLt's FP8 type table).
                    let bt = self.half;
                    set(D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt as *const _ as *const c_void, 4)?;
                }
            }
            if let Some(f) = fp8 {
                let (wm, xm) = f.mode.modes();
                set(D::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &wm as *const i32 as *const c_void, 4)?;
                set(D::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &xm as *const i32 as *const c_void, 4)?;
                set(D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p.w_scales as *const u64 as *const c_void, 8)?;
                set(D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &f.scales as *const u64 as *const c_void, 8)?;
            }
            let key = (p.n, t, k, p.bias != 0, fp8.map(|f| f.mode), p.ld);
            let (alpha, beta) = (1.0f32, 0.0f32);
            let (ws, _sync) = self.workspace.device_ptr(stream);
            let run = |algo: &sys::cublasLtMatmulAlgo_t| {
                lt::matmul(
                    self.handle,
                    desc,
                    &alpha as *const f32 as *const c_void,
                    &beta as *const f32 as *const c_void,
                    p.w as *const c_void,
                    a,
                    x as *const c_void,
                    b,
                    p.out as *const c_void,
                    c,
                    p.out as *mut c_void,
                    c,
                    algo,
                    ws as *mut c_void,
                    WORKSPACE,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            };
            let found = self.algos.borrow().get(&key).copied();
            let algo = match found {
                Some(a) => a,
                None => {
                    let mut algos = self.heuristics(desc, a, b, c)?;
                    if self.explore.get() {
                        for other in siblings(&self.algos.borrow(), &key) {
                            if !algos.iter().any(|x| x.data == other.data) && self.applies(desc, [a, b, c], &other) {
                                algos.push(other);
                            }
                        }
                    }
                    let best = if self.explore.get() && algos.len() > 1 {
                        self.explored.set(true);
                        fastest(stream, &algos, run)
                    } else {
                        algos[0]
                    };
                    self.algos.borrow_mut().insert(key, best);
                    best
                }
            };
            run(&algo)
        })();
        let _ = lt::destroy_matmul_desc(desc);
        for l in [a, b, c] {
            let _ = lt::destroy_matrix_layout(l);
        }
        r
    }
}

/// The algorithms of `found` for `key`'s matmul at other row counts, each once. The heuristic's
/// picks at some row counts are much slower than its picks at others: on the H200 the 7B
/// shape's o projection took 27-32 us at 112-128 rows and 13 us at 96 and 256 (docs/perf.md,
/// 2026-11-25), so a new row count's timing tries these too.
fn siblings(found: &HashMap<AlgoKey, sys::cublasLtMatmulAlgo_t>, key: &AlgoKey) -> Vec<sys::cublasLtMatmulAlgo_t> {
    let same = |k: &AlgoKey| (k.0, k.2, k.3, k.4, k.5) == (key.0, key.2, key.3, key.4, key.5) && k.1 != key.1;
    let mut out: Vec<sys::cublasLtMatmulAlgo_t> = vec![];
    for (_, a) in found.iter().filter(|(k, _)| same(k)) {
        if !out.iter().any(|x| x.data == a.data) {
            out.push(*a);
        }
    }
    out
}

/// The loaded cuBLASLt's version (an algorithm is only valid for the library that found it).
fn version() -> usize {
    unsafe { sys::cublasLtGetVersion() }
}

/// `AlgoKey`'s FP8 mode as a number of the algorithms file.
fn mode_number(m: Option<Fp8Scales>) -> usize {
    match m {
        None => 0,
        Some(Fp8Scales::Rows) => 1,
        Some(Fp8Scales::Blocks) => 2,
    }
}

/// The algorithms file: a line `cublasLt2 VERSION`, then per matmul shape `n t k bias mode ld`
/// and the algorithm's eight words in hex.
fn algos_text(version: usize, algos: &HashMap<AlgoKey, sys::cublasLtMatmulAlgo_t>) -> String {
    let mut text = format!("cublasLt2 {version}\n");
    for ((n, t, k, bias, mode, ld), a) in algos {
        let _ = write!(text, "{n} {t} {k} {} {} {ld}", u8::from(*bias), mode_number(*mode));
        for w in a.data {
            let _ = write!(text, " {w:x}");
        }
        text.push('\n');
    }
    text
}

/// What [`algos_text`] wrote, where its version is `version`.
fn parse_algos(text: &str, version: usize) -> HashMap<AlgoKey, sys::cublasLtMatmulAlgo_t> {
    let mut lines = text.lines();
    if lines.next() != Some(format!("cublasLt2 {version}").as_str()) {
        return HashMap::new();
    }
    let parse = |l: &str| -> Option<(AlgoKey, sys::cublasLtMatmulAlgo_t)> {
        let w: Vec<&str> = l.split_whitespace().collect();
        let [n, t, k, bias, mode, ld] =
            [w.first()?, w.get(1)?, w.get(2)?, w.get(3)?, w.get(4)?, w.get(5)?].map(|x| x.parse::<usize>().ok());
        let mode = [None, Some(Fp8Scales::Rows), Some(Fp8Scales::Blocks)].get(mode?).copied()?;
        let data: Vec<u64> = w.get(6..)?.iter().map(|x| u64::from_str_radix(x, 16).ok()).collect::<Option<_>>()?;
        let data: [u64; 8] = data.try_into().ok()?;
        Some(((n?, t?, k?, bias? == 1, mode, ld?), sys::cublasLtMatmulAlgo_t { data }))
    };
    lines.filter_map(parse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new row count's candidates are the shape's algorithms at the other row counts, each
    /// once; another shape's, bias, FP8 mode or row stride are not.
    #[test]
    fn siblings_are_the_same_matmul_at_other_row_counts() {
        let algo = |w: u64| sys::cublasLtMatmulAlgo_t { data: [w; 8] };
        let found = HashMap::from([
            ((3584, 64, 3584, false, None, 3584), algo(1)),
            ((3584, 96, 3584, false, None, 3584), algo(2)),
            ((3584, 112, 3584, false, None, 3584), algo(2)),
            ((3584, 128, 3584, false, None, 3584), algo(3)),
            ((3584, 96, 3584, true, None, 3584), algo(4)),
            ((3584, 96, 3584, false, Some(Fp8Scales::Rows), 3584), algo(5)),
            ((3584, 96, 3584, false, None, 4608), algo(6)),
            ((512, 96, 3584, false, None, 3584), algo(7)),
        ]);
        let mut got: Vec<u64> =
            siblings(&found, &(3584, 128, 3584, false, None, 3584)).iter().map(|a| a.data[0]).collect();
        got.sort();
        assert_eq!(got, [1, 2]);
    }

    #[test]
    fn algorithms_survive_their_file_for_the_same_library_only() {
        let a = sys::cublasLtMatmulAlgo_t { data: [1, 2, 3, u64::MAX, 5, 6, 7, 8] };
        let b = sys::cublasLtMatmulAlgo_t { data: [9; 8] };
        let algos = HashMap::from([
            ((3584, 64, 18944, false, Some(Fp8Scales::Rows), 3584), a),
            ((512, 8, 896, true, None, 1152), b),
        ]);
        let text = algos_text(130000, &algos);
        let back = parse_algos(&text, 130000);
        assert_eq!(back.len(), 2);
        for (k, v) in &algos {
            assert_eq!(back[k].data, v.data);
        }
        assert!(parse_algos(&text, 130001).is_empty(), "another library's algorithms are not taken");
        let bad = "cublasLt2 7\n1 2 3 0 0 1 2\n1 2 3 0 9 1 1 2 3 4 5 6 7 8\n1 2 3 0 2 1 1 2 3 4 5 6 7 8\n";
        assert_eq!(parse_algos(bad, 7).len(), 1, "short lines and unknown modes are left out");
        let old = text.replacen("cublasLt2", "cublasLt", 1);
        assert!(parse_algos(&old, 130000).is_empty(), "a file of the format without row strides is not read");
    }
}
