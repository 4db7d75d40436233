//! The engine's greedy tokens against the same requests run alone (`engrun bench --verify-alone`).
//!
//! The engine batches requests, splits prompts into chunks, shares cached prefixes and pads
//! decode batches; none of that may change what a request generates. Each request is run again
//! by itself through [`Sequences`] (its whole prompt in one step, then one token per step),
//! teacher-forced with the engine's tokens, and at every step the engine's token is compared
//! with the argmax of the lone run's logits. A different token is allowed only at a near tie:
//! when the lone run's best logit beats the engine's token by at most `tol` times the row's
//! largest magnitude (two float paths that round differently may pick either side of a tie).

use crate::{Request, RuntimeError, Sequences};

/// The verdict of [`against_alone`].
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct AloneReport {
    /// Requests compared.
    pub requests: usize,
    /// Generated tokens compared.
    pub tokens: usize,
    /// Tokens equal to the lone run's argmax.
    pub equal: usize,
    /// Different tokens at a near tie (allowed).
    pub near_ties: usize,
    /// Different tokens where the lone run's choice was clear (each one fails the check).
    pub clear_mismatches: usize,
    /// The largest relative margin of any different token (0 when all are equal).
    pub worst_margin: f32,
    /// The tolerance the margins were held to.
    pub tol: f32,
    /// The first clear mismatch: request index, step, engine token, lone token, margin.
    pub first_clear: Option<(usize, usize, u32, u32, f32)>,
    /// No clear mismatch.
    pub pass: bool,
}

impl AloneReport {
    /// Records the engine's `token` at a step whose lone logits are `row`.
    fn compare(&mut self, req: usize, step: usize, token: u32, row: &[f32]) {
        self.tokens += 1;
        let best = argmax(row);
        if best == token {
            self.equal += 1;
            return;
        }
        let scale = row.iter().fold(0f32, |m, x| m.max(x.abs())).max(f32::MIN_POSITIVE);
        let margin = row.get(token as usize).map_or(f32::INFINITY, |&t| (row[best as usize] - t) / scale);
        self.worst_margin = self.worst_margin.max(margin);
        if margin <= self.tol {
            self.near_ties += 1;
        } else {
            self.clear_mismatches += 1;
            self.first_clear.get_or_insert((req, step, token, best, margin));
        }
    }
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Runs every request of `reqs` alone on `seqs`, fed the engine's tokens `outs[i]`, and
/// compares each token with the lone run's argmax (see the module doc). Greedy requests only.
pub fn against_alone(
    seqs: &mut Sequences,
    reqs: &[Request],
    outs: &[Vec<u32>],
    tol: f32,
) -> Result<AloneReport, RuntimeError> {
    if reqs.len() != outs.len() {
        return Err(RuntimeError::Invalid(format!("{} requests but {} outputs", reqs.len(), outs.len())));
    }
    if let Some(i) = reqs.iter().position(|r| r.sampling.temperature != 0.0) {
        return Err(RuntimeError::Invalid(format!("request {i} samples; the lone-run check needs greedy requests")));
    }
    let mut report = AloneReport { requests: reqs.len(), tol, ..AloneReport::default() };
    for (i, (req, out)) in reqs.iter().zip(outs).enumerate() {
        let seq = i as u64;
        let mut row = seqs.forward(seq, &req.prompt, &[req.prompt.len() - 1]);
        for (step, &token) in out.iter().enumerate() {
            let logits = row?;
            report.compare(i, step, token, &logits);
            row = if step + 1 < out.len() { seqs.forward(seq, &[token], &[0]) } else { Ok(vec![]) };
        }
        seqs.release(seq);
    }
    report.pass = report.clear_mismatches == 0;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(tol: f32) -> AloneReport {
        AloneReport { tol, ..AloneReport::default() }
    }

    #[test]
    fn equal_tokens_pass() {
        let mut r = report(0.01);
        r.compare(0, 0, 2, &[0.0, 1.0, 3.0]);
        assert_eq!((r.tokens, r.equal, r.near_ties, r.clear_mismatches), (1, 1, 0, 0));
    }

    #[test]
    fn near_tie_is_allowed_and_clear_mismatch_is_not() {
        let mut r = report(0.01);
        r.compare(0, 0, 1, &[0.0, 2.995, 3.0]);
        assert_eq!((r.near_ties, r.clear_mismatches), (1, 0));
        r.compare(1, 4, 0, &[0.0, 1.0, 3.0]);
        assert_eq!(r.clear_mismatches, 1);
        assert_eq!(r.first_clear, Some((1, 4, 0, 2, 1.0)));
        assert!((r.worst_margin - 1.0).abs() < 1e-6);
    }

    #[test]
    fn token_outside_the_row_is_a_clear_mismatch() {
        let mut r = report(0.5);
        r.compare(0, 0, 7, &[0.0, 1.0]);
        assert_eq!(r.clear_mismatches, 1);
    }
}
