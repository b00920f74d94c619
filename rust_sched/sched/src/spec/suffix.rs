//! Suffix proposals: the longest match of the sequence's newest tokens, looked up in its
//! own tokens (the n-gram scan, with longer matches) and in the outputs of recently
//! finished requests, so an agent loop or a code edit that repeats an earlier answer finds
//! it across requests.
//!
//! The cross-request part is a hashed n-gram index ([`SuffixCache`]): for every position of
//! a finished output and every match length `min_n..=max_n`, the hash of the tokens
//! before it maps to the newest place they occurred. It is bounded by a token budget: the
//! oldest outputs leave first, and their stale entries are dropped when the index is
//! rebuilt (when they outnumber the live ones). Unlike a suffix tree (vLLM's arctic suffix
//! decoding keeps one per request plus a global one, scores continuations by how often
//! they were seen and proposes a tree of drafts), this finds one continuation, the most
//! recent, for the longest match up to `max_n` tokens, and proposes a single chain.

use std::collections::{HashMap, VecDeque};

use super::ngram;

/// Finished outputs kept for lookup, in tokens (all of them together).
pub const SUFFIX_CACHE_TOKENS: usize = 1 << 16;
/// Prompt tokens kept before each output, so the output's first tokens can be found too.
const PROMPT_CONTEXT: usize = 16;

/// Where a hashed context last occurred: the document's generation and the position of the
/// token that followed it.
#[derive(Debug, Clone, Copy)]
struct Occurrence {
    generation: u64,
    next: u32,
}

/// Recently finished outputs and the index over them.
#[derive(Debug)]
pub struct SuffixCache {
    min_n: usize,
    max_n: usize,
    capacity: usize,
    /// (generation, tokens), oldest first; generations increase by one.
    docs: VecDeque<(u64, Vec<u32>)>,
    num_tokens: usize,
    next_generation: u64,
    index: HashMap<u64, Occurrence>,
    /// Index entries added for documents still kept.
    live_entries: usize,
}

