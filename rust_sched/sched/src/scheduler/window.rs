//! Sliding windows as block accounting (`kv_groups.rs`): when every layer of the model is
//! windowed, a running sequence's blocks that fall behind the window of the first query
//! a step computes go back to the pool, and a prefix-cache hit needs only the cached
//! blocks that the window before the hit point reaches.
//!
//! Freeing at planning time is safe for the same reason preemption's is: the executor
//! runs plans in order, so a freed block reallocated in this plan is written after every
//! earlier step that read it, and no query of this plan reads it.

use crate::block_pool::{BlockId, NULL_BLOCK};
use crate::kv_groups::blocks_behind;
use crate::request::SeqIndex;

use super::Scheduler;

impl Scheduler {
    /// Hands back the blocks of the running sequence at `seq_index` that no layer reads
    /// for a query at its next position (`computed`). Full blocks are offered to the prefix
    /// cache first, so that they stay findable (evictable) like any other freed block.
    pub(super) fn drop_behind_window(&mut self, seq_index: SeqIndex) {
        let Some(window) = self.window else {
            return;
        };
        let bs = self.config.block_size;
        let seq = self.seqs[seq_index as usize].as_mut().expect("live sequence");
        let from = seq.num_window_freed as usize;
        let to = blocks_behind(seq.computed(), window, bs).min(seq.blocks.len());
        if to <= from {
            return;
        }
        if self.pool.caching_enabled() && !seq.pooling && !seq.kv_failed {
            // Blocks of known tokens only (at depth 2 the newest position may still be
            // sampling); a block behind the window whose token is unknown goes uncached.
            super::tables::register_tables(&mut self.pool, seq, to.min(seq.num_tokens() / bs), bs);
        }
        self.pool.release(&seq.blocks[from..to]);
        seq.blocks[from..to].fill(NULL_BLOCK);
        seq.num_window_freed = to as u32;
        self.counters.window_freed_blocks += (to - from) as u64;
    }

    /// Leading blocks a hit of `k` blocks may skip: those behind the window of its first
    /// computed query (0 without a shared window).
    pub(super) fn hit_skips(&self, k: usize) -> usize {
        let bs = self.config.block_size;
        self.window.map_or(0, |w| blocks_behind(k * bs, w, bs).min(k))
    }

    /// Fills `hit` with the cached blocks of the longest prefix of `hashes` a sequence can
    /// resume from, returning the leading blocks the hit skips (behind the window).
    pub(super) fn cached_prefix(
        &self,
        hashes: &[crate::block_hash::BlockHash],
        hit: &mut Vec<BlockId>,
    ) -> usize {
        if self.window.is_none() {
            self.pool.longest_cached_prefix(hashes, hit);
            return 0;
        }
        self.pool.longest_cached_window(hashes, |k| self.hit_skips(k), hit)
    }
}
