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
    /// Added to the logits of these tokens before every choice (OpenAI's `logit_bias`, each in
    /// [-100, 100]: -100 bans a token, +100 all but forces it); applied like the penalties
    /// ([`RequestSampler::adjustments`]), on the device where the backend samples there.
    pub logit_bias: Vec<(u32, f32)>,
    /// The tokens `min_tokens_ids` cannot be chosen before this many were generated (vLLM's
    /// and SGLang's `min_tokens`; 0: off).
    pub min_tokens: usize,
    /// The ids `min_tokens` holds back: the engine fills them in at submission (the model's eos
    /// ids unless the request ignores eos, and the request's stop ids).
    pub min_tokens_ids: Vec<u32>,
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
            logit_bias: Vec::new(),
            min_tokens: 0,
            min_tokens_ids: Vec::new(),
        }
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
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 2.0) {
            return bad(format!("repetition_penalty must be in (0, 2], got {}", self.repetition_penalty));
        }
        for (name, v) in [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if let Some((t, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return bad(format!("logit_bias of token {t} must be in [-100, 100], got {b}"));
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
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// This step's choice for one row: the parameters and, unless greedy, a fresh uniform
    /// number (greedy steps draw none).
    pub fn row(&mut self) -> RowSampling {
        let p = &self.params;
        let mut row =
            RowSampling { temperature: p.temperature, top_k: p.top_k, top_p: p.top_p, min_p: p.min_p, u: 0.0 };
        if !row.is_greedy() {
            row.u = (self.next_u64() >> 40) as f32 / (1u32 << 24) as f32;
        }
        row
    }

    /// Chooses a token from one row of logits (draws this step's number, then [`pick`]).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        pick(logits, &self.row())
    }
}

/// One logits row's sampling parameters and this step's uniform number: what a backend needs
/// to choose the token on its device (`kernels/sample.cuh`) or the host (`pick`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    /// Softmax temperature; 0 is greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens that holds this much of the mass.
    pub top_p: f32,
    /// Keep tokens at least this likely relative to the top one.
    pub min_p: f32,
    /// Uniform in [0, 1): where in the kept mass the token lies.
    pub u: f32,
}

impl RowSampling {
    /// Greedy: the argmax, whatever `u`.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// The five numbers the device kernel reads (top_k clamped to the vocabulary).
    pub fn to_device(&self, vocab: usize) -> [f32; 5] {
        [self.temperature, self.top_k.min(vocab) as f32, self.top_p, self.min_p, self.u]
    }
}

/// One token's change to its logit before a choice: `x' = (x > 0 ? x / div : x * mul) + add`
/// (HF's repetition penalty, then OpenAI's frequency and presence penalties, `logit_bias`, and
/// a ban as `add = -inf`), computed with single correctly rounded operations: the device
/// (`adjust_logits` in `kernels/sample.cuh`) gets the same bits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adjust {
    /// The token.
    pub token: u32,
    /// Divides a positive logit.
    pub div: f32,
    /// Multiplies a logit that is not positive.
    pub mul: f32,
    /// Added after.
    pub add: f32,
}

impl Adjust {
    /// The adjusted logit.
    pub fn apply(&self, x: f32) -> f32 {
        (if x > 0.0 { x / self.div } else { x * self.mul }) + self.add
    }

    /// The five numbers the device reads: row, token, div, mul, add (row and token exact in
    /// f32 below 2^24).
    pub fn to_device(&self, row: usize) -> [f32; 5] {
        [row as f32, self.token as f32, self.div, self.mul, self.add]
    }
}

/// `logits` with `adjust` applied (tokens outside the row are skipped).
pub fn adjusted(logits: &[f32], adjust: &[Adjust]) -> Vec<f32> {
    let mut l = logits.to_vec();
    for a in adjust {
        if let Some(x) = l.get_mut(a.token as usize) {
            *x = a.apply(*x);
        }
    }
    l
}

