//! Per-group block tables for hybrid models (`kv_groups::table_layout`): table 0 is a
//! full table and lives in `Sequence::blocks` as the one shared table does; the other
//! tables live in `Sequence::extra`, each as long as table 0. Every table grows by the
//! same blocks per step from the one pool; a windowed table hands back the blocks behind
//! its window while the sequence runs (its entries become null); a full table keeps them.
//!
//! Prefix caching per table: a block of table `t` is cached under its chain hash made
//! distinct per table (`BlockHash::for_table`), so a hit for a full table needs every
//! block before the hit point and a windowed table only those its window reaches; a hit
//! is the longest prefix every table agrees on. Freeing behind the window at planning
//! time is safe for the reason `window.rs` gives.

use crate::block_hash::BlockHash;
use crate::block_pool::{BlockId, BlockPool, NULL_BLOCK};
use crate::kv_groups::blocks_behind;
use crate::plan::StepPlan;
use crate::request::{GroupTable, SeqIndex, Sequence};

use super::Scheduler;

/// One extra table's share of a prefix hit: the leading entries it skips (behind its
/// window) and the cached blocks after them.
#[derive(Debug, Default, Clone)]
pub(super) struct TableHit {
    pub skipped: usize,
    pub blocks: Vec<BlockId>,
}

/// Leading blocks of a table with `window` that a query at `pos` no longer reads.
fn behind(window: Option<usize>, pos: usize, bs: usize) -> usize {
    window.map_or(0, |w| blocks_behind(pos, w, bs))
}

impl Scheduler {
    /// Block tables per sequence (1: one shared table).
    pub(super) fn num_tables(&self) -> usize {
        1 + self.extra_windows.len()
    }

    /// Hands back the blocks of the extra tables that their windows have passed for the
    /// sequence's next query. Full blocks of known tokens are offered to the prefix cache
    /// first, in every table (so that the tables stay registered together).
    pub(super) fn drop_behind_tables(&mut self, seq_index: SeqIndex) {
        if self.extra_windows.is_empty() {
            return;
        }
        let bs = self.config.block_size;
        let seq = self.seqs[seq_index as usize].as_mut().expect("live sequence");
        let computed = seq.computed();
        let due = self
            .extra_windows
            .iter()
            .zip(&seq.extra)
            .any(|(&w, t)| behind(w, computed, bs).min(t.blocks.len()) > t.freed as usize);
        if !due {
            return;
        }
        if self.pool.caching_enabled() && !seq.pooling && !seq.kv_failed {
            let full = seq.num_tokens().min(computed) / bs;
            register_tables(&mut self.pool, seq, full, bs);
        }
        for (&w, table) in self.extra_windows.iter().zip(seq.extra.iter_mut()) {
            let from = table.freed as usize;
            let to = behind(w, computed, bs).min(table.blocks.len());
            if to > from {
                self.pool.release(&table.blocks[from..to]);
                table.blocks[from..to].fill(NULL_BLOCK);
                table.freed = to as u32;
                self.counters.window_freed_blocks += (to - from) as u64;
            }
        }
    }

    /// Grows every extra table by `need` blocks (table 0 grew already; the blocks are
    /// checked free) and records the table writes.
    pub(super) fn grow_tables(&mut self, seq_index: SeqIndex, need: usize, plan: &mut StepPlan) {
        if need == 0 || self.extra_windows.is_empty() {
            return;
        }
        let seq = self.seqs[seq_index as usize].as_mut().unwrap();
        let row = seq.row().expect("running sequence has a row") as i32;
        for (t, table) in seq.extra.iter_mut().enumerate() {
            let start = table.blocks.len();
            self.pool.allocate(need, &mut table.blocks);
            for (col, &b) in table.blocks.iter().enumerate().skip(start) {
                push_write(plan, t + 1, row, col, b);
            }
        }
    }

