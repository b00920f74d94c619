//! pyengine's native extension, `pyengine._native`: the bindings of the scheduler core
//! (`pyengine-sched`) and of the executor's CPU kernels (`pyengine-kernels`).
//!
//! One shared library (maturin builds one per project), two Python modules:
//! `pyengine._sched` and `pyengine._kernels`, registered in `sys.modules` when the
//! extension loads (`pyengine/__init__.py` imports it first), so the model code never
//! imports "the scheduler" to normalise a hidden state. The bindings convert arguments
//! into owned Rust values, call the core with the GIL released and its errors mapped
//! (`gil.rs`, the one place that does both), and convert results back. No scheduling
//! logic and no kernel code lives here.

mod arrays;
mod attachment;
mod config;
mod decode_layer;
mod errors;
mod gil;
mod grammar;
mod kernels;
mod request;
mod scheduler;
mod thread;

use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// The extension allocates through mimalloc: a plan's arrays are allocated every step and
/// freed when Python drops them, and glibc's malloc turns such large, short-lived blocks
/// into fresh mmaps and page faults at thousands of sequences.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The package version (the workspace's), exported as `pyengine.__version__`.
const VERSION: &str = env!("CARGO_PKG_VERSION");

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", VERSION)?;
    let sched = PyModule::new(py, "pyengine._sched")?;
    add_sched(&sched)?;
    let kernels = PyModule::new(py, "pyengine._kernels")?;
    add_kernels(&kernels)?;
    let modules = py.import("sys")?.getattr("modules")?;
    for (name, module) in [("_sched", sched), ("_kernels", kernels)] {
        modules.set_item(format!("pyengine.{name}"), &module)?;
        m.add(name, module)?;
    }
    Ok(())
}

/// `pyengine._sched`: the scheduler, its thread, and the data that crosses it.
fn add_sched(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", VERSION)?;
    m.add("PLACEHOLDER_TOKEN", pyengine_sched::PLACEHOLDER_TOKEN)?;
    m.add("FINISH_REASONS", PyTuple::new(m.py(), pyengine_sched::FINISH_REASONS)?)?;
    m.add("THREAD_NAME", pyengine_sched::engine::THREAD_NAME)?;
    m.add_class::<config::PySchedulerConfig>()?;
    m.add_class::<request::PyRequest>()?;
    m.add_class::<arrays::PyStepPlan>()?;
    m.add_class::<arrays::PyOutputEvent>()?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<thread::PySchedulerThread>()?;
    m.add_function(wrap_pyfunction!(block_hashes, m)?)?;
    m.add_class::<grammar::PyGrammarCompiler>()?;
    m.add_class::<grammar::PyCompiledConstraint>()?;
    m.add_class::<grammar::PyGrammarMaskTicket>()?;
    Ok(())
}

/// The hashes KV-cache events publish for the full blocks of `token_ids` (the chain
/// `docs/kv_events.md` documents), for routers and tests to reproduce them.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size, cache_salt = None))]
fn block_hashes(token_ids: Vec<u32>, block_size: usize, cache_salt: Option<&str>) -> PyResult<Vec<u64>> {
    if block_size == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err("block_size must be positive"));
    }
    let mut hashes = Vec::new();
    pyengine_sched::block_hash::extend_block_hashes(&mut hashes, &token_ids, block_size, cache_salt);
    Ok(hashes.into_iter().map(|h| h.published()).collect())
}

/// `pyengine._kernels`: the executor's CPU kernels over numpy views of torch tensors.
fn add_kernels(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(kernels::paged_decode_attention, m)?)?;
    m.add_class::<decode_layer::DecodeLayer>()?;
    m.add_function(wrap_pyfunction!(kernels::rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::gemv_f32, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::gemv_quantized, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::qk_norm_rope, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::release_openmp_workers, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::apply_token_bitmask, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::host_group_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::host_group_register, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::host_all_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::host_gather, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::shared_word_advance, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::shared_word_read, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::shared_word_write, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::shared_word_wait_past, m)?)?;
    Ok(())
}
