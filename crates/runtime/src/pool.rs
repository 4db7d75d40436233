//! The KV page allocator: the pool's token slots in pages of `page_size` consecutive slots.
//! Position `p` of a sequence with pages `P` lives in slot `P[p / page_size] * page_size +
//! p % page_size`.

use crate::RuntimeError;

/// Free pages of the KV pool.
#[derive(Debug, Clone)]
pub struct PagePool {
    page_size: usize,
    pages: usize,
    free: Vec<u32>,
}

impl PagePool {
    /// A pool of `slots / page_size` pages, all free.
    pub fn new(slots: usize, page_size: usize) -> Result<PagePool, RuntimeError> {
        if page_size == 0 || slots < page_size || slots / page_size > u32::MAX as usize / page_size {
            return Err(RuntimeError::Invalid(format!(
                "a KV pool of {slots} token slots cannot be split into pages of {page_size}"
            )));
        }
        let pages = slots / page_size;
        Ok(PagePool { page_size, pages, free: (0..pages as u32).rev().collect() })
    }

    /// Token slots per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages in the pool.
    pub fn total(&self) -> usize {
        self.pages
    }

    /// Free pages.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// The free pages (for integrity checks).
    pub fn free_pages(&self) -> &[u32] {
        &self.free
    }

    /// Takes `n` pages, or none if fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        let at = self.free.len().checked_sub(n)?;
        Some(self.free.split_off(at).into_iter().rev().collect())
    }

    /// Returns pages to the pool.
    pub fn free(&mut self, pages: &[u32]) {
        debug_assert!(pages.iter().all(|&p| (p as usize) < self.pages));
        self.free.extend(pages.iter().rev());
    }

    /// Pages needed to hold `positions` positions.
    pub fn pages_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.page_size)
    }

    /// The slots of positions `0..n` of a sequence holding `pages`.
    pub fn slots(&self, pages: &[u32], n: usize) -> Vec<u32> {
        let ps = self.page_size;
        (0..n).map(|p| pages[p / ps] * ps as u32 + (p % ps) as u32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_and_slots() {
        let mut p = PagePool::new(40, 4).unwrap();
        assert_eq!(p.total(), 10);
        let a = p.alloc(3).unwrap();
        assert_eq!(a, [0, 1, 2]);
        assert_eq!(p.slots(&[2, 0], 6), [8, 9, 10, 11, 0, 1]);
        assert!(p.alloc(8).is_none());
        p.free(&a);
        assert_eq!(p.available(), 10);
        assert_eq!(p.pages_for(9), 3);
        assert!(PagePool::new(3, 4).is_err() && PagePool::new(8, 0).is_err());
    }
}
