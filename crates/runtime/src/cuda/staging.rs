//! Pinned host memory for a step's inputs and its chosen tokens. A copy from pageable memory
//! makes the driver wait for the stream first, and a copy into it returns only when done; from
//! and into pinned memory both are queued on the stream, so the host can pack and launch the
//! next step while the GPU runs this one (pipelined steps, `Backend::launch_sample`). Two
//! buffers each, taken in turn: a step's buffer is written again only two steps later, after
//! its event says the copy is done.

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

/// The pinned buffers of one backend, and the steps whose tokens are on their way back.
#[derive(Default)]
pub(super) struct Staging {
    inputs: [Option<HostBuf>; 2],
    next_input: usize,
    tokens: [Option<HostBuf>; 2],
    next_tokens: usize,
    /// Per step whose tokens were queued for copying and not yet taken: its buffer and count.
    pending: VecDeque<(usize, usize)>,
}

/// The buffer `slot` of `bufs` with room for `len` values (a new one when too small), once its
/// last copy is done.
fn slot<'a>(
    bufs: &'a mut [Option<HostBuf>; 2],
    slot: usize,
    stream: &Arc<CudaStream>,
    len: usize,
    write_only: bool,
) -> Result<&'a mut HostBuf, RuntimeError> {
    if let Some(b) = &bufs[slot] {
        b.wait()?;
    }
    if bufs[slot].as_ref().is_none_or(|b| b.buf.len() < len) {
        bufs[slot] = Some(HostBuf::new(stream, len, write_only)?);
    }
    Ok(bufs[slot].as_mut().expect("made above"))
}

impl Staging {
    /// Queues the copy of `host` to device memory at `dst` (room for `host.len()` values) on
    /// `stream`, through the next pinned input buffer.
    pub fn upload(&mut self, stream: &Arc<CudaStream>, host: &[i32], dst: CUdeviceptr) -> Result<(), RuntimeError> {
        let b = slot(&mut self.inputs, self.next_input, stream, host.len(), true)?;
        self.next_input ^= 1;
        let pinned = &mut b.buf.as_mut_slice().map_err(driver("pinned host memory"))?[..host.len()];
        pinned.copy_from_slice(host);
        // Safety: `dst` holds `host.len()` values (the caller's); the pinned source stays
        // untouched until `copied` completes (`slot` waits for it).
        unsafe { result::memcpy_htod_async(dst, pinned, stream.cu_stream()) }.map_err(driver("copying step inputs"))?;
        b.copied.record(stream).map_err(driver("recording an event"))
    }

    /// Queues the copy of the `wanted` tokens at `src` to the host; [`Staging::take`] returns
    /// them, steps in the order they were queued (at most two at once).
    pub fn download(&mut self, stream: &Arc<CudaStream>, src: CUdeviceptr, wanted: usize) -> Result<(), RuntimeError> {
        if self.pending.len() == 2 {
            return Err(RuntimeError::Invalid("a third step launched before the first one's tokens were taken".into()));
        }
        let i = self.next_tokens;
        let b = slot(&mut self.tokens, i, stream, wanted, false)?;
        self.next_tokens ^= 1;
        if wanted > 0 {
            let pinned = &mut b.buf.as_mut_slice().map_err(driver("pinned host memory"))?[..wanted];
            // Safety: `src` holds `wanted` tokens; the buffer is read only after `copied`.
            unsafe { result::memcpy_dtoh_async(pinned, src, stream.cu_stream()) }.map_err(driver("copying tokens"))?;
        }
        b.copied.record(stream).map_err(driver("recording an event"))?;
        self.pending.push_back((i, wanted));
        Ok(())
    }

    /// Whether the oldest queued step's tokens are on the host (true when none is queued).
    pub fn ready(&self) -> Result<bool, RuntimeError> {
        let Some(&(i, _)) = self.pending.front() else { return Ok(true) };
        let b = self.tokens[i].as_ref().expect("a queued step's buffer");
        b.copied.try_is_complete().map_err(driver("running a step"))
    }

    /// The oldest queued step's tokens, waiting for them.
    pub fn take(&mut self) -> Result<Vec<u32>, RuntimeError> {
        let (i, wanted) = self
            .pending
            .pop_front()
            .ok_or_else(|| RuntimeError::Invalid("no step's tokens are on their way".into()))?;
        let b = self.tokens[i].as_ref().expect("a queued step's buffer");
        b.wait()?;
        let ids = b.buf.as_slice().map_err(driver("pinned host memory"))?;
        Ok(ids[..wanted].iter().map(|&t| t as u32).collect())
    }

    /// Steps whose tokens were queued and not taken.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}
