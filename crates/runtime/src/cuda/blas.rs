//! cuBLASLt for the linears of 3 rows or more (`KernelKey::GemmSkinny` and `KernelKey::Gemm`)
//! where it measures faster than our kernel. At load every linear shape of the schedule is timed
//! both ways at each token count of `buckets` (every captured decode batch from 8 rows, and a
//! few prefill sizes), ours being the variant the schedule runs at that count; the choice is
//! logged, and a step uses the choice of the smallest bucket not below its token count (the
//! size a decode graph pads it to: graphs and eager steps run the same GEMMs; past the largest
//! bucket, the largest's), and the decode graphs capture it. The library is optional: where it cannot be loaded, our kernels
//! run throughout. The library's own wrapper (matmuls, algorithms) is `lt`.

use super::lt::{Blas, Part};
use super::w8a8::Fp8In;
use super::{driver, CudaBackend};
use crate::RuntimeError;
use codegen_cuda::{Arg, Count, KernelKey, Launch, Step, WFormat, SKINNY_ROWS};
use cudarc::driver::CudaStream;
use std::collections::HashMap;
use std::fmt::Write;

/// Token counts at which both GEMMs are timed: each captured decode batch from the smallest
/// tensor-core variant's rows on, then prefill sizes.
fn buckets() -> Vec<usize> {
    let decode = super::CAPTURE_SIZES.iter().copied().filter(|&s| s >= SKINNY_ROWS[0]);
    decode.chain([512, 1024, 4096]).collect()
}

/// The linear shape a tensor-core launch computes, `(k, n, weight format)`, whatever its row
/// variant: the key the GEMM choices are kept under.
pub(crate) type Shape = (usize, [usize; 3], WFormat);

/// The shape of a tensor-core linear launch (`None` for every other kernel), which another
/// GEMM may run ([`candidates`]): cuBLASLt runs 16-bit weights as they are and E4M3 ones as
/// W8A8 on FP8 tensor cores, the input quantized first ([`KernelKey::QuantE4M3`]), where their
/// scales are per output channel or 128 x 128 blocks; GGUF's blocks only our kernels read.
pub(crate) fn gemm_shape(key: &KernelKey) -> Option<Shape> {
    match *key {
        KernelKey::Gemm { k, n, wf, .. } | KernelKey::GemmSkinny { k, n, wf, .. } => Some((k, n, wf)),
        _ => None,
    }
}

/// The logits rows the buffers hold while the GEMMs are timed at load (the most a decode step
/// captures).
const MAX_LOGITS_ROWS: usize = 256;

/// Which kernel runs a linear launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Gemm {
    /// The schedule's own (16-bit, or W8A16 for E4M3 weights).
    Ours,
    /// cuBLASLt (W8A8 for E4M3 weights: `w8a8`).
    Blas,
    /// Our `wgmma` small-batch kernel (`KernelKey::GemmSkinnyA8`: W8A8 for E4M3 weights, or
    /// 16-bit), stream-K.
    A8,
    /// The schedule's tiled GEMM where the small-batch kernel is the variant at the row count
    /// (`codegen_cuda::tiled`): it fills more SMs on narrow shapes.
    Tiled,
    /// Our `wgmma` small-batch kernel with a thread-block cluster a tile, where the shape has one
    /// (`KernelKey::a8_clustered`). Alone it may be slower than stream-K (q|k|v of the 7B at
    /// 64 rows: 18 against 15 us) and yet shorten the step (a 4-layer 7B FP8 graph at 64 rows:
    /// 851 against 926 us), or the reverse (16 rows: 840 against 790): the graph chooses.
    A8c,
    /// cuBLASLt's 16-bit GEMM on a 16-bit copy of E4M3 weights, where the model is small enough
    /// to keep one (`w16`).
    Blas16,
}

impl Gemm {
    /// The mark of the log line where it runs, the letter before its time there, and the
    /// number of the choices file.
    pub(crate) fn mark(self) -> (&'static str, &'static str, u8) {
        match self {
            Gemm::Ours => ("", "", 0),
            Gemm::Blas => ("*", "L", 1),
            Gemm::A8 => ("+", "A", 2),
            Gemm::Tiled => ("^", "T", 3),
            Gemm::A8c => ("#", "C", 4),
            Gemm::Blas16 => ("%", "H", 5),
        }
    }

