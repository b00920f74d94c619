//! [`crate::gemv_digits::digits`] on CPUs with AVX-512 (every CPU that runs the VNNI loops
//! has it): 16 columns a step, the same digits as the portable code, bit for bit (the
//! tests compare them). The portable code, one column at a time, took about 3.5 ns a
//! column, a third of a 16 x 1024 int8 product's time on the Intel Xeon development VM;
//! a decode step writes some 58,000 columns of `x` as digits.

use std::arch::x86_64::*;

use super::gemv_digits::{exponent, pow2, DigitLayout, Digits, BYTE_BLOCK_COLUMNS, LANES};

/// Floats per vector.
const WIDTH: usize = 16;

/// As [`crate::gemv_digits::digits`].
///
/// # Safety
/// The CPU must have AVX-512F and BW; the arguments must meet `digits`' conditions.
#[target_feature(enable = "avx512f,avx512bw")]
#[allow(clippy::needless_range_loop)] // `chunk` picks a column range and every digit's sum
pub(crate) unsafe fn digits(x: &[f32], rows: usize, k: usize, group: usize, layout: DigitLayout) -> Digits {
    let columns = layout.block_columns();
    debug_assert!(group % columns == 0 && k % group == 0 && x.len() == rows * k);
    let groups = k / group;
    let mut bytes = vec![0i8; rows * k * 4];
    let mut factors = vec![0f32; rows * groups];
    let with_starts = layout == DigitLayout::Bytes;
    let mut starts = vec![0i32; if with_starts { rows * groups * 4 * LANES } else { 0 }];
    for (g, (part, out)) in x.chunks_exact(group).zip(bytes.chunks_exact_mut(4 * group)).enumerate() {
        let e = exponent(largest(part));
        factors[g] = pow2(-e);
        let up = _mm512_set1_ps(pow2(e));
        // Per digit and 16-column chunk of a 64-column block, the digits summed over the
        // group's blocks (int8 only).
        let mut sums = [[_mm512_setzero_si512(); BYTE_BLOCK_COLUMNS / WIDTH]; 4];
        for (block, digits) in part.chunks_exact(columns).zip(out.chunks_exact_mut(4 * columns)) {
            match layout {
                DigitLayout::Bytes => {
                    for chunk in 0..BYTE_BLOCK_COLUMNS / WIDTH {
                        // SAFETY: 16 floats at chunk * 16 < 64 lie in the block.
                        let v = unsafe { _mm512_loadu_ps(block.as_ptr().add(chunk * WIDTH)) };
                        for (d, digit) in split(v, up).into_iter().enumerate() {
                            sums[d][chunk] = _mm512_add_epi32(sums[d][chunk], digit);
                            store(digits, d * BYTE_BLOCK_COLUMNS + chunk * WIDTH, digit);
                        }
                    }
                }
                DigitLayout::Nibbles => {
                    for half in 0..2 {
                        // Lane i takes column 2i + half of the 32 loaded.
                        let pick = _mm512_add_epi32(
                            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                            _mm512_set1_epi32(half as i32),
                        );
                        for i0 in (0..columns / 2).step_by(WIDTH) {
                            // SAFETY: columns 2 i0 .. 2 i0 + 32 <= 128 lie in the block.
                            let (a, b) = unsafe {
                                let at = block.as_ptr().add(2 * i0);
                                (_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(WIDTH)))
                            };
                            let v = _mm512_permutex2var_ps(a, pick, b);
                            for (d, digit) in split(v, up).into_iter().enumerate() {
                                store(digits, half * 4 * 64 + d * 64 + i0, digit);
                            }
                        }
                    }
                }
            }
        }
        if with_starts {
            let start = &mut starts[g * 4 * LANES..(g + 1) * 4 * LANES];
            for (d, chunks) in sums.iter().enumerate() {
                for (chunk, &sum) in chunks.iter().enumerate() {
                    let mut column_sums = [0i32; WIDTH];
                    // SAFETY: 16 int32 into a 16-element array.
                    unsafe { _mm512_storeu_si512(column_sums.as_mut_ptr() as *mut __m512i, sum) };
                    // Lane l of vpdpbusd adds columns 4l .. 4l + 4 of a 64-column block.
                    for (q, four) in column_sums.chunks_exact(4).enumerate() {
                        start[d * LANES + chunk * 4 + q] = -128 * four.iter().sum::<i32>();
                    }
                }
            }
        }
    }
    Digits { bytes, factors, starts }
}

/// The largest `|x|` of `part` (a multiple of 16 floats, none NaN).
#[inline]
#[target_feature(enable = "avx512f")]
fn largest(part: &[f32]) -> f32 {
    let mut most = _mm512_setzero_ps();
    for chunk in part.chunks_exact(WIDTH) {
        // SAFETY: 16 floats.
        let v = unsafe { _mm512_loadu_ps(chunk.as_ptr()) };
        most = _mm512_max_ps(most, _mm512_abs_ps(v));
    }
    _mm512_reduce_max_ps(most)
}

/// `round_ties_even(v * up)` as 16 integers `sum_d d_d 2^(8 d)`, each digit a signed byte
/// (in an int32 lane): `gemv_digits::split` on every lane.
#[inline]
#[target_feature(enable = "avx512f")]
fn split(v: __m512, up: __m512) -> [__m512i; 4] {
    let value =
        _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(v, up));
    let low_byte = |w: __m512i| _mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(w));
    let d0 = low_byte(value);
    let r1 = _mm512_srai_epi32::<8>(_mm512_sub_epi32(value, d0));
    let d1 = low_byte(r1);
    let r2 = _mm512_srai_epi32::<8>(_mm512_sub_epi32(r1, d1));
    let d2 = low_byte(r2);
    let d3 = _mm512_srai_epi32::<8>(_mm512_sub_epi32(r2, d2));
    [d0, d1, d2, d3]
}

/// The 16 digits (int32 lanes holding bytes) as bytes `at..at + 16` of `out`.
#[inline]
#[target_feature(enable = "avx512f")]
fn store(out: &mut [i8], at: usize, digit: __m512i) {
    assert!(at + WIDTH <= out.len());
    // SAFETY: checked just above.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().add(at) as *mut __m128i, _mm512_cvtepi32_epi8(digit)) };
}
