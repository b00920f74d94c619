//! N-gram prompt lookup: the sequence's newest `n` tokens (from `max_n` down to `min_n`)
//! are looked up earlier in its own prompt and output; the tokens that followed the most
//! recent earlier occurrence are the drafts. No model and no state between steps: a scan
//! of the sequence's tokens, newest first.

/// Appends to `out` up to `k` drafts for `tokens`, the sequence's known tokens in order.
/// The longest suffix length in `min_n..=max_n` that occurs earlier wins; among its
/// occurrences the most recent one. Returns how many drafts it appended (0: no match).
pub fn propose(tokens: &[u32], min_n: usize, max_n: usize, k: usize, out: &mut Vec<u32>) -> usize {
    if k == 0 {
        return 0;
    }
    let Some(m) = find(tokens, min_n, max_n) else {
        return 0;
    };
    let take = k.min(tokens.len() - m.next);
    out.extend_from_slice(&tokens[m.next..m.next + take]);
    take
}

/// The best earlier occurrence of the end of a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Match {
    /// How many tokens matched.
    pub len: usize,
    /// Position of the token that followed the occurrence (always `< tokens.len()`).
    pub next: usize,
}

/// The longest (then most recent) earlier occurrence of the last `min_n..=max_n` tokens.
pub fn find(tokens: &[u32], min_n: usize, max_n: usize) -> Option<Match> {
    let len = tokens.len();
    if min_n == 0 || len < min_n + 1 {
        return None;
    }
    let max_n = max_n.min(len - 1);
    // One scan, newest first: at each candidate end `e` (exclusive, `e < len` so a token
    // follows), the length of the common suffix of tokens[..e] and tokens[..len], capped at
    // `max_n`. The first candidate that reaches `max_n` wins at once; otherwise the longest
    // seen (the most recent among equals, as the scan goes newest first).
    let mut best = Match { len: 0, next: 0 };
    let last = tokens[len - 1];
    for e in (min_n..len).rev() {
        if tokens[e - 1] != last {
            continue;
        }
        let mut m = 1;
        while m < max_n && m < e && tokens[e - 1 - m] == tokens[len - 1 - m] {
            m += 1;
        }
        if m > best.len {
            best = Match { len: m, next: e };
            if m == max_n {
                break;
            }
        }
    }
    (best.len >= min_n).then_some(best)
}

#[cfg(test)]
mod tests {
    use super::propose;

    fn drafts(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let n = propose(tokens, min_n, max_n, k, &mut out);
        assert_eq!(n, out.len());
        out
    }

    #[test]
    fn finds_the_continuation_of_a_repeated_span() {
        // "1 2 3 4 5 ... 1 2 3" -> "4 5"
        assert_eq!(drafts(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 1, 3, 2), vec![4, 5]);
        // k caps the drafts; the end of the sequence caps them too.
        assert_eq!(drafts(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 1, 3, 10), vec![4, 5, 9, 1, 2, 3]);
    }

    #[test]
    fn longest_match_wins_over_a_more_recent_shorter_one() {
        // Suffix "7 8": "7 8" occurs at 0..2 (followed by 1); "8" alone more recently at
        // 4 (followed by 2). The 2-gram wins.
        assert_eq!(drafts(&[7, 8, 1, 5, 8, 2, 7, 8], 1, 3, 1), vec![1]);
        // With max_n = 1 only the newest 1-gram counts: the "8" at 4.
        assert_eq!(drafts(&[7, 8, 1, 5, 8, 2, 7, 8], 1, 1, 1), vec![2]);
    }

    #[test]
    fn most_recent_of_equal_matches_wins() {
        assert_eq!(drafts(&[4, 1, 4, 2, 4], 1, 3, 1), vec![2]);
    }

    #[test]
    fn min_n_refuses_short_matches() {
        assert!(drafts(&[1, 2, 3, 9, 3], 2, 3, 3).is_empty());
        assert_eq!(drafts(&[1, 2, 3, 9, 3], 1, 3, 3), vec![9, 3]);
    }

    #[test]
    fn nothing_for_short_or_unrepeated_sequences() {
        assert!(drafts(&[], 1, 3, 3).is_empty());
        assert!(drafts(&[5], 1, 3, 3).is_empty());
        assert!(drafts(&[1, 2, 3, 4], 1, 3, 3).is_empty());
        assert!(drafts(&[1, 1], 1, 3, 0).is_empty());
    }

    #[test]
    fn a_run_of_one_token_proposes_more_of_it() {
        assert_eq!(drafts(&[6, 6, 6, 6], 1, 3, 3), vec![6]);
        // The most recent occurrence is the one just before the end: one token follows it.
        assert_eq!(drafts(&[2, 6, 6, 6, 6, 6, 6, 6], 1, 3, 3), vec![6]);
    }
}
