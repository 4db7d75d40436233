//! The GEMM choices of a decode graph, by timing the graph itself. The load times each linear
//! alone (`blas`), and that misleads inside a step: our kernels overlap their neighbours
//! (programmatic dependent launches), cuBLASLt's do not, and a kernel that wins alone may slow
//! the next one (Qwen2.5-0.5B at 32 rows: ours on the down projection takes 13 us alone against
//! cuBLASLt's 12, yet the step is 0.33 ms longer with it). So before a decode graph of a size is
//! captured the first time, each linear shape in turn (the others as chosen) is run with every
//! GEMM viable at that size, the step's graph captured and replayed, and the fastest kept. The
//! step being tuned is the real one: a replay writes the same KV rows and logits again. The
//! choices, marked tuned, go to the choices file, so a later load captures at once.
//! `ENGINE_GEMM_TUNE=0` keeps the load's choices; tensor-parallel ranks keep them too (their
//! graphs meet in collectives, and would have to be timed in step). The same timing decides
//! whether a graph leaves out the launches idle in decode steps ([`CudaBackend::tune_lean`];
//! untimed, it does).

use super::blas::{Choice, Gemm, Shape};
use super::{driver, CudaBackend, Packed};
use crate::RuntimeError;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use std::collections::HashMap;
use std::fmt::Write;

impl CudaBackend {
    /// Captures the graph of packed decode step `p` (its inputs already on the device): the fed
    /// tokens' replacement ([`CudaBackend::feed_tokens`]), then the step.
    pub(super) fn capture(&mut self, p: &Packed) -> Result<CudaGraph, RuntimeError> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("capturing a graph"))?;
        let lean = p.graph && self.lean.get(&p.t).copied().unwrap_or(true);
        let enq = self.feed_tokens(p.t).and_then(|()| self.enqueue(p.t, p.r, &p.off, lean));
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0)).map_err(driver("capturing a graph"))?;
        enq?;
        graph.ok_or_else(|| RuntimeError::Unsupported("CUDA: graph capture gave nothing".into()))
    }

    /// Chooses, by timing step `p`'s graph, the GEMM of every linear shape whose choice at the
    /// step's size is not tuned yet and has more than one viable GEMM.
    pub(super) fn tune_graph(&mut self, p: &Packed) -> Result<(), RuntimeError> {
        if self.untimed() || Gemm::forced().is_some() {
            return Ok(());
        }
        let t = p.t;
        let todo = untuned(&self.blas_choice, t);
        if todo.is_empty() {
            return Ok(());
        }
        let start = std::time::Instant::now();
        // The first replays of a process run slower (clocks, caches): ten of the step as it is
        // first, so that the first shape's timings compare with the others'.
        let graph = self.capture(p)?;
        for _ in 0..10 {
            graph.launch().map_err(driver("replaying a graph"))?;
        }
        // Two rounds: a shape's best may change once the shapes after it changed.
        for round in 1..=2 {
            let mut line =
                format!("GEMMs in the batch-{t} graph, round {round} (us a step with each GEMM of a shape):");
            for &(shape, at) in &todo {
                let choice = self.blas_choice[&shape][at].1;
                let _ = write!(line, " k{} n{:?}", shape.0, shape.1);
                let mut best = (choice.gemm, f64::MAX);
                for g in choice.each().collect::<Vec<_>>() {
                    self.set_choice(shape, at, Choice { gemm: g, ..choice });
                    // A GEMM whose graph cannot be captured or replayed is passed over.
                    match self.time_graph(p) {
                        Ok(ms) => {
                            let _ = write!(line, " {}{:.0}", g.mark().1, ms * 1e3);
                            if ms < best.1 {
                                best = (g, ms);
                            }
                        }
                        Err(e) => {
                            let _ = write!(line, " {} failed ({e})", g.mark().1);
                        }
                    }
                }
                self.set_choice(shape, at, Choice { gemm: best.0, tuned: round == 2, ..choice });
                let _ = write!(line, " ->{}", if best.0 == Gemm::Ours { "ours" } else { best.0.mark().1 });
            }
            eprintln!("{line} ({:.0} ms)", start.elapsed().as_secs_f64() * 1e3);
        }
        self.save_choices();
        Ok(())
    }

    /// Whether decode graph step `p` runs faster without the launches idle in it
    /// (`Launch::idle_in_decode`), by timing its graph both ways, twice in turn. They cost
    /// a launch each, yet leaving them out can slow the kernels around them: measured on an
    /// H200 (docs/perf.md), Qwen2.5-0.5B's steps of 64 and 128 rows 5-7% faster without
    /// extend attention's launch, a 4-layer Qwen2.5-7B's of 64 rows 3% slower.
    pub(super) fn tune_lean(&mut self, p: &Packed) -> Result<(), RuntimeError> {
        let idle = |s: &codegen_cuda::Step| s.launches(p.t, p.r).iter().any(|l| l.idle_in_decode);
        if self.untimed() || self.lean.contains_key(&p.t) || !self.program.steps.iter().any(idle) {
            return Ok(());
        }
        let mut best = [f64::MAX; 2];
        for _ in 0..2 {
            for lean in [false, true] {
                self.lean.insert(p.t, lean);
                let ms = self.time_graph(p)?;
                best[usize::from(lean)] = best[usize::from(lean)].min(ms);
            }
        }
        let lean = best[1] < best[0];
        self.lean.insert(p.t, lean);
        eprintln!(
            "batch-{} graph: {:.0} us with the launches idle in decode steps, {:.0} without ->{}",
            p.t,
            best[0] * 1e3,
            best[1] * 1e3,
            if lean { "without" } else { "with" }
        );
        Ok(())
    }

    /// Whether decode graphs are captured as the load left them, untimed: with
    /// `ENGINE_GEMM_TUNE=0`, and on tensor-parallel ranks.
    fn untimed(&self) -> bool {
        self.comm.is_some() || std::env::var("ENGINE_GEMM_TUNE").is_ok_and(|v| v == "0")
    }

    /// Milliseconds a replay of step `p`'s graph takes (one warm-up, the mean of three).
    fn time_graph(&mut self, p: &Packed) -> Result<f64, RuntimeError> {
        let graph = self.capture(p)?;
        let replay = || graph.launch().map_err(driver("replaying a graph"));
        super::device::mean_ms(&self.stream, replay, driver("timing a graph"))
    }

    fn set_choice(&mut self, shape: Shape, at: usize, c: Choice) {
        if let Some(ch) = self.blas_choice.get_mut(&shape) {
            ch[at].1 = c;
        }
    }
}

