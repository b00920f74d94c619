//! `SchedulerThread` for Python: starts `pyengine-sched` and exposes the calls the
//! executor and output threads make. Every wait releases the GIL.

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::engine::EngineHandle;

use super::arrays::{sampled_tokens, PyOutputEvent, PyStepPlan};
use super::config::PySchedulerConfig;
use super::errors::IntoPyResult;
use super::gil::{detached, wait_interruptibly};
use super::request::PyRequest;
use super::scheduler::{parse_reason, snapshot_dict};

#[pyclass(name = "SchedulerThread", module = "pyengine._sched", frozen)]
pub struct PySchedulerThread {
    handle: EngineHandle,
}

#[pymethods]
impl PySchedulerThread {
    #[new]
    fn new(py: Python<'_>, config: &PySchedulerConfig) -> PyResult<Self> {
        let handle = EngineHandle::start(config.inner.clone()).py_err(py)?;
        Ok(PySchedulerThread { handle })
    }

    #[getter]
    fn config(&self) -> PySchedulerConfig {
        PySchedulerConfig { inner: self.handle.config().clone() }
    }

    /// Validates and queues a request; returns its first sequence id.
    fn add_request(&self, py: Python<'_>, request: &PyRequest) -> PyResult<u64> {
        let spec = request.spec.clone();
        detached(py, || self.handle.add_request(spec)).py_err(py)
    }

    fn abort(&self, py: Python<'_>, request_id: String) -> PyResult<()> {
        detached(py, || self.handle.abort(&request_id)).py_err(py)
    }

    #[pyo3(signature = (seq_id, reason = "stop"))]
    fn finish(&self, py: Python<'_>, seq_id: u64, reason: &str) -> PyResult<()> {
        let reason = parse_reason(py, reason)?;
        detached(py, || self.handle.finish(seq_id, reason)).py_err(py)
    }

    /// The next plan; None if `timeout` seconds pass first (None = wait until one comes).
    #[pyo3(signature = (timeout = None))]
    fn next_plan(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PyStepPlan>> {
        let plan = wait_interruptibly(py, timeout, |t| self.handle.next_plan(Some(t)))?.py_err(py)?;
        Ok(plan.map(|p| PyStepPlan::new(py, p)))
    }

    fn submit_result(&self, py: Python<'_>, step_id: u64, sampled: &Bound<'_, PyAny>) -> PyResult<()> {
        let sampled = sampled_tokens(sampled)?;
        detached(py, || self.handle.submit_result(step_id, sampled)).py_err(py)
    }

    fn fail_step(&self, py: Python<'_>, step_id: u64) -> PyResult<()> {
        detached(py, || self.handle.fail_step(step_id)).py_err(py)
    }

    /// The next output event; None if `timeout` seconds pass first.
    #[pyo3(signature = (timeout = None))]
    fn next_output(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PyOutputEvent>> {
        let ev = wait_interruptibly(py, timeout, |t| self.handle.next_output(Some(t)))?.py_err(py)?;
        Ok(ev.map(|e| PyOutputEvent::new(py, e)))
    }

    #[pyo3(signature = (timeout = 1.0))]
    fn stats<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        let s = detached(py, || self.handle.stats(Duration::from_secs_f64(timeout.max(0.0))));
        let d = snapshot_dict(py, &s.scheduler)?;
        d.set_item("sched_busy_seconds", s.busy_seconds)?;
        d.set_item("sched_idle_seconds", s.idle_seconds)?;
        d.set_item("plan_queue_depth", s.plan_queue_depth)?;
        d.set_item("output_queue_depth", s.output_queue_depth)?;
        d.set_item("command_queue_depth", s.command_queue_depth)?;
        d.set_item("plan_us_mean", s.plan_us_mean)?;
        d.set_item("plan_us_max", s.plan_us_max)?;
        Ok(d)
    }

    #[getter]
    fn is_alive(&self) -> bool {
        self.handle.is_alive()
    }

    /// Why the scheduler thread died, or None.
    #[getter]
    fn death(&self) -> Option<String> {
        self.handle.death()
    }

    /// Stops and joins the thread; raises EngineDeadError if it does not stop in time.
    #[pyo3(signature = (timeout = 5.0))]
    fn shutdown(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        detached(py, || self.handle.shutdown(Duration::from_secs_f64(timeout.max(0.0)))).py_err(py)
    }

    /// Test hook: makes the scheduler thread panic.
    fn _inject_panic(&self, py: Python<'_>) -> PyResult<()> {
        self.handle.inject_panic().py_err(py)
    }
}
