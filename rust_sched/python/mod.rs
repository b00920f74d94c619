//! `pyengine._sched`: the PyO3 bindings. They convert arguments into owned Rust values,
//! call the core with the GIL released (through `gil.rs`, the one place that does), and
//! convert results back. No scheduling logic lives here.

mod arrays;
mod config;
mod errors;
mod gil;
mod kernels;
mod request;
mod scheduler;
mod thread;

use pyo3::prelude::*;
use pyo3::types::PyTuple;

#[pymodule]
fn _sched(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", crate::VERSION)?;
    m.add("PLACEHOLDER_TOKEN", crate::PLACEHOLDER_TOKEN)?;
    m.add("FINISH_REASONS", PyTuple::new(m.py(), crate::FINISH_REASONS)?)?;
    m.add("THREAD_NAME", crate::engine::THREAD_NAME)?;
    m.add_class::<config::PySchedulerConfig>()?;
    m.add_class::<request::PyRequest>()?;
    m.add_class::<arrays::PyStepPlan>()?;
    m.add_class::<arrays::PyOutputEvent>()?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<thread::PySchedulerThread>()?;
    m.add_function(wrap_pyfunction!(kernels::paged_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::release_openmp_workers, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::qk_norm_rope, m)?)?;
    Ok(())
}
