//! Skinny matrix products `out = x W^T` for a few rows of `x` (decode steps), reading a
//! float32, int8 or int4 weight exactly once.
//!
//! At batch 1 a decode step reads every weight once and does two flops per weight, so its
//! speed is the memory bandwidth divided by the weight bytes. A general GEMM (oneDNN,
//! MKL) is built for the reuse a wide `x` gives and leaves bandwidth unused on a single
//! row; these kernels stream each weight row once, decode it in registers (int8: sign
//! extend and convert; int4: two nibbles per byte) and multiply it into up to four rows
//! of `x` at a time. Weight rows are taken in blocks of [`ROW_BLOCK`], and every block of
//! `x` rows goes over one weight block while it is still in the L1/L2 cache, so a wider
//! `x` (batch 32) still reads the weights from memory once.
//!
//! The weight format is PackedWeight's (`pyengine/models/quantization/packed.py`):
//! `W[n, k] = scale[n, k / G] * q[n, k] + bias[n, k / G]`; int4 bytes hold the even
//! column in the low nibble. The kernel computes, per group, `scale * (x . q) + bias *
//! sum(x)` (the group sums of `x` taken once per call). For int4, `x` is reordered once
//! per call so that the low nibbles of 8 bytes meet 8 even columns and the high nibbles
//! the 8 odd ones: the weights are read as stored, with no repacking at load.
//!
//! The work is split over output features (weight rows), one part per thread, on
//! PyTorch's OpenMP team ([`for_each_part`]). [`crate::gemv_avx2`] holds the AVX2 + FMA
//! inner loops (chosen at run time); the portable loops here serve other CPUs and are the
//! tests' reference.

use super::parallel::for_each_part;
use super::KernelError;

/// Weight rows per cache block (each `x` row block goes over them while they are cached).
pub(crate) const ROW_BLOCK: usize = 8;
/// Columns per decoded chunk: every group size and `K` must be a multiple of it.
pub const CHUNK: usize = 16;
/// Weight bytes per thread below which a call stays on one thread.
const BYTES_PER_THREAD: usize = 1 << 16;

/// A weight `W` [n, k] in one of PackedWeight's formats.
#[derive(Clone, Copy)]
pub enum WeightData<'a> {
    /// float32 [n, k].
    F32(&'a [f32]),
    /// int8 [n, k], signed.
    Int8(&'a [i8]),
    /// uint8 [n, k / 2], two unsigned nibbles per byte (low nibble: even column).
    Int4(&'a [u8]),
}

/// A weight and its per-group scales and biases (none for float32).
#[derive(Clone, Copy)]
pub struct Weight<'a> {
    pub data: WeightData<'a>,
    /// [n, k / group] (integer formats).
    pub scales: Option<&'a [f32]>,
    /// [n, k / group], or None for zero.
    pub biases: Option<&'a [f32]>,
    pub out_features: usize,
    pub in_features: usize,
    /// Columns per scale (`in_features` for one group per row; float32: `in_features`).
    pub group_size: usize,
}

/// What the inner loops see: `x` rows already reordered for the format, group sums, and
/// the output written through a raw pointer (each part writes its own columns).
pub(crate) struct Problem<'a> {
    pub weight: Weight<'a>,
    /// [rows, k], reordered per chunk for int4.
    pub x: &'a [f32],
    /// [rows, k / group] when the weight has biases.
    pub x_sums: &'a [f32],
    pub rows: usize,
    pub out: OutPtr,
}

