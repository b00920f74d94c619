//! Core errors as Python exceptions. The classes live in `pyengine/errors.py` (so they can
//! also derive from ValueError / LookupError, all under `EngineError`); they are looked up
//! only when raising.

use std::convert::Infallible;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use pyengine_grammar::GrammarError;
use pyengine_kernels::{GroupError, KernelError};
use pyengine_sched::error::{panic_message, SchedError};

/// An error of a core crate, and the `pyengine.errors` class it is raised as.
pub trait NativeError: Send {
    fn class_name(&self) -> &'static str;
    fn message(&self) -> String;

    /// Builds the Python exception (RuntimeError if `pyengine.errors` cannot be imported,
    /// which would be a packaging bug).
    fn into_py_err(self, py: Python<'_>) -> PyErr
    where
        Self: Sized,
    {
        let message = self.message();
        let class = py.import("pyengine.errors").and_then(|m| m.getattr(self.class_name()));
        match class {
            Ok(cls) => match cls.call1((message.clone(),)) {
                Ok(instance) => PyErr::from_value(instance),
                Err(e) => e,
            },
            Err(_) => PyRuntimeError::new_err(message),
        }
    }
}

impl NativeError for SchedError {
    fn class_name(&self) -> &'static str {
        match self {
            SchedError::InvalidConfig(_) => "InvalidConfigError",
            SchedError::InvalidRequest { .. } => "InvalidRequestError",
            SchedError::DuplicateRequest(_) => "DuplicateRequestError",
            SchedError::Unknown { .. } => "UnknownRequestError",
            SchedError::BadStepResult(_) => "StepResultError",
            SchedError::Closed(_) => "EngineDeadError",
        }
    }

    fn message(&self) -> String {
        self.to_string()
    }
}

impl NativeError for GrammarError {
    fn class_name(&self) -> &'static str {
        match self {
            GrammarError::InvalidConstraint { .. } => "InvalidRequestError",
            GrammarError::InvalidVocabulary(_) => "InvalidConfigError",
        }
    }

    fn message(&self) -> String {
        self.to_string()
    }
}

impl NativeError for KernelError {
    fn class_name(&self) -> &'static str {
        "KernelError"
    }

    fn message(&self) -> String {
        self.to_string()
    }
}

/// A host-group collective that failed: its group cannot run another step.
impl NativeError for GroupError {
    fn class_name(&self) -> &'static str {
        match self {
            GroupError::BadArgument(_) => "KernelError",
            _ => "EngineDeadError",
        }
    }

    fn message(&self) -> String {
        self.to_string()
    }
}

impl NativeError for Infallible {
    fn class_name(&self) -> &'static str {
        match *self {}
    }

    fn message(&self) -> String {
        match *self {}
    }
}

/// A panic inside the native core, caught at the binding (`gil::call`, `gil::guarded`).
pub struct Panic(String);

impl Panic {
    /// The panic's message (`panic!` with a literal gives a `&str`, with arguments a `String`).
    pub fn from_payload(payload: &(dyn std::any::Any + Send)) -> Self {
        Panic(panic_message(payload))
    }
}

impl NativeError for Panic {
    fn class_name(&self) -> &'static str {
        "NativePanicError"
    }

    fn message(&self) -> String {
        format!("pyengine's native core panicked (a bug; please report it): {}", self.0)
    }
}

/// Raises `InvalidConfigError` / `InvalidRequestError` for a bad argument.
pub fn invalid_config(py: Python<'_>, message: String) -> PyErr {
    SchedError::InvalidConfig(message).into_py_err(py)
}

pub fn invalid_request(py: Python<'_>, request_id: &str, reason: String) -> PyErr {
    SchedError::InvalidRequest { request_id: request_id.into(), reason }.into_py_err(py)
}

/// A kernel's argument that the bindings refuse before calling it (shape, layout, aliasing).
pub fn bad_kernel_argument(message: String) -> PyErr {
    Python::attach(|py| KernelError::new(message).into_py_err(py))
}
