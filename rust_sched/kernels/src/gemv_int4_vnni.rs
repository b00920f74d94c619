//! The int4 loops for CPUs with AVX-512 VNNI (Intel from Ice Lake and Cascade Lake, AMD
//! from Zen 4; AMD CPUs keep `gemv_planes`, measured there): 64 products an instruction,
//! in integers, against `x` written as signed byte digits (`gemv_digits`).
//!
//! The 16-column loops (`gemv_avx2`) spend a zero-extend, two nibble masks, two
//! conversions and two FMAs per 16 weights and are bound by the conversions (about 8
//! weights a cycle). Here a weight row's 128-column block, 64 bytes, is one load; a mask
//! takes the 64 low nibbles and a shift and a mask the 64 high ones, and each half meets
//! the four digit planes of its 64 columns in four `vpdpbusd` (unsigned nibble times
//! signed digit, 4 products summed into each 32-bit lane, exactly). Per group and row the
//! four digit sums are converted and combined in float, `((s3 * 2^8 + s2) * 2^8 + s1) *
//! 2^8 + s0`, and scaled once by the weight's scale times the digits' `2^-e`: 8 integer
//! products a row and 3 decoding steps shared by the rows per 128 weights, where the other
//! loops spend 56 operations.
//!
//! The digit sums are exact: a lane adds `group / 16` products of at most `15 * 128` in
//! magnitude, below 2^24 (so its conversion is exact too) for every group up to 139,810
//! columns, and below 2^31 up to 17.9 million. The row is prefetched a cache line at a
//! time, 4 KiB ahead (`gemv_avx512::stream_ahead`), as in `gemv_int8_avx512`: these loops, too, spend a few cycles of
//! arithmetic per 64-byte line.

use std::arch::x86_64::*;

use super::gemv::{Problem, WeightData};
use super::gemv_avx512::{combine, stream_ahead, write_rows};
use super::gemv_digits::BLOCK_COLUMNS;

/// `out[r0 + r, n]` for `r < R` of an int4 weight whose groups are whole 128-column
/// blocks, `problem.digits` holding `x`'s digits: per block one load, the two nibble
/// halves, then 8 `vpdpbusd` per row of `x` into `H` sets of four digit sums (at two
/// rows two sets, one for each half; one row did as well with one set, its groups'
/// chains overlapping).
///
/// # Safety
/// The CPU must have AVX-512F, BW and VNNI; `problem`'s lengths must have passed `gemv`'s
/// checks and its digits be those of its `x` for this weight's groups.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::needless_range_loop)] // `d` picks a digit plane of x and a digit sum
pub(crate) unsafe fn row<const R: usize, const H: usize>(problem: &Problem<'_>, n: usize, r0: usize) {
    let w = problem.weight;
    let WeightData::Int4(bytes) = w.data else { unreachable!("the VNNI loops are int4's") };
    let digits = problem.digits.expect("the VNNI loops multiply x's digits");
    let (k, group) = (w.in_features, w.group_size);
    let groups = k / group;
    let scales = w.scales.expect("int4 weights have scales");
    // Four digit bytes per column of x.
    let x: [*const i8; R] = std::array::from_fn(|r| unsafe { digits.bytes.as_ptr().add((r0 + r) * k * 4) });
    let row = unsafe { bytes.as_ptr().add(n * k / 2) };
    let stream = r0 == 0;
    let nibble = _mm512_set1_epi8(0x0F);
    let mut total = [_mm512_setzero_ps(); R];
    for g in 0..groups {
        let mut sums = [[[_mm512_setzero_si512(); 4]; H]; R];
        let mut j = g * group;
        let end = j + group;
        // SAFETY: j + 128 <= end <= k: the block's 64 bytes lie in row n, and its 512
        // digit bytes in each row r0 + r < rows of the digits. A prefetch never faults.
        unsafe {
            while j < end {
                if stream {
                    stream_ahead(row as *const i8, j / 2); // a block is one line's worth of bytes
                }
                let all = _mm512_loadu_si512(row.add(j / 2) as *const __m512i);
                let halves =
                    [_mm512_and_si512(all, nibble), _mm512_and_si512(_mm512_srli_epi16::<4>(all), nibble)];
                for r in 0..R {
                    let block = x[r].add(j * 4);
                    for (h, &q) in halves.iter().enumerate() {
                        for d in 0..4 {
                            let xs = _mm512_loadu_si512(block.add((h * 4 + d) * 64) as *const __m512i);
                            sums[r][h % H][d] = _mm512_dpbusd_epi32(sums[r][h % H][d], q, xs);
                        }
                    }
                }
                j += BLOCK_COLUMNS;
            }
        }
        for r in 0..R {
            let factor = scales[n * groups + g] * digits.factors[(r0 + r) * groups + g];
            total[r] = _mm512_fmadd_ps(combine(sums[r]), _mm512_set1_ps(factor), total[r]);
        }
    }
    // SAFETY: rows r0 + r < rows and n < out_features; only this part writes column n.
    unsafe { write_rows(problem, n, r0, &total) };
}
