//! The CPU JIT linear kernel on SmolLM2-135M's shapes, dense and block (GGUF Q4_1 / Q8_0, as
//! its GGUF stores them, and the k-quants Q4_K / Q5_K / Q6_K where K is a multiple of 256)
//! weights: weight bytes streamed per second (what bounds batch-1 decode
//! when the kernel keeps up: compare with the machine's copy bandwidth in docs/perf.md) and
//! multiply-adds per second. `cargo bench -p benches --bench linear` (`-- q4_1` to run only
//! the dtypes whose name contains `q4_1`).

use codegen_cpu::{blocks, LinearKernel, Pool};
use ir::DType;
use std::time::Instant;

fn main() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // (name, k, n): SmolLM2-135M's projections and its tied lm_head.
    let shapes = [
        ("qkv-like 576x576", 576, 576),
        ("gate/up 576x1536", 576, 1536),
        ("down 1536x576", 1536, 576),
        ("lm_head 576x49152", 576, 49152),
    ];
    println!("threads available: {threads}");
    let only = std::env::args().nth(1).filter(|a| !a.starts_with('-'));
    println!(
        "{:<20} {:>5} {:>6} {:>4} {:>10} {:>9} {:>8}",
        "shape", "dtype", "batch", "thr", "us/call", "GB/s(w)", "GMAC/s"
    );
    for (name, k, n) in shapes {
        let k_quants = [DType::Q4_K, DType::Q5_K, DType::Q6_K];
        for dtype in [DType::F32, DType::BF16, DType::Q4_1, DType::Q8_0].into_iter().chain(k_quants) {
            let k_quant = k_quants.contains(&dtype);
            if only.as_ref().is_some_and(|o| !dtype.to_string().contains(o.as_str())) || (k_quant && k % 256 != 0) {
                continue;
            }
            let kernel = LinearKernel::compile(k, n, dtype).expect("compiles");
            let w = if k_quant {
                blocks::k_quant_sample(dtype, n * k / 256, 0)
            } else {
                dtype.from_f32(&(0..n * k).map(|i| ((i % 97) as f32 - 48.0) / 97.0).collect::<Vec<_>>())
            };
            let w = if dtype.is_block() { blocks::repack(dtype, &w) } else { w };
            for batch in [1, 8, 64] {
                let x: Vec<f32> = (0..batch * k).map(|i| ((i % 13) as f32) / 13.0).collect();
                let mut out = vec![0.0; batch * n];
                for thr in [1, threads] {
                    let pool = Pool::new(thr);
                    let mut best = f64::MAX;
                    for _ in 0..5 {
                        let reps = (2e8 / (w.len() as f64)).ceil() as usize;
                        let t = Instant::now();
                        for _ in 0..reps {
                            kernel.run(&pool, &x, &w, &mut out);
                        }
                        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
                    }
                    println!(
                        "{name:<20} {dtype:>5} {batch:>6} {thr:>4} {:>10.1} {:>9.2} {:>8.2}",
                        best * 1e6,
                        w.len() as f64 / best / 1e9,
                        (batch * n * k) as f64 / best / 1e9
                    );
                    if threads == 1 {
                        break;
                    }
                }
            }
        }
    }
}
