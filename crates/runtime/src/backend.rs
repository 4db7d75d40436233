//! The backend interface and the reference backend.
//!
//! A backend owns the weights and the KV pool: per layer, K and V rows for `kv_slots()` token
//! slots. It does not decide which slot belongs to which sequence: every step names, for each
//! sequence, the slot of every position (SGLang's `req_to_token` row), so the page allocator
//! and the radix cache ([`crate::PagePool`], [`crate::RadixCache`]) stay on the host, shared
//! by every backend.

use crate::constraint::{apply, masks};
use crate::sampler::{adjusted, pick, Adjust, RowSampling};
use crate::Constraint;
use crate::RuntimeError;
use bundle::Bundle;
use ir::{Interpreter, IrError, KvStore, Plan};
use std::str::FromStr;

/// Where a plan runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The reference interpreter (f32, slow, the oracle).
    Ref,
    /// The Cranelift JIT backend.
    Cpu,
    /// The CUDA backend.
    Cuda,
    /// CUDA when a GPU is usable and the bundle runs there (one rank, kernels it has), else
    /// the CPU.
    Auto,
}

impl FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ref" => Ok(Device::Ref),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            "auto" => Ok(Device::Auto),
            other => Err(format!("unknown device `{other}` (expected auto, ref, cpu or cuda)")),
        }
    }
}

/// One sequence's part of a step: its new tokens, the KV slot of every position up to and
/// including them, and the rows (indices into `tokens`) whose logits are wanted.
#[derive(Debug, Clone, Copy)]
pub struct StepSeq<'a> {
    /// The new tokens, at positions `slots.len() - tokens.len()..`.
    pub tokens: &'a [u32],
    /// KV slot of each position `0..slots.len()`; the last `tokens.len()` are written.
    pub slots: &'a [u32],
    /// Rows of `tokens` whose logits are returned.
    pub rows: &'a [usize],
}

impl StepSeq<'_> {
    /// Positions cached before this step.
    pub fn start(&self) -> usize {
        self.slots.len() - self.tokens.len()
    }
}

/// A token of a pipelined step fed from the step before ([`Backend::launch_forward`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fed {
    /// The token's index in the step, counting the sequences' tokens one after another.
    pub token: usize,
    /// The logits row of the step before whose chosen token it is.
    pub row: usize,
}

