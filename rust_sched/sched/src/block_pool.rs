//! The paged KV block pool: reference counts, a free stack, prefix-cache identities and
//! least-recently-used eviction of cached blocks nobody owns.
//!
//! A block is in exactly one of three states:
//! - **used**: reference count > 0 (owned by one or more sequences);
//! - **fresh**: free and holding nothing reusable (on the `fresh` stack);
//! - **evictable**: free but still holding a full, hashed block that a later prompt may
//!   reuse (on the `evictable` LRU list, and in `cached`).
//!
//! Allocation takes fresh blocks first and evicts the least recently freed cached block
//! only when none is left, so the cache keeps as much as the pool can afford.
//!
//! With KV-cache events on ([`BlockPool::record_events`]), every change to the set of
//! cached hashes is also appended to a [`KvEventLog`]: a block registered under a new hash
//! (stored), a cached block evicted or forgotten (removed). The log therefore replays to
//! exactly the keys of the prefix map ([`BlockPool::cached_hashes`]).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::block_hash::BlockHash;
use crate::kv_events::KvEventLog;
use crate::lru::LruList;

pub type BlockId = u32;

/// A block-table entry whose block went back to the pool because every layer's sliding
/// window has passed it (`kv_groups.rs`): it is never read again, and never a real block
/// (the pool holds fewer than `u32::MAX` blocks).
pub const NULL_BLOCK: BlockId = BlockId::MAX;

/// Returned by [`BlockPool::try_allocate`] when the pool cannot serve the request; nothing
/// was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolExhausted {
    pub requested: usize,
    pub free: usize,
}

/// Block counts: `free + used == total`, and `evictable <= free`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolUsage {
    pub total: usize,
    pub free: usize,
    pub evictable: usize,
    pub used: usize,
}

/// Prefix-cache lookups, counted in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixCacheStats {
    pub queried_tokens: u64,
    pub hit_tokens: u64,
}

/// Hashes a [`BlockHash`] by taking its low 64 bits: the key is already a strong hash, so
/// hashing it again would only cost time.
#[derive(Debug, Default, Clone, Copy)]
pub struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached for keys other than `BlockHash`; fold them in anyway.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

type BlockHashMap = HashMap<BlockHash, BlockId, BuildHasherDefault<PassThroughHasher>>;

