//! The prefix cache's changes, recorded for routers that track which blocks each replica
//! holds (vLLM's KV-cache events: `docs/kv_events.md`).
//!
//! The block pool appends to a [`KvEventLog`] as blocks enter and leave the prefix cache,
//! on the scheduler thread, into flat vectors; the scheduler moves the log into the next
//! output event (its vectors go to Python) and the pool starts a new one sized to the log
//! it gave away ([`KvEventLog::sized_like`]), so a step allocates each vector once rather
//! than per event while it grows. The events cross to Python on the channel that already
//! carries each step's tokens, in the order they happened. With events off the pool holds no log and records nothing.

use crate::block_hash::BlockHash;

/// A block entered the prefix cache as the first block of its sequence (no parent).
pub const KV_STORED_ROOT: u8 = 0;
/// A block entered the prefix cache after the block whose hash is in `parents`.
pub const KV_STORED_CHILD: u8 = 1;
/// A cached block left the prefix cache (evicted for reuse, or its content distrusted).
pub const KV_REMOVED: u8 = 2;
/// Every cached block left the prefix cache at once.
pub const KV_ALL_CLEARED: u8 = 3;

/// Events in the order they happened. Entry `i` is `kinds[i]`, with `hashes[i]` (the
/// published hash, [`BlockHash::published`]; 0 for [`KV_ALL_CLEARED`]) and `parents[i]`
/// (meaningful for [`KV_STORED_CHILD`] only). Each stored event (root or child) owns the
/// next `block_size` entries of `tokens`, in event order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvEventLog {
    pub kinds: Vec<u8>,
    pub hashes: Vec<u64>,
    pub parents: Vec<u64>,
    pub tokens: Vec<u32>,
}

impl KvEventLog {
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// An empty log with room for as many events (and tokens) as `other` holds: the next
    /// step's, which is likely about as busy.
    pub fn sized_like(other: &KvEventLog) -> KvEventLog {
        KvEventLog {
            kinds: Vec::with_capacity(other.kinds.len()),
            hashes: Vec::with_capacity(other.hashes.len()),
            parents: Vec::with_capacity(other.parents.len()),
            tokens: Vec::with_capacity(other.tokens.len()),
        }
    }

    pub fn stored(&mut self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[u32]) {
        self.kinds.push(if parent.is_some() { KV_STORED_CHILD } else { KV_STORED_ROOT });
        self.hashes.push(hash.published());
        self.parents.push(parent.map_or(0, BlockHash::published));
        self.tokens.extend_from_slice(tokens);
    }

    pub fn removed(&mut self, hash: BlockHash) {
        self.kinds.push(KV_REMOVED);
        self.hashes.push(hash.published());
        self.parents.push(0);
    }

    pub fn all_cleared(&mut self) {
        self.kinds.push(KV_ALL_CLEARED);
        self.hashes.push(0);
        self.parents.push(0);
    }
}
