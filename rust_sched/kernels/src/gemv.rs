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
//! inner loops (chosen at run time, [`Loops`]); the portable loops here serve other CPUs
//! and are the tests' reference.

use super::gemv_digits::{digits, digits_fit, DigitLayout, Digits, BLOCK_COLUMNS, BYTE_BLOCK_COLUMNS};
use super::parallel::for_each_part;
use super::KernelError;

/// Weight rows per cache block (each `x` row block goes over them while they are cached).
pub(crate) const ROW_BLOCK: usize = 8;
/// Columns per decoded chunk: every group size and `K` must be a multiple of it.
pub const CHUNK: usize = 16;
/// GGUF Q8_0's group size: int8 weights in such groups (`K` a multiple of 64) take
/// [`Loops::Int8Q8`] where the CPU has AVX-512F.
pub(crate) const Q8_GROUP: usize = 32;
/// Rows of `x` up to which int4 takes the VNNI loops where the CPU has them. They spend 8
/// integer products per row and 128 weights against the 16-column loops' 16 FMAs, but
/// their per-group combining costs more, so past the weight decoding they share they
/// are no faster. On the Intel Xeon development VM (AVX-512 VNNI, 2 vCPUs, a streamed
/// token, two threads, `cargo bench -p pyengine-kernels --bench gemv -- --formats int4
/// --rows R`, alternated): one row 9.7-10.0 -> 6.9-8.2 ms, two 13.7-14.0 -> 13.1-13.4,
/// three 15.5-15.7 -> 16.9-17.7, four 20.2 -> 22.3.
const VNNI_ROWS: usize = 2;
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
    pub loops: Loops,
    /// `x` as digits, for [`Loops::Int4Vnni`] and [`Loops::Int8Vnni`] only.
    pub digits: Option<&'a Digits>,
}

/// Which inner loops multiply, chosen per call from the CPU, the format and `x`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Loops {
    /// The AVX2 + FMA loops of `gemv_avx2` (portable ones where the CPU lacks them); int4
    /// `x` in [`deinterleave`] order.
    Plain,
    /// int8 on AVX-512F: `gemv_int8_avx512::row`.
    Int8Avx512,
    /// int8 in groups of 32 (GGUF Q8_0), `in_features` a multiple of 64, on AVX-512F:
    /// `gemv_int8_avx512::row_q8`.
    Int8Q8,
    /// int4 on AMD CPUs with AVX-512, groups a multiple of 128, `x` within
    /// [`planes_fit`]: `gemv_planes`, `x` in [`planes`] order.
    Int4Planes,
    /// int4 on other CPUs with AVX-512 VNNI, groups a multiple of 128, `x` within
    /// `digits_fit`: `gemv_int4_vnni`, on `x`'s digits (`gemv_digits`).
    Int4Vnni,
    /// int8 on CPUs with AVX-512 VNNI, groups a multiple of 64, `x` within `digits_fit`:
    /// `gemv_int8_vnni`, on `x`'s digits in the int8 layout.
    Int8Vnni,
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
    let group = weight.group_size;
    let loops = match weight.data {
        WeightData::Int4(_) if group % PLANE_COLUMNS == 0 && planes_cpu() && planes_fit(x) => {
            Loops::Int4Planes
        }
        WeightData::Int4(_)
            if rows <= VNNI_ROWS && group % BLOCK_COLUMNS == 0 && vnni_cpu() && digits_fit(x) =>
        {
            Loops::Int4Vnni
        }
        WeightData::Int8(_)
            if avx512_cpu() && group == Q8_GROUP && weight.in_features % (2 * Q8_GROUP) == 0 =>
        {
            Loops::Int8Q8
        }
        WeightData::Int8(_) if group % BYTE_BLOCK_COLUMNS == 0 && vnni_cpu() && digits_fit(x) => {
            Loops::Int8Vnni
        }
        WeightData::Int8(_) if avx512_cpu() => Loops::Int8Avx512,
        _ => Loops::Plain,
    };
    run(weight, x, rows, out, num_threads, loops);
    Ok(())
}

