//! The model YAML schema, as it is written in `models/*.yaml`.

use crate::expr::{parse_statement, Statement};
use crate::SpecError;
use serde::Deserialize;

/// A model architecture, parsed from YAML but not yet bound to a checkpoint.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    /// Short name (`qwen2`).
    pub name: String,
    /// HF `architectures` entries this spec serves (matched against config.json).
    pub architectures: Vec<String>,
    /// Parameters in declaration order; later ones may refer to earlier ones.
    pub params: Vec<(String, ParamSpec)>,
    /// Global weights in declaration order.
    pub weights: Vec<(String, WeightSpec)>,
    /// Weights repeated per layer (`{i}` in their names is the layer index).
    pub per_layer_weights: Vec<(String, WeightSpec)>,
    /// The forward graph.
    pub graph: Vec<GraphItem>,
    /// Where the spec came from (a path, for error messages).
    pub origin: String,
    /// The YAML text, used to point errors at lines.
    pub source: String,
}

/// How a parameter gets its value.
#[derive(Debug, Clone, PartialEq)]
pub enum ParamSpec {
    /// Read from config.json: the first of `keys` (dotted paths) that is present, else
    /// `default` (an expression), else an error.
    Config {
        /// Alternative key paths, tried in order.
        keys: Vec<String>,
        /// Expression used when no key is present.
        default: Option<String>,
    },
    /// Computed from earlier parameters.
    Expr(String),
}

/// Tensor-parallel split of a weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ShardKind {
    /// Every rank holds the whole tensor.
    #[default]
    Replicated,
    /// Split along dim 0 (output features): column-parallel linear.
    Column,
    /// Split along the last dim (input features): row-parallel linear.
    Row,
}

/// A weight as declared in YAML.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightSpec {
    /// Tensor name in the checkpoint; `{i}` is replaced by the layer index.
    pub name: String,
    /// Shape expressions.
    pub shape: Vec<serde_yaml::Value>,
    /// Tensor-parallel split.
    #[serde(default)]
    pub shard: ShardKind,
    /// When set, the split is in units of this many heads: ranks beyond the head count share
    /// (replicate) heads, as SGLang does for KV heads.
    #[serde(default)]
    pub shard_heads: Option<String>,
    /// The weight exists only when this expression is true.
    #[serde(default)]
    pub when: Option<String>,
    /// When the weight does not exist (`when` is false), uses of it refer to this weight.
    #[serde(default)]
    pub tied_to: Option<String>,
    /// `[start, end]` or `[start, end, step]` (expressions): the weight is rows `start..end`
    /// (every `step`-th) of the checkpoint tensor, one part of a fused tensor (Phi-3's
    /// `qkv_proj`, `gate_up_proj`; gpt-oss's interleaved gate and up). Its `shape` is the
    /// part's, and `shard` splits the part. For a stack of experts, the rows of each expert.
    #[serde(default)]
    pub rows: Option<Vec<serde_yaml::Value>>,
    /// A stack of this many experts' tensors (shape `[experts, ...]`): one checkpoint tensor
    /// per expert when `name` holds `{e}` (the expert's index), else one stacked tensor.
    /// Column and row splits cut each expert's rows and columns.
    #[serde(default)]
    pub experts: Option<String>,
    /// The checkpoint stores each matrix transposed (`[k, n]` for the weight's `[n, k]`, as
    /// gpt-oss's expert stacks are).
    #[serde(default)]
    pub transposed: bool,
}

/// One entry of the `graph:` list.
#[derive(Debug, Clone)]
pub enum GraphItem {
    /// A statement run once.
    Stmt(Located<Statement>),
    /// Statements repeated for every layer, each where its condition holds.
    PerLayer(Vec<Guarded>),
}

/// A per-layer statement and the condition (an expression over the params and the layer's
/// index `i`) under which it runs: from `{ if: COND, then: [...], else: [...] }`.
#[derive(Debug, Clone)]
pub struct Guarded {
    /// Runs where this is true (`not (COND)` for an `else` branch); always when `None`.
    pub when: Option<String>,
    /// The statement.
    pub stmt: Located<Statement>,
}

