//! The scheduler: the request lifecycle (waiting → extend, possibly in chunks → decode →
//! finished), page allocation from the [`PagePool`], prefix reuse through the
//! [`RadixCache`], and the choice of each step's batch (SGLang's `get_next_batch_to_run`,
//! `process_batch_result`, `cache_finished_req` / `cache_unfinished_req`).
//!
//! Every running request gets its next tokens each step: one for a decoding request, a chunk
//! of its prompt for an extending one (chunked prefill, mixed into the same step as the
//! decodes). With overlap scheduling a step is planned while the previous one runs: a
//! request whose next token is still being sampled is fed it as a placeholder
//! ([`SeqPlan::prev`]) that the worker fills in. Pages freed here are only reused by later
//! steps, which the worker runs after every earlier one, so nothing in flight is overwritten.
//!
//! Embedding requests ([`Request::embed`]) run their prompts in steps of their own (the
//! backend returns hidden states, not tokens, for those: [`StepPlan::embed`]), batched
//! together and taking turns with the other steps while both kinds have work; they never take
//! a prefix from the cache (a mean needs every token's state) but leave their KV pages in it.

use crate::engine::EngineConfig;
use crate::radix::NodeId;
use crate::{Event, Finish, FinishReason, Logprobs, PagePool, RadixCache, ReqId, Request, RuntimeError};
use std::collections::{HashMap, VecDeque};
use std::str::FromStr;
use std::sync::Arc;

/// The order in which waiting requests are admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served.
    Fcfs,
    /// Longest cached prefix first (falls back to FCFS when more than 128 wait).
    Lpm,
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Policy, String> {
        match s {
            "fcfs" => Ok(Policy::Fcfs),
            "lpm" => Ok(Policy::Lpm),
            other => Err(format!("unknown schedule policy `{other}` (expected fcfs or lpm)")),
        }
    }
}

/// A request inside the scheduler.
struct Req {
    req: Arc<Request>,
    output: Vec<u32>,
    /// KV pages of positions `0..scheduled`; the first `tree_pages` belong to the radix cache.
    pages: Vec<u32>,
    tree_pages: usize,
    /// The locked radix node whose path holds `pages[..tree_pages]`.
    node: NodeId,
    /// Positions whose KV has been submitted to the worker / is complete.
    scheduled: usize,
    done: usize,
    /// Tokens being sampled in submitted steps (with overlap, up to two: the step running and
    /// the one planned behind it, which feeds the first as its placeholder).
    pending: usize,
    cached_tokens: Option<usize>,
    /// An embedding's pooled hidden states so far (a sum for a mean, else the last row).
    pooled: Vec<f32>,
}

impl Req {
    fn seq_len(&self) -> usize {
        self.req.prompt.len() + self.output.len()
    }

    fn token(&self, i: usize) -> u32 {
        let p = self.req.prompt.len();
        if i < p {
            self.req.prompt[i]
        } else {
            self.output[i - p]
        }
    }

    fn tokens(&self, range: std::ops::Range<usize>) -> Vec<u32> {
        range.map(|i| self.token(i)).collect()
    }

    /// Tokens still to feed: the unfed part of prompt + output, plus the last pending one
    /// (the earlier pending ones were fed as placeholders already).
    fn feed(&self) -> usize {
        self.seq_len() + self.pending - self.scheduled
    }

    fn will_finish(&self) -> bool {
        self.output.len() + self.pending >= self.req.max_tokens
    }

    fn embeds(&self) -> bool {
        self.req.embed.is_some()
    }
}

/// One sequence of a planned step.
#[derive(Debug)]
pub(crate) struct SeqPlan {
    pub req: ReqId,
    /// Known tokens to feed.
    pub tokens: Vec<u32>,
    /// One more token follows `tokens`: the one the previous step samples for this request.
    pub prev: bool,
    /// Slots of positions `0..` through the last fed token.
    pub slots: Vec<u32>,
    /// Sample the next token (the chunk reaches the end of the sequence).
    pub sample: Option<Arc<Request>>,
    /// An extend chunk (not a decode): its pages go into the cache when it completes.
    pub extend: bool,
    /// Rows of `tokens` whose final hidden states an embedding step returns.
    pub hidden_rows: Vec<usize>,
}