/// [`gemv`] after its checks, with the loops chosen (the tests choose each one the CPU
/// can run).
pub(crate) fn run(
    weight: Weight<'_>,
    x: &[f32],
    rows: usize,
    out: &mut [f32],
    num_threads: usize,
    loops: Loops,
) {
    let (n, k, group) = (weight.out_features, weight.in_features, weight.group_size);
    let groups = k / group;
    let x_sums: Vec<f32> = match weight.biases {
        Some(_) => x.chunks_exact(group).map(|part| part.iter().sum()).collect(),
        None => Vec::new(),
    };
    let avx2 = avx2_available();
    let int4 = matches!(weight.data, WeightData::Int4(_));
    let digits = match loops {
        Loops::Int4Vnni => Some(digits(x, rows, k, group, DigitLayout::Nibbles)),
        Loops::Int8Vnni => Some(digits(x, rows, k, group, DigitLayout::Bytes)),
        _ => None,
    };
    let reordered;
    let x = match loops {
        Loops::Int4Planes => {
            reordered = planes(x);
            &reordered[..]
        }
        Loops::Plain if int4 => {
            reordered = deinterleave(x);
            &reordered[..]
        }
        _ => x,
    };
    debug_assert!(x_sums.is_empty() || x_sums.len() == rows * groups);
    let out = OutPtr(out.as_mut_ptr());
    let problem = Problem { weight, x, x_sums: &x_sums, rows, out, loops, digits: digits.as_ref() };
    let bytes = weight_bytes(&weight);
    let parts = num_threads.clamp(1, (bytes / BYTES_PER_THREAD).max(1)).min(n.div_ceil(ROW_BLOCK));
    let blocks = n.div_ceil(ROW_BLOCK);
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

/// Whether the CPU has AVX-512F (and AVX2 + FMA, which the loops around the AVX-512 ones use).
fn avx512_cpu() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2_available() && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU has AVX-512 VNNI (and BW, for the byte shifts of `gemv_int4_vnni`).
fn vnni_cpu() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512_cpu()
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU runs the int4 plane loops (`gemv_planes`): AVX-512F, and an AMD CPU.
/// They feed subnormal floats to the FMAs; AMD's take them at full speed (measured on a
/// Zen 5), while Intel's have been known to take a microcode assist on subnormal inputs,
/// which would cost far more than the loops save; not measured there, so not taken.
/// Asked once per process: CPUID is a trapping instruction under virtualisation (about
/// 5 us each on the development VM), and int4 products run a hundred times a step.
fn planes_cpu() -> bool {
    static PLANES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PLANES.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: CPUID leaf 0 exists on every x86-64 CPU (newer compilers call it safe).
            #[allow(unused_unsafe)]
            let vendor = unsafe { std::arch::x86_64::__cpuid(0) };
            let amd = (vendor.ebx, vendor.edx, vendor.ecx) == (0x6874_7541, 0x6974_6E65, 0x444D_4163);
            amd && avx512_cpu()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
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

/// Columns of one int4 plane block: 64 bytes, read as 16 little-endian 32-bit words.
pub(crate) const PLANE_COLUMNS: usize = 128;

/// `x` for the int4 plane loops (`gemv_planes`), on groups that are a multiple of
/// [`PLANE_COLUMNS`]. In each block (64 bytes), 32-bit word `i` holds columns `8i + p`
/// for nibble `p = 0..8` at bits `4p..4p + 4`. The loops take nibble `p` of all the
/// block's words at once with one mask (nibbles 5..8 after shifting the words
/// down by 20 bits) and use the masked word itself as a float: a subnormal,
/// `q * 2^(4p' - 149)` (`p' = p`, or `p - 5` for the shifted ones), no conversion. So
/// position `16p + i` of a block here holds its column `8i + p` times `2^(100 - 4p')`, a
/// power of two:
/// every product is `x * q * 2^-49`, exactly (down to `|x|` of about `2^-77`, below
/// which the products are subnormal and keep fewer bits), and the loops multiply the
/// group's scale by `2^49`. Only taken where [`planes_fit`] holds.
pub(crate) fn planes(x: &[f32]) -> Vec<f32> {
    let (columns, words) = (PLANE_COLUMNS, PLANE_COLUMNS / 8);
    let mut out = vec![0f32; x.len()];
    for (src, dst) in x.chunks_exact(columns).zip(out.chunks_exact_mut(columns)) {
        for p in 0..8 {
            let shift = 4 * if p < 5 { p } else { p - 5 };
            let factor = (100.0 - shift as f32).exp2();
            for i in 0..words {
                dst[words * p + i] = src[8 * i + p] * factor;
            }
        }
    }
    out
}

/// Whether the plane loops give this call's products exactly: every `|x|` below `2^27`
/// (scaled by up to `2^100` it stays finite; larger, infinite or NaN `x` take the other
/// loops, whose NaN and infinity behaviour is plain float arithmetic), and subnormal
/// inputs not read as zero (MXCSR's DAZ bit clear; flush-to-zero of results is harmless,
/// as the products are normal where they matter).
pub(crate) fn planes_fit(x: &[f32]) -> bool {
    x.iter().all(|v| v.abs() < PLANE_X_LIMIT) && !denormals_are_zero()
}

const PLANE_X_LIMIT: f32 = 134_217_728.0; // 2^27

fn denormals_are_zero() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        #[allow(deprecated)] // _mm_getcsr: reading MXCSR has no other stable form
        // SAFETY: SSE is part of x86_64.
        let csr = unsafe { std::arch::x86_64::_mm_getcsr() };
        csr & (1 << 6) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        true
    }
}