/// A parsed item with the text and line it came from.
#[derive(Debug, Clone)]
pub struct Located<T> {
    /// The parsed value.
    pub value: T,
    /// The source text of the item.
    pub text: String,
    /// 1-based line in the YAML file, when found.
    pub line: Option<usize>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpec {
    name: String,
    #[serde(default)]
    architectures: Vec<String>,
    params: serde_yaml::Mapping,
    weights: serde_yaml::Mapping,
    graph: Vec<RawGraphItem>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawGraphItem {
    Stmt(String),
    PerLayer { per_layer: Vec<RawLayerItem> },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawLayerItem {
    Stmt(String),
    If {
        #[serde(rename = "if")]
        cond: String,
        then: Vec<String>,
        #[serde(default, rename = "else")]
        otherwise: Vec<String>,
    },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawKeys {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawParamObj {
    #[serde(default)]
    key: Option<RawKeys>,
    /// `Some(Null)` for an explicit `default: null`, `None` when absent.
    #[serde(default, deserialize_with = "present")]
    default: Option<serde_yaml::Value>,
    #[serde(default)]
    expr: Option<String>,
}

fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<serde_yaml::Value>, D::Error> {
    serde_yaml::Value::deserialize(d).map(Some)
}

/// Renders a YAML scalar as expression text (numbers and booleans as themselves).
pub(crate) fn scalar_text(v: &serde_yaml::Value) -> Option<String> {
    match v {
        serde_yaml::Value::Null => Some("null".into()),
        serde_yaml::Value::Bool(b) => Some(b.to_string()),
        serde_yaml::Value::Number(n) => Some(n.to_string()),
        serde_yaml::Value::String(s) => Some(s.clone()),
        _ => None,
    }
}

impl ModelSpec {
    /// Parses a model YAML. `origin` names the file in error messages.
    pub fn parse(source: &str, origin: &str) -> Result<ModelSpec, SpecError> {
        let raw: RawSpec = serde_yaml::from_str(source).map_err(|e| {
            let loc = e.location();
            SpecError::Yaml {
                origin: origin.to_string(),
                line: loc.as_ref().map(|l| l.line()),
                column: loc.as_ref().map(|l| l.column()),
                message: e.to_string(),
            }
        })?;
        let mut spec = ModelSpec {
            name: raw.name,
            architectures: raw.architectures,
            params: Vec::new(),
            weights: Vec::new(),
            per_layer_weights: Vec::new(),
            graph: Vec::new(),
            origin: origin.to_string(),
            source: source.to_string(),
        };
        for (k, v) in &raw.params {
            let name = spec.key_name(k, "params")?;
            let p = spec.param_spec(&name, v)?;
            spec.params.push((name, p));
        }
        for (k, v) in &raw.weights {
            let name = spec.key_name(k, "weights")?;
            if name == "per_layer" {
                let serde_yaml::Value::Mapping(m) = v else {
                    return Err(spec.schema_error("weights.per_layer", "must be a mapping of weights"));
                };
                for (lk, lv) in m {
                    let lname = spec.key_name(lk, "weights.per_layer")?;
                    let w = spec.weight_spec(&lname, lv)?;
                    spec.per_layer_weights.push((lname, w));
                }
            } else {
                let w = spec.weight_spec(&name, v)?;
                spec.weights.push((name, w));
            }
        }
        for item in raw.graph {
            let parsed = match item {
                RawGraphItem::Stmt(s) => GraphItem::Stmt(spec.statement(&s)?),
                RawGraphItem::PerLayer { per_layer } => {
                    let mut stmts = Vec::new();
                    for item in per_layer {
                        match item {
                            RawLayerItem::Stmt(s) => stmts.push(Guarded { when: None, stmt: spec.statement(&s)? }),
                            RawLayerItem::If { cond, then, otherwise } => {
                                crate::expr::parse_expr(&cond)
                                    .map_err(|e| spec.schema_error("graph.per_layer.if", &format!("`{cond}`: {e}")))?;
                                for (when, list) in [(cond.clone(), then), (format!("not ({cond})"), otherwise)] {
                                    for s in list {
                                        stmts.push(Guarded { when: Some(when.clone()), stmt: spec.statement(&s)? });
                                    }
                                }
                            }
                        }
                    }
                    GraphItem::PerLayer(stmts)
                }
            };
            spec.graph.push(parsed);
        }
        Ok(spec)
    }

    /// Reads and parses a model YAML file.
    pub fn load(path: &std::path::Path) -> Result<ModelSpec, SpecError> {
        let origin = path.display().to_string();
        let source = std::fs::read_to_string(path)
            .map_err(|e| SpecError::Io { path: origin.clone(), message: e.to_string() })?;
        Self::parse(&source, &origin)
    }

    /// The 1-based line where `needle` first occurs in the YAML source.
    pub fn line_of(&self, needle: &str) -> Option<usize> {
        let at = self.source.find(needle)?;
        Some(self.source[..at].matches('\n').count() + 1)
    }

    /// `file:line` for `needle`, or the file alone.
    pub fn locate(&self, needle: &str) -> String {
        match self.line_of(needle) {
            Some(l) => format!("{}:{l}", self.origin),
            None => self.origin.clone(),
        }
    }

    fn schema_error(&self, at: &str, message: &str) -> SpecError {
        let last = at.rsplit('.').next().unwrap_or(at);
        SpecError::Schema { at: format!("{} ({at})", self.locate(&format!("{last}:"))), message: message.to_string() }
    }

    fn key_name(&self, k: &serde_yaml::Value, section: &str) -> Result<String, SpecError> {
        match k {
            serde_yaml::Value::String(s) => Ok(s.clone()),
            other => Err(self.schema_error(section, &format!("key {other:?} is not a name"))),
        }
    }

    fn param_spec(&self, name: &str, v: &serde_yaml::Value) -> Result<ParamSpec, SpecError> {
        if let serde_yaml::Value::String(s) = v {
            return Ok(ParamSpec::Config { keys: vec![s.clone()], default: None });
        }
        if let Some(text) = scalar_text(v) {
            return Ok(ParamSpec::Expr(text));
        }
        let at = format!("params.{name}");
        let obj: RawParamObj = serde_yaml::from_value(v.clone())
            .map_err(|e| self.schema_error(&at, &format!("expected a key, an expression or {{key, default}}: {e}")))?;
        match (obj.key, obj.expr) {
            (Some(_), Some(_)) => Err(self.schema_error(&at, "give `key` or `expr`, not both")),
            (None, Some(expr)) => Ok(ParamSpec::Expr(expr)),
            (Some(keys), None) => {
                let keys = match keys {
                    RawKeys::One(k) => vec![k],
                    RawKeys::Many(ks) => ks,
                };
                let default = match obj.default {
                    None => None,
                    Some(d) => Some(
                        scalar_text(&d)
                            .ok_or_else(|| self.schema_error(&at, "default must be a scalar or an expression"))?,
                    ),
                };
                Ok(ParamSpec::Config { keys, default })
            }
            (None, None) => Err(self.schema_error(&at, "needs `key` or `expr`")),
        }
    }

    fn weight_spec(&self, name: &str, v: &serde_yaml::Value) -> Result<WeightSpec, SpecError> {
        serde_yaml::from_value(v.clone()).map_err(|e| self.schema_error(&format!("weights.{name}"), &e.to_string()))
    }

    fn statement(&self, text: &str) -> Result<Located<Statement>, SpecError> {
        let line = self.line_of(text);
        let value = parse_statement(text).map_err(|e| SpecError::Statement {
            at: match line {
                Some(l) => format!("{}:{l}", self.origin),
                None => self.origin.clone(),
            },
            statement: text.to_string(),
            message: format!("{} (column {})", e.message, e.column),
        })?;
        Ok(Located { value, text: text.to_string(), line })
    }
}
