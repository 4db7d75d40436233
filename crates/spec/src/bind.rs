//! Binding a [`ModelSpec`] to a checkpoint's `config.json`: parameters get values, weights get
//! concrete names and shapes.

use crate::expr::parse_expr;
use crate::model::{scalar_text, ModelSpec, ParamSpec, ShardKind, WeightSpec};
use crate::value::{eval, Value};
use crate::SpecError;

/// A model spec with every parameter and weight shape made concrete.
#[derive(Debug, Clone)]
pub struct BoundModel {
    /// The spec that was bound.
    pub spec: ModelSpec,
    /// Parameter values in declaration order.
    pub params: Vec<(String, Value)>,
    /// Number of layers (the `layers` parameter).
    pub layers: usize,
    /// Every weight that exists for this config (global ones first, then per layer).
    pub weights: Vec<BoundWeight>,
    /// Weight keys that do not exist for this config but stand for another (`tied_to`).
    pub aliases: Vec<(String, String)>,
}

/// A weight with its concrete checkpoint name and shape.
#[derive(Debug, Clone, PartialEq)]
pub struct BoundWeight {
    /// YAML key (`q`, `embed`).
    pub key: String,
    /// Layer index for per-layer weights.
    pub layer: Option<usize>,
    /// The weight's name in the plan and the bundle: the checkpoint tensor's (`*` for the
    /// expert's index of a stack of per-expert tensors), or for rows of a fused tensor
    /// `TENSOR[start:end]` (`TENSOR[start:end:step]`).
    pub name: String,
    /// The checkpoint tensor it is read from.
    pub tensor: String,
    /// The rows of `tensor` it holds (a part of a fused tensor), when not all of them.
    pub rows: Option<Rows>,
    /// The number of experts of a stack of them (the shape's first dimension), and whether
    /// the checkpoint holds one tensor per expert (`tensor` then holds `{e}`).
    pub experts: Option<(usize, bool)>,
    /// Whether the checkpoint stores each matrix transposed.
    pub transposed: bool,
    /// Full (unsharded) shape.
    pub shape: Vec<usize>,
    /// Tensor-parallel split.
    pub shard: ShardKind,
    /// Split in units of this many heads (see [`WeightSpec::shard_heads`]).
    pub shard_heads: Option<usize>,
}

/// Rows `start..end`, every `step`-th, of a checkpoint tensor (of each expert's matrix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    /// The first row.
    pub start: usize,
    /// One past the last row.
    pub end: usize,
    /// The distance between rows.
    pub step: usize,
}

impl Rows {
    /// How many rows.
    pub fn count(&self) -> usize {
        (self.end - self.start).div_ceil(self.step)
    }
}

impl BoundWeight {
    /// The dimension of the shape that holds each matrix's rows: 1 for a stack of experts, 0
    /// otherwise.
    pub fn row_dim(&self) -> usize {
        usize::from(self.experts.is_some())
    }

    /// The checkpoint tensor of expert `e` (the stacked tensor itself when it is not stored
    /// per expert).
    pub fn tensor_of(&self, e: usize) -> String {
        self.tensor.replace("{e}", &e.to_string())
    }
}

impl BoundModel {
    /// The value of a parameter.
    pub fn param(&self, name: &str) -> Option<&Value> {
        self.params.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// Finds a weight by YAML key and layer, following `tied_to` aliases.
    pub fn weight(&self, key: &str, layer: Option<usize>) -> Option<&BoundWeight> {
        let key = self.aliases.iter().find(|(k, _)| k == key).map_or(key, |(_, t)| t.as_str());
        let per_layer = self.spec.per_layer_weights.iter().any(|(k, _)| k == key);
        let layer = if per_layer { layer } else { None };
        self.weights.iter().find(|w| w.key == key && w.layer == layer)
    }

    /// Whether `key` names a weight in the spec (existing for this config or not).
    pub fn declares_weight(&self, key: &str) -> bool {
        let s = &self.spec;
        s.weights.iter().chain(&s.per_layer_weights).any(|(k, _)| k == key)
    }
}

/// Looks up a dotted path (`rope_parameters.rope_theta`) in a JSON object.
fn json_path<'a>(config: &'a serde_json::Value, path: &str) -> Option<&'a serde_json::Value> {
    path.split('.').try_fold(config, |v, part| v.get(part)).filter(|v| !v.is_null())
}

