//! KV cache: the page pool (tensors), the page allocator, per-sequence block tables, the prefix
//! cache, and [`KvManager`] tying allocator and prefix cache together for the engine.
//!
//! The allocator knows nothing of requests; block tables know nothing of tensors; the only
//! tensor-level operation a page operation implies (the copy of copy-on-write) is returned to the
//! caller as `(src, dst)` pairs for [`KvPool::copy_pages`].

mod allocator;
mod block_table;
mod manager;
mod pool;
mod prefix;
mod state;

pub use allocator::{AtomicAllocator, PageAllocator, PageError, PageId, SimpleAllocator};
pub use block_table::BlockTable;
pub use manager::{KvManager, KvStats};
pub use pool::{KvPool, LayerCache, LayerCacheShape};
pub use prefix::{
    chain_hash, namespace, root_hash, root_hash_of, salt_hash, EndingHit, FnvHasher, PageClass,
    PrefixCache, PrefixStats,
};
pub use state::{SequenceStates, SnapshotAt, StateData, StatePool, StateRef, StateSeed, StateSlot};
