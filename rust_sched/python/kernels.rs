//! The executor's CPU kernels (`kernels/`) for Python: numpy views of torch tensors in,
//! shapes checked, the kernel run with the GIL released.

use numpy::{
    PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyReadonlyArray4, PyReadwriteArray3,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::kernels::{DecodeQueries, PagedKv};

use super::gil::detached;

fn contiguous<'a, T>(name: &str, slice: Result<&'a [T], numpy::AsSliceError>) -> PyResult<&'a [T]> {
    slice.map_err(|_| PyValueError::new_err(format!("{name} must be C-contiguous")))
}

/// Decode attention over one layer's paged cache; see `kernels/paged_decode.rs`.
#[pyfunction]
#[pyo3(signature = (out, query, key_cache, value_cache, block_tables, seq_lens, scale, num_threads = 1))]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(
    py: Python<'_>,
    mut out: PyReadwriteArray3<'_, f32>,
    query: PyReadonlyArray3<'_, f32>,
    key_cache: PyReadonlyArray4<'_, f32>,
    value_cache: PyReadonlyArray4<'_, f32>,
    block_tables: PyReadonlyArray2<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    scale: f32,
    num_threads: usize,
) -> PyResult<()> {
    let (cache_shape, query_shape) = (key_cache.shape().to_vec(), query.shape().to_vec());
    if value_cache.shape() != cache_shape.as_slice() || query_shape[2] != cache_shape[3] {
        return Err(PyValueError::new_err(format!(
            "paged decode attention: value cache {:?} must match key cache {cache_shape:?}, and \
             query {query_shape:?} its head_dim",
            value_cache.shape()
        )));
    }
    let kv = PagedKv {
        keys: contiguous("key_cache", key_cache.as_slice())?,
        values: contiguous("value_cache", value_cache.as_slice())?,
        block_size: cache_shape[1],
        kv_heads: cache_shape[2],
        head_dim: cache_shape[3],
    };
    let queries = DecodeQueries {
        query: contiguous("query", query.as_slice())?,
        heads: query_shape[1],
        block_tables: contiguous("block_tables", block_tables.as_slice())?,
        table_width: block_tables.shape()[1],
        seq_lens: contiguous("seq_lens", seq_lens.as_slice())?,
        scale,
    };
    let out = out.as_slice_mut().map_err(|_| PyValueError::new_err("out must be C-contiguous"))?;
    detached(py, || crate::kernels::paged_decode_attention(&queries, &kv, out, num_threads))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Frees the calling thread's idle OpenMP workers; see `kernels/parallel.rs`.
#[pyfunction]
pub fn release_openmp_workers() -> bool {
    crate::kernels::release_calling_thread_workers()
}
