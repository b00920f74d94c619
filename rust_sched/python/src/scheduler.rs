//! `Scheduler` for Python: the core driven synchronously from the calling thread (tests,
//! benchmarks, simulations). The engine uses `SchedulerThread` instead.

use std::convert::Infallible;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use pyengine_sched::plan::FinishReason;
use pyengine_sched::scheduler::{Scheduler, SchedulerSnapshot, SpecResult};

use crate::arrays::{draft_result, sampled_tokens, PyOutputEvent, PyStepPlan};
use crate::config::PySchedulerConfig;
use crate::errors::{invalid_request, NativeError};
use crate::gil::{call, guarded};
use crate::request::PyRequest;

#[pyclass(name = "Scheduler", module = "pyengine._sched", frozen)]
pub struct PyScheduler {
    inner: Mutex<Scheduler>,
}

impl PyScheduler {
    fn lock(&self) -> std::sync::MutexGuard<'_, Scheduler> {
        // A panic while locked was already raised to Python as NativePanicError; the state
        // it left is what check_invariants is for.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub fn parse_reason(py: Python<'_>, reason: &str) -> PyResult<FinishReason> {
    FinishReason::parse(reason).ok_or_else(|| {
        invalid_request(
            py,
            "",
            format!("unknown finish reason {reason:?}: expected one of {:?}", pyengine_sched::FINISH_REASONS),
        )
    })
}

/// Scheduler figures as a flat dict.
pub fn snapshot_dict<'py>(py: Python<'py>, s: &SchedulerSnapshot) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("num_running", s.num_running)?;
    d.set_item("num_waiting", s.num_waiting)?;
    d.set_item("num_preempted_waiting", s.num_preempted_waiting)?;
    d.set_item("num_inflight_steps", s.num_inflight_steps)?;
    d.set_item("kv_blocks_total", s.kv.total)?;
    d.set_item("kv_blocks_free", s.kv.free)?;
    d.set_item("kv_blocks_evictable", s.kv.evictable)?;
    d.set_item("kv_blocks_used", s.kv.used)?;
    d.set_item("kv_blocks_used_peak", s.kv_peak_used)?;
    d.set_item("kv_usage", if s.kv.total > 0 { s.kv.used as f64 / s.kv.total as f64 } else { 0.0 })?;
    d.set_item("prefix_cache_queried_tokens", s.prefix.queried_tokens)?;
    d.set_item("prefix_cache_hit_tokens", s.prefix.hit_tokens)?;
    let c = &s.counters;
    d.set_item("steps_planned", c.steps_planned)?;
    d.set_item("steps_applied", c.steps_applied)?;
    d.set_item("preemptions", c.preemptions)?;
    d.set_item("requests_added", c.requests_added)?;
    d.set_item("sequences_finished", c.sequences_finished)?;
    d.set_item("prefill_tokens_scheduled", c.prefill_tokens_scheduled)?;
    d.set_item("decode_tokens_scheduled", c.decode_tokens_scheduled)?;
    d.set_item("generated_tokens", c.generated_tokens)?;
    d.set_item("discarded_tokens", c.discarded_tokens)?;
    d.set_item("mask_steps", c.mask_steps)?;
    d.set_item("masks_computed", c.masks_computed)?;
    d.set_item("mask_seconds", c.mask_ns as f64 * 1e-9)?;
    d.set_item("grammar_dead_ends", c.dead_ends)?;
    d.set_item("kv_blocks_freed_behind_window", c.window_freed_blocks)?;
    let spec = &s.spec;
    d.set_item("spec_drafts", spec.drafts)?;
    d.set_item("spec_draft_tokens", spec.draft_tokens)?;
    d.set_item("spec_accepted_tokens", spec.accepted_tokens)?;
    d.set_item("spec_accepted_per_position", spec.accepted_per_position[..spec.k].to_vec())?;
    d.set_item("spec_disabled_sequences", spec.disabled_sequences)?;
    d.set_item("spec_disabled_low_rate", spec.disabled_low_rate)?;
    d.set_item("spec_disabled_failing", spec.disabled_failing)?;
    d.set_item("spec_disabled_learning", spec.disabled_learning)?;
    d.set_item("spec_pauses", spec.pauses)?;
    d.set_item("spec_backoffs", spec.backoffs)?;
    d.set_item("spec_empty_proposals", spec.empty_proposals)?;
    d.set_item(
        "spec_mean_accepted_length",
        if spec.drafts > 0 { 1.0 + spec.accepted_tokens as f64 / spec.drafts as f64 } else { 0.0 },
    )?;
    d.set_item("spec_proposals", spec.proposals)?;
    d.set_item("spec_propose_seconds", spec.propose_ns as f64 * 1e-9)?;
    Ok(d)
}