fn check(weight: &Weight<'_>, x: &[f32], rows: usize, out: &mut [f32]) -> Result<(), KernelError> {
    check_weight(weight)?;
    let (n, k) = (weight.out_features, weight.in_features);
    if x.len() != rows * k || out.len() != rows * n {
        return Err(KernelError::new(format!(
            "gemv: x holds {} floats and out {}; {rows} rows of [{k}] in and [{n}] out need {} and {}",
            x.len(),
            out.len(),
            rows * k,
            rows * n
        )));
    }
    Ok(())
}

/// [`gemv`]'s checks of the weight alone: its shape, group size, scales and biases.
pub(crate) fn check_weight(weight: &Weight<'_>) -> Result<(), KernelError> {
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

/// Writes `out[row, n] = value + sum_g bias[n, g] * x_sums[row, g]`: the end of every
/// vectorised loop's output element, `value` being its scaled group sums.
///
/// # Safety
/// `row < rows` and `n < out_features` (inside `out`, checked), and only the caller's part
/// writes column `n`.
#[inline(always)]
pub(crate) unsafe fn finish(problem: &Problem<'_>, n: usize, row: usize, mut value: f32) {
    let w = problem.weight;
    if let Some(biases) = w.biases {
        let groups = w.in_features / w.group_size;
        let sums = &problem.x_sums[row * groups..(row + 1) * groups];
        value += biases[n * groups..(n + 1) * groups].iter().zip(sums).map(|(b, s)| b * s).sum::<f32>();
    }
    // SAFETY: the caller's.
    unsafe { *problem.out.0.add(row * w.out_features + n) = value };
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
        // Every seventh weight -128, the int8 range's end (the VNNI loops flip its sign bit).
        let int8: &'static [i8] = numbers(6, n * k)
            .iter()
            .enumerate()
            .map(|(i, v)| if i % 7 == 0 { i8::MIN } else { (v * 127.0) as i8 })
            .collect::<Vec<_>>()
            .leak();
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
                    loops: Loops::Plain,
                    digits: None,
                };
                portable_rows(&problem, 0, n);
                close(&plain, &want);
            }
        }
    }

    /// The loops this CPU can run for a format, `Plain` first.
    fn loops(int4: bool) -> Vec<Loops> {
        let mut all = vec![Loops::Plain];
        if int4 && planes_cpu() {
            all.push(Loops::Int4Planes);
        }
        if int4 && vnni_cpu() {
            all.push(Loops::Int4Vnni);
        }
        if !int4 && avx512_cpu() {
            all.push(Loops::Int8Avx512);
            all.push(Loops::Int8Q8); // (for groups of 32 only: the int8 test picks it there)
        }
        if !int4 && vnni_cpu() {
            all.push(Loops::Int8Vnni); // (for groups of 64 and more only, likewise)
        }
        all
    }

    #[test]
    fn int8_loops_match_the_dequantized_product() {
        // Per-channel groups, groups of 32 (Q8_0), of one 64-column block and of 128, with
        // and without biases, every row count the loops specialise and a tail past 4.
        for (rows, n, k, group) in [
            (1, 37, 512, 512),
            (2, 19, 256, 32),
            (3, 9, 96, 32),
            (3, 9, 128, 64),
            (4, 11, 192, 64),
            (6, 21, 512, 128),
        ] {
            for (dense, weight) in formats(n, k, group).into_iter().skip(1).take(2) {
                let x = numbers(rows as u64 + 5, rows * k);
                let want = reference(&dense, &x, rows, n, k);
                let q8 = group == Q8_GROUP && k % (2 * Q8_GROUP) == 0;
                let vnni = group % BYTE_BLOCK_COLUMNS == 0;
                let fits = |l: &Loops| (q8 || *l != Loops::Int8Q8) && (vnni || *l != Loops::Int8Vnni);
                for chosen in loops(false).into_iter().filter(fits) {
                    let mut got = vec![f32::NAN; rows * n];
                    run(weight(), &x, rows, &mut got, 2, chosen);
                    close(&got, &want);
                }
            }
        }
    }

    #[test]
    fn int4_plane_and_vnni_loops_match_the_dequantized_product() {
        // Every row count the loops specialise (1..=4, and a tail past 4), groups of one
        // and two 128-column blocks, an out_features that is no multiple of the row block.
        for (rows, n, k, group) in [(1, 37, 512, 128), (2, 19, 256, 256), (3, 9, 256, 128), (6, 21, 512, 256)]
        {
            let case = formats(n, k, group).pop().expect("int4 is the last format");
            let (dense, weight) = case;
            // Magnitudes from 2^-60 to 2^20: the scaled copies stay normal and finite.
            let x: Vec<f32> = numbers(rows as u64 + 11, rows * k)
                .iter()
                .enumerate()
                .map(|(i, v)| v * ((i % 9) as f32 * 10.0 - 60.0).exp2())
                .collect();
            let want = reference(&dense, &x, rows, n, k);
            for chosen in loops(true) {
                let mut got = vec![f32::NAN; rows * n];
                run(weight(), &x, rows, &mut got, 2, chosen);
                close(&got, &want);
            }
        }
    }

    #[test]
    fn int4_x_too_large_for_the_planes_or_the_digits_takes_the_other_loops() {
        let (n, k, group) = (16, 128, 128);
        let (dense, weight) = formats(n, k, group).pop().expect("int4 is the last format");
        let mut x = numbers(21, k);
        assert!(planes_fit(&x) || denormals_are_zero());
        x[3] = 3.0e8; // past 2^27: scaled by 2^100 it would overflow
        assert!(!planes_fit(&x) && digits_fit(&x));
        let mut got = vec![f32::NAN; n];
        gemv(weight(), &x, 1, &mut got, 1).unwrap();
        close(&got, &reference(&dense, &x, 1, n, k));
        x[3] = 3.0e19; // past 2^64: the digits' exponent would leave a normal float
        assert!(!digits_fit(&x));
        gemv(weight(), &x, 1, &mut got, 1).unwrap();
        close(&got, &reference(&dense, &x, 1, n, k));
        x[3] = f32::INFINITY;
        assert!(!planes_fit(&x) && !digits_fit(&x));
    }

    #[test]
    fn vnni_loops_keep_an_outlier_group_within_float_rounding() {
        // One activation 1,000 times the others' scale in each group: the digits round
        // every element to 2^-30 of that outlier, still inside the float tolerance. int4
        // in groups of 128, int8 per channel (one group of 512) and in groups of 128.
        if !vnni_cpu() {
            return; // no VNNI loops on this CPU to hold to it
        }
        let (rows, n, k) = (2, 24, 512);
        let mut cases =
            vec![(formats(n, k, 128).pop().expect("int4 is the last format"), 128, Loops::Int4Vnni)];
        for group in [k, 128] {
            cases.push((formats(n, k, group).swap_remove(1), group, Loops::Int8Vnni));
        }
        for ((dense, weight), group, chosen) in cases {
            let mut x = numbers(31, rows * k);
            for g in 0..rows * k / group {
                x[g * group + 17] = 1000.0;
            }
            let want = reference(&dense, &x, rows, n, k);
            let mut got = vec![f32::NAN; rows * n];
            run(weight(), &x, rows, &mut got, 2, chosen);
            for (i, (a, (b, magnitude))) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 2e-6 * magnitude,
                    "{chosen:?} element {i}: {a} vs {b} (terms {magnitude})"
                );
            }
        }
    }

    #[test]
    fn int8_x_too_large_for_the_digits_takes_the_float_loops() {
        let (n, k) = (16, 128);
        let (dense, weight) = formats(n, k, k).swap_remove(1);
        let mut x = numbers(23, k);
        x[5] = 3.0e19; // past the digits' range (2^64)
        assert!(!digits_fit(&x));
        let mut got = vec![f32::NAN; n];
        gemv(weight(), &x, 1, &mut got, 1).unwrap();
        close(&got, &reference(&dense, &x, 1, n, k));
    }

    #[test]
    fn planes_put_each_nibble_column_in_its_plane() {
        let x: Vec<f32> = (0..2 * PLANE_COLUMNS).map(|c| c as f32).collect();
        let (columns, words) = (PLANE_COLUMNS, PLANE_COLUMNS / 8);
        for (position, &value) in planes(&x).iter().enumerate() {
            let (block, within) = (position / columns, position % columns);
            let (p, i) = (within / words, within % words);
            let shift = 4 * if p < 5 { p } else { p - 5 };
            let column = block * columns + 8 * i + p;
            assert_eq!(value, column as f32 * (100.0 - shift as f32).exp2(), "position {position}");
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
