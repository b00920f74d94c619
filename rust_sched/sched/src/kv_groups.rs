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
//! `max_window_layers`), that group needs every block and nothing is freed early.
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
    fn bad_groups_are_refused() {
        assert!(validate(&[KvGroup::windowed(0, 1)]).is_err());
        assert!(validate(&[KvGroup::full(0)]).is_err());
        assert!(validate(&[KvGroup::full(3), KvGroup::windowed(4096, 1)]).is_ok());
    }
}
