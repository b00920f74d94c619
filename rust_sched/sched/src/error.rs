//! The one error type of the core. The bindings map each variant to a specific Python
//! exception (see `rust_sched/python/src/errors.rs`).

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

/// The message of a caught panic (`catch_unwind`'s payload): `panic!` with a literal
/// gives a `&str`, with arguments a `String`; anything else has none.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_string())
}

#[cfg(test)]
mod tests {
    use super::panic_message;
    use std::panic::catch_unwind;

    #[test]
    fn panic_message_reads_literal_and_formatted_payloads() {
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let literal = catch_unwind(|| panic!("plain")).unwrap_err();
        let formatted = catch_unwind(|| panic!("row {}", 3)).unwrap_err();
        let other = catch_unwind(|| std::panic::panic_any(7_u8)).unwrap_err();
        std::panic::set_hook(hook);
        assert_eq!(panic_message(literal.as_ref()), "plain");
        assert_eq!(panic_message(formatted.as_ref()), "row 3");
        assert_eq!(panic_message(other.as_ref()), "(no message)");
    }
}
