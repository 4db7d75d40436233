//! The engine (scheduler, paged KV pool, radix cache, worker) on the CPU backend: outputs
//! under continuous batching, chunked prefill, prefix reuse, eviction, retraction, aborts and
//! overlap equal each request run alone; the pool's integrity holds after every step.

use e2e::*;
use proptest::prelude::*;
use runtime::{
    CpuBackend, Engine, EngineConfig, Event, FinishReason, Policy, ReqId, Request, Sampler, SamplingParams, Sequences,
};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

fn bundle_path() -> &'static PathBuf {
    static B: OnceLock<PathBuf> = OnceLock::new();
    B.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("engine-tests");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        compile_fixture("tiny-llama", &dir, 1, None)
    })
}

fn bundle() -> bundle::Bundle {
    bundle::Bundle::open(bundle_path()).unwrap()
}

fn engine(cfg: EngineConfig) -> Engine {
    let b = bundle();
    Engine::new(Box::new(CpuBackend::new(&b).unwrap()), cfg).unwrap()
}

fn config() -> EngineConfig {
    EngineConfig { kv_slots: Some(4096), ..EngineConfig::for_bundle(&bundle()).unwrap() }
}

/// Greedy decoding of `req` straight on the backend, without the scheduler: the oracle.
fn alone(s: &mut Sequences, req: &Request, eos: &[u32]) -> (Vec<u32>, FinishReason) {
    let mut logits = s.forward(0, &req.prompt, &[req.prompt.len() - 1]).unwrap();
    let mut out = vec![];
    let reason = loop {
        let t = Sampler::argmax(&logits);
        if (!req.ignore_eos && eos.contains(&t)) || req.stop_ids.contains(&t) {
            break FinishReason::Stop;
        }
        out.push(t);
        if out.len() == req.max_tokens {
            break FinishReason::Length;
        }
        logits = s.forward(0, &[t], &[0]).unwrap();
    };
    s.release(0);
    (out, reason)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| 3 + self.next(49000) as u32).collect()
    }
}

/// A planned request: what, when it arrives, when (if) it is aborted.
struct Planned {
    req: Request,
    arrive: usize,
    abort: Option<usize>,
}

fn workload(rng: &mut Rng, n: usize) -> Vec<Planned> {
    let lens = [5 + rng.next(40), 5 + rng.next(40)];
    let bases = [rng.tokens(lens[0]), rng.tokens(lens[1])];
    (0..n)
        .map(|_| {
            let mut prompt = match rng.next(3) {
                2 => vec![],
                i => {
                    let cut = 1 + rng.next(bases[i].len());
                    bases[i][..cut].to_vec()
                }
            };
            let extra = 1 + rng.next(20);
            prompt.extend(rng.tokens(extra));
            let arrive = rng.next(6);
            let abort = (rng.next(4) == 0).then(|| arrive + rng.next(8));
            Planned { req: Request::greedy(prompt, 1 + rng.next(30)), arrive, abort }
        })
        .collect()
}

/// Runs the planned requests through `engine`, checking the pool after every step; returns
/// each request's tokens and finish reason.
fn drive(engine: &mut Engine, plan: &[Planned]) -> Vec<(Vec<u32>, FinishReason)> {
    let mut ids: Vec<Option<ReqId>> = vec![None; plan.len()];
    let mut out: HashMap<ReqId, (Vec<u32>, Option<FinishReason>)> = HashMap::new();
    let mut step = 0;
    loop {
        for (i, p) in plan.iter().enumerate() {
            if p.arrive == step {
                let id = engine.submit(p.req.clone()).unwrap();
                ids[i] = Some(id);
                out.insert(id, (vec![], None));
            }
            if p.abort == Some(step) {
                if let Some(Event::Finished(f)) = engine.abort(ids[i].unwrap()) {
                    out.get_mut(&ids[i].unwrap()).unwrap().1 = Some(f.reason);
                }
            }
        }
        for (id, e) in engine.step().unwrap() {
            let o = out.get_mut(&id).unwrap();
            assert!(o.1.is_none(), "request {id} has an event after it finished");
            match e {
                Event::Token { id, .. } => o.0.push(id),
                Event::Finished(f) => o.1 = Some(f.reason),
            }
        }
        engine.check().unwrap_or_else(|e| panic!("after step {step}: {e}"));
        step += 1;
        if step > 6 && engine.is_idle() && plan.iter().all(|p| p.abort.is_none_or(|a| a < step)) {
            break;
        }
        assert!(step < 10_000, "the engine does not finish");
    }
    ids.iter().map(|id| out.remove(&id.unwrap()).map(|(t, r)| (t, r.unwrap())).unwrap()).collect()
}