/// exp(x) for x <= 0 (0 below -87) from correctly rounded IEEE operations only: the very
/// operations, in the same order on the same constants, of `exp_det` in `kernels/sample.cuh`,
/// so that the device and the host compute the same bits of every p and so keep and pick the
/// same tokens (`f32::exp` and CUDA's `__expf` differ in the last bits, which flipped about one
/// row in 900 at a top-p boundary). Range reduction by ln 2 in two parts, a degree-6 Taylor
/// polynomial (within 2 ulp of exp), the power of two set in the exponent.
pub fn exp_det(x: f32) -> f32 {
    if x < -87.0 {
        return 0.0;
    }
    let n = (x * f32::from_bits(0x3fb8_aa3b)).round_ties_even();
    let r = n.mul_add(-f32::from_bits(0x3f31_7200), x);
    let r = n.mul_add(-f32::from_bits(0x35bf_be8e), r);
    let mut p = f32::from_bits(0x3ab6_0b61);
    for c in [0x3c08_8889, 0x3d2a_aaab, 0x3e2a_aaab, 0x3f00_0000, 0x3f80_0000, 0x3f80_0000] {
        p = p.mul_add(r, f32::from_bits(c));
    }
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Mass of a probability relative to the top token's, in fixed point (so that sums do not
/// depend on the order of addition).
fn mass(p: f32) -> u64 {
    (p * (1u64 << 40) as f32) as u64
}

/// Chooses a token from one row of logits: greedy, or the rule of `kernels/sample.cuh` (the
/// device kernel), to the same numbers. With m the largest logit, p = exp((l - m) / T); the kept
/// tokens are those at or above the largest of: the k-th largest p (top_k), the largest p whose
/// tokens at or above it hold top_p of the top-k mass (top_p), and min_p; the token is the kept
/// one, in id order, where the running mass passes `u` times the kept mass.
pub fn pick(logits: &[f32], row: &RowSampling) -> u32 {
    if row.is_greedy() || logits.is_empty() {
        return Sampler::argmax(logits);
    }
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let inv_t = 1.0 / row.temperature;
    let p: Vec<f32> = logits.iter().map(|&l| if l == m { 1.0 } else { exp_det((l - m) * inv_t) }).collect();
    let mut thr = row.min_p.to_bits();
    let top_k = if row.top_k > 0 && row.top_k < p.len() { row.top_k } else { 0 };
    if top_k > 0 || row.top_p < 1.0 {
        thr = thr.max(top_k_top_p(&p, top_k, row.top_p));
    }
    let kept = || p.iter().enumerate().filter(|(_, x)| x.to_bits() >= thr);
    let total: u64 = kept().map(|(_, &x)| mass(x)).sum();
    let r = ((row.u as f64 * total as f64) as u64).min(total.saturating_sub(1));
    let mut acc = 0;
    for (i, &x) in kept() {
        acc += mass(x);
        if r < acc {
            return i as u32;
        }
    }
    Sampler::argmax(logits)
}

/// The top_k threshold, then the top_p one within it (bits of p; see [`pick`]).
fn top_k_top_p(p: &[f32], top_k: usize, top_p: f32) -> u32 {
    let desc = |a: &u32, b: &u32| b.cmp(a);
    let mut bits: Vec<u32> = p.iter().map(|x| x.to_bits()).collect();
    let mut thr = 0;
    if top_k > 0 {
        bits.select_nth_unstable_by(top_k - 1, desc);
        thr = bits[top_k - 1];
        bits.retain(|&b| b >= thr);
    }
    if top_p < 1.0 {
        bits.sort_unstable_by(desc);
        let total: u64 = bits.iter().map(|&b| mass(f32::from_bits(b))).sum();
        let need = ((top_p as f64 * total as f64) as u64).max(1);
        let mut acc = 0;
        for (i, &b) in bits.iter().enumerate() {
            acc += mass(f32::from_bits(b));
            // Tokens of equal p are kept together: stop after the last of them.
            if acc >= need && bits.get(i + 1) != Some(&b) {
                return thr.max(b);
            }
        }
    }
    thr
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

    /// This step's changes to the raw logits, one per token they touch, by token: the
    /// repetition penalty of tokens in the prompt or the output, the frequency and presence
    /// penalties of generated tokens, `logit_bias`, and `min_tokens`' bans. Empty for most
    /// requests. Every backend applies them the same way ([`Adjust::apply`]) before choosing,
    /// on its device or the host.
    pub fn adjustments(&self) -> Vec<Adjust> {
        fn at(adj: &mut std::collections::BTreeMap<u32, Adjust>, t: u32) -> &mut Adjust {
            adj.entry(t).or_insert(Adjust { token: t, div: 1.0, mul: 1.0, add: 0.0 })
        }
        let p = &self.sampler.params;
        let mut adj = std::collections::BTreeMap::new();
        let rep = p.repetition_penalty;
        if rep != 1.0 {
            for &t in self.prompt.iter().chain(self.counts.keys()) {
                let a = at(&mut adj, t);
                (a.div, a.mul) = (rep, rep);
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &c) in &self.counts {
                at(&mut adj, t).add -= p.frequency_penalty * c as f32 + p.presence_penalty;
            }
        }
        for &(t, b) in &p.logit_bias {
            at(&mut adj, t).add += b;
        }
        if self.holding_back() {
            for &t in &p.min_tokens_ids {
                at(&mut adj, t).add = f32::NEG_INFINITY;
            }
        }
        adj.into_values().collect()
    }

    /// Whether `min_tokens` still holds its ids back.
    fn holding_back(&self) -> bool {
        let p = &self.sampler.params;
        !p.min_tokens_ids.is_empty() && (self.counts.values().sum::<u32>() as usize) < p.min_tokens
    }

    /// This step's parameters and uniform number (see [`Sampler::row`]); draw once per step.
    pub fn row(&mut self) -> RowSampling {
        self.sampler.row()
    }

    /// Records a token chosen elsewhere (on a device) by this step's `row()`.
    pub fn record(&mut self, token: u32) {
        *self.counts.entry(token).or_insert(0) += 1;
    }

    /// Chooses the next token from `logits` after this step's `adjust` (its
    /// [`RequestSampler::adjustments`]) by this step's `row` and records it; with `logprobs =
    /// Some(n)` also returns the chosen token's log-probability and the top `n`.
    pub fn choose(
        &mut self,
        logits: &[f32],
        row: &RowSampling,
        adjust: &[Adjust],
        logprobs: Option<usize>,
    ) -> (u32, Option<Logprobs>) {
        let token = if adjust.is_empty() { pick(logits, row) } else { pick(&adjusted(logits, adjust), row) };
        self.record(token);
        (token, logprobs.map(|n| log_probs(logits, token, n)))
    }

    /// Draws this step's number and chooses (`row`, then `choose`).
    pub fn next(&mut self, logits: &[f32], logprobs: Option<usize>) -> (u32, Option<Logprobs>) {
        let row = self.row();
        let adjust = self.adjustments();
        self.choose(logits, &row, &adjust, logprobs)
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

    /// One adjustment per token, whatever changes it: the repetition penalty, then the
    /// frequency and presence penalties, then the bias; a ban wins.
    #[test]
    fn adjustments_combine_per_token() {
        let params = SamplingParams {
            temperature: 1.0,
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            logit_bias: vec![(3, 1.0), (9, -2.0)],
            min_tokens: 5,
            min_tokens_ids: vec![9],
            ..Default::default()
        };
        let mut s = RequestSampler::new(params, &[7]).unwrap();
        s.record(3);
        s.record(3);
        let a = s.adjustments();
        let by = |t: u32| *a.iter().find(|a| a.token == t).unwrap();
        assert_eq!(a.iter().map(|a| a.token).collect::<Vec<_>>(), [3, 7, 9]);
        assert_eq!(by(3), Adjust { token: 3, div: 2.0, mul: 2.0, add: -1.25 + 1.0 });
        assert_eq!(by(7), Adjust { token: 7, div: 2.0, mul: 2.0, add: 0.0 });
        assert_eq!(by(9).add, f32::NEG_INFINITY);
        assert_eq!(by(3).apply(4.0), 2.0 - 0.25);
        assert_eq!(by(3).apply(-4.0), -8.0 - 0.25);
        assert_eq!(adjusted(&[1.0; 10], &a)[9], f32::NEG_INFINITY);
    }

    /// exp_det is exp to within 2 ulp over the range sampling uses, 1 at 0, 0 far below.
    #[test]
    fn exp_det_is_exp() {
        let mut worst = 0.0f64;
        for k in 0..=870_000 {
            let x = -(k as f32) * 1e-4;
            let (got, want) = (exp_det(x) as f64, (x as f64).exp());
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
        assert_eq!(exp_det(0.0), 1.0);
        assert_eq!(exp_det(-0.0), 1.0);
        assert_eq!(exp_det(-88.0), 0.0);
    }

    /// The bits the device's `exp_det` (kernels/sample.cuh) computes for the same inputs: the
    /// two are one rule, so a change to either side must change both (and this table).
    #[test]
    fn exp_det_bits_are_pinned() {
        let got: Vec<u32> = [-0.5f32, -1.0, -3.25, -10.0, -40.0, -86.9].iter().map(|&x| exp_det(x).to_bits()).collect();
        let want: [u32; 6] = [0x3f1b_4598, 0x3ebc_5ab3, 0x3d1e_d1b4, 0x383e_6bce, 0x229c_bc92, 0x00c6_0f89];
        assert_eq!(got, want, "{:x?}", got);
    }

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

    /// The kept set by the textbook rule (sort by probability, top-k, the smallest prefix that
    /// reaches top-p of the top-k mass, min-p), in f64.
    fn kept_by_sorting(logits: &[f32], r: &RowSampling) -> Vec<u32> {
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let mut p: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l as f64 - m) / r.temperature as f64).exp()))
            .collect();
        p.sort_by(|a, b| b.1.total_cmp(&a.1));
        if r.top_k > 0 {
            p.truncate(r.top_k);
        }
        let total: f64 = p.iter().map(|x| x.1).sum();
        let (mut acc, mut keep) = (0.0, 0);
        while keep < p.len() && (keep == 0 || acc < r.top_p as f64 * total) {
            acc += p[keep].1;
            keep += 1;
        }
        p.truncate(keep);
        p.retain(|x| x.1 >= r.min_p as f64);
        let mut ids: Vec<u32> = p.into_iter().map(|x| x.0).collect();
        ids.sort();
        ids
    }

    #[test]
    fn pick_keeps_what_sorting_keeps() {
        let mut rng = Sampler::new(SamplingParams { temperature: 1.0, seed: 3, ..Default::default() }).unwrap();
        for case in 0..40 {
            let vocab = 50 + case * 7;
            let logits: Vec<f32> = (0..vocab).map(|_| (rng.uniform() * 8.0 - 4.0) as f32).collect();
            let r = RowSampling {
                temperature: [0.5, 1.0, 1.7][case % 3],
                top_k: [0, 1 + case % 9, 40][case % 3],
                top_p: [1.0, 0.9, 0.5, 0.97][case % 4],
                min_p: [0.0, 0.0, 0.05][case % 3],
                u: 0.0,
            };
            let kept = kept_by_sorting(&logits, &r);
            // u on a fine grid reaches only kept tokens, and every one it can (a share of the
            // kept mass above the grid's step).
            let grid = 20_000;
            let mut seen: Vec<u32> =
                (0..grid).map(|i| pick(&logits, &RowSampling { u: i as f32 / grid as f32, ..r })).collect();
            seen.sort();
            seen.dedup();
            assert!(seen.iter().all(|t| kept.contains(t)), "case {case}: {r:?}: {seen:?} not in {kept:?}");
            let p =
                |t: u32| ((logits[t as usize] - logits.iter().copied().fold(f32::MIN, f32::max)) / r.temperature).exp();
            let mass: f32 = kept.iter().map(|&t| p(t)).sum();
            let reachable = kept.iter().filter(|&&t| p(t) / mass > 2.0 / grid as f32);
            assert!(
                reachable.clone().all(|t| seen.contains(t)),
                "case {case}: {r:?}: {seen:?} misses some of {kept:?}"
            );
            assert!(reachable.count() > 0);
        }
    }

    #[test]
    fn pick_follows_the_probabilities() {
        // p = 1, 1/2, 1/4, 1/8 at temperature 1: u splits [0, 1) by mass, in id order.
        let l = [0.0f32, -std::f32::consts::LN_2, -2.0 * std::f32::consts::LN_2, -3.0 * std::f32::consts::LN_2];
        let r = RowSampling { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, u: 0.0 };
        let at = |u: f32| pick(&l, &RowSampling { u, ..r });
        assert_eq!(
            [at(0.0), at(0.53), at(0.54), at(0.79), at(0.81), at(0.93), at(0.94), at(0.999)],
            [0, 0, 1, 1, 2, 2, 3, 3]
        );
        // top_p 0.5 of 1.875: the top token alone holds 0.53 of it.
        assert_eq!(pick(&l, &RowSampling { top_p: 0.5, u: 0.99, ..r }), 0);
        assert_eq!(pick(&l, &RowSampling { top_p: 0.6, u: 0.99, ..r }), 1);
        assert_eq!(pick(&l, &RowSampling { min_p: 0.2, u: 0.99, ..r }), 2);
        assert_eq!(pick(&l, &RowSampling { top_k: 2, u: 0.99, ..r }), 1);
        assert_eq!(pick(&l, &RowSampling { temperature: 0.0, u: 0.99, ..r }), 0);
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

    /// A bias of -100 bans the greedy token, +100 forces a token, in greedy and in sampled
    /// choices; the logprobs stay those of the raw logits.
    #[test]
    fn logit_bias_bans_and_forces() {
        let logits = [2.0, 1.9, 0.0, -1.0];
        let ban = SamplingParams { logit_bias: vec![(0, -100.0)], ..Default::default() };
        let mut s = RequestSampler::new(ban, &[]).unwrap();
        assert!(!s.adjustments().is_empty(), "a biased request adjusts the step's logits");
        let (t, lp) = s.next(&logits, Some(1));
        assert_eq!(t, 1, "token 0 is banned");
        assert_eq!(lp.unwrap().top[0].0, 0, "logprobs are the raw logits'");
        for seed in 0..20 {
            let force = SamplingParams { logit_bias: vec![(3, 100.0)], temperature: 1.0, seed, ..Default::default() };
            assert_eq!(RequestSampler::new(force, &[]).unwrap().next(&logits, None).0, 3, "seed {seed}");
        }
        assert!(Sampler::new(SamplingParams { logit_bias: vec![(1, 101.0)], ..Default::default() }).is_err());
    }

    /// `min_tokens` holds its ids back until that many tokens were generated, then lets them.
    #[test]
    fn min_tokens_holds_back_eos() {
        let logits = [0.0, 5.0, 1.0];
        let p = SamplingParams { min_tokens: 2, min_tokens_ids: vec![1], ..Default::default() };
        let mut s = RequestSampler::new(p, &[]).unwrap();
        assert!(!s.adjustments().is_empty());
        assert_eq!(s.next(&logits, None).0, 2, "eos (1) held back at the first token");
        assert_eq!(s.next(&logits, None).0, 2, "and at the second");
        assert!(s.adjustments().is_empty(), "free after two tokens");
        assert_eq!(s.next(&logits, None).0, 1);
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
