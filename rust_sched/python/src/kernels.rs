//! The executor's CPU kernels (`kernels/`) for Python: numpy views of torch tensors in,
//! shapes checked, the kernel run with the GIL released.

use numpy::{
    PyArrayDescrMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyReadonlyArray4,
    PyReadonlyArrayDyn, PyReadwriteArray1, PyReadwriteArray2, PyReadwriteArray3, PyReadwriteArrayDyn,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use pyengine_kernels::{DecodeQueries, ElementType, HostGroup, Norm, PagedKv, QkHeads, Weight, WeightData};

use crate::errors::{bad_kernel_argument, NativeError};
use crate::gil::call;

/// The bytes an array's elements occupy (exact for C-contiguous arrays, which the kernels
/// require; other layouts are refused after this check).
pub(crate) fn span<'py>(array: &impl PyUntypedArrayMethods<'py>) -> (usize, usize) {
    // SAFETY: reads the data pointer field of a live numpy array object.
    let start = unsafe { (*array.as_array_ptr()).fields.data } as usize;
    (start, start + array.len() * array.dtype().itemsize())
}

/// Refuses an array the kernel writes that shares memory with another argument: the
/// kernel's slices must not alias (and one tensor passed twice is a caller's mistake).
pub(crate) fn check_disjoint(
    written: &[(&str, (usize, usize))],
    read: &[(&str, (usize, usize))],
) -> PyResult<()> {
    for (i, (name, w)) in written.iter().enumerate() {
        for (other, o) in written[i + 1..].iter().chain(read) {
            if w.0 < o.1 && o.0 < w.1 {
                return Err(bad_kernel_argument(format!("{name} shares memory with {other}")));
            }
        }
    }
    Ok(())
}

fn optional_norm<'a>(
    weight: Option<&'a PyReadonlyArray1<'_, f32>>,
    name: &str,
    eps: f32,
) -> PyResult<Option<Norm<'a>>> {
    weight.map(|w| Ok(Norm { weight: contiguous(name, w.as_slice())?, eps })).transpose()
}

pub(crate) fn contiguous<'a, T>(
    name: &str,
    slice: Result<&'a [T], numpy::AsSliceError>,
) -> PyResult<&'a [T]> {
    slice.map_err(|_| bad_kernel_argument(format!("{name} must be C-contiguous")))
}

pub(crate) fn contiguous_mut<'a, T>(
    name: &str,
    slice: Result<&'a mut [T], numpy::AsSliceError>,
) -> PyResult<&'a mut [T]> {
    slice.map_err(|_| bad_kernel_argument(format!("{name} must be C-contiguous")))
}

