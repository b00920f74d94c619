//! The AVX2 + FMA inner loops of [`crate::gemv`]: one weight row against up to four rows
//! of `x`, 16 columns (two 8-lane vectors) per step, decoded in registers.
//!
//! - float32: two loads.
//! - int8: 8 bytes sign-extended to 8 int32 lanes and converted, twice.
//! - int4: 8 bytes zero-extended to 8 lanes; the low nibbles are the chunk's 8 even
//!   columns, the high nibbles its 8 odd ones (the order `gemv` put `x` in).
//! - int4 on AMD CPUs with AVX-512, groups a multiple of 128: the plane loops of
//!   [`crate::gemv_planes`] instead; on other CPUs with AVX-512 VNNI, groups a multiple
//!   of 128: [`crate::gemv_int4_vnni`]; int8 on CPUs with AVX-512:
//!   [`crate::gemv_int8_avx512`], or with AVX-512 VNNI, groups a multiple of 64:
//!   [`crate::gemv_int8_vnni`].
//!
//! Each weight row's bytes are prefetched [`PREFETCH_BYTES`] ahead as the row starts
//! (the int8 AVX-512 loop prefetches its own, a line at a time: `gemv_int8_avx512`).
//! A group's products accumulate unscaled; the group's scale multiplies the sum once. With
//! one or two rows of `x` there are four accumulators per row (two chunks per step), so
//! the FMA latency does not limit a single-row product; with three or four rows, two.

use std::arch::x86_64::*;

use super::gemv::{finish, Loops, Problem, WeightData, CHUNK, ROW_BLOCK};
use super::gemv_int4_vnni;
use super::gemv_int8_avx512;
use super::gemv_int8_vnni;
use super::gemv_planes;

const F32: u8 = 0;
const INT8: u8 = 1;
const INT4: u8 = 2;
/// int4 in plane blocks (`gemv::planes`, the loops of `gemv_planes`).
const INT4_PLANES: u8 = 3;
/// int8 by the loops of `gemv_int8_avx512`.
const INT8_AVX512: u8 = 4;
/// int4 by the loops of `gemv_int4_vnni`.
const INT4_VNNI: u8 = 5;
/// int8 in Q8_0's groups of 32 by `gemv_int8_avx512::row_q8`.
const INT8_Q8: u8 = 6;
/// int8 by the loops of `gemv_int8_vnni`.
const INT8_VNNI: u8 = 7;

/// Weight rows `[first, last)` for every row of `x`.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `problem`'s lengths must have passed `gemv`'s checks.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn rows(problem: &Problem<'_>, first: usize, last: usize) {
    match (problem.weight.data, problem.loops) {
        (WeightData::F32(_), _) => unsafe { blocks::<F32>(problem, first, last) },
        (WeightData::Int8(_), Loops::Int8Avx512) => unsafe { blocks::<INT8_AVX512>(problem, first, last) },
        (WeightData::Int8(_), Loops::Int8Q8) => unsafe { blocks::<INT8_Q8>(problem, first, last) },
        (WeightData::Int8(_), Loops::Int8Vnni) => unsafe { blocks::<INT8_VNNI>(problem, first, last) },
        (WeightData::Int8(_), _) => unsafe { blocks::<INT8>(problem, first, last) },
        (WeightData::Int4(_), Loops::Int4Planes) => unsafe { blocks::<INT4_PLANES>(problem, first, last) },
        (WeightData::Int4(_), Loops::Int4Vnni) => unsafe { blocks::<INT4_VNNI>(problem, first, last) },
        (WeightData::Int4(_), _) => unsafe { blocks::<INT4>(problem, first, last) },
    }
}

/// How far ahead of the row being multiplied its weight bytes are prefetched.
///
/// Measured with `cargo bench -p pyengine-kernels --bench gemv -- --threads 1` on the
/// 2-core EPYC (Zen 3) development VM, by CPU time, 7 alternated pairs while the machine
/// was shared (load 11-17, so noisy): without it a streamed product took about the time of
/// its memory reads *plus* its arithmetic (int8 about 6 GB/s where a plain read runs at
/// 7-10 and the arithmetic alone, on cached weights, at 15-16): the hardware prefetcher
/// kept too few lines in flight for a loop that spends a cycle or more on every 8
/// weights. Prefetching 1 KiB ahead overlaps the two: medians int8 6.2 -> 7.4 GB/s, int4
/// 4.4 -> 6.1; float32 unchanged within the noise. 1 KiB did as well as or better than 4
/// and 16 KiB.
const PREFETCH_BYTES: usize = 1024;
const LINE: usize = 64;

