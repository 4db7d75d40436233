//! The engine (scheduler, paged KV pool, radix cache, worker) on the CPU backend: outputs
//! under continuous batching, chunked prefill, prefix reuse, eviction, retraction, aborts,
//! overlap, pipelined steps (`HostPipeline`), `max_running_requests` and a `--tp 2` bundle equal
//! each request run alone; the pool's integrity holds after every step; each penalty follows its
//! documented formula.

use e2e::*;
use proptest::prelude::*;
use runtime::{
    CpuBackend, Engine, EngineConfig, Event, FinishReason, HostPipeline, Policy, ReqId, Request, Sampler,
    SamplingParams, Sequences,
};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

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

/// An engine whose worker launches steps ahead of the tokens of the step before
/// (`HostPipeline`, each step ready a millisecond after its launch, as on a device), and the
/// count of tokens it has fed from a step before.
fn pipelined_engine(cfg: EngineConfig) -> (Engine, Arc<AtomicUsize>) {
    let latency = std::time::Duration::from_millis(1);
    let p = HostPipeline::new(Box::new(CpuBackend::new(&bundle()).unwrap()), latency);
    let fed = p.fed_tokens();
    (Engine::new(Box::new(p), cfg).unwrap(), fed)
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
        (0..n).map(|_| 3 + self.next(1000) as u32).collect()
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
                Event::Embedding(_) => panic!("request {id}: an embedding event for a generation"),
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
    /// pool of the biggest request plus 0-3 pages: every request's greedy output equals
    /// running it alone, the pool passes its integrity check after every step and is whole at
    /// the end. Eviction and retraction happen in some cases only (`ENGINE_TEST_STATS=1`
    /// prints the counters); `eviction_keeps_outputs` and `retraction_keeps_outputs` make sure
    /// of each.
    #[test]
    fn random_streams_equal_running_alone(
        seed in any::<u64>(),
        page_size in prop::sample::select(vec![1usize, 4, 16]),
        chunk in 3usize..40,
        extra_pages in 0usize..4,
        overlap in any::<bool>(),
        pipelined in any::<bool>(),
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
        let mut e = if pipelined { pipelined_engine(cfg).0 } else { engine(cfg) };
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

/// A pool that holds about one request: each new prompt evicts the cached pages of earlier
/// ones, a prompt whose shared prefix was evicted computes it
/// again, and one whose prefix is still cached reuses it; every output equals running alone.
#[test]
fn eviction_keeps_outputs() {
    let mut rng = Rng(17);
    let (a, b) = (rng.tokens(30), rng.tokens(30));
    let sharing = |base: &[u32], rng: &mut Rng| [&base[..20], &rng.tokens(10)].concat();
    // a, then b (evicts a's pages), then a prompt sharing b's first 20 tokens (cached), then one
    // sharing a's (evicted: computed again).
    let reqs: Vec<Request> = [a.clone(), b.clone(), sharing(&b, &mut rng), sharing(&a, &mut rng)]
        .into_iter()
        .map(|p| Request { ignore_eos: true, ..Request::greedy(p, 10) })
        .collect();
    let run = |slots: usize| {
        let mut e = engine(EngineConfig { page_size: 4, kv_slots: Some(slots), ..config() });
        let outs: Vec<_> = reqs.iter().map(|r| e.generate(vec![r.clone()]).unwrap().remove(0)).collect();
        assert_whole(&e);
        (outs, e.stats())
    };
    let (outs, stats) = run(64);
    let (roomy, roomy_stats) = run(4096);
    assert_eq!(roomy_stats.evicted_pages, 0);
    assert!(stats.evicted_pages > 0, "nothing was evicted: {stats:?}");
    let cached: Vec<usize> = outs.iter().map(|o| o.finish.cached_tokens).collect();
    let roomy_cached: Vec<usize> = roomy.iter().map(|o| o.finish.cached_tokens).collect();
    assert_eq!(roomy_cached, [0, 0, 20, 20], "a roomy pool keeps both prefixes");
    assert_eq!(cached, [0, 0, 20, 0], "b's prefix is cached, a's was evicted: {stats:?}");
    let mut s = seqs(CpuBackend::new(&bundle()).unwrap());
    for (i, (r, o)) in reqs.iter().zip(&outs).enumerate() {
        assert_eq!(o.tokens, alone(&mut s, r, &[]).0, "request {i}");
    }
}

/// A request aborted between the chunks of its prompt's prefill (its first chunk computed and
/// cached, the rest not, with and without a step in flight): it finishes with Abort and no
/// token, the pool is whole at once, the other requests' outputs equal running alone, and the
/// cached first chunk serves the same prompt again.
#[test]
fn abort_in_the_middle_of_a_chunked_prefill() {
    let mut rng = Rng(19);
    let long = Request { ignore_eos: true, ..Request::greedy(rng.tokens(120), 6) };
    let others: Vec<Request> =
        (0..3).map(|i| Request { ignore_eos: true, ..Request::greedy(rng.tokens(6 + 5 * i), 8) }).collect();
    let mut s = seqs(CpuBackend::new(&bundle()).unwrap());
    for overlap in [false, true] {
        let chunk = 32;
        let mut e = engine(EngineConfig { page_size: 4, chunked_prefill_size: chunk, overlap, ..config() });
        let id = e.submit(long.clone()).unwrap();
        let ids: Vec<ReqId> = others.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
        let mut events = Vec::new();
        // Without overlap a step is done when step() returns; with it, one more is in flight.
        for _ in 0..1 + overlap as usize {
            events.extend(e.step().unwrap());
        }
        let planned = e.stats().extend_tokens;
        assert!(planned >= chunk && planned < long.prompt.len(), "overlap {overlap}: {:?}", e.stats());
        assert_eq!(e.usage().locked, chunk / 4, "overlap {overlap}: the first chunk is cached and held");
        let Some(Event::Finished(f)) = e.abort(id) else { panic!("overlap {overlap}: no Finished event") };
        assert_eq!((f.reason, f.completion_tokens), (FinishReason::Abort, 0), "overlap {overlap}");
        e.check().unwrap();
        assert_whole(&e);
        while !e.is_idle() {
            events.extend(e.step().unwrap());
        }
        assert!(events.iter().all(|(r, _)| *r != id), "overlap {overlap}: an event after the abort");
        for (r, rid) in others.iter().zip(&ids) {
            let got: Vec<u32> = events
                .iter()
                .filter_map(|(i, ev)| match ev {
                    Event::Token { id, .. } if i == rid => Some(*id),
                    _ => None,
                })
                .collect();
            assert_eq!(got, alone(&mut s, r, &[]).0, "overlap {overlap}: request {rid}");
        }
        assert_whole(&e);
        let again = e.generate(vec![long.clone()]).unwrap().remove(0);
        assert_eq!(again.finish.cached_tokens, chunk, "overlap {overlap}: the computed chunk is cached");
        assert_eq!(again.tokens, alone(&mut s, &long, &[]).0, "overlap {overlap}");
    }
}

/// `max_running_requests` caps every step's batch; all requests still finish with the outputs
/// of running alone. Without the cap the same workload runs all at once.
#[test]
fn max_running_requests_caps_every_step() {
    let mut rng = Rng(23);
    let reqs: Vec<Request> =
        (0..6).map(|i| Request { ignore_eos: true, ..Request::greedy(rng.tokens(5 + i), 4 + 3 * i) }).collect();
    let run = |max_running_requests: usize| {
        let mut e = engine(EngineConfig { max_running_requests, ..config() });
        e.record_steps();
        let outs = e.generate(reqs.clone()).unwrap();
        let widest = e.take_records().iter().map(|r| r.seqs).max().unwrap();
        (outs, widest)
    };
    let (outs, widest) = run(2);
    assert_eq!(widest, 2, "2 running at most, and 2 at some step");
    assert_eq!(run(256).1, reqs.len(), "without the cap all run at once");
    let mut s = seqs(CpuBackend::new(&bundle()).unwrap());
    for (i, (r, o)) in reqs.iter().zip(&outs).enumerate() {
        assert_eq!(o.finish.reason, FinishReason::Length, "request {i}");
        assert_eq!(o.tokens, alone(&mut s, r, &[]).0, "request {i}");
    }
}

/// With overlap, every running request decodes in every step: a request whose token of the
/// step in flight is still pending is fed it as the placeholder, even while the step before
/// that one's results are processed. Two groups admitted a step apart must not fall into
/// alternate steps (they did: a batch of 128 ran as steps of 64, 64 and 128 in turn).
#[test]
fn overlap_runs_every_request_every_step() {
    let mut rng = Rng(31);
    let reqs: Vec<Request> =
        (0..8).map(|_| Request { ignore_eos: true, ..Request::greedy(rng.tokens(16), 12) }).collect();
    for overlap in [false, true] {
        let mut e = engine(EngineConfig { overlap, chunked_prefill_size: 64, max_prefill_tokens: 64, ..config() });
        e.record_steps();
        let outs = e.generate(reqs.clone()).unwrap();
        let widths: Vec<usize> = e.take_records().iter().map(|r| r.seqs).collect();
        // Step 1 prefills 4 requests; step 2 decodes them and prefills the other 4; then all 8
        // decode together until the first group's 12 tokens are out, and the second's last.
        assert_eq!(widths, [vec![4, 8], vec![8; 10], vec![4]].concat(), "overlap {overlap}");
        let mut s = seqs(CpuBackend::new(&bundle()).unwrap());
        for (i, (r, o)) in reqs.iter().zip(&outs).enumerate() {
            assert_eq!(o.tokens, alone(&mut s, r, &[]).0, "overlap {overlap}: request {i}");
        }
    }
}

/// A worker that launches each step's forward pass before the step before has its tokens on
/// the host (the tokens fed on the device, `Backend::launch_forward`) and its choice once they
/// are gives every request what the synchronous worker gives: greedy, seeded, penalised,
/// `min_tokens` and constrained requests pipelined (their adjustments and masks made after the
/// step before's tokens), steps with logprobs or embeddings after the step in flight, and
/// requests finishing while their next step is in flight.
#[test]
fn pipelined_steps_equal_synchronous_ones() {
    let mut rng = Rng(37);
    let seeded = SamplingParams { temperature: 0.8, top_p: 0.9, seed: 5, ..Default::default() };
    let sampling = [
        SamplingParams::default(),
        seeded.clone(),
        SamplingParams { logit_bias: vec![(7, 2.0)], ..seeded.clone() },
        SamplingParams { frequency_penalty: 0.3, ..Default::default() },
        SamplingParams { min_tokens: 6, min_tokens_ids: vec![5, 9], ..seeded.clone() },
    ];
    let mut reqs: Vec<Request> = (0..10)
        .map(|i| Request {
            sampling: sampling[i % sampling.len()].clone(),
            ..Request::greedy(rng.tokens(3 + 5 * i), 4 + 3 * i)
        })
        .collect();
    reqs[6].logprobs = Some(2);
    // Embedding requests take turns with the generation steps (each runs after the step in
    // flight).
    let mut all = reqs.clone();
    all.insert(3, Request::embedding(rng.tokens(30), runtime::Pooling::Mean));
    all.push(Request::embedding(rng.tokens(7), runtime::Pooling::Last));
    let cfg = || EngineConfig { chunked_prefill_size: 24, ..config() };
    // Every request; then those that need nothing on the host (greedy, seeded, logit_bias).
    let light: Vec<Request> = [0, 1, 2, 5, 7].iter().map(|&i| reqs[i].clone()).collect();
    for (reqs, share) in [(all, 0.0), (light, 0.5)] {
        let want = engine(cfg()).generate(reqs.clone()).unwrap();
        let (mut e, fed) = pipelined_engine(cfg());
        let got = e.generate(reqs.clone()).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!((&g.tokens, g.finish.reason), (&w.tokens, w.finish.reason), "request {i}");
            assert_eq!(g.logprobs.len(), w.logprobs.len(), "request {i}");
            assert_eq!(g.embedding, w.embedding, "request {i}");
        }
        assert!(got.iter().zip(&reqs).all(|(g, r)| r.embed.is_none() || !g.embedding.is_empty()));
        let decoded: usize = want.iter().map(|o| o.tokens.len().saturating_sub(1)).sum();
        let fed = fed.load(Ordering::Relaxed);
        eprintln!("{} requests: {fed} of {decoded} decode tokens fed from the step before", reqs.len());
        assert!(
            fed > 0 && fed as f64 >= share * decoded as f64,
            "{fed} of {decoded} decode tokens fed from the step before"
        );
    }
    // Constrained requests: each token must follow the one before (`Follows`), so a mask made
    // before the step before's token was taken would show.
    let constrained = |seed: u64| -> Vec<Request> {
        (0..6)
            .map(|i| Request {
                sampling: if i % 2 == 0 {
                    SamplingParams::default()
                } else {
                    SamplingParams { seed, ..seeded.clone() }
                },
                constraint: Some(runtime::Constraint::new(Follows(None))),
                ..Request::greedy(Rng(40 + i).tokens(5 + 4 * i as usize), 10 + i as usize)
            })
            .collect()
    };
    let want = engine(cfg()).generate(constrained(3)).unwrap();
    let (mut e, fed) = pipelined_engine(cfg());
    let got = e.generate(constrained(3)).unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.tokens, w.tokens, "constrained request {i}");
        assert!(g.tokens.windows(2).all(|t| t[1] % 5 == (t[0] + 1) % 5), "request {i}: {:?}", g.tokens);
    }
    assert!(fed.load(Ordering::Relaxed) > 0);
    // Greedy requests equal running alone.
    let (mut e, _) = pipelined_engine(cfg());
    let greedy: Vec<Request> = reqs.iter().map(|r| Request::greedy(r.prompt.clone(), r.max_tokens)).collect();
    let outs = e.generate(greedy.clone()).unwrap();
    let mut s = seqs(CpuBackend::new(&bundle()).unwrap());
    for (i, (r, o)) in greedy.iter().zip(&outs).enumerate() {
        assert_eq!((o.tokens.clone(), o.finish.reason), alone(&mut s, r, &config().eos_ids), "greedy request {i}");
    }
}

