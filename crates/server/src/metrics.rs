//! Prometheus metrics (`GET /metrics`): request and token counters, TTFT and TPOT histograms,
//! and the engine's queue, running requests, KV pool and cache hit rate.

use runtime::Snapshot;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

const BUCKETS: [f64; 12] = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// A histogram of seconds.
#[derive(Default)]
struct Histogram {
    counts: Mutex<([u64; BUCKETS.len()], u64, f64)>,
}

impl Histogram {
    fn observe(&self, v: f64) {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        for (i, b) in BUCKETS.iter().enumerate() {
            if v <= *b {
                c.0[i] += 1;
            }
        }
        c.1 += 1;
        c.2 += v;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in BUCKETS.iter().enumerate() {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", c.0[i]);
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", c.1, c.2, c.1);
    }
}

/// The server's metrics.
#[derive(Default)]
pub struct Metrics {
    requests: AtomicU64,
    errors: AtomicU64,
    ttft: Histogram,
    tpot: Histogram,
}

impl Metrics {
    /// A request arrived.
    pub fn request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// A request was answered with an error.
    pub fn error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// A choice finished: its time to first token, time per output token after the first.
    pub fn finished(&self, ttft: Option<f64>, tpot: Option<f64>) {
        if let Some(t) = ttft {
            self.ttft.observe(t);
        }
        if let Some(t) = tpot {
            self.tpot.observe(t);
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self, s: &Snapshot) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(&mut out, "engine_requests_total", "HTTP generation requests", self.requests.load(Ordering::Relaxed));
        counter(
            &mut out,
            "engine_request_errors_total",
            "Requests answered with an error",
            self.errors.load(Ordering::Relaxed),
        );
        // The engine counts tokens itself, so those of requests aborted by a disconnect or a
        // shutdown count too.
        let prompt = s.stats.prompt_tokens as u64;
        counter(&mut out, "engine_prompt_tokens_total", "Prompt tokens of admitted requests", prompt);
        let generated = s.stats.generated_tokens as u64;
        counter(&mut out, "engine_generation_tokens_total", "Generated tokens (aborted requests' included)", generated);
        self.ttft.write(&mut out, "engine_time_to_first_token_seconds", "Time to first token");
        self.tpot.write(&mut out, "engine_time_per_output_token_seconds", "Time per output token after the first");
        gauge(&mut out, "engine_queue_requests", "Requests waiting for admission", s.queued as f64);
        gauge(&mut out, "engine_running_requests", "Requests running", s.running as f64);
        if let Some(p) = s.pool {
            let used = (p.locked + p.private) as f64 / p.total.max(1) as f64;
            gauge(&mut out, "engine_kv_pool_usage", "Share of KV pages used by running requests", used);
            gauge(&mut out, "engine_kv_pages_total", "KV pages", p.total as f64);
            gauge(&mut out, "engine_kv_pages_free", "Free KV pages", p.free as f64);
            gauge(&mut out, "engine_kv_pages_cached", "KV pages in the prefix cache", (p.evictable + p.locked) as f64);
            gauge(&mut out, "engine_kv_pages_private", "KV pages private to running requests", p.private as f64);
        }
        let hit = s.stats.cached_tokens as f64 / s.stats.prompt_tokens.max(1) as f64;
        gauge(&mut out, "engine_cache_hit_rate", "Prompt tokens served from the prefix cache", hit);
        counter(
            &mut out,
            "engine_retractions_total",
            "Requests retracted for lack of KV pages",
            s.stats.retractions as u64,
        );
        counter(&mut out, "engine_step_errors_total", "Engine steps that failed", s.step_errors as u64);
        if let Some(rss) = resident_bytes() {
            gauge(&mut out, "process_resident_memory_bytes", "Resident memory", rss as f64);
        }
        out
    }
}

/// Resident memory of this process (Linux).
pub fn resident_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}
