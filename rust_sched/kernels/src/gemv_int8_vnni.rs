//! The int8 loops for CPUs with AVX-512 VNNI: 64 products an instruction, in integers,
//! against `x` written as signed byte digits (`gemv_digits`, the int8 layout).
//!
//! The 16-column loop (`gemv_int8_avx512::row`) spends a sign extension, a conversion and
//! an FMA per 16 weights and row: 12 operations per 64-byte line, which on cached weights
//! ran at about 30 GB/s on the Intel Xeon development VM (2 vCPUs), barely above its
//! memory's pace, so a streamed product took longer than its reads (about 0.7 of a plain
//! read). Here a 64-byte line is one load and one exclusive-or (the sign bit flipped:
//! `vpdpbusd` takes its weight bytes unsigned, `q + 128`), then four `vpdpbusd` per row
//! of `x`, one per digit plane. The flip counts every digit 128 times too many; each
//! group's digit sums start from `-128` times the digits their lanes meet
//! (`Digits::starts`), so they end exact. Per group and row the four sums are combined in
//! float (`gemv_avx512::combine`) and scaled once by the weight's scale times the digits'
//! `2^-e`.
//!
//! Unlike int4's VNNI loops, these are taken at every row count: the FMA loop's per-row
//! work (an FMA per 16 weights) is no less than a `vpdpbusd` per 16, so the shared
//! decoding they drop is a gain; measured faster at every row count but two, where the
//! difference was within the noise. On the Intel Xeon development VM (a streamed token, two threads,
//! `cargo bench -p pyengine-kernels --bench gemv -- --formats int8 --rows R`, two
//! alternated rounds on a shared machine): one row 17.1-17.8 -> 11.0-11.2 ms, three
//! 19.9-20.4 -> 17.7-18.1, four 22.1-22.8 -> 18.5-19.5, eight 42.8-43.1 -> 32.8-33.3,
//! 32 rows 178 -> 168; two rows 14.8-15.6 -> 15.1-18.6 (within the noise). Cached weights
//! (a 8 MiB working set, one row): about 33 -> 50 GB/s.
//!
//! The sums are exact: a lane meets `group / 16` columns, and after any number of blocks
//! its sum is `sum_seen q d - 128 sum_unseen d` over them (the start took `128 d` off for
//! every column, each block added `(q + 128) d` back for its own), at most `128 * 128` a
//! column in magnitude: `1024 * group` in all, inside 32 bits for groups up to 2 million
//! columns; the final sum converts to float exactly for groups up to 16,384 columns
//! (beyond, it rounds as float32 sums do).

use std::arch::x86_64::*;

use super::gemv::{Problem, WeightData};
use super::gemv_avx512::{combine, stream_ahead, write_rows};
use super::gemv_digits::{BYTE_BLOCK_COLUMNS, LANES};

/// `out[r0 + r, n]` for `r < R` of an int8 weight whose groups are whole 64-column blocks,
/// `problem.digits` holding `x`'s digits in the int8 layout: per block one load and one
/// flip, then 4 `vpdpbusd` per row of `x`.
///
/// # Safety
/// The CPU must have AVX-512F, BW and VNNI; `problem`'s lengths must have passed `gemv`'s
/// checks and its digits be those of its `x` for this weight's groups, int8 layout.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::needless_range_loop)] // `d` picks a digit plane of x and a digit sum
pub(crate) unsafe fn row<const R: usize>(problem: &Problem<'_>, n: usize, r0: usize) {
    let w = problem.weight;
    let WeightData::Int8(bytes) = w.data else { unreachable!("these loops are int8's") };
    let digits = problem.digits.expect("the VNNI loops multiply x's digits");
    let (k, group) = (w.in_features, w.group_size);
    let groups = k / group;
    let scales = w.scales.expect("int8 weights have scales");
    // Four digit bytes per column of x, and 4 x 16 starting sums per group.
    let x: [*const i8; R] = std::array::from_fn(|r| unsafe { digits.bytes.as_ptr().add((r0 + r) * k * 4) });
    let starts: [*const i32; R] =
        std::array::from_fn(|r| unsafe { digits.starts.as_ptr().add((r0 + r) * groups * 4 * LANES) });
    let row = unsafe { bytes.as_ptr().add(n * k) };
    let stream = r0 == 0;
    let flip = _mm512_set1_epi8(i8::MIN);
    let mut total = [_mm512_setzero_ps(); R];
    for g in 0..groups {
        // SAFETY: group g's 4 x 16 starts lie in each row r0 + r < rows of them.
        let mut sums: [[__m512i; 4]; R] = std::array::from_fn(|r| {
            std::array::from_fn(|d| unsafe {
                _mm512_loadu_si512(starts[r].add((g * 4 + d) * LANES) as *const __m512i)
            })
        });
        let mut j = g * group;
        let end = j + group;
        // SAFETY: j + 64 <= end <= k: the block's 64 bytes lie in row n, and its 256 digit
        // bytes in each row r0 + r < rows of the digits. A prefetch never faults.
        unsafe {
            while j < end {
                if stream {
                    stream_ahead(row, j);
                }
                let q = _mm512_xor_si512(_mm512_loadu_si512(row.add(j) as *const __m512i), flip);
                for r in 0..R {
                    let block = x[r].add(j * 4);
                    for d in 0..4 {
                        let xs = _mm512_loadu_si512(block.add(d * BYTE_BLOCK_COLUMNS) as *const __m512i);
                        sums[r][d] = _mm512_dpbusd_epi32(sums[r][d], q, xs);
                    }
                }
                j += BYTE_BLOCK_COLUMNS;
            }
        }
        for r in 0..R {
            let factor = scales[n * groups + g] * digits.factors[(r0 + r) * groups + g];
            total[r] = _mm512_fmadd_ps(combine([sums[r]]), _mm512_set1_ps(factor), total[r]);
        }
    }
    // SAFETY: rows r0 + r < rows and n < out_features; only this part writes column n.
    unsafe { write_rows(problem, n, r0, &total) };
}
