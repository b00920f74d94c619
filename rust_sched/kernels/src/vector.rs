//! Slice arithmetic for the kernels. `dot` and `axpy` come in two implementations behind
//! [`Ops`]: [`Portable`] (plain loops, any CPU) and, on x86-64, [`Avx2`] (AVX2 + FMA
//! intrinsics, chosen at run time). `exp_shifted_in_place` and `max` use independent
//! accumulator lanes so that LLVM vectorizes them on any target.

const LANES: usize = 16;

/// The inner products of the attention kernel.
pub trait Ops {
    /// `a . b` (equal lengths).
    fn dot(a: &[f32], b: &[f32]) -> f32;
    /// `acc += weight * x` (equal lengths).
    fn axpy(acc: &mut [f32], weight: f32, x: &[f32]);
    /// Asks the CPU to start loading `data` into the cache (a hint; may do nothing).
    fn prefetch(_data: &[f32]) {}
}

/// Plain loops, for any CPU and any length.
pub struct Portable;

impl Ops for Portable {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; LANES];
        let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
        let tail: f32 = a_chunks.remainder().iter().zip(b_chunks.remainder()).map(|(x, y)| x * y).sum();
        for (x, y) in a_chunks.zip(b_chunks) {
            for i in 0..LANES {
                acc[i] += x[i] * y[i];
            }
        }
        lane_sum(acc) + tail
    }

    #[inline(always)]
    fn axpy(acc: &mut [f32], weight: f32, x: &[f32]) {
        for (a, v) in acc.iter_mut().zip(x) {
            *a += weight * v;
        }
    }
}

/// AVX2 + FMA on lengths that are a multiple of 8. Only call it from code compiled with
/// `#[target_feature(enable = "avx2,fma")]` on a CPU that has both.
#[cfg(target_arch = "x86_64")]
pub struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Ops for Avx2 {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        assert!(a.len() == b.len() && a.len() % 8 == 0);
        // SAFETY: in bounds (checked above); the caller guarantees the CPU features.
        unsafe {
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i + 16 <= a.len() {
                even = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), even);
                odd = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), odd);
                i += 16;
            }
            if i < a.len() {
                even = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), even);
            }
            let sum = _mm256_add_ps(even, odd);
            let quad = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
            let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
            _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)))
        }
    }

    #[inline(always)]
    fn axpy(acc: &mut [f32], weight: f32, x: &[f32]) {
        use std::arch::x86_64::*;
        assert!(acc.len() == x.len() && x.len() % 8 == 0);
        // SAFETY: in bounds (checked above); the caller guarantees the CPU features.
        unsafe {
            let w = _mm256_set1_ps(weight);
            let (pa, px) = (acc.as_mut_ptr(), x.as_ptr());
            for i in (0..x.len()).step_by(8) {
                _mm256_storeu_ps(
                    pa.add(i),
                    _mm256_fmadd_ps(w, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(pa.add(i))),
                );
            }
        }
    }
}

#[inline(always)]
fn lane_sum(acc: [f32; LANES]) -> f32 {
    let mut half = [0f32; LANES / 2];
    for i in 0..LANES / 2 {
        half[i] = acc[i] + acc[i + LANES / 2];
    }
    half.iter().sum()
}

