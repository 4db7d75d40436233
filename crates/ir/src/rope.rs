//! Rotary position embedding: frequencies for every scaling type that HF configs name.

use crate::IrError;
use serde::{Deserialize, Serialize};

/// RoPE scaling, as `rope_scaling` (transformers 4.x) or `rope_parameters` (5.x) describe it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        /// Scale for low frequencies.
        factor: f64,
        /// Wavelength threshold factor for low frequencies.
        low_freq_factor: f64,
        /// Wavelength threshold factor for high frequencies.
        high_freq_factor: f64,
        /// Context length the model was trained with.
        original_max_positions: f64,
    },
    /// YaRN.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// Context length the model was trained with.
        original_max_positions: f64,
        /// Fast boundary of the ramp (rotations).
        beta_fast: f64,
        /// Slow boundary of the ramp (rotations).
        beta_slow: f64,
        /// Multiplier applied to cos and sin.
        attention_factor: f64,
        /// Whether the ramp's ends are rounded to whole dimensions (`truncate`, true unless a
        /// config says false, as gpt-oss's do).
        #[serde(default = "yes", skip_serializing_if = "is_true")]
        truncate: bool,
    },
    /// LongRoPE (Phi-3's `longrope`, formerly `su`): frequency `i` divided by `factors[i]`, cos
    /// and sin multiplied by `attention_factor`.
    ///
    /// The config carries two lists, `short_factor` and `long_factor`. HF transformers picks
    /// per forward call: the long list when the call's highest position + 1 exceeds
    /// `original_max_position_embeddings`, the short one otherwise, so one sequence's cached keys
    /// can mix both. vLLM and SGLang keep both tables and pick per batch (the long one for every
    /// token when any position of the batch exceeds the original length). A paged KV cache that
    /// outlives steps needs one table for every position, so this holds one list, chosen when
    /// the config is read: the long factors when `max_position_embeddings` exceeds
    /// `original_max_position_embeddings` (the long-context releases, which are meant to be
    /// served past the original length), else the short ones. Outputs equal HF's for sequences
    /// longer than the original length in the first case and no longer than it in the second;
    /// a long-context model given only short prompts differs from HF (which then uses the short
    /// factors).
    #[serde(rename = "longrope")]
    LongRope {
        /// Per-frequency divisors (`head_dim / 2` of them).
        factors: Vec<f64>,
        /// Multiplier applied to cos and sin.
        attention_factor: f64,
    },
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

fn field(cfg: &serde_json::Value, key: &str) -> Option<f64> {
    cfg.get(key).and_then(serde_json::Value::as_f64)
}

fn number_list(cfg: &serde_json::Value, key: &str) -> Option<Vec<f64>> {
    cfg.get(key)?.as_array()?.iter().map(serde_json::Value::as_f64).collect()
}

/// LongRoPE's default attention factor: `sqrt(1 + ln(factor) / ln(original_max_positions))`.
fn longrope_mscale(factor: f64, original_max_positions: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        (1.0 + factor.ln() / original_max_positions.ln()).sqrt()
    }
}

fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeScaling {
    /// Reads the scaling from a config object (`rope_scaling` or `rope_parameters`); null means
    /// [`RopeScaling::Default`]. `max_positions` is `max_position_embeddings`, used where the
    /// config omits the original context length (and by `longrope` to pick its factors);
    /// `head_dim` is the size of a rotated head (a `longrope` list has `head_dim / 2` entries).
    pub fn from_config(
        cfg: &serde_json::Value,
        max_positions: Option<f64>,
        head_dim: usize,
    ) -> Result<RopeScaling, IrError> {
        if cfg.is_null() {
            return Ok(RopeScaling::Default);
        }
        let kind = cfg.get("rope_type").or_else(|| cfg.get("type")).and_then(|v| v.as_str()).unwrap_or("default");
        let bad = |message: String| IrError::Attr { op: "rope".into(), message };
        let need =
            |key: &str| field(cfg, key).ok_or_else(|| bad(format!("rope scaling `{kind}` needs `{key}` in {cfg}")));
        let orig = || {
            field(cfg, "original_max_position_embeddings")
                .or(max_positions)
                .ok_or_else(|| bad(format!("rope scaling `{kind}` needs original_max_position_embeddings")))
        };
        Ok(match kind {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear { factor: need("factor")? },
            "llama3" => RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_positions: orig()?,
            },
            "yarn" => {
                let factor = need("factor")?;
                let attention_factor = match field(cfg, "attention_factor") {
                    Some(a) => a,
                    None => match (field(cfg, "mscale"), field(cfg, "mscale_all_dim")) {
                        (Some(m), Some(all)) => yarn_mscale(factor, m) / yarn_mscale(factor, all),
                        _ => yarn_mscale(factor, 1.0),
                    },
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_positions: orig()?,
                    beta_fast: field(cfg, "beta_fast").unwrap_or(32.0),
                    beta_slow: field(cfg, "beta_slow").unwrap_or(1.0),
                    attention_factor,
                    truncate: cfg.get("truncate").and_then(serde_json::Value::as_bool).unwrap_or(true),
                }
            }
            "longrope" | "su" => {
                let orig = orig()?;
                let max = max_positions.unwrap_or(orig);
                let key = if max > orig { "long_factor" } else { "short_factor" };
                let factors = number_list(cfg, key)
                    .ok_or_else(|| bad(format!("rope scaling `{kind}` needs `{key}` (a list of numbers) in {cfg}")))?;
                if factors.len() != head_dim / 2 || factors.iter().any(|&f| f <= 0.0 || !f.is_finite()) {
                    return Err(bad(format!(
                        "rope scaling `{kind}`: `{key}` must be {} positive numbers (head_dim {head_dim} / 2), got {factors:?}",
                        head_dim / 2
                    )));
                }
                let factor = field(cfg, "factor").unwrap_or(max / orig);
                let attention_factor = field(cfg, "attention_factor").unwrap_or_else(|| longrope_mscale(factor, orig));
                RopeScaling::LongRope { factors, attention_factor }
            }
            other => {
                return Err(bad(format!(
                    "unsupported rope scaling type `{other}` (supported: default, linear, llama3, yarn, longrope)"
                )))
            }
        })
    }

    /// The inverse frequencies (`head_dim / 2` of them) and the factor applied to cos and sin.
    pub fn inv_freq(&self, head_dim: usize, theta: f64) -> (Vec<f64>, f64) {
        let half = head_dim / 2;
        let base: Vec<f64> = (0..half).map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64)).collect();
        match *self {
            RopeScaling::Default => (base, 1.0),
            RopeScaling::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_positions } => {
                let low_wavelen = original_max_positions / low_freq_factor;
                let high_wavelen = original_max_positions / high_freq_factor;
                let out = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (original_max_positions / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (out, 1.0)
            }
            RopeScaling::Yarn { factor, original_max_positions, beta_fast, beta_slow, attention_factor, truncate } => {
                let d = head_dim as f64;
                let correction = |rot: f64| {
                    d * (original_max_positions / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
                };
                let (low, high) = (correction(beta_fast), correction(beta_slow));
                let (low, high) = if truncate { (low.floor(), high.ceil()) } else { (low, high) };
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001;
                }
                let out = base
                    .iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        (f / factor) * (1.0 - extrapolation) + f * extrapolation
                    })
                    .collect();
                (out, attention_factor)
            }
            RopeScaling::LongRope { ref factors, attention_factor } => {
                // from_config checked the length; a missing factor (a hand-made plan) leaves the
                // frequency as it is.
                let out = base.iter().enumerate().map(|(i, &f)| f / factors.get(i).copied().unwrap_or(1.0)).collect();
                (out, attention_factor)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_both_config_styles() {
        let v4 = json!({"type": "linear", "factor": 2.0});
        assert_eq!(RopeScaling::from_config(&v4, None, 128).unwrap(), RopeScaling::Linear { factor: 2.0 });
        let v5 = json!({"rope_type": "default", "rope_theta": 100000.0});
        assert_eq!(RopeScaling::from_config(&v5, None, 128).unwrap(), RopeScaling::Default);
        let bad = json!({"rope_type": "dynamic-ish", "factor": 2.0});
        let err = RopeScaling::from_config(&bad, None, 128).unwrap_err().to_string();
        assert!(err.contains("unsupported rope scaling"), "{err}");
        let missing = json!({"rope_type": "llama3", "factor": 8.0});
        assert!(RopeScaling::from_config(&missing, None, 128).unwrap_err().to_string().contains("low_freq_factor"));
    }

    #[test]
    fn llama3_keeps_high_and_scales_low_frequencies() {
        let s = RopeScaling::from_config(
            &json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
            None,
            128,
        )
        .unwrap();
        let (base, _) = RopeScaling::Default.inv_freq(128, 500000.0);
        let (f, att) = s.inv_freq(128, 500000.0);
        assert_eq!(att, 1.0);
        assert_eq!(f[0], base[0]); // wavelength 2π < 2048: unchanged
        assert!((f[63] - base[63] / 8.0).abs() < 1e-15); // longest wavelength: divided by factor
        assert!(f.windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn longrope_picks_its_factors_by_context_length() {
        let cfg = json!({"rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [4.0, 8.0], "original_max_position_embeddings": 1024});
        let (base, _) = RopeScaling::Default.inv_freq(4, 1e4);
        // A long-context release (max 4096 > original 1024): long factors, factor 4.
        let long = RopeScaling::from_config(&cfg, Some(4096.0), 4).unwrap();
        let (f, att) = long.inv_freq(4, 1e4);
        assert_eq!(f, vec![base[0] / 4.0, base[1] / 8.0]);
        assert!((att - (1.0 + 4f64.ln() / 1024f64.ln()).sqrt()).abs() < 1e-15, "{att}");
        // max == original: short factors, no attention scaling.
        let (f, att) = RopeScaling::from_config(&cfg, Some(1024.0), 4).unwrap().inv_freq(4, 1e4);
        assert_eq!((f, att), (vec![base[0], base[1] / 2.0], 1.0));
        // `factor` and `attention_factor` win over the ratio of the context lengths; `su` is
        // the old name.
        let mut given = cfg.clone();
        given["type"] = json!("su");
        given.as_object_mut().unwrap().remove("rope_type");
        given["factor"] = json!(16.0);
        let (_, att) = RopeScaling::from_config(&given, Some(4096.0), 4).unwrap().inv_freq(4, 1e4);
        assert!((att - (1.0 + 16f64.ln() / 1024f64.ln()).sqrt()).abs() < 1e-15, "{att}");
        given["attention_factor"] = json!(1.5);
        assert_eq!(RopeScaling::from_config(&given, Some(4096.0), 4).unwrap().inv_freq(4, 1e4).1, 1.5);
        // Lists of the wrong length or with non-positive entries are errors naming the key.
        let err = RopeScaling::from_config(&cfg, Some(4096.0), 8).unwrap_err().to_string();
        assert!(err.contains("`long_factor` must be 4 positive numbers"), "{err}");
        let mut zero = cfg.clone();
        zero["short_factor"] = json!([1.0, 0.0]);
        let err = RopeScaling::from_config(&zero, Some(1024.0), 4).unwrap_err().to_string();
        assert!(err.contains("`short_factor` must be 2 positive numbers"), "{err}");
        zero.as_object_mut().unwrap().remove("short_factor");
        let err = RopeScaling::from_config(&zero, Some(1024.0), 4).unwrap_err().to_string();
        assert!(err.contains("needs `short_factor`"), "{err}");
    }

    #[test]
    fn yarn_ramps_between_extrapolation_and_interpolation() {
        let s = RopeScaling::from_config(
            &json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
            None,
            128,
        )
        .unwrap();
        let (base, _) = RopeScaling::Default.inv_freq(128, 1e6);
        let (f, att) = s.inv_freq(128, 1e6);
        assert!((att - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        assert_eq!(f[0], base[0]);
        assert!((f[63] - base[63] / 4.0).abs() < 1e-18);
    }
}
