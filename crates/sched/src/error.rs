//! The one error type of the core. The bindings map each variant to a specific Python
//! exception (see `crates/python/src/errors.rs`).

use thiserror::Error;

/// Why the scheduler refused a call.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SchedError {
    /// An engine argument is out of range or inconsistent with another.
    #[error("invalid scheduler config: {0}")]
    InvalidConfig(String),
    /// A request that can never be served, or a malformed one.
    #[error("invalid request {request_id:?}: {reason}")]
    InvalidRequest { request_id: String, reason: String },
    /// `add_request` with an id that is still live.
    #[error("duplicate request id {0:?}: a request with this id is still running")]
    DuplicateRequest(String),
    /// `abort` / `finish` naming something the scheduler does not hold.
    #[error("unknown {kind} {id}")]
    Unknown { kind: &'static str, id: String },
    /// A step result that does not fit the plan it answers.
    #[error("step result rejected: {0}")]
    BadStepResult(String),
    /// The scheduler thread is gone (shut down, or it panicked).
    #[error("scheduler is not running: {0}")]
    Closed(String),
}

pub type SchedResult<T> = Result<T, SchedError>;