/// A test constraint: after token t only tokens t' with t' % 5 == (t + 1) % 5 (anything first).
struct Follows(Option<u32>);

impl runtime::TokenConstraint for Follows {
    fn allowed(&mut self) -> Vec<u32> {
        let words = 1024usize.div_ceil(32);
        let ok = |t: u32| self.0.is_none_or(|p| t % 5 == (p + 1) % 5);
        (0..words).map(|w| (0..32).filter(|b| ok(32 * w as u32 + b)).fold(0u32, |m, b| m | 1 << b)).collect()
    }
    fn accept(&mut self, token: u32) {
        self.0 = Some(token);
    }
}

/// A `--tp 2` bundle on the CPU (one rank per thread) serves through the engine with the radix
/// cache: prompts sharing prefixes reuse the cached pages, and every output equals the request
/// run alone on the same bundle.
#[test]
fn tp2_with_the_radix_cache_equals_running_alone() {
    let dir = scratch(env!("CARGO_TARGET_TMPDIR"), "engine-tp2");
    let b = bundle::Bundle::open(&compile_fixture("tiny-llama", &dir, 2, None)).unwrap();
    let backend = || runtime::load(&b, runtime::Device::Cpu, &[]).unwrap();
    let mut rng = Rng(29);
    let base = rng.tokens(40);
    let reqs: Vec<Request> = (0..4)
        .map(|i| {
            let prompt = [&base[..16 + 8 * i], &rng.tokens(3 + i)].concat();
            Request { ignore_eos: true, ..Request::greedy(prompt, 8) }
        })
        .collect();
    let cfg = EngineConfig { page_size: 4, kv_slots: Some(1024), ..EngineConfig::for_bundle(&b).unwrap() };
    let mut e = Engine::new(backend(), cfg).unwrap();
    // The first request alone fills the cache; the rest run together on its prefix.
    let mut outs = e.generate(vec![reqs[0].clone()]).unwrap();
    outs.extend(e.generate(reqs[1..].to_vec()).unwrap());
    let cached: Vec<usize> = outs.iter().map(|o| o.finish.cached_tokens).collect();
    assert_eq!(cached, [0, 16, 16, 16], "{:?}", e.stats());
    assert_whole(&e);
    let mut s = runtime::Sequences::new(backend(), 1024).unwrap();
    for (i, (r, o)) in reqs.iter().zip(&outs).enumerate() {
        assert_eq!(o.tokens, alone(&mut s, r, &[]).0, "request {i}");
    }
}

