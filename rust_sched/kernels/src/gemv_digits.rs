//! `x` as integers for the VNNI loops (`gemv_int4_vnni`, `gemv_int8_vnni`): each group of
//! each row scaled by a power of two to 30-bit integers, written as four signed byte digits.
//!
//! AVX-512 VNNI's `vpdpbusd` multiplies 64 unsigned bytes by 64 signed bytes and adds
//! each 4 products into a 32-bit lane: 64 products in one instruction, exactly. The
//! weights are the unsigned bytes (int4's nibbles, 0..15; int8's bytes with their sign
//! bit flipped, `q + 128`, 0..255); `x` must be the signed ones. Rounding `x` to
//! one byte (llama.cpp's Q8 activations) would cost up to 1/254 of a block's largest
//! `|x|` per element, far past float32 rounding. Here `x * 2^e` is rounded to an integer
//! `v` with `|v| <= 2^30` (`e` per row and group, from the group's largest `|x|`), and
//! `v = d0 + 2^8 d1 + 2^16 d2 + 2^24 d3` with every digit a signed byte: four exact
//! `vpdpbusd` give the group's four digit sums, which the loops combine in float. The
//! rounding is at most `2^-30` of the group's largest `|x|` per element (float32's is
//! `2^-24` of each element), so the products stay within float32 rounding of the sum of
//! `|terms|` unless a group's largest `|x|` is some thousands of times its typical one.
//!
//! Layouts ([`DigitLayout`]), per row, per block of one 512-bit weight load:
//! - int4, 128-column blocks (64 bytes): the low nibbles of byte `i` are column `2i`, the
//!   high ones column `2i + 1`, so the block's 512 digit bytes hold `[half h][digit d][i]`
//!   = digit `d` of column `2i + h`;
//! - int8, 64-column blocks: the 256 digit bytes hold `[digit d][i]` = digit `d` of column
//!   `i`. The flipped weights count every digit 128 times too many, so each row and
//!   group also gets [`Digits::starts`], what its digit sums start from: `-128` times the
//!   sum of the digits each 32-bit lane meets over the group, exactly.

/// Columns of one int4 block: the 64 bytes of int4 weight one 512-bit load takes.
pub(crate) const BLOCK_COLUMNS: usize = 128;
/// Columns of one int8 block (one 512-bit load).
pub(crate) const BYTE_BLOCK_COLUMNS: usize = 64;
/// 32-bit lanes of a 512-bit vector: the int8 loops' digit sums per digit.
pub(crate) const LANES: usize = 16;

/// Where the loops of a weight format read the digits of a block's columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DigitLayout {
    /// int4: 128-column blocks, `[half][digit][i]`.
    Nibbles,
    /// int8: 64-column blocks, `[digit][i]`, with [`Digits::starts`].
    Bytes,
}

impl DigitLayout {
    pub(crate) fn block_columns(self) -> usize {
        match self {
            DigitLayout::Nibbles => BLOCK_COLUMNS,
            DigitLayout::Bytes => BYTE_BLOCK_COLUMNS,
        }
    }

    /// Offset of digit `digit` of column `column` (of its block) in the block's digit bytes.
    #[inline(always)]
    fn position(self, column: usize, digit: usize) -> usize {
        match self {
            DigitLayout::Nibbles => (column % 2) * 4 * 64 + digit * 64 + column / 2,
            DigitLayout::Bytes => digit * BYTE_BLOCK_COLUMNS + column,
        }
    }
}
/// Largest `|x|` the digits take (`2^64`); larger, infinite or NaN `x` keep the float loops.
const X_LIMIT: f32 = 18_446_744_073_709_551_616.0;
/// `e` is at most this: groups whose largest `|x|` is below `2^-71` keep fewer than 30
/// bits, so that `2^e` and `2^-e` stay normal floats.
const MAX_EXPONENT: i32 = 100;

/// `x` [rows, k] as digit blocks, and per row and group the factor `2^-e` that takes the
/// integers back to `x`'s scale.
pub(crate) struct Digits {
    /// [rows, k * 4] signed digits, in blocks laid out as the [`DigitLayout`] says.
    pub bytes: Vec<i8>,
    /// [rows, k / group] powers of two.
    pub factors: Vec<f32>,
    /// [`DigitLayout::Bytes`] only: [rows, k / group, 4, 16], digit `d`'s lane `l` holding
    /// `-128` times the sum of digit `d` of the group's columns `c` with `c % 64 / 4 == l`
    /// (the lane `vpdpbusd` adds their products into). Empty for `Nibbles`.
    pub starts: Vec<i32>,
}