fn assert_whole(engine: &Engine) {
    let u = engine.usage();
    assert_eq!((u.locked, u.private), (0, 0), "{u:?}");
    assert_eq!(u.free + u.evictable, u.total, "{u:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("ENGINE_TEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(32), ..ProptestConfig::default() })]

    /// Random streams of requests with shared prefixes, random lengths and aborts, through a
    /// small pool that forces eviction and retraction: every request's greedy output equals
    /// running it alone; the pool is whole at the end.
    #[test]
    fn random_streams_equal_running_alone(
        seed in any::<u64>(),
        page_size in prop::sample::select(vec![1usize, 4, 16]),
        chunk in 3usize..40,
        extra_pages in 0usize..4,
        overlap in any::<bool>(),
        radix in any::<bool>(),
        lpm in any::<bool>(),
        n in 2usize..10,
    ) {
        let mut rng = Rng(seed | 1);
        let plan = workload(&mut rng, n);
        let biggest = plan.iter().map(|p| p.req.prompt.len() + p.req.max_tokens).max().unwrap();
        let slots = (biggest.div_ceil(page_size) + extra_pages) * page_size;
        let cfg = EngineConfig {
            page_size,
            kv_slots: Some(slots),
            chunked_prefill_size: chunk,
            overlap,
            radix_cache: radix,
            policy: if lpm { Policy::Lpm } else { Policy::Fcfs },
            ..config()
        };
        let eos = cfg.eos_ids.clone();
        let mut e = engine(cfg);
        let got = drive(&mut e, &plan);
        if std::env::var_os("ENGINE_TEST_STATS").is_some() {
            eprintln!("{:?}", e.stats());
        }
        assert_whole(&e);
        let mut s = seqs(CpuBackend::new(&bundle()).unwrap());
        for (i, (p, (tokens, reason))) in plan.iter().zip(&got).enumerate() {
            let (want, want_reason) = alone(&mut s, &p.req, &eos);
            if *reason == FinishReason::Abort {
                prop_assert!(want.starts_with(tokens), "request {i}: aborted output is not a prefix");
            } else {
                prop_assert_eq!(tokens, &want, "request {}", i);
                prop_assert_eq!(*reason, want_reason);
            }
        }
    }
}

/// A request sharing 90% of its prompt with a finished one computes only the new tokens.
#[test]
fn radix_cache_computes_only_new_tokens() {
    for page_size in [1, 16] {
        let mut rng = Rng(7);
        let a = rng.tokens(100);
        let mut b = a[..90].to_vec();
        b.extend(rng.tokens(10));
        let mut e = engine(EngineConfig { page_size, ..config() });
        e.generate(vec![Request::greedy(a, 4)]).unwrap();
        let before = e.stats().extend_tokens;
        let out = e.generate(vec![Request::greedy(b.clone(), 4)]).unwrap();
        let reused = 90 / page_size * page_size;
        assert_eq!(out[0].finish.cached_tokens, reused, "page size {page_size}");
        assert_eq!(e.stats().extend_tokens - before, 100 - reused, "page size {page_size}: extend tokens");
        // The cached run's output equals an uncached one.
        let mut cold = engine(EngineConfig { radix_cache: false, ..config() });
        assert_eq!(cold.generate(vec![Request::greedy(b, 4)]).unwrap()[0].tokens, out[0].tokens);
        assert_whole(&e);
    }
}