/// The raw logits before each token of `tokens` (the engine's output for `prompt`), from the
/// request run alone, teacher-forced: row k is what the engine's sampler saw before choosing
/// `tokens[k]`.
fn raw_steps(s: &mut Sequences, prompt: &[u32], tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut rows = vec![s.forward(0, prompt, &[prompt.len() - 1]).unwrap()];
    for &t in &tokens[..tokens.len().saturating_sub(1)] {
        rows.push(s.forward(0, &[t], &[0]).unwrap());
    }
    s.release(0);
    rows
}

/// The documented penalties applied to `raw` after `prompt` and `output`: HF's repetition
/// penalty (a positive logit of a token seen in prompt or output divided by it, a negative one
/// multiplied), then OpenAI's frequency penalty (times the token's count in the output) and
/// presence penalty (once per token present in the output).
fn penalised(raw: &[f32], p: &SamplingParams, prompt: &[u32], output: &[u32]) -> Vec<f32> {
    let mut l = raw.to_vec();
    let seen: std::collections::HashSet<u32> = prompt.iter().chain(output).copied().collect();
    for t in seen {
        let x = &mut l[t as usize];
        *x = if *x > 0.0 { *x / p.repetition_penalty } else { *x * p.repetition_penalty };
    }
    let mut counts: HashMap<u32, u32> = HashMap::new();
    for &t in output {
        *counts.entry(t).or_default() += 1;
    }
    for (t, c) in counts {
        l[t as usize] -= p.frequency_penalty * c as f32 + p.presence_penalty;
    }
    l
}

