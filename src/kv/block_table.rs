//! Per-sequence mapping from logical page index to physical page.

use crate::error::{DetspecError, Result};

use super::{PageAllocator, PageId};

/// The pages one sequence's KV lives in, in logical order.
#[derive(Debug, Clone, Default)]
pub struct BlockTable {
    pages: Vec<PageId>,
}

impl BlockTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Physical pages in logical order.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    /// Tokens the current pages can hold.
    pub fn capacity(&self, page_size: usize) -> usize {
        self.pages.len() * page_size
    }

    /// Pages needed beyond the current ones to hold `num_tokens` tokens.
    pub fn pages_needed(&self, num_tokens: usize, page_size: usize) -> usize {
        num_tokens.div_ceil(page_size).saturating_sub(self.pages.len())
    }

    /// Grows the table so it can hold `num_tokens` tokens. All or nothing: on failure the pages
    /// taken by this call are returned and the table is unchanged.
    pub fn reserve(&mut self, num_tokens: usize, page_size: usize, alloc: &dyn PageAllocator) -> Result<()> {
        let needed = self.pages_needed(num_tokens, page_size);
        let before = self.pages.len();
        for _ in 0..needed {
            match alloc.allocate() {
                Some(p) => self.pages.push(p),
                None => {
                    for p in self.pages.drain(before..) {
                        alloc.release(p);
                    }
                    return Err(DetspecError::OutOfPages {
                        needed,
                        free: alloc.num_free(),
                        total: alloc.num_total(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Flat cache slot of absolute position `pos`; `None` if no page holds it yet.
    pub fn slot(&self, pos: usize, page_size: usize) -> Option<u32> {
        let page = *self.pages.get(pos / page_size)?;
        Some(page * page_size as u32 + (pos % page_size) as u32)
    }

    /// Keeps only the pages needed for the first `num_tokens` tokens, releasing the rest.
    pub fn truncate(&mut self, num_tokens: usize, page_size: usize, alloc: &dyn PageAllocator) {
        let keep = num_tokens.div_ceil(page_size);
        for p in self.pages.drain(keep.min(self.pages.len())..) {
            alloc.release(p);
        }
    }

    /// Releases every page.
    pub fn free(&mut self, alloc: &dyn PageAllocator) {
        self.truncate(0, 1, alloc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::SimpleAllocator;

    #[test]
    fn reserve_slot_truncate_free() {
        let a = SimpleAllocator::new(3);
        let mut bt = BlockTable::new();
        bt.reserve(17, 16, &a).unwrap();
        assert_eq!(bt.pages(), &[0, 1]);
        assert_eq!(bt.slot(16, 16), Some(16));
        assert_eq!(bt.slot(32, 16), None);
        // Too much: all-or-nothing.
        let err = bt.reserve(64, 16, &a).unwrap_err();
        assert!(matches!(err, DetspecError::OutOfPages { .. }));
        assert_eq!(bt.pages().len(), 2);
        assert_eq!(a.num_free(), 1);
        bt.truncate(16, 16, &a);
        assert_eq!(bt.pages(), &[0]);
        bt.free(&a);
        assert_eq!(a.num_free(), 3);
    }
}
