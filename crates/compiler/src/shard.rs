//! Tensor-parallel splitting of weights: which slice of a tensor each rank holds. The TP pass
//! uses it for shapes and the bundle emitter for data, so both agree by construction.

use crate::CompileError;
use spec::{BoundWeight, ShardKind};
use std::ops::Range;

/// The slice of a weight that one rank holds: a range along one dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    /// The dimension split (0 for column, the last for row).
    pub dim: usize,
    /// The indices kept along it.
    pub range: Range<usize>,
}

/// The slice of `w` that `rank` of `tp` holds, or `None` when it is replicated.
pub fn slice(w: &BoundWeight, tp: usize, rank: usize) -> Result<Option<Slice>, CompileError> {
    if tp == 1 || w.shard == ShardKind::Replicated {
        return Ok(None);
    }
    let dim = match w.shard {
        ShardKind::Column => 0,
        ShardKind::Row => w.shape.len().saturating_sub(1),
        ShardKind::Replicated => unreachable!("returned above"),
    };
    let size = w.shape.get(dim).copied().unwrap_or(0);
    let err = |message: String| CompileError::Tp { weight: w.name.clone(), message };
    let range = match w.shard_heads {
        Some(heads) => {
            if heads == 0 || size % heads != 0 {
                return Err(err(format!("dimension {dim} ({size}) is not a whole number of {heads} heads")));
            }
            let unit = size / heads;
            if tp <= heads {
                if heads % tp != 0 {
                    return Err(err(format!("tp {tp} does not divide the {heads} heads")));
                }
                let per = heads / tp;
                rank * per * unit..(rank + 1) * per * unit
            } else {
                if !tp.is_multiple_of(heads) {
                    return Err(err(format!("tp {tp} is more than the {heads} heads and not a multiple of them, so they cannot be replicated evenly")));
                }
                let head = rank / (tp / heads);
                head * unit..(head + 1) * unit
            }
        }
        None => {
            if size % tp != 0 {
                return Err(err(format!("tp {tp} does not divide dimension {dim} ({size})")));
            }
            let per = size / tp;
            rank * per..(rank + 1) * per
        }
    };
    Ok(Some(Slice { dim, range }))
}

/// The shape of `w` on one rank.
pub fn shape(w: &BoundWeight, tp: usize) -> Result<Vec<usize>, CompileError> {
    let mut s = w.shape.clone();
    if let Some(sl) = slice(w, tp, 0)? {
        s[sl.dim] = sl.range.len();
    }
    Ok(s)
}

/// Cuts `rank`'s slice out of the full tensor `data` (row-major, shape `w.shape`).
pub fn cut(w: &BoundWeight, data: &[f32], tp: usize, rank: usize) -> Result<Vec<f32>, CompileError> {
    let Some(sl) = slice(w, tp, rank)? else {
        return Ok(data.to_vec());
    };
    let inner: usize = w.shape[sl.dim + 1..].iter().product();
    let outer: usize = w.shape[..sl.dim].iter().product();
    let size = w.shape[sl.dim];
    let mut out = Vec::with_capacity(outer * sl.range.len() * inner);
    for o in 0..outer {
        let base = o * size * inner;
        out.extend_from_slice(&data[base + sl.range.start * inner..base + sl.range.end * inner]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(shape: Vec<usize>, shard: ShardKind, heads: Option<usize>) -> BoundWeight {
        BoundWeight {
            key: "w".into(),
            layer: None,
            name: "w".into(),
            tensor: "w".into(),
            rows: None,
            shape,
            shard,
            shard_heads: heads,
        }
    }

    #[test]
    fn column_and_row_slices_concatenate_back() {
        let data: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let col = w(vec![4, 6], ShardKind::Column, None);
        let parts: Vec<Vec<f32>> = (0..2).map(|r| cut(&col, &data, 2, r).unwrap()).collect();
        assert_eq!(parts.concat(), data);
        let row = w(vec![4, 6], ShardKind::Row, None);
        let p0 = cut(&row, &data, 2, 0).unwrap();
        assert_eq!(p0, vec![0., 1., 2., 6., 7., 8., 12., 13., 14., 18., 19., 20.]);
    }

    #[test]
    fn kv_heads_replicate_beyond_their_count() {
        let kv = w(vec![2 * 3, 4], ShardKind::Column, Some(2));
        let ranges: Vec<_> = (0..4).map(|r| slice(&kv, 4, r).unwrap().unwrap().range).collect();
        assert_eq!(ranges, vec![0..3, 0..3, 3..6, 3..6]);
        assert!(slice(&kv, 3, 0).unwrap_err().to_string().contains("not a multiple"));
        let q = w(vec![6, 4], ShardKind::Column, Some(3));
        assert!(slice(&q, 2, 0).unwrap_err().to_string().contains("does not divide the 3 heads"));
    }
}
