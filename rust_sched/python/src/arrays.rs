//! `StepPlan` and `OutputEvent` for Python: each vector of the core's plan or event is
//! moved into a numpy array without copying. Field meanings: `plan.rs` and
//! `docs/contract.md`.
//!
//! One list per class: the core struct is taken apart with an exhaustive pattern (a field
//! added in the core and not here does not compile), and `FIELDS` names what Python sees,
//! so the stub, the contract document and the Python-side plan classes are checked
//! against it by tests.

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyList;

use pyengine_sched::kv_events::KvEventLog;
use pyengine_sched::plan::{OutputEvent, StepPlan};
use pyengine_sched::DraftResult;

use crate::attachment::{detach_object, object_list};
use crate::grammar::PyGrammarMaskTicket;

type Arr<T> = Py<PyArray1<T>>;

fn arr<T: numpy::Element>(py: Python<'_>, v: Vec<T>) -> Arr<T> {
    PyArray1::from_vec(py, v).unbind()
}

/// Declares a frozen pyclass with one `#[pyo3(get)]` attribute per field and a `FIELDS`
/// tuple listing them in order.
macro_rules! data_class {
    ($(#[$meta:meta])* $name:ident as $py_name:literal { $($field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        #[pyclass(name = $py_name, module = "pyengine._sched", frozen)]
        pub struct $name {
            $(#[pyo3(get)] $field: $ty,)*
        }

        impl $name {
            pub const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];
        }
    };
}

data_class! {
    /// One step for the executor (`docs/contract.md`).
    PyStepPlan as "StepPlan" {
        step_id: u64,
        rows: Arr<i32>,
        num_scheduled_tokens: Arr<i32>,
        query_start_loc: Arr<i32>,
        seq_lens: Arr<i32>,
        input_ids: Arr<i64>,
        positions: Arr<i64>,
        slot_mapping: Arr<i64>,
        logits_indices: Arr<i64>,
        sample_rows: Arr<i32>,
        pool_indices: Arr<i32>,
        block_table_rows: Arr<i32>,
        block_table_cols: Arr<i32>,
        block_table_ids: Arr<i32>,
        new_rows: Arr<i32>,
        new_seq_ids: Arr<u64>,
        new_num_prompt_tokens: Arr<i32>,
        new_token_offsets: Arr<i64>,
        new_token_ids: Arr<i64>,
        new_params: Py<PyList>,
        freed_rows: Arr<i32>,
        mask_sample_indices: Arr<i32>,
        grammar_mask: Option<Py<PyGrammarMaskTicket>>,
        num_draft_tokens: Arr<i32>,
        draft_token_ids: Arr<i64>,
        propose_indices: Arr<i32>,
        propose_counts: Arr<i32>,
        block_table_groups: Arr<i32>,
        group_slot_mapping: Arr<i64>,
        may_draft_indices: Arr<i32>,
        num_seqs: usize,
        num_tokens: usize,
        num_samples: usize,
    }
}

impl PyStepPlan {
    pub fn new(py: Python<'_>, p: StepPlan) -> PyResult<Self> {
        let (num_seqs, num_tokens, num_samples) = (p.num_seqs(), p.num_tokens(), p.num_samples());
        let StepPlan {
            step_id,
            rows,
            num_scheduled_tokens,
            query_start_loc,
            seq_lens,
            input_ids,
            positions,
            slot_mapping,
            group_slot_mapping,
            logits_indices,
            sample_rows,
            num_draft_tokens,
            draft_token_ids,
            propose_indices,
            propose_counts,
            may_draft_indices,
            pool_indices,
            block_table_rows,
            block_table_cols,
            block_table_ids,
            block_table_groups,
            new_rows,
            new_seq_ids,
            new_num_prompt_tokens,
            mut new_token_offsets,
            new_token_ids,
            new_attachments,
            freed_rows,
            mask_sample_indices,
            grammar_mask,
        } = p;
        if new_token_offsets.is_empty() {
            new_token_offsets.push(0);
        }
        Ok(PyStepPlan {
            step_id,
            rows: arr(py, rows),
            num_scheduled_tokens: arr(py, num_scheduled_tokens),
            query_start_loc: arr(py, query_start_loc),
            seq_lens: arr(py, seq_lens),
            input_ids: arr(py, input_ids),
            positions: arr(py, positions),
            slot_mapping: arr(py, slot_mapping),
            logits_indices: arr(py, logits_indices),
            sample_rows: arr(py, sample_rows),
            num_draft_tokens: arr(py, num_draft_tokens),
            draft_token_ids: arr(py, draft_token_ids),
            propose_indices: arr(py, propose_indices),
            propose_counts: arr(py, propose_counts),
            block_table_groups: arr(py, block_table_groups),
            group_slot_mapping: arr(py, group_slot_mapping),
            may_draft_indices: arr(py, may_draft_indices),
            pool_indices: arr(py, pool_indices),
            block_table_rows: arr(py, block_table_rows),
            block_table_cols: arr(py, block_table_cols),
            block_table_ids: arr(py, block_table_ids),
            new_rows: arr(py, new_rows),
            new_seq_ids: arr(py, new_seq_ids),
            new_num_prompt_tokens: arr(py, new_num_prompt_tokens),
            new_token_offsets: arr(py, new_token_offsets),
            new_token_ids: arr(py, new_token_ids),
            new_params: object_list(py, &new_attachments)?,
            freed_rows: arr(py, freed_rows),
            mask_sample_indices: arr(py, mask_sample_indices),
            grammar_mask: grammar_mask
                .map(|ticket| Py::new(py, PyGrammarMaskTicket { ticket }))
                .transpose()?,
            num_seqs,
            num_tokens,
            num_samples,
        })
    }
}

#[pymethods]
impl PyStepPlan {
    /// The attributes, in contract order.
    #[classattr]
    #[pyo3(name = "FIELDS")]
    fn fields() -> Vec<&'static str> {
        Self::FIELDS.to_vec()
    }

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

data_class! {
    /// What the output thread learns from one applied step result or from commands.
    PyOutputEvent as "OutputEvent" {
        step_id: Option<u64>,
        seq_ids: Arr<u64>,
        token_ids: Arr<i64>,
        sample_indices: Arr<i32>,
        finished_seq_ids: Arr<u64>,
        finish_reasons: Arr<u8>,
        stop_token_ids: Arr<i64>,
        num_prompt_tokens: Arr<i32>,
        num_cached_tokens: Arr<i32>,
        num_output_tokens: Arr<i32>,
        num_preemptions: Arr<i32>,
        step_result: Py<PyAny>,
        kv_events: Py<PyAny>,
    }
}

impl PyOutputEvent {
    pub fn new(py: Python<'_>, e: OutputEvent) -> PyResult<Self> {
        let OutputEvent {
            step_id,
            seq_ids,
            token_ids,
            sample_indices,
            finished_seq_ids,
            finish_reasons,
            stop_token_ids,
            num_prompt_tokens,
            num_cached_tokens,
            num_output_tokens,
            num_preemptions,
            step_attachment,
            kv_events,
        } = e;
        Ok(PyOutputEvent {
            step_id,
            seq_ids: arr(py, seq_ids),
            token_ids: arr(py, token_ids),
            sample_indices: arr(py, sample_indices),
            finished_seq_ids: arr(py, finished_seq_ids),
            finish_reasons: arr(py, finish_reasons),
            stop_token_ids: arr(py, stop_token_ids),
            num_prompt_tokens: arr(py, num_prompt_tokens),
            num_cached_tokens: arr(py, num_cached_tokens),
            num_output_tokens: arr(py, num_output_tokens),
            num_preemptions: arr(py, num_preemptions),
            step_result: detach_object(py, step_attachment.as_ref()),
            kv_events: kv_event_arrays(py, kv_events)?,
        })
    }
}

/// None, or the log's four arrays `(kinds, hashes, parents, tokens)` (`kv_events.rs`).
fn kv_event_arrays(py: Python<'_>, log: Option<KvEventLog>) -> PyResult<Py<PyAny>> {
    let Some(KvEventLog { kinds, hashes, parents, tokens }) = log else {
        return Ok(py.None());
    };
    let arrays = (arr(py, kinds), arr(py, hashes), arr(py, parents), arr(py, tokens));
    Ok(arrays.into_pyobject(py)?.into_any().unbind())
}

#[pymethods]
impl PyOutputEvent {
    /// The attributes, in contract order.
    #[classattr]
    #[pyo3(name = "FIELDS")]
    fn fields() -> Vec<&'static str> {
        Self::FIELDS.to_vec()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "OutputEvent(step_id={:?}, tokens={}, finished={})",
            self.step_id,
            self.seq_ids.bind(py).len(),
            self.finished_seq_ids.bind(py).len()
        )
    }
}