/// A planned step.
#[derive(Debug, Default)]
pub(crate) struct StepPlan {
    pub seqs: Vec<SeqPlan>,
    /// Tokens of extend chunks (the rest are decodes).
    pub extend_tokens: usize,
    /// A step of embedding chunks only: the backend returns hidden states.
    pub embed: bool,
}

pub(crate) enum Next {
    Step(StepPlan),
    /// Nothing to run now.
    Idle,
    /// Memory is short: finish the step in flight, then plan again.
    Sync,
}

/// A sampled token as the worker returns it.
#[derive(Debug, Clone)]
pub(crate) struct Sampled {
    pub token: u32,
    pub logprobs: Option<Logprobs>,
}

/// What the worker returns for one sequence of a step.
#[derive(Debug, Clone)]
pub(crate) enum SeqOut {
    /// Nothing (a chunk that does not reach the end of its sequence).
    Nothing,
    /// The next token.
    Token(Sampled),
    /// An embedding chunk's hidden states: its `hidden_rows`, one after another.
    Hidden(Vec<f32>),
}

/// Counters since the engine started.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct SchedStats {
    /// Prompt tokens of admitted requests (first admission).
    pub prompt_tokens: usize,
    /// Of those, tokens found in the prefix cache.
    pub cached_tokens: usize,
    /// Tokens computed in extend chunks (re-prefills after retraction included).
    pub extend_tokens: usize,
    /// Tokens computed by decodes.
    pub decode_tokens: usize,
    /// Tokens generated for requests (eos and stop ids not counted), aborted requests' too.
    pub generated_tokens: usize,
    /// Requests retracted to the queue for lack of pages.
    pub retractions: usize,
    /// Pages evicted from the prefix cache.
    pub evicted_pages: usize,
}

/// What the pool holds, in pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PoolUsage {
    /// Pages in the pool.
    pub total: usize,
    /// Free pages.
    pub free: usize,
    /// Cached pages no request uses (evictable).
    pub evictable: usize,
    /// Cached pages running requests use.
    pub locked: usize,
    /// Pages of running requests outside the cache.
    pub private: usize,
}

pub(crate) struct Scheduler {
    cfg: EngineConfig,
    pool: PagePool,
    tree: RadixCache,
    reqs: HashMap<ReqId, Req>,
    waiting: VecDeque<ReqId>,
    running: Vec<ReqId>,
    /// Expected share of max_tokens a running request still generates (SGLang's
    /// new_token_ratio): the admission reserve.
    ratio: f64,
    next_id: ReqId,
    /// The last step was an embedding step (embedding and other steps take turns).
    embed_turn: bool,
    pub stats: SchedStats,
}

/// Most tokens of a mean-pooled embedding in one step: each is a row of hidden state (and of
/// logits, on a backend that computes them anyway) that the step returns.
const MEAN_POOL_ROWS: usize = 256;

/// Shared tokens beyond the cache that make a waiting request wait for another's prefill.
const IN_BATCH_PREFIX: usize = 32;
const RATIO_INIT: f64 = 0.7;
const RATIO_MIN: f64 = 0.1;
const RATIO_DECAY: f64 = 0.001;

impl Scheduler {
    pub fn new(cfg: EngineConfig, pool: PagePool) -> Scheduler {
        let tree = RadixCache::new(pool.page_size());
        Scheduler {
            cfg,
            pool,
            tree,
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            ratio: RATIO_INIT,
            next_id: 0,
            embed_turn: false,
            stats: SchedStats::default(),
        }
    }

    pub fn submit(&mut self, mut req: Request, vocab: usize) -> Result<ReqId, RuntimeError> {
        req.validate(vocab, self.cfg.max_context)?;
        if req.sampling.min_tokens > 0 {
            let eos = if req.ignore_eos { &[][..] } else { &self.cfg.eos_ids[..] };
            req.sampling.min_tokens_ids = eos.iter().chain(&req.stop_ids).copied().collect();
        }
        let need = self.pool.pages_for(req.prompt.len() + req.max_tokens);
        if need > self.pool.total() {
            return Err(RuntimeError::Invalid(format!(
                "the prompt ({} tokens) plus max_tokens ({}) needs {} KV slots; the pool has {}",
                req.prompt.len(),
                req.max_tokens,
                need * self.pool.page_size(),
                self.pool.total() * self.pool.page_size()
            )));
        }
        let id = self.next_id;
        self.next_id += 1;
        let r = Req {
            req: Arc::new(req),
            output: vec![],
            pages: vec![],
            tree_pages: 0,
            node: RadixCache::ROOT,
            scheduled: 0,
            done: 0,
            pending: 0,
            cached_tokens: None,
            pooled: vec![],
        };
        self.reqs.insert(id, r);
        self.waiting.push_back(id);
        Ok(id)
    }

