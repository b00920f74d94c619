//! Applying grammar masks to logits in place: the disallowed tokens of each constrained
//! row become `-inf`. One pass over the row; a word of 32 disallowed tokens (the common
//! case) is one fill, a word of 32 allowed ones is skipped. On CPU this replaces
//! unpacking the mask into a `[rows, vocab]` tensor and a masked copy.

use crate::KernelError;

/// `logits` is `[S, vocab]` (row-major); `bits` is `[rows.len(), words]`, bit `t % 32` of
/// word `t / 32` allowing token `t` of the row `rows[i]` of `logits`. Tokens past the
/// mask's `words * 32` are disallowed.
pub fn apply_token_bitmask(
    logits: &mut [f32],
    vocab: usize,
    bits: &[u32],
    words: usize,
    rows: &[i64],
) -> Result<(), KernelError> {
    let bad = |m: String| Err(KernelError::new(m));
    if vocab == 0 || logits.len() % vocab != 0 {
        return bad(format!("logits of {} values are not rows of {vocab}", logits.len()));
    }
    if bits.len() != rows.len() * words {
        return bad(format!("a mask of {} words is not {} rows of {words}", bits.len(), rows.len()));
    }
    let num_rows = logits.len() / vocab;
    if let Some(&r) = rows.iter().find(|&&r| r < 0 || r as usize >= num_rows) {
        return bad(format!("row {r} is outside the {num_rows} rows of logits"));
    }
    for (mask, &row) in bits.chunks_exact(words.max(1)).zip(rows) {
        let out = &mut logits[row as usize * vocab..(row as usize + 1) * vocab];
        for (w, chunk) in out.chunks_mut(32).enumerate() {
            let word = mask.get(w).copied().unwrap_or(0);
            if word == u32::MAX {
                continue;
            }
            if word == 0 {
                chunk.fill(f32::NEG_INFINITY);
                continue;
            }
            for (b, x) in chunk.iter_mut().enumerate() {
                if word >> b & 1 == 0 {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_only_the_named_rows_and_only_disallowed_tokens() {
        let vocab = 70; // three words, the last one partial
        let mut logits: Vec<f32> = (0..3 * vocab).map(|i| i as f32).collect();
        let bits = [0b101, u32::MAX, 0, /* row 2: */ 0, 0, 1 << 5];
        apply_token_bitmask(&mut logits, vocab, &bits, 3, &[0, 2]).unwrap();
        let finite = |r: usize| (0..vocab).filter(|&t| logits[r * vocab + t].is_finite()).collect::<Vec<_>>();
        let mut want0 = vec![0, 2];
        want0.extend(32..64);
        assert_eq!(finite(0), want0);
        assert_eq!(finite(1), (0..vocab).collect::<Vec<_>>(), "row 1 is not constrained");
        assert_eq!(finite(2), vec![69]);
        assert_eq!(logits[2 * vocab + 69], (2 * vocab + 69) as f32);
    }

    #[test]
    fn a_narrow_mask_disallows_the_rest_and_bad_shapes_are_refused() {
        let mut logits = vec![0.0f32; 40];
        apply_token_bitmask(&mut logits, 40, &[u32::MAX], 1, &[0]).unwrap();
        assert!(logits[..32].iter().all(|x| x.is_finite()) && logits[32..].iter().all(|x| x.is_infinite()));
        assert!(apply_token_bitmask(&mut logits, 30, &[0], 1, &[0]).is_err());
        assert!(apply_token_bitmask(&mut logits, 40, &[0, 0], 1, &[0]).is_err());
        assert!(apply_token_bitmask(&mut logits, 40, &[0], 1, &[1]).is_err());
    }
}