/// A loaded model that runs forward steps over a KV pool of token slots.
pub trait Backend: Send {
    /// Vocabulary size (columns of the logits).
    fn vocab(&self) -> usize;
    /// Bytes of KV one token slot takes (all layers, K and V).
    fn kv_slot_bytes(&self) -> usize;
    /// Token slots in the KV pool.
    fn kv_slots(&self) -> usize;
    /// (Re)allocates the KV pool with `slots` token slots; earlier contents are lost.
    fn alloc_kv(&mut self, slots: usize) -> Result<(), RuntimeError>;
    /// Runs one step over several sequences (all their tokens through each weight once) and
    /// returns the logits of every sequence's rows, sequence after sequence.
    fn forward(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError>;
    /// Like `forward`, but returns the final hidden state (the `logits` op's input, after the
    /// final norm) of every sequence's rows, [`Backend::hidden_size`] floats a row: what an
    /// embedding pools.
    fn forward_hidden(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        let _ = batch;
        Err(RuntimeError::Unsupported("this backend does not return hidden states (embeddings)".into()))
    }
    /// Features of the final hidden state.
    fn hidden_size(&self) -> usize;
    /// Like `forward`, but returns each logits row's token, chosen by `rows` (one per logits
    /// row, see [`crate::sampler::pick`]) after each row's `adjust` (one list per row, or none
    /// at all: [`crate::sampler::Adjust`]) and the mask of its constraint (one entry per row,
    /// or none at all: [`crate::constraint::masks`]); a backend with a device overrides this to
    /// choose there and copy back only the tokens, computing the masks while the device runs
    /// the forward pass.
    fn forward_sample(
        &mut self,
        batch: &[StepSeq],
        rows: &[RowSampling],
        adjust: &[Vec<Adjust>],
        constraints: &[Option<Constraint>],
    ) -> Result<Vec<u32>, RuntimeError> {
        let logits = self.forward(batch)?;
        Ok(choose_rows(&logits, self.vocab(), rows, adjust, constraints))
    }
    /// Whether this backend launches a step without waiting for its tokens
    /// ([`Backend::launch_forward`], [`Backend::launch_choice`]), so that the worker can launch
    /// the next step before they reach the host (SGLang's overlap of "future" token ids): the
    /// next step's tokens that are this one's samples are then fed on the device.
    fn pipelined(&self) -> bool {
        false
    }
    /// The forward pass of `forward_sample`, returning once it is launched; the choice follows
    /// with [`Backend::launch_choice`] and the tokens come from [`Backend::finish_sample`],
    /// steps finishing in launch order. Each [`Fed`] names a token of `batch` (whose value there
    /// is ignored) that is the token chosen for a row of the step launched before this one,
    /// not yet finished. Only for a [`Backend::pipelined`] backend.
    fn launch_forward(&mut self, batch: &[StepSeq], fed: &[Fed]) -> Result<(), RuntimeError> {
        let _ = (batch, fed);
        Err(RuntimeError::Unsupported("this backend does not launch steps ahead of their tokens".into()))
    }
    /// The choice of `forward_sample` for the step last launched by `launch_forward`, returning
    /// once it is launched (the adjustments and constraints as they are after the step before
    /// finished: the worker calls this after finishing it).
    fn launch_choice(
        &mut self,
        rows: &[RowSampling],
        adjust: &[Vec<Adjust>],
        constraints: &[Option<Constraint>],
    ) -> Result<(), RuntimeError> {
        let _ = (rows, adjust, constraints);
        Err(RuntimeError::Unsupported("this backend does not launch steps ahead of their tokens".into()))
    }
    /// Whether the oldest launched step's tokens are on the host (`finish_sample` would not wait).
    fn sample_ready(&mut self) -> Result<bool, RuntimeError> {
        Ok(true)
    }
    /// The tokens of the oldest launched step not yet finished, waiting for them.
    fn finish_sample(&mut self) -> Result<Vec<u32>, RuntimeError> {
        Err(RuntimeError::Unsupported("no step was launched ahead of its tokens".into()))
    }
    /// Chooses again, on the device, from the logits of the last step (one entry of `rows` and
    /// of `adjust` per logits row, as for `forward_sample`), for checking the device's choice
    /// against [`pick`]; `None`: the backend chooses on the host.
    fn resample(&mut self, rows: &[RowSampling], adjust: &[Vec<Adjust>]) -> Result<Option<Vec<u32>>, RuntimeError> {
        let _ = (rows, adjust);
        Ok(None)
    }
    /// Free memory of the backend's device in bytes, when it is not the host's (the KV pool
    /// is then sized from it).
    fn free_memory(&self) -> Option<usize> {
        None
    }
    /// The device's measured copy bandwidth (bytes read + written per second), for backends
    /// whose memory is not the host's (`cuda::probe::copy`); `None`: the host's (see `bench::copy_bandwidth`).
    fn copy_bandwidth(&mut self) -> Option<f64> {
        None
    }
    /// The device's measured dense matmul rate (FLOP/s) in the program's 16-bit type, for
    /// backends that measure one (`cuda::probe::matmul`); `None`: not measured.
    fn matmul_rate(&mut self) -> Option<f64> {
        None
    }
}

/// The token of each row of `logits` (`vocab` a row) by `forward_sample`'s rule: each row's
/// `adjust` (one list per row, or none at all) and the mask of its constraint, then [`pick`].
pub fn choose_rows(
    logits: &[f32],
    vocab: usize,
    rows: &[RowSampling],
    adjust: &[Vec<Adjust>],
    constraints: &[Option<Constraint>],
) -> Vec<u32> {
    let masks = masks(constraints);
    let rows = logits.chunks_exact(vocab).zip(rows).enumerate();
    rows.map(|(i, (l, r))| {
        let a = adjust.get(i).filter(|a| !a.is_empty());
        match masks.get(i).and_then(Option::as_ref) {
            Some(m) => {
                let mut l = a.map_or_else(|| l.to_vec(), |a| adjusted(l, a));
                apply(m, &mut l);
                pick(&l, r)
            }
            None => a.map_or_else(|| pick(l, r), |a| pick(&adjusted(l, a), r)),
        }
    })
    .collect()
}

/// Checks a step against the plan and the pool: token ids and rows (as
/// [`Plan::check_step`]), non-empty sequences, slots inside the pool, and no slot written
/// twice in the step.
pub fn check_batch(plan: &Plan, batch: &[StepSeq], kv_slots: usize) -> Result<(), RuntimeError> {
    let mut written = std::collections::HashSet::new();
    for (i, s) in batch.iter().enumerate() {
        plan.check_step(s.tokens, s.rows)?;
        if s.tokens.is_empty() || s.slots.len() < s.tokens.len() {
            return Err(RuntimeError::Invalid(format!(
                "sequence {i} of the step has {} tokens and {} slots (need at least one token and a slot for each)",
                s.tokens.len(),
                s.slots.len()
            )));
        }
        if let Some(bad) = s.slots.iter().find(|&&x| x as usize >= kv_slots) {
            return Err(RuntimeError::Invalid(format!(
                "sequence {i} of the step names KV slot {bad}, outside the pool of {kv_slots}"
            )));
        }
        if let Some(dup) = s.slots[s.start()..].iter().find(|&&x| !written.insert(x)) {
            return Err(RuntimeError::Invalid(format!("KV slot {dup} is written twice in one step")));
        }
    }
    Ok(())
}

/// Per layer, K and V of every token slot, `row` floats each: the host-memory pool of the
/// reference and CPU backends.
pub(crate) struct HostKv {
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    pub row: usize,
    pub slots: usize,
}

impl HostKv {
    pub fn new(plan: &Plan) -> HostKv {
        HostKv {
            k: vec![Vec::new(); plan.kv.layers],
            v: vec![Vec::new(); plan.kv.layers],
            row: plan.kv.row(),
            slots: 0,
        }
    }

