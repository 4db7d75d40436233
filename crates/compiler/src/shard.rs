//! Tensor-parallel splitting of weights: which slice of a tensor each rank holds. The TP pass
//! uses it for shapes and the bundle emitter for data, so both agree by construction.

use crate::CompileError;
use ir::DType;
use spec::{BoundWeight, ShardKind};
use std::ops::Range;

/// The slice of a weight that one rank holds: a range along one dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    /// The dimension split (0 for column, 1 for a stack of experts', the last for row).
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
        // Each expert's rows, for a stack of experts.
        ShardKind::Column => w.row_dim(),
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
    cut_units(w, data, tp, rank, Some)
}

/// Cuts `rank`'s slice out of the bytes of a tensor of `elem`-byte elements (a weight copied
/// as the checkpoint stores it: `arrange::read_stored`).
pub fn cut_bytes(w: &BoundWeight, data: &[u8], elem: usize, tp: usize, rank: usize) -> Result<Vec<u8>, CompileError> {
    cut_units(w, data, tp, rank, |n| Some(n * elem))
}

/// Cuts `rank`'s slice out of the blocks of a block-type tensor (`data`: its bytes, rows of
/// whole blocks of that type's length, 32 or a k-quant's 256); a slice that would split a
/// block is an error.
pub fn cut_blocks(w: &BoundWeight, data: &[u8], dtype: DType, tp: usize, rank: usize) -> Result<Vec<u8>, CompileError> {
    cut_units(w, data, tp, rank, |n| dtype.bytes(n)).map_err(|e| match e {
        CompileError::Usage(m) => CompileError::Usage(format!("{m}: {}", unsplittable(w, dtype, tp))),
        e => e,
    })
}

/// Checks that the rows of a block-type weight's slice (`shape`, one rank's) are whole blocks:
/// a row-parallel slice must not split one.
pub fn check_blocks(w: &BoundWeight, shape: &[usize], dtype: DType, tp: usize) -> Result<(), CompileError> {
    match (dtype.block(), shape.last()) {
        (Some((len, _)), Some(k)) if !k.is_multiple_of(len) => Err(CompileError::Tp {
            weight: w.name.clone(),
            message: format!("a rank's rows would be {k} values, {}", unsplittable(w, dtype, tp)),
        }),
        _ => Ok(()),
    }
}

/// Why a block-type weight cannot be sliced at `tp`, and what to do.
fn unsplittable(w: &BoundWeight, dtype: DType, tp: usize) -> String {
    format!(
        "`{}` is {dtype}, whose blocks of {} cannot be split at --tp {tp} (compile with --dtype f32 or bf16)",
        w.name,
        dtype.block().map_or(1, |(len, _)| len)
    )
}

/// [`cut`] over `data` whose element offset `n` is at `unit(n)` (`None`: not a boundary).
fn cut_units<T: Copy>(
    w: &BoundWeight,
    data: &[T],
    tp: usize,
    rank: usize,
    unit: impl Fn(usize) -> Option<usize>,
) -> Result<Vec<T>, CompileError> {
    let Some(sl) = slice(w, tp, rank)? else {
        return Ok(data.to_vec());
    };
    let inner: usize = w.shape[sl.dim + 1..].iter().product();
    let outer: usize = w.shape[..sl.dim].iter().product();
    let size = w.shape[sl.dim];
    let at = |n: usize| unit(n).ok_or_else(|| CompileError::Usage(format!("element {n} of `{}`", w.name)));
    let mut out = Vec::with_capacity(data.len() / tp.max(1));
    for o in 0..outer {
        let base = o * size * inner;
        out.extend_from_slice(&data[at(base + sl.range.start * inner)?..at(base + sl.range.end * inner)?]);
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
            experts: None,
            transposed: false,
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
    fn block_slices_keep_whole_blocks() {
        let data: Vec<u8> = (0..4 * 2 * 20).map(|v| v as u8).collect(); // 4 rows of 2 Q4_1 blocks
        let row = w(vec![4, 64], ShardKind::Row, None);
        let p1 = cut_blocks(&row, &data, ir::DType::Q4_1, 2, 1).unwrap();
        assert_eq!(p1.len(), 80);
        assert_eq!(p1[..20], data[20..40]);
        let col = w(vec![4, 64], ShardKind::Column, None);
        assert_eq!(cut_blocks(&col, &data, ir::DType::Q4_1, 2, 1).unwrap(), data[80..]);
        let err = cut_blocks(&row, &data, ir::DType::Q4_1, 4, 1).unwrap_err().to_string();
        assert!(err.contains("q4_1") && err.contains("--tp 4"), "{err}");
        // A k-quant's super-blocks of 256: rows of 512 split in two, not in four.
        let data: Vec<u8> = (0..2 * 2 * 144).map(|v| v as u8).collect(); // 2 rows of 2 Q4_K blocks
        let row = w(vec![2, 512], ShardKind::Row, None);
        let p1 = cut_blocks(&row, &data, ir::DType::Q4_K, 2, 1).unwrap();
        assert_eq!((p1[..144].to_vec(), p1[144..].to_vec()), (data[144..288].to_vec(), data[432..].to_vec()));
        let err = cut_blocks(&row, &data, ir::DType::Q4_K, 4, 1).unwrap_err().to_string();
        assert!(err.contains("q4_k") && err.contains("blocks of 256"), "{err}");
        // FP8's blocks of 32: rows of 64 split in two, not in four; the TP pass says so first.
        let row = w(vec![4, 64], ShardKind::Row, None);
        assert!(check_blocks(&row, &shape(&row, 2).unwrap(), ir::DType::F8_E4M3, 2).is_ok());
        let err = check_blocks(&row, &shape(&row, 4).unwrap(), ir::DType::F8_E4M3, 4).unwrap_err().to_string();
        assert!(err.contains("cannot shard `w`") && err.contains("16 values") && err.contains("f8_e4m3"), "{err}");
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