    /// What a launch of `key` through this GEMM is called in `ENGINE_CUDA_PROFILE`'s table:
    /// cuBLASLt's under the kernel it stands in for, ours W8A8 under its own kernel (both with
    /// the input's quantization, for E4M3 weights), the tiled GEMM under its own.
    pub(crate) fn label(self, key: &KernelKey) -> String {
        match (self, self.a8_key(key)) {
            (Gemm::Blas, _) => format!("cublaslt[{}]", key.name()),
            (Gemm::Blas16, _) => format!("cublaslt[{}_h16]", key.name()),
            (_, Some(a8 @ KernelKey::GemmSkinnyA8 { wf: WFormat::E4m3, .. })) => format!("{} (+quant_e4m3)", a8.name()),
            (_, Some(a8)) => a8.name(),
            (Gemm::Tiled, _) => key.tiled().map_or_else(|| key.name(), |k| k.name()),
            _ => key.name(),
        }
    }

    /// The instance of our `wgmma` kernel this GEMM runs for launch `key`, if it is that kernel
    /// and the launch has one: stream-K, or with clusters.
    pub(crate) fn a8_key(self, key: &KernelKey) -> Option<KernelKey> {
        match self {
            Gemm::A8 => key.a8(),
            Gemm::A8c => key.a8_clustered(),
            _ => None,
        }
    }

    pub(crate) fn from_number(n: usize) -> Option<Gemm> {
        [Gemm::Ours, Gemm::Blas, Gemm::A8, Gemm::Tiled, Gemm::A8c, Gemm::Blas16].get(n).copied()
    }

    /// `ENGINE_GEMM_FORCE` (`ours`, `cublaslt`, `a8`, `a8c`, `h16` or `tiled`): the GEMM every launch runs where it
    /// has it and its check passed, whatever the timing says, so the GPU check can test each
    /// (the choices are kept in a cache file of their own, so that the check's processes run
    /// the same GEMMs).
    pub(crate) fn forced() -> Option<Gemm> {
        match std::env::var("ENGINE_GEMM_FORCE").ok()?.as_str() {
            "ours" => Some(Gemm::Ours),
            "cublaslt" => Some(Gemm::Blas),
            "a8" => Some(Gemm::A8),
            "a8c" => Some(Gemm::A8c),
            "h16" => Some(Gemm::Blas16),
            "tiled" => Some(Gemm::Tiled),
            _ => None,
        }
    }
}

/// The GEMMs besides ours that may run launch `l`, less the `refused`: cuBLASLt (not over
/// GGUF's blocks), our `wgmma` kernel and our tiled GEMM where the launch has them.
pub(crate) fn candidates<'a>(l: &'a Launch, refused: &'a [Gemm]) -> impl Iterator<Item = Gemm> + 'a {
    let has = |g: &Gemm| match g {
        Gemm::A8 | Gemm::A8c => g.a8_key(&l.key).is_some(),
        Gemm::Blas16 => gemm_shape(&l.key).is_some_and(|s| s.2 == WFormat::E4m3),
        Gemm::Tiled => l.key.tiled().is_some(),
        Gemm::Blas => gemm_shape(&l.key).is_some_and(|s| !s.2.gguf()),
        Gemm::Ours => true,
    };
    [Gemm::Blas, Gemm::Blas16, Gemm::A8, Gemm::A8c, Gemm::Tiled]
        .into_iter()
        .filter(move |g| has(g) && !refused.contains(g))
}

/// The GEMM a linear shape runs at one bucket, with what else could: the choice of the load's
/// timing, then of the decode graph's (`tune`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Choice {
    /// The one that runs.
    pub gemm: Gemm,
    /// Those that ran and agreed with ours at load (bit [`Gemm::mark`]'s number), ours included.
    pub viable: u8,
    /// Chosen by timing the decode graph of the bucket's size with each of them.
    pub tuned: bool,
}

