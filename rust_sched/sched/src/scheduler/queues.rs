//! The waiting queue, the running list and the persistent-batch row allocator.

use std::collections::BTreeMap;

use crate::request::SeqIndex;

/// Admission / preemption rank: lower runs first. Under `fcfs` the priority part is 0, so
/// the order is arrival order; a preempted sequence keeps its arrival and so goes back
/// ahead of everything that arrived after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rank {
    pub priority: i64,
    pub arrival: u64,
    pub seq_id: u64,
}

/// Waiting sequences (their indices in the scheduler's slab) by rank.
#[derive(Debug, Default)]
pub struct WaitingQueue {
    by_rank: BTreeMap<Rank, SeqIndex>,
}

impl WaitingQueue {
    pub fn insert(&mut self, rank: Rank, seq_index: SeqIndex) {
        self.by_rank.insert(rank, seq_index);
    }

    pub fn remove(&mut self, rank: &Rank) -> Option<SeqIndex> {
        self.by_rank.remove(rank)
    }

    pub fn first(&self) -> Option<(Rank, SeqIndex)> {
        self.by_rank.first_key_value().map(|(r, s)| (*r, *s))
    }

    pub fn len(&self) -> usize {
        self.by_rank.len()
    }

    pub fn seq_indices(&self) -> impl Iterator<Item = SeqIndex> + '_ {
        self.by_rank.values().copied()
    }
}

/// Running sequences kept sorted by rank, so that the step visits the most important first
/// and the preemption victim is always the last entry.
#[derive(Debug, Default)]
pub struct RunningList {
    entries: Vec<(Rank, SeqIndex)>,
}

impl RunningList {
    pub fn insert(&mut self, rank: Rank, seq_index: SeqIndex) {
        let at = self.entries.partition_point(|(r, _)| *r < rank);
        self.entries.insert(at, (rank, seq_index));
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn get(&self, i: usize) -> (Rank, SeqIndex) {
        self.entries[i]
    }

    pub fn remove_at(&mut self, i: usize) -> (Rank, SeqIndex) {
        self.entries.remove(i)
    }

    pub fn remove(&mut self, rank: &Rank) -> bool {
        match self.entries.binary_search_by(|(r, _)| r.cmp(rank)) {
            Ok(i) => {
                self.entries.remove(i);
                true
            }
            Err(_) => false,
        }
    }

    pub fn seq_indices(&self) -> impl Iterator<Item = SeqIndex> + '_ {
        self.entries.iter().map(|(_, s)| *s)
    }
}

/// Rows of the executor's persistent batch; the lowest free row is handed out first.
#[derive(Debug)]
pub struct RowAllocator {
    free: Vec<u32>,
    capacity: usize,
}

impl RowAllocator {
    pub fn new(capacity: usize) -> Self {
        RowAllocator { free: (0..capacity as u32).rev().collect(), capacity }
    }

    pub fn take(&mut self) -> Option<u32> {
        self.free.pop()
    }

    pub fn give_back(&mut self, row: u32) {
        debug_assert!(!self.free.contains(&row), "row {row} freed twice");
        self.free.push(row);
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(p: i64, a: u64) -> Rank {
        Rank { priority: p, arrival: a, seq_id: a }
    }

    #[test]
    fn running_list_stays_sorted() {
        let mut l = RunningList::default();
        l.insert(rank(0, 5), 5);
        l.insert(rank(0, 1), 1);
        l.insert(rank(-1, 9), 9);
        assert_eq!(l.seq_indices().collect::<Vec<_>>(), vec![9, 1, 5]);
        assert!(l.remove(&rank(0, 1)));
        assert!(!l.remove(&rank(0, 1)));
        assert_eq!(l.seq_indices().collect::<Vec<_>>(), vec![9, 5]);
    }

    #[test]
    fn waiting_queue_orders_by_rank() {
        let mut q = WaitingQueue::default();
        q.insert(rank(1, 0), 0);
        q.insert(rank(0, 3), 3);
        assert_eq!(q.first().unwrap().1, 3);
    }
}
