//! LFM2's causal depthwise convolution, read from the paged cache: each layer's cache holds one
//! row per token (the convolution's input, `B ⊙ x`), written at the token's slot before this
//! runs, so a token's output reads its own row and the `kernel - 1` before it wherever they
//! were computed (this batch, an earlier chunk, a shared prefix page).
//!
//! Each output element is one fixed sum over the taps in order, `Σ_j w[c, j] · x[p − k + 1 + j, c]`
//! then the bias: its bits depend on nothing but the rows it reads, so the op is batch-,
//! position- and thread-invariant by construction, on every instruction set (no SIMD
//! reassociation: each channel is its own scalar chain).

use std::sync::Arc;

use candle_core::{bail, Tensor};
use rayon::prelude::*;

use super::{bf16_to_f32, with_bf16_bits, with_f32_values, AttentionMetadata};

/// A convolution's taps and bias on the host, as transformers holds them
/// (`conv.weight` `[width, 1, kernel]`, `conv.bias` `[width]`).
#[derive(Debug, Clone)]
pub struct ConvTaps {
    /// `[width, kernel]`, row-major.
    pub weight: Arc<[f32]>,
    pub bias: Option<Arc<[f32]>>,
    pub kernel: usize,
}

/// The convolution of every batch row (`meta.positions`, `meta.row_seq`, `meta.block_tables`)
/// over the row cache `rows` (`[pages, page_size, 1, width]`, f32 or bf16, on the CPU):
/// `[rows, width]` f32. Positions before 0 contribute nothing (transformers pads with zeros).
pub fn short_conv(
    rows: &Tensor,
    taps: &ConvTaps,
    meta: &AttentionMetadata,
) -> candle_core::Result<Tensor> {
    let &[pages, page_size, 1, width] = rows.dims() else {
        bail!(
            "short_conv: the row cache must be [pages, page_size, 1, width], got {:?}",
            rows.dims()
        );
    };
    let k = taps.kernel;
    if k == 0 || taps.weight.len() != width * k {
        bail!(
            "short_conv: {} taps for {width} channels of {k}",
            taps.weight.len()
        );
    }
    if taps.bias.as_ref().is_some_and(|b| b.len() != width) {
        bail!("short_conv: the bias is not {width} wide");
    }
    let n = meta.positions.len();
    if meta.row_seq.len() != n {
        bail!("short_conv: {n} positions for {} rows", meta.row_seq.len());
    }
    // Every row's slots for its taps, oldest first (`None` before position 0), checked once.
    let mut slots = Vec::with_capacity(n * k);
    for (&pos, &seq) in meta.positions.iter().zip(&meta.row_seq) {
        let Some(table) = meta.block_tables.get(seq as usize) else {
            bail!("short_conv: row of sequence {seq} without a block table");
        };
        for j in 0..k {
            let Some(p) = (pos as usize + j + 1).checked_sub(k) else {
                slots.push(None);
                continue;
            };
            let page = match table.get(p / page_size) {
                Some(&page) if (page as usize) < pages => page as usize,
                _ => bail!("short_conv: position {p} of sequence {seq} is not in its pages"),
            };
            slots.push(Some(page * page_size + p % page_size));
        }
    }
    let mut out = vec![0f32; n * width];
    let done = with_bf16_bits(rows, |bits| {
        fill(&mut out, &slots, taps, width, bits, |b: u16| bf16_to_f32(b))
    })?;
    if done.is_none() {
        with_f32_values(rows, |values| {
            fill(&mut out, &slots, taps, width, values, |x: f32| x)
        })?;
    }
    Tensor::from_vec(out, (n, width), rows.device())
}

