//! The worker: a thread that owns the backend and runs planned steps strictly in order,
//! feeding each sequence's placeholder token from the previous step's sample and sampling
//! with each request's own generator. Because it runs steps in order, the scheduler may plan
//! step N+1 while step N runs (overlap scheduling). On a pipelined backend
//! ([`Backend::pipelined`]) it also launches step N+1 before step N's tokens reach the host,
//! where no request of N+1 needs them there: the placeholders are then fed on the device
//! ([`Fed`]; docs/runtime.md, "Pipelined steps").

use crate::sampler::{Adjust, RowSampling};
use crate::scheduler::{Sampled, SeqOut, StepPlan};
use crate::{Backend, Constraint, Fed, ReqId, RequestSampler, RuntimeError, StepSeq};
use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

enum Msg {
    Step(StepPlan),
    Release(ReqId),
}

/// A finished step: the plan back, what each sequence produced, and the time it took.
pub(crate) type StepDone = (StepPlan, Result<Vec<SeqOut>, RuntimeError>, Duration);

pub(crate) struct Worker {
    tx: Option<Sender<Msg>>,
    rx: Receiver<StepDone>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    pub fn spawn(backend: Box<dyn Backend>) -> Worker {
        let (tx, inbox) = channel::<Msg>();
        let (outbox, rx) = channel();
        let thread = std::thread::Builder::new()
            .name("engine-worker".into())
            .spawn(move || run(backend, inbox, outbox))
            .expect("spawn the worker thread");
        Worker { tx: Some(tx), rx, thread: Some(thread) }
    }

    fn send(&self, m: Msg) -> Result<(), RuntimeError> {
        let tx = self.tx.as_ref().expect("worker running");
        tx.send(m).map_err(|_| RuntimeError::Unsupported("the worker thread has stopped".into()))
    }

    pub fn submit(&self, plan: StepPlan) -> Result<(), RuntimeError> {
        self.send(Msg::Step(plan))
    }

    /// Drops a finished request's sampler.
    pub fn release(&self, id: ReqId) {
        let _ = self.send(Msg::Release(id));
    }