/// Binds `spec` to `config` (the parsed config.json).
pub fn bind(spec: &ModelSpec, config: &serde_json::Value) -> Result<BoundModel, SpecError> {
    if let Some(archs) = config.get("architectures").and_then(|a| a.as_array()) {
        let names: Vec<&str> = archs.iter().filter_map(|a| a.as_str()).collect();
        if !spec.architectures.is_empty() && !names.iter().any(|n| spec.architectures.iter().any(|a| a == n)) {
            return Err(SpecError::Architecture {
                origin: spec.origin.clone(),
                config: names.join(", "),
                supported: spec.architectures.join(", "),
            });
        }
    }
    let mut params: Vec<(String, Value)> = Vec::new();
    for (name, p) in &spec.params {
        let v = bind_param(spec, name, p, config, &params)?;
        params.push((name.clone(), v));
    }
    let lookup = |n: &str| params.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let layers = lookup("layers").and_then(|v| v.as_usize()).ok_or_else(|| SpecError::Schema {
        at: spec.origin.clone(),
        message: "params must define `layers` (the number of layers) as a non-negative integer".into(),
    })?;
    let mut bound =
        BoundModel { spec: spec.clone(), params: params.clone(), layers, weights: Vec::new(), aliases: Vec::new() };
    for (key, w) in &spec.weights {
        if let Some(bw) = bind_weight(spec, key, w, None, &lookup, &mut bound.aliases)? {
            bound.weights.push(bw);
        }
    }
    for layer in 0..layers {
        // A per-layer weight's expressions may read the layer's index `i`.
        let at_layer = |n: &str| if n == "i" { Some(Value::Int(layer as i64)) } else { lookup(n) };
        for (key, w) in &spec.per_layer_weights {
            let mut aliases = Vec::new();
            if let Some(bw) = bind_weight(spec, key, w, Some(layer), &at_layer, &mut aliases)? {
                bound.weights.push(bw);
            }
            if layer == 0 {
                bound.aliases.extend(aliases);
            }
        }
    }
    Ok(bound)
}

fn bind_param(
    spec: &ModelSpec,
    name: &str,
    p: &ParamSpec,
    config: &serde_json::Value,
    earlier: &[(String, Value)],
) -> Result<Value, SpecError> {
    let at = spec.locate(&format!("{name}:"));
    let eval_text = |text: &str| -> Result<Value, SpecError> {
        let e = parse_expr(text).map_err(|e| SpecError::Param {
            at: at.clone(),
            param: name.to_string(),
            message: e.to_string(),
        })?;
        let lookup = |n: &str| earlier.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
        eval(&e, &lookup).map_err(|message| SpecError::Param {
            at: at.clone(),
            param: name.to_string(),
            message: format!("{message} in `{text}`"),
        })
    };
    match p {
        ParamSpec::Expr(text) => eval_text(text),
        ParamSpec::Config { keys, default } => {
            if let Some(v) = keys.iter().find_map(|k| json_path(config, k)) {
                return Ok(Value::from_json(v));
            }
            match default {
                Some(d) => eval_text(d),
                None => Err(SpecError::MissingConfigKey { at, param: name.to_string(), keys: keys.join(" or ") }),
            }
        }
    }
}

