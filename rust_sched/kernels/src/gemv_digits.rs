//! `x` as integers for the int4 VNNI loops (`gemv_int4_vnni`): each group of each row
//! scaled by a power of two to 30-bit integers, written as four signed byte digits.
//!
//! AVX-512 VNNI's `vpdpbusd` multiplies 64 unsigned bytes by 64 signed bytes and adds
//! each 4 products into a 32-bit lane: 64 products in one instruction, exactly. The int4
//! weights (0..15) are the unsigned bytes; `x` must be the signed ones. Rounding `x` to
//! one byte (llama.cpp's Q8 activations) would cost up to 1/254 of a block's largest
//! `|x|` per element, far past float32 rounding. Here `x * 2^e` is rounded to an integer
//! `v` with `|v| <= 2^30` (`e` per row and group, from the group's largest `|x|`), and
//! `v = d0 + 2^8 d1 + 2^16 d2 + 2^24 d3` with every digit a signed byte: four exact
//! `vpdpbusd` give the group's four digit sums, which the loops combine in float. The
//! rounding is at most `2^-30` of the group's largest `|x|` per element (float32's is
//! `2^-24` of each element), so the products stay within float32 rounding of the sum of
//! `|terms|` unless a group's largest `|x|` is some thousands of times its typical one.
//!
//! Layout, per row, per 128-column block (64 weight bytes, one 512-bit load): the low
//! nibbles of byte `i` are column `2i`, the high ones column `2i + 1`, so the block's
//! 512 digit bytes hold `[half h][digit d][i]` = digit `d` of column `2i + h`.

/// Columns of one block: the 64 bytes of int4 weight one 512-bit load takes.
pub(crate) const BLOCK_COLUMNS: usize = 128;
/// Digit bytes per block: two halves (even, odd columns) of four digits of 64 columns.
const BLOCK_BYTES: usize = 4 * BLOCK_COLUMNS;
/// Largest `|x|` the digits take (`2^64`); larger, infinite or NaN `x` keep the float loops.
const X_LIMIT: f32 = 18_446_744_073_709_551_616.0;
/// `e` is at most this: groups whose largest `|x|` is below `2^-71` keep fewer than 30
/// bits, so that `2^e` and `2^-e` stay normal floats.
const MAX_EXPONENT: i32 = 100;

/// `x` [rows, k] as digit blocks, and per row and group the factor `2^-e` that takes the
/// integers back to `x`'s scale.
pub(crate) struct Digits {
    /// [rows, k / 128, 2, 4, 64] signed digits.
    pub bytes: Vec<i8>,
    /// [rows, k / group] powers of two.
    pub factors: Vec<f32>,
}

/// Whether every `x` can be written as digits (finite, below `2^64`).
pub(crate) fn digits_fit(x: &[f32]) -> bool {
    x.iter().all(|v| v.abs() < X_LIMIT)
}

/// `x` [rows, k] in digits, groups of `group` columns (a multiple of 128 dividing `k`),
/// every `x` within [`digits_fit`].
pub(crate) fn digits(x: &[f32], rows: usize, k: usize, group: usize) -> Digits {
    debug_assert!(group % BLOCK_COLUMNS == 0 && k % group == 0 && x.len() == rows * k);
    let groups = k / group;
    let mut bytes = vec![0i8; rows * k * 4];
    let mut factors = vec![0f32; rows * groups];
    for (g, (part, out)) in x.chunks_exact(group).zip(bytes.chunks_exact_mut(4 * group)).enumerate() {
        let largest = part.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e = exponent(largest);
        factors[g] = pow2(-e);
        let up = pow2(e);
        for (block, digits) in part.chunks_exact(BLOCK_COLUMNS).zip(out.chunks_exact_mut(BLOCK_BYTES)) {
            for half in 0..2 {
                let plane = &mut digits[half * 256..(half + 1) * 256];
                for i in 0..BLOCK_COLUMNS / 2 {
                    let d = split((block[2 * i + half] * up).round_ties_even() as i32);
                    for (digit, value) in d.into_iter().enumerate() {
                        plane[digit * 64 + i] = value;
                    }
                }
            }
        }
    }
    Digits { bytes, factors }
}

/// `e` for a group whose largest `|x|` is `largest`: `largest * 2^e < 2^30`, as close as
/// that allows (0 for a group of zeros).
fn exponent(largest: f32) -> i32 {
    if largest == 0.0 {
        return 0;
    }
    // floor(log2(largest)) from the float's exponent bits; subnormals read as -127,
    // below where MAX_EXPONENT clamps anyway.
    let floor_log2 = ((largest.to_bits() >> 23) & 0xFF) as i32 - 127;
    (29 - floor_log2).min(MAX_EXPONENT)
}

/// `2^e` for `e` in [-126, 127], exactly.
fn pow2(e: i32) -> f32 {
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
        let d = digits(&x, rows, k, group);
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
