//! KV groups: the model's layers grouped by what their attention needs of the KV cache.
//!
//! A full-attention layer reads every position before the query; a layer with a sliding
//! window of `W` tokens reads only positions `p - W < j <= p` for a query at `p`. The
//! executor tells the scheduler the groups once, at engine start ([`SchedulerConfig`]'s
//! `kv_groups`). The scheduler keeps one block table per sequence, shared by all groups:
//! when every group is windowed, a block that has fallen behind the widest window of
//! the earliest query a step computes is read by no layer again, so it goes back to the
//! pool while the sequence runs (its table entry becomes [`NULL_BLOCK`]). When any group
//! attends to the whole context (a hybrid model such as Gemma 2/3, or Qwen2 with
//! `max_window_layers`), that group needs every block: with one shared table nothing is
//! freed early.
//!
//! **Per-group tables** (hybrid models, when the executor asks for them with
//! `SchedulerConfig::group_tables`): the layers are split into *tables* of (at most)
//! `layers_per_table` layers ([`table_layout`]), each with its own block table per sequence, all drawing
//! from one pool and one id space. A block id then holds the KV of one table's layers
//! (cache tensor `j` serves layer `j` of whichever table owns the block), so a block a
//! windowed table frees serves a full table next. A full table allocates as the shared
//! table does; a windowed table frees the blocks behind its window while the sequence
//! runs (`scheduler/tables.rs`).
//!
//! [`SchedulerConfig`]: crate::config::SchedulerConfig
//! [`NULL_BLOCK`]: crate::block_pool::NULL_BLOCK

use crate::error::{SchedError, SchedResult};

/// Layers that share one attention need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGroup {
    /// Sliding window in tokens; None: the layers see the whole context.
    pub window: Option<usize>,
    pub num_layers: usize,
}

impl KvGroup {
    pub fn full(num_layers: usize) -> Self {
        KvGroup { window: None, num_layers }
    }

    pub fn windowed(window: usize, num_layers: usize) -> Self {
        KvGroup { window: Some(window), num_layers }
    }
}

/// Checks the groups an engine reports; the message names what is wrong.
pub fn validate(groups: &[KvGroup]) -> SchedResult<()> {
    for g in groups {
        if g.num_layers == 0 {
            return Err(SchedError::InvalidConfig("a KV group must have at least one layer".into()));
        }
        if g.window == Some(0) {
            return Err(SchedError::InvalidConfig(
                "a KV group's sliding window must be at least 1 token".into(),
            ));
        }
        if g.window.is_some_and(|w| w > i32::MAX as usize) {
            return Err(SchedError::InvalidConfig("a KV group's sliding window must fit in int32".into()));
        }
    }
    Ok(())
}

/// The window behind which every layer is done with a sequence's blocks: the widest
/// window when every group is windowed; None when any group (or, with no groups given,
/// the model as a whole) attends to the whole context.
pub fn shared_window(groups: &[KvGroup]) -> Option<usize> {
    if groups.is_empty() {
        return None;
    }
    groups.iter().map(|g| g.window).try_fold(0, |widest, w| w.map(|w| widest.max(w)))
}

/// Most tables a hybrid model is split into; beyond it (27 windowed layers and 1 full:
/// 28 tables of one layer) the model keeps one shared table: per-table work grows with
/// the tables.
pub const MAX_KV_TABLES: usize = 8;

/// How a hybrid model's layers map onto per-group block tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableLayout {
    /// Layers per table: the layers one block id holds the KV of. The greatest common
    /// divisor of the groups' layer counts when that gives at most [`MAX_KV_TABLES`]
    /// tables (every table full); else the smallest group's count, a larger group's last
    /// table then holding fewer layers (its blocks keep room for the layers it lacks:
    /// Gemma 3 1B's 4 full and 22 sliding layers are 7 tables of 4, the last with 2).
    pub layers_per_table: usize,
    /// Window of each table (None: full attention). Full tables come first, in group
    /// order, then the windowed ones in group order; group `g` contributes
    /// `ceil(num_layers / layers_per_table)` consecutive tables, its layers in order,
    /// chunked.
    pub windows: Vec<Option<usize>>,
    /// The group each table's layers come from (an index into the groups given).
    pub groups: Vec<usize>,
}