/// Decode attention over one layer's paged cache; see `rust_sched/kernels/src/paged_decode.rs`.
#[pyfunction]
#[pyo3(signature = (out, query, key_cache, value_cache, block_tables, seq_lens, scale, num_threads = 1, window = 0, softcap = 0.0))]
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
    window: usize,
    softcap: f32,
) -> PyResult<()> {
    check_disjoint(
        &[("out", span(&**out))],
        &[
            ("query", span(&*query)),
            ("key_cache", span(&*key_cache)),
            ("value_cache", span(&*value_cache)),
            ("block_tables", span(&*block_tables)),
            ("seq_lens", span(&*seq_lens)),
        ],
    )?;
    let (cache_shape, query_shape) = (key_cache.shape().to_vec(), query.shape().to_vec());
    if value_cache.shape() != cache_shape.as_slice() || query_shape[2] != cache_shape[3] {
        return Err(bad_kernel_argument(format!(
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
        window,
        softcap,
    };
    let out = contiguous_mut("out", out.as_slice_mut())?;
    call(py, || pyengine_kernels::paged_decode_attention(&queries, &kv, out, num_threads))
}

/// RMSNorm of each row into `out`, after `residual += x` when a residual is given; see
/// `rust_sched/kernels/src/norm.rs`.
#[pyfunction]
#[pyo3(signature = (out, x, weight, eps, residual = None, num_threads = 1))]
pub fn rms_norm(
    py: Python<'_>,
    mut out: PyReadwriteArrayDyn<'_, f32>,
    x: PyReadonlyArrayDyn<'_, f32>,
    weight: PyReadonlyArray1<'_, f32>,
    eps: f32,
    residual: Option<PyReadwriteArrayDyn<'_, f32>>,
    num_threads: usize,
) -> PyResult<()> {
    let mut written = vec![("out", span(&**out))];
    written.extend(residual.as_ref().map(|r| ("residual", span(&***r))));
    check_disjoint(&written, &[("x", span(&*x)), ("weight", span(&*weight))])?;
    let norm = Norm { weight: contiguous("weight", weight.as_slice())?, eps };
    let x = contiguous("x", x.as_slice())?;
    let mut residual = residual;
    let residual = residual.as_mut().map(|r| contiguous_mut("residual", r.as_slice_mut())).transpose()?;
    let out = contiguous_mut("out", out.as_slice_mut())?;
    call(py, || pyengine_kernels::rms_norm(x, residual, norm, out, num_threads))
}

/// Per-head RMSNorm (where weights are given) and rotary embedding of the q and k heads of
/// `qkv`, in place; see `rust_sched/kernels/src/norm.rs`.
#[pyfunction]
#[pyo3(signature = (qkv, cos, sin, q_heads, k_heads, q_norm_weight = None, k_norm_weight = None, eps = 1e-6, num_threads = 1))]
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope(
    py: Python<'_>,
    mut qkv: PyReadwriteArray2<'_, f32>,
    cos: PyReadonlyArray2<'_, f32>,
    sin: PyReadonlyArray2<'_, f32>,
    q_heads: usize,
    k_heads: usize,
    q_norm_weight: Option<PyReadonlyArray1<'_, f32>>,
    k_norm_weight: Option<PyReadonlyArray1<'_, f32>>,
    eps: f32,
    num_threads: usize,
) -> PyResult<()> {
    let mut read = vec![("cos", span(&*cos)), ("sin", span(&*sin))];
    read.extend(q_norm_weight.as_ref().map(|w| ("q_norm_weight", span(&**w))));
    read.extend(k_norm_weight.as_ref().map(|w| ("k_norm_weight", span(&**w))));
    check_disjoint(&[("qkv", span(&**qkv))], &read)?;
    let (tokens, row_stride) = (qkv.shape()[0], qkv.shape()[1]);
    if cos.shape()[0] != tokens {
        return Err(bad_kernel_argument(format!(
            "qk_norm_rope: cos and sin need one row per token ({tokens}), got {:?}",
            cos.shape()
        )));
    }
    let heads = QkHeads {
        q_heads,
        k_heads,
        head_dim: cos.shape()[1],
        row_stride,
        q_norm: optional_norm(q_norm_weight.as_ref(), "q_norm_weight", eps)?,
        k_norm: optional_norm(k_norm_weight.as_ref(), "k_norm_weight", eps)?,
        cos: contiguous("cos", cos.as_slice())?,
        sin: contiguous("sin", sin.as_slice())?,
    };
    let qkv = contiguous_mut("qkv", qkv.as_slice_mut())?;
    call(py, || pyengine_kernels::qk_norm_rope(qkv, &heads, num_threads))
}

/// Frees the calling thread's idle OpenMP workers; see `rust_sched/kernels/src/parallel.rs`.
#[pyfunction]
pub fn release_openmp_workers() -> bool {
    pyengine_kernels::release_calling_thread_workers()
}

/// Grammar masks applied in place: for each `rows[i]`, the logits whose bit in `bits[i]`
/// is clear become `-inf`; see `rust_sched/kernels/src/token_mask.rs`.
#[pyfunction]
pub fn apply_token_bitmask(
    py: Python<'_>,
    mut logits: PyReadwriteArray2<'_, f32>,
    bits: PyReadonlyArray2<'_, u32>,
    rows: PyReadonlyArray1<'_, i64>,
) -> PyResult<()> {
    check_disjoint(&[("logits", span(&**logits))], &[("bits", span(&*bits)), ("rows", span(&*rows))])?;
    let vocab = logits.shape()[1];
    let words = bits.shape()[1];
    let bits = contiguous("bits", bits.as_slice())?;
    let rows = contiguous("rows", rows.as_slice())?;
    let logits = contiguous_mut("logits", logits.as_slice_mut())?;
    call(py, || pyengine_kernels::apply_token_bitmask(logits, vocab, bits, words, rows))
}

fn host_group(
    segment: &mut PyReadwriteArray1<'_, u8>,
    rank: usize,
    world_size: usize,
    slot_bytes: usize,
) -> PyResult<HostGroup> {
    let memory = contiguous_mut("segment", segment.as_slice_mut())?;
    HostGroup::new(memory, rank, world_size, slot_bytes).map_err(|e| Python::attach(|py| e.into_py_err(py)))
}

fn element_type(name: &str) -> PyResult<ElementType> {
    match name {
        "float32" => Ok(ElementType::F32),
        "bfloat16" => Ok(ElementType::BF16),
        other => Err(bad_kernel_argument(format!("host collectives sum float32 or bfloat16, not {other}"))),
    }
}

/// Bytes of a host group's shared segment; see `rust_sched/kernels/src/host_group.rs`.
#[pyfunction]
pub fn host_group_bytes(world_size: usize, slot_bytes: usize) -> usize {
    pyengine_kernels::segment_bytes(world_size, slot_bytes)
}

/// Records `pid` as `rank`'s process in the segment (the waiting ranks watch it).
#[pyfunction]
pub fn host_group_register(
    mut segment: PyReadwriteArray1<'_, u8>,
    rank: usize,
    world_size: usize,
    slot_bytes: usize,
    pid: u64,
) -> PyResult<()> {
    host_group(&mut segment, rank, world_size, slot_bytes)?.register(pid);
    Ok(())
}

/// Sums `data` (the bytes of a float32 or bfloat16 tensor) over the host group in place,
/// the same bits on every rank; each wait for a peer bounded by `timeout_s`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn host_all_reduce(
    py: Python<'_>,
    mut segment: PyReadwriteArray1<'_, u8>,
    mut data: PyReadwriteArray1<'_, u8>,
    element: &str,
    rank: usize,
    world_size: usize,
    slot_bytes: usize,
    timeout_s: f64,
) -> PyResult<()> {
    check_disjoint(&[("data", span(&**data))], &[("segment", span(&**segment))])?;
    let element = element_type(element)?;
    let group = host_group(&mut segment, rank, world_size, slot_bytes)?;
    let data = contiguous_mut("data", data.as_slice_mut())?;
    let timeout = Duration::from_secs_f64(timeout_s.max(0.0));
    call(py, || group.all_reduce(data, element, timeout))
}

/// Gathers every rank's `data` bytes into `out` on rank 0 (rank r's at `r * len(data)`);
/// the other ranks pass None.
#[pyfunction]
#[pyo3(signature = (segment, data, out, rank, world_size, slot_bytes, timeout_s))]
#[allow(clippy::too_many_arguments)]
pub fn host_gather(
    py: Python<'_>,
    mut segment: PyReadwriteArray1<'_, u8>,
    data: PyReadonlyArray1<'_, u8>,
    out: Option<PyReadwriteArray1<'_, u8>>,
    rank: usize,
    world_size: usize,
    slot_bytes: usize,
    timeout_s: f64,
) -> PyResult<()> {
    let mut written = vec![];
    written.extend(out.as_ref().map(|o| ("out", span(&***o))));
    check_disjoint(&written, &[("data", span(&*data)), ("segment", span(&**segment))])?;
    let group = host_group(&mut segment, rank, world_size, slot_bytes)?;
    let data = contiguous("data", data.as_slice())?;
    let mut out = out;
    let out = out.as_mut().map(|o| contiguous_mut("out", o.as_slice_mut())).transpose()?;
    let timeout = Duration::from_secs_f64(timeout_s.max(0.0));
    call(py, || group.gather(data, out, timeout))
}

/// Element `index` of `words` (an int64 array in shared memory) as an atomic word.
fn shared_word<'a>(words: &'a mut PyReadwriteArray1<'_, i64>, index: usize) -> PyResult<&'a AtomicU64> {
    let slice = contiguous_mut("words", words.as_slice_mut())?;
    let length = slice.len();
    let word = slice
        .get_mut(index)
        .ok_or_else(|| bad_kernel_argument(format!("word {index} of an array of {length}")))?;
    // SAFETY: an i64 is 8-byte aligned and as large as an AtomicU64; the array outlives the borrow.
    Ok(unsafe { &*(word as *mut i64 as *const AtomicU64) })
}

/// Advances `words[index]` by one (sequentially consistent: what was written before is
/// visible to a reader that sees the new value); returns the new value.
#[pyfunction]
pub fn shared_word_advance(mut words: PyReadwriteArray1<'_, i64>, index: usize) -> PyResult<u64> {
    Ok(pyengine_kernels::sequence_word::advance(shared_word(&mut words, index)?))
}

/// `words[index]`, read sequentially consistent.
#[pyfunction]
pub fn shared_word_read(mut words: PyReadwriteArray1<'_, i64>, index: usize) -> PyResult<u64> {
    Ok(pyengine_kernels::sequence_word::read(shared_word(&mut words, index)?))
}

/// Sets `words[index]`, sequentially consistent.
#[pyfunction]
pub fn shared_word_write(mut words: PyReadwriteArray1<'_, i64>, index: usize, value: u64) -> PyResult<()> {
    pyengine_kernels::sequence_word::write(shared_word(&mut words, index)?, value);
    Ok(())
}

/// Polls `words[index]` until it differs from `last` (returns the new value) or
/// `timeout_s` passed (None); spins, then yields its core; the GIL is released.
#[pyfunction]
pub fn shared_word_wait_past(
    py: Python<'_>,
    mut words: PyReadwriteArray1<'_, i64>,
    index: usize,
    last: u64,
    timeout_s: f64,
) -> PyResult<Option<u64>> {
    let word = shared_word(&mut words, index)?;
    let timeout = Duration::from_secs_f64(timeout_s.max(0.0));
    call(py, || {
        Ok::<_, std::convert::Infallible>(pyengine_kernels::sequence_word::wait_past(word, last, timeout))
    })
}

/// Shapes of a skinny product: `x` [rows, k] and `out` [rows, n].
fn gemv_shapes(
    out: &PyReadwriteArray2<'_, f32>,
    x: &PyReadonlyArray2<'_, f32>,
) -> PyResult<(usize, usize, usize)> {
    let (rows, k) = (x.shape()[0], x.shape()[1]);
    if out.shape()[0] != rows {
        return Err(bad_kernel_argument(format!(
            "gemv: out {:?} needs one row per row of x ({rows})",
            out.shape()
        )));
    }
    Ok((rows, k, out.shape()[1]))
}

/// `out = x W^T` for a float32 weight [n, k], read once; see `rust_sched/kernels/src/gemv.rs`.
#[pyfunction]
#[pyo3(signature = (out, x, weight, num_threads = 1))]
pub fn gemv_f32(
    py: Python<'_>,
    mut out: PyReadwriteArray2<'_, f32>,
    x: PyReadonlyArray2<'_, f32>,
    weight: PyReadonlyArray2<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    check_disjoint(&[("out", span(&**out))], &[("x", span(&*x)), ("weight", span(&*weight))])?;
    let (rows, k, n) = gemv_shapes(&out, &x)?;
    if weight.shape() != [n, k] {
        return Err(bad_kernel_argument(format!("gemv_f32: weight {:?} must be [{n}, {k}]", weight.shape())));
    }
    let weight = Weight {
        data: WeightData::F32(contiguous("weight", weight.as_slice())?),
        scales: None,
        biases: None,
        out_features: n,
        in_features: k,
        group_size: k,
    };
    let x = contiguous("x", x.as_slice())?;
    let out = contiguous_mut("out", out.as_slice_mut())?;
    call(py, || pyengine_kernels::gemv(weight, x, rows, out, num_threads))
}

/// `out = x W^T` for a PackedWeight's int8 or int4 integers (`qweight` int8 [n, k] or
/// uint8 [n, k / 2]), read once; see `rust_sched/kernels/src/gemv.rs`.
#[pyfunction]
#[pyo3(signature = (out, x, qweight, scales, biases, group_size, num_threads = 1))]
#[allow(clippy::too_many_arguments)]
pub fn gemv_quantized(
    py: Python<'_>,
    mut out: PyReadwriteArray2<'_, f32>,
    x: PyReadonlyArray2<'_, f32>,
    qweight: &Bound<'_, PyAny>,
    scales: PyReadonlyArray2<'_, f32>,
    biases: Option<PyReadonlyArray2<'_, f32>>,
    group_size: usize,
    num_threads: usize,
) -> PyResult<()> {
    let (rows, k, n) = gemv_shapes(&out, &x)?;
    let int8 = qweight.extract::<PyReadonlyArray2<'_, i8>>().ok();
    let int4 = if int8.is_none() { qweight.extract::<PyReadonlyArray2<'_, u8>>().ok() } else { None };
    let (data, data_span) = match (&int8, &int4) {
        (Some(q), _) if q.shape() == [n, k] => {
            (WeightData::Int8(contiguous("qweight", q.as_slice())?), span(&**q))
        }
        (_, Some(q)) if q.shape() == [n, k / 2] && k % 2 == 0 => {
            (WeightData::Int4(contiguous("qweight", q.as_slice())?), span(&**q))
        }
        _ => {
            return Err(bad_kernel_argument(format!(
                "gemv_quantized: qweight must be int8 [{n}, {k}] or uint8 [{n}, {}]",
                k / 2
            )))
        }
    };
    let mut read = vec![("x", span(&*x)), ("qweight", data_span), ("scales", span(&*scales))];
    read.extend(biases.as_ref().map(|b| ("biases", span(&**b))));
    check_disjoint(&[("out", span(&**out))], &read)?;
    let weight = Weight {
        data,
        scales: Some(contiguous("scales", scales.as_slice())?),
        biases: biases.as_ref().map(|b| contiguous("biases", b.as_slice())).transpose()?,
        out_features: n,
        in_features: k,
        group_size,
    };
    let x = contiguous("x", x.as_slice())?;
    let out = contiguous_mut("out", out.as_slice_mut())?;
    call(py, || pyengine_kernels::gemv(weight, x, rows, out, num_threads))
}