impl Choice {
    /// Each viable GEMM, ours first.
    pub(crate) fn each(&self) -> impl Iterator<Item = Gemm> + '_ {
        (0..8).filter(|i| self.viable & (1 << i) != 0).filter_map(Gemm::from_number)
    }
}

/// Which GEMM runs a launch of `t` tokens, given the choices per bucket, ascending: the smallest
/// bucket's not below `t`, as a decode graph pads `t` to that bucket (every captured size from 8
/// rows is one; fewer rows follow the 8-row bucket), else the largest's; ours without choices.
pub(crate) fn chosen(choice: &[(usize, Choice)], t: usize) -> Gemm {
    choice.iter().find(|(b, _)| *b >= t).or(choice.last()).map_or(Gemm::Ours, |(_, c)| c.gemm)
}

impl CudaBackend {
    /// Times every linear shape of the schedule with our kernel and with cuBLASLt (and, for
    /// small batches, our `wgmma` kernel) at each bucket and keeps the fastest per
    /// bucket (`ENGINE_CUBLASLT=0`: ours only). A candidate of an E4M3 shape, or of a 16-bit
    /// one our `wgmma` kernel may run, whose result on a random input is off from ours is
    /// refused for the shape first (`w8a8_disagrees`).
    pub(super) fn choose_gemms(&mut self) -> Result<(), RuntimeError> {
        let buckets = buckets();
        let shapes = self.gemm_launches(&buckets);
        if shapes.is_empty() || std::env::var("ENGINE_CUBLASLT").is_ok_and(|v| v == "0") {
            return Ok(());
        }
        let Some(blas) = Blas::new(&self.stream, self.program.half)? else {
            eprintln!("cuBLASLt not found: every GEMM runs our kernel");
            return Ok(());
        };
        self.make_w16_copies();
        let file = choices_file(&self.stream, &self.program.source, !self.w16.is_empty());
        self.choices_file.clone_from(&file);
        let algos_file = file.as_ref().map(|f| f.with_extension("algos"));
        if let Some(f) = &algos_file {
            blas.load_algos(f);
        }
        blas.explore(true);
        self.blas = Some(blas);
        let firsts: Vec<Launch> = shapes.iter().flat_map(|(_, ls)| ls.iter().map(|(_, l)| l.clone())).collect();
        self.convert_biases(&firsts)?;
        self.convert_w8_scales()?;
        self.ensure_cap(buckets[buckets.len() - 1], MAX_LOGITS_ROWS)?;
        let cached = file.as_deref().map(read_choices).unwrap_or_default();
        let mut timed = false;
        for (shape, launches) in &shapes {
            let mut choice = vec![];
            let wf = match shape.2 {
                WFormat::H16 => String::new(),
                WFormat::E4m3 => " e4m3".into(),
                f => format!(" {}", f.ctype()),
            };
            let mut line = format!(
                "GEMM k{} n{:?}{wf} (us: ours / L cuBLASLt / H its 16-bit copy / A ours on wgmma / C its clusters / T ours tiled):",
                shape.0, shape.1
            );
            let fresh = !launches.iter().all(|(t, _)| cached.contains_key(&(*shape, *t)));
            // E4M3 shapes check every candidate, 16-bit ones our wgmma kernel, before the timing.
            let checked = shape.2 == WFormat::E4m3 || launches.iter().any(|(_, l)| l.key.a8().is_some());
            let refused = if checked && fresh { self.w8a8_refusals(launches, &mut line)? } else { vec![] };
            for (t, l) in launches {
                if let Some(&c) = cached.get(&(*shape, *t)) {
                    let _ = write!(line, " t={t} cached{}", c.gemm.mark().0);
                    choice.push((*t, c));
                    continue;
                }
                let best = self.fastest_gemm(l, *t, &refused, &mut line)?;
                line += best.gemm.mark().0;
                choice.push((*t, best));
                timed = true;
            }
            eprintln!(
                "{line} (runs: *: cuBLASLt, %: its 16-bit copy, +: ours on wgmma, #: its clusters, ^: ours tiled)"
            );
            choice.sort_by_key(|(t, _)| *t);
            self.blas_choice.insert(*shape, choice);
        }
        if timed {
            self.save_choices();
        }
        self.drop_unused_w16();
        if let Some(b) = &self.blas {
            b.explore(false);
            if let Some(f) = &algos_file {
                b.save_algos(f);
            }
        }
        Ok(())
    }

