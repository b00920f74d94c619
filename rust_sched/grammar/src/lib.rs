//! pyengine's grammar matchers: llguidance behind the scheduler's constraint interface
//! (`pyengine_sched::constraint`).
//!
//! A [`Vocabulary`] (every token's bytes, the special tokens, the EOS ids) is built once
//! per engine; a [`GrammarCompiler`] over it turns a [`ConstraintSpec`] (JSON Schema, any
//! JSON object, regex, choice, Lark grammar) into a compiled grammar, caching by spec; the
//! scheduler starts one matcher per sample from it. Pure Rust: no Python here.

pub mod compiler;
pub mod error;
pub mod matcher;
pub mod spec;
pub mod vocabulary;

pub use compiler::{CompileStats, Compiled, GrammarCompiler};
pub use error::GrammarError;
pub use matcher::CompiledGrammar;
pub use spec::{ConstraintKind, ConstraintSpec, JsonOptions};
pub use vocabulary::Vocabulary;
