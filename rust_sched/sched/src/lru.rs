//! An intrusive doubly linked list over block ids: O(1) push to the back, pop from the
//! front and removal from the middle (a cached block that gets a prefix hit leaves the
//! eviction queue without a scan).

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub struct LruList {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl LruList {
    pub fn new(capacity: usize) -> Self {
        LruList {
            prev: vec![NIL; capacity],
            next: vec![NIL; capacity],
            linked: vec![false; capacity],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `id` as the most recently used entry.
    pub fn push_back(&mut self, id: u32) {
        debug_assert!(!self.linked[id as usize], "block {id} linked twice");
        let i = id as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.linked[i] = true;
        self.len += 1;
    }

    /// Removes and returns the least recently used entry.
    pub fn pop_front(&mut self) -> Option<u32> {
        if self.head == NIL {
            return None;
        }
        let id = self.head;
        self.remove(id);
        Some(id)
    }

    /// Unlinks `id` wherever it is. Returns false when it was not linked.
    pub fn remove(&mut self, id: u32) -> bool {
        let i = id as usize;
        if !self.linked[i] {
            return false;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.linked[i] = false;
        self.len -= 1;
        true
    }

    /// Entries from least to most recently used.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let id = cur;
            cur = self.next[id as usize];
            Some(id)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_order_and_removal() {
        let mut l = LruList::new(8);
        for id in [3, 1, 4, 5] {
            l.push_back(id);
        }
        assert!(l.remove(4));
        assert!(!l.remove(4));
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![3, 1, 5]);
        assert_eq!(l.pop_front(), Some(3));
        l.push_back(3);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![1, 5, 3]);
        assert_eq!(l.len(), 3);
        while l.pop_front().is_some() {}
        assert!(l.is_empty());
    }
}
