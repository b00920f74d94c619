//! The int8 loop for CPUs with AVX-512: 16 weights sign-extended, converted and
//! multiplied per step, half the instructions of the 256-bit loop (`gemv_avx2`), whose
//! conversions (8 weights each, one a cycle) bound a core below its memory bandwidth.
//! Plain floats throughout (no subnormal tricks), so any AVX-512F CPU takes it; those with
//! AVX-512 VNNI take `gemv_int8_vnni` instead wherever the groups are whole 64-column
//! blocks and every `|x|` is within the digits' range (all but Q8_0's groups of 32, which
//! keep [`row_q8`]).
//!
//! The weight row's bytes are prefetched 4 KiB ahead (`gemv_avx512::stream_ahead`), one cache line each time
//! the loop reaches a new 64 columns, rather than a row's worth at once as the row starts
//! (the other loops' `gemv_avx2::prefetch_ahead`). This loop spends about 6 cycles of
//! arithmetic on each 64-byte line, so the out-of-order window holds few lines' loads; on
//! the Intel Xeon (AVX-512, 2 vCPUs) development VM a streamed token of int8 products
//! spent about as long waiting for lines as computing. Spread prefetches 4 KiB ahead took
//! it from 17.9-18.0 ms to 14.3-14.7 ms (two threads, `cargo bench -p pyengine-kernels
//! --bench gemv -- --formats int8`, two alternated rounds, the machine paused), 2 KiB
//! ahead to 15.0-15.3 ms; with the row-start burst as well, 16.2 ms.

use std::arch::x86_64::*;

use super::gemv::{Problem, WeightData, CHUNK, Q8_GROUP};
use super::gemv_avx512::{fold, stream_ahead, write_rows};

/// `out[r0 + r, n]` for `r < R` of an int8 weight: per group, 16 columns a step into `A`
/// accumulators per row (taking turns), the group's sum scaled once. The first block of
/// `x` rows (`r0 == 0`) streams the weight row in ([`stream_ahead`]); later blocks find it
/// cached.
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
    let stream = r0 == 0;
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
                    if stream {
                        stream_ahead(row, at);
                    }
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
                if stream {
                    stream_ahead(row, j);
                }
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
            total[r] = _mm512_fmadd_ps(fold(acc[r]), scale, total[r]);
        }
    }
    // SAFETY: rows r0 + r < rows and n < out_features; only this part writes column n.
    unsafe { write_rows(problem, n, r0, &total) };
}

/// `out[r0 + r, n]` for `r < R` of an int8 weight in groups of 32 (GGUF's Q8_0), `k` a
/// multiple of 64: each 16 columns converted, multiplied by their group's scale and
/// accumulated, 64 columns (two groups, four accumulators per row) a step; one fold per
/// row at the end. [`row`] sums each group apart and scales the sum, which for a group of
/// 32 costs a fold and a scaling FMA per 32 weights: here a multiply per 16 instead.
///
/// # Safety
/// As [`row`], and `group_size == 32`, `in_features % 64 == 0`.
#[inline]
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)] // `a` picks the accumulator of every row `r`
pub(crate) unsafe fn row_q8<const R: usize>(problem: &Problem<'_>, n: usize, r0: usize) {
    let w = problem.weight;
    let WeightData::Int8(bytes) = w.data else { unreachable!("an int8 weight") };
    let k = w.in_features;
    debug_assert!(w.group_size == Q8_GROUP && k % (2 * Q8_GROUP) == 0);
    let scales = w.scales.expect("int8 weights have scales");
    let x: [*const f32; R] = std::array::from_fn(|r| unsafe { problem.x.as_ptr().add((r0 + r) * k) });
    let row = unsafe { bytes.as_ptr().add(n * k) };
    let row_scales = unsafe { scales.as_ptr().add(n * (k / Q8_GROUP)) };
    let stream = r0 == 0;
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let mut j = 0;
    // SAFETY: j + 64 <= k: inside row n, its k / 32 scales, and every row r0 + r < rows of `x`.
    unsafe {
        while j < k {
            if stream {
                stream_ahead(row, j);
            }
            let first = _mm512_set1_ps(*row_scales.add(j / Q8_GROUP));
            let second = _mm512_set1_ps(*row_scales.add(j / Q8_GROUP + 1));
            for a in 0..4 {
                let at = j + a * CHUNK;
                let scale = if a < 2 { first } else { second };
                let q = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row.add(at) as *const __m128i))),
                    scale,
                );
                for r in 0..R {
                    acc[r][a] = _mm512_fmadd_ps(q, _mm512_loadu_ps(x[r].add(at)), acc[r][a]);
                }
            }
            j += 2 * Q8_GROUP;
        }
    }
    let total: [__m512; R] = std::array::from_fn(|r| fold(acc[r]));
    // SAFETY: rows r0 + r < rows and n < out_features; only this part writes column n.
    unsafe { write_rows(problem, n, r0, &total) };
}
