//! The grammar crate's one error type; the bindings raise both variants as
//! `InvalidRequestError` / `InvalidConfigError`.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GrammarError {
    /// A schema, regex, grammar or choice list that cannot be compiled, or that allows no
    /// output at all. The message names what is wrong.
    #[error("invalid {kind}: {reason}")]
    InvalidConstraint { kind: &'static str, reason: String },
    /// Token bytes that cannot form a vocabulary (sizes, EOS ids).
    #[error("invalid vocabulary: {0}")]
    InvalidVocabulary(String),
}