    /// Writes the choices to their cache file, if there is one.
    pub(super) fn save_choices(&self) {
        if let Some(f) = &self.choices_file {
            write_choices(f, &self.blas_choice);
        }
    }

    /// The fastest GEMM for launch `l` at `t` tokens (or logits rows, a decode step's lm_head)
    /// of ours and the candidates not `refused`, the times appended to the log `line`.
    fn fastest_gemm(&self, l: &Launch, t: usize, refused: &[Gemm], line: &mut String) -> Result<Choice, RuntimeError> {
        let ours = self.time(|be| be.run_gemm(l, t, Gemm::Ours))?;
        let _ = write!(line, " t={t} {:.0}", ours * 1e3);
        let mut timed = vec![(Gemm::Ours, ours)];
        for g in candidates(l, refused) {
            match self.time(|be| be.run_gemm(l, t, g)) {
                Ok(ms) => {
                    let _ = write!(line, "/{}{:.0}", g.mark().1, ms * 1e3);
                    timed.push((g, ms));
                }
                Err(e) => {
                    let _ = write!(line, "/{} failed ({e})", g.mark().1);
                }
            }
        }
        let forced = Gemm::forced();
        let best = timed.iter().find(|(g, _)| Some(*g) == forced).or(timed.iter().min_by(|a, b| a.1.total_cmp(&b.1)));
        let viable = timed.iter().fold(0, |m, (g, _)| m | 1 << g.mark().2);
        Ok(Choice { gemm: best.map_or(Gemm::Ours, |(g, _)| *g), viable, tuned: false })
    }

    /// Runs linear launch `l` of `t` tokens (or logits rows) with GEMM `g`.
    pub(super) fn run_gemm(&self, l: &Launch, t: usize, g: Gemm) -> Result<(), RuntimeError> {
        match g {
            Gemm::Ours => self.launch(l, t, t, &[0; 6]),
            Gemm::Blas => self.launch_blas(l, t, None),
            Gemm::Blas16 => match self.w16_copy(l) {
                Some(copy) => self.launch_blas(l, t, Some(copy)),
                None => Err(RuntimeError::Unsupported(format!("{} has no 16-bit copy", l.key.name()))),
            },
            Gemm::A8 | Gemm::A8c => self.launch_a8(l, t, g),
            Gemm::Tiled => match codegen_cuda::tiled(l) {
                Some(tiled) => self.launch(&tiled, t, t, &[0; 6]),
                None => Err(RuntimeError::Unsupported(format!("{} has no tiled GEMM", l.key.name()))),
            },
        }
    }

    /// Per linear shape of the schedule, the launch ours runs at each bucket: of the per-token
    /// steps at every bucket, of the logits rows' (a decode step's lm_head) up to
    /// [`MAX_LOGITS_ROWS`].
    fn gemm_launches(&self, buckets: &[usize]) -> Vec<(Shape, Vec<(usize, Launch)>)> {
        let mut shapes: Vec<(Shape, Vec<(usize, Launch)>)> = Vec::new();
        for step in self.program.steps.iter() {
            let Step::Kernels { by, .. } = step else { continue };
            for &t in buckets.iter().filter(|&&t| *by == Count::Tokens || t <= MAX_LOGITS_ROWS) {
                for l in step.launches(t, t) {
                    let Some(shape) = gemm_shape(&l.key) else { continue };
                    let at = match shapes.iter().position(|(s, _)| *s == shape) {
                        Some(i) => i,
                        None => {
                            shapes.push((shape, vec![]));
                            shapes.len() - 1
                        }
                    };
                    if !shapes[at].1.iter().any(|(b, _)| *b == t) {
                        shapes[at].1.push((t, l.clone()));
                    }
                }
            }
        }
        shapes
    }