/// Weight row `n`'s bytes (start, length) in the stored format.
fn row_bytes(data: WeightData<'_>, n: usize, k: usize) -> (*const u8, usize) {
    match data {
        WeightData::F32(w) => (w.as_ptr().wrapping_add(n * k) as *const u8, k * 4),
        WeightData::Int8(w) => (w.as_ptr().wrapping_add(n * k) as *const u8, k),
        WeightData::Int4(w) => (w.as_ptr().wrapping_add(n * k / 2), k / 2),
    }
}

/// Asks for the cache lines `PREFETCH_BYTES` past row `n`'s bytes. A prefetch never
/// faults, so addresses past the weight's end are harmless (they are not dereferenced).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn prefetch_ahead(data: WeightData<'_>, n: usize, k: usize) {
    let (start, length) = row_bytes(data, n, k);
    let ahead = start.wrapping_add(PREFETCH_BYTES);
    let mut offset = 0;
    while offset < length {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(offset) as *const i8);
        offset += LINE;
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn blocks<const FMT: u8>(problem: &Problem<'_>, first: usize, last: usize) {
    let (data, k) = (problem.weight.data, problem.weight.in_features);
    let mut block = first;
    while block < last {
        let end = (block + ROW_BLOCK).min(last);
        let mut r0 = 0;
        while r0 < problem.rows {
            let left = problem.rows - r0;
            for n in block..end {
                // The AVX-512 int8 and int4 VNNI loops prefetch as they go.
                if r0 == 0 && !matches!(FMT, INT8_AVX512 | INT8_Q8 | INT4_VNNI | INT8_VNNI) {
                    prefetch_ahead(data, n, k);
                }
                // SAFETY: as this function's (n < out_features, r0 + R <= rows).
                unsafe {
                    match left {
                        // `gemv` chose these two only where the CPU has AVX-512F.
                        1 if FMT == INT8_Q8 => gemv_int8_avx512::row_q8::<1>(problem, n, r0),
                        2 if FMT == INT8_Q8 => gemv_int8_avx512::row_q8::<2>(problem, n, r0),
                        3 if FMT == INT8_Q8 => gemv_int8_avx512::row_q8::<3>(problem, n, r0),
                        _ if FMT == INT8_Q8 => gemv_int8_avx512::row_q8::<4>(problem, n, r0),
                        1 if FMT == INT8_AVX512 => gemv_int8_avx512::row::<1, 4>(problem, n, r0),
                        2 if FMT == INT8_AVX512 => gemv_int8_avx512::row::<2, 2>(problem, n, r0),
                        3 if FMT == INT8_AVX512 => gemv_int8_avx512::row::<3, 2>(problem, n, r0),
                        _ if FMT == INT8_AVX512 => gemv_int8_avx512::row::<4, 1>(problem, n, r0),
                        // and these only where it has AVX-512 VNNI and BW.
                        1 if FMT == INT8_VNNI => gemv_int8_vnni::row::<1>(problem, n, r0),
                        2 if FMT == INT8_VNNI => gemv_int8_vnni::row::<2>(problem, n, r0),
                        3 if FMT == INT8_VNNI => gemv_int8_vnni::row::<3>(problem, n, r0),
                        _ if FMT == INT8_VNNI => gemv_int8_vnni::row::<4>(problem, n, r0),
                        1 if FMT == INT4_VNNI => gemv_int4_vnni::row::<1, 1>(problem, n, r0),
                        2 if FMT == INT4_VNNI => gemv_int4_vnni::row::<2, 2>(problem, n, r0),
                        3 if FMT == INT4_VNNI => gemv_int4_vnni::row::<3, 1>(problem, n, r0),
                        _ if FMT == INT4_VNNI => gemv_int4_vnni::row::<4, 1>(problem, n, r0),
                        1 if FMT == INT4_PLANES => gemv_planes::row::<1, 8>(problem, n, r0),
                        2 if FMT == INT4_PLANES => gemv_planes::row::<2, 4>(problem, n, r0),
                        3 if FMT == INT4_PLANES => gemv_planes::row::<3, 2>(problem, n, r0),
                        _ if FMT == INT4_PLANES => gemv_planes::row::<4, 2>(problem, n, r0),
                        1 => one_row::<1, FMT>(problem, n, r0),
                        2 => one_row::<2, FMT>(problem, n, r0),
                        3 => one_row::<3, FMT>(problem, n, r0),
                        _ => one_row::<4, FMT>(problem, n, r0),
                    }
                }
            }
            r0 += left.min(4);
        }
        block = end;
    }
}

