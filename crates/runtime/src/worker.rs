//! The worker: a thread that owns the backend and runs planned steps strictly in order,
//! feeding each sequence's placeholder token from the previous step's sample and sampling
//! with each request's own generator. Because it runs steps in order, the scheduler may plan
//! step N+1 while step N runs (overlap scheduling).

use crate::scheduler::{Sampled, SeqOut, StepPlan};
use crate::{Backend, ReqId, RequestSampler, RuntimeError, StepSeq};
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
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

fn step(backend: &mut dyn Backend, plan: &StepPlan, st: &mut State) -> Result<Vec<SeqOut>, RuntimeError> {
    if plan.embed {
        return embed_step(backend, plan);
    }
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
    // One draw per sampled sequence and step, whichever side then chooses the token.
    let (mut rows, mut adjust, mut constraints) = (Vec::new(), Vec::new(), Vec::new());
    let mut on_device = true;
    for s in &plan.seqs {
        let Some(req) = &s.sample else { continue };
        let sampler = match st.samplers.entry(s.req) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(RequestSampler::new(req.sampling.clone(), &req.prompt)?)
            }
        };
        on_device &= req.logprobs.is_none();
        constraints.push(req.constraint.clone());
        adjust.push(sampler.adjustments());
        rows.push(sampler.row());
    }
    let mut chosen = Vec::with_capacity(rows.len());
    if on_device {
        let ids = backend.forward_sample(&steps, &rows, &adjust, &constraints)?;
        for (s, token) in plan.seqs.iter().filter(|s| s.sample.is_some()).zip(ids) {
            st.samplers.get_mut(&s.req).expect("sampler made above").record(token);
            if let Some(c) = s.sample.as_ref().and_then(|r| r.constraint.as_ref()) {
                c.accept(token);
            }
            chosen.push(Sampled { token, logprobs: None });
        }
    } else {
        let logits = backend.forward(&steps)?;
        let sampled = plan.seqs.iter().filter_map(|s| Some((s.req, s.sample.as_ref()?)));
        let rows = rows.iter().zip(&adjust);
        for (((req, r), logits), (row, adjust)) in sampled.zip(logits.chunks_exact(backend.vocab())).zip(rows) {
            let sampler = st.samplers.get_mut(&req).expect("sampler made above");
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
    Ok(out)
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
