//! `SchedulerThread` for Python: starts `pyengine-sched` and exposes the calls the
//! executor and output threads make. Every call releases the GIL (`gil.rs`).

use std::convert::Infallible;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use pyengine_sched::engine::EngineHandle;

use crate::arrays::{draft_result, sampled_tokens, PyOutputEvent, PyStepPlan};
use crate::attachment::attach;
use crate::config::PySchedulerConfig;
use crate::gil::{call, wait};
use crate::request::PyRequest;
use crate::scheduler::{parse_reason, snapshot_dict};
use pyengine_sched::DraftResult;

#[pyclass(name = "SchedulerThread", module = "pyengine._sched", frozen)]
pub struct PySchedulerThread {
    handle: EngineHandle,
}

fn seconds(timeout: f64) -> Duration {
    Duration::from_secs_f64(timeout.max(0.0))
}

#[pymethods]
impl PySchedulerThread {
    #[new]
    fn new(py: Python<'_>, config: &PySchedulerConfig) -> PyResult<Self> {
        let config = config.inner.clone();
        let handle = call(py, || EngineHandle::start(config))?;
        Ok(PySchedulerThread { handle })
    }

    #[getter]
    fn config(&self) -> PySchedulerConfig {
        PySchedulerConfig { inner: self.handle.config().clone() }
    }

    /// Validates and queues a request; returns its first sequence id.
    fn add_request(&self, py: Python<'_>, request: &PyRequest) -> PyResult<u64> {
        let spec = request.spec.clone();
        call(py, || self.handle.add_request(spec))
    }

    fn abort(&self, py: Python<'_>, request_id: String) -> PyResult<()> {
        call(py, || self.handle.abort(&request_id))
    }

    #[pyo3(signature = (seq_id, reason = "stop"))]
    fn finish(&self, py: Python<'_>, seq_id: u64, reason: &str) -> PyResult<()> {
        let reason = parse_reason(py, reason)?;
        call(py, || self.handle.finish(seq_id, reason))
    }

    /// The next plan; None if `timeout` seconds pass first (None = wait until one comes).
    #[pyo3(signature = (timeout = None))]
    fn next_plan(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PyStepPlan>> {
        let plan = wait(py, timeout, |t| self.handle.next_plan(Some(t)))?;
        plan.map(|p| PyStepPlan::new(py, p)).transpose()
    }

    /// Hands back the step's sampled ids; `result` (any object) reaches the output thread
    /// as that step's `OutputEvent.step_result`.
    ///
    /// With drafts in the plan, `num_accepted` (`[S]`) says how many of each sampled
    /// sequence's drafts were accepted and `sampled` holds them followed by one more token
    /// per sequence; `next_drafts` = `(counts [S], tokens)` proposes the next step's drafts
    /// (method "executor").
    #[pyo3(signature = (step_id, sampled, result = None, *, num_accepted = None, next_drafts = None))]
    fn submit_result(
        &self,
        py: Python<'_>,
        step_id: u64,
        sampled: &Bound<'_, PyAny>,
        result: Option<Bound<'_, PyAny>>,
        num_accepted: Option<Bound<'_, PyAny>>,
        next_drafts: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let sampled = sampled_tokens(sampled)?;
        let drafts = draft_result(num_accepted.as_ref(), next_drafts.as_ref())?;
        let attachment = attach(result);
        if drafts == DraftResult::default() {
            return call(py, || self.handle.submit_result(step_id, sampled, attachment));
        }
        call(py, || self.handle.submit_spec_result(step_id, sampled, attachment, drafts))
    }

    /// The executor could not run the step: its sequences end with reason "error", and
    /// `result` (what went wrong) reaches the output thread in that step's event.
    #[pyo3(signature = (step_id, result = None))]
    fn fail_step(&self, py: Python<'_>, step_id: u64, result: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        let attachment = attach(result);
        call(py, || self.handle.fail_step(step_id, attachment))
    }

    /// The next output event; None if `timeout` seconds pass first.
    #[pyo3(signature = (timeout = None))]
    fn next_output(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<PyOutputEvent>> {
        let ev = wait(py, timeout, |t| self.handle.next_output(Some(t)))?;
        ev.map(|e| PyOutputEvent::new(py, e)).transpose()
    }

    /// The published hashes of every block in the prefix cache, sorted (what a KV-event
    /// subscriber that saw every event so far holds); None if the thread did not answer
    /// within `timeout` seconds.
    #[pyo3(signature = (timeout = 1.0))]
    fn cached_block_hashes(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<Vec<u64>>> {
        call(py, || Ok::<_, Infallible>(self.handle.cached_block_hashes(seconds(timeout))))
    }

    #[pyo3(signature = (timeout = 1.0))]
    fn stats<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        let s = call(py, || Ok::<_, Infallible>(self.handle.stats(seconds(timeout))))?;
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
        call(py, || self.handle.shutdown(seconds(timeout)))
    }

    /// Test hook: makes the scheduler thread panic.
    fn _inject_panic(&self, py: Python<'_>) -> PyResult<()> {
        call(py, || self.handle.inject_panic())
    }
}
