//! Core errors as Python exceptions. The classes live in `pyengine/errors.py` (so they can
//! also derive from ValueError / LookupError); they are looked up only when raising.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::error::SchedError;

fn class_name(err: &SchedError) -> &'static str {
    match err {
        SchedError::InvalidConfig(_) => "InvalidConfigError",
        SchedError::InvalidRequest { .. } => "InvalidRequestError",
        SchedError::DuplicateRequest(_) => "DuplicateRequestError",
        SchedError::Unknown { .. } => "UnknownRequestError",
        SchedError::BadStepResult(_) => "StepResultError",
        SchedError::Closed(_) => "EngineDeadError",
    }
}

/// Builds the Python exception for `err` (falls back to RuntimeError if the errors module
/// cannot be imported, which would be a packaging bug).
pub fn to_py_err(py: Python<'_>, err: SchedError) -> PyErr {
    let message = err.to_string();
    let class = py.import("pyengine.errors").and_then(|m| m.getattr(class_name(&err)));
    match class {
        Ok(cls) => match cls.call1((message.clone(),)) {
            Ok(instance) => PyErr::from_value(instance),
            Err(e) => e,
        },
        Err(_) => PyRuntimeError::new_err(message),
    }
}

/// Raises `InvalidConfigError` / `InvalidRequestError` for a bad argument.
pub fn invalid_config(py: Python<'_>, message: String) -> PyErr {
    to_py_err(py, SchedError::InvalidConfig(message))
}

pub fn invalid_request(py: Python<'_>, request_id: &str, reason: String) -> PyErr {
    to_py_err(py, SchedError::InvalidRequest { request_id: request_id.into(), reason })
}

/// `Result` conversion at the edge.
pub trait IntoPyResult<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, SchedError> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py_err(py, e))
    }
}