    pub fn is_idle(&self) -> bool {
        self.reqs.is_empty()
    }

    pub fn queue_len(&self) -> usize {
        self.waiting.len()
    }

    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    /// Ends request `id` (if it is still known): its pages go to the cache or the pool.
    pub fn abort(&mut self, id: ReqId) -> Option<Event> {
        self.reqs.contains_key(&id).then(|| self.finish(id, FinishReason::Abort))
    }

    fn finish(&mut self, id: ReqId, reason: FinishReason) -> Event {
        let mut r = self.reqs.remove(&id).expect("known request");
        self.running.retain(|&x| x != id);
        self.waiting.retain(|&x| x != id);
        self.cache(&mut r, false);
        Event::Finished(Finish {
            reason,
            prompt_tokens: r.req.prompt.len(),
            completion_tokens: r.output.len(),
            cached_tokens: r.cached_tokens.unwrap_or(0),
        })
    }

    /// Makes `n` pages free, evicting from the cache if needed.
    fn ensure(&mut self, n: usize) -> bool {
        if self.pool.available() < n {
            let short = n - self.pool.available();
            self.stats.evicted_pages += self.tree.evict(short, &mut self.pool);
        }
        self.pool.available() >= n
    }

    /// Pages running requests are expected to need beyond what they hold.
    fn reserve(&self) -> usize {
        self.running.iter().map(|id| self.growth(&self.reqs[id])).sum()
    }

    fn growth(&self, r: &Req) -> usize {
        let left = r.req.max_tokens.saturating_sub(r.output.len());
        let expect = r.seq_len() + (left as f64 * self.ratio).ceil() as usize;
        self.pool.pages_for(expect).saturating_sub(r.pages.len())
    }

    /// Plans the next step (see the module docs). `in_flight`: a step is still running.
    pub fn schedule(&mut self, in_flight: bool) -> Next {
        if let Some(plan) = self.embed_step(false) {
            return Next::Step(plan);
        }
        loop {
            let decoders: Vec<ReqId> = self
                .running
                .iter()
                .copied()
                .filter(|id| {
                    let r = &self.reqs[id];
                    r.feed() == 1 && !r.will_finish()
                })
                .collect();
            let short = decoders
                .iter()
                .map(|id| {
                    let r = &self.reqs[id];
                    self.pool.pages_for(r.scheduled + 1).saturating_sub(r.pages.len())
                })
                .sum::<usize>()
                > self.pool.available() + self.tree.evictable_pages();
            if short {
                if in_flight {
                    return Next::Sync;
                }
                self.retract_newest();
                continue;
            }
            let mut plan = StepPlan::default();
            for id in decoders {
                self.plan_chunk(id, 1, &mut plan);
            }
            if !plan.seqs.is_empty() {
                self.ratio = (self.ratio - RATIO_DECAY).max(RATIO_MIN);
            }
            let mut budget = self.cfg.chunked_prefill_size.min(self.cfg.max_prefill_tokens);
            self.continue_extends(&mut budget, &mut plan);
            self.admit(&mut budget, &mut plan);
            if !plan.seqs.is_empty() {
                return Next::Step(plan);
            }
            if let Some(plan) = self.embed_step(true) {
                return Next::Step(plan);
            }
            if in_flight || self.running.is_empty() {
                return Next::Idle;
            }
            // Every running request is blocked on pages: make room.
            self.retract_newest();
        }
    }

    /// A step of embedding chunks when embeddings have work and it is their turn (the last
    /// step was not one, or no other request is known) or `force`: running embeddings' next
    /// chunks, then waiting ones admitted.
    fn embed_step(&mut self, force: bool) -> Option<StepPlan> {
        if !self.reqs.values().any(Req::embeds) {
            self.embed_turn = false;
            return None;
        }
        if self.embed_turn && !force && self.reqs.values().any(|r| !r.embeds()) {
            self.embed_turn = false;
            return None;
        }
        let mut plan = StepPlan { embed: true, ..StepPlan::default() };
        let mut budget = self.cfg.chunked_prefill_size.min(self.cfg.max_prefill_tokens);
        self.continue_extends(&mut budget, &mut plan);
        self.admit(&mut budget, &mut plan);
        self.embed_turn = !plan.seqs.is_empty();
        self.embed_turn.then_some(plan)
    }