    /// The oldest step not yet returned.
    pub fn wait(&self) -> Result<StepDone, RuntimeError> {
        self.rx.recv().map_err(|_| RuntimeError::Unsupported("the worker thread has stopped".into()))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The worker's state between messages.
#[derive(Default)]
struct State {
    samplers: HashMap<ReqId, RequestSampler>,
    /// Each request's last token on the host.
    last: HashMap<ReqId, u32>,
    /// Steps launched and not yet finished, oldest first (a pipelined backend; at most two).
    flight: VecDeque<Launched>,
    /// Releases waiting for the steps received before them to finish: (request, steps
    /// received by then).
    releases: Vec<(ReqId, u64)>,
    received: u64,
    finished: u64,
    /// When the last step finished (a step's time counts from there or its start, the later).
    last_done: Option<Instant>,
}

/// A step launched on a pipelined backend, its tokens not yet on the host.
struct Launched {
    plan: StepPlan,
    /// The requests of its sampled sequences, in logits-row order, and their constraints.
    sampled: Vec<ReqId>,
    constraints: Vec<Option<Constraint>>,
    start: Instant,
}

impl State {
    fn apply_releases(&mut self) {
        let finished = self.finished;
        let (samplers, last) = (&mut self.samplers, &mut self.last);
        self.releases.retain(|&(id, received)| {
            let due = finished >= received;
            if due {
                samplers.remove(&id);
                last.remove(&id);
            }
            !due
        });
    }

    /// A step started at `start` is done now: its time ([`step_time`]).
    fn done(&mut self, start: Instant) -> Duration {
        self.finished += 1;
        step_time(start, &mut self.last_done)
    }
}

/// The time of a step started at `start` and done now, counted from the later of its start and
/// `last_end`, the previous step's end (a pipelined step starts before the one before it ends,
/// and overlapping steps must not count twice); `last_end` becomes now.
pub(crate) fn step_time(start: Instant, last_end: &mut Option<Instant>) -> Duration {
    let now = Instant::now();
    let from = last_end.map_or(start, |e| e.max(start));
    *last_end = Some(now);
    now.saturating_duration_since(from)
}

enum Poll {
    Msg(Msg),
    Ready,
    Closed,
}

fn run(mut backend: Box<dyn Backend>, inbox: Receiver<Msg>, outbox: Sender<StepDone>) {
    let mut st = State::default();
    loop {
        let msg = if st.flight.is_empty() {
            match inbox.recv() {
                Ok(m) => m,
                Err(_) => return,
            }
        } else {
            match poll(backend.as_mut(), &inbox) {
                Poll::Msg(m) => m,
                Poll::Ready if finish_oldest(backend.as_mut(), &mut st, &outbox) => continue,
                Poll::Ready | Poll::Closed => return,
            }
        };
        match msg {
            Msg::Release(id) => {
                st.releases.push((id, st.received));
                st.apply_releases();
            }
            Msg::Step(plan) => {
                st.received += 1;
                if !take(backend.as_mut(), plan, &mut st, &outbox) {
                    return;
                }
            }
        }
    }
}

/// With a step in flight: the next message, or that the step's tokens are ready, whichever
/// comes first (the worker spins: a step is a millisecond or two of device time, and the next
/// plan should launch as soon as the engine sends it).
fn poll(backend: &mut dyn Backend, inbox: &Receiver<Msg>) -> Poll {
    loop {
        match inbox.try_recv() {
            Ok(m) => return Poll::Msg(m),
            Err(TryRecvError::Disconnected) => return Poll::Closed,
            Err(TryRecvError::Empty) => {}
        }
        if backend.sample_ready().unwrap_or(true) {
            return Poll::Ready;
        }
        std::hint::spin_loop();
    }
}

/// Finishes the oldest launched step and sends its result; false when the engine is gone.
fn finish_oldest(backend: &mut dyn Backend, st: &mut State, outbox: &Sender<StepDone>) -> bool {
    let Some(l) = st.flight.pop_front() else { return true };
    let r = backend.finish_sample().and_then(|ids| {
        if ids.len() != l.sampled.len() {
            return Err(RuntimeError::Invalid(format!(
                "the backend returned {} tokens for a step sampling {}",
                ids.len(),
                l.sampled.len()
            )));
        }
        let chosen = l.sampled.iter().zip(&l.constraints).zip(ids).map(|((req, c), token)| {
            if let Some(s) = st.samplers.get_mut(req) {
                s.record(token);
            }
            if let Some(c) = c {
                c.accept(token);
            }
            Sampled { token, logprobs: None }
        });
        let chosen = chosen.collect();
        Ok(outputs(&l.plan, chosen, st))
    });
    let elapsed = st.done(l.start);
    let sent = outbox.send((l.plan, r, elapsed)).is_ok();
    st.apply_releases();
    sent
}

fn finish_all(backend: &mut dyn Backend, st: &mut State, outbox: &Sender<StepDone>) -> bool {
    while !st.flight.is_empty() {
        if !finish_oldest(backend, st, outbox) {
            return false;
        }
    }
    true
}

/// Runs or launches a step the engine sent; false when the engine is gone.
fn take(backend: &mut dyn Backend, plan: StepPlan, st: &mut State, outbox: &Sender<StepDone>) -> bool {
    let start = Instant::now();
    // The forward pass launched ahead of the step in flight (its tokens fed on the device),
    // or the whole step after it.
    let ahead = backend.pipelined() && !plan.embed && all_on_device(&plan);
    if !ahead && !finish_all(backend, st, outbox) {
        return false;
    }
    let sampling = if plan.embed { None } else { Some(sampling(&plan, st)) };
    let r = match sampling {
        None => embed_step(backend, &plan),
        // Results go back in order: the step in flight's first.
        Some(Err(e)) => match finish_all(backend, st, outbox) {
            true => Err(e),
            false => return false,
        },
        Some(Ok(s)) if ahead => {
            let forward = Inputs::new(&plan, st).and_then(|inp| backend.launch_forward(&inp.steps(&plan), &inp.fed));
            // The step before finishes while this one's forward pass runs: the engine needs its
            // tokens to plan the next, and this step's adjustments and masks follow them.
            if !finish_all(backend, st, outbox) {
                return false;
            }
            match forward.and_then(|()| backend.launch_choice(&s.rows, &adjustments(&s, st), &s.constraints)) {
                Ok(()) => {
                    let (sampled, constraints) = (s.sampled, s.constraints);
                    st.flight.push_back(Launched { plan, sampled, constraints, start });
                    return true;
                }
                Err(e) => Err(e),
            }
        }
        Some(Ok(s)) => step(backend, &plan, &s, st),
    };
    let elapsed = st.done(start);
    let sent = outbox.send((plan, r, elapsed)).is_ok();
    st.apply_releases();
    sent
}

/// A step's sampled sequences: one draw each (whichever side then chooses the token) and their
/// constraints.
struct Sampling {
    rows: Vec<RowSampling>,
    constraints: Vec<Option<Constraint>>,
    /// The requests, in logits-row order.
    sampled: Vec<ReqId>,
}

/// Whether every token of `plan` is chosen on the device (no request asks for logprobs, whose
/// logits the host reads): only then may its forward pass launch before the step in flight
/// finishes.
fn all_on_device(plan: &StepPlan) -> bool {
    plan.seqs.iter().filter_map(|q| q.sample.as_ref()).all(|r| r.logprobs.is_none())
}

/// This step's changes to each sampled row's logits (penalties, `logit_bias`, `min_tokens`'
/// bans), as the tokens recorded so far make them: made once the step before has finished.
fn adjustments(s: &Sampling, st: &State) -> Vec<Vec<Adjust>> {
    s.sampled.iter().map(|r| st.samplers.get(r).map_or_else(Vec::new, RequestSampler::adjustments)).collect()
}

fn sampling(plan: &StepPlan, st: &mut State) -> Result<Sampling, RuntimeError> {
    let mut s = Sampling { rows: vec![], constraints: vec![], sampled: vec![] };
    for q in &plan.seqs {
        let Some(req) = &q.sample else { continue };
        let sampler = match st.samplers.entry(q.req) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(RequestSampler::new(req.sampling.clone(), &req.prompt)?),
        };
        s.constraints.push(req.constraint.clone());
        s.rows.push(sampler.row());
        s.sampled.push(q.req);
    }
    Ok(s)
}

/// A step's tokens and logits rows per sequence, and those fed on the device from the step in
/// flight (a request it samples whose token this step feeds).
struct Inputs {
    tokens: Vec<Vec<u32>>,
    rows: Vec<Vec<usize>>,
    fed: Vec<Fed>,
}

impl Inputs {
    fn new(plan: &StepPlan, st: &State) -> Result<Inputs, RuntimeError> {
        let in_flight: HashMap<ReqId, usize> =
            st.flight.back().map(|l| l.sampled.iter().enumerate().map(|(i, &r)| (r, i)).collect()).unwrap_or_default();
        let mut inp = Inputs { tokens: vec![], rows: vec![], fed: vec![] };
        let mut at = 0;
        for s in &plan.seqs {
            let mut t = s.tokens.clone();
            if s.prev {
                if let Some(&row) = in_flight.get(&s.req) {
                    inp.fed.push(Fed { token: at + t.len(), row });
                    t.push(0);
                } else {
                    let p = st.last.get(&s.req).ok_or_else(|| {
                        RuntimeError::Invalid(format!("request {} is fed a previous token it never sampled", s.req))
                    })?;
                    t.push(*p);
                }
            }
            at += t.len();
            inp.rows.push(if s.sample.is_some() { vec![t.len() - 1] } else { vec![] });
            inp.tokens.push(t);
        }
        Ok(inp)
    }

