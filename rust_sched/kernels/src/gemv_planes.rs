//! The int4 loops for AVX-512 CPUs (AMD only, see `gemv::planes_fit`): a mask and an FMA
//! per 16 weights, no conversion.
//!
//! The other int4 loops (`gemv_avx2`) zero-extend 8 bytes, mask and shift the two
//! nibbles and convert each 8 of them to floats: the conversion (one per cycle) bound
//! them, at about 8 weights a cycle. Here a weight row's 128-column block, 64 bytes, is
//! read as 16 32-bit words, each holding 8 consecutive columns' nibbles; one mask takes
//! nibble `p` of every word (nibbles 5..8 after one shift of the words by 20 bits), and
//! the masked word is used as a float as it stands: a subnormal, `q * 2^(4p' - 149)`.
//! Multiplied by a copy of `x` reordered to match and scaled by the power of two that
//! makes every product `x * q * 2^-49` (`gemv::planes`), exactly; the group's scale takes
//! the `2^49`.
//!
//! On the Zen 5 development machine (one thread, one cached 1024 x 1024 weight, best of
//! 40 alternated rounds by CPU time) these loops took 30 us against 47 us for the
//! 16-column loops; 256-bit plane loops (8 words a block) took 46 us, so AVX2-only CPUs
//! keep the 16-column loops.

use std::arch::x86_64::*;

use super::gemv::{Problem, WeightData, PLANE_COLUMNS};
use super::gemv_avx512::{fold, write_rows};

/// `out[r0 + r, n]` for `r < R` of an int4 weight whose groups are whole plane blocks,
/// `x` in `gemv::planes` order: per block one 64-byte load and one shift, then per
/// nibble a mask and one FMA per row of `x`, into `A` accumulators per row (8 at one row,
/// so the FMA latency does not bind). Every product is `2^-49` times `x * q`; the group's
/// scale takes the `2^49`.
///
/// # Safety
/// The CPU must have AVX-512F; `problem`'s lengths must have passed `gemv`'s checks.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn row<const R: usize, const A: usize>(problem: &Problem<'_>, n: usize, r0: usize) {
    let w = problem.weight;
    let WeightData::Int4(bytes) = w.data else { unreachable!("planes are int4") };
    let (k, group) = (w.in_features, w.group_size);
    let (groups, words) = (k / group, PLANE_COLUMNS / 8);
    let scales = w.scales.expect("int4 weights have scales");
    let x: [*const f32; R] = std::array::from_fn(|r| unsafe { problem.x.as_ptr().add((r0 + r) * k) });
    let row = unsafe { bytes.as_ptr().add(n * k / 2) };
    let mut total = [_mm512_setzero_ps(); R];
    for g in 0..groups {
        let mut acc = [[_mm512_setzero_ps(); A]; R];
        let mut j = g * group;
        let end = j + group;
        // SAFETY: j + 128 <= end <= k: the block's 64 bytes lie in row n, and its 128
        // floats in each row r0 + r < rows of `x`.
        unsafe {
            while j < end {
                let all = _mm512_loadu_si512(row.add(j / 2) as *const __m512i);
                let high = _mm512_srli_epi32::<20>(all);
                macro_rules! plane {
                    ($p:literal) => {
                        let source = if $p < 5 { all } else { high };
                        let shift = 4 * if $p < 5 { $p } else { $p - 5 };
                        let f =
                            _mm512_castsi512_ps(_mm512_and_si512(source, _mm512_set1_epi32(0xF << shift)));
                        for r in 0..R {
                            let slot = $p % A;
                            let xs = _mm512_loadu_ps(x[r].add(j + words * $p));
                            acc[r][slot] = _mm512_fmadd_ps(f, xs, acc[r][slot]);
                        }
                    };
                }
                plane!(0);
                plane!(1);
                plane!(2);
                plane!(3);
                plane!(4);
                plane!(5);
                plane!(6);
                plane!(7);
                j += PLANE_COLUMNS;
            }
        }
        let scale = _mm512_set1_ps(scales[n * groups + g] * PLANE_UNSCALE);
        for r in 0..R {
            total[r] = _mm512_fmadd_ps(fold(acc[r]), scale, total[r]);
        }
    }
    // SAFETY: rows r0 + r < rows and n < out_features; only this part writes column n.
    unsafe { write_rows(problem, n, r0, &total) };
}

/// `2^49`: what the plane products lack (`gemv::planes`).
const PLANE_UNSCALE: f32 = 562_949_953_421_312.0;
