//! Token sampling: greedy at temperature 0, else temperature / top-k / top-p / min-p sampling
//! with a seeded generator (the same seed gives the same tokens).

use crate::RuntimeError;

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
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0 }
    }
}

impl SamplingParams {
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
        let mut probs: Vec<(u32, f64)> =
            logits.iter().enumerate().map(|(i, &l)| (i as u32, (((l - max) / t) as f64).exp())).collect();
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.params.top_k > 0 {
            probs.truncate(self.params.top_k);
        }
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
    fn rejects_absurd_params() {
        for p in [
            SamplingParams { temperature: -1.0, ..Default::default() },
            SamplingParams { temperature: f32::NAN, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { min_p: 2.0, ..Default::default() },
        ] {
            assert!(Sampler::new(p).is_err());
        }
    }
}