    /// The most tokens of request `r` one step feeds: [`MEAN_POOL_ROWS`] for a mean-pooled
    /// embedding (every token is a returned row), else any number.
    fn chunk_cap(r: &Req) -> usize {
        match r.req.embed {
            Some(crate::Pooling::Mean) => MEAN_POOL_ROWS,
            _ => usize::MAX,
        }
    }

    /// Feeds the next `n` tokens of request `id` (pages must be available).
    fn plan_chunk(&mut self, id: ReqId, n: usize, plan: &mut StepPlan) -> bool {
        let r = &self.reqs[&id];
        let need = self.pool.pages_for(r.scheduled + n).saturating_sub(r.pages.len());
        if !self.ensure(need) {
            return false;
        }
        let new = self.pool.alloc(need).expect("ensured");
        let r = self.reqs.get_mut(&id).expect("known request");
        r.pages.extend(new);
        let end = r.scheduled + n;
        // The chunk ends at the last pending token: it is fed as the placeholder.
        let prev = r.pending > 0 && end == r.seq_len() + r.pending;
        let sample = !r.embeds() && end == r.seq_len() + r.pending;
        let hidden_rows = match r.req.embed {
            Some(crate::Pooling::Mean) => (0..n).collect(),
            Some(crate::Pooling::Last) if end == r.seq_len() => vec![n - 1],
            _ => vec![],
        };
        // A decode feeds one generated token; anything else extends.
        let extend = n > 1 || r.scheduled < r.req.prompt.len();
        let seq = SeqPlan {
            req: id,
            tokens: r.tokens(r.scheduled..end - prev as usize),
            prev,
            slots: self.pool.slots(&r.pages, end),
            sample: sample.then(|| r.req.clone()),
            extend,
            hidden_rows,
        };
        r.scheduled = end;
        r.pending += sample as usize;
        plan.seqs.push(seq);
        if extend {
            plan.extend_tokens += n;
            self.stats.extend_tokens += n;
        } else {
            self.stats.decode_tokens += 1;
        }
        true
    }

    /// Next chunks of running requests whose prompt is not all computed (embeddings' in an
    /// embedding step, the others' in any other).
    fn continue_extends(&mut self, budget: &mut usize, plan: &mut StepPlan) {
        let extending: Vec<ReqId> = self
            .running
            .iter()
            .copied()
            .filter(|id| {
                let r = &self.reqs[id];
                r.embeds() == plan.embed && r.feed() > !plan.embed as usize
            })
            .collect();
        for id in extending {
            let r = &self.reqs[&id];
            let n = r.feed().min(*budget).min(Self::chunk_cap(r));
            if n == 0 || !self.plan_chunk(id, n, plan) {
                break;
            }
            *budget -= n;
        }
    }