    /// f32 copies of the biases of the GEMM launches (cuBLASLt adds a bias of D's type): a
    /// launch's linears' biases end to end (zeros for one without), by its first weight.
    fn convert_biases(&mut self, gemms: &[Launch]) -> Result<(), RuntimeError> {
        let program = self.program.clone();
        let launches = program.steps.iter().flat_map(|s| match s {
            Step::Kernels { variants, .. } => variants.iter().flat_map(|(_, ls)| ls).collect(),
            _ => vec![],
        });
        for l in launches.filter(|l| gemms.iter().any(|g| g.key == l.key)) {
            let (Some((_, n, wf)), Some(&Arg::Weight(first))) = (gemm_shape(&l.key), l.args.get(1)) else {
                continue;
            };
            // 16-bit weights, and E4M3 ones with a 16-bit copy (`w16`).
            if wf != WFormat::H16 && !(wf == WFormat::E4m3 && self.w16.contains_key(&first)) {
                continue;
            }
            let biases: Vec<Option<usize>> = (0..3)
                .filter(|&g| n[g] > 0)
                .map(|g| if let Some(&Arg::Weight(b)) = l.args.get(2 + 3 * g) { Some(b) } else { None })
                .collect();
            if self.bias_f32.contains_key(&first) || biases.iter().all(Option::is_none) {
                continue;
            }
            let mut f = vec![];
            for (g, b) in biases.iter().enumerate() {
                match b.and_then(|b| self.weights.view(b)) {
                    Some(w) => f.extend(
                        self.program.half.to_f32(&self.stream.clone_dtoh(&w).map_err(driver("reading a bias"))?),
                    ),
                    None => f.extend(std::iter::repeat_n(0.0, n[g])),
                }
            }
            let d = self.stream.clone_htod(&f).map_err(driver("uploading a bias"))?;
            self.bias_f32.insert(first, d);
        }
        Ok(())
    }

    /// A GEMM launch (`KernelKey::Gemm`: x, then weight, bias and output of up to three linears,
    /// the outputs one packed matrix) of `t` tokens through cuBLASLt: one matmul where the
    /// weights are adjacent (`weights`) and 16-bit, else one per linear; E4M3 weights as W8A8
    /// (`w8a8`), refused where their scales fit no cuBLASLt mode, or (`copy`: the address of
    /// their 16-bit copy, `w16`) as 16-bit ones.
    pub(super) fn launch_blas(&self, l: &Launch, t: usize, copy: Option<u64>) -> Result<(), RuntimeError> {
        let (Some((k, n, wf)), Some(blas)) = (gemm_shape(&l.key), &self.blas) else {
            return Err(RuntimeError::Unsupported(format!("{} is not a cuBLASLt GEMM", l.key.name())));
        };
        if wf.gguf() {
            return Err(RuntimeError::Unsupported(format!("{}: cuBLASLt reads no GGUF blocks", l.key.name())));
        }
        let w8 = wf == WFormat::E4m3 && copy.is_none();
        let ntot: usize = n.iter().sum();
        let biases = l.args.get(1).and_then(|w| if let Arg::Weight(w) = w { self.bias_f32.get(w) } else { None });
        let mut parts = Vec::with_capacity(3);
        let mut modes = Vec::with_capacity(3);
        let mut at = 0;
        for (g, &n) in n.iter().enumerate().filter(|(_, &n)| n > 0) {
            let bias = match l.args.get(2 + 3 * g) {
                // W8A8 adds a 16-bit bias (the weight as stored), 16-bit GEMMs an f32 one.
                Some(a @ Arg::Weight(_)) if w8 => self.arg_ptr(a),
                Some(Arg::Weight(_)) => biases.map_or(0, |s| self.ptr(s) + 4 * at as u64),
                _ => 0,
            };
            let w = match copy {
                Some(c) => c + (at * k * self.program.half.size()) as u64,
                None => self.arg_ptr(&l.args[1 + 3 * g]),
            };
            let out = self.arg_ptr(&l.args[3 + 3 * g]);
            let mut w_scales = 0;
            if let (true, Arg::Weight(i)) = (w8, &l.args[1 + 3 * g]) {
                let Some((mode, s)) = self.w8_scales.get(i) else {
                    return Err(RuntimeError::Unsupported("E4M3 scales fit no cuBLASLt FP8 mode".into()));
                };
                modes.push(*mode);
                w_scales = self.ptr(s);
            }
            parts.push(Part { w, bias, out, n, ld: ntot, w_scales });
            at += n;
        }
        // Adjacent 16-bit weights (and so their outputs and f32 biases): one matmul.
        let row = (k * self.program.half.size()) as u64;
        let adjacent = parts.windows(2).all(|p| p[1].w == p[0].w + p[0].n as u64 * row);
        if !w8 && parts.len() > 1 && adjacent {
            let bias = if parts.iter().any(|p| p.bias != 0) { biases.map_or(0, |s| self.ptr(s)) } else { 0 };
            parts = vec![Part { bias, n: ntot, ..parts[0] }];
        }
        let x = self.arg_ptr(&l.args[0]);
        let (x, fp8) = match modes.first() {
            None => (x, None),
            Some(&m) if !m.takes(t) => {
                return Err(RuntimeError::Unsupported(format!("cuBLASLt takes no {t}-row launch with block scales")));
            }
            Some(&m) if modes.iter().all(|&o| o == m) => {
                let (q, scales) = self.quantize_input(x, k, t, m.group(k))?;
                (q, Some(Fp8In { scales, mode: m }))
            }
            Some(_) => return Err(RuntimeError::Unsupported("the linears of a launch mix E4M3 scale modes".into())),
        };
        blas.gemm(&self.stream, x, fp8, k, t, &parts).map_err(RuntimeError::Unsupported)
    }