#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    enable_caching: bool,
    ref_counts: Vec<u32>,
    hashes: Vec<Option<BlockHash>>,
    /// Cached blocks of a hybrid model's extra tables: KV-cache events do not publish them
    /// (a router knows one identity per block of tokens, table 0's).
    quiet: Vec<bool>,
    cached: BlockHashMap,
    fresh: Vec<BlockId>,
    evictable: LruList,
    num_used: usize,
    /// The most blocks in use at once so far.
    peak_used: usize,
    stats: PrefixCacheStats,
    /// What changed in the prefix cache since the last `take_events`; None when events
    /// are off (nothing is recorded).
    events: Option<KvEventLog>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize, enable_caching: bool) -> Self {
        assert!(num_blocks > 0 && num_blocks < u32::MAX as usize, "num_blocks out of range");
        assert!(block_size > 0, "block_size must be positive");
        BlockPool {
            block_size,
            enable_caching,
            ref_counts: vec![0; num_blocks],
            hashes: vec![None; num_blocks],
            quiet: vec![false; num_blocks],
            // Sized once: registering blocks never rehashes on the hot path.
            cached: if enable_caching {
                BlockHashMap::with_capacity_and_hasher(num_blocks, Default::default())
            } else {
                BlockHashMap::default()
            },
            // Reversed so that block 0 is handed out first (easier to read in tests).
            fresh: (0..num_blocks as BlockId).rev().collect(),
            evictable: LruList::new(num_blocks),
            num_used: 0,
            peak_used: 0,
            stats: PrefixCacheStats::default(),
            events: None,
        }
    }

    /// Starts recording KV-cache events (a no-op without prefix caching: nothing is ever
    /// cached then).
    pub fn record_events(&mut self) {
        if self.enable_caching && self.events.is_none() {
            // The first event says the pool holds nothing: a subscriber that remembers an
            // earlier engine on the same endpoint starts over.
            let mut log = KvEventLog::default();
            log.all_cleared();
            self.events = Some(log);
        }
    }

    /// Whether KV-cache events are recorded (`register` reads its `parent` and `tokens`).
    pub fn records_events(&self) -> bool {
        self.events.is_some()
    }

    /// The events recorded since the last call; None when there are none or events are off.
    pub fn take_events(&mut self) -> Option<KvEventLog> {
        let log = self.events.as_mut()?;
        if log.is_empty() {
            return None;
        }
        let next = KvEventLog::sized_like(log);
        Some(std::mem::replace(log, next))
    }

    /// Published hashes ([`BlockHash::published`]) of every block in the prefix cache now
    /// but the quiet ones (`register_quiet`), sorted: what a subscriber that replayed every
    /// event must hold.
    pub fn cached_hashes(&self) -> Vec<u64> {
        let mut out: Vec<u64> = self
            .cached
            .iter()
            .filter(|&(_, &b)| !self.quiet[b as usize])
            .map(|(h, _)| h.published())
            .collect();
        out.sort_unstable();
        out
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn caching_enabled(&self) -> bool {
        self.enable_caching
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.fresh.len() + self.evictable.len()
    }

    pub fn usage(&self) -> PoolUsage {
        PoolUsage {
            total: self.num_blocks(),
            free: self.num_free(),
            evictable: self.evictable.len(),
            used: self.num_used,
        }
    }

    /// The most blocks that were in use at once since the pool was made.
    pub fn peak_used(&self) -> usize {
        self.peak_used
    }

    pub fn prefix_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts[block as usize]
    }

    pub fn hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.hashes[block as usize]
    }

    /// The longest run of cached blocks matching `hashes` from the start. Read-only: call
    /// [`acquire`](Self::acquire) on the blocks to keep them.
    pub fn longest_cached_prefix(&self, hashes: &[BlockHash], out: &mut Vec<BlockId>) {
        out.clear();
        if !self.enable_caching {
            return;
        }
        for h in hashes {
            match self.cached.get(h) {
                Some(&b) => out.push(b),
                None => break,
            }
        }
    }

    /// The longest cached prefix a sliding-window attention can resume from: the largest
    /// `k <= hashes.len()` such that the blocks a query at the hit point still reads,
    /// `behind(k)..k`, are all cached (the blocks before them need not be: their hashes
    /// chain, so a cached block vouches for the whole prefix before it). Fills `out` with
    /// those blocks and returns `behind(k)`, the leading blocks the hit skips; the hit is
    /// `behind(k) + out.len()` blocks. Scans from the end, as runs of cached blocks.
    pub fn longest_cached_window(
        &self,
        hashes: &[BlockHash],
        behind: impl Fn(usize) -> usize,
        out: &mut Vec<BlockId>,
    ) -> usize {
        out.clear();
        if !self.enable_caching {
            return 0;
        }
        // Blocks i..end are cached; end is a candidate hit.
        let mut end = hashes.len();
        let mut i = end;
        loop {
            let skip = behind(end).min(end);
            if i <= skip {
                out.extend(hashes[skip..end].iter().map(|h| self.cached[h]));
                return skip;
            }
            i -= 1;
            if !self.cached.contains_key(&hashes[i]) {
                end = i;
            }
        }
    }

    /// Counts one prefix-cache lookup of `queried` tokens of which `hit` were cached.
    pub fn record_lookup(&mut self, queried: usize, hit: usize) {
        self.stats.queried_tokens += queried as u64;
        self.stats.hit_tokens += hit as u64;
    }

    /// How many of `blocks` are free now (evictable) and would stop counting as free once
    /// acquired.
    pub fn count_evictable(&self, blocks: &[BlockId]) -> usize {
        blocks.iter().filter(|&&b| self.ref_counts[b as usize] == 0).count()
    }

    /// Takes one more reference on each of `blocks` (cached hits or blocks shared with a
    /// sibling sequence). Evictable blocks leave the eviction queue.
    pub fn acquire(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            let i = b as usize;
            if self.ref_counts[i] == 0 {
                let was_evictable = self.evictable.remove(b);
                debug_assert!(was_evictable, "acquired a free block {b} that holds nothing");
                self.num_used += 1;
            }
            self.ref_counts[i] += 1;
        }
        self.peak_used = self.peak_used.max(self.num_used);
    }

    /// Appends `n` fresh blocks (reference count 1) to `out`, or takes nothing and says how
    /// many were free.
    pub fn try_allocate(&mut self, n: usize, out: &mut Vec<BlockId>) -> Result<(), PoolExhausted> {
        if n > self.num_free() {
            return Err(PoolExhausted { requested: n, free: self.num_free() });
        }
        out.reserve(n);
        for _ in 0..n {
            let b = match self.fresh.pop() {
                Some(b) => b,
                None => self.evict_one(),
            };
            self.ref_counts[b as usize] = 1;
            out.push(b);
        }
        self.num_used += n;
        self.peak_used = self.peak_used.max(self.num_used);
        Ok(())
    }

    /// Like [`try_allocate`](Self::try_allocate), for callers that checked `num_free`.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<BlockId>) {
        if let Err(e) = self.try_allocate(n, out) {
            panic!("allocate({n}) with only {} free blocks", e.free);
        }
    }

    fn evict_one(&mut self) -> BlockId {
        let b = self.evictable.pop_front().expect("num_free counted an evictable block");
        if let Some(h) = self.hashes[b as usize].take() {
            self.uncache(h, b);
        }
        b
    }

    /// Drops `hash`'s prefix-map entry if it is `block`'s.
    fn uncache(&mut self, hash: BlockHash, block: BlockId) {
        let quiet = std::mem::take(&mut self.quiet[block as usize]);
        if self.cached.get(&hash) == Some(&block) {
            self.cached.remove(&hash);
            if let (Some(log), false) = (&mut self.events, quiet) {
                log.removed(hash);
            }
        }
    }

    /// Drops one reference on each of `blocks`, a sequence's block table in order. Blocks
    /// whose last reference goes become free; the table is walked backwards so that its
    /// tail, the part least likely to be shared, is evicted first.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let i = b as usize;
            assert!(self.ref_counts[i] > 0, "block {b} released more often than acquired");
            self.ref_counts[i] -= 1;
            if self.ref_counts[i] == 0 {
                self.num_used -= 1;
                if self.hashes[i].is_some() {
                    self.evictable.push_back(b);
                } else {
                    self.fresh.push(b);
                }
            }
        }
    }

    /// Makes a full, computed block findable by its content hash. A block that is already
    /// registered, or whose content another block already caches, stays as it is.
    /// `parent` (the hash of the block before it in its sequence) and `tokens` (the
    /// block's token ids) are read only for the KV-cache event, when events are on.
    pub fn register(&mut self, block: BlockId, hash: BlockHash, parent: Option<BlockHash>, tokens: &[u32]) {
        if !self.enable_caching || self.hashes[block as usize].is_some() {
            return;
        }
        // A subscriber finds a stored event's tokens by position (block_size per event), so
        // one event without a full block would shift every later one's in the step: such a
        // block is not cached at all (a lost prefix hit), and the cache and events agree.
        if self.events.is_some() && tokens.len() != self.block_size {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(block);
            self.hashes[block as usize] = Some(hash);
            if let Some(log) = &mut self.events {
                log.stored(hash, parent, tokens);
            }
        }
    }

    /// Like [`register`](Self::register) for a block of a hybrid model's extra table
    /// (`hash` from [`BlockHash::for_table`]): findable, never published as an event.
    pub fn register_quiet(&mut self, block: BlockId, hash: BlockHash) {
        if !self.enable_caching || self.hashes[block as usize].is_some() {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(block);
            self.hashes[block as usize] = Some(hash);
            self.quiet[block as usize] = true;
        }
    }

    /// Whether `hash` is cached now (a hybrid model's prefix lookup checks each table).
    pub fn is_cached(&self, hash: &BlockHash) -> bool {
        self.enable_caching && self.cached.contains_key(hash)
    }

    /// The block cached under `hash`, if any.
    pub fn cached_block(&self, hash: &BlockHash) -> Option<BlockId> {
        if self.enable_caching {
            self.cached.get(hash).copied()
        } else {
            None
        }
    }

    /// Takes back whatever cache identity `block` has (a step that was to compute part of
    /// it failed, so its content cannot be trusted). A free block becomes fresh.
    pub fn forget(&mut self, block: BlockId) {
        let i = block as usize;
        let Some(hash) = self.hashes[i].take() else {
            return;
        };
        self.uncache(hash, block);
        if self.ref_counts[i] == 0 {
            self.evictable.remove(block);
            self.fresh.push(block);
        }
    }

    /// Checks the pool's own invariants; returns a description of the first broken one.
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.num_blocks();
        let mut free_seen = vec![false; n];
        for &b in &self.fresh {
            let i = b as usize;
            if free_seen[i] {
                return Err(format!("block {b} twice on the fresh stack"));
            }
            free_seen[i] = true;
            if self.ref_counts[i] != 0 || self.hashes[i].is_some() {
                return Err(format!("fresh block {b} is owned or hashed"));
            }
        }
        for b in self.evictable.iter() {
            let i = b as usize;
            if free_seen[i] {
                return Err(format!("block {b} both fresh and evictable"));
            }
            free_seen[i] = true;
            if self.ref_counts[i] != 0 || self.hashes[i].is_none() {
                return Err(format!("evictable block {b} is owned or not hashed"));
            }
        }
        let used = (0..n).filter(|&i| self.ref_counts[i] > 0).count();
        if used != self.num_used || used + self.num_free() != n {
            return Err(format!(
                "counts disagree: used {used} (tracked {}), free {}, total {n}",
                self.num_used,
                self.num_free()
            ));
        }
        if let Some(i) = (0..n).find(|&i| self.ref_counts[i] == 0 && !free_seen[i]) {
            return Err(format!("block {i} has no owner and is not free"));
        }
        for (h, &b) in &self.cached {
            if self.hashes[b as usize] != Some(*h) {
                return Err(format!("prefix map entry points at block {b} with another hash"));
            }
        }
        let hashed = self.hashes.iter().filter(|h| h.is_some()).count();
        if hashed != self.cached.len() {
            return Err(format!("{hashed} hashed blocks but {} map entries", self.cached.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u128) -> BlockHash {
        BlockHash(x)
    }

    #[test]
    fn allocate_release_counts() {
        let mut p = BlockPool::new(4, 16, true);
        let mut t = Vec::new();
        p.try_allocate(3, &mut t).unwrap();
        assert_eq!(t, vec![0, 1, 2]);
        assert_eq!(p.usage(), PoolUsage { total: 4, free: 1, evictable: 0, used: 3 });
        let mut more = Vec::new();
        assert_eq!(p.try_allocate(2, &mut more), Err(PoolExhausted { requested: 2, free: 1 }));
        assert!(more.is_empty());
        p.release(&t);
        assert_eq!(p.usage().free, 4);
        p.check_invariants().unwrap();
    }

    #[test]
    fn cached_blocks_survive_release_and_are_evicted_lru() {
        let mut p = BlockPool::new(3, 4, true);
        let mut a = Vec::new();
        p.try_allocate(2, &mut a).unwrap();
        p.register(a[0], h(10), None, &[0; 4]);
        p.register(a[1], h(11), None, &[0; 4]);
        p.release(&a);
        assert_eq!(p.usage(), PoolUsage { total: 3, free: 3, evictable: 2, used: 0 });
        let mut hit = Vec::new();
        p.longest_cached_prefix(&[h(10), h(11), h(12)], &mut hit);
        assert_eq!(hit, a);
        // Fresh block first, then the least recently freed cached one: the tail (a[1]) was
        // released first, so it goes first.
        let mut b = Vec::new();
        p.try_allocate(2, &mut b).unwrap();
        assert_eq!(b[1], a[1]);
        p.longest_cached_prefix(&[h(10), h(11)], &mut hit);
        assert_eq!(hit, vec![a[0]]);
        p.check_invariants().unwrap();
    }

    #[test]
    fn acquire_removes_from_eviction_and_fork_shares() {
        let mut p = BlockPool::new(2, 4, true);
        let mut a = Vec::new();
        p.try_allocate(1, &mut a).unwrap();
        p.register(a[0], h(1), None, &[0; 4]);
        p.release(&a);
        p.acquire(&a);
        assert_eq!(p.usage().evictable, 0);
        p.acquire(&a); // a sibling forks the block
        assert_eq!(p.ref_count(a[0]), 2);
        p.release(&a);
        p.release(&a);
        assert_eq!(p.usage().evictable, 1);
        p.check_invariants().unwrap();
    }

    #[test]
    fn duplicate_content_is_not_registered_twice() {
        let mut p = BlockPool::new(2, 4, true);
        let mut a = Vec::new();
        p.try_allocate(2, &mut a).unwrap();
        p.register(a[0], h(5), None, &[0; 4]);
        p.register(a[1], h(5), None, &[0; 4]);
        assert_eq!(p.hash_of(a[1]), None);
        p.release(&a);
        assert_eq!(p.usage().evictable, 1);
        p.check_invariants().unwrap();
    }

    #[test]
    fn caching_disabled_never_hits() {
        let mut p = BlockPool::new(2, 4, false);
        let mut a = Vec::new();
        p.try_allocate(1, &mut a).unwrap();
        p.register(a[0], h(5), None, &[0; 4]);
        p.release(&a);
        let mut hit = Vec::new();
        p.longest_cached_prefix(&[h(5)], &mut hit);
        assert!(hit.is_empty());
        assert_eq!(p.usage().evictable, 0);
    }

    /// Replays `log` onto `set` as a subscriber would.
    fn replay(set: &mut std::collections::BTreeSet<u64>, log: &KvEventLog) {
        use crate::kv_events::*;
        for (i, &k) in log.kinds.iter().enumerate() {
            match k {
                KV_STORED_ROOT | KV_STORED_CHILD => assert!(set.insert(log.hashes[i]), "stored twice"),
                KV_REMOVED => assert!(set.remove(&log.hashes[i]), "removed a hash never stored"),
                KV_ALL_CLEARED => set.clear(),
                _ => unreachable!(),
            }
        }
    }

    #[test]
    fn events_off_record_nothing() {
        let mut p = BlockPool::new(2, 4, true);
        let mut a = Vec::new();
        p.try_allocate(1, &mut a).unwrap();
        p.register(a[0], h(5), None, &[1, 2, 3, 4]);
        assert_eq!(p.take_events(), None);
        let mut q = BlockPool::new(2, 4, false);
        q.record_events();
        assert_eq!(q.take_events(), None, "no prefix cache, no events");
    }

    #[test]
    fn events_follow_store_evict_forget_and_skip_duplicates() {
        use crate::kv_events::*;
        let mut p = BlockPool::new(3, 2, true);
        p.record_events();
        let mut a = Vec::new();
        p.try_allocate(3, &mut a).unwrap();
        p.register(a[0], h(1), None, &[10, 11]);
        p.register(a[1], h(2), Some(h(1)), &[12, 13]);
        p.register(a[2], h(2), Some(h(1)), &[12, 13]); // same content: not cached twice
        p.register(a[0], h(1), None, &[10, 11]); // already registered
        let log = p.take_events().unwrap();
        assert_eq!(log.kinds, vec![KV_ALL_CLEARED, KV_STORED_ROOT, KV_STORED_CHILD]);
        assert_eq!(log.hashes[1..], [h(1).published(), h(2).published()]);
        assert_eq!(log.parents[2], h(1).published());
        assert_eq!(log.tokens, vec![10, 11, 12, 13]);
        assert_eq!(p.take_events(), None, "taken once");
        let mut set = std::collections::BTreeSet::new();
        replay(&mut set, &log);
        p.release(&a);
        // a[2] (never cached) is fresh; the next two allocations evict a[1] then a[0].
        let mut b = Vec::new();
        p.try_allocate(2, &mut b).unwrap();
        p.register(b[1], h(3), None, &[7, 7]);
        p.forget(b[1]);
        let log = p.take_events().unwrap();
        assert_eq!(log.kinds, vec![KV_REMOVED, KV_STORED_ROOT, KV_REMOVED]);
        assert_eq!(log.hashes, vec![h(2).published(), h(3).published(), h(3).published()]);
        replay(&mut set, &log);
        assert_eq!(set.into_iter().collect::<Vec<_>>(), p.cached_hashes());
        assert_eq!(p.cached_hashes(), vec![h(1).published()]);
        p.check_invariants().unwrap();
    }

    #[test]
    fn a_block_without_its_tokens_is_neither_cached_nor_published() {
        use crate::kv_events::*;
        let mut p = BlockPool::new(3, 2, true);
        p.record_events();
        let mut a = Vec::new();
        p.try_allocate(3, &mut a).unwrap();
        p.register(a[0], h(1), None, &[10, 11]);
        p.register(a[1], h(2), Some(h(1)), &[]);
        p.register(a[2], h(3), None, &[14, 15]);
        let log = p.take_events().unwrap();
        assert_eq!(log.kinds, vec![KV_ALL_CLEARED, KV_STORED_ROOT, KV_STORED_ROOT]);
        assert_eq!(log.tokens, vec![10, 11, 14, 15], "each stored event's block where it is expected");
        assert_eq!(p.cached_hashes(), vec![h(1).published(), h(3).published()]);
        p.check_invariants().unwrap();
    }

    #[test]
    fn taking_events_leaves_a_log_sized_like_the_one_taken() {
        let mut p = BlockPool::new(4, 2, true);
        p.record_events();
        let mut a = Vec::new();
        p.try_allocate(4, &mut a).unwrap();
        for (i, &b) in a.iter().enumerate() {
            p.register(b, h(i as u128 + 1), None, &[1, 2]);
        }
        let taken = p.take_events().unwrap();
        let next = p.events.as_ref().unwrap();
        assert!(next.is_empty());
        assert!(next.kinds.capacity() >= taken.kinds.len() && next.hashes.capacity() >= taken.hashes.len());
        assert!(
            next.parents.capacity() >= taken.parents.len() && next.tokens.capacity() >= taken.tokens.len()
        );
    }
}
