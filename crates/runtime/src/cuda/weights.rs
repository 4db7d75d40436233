//! The weights on the device. Each is uploaded in the layout its kernels read (f32 and the
//! program's 16-bit float as stored, E4M3 in `codegen_cuda::fp8_device_layout`, GGUF's blocks
//! in `codegen_cuda::block_device_layout`, anything else as f32) into an allocation of its own, except the 16-bit weights of one linear launch of
//! several (q, k and v; gate and up): those go into one allocation, adjacent in the launch's
//! order, so that with the launch's packed output (`codegen_cuda`'s `Builder::packed`) they
//! are one `[n0 + n1 + n2, k]` matrix cuBLASLt multiplies in one matmul.

use super::driver;
use crate::RuntimeError;
use bundle::WeightFile;
use codegen_cuda::{Arg, KernelKey, Program, Step, WFormat};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr};
use ir::{DType, Op, Plan};
use std::borrow::Cow;
use std::sync::Arc;

/// Where a weight lives: bytes `at..at + len` of allocation `slab`.
#[derive(Debug, Clone, Copy)]
struct Place {
    slab: usize,
    at: usize,
    len: usize,
}

/// Every weight of a plan on one device, by plan node.
pub(super) struct Weights {
    slabs: Vec<CudaSlice<u8>>,
    places: Vec<Option<Place>>,
}

impl Weights {
    /// Uploads the weights of `plan` from `file`; with the bytes uploaded.
    pub(super) fn upload(
        stream: &Arc<CudaStream>,
        plan: &Plan,
        program: &Program,
        file: &WeightFile,
    ) -> Result<(Weights, usize), RuntimeError> {
        let mut w = Weights { slabs: vec![], places: vec![None; plan.nodes.len()] };
        let mut total = 0;
        let mut up = |w: &mut Weights, members: &[usize], bytes: &[u8], lens: &[usize]| {
            let slab = w.slabs.len();
            let mut at = 0;
            for (&i, &len) in members.iter().zip(lens) {
                w.places[i] = Some(Place { slab, at, len });
                at += len;
            }
            total += bytes.len();
            w.slabs.push(stream.clone_htod(bytes).map_err(driver("uploading weights"))?);
            Ok::<_, RuntimeError>(())
        };
        let groups = adjacent_groups(program);
        for (i, n) in plan.nodes.iter().enumerate() {
            let Op::Weight { name, shape, dtype, .. } = &n.op else { continue };
            if !groups.iter().any(|g| g.contains(&i)) {
                let bytes = device_bytes(file, name, shape, *dtype, program.half)?;
                up(&mut w, &[i], &bytes, &[bytes.len()])?;
            }
        }
        for group in groups {
            let (mut bytes, mut lens) = (vec![], vec![]);
            for &i in &group {
                let Op::Weight { name, shape, dtype, .. } = &plan.nodes[i].op else { continue };
                let part = device_bytes(file, name, shape, *dtype, program.half)?;
                lens.push(part.len());
                bytes.extend_from_slice(&part);
            }
            up(&mut w, &group, &bytes, &lens)?;
        }
        Ok((w, total))
    }

    /// The device address of weight `i` (0 for a node that is not a weight).
    pub(super) fn ptr(&self, stream: &CudaStream, i: usize) -> u64 {
        self.place(i).map_or(0, |p| {
            let (base, _sync) = self.slabs[p.slab].device_ptr(stream);
            base + p.at as u64
        })
    }

    /// The bytes of weight `i` on the device (0 for a node that is not a weight).
    pub(super) fn len(&self, i: usize) -> usize {
        self.place(i).map_or(0, |p| p.len)
    }

    /// Weight `i`'s bytes on the device.
    pub(super) fn view(&self, i: usize) -> Option<CudaView<'_, u8>> {
        self.place(i).map(|p| self.slabs[p.slab].slice(p.at..p.at + p.len))
    }

    fn place(&self, i: usize) -> Option<Place> {
        self.places.get(i).copied().flatten()
    }
}