    /// The longest prefix of `hashes` (table 0's chain) every table can resume from:
    /// fills `hit` with table 0's blocks and `extra_hits` with each extra table's, and
    /// returns the hit in blocks.
    pub(super) fn tables_cached_prefix(
        &self,
        hashes: &[BlockHash],
        hit: &mut Vec<BlockId>,
        extra_hits: &mut [TableHit],
    ) -> usize {
        hit.clear();
        for h in extra_hits.iter_mut() {
            h.skipped = 0;
            h.blocks.clear();
        }
        if !self.pool.caching_enabled() {
            return 0;
        }
        let bs = self.config.block_size;
        let full_tables: Vec<usize> =
            (0..self.extra_windows.len()).filter(|&t| self.extra_windows[t].is_none()).collect();
        // Full tables need every block from the start.
        let mut k = hashes
            .iter()
            .position(|h| {
                !self.pool.is_cached(h)
                    || full_tables.iter().any(|&t| !self.pool.is_cached(&h.for_table(t + 1)))
            })
            .unwrap_or(hashes.len());
        // Windowed tables need the blocks their window reaches from the hit point: a
        // missing one at `i` rules out every hit past it (the windows only move right).
        'shrink: loop {
            for (t, &w) in self.extra_windows.iter().enumerate() {
                let Some(w) = w else {
                    continue;
                };
                let skip = blocks_behind(k * bs, w, bs).min(k);
                if let Some(i) = (skip..k).rev().find(|&i| !self.pool.is_cached(&hashes[i].for_table(t + 1)))
                {
                    k = i;
                    continue 'shrink;
                }
            }
            break;
        }
        hit.extend(hashes[..k].iter().map(|h| self.pool.cached_block(h).expect("checked cached")));
        for (t, (&w, out)) in self.extra_windows.iter().zip(extra_hits.iter_mut()).enumerate() {
            out.skipped = behind(w, k * bs, bs).min(k);
            out.blocks.extend(
                hashes[out.skipped..k]
                    .iter()
                    .map(|h| self.pool.cached_block(&h.for_table(t + 1)).expect("checked cached")),
            );
        }
        k
    }

    /// A forked sample's share of its running first sibling's extra tables for a hit of
    /// `shared` blocks, or false when a windowed table of the sibling no longer holds
    /// what the sample's window reaches.
    pub(super) fn tables_fork_share(
        &self,
        parent: &Sequence,
        shared: usize,
        extra_hits: &mut [TableHit],
    ) -> bool {
        let bs = self.config.block_size;
        for ((&w, table), out) in self.extra_windows.iter().zip(&parent.extra).zip(extra_hits.iter_mut()) {
            let skip = behind(w, shared * bs, bs).min(shared);
            if table.freed as usize > skip {
                for h in extra_hits.iter_mut() {
                    h.skipped = 0;
                    h.blocks.clear();
                }
                return false;
            }
            out.skipped = skip;
            out.blocks.clear();
            out.blocks.extend_from_slice(&table.blocks[skip..shared]);
        }
        true
    }

    /// Installs an admitted sequence's extra tables from its hit (acquired already).
    pub(super) fn install_tables(&mut self, seq_index: SeqIndex, extra_hits: &[TableHit]) {
        if self.extra_windows.is_empty() {
            return;
        }
        let seq = self.seqs[seq_index as usize].as_mut().unwrap();
        seq.extra.clear();
        seq.extra.extend(extra_hits.iter().map(|h| {
            let mut blocks = vec![NULL_BLOCK; h.skipped];
            blocks.extend_from_slice(&h.blocks);
            GroupTable { blocks, freed: h.skipped as u32 }
        }));
    }
}

/// Records `block_table[table][row, col] = block` in the plan (the table index only with
/// more than one table: `block_table_groups` stays empty otherwise).
pub(super) fn push_write(plan: &mut StepPlan, table: usize, row: i32, col: usize, block: BlockId) {
    plan.block_table_rows.push(row);
    plan.block_table_cols.push(col as i32);
    plan.block_table_ids.push(block as i32);
    plan.block_table_groups.push(table as i32);
}

/// Offers the prefix cache the full blocks `num_registered..full` of every table (table 0
/// published, the others quiet); null entries are skipped.
pub(super) fn register_tables(pool: &mut BlockPool, seq: &mut Sequence, full: usize, bs: usize) {
    let full = full.min(seq.blocks.len());
    if full <= seq.num_registered as usize {
        return;
    }
    seq.update_hashes(bs);
    for i in seq.num_registered as usize..full {
        if seq.blocks[i] != NULL_BLOCK {
            let (tokens, parent) = seq.hashed_block(i, bs);
            pool.register(seq.blocks[i], seq.hashes[i], parent, tokens);
        }
        for (t, table) in seq.extra.iter().enumerate() {
            if table.blocks[i] != NULL_BLOCK {
                pool.register_quiet(table.blocks[i], seq.hashes[i].for_table(t + 1));
            }
        }
    }
    seq.num_registered = full as u32;
}

/// Hands back every block an extra table holds and empties the tables.
pub(super) fn release_tables(pool: &mut BlockPool, seq: &mut Sequence) {
    for table in seq.extra.drain(..) {
        pool.release(&table.blocks[table.freed as usize..]);
    }
}