    pub fn alloc(&mut self, slots: usize) -> Result<(), RuntimeError> {
        let floats = slots
            .checked_mul(self.row)
            .filter(|f| f.checked_mul(4).is_some())
            .ok_or_else(|| RuntimeError::Invalid(format!("a KV pool of {slots} slots does not fit in memory")))?;
        for l in self.k.iter_mut().chain(self.v.iter_mut()) {
            *l = Vec::new();
            // Probe first so that a pool too big is an error, not an abort; then take zeroed
            // memory, which the OS commits page by page as the pool fills.
            Vec::<f32>::new().try_reserve_exact(floats).map_err(|_| {
                RuntimeError::Invalid(format!("out of memory allocating a KV pool of {slots} token slots"))
            })?;
            *l = vec![0.0; floats];
        }
        self.slots = slots;
        Ok(())
    }

    pub fn slot_bytes(&self) -> usize {
        2 * self.k.len() * self.row * 4
    }
}

/// One sequence's view of a [`HostKv`] as the interpreter's [`KvStore`].
struct PagedView<'a> {
    kv: &'a mut HostKv,
    slots: &'a [u32],
    start: usize,
}

impl KvStore for PagedView<'_> {
    fn start(&self) -> usize {
        self.start
    }

    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(Vec<f32>, Vec<f32>), IrError> {
        let row = self.kv.row;
        for (i, &slot) in self.slots[self.start..].iter().enumerate() {
            let at = slot as usize * row;
            self.kv.k[layer][at..at + row].copy_from_slice(&k[i * row..(i + 1) * row]);
            self.kv.v[layer][at..at + row].copy_from_slice(&v[i * row..(i + 1) * row]);
        }
        let gather = |pool: &[f32]| -> Vec<f32> {
            self.slots.iter().flat_map(|&s| pool[s as usize * row..(s as usize + 1) * row].iter().copied()).collect()
        };
        Ok((gather(&self.kv.k[layer]), gather(&self.kv.v[layer])))
    }

    fn commit(&mut self, _n: usize) {}
}

