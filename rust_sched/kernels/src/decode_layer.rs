//! The front of a decoder layer's decode step in one call: what a pre-norm Llama-family
//! layer computes from its input to its MLP's gate/up projection.
//!
//! The native decode path (`pyengine/models/decode_path.py`) runs every kernel of a decode
//! step already (`rms_norm`, `gemv`, `qk_norm_rope`, `paged_decode_attention`); called one
//! at a time from Python, the calls between them (views, arrays, output tensors, the KV
//! write) cost more than some of the kernels. This runs them in sequence on the same
//! arrays, the same kernels in the same order, so the results are bit for bit the ones
//! the calls give (`tests/test_decode_path.py` compares them):
//!
//! 1. the input RMSNorm (on the first layer of the residual stream `hidden` itself,
//!    later of `residual += hidden`);
//! 2. the fused q/k/v projection (and its bias);
//! 3. q/k norm (Qwen3) and the rotary embedding, in place;
//! 4. each row's new key and value into its cache slot;
//! 5. decode attention over the paged cache;
//! 6. the output projection (and its bias);
//! 7. the post-attention RMSNorm of `residual += o`;
//! 8. the MLP's fused gate/up projection, into the caller's array.
//!
//! The activation and the down projection stay with the caller, which also owns every
//! step's arrays. Tensor parallelism (an all-reduce after the output projection) is not
//! done here: such layers keep the separate calls.

use super::gemv::{check_weight, gemv, Weight};
use super::norm::{check_qk, qk_norm_rope, rms_norm, Norm, QkHeads};
use super::paged_decode::{self, paged_decode_attention, DecodeQueries, PagedKv};
use super::KernelError;

/// A linear as a decode step multiplies by it: the weight and an optional bias [out].
#[derive(Clone, Copy)]
pub struct Linear<'a> {
    pub weight: Weight<'a>,
    pub bias: Option<&'a [f32]>,
}

/// One layer's weights and attention shape.
#[derive(Clone, Copy)]
pub struct LayerWeights<'a> {
    pub input_norm: Norm<'a>,
    pub post_norm: Norm<'a>,
    /// [q heads, k heads, v heads] x head_dim outputs.
    pub qkv: Linear<'a>,
    pub o: Linear<'a>,
    /// [gate, up] outputs.
    pub gate_up: Linear<'a>,
    pub q_norm: Option<Norm<'a>>,
    pub k_norm: Option<Norm<'a>>,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Attention score scale, sliding window (0: none) and soft cap (0: none).
    pub scale: f32,
    pub window: usize,
    pub softcap: f32,
}

/// One layer's paged cache, `[num_blocks, block_size, kv_heads, head_dim]` each.
pub struct LayerCache<'a> {
    pub keys: &'a mut [f32],
    pub values: &'a mut [f32],
    pub block_size: usize,
}

/// What the step's rows bring: their cache slots, block tables, context lengths (the new
/// token included) and rotary tables.
#[derive(Clone, Copy)]
pub struct StepRows<'a> {
    /// [rows] slot (`block * block_size + offset`) of each row's new key and value.
    pub slots: &'a [i64],
    /// [rows, table_width].
    pub block_tables: &'a [i32],
    pub table_width: usize,
    /// [rows].
    pub seq_lens: &'a [i32],
    /// [rows, head_dim] each.
    pub cos: &'a [f32],
    pub sin: &'a [f32],
}

/// Steps 1-8 of the module docs for `rows = step.seq_lens.len()` rows: `hidden` and
/// `residual` are [rows, hidden_size] (`residual` is written: set to `hidden` on the first
/// layer, `first`, else added to; then the attention output added), `gate_up` [rows,
/// gate/up outputs] receives the MLP's input projection. Every argument is checked (each
/// kernel's own checks included) before anything is written, so a refused call leaves
/// the residual stream and the caches as they were.
#[allow(clippy::too_many_arguments)]
pub fn decode_layer_front(
    layer: &LayerWeights<'_>,
    hidden: &[f32],
    residual: &mut [f32],
    first: bool,
    cache: LayerCache<'_>,
    step: &StepRows<'_>,
    gate_up: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    let rows = step.seq_lens.len();
    let width = layer.input_norm.weight.len();
    let (q_width, kv_width) = widths(layer)?;
    let qkv_width = layer.qkv.weight.out_features;
    let heads = QkHeads {
        q_heads: layer.heads,
        k_heads: layer.kv_heads,
        head_dim: layer.head_dim,
        row_stride: qkv_width,
        q_norm: layer.q_norm,
        k_norm: layer.k_norm,
        cos: step.cos,
        sin: step.sin,
    };
    let mut query = vec![0f32; rows * q_width];
    check(layer, hidden, residual, &cache, step, gate_up, rows, width)?;
    check_qk(rows * qkv_width, &heads)?;
    paged_decode::check(&queries(layer, step, &query), &paged(layer, &cache), rows * q_width)?;

    let mut normed = vec![0f32; rows * width];
    if first {
        residual.copy_from_slice(hidden);
        rms_norm(residual, None, layer.input_norm, &mut normed, threads)?;
    } else {
        rms_norm(hidden, Some(residual), layer.input_norm, &mut normed, threads)?;
    }
    let mut qkv = vec![0f32; rows * qkv_width];
    linear(&layer.qkv, &normed, rows, &mut qkv, threads)?;
    qk_norm_rope(&mut qkv, &heads, threads)?;
    for (r, (row, q)) in qkv.chunks_exact(qkv_width).zip(query.chunks_exact_mut(q_width)).enumerate() {
        let at = step.slots[r] as usize * kv_width; // in range: checked
        cache.keys[at..at + kv_width].copy_from_slice(&row[q_width..q_width + kv_width]);
        cache.values[at..at + kv_width].copy_from_slice(&row[q_width + kv_width..]);
        q.copy_from_slice(&row[..q_width]);
    }
    let mut attended = vec![0f32; rows * q_width];
    paged_decode_attention(&queries(layer, step, &query), &paged(layer, &cache), &mut attended, threads)?;
    let mut o = vec![0f32; rows * width];
    linear(&layer.o, &attended, rows, &mut o, threads)?;
    rms_norm(&o, Some(residual), layer.post_norm, &mut normed, threads)?;
    linear(&layer.gate_up, &normed, rows, gate_up, threads)
}

