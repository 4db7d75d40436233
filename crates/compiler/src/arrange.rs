//! A weight's values from the checkpoint tensors it is declared over (`spec::BoundWeight`):
//! one tensor, or a stack of experts (one tensor per expert, or one stacked tensor); each
//! matrix transposed back where the checkpoint stores it transposed; and the rows it takes of
//! a fused tensor (every `step`-th for interleaved parts). The checkpoint validation and the
//! reading use the same stored shape, so they agree by construction.

use crate::checkpoint::Checkpoint;
use crate::CompileError;
use ir::DType;
use spec::BoundWeight;

/// The checkpoint tensors of `bw`: one per expert, or the one tensor.
pub fn tensors(bw: &BoundWeight) -> Vec<String> {
    match bw.experts {
        Some((n, true)) => (0..n).map(|e| bw.tensor_of(e)).collect(),
        _ => vec![bw.tensor.clone()],
    }
}

/// The shape each of [`tensors`] must have, and which dimension of it holds the rows a
/// `rows` part takes (that dimension need only be at least as long as the expected one).
pub fn stored_shape(bw: &BoundWeight) -> (Vec<usize>, usize) {
    let mut m = bw.shape[bw.row_dim()..].to_vec();
    if let (Some(r), Some(first)) = (bw.rows, m.first_mut()) {
        *first = r.end;
    }
    let mut row = 0;
    if bw.transposed {
        m.swap(0, 1);
        row = 1;
    }
    match bw.experts {
        Some((n, false)) => ([vec![n], m].concat(), row + 1),
        _ => (m, row),
    }
}

/// Whether a checkpoint tensor of shape `found` can give `bw`.
pub fn fits(bw: &BoundWeight, found: &[usize]) -> bool {
    let (want, row) = stored_shape(bw);
    want.len() == found.len()
        && want.iter().zip(found).enumerate().all(|(d, (w, f))| match (d == row, bw.rows) {
            (true, Some(_)) => f >= w,
            _ => f == w,
        })
}

/// `bw`'s values, row-major in its shape.
pub fn read(ckpt: &Checkpoint, bw: &BoundWeight) -> Result<Vec<f32>, CompileError> {
    let whole = !bw.transposed && bw.rows.is_none();
    if whole && !matches!(bw.experts, Some((_, true))) {
        return ckpt.read_f32(&bw.tensor);
    }
    let mut out = Vec::with_capacity(bw.shape.iter().product());
    for name in tensors(bw) {
        let shape = ckpt.info(&name).map(|t| t.shape.clone()).unwrap_or_default();
        let data = ckpt.read_f32(&name)?;
        if whole {
            out.extend_from_slice(&data);
            continue;
        }
        // A stacked tensor holds one matrix per expert.
        let dims = &shape[usize::from(matches!(bw.experts, Some((_, false))))..];
        let size: usize = dims.iter().product();
        for m in data.chunks_exact(size.max(1)) {
            out.extend(arrange(m, dims, bw));
        }
    }
    Ok(out)
}

/// `bw`'s bytes as stored, where every tensor of it is stored as `dtype` and is taken whole
/// (not transposed, no rows picked): the tensors' bytes one after the other, what [`read`]
/// and a conversion back to `dtype` would give, without them (a 61 GB checkpoint compiles at
/// the speed of a copy). `None` where that does not hold.
pub fn read_stored(ckpt: &Checkpoint, bw: &BoundWeight, dtype: DType) -> Option<Vec<u8>> {
    if bw.transposed || bw.rows.is_some() {
        return None;
    }
    let names = tensors(bw);
    let parts: Option<Vec<&[u8]>> =
        names.iter().map(|n| ckpt.dense_bytes(n).filter(|(d, _)| *d == dtype).map(|(_, b)| b)).collect();
    Some(parts?.concat())
}

/// One stored matrix (or vector) made `bw`'s: transposed back, its rows taken.
fn arrange(m: &[f32], dims: &[usize], bw: &BoundWeight) -> Vec<f32> {
    let (rows, cols) = match (bw.transposed, dims) {
        (true, [k, n]) => (*n, *k),
        _ => (dims.first().copied().unwrap_or(1), dims.iter().skip(1).product()),
    };
    let at = |r: usize, c: usize| if bw.transposed { m[c * rows + r] } else { m[r * cols + c] };
    let picked = match bw.rows {
        Some(r) => (r.start..r.end).step_by(r.step),
        None => (0..rows).step_by(1),
    };
    picked.flat_map(|r| (0..cols).map(move |c| at(r, c))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use spec::{Rows, ShardKind};

    fn w(shape: Vec<usize>, rows: Option<Rows>, experts: Option<(usize, bool)>, transposed: bool) -> BoundWeight {
        BoundWeight {
            key: "w".into(),
            layer: None,
            name: "w".into(),
            tensor: "t".into(),
            rows,
            experts,
            transposed,
            shape,
            shard: ShardKind::Replicated,
            shard_heads: None,
        }
    }

    /// gpt-oss's gate: the even columns of each expert's `[hidden, 2 * inter]`, transposed.
    #[test]
    fn interleaved_transposed_parts_of_a_stack() {
        // Two experts of [k=2, 2n=4]: value = 100 e + 10 k + j.
        let m: Vec<f32> =
            (0..2).flat_map(|e| (0..2).flat_map(move |k| (0..4).map(move |j| (100 * e + 10 * k + j) as f32))).collect();
        let gate = w(vec![2, 2, 2], Some(Rows { start: 0, end: 4, step: 2 }), Some((2, false)), true);
        assert_eq!(stored_shape(&gate), (vec![2, 2, 4], 2));
        assert!(fits(&gate, &[2, 2, 4]) && fits(&gate, &[2, 2, 5]) && !fits(&gate, &[2, 3, 4]));
        let got: Vec<f32> = m.chunks(8).flat_map(|x| arrange(x, &[2, 4], &gate)).collect();
        // gate[e][n][k] = stored[e][k][2n].
        assert_eq!(got, vec![0., 10., 2., 12., 100., 110., 102., 112.]);
        let up = w(vec![2, 2, 2], Some(Rows { start: 1, end: 4, step: 2 }), Some((2, false)), true);
        let got: Vec<f32> = m.chunks(8).flat_map(|x| arrange(x, &[2, 4], &up)).collect();
        assert_eq!(got, vec![1., 11., 3., 13., 101., 111., 103., 113.]);
    }

    #[test]
    fn per_expert_tensors_are_read_whole() {
        let b = w(vec![4, 3, 2], None, Some((4, true)), false);
        assert_eq!(stored_shape(&b), (vec![3, 2], 0));
        assert_eq!(arrange(&[1., 2., 3., 4., 5., 6.], &[3, 2], &b), vec![1., 2., 3., 4., 5., 6.]);
    }
}