    /// Admits waiting requests in policy order while budget, slots and pages last: the
    /// embeddings in an embedding step, the others in any other.
    fn admit(&mut self, budget: &mut usize, plan: &mut StepPlan) {
        if self.cfg.policy == Policy::Lpm && self.cfg.radix_cache && self.waiting.len() <= 128 {
            let mut keyed: Vec<(usize, ReqId)> = self
                .waiting
                .iter()
                .map(|&id| {
                    let r = &self.reqs[&id];
                    let toks = r.tokens(0..r.seq_len() - 1);
                    (self.tree.match_prefix(&toks).0.len(), id)
                })
                .collect();
            keyed.sort_by_key(|&(m, _)| std::cmp::Reverse(m));
            self.waiting = keyed.into_iter().map(|(_, id)| id).collect();
        }
        let mut i = 0;
        while *budget > 0 && self.running.len() < self.cfg.max_running_requests && i < self.waiting.len() {
            let id = self.waiting[i];
            let r = &self.reqs[&id];
            if r.embeds() != plan.embed {
                i += 1;
                continue;
            }
            let len = r.seq_len();
            let reuse = self.cfg.radix_cache && !r.embeds();
            let (prefix, node) =
                if reuse { self.tree.match_prefix(&r.tokens(0..len - 1)) } else { (vec![], RadixCache::ROOT) };
            let matched = prefix.len() * self.pool.page_size();
            if reuse && self.prefix_in_flight(id, matched) {
                // Another request is computing this prompt's prefix right now: wait one step
                // and take it from the cache instead of computing it twice.
                i += 1;
                continue;
            }
            self.tree.lock(node);
            let left = r.req.max_tokens.saturating_sub(r.output.len());
            let whole = self.pool.pages_for(len + (left as f64 * self.ratio).ceil() as usize) - prefix.len();
            let room = self.pool.available() + self.tree.evictable_pages();
            if !self.running.is_empty() && whole + self.reserve() > room {
                self.tree.unlock(node);
                break;
            }
            let r = self.reqs.get_mut(&id).expect("known request");
            r.pages = prefix;
            r.tree_pages = r.pages.len();
            r.node = node;
            r.scheduled = matched;
            r.done = matched;
            if r.cached_tokens.is_none() {
                r.cached_tokens = Some(matched);
                self.stats.prompt_tokens += r.req.prompt.len();
                self.stats.cached_tokens += matched;
            }
            let n = (len - matched).min(*budget).min(Self::chunk_cap(r));
            self.waiting.remove(i);
            self.running.push(id);
            if !self.plan_chunk(id, n, plan) {
                // Not even the first chunk fits: back to the queue.
                self.retract(id);
                break;
            }
            *budget -= n;
        }
    }

    /// Whether a running request with tokens not yet in the cache shares at least
    /// [`IN_BATCH_PREFIX`] more tokens with waiting request `id` than the cache holds (SGLang's
    /// in-batch prefix check).
    fn prefix_in_flight(&self, id: ReqId, cached: usize) -> bool {
        let c = &self.reqs[&id];
        self.running.iter().any(|o| {
            let r = &self.reqs[o];
            let n = r.scheduled.min(c.seq_len());
            r.done < r.scheduled
                && n >= cached + IN_BATCH_PREFIX
                && (0..n).take_while(|&i| c.token(i) == r.token(i)).count() >= cached + IN_BATCH_PREFIX
        })
    }

    /// Returns the most recently admitted running request to the front of the queue; its
    /// computed prefix stays in the cache.
    fn retract_newest(&mut self) {
        if let Some(&id) = self.running.last() {
            self.retract(id);
            self.stats.retractions += 1;
            self.ratio = (self.ratio + 0.2).min(1.0);
        }
    }

    fn retract(&mut self, id: ReqId) {
        let mut r = self.reqs.remove(&id).expect("known request");
        assert!(r.pending == 0 && r.done == r.scheduled, "retracting a request with a step in flight");
        self.cache(&mut r, false);
        r.pages.clear();
        r.tree_pages = 0;
        r.node = RadixCache::ROOT;
        r.scheduled = 0;
        r.done = 0;
        r.pooled.clear();
        self.reqs.insert(id, r);
        self.running.retain(|&x| x != id);
        self.waiting.push_front(id);
    }

    /// Puts the computed whole pages of `r` into the cache. `keep`: `r` goes on running on
    /// the cache's pages (cache_unfinished_req); else its lock and private pages are released
    /// (cache_finished_req).
    fn cache(&mut self, r: &mut Req, keep: bool) {
        let ps = self.pool.page_size();
        let full = if self.cfg.radix_cache { r.done / ps } else { 0 };
        let old = r.node;
        if full > 0 {
            let toks = r.tokens(0..full * ps);
            let existing = self.tree.insert(&toks, &r.pages[..full]);
            if existing > r.tree_pages {
                self.pool.free(&r.pages[r.tree_pages..existing]);
            }
            if keep {
                let (pages, node) = self.tree.match_prefix(&toks);
                self.tree.lock(node);
                r.pages.splice(..full, pages);
                r.tree_pages = full;
                r.node = node;
            }
        }
        if keep {
            if full > 0 {
                self.tree.unlock(old);
            }
        } else {
            self.tree.unlock(old);
            self.pool.free(&r.pages[full.max(r.tree_pages)..]);
        }
    }

