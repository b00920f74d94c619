//! `SchedulerConfig` for Python: the scheduler's engine arguments, checked on construction.

use pyo3::prelude::*;

use pyengine_sched::config::{Policy, SchedulerConfig};
use pyengine_sched::{KvGroup, SpecMethod};

use crate::errors::{invalid_config, NativeError};

#[pyclass(name = "SchedulerConfig", module = "pyengine._sched", frozen)]
#[derive(Clone)]
pub struct PySchedulerConfig {
    pub inner: SchedulerConfig,
}

fn count(py: Python<'_>, name: &str, value: i64, min: i64) -> PyResult<usize> {
    if value < min {
        return Err(invalid_config(py, format!("{name} must be at least {min}, got {value}")));
    }
    Ok(value as usize)
}

#[pymethods]
impl PySchedulerConfig {
    #[new]
    #[pyo3(signature = (
        num_blocks,
        *,
        block_size = 16,
        max_num_seqs = 256,
        max_num_batched_tokens = 8192,
        max_model_len = 4096,
        long_prefill_token_threshold = 0,
        enable_prefix_caching = true,
        enable_kv_events = false,
        policy = "fcfs",
        pipeline_depth = 2,
        num_speculative_tokens = 0,
        speculative_method = "none",
        prompt_lookup_min = 1,
        prompt_lookup_max = 3,
        spec_min_acceptance = 0.1,
        kv_groups = Vec::new(),
        group_tables = false,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: i64,
        block_size: i64,
        max_num_seqs: i64,
        max_num_batched_tokens: i64,
        max_model_len: i64,
        long_prefill_token_threshold: i64,
        enable_prefix_caching: bool,
        enable_kv_events: bool,
        policy: &str,
        pipeline_depth: i64,
        num_speculative_tokens: i64,
        speculative_method: &str,
        prompt_lookup_min: i64,
        prompt_lookup_max: i64,
        spec_min_acceptance: f64,
        kv_groups: Vec<(Option<i64>, i64)>,
        group_tables: bool,
    ) -> PyResult<Self> {
        let mut groups = Vec::with_capacity(kv_groups.len());
        for (window, num_layers) in kv_groups {
            let window = match window {
                Some(w) => Some(count(py, "a KV group's window", w, 1)?),
                None => None,
            };
            groups.push(KvGroup { window, num_layers: count(py, "a KV group's num_layers", num_layers, 1)? });
        }
        let inner = SchedulerConfig {
            num_blocks: count(py, "num_blocks", num_blocks, 1)?,
            block_size: count(py, "block_size", block_size, 1)?,
            max_num_seqs: count(py, "max_num_seqs", max_num_seqs, 1)?,
            max_num_batched_tokens: count(py, "max_num_batched_tokens", max_num_batched_tokens, 1)?,
            max_model_len: count(py, "max_model_len", max_model_len, 1)?,
            long_prefill_token_threshold: count(
                py,
                "long_prefill_token_threshold",
                long_prefill_token_threshold,
                0,
            )?,
            enable_prefix_caching,
            enable_kv_events,
            policy: Policy::parse(policy).map_err(|e| e.into_py_err(py))?,
            pipeline_depth: count(py, "pipeline_depth", pipeline_depth, 1)?,
            num_speculative_tokens: count(py, "num_speculative_tokens", num_speculative_tokens, 0)?,
            speculative_method: SpecMethod::parse(speculative_method).map_err(|e| e.into_py_err(py))?,
            prompt_lookup_min: count(py, "prompt_lookup_min", prompt_lookup_min, 1)?,
            prompt_lookup_max: count(py, "prompt_lookup_max", prompt_lookup_max, 1)?,
            spec_min_acceptance,
            kv_groups: groups,
            group_tables,
        };
        inner.validate().map_err(|e| e.into_py_err(py))?;
        Ok(PySchedulerConfig { inner })
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }
    #[getter]
    fn max_num_seqs(&self) -> usize {
        self.inner.max_num_seqs
    }
    #[getter]
    fn max_num_batched_tokens(&self) -> usize {
        self.inner.max_num_batched_tokens
    }
    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.max_model_len
    }
    #[getter]
    fn long_prefill_token_threshold(&self) -> usize {
        self.inner.long_prefill_token_threshold
    }
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.enable_prefix_caching
    }
    #[getter]
    fn enable_kv_events(&self) -> bool {
        self.inner.enable_kv_events
    }
    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy.name()
    }
    #[getter]
    fn pipeline_depth(&self) -> usize {
        self.inner.pipeline_depth
    }

    #[getter]
    fn num_speculative_tokens(&self) -> usize {
        self.inner.num_speculative_tokens
    }
    #[getter]
    fn speculative_method(&self) -> &'static str {
        self.inner.speculative_method.name()
    }
    #[getter]
    fn prompt_lookup_min(&self) -> usize {
        self.inner.prompt_lookup_min
    }
    #[getter]
    fn prompt_lookup_max(&self) -> usize {
        self.inner.prompt_lookup_max
    }
    #[getter]
    fn spec_min_acceptance(&self) -> f64 {
        self.inner.spec_min_acceptance
    }

    /// The model's layers by attention need: (window or None, number of layers).
    #[getter]
    fn kv_groups(&self) -> Vec<(Option<usize>, usize)> {
        self.inner.kv_groups.iter().map(|g| (g.window, g.num_layers)).collect()
    }
    /// The window behind which blocks are freed while a sequence runs (every group
    /// windowed), or None.
    #[getter]
    fn shared_window(&self) -> Option<usize> {
        self.inner.shared_window()
    }
    /// Whether a hybrid model's groups get block tables of their own.
    #[getter]
    fn group_tables(&self) -> bool {
        self.inner.group_tables
    }
    /// The per-group tables the scheduler keeps (`kv_groups::table_layout`): (layers per
    /// table, each table's window, each table's group index); None with one shared table.
    #[getter]
    fn table_layout(&self) -> Option<(usize, Vec<Option<usize>>, Vec<usize>)> {
        self.inner.table_layout().map(|l| (l.layers_per_table, l.windows, l.groups))
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "SchedulerConfig(num_blocks={}, block_size={}, max_num_seqs={}, max_num_batched_tokens={}, \
             max_model_len={}, long_prefill_token_threshold={}, enable_prefix_caching={}, \
             enable_kv_events={}, policy={:?}, pipeline_depth={}, num_speculative_tokens={}, speculative_method={:?}, \
             prompt_lookup_min={}, prompt_lookup_max={}, spec_min_acceptance={}, kv_groups={}, group_tables={})",
            c.num_blocks,
            c.block_size,
            c.max_num_seqs,
            c.max_num_batched_tokens,
            c.max_model_len,
            c.long_prefill_token_threshold,
            if c.enable_prefix_caching { "True" } else { "False" },
            if c.enable_kv_events { "True" } else { "False" },
            c.policy.name(),
            c.pipeline_depth,
            c.num_speculative_tokens,
            c.speculative_method.name(),
            c.prompt_lookup_min,
            c.prompt_lookup_max,
            c.spec_min_acceptance,
            kv_groups_repr(&c.kv_groups),
            if c.group_tables { "True" } else { "False" }
        )
    }
}

/// `[(4096, 32)]`, `[(None, 1), (512, 5)]`: as Python writes the list of tuples.
fn kv_groups_repr(groups: &[KvGroup]) -> String {
    let items: Vec<String> = groups
        .iter()
        .map(|g| match g.window {
            Some(w) => format!("({w}, {})", g.num_layers),
            None => format!("(None, {})", g.num_layers),
        })
        .collect();
    format!("[{}]", items.join(", "))
}
