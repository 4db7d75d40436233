//! Pinned host memory for a step's inputs, sampling parameters, logit adjustments and
//! constraint masks, and its chosen tokens. A copy from pageable memory makes the driver wait for the stream first, and a
//! copy into it returns only when done; from and into pinned memory both are queued on the
//! stream, so the host can pack and launch the next step while the GPU runs this one
//! (pipelined steps, `Backend::launch_forward`). Two buffers of each kind, taken in turn: a
//! step's buffer is written again only two steps later, after its event says the copy is done.
//! The inputs and the tokens go on streams of their own, ordered with the step's stream by
//! events, so the step's stream runs kernels only.

use super::driver;
use crate::RuntimeError;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{result, CudaEvent, CudaStream, PinnedHostSlice};
use std::collections::VecDeque;
use std::sync::Arc;

/// A pinned buffer and the event recorded after the last copy from or into it.
struct HostBuf {
    buf: PinnedHostSlice<i32>,
    copied: CudaEvent,
}

impl HostBuf {
    /// At least `len` values; write-combined for a buffer the host only writes.
    fn new(stream: &Arc<CudaStream>, len: usize, write_only: bool) -> Result<HostBuf, RuntimeError> {
        let ctx = stream.context();
        let flags = if write_only { cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED } else { 0 };
        let len = len.max(1024).next_power_of_two();
        // Safety: the memory is written before every read (`upload`, `download`).
        let buf = unsafe { ctx.alloc_pinned_with_flags::<i32>(len, flags) }.map_err(driver("pinned host memory"))?;
        let copied = ctx.new_event(None).map_err(driver("creating an event"))?;
        Ok(HostBuf { buf, copied })
    }

    /// Waits (spinning) until the last copy from or into the buffer is done.
    fn wait(&self) -> Result<(), RuntimeError> {
        while !self.copied.try_is_complete().map_err(driver("running a step"))? {
            std::hint::spin_loop();
        }
        Ok(())
    }
}

/// Two pinned buffers taken in turn.
#[derive(Default)]
struct Ring {
    bufs: [Option<HostBuf>; 2],
    next: usize,
}

impl Ring {
    /// The next buffer, with room for `len` values (a new one when too small), once its last
    /// copy is done; and its index.
    fn take(
        &mut self,
        stream: &Arc<CudaStream>,
        len: usize,
        write_only: bool,
    ) -> Result<(usize, &mut HostBuf), RuntimeError> {
        let i = self.next;
        self.next ^= 1;
        if let Some(b) = &self.bufs[i] {
            b.wait()?;
        }
        if self.bufs[i].as_ref().is_none_or(|b| b.buf.len() < len) {
            self.bufs[i] = Some(HostBuf::new(stream, len, write_only)?);
        }
        Ok((i, self.bufs[i].as_mut().expect("made above")))
    }

    /// Queues the copy of `host` (4-byte values) to device memory at `dst` (room for
    /// `host.len()` values) on `stream`.
    fn upload<W: Word>(
        &mut self,
        stream: &Arc<CudaStream>,
        host: &[W],
        dst: CUdeviceptr,
    ) -> Result<&CudaEvent, RuntimeError> {
        let (_, b) = self.take(stream, host.len(), true)?;
        let pinned = &mut b.buf.as_mut_slice().map_err(driver("pinned host memory"))?[..host.len()];
        for (p, h) in pinned.iter_mut().zip(host) {
            *p = h.bits();
        }
        // Safety: `dst` holds `host.len()` values (the caller's); the pinned source stays
        // untouched until `copied` completes (`take` waits for it).
        unsafe { result::memcpy_htod_async(dst, pinned, stream.cu_stream()) }.map_err(driver("copying to the GPU"))?;
        b.copied.record(stream).map_err(driver("recording an event"))?;
        Ok(&b.copied)
    }
}

/// A stream beside the step's for one direction of copies, and an event recorded on the
/// step's stream that its next copy waits for.
struct Side {
    stream: Arc<CudaStream>,
    after: CudaEvent,
}

impl Side {
    fn new(main: &Arc<CudaStream>) -> Result<Side, RuntimeError> {
        let ctx = main.context();
        let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        let after = ctx.new_event(None).map_err(driver("creating an event"))?;
        Ok(Side { stream, after })
    }
}

impl Drop for Side {
    /// The pinned buffers are freed after the copies still queued here.
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
    }
}

/// A 4-byte value as the bits a pinned buffer holds.
pub(super) trait Word: Copy {
    fn bits(self) -> i32;
}
impl Word for i32 {
    fn bits(self) -> i32 {
        self
    }
}
impl Word for u32 {
    fn bits(self) -> i32 {
        self as i32
    }
}
impl Word for f32 {
    fn bits(self) -> i32 {
        self.to_bits() as i32
    }
}

/// What a step uploads, each through pinned buffers of its own.
#[derive(Clone, Copy)]
pub(super) enum Upload {
    /// The packed inputs (`Packed`).
    Inputs,
    /// The sampling parameters.
    Params,
    /// The logit adjustments.
    Adjust,
    /// The constraint masks.
    Masks,
}

