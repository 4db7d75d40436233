//! Token sampling: greedy at temperature 0, else temperature / top-k / top-p / min-p sampling
//! with a seeded generator (the same seed gives the same tokens); repetition, frequency and
//! presence penalties; the log-probabilities of the chosen token and the top ones.

use crate::RuntimeError;
use std::collections::{HashMap, HashSet};

/// How to choose the next token.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 is greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1: all).
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the top one (0: none).
    pub min_p: f32,
    /// Seed of the generator.
    pub seed: u64,
    /// Logits of tokens already in the prompt or the output are divided by this when
    /// positive, multiplied when negative (HF's `repetition_penalty`; 1: off).
    pub repetition_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated (OpenAI's; 0: off).
    pub frequency_penalty: f32,
    /// Subtracted from the logit of every token generated at least once (OpenAI's; 0: off).
    pub presence_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
        }
    }
}

impl SamplingParams {
    /// Whether the choice is the plain argmax of the raw logits (greedy, no penalty), which a
    /// backend may compute on its device.
    pub fn is_greedy(&self) -> bool {
        (self.temperature == 0.0 || self.top_k == 1)
            && self.repetition_penalty == 1.0
            && self.frequency_penalty == 0.0
            && self.presence_penalty == 0.0
    }

    /// Checks every parameter's range.
    pub fn validate(&self) -> Result<(), RuntimeError> {
        let bad = |m: String| Err(RuntimeError::Invalid(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 || self.temperature > 100.0 {
            return bad(format!("temperature must be in [0, 100], got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 2.0) {
            return bad(format!("repetition_penalty must be in (0, 2], got {}", self.repetition_penalty));
        }
        for (name, v) in [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        Ok(())
    }
}

/// A seeded sampler (SplitMix64 generator).
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    state: u64,
}

impl Sampler {
    /// A sampler for `params` (validated).
    pub fn new(params: SamplingParams) -> Result<Sampler, RuntimeError> {
        params.validate()?;
        let state = params.seed ^ 0x9E37_79B9_7F4A_7C15;
        Ok(Sampler { params, state })
    }

    /// The index of the largest logit (the greedy choice).
    pub fn argmax(logits: &[f32]) -> u32 {
        logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
    }

    /// A uniform number in [0, 1) from the sampler's generator.
    pub fn uniform(&mut self) -> f64 {
        self.next_f64()
    }

    fn next_f64(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Chooses a token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature == 0.0 || self.params.top_k == 1 {
            return Sampler::argmax(logits);
        }
        let t = self.params.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Tokens more than e^-40 below the top cannot be drawn in f64; skip them before sorting.
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .filter(|&(_, &l)| (l - max) / t > -40.0)
            .map(|(i, &l)| (i as u32, (((l - max) / t) as f64).exp()))
            .collect();
        let order = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if self.params.top_k > 0 && self.params.top_k < probs.len() {
            probs.select_nth_unstable_by(self.params.top_k - 1, order);
            probs.truncate(self.params.top_k);
        }
        // Only top-p and min-p need the tokens in order; plain sampling draws from them as
        // they are (in id order).
        let kept = if self.params.top_p < 1.0 || self.params.min_p > 0.0 {
            probs.sort_by(order);
            let total: f64 = probs.iter().map(|p| p.1).sum();
            let top = probs[0].1;
            let mut kept = 0.0;
            let mut keep = 0;
            for p in &probs {
                if keep > 0 && (kept / total >= self.params.top_p as f64 || p.1 < self.params.min_p as f64 * top) {
                    break;
                }
                kept += p.1;
                keep += 1;
            }
            probs.truncate(keep);
            kept
        } else {
            probs.iter().map(|p| p.1).sum()
        };
        let mut r = self.next_f64() * kept;
        for (id, p) in &probs {
            if r < *p {
                return *id;
            }
            r -= p;
        }
        probs[probs.len() - 1].0
    }
}

/// The log-probabilities of a sampled token and of the most likely tokens, from the model's
/// distribution (log-softmax of the raw logits, before penalties and temperature).
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    /// The chosen token's.
    pub token: f32,
    /// The `n` most likely tokens and theirs, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// One request's sampling state: its generator, and the tokens its penalties look at.
#[derive(Debug, Clone)]
pub struct RequestSampler {
    sampler: Sampler,
    prompt: HashSet<u32>,
    counts: HashMap<u32, u32>,
}

impl RequestSampler {
    /// A sampler for a request with this prompt.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Result<RequestSampler, RuntimeError> {
        let penalised = params.repetition_penalty != 1.0;
        let prompt = if penalised { prompt.iter().copied().collect() } else { HashSet::new() };
        Ok(RequestSampler { sampler: Sampler::new(params)?, prompt, counts: HashMap::new() })
    }

    /// Chooses the next token from `logits` and records it; with `logprobs = Some(n)` also
    /// returns the chosen token's log-probability and the top `n`.
    pub fn next(&mut self, logits: &[f32], logprobs: Option<usize>) -> (u32, Option<Logprobs>) {
        let p = &self.sampler.params;
        let penalised = p.repetition_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
        let token = if penalised {
            let mut l = logits.to_vec();
            let rep = p.repetition_penalty;
            if rep != 1.0 {
                let output_only = self.counts.keys().filter(|t| !self.prompt.contains(t));
                for &t in self.prompt.iter().chain(output_only) {
                    let x = &mut l[t as usize];
                    *x = if *x > 0.0 { *x / rep } else { *x * rep };
                }
            }
            for (&t, &c) in &self.counts {
                l[t as usize] -= p.frequency_penalty * c as f32 + p.presence_penalty;
            }
            self.sampler.sample(&l)
        } else {
            self.sampler.sample(logits)
        };
        *self.counts.entry(token).or_insert(0) += 1;
        (token, logprobs.map(|n| log_probs(logits, token, n)))
    }
}

/// Log-softmax of `logits` at `token`, and the top `n` entries.
fn log_probs(logits: &[f32], token: u32, n: usize) -> Logprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max as f64 + logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>().ln();
    let lp = |t: u32| (logits[t as usize] as f64 - lse) as f32;
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let order = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let n = n.min(idx.len());
    if n > 0 && n < idx.len() {
        idx.select_nth_unstable_by(n - 1, order);
    }
    idx.truncate(n);
    idx.sort_by(order);
    Logprobs { token: lp(token), top: idx.into_iter().map(|t| (t, lp(t))).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_seeded() {
        let logits = [0.1, 2.0, 1.9, -1.0];
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&logits), 1);
        let p = SamplingParams { temperature: 1.0, seed: 7, ..Default::default() };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone()).unwrap();
            (0..32).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p).unwrap();
            (0..32).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.contains(&2) && a.contains(&1), "{a:?}");
        let k = SamplingParams { temperature: 1.0, top_k: 2, ..Default::default() };
        let mut s = Sampler::new(k).unwrap();
        assert!((0..64).all(|_| matches!(s.sample(&logits), 1 | 2)));
    }

    #[test]
    fn penalties_and_logprobs() {
        let logits = [2.0, 1.9, 0.0];
        let p = SamplingParams { presence_penalty: 0.5, ..Default::default() };
        let mut s = RequestSampler::new(p, &[]).unwrap();
        assert_eq!(s.next(&logits, None).0, 0);
        assert_eq!(s.next(&logits, None).0, 1, "token 0 is penalised once generated");
        let p = SamplingParams { repetition_penalty: 2.0, ..Default::default() };
        let mut s = RequestSampler::new(p, &[0]).unwrap();
        assert_eq!(s.next(&logits, None).0, 1, "token 0 is in the prompt");
        let mut s = RequestSampler::new(SamplingParams::default(), &[]).unwrap();
        let (t, lp) = s.next(&logits, Some(2));
        let lp = lp.unwrap();
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        assert_eq!(t, 0);
        assert!((lp.token as f64 - (2.0 - z.ln())).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|x| x.0).collect::<Vec<_>>(), [0, 1]);
    }

    #[test]
    fn rejects_absurd_params() {
        for p in [
            SamplingParams { temperature: -1.0, ..Default::default() },
            SamplingParams { temperature: f32::NAN, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { min_p: 2.0, ..Default::default() },
            SamplingParams { repetition_penalty: 0.0, ..Default::default() },
            SamplingParams { frequency_penalty: 3.0, ..Default::default() },
        ] {
            assert!(Sampler::new(p).is_err());
        }
    }
}
