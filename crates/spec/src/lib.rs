//! `spec`: the first stage of the pipeline. It parses a model architecture written in YAML
//! (`models/*.yaml`) into a [`ModelSpec`] and binds it to a checkpoint's `config.json`
//! ([`bind`]), giving concrete parameter values, weight names and shapes. It knows nothing of
//! graphs: `compiler` lowers the bound statements into the IR.
#![deny(missing_docs)]

pub mod bind;
pub mod expr;
pub mod model;
pub mod value;

pub use bind::{bind, BoundModel, BoundWeight, Rows};
pub use expr::{parse_expr, parse_statement, Expr, Statement};
pub use model::{GraphItem, Guarded, Located, ModelSpec, ParamSpec, ShardKind, WeightSpec};
pub use value::Value;

/// Errors in a model YAML or in binding it to a config. Each names the file and, where it can,
/// the line.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The file could not be read.
    #[error("cannot read {path}: {message}")]
    Io {
        /// The path.
        path: String,
        /// The OS error.
        message: String,
    },
    /// The YAML is not well-formed or does not follow the schema.
    #[error("{origin}{}: malformed model YAML: {message}", fmt_loc(*line, *column))]
    Yaml {
        /// The file.
        origin: String,
        /// 1-based line.
        line: Option<usize>,
        /// 1-based column.
        column: Option<usize>,
        /// The parser's message.
        message: String,
    },
    /// A section has the wrong structure.
    #[error("{at}: {message}")]
    Schema {
        /// Where.
        at: String,
        /// What is wrong.
        message: String,
    },
    /// A graph statement does not parse.
    #[error("{at}: cannot parse graph statement `{statement}`: {message}")]
    Statement {
        /// Where.
        at: String,
        /// The statement text.
        statement: String,
        /// What is wrong.
        message: String,
    },
    /// A parameter expression failed.
    #[error("{at}: parameter `{param}`: {message}")]
    Param {
        /// Where.
        at: String,
        /// The parameter.
        param: String,
        /// What is wrong.
        message: String,
    },
    /// A parameter's config key is absent and it has no default.
    #[error("{at}: parameter `{param}` needs config.json key {keys}, which is missing, and it has no default")]
    MissingConfigKey {
        /// Where.
        at: String,
        /// The parameter.
        param: String,
        /// The keys tried.
        keys: String,
    },
    /// A weight declaration failed to bind.
    #[error("{at}: weight `{weight}`: {message}")]
    Weight {
        /// Where.
        at: String,
        /// The weight key.
        weight: String,
        /// What is wrong.
        message: String,
    },
    /// The config's architecture is not one this spec serves.
    #[error("config.json declares architectures [{config}] but {origin} serves [{supported}]")]
    Architecture {
        /// The spec file.
        origin: String,
        /// What config.json says.
        config: String,
        /// What the spec supports.
        supported: String,
    },
}

fn fmt_loc(line: Option<usize>, column: Option<usize>) -> String {
    match (line, column) {
        (Some(l), Some(c)) => format!(":{l}:{c}"),
        (Some(l), None) => format!(":{l}"),
        _ => String::new(),
    }
}
