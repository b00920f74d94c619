//! The one place where the bindings release the GIL.

use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// How long a blocking wait stays detached before checking for Ctrl-C.
const SIGNAL_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// Runs `f` with the GIL released: other Python threads run meanwhile.
pub fn detached<T: Send, F: Send + FnOnce() -> T>(py: Python<'_>, f: F) -> T {
    py.detach(f)
}

/// Waits for `wait(slice)` to produce a value, with the GIL released, for at most
/// `timeout` seconds (forever when None). Between slices it lets Python handle signals, so
/// KeyboardInterrupt reaches a thread blocked here. Ok(None) when the time ran out.
pub fn wait_interruptibly<T, E, F>(
    py: Python<'_>,
    timeout: Option<f64>,
    wait: F,
) -> PyResult<Result<Option<T>, E>>
where
    T: Send,
    E: Send,
    F: Sync + Fn(Duration) -> Result<Option<T>, E>,
{
    let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
    loop {
        let slice = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(SIGNAL_CHECK_INTERVAL),
            None => SIGNAL_CHECK_INTERVAL,
        };
        match detached(py, || wait(slice)) {
            Ok(None) => {}
            other => return Ok(other),
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(Ok(None));
        }
    }
}