/// The pinned buffers of one backend, and the steps whose tokens are on their way back.
#[derive(Default)]
pub(super) struct Staging {
    /// The streams the inputs are copied to the device on (after the step before read them,
    /// [`Staging::inputs_read`]) and the tokens back (after they were chosen), so that neither
    /// copy waits on the step's stream for the other, nor the next step for them: the next
    /// step's inputs are copied while this step's tokens are chosen, its tokens go back while
    /// the next step runs. Dropped first (fields drop in order): their copies end before the
    /// pinned buffers below are freed.
    up: Option<Side>,
    down: Option<Side>,
    /// One ring per kind of [`Upload`], in its order.
    uploads: [Ring; 4],
    tokens: Ring,
    /// Per step whose tokens were queued for copying and not yet taken: its buffer and count.
    pending: VecDeque<(usize, usize)>,
}

/// `side`, made beside `main` on first use.
fn side<'a>(side: &'a mut Option<Side>, main: &Arc<CudaStream>) -> Result<&'a Side, RuntimeError> {
    if side.is_none() {
        *side = Some(Side::new(main)?);
    }
    Ok(side.as_ref().expect("made above"))
}

impl Staging {
    /// Queues the copy of a step's `what` to device memory at `dst` (room for `host.len()`
    /// values) on `stream`.
    pub fn upload<W: Word>(
        &mut self,
        what: Upload,
        stream: &Arc<CudaStream>,
        host: &[W],
        dst: CUdeviceptr,
    ) -> Result<(), RuntimeError> {
        self.uploads[what as usize].upload(stream, host, dst).map(|_| ())
    }

    /// Queues the copy of a step's packed inputs to device memory at `dst` on the inputs'
    /// stream, after the step before read them ([`Staging::inputs_read`]); `main`'s work queued
    /// next waits for it.
    pub fn upload_inputs(
        &mut self,
        main: &Arc<CudaStream>,
        host: &[i32],
        dst: CUdeviceptr,
    ) -> Result<(), RuntimeError> {
        let up = side(&mut self.up, main)?;
        up.stream.wait(&up.after).map_err(driver("ordering a copy"))?;
        let copied = self.uploads[Upload::Inputs as usize].upload(&up.stream, host, dst)?;
        main.wait(copied).map_err(driver("ordering a copy"))
    }

    /// Marks the point of `main` after which the device's inputs may be written again: the
    /// next [`Staging::upload_inputs`] waits for the work queued on `main` so far.
    pub fn inputs_read(&mut self, main: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        side(&mut self.up, main)?.after.record(main).map_err(driver("recording an event"))
    }

    /// Makes the work queued next on `main` wait until the last queued copy of the tokens to
    /// the host is done (before the tokens are written again; a step's tokens taken are done).
    pub fn tokens_free(&self, main: &Arc<CudaStream>) -> Result<(), RuntimeError> {
        let Some(&(i, _)) = self.pending.back() else { return Ok(()) };
        let b = self.tokens.bufs[i].as_ref().expect("a queued step's buffer");
        main.wait(&b.copied).map_err(driver("ordering a copy"))
    }

    /// Queues the copy of the `wanted` tokens at `src` to the host, after the work queued on
    /// `stream` so far, on the tokens' stream; [`Staging::take`] returns them, steps in the
    /// order they were queued (at most two at once).
    pub fn download(&mut self, stream: &Arc<CudaStream>, src: CUdeviceptr, wanted: usize) -> Result<(), RuntimeError> {
        if self.pending.len() == 2 {
            return Err(RuntimeError::Invalid("a third step launched before the first one's tokens were taken".into()));
        }
        let down = side(&mut self.down, stream)?;
        down.after.record(stream).map_err(driver("recording an event"))?;
        down.stream.wait(&down.after).map_err(driver("ordering a copy"))?;
        let (i, b) = self.tokens.take(&down.stream, wanted, false)?;
        if wanted > 0 {
            let pinned = &mut b.buf.as_mut_slice().map_err(driver("pinned host memory"))?[..wanted];
            // Safety: `src` holds `wanted` tokens, not written again before `copied`
            // (`tokens_free`); the buffer is read only after `copied`.
            unsafe { result::memcpy_dtoh_async(pinned, src, down.stream.cu_stream()) }
                .map_err(driver("copying tokens"))?;
        }
        b.copied.record(&down.stream).map_err(driver("recording an event"))?;
        self.pending.push_back((i, wanted));
        Ok(())
    }

    /// Whether the oldest queued step's tokens are on the host (true when none is queued).
    pub fn ready(&self) -> Result<bool, RuntimeError> {
        let Some(&(i, _)) = self.pending.front() else { return Ok(true) };
        let b = self.tokens.bufs[i].as_ref().expect("a queued step's buffer");
        b.copied.try_is_complete().map_err(driver("running a step"))
    }

    /// The oldest queued step's tokens, waiting for them.
    pub fn take(&mut self) -> Result<Vec<u32>, RuntimeError> {
        let (i, wanted) = self
            .pending
            .pop_front()
            .ok_or_else(|| RuntimeError::Invalid("no step's tokens are on their way".into()))?;
        let b = self.tokens.bufs[i].as_ref().expect("a queued step's buffer");
        b.wait()?;
        let ids = b.buf.as_slice().map_err(driver("pinned host memory"))?;
        Ok(ids[..wanted].iter().map(|&t| t as u32).collect())
    }

    /// Steps whose tokens were queued and not taken.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// An error naming `what` when some step's tokens are on their way (what must wait for
    /// them all).
    pub fn none_pending(&self, what: &str) -> Result<(), RuntimeError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        Err(RuntimeError::Invalid(format!("{what} while another step's tokens are on their way")))
    }
}