/// Chunked prefill of a long prompt gives the same logits as one prefill.
#[test]
fn chunked_prefill_equals_one_prefill() {
    let prompt = Rng(3).tokens(300);
    let mut s = seqs(CpuBackend::new(&bundle()).unwrap());
    let rows: Vec<usize> = (0..prompt.len()).collect();
    let whole = s.forward(0, &prompt, &rows).unwrap();
    let mut chunked = Vec::new();
    for c in prompt.chunks(37) {
        chunked.extend(s.forward(1, c, &(0..c.len()).collect::<Vec<_>>()).unwrap());
    }
    assert_eq!(chunked, whole, "chunked prefill logits differ");
    // Through the engine: the first token's log-probabilities do not depend on the chunking.
    let req = Request { logprobs: Some(5), ..Request::greedy(prompt, 3) };
    let one = engine(config()).generate(vec![req.clone()]).unwrap();
    let many = engine(EngineConfig { chunked_prefill_size: 37, ..config() }).generate(vec![req]).unwrap();
    assert_eq!(one[0].logprobs, many[0].logprobs);
    assert_eq!(one[0].tokens, many[0].tokens);
}

/// The same seed gives the same sampled output whatever else is in the batch.
#[test]
fn seeded_sampling_is_reproducible_across_batches() {
    let mut rng = Rng(11);
    let sampling = SamplingParams { temperature: 0.9, top_p: 0.95, top_k: 50, seed: 42, ..Default::default() };
    let target = Request { sampling: sampling.clone(), ignore_eos: true, ..Request::greedy(rng.tokens(20), 24) };
    let alone = engine(config()).generate(vec![target.clone()]).unwrap();
    let mut batch: Vec<Request> = (0..5)
        .map(|i| Request {
            sampling: SamplingParams { seed: i, ..sampling.clone() },
            ..Request::greedy(rng.tokens(5 + 7 * i as usize), 30)
        })
        .collect();
    batch.insert(2, target.clone());
    for overlap in [false, true] {
        let mixed = engine(EngineConfig { overlap, chunked_prefill_size: 16, ..config() }).generate(batch.clone());
        assert_eq!(mixed.unwrap()[2].tokens, alone[0].tokens, "overlap {overlap}");
    }
    let other = Request { sampling: SamplingParams { seed: 43, ..sampling }, ..target };
    assert_ne!(engine(config()).generate(vec![other]).unwrap()[0].tokens, alone[0].tokens, "the seed matters");
}

/// A pool too small for all requests at once: requests are retracted and re-run, and every
/// output still equals running alone.
#[test]
fn retraction_keeps_outputs() {
    let mut rng = Rng(5);
    let reqs: Vec<Request> =
        (0..8).map(|_| Request { ignore_eos: true, ..Request::greedy(rng.tokens(10), 60) }).collect();
    let mut e = engine(EngineConfig { page_size: 4, kv_slots: Some(160), ..config() });
    let got = e.generate(reqs.clone()).unwrap();
    assert!(e.stats().retractions > 0, "the pool was big enough: {:?}", e.stats());
    let mut s = seqs(CpuBackend::new(&bundle()).unwrap());
    for (r, o) in reqs.iter().zip(&got) {
        assert_eq!(o.tokens, alone(&mut s, r, &[]).0);
    }
    assert_whole(&e);
}