    /// Milliseconds per run of `f` on the stream (one warm-up, then the mean of three).
    fn time(&self, f: impl Fn(&Self) -> Result<(), RuntimeError>) -> Result<f64, RuntimeError> {
        super::device::mean_ms(&self.stream, || f(self), driver("timing"))
    }
}

/// Where a machine keeps its choices between runs: beside the kernel cache
/// (`codegen_cuda::nvrtc::cache_dir`), one file per GPU model and CUDA source (our kernels and
/// the 16-bit type). A later load reuses them, so every process on one machine runs the same
/// GEMMs: where the two time within the noise the choice would otherwise differ from run to
/// run, and the logits with it. `None`: no cache folder. `ENGINE_GEMM_CHOICES=FILE` names the
/// file instead, so that binaries with different kernels run the same GEMMs (an A/B of
/// anything but the GEMMs: `scripts/gpu-ab.sh`). A load with 16-bit copies of its E4M3 linears
/// (`copies`, `w16`) keeps its own: a choice of the copies means nothing to a load without them,
/// and a load with them would never time them against choices made without.
fn choices_file(stream: &CudaStream, source: &str, copies: bool) -> Option<std::path::PathBuf> {
    use std::hash::{Hash, Hasher};
    if let Some(f) = std::env::var_os("ENGINE_GEMM_CHOICES") {
        return Some(f.into());
    }
    let name = stream.context().name().ok()?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (name, source).hash(&mut h);
    let forced = Gemm::forced().map_or(String::new(), |g| format!("-forced{}", g.mark().2));
    let copies = if copies { "-h16" } else { "" };
    Some(codegen_cuda::nvrtc::cache_dir()?.join(format!("gemm-choices-{:016x}{forced}{copies}.txt", h.finish())))
}

/// The choices of a file [`write_choices`] wrote: lines `k n0 n1 n2 wf t gemm viable tuned`
/// (`wf` the weight format's number, [`WFormat::number`]: 0 16-bit, 1 E4M3, as the `w8` column
/// of older files; `tuned` 1 or 0; `gemm` 0 ours, 1 cuBLASLt, 2 ours W8A8, 3 ours tiled, 4 ours W8A8 with clusters, 5 cuBLASLt on a 16-bit copy; `viable` the
/// mask of [`Choice`]); unreadable lines (and a missing file) are left out, so they are timed
/// again.
fn read_choices(path: &std::path::Path) -> HashMap<(Shape, usize), Choice> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let parse = |l: &str| -> Option<((Shape, usize), Choice)> {
        let v: Vec<usize> = l.split_whitespace().map(|w| w.parse().ok()).collect::<Option<_>>()?;
        let [k, n0, n1, n2, wf, t, g, viable, tuned] = v[..] else { return None };
        let choice = Choice { gemm: Gemm::from_number(g)?, viable: u8::try_from(viable).ok()?, tuned: tuned == 1 };
        Some((((k, [n0, n1, n2], WFormat::from_number(wf)?), t), choice))
    };
    text.lines().filter_map(parse).collect()
}