/// A weight's bytes in the layout its kernels read: f32 and the program's 16-bit float as
/// stored (the codegen rejects the other 16-bit float), E4M3 and GGUF's blocks in the kernels'
/// layouts (`codegen_cuda::fp8_device_layout`, `block_device_layout`), the rest as f32.
fn device_bytes<'f>(
    file: &'f WeightFile,
    name: &str,
    shape: &[usize],
    dtype: DType,
    half: DType,
) -> Result<Cow<'f, [u8]>, RuntimeError> {
    let bytes = file.bytes_as(name, dtype, shape)?;
    Ok(match dtype {
        d if d == DType::F32 || d == half => Cow::Borrowed(bytes),
        d if d.is_block() => {
            let (rows, k) = (shape.iter().rev().skip(1).product(), shape.last().copied().unwrap_or(0));
            let dev = match d {
                DType::F8_E4M3 => codegen_cuda::fp8_device_layout(name, bytes, rows, k),
                _ => codegen_cuda::block_device_layout(name, d, bytes, rows, k),
            };
            Cow::Owned(dev.map_err(|e| RuntimeError::Unsupported(e.to_string()))?)
        }
        d => Cow::Owned(d.to_f32(bytes).iter().flat_map(|f| f.to_le_bytes()).collect()),
    })
}

/// The 16-bit weights of each tensor-core linear launch of more than one linear, in the
/// launch's order; a weight in no such launch, or in two different ones, is in none.
fn adjacent_groups(program: &Program) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = vec![];
    for step in &program.steps {
        let Step::Kernels { variants, .. } = step else { continue };
        for l in variants.iter().flat_map(|(_, ls)| ls) {
            let (KernelKey::Gemm { n, wf: WFormat::H16, .. } | KernelKey::GemmSkinny { n, wf: WFormat::H16, .. }) =
                l.key
            else {
                continue;
            };
            let ws: Vec<usize> = (0..3)
                .filter(|&g| n[g] > 0)
                .filter_map(|g| if let Some(&Arg::Weight(w)) = l.args.get(1 + 3 * g) { Some(w) } else { None })
                .collect();
            if ws.len() > 1 && !groups.contains(&ws) {
                groups.push(ws);
            }
        }
    }
    let clash = |w: usize| groups.iter().filter(|g| g.contains(&w)).count() > 1;
    let clashing: Vec<bool> = groups.iter().map(|g| g.iter().any(|&w| clash(w))).collect();
    groups.into_iter().zip(clashing).filter(|(_, c)| !c).map(|(g, _)| g).collect()
}

#[cfg(test)]
mod tests {
    use super::adjacent_groups;
    use ir::{DType, Fusion, FusionKind, Graph, Op};

    /// x → norm → act(x·gateᵀ) * (x·upᵀ) → down → logits, 64 wide, bf16: gate and up are the
    /// one launch of several linears, so their weights, in that order, are one group; the lone
    /// down projection and the logits are in none.
    #[test]
    fn a_launchs_weights_are_one_group_in_its_order() {
        let mut g = Graph::new(DType::BF16);
        let w = |g: &mut Graph, name: &str, shape: Vec<usize>| {
            g.add(Op::Weight { name: name.into(), shape, dtype: DType::BF16, derived: None }, &[], name).unwrap()
        };
        let (table, nw) = (w(&mut g, "table", vec![64, 64]), w(&mut g, "norm", vec![64]));
        let (gw, uw, dw) =
            (w(&mut g, "gate", vec![128, 64]), w(&mut g, "up", vec![128, 64]), w(&mut g, "down", vec![64, 128]));
        let t = g.add(Op::Tokens, &[], "tokens").unwrap();
        let x = g.add(Op::Embedding, &[t, table], "x").unwrap();
        let h = g.add(Op::RmsNorm { eps: 1e-6 }, &[x, nw], "h").unwrap();
        let gate = g.add(Op::Linear { bias: false }, &[h, gw], "g").unwrap();
        let up = g.add(Op::Linear { bias: false }, &[h, uw], "u").unwrap();
        let act = g.add(Op::Silu, &[gate], "a").unwrap();
        let m = g.add(Op::Mul, &[act, up], "m").unwrap();
        let y = g.add(Op::Linear { bias: false }, &[m, dw], "y").unwrap();
        g.fusions.push(Fusion { kind: FusionKind::Glu, nodes: vec![gate, up, act, m] });
        g.fusions.push(Fusion { kind: FusionKind::Linears, nodes: vec![y] });
        g.output = Some(g.add(Op::Logits, &[y, table], "logits").unwrap());
        let plan = g.to_plan().unwrap();
        let program = codegen_cuda::emit(&plan).unwrap();
        let node = |name: &str| plan.nodes.iter().position(|n| n.label == name).unwrap();
        assert_eq!(adjacent_groups(&program), [vec![node("gate"), node("up")]]);
    }
}