/// The output [rows, n]: parts write disjoint column ranges of it.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub *mut f32);
// SAFETY: every part writes only the columns of its own weight rows, so no two threads
// touch the same element, and the caller's `&mut` outlives the parallel region.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out[r, n] = sum_k x[r, k] W[n, k]` for `rows` rows of `x` ([rows, k]); `out` is
/// [rows, n]. Uses up to `num_threads` threads for large weights.
pub fn gemv(
    weight: Weight<'_>,
    x: &[f32],
    rows: usize,
    out: &mut [f32],
    num_threads: usize,
) -> Result<(), KernelError> {
    check(&weight, x, rows, out)?;
    let (n, k, group) = (weight.out_features, weight.in_features, weight.group_size);
    let groups = k / group;
    let x_sums: Vec<f32> = match weight.biases {
        Some(_) => x.chunks_exact(group).map(|part| part.iter().sum()).collect(),
        None => Vec::new(),
    };
    let reordered;
    let x = if matches!(weight.data, WeightData::Int4(_)) {
        reordered = deinterleave(x);
        &reordered[..]
    } else {
        x
    };
    debug_assert!(x_sums.is_empty() || x_sums.len() == rows * groups);
    let problem = Problem { weight, x, x_sums: &x_sums, rows, out: OutPtr(out.as_mut_ptr()) };
    let bytes = weight_bytes(&weight);
    let parts = num_threads.clamp(1, (bytes / BYTES_PER_THREAD).max(1)).min(n.div_ceil(ROW_BLOCK));
    let blocks = n.div_ceil(ROW_BLOCK);
    let avx2 = avx2_available();
    for_each_part(parts, &|part| {
        let first = blocks * part / parts * ROW_BLOCK;
        let last = (blocks * (part + 1) / parts * ROW_BLOCK).min(n);
        if avx2 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX2 and FMA (checked at run time); `check` validated
            // every length the loops index with.
            unsafe {
                crate::gemv_avx2::rows(&problem, first, last)
            };
        } else {
            portable_rows(&problem, first, last);
        }
    });
    Ok(())
}

fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn weight_bytes(weight: &Weight<'_>) -> usize {
    match weight.data {
        WeightData::F32(w) => w.len() * 4,
        WeightData::Int8(w) => w.len(),
        WeightData::Int4(w) => w.len(),
    }
}

/// Each chunk of 16 columns as its 8 even columns then its 8 odd ones: the order in which
/// the low and high nibbles of 8 int4 bytes come out.
fn deinterleave(x: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (src, dst) in x.chunks_exact(CHUNK).zip(out.chunks_exact_mut(CHUNK)) {
        for i in 0..CHUNK / 2 {
            dst[i] = src[2 * i];
            dst[CHUNK / 2 + i] = src[2 * i + 1];
        }
    }
    out
}

fn check(weight: &Weight<'_>, x: &[f32], rows: usize, out: &mut [f32]) -> Result<(), KernelError> {
    let (n, k, group) = (weight.out_features, weight.in_features, weight.group_size);
    let fail = |what: String| Err(KernelError::new(format!("gemv: {what}")));
    if n == 0 || k == 0 || k % CHUNK != 0 || group == 0 || k % group != 0 || group % CHUNK != 0 {
        return fail(format!(
            "in_features ({k}) and group_size ({group}) must be positive multiples of {CHUNK}, the group \
             dividing in_features, and out_features ({n}) positive"
        ));
    }
    let groups = k / group;
    let data_len = match weight.data {
        WeightData::F32(w) => (w.len(), n * k),
        WeightData::Int8(w) => (w.len(), n * k),
        WeightData::Int4(w) => (w.len(), n * k / 2),
    };
    if data_len.0 != data_len.1 {
        return fail(format!("the weight holds {} elements, [{n}, {k}] needs {}", data_len.0, data_len.1));
    }
    let float = matches!(weight.data, WeightData::F32(_));
    match (float, weight.scales) {
        (true, Some(_)) => return fail("a float32 weight takes no scales".into()),
        (false, None) => return fail("an integer weight needs scales".into()),
        (false, Some(s)) if s.len() != n * groups => {
            return fail(format!("scales hold {}, [{n}, {groups}] needs {}", s.len(), n * groups))
        }
        _ => {}
    }
    if float && (weight.biases.is_some() || group != k) {
        return fail("a float32 weight takes no biases and one group".into());
    }
    if let Some(b) = weight.biases {
        if b.len() != n * groups {
            return fail(format!("biases hold {}, [{n}, {groups}] needs {}", b.len(), n * groups));
        }
    }
    if x.len() != rows * k || out.len() != rows * n {
        return fail(format!(
            "x holds {} floats and out {}; {rows} rows of [{k}] in and [{n}] out need {} and {}",
            x.len(),
            out.len(),
            rows * k,
            rows * n
        ));
    }
    Ok(())
}

