//! The routing rule of a mixture of experts ([`crate::Op::Moe`]), declared once: the
//! interpreter and every backend that routes on the host call it.

/// The experts one row of router `logits` picks and their weights: the `top_k` largest logits
/// (on equal logits the lower index first), weighted by the softmax of the logits over the
/// chosen ones (`norm_topk`) or over all of them.
pub fn route(logits: &[f32], top_k: usize, norm_topk: bool) -> Vec<(usize, f32)> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // A stable sort: equal logits keep the lower index first.
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    order.truncate(top_k);
    let Some(&first) = order.first() else { return Vec::new() };
    let max = logits[first];
    let exps: Vec<f32> = order.iter().map(|&e| (logits[e] - max).exp()).collect();
    let sum: f32 = if norm_topk { exps.iter().sum() } else { logits.iter().map(|l| (l - max).exp()).sum() };
    order.into_iter().zip(exps).map(|(e, x)| (e, x / sum)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_by_logit_with_softmax_weights() {
        let l = [0.5f32, 2.0, -1.0, 2.0, 1.0];
        let r = route(&l, 3, true);
        let picked: Vec<usize> = r.iter().map(|p| p.0).collect();
        assert_eq!(picked, [1, 3, 4], "ties: the lower index first");
        let z = 2.0f32.exp() * 2.0 + 1.0f32.exp();
        for (e, w) in &r {
            assert!((w - l[*e].exp() / z).abs() < 1e-6);
        }
        let all: f32 = l.iter().map(|x| x.exp()).sum();
        let r = route(&l, 2, false);
        assert!(r.iter().all(|(e, w)| (w - l[*e].exp() / all).abs() < 1e-6), "{r:?}");
        assert!(r.iter().map(|p| p.1).sum::<f32>() < 1.0);
    }
}
