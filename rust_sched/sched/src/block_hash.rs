//! Content identity of a full KV block, chained over the blocks before it.

use xxhash_rust::xxh3::Xxh3;

/// 128-bit identity of a full block: its token ids, every token before it (through the
/// previous block's hash) and the request's cache salt. 128 bits make an accidental
/// collision (which would silently reuse the wrong KV) negligible.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// Hash of the block holding `tokens`, following the block whose hash is `prev`
    /// (`None` for a sequence's first block, where `salt` enters instead).
    pub fn chain(prev: Option<BlockHash>, tokens: &[u32], salt: Option<&str>) -> BlockHash {
        let mut hasher = Xxh3::new();
        match prev {
            Some(BlockHash(p)) => {
                hasher.update(&[1u8]);
                hasher.update(&p.to_le_bytes());
            }
            None => {
                hasher.update(&[0u8]);
                if let Some(salt) = salt {
                    hasher.update(&(salt.len() as u64).to_le_bytes());
                    hasher.update(salt.as_bytes());
                }
            }
        }
        for &t in tokens {
            hasher.update(&t.to_le_bytes());
        }
        BlockHash(hasher.digest128())
    }

    /// The identity of the same block in a hybrid model's block table `table`
    /// (`kv_groups::TableLayout`): table 0 keeps the chain's hash; another table's block
    /// holds other layers' KV for the same tokens, so it is cached under its own key.
    pub fn for_table(self, table: usize) -> BlockHash {
        if table == 0 {
            return self;
        }
        let mut hasher = Xxh3::new();
        hasher.update(&[2u8, table as u8]);
        hasher.update(&self.0.to_le_bytes());
        BlockHash(hasher.digest128())
    }

    /// The hash KV-cache events publish: the low 64 bits of the 128-bit digest (msgpack,
    /// and the routers that read vLLM's events, take 64-bit integers). Reproducible across
    /// processes and runs: XXH3 with its default seed, over the bytes `chain` documents.
    pub fn published(self) -> u64 {
        self.0 as u64
    }
}

/// Extends `hashes` with the hashes of every full block of `tokens` not hashed yet.
pub fn extend_block_hashes(
    hashes: &mut Vec<BlockHash>,
    tokens: &[u32],
    block_size: usize,
    salt: Option<&str>,
) {
    let full = tokens.len() / block_size;
    while hashes.len() < full {
        let i = hashes.len();
        let chunk = &tokens[i * block_size..(i + 1) * block_size];
        let prev = hashes.last().copied();
        hashes.push(BlockHash::chain(prev, chunk, salt));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_prefix_tokens_and_salt() {
        let a = BlockHash::chain(None, &[1, 2, 3], None);
        assert_eq!(a, BlockHash::chain(None, &[1, 2, 3], None));
        assert_ne!(a, BlockHash::chain(None, &[1, 2, 4], None));
        assert_ne!(a, BlockHash::chain(None, &[1, 2, 3], Some("tenant")));
        let b1 = BlockHash::chain(Some(a), &[7, 8, 9], None);
        let b2 = BlockHash::chain(Some(BlockHash::chain(None, &[0, 2, 3], None)), &[7, 8, 9], None);
        assert_ne!(b1, b2, "same block after a different prefix must differ");
    }

    /// Pins the algorithm: routers and `docs/kv_events.md` rely on these exact values
    /// (no per-process seed), so a change to `chain` must be deliberate.
    #[test]
    fn published_hashes_are_pinned() {
        let a = BlockHash::chain(None, &[1, 2, 3, 4], None);
        let b = BlockHash::chain(Some(a), &[5, 6, 7, 8], None);
        let salted = BlockHash::chain(None, &[1, 2, 3, 4], Some("tenant"));
        assert_eq!(
            [a.published(), b.published(), salted.published()],
            [0x6c77_fcbd_4160_dde3, 0x6295_06a5_1789_5b32, 0x19f5_4ca1_b92d_ceab],
            "got {:#x} {:#x} {:#x}",
            a.published(),
            b.published(),
            salted.published()
        );
    }

    #[test]
    fn extend_hashes_only_full_blocks() {
        let mut h = Vec::new();
        extend_block_hashes(&mut h, &[1, 2, 3, 4, 5], 2, None);
        assert_eq!(h.len(), 2);
        let before = h.clone();
        extend_block_hashes(&mut h, &[1, 2, 3, 4, 5, 6], 2, None);
        assert_eq!(h.len(), 3);
        assert_eq!(&h[..2], &before[..]);
    }
}