/// The weight element `(n, k)` as stored (column `k` in the reordered `x`'s order for
/// int4 is handled by the caller): the integer (or float) before scaling.
#[inline(always)]
fn element(data: WeightData<'_>, n: usize, k: usize, width: usize) -> f32 {
    match data {
        WeightData::F32(w) => w[n * width + k],
        WeightData::Int8(w) => w[n * width + k] as f32,
        WeightData::Int4(w) => {
            let byte = w[(n * width + k) / 2];
            (if k % 2 == 0 { byte & 0x0F } else { byte >> 4 }) as f32
        }
    }
}

/// Column of the original order that position `j` of the reordered `x` holds.
#[inline(always)]
fn source_column(int4: bool, j: usize) -> usize {
    if !int4 {
        return j;
    }
    let (chunk, i) = (j / CHUNK, j % CHUNK);
    chunk * CHUNK + if i < CHUNK / 2 { 2 * i } else { 2 * (i - CHUNK / 2) + 1 }
}

/// Weight rows `[first, last)` of every output row, in plain loops.
pub(crate) fn portable_rows(problem: &Problem<'_>, first: usize, last: usize) {
    let w = problem.weight;
    let (k, group) = (w.in_features, w.group_size);
    let groups = k / group;
    let int4 = matches!(w.data, WeightData::Int4(_));
    for r in 0..problem.rows {
        let x = &problem.x[r * k..(r + 1) * k];
        for n in first..last {
            let mut total = 0f32;
            for g in 0..groups {
                let columns = g * group..(g + 1) * group;
                let acc: f32 = x[columns.clone()]
                    .iter()
                    .zip(columns)
                    .map(|(v, j)| v * element(w.data, n, source_column(int4, j), k))
                    .sum();
                let scale = w.scales.map_or(1.0, |s| s[n * groups + g]);
                let bias = w.biases.map_or(0.0, |b| b[n * groups + g] * problem.x_sums[r * groups + g]);
                total += acc * scale + bias;
            }
            // SAFETY: r < rows and n < out_features, inside `out` (checked); this part
            // alone writes column n.
            unsafe { *problem.out.0.add(r * w.out_features + n) = total };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random numbers (no dependency).
    fn numbers(seed: u64, count: usize) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..count)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// `x W^T` with `W` dequantized first, in f64, and each element's sum of |products|
    /// (the scale of its float32 rounding error).
    fn reference(dense: &[f32], x: &[f32], rows: usize, n: usize, k: usize) -> Vec<(f32, f32)> {
        let mut out = vec![(0f32, 0f32); rows * n];
        for r in 0..rows {
            for j in 0..n {
                let terms = (0..k).map(|c| x[r * k + c] as f64 * dense[j * k + c] as f64);
                out[r * n + j] = (terms.clone().sum::<f64>() as f32, terms.map(f64::abs).sum::<f64>() as f32);
            }
        }
        out
    }

    fn close(got: &[f32], want: &[(f32, f32)]) {
        for (i, (a, (b, magnitude))) in got.iter().zip(want).enumerate() {
            assert!((a - b).abs() <= 1e-5 * (1.0 + magnitude), "element {i}: {a} vs {b} (terms {magnitude})");
        }
    }

    /// A dense reference and a maker of the same weight in one format.
    type Case = (Vec<f32>, Box<dyn Fn() -> Weight<'static>>);

    fn formats(n: usize, k: usize, group: usize) -> Vec<Case> {
        let groups = k / group;
        let scales: &'static [f32] =
            numbers(3, n * groups).into_iter().map(|s| s.abs() + 0.01).collect::<Vec<_>>().leak();
        let biases: &'static [f32] = numbers(4, n * groups).leak();
        let floats: &'static [f32] = numbers(5, n * k).leak();
        let int8: &'static [i8] =
            numbers(6, n * k).iter().map(|v| (v * 127.0) as i8).collect::<Vec<_>>().leak();
        let nibbles: Vec<u8> = numbers(7, n * k).iter().map(|v| ((v + 1.0) * 7.99) as u8).collect();
        let int4: &'static [u8] =
            nibbles.chunks_exact(2).map(|p| p[0] | (p[1] << 4)).collect::<Vec<_>>().leak();
        let dequant = |q: &dyn Fn(usize) -> f32, with_bias: bool| -> Vec<f32> {
            (0..n * k)
                .map(|i| {
                    let g = (i / k) * groups + (i % k) / group;
                    scales[g] * q(i) + if with_bias { biases[g] } else { 0.0 }
                })
                .collect()
        };
        vec![
            (
                floats.to_vec(),
                Box::new(move || Weight {
                    data: WeightData::F32(floats),
                    scales: None,
                    biases: None,
                    out_features: n,
                    in_features: k,
                    group_size: k,
                }),
            ),
            (
                dequant(&|i| int8[i] as f32, false),
                Box::new(move || Weight {
                    data: WeightData::Int8(int8),
                    scales: Some(scales),
                    biases: None,
                    out_features: n,
                    in_features: k,
                    group_size: group,
                }),
            ),
            (
                dequant(&|i| int8[i] as f32, true),
                Box::new(move || Weight {
                    data: WeightData::Int8(int8),
                    scales: Some(scales),
                    biases: Some(biases),
                    out_features: n,
                    in_features: k,
                    group_size: group,
                }),
            ),
            (
                dequant(&|i| nibbles[i] as f32, true),
                Box::new(move || Weight {
                    data: WeightData::Int4(int4),
                    scales: Some(scales),
                    biases: Some(biases),
                    out_features: n,
                    in_features: k,
                    group_size: group,
                }),
            ),
        ]
    }

    #[test]
    fn every_format_matches_the_dequantized_product() {
        for (rows, n, k, group, threads) in
            [(1, 37, 256, 128, 1), (5, 19, 64, 32, 2), (9, 8, 128, 128, 3), (32, 70, 512, 128, 2)]
        {
            let x = numbers(rows as u64, rows * k);
            for (dense, weight) in formats(n, k, group) {
                let want = reference(&dense, &x, rows, n, k);
                let mut got = vec![f32::NAN; rows * n];
                gemv(weight(), &x, rows, &mut got, threads).unwrap();
                close(&got, &want);
                // The portable loops alone (the AVX2 ones ran above where present).
                let reordered =
                    if matches!(weight().data, WeightData::Int4(_)) { deinterleave(&x) } else { x.clone() };
                let sums: Vec<f32> = x.chunks_exact(group).map(|p| p.iter().sum()).collect();
                let mut plain = vec![f32::NAN; rows * n];
                let problem = Problem {
                    weight: weight(),
                    x: &reordered,
                    x_sums: &sums,
                    rows,
                    out: OutPtr(plain.as_mut_ptr()),
                };
                portable_rows(&problem, 0, n);
                close(&plain, &want);
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let w = [0f32; 64];
        let weight = Weight {
            data: WeightData::F32(&w),
            scales: None,
            biases: None,
            out_features: 2,
            in_features: 32,
            group_size: 32,
        };
        let mut out = [0f32; 2];
        assert!(gemv(weight, &[0f32; 31], 1, &mut out, 1).is_err());
        let odd = Weight { in_features: 24, group_size: 24, out_features: 2, ..weight };
        assert!(gemv(odd, &[0f32; 24], 1, &mut out, 1).is_err());
        let scaled = Weight { scales: Some(&[1.0, 1.0]), ..weight };
        assert!(gemv(scaled, &[0f32; 32], 1, &mut out, 1).is_err());
        assert!(gemv(weight, &[0f32; 32], 1, &mut out, 1).is_ok());
    }
}