/// Whether every `x` can be written as digits (finite, below `2^64`).
pub(crate) fn digits_fit(x: &[f32]) -> bool {
    x.iter().all(|v| v.abs() < X_LIMIT)
}

/// `x` [rows, k] in digits laid out for `layout`, groups of `group` columns (a multiple of
/// the layout's block dividing `k`), every `x` within [`digits_fit`]: by
/// `gemv_digits_avx512` where the CPU has AVX-512F and BW (every CPU the VNNI loops run
/// on), else by [`portable_digits`].
pub(crate) fn digits(x: &[f32], rows: usize, k: usize, group: usize, layout: DigitLayout) -> Digits {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bw") {
        // SAFETY: the CPU has both (checked just above); the conditions are the caller's.
        return unsafe { crate::gemv_digits_avx512::digits(x, rows, k, group, layout) };
    }
    portable_digits(x, rows, k, group, layout)
}

/// [`digits`] in plain Rust, a column at a time (the tests' reference).
pub(crate) fn portable_digits(x: &[f32], rows: usize, k: usize, group: usize, layout: DigitLayout) -> Digits {
    let columns = layout.block_columns();
    debug_assert!(group % columns == 0 && k % group == 0 && x.len() == rows * k);
    let groups = k / group;
    let mut bytes = vec![0i8; rows * k * 4];
    let mut factors = vec![0f32; rows * groups];
    let with_starts = layout == DigitLayout::Bytes;
    let mut starts = vec![0i32; if with_starts { rows * groups * 4 * LANES } else { 0 }];
    for (g, (part, out)) in x.chunks_exact(group).zip(bytes.chunks_exact_mut(4 * group)).enumerate() {
        let largest = part.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e = exponent(largest);
        factors[g] = pow2(-e);
        let up = pow2(e);
        let mut lane_sums = [[0i32; LANES]; 4];
        for (block, digits) in part.chunks_exact(columns).zip(out.chunks_exact_mut(4 * columns)) {
            for (c, &value) in block.iter().enumerate() {
                let d = split((value * up).round_ties_even() as i32);
                for (digit, &byte) in d.iter().enumerate() {
                    digits[layout.position(c, digit)] = byte;
                    lane_sums[digit][c % BYTE_BLOCK_COLUMNS / 4] += byte as i32;
                }
            }
        }
        if with_starts {
            let start = &mut starts[g * 4 * LANES..(g + 1) * 4 * LANES];
            for (slot, sum) in start.iter_mut().zip(lane_sums.iter().flatten()) {
                *slot = -128 * sum;
            }
        }
    }
    Digits { bytes, factors, starts }
}

/// `e` for a group whose largest `|x|` is `largest`: `largest * 2^e < 2^30`, as close as
/// that allows (0 for a group of zeros).
pub(crate) fn exponent(largest: f32) -> i32 {
    if largest == 0.0 {
        return 0;
    }
    // floor(log2(largest)) from the float's exponent bits; subnormals read as -127,
    // below where MAX_EXPONENT clamps anyway.
    let floor_log2 = ((largest.to_bits() >> 23) & 0xFF) as i32 - 127;
    (29 - floor_log2).min(MAX_EXPONENT)
}

/// `2^e` for `e` in [-126, 127], exactly.
pub(crate) fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