/// The step's queries ([rows, heads, head_dim]) as the attention kernel takes them.
fn queries<'a>(layer: &LayerWeights<'_>, step: &StepRows<'a>, query: &'a [f32]) -> DecodeQueries<'a> {
    DecodeQueries {
        query,
        heads: layer.heads,
        block_tables: step.block_tables,
        table_width: step.table_width,
        seq_lens: step.seq_lens,
        scale: layer.scale,
        window: layer.window,
        softcap: layer.softcap,
    }
}

/// The layer's cache as the attention kernel reads it.
fn paged<'a>(layer: &LayerWeights<'_>, cache: &'a LayerCache<'_>) -> PagedKv<'a> {
    PagedKv {
        keys: cache.keys,
        values: cache.values,
        block_size: cache.block_size,
        kv_heads: layer.kv_heads,
        head_dim: layer.head_dim,
    }
}

/// The q and the k (or v) widths of a q/k/v row, `heads` and `kv_heads` times `head_dim`.
fn widths(layer: &LayerWeights<'_>) -> Result<(usize, usize), KernelError> {
    let fail = || {
        KernelError::new("decode_layer_front: heads and kv_heads must be positive, heads a multiple of kv_heads, and their widths fit in memory".into())
    };
    if layer.heads == 0 || layer.kv_heads == 0 || layer.heads % layer.kv_heads != 0 {
        return Err(fail());
    }
    let q = layer.heads.checked_mul(layer.head_dim).ok_or_else(fail)?;
    let kv = layer.kv_heads.checked_mul(layer.head_dim).ok_or_else(fail)?;
    Ok((q, kv))
}

/// `out = x W^T (+ b)`, the bias added after the product as the modules add it.
fn linear(
    linear: &Linear<'_>,
    x: &[f32],
    rows: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    gemv(linear.weight, x, rows, out, threads)?;
    if let Some(bias) = linear.bias {
        for row in out.chunks_exact_mut(bias.len()) {
            row.iter_mut().zip(bias).for_each(|(y, b)| *y += b);
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn check(
    layer: &LayerWeights<'_>,
    hidden: &[f32],
    residual: &[f32],
    cache: &LayerCache<'_>,
    step: &StepRows<'_>,
    gate_up: &[f32],
    rows: usize,
    width: usize,
) -> Result<(), KernelError> {
    let fail = |what: String| Err(KernelError::new(format!("decode_layer_front: {what}")));
    let (q_width, kv_width) = widths(layer)?;
    if rows == 0 || width == 0 || layer.head_dim == 0 {
        return fail("rows, the hidden size and head_dim must be positive".into());
    }
    for linear in [&layer.qkv, &layer.o, &layer.gate_up] {
        check_weight(&linear.weight)?;
    }
    if hidden.len() != rows * width || residual.len() != rows * width {
        return fail(format!("hidden and residual must be [{rows}, {width}]"));
    }
    if layer.post_norm.weight.len() != width {
        return fail(format!("the post-attention norm must have {width} weights"));
    }
    let (qkv, o, gate_up_weight) = (layer.qkv.weight, layer.o.weight, layer.gate_up.weight);
    if qkv.in_features != width
        || Some(qkv.out_features) != kv_width.checked_mul(2).and_then(|w| w.checked_add(q_width))
    {
        return fail(format!(
            "the q/k/v projection must be [{} , {width}] ({} q and {} kv heads of {})",
            q_width + 2 * kv_width,
            layer.heads,
            layer.kv_heads,
            layer.head_dim
        ));
    }
    if o.in_features != q_width || o.out_features != width {
        return fail(format!("the output projection must be [{width}, {q_width}]"));
    }
    if gate_up_weight.in_features != width || gate_up.len() != rows * gate_up_weight.out_features {
        return fail(format!(
            "the gate/up projection must take {width} inputs and gate_up be [{rows}, its outputs]"
        ));
    }
    for (name, linear) in [("q/k/v", &layer.qkv), ("output", &layer.o), ("gate/up", &layer.gate_up)] {
        if linear.bias.is_some_and(|b| b.len() != linear.weight.out_features) {
            return fail(format!("the {name} projection's bias must have one entry per output"));
        }
    }
    if step.slots.len() != rows || step.cos.len() != rows * layer.head_dim {
        return fail(format!("slots must be [{rows}] and cos / sin [{rows}, {}]", layer.head_dim));
    }
    let slots = cache.keys.len() / kv_width;
    if cache.keys.len() != cache.values.len() || cache.keys.len() % kv_width != 0 {
        return fail("the key and value caches must both be whole slots of kv_heads x head_dim".into());
    }
    if let Some(bad) = step.slots.iter().find(|&&s| s < 0 || s as usize >= slots) {
        return fail(format!("slot {bad} outside the cache's {slots} slots"));
    }
    Ok(())
}
