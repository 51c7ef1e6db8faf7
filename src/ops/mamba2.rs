//! Mamba2's selective state-space recurrence on the CPU (Granite 4.0-H's Mamba layers): the
//! causal convolution (then SiLU) over each sequence's `xBC`, then per head the recurrence over
//! its per-sequence state (`kv::state`), token after token.
//!
//! Per head `h` (group `g`, `A = -e^{A_log}`, `Δ = softplus(dt + dt_bias)`) and token:
//!
//! ```text
//! S ← e^{Δ·A} · S + (Δ · B) xᵀ;   y = Sᵀ C + D · x     (S: state × head_dim)
//! ```
//!
//! Each output element is one fixed-order sum over the state dimension; a token's result
//! depends on nothing but its sequence's state and its own inputs. The op is therefore batch-,
//! position- and thread-invariant by construction, and a prefill gives the bits of the same
//! tokens decoded one by one (transformers' chunked scan of a whole prompt reorders the sums:
//! it agrees to rounding, not bits).

use std::sync::Arc;

use candle_core::{bail, Tensor};

use super::math::{exp_nonpositive, softplus};
use super::recurrent::{over_heads, over_sequences, CausalConv};
use super::{to_f32_vec, AttentionMetadata};
use crate::config::MambaDims;
use crate::kv::{StatePool, StateRef};

/// One Mamba2 layer's parameters, on the host.
#[derive(Debug, Clone)]
pub struct Mamba2Params {
    pub dims: MambaDims,
    /// `[conv_dim, kernel]`, row-major (`conv1d.weight` without its middle axis).
    pub conv: Arc<[f32]>,
    /// `conv1d.bias`, where the layer has one.
    pub conv_bias: Option<Arc<[f32]>>,
    /// Per head: the decay's rate is `-e^{A_log}` (in f32, as transformers computes it).
    pub a_log: Arc<[f32]>,
    pub dt_bias: Arc<[f32]>,
    /// The skip connection's weight per head.
    pub d: Arc<[f32]>,
}

/// The layer's scan output `[rows, heads · head_dim]` (before its gated norm) for the rows'
/// pre-convolution `xbc` (`[rows, conv_dim]`) and time steps `dt` (`[rows, heads]`). Each
/// sequence's rows (`meta.row_seq`, consecutive positions in order) continue the state
/// `states[seq]` names in layer `layer` of `pool`; rows of a sequence without one (padding)
/// output zeros.
pub fn mamba2_scan(
    (xbc, dt): (&Tensor, &Tensor),
    p: &Mamba2Params,
    meta: &AttentionMetadata,
    states: &[Option<StateRef>],
    (pool, layer): (&StatePool, usize),
) -> candle_core::Result<Tensor> {
    let (n, conv_dim) = xbc.dims2()?;
    let d = p.dims;
    if conv_dim != d.conv_dim() || dt.dims() != [n, d.heads] || meta.row_seq.len() != n {
        bail!(
            "mamba2_scan: xBC {:?}, dt {:?} and {} rows of metadata for {} channels and {} heads",
            xbc.dims(),
            dt.dims(),
            meta.row_seq.len(),
            d.conv_dim(),
            d.heads
        );
    }
    let per_head = [&p.a_log, &p.dt_bias, &p.d];
    if d.kernel == 0
        || p.conv.len() != conv_dim * d.kernel
        || p.conv_bias.as_ref().is_some_and(|b| b.len() != conv_dim)
        || per_head.iter().any(|v| v.len() != d.heads)
        || d.groups == 0
        || !d.heads.is_multiple_of(d.groups)
    {
        bail!(
            "mamba2_scan: {} taps for {conv_dim} channels of {} taps, A_log/dt_bias/D of {:?} \
             for {} heads in {} groups",
            p.conv.len(),
            d.kernel,
            per_head.map(|v| v.len()),
            d.heads,
            d.groups
        );
    }
    let (xbc, dt) = (to_f32_vec(xbc)?, to_f32_vec(dt)?);
    let neg_a: Vec<f32> = p.a_log.iter().map(|&x| -libm::expf(x)).collect();
    let out = over_sequences(
        "mamba2_scan",
        meta,
        states,
        (pool, layer),
        (d.state_values(), d.inner()),
        |st, rows, advance| scan(st, rows, advance, (&xbc, &dt, &neg_a), p),
    )?;
    Tensor::from_vec(out, (n, d.inner()), &candle_core::Device::Cpu)
}

