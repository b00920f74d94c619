//! `StepPlan` and `OutputEvent` for Python: each vector of the core's plan or event is
//! moved into a numpy array without copying. Field meanings: `plan.rs` and
//! `docs/contract.md`.

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::plan::{OutputEvent, StepPlan};

type Arr<T> = Py<PyArray1<T>>;

fn arr<T: numpy::Element>(py: Python<'_>, v: Vec<T>) -> Arr<T> {
    PyArray1::from_vec(py, v).unbind()
}

#[pyclass(name = "StepPlan", module = "pyengine._sched", frozen)]
pub struct PyStepPlan {
    #[pyo3(get)]
    step_id: u64,
    #[pyo3(get)]
    rows: Arr<i32>,
    #[pyo3(get)]
    num_scheduled_tokens: Arr<i32>,
    #[pyo3(get)]
    query_start_loc: Arr<i32>,
    #[pyo3(get)]
    seq_lens: Arr<i32>,
    #[pyo3(get)]
    input_ids: Arr<i64>,
    #[pyo3(get)]
    positions: Arr<i64>,
    #[pyo3(get)]
    slot_mapping: Arr<i64>,
    #[pyo3(get)]
    logits_indices: Arr<i64>,
    #[pyo3(get)]
    sample_rows: Arr<i32>,
    #[pyo3(get)]
    pool_indices: Arr<i32>,
    #[pyo3(get)]
    block_table_rows: Arr<i32>,
    #[pyo3(get)]
    block_table_cols: Arr<i32>,
    #[pyo3(get)]
    block_table_ids: Arr<i32>,
    #[pyo3(get)]
    new_rows: Arr<i32>,
    #[pyo3(get)]
    new_seq_ids: Arr<u64>,
    #[pyo3(get)]
    new_num_prompt_tokens: Arr<i32>,
    #[pyo3(get)]
    new_token_offsets: Arr<i64>,
    #[pyo3(get)]
    new_token_ids: Arr<i64>,
    #[pyo3(get)]
    freed_rows: Arr<i32>,
    #[pyo3(get)]
    num_seqs: usize,
    #[pyo3(get)]
    num_tokens: usize,
    #[pyo3(get)]
    num_samples: usize,
}

impl PyStepPlan {
    pub fn new(py: Python<'_>, p: StepPlan) -> Self {
        let (num_seqs, num_tokens, num_samples) = (p.num_seqs(), p.num_tokens(), p.num_samples());
        let mut offsets = p.new_token_offsets;
        if offsets.is_empty() {
            offsets.push(0);
        }
        PyStepPlan {
            step_id: p.step_id,
            rows: arr(py, p.rows),
            num_scheduled_tokens: arr(py, p.num_scheduled_tokens),
            query_start_loc: arr(py, p.query_start_loc),
            seq_lens: arr(py, p.seq_lens),
            input_ids: arr(py, p.input_ids),
            positions: arr(py, p.positions),
            slot_mapping: arr(py, p.slot_mapping),
            logits_indices: arr(py, p.logits_indices),
            sample_rows: arr(py, p.sample_rows),
            pool_indices: arr(py, p.pool_indices),
            block_table_rows: arr(py, p.block_table_rows),
            block_table_cols: arr(py, p.block_table_cols),
            block_table_ids: arr(py, p.block_table_ids),
            new_rows: arr(py, p.new_rows),
            new_seq_ids: arr(py, p.new_seq_ids),
            new_num_prompt_tokens: arr(py, p.new_num_prompt_tokens),
            new_token_offsets: arr(py, offsets),
            new_token_ids: arr(py, p.new_token_ids),
            freed_rows: arr(py, p.freed_rows),
            num_seqs,
            num_tokens,
            num_samples,
        }
    }
}

#[pymethods]
impl PyStepPlan {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "StepPlan(step_id={}, seqs={}, tokens={}, samples={}, new={})",
            self.step_id,
            self.num_seqs,
            self.num_tokens,
            self.num_samples,
            self.new_rows.bind(py).len()
        )
    }
}

#[pyclass(name = "OutputEvent", module = "pyengine._sched", frozen)]
pub struct PyOutputEvent {
    #[pyo3(get)]
    step_id: Option<u64>,
    #[pyo3(get)]
    seq_ids: Arr<u64>,
    #[pyo3(get)]
    token_ids: Arr<i64>,
    #[pyo3(get)]
    finished_seq_ids: Arr<u64>,
    #[pyo3(get)]
    finish_reasons: Arr<u8>,
    #[pyo3(get)]
    stop_token_ids: Arr<i64>,
    #[pyo3(get)]
    num_prompt_tokens: Arr<i32>,
    #[pyo3(get)]
    num_cached_tokens: Arr<i32>,
    #[pyo3(get)]
    num_output_tokens: Arr<i32>,
    #[pyo3(get)]
    num_preemptions: Arr<i32>,
}

impl PyOutputEvent {
    pub fn new(py: Python<'_>, e: OutputEvent) -> Self {
        PyOutputEvent {
            step_id: e.step_id,
            seq_ids: arr(py, e.seq_ids),
            token_ids: arr(py, e.token_ids),
            finished_seq_ids: arr(py, e.finished_seq_ids),
            finish_reasons: arr(py, e.finish_reasons),
            stop_token_ids: arr(py, e.stop_token_ids),
            num_prompt_tokens: arr(py, e.num_prompt_tokens),
            num_cached_tokens: arr(py, e.num_cached_tokens),
            num_output_tokens: arr(py, e.num_output_tokens),
            num_preemptions: arr(py, e.num_preemptions),
        }
    }
}

#[pymethods]
impl PyOutputEvent {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "OutputEvent(step_id={:?}, tokens={}, finished={})",
            self.step_id,
            self.seq_ids.bind(py).len(),
            self.finished_seq_ids.bind(py).len()
        )
    }
}

/// Reads sampled token ids from a 1-D int64 numpy array (fast path) or any sequence of ints.
pub fn sampled_tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        return Ok(a.readonly().as_slice()?.to_vec());
    }
    obj.extract::<Vec<i64>>()
}