fn hash_context(tokens: &[u32]) -> u64 {
    // FNV-1a over the ids, the length folded in first; collisions are checked by
    // comparing tokens, so a fast hash is enough.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ tokens.len() as u64;
    for &t in tokens {
        h ^= u64::from(t);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl SuffixCache {
    pub fn new(min_n: usize, max_n: usize, capacity: usize) -> Self {
        SuffixCache {
            min_n: min_n.max(1),
            max_n: max_n.max(min_n.max(1)),
            capacity,
            docs: VecDeque::new(),
            num_tokens: 0,
            next_generation: 0,
            index: HashMap::new(),
            live_entries: 0,
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    pub fn num_docs(&self) -> usize {
        self.docs.len()
    }

    /// Keeps a finished request's output (with the end of its prompt before it).
    pub fn insert(&mut self, prompt: &[u32], output: &[u32]) {
        if output.is_empty() {
            return;
        }
        let context = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..];
        let mut doc = Vec::with_capacity(context.len() + output.len());
        doc.extend_from_slice(context);
        doc.extend_from_slice(output);
        if doc.len() > self.capacity {
            doc.drain(..doc.len() - self.capacity);
        }
        while self.num_tokens + doc.len() > self.capacity {
            let (_, old) = self.docs.pop_front().expect("tokens counted in a document");
            self.num_tokens -= old.len();
            self.live_entries -= self.entries_of(old.len());
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        for next in 1..doc.len() {
            for m in self.min_n..=self.max_n.min(next) {
                self.index
                    .insert(hash_context(&doc[next - m..next]), Occurrence { generation, next: next as u32 });
            }
        }
        self.live_entries += self.entries_of(doc.len());
        self.num_tokens += doc.len();
        self.docs.push_back((generation, doc));
        if self.index.len() > 2 * self.live_entries.max(1024) {
            self.rebuild();
        }
    }

    /// How many index entries a document of `len` tokens adds.
    fn entries_of(&self, len: usize) -> usize {
        (1..len).map(|next| (self.max_n.min(next) + 1).saturating_sub(self.min_n)).sum()
    }

    /// Drops entries of documents no longer kept (newer documents win, as on insert).
    fn rebuild(&mut self) {
        let oldest = self.docs.front().map_or(self.next_generation, |d| d.0);
        self.index.retain(|_, occ| occ.generation >= oldest);
    }

    fn doc(&self, generation: u64) -> Option<&[u32]> {
        let first = self.docs.front()?.0;
        let (g, doc) = self.docs.get(generation.checked_sub(first)? as usize)?;
        (*g == generation).then_some(doc.as_slice())
    }

    /// The continuation of the longest kept context matching the end of `tokens`, longer
    /// than `at_least` tokens: appends up to `k` drafts to `out`, returns (match length,
    /// drafts appended), (0, 0) when none.
    pub fn lookup(&self, tokens: &[u32], at_least: usize, k: usize, out: &mut Vec<u32>) -> (usize, usize) {
        if k == 0 || self.docs.is_empty() {
            return (0, 0);
        }
        for m in (self.min_n.max(at_least + 1)..=self.max_n.min(tokens.len())).rev() {
            let context = &tokens[tokens.len() - m..];
            let Some(occ) = self.index.get(&hash_context(context)) else {
                continue;
            };
            let Some(doc) = self.doc(occ.generation) else {
                continue;
            };
            let next = occ.next as usize;
            if next < m || doc[next - m..next] != *context || next >= doc.len() {
                continue; // a hash collision or a stale entry
            }
            let take = k.min(doc.len() - next);
            out.extend_from_slice(&doc[next..next + take]);
            return (m, take);
        }
        (0, 0)
    }
}

/// Drafts for one sequence: the longest match of its newest `min_n..=max_n` tokens, in
/// its own tokens (as the n-gram proposer) or in the finished outputs kept in `cache`; at
/// equal length its own tokens win. Returns how many drafts it appended to `out`.
pub fn propose(
    tokens: &[u32],
    cache: &SuffixCache,
    min_n: usize,
    max_n: usize,
    k: usize,
    out: &mut Vec<u32>,
) -> usize {
    if k == 0 {
        return 0;
    }
    let own = ngram::find(tokens, min_n, max_n);
    let own_len = own.map_or(0, |m| m.len);
    if own_len < max_n {
        let (_, taken) = cache.lookup(tokens, own_len, k, out);
        if taken > 0 {
            return taken;
        }
    }
    let Some(m) = own else {
        return 0;
    };
    let take = k.min(tokens.len() - m.next);
    out.extend_from_slice(&tokens[m.next..m.next + take]);
    take
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafts(tokens: &[u32], cache: &SuffixCache, k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let n = propose(tokens, cache, 1, 4, k, &mut out);
        assert_eq!(n, out.len());
        out
    }

    #[test]
    fn finds_a_finished_requests_output() {
        let mut cache = SuffixCache::new(1, 4, 1024);
        cache.insert(&[1, 2, 3], &[10, 11, 12, 13, 14]);
        // A new request whose output has started repeating the earlier one.
        assert_eq!(drafts(&[7, 8, 10, 11], &cache, 3), vec![12, 13, 14]);
        // The prompt's end is context too.
        assert_eq!(drafts(&[9, 2, 3], &cache, 2), vec![10, 11]);
    }

    #[test]
    fn own_tokens_win_at_equal_length_and_longer_matches_win_overall() {
        let mut cache = SuffixCache::new(1, 4, 1024);
        cache.insert(&[], &[5, 6, 7, 1, 2, 3, 4]);
        // Own tokens hold "3 -> 9"; the cache holds "1 2 3 -> 4" (longer).
        assert_eq!(drafts(&[3, 9, 1, 2, 3], &cache, 1), vec![4]);
        // Both hold only "3": the sequence's own continuation wins.
        assert_eq!(drafts(&[3, 9, 8, 3], &cache, 1), vec![9]);
    }

    #[test]
    fn bounded_by_its_token_budget_oldest_first() {
        let mut cache = SuffixCache::new(1, 2, 20);
        cache.insert(&[], &[100, 101, 102, 103, 104, 105, 106, 107, 108, 109]);
        cache.insert(&[], &[200, 201, 202, 203, 204, 205, 206, 207, 208, 209]);
        assert_eq!(cache.num_tokens(), 20);
        cache.insert(&[], &[300, 301, 302, 303, 304]);
        assert!(cache.num_tokens() <= 20);
        assert_eq!(cache.num_docs(), 2);
        let mut out = Vec::new();
        assert_eq!(cache.lookup(&[100, 101], 0, 2, &mut out), (0, 0), "the oldest output left");
        assert_eq!(cache.lookup(&[201, 202], 0, 2, &mut out), (2, 2));
        assert_eq!(out, vec![203, 204]);
        for i in 0..2000u32 {
            cache.insert(&[], &[i, i + 1, i + 2]);
        }
        assert!(cache.num_tokens() <= 20);
        assert!(cache.index.len() <= 2 * cache.live_entries.max(1024) + 8);
    }

    #[test]
    fn nothing_without_a_match() {
        let cache = SuffixCache::new(1, 3, 64);
        assert!(drafts(&[1, 2, 3], &cache, 3).is_empty());
        let mut cache = SuffixCache::new(1, 3, 64);
        cache.insert(&[], &[4, 5, 6]);
        assert!(drafts(&[1, 2, 3], &cache, 3).is_empty());
        assert!(drafts(&[1, 2, 4], &cache, 0).is_empty());
    }
}
