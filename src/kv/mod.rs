//! KV cache: the page pool (tensors), the page allocator, and per-sequence block tables.
//!
//! The allocator knows nothing of requests; block tables know nothing of tensors.

mod allocator;
mod block_table;
mod pool;

pub use allocator::{PageAllocator, PageId, SimpleAllocator};
pub use block_table::BlockTable;
pub use pool::KvPool;