/// Every row's output (`out`: `[rows, width]`), rows in parallel: per channel, the taps in
/// order, then the bias. `cache` holds `width` values per slot, widened by `widen`.
fn fill<T: Copy + Sync>(
    out: &mut [f32],
    slots: &[Option<usize>],
    taps: &ConvTaps,
    width: usize,
    cache: &[T],
    widen: impl Fn(T) -> f32 + Sync,
) {
    let k = taps.kernel;
    out.par_chunks_mut(width.max(1))
        .zip(slots.par_chunks(k))
        .for_each(|(y, at)| {
            for (c, out) in y.iter_mut().enumerate() {
                let w = &taps.weight[c * k..(c + 1) * k];
                let mut acc = 0f32;
                for (&wj, slot) in w.iter().zip(at) {
                    if let Some(slot) = *slot {
                        acc += wj * widen(cache[slot * width + c]);
                    }
                }
                *out = match &taps.bias {
                    Some(b) => acc + b[c],
                    None => acc,
                };
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// A row cache of `pages` pages of 4 slots, `width` 3, holding `f(slot, c)`.
    fn cache(pages: usize, f: impl Fn(usize, usize) -> f32) -> Tensor {
        let v: Vec<f32> = (0..pages * 4 * 3).map(|i| f(i / 3, i % 3)).collect();
        Tensor::from_vec(v, (pages, 4, 1, 3), &Device::Cpu).unwrap()
    }

    fn taps(bias: bool) -> ConvTaps {
        ConvTaps {
            weight: (0..9).map(|i| 0.5 + i as f32).collect::<Vec<_>>().into(),
            bias: bias.then(|| vec![0.25, -1.0, 2.0].into()),
            kernel: 3,
        }
    }

    fn meta(rows: &[(u32, u32)], tables: Vec<Vec<u32>>) -> AttentionMetadata {
        AttentionMetadata {
            positions: rows.iter().map(|r| r.1).collect(),
            row_seq: rows.iter().map(|r| r.0).collect(),
            block_tables: tables,
            ..AttentionMetadata::default()
        }
    }

    #[test]
    fn matches_a_causal_convolution_across_pages() {
        let rows = cache(3, |slot, c| (slot * 10 + c) as f32 * 0.125);
        // One sequence on pages 2, 0: positions 0..8 live at slots 8..12, then 0..4.
        let table = vec![2, 0];
        let slot_of = |p: usize| [8, 0][p / 4] + p % 4;
        let m = meta(&[(0, 0), (0, 1), (0, 4), (0, 5)], vec![table]);
        for bias in [false, true] {
            let t = taps(bias);
            let y = short_conv(&rows, &t, &m).unwrap().to_vec2::<f32>().unwrap();
            for (r, &p) in m.positions.iter().enumerate() {
                for c in 0..3 {
                    let mut want = 0f32;
                    for j in 0..3 {
                        if let Some(q) = (p as usize + j + 1).checked_sub(3) {
                            want += t.weight[c * 3 + j] * ((slot_of(q) * 10 + c) as f32 * 0.125);
                        }
                    }
                    if let Some(b) = &t.bias {
                        want += b[c];
                    }
                    assert_eq!(y[r][c].to_bits(), want.to_bits(), "row {r} channel {c}");
                }
            }
        }
    }

    /// A row's bits do not depend on which other rows (of other sequences) share the batch,
    /// nor on where it sits in it.
    #[test]
    fn a_row_is_batch_invariant() {
        let rows = cache(4, |slot, c| ((slot * 7 + c * 3) % 11) as f32 / 7.0 - 0.6);
        let tables = vec![vec![1, 3], vec![0, 2]];
        let alone = short_conv(&rows, &taps(true), &meta(&[(0, 6)], tables.clone())).unwrap();
        let crowd = meta(&[(1, 2), (1, 7), (0, 6), (1, 0)], tables);
        let all = short_conv(&rows, &taps(true), &crowd).unwrap();
        let row = all.get(2).unwrap().to_vec1::<f32>().unwrap();
        let alone = alone.get(0).unwrap().to_vec1::<f32>().unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&row), bits(&alone));
    }

    #[test]
    fn bf16_rows_are_read_widened() {
        let f = |slot: usize, c: usize| (slot + c) as f32 * 0.5;
        let rows = cache(2, f);
        let m = meta(&[(0, 3)], vec![vec![0, 1]]);
        let a = short_conv(&rows, &taps(false), &m).unwrap();
        let b = short_conv(&rows.to_dtype(DType::BF16).unwrap(), &taps(false), &m).unwrap();
        // Multiples of 0.5 below 8 are exact in bf16.
        assert_eq!(a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
    }

    #[test]
    fn bad_shapes_and_missing_pages_are_errors() {
        let rows = cache(2, |_, _| 1.0);
        let m = meta(&[(0, 5)], vec![vec![0]]);
        let e = short_conv(&rows, &taps(false), &m).unwrap_err().to_string();
        assert!(e.contains("position 4 of sequence 0"), "{e}");
        let m = meta(&[(1, 0)], vec![vec![0]]);
        assert!(short_conv(&rows, &taps(false), &m).is_err());
        let flat = Tensor::zeros((2, 4, 3), DType::F32, &Device::Cpu).unwrap();
        assert!(short_conv(&flat, &taps(false), &meta(&[(0, 0)], vec![vec![0]])).is_err());
        let short = ConvTaps {
            weight: vec![1.0; 4].into(),
            bias: None,
            kernel: 3,
        };
        assert!(short_conv(&rows, &short, &meta(&[(0, 0)], vec![vec![0]])).is_err());
    }
}