/// The reference interpreter as a backend.
pub struct RefBackend {
    interp: Interpreter,
    kv: HostKv,
}

impl RefBackend {
    /// Loads rank 0's weights of `bundle` as f32.
    pub fn new(bundle: &Bundle) -> Result<RefBackend, RuntimeError> {
        let weights = bundle.weights(0)?;
        let interp = Interpreter::new(bundle.plan.clone(), |name, shape, dtype| {
            weights.f32(name, shape, dtype).map_err(|e| e.to_string())
        })?;
        let kv = HostKv::new(interp.plan());
        Ok(RefBackend { interp, kv })
    }
}

impl Backend for RefBackend {
    fn vocab(&self) -> usize {
        self.interp.plan().vocab
    }

    fn kv_slot_bytes(&self) -> usize {
        self.kv.slot_bytes()
    }

    fn kv_slots(&self) -> usize {
        self.kv.slots
    }

    fn alloc_kv(&mut self, slots: usize) -> Result<(), RuntimeError> {
        self.kv.alloc(slots)
    }

    fn forward(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        self.run(batch, false)
    }

    fn forward_hidden(&mut self, batch: &[StepSeq]) -> Result<Vec<f32>, RuntimeError> {
        self.run(batch, true)
    }

    fn hidden_size(&self) -> usize {
        self.interp.plan().hidden_size()
    }
}

impl RefBackend {
    /// One sequence after another through the interpreter: logits, or the final hidden state.
    fn run(&mut self, batch: &[StepSeq], hidden: bool) -> Result<Vec<f32>, RuntimeError> {
        check_batch(self.interp.plan(), batch, self.kv.slots)?;
        let mut out = Vec::new();
        for s in batch {
            let mut view = PagedView { kv: &mut self.kv, slots: s.slots, start: s.start() };
            out.extend(if hidden {
                self.interp.forward_hidden(&mut view, s.tokens, s.rows)?
            } else {
                self.interp.forward(&mut view, s.tokens, s.rows)?
            });
        }
        Ok(out)
    }
}

/// Loads `bundle` onto `device`; on CUDA, rank `i` on GPU `gpus[i]` (`--devices`; empty:
/// GPUs `0..tp`).
pub fn load(bundle: &Bundle, device: Device, gpus: &[usize]) -> Result<Box<dyn Backend>, RuntimeError> {
    match device {
        Device::Ref => Ok(Box::new(RefBackend::new(bundle)?)),
        Device::Cpu if bundle.plan.tp > 1 => Ok(Box::new(crate::TpCpuBackend::new(bundle)?)),
        Device::Cpu => Ok(Box::new(crate::CpuBackend::new(bundle)?)),
        Device::Cuda => crate::cuda::tp::load(bundle, gpus),
        Device::Auto => load(bundle, resolve(bundle, Device::Auto, gpus), gpus),
    }
}

/// The device `Auto` means for `bundle` here (other devices are themselves): CUDA when there
/// is a usable GPU for every rank and the bundle runs on them, else the CPU (saying why on
/// stderr when a GPU is there).
pub fn resolve(bundle: &Bundle, device: Device, gpus: &[usize]) -> Device {
    if device != Device::Auto {
        return device;
    }
    match crate::cuda::usable(bundle, gpus) {
        Ok(()) => Device::Cuda,
        Err(why) => {
            if crate::cuda::gpu_present() {
                eprintln!("running on the CPU: {why}");
            }
            Device::Cpu
        }
    }
}