/// Columns `[j, j + 16)` of weight row `n` as two vectors, in the reordered `x`'s order.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn chunk<const FMT: u8>(data: WeightData<'_>, n: usize, k: usize, j: usize) -> (__m256, __m256) {
    // SAFETY (all arms): j + 16 <= k and n < out_features, inside the checked weight.
    unsafe {
        match data {
            WeightData::F32(w) if FMT == F32 => {
                let p = w.as_ptr().add(n * k + j);
                (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
            }
            WeightData::Int8(w) if FMT == INT8 => {
                let p = w.as_ptr().add(n * k + j) as *const __m128i;
                let low = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p));
                let high = _mm256_cvtepi8_epi32(_mm_loadl_epi64((p as *const i8).add(8) as *const __m128i));
                (_mm256_cvtepi32_ps(low), _mm256_cvtepi32_ps(high))
            }
            WeightData::Int4(w) => {
                let p = w.as_ptr().add((n * k + j) / 2) as *const __m128i;
                let bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p));
                let even = _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F));
                let odd = _mm256_srli_epi32::<4>(bytes);
                (_mm256_cvtepi32_ps(even), _mm256_cvtepi32_ps(odd))
            }
            _ => unreachable!("format and data agree"),
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn lane_sum(v: __m256) -> f32 {
    let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
}

/// `out[r0 + r, n]` for `r < R`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn one_row<const R: usize, const FMT: u8>(problem: &Problem<'_>, n: usize, r0: usize) {
    let w = problem.weight;
    let (k, group) = (w.in_features, w.group_size);
    let groups = k / group;
    let x: [*const f32; R] = std::array::from_fn(|r| unsafe { problem.x.as_ptr().add((r0 + r) * k) });
    let mut total = [_mm256_setzero_ps(); R];
    let wide = R <= 2 && group % (2 * CHUNK) == 0;
    for g in 0..groups {
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        let (mut j, end) = (g * group, (g + 1) * group);
        // SAFETY: every j + 32 (wide) or j + 16 <= end <= k; rows r0 + r < rows.
        unsafe {
            if wide {
                while j < end {
                    let (a0, a1) = chunk::<FMT>(w.data, n, k, j);
                    let (b0, b1) = chunk::<FMT>(w.data, n, k, j + CHUNK);
                    for r in 0..R {
                        acc[r][0] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(x[r].add(j)), acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(a1, _mm256_loadu_ps(x[r].add(j + 8)), acc[r][1]);
                        acc[r][2] = _mm256_fmadd_ps(b0, _mm256_loadu_ps(x[r].add(j + 16)), acc[r][2]);
                        acc[r][3] = _mm256_fmadd_ps(b1, _mm256_loadu_ps(x[r].add(j + 24)), acc[r][3]);
                    }
                    j += 2 * CHUNK;
                }
            } else {
                while j < end {
                    let (a0, a1) = chunk::<FMT>(w.data, n, k, j);
                    for r in 0..R {
                        acc[r][0] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(x[r].add(j)), acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(a1, _mm256_loadu_ps(x[r].add(j + 8)), acc[r][1]);
                    }
                    j += CHUNK;
                }
            }
        }
        for r in 0..R {
            let mut sum = _mm256_add_ps(acc[r][0], acc[r][1]);
            if wide {
                sum = _mm256_add_ps(sum, _mm256_add_ps(acc[r][2], acc[r][3]));
            }
            total[r] = match w.scales {
                Some(scales) => _mm256_fmadd_ps(sum, _mm256_set1_ps(scales[n * groups + g]), total[r]),
                None => _mm256_add_ps(sum, total[r]),
            };
        }
    }
    for (r, lanes) in total.iter().enumerate() {
        // SAFETY: (r0 + r, n) is inside `out`, and only this part writes column n.
        unsafe { finish(problem, n, r0 + r, lane_sum(*lanes)) };
    }
}