/// Checks a greedy penalised output against [`penalised`] raw logits: every token where the
/// penalised top-2 margin is clear is the penalised argmax. Returns how many of those steps
/// the penalty changed the choice (the raw argmax differs).
fn check_penalised(s: &mut Sequences, req: &Request, tokens: &[u32], what: &str) -> usize {
    assert_eq!(tokens.len(), req.max_tokens, "{what}: ignore_eos runs to max_tokens");
    let (mut compared, mut changed) = (0, 0);
    for (k, raw) in raw_steps(s, &req.prompt, tokens).iter().enumerate() {
        let l = penalised(raw, &req.sampling, &req.prompt, &tokens[..k]);
        let (want, margin) = top2(&l);
        let scale = l.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        if margin <= 1e-4 * scale {
            continue;
        }
        compared += 1;
        assert_eq!(tokens[k], want, "{what}: step {k} is not the penalised argmax (margin {margin}): {tokens:?}");
        changed += (top2(raw).0 != want) as usize;
    }
    assert!(compared + 2 >= tokens.len(), "{what}: only {compared} of {} steps had a clear margin", tokens.len());
    changed
}

/// Penalties, stop ids and logprobs per request in one batch: each penalty alone gives the
/// argmax of the logits penalised by its documented formula at every step, and changes the
/// choice at some; the greedy request's logprobs are the log-softmax of its raw logits.
#[test]
fn per_request_sampling_options() {
    // The prompt ends with its own greedy continuation, so the tokens the model goes on to
    // prefer are in the prompt: the repetition penalty's prompt part matters too.
    let mut s = seqs(CpuBackend::new(&bundle()).unwrap());
    let mut prompt = Rng(9).tokens(12);
    prompt.extend(alone(&mut s, &Request { ignore_eos: true, ..Request::greedy(prompt.clone(), 12) }, &[]).0);
    let greedy = Request { ignore_eos: true, logprobs: Some(3), ..Request::greedy(prompt.clone(), 24) };
    let with =
        |name: &'static str, sampling: SamplingParams| (name, Request { sampling, logprobs: None, ..greedy.clone() });
    // Penalties of the order of the logits' top-2 margins (~0.02-0.2), so a token may still
    // repeat and the count matters.
    let penalties = [
        with("frequency", SamplingParams { frequency_penalty: 0.06, ..Default::default() }),
        with("presence", SamplingParams { presence_penalty: 0.06, ..Default::default() }),
        with("repetition", SamplingParams { repetition_penalty: 1.05, ..Default::default() }),
        with(
            "all three",
            SamplingParams {
                frequency_penalty: 0.05,
                presence_penalty: -0.03,
                repetition_penalty: 1.03,
                ..Default::default()
            },
        ),
    ];
    let batch: Vec<Request> = std::iter::once(greedy.clone()).chain(penalties.iter().map(|p| p.1.clone())).collect();
    let out = engine(config()).generate(batch).unwrap();
    let g = &out[0];
    let raw = raw_steps(&mut s, &prompt, &g.tokens);
    assert_eq!(g.logprobs.len(), 24);
    for ((t, lp), raw) in g.tokens.iter().zip(&g.logprobs).zip(&raw) {
        assert_eq!(lp.top.len(), 3);
        assert_eq!(lp.top[0].0, *t, "greedy picks the most likely token");
        assert_eq!(*t, Sampler::argmax(raw), "greedy output equals running alone");
        let max = raw.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = max + raw.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
        assert!(
            (lp.token - (raw[*t as usize] - lse)).abs() < 1e-4,
            "logprob {} vs {}",
            lp.token,
            raw[*t as usize] - lse
        );
        assert_eq!(lp.token, lp.top[0].1);
    }
    for ((name, req), o) in penalties.iter().zip(&out[1..]) {
        let changed = check_penalised(&mut s, req, &o.tokens, name);
        eprintln!("{name}: changed {changed} of {} choices: {:?}", o.tokens.len(), o.tokens);
        assert!(changed > 0, "{name}: the penalty never changed the greedy choice: {:?}", o.tokens);
    }
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

/// Requests submitted from several threads while the engine thread steps are each admitted:
/// none is lost between its loop's reads of the command channel (a submission that arrived
/// there was once swallowed by the check for a dropped handle, and its caller told that the
/// engine had stopped).
#[test]
fn handle_admits_every_request_submitted_while_it_steps() {
    let h = std::sync::Arc::new(runtime::EngineHandle::spawn(engine(config())));
    let threads: Vec<_> = (0..8)
        .map(|k| {
            let h = h.clone();
            std::thread::spawn(move || {
                for i in 0..500 {
                    let req = Request { ignore_eos: true, ..Request::greedy(Rng(1000 * k + i + 1).tokens(4), 4) };
                    if let Err(e) = h.submit(req, Box::new(|_| {})) {
                        panic!("submission {i} of thread {k}: {e}");
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a submission failed");
    }
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
