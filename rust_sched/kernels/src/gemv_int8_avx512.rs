//! The int8 loop for CPUs with AVX-512: 16 weights sign-extended, converted and
//! multiplied per step, half the instructions of the 256-bit loop (`gemv_avx2`), whose
//! conversions (8 weights each, one a cycle) bound a core below its memory bandwidth.
//! Plain floats throughout (no subnormal tricks), so any AVX-512F CPU takes it.

use std::arch::x86_64::*;

use super::gemv::{Problem, WeightData, CHUNK};

/// `out[r0 + r, n]` for `r < R` of an int8 weight: per group, 16 columns a step into `A`
/// accumulators per row (taking turns), the group's sum scaled once.
///
/// # Safety
/// The CPU must have AVX-512F; `problem`'s lengths must have passed `gemv`'s checks.
#[inline]
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)] // `a` picks the accumulator of every row `r`
pub(crate) unsafe fn row<const R: usize, const A: usize>(problem: &Problem<'_>, n: usize, r0: usize) {
    let w = problem.weight;
    let WeightData::Int8(bytes) = w.data else { unreachable!("an int8 weight") };
    let (k, group) = (w.in_features, w.group_size);
    let groups = k / group;
    let scales = w.scales.expect("int8 weights have scales");
    let x: [*const f32; R] = std::array::from_fn(|r| unsafe { problem.x.as_ptr().add((r0 + r) * k) });
    let row = unsafe { bytes.as_ptr().add(n * k) };
    let mut total = [_mm512_setzero_ps(); R];
    for g in 0..groups {
        let mut acc = [[_mm512_setzero_ps(); A]; R];
        let (mut j, end) = (g * group, (g + 1) * group);
        // SAFETY: j + 16 <= end <= k (group is a multiple of 16): inside row n and every
        // row r0 + r < rows of `x`.
        unsafe {
            while j + A * CHUNK <= end {
                for a in 0..A {
                    let at = j + a * CHUNK;
                    let q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                        row.add(at) as *const __m128i
                    )));
                    for r in 0..R {
                        acc[r][a] = _mm512_fmadd_ps(q, _mm512_loadu_ps(x[r].add(at)), acc[r][a]);
                    }
                }
                j += A * CHUNK;
            }
            while j < end {
                let q =
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row.add(j) as *const __m128i)));
                for r in 0..R {
                    acc[r][0] = _mm512_fmadd_ps(q, _mm512_loadu_ps(x[r].add(j)), acc[r][0]);
                }
                j += CHUNK;
            }
        }
        let scale = _mm512_set1_ps(scales[n * groups + g]);
        for r in 0..R {
            let mut width = A;
            while width > 1 {
                width /= 2;
                for a in 0..width {
                    acc[r][a] = _mm512_add_ps(acc[r][a], acc[r][a + width]);
                }
            }
            total[r] = _mm512_fmadd_ps(acc[r][0], scale, total[r]);
        }
    }
    for (r, lanes) in total.iter().enumerate() {
        let mut value = _mm512_reduce_add_ps(*lanes);
        if let Some(biases) = w.biases {
            let sums = &problem.x_sums[(r0 + r) * groups..(r0 + r + 1) * groups];
            value += biases[n * groups..(n + 1) * groups].iter().zip(sums).map(|(b, s)| b * s).sum::<f32>();
        }
        // SAFETY: (r0 + r, n) is inside `out`, and only this part writes column n.
        unsafe { *problem.out.0.add((r0 + r) * w.out_features + n) = value };
    }
}