    fn steps<'a>(&'a self, plan: &'a StepPlan) -> Vec<StepSeq<'a>> {
        let seqs = plan.seqs.iter().zip(&self.tokens).zip(&self.rows);
        seqs.map(|((s, t), r)| StepSeq { tokens: t, slots: &s.slots, rows: r }).collect()
    }
}

/// Each sequence's output, a sampled one's token in turn from `chosen` (kept as the request's
/// last token).
fn outputs(plan: &StepPlan, chosen: Vec<Sampled>, st: &mut State) -> Vec<SeqOut> {
    let mut chosen = chosen.into_iter();
    let mut out = Vec::with_capacity(plan.seqs.len());
    for s in &plan.seqs {
        let sampled = s.sample.as_ref().and_then(|_| chosen.next());
        out.push(match sampled {
            Some(c) => {
                st.last.insert(s.req, c.token);
                SeqOut::Token(c)
            }
            None => SeqOut::Nothing,
        });
    }
    out
}

/// Runs a step to its tokens (nothing in flight).
fn step(backend: &mut dyn Backend, plan: &StepPlan, s: &Sampling, st: &mut State) -> Result<Vec<SeqOut>, RuntimeError> {
    let inp = Inputs::new(plan, st)?;
    let steps = inp.steps(plan);
    let adjust = adjustments(s, st);
    let mut chosen = Vec::with_capacity(s.rows.len());
    if all_on_device(plan) {
        let ids = backend.forward_sample(&steps, &s.rows, &adjust, &s.constraints)?;
        for ((req, c), token) in s.sampled.iter().zip(&s.constraints).zip(ids) {
            st.samplers.get_mut(req).expect("sampler made by `sampling`").record(token);
            if let Some(c) = c {
                c.accept(token);
            }
            chosen.push(Sampled { token, logprobs: None });
        }
    } else {
        let logits = backend.forward(&steps)?;
        let sampled = plan.seqs.iter().filter_map(|q| Some((q.req, q.sample.as_ref()?)));
        let rows = s.rows.iter().zip(&adjust);
        for (((req, r), logits), (row, adjust)) in sampled.zip(logits.chunks_exact(backend.vocab())).zip(rows) {
            let sampler = st.samplers.get_mut(&req).expect("sampler made by `sampling`");
            let (token, logprobs) = match &r.constraint {
                Some(c) => {
                    let mut masked = logits.to_vec();
                    c.mask(&mut masked);
                    let chosen = sampler.choose(&masked, row, adjust, r.logprobs);
                    c.accept(chosen.0);
                    chosen
                }
                None => sampler.choose(logits, row, adjust, r.logprobs),
            };
            chosen.push(Sampled { token, logprobs });
        }
    }
    Ok(outputs(plan, chosen, st))
}

/// A step of embedding chunks: the final hidden states of each sequence's `hidden_rows`.
fn embed_step(backend: &mut dyn Backend, plan: &StepPlan) -> Result<Vec<SeqOut>, RuntimeError> {
    let steps: Vec<StepSeq> =
        plan.seqs.iter().map(|s| StepSeq { tokens: &s.tokens, slots: &s.slots, rows: &s.hidden_rows }).collect();
    let hidden = backend.forward_hidden(&steps)?;
    let width = backend.hidden_size();
    let mut rest = hidden.as_slice();
    let mut out = Vec::with_capacity(plan.seqs.len());
    for s in &plan.seqs {
        let n = s.hidden_rows.len() * width;
        if rest.len() < n {
            return Err(RuntimeError::Invalid(format!(
                "the backend returned {} hidden floats for a step wanting more",
                hidden.len()
            )));
        }
        let (mine, tail) = rest.split_at(n);
        rest = tail;
        out.push(SeqOut::Hidden(mine.to_vec()));
    }
    Ok(out)
}