/// `e^x` for `x <= 0` to about one ulp (`x` below -87 gives about 1e-38, not 0): split
/// `x = n ln2 + r` with `|r| <= ln2 / 2`, a degree-6 Taylor polynomial for `e^r` and the
/// exponent bits for `2^n`. Branch-free, so a loop over a slice vectorizes.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75; // ln 2 split so that n * LN2_HI is exact
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let x = x.clamp(-87.0, 0.0);
    let n = (x * LOG2_E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Below this, `e^(x - max)` is taken as 0: such a weight is under `2^-64` of the largest
/// (which is 1), so it cannot move a float32 sum that holds that one, and weights near
/// `2^-126` would make subnormal products in the value sums, which on Intel CPUs take a
/// microcode assist each (a sharply peaked attention, the copy model's, ran its decode
/// kernel 4-7x slower on them).
const NEGLIGIBLE_SHIFT: f32 = -64.0 * std::f32::consts::LN_2;

/// Replaces every `x` by `e^(x - max)` (`max` at least every `x`; 0 where that is below
/// `2^-64`) and returns their sum.
#[inline(always)]
pub fn exp_shifted_in_place(xs: &mut [f32], max: f32) -> f32 {
    #[inline(always)]
    fn weight(shifted: f32) -> f32 {
        let e = exp_nonpositive(shifted);
        if shifted < NEGLIGIBLE_SHIFT {
            0.0
        } else {
            e
        }
    }
    let mut acc = [0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        let chunk: &mut [f32; LANES] = chunk.try_into().unwrap();
        for i in 0..LANES {
            chunk[i] = weight(chunk[i] - max);
            acc[i] += chunk[i];
        }
    }
    let mut tail = 0.0;
    for x in chunks.into_remainder() {
        *x = weight(*x - max);
        tail += *x;
    }
    lane_sum(acc) + tail
}

/// The largest element (`-inf` for an empty slice).
#[inline(always)]
pub fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    for chunk in chunks {
        let chunk: &[f32; LANES] = chunk.try_into().unwrap();
        for i in 0..LANES {
            acc[i] = acc[i].max(chunk[i]);
        }
    }
    acc.iter().fold(tail, |m, &x| m.max(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_within_a_few_ulps() {
        let mut worst = 0f32;
        for i in 0..=86_900 {
            let x = -(i as f32) * 1e-3;
            let (got, want) = (exp_nonpositive(x), x.exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }

    #[test]
    fn weights_below_two_to_the_minus_64_are_zero_not_subnormal() {
        let cut = NEGLIGIBLE_SHIFT;
        let mut xs = vec![0.0, -1.0, cut + 0.01, cut - 0.01, -80.0, -87.5, -1e30, f32::NEG_INFINITY];
        xs.extend([-3.0; 17]); // a whole chunk and a tail
        let sum = exp_shifted_in_place(&mut xs, 0.0);
        assert_eq!(xs[0], 1.0);
        assert!((xs[1] - (-1f32).exp()).abs() < 1e-7);
        assert!(xs[2] >= f32::MIN_POSITIVE, "kept above the cut, and normal: {}", xs[2]);
        assert_eq!(&xs[3..8], &[0.0; 5]);
        let want = 1.0 + (-1f32).exp() + xs[2] + 17.0 * (-3f32).exp();
        assert!((sum - want).abs() < 1e-5, "{sum} vs {want}");
    }

    #[test]
    fn slice_helpers_match_plain_loops() {
        let a: Vec<f32> = (0..70).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..70).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((Portable::dot(&a, &b) - want).abs() < 1e-5);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            assert!((Avx2::dot(&a[..64], &b[..64]) - Portable::dot(&a[..64], &b[..64])).abs() < 1e-5);
            assert!((Avx2::dot(&a[..40], &b[..40]) - Portable::dot(&a[..40], &b[..40])).abs() < 1e-5);
            let (mut fast, mut plain) = (vec![0.5; 64], vec![0.5; 64]);
            Avx2::axpy(&mut fast, 3.0, &a[..64]);
            Portable::axpy(&mut plain, 3.0, &a[..64]);
            assert!(fast.iter().zip(&plain).all(|(x, y)| (x - y).abs() < 1e-6));
        }
        assert_eq!(max(&a), a.iter().cloned().fold(f32::NEG_INFINITY, f32::max));
        let mut e = a.clone();
        let sum = exp_shifted_in_place(&mut e, 1.0);
        let want: Vec<f32> = a.iter().map(|x| (x - 1.0).exp()).collect();
        for (got, want) in e.iter().zip(&want) {
            assert!((got - want).abs() < 1e-6);
        }
        assert!((sum - want.iter().sum::<f32>()).abs() < 1e-4);
        let mut acc = vec![1.0; 70];
        Portable::axpy(&mut acc, 2.0, &a);
        assert!(acc.iter().zip(&a).all(|(got, x)| (got - (1.0 + 2.0 * x)).abs() < 1e-6));
    }
}