impl TableLayout {
    pub fn num_tables(&self) -> usize {
        self.windows.len()
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The per-group tables of a hybrid model: Some when at least one group is full and one
/// windowed, and the split gives at most [`MAX_KV_TABLES`] tables; None otherwise (one
/// shared table, freed behind [`shared_window`] when every group is windowed).
pub fn table_layout(groups: &[KvGroup]) -> Option<TableLayout> {
    let any_full = groups.iter().any(|g| g.window.is_none());
    let any_windowed = groups.iter().any(|g| g.window.is_some());
    if !(any_full && any_windowed) {
        return None;
    }
    let tables_for = |per: usize| groups.iter().map(|g| g.num_layers.div_ceil(per)).sum::<usize>();
    let exact = groups.iter().fold(0, |acc, g| gcd(acc, g.num_layers));
    let smallest = groups.iter().map(|g| g.num_layers).min().unwrap_or(0);
    let per = if exact > 0 && tables_for(exact) <= MAX_KV_TABLES { exact } else { smallest };
    if per == 0 || tables_for(per) > MAX_KV_TABLES {
        return None;
    }
    let total = tables_for(per);
    let mut windows = Vec::with_capacity(total);
    let mut owners = Vec::with_capacity(total);
    for full_first in [true, false] {
        for (i, g) in groups.iter().enumerate() {
            if g.window.is_none() == full_first {
                windows.extend(std::iter::repeat_n(g.window, g.num_layers.div_ceil(per)));
                owners.extend(std::iter::repeat_n(i, g.num_layers.div_ceil(per)));
            }
        }
    }
    Some(TableLayout { layers_per_table: per, windows, groups: owners })
}

/// Leading blocks no layer reads for a query at `pos` under `window`: they hold only
/// positions `<= pos - window`.
#[inline]
pub fn blocks_behind(pos: usize, window: usize, block_size: usize) -> usize {
    (pos + 1).saturating_sub(window) / block_size
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_window_is_the_widest_only_when_every_group_is_windowed() {
        assert_eq!(shared_window(&[]), None);
        assert_eq!(shared_window(&[KvGroup::windowed(8, 2)]), Some(8));
        assert_eq!(shared_window(&[KvGroup::windowed(8, 2), KvGroup::windowed(32, 1)]), Some(32));
        assert_eq!(shared_window(&[KvGroup::windowed(8, 2), KvGroup::full(1)]), None);
    }

    #[test]
    fn blocks_behind_keeps_the_block_of_the_window_start() {
        // window 4, blocks of 2: a query at 5 reads 2..=5, so block 0 (0, 1) is behind.
        assert_eq!(blocks_behind(5, 4, 2), 1);
        assert_eq!(blocks_behind(6, 4, 2), 1); // reads 3..=6: block 1 holds 3
        assert_eq!(blocks_behind(7, 4, 2), 2);
        assert_eq!(blocks_behind(2, 4, 2), 0);
        assert_eq!(blocks_behind(9, 1, 2), 4); // only itself: blocks 0..4 hold 0..=7
    }

    #[test]
    fn hybrid_models_split_into_equal_tables_full_ones_first() {
        // Gemma 2: alternating; Gemma 3: 5 local to 1 global.
        let gemma2 = table_layout(&[KvGroup::windowed(4096, 13), KvGroup::full(13)]).unwrap();
        assert_eq!((gemma2.layers_per_table, gemma2.windows.clone()), (13, vec![None, Some(4096)]));
        assert_eq!(gemma2.groups, vec![1, 0]);
        let gemma3 = table_layout(&[KvGroup::windowed(512, 30), KvGroup::full(6)]).unwrap();
        assert_eq!(gemma3.layers_per_table, 6);
        assert_eq!(gemma3.windows, [vec![None], vec![Some(512); 5]].concat());
        // Qwen2 with max_window_layers 21 of 28: 3 full tables of 7 and one windowed.
        let qwen = table_layout(&[KvGroup::full(21), KvGroup::windowed(4096, 7)]).unwrap();
        assert_eq!(qwen.windows, vec![None, None, None, Some(4096)]);
        // Gemma 3 1B (4 full, 22 sliding): equal tables would be 13 of 2 layers; 7 of 4
        // instead, the last sliding one with 2. Gemma 3 27B (10 full, 52 sliding): 7 of 10.
        let gemma3_1b = table_layout(&[KvGroup::windowed(512, 22), KvGroup::full(4)]).unwrap();
        assert_eq!(gemma3_1b.layers_per_table, 4);
        assert_eq!(gemma3_1b.windows, [vec![None], vec![Some(512); 6]].concat());
        let gemma3_27b = table_layout(&[KvGroup::windowed(1024, 52), KvGroup::full(10)]).unwrap();
        assert_eq!((gemma3_27b.layers_per_table, gemma3_27b.num_tables()), (10, 7));
        // Too many tables, a model with no full group, or none windowed: one shared table.
        assert_eq!(table_layout(&[KvGroup::windowed(8, 27), KvGroup::full(1)]), None);
        assert_eq!(table_layout(&[KvGroup::windowed(8, 2), KvGroup::windowed(16, 2)]), None);
        assert_eq!(table_layout(&[KvGroup::full(4)]), None);
        assert_eq!(table_layout(&[]), None);
    }

    #[test]
    fn bad_groups_are_refused() {
        assert!(validate(&[KvGroup::windowed(0, 1)]).is_err());
        assert!(validate(&[KvGroup::full(0)]).is_err());
        assert!(validate(&[KvGroup::full(3), KvGroup::windowed(4096, 1)]).is_ok());
    }
}
