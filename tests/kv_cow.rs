//! KV contents stay right through page operations, at the tensor level: fork + copy-on-write,
//! truncate + regrow, and `copy_pages` itself (bounds, dtypes, every layer of a pool).

#![cfg(not(loom))]

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use detspec::kv::{
    AtomicAllocator, BlockTable, KvManager, KvPool, LayerCache, LayerCacheShape, PageAllocator,
};
use detspec::ops::{copy_pages, write_k, write_kv};

const PAGES: usize = 8;
const PS: usize = 4;
const KVH: usize = 2;
const HD: usize = 3;

/// Distinct, deterministic row `i` of K/V data (`[1, KVH, HD]`).
fn row(i: usize) -> Tensor {
    let v: Vec<f32> = (0..KVH * HD)
        .map(|j| (i * 31 + j) as f32 * 0.37 - 5.0)
        .collect();
    Tensor::from_vec(v, (1, KVH, HD), &Device::Cpu).unwrap()
}

fn zeros() -> Tensor {
    Tensor::zeros((PAGES, PS, KVH, HD), DType::F32, &Device::Cpu).unwrap()
}

/// Bits of the cache row at flat `slot`.
fn at(cache: &Tensor, slot: u32) -> Vec<u32> {
    cache
        .reshape((PAGES * PS, KVH * HD))
        .unwrap()
        .get(slot as usize)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// Writes rows for positions `from..to` of a sequence whose token at position `p` has data
/// `row(data(p))`.
fn write(cache: &Tensor, bt: &BlockTable, from: usize, to: usize, data: impl Fn(usize) -> usize) {
    for pos in from..to {
        let slot = bt.slot(pos, PS).unwrap();
        write_kv(cache, &row(data(pos)), Arc::new(vec![slot])).unwrap();
    }
}

#[test]
fn fork_then_write_copies_partial_page_and_leaves_parent_intact() {
    let cache = zeros();
    let a = AtomicAllocator::new(PAGES);
    let mut parent = BlockTable::new();
    assert_eq!(parent.prepare_append(6, PS, &a).unwrap(), None);
    write(&cache, &parent, 0, 6, |p| p);
    let parent_before: Vec<Vec<u32>> = (0..6)
        .map(|p| at(&cache, parent.slot(p, PS).unwrap()))
        .collect();
    let whole_before = bits(&cache);

    let mut child = parent.fork(&a);
    let (src, dst) = child
        .prepare_append(7, PS, &a)
        .unwrap()
        .expect("shared partial page must be copied");
    assert_eq!(src, parent.pages()[1]);
    copy_pages(&cache, &[(src, dst)]).unwrap();
    // The child's new token differs from anything the parent wrote.
    write(&cache, &child, 6, 7, |_| 1000);

    // Parent: every row it owns is bitwise unchanged, and its page 1 slot 2 was not touched.
    for (p, want) in parent_before.iter().enumerate() {
        assert_eq!(
            &at(&cache, parent.slot(p, PS).unwrap()),
            want,
            "parent row {p}"
        );
    }
    let parent_slot6 = parent.pages()[1] as usize * PS + 2;
    assert_eq!(at(&cache, parent_slot6 as u32), at(&zeros(), 0));
    // Only the child's private page changed anywhere in the cache.
    let now = bits(&cache);
    let page_elems = PS * KVH * HD;
    for (i, (x, y)) in now.iter().zip(&whole_before).enumerate() {
        if i / page_elems != dst as usize {
            assert_eq!(x, y, "element {i} outside the child's new page changed");
        }
    }
    // Child: copied rows equal the parent's bitwise; its new row is the new data.
    for (p, want) in parent_before.iter().enumerate() {
        assert_eq!(
            &at(&cache, child.slot(p, PS).unwrap()),
            want,
            "child row {p}"
        );
    }
    assert_eq!(at(&cache, child.slot(6, PS).unwrap()), bits(&row(1000)));
    // Full page 0 is still shared, page 1 is not.
    assert_eq!(child.pages()[0], parent.pages()[0]);
    assert_eq!(a.ref_count(parent.pages()[0]), 2);
    assert_eq!(a.ref_count(parent.pages()[1]), 1);
}

#[test]
fn truncate_then_regrow_equals_fresh_sequence() {
    // Sequence A writes 11 tokens, rolls back to 5 (DVR rejection) and writes 4 different ones;
    // sequence B writes the final 9 tokens directly. Their KV must be bitwise equal per position.
    let m = KvManager::new(PAGES, PS, true).unwrap();
    let cache = zeros();
    let data_a = |p: usize| if p < 5 { p } else { 500 + p };
    let mut a = BlockTable::new();
    a.prepare_append(11, PS, &m).unwrap();
    write(&cache, &a, 0, 11, |p| if p < 5 { p } else { 900 + p });
    a.truncate(5, PS, &m);
    assert_eq!(a.pages().len(), 2);
    assert_eq!(a.prepare_append(9, PS, &m).unwrap(), None);
    write(&cache, &a, 5, 9, data_a);

    let mut b = BlockTable::new();
    b.prepare_append(9, PS, &m).unwrap();
    write(&cache, &b, 0, 9, data_a);
    for p in 0..9 {
        assert_eq!(
            at(&cache, a.slot(p, PS).unwrap()),
            at(&cache, b.slot(p, PS).unwrap()),
            "position {p}"
        );
    }
}

#[test]
fn rollback_into_a_cached_page_copies_it() {
    // A full page registered in the prefix cache is read-only: rolling back into it and writing
    // again must go to a private copy, leaving the cached KV intact for later hits.
    let m = KvManager::new(PAGES, PS, true).unwrap();
    let cache = zeros();
    let mut a = BlockTable::new();
    a.prepare_append(8, PS, &m).unwrap();
    write(&cache, &a, 0, 8, |p| p);
    let tokens: Vec<u32> = (0..8).collect();
    assert_eq!(m.insert_prefix(&tokens, a.pages()), 2);
    let cached_page = a.pages()[1];
    let cached_bits: Vec<Vec<u32>> = (4..8).map(|p| at(&cache, a.slot(p, PS).unwrap())).collect();

    a.truncate(6, PS, &m);
    let pair = a.prepare_append(7, PS, &m).unwrap().expect("copy");
    assert_eq!(pair.0, cached_page);
    copy_pages(&cache, &[pair]).unwrap();
    write(&cache, &a, 6, 7, |_| 777);

    let hit = m.lookup_prefix(&tokens);
    assert_eq!(hit[1], cached_page);
    for (i, want) in cached_bits.iter().enumerate() {
        let slot = cached_page as usize * PS + i;
        assert_eq!(&at(&cache, slot as u32), want);
    }
    assert_eq!(at(&cache, a.slot(4, PS).unwrap()), cached_bits[0]);
    assert_eq!(at(&cache, a.slot(5, PS).unwrap()), cached_bits[1]);
    assert_eq!(at(&cache, a.slot(6, PS).unwrap()), bits(&row(777)));
}

#[test]
fn copy_pages_bounds_and_order() {
    let cache = Tensor::arange(0f32, (PAGES * PS * KVH * HD) as f32, &Device::Cpu)
        .unwrap()
        .reshape((PAGES, PS, KVH, HD))
        .unwrap();
    let before = bits(&cache);
    // Out of range: error, nothing written (even the valid first pair).
    assert!(copy_pages(&cache, &[(0, 1), (0, PAGES as u32)]).is_err());
    assert!(copy_pages(&cache, &[(PAGES as u32 + 3, 0)]).is_err());
    assert_eq!(bits(&cache), before);
    // Pairs apply in order: 2 -> 3, then 3 -> 4 (so 4 gets page 2's data), and a self-copy.
    copy_pages(&cache, &[(2, 3), (3, 4), (5, 5)]).unwrap();
    let page = |t: &Tensor, i: usize| bits(&t.get(i).unwrap());
    let orig = Tensor::from_vec(
        before
            .iter()
            .map(|&b| f32::from_bits(b))
            .collect::<Vec<_>>(),
        (PAGES, PS, KVH, HD),
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(page(&cache, 3), page(&orig, 2));
    assert_eq!(page(&cache, 4), page(&orig, 2));
    for i in [0, 1, 2, 5, 6, 7] {
        assert_eq!(page(&cache, i), page(&orig, i), "page {i}");
    }
    // Not contiguous: error, not a panic.
    let t = cache.transpose(0, 1).unwrap();
    assert!(copy_pages(&t, &[(0, 1)]).is_err());
}

#[test]
fn copy_pages_other_dtypes() {
    for dtype in [DType::BF16, DType::F16, DType::U32] {
        let cache = Tensor::arange(0u32, 4 * 6, &Device::Cpu)
            .unwrap()
            .reshape((4, 6))
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        copy_pages(&cache, &[(0, 3)]).unwrap();
        let v = cache
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec2::<u32>()
            .unwrap();
        assert_eq!(v[3], v[0], "{dtype:?}");
        assert_eq!(v[1], (6..12).collect::<Vec<u32>>());
    }
}

#[test]
fn pool_copy_pages_covers_every_layer() {
    let attention = LayerCacheShape::Attention {
        kv_heads: KVH,
        head_dim: HD,
    };
    // An LFM2-style convolution layer between attention layers: one row per token.
    let rows = LayerCacheShape::Rows { width: KVH * HD };
    let pool = KvPool::new(
        vec![attention, rows, attention],
        PAGES,
        PS,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    for l in 0..3 {
        match pool.layer(l).unwrap() {
            LayerCache::Attention { k, v } => {
                write_k(k, &row(l), Arc::new(vec![1])).unwrap();
                write_kv(v, &row(10 + l), Arc::new(vec![2])).unwrap();
            }
            LayerCache::Rows(r) => write_kv(r, &row(10 + l), Arc::new(vec![2])).unwrap(),
            LayerCache::Recurrent | LayerCache::Stateless => {
                unreachable!("no recurrent or stateless layer in this pool")
            }
        }
    }
    pool.copy_pages(&[(0, 5)]).unwrap();
    for l in 0..3 {
        let v = match pool.layer(l).unwrap() {
            LayerCache::Attention { k, v } => {
                // K is stored transposed per page ([pages, kv_heads, head_dim, page_size]):
                // compare the whole page, which holds the written key.
                let page = |p: usize| bits(&k.narrow(0, p, 1).unwrap());
                assert_eq!(page(5), page(0));
                assert!(
                    page(5).iter().any(|&b| b != 0),
                    "layer {l}: the key was written"
                );
                v
            }
            LayerCache::Rows(r) => r,
            LayerCache::Recurrent | LayerCache::Stateless => unreachable!("no such layer here"),
        };
        assert_eq!(at(v, 5 * PS as u32 + 2), bits(&row(10 + l)));
    }
    assert!(pool.copy_pages(&[(0, PAGES as u32)]).is_err());
}

#[test]
fn pool_sizing() {
    let attention = LayerCacheShape::Attention {
        kv_heads: KVH,
        head_dim: HD,
    };
    let per = KvPool::bytes_per_page(&[attention; 2], PS, DType::F32);
    assert_eq!(per, 2 * 2 * KVH * HD * PS * 4);
    let with_rows = [attention, LayerCacheShape::Rows { width: 3 }];
    assert_eq!(
        KvPool::bytes_per_page(&with_rows, PS, DType::BF16),
        (2 * KVH * HD + 3) * PS * 2
    );
    assert_eq!(KvPool::num_pages_for(Some(7), 0, per).unwrap(), 7);
    assert_eq!(KvPool::num_pages_for(None, per * 10 + 1, per).unwrap(), 10);
    assert!(KvPool::num_pages_for(None, per - 1, per).is_err());
    assert!(KvPool::num_pages_for(Some(0), 1 << 30, per).is_err());
}
