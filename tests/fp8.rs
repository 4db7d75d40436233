//! `engc compile --quant fp8` on the tiny Qwen3 fixture: every linear's weight (not the
//! embedding, the norms or the lm_head) stored as FP8 E4M3 with one f32 scale per output
//! channel, in 0.5625x the bytes those weights take in bf16; the CPU backend (which dequantizes
//! them at load) gives the reference interpreter's logits on the same bundle within 1e-4, at
//! tp 1 and tp 2 (a row-parallel slice keeps its rows' scales); the quantization moves the
//! logits from the bf16 bundle's by ~8% of the largest logit on these random weights (checked
//! below 20%); the CUDA codegen refuses the plan by weight name.

use e2e::*;
use std::path::{Path, PathBuf};

const PROMPT: [u32; 12] = [1, 17, 250, 3, 99, 311, 42, 7, 128, 64, 200, 11];
const DECODE: [u32; 3] = [45, 310, 2];

fn compile(dir: &Path, tp: usize, quant: Option<compiler::Quant>) -> PathBuf {
    let out = dir.join(format!("q3-tp{tp}-{}.bundle", if quant.is_some() { "fp8" } else { "bf16" }));
    compile_to("qwen3", &fixture("tiny-qwen3"), &out, |o| {
        o.tp = tp;
        o.dtype = Some(ir::DType::BF16);
        o.quant = quant;
    })
}

#[test]
fn fp8_linears_match_their_dequantization_in_fewer_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let fp8 = bundle::Bundle::open(&compile(dir.path(), 1, Some(compiler::Quant::Fp8))).unwrap();
    let bf16 = bundle::Bundle::open(&compile(dir.path(), 1, None)).unwrap();
    let (mut quantized, mut fp8_bytes, mut bf16_bytes) = (0, 0, 0);
    for ((name, shape, d), (_, _, before)) in fp8.plan.weights().zip(bf16.plan.weights()) {
        let linear = name.contains("_proj");
        assert_eq!(d == ir::DType::F8_E4M3, linear, "{name} is {d}");
        if linear {
            quantized += 1;
            let n: usize = shape.iter().product();
            fp8_bytes += d.bytes(n).unwrap();
            bf16_bytes += before.bytes(n).unwrap();
        }
    }
    assert!(quantized >= 7 && fp8_bytes * 10 <= bf16_bytes * 6, "{quantized} weights: {fp8_bytes} vs {bf16_bytes}");

    let run = |b: Box<dyn runtime::Backend>| prefill_then_decode(&mut seqs_of(b), &PROMPT, &DECODE);
    let want = run(Box::new(runtime::RefBackend::new(&fp8).unwrap()));
    let cpu = run(Box::new(runtime::CpuBackend::new(&fp8).unwrap()));
    let tp2 = bundle::Bundle::open(&compile(dir.path(), 2, Some(compiler::Quant::Fp8))).unwrap();
    let cpu2 = run(runtime::load(&tp2, runtime::Device::Cpu, &[]).unwrap());
    let unquantized = run(Box::new(runtime::RefBackend::new(&bf16).unwrap()));
    for (step, w) in want.iter().enumerate() {
        let (e1, e2) = (rel_err(&cpu[step], w), rel_err(&cpu2[step], w));
        assert!(e1 < 1e-4 && e2 < 1e-4, "step {step}: CPU tp1 {e1}, tp2 {e2} against the reference");
        let moved = rel_err(w, &unquantized[step]);
        // Random weights, E4M3's 3 mantissa bits: ~8% of the largest logit measured; a wrong scale
        // or a misread code moves them by their own size.
        assert!(moved > 0.0 && moved < 0.2, "step {step}: fp8 moved the logits by {moved}");
    }
    let refused = codegen_cuda::emit(&fp8.plan).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(refused.contains("is f8_e4m3"), "{refused}");
}

fn seqs_of(b: Box<dyn runtime::Backend>) -> runtime::Sequences {
    runtime::Sequences::new(b, 4096).expect("KV pool")
}
