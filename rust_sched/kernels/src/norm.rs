//! The decoder's elementwise work between its matmuls, one pass over each row:
//!
//! - [`rms_norm`]: `y = x / sqrt(mean(x^2) + eps) * w` over contiguous rows, optionally
//!   adding the block's output into the residual stream first (`r += x; y = norm(r)`),
//!   which is what a pre-norm decoder layer does between its attention and MLP blocks;
//! - [`qk_norm_rope`]: on a q/k/v projection's output, in place, the per-head RMSNorm of
//!   q and k (Qwen3) and the rotary embedding (rotate-half layout) of every q and k head.
//!
//! Composed of PyTorch operators these are 5 to 7 operators each, every one a pass over
//! the activations and a dispatch: on a decode step that dispatch is most of their cost,
//! on a prefill step the passes are. Rows split over threads as described in `parallel.rs`
//! once a call has enough of them.

use std::ops::Range;
use std::sync::Mutex;

use super::parallel::for_each_part;
use super::KernelError;

/// Floats per thread below which a call stays on one thread (joining the team costs
/// about a microsecond; a row of 256 floats takes a fraction of that).
const MIN_FLOATS_PER_THREAD: usize = 1 << 17;

/// An RMSNorm's weight and epsilon.
#[derive(Clone, Copy)]
pub struct Norm<'a> {
    pub weight: &'a [f32],
    pub eps: f32,
}

/// `out[r] = norm(x[r])` for every row (`x` and `out` are `[rows, weight.len()]`); with
/// `residual`, first `residual[r] += x[r]` and the norm is of the sum.
pub fn rms_norm(
    x: &[f32],
    residual: Option<&mut [f32]>,
    norm: Norm<'_>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    let width = norm.weight.len();
    if width == 0 || x.len() % width != 0 || out.len() != x.len() {
        return Err(KernelError::new(format!(
            "rms_norm: x ({} floats) and out ({} floats) must be whole rows of the weight's {width}",
            x.len(),
            out.len()
        )));
    }
    if residual.as_ref().is_some_and(|r| r.len() != x.len()) {
        return Err(KernelError::new("rms_norm: the residual must have x's shape".to_string()));
    }
    let rows = x.len() / width;
    let parts = split_rows(rows, width, threads);
    let mut out_rest = out;
    let mut residual_rest = residual;
    let mut pieces = Vec::with_capacity(parts.len());
    for range in parts {
        let len = range.len() * width;
        let (out_piece, tail) = out_rest.split_at_mut(len);
        out_rest = tail;
        let residual_piece = residual_rest.take().map(|r| {
            let (piece, tail) = r.split_at_mut(len);
            residual_rest = Some(tail);
            piece
        });
        pieces.push(Mutex::new(Some((range, out_piece, residual_piece))));
    }
    for_each_part(pieces.len(), &|part| {
        let taken = pieces[part].lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some((range, out, mut residual)) = taken else { return };
        let x = &x[range.start * width..range.end * width];
        for (row, (x, out)) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)).enumerate() {
            match residual.as_deref_mut() {
                Some(residual) => {
                    let sum = &mut residual[row * width..(row + 1) * width];
                    sum.iter_mut().zip(x).for_each(|(r, v)| *r += v);
                    normalize(sum, norm, out);
                }
                None => normalize(x, norm, out),
            }
        }
    });
    Ok(())
}

/// Where the heads of a fused q/k/v projection's output lie, and what to apply to them.
pub struct QkHeads<'a> {
    /// q heads, then k heads, then (untouched) v heads, each `head_dim` wide.
    pub q_heads: usize,
    pub k_heads: usize,
    pub head_dim: usize,
    /// Floats from one token's row to the next (at least all the heads).
    pub row_stride: usize,
    /// Per-head RMSNorm of q and of k (Qwen3), applied before the rotation.
    pub q_norm: Option<Norm<'a>>,
    pub k_norm: Option<Norm<'a>>,
    /// `[tokens, head_dim]` rotary tables of each token's position; each half repeats the
    /// other (the rotate-half layout).
    pub cos: &'a [f32],
    pub sin: &'a [f32],
}