    /// Applies a finished step's samples; returns the events and the requests that ended.
    pub fn process(&mut self, plan: StepPlan, outs: Vec<SeqOut>) -> Vec<(ReqId, Event)> {
        let mut events = Vec::new();
        for (seq, out) in plan.seqs.into_iter().zip(outs) {
            let Some(mut r) = self.reqs.remove(&seq.req) else { continue };
            r.done += seq.tokens.len() + seq.prev as usize;
            if seq.extend {
                // cache_unfinished_req: the computed prefix is shared from now on.
                self.cache(&mut r, true);
            }
            self.reqs.insert(seq.req, r);
            let s = match out {
                SeqOut::Nothing => continue,
                SeqOut::Hidden(h) => {
                    self.pool_hidden(seq.req, &h, seq.hidden_rows.len(), &mut events);
                    continue;
                }
                SeqOut::Token(s) => s,
            };
            let r = self.reqs.get_mut(&seq.req).expect("known request");
            r.pending -= 1;
            let eos = !r.req.ignore_eos && self.cfg.eos_ids.contains(&s.token);
            if eos || r.req.stop_ids.contains(&s.token) {
                events.push((seq.req, self.finish(seq.req, FinishReason::Stop)));
                continue;
            }
            r.output.push(s.token);
            self.stats.generated_tokens += 1;
            events.push((seq.req, Event::Token { id: s.token, logprobs: s.logprobs }));
            if r.output.len() >= r.req.max_tokens {
                events.push((seq.req, self.finish(seq.req, FinishReason::Length)));
            }
        }
        events
    }

    /// Adds an embedding chunk's hidden states (`rows` of them) to request `id`'s pooling;
    /// when its whole prompt is computed, reports the embedding and ends the request.
    fn pool_hidden(&mut self, id: ReqId, hidden: &[f32], rows: usize, events: &mut Vec<(ReqId, Event)>) {
        let r = self.reqs.get_mut(&id).expect("known request");
        if let Some(width) = hidden.len().checked_div(rows) {
            match r.req.embed {
                Some(crate::Pooling::Mean) => {
                    r.pooled.resize(width, 0.0);
                    for row in hidden.chunks_exact(width) {
                        r.pooled.iter_mut().zip(row).for_each(|(p, x)| *p += x);
                    }
                }
                _ => r.pooled = hidden[hidden.len() - width..].to_vec(),
            }
        }
        if r.done < r.req.prompt.len() {
            return;
        }
        let embedding = crate::request::normalized(std::mem::take(&mut r.pooled));
        events.push((id, Event::Embedding(embedding)));
        events.push((id, self.finish(id, FinishReason::Stop)));
    }

    /// What the pool holds now.
    pub fn usage(&self) -> PoolUsage {
        let private = self.reqs.values().map(|r| r.pages.len() - r.tree_pages).sum();
        PoolUsage {
            total: self.pool.total(),
            free: self.pool.available(),
            evictable: self.tree.evictable_pages(),
            locked: self.tree.protected_pages(),
            private,
        }
    }

    /// The integrity check: every page is exactly one of free, cached or private to one
    /// request, and the cache's locks are exactly the running requests'.
    pub fn check(&self) -> Result<(), RuntimeError> {
        let u = self.usage();
        let fail = |what: String| {
            Err(RuntimeError::Invalid(format!(
                "KV pool integrity check failed: {what} ({} free + {} evictable + {} locked + {} private = {} of {} \
                 pages)",
                u.free,
                u.evictable,
                u.locked,
                u.private,
                u.free + u.evictable + u.locked + u.private,
                u.total
            )))
        };
        let mut seen = vec![false; u.total];
        let private = self.reqs.values().flat_map(|r| r.pages[r.tree_pages..].iter().copied());
        for p in self.pool.free_pages().iter().copied().chain(self.tree.pages()).chain(private) {
            match seen.get_mut(p as usize) {
                Some(s) if !*s => *s = true,
                Some(_) => return fail(format!("page {p} is held twice")),
                None => return fail(format!("page {p} is outside the pool")),
            }
        }
        if let Some(lost) = seen.iter().position(|s| !s) {
            return fail(format!("page {lost} is lost"));
        }
        let held: Vec<NodeId> = self.reqs.values().map(|r| r.node).filter(|&n| n != RadixCache::ROOT).collect();
        if let Err(e) = self.tree.check(&held) {
            return fail(e);
        }
        Ok(())
    }
}
