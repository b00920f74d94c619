//! Structured outputs for Python: `GrammarCompiler` (the vocabulary, once per engine, and
//! a compile cache), the `CompiledConstraint` a `Request` carries, and the
//! `GrammarMaskTicket` through which the executor takes a step's mask.

use std::sync::Arc;
use std::time::Duration;

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use pyengine_grammar::{
    ConstraintKind, ConstraintSpec, GrammarCompiler, GrammarError, JsonOptions, Vocabulary,
};
use pyengine_sched::constraint::{ConstraintHandle, MaskTicket, MaskWait};
use pyengine_sched::SchedError;

use crate::errors::NativeError;
use crate::gil::{call, wait};

#[pyclass(name = "GrammarCompiler", module = "pyengine._sched", frozen)]
pub struct PyGrammarCompiler {
    inner: Arc<GrammarCompiler>,
}

#[pyclass(name = "CompiledConstraint", module = "pyengine._sched", frozen)]
pub struct PyCompiledConstraint {
    pub handle: ConstraintHandle,
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get)]
    cached: bool,
    #[pyo3(get)]
    compile_seconds: f64,
}

#[pymethods]
impl PyGrammarCompiler {
    /// Builds the vocabulary (GIL released): `token_bytes[i]` is token i's bytes,
    /// `special_token_ids` are never produced as text, `eos_token_ids` end an output,
    /// `vocab_size` is the logits' width.
    #[new]
    #[pyo3(signature = (token_bytes, special_token_ids, eos_token_ids, vocab_size, cache_capacity = 256))]
    fn new(
        py: Python<'_>,
        token_bytes: Vec<Vec<u8>>,
        special_token_ids: Vec<u32>,
        eos_token_ids: Vec<u32>,
        vocab_size: usize,
        cache_capacity: usize,
    ) -> PyResult<Self> {
        let inner = call(py, || {
            let vocab = Vocabulary::new(token_bytes, &special_token_ids, &eos_token_ids, vocab_size)?;
            GrammarCompiler::new(vocab, cache_capacity)
        })?;
        Ok(PyGrammarCompiler { inner: Arc::new(inner) })
    }

    /// Compiles a constraint with the GIL released (served from the cache when the same
    /// one was compiled before). `kind` is json, json_object, regex, choice (`text` a JSON
    /// list of strings) or grammar (llguidance's Lark). Raises InvalidRequestError naming
    /// what is wrong.
    #[pyo3(signature = (kind, text, *, disable_any_whitespace = false, disable_additional_properties = false,
                        whitespace_pattern = None))]
    fn compile(
        &self,
        py: Python<'_>,
        kind: &str,
        text: String,
        disable_any_whitespace: bool,
        disable_additional_properties: bool,
        whitespace_pattern: Option<String>,
    ) -> PyResult<PyCompiledConstraint> {
        let spec =
            spec(py, kind, text, disable_any_whitespace, disable_additional_properties, whitespace_pattern)?;
        let compiled = call(py, || self.inner.compile(&spec))?;
        Ok(PyCompiledConstraint {
            handle: ConstraintHandle(compiled.grammar),
            kind: spec.kind.name(),
            cached: compiled.cached,
            compile_seconds: compiled.seconds,
        })
    }

    /// Whether `compile` with these arguments would be served from the cache (nothing is
    /// compiled).
    #[pyo3(signature = (kind, text, *, disable_any_whitespace = false, disable_additional_properties = false,
                        whitespace_pattern = None))]
    fn is_cached(
        &self,
        py: Python<'_>,
        kind: &str,
        text: String,
        disable_any_whitespace: bool,
        disable_additional_properties: bool,
        whitespace_pattern: Option<String>,
    ) -> PyResult<bool> {
        let spec =
            spec(py, kind, text, disable_any_whitespace, disable_additional_properties, whitespace_pattern)?;
        Ok(self.inner.cached(&spec).is_some())
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocabulary().vocab_size()
    }

    /// Compilations, cache hits, failures, total compile seconds, grammars cached.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("compiled", s.compiled)?;
        d.set_item("cache_hits", s.cache_hits)?;
        d.set_item("failed", s.failed)?;
        d.set_item("compile_seconds", s.compile_seconds)?;
        d.set_item("cached_grammars", s.cached_grammars)?;
        Ok(d)
    }
}

fn spec(
    py: Python<'_>,
    kind: &str,
    text: String,
    disable_any_whitespace: bool,
    disable_additional_properties: bool,
    whitespace_pattern: Option<String>,
) -> PyResult<ConstraintSpec> {
    let Some(kind) = ConstraintKind::parse(kind) else {
        return Err(GrammarError::InvalidConstraint {
            kind: "constraint",
            reason: format!("unknown kind {kind:?}: expected json, json_object, regex, choice or grammar"),
        }
        .into_py_err(py));
    };
    Ok(ConstraintSpec {
        kind,
        text,
        json: JsonOptions { disable_any_whitespace, disable_additional_properties, whitespace_pattern },
    })
}

#[pymethods]
impl PyCompiledConstraint {
    fn __repr__(&self) -> String {
        format!("CompiledConstraint(kind={:?}, cached={})", self.kind, self.cached)
    }
}

/// The executor's end of one step's grammar mask.
#[pyclass(name = "GrammarMaskTicket", module = "pyengine._sched", frozen)]
pub struct PyGrammarMaskTicket {
    pub ticket: MaskTicket,
}

#[pymethods]
impl PyGrammarMaskTicket {
    /// Waits (GIL released) at most `timeout` seconds for the mask: returns `(bits,
    /// compute_seconds)`, `bits` uint32 `[M, words]` (bit `t % 32` of word `t / 32` allows
    /// token t), `compute_seconds` the scheduler thread's time computing it. Raises
    /// StepResultError when it does not come in time, EngineDeadError when the scheduler
    /// stopped.
    #[pyo3(signature = (timeout = 30.0))]
    fn take<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<(Bound<'py, PyArray2<u32>>, f64)> {
        let got = wait(py, Some(timeout), |slice: Duration| match self.ticket.take(slice) {
            Ok(mask) => Ok(Some(Ok(mask))),
            Err(MaskWait::Pending) => Ok(None),
            Err(MaskWait::Gone) => Ok::<_, SchedError>(Some(Err(()))),
        })?;
        let mask = match got {
            Some(Ok(mask)) => mask,
            Some(Err(())) => {
                return Err(SchedError::Closed("the scheduler dropped the step's grammar mask".into())
                    .into_py_err(py))
            }
            None => {
                return Err(SchedError::BadStepResult(format!(
                    "the grammar mask did not arrive within {timeout} s"
                ))
                .into_py_err(py))
            }
        };
        let bits = PyArray1::from_vec(py, mask.bits).reshape([mask.rows, mask.words])?;
        Ok((bits, mask.compute.as_secs_f64()))
    }
}
