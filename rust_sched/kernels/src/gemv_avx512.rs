//! What the AVX-512 loops (`gemv_int8_avx512`, `gemv_planes`, `gemv_int4_vnni`) share: a
//! group's accumulators folded into one vector, each row's output written from its lanes,
//! and the weight row prefetched a cache line at a time as it streams in.

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
