//! The radix prefix cache: a radix tree over token ids whose edges hold the KV pages of those
//! tokens, so a request whose prompt starts like an earlier one reuses its pages instead of
//! recomputing them. Keys are whole pages (a partly filled page stays private to its
//! request). Nodes that running requests use are locked (reference counts up the path to the
//! root); unlocked leaves are evicted least recently used first.

use crate::PagePool;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// A node of the tree (the root is [`RadixCache::ROOT`]).
pub type NodeId = usize;

#[derive(Debug)]
struct Node {
    /// Tokens of the edge into this node (a whole number of pages).
    key: Vec<u32>,
    /// KV pages of those tokens.
    pages: Vec<u32>,
    /// Children by the tokens of their first page.
    children: HashMap<Vec<u32>, NodeId>,
    parent: NodeId,
    /// Requests using this node or a descendant.
    lock: usize,
    last_access: u64,
}

/// The radix cache (see the module docs).
#[derive(Debug)]
pub struct RadixCache {
    page_size: usize,
    nodes: Vec<Option<Node>>,
    free_ids: Vec<NodeId>,
    tick: u64,
    evictable: usize,
    protected: usize,
}

impl RadixCache {
    /// The root: the empty prefix.
    pub const ROOT: NodeId = 0;

    /// An empty tree over pages of `page_size` tokens.
    pub fn new(page_size: usize) -> RadixCache {
        let root = Node { key: vec![], pages: vec![], children: HashMap::new(), parent: 0, lock: 0, last_access: 0 };
        RadixCache { page_size, nodes: vec![Some(root)], free_ids: vec![], tick: 0, evictable: 0, protected: 0 }
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id].as_ref().expect("live node")
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id].as_mut().expect("live node")
    }

    /// Pages held by unlocked nodes (can be evicted).
    pub fn evictable_pages(&self) -> usize {
        self.evictable
    }

    /// Pages held by locked nodes.
    pub fn protected_pages(&self) -> usize {
        self.protected
    }

    /// The longest cached prefix of `tokens` in whole pages: its pages and the node where it
    /// ends (lock it to keep the pages).
    pub fn match_prefix(&mut self, tokens: &[u32]) -> (Vec<u32>, NodeId) {
        let (node, matched, _) = self.walk(tokens, true);
        let mut pages = Vec::with_capacity(matched);
        let mut path = Vec::new();
        let mut n = node;
        while n != Self::ROOT {
            path.push(n);
            n = self.node(n).parent;
        }
        for &n in path.iter().rev() {
            pages.extend_from_slice(&self.node(n).pages);
        }
        debug_assert_eq!(pages.len(), matched);
        (pages, node)
    }

    /// Follows `tokens` (whole pages) down the tree, splitting an edge where the match ends
    /// inside it. Returns the deepest node reached, the pages matched, and the tokens left.
    fn walk<'t>(&mut self, tokens: &'t [u32], touch: bool) -> (NodeId, usize, &'t [u32]) {
        let ps = self.page_size;
        let mut rest = &tokens[..tokens.len() / ps * ps];
        self.tick += 1;
        let (tick, mut node, mut matched) = (self.tick, Self::ROOT, 0);
        while !rest.is_empty() {
            let Some(&child) = self.node(node).children.get(&rest[..ps]) else { break };
            let key = &self.node(child).key;
            let common = key.chunks(ps).zip(rest.chunks(ps)).take_while(|(a, b)| a == b).count();
            let child = if common * ps < key.len() { self.split(child, common) } else { child };
            if touch {
                self.node_mut(child).last_access = tick;
            }
            matched += common;
            rest = &rest[common * ps..];
            node = child;
        }
        (node, matched, rest)
    }

    /// Splits `id`'s edge after `pages` pages; returns the new upper node.
    fn split(&mut self, id: NodeId, pages: usize) -> NodeId {
        let ps = self.page_size;
        let n = self.node_mut(id);
        let key_tail = n.key.split_off(pages * ps);
        let pages_tail = n.pages.split_off(pages);
        let upper_key = std::mem::replace(&mut n.key, key_tail);
        let upper_pages = std::mem::replace(&mut n.pages, pages_tail);
        let (parent, lock, last_access) = (n.parent, n.lock, n.last_access);
        let first = self.node(id).key[..ps].to_vec();
        let upper = Node {
            key: upper_key,
            pages: upper_pages,
            children: HashMap::from([(first, id)]),
            parent,
            lock,
            last_access,
        };
        let up = self.add(upper);
        self.node_mut(id).parent = up;
        let k = self.node(up).key[..ps].to_vec();
        self.node_mut(parent).children.insert(k, up);
        up
    }

    fn add(&mut self, n: Node) -> NodeId {
        match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id] = Some(n);
                id
            }
            None => {
                self.nodes.push(Some(n));
                self.nodes.len() - 1
            }
        }
    }

    /// Inserts `tokens` (whole pages) with their `pages`. Returns how many leading pages the
    /// tree already held: the caller's copies of those are not taken (free the ones that are
    /// not already the tree's own); the rest now belong to the tree.
    pub fn insert(&mut self, tokens: &[u32], pages: &[u32]) -> usize {
        let ps = self.page_size;
        assert_eq!(tokens.len(), pages.len() * ps, "insert takes whole pages");
        let (node, matched, rest) = self.walk(tokens, true);
        if !rest.is_empty() {
            let leaf = Node {
                key: rest.to_vec(),
                pages: pages[matched..].to_vec(),
                children: HashMap::new(),
                parent: node,
                lock: 0,
                last_access: self.tick,
            };
            self.evictable += leaf.pages.len();
            let id = self.add(leaf);
            self.node_mut(node).children.insert(rest[..ps].to_vec(), id);
        }
        matched
    }

    /// Locks `node` and its ancestors (a request uses their pages).
    pub fn lock(&mut self, mut node: NodeId) {
        while node != Self::ROOT {
            let n = self.node_mut(node);
            if n.lock == 0 {
                let p = n.pages.len();
                self.evictable -= p;
                self.protected += p;
            }
            self.node_mut(node).lock += 1;
            node = self.node(node).parent;
        }
    }

    /// Undoes one [`RadixCache::lock`] of `node`.
    pub fn unlock(&mut self, mut node: NodeId) {
        while node != Self::ROOT {
            let n = self.node_mut(node);
            assert!(n.lock > 0, "unlock of an unlocked radix node");
            n.lock -= 1;
            if n.lock == 0 {
                let p = n.pages.len();
                self.evictable += p;
                self.protected -= p;
            }
            node = self.node(node).parent;
        }
    }

    /// Evicts unlocked leaves, least recently used first, until `pages` pages have gone back
    /// to `pool` or nothing is evictable. Returns the pages freed.
    pub fn evict(&mut self, pages: usize, pool: &mut PagePool) -> usize {
        let mut heap: BinaryHeap<Reverse<(u64, NodeId)>> = self
            .live()
            .filter(|&(id, n)| id != Self::ROOT && n.children.is_empty() && n.lock == 0)
            .map(|(id, n)| Reverse((n.last_access, id)))
            .collect();
        let mut freed = 0;
        while freed < pages {
            let Some(Reverse((_, id))) = heap.pop() else { break };
            let n = self.nodes[id].take().expect("live node");
            self.free_ids.push(id);
            pool.free(&n.pages);
            freed += n.pages.len();
            self.evictable -= n.pages.len();
            let ps = self.page_size;
            let parent = self.node_mut(n.parent);
            parent.children.remove(&n.key[..ps]);
            if n.parent != Self::ROOT && parent.children.is_empty() && parent.lock == 0 {
                heap.push(Reverse((parent.last_access, n.parent)));
            }
        }
        freed
    }

    fn live(&self) -> impl Iterator<Item = (NodeId, &Node)> {
        self.nodes.iter().enumerate().filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
    }

    /// Every page the tree holds.
    pub fn pages(&self) -> impl Iterator<Item = u32> + '_ {
        self.live().flat_map(|(_, n)| n.pages.iter().copied())
    }

    /// Checks the tree's structure, its page counters, and that the locks are exactly those
    /// of `held` (one [`RadixCache::lock`] per entry).
    pub fn check(&self, held: &[NodeId]) -> Result<(), String> {
        let mut want = vec![0usize; self.nodes.len()];
        for &h in held {
            let mut n = h;
            while n != Self::ROOT {
                want[n] += 1;
                n = self.nodes.get(n).and_then(Option::as_ref).ok_or(format!("lock held on dead node {n}"))?.parent;
            }
        }
        let (mut evictable, mut protected) = (0, 0);
        for (id, n) in self.live().filter(|&(id, _)| id != Self::ROOT) {
            if n.key.len() != n.pages.len() * self.page_size || n.key.is_empty() {
                return Err(format!("radix node {id}: {} tokens for {} pages", n.key.len(), n.pages.len()));
            }
            if self.node(n.parent).children.get(&n.key[..self.page_size]) != Some(&id) {
                return Err(format!("radix node {id} is not its parent's child"));
            }
            if n.lock != want[id] {
                return Err(format!("radix node {id} has lock {}, but requests hold {}", n.lock, want[id]));
            }
            if n.lock == 0 {
                evictable += n.pages.len();
            } else {
                protected += n.pages.len();
            }
        }
        if (evictable, protected) != (self.evictable, self.protected) {
            return Err(format!(
                "radix counters say {} evictable and {} protected pages, the tree holds {evictable} and {protected}",
                self.evictable, self.protected
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn match_insert_split_lock_evict() {
        let mut pool = PagePool::new(64, 2).unwrap();
        let mut t = RadixCache::new(2);
        let a = pool.alloc(3).unwrap();
        assert_eq!(t.insert(&[1, 2, 3, 4, 5, 6], &a), 0);
        // A match stops at whole pages and splits the edge where it ends.
        let (p, n) = t.match_prefix(&[1, 2, 3, 4, 9, 9, 9]);
        assert_eq!(p, a[..2]);
        t.lock(n);
        assert_eq!((t.evictable_pages(), t.protected_pages()), (1, 2));
        let b = pool.alloc(2).unwrap();
        assert_eq!(t.insert(&[1, 2, 3, 4, 7, 8, 9, 10], &[a[0], a[1], b[0], b[1]]), 2);
        t.check(&[n]).unwrap();
        // Only unlocked leaves go: [5, 6] and [7, 8, 9, 10].
        let before = pool.available();
        assert_eq!(t.evict(100, &mut pool), 3);
        assert_eq!(pool.available(), before + 3);
        assert_eq!(t.match_prefix(&[1, 2, 3, 4, 5, 6]).0, a[..2]);
        t.unlock(n);
        t.check(&[]).unwrap();
        assert_eq!(t.evict(100, &mut pool), 2);
        assert_eq!(pool.available(), 32);
        assert!(t.match_prefix(&[1, 2]).0.is_empty());
    }

    #[test]
    fn lru_order() {
        let mut pool = PagePool::new(16, 1).unwrap();
        let mut t = RadixCache::new(1);
        let (a, b) = (pool.alloc(2).unwrap(), pool.alloc(2).unwrap());
        t.insert(&[1, 2], &a);
        t.insert(&[3, 4], &b);
        t.match_prefix(&[1, 2]);
        assert_eq!(t.evict(1, &mut pool), 2);
        assert_eq!(t.match_prefix(&[3, 4]).0, Vec::<u32>::new());
        assert_eq!(t.match_prefix(&[1, 2]).0, a);
    }
}