/// Writes every shape's choices over those the file holds (a file shared by two bundles, as
/// `scripts/gpu-ab.sh`'s bf16 and FP8 runs share one, keeps both bundles' shapes), atomically:
/// a temporary file renamed; a cache that cannot be written is only a cache.
fn write_choices(path: &std::path::Path, choices: &HashMap<Shape, Vec<(usize, Choice)>>) {
    let mut all = read_choices(path);
    all.extend(choices.iter().flat_map(|(s, ch)| ch.iter().map(move |(t, c)| ((*s, *t), *c))));
    let mut lines: Vec<String> = all
        .iter()
        .map(|(((k, n, wf), t), c)| {
            let (g, tuned) = (c.gemm.mark().2, u8::from(c.tuned));
            format!("{k} {} {} {} {} {t} {g} {} {tuned}\n", n[0], n[1], n[2], wf.number(), c.viable)
        })
        .collect();
    lines.sort();
    write_atomically(path, &lines.concat());
}

/// Writes `text` to `path` through a temporary file renamed (a cache that cannot be written is
/// only a cache).
pub(crate) fn write_atomically(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let ok = path.parent().is_some_and(|d| std::fs::create_dir_all(d).is_ok())
        && std::fs::write(&tmp, text).is_ok()
        && std::fs::rename(&tmp, path).is_ok();
    if !ok {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_captured_batch_from_the_tensor_core_rows_is_timed() {
        let b = buckets();
        assert_eq!(b[0], SKINNY_ROWS[0]);
        for s in super::super::CAPTURE_SIZES.iter().filter(|&&s| s >= SKINNY_ROWS[0]) {
            assert!(b.contains(s), "{s}");
        }
        assert!(b.windows(2).all(|w| w[0] < w[1]) && b.contains(&4096));
    }

    /// A choice of `g`, with `g` and ours viable.
    fn of(g: Gemm) -> Choice {
        Choice { gemm: g, viable: 1 | 1 << g.mark().2, tuned: false }
    }

    #[test]
    fn a_step_follows_the_bucket_a_graph_pads_its_rows_to() {
        let (o, b, a) = (Gemm::Ours, Gemm::Blas, Gemm::A8);
        let choice = [(16, of(o)), (32, of(b)), (64, of(a))];
        let runs: Vec<Gemm> = [8, 16, 17, 24, 32, 33, 63, 64, 4096].iter().map(|&t| chosen(&choice, t)).collect();
        assert_eq!(runs, [o, o, b, b, b, a, a, a, a]);
        assert_eq!(chosen(&[], 64), o);
        assert_eq!(of(Gemm::Tiled).each().collect::<Vec<_>>(), [o, Gemm::Tiled]);
    }

    #[test]
    fn choices_survive_the_file_and_bad_lines_are_timed_again() {
        let dir = std::env::temp_dir().join(format!("gemm-choices-test-{}", std::process::id()));
        let path = dir.join("sub/choices.txt");
        let (shape, w8) = ((896, [4864, 4864, 0], WFormat::H16), (896, [4864, 4864, 0], WFormat::E4m3));
        let tuned = Choice { tuned: true, ..of(Gemm::Tiled) };
        let choices = HashMap::from([
            (shape, vec![(16, of(Gemm::Ours)), (64, of(Gemm::Blas))]),
            (w8, vec![(16, of(Gemm::A8)), (128, tuned)]),
        ]);
        // Written in two parts (two bundles' shapes sharing the file): both are kept.
        write_choices(&path, &HashMap::from([(shape, choices[&shape].clone())]));
        write_choices(&path, &HashMap::from([(w8, choices[&w8].clone())]));
        let back = read_choices(&path);
        let want = [
            ((shape, 16), of(Gemm::Ours)),
            ((shape, 64), of(Gemm::Blas)),
            ((w8, 16), of(Gemm::A8)),
            ((w8, 128), tuned),
        ];
        assert_eq!(back, HashMap::from(want));
        // The seven-field lines of a file from before the graph's tuning, the six-field ones from
        // before E4M3 shapes, and unknown kernels, are timed again.
        let lines =
            "896 4864 4864 0 0 16 0 1 0\n896 4864 x 0 0 64 1 3 0\n896 4864 4864 0 16 0\n896 4864 4864 0 1 8 6 65 0\n\
                     896 4864 4864 0 0 32 1\n1 2 3\n";
        std::fs::write(&path, lines).unwrap();
        assert_eq!(read_choices(&path), HashMap::from([((shape, 16), of(Gemm::Ours))]));
        assert!(read_choices(&dir.join("none.txt")).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_tensor_core_variants_of_one_linear_share_a_shape() {
        let (k, n) = (896, [4864, 4864, 0]);
        let (h16, w8) = (WFormat::H16, WFormat::E4m3);
        assert_eq!(gemm_shape(&KernelKey::Gemm { k, n, wf: h16, b32: false }), Some((k, n, h16)));
        assert_eq!(gemm_shape(&KernelKey::GemmSkinny { k, n, tiles: 8, wf: h16, b32: false }), Some((k, n, h16)));
        assert_eq!(gemm_shape(&KernelKey::GemmSkinny { k, n, tiles: 8, wf: w8, b32: false }), Some((k, n, w8)));
        assert_eq!(gemm_shape(&KernelKey::ToH16), None);
    }

    /// The tiled GEMM stands in for the small-batch kernel's launches only; our `wgmma` kernel
    /// for those of E4M3 or 16-bit weights with output counts of whole 128-feature tiles (its clusters where
    /// stream-K puts several blocks on every tile); cuBLASLt on a 16-bit copy for any E4M3
    /// launch (whether it has one is the load's to say: `w16_refused`).
    #[test]
    fn candidates_follow_the_launch() {
        let (k, n) = (896, [4864, 4864, 0]);
        let of = |key: KernelKey, refused: &[Gemm]| {
            let l =
                Launch { key, args: vec![], grid: [codegen_cuda::Dim::Fixed(1); 2], block: 256, idle_in_decode: false };
            candidates(&l, refused).collect::<Vec<_>>()
        };
        let (b, a, t, c, h) = (Gemm::Blas, Gemm::A8, Gemm::Tiled, Gemm::A8c, Gemm::Blas16);
        let (h16, w8) = (WFormat::H16, WFormat::E4m3);
        assert_eq!(of(KernelKey::GemmSkinny { k, n, tiles: 8, wf: h16, b32: false }, &[]), [b, a, c, t]);
        assert_eq!(of(KernelKey::GemmSkinny { k, n: [4864, 64, 0], tiles: 8, wf: h16, b32: false }, &[]), [b, t]);
        assert_eq!(of(KernelKey::GemmSkinny { k, n: [4864, 128, 0], tiles: 8, wf: w8, b32: false }, &[b]), [h, a, t]);
        assert_eq!(of(KernelKey::GemmSkinny { k, n, tiles: 16, wf: w8, b32: false }, &[h]), [b, t]);
        assert_eq!(of(KernelKey::Gemm { k, n, wf: w8, b32: false }, &[]), [b, h]);
        let o7b = KernelKey::GemmSkinny { k: 3584, n: [3584, 0, 0], tiles: 8, wf: w8, b32: false };
        assert_eq!(of(o7b, &[h]), [b, a, c, t]);
        // GGUF's blocks: our tiled GEMM only, never cuBLASLt.
        assert_eq!(of(KernelKey::GemmSkinny { k, n, tiles: 8, wf: WFormat::Q4, b32: false }, &[]), [t]);
        assert_eq!(of(KernelKey::Gemm { k, n, wf: WFormat::S8, b32: false }, &[]), []);
    }
}
