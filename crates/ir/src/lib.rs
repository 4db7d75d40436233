//! `ir`: the graph IR at the centre of the compiler. It owns the op set ([`Op`], declared
//! once), tensor types and shape inference, the petgraph-based [`Graph`] and its verifier, the
//! flat [`Plan`] that bundles carry, and the reference [`Interpreter`]: the f32 oracle every
//! backend is tested against. It does no code generation and reads no files.
#![deny(missing_docs)]

pub mod fusion;
pub mod graph;
pub mod interp;
pub mod moe;
pub mod op;
pub mod plan;
pub mod quant;
pub mod rope;
pub mod scalar;
pub mod text;
pub mod types;

pub use fusion::{Fusion, FusionKind};
pub use graph::{Graph, Node};
pub use interp::{Interpreter, KvCache, KvStore};
pub use op::{Derived, Op};
pub use petgraph::stable_graph::NodeIndex;
pub use plan::{chosen_share, KvLayout, Plan, PlanNode, WeightUse};
pub use rope::RopeScaling;
pub use scalar::{Fun, Scalar};
pub use types::{DType, Dim, TensorType, BLOCK};

/// Errors of graph construction, verification and interpretation.
#[derive(Debug, Clone, thiserror::Error)]
pub enum IrError {
    /// An op's inputs do not fit its shape rule.
    #[error("{op}: {message}")]
    Shape {
        /// The op.
        op: String,
        /// What does not fit.
        message: String,
    },
    /// An op attribute is invalid.
    #[error("{op}: {message}")]
    Attr {
        /// The op.
        op: String,
        /// What is wrong.
        message: String,
    },
    /// The same error, located at a labelled node.
    #[error("at `{label}`: {source}")]
    At {
        /// The node's label.
        label: String,
        /// The error.
        source: Box<IrError>,
    },
    /// The verifier found a broken invariant.
    #[error("graph verification failed: {0}")]
    Verify(String),
    /// A weight could not be loaded.
    #[error("weight `{name}`: {message}")]
    Weight {
        /// Tensor name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// Bad runtime input (token id, row index).
    #[error("{0}")]
    Input(String),
    /// Something this component does not do.
    #[error("{0}")]
    Unsupported(String),
}

impl IrError {
    /// Wraps the error with the label of the node it happened at.
    pub fn at(self, label: &str) -> IrError {
        IrError::At { label: label.to_string(), source: Box::new(self) }
    }
}