/// The speculative part of a step result from Python: `num_accepted` (`[S]` ints) and
/// `next_drafts` (a pair `(counts [S], tokens [sum])`), each None or absent.
pub fn draft_result(
    num_accepted: Option<&Bound<'_, PyAny>>,
    next_drafts: Option<&Bound<'_, PyAny>>,
) -> PyResult<DraftResult> {
    let num_accepted = num_accepted.filter(|o| !o.is_none()).map(int32s).transpose()?;
    let next_drafts = match next_drafts.filter(|o| !o.is_none()) {
        None => None,
        Some(pair) => {
            let (counts, tokens): (Bound<'_, PyAny>, Bound<'_, PyAny>) = pair.extract()?;
            Some((int32s(&counts)?, sampled_tokens(&tokens)?))
        }
    };
    Ok(DraftResult { num_accepted, next_drafts })
}

fn int32s(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        return Ok(a.readonly().as_slice()?.to_vec());
    }
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        return a
            .readonly()
            .as_slice()?
            .iter()
            .map(|&v| {
                i32::try_from(v).map_err(|_| {
                    pyo3::exceptions::PyValueError::new_err(format!("{v} is out of int32 range"))
                })
            })
            .collect();
    }
    obj.extract::<Vec<i32>>()
}

/// Reads sampled token ids from a 1-D int64 numpy array (fast path) or any sequence of ints.
pub fn sampled_tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        return Ok(a.readonly().as_slice()?.to_vec());
    }
    obj.extract::<Vec<i64>>()
}
