//! `Request` for Python: what the scheduler needs to know about one request.

use pyo3::prelude::*;

use pyengine_sched::request::RequestSpec;
use pyengine_sched::Attachment;

use crate::attachment::attach;
use crate::errors::invalid_request;
use crate::grammar::PyCompiledConstraint;

#[pyclass(name = "Request", module = "pyengine._sched", frozen)]
pub struct PyRequest {
    pub spec: RequestSpec,
}

fn token_ids(py: Python<'_>, request_id: &str, field: &str, ids: Vec<i64>) -> PyResult<Vec<u32>> {
    ids.iter()
        .enumerate()
        .map(|(i, &t)| {
            u32::try_from(t).map_err(|_| {
                invalid_request(py, request_id, format!("{field}[{i}] = {t} is not a valid token id"))
            })
        })
        .collect()
}

/// One attachment per given sample parameter object; None is refused (every sample of a
/// request that gives parameters needs its own).
fn sample_attachments(
    py: Python<'_>,
    request_id: &str,
    params: Option<Vec<Bound<'_, PyAny>>>,
) -> PyResult<Vec<Attachment>> {
    params
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            attach(Some(p))
                .ok_or_else(|| invalid_request(py, request_id, format!("sample_params[{i}] is None")))
        })
        .collect()
}

#[pymethods]
impl PyRequest {
    #[new]
    #[pyo3(signature = (
        request_id,
        prompt_token_ids,
        *,
        max_tokens = 16,
        min_tokens = 0,
        eos_token_ids = Vec::new(),
        ignore_eos = false,
        stop_token_ids = Vec::new(),
        priority = 0,
        pooling = false,
        n = 1,
        cache_salt = None,
        sample_params = None,
        constraint = None,
        no_spec = false,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        request_id: String,
        prompt_token_ids: Vec<i64>,
        max_tokens: i64,
        min_tokens: i64,
        eos_token_ids: Vec<i64>,
        ignore_eos: bool,
        stop_token_ids: Vec<i64>,
        priority: i64,
        pooling: bool,
        n: i64,
        cache_salt: Option<String>,
        sample_params: Option<Vec<Bound<'_, PyAny>>>,
        constraint: Option<PyRef<'_, PyCompiledConstraint>>,
        no_spec: bool,
    ) -> PyResult<Self> {
        let non_negative = |name: &str, v: i64| {
            usize::try_from(v)
                .map_err(|_| invalid_request(py, &request_id, format!("{name} must be >= 0, got {v}")))
        };
        let spec = RequestSpec {
            prompt: token_ids(py, &request_id, "prompt_token_ids", prompt_token_ids)?,
            max_tokens: non_negative("max_tokens", max_tokens)?,
            min_tokens: non_negative("min_tokens", min_tokens)?,
            eos_token_ids: token_ids(py, &request_id, "eos_token_ids", eos_token_ids)?,
            ignore_eos,
            stop_token_ids: token_ids(py, &request_id, "stop_token_ids", stop_token_ids)?,
            priority,
            pooling,
            n: non_negative("n", n)?,
            cache_salt,
            sample_attachments: sample_attachments(py, &request_id, sample_params)?,
            constraint: constraint.map(|c| c.handle.clone()),
            no_spec,
            request_id,
        };
        Ok(PyRequest { spec })
    }

    #[getter]
    fn request_id(&self) -> &str {
        &self.spec.request_id
    }
    #[getter]
    fn prompt_token_ids(&self) -> Vec<u32> {
        self.spec.prompt.clone()
    }
    #[getter]
    fn num_prompt_tokens(&self) -> usize {
        self.spec.prompt.len()
    }
    #[getter]
    fn max_tokens(&self) -> usize {
        self.spec.max_tokens
    }
    #[getter]
    fn n(&self) -> usize {
        self.spec.n
    }
    #[getter]
    fn pooling(&self) -> bool {
        self.spec.pooling
    }
    #[getter]
    fn priority(&self) -> i64 {
        self.spec.priority
    }
    /// Whether a grammar constrains its output.
    #[getter]
    fn constrained(&self) -> bool {
        self.spec.constraint.is_some()
    }

    fn __repr__(&self) -> String {
        format!(
            "Request({:?}, {} prompt tokens, max_tokens={}, n={})",
            self.spec.request_id,
            self.spec.prompt.len(),
            self.spec.max_tokens,
            self.spec.n
        )
    }
}
