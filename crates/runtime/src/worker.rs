//! The worker: a thread that owns the backend and runs planned steps strictly in order,
//! feeding each sequence's placeholder token from the previous step's sample and sampling
//! with each request's own generator. Because it runs steps in order, the scheduler may plan
//! step N+1 while step N runs (overlap scheduling).

use crate::scheduler::{Sampled, StepPlan};
use crate::{Backend, ReqId, RequestSampler, RuntimeError, StepSeq};
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

enum Msg {
    Step(StepPlan),
    Release(ReqId),
}

/// A finished step: the plan back, its samples (one per sequence), and the time it took.
pub(crate) type StepDone = (StepPlan, Result<Vec<Option<Sampled>>, RuntimeError>, Duration);

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

#[derive(Default)]
struct State {
    samplers: HashMap<ReqId, RequestSampler>,
    last: HashMap<ReqId, u32>,
}

fn run(mut backend: Box<dyn Backend>, inbox: Receiver<Msg>, outbox: Sender<StepDone>) {
    let mut st = State::default();
    for msg in inbox {
        match msg {
            Msg::Release(id) => {
                st.samplers.remove(&id);
                st.last.remove(&id);
            }
            Msg::Step(plan) => {
                let t = Instant::now();
                let r = step(backend.as_mut(), &plan, &mut st);
                if outbox.send((plan, r, t.elapsed())).is_err() {
                    return;
                }
            }
        }
    }
}

fn step(backend: &mut dyn Backend, plan: &StepPlan, st: &mut State) -> Result<Vec<Option<Sampled>>, RuntimeError> {
    let mut tokens = Vec::with_capacity(plan.seqs.len());
    let mut rows = Vec::with_capacity(plan.seqs.len());
    for s in &plan.seqs {
        let mut t = s.tokens.clone();
        if s.prev {
            let p = st.last.get(&s.req).ok_or_else(|| {
                RuntimeError::Invalid(format!("request {} is fed a previous token it never sampled", s.req))
            })?;
            t.push(*p);
        }
        rows.push(if s.sample.is_some() { vec![t.len() - 1] } else { vec![] });
        tokens.push(t);
    }
    let steps: Vec<StepSeq> = plan
        .seqs
        .iter()
        .zip(&tokens)
        .zip(&rows)
        .map(|((s, t), r)| StepSeq { tokens: t, slots: &s.slots, rows: r })
        .collect();
    let greedy =
        plan.seqs.iter().all(|s| s.sample.as_ref().is_none_or(|r| r.logprobs.is_none() && r.sampling.is_greedy()));
    if greedy {
        if let Some(ids) = backend.forward_argmax(&steps)? {
            let mut ids = ids.into_iter();
            return Ok(plan
                .seqs
                .iter()
                .map(|s| {
                    s.sample.as_ref()?;
                    let token = ids.next().expect("one token per sampled sequence");
                    st.last.insert(s.req, token);
                    Some(Sampled { token, logprobs: None })
                })
                .collect());
        }
    }
    let logits = backend.forward(&steps)?;
    let vocab = backend.vocab();
    let mut rows = logits.chunks_exact(vocab);
    let mut out = Vec::with_capacity(plan.seqs.len());
    for s in &plan.seqs {
        let Some(req) = &s.sample else {
            out.push(None);
            continue;
        };
        let row = rows.next().expect("one logits row per sampled sequence");
        let sampler = match st.samplers.entry(s.req) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(RequestSampler::new(req.sampling.clone(), &req.prompt)?)
            }
        };
        let (token, logprobs) = sampler.next(row, req.logprobs);
        st.last.insert(s.req, token);
        out.push(Some(Sampled { token, logprobs }));
    }
    Ok(out)
}
