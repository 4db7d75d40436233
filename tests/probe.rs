//! `engrun probe`: the host copy bandwidth as JSON (small sizes), and `--device cuda` on a
//! machine without a GPU failing with the runtime's clear error.

use e2e::{run, stderr};
use serde_json::Value;

/// The probe's JSON object (stdout must be exactly one).
fn probe_json(args: &[&str]) -> Value {
    let o = run("engrun", args);
    assert!(o.status.success(), "engrun {args:?} failed: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("stdout is not one JSON object: {e}"))
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("`{key}` is not a number in {v}"))
}

/// A copy rate of `bytes`, `reps` runs: positive finite times and rate, the best no slower
/// than the mean, and the rate counting bytes read + written (2 x bytes / best time).
fn check_copy(c: &Value, bytes: u64, reps: u64) {
    assert_eq!(c["bytes"].as_u64(), Some(bytes), "{c}");
    assert_eq!(c["reps"].as_u64(), Some(reps), "{c}");
    let (best, mean, gb_s) = (num(c, "best_ms"), num(c, "mean_ms"), num(c, "gb_s"));
    for x in [best, mean, gb_s] {
        assert!(x.is_finite() && x > 0.0, "{c}");
    }
    assert!(best <= mean * (1.0 + 1e-9), "best slower than the mean: {c}");
    let want = 2.0 * bytes as f64 / (best * 1e-3) / 1e9;
    assert!((gb_s - want).abs() <= 1e-9 * want, "gb_s {gb_s} is not bytes read + written per second ({want}): {c}");
    assert!(gb_s < 1e5, "implausible copy rate: {c}");
}

#[test]
fn cpu_probe_reports_sane_copy_rates() {
    let v = probe_json(&["probe", "--device", "cpu", "--host-mib", "8", "--reps", "3", "--json"]);
    assert!(v["convention"].as_str().is_some_and(|c| c.contains("read + written")), "{v}");
    assert_eq!(v["gpus"].as_array().map(Vec::len), Some(0), "no GPU asked for: {v}");
    let h = &v["host"];
    let threads = h["threads"].as_u64().unwrap_or(0);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    assert_eq!(threads, cores, "the all-cores copy runs one thread per core: {h}");
    check_copy(&h["one_thread"], 8 << 20, 3);
    check_copy(&h["all_cores"], 8 << 20, 3);
}

#[test]
fn cuda_probe_without_gpu_is_a_clear_error() {
    let args = [
        "probe",
        "--device",
        "cuda",
        "--host-mib",
        "8",
        "--device-mib",
        "8",
        "--matmul-size",
        "256",
        "--reps",
        "2",
        "--warmup",
        "1",
        "--json",
    ];
    let o = run("engrun", &args);
    if o.status.success() {
        // A machine with a GPU: GPU 0 measured.
        let v: Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
        let g = &v["gpus"][0];
        assert!(g["name"].as_str().is_some_and(|n| !n.is_empty()), "{v}");
        check_copy(&g["copy"], 8 << 20, 2);
        let m = g["matmul"].as_array().expect("matmul rates");
        assert_eq!(m.len(), 2, "bf16 and f16: {v}");
        assert!(m.iter().all(|r| num(r, "tflop_s").is_finite() && num(r, "tflop_s") > 0.0), "{v}");
    } else {
        let e = stderr(&o);
        let clear = ["CUDA driver (libcuda.so) was not found", "no usable GPU"];
        assert!(clear.iter().any(|c| e.contains(c)), "not the runtime's clear error: {e}");
        assert!(o.stdout.is_empty(), "no report on failure: {}", String::from_utf8_lossy(&o.stdout));
    }
}

#[test]
fn zero_reps_is_refused() {
    let o = run("engrun", &["probe", "--reps", "0", "--host-mib", "1"]);
    assert!(!o.status.success(), "--reps 0 accepted");
    assert!(stderr(&o).contains("repetitions must be at least 1"), "{}", stderr(&o));
}