fn bind_weight(
    spec: &ModelSpec,
    key: &str,
    w: &WeightSpec,
    layer: Option<usize>,
    lookup: &dyn Fn(&str) -> Option<Value>,
    aliases: &mut Vec<(String, String)>,
) -> Result<Option<BoundWeight>, SpecError> {
    let at = spec.locate(&format!("{key}:"));
    let werr = |message: String| SpecError::Weight { at: at.clone(), weight: key.to_string(), message };
    let eval_text = |text: &str| -> Result<Value, SpecError> {
        let e = parse_expr(text).map_err(|e| werr(e.to_string()))?;
        eval(&e, lookup).map_err(|m| werr(format!("{m} in `{text}`")))
    };
    if let Some(cond) = &w.when {
        let v = eval_text(cond)?;
        let exists = v.as_bool().ok_or_else(|| werr(format!("`when: {cond}` is {v}, not a bool")))?;
        if !exists {
            if let Some(t) = &w.tied_to {
                aliases.push((key.to_string(), t.clone()));
            }
            return Ok(None);
        }
    }
    let mut shape = Vec::with_capacity(w.shape.len());
    for d in &w.shape {
        let text = scalar_text(d).ok_or_else(|| werr(format!("shape entry {d:?} is not an expression")))?;
        let v = eval_text(&text)?;
        shape.push(v.as_usize().ok_or_else(|| werr(format!("shape entry `{text}` is {v}, not a size")))?);
    }
    let shard_heads = match &w.shard_heads {
        None => None,
        Some(text) => {
            let v = eval_text(text)?;
            Some(v.as_usize().ok_or_else(|| werr(format!("shard_heads `{text}` is {v}, not a count")))?)
        }
    };
    let tensor = match layer {
        Some(i) => w.name.replace("{i}", &i.to_string()),
        None => w.name.clone(),
    };
    let experts = match &w.experts {
        None => None,
        Some(text) => {
            let v = eval_text(text)?;
            let n =
                v.as_usize().filter(|&n| n > 0).ok_or_else(|| werr(format!("experts `{text}` is {v}, not a count")))?;
            if shape.first() != Some(&n) {
                return Err(werr(format!("a stack of {n} experts needs a shape [{n}, ...], got {shape:?}")));
            }
            Some((n, tensor.contains("{e}")))
        }
    };
    if tensor.contains("{e}") && experts.is_none() {
        return Err(werr("`{e}` in a name needs `experts: COUNT`".into()));
    }
    let row_dim = usize::from(experts.is_some());
    if w.transposed && shape.len() != row_dim + 2 {
        return Err(werr(format!("`transposed` needs a matrix (of each expert), got the shape {shape:?}")));
    }
    let rows = match &w.rows {
        None => None,
        Some(r) => {
            let bound = |d: &serde_yaml::Value| -> Result<usize, SpecError> {
                let text = scalar_text(d).ok_or_else(|| werr(format!("rows entry {d:?} is not an expression")))?;
                let v = eval_text(&text)?;
                v.as_usize().ok_or_else(|| werr(format!("rows entry `{text}` is {v}, not a row index")))
            };
            let (start, end, step) = match r.as_slice() {
                [a, b] => (bound(a)?, bound(b)?, 1),
                [a, b, c] => (bound(a)?, bound(b)?, bound(c)?),
                _ => return Err(werr("rows must be [start, end] or [start, end, step]".into())),
            };
            let rows = Rows { start, end, step };
            let given = format!("rows [{start}, {end}, {step}]");
            if step == 0 || end <= start {
                return Err(werr(format!("{given}: the step must be at least 1 and the end past the start")));
            }
            if shape.get(row_dim) != Some(&rows.count()) {
                let has = shape.get(row_dim).map_or("does not exist".to_string(), |n| format!("has {n}"));
                return Err(werr(format!(
                    "{given} are {} rows, but dimension {row_dim} of the shape {shape:?} {has}",
                    rows.count()
                )));
            }
            Some(rows)
        }
    };
    let base = tensor.replace("{e}", "*");
    let name = match rows {
        Some(Rows { start, end, step: 1 }) => format!("{base}[{start}:{end}]"),
        Some(Rows { start, end, step }) => format!("{base}[{start}:{end}:{step}]"),
        None => base,
    };
    let transposed = w.transposed;
    Ok(Some(BoundWeight {
        key: key.to_string(),
        layer,
        name,
        tensor,
        rows,
        experts,
        transposed,
        shape,
        shard: w.shard,
        shard_heads,
    }))
}