/// Penalties, stop ids and logprobs per request in one batch.
#[test]
fn per_request_sampling_options() {
    let prompt = Rng(9).tokens(12);
    let greedy = Request { ignore_eos: true, logprobs: Some(3), ..Request::greedy(prompt.clone(), 12) };
    let penalised = Request {
        sampling: SamplingParams { frequency_penalty: 2.0, presence_penalty: 2.0, ..Default::default() },
        ..greedy.clone()
    };
    let out = engine(config()).generate(vec![greedy.clone(), penalised]).unwrap();
    let (g, p) = (&out[0], &out[1]);
    assert_eq!(g.logprobs.len(), 12);
    for (t, lp) in g.tokens.iter().zip(&g.logprobs) {
        assert_eq!(lp.top.len(), 3);
        assert_eq!(lp.top[0].0, *t, "greedy picks the most likely token");
        assert!(lp.token <= 0.0 && (lp.token - lp.top[0].1).abs() < 1e-6);
    }
    let distinct = |v: &[u32]| v.iter().collect::<std::collections::HashSet<_>>().len();
    assert!(distinct(&p.tokens) >= distinct(&g.tokens), "penalties repeat less: {:?} vs {:?}", p.tokens, g.tokens);
    // A stop id ends the request before it is emitted.
    let stop = Request { stop_ids: vec![g.tokens[3]], ..greedy };
    let s = engine(config()).generate(vec![stop]).unwrap();
    let first = g.tokens.iter().position(|&t| t == g.tokens[3]).unwrap();
    assert_eq!(s[0].tokens, g.tokens[..first]);
    assert_eq!(s[0].finish.reason, FinishReason::Stop);
}

/// Bad requests are refused with a message; the engine goes on serving.
#[test]
fn rejects_bad_requests() {
    let mut e = engine(EngineConfig { kv_slots: Some(64), page_size: 16, ..config() });
    let cases: Vec<(Request, &str)> = vec![
        (Request::greedy(vec![], 4), "prompt is empty"),
        (Request::greedy(vec![1, 99_999], 4), "outside the vocabulary"),
        (Request::greedy(vec![1], 0), "max_tokens"),
        (Request::greedy(vec![1; 8000], 500), "exceeds the context length"),
        (Request::greedy(vec![1; 60], 10), "KV slots"),
        (
            Request {
                sampling: SamplingParams { temperature: -1.0, ..Default::default() },
                ..Request::greedy(vec![1], 1)
            },
            "temperature",
        ),
        (Request { logprobs: Some(100), ..Request::greedy(vec![1], 1) }, "logprobs"),
    ];
    for (r, msg) in cases {
        let err = e.submit(r).unwrap_err().to_string();
        assert!(err.contains(msg), "`{err}` does not mention `{msg}`");
    }
    assert_eq!(e.generate(vec![Request::greedy(vec![5, 6, 7], 3)]).unwrap()[0].tokens.len(), 3);
}

/// The threaded handle streams the same tokens as the offline API, and aborts.
#[test]
fn handle_streams_and_aborts() {
    let req = Request { ignore_eos: true, ..Request::greedy(Rng(13).tokens(10), 8) };
    let want = engine(config()).generate(vec![req.clone()]).unwrap();
    let h = runtime::EngineHandle::spawn(engine(config()));
    let (tx, rx) = std::sync::mpsc::channel();
    h.submit(req.clone(), Box::new(move |e| tx.send(e).unwrap())).unwrap();
    let events: Vec<Event> = rx.iter().collect();
    let tokens: Vec<u32> =
        events.iter().filter_map(|e| if let Event::Token { id, .. } = e { Some(*id) } else { None }).collect();
    assert_eq!(tokens, want[0].tokens);
    assert!(matches!(events.last(), Some(Event::Finished(f)) if f.reason == FinishReason::Length));
    let (tx, rx) = std::sync::mpsc::channel();
    let long = Request { max_tokens: 4000, ..req };
    let id = h.submit(long, Box::new(move |e| tx.send(e).unwrap())).unwrap();
    rx.recv().unwrap();
    h.abort(id);
    let last = rx.iter().last().unwrap();
    assert!(matches!(last, Event::Finished(f) if f.reason == FinishReason::Abort), "{last:?}");
    assert!(h.submit(Request::greedy(vec![], 1), Box::new(|_| {})).is_err());
    // The snapshot is published after each turn of the engine thread.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while h.snapshot().running != 0 {
        assert!(std::time::Instant::now() < deadline, "{:?}", h.snapshot());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    h.shutdown();
}
