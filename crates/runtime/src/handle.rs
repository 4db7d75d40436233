//! The engine on its own thread, driven through a handle: the streaming form of the API that
//! the HTTP server uses. Requests come in with a [`Sink`] that receives their events; the
//! thread steps the engine while anything is queued or running and sleeps otherwise.

use crate::{Engine, Event, PoolUsage, ReqId, Request, RuntimeError, SchedStats};
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Where a request's events go (called on the engine thread; keep it quick).
pub type Sink = Box<dyn FnMut(Event) + Send>;

/// The engine's state as last published by its thread.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Snapshot {
    /// Requests waiting for admission.
    pub queued: usize,
    /// Requests running.
    pub running: usize,
    /// KV pool pages by state.
    pub pool: Option<PoolUsage>,
    /// Counters since start.
    pub stats: SchedStats,
    /// Steps that failed (the engine aborted every request then), including failed
    /// integrity checks.
    pub step_errors: usize,
}

enum Cmd {
    Submit(Box<Request>, Sink, Sender<Result<ReqId, RuntimeError>>),
    Abort(ReqId),
    AbortAll,
}

/// A handle to an engine running on its own thread. Dropping it aborts what is left and
/// stops the thread.
pub struct EngineHandle {
    tx: Option<Sender<Cmd>>,
    snapshot: Arc<Mutex<Snapshot>>,
    thread: Option<JoinHandle<()>>,
}

impl EngineHandle {
    /// Moves `engine` to a new thread.
    pub fn spawn(engine: Engine) -> EngineHandle {
        let (tx, rx) = channel();
        let snapshot = Arc::new(Mutex::new(Snapshot::default()));
        let snap = snapshot.clone();
        let thread = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || serve(engine, rx, snap))
            .expect("spawn the engine thread");
        EngineHandle { tx: Some(tx), snapshot, thread: Some(thread) }
    }

    fn send(&self, c: Cmd) -> Result<(), RuntimeError> {
        let tx = self.tx.as_ref().expect("engine running");
        tx.send(c).map_err(|_| RuntimeError::Unsupported("the engine thread has stopped".into()))
    }

    /// Queues `req`; its events go to `sink`. Fails (and `sink` is dropped) if the request is
    /// invalid.
    pub fn submit(&self, req: Request, sink: Sink) -> Result<ReqId, RuntimeError> {
        let (tx, rx) = channel();
        self.send(Cmd::Submit(Box::new(req), sink, tx))?;
        rx.recv().map_err(|_| RuntimeError::Unsupported("the engine thread has stopped".into()))?
    }

    /// Aborts a request (its sink gets a `Finished` event with reason `Abort`).
    pub fn abort(&self, id: ReqId) {
        let _ = self.send(Cmd::Abort(id));
    }

    /// Aborts every request (each sink gets a `Finished` event with reason `Abort`); the
    /// engine keeps serving new ones.
    pub fn abort_all(&self) {
        let _ = self.send(Cmd::AbortAll);
    }

    /// The engine's state.
    pub fn snapshot(&self) -> Snapshot {
        *self.snapshot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Aborts every request and waits for the thread to end.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Aborts every request that has a sink, telling each.
fn abort_all(engine: &mut Engine, sinks: &mut HashMap<ReqId, Sink>) {
    for (id, mut s) in sinks.drain() {
        if let Some(e) = engine.abort(id) {
            s(e);
        }
    }
}

fn serve(mut engine: Engine, rx: Receiver<Cmd>, snapshot: Arc<Mutex<Snapshot>>) {
    let mut sinks: HashMap<ReqId, Sink> = HashMap::new();
    let mut open = true;
    let mut step_errors = 0;
    while open || !engine.is_idle() {
        // Block for work only when there is nothing to step; then take every command queued.
        // Only a read that finds the channel empty or disconnected ends the intake: a command
        // is never read by anything but this loop.
        let mut next =
            if engine.is_idle() && open { rx.recv().map_err(|_| TryRecvError::Disconnected) } else { rx.try_recv() };
        loop {
            match next {
                Ok(Cmd::Submit(req, sink, reply)) => {
                    let r = engine.submit(*req);
                    if let Ok(id) = r {
                        sinks.insert(id, sink);
                    }
                    let _ = reply.send(r);
                }
                Ok(Cmd::Abort(id)) => {
                    if let (Some(e), Some(mut s)) = (engine.abort(id), sinks.remove(&id)) {
                        s(e);
                    }
                }
                Ok(Cmd::AbortAll) => abort_all(&mut engine, &mut sinks),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    if open {
                        // The handle is gone: abort what is left.
                        open = false;
                        abort_all(&mut engine, &mut sinks);
                    }
                    break;
                }
            }
            next = rx.try_recv();
        }
        if !engine.is_idle() {
            match engine.step() {
                Ok(events) => {
                    for (id, e) in events {
                        let last = matches!(e, Event::Finished(_));
                        if let Some(s) = sinks.get_mut(&id) {
                            s(e);
                        }
                        if last {
                            sinks.remove(&id);
                        }
                    }
                }
                Err(err) => {
                    step_errors += 1;
                    eprintln!("engine: step failed: {err}; aborting every request");
                    for (id, mut s) in sinks.drain() {
                        if let Some(e) = engine.abort(id) {
                            s(e);
                        }
                    }
                }
            }
        }
        *snapshot.lock().unwrap_or_else(|e| e.into_inner()) = Snapshot {
            queued: engine.queue_len(),
            running: engine.running_len(),
            pool: Some(engine.usage()),
            stats: engine.stats(),
            step_errors,
        };
    }
}