/// The linear shapes whose choice at bucket `t` (a graph's size) the graph should make: those
/// with a choice there, not tuned yet, with more than one viable GEMM; in shape order, each with
/// the index of its bucket.
fn untuned(choices: &HashMap<Shape, Vec<(usize, Choice)>>, t: usize) -> Vec<(Shape, usize)> {
    let mut todo: Vec<(Shape, usize)> = choices
        .iter()
        .filter_map(|(s, ch)| {
            let at = ch.iter().position(|(b, _)| *b == t)?;
            let c = ch[at].1;
            (!c.tuned && c.each().count() > 1).then_some((*s, at))
        })
        .collect();
    todo.sort();
    todo
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_graph_chooses_where_the_load_left_a_choice() {
        let c = |gemm, viable, tuned| Choice { gemm, viable, tuned };
        let (h16, w8) = (codegen_cuda::WFormat::H16, codegen_cuda::WFormat::E4m3);
        let (a, b, d) = ((896, [896, 0, 0], h16), (896, [4864, 4864, 0], w8), (4864, [896, 0, 0], h16));
        let choices = HashMap::from([
            (b, vec![(16, c(Gemm::Blas, 0b0111, false)), (64, c(Gemm::A8, 0b0101, false))]),
            (a, vec![(16, c(Gemm::Ours, 0b0011, false)), (64, c(Gemm::Blas, 0b0011, true))]),
            (d, vec![(16, c(Gemm::Ours, 0b0001, false)), (64, c(Gemm::Ours, 0b1001, false))]),
        ]);
        // At 16 rows: a and b, in shape order (d has ours alone); at 64: b and d (a's is tuned);
        // a size no bucket has: none.
        assert_eq!(untuned(&choices, 16), [(a, 0), (b, 0)]);
        assert_eq!(untuned(&choices, 64), [(b, 1), (d, 1)]);
        assert!(untuned(&choices, 8).is_empty());
    }
}