/// The convolution and the recurrence over one sequence's `rows` from the state `st` (one
/// layer's), left at its value after `advance` rows. Returns the rows' outputs, in order.
fn scan(
    st: &mut [f32],
    rows: &[usize],
    advance: usize,
    (xbc, dt, neg_a): (&[f32], &[f32], &[f32]),
    p: &Mamba2Params,
) -> Vec<f32> {
    let d = p.dims;
    let (m, cd, inner) = (rows.len(), d.conv_dim(), d.inner());
    let conv = CausalConv {
        taps: &p.conv,
        bias: p.conv_bias.as_deref(),
        kernel: d.kernel,
        channels: cd,
    };
    let (hist, heads) = st.split_at_mut(conv.state_len());
    let post = conv.silu(hist, rows, xbc, advance);
    let (hd, ns) = (d.head_dim, d.state);
    let (per_group, post) = (d.heads / d.groups, &post);
    // Per head: its state, advanced row by row.
    // A head's state is held state-index-major (`[state, head_dim]`): each output element's
    // sum over the state runs in order while the head dimension's lanes run side by side.
    over_heads(heads, hd * ns, (m, advance), hd, |h| {
        let g = h / per_group;
        move |s: &mut [f32], j: usize, y: &mut [f32]| {
            let r = rows[j];
            let row = &post[j * cd..(j + 1) * cd];
            let x = &row[h * hd..(h + 1) * hd];
            let b = &row[inner + g * ns..inner + (g + 1) * ns];
            let c = &row[inner + (d.groups + g) * ns..inner + (d.groups + g + 1) * ns];
            let step = softplus(dt[r * d.heads + h] + p.dt_bias[h]);
            let decay = exp_nonpositive((step * neg_a[h]).min(0.0));
            for ((sn, &bn), &cn) in s.chunks_exact_mut(hd).zip(b).zip(c) {
                let dbn = step * bn;
                for ((sv, &xp), yp) in sn.iter_mut().zip(x).zip(y.iter_mut()) {
                    *sv = *sv * decay + dbn * xp;
                    *yp += *sv * cn;
                }
            }
            for (yp, &xp) in y.iter_mut().zip(x) {
                *yp += p.d[h] * xp;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::SequenceStates;
    use crate::ops::tensor_bits as bits;
    use candle_core::Device;

    /// 4 heads of 2 in 2 groups, a state of 3, kernel 3: inner 8, conv_dim 8 + 2·2·3 = 20.
    fn params() -> Mamba2Params {
        let dims = MambaDims {
            kernel: 3,
            heads: 4,
            head_dim: 2,
            groups: 2,
            state: 3,
        };
        let cd = dims.conv_dim();
        Mamba2Params {
            dims,
            conv: (0..cd * 3)
                .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.1)
                .collect::<Vec<_>>()
                .into(),
            conv_bias: Some(
                (0..cd)
                    .map(|i| (i as f32 - 9.0) * 0.01)
                    .collect::<Vec<_>>()
                    .into(),
            ),
            a_log: vec![0.1, -0.5, 1.0, 0.3].into(),
            dt_bias: vec![0.2, -0.1, 0.4, 0.0].into(),
            d: vec![1.0, 0.5, -0.25, 2.0].into(),
        }
    }

    fn inputs(n: usize, seed: usize, p: &Mamba2Params) -> (Tensor, Tensor) {
        let val = |i: usize| (((i * 31 + seed * 17) % 23) as f32 - 11.0) * 0.07;
        let cd = p.dims.conv_dim();
        let xbc: Vec<f32> = (0..n * cd).map(val).collect();
        let dt: Vec<f32> = (0..n * p.dims.heads).map(|i| val(i + 5)).collect();
        (
            Tensor::from_vec(xbc, (n, cd), &Device::Cpu).unwrap(),
            Tensor::from_vec(dt, (n, p.dims.heads), &Device::Cpu).unwrap(),
        )
    }

    fn meta(seqs: &[(u32, usize, usize)]) -> AttentionMetadata {
        let mut m = AttentionMetadata::default();
        for &(s, start, len) in seqs {
            for pos in start..start + len {
                m.row_seq.push(s);
                m.positions.push(pos as u32);
            }
        }
        m
    }

    #[test]
    fn a_prefill_is_its_rows_decoded_one_by_one() {
        let p = params();
        let pool = StatePool::new(&[p.dims.state_values()]);
        let (xbc, dt) = inputs(7, 1, &p);
        let whole = SequenceStates::transient(&pool, None);
        let all = mamba2_scan(
            (&xbc, &dt),
            &p,
            &meta(&[(0, 0, 7)]),
            &[Some(whole.forward().unwrap())],
            (&pool, 0),
        )
        .unwrap();
        let one = SequenceStates::transient(&pool, None);
        for t in 0..7 {
            let row = mamba2_scan(
                (&xbc.narrow(0, t, 1).unwrap(), &dt.narrow(0, t, 1).unwrap()),
                &p,
                &meta(&[(0, t, 1)]),
                &[Some(one.forward().unwrap())],
                (&pool, 0),
            )
            .unwrap();
            assert_eq!(bits(&row), bits(&all.narrow(0, t, 1).unwrap()), "row {t}");
        }
        // And the states they leave are the same bits.
        let values = |s: &SequenceStates| {
            let slot = pool.get(s.forward().unwrap().read).unwrap();
            let d = slot.lock().unwrap();
            d.values.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(values(&whole), values(&one));
        assert!(
            all.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                > 0.0
        );
    }

    #[test]
    fn a_sequence_is_batch_invariant() {
        let p = params();
        let pool = StatePool::new(&[p.dims.state_values()]);
        let (xbc, dt) = inputs(5, 2, &p);
        let alone = SequenceStates::transient(&pool, None);
        let want = mamba2_scan(
            (&xbc, &dt),
            &p,
            &meta(&[(0, 0, 5)]),
            &[Some(alone.forward().unwrap())],
            (&pool, 0),
        )
        .unwrap();
        // Beside another sequence and a padding row.
        let (other_x, other_dt) = inputs(3, 9, &p);
        let (pad_x, pad_dt) = inputs(1, 4, &p);
        let xs = Tensor::cat(&[&other_x, &xbc, &pad_x], 0).unwrap();
        let dts = Tensor::cat(&[&other_dt, &dt, &pad_dt], 0).unwrap();
        let (other, mine) = (
            SequenceStates::transient(&pool, None),
            SequenceStates::transient(&pool, None),
        );
        let got = mamba2_scan(
            (&xs, &dts),
            &p,
            &meta(&[(0, 0, 3), (1, 0, 5), (2, 0, 1)]),
            &[
                Some(other.forward().unwrap()),
                Some(mine.forward().unwrap()),
                None,
            ],
            (&pool, 0),
        )
        .unwrap();
        assert_eq!(bits(&got.narrow(0, 3, 5).unwrap()), bits(&want));
        assert!(bits(&got.narrow(0, 8, 1).unwrap()).iter().all(|&b| b == 0));
    }

    #[test]
    fn advance_keeps_the_state_after_the_accepted_rows() {
        let p = params();
        let pool = StatePool::new(&[p.dims.state_values()]);
        let (xbc, dt) = inputs(5, 3, &p);
        let two = SequenceStates::transient(&pool, None);
        mamba2_scan(
            (&xbc.narrow(0, 0, 2).unwrap(), &dt.narrow(0, 0, 2).unwrap()),
            &p,
            &meta(&[(0, 0, 2)]),
            &[Some(two.forward().unwrap())],
            (&pool, 0),
        )
        .unwrap();
        let mut s = SequenceStates::new(&pool, true);
        assert!(s.acquire());
        mamba2_scan(
            (&xbc, &dt),
            &p,
            &meta(&[(0, 0, 5)]),
            &[Some(s.replay(2).unwrap())],
            (&pool, 0),
        )
        .unwrap();
        let values = |id: u32| {
            let slot = pool.get(id).unwrap();
            let d = slot.lock().unwrap();
            (
                d.values.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                d.seen[0],
            )
        };
        assert_eq!(
            values(s.forward().unwrap().write),
            values(two.forward().unwrap().write)
        );
        // A row that does not continue its state is refused.
        let e = mamba2_scan(
            (&xbc.narrow(0, 0, 1).unwrap(), &dt.narrow(0, 0, 1).unwrap()),
            &p,
            &meta(&[(0, 4, 1)]),
            &[Some(two.forward().unwrap())],
            (&pool, 0),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("position 4") && e.contains("2 tokens"), "{e}");
    }
}
