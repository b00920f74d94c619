//! What the AVX-512 loops (`gemv_int8_avx512`, `gemv_planes`, `gemv_int4_vnni`,
//! `gemv_int8_vnni`) share: a group's accumulators folded into one vector, the VNNI loops'
//! digit sums combined, each row's output written from its lanes, and the weight row
//! prefetched a cache line at a time as it streams in.

use std::arch::x86_64::*;

use super::gemv::{finish, Problem};

/// How far ahead of the bytes being multiplied a streamed weight row is prefetched
/// (measured for the int8 loop, see `gemv_int8_avx512`).
const AHEAD: usize = 4096;
/// Bytes per cache line.
const LINE: usize = 64;

/// Asks for the cache line `AHEAD` bytes past byte `offset` of a weight row, once per
/// line (where `offset` starts one). A prefetch never faults: addresses past the weight
/// are harmless.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn stream_ahead(row: *const i8, offset: usize) {
    if offset % LINE == 0 {
        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(offset + AHEAD));
    }
}

/// `acc[0] + ... + acc[A - 1]` (`A` a power of two), added in pairs.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn fold<const A: usize>(mut acc: [__m512; A]) -> __m512 {
    let mut width = A;
    while width > 1 {
        width /= 2;
        for a in 0..width {
            acc[a] = _mm512_add_ps(acc[a], acc[a + width]);
        }
    }
    acc[0]
}

/// `out[r0 + r, n]` for every `r < R`: row `r`'s lanes summed, then `gemv::finish`.
///
/// # Safety
/// As `gemv::finish` for every row `r0 + r`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn write_rows<const R: usize>(
    problem: &Problem<'_>,
    n: usize,
    r0: usize,
    total: &[__m512; R],
) {
    for (r, lanes) in total.iter().enumerate() {
        // SAFETY: the caller's.
        unsafe { finish(problem, n, r0 + r, _mm512_reduce_add_ps(*lanes)) };
    }
}

/// A group's digit sums (in `H` sets, added) as the float lanes `sum_d s_d 2^(8 d)`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn combine<const H: usize>(sets: [[__m512i; 4]; H]) -> __m512 {
    let mut digit = sets[0];
    for set in &sets[1..] {
        for d in 0..4 {
            digit[d] = _mm512_add_epi32(digit[d], set[d]);
        }
    }
    let radix = _mm512_set1_ps(256.0);
    let mut value = _mm512_cvtepi32_ps(digit[3]);
    for d in (0..3).rev() {
        value = _mm512_fmadd_ps(value, radix, _mm512_cvtepi32_ps(digit[d]));
    }
    value
}