/// [`qk_norm_rope`]'s checks of a `qkv_len`-float q/k/v array against `heads`.
pub(crate) fn check_qk(qkv_len: usize, heads: &QkHeads<'_>) -> Result<(), KernelError> {
    let dim = heads.head_dim;
    let used = (heads.q_heads + heads.k_heads) * dim;
    let tokens = heads.cos.len() / dim.max(1);
    let fail = |what: &str| Err(KernelError::new(format!("qk_norm_rope: {what}")));
    if dim == 0 || dim % 2 != 0 {
        return fail("head_dim must be even and positive");
    }
    if heads.row_stride < used || qkv_len != tokens * heads.row_stride {
        return fail("qkv must be [tokens, row_stride] with the q and k heads in each row");
    }
    if heads.cos.len() != tokens * dim || heads.sin.len() != heads.cos.len() {
        return fail("cos and sin must be [tokens, head_dim]");
    }
    if [heads.q_norm, heads.k_norm].iter().flatten().any(|n| n.weight.len() != dim) {
        return fail("the q/k norm weights must have head_dim entries");
    }
    Ok(())
}

/// Normalizes (where asked) and rotates every q and k head of every token of `qkv`
/// (`[tokens, row_stride]`), in place.
pub fn qk_norm_rope(qkv: &mut [f32], heads: &QkHeads<'_>, threads: usize) -> Result<(), KernelError> {
    check_qk(qkv.len(), heads)?;
    let dim = heads.head_dim;
    let used = (heads.q_heads + heads.k_heads) * dim;
    let tokens = heads.cos.len() / dim;
    let parts = split_rows(tokens, used, threads);
    let mut rest = qkv;
    let mut pieces = Vec::with_capacity(parts.len());
    for range in parts {
        let (piece, tail) = rest.split_at_mut(range.len() * heads.row_stride);
        rest = tail;
        pieces.push(Mutex::new(Some((range, piece))));
    }
    for_each_part(pieces.len(), &|part| {
        let taken = pieces[part].lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some((range, piece)) = taken else { return };
        let mut scratch = vec![0f32; dim];
        for (token, row) in range.zip(piece.chunks_exact_mut(heads.row_stride)) {
            let cos = &heads.cos[token * dim..(token + 1) * dim];
            let sin = &heads.sin[token * dim..(token + 1) * dim];
            let (q, rest) = row.split_at_mut(heads.q_heads * dim);
            let k = &mut rest[..heads.k_heads * dim];
            for (part, norm) in [(q, heads.q_norm), (k, heads.k_norm)] {
                for head in part.chunks_exact_mut(dim) {
                    if let Some(norm) = norm {
                        scratch.copy_from_slice(head);
                        normalize(&scratch, norm, head);
                    }
                    rotate_half(head, cos, sin);
                }
            }
        }
    });
    Ok(())
}

/// Equal row ranges for at most `threads` threads, fewer on small calls.
fn split_rows(rows: usize, width: usize, threads: usize) -> Vec<Range<usize>> {
    let threads = threads.clamp(1, rows.max(1)).min(rows * width / MIN_FLOATS_PER_THREAD + 1);
    (0..threads).map(|t| rows * t / threads..rows * (t + 1) / threads).collect()
}