/// `v` (`|v| <= 2^30`) as `[d0, d1, d2, d3]`, signed bytes, `v = sum_i d_i 2^(8 i)`.
#[inline(always)]
fn split(v: i32) -> [i8; 4] {
    let d0 = v as i8;
    let r1 = (v - d0 as i32) >> 8;
    let d1 = r1 as i8;
    let r2 = (r1 - d1 as i32) >> 8;
    let d2 = r2 as i8;
    let d3 = (r2 - d2 as i32) >> 8;
    debug_assert!((-128..=127).contains(&d3));
    [d0, d1, d2, d3 as i8]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(d: &[i8], base: usize) -> i64 {
        (0..4).map(|digit| (d[base + digit * 64] as i64) << (8 * digit)).sum()
    }

    #[test]
    fn digits_give_back_x_to_within_two_to_the_minus_30_of_the_group_largest() {
        let (rows, k, group) = (2, 512, 256);
        let x: Vec<f32> = (0..rows * k)
            .map(|i| {
                let scale = [1e-18f32, 1.0, 3e9, 0.0][(i / group) % 4];
                scale * (((i * 7919) % 1013) as f32 - 506.0) / 97.0
            })
            .collect();
        assert!(digits_fit(&x));
        let d = digits(&x, rows, k, group, DigitLayout::Nibbles);
        for r in 0..rows {
            for c in 0..k {
                let (g, within) = (c / group, c % group);
                let base = (r * k + g * group + within / BLOCK_COLUMNS * BLOCK_COLUMNS) * 4
                    + (within % 2) * 256
                    + (within % BLOCK_COLUMNS) / 2;
                let back = value(&d.bytes, base) as f64 * d.factors[r * (k / group) + g] as f64;
                let part = &x[r * k + g * group..r * k + (g + 1) * group];
                let largest = part.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                let want = x[r * k + c] as f64;
                assert!(
                    (back - want).abs() <= largest * 2f64.powi(-30),
                    "row {r} column {c}: {back} vs {want}"
                );
            }
        }
    }

    #[test]
    fn the_avx512_digits_are_the_portable_ones() {
        let (rows, k, group) = (3, 512, 256);
        let x: Vec<f32> = (0..rows * k)
            .map(|i| [1e-18f32, 1.0, 3e9, 0.0][(i / group) % 4] * (((i * 7919) % 1013) as f32 - 506.5) / 97.0)
            .collect();
        #[cfg(target_arch = "x86_64")]
        for layout in [DigitLayout::Nibbles, DigitLayout::Bytes] {
            if !(std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw"))
            {
                eprintln!("skipped: no AVX-512F and BW on this CPU");
                return;
            }
            let want = portable_digits(&x, rows, k, group, layout);
            // SAFETY: the CPU has AVX-512F and BW (checked above).
            let got = unsafe { crate::gemv_digits_avx512::digits(&x, rows, k, group, layout) };
            assert_eq!(got.bytes, want.bytes, "{layout:?}");
            assert_eq!(got.factors, want.factors, "{layout:?}");
            assert_eq!(got.starts, want.starts, "{layout:?}");
        }
    }

    #[test]
    fn int8_starts_take_back_the_flipped_weights_count() {
        // With every weight 0 (flipped: 128), a lane's digit sum plus its start is 0.
        let (rows, k, group) = (2, 256, 128);
        let x: Vec<f32> = (0..rows * k).map(|i| ((i * 31) % 97) as f32 - 48.0).collect();
        let d = portable_digits(&x, rows, k, group, DigitLayout::Bytes);
        for (rg, starts) in d.starts.chunks_exact(4 * LANES).enumerate() {
            let (r, g) = (rg / (k / group), rg % (k / group));
            for digit in 0..4 {
                for lane in 0..LANES {
                    let mut sum = starts[digit * LANES + lane];
                    for block in 0..group / BYTE_BLOCK_COLUMNS {
                        let base =
                            (r * k + g * group + block * BYTE_BLOCK_COLUMNS) * 4 + digit * BYTE_BLOCK_COLUMNS;
                        sum += (0..4).map(|c| 128 * d.bytes[base + 4 * lane + c] as i32).sum::<i32>();
                    }
                    assert_eq!(sum, 0, "row {r} group {g} digit {digit} lane {lane}");
                }
            }
        }
    }

    #[test]
    fn split_covers_the_whole_range() {
        for v in [0, 1, -1, 127, 128, -128, -129, 255, 1 << 30, -(1 << 30), 0x1234_5678 >> 3, -0x0765_4321] {
            let d = split(v);
            let back: i64 = d.iter().enumerate().map(|(i, &x)| (x as i64) << (8 * i)).sum();
            assert_eq!(back, v as i64, "{v}");
        }
    }

    #[test]
    fn non_finite_and_huge_x_do_not_fit() {
        assert!(digits_fit(&[1e19, -1e-40, 0.0]));
        assert!(!digits_fit(&[2e19]));
        assert!(!digits_fit(&[f32::NAN]));
        assert!(!digits_fit(&[f32::NEG_INFINITY]));
    }
}
