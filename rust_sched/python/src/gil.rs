//! The one place where the bindings release the GIL and map the core's errors.
//!
//! Every call into a core crate goes through [`call`] (or [`wait`] for blocking waits):
//! the arguments are already owned Rust values, the call runs detached from the
//! interpreter so the other Python threads run meanwhile, and a core error becomes the
//! matching `pyengine.errors` exception.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::errors::{NativeError, Panic};

/// How long a blocking wait stays detached before checking for Ctrl-C.
const SIGNAL_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// Runs `f` with the GIL released; its error is raised as the matching Python exception,
/// and a panic inside it as `NativePanicError` (an `EngineError`, not pyo3's
/// `PanicException`, which derives from `BaseException` and escapes `except Exception`).
pub fn call<T, E, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    T: Send,
    E: NativeError,
    F: Send + FnOnce() -> Result<T, E>,
{
    match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(result) => result.map_err(|e| e.into_py_err(py)),
        Err(payload) => Err(Panic::from_payload(payload.as_ref()).into_py_err(py)),
    }
}

/// Runs `f` (holding the GIL) with a panic inside it raised as `NativePanicError`: for the
/// bindings' calls that do not go through [`call`].
pub fn guarded<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    F: FnOnce() -> PyResult<T>,
{
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|payload| Err(Panic::from_payload(payload.as_ref()).into_py_err(py)))
}

/// Waits for `wait(slice)` to produce a value, with the GIL released, for at most
/// `timeout` seconds (forever when None). Between slices it lets Python handle signals, so
/// KeyboardInterrupt reaches a thread blocked here. Ok(None) when the time ran out.
pub fn wait<T, E, F>(py: Python<'_>, timeout: Option<f64>, wait: F) -> PyResult<Option<T>>
where
    T: Send,
    E: NativeError,
    F: Sync + Fn(Duration) -> Result<Option<T>, E>,
{
    let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
    loop {
        let slice = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(SIGNAL_CHECK_INTERVAL),
            None => SIGNAL_CHECK_INTERVAL,
        };
        if let Some(value) = call(py, || wait(slice))? {
            return Ok(Some(value));
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
    }
}