#[pymethods]
impl PyScheduler {
    #[new]
    fn new(py: Python<'_>, config: &PySchedulerConfig) -> PyResult<Self> {
        let inner = call(py, || Scheduler::new(config.inner.clone()))?;
        Ok(PyScheduler { inner: Mutex::new(inner) })
    }

    /// Adds a request; returns its first sequence id.
    fn add_request(&self, py: Python<'_>, request: &PyRequest) -> PyResult<u64> {
        let spec = request.spec.clone();
        call(py, || self.lock().add_request(spec))
    }

    /// Plans the next step (GIL released), or None.
    fn schedule(&self, py: Python<'_>) -> PyResult<Option<PyStepPlan>> {
        let plan = call(py, || {
            let mut s = self.lock();
            let plan = s.schedule();
            s.send_front_mask();
            Ok::<_, Infallible>(plan)
        })?;
        plan.map(|p| PyStepPlan::new(py, p)).transpose()
    }

    /// Applies the oldest in-flight step's sampled tokens (GIL released); `num_accepted`
    /// and `next_drafts` as for `SchedulerThread.submit_result`.
    #[pyo3(signature = (step_id, sampled, *, num_accepted = None, next_drafts = None))]
    fn apply_result(
        &self,
        py: Python<'_>,
        step_id: u64,
        sampled: &Bound<'_, PyAny>,
        num_accepted: Option<Bound<'_, PyAny>>,
        next_drafts: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let sampled = sampled_tokens(sampled)?;
        let drafts = draft_result(num_accepted.as_ref(), next_drafts.as_ref())?;
        call(py, || {
            let mut s = self.lock();
            let spec = SpecResult {
                num_accepted: drafts.num_accepted.as_deref(),
                next_drafts: drafts.next_drafts.as_ref().map(|(c, t)| (c.as_slice(), t.as_slice())),
            };
            s.apply_spec_result(step_id, &sampled, spec)?;
            s.send_front_mask();
            Ok::<_, pyengine_sched::SchedError>(())
        })
    }

    /// Ends every sequence of a step the executor could not run, with reason "error"
    /// (GIL released).
    fn fail_step(&self, py: Python<'_>, step_id: u64) -> PyResult<()> {
        call(py, || {
            let mut s = self.lock();
            s.fail_step(step_id)?;
            s.send_front_mask();
            Ok::<_, pyengine_sched::SchedError>(())
        })
    }

    /// What happened since the last call: accepted tokens and ended sequences.
    #[pyo3(signature = (step_id = None))]
    fn take_output(&self, py: Python<'_>, step_id: Option<u64>) -> PyResult<PyOutputEvent> {
        let ev = guarded(py, || Ok(self.lock().take_output(step_id)))?;
        PyOutputEvent::new(py, ev)
    }

    fn abort(&self, py: Python<'_>, request_id: &str) -> PyResult<bool> {
        guarded(py, || Ok(self.lock().abort(request_id)))
    }

    #[pyo3(signature = (seq_id, reason = "stop"))]
    fn finish(&self, py: Python<'_>, seq_id: u64, reason: &str) -> PyResult<bool> {
        let reason = parse_reason(py, reason)?;
        call(py, || self.lock().finish(seq_id, reason))
    }

    fn has_unfinished(&self, py: Python<'_>) -> PyResult<bool> {
        guarded(py, || Ok(self.lock().has_unfinished()))
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let snap = guarded(py, || Ok(self.lock().snapshot()))?;
        snapshot_dict(py, &snap)
    }

    /// Raises `EngineError` describing the first broken internal invariant, if any.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let result = guarded(py, || Ok(self.lock().check_invariants()))?;
        result.map_err(|m| {
            pyengine_sched::SchedError::BadStepResult(format!("invariant broken: {m}")).into_py_err(py)
        })
    }

    /// Test hook: panics inside the core, to show a Rust panic surfaces as `NativePanicError`.
    fn _panic(&self, py: Python<'_>) -> PyResult<()> {
        call(py, || -> Result<(), Infallible> { panic!("requested by Scheduler._panic()") })
    }
}