/// `out = x / sqrt(mean(x^2) + eps) * weight`, the sum of squares in f32 lanes.
#[inline]
fn normalize(x: &[f32], norm: Norm<'_>, out: &mut [f32]) {
    const LANES: usize = 16;
    let mut lanes = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for chunk in chunks {
        for i in 0..LANES {
            lanes[i] += chunk[i] * chunk[i];
        }
    }
    let sum_squares = lanes.iter().sum::<f32>() + tail;
    let scale = 1.0 / (sum_squares / x.len() as f32 + norm.eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(norm.weight) {
        *o = w * (v * scale);
    }
}

/// Rotary embedding of one head, rotate-half convention: the pair `(x[i], x[i + half])`
/// turns by the angle whose cosine and sine are `cos[i]`, `sin[i]`.
#[inline]
fn rotate_half(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = head.len() / 2;
    let (low, high) = head.split_at_mut(half);
    for i in 0..half {
        let (a, b) = (low[i], high[i]);
        low[i] = a * cos[i] - b * sin[i];
        high[i] = b * cos[half + i] + a * sin[half + i];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        x.iter().zip(w).map(|(v, w)| w * v / (ms + eps).sqrt()).collect()
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    #[test]
    fn norm_with_and_without_residual_matches_f64() {
        for (rows, width, threads) in [(3, 20, 1), (700, 256, 2), (1, 17, 4)] {
            let x = values(rows * width, 1);
            let weight = values(width, 2);
            let mut residual = values(rows * width, 3);
            let before = residual.clone();
            let norm = Norm { weight: &weight, eps: 1e-6 };
            let (mut plain, mut fused) = (vec![0f32; x.len()], vec![0f32; x.len()]);
            rms_norm(&x, None, norm, &mut plain, threads).unwrap();
            rms_norm(&x, Some(&mut residual), norm, &mut fused, threads).unwrap();
            let w64: Vec<f64> = weight.iter().map(|&v| v as f64).collect();
            for r in 0..rows {
                let row = r * width..(r + 1) * width;
                let x64: Vec<f64> = x[row.clone()].iter().map(|&v| v as f64).collect();
                let sum64: Vec<f64> =
                    x64.iter().zip(&before[row.clone()]).map(|(a, &b)| a + b as f64).collect();
                for (got, want) in plain[row.clone()].iter().zip(reference_norm(&x64, &w64, 1e-6)) {
                    assert!((*got as f64 - want).abs() < 1e-5 * (1.0 + want.abs()), "{got} vs {want}");
                }
                for (got, want) in fused[row.clone()].iter().zip(reference_norm(&sum64, &w64, 1e-6)) {
                    assert!((*got as f64 - want).abs() < 1e-5 * (1.0 + want.abs()), "{got} vs {want}");
                }
                for (got, want) in residual[row.clone()].iter().zip(&sum64) {
                    assert!((*got as f64 - want).abs() < 1e-6);
                }
            }
        }
    }

    #[test]
    fn rope_rotates_pairs_and_leaves_v_alone() {
        let (tokens, dim, q_heads, k_heads, v_heads) = (5, 8, 2, 1, 1);
        let stride = (q_heads + k_heads + v_heads) * dim;
        let original = values(tokens * stride, 7);
        let angles: Vec<f32> = (0..tokens * dim / 2).map(|i| i as f32 * 0.1).collect();
        let table = |f: fn(f32) -> f32| -> Vec<f32> {
            (0..tokens)
                .flat_map(|t| (0..dim).map(move |i| (t, i % (dim / 2))))
                .map(|(t, i)| f(angles[t * dim / 2 + i]))
                .collect()
        };
        let (cos, sin) = (table(f32::cos), table(f32::sin));
        let norm_weight = values(dim, 9);
        let norm = Norm { weight: &norm_weight, eps: 1e-6 };
        let heads = QkHeads {
            q_heads,
            k_heads,
            head_dim: dim,
            row_stride: stride,
            q_norm: None,
            k_norm: Some(norm),
            cos: &cos,
            sin: &sin,
        };
        let mut qkv = original.clone();
        qk_norm_rope(&mut qkv, &heads, 2).unwrap();
        for t in 0..tokens {
            for h in 0..q_heads + k_heads + v_heads {
                let at = t * stride + h * dim;
                let mut x = original[at..at + dim].to_vec();
                if h == q_heads {
                    let mut normed = vec![0f32; dim];
                    normalize(&x, norm, &mut normed);
                    x = normed;
                }
                for i in 0..dim / 2 {
                    let angle = angles[t * dim / 2 + i];
                    let (a, b) = (x[i], x[i + dim / 2]);
                    let want = if h < q_heads + k_heads {
                        [a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()]
                    } else {
                        [a, b]
                    };
                    assert!(
                        (qkv[at + i] - want[0]).abs() < 1e-5
                            && (qkv[at + i + dim / 2] - want[1]).abs() < 1e-5
                    );
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        let weight = [1f32; 4];
        let norm = Norm { weight: &weight, eps: 1e-6 };
        assert!(rms_norm(&[0.0; 6], None, norm, &mut [0.0; 6], 1).is_err());
        assert!(rms_norm(&[0.0; 8], Some(&mut [0.0; 4]), norm, &mut [0.0; 8], 1).is_err());
        let table = [0f32; 4];
        let heads = QkHeads {
            q_heads: 1,
            k_heads: 1,
            head_dim: 4,
            row_stride: 4,
            q_norm: None,
            k_norm: None,
            cos: &table,
            sin: &table,
        };
        assert!(qk_norm_rope(&mut [0.0; 4], &heads, 1).is_err(), "row_stride below the q and k heads");
    }
}
