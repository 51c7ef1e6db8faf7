//! Qwen3.5's gated DeltaNet core on the CPU: the causal convolution (then SiLU) over each
//! sequence's queries, keys and values, and the gated delta rule over its per-sequence state
//! (`kv::state`), token after token.
//!
//! Per value head `h` and token `t` (queries and keys L2-normed, queries scaled by
//! `key_dim^-½`, `g = -e^{A_log} · softplus(a + dt_bias)`, `β = σ(b)`):
//!
//! ```text
//! S ← e^g · S;   δ = β · (v − Sᵀk);   S ← S + k δᵀ;   o = Sᵀq
//! ```
//!
//! Every sum runs over the key dimension in order, one scalar chain per output element; a
//! token's result depends on nothing but its sequence's state and its own inputs. The op is
//! therefore batch-, position- and thread-invariant by construction, and a prefill gives the
//! bits of the same tokens decoded one by one (transformers' chunked form of the rule reorders
//! the sums: it agrees to rounding, not bits).

use std::sync::Arc;

use candle_core::{bail, Tensor};
use rayon::prelude::*;

use super::math::{exp_nonpositive, sigmoid, softplus};
use super::recurrent::{over_heads, over_sequences, CausalConv};
use super::{to_f32_vec, AttentionMetadata};
use crate::config::DeltaNetDims;
use crate::kv::{StatePool, StateRef};

/// One layer's parameters, on the host.
#[derive(Debug, Clone)]
pub struct DeltaNetParams {
    pub dims: DeltaNetDims,
    /// `[conv_dim, kernel]`, row-major (`conv1d.weight` without its middle axis).
    pub conv: Arc<[f32]>,
    /// `A_log` per value head (the decay's rate is `-e^{A_log}`, in f32 as transformers
    /// computes it).
    pub a_log: Arc<[f32]>,
    pub dt_bias: Arc<[f32]>,
}

/// `x · (Σx² + 1e-6)^-½ · scale`, in place (the FLA library's L2 norm, as transformers').
fn l2_normalize(x: &mut [f32], scale: f32) {
    let sum = x.iter().fold(0f32, |acc, &v| acc + v * v);
    let inv = 1.0 / (sum + 1e-6).sqrt();
    for v in x {
        *v = *v * inv * scale;
    }
}

/// The layer's core output `[rows, value_heads · value_dim]` for the rows' pre-convolution
/// `qkv` (`[rows, conv_dim]`) and gate inputs `a`, `b` (`[rows, value_heads]`). Each
/// sequence's rows (`meta.row_seq`, consecutive positions in order) continue the state
/// `states[seq]` names (`StateRef`) in layer `layer` of `pool`; rows of a sequence without
/// one (padding) output zeros.
pub fn gated_delta_rule(
    (qkv, a, b): (&Tensor, &Tensor, &Tensor),
    p: &DeltaNetParams,
    meta: &AttentionMetadata,
    states: &[Option<StateRef>],
    (pool, layer): (&StatePool, usize),
) -> candle_core::Result<Tensor> {
    let (n, conv_dim) = qkv.dims2()?;
    let hv = p.dims.value_heads;
    if conv_dim != p.dims.conv_dim() || a.dims() != [n, hv] || b.dims() != [n, hv] {
        bail!(
            "gated_delta_rule: qkv {:?}, a {:?}, b {:?} for {conv_dim} channels and {hv} value heads",
            qkv.dims(),
            a.dims(),
            b.dims()
        );
    }
    if p.dims.kernel == 0 || p.conv.len() != conv_dim * p.dims.kernel {
        bail!(
            "gated_delta_rule: {} taps for {conv_dim} channels",
            p.conv.len()
        );
    }
    if p.a_log.len() != hv
        || p.dt_bias.len() != hv
        || p.dims.key_heads == 0
        || !hv.is_multiple_of(p.dims.key_heads)
    {
        bail!(
            "gated_delta_rule: A_log and dt_bias must have one value per value head ({hv}), \
             and the value heads must share the key heads ({}) evenly",
            p.dims.key_heads
        );
    }
    if meta.row_seq.len() != n {
        bail!(
            "gated_delta_rule: {n} rows, {} in the metadata",
            meta.row_seq.len()
        );
    }
    let (qkv, a, b) = (to_f32_vec(qkv)?, to_f32_vec(a)?, to_f32_vec(b)?);
    let neg_a: Vec<f32> = p.a_log.iter().map(|&x| -libm::expf(x)).collect();
    let inputs = Inputs {
        qkv: &qkv,
        a: &a,
        b: &b,
        neg_a: &neg_a,
    };
    let width = hv * p.dims.value_dim;
    let out = over_sequences(
        "gated_delta_rule",
        meta,
        states,
        (pool, layer),
        (p.dims.state_values(), width),
        |st, rows, advance| apply_rule(st, rows, advance, &inputs, p),
    )?;
    Tensor::from_vec(out, (n, width), &candle_core::Device::Cpu)
}

/// The batch's inputs to the rule, flattened on the host, and `-e^{A_log}` per value head.
struct Inputs<'a> {
    qkv: &'a [f32],
    a: &'a [f32],
    b: &'a [f32],
    neg_a: &'a [f32],
}

/// The convolution and the rule over one sequence's `rows` from the state `st` (one layer's),
/// left at its value after `advance` rows. Returns the rows' outputs, in order.
fn apply_rule(
    st: &mut [f32],
    rows: &[usize],
    advance: usize,
    inputs: &Inputs<'_>,
    p: &DeltaNetParams,
) -> Vec<f32> {
    let Inputs { qkv, a, b, neg_a } = *inputs;
    let m = rows.len();
    let cd = p.dims.conv_dim();
    let conv = CausalConv {
        taps: &p.conv,
        bias: None,
        kernel: p.dims.kernel,
        channels: cd,
    };
    let (hist, heads) = st.split_at_mut(conv.state_len());
    let mut post = conv.silu(hist, rows, qkv, advance);
    // Queries and keys normed per key head (queries also scaled), by row.
    let (hk, dk, dv, hv) = (
        p.dims.key_heads,
        p.dims.key_dim,
        p.dims.value_dim,
        p.dims.value_heads,
    );
    let scale = 1.0 / (dk as f32).sqrt();
    post.par_chunks_mut(cd).for_each(|row| {
        let (q, rest) = row.split_at_mut(hk * dk);
        let (kk, _) = rest.split_at_mut(hk * dk);
        for h in 0..hk {
            l2_normalize(&mut q[h * dk..(h + 1) * dk], scale);
            l2_normalize(&mut kk[h * dk..(h + 1) * dk], 1.0);
        }
    });
    let (group, post) = (hv / hk, &post);
    // Per value head: its state, advanced row by row.
    over_heads(heads, dk * dv, (m, advance), dv, |h| {
        let kh = h / group;
        let (mut kv_mem, mut delta) = (vec![0f32; dv], vec![0f32; dv]);
        move |s: &mut [f32], j: usize, o: &mut [f32]| {
            let r = rows[j];
            let row = &post[j * cd..(j + 1) * cd];
            let q = &row[kh * dk..(kh + 1) * dk];
            let kv = &row[hk * dk + kh * dk..hk * dk + (kh + 1) * dk];
            let v = &row[2 * hk * dk + h * dv..2 * hk * dk + (h + 1) * dv];
            let g = neg_a[h] * softplus(a[r * hv + h] + p.dt_bias[h]);
            let decay = exp_nonpositive(g.min(0.0));
            let beta = sigmoid(b[r * hv + h]);
            for x in s.iter_mut() {
                *x *= decay;
            }
            kv_mem.iter_mut().for_each(|x| *x = 0.0);
            for (i, &ki) in kv.iter().enumerate() {
                for (acc, &sv) in kv_mem.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                    *acc += sv * ki;
                }
            }
            for (d, (&vc, &mem)) in delta.iter_mut().zip(v.iter().zip(&kv_mem)) {
                *d = (vc - mem) * beta;
            }
            for (i, &ki) in kv.iter().enumerate() {
                for (sv, &d) in s[i * dv..(i + 1) * dv].iter_mut().zip(&delta) {
                    *sv += ki * d;
                }
            }
            for (i, &qi) in q.iter().enumerate() {
                for (oc, &sv) in o.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                    *oc += sv * qi;
                }
            }
        }
    })
}

/// `x · σ(gate)` per element ([`sigmoid`]): the attention's output gate (Qwen3.5).
pub fn sigmoid_gate(x: &Tensor, gate: &Tensor) -> candle_core::Result<Tensor> {
    if x.dims() != gate.dims() {
        bail!(
            "sigmoid_gate: shapes {:?} and {:?} differ",
            x.dims(),
            gate.dims()
        );
    }
    let (xs, gs) = (to_f32_vec(x)?, to_f32_vec(gate)?);
    let out: Vec<f32> = xs
        .par_iter()
        .zip(gs.par_iter())
        .map(|(&v, &g)| v * sigmoid(g))
        .collect();
    Tensor::from_vec(out, x.shape(), x.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{SequenceStates, SnapshotAt};
    use crate::ops::tensor_bits as bits;
    use candle_core::Device;

    /// 2 key heads, 4 value heads of 3, keys of 2, kernel 3: conv_dim 2·2·2 + 4·3 = 20.
    fn params() -> DeltaNetParams {
        let conv_dim = 20;
        DeltaNetParams {
            dims: DeltaNetDims {
                kernel: 3,
                key_heads: 2,
                value_heads: 4,
                key_dim: 2,
                value_dim: 3,
            },
            conv: (0..conv_dim * 3)
                .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.1)
                .collect::<Vec<_>>()
                .into(),
            a_log: vec![0.1, -0.5, 1.0, 0.3].into(),
            dt_bias: vec![0.2, -0.1, 0.4, 0.0].into(),
        }
    }

    fn pool(p: &DeltaNetParams) -> Arc<StatePool> {
        StatePool::new(&[0, p.dims.state_values()])
    }

    /// Inputs of `n` rows: qkv `[n, 20]`, a and b `[n, 4]`, from a seed.
    fn inputs(n: usize, seed: usize) -> (Tensor, Tensor, Tensor) {
        let v = |w: usize, k: usize| -> Tensor {
            let data: Vec<f32> = (0..n * w)
                .map(|i| (((i + seed * 31 + k) * 2654435761usize % 1000) as f32) / 500.0 - 1.0)
                .collect();
            Tensor::from_vec(data, (n, w), &Device::Cpu).unwrap()
        };
        (v(20, 0), v(4, 1), v(4, 2))
    }

    fn meta(rows: &[(u32, u32)]) -> AttentionMetadata {
        AttentionMetadata {
            positions: rows.iter().map(|r| r.1).collect(),
            row_seq: rows.iter().map(|r| r.0).collect(),
            ..AttentionMetadata::default()
        }
    }

    fn rows(t: &Tensor, from: usize, n: usize) -> Vec<u32> {
        bits(&t.narrow(0, from, n).unwrap())
    }

    /// A state after the first `n` rows of `inputs` run alone.
    fn after_rows(
        p: &DeltaNetParams,
        pool: &Arc<StatePool>,
        (qkv, a, b): &(Tensor, Tensor, Tensor),
        n: usize,
    ) -> SequenceStates {
        let s = SequenceStates::transient(pool, None);
        let first = |t: &Tensor| t.narrow(0, 0, n).unwrap();
        let positions: Vec<(u32, u32)> = (0..n as u32).map(|i| (0, i)).collect();
        gated_delta_rule(
            (&first(qkv), &first(a), &first(b)),
            p,
            &meta(&positions),
            &[Some(s.forward().unwrap())],
            (pool, 1),
        )
        .unwrap();
        s
    }

    /// Slot `id`'s tokens taken in per layer and its values' bits.
    fn slot_bits(pool: &StatePool, id: u32) -> (Vec<usize>, Vec<u32>) {
        let d = pool.get(id).unwrap();
        let d = d.lock().unwrap();
        (
            d.seen.clone(),
            d.values.iter().map(|x| x.to_bits()).collect(),
        )
    }

    /// A prefill of 5 rows gives the bits of the same rows run one at a time, each continuing
    /// the state the one before left (the decode path).
    #[test]
    fn a_prefill_is_its_rows_decoded_one_by_one() {
        let p = params();
        let pool = pool(&p);
        let (qkv, a, b) = inputs(5, 1);
        let whole = SequenceStates::transient(&pool, None);
        let all = gated_delta_rule(
            (&qkv, &a, &b),
            &p,
            &meta(&[(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]),
            &[Some(whole.forward().unwrap())],
            (&pool, 1),
        )
        .unwrap();
        let one = SequenceStates::transient(&pool, None);
        for r in 0..5 {
            let pick = |t: &Tensor| t.narrow(0, r, 1).unwrap();
            let y = gated_delta_rule(
                (&pick(&qkv), &pick(&a), &pick(&b)),
                &p,
                &meta(&[(0, r as u32)]),
                &[Some(one.forward().unwrap())],
                (&pool, 1),
            )
            .unwrap();
            assert_eq!(bits(&y), rows(&all, r, 1), "row {r}");
        }
        let state = |s: &SequenceStates| slot_bits(&pool, s.forward().unwrap().read);
        assert_eq!(state(&whole), state(&one));
        assert!(all
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .any(|&x| x != 0.0));
    }

    /// A sequence's rows have the same bits whatever other sequences (and padding) share the
    /// batch, and wherever they sit in it.
    #[test]
    fn a_sequence_is_batch_invariant() {
        let p = params();
        let pool = pool(&p);
        let (qkv, a, b) = inputs(3, 2);
        let alone = SequenceStates::transient(&pool, None);
        let want = gated_delta_rule(
            (&qkv, &a, &b),
            &p,
            &meta(&[(0, 0), (0, 1), (0, 2)]),
            &[Some(alone.forward().unwrap())],
            (&pool, 1),
        )
        .unwrap();
        let (oq, oa, ob) = inputs(4, 9);
        let cat = |x: &Tensor, y: &Tensor| {
            Tensor::cat(
                &[&x.narrow(0, 0, 2).unwrap(), y, &x.narrow(0, 2, 2).unwrap()],
                0,
            )
            .unwrap()
        };
        let (other, mine) = (
            SequenceStates::transient(&pool, None),
            SequenceStates::transient(&pool, None),
        );
        // Rows: other 0, other 1, mine 0..3, padding (sequence 2, no state), other 2.
        let crowd = gated_delta_rule(
            (&cat(&oq, &qkv), &cat(&oa, &a), &cat(&ob, &b)),
            &p,
            &meta(&[(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0), (0, 2)]),
            &[
                Some(other.forward().unwrap()),
                Some(mine.forward().unwrap()),
                None,
            ],
            (&pool, 1),
        )
        .unwrap();
        assert_eq!(rows(&crowd, 2, 3), bits(&want));
        assert!(
            rows(&crowd, 5, 1).iter().all(|&b| b == 0),
            "padding outputs zeros"
        );
    }

    /// `advance` leaves the state after that many rows: what a run of those rows alone
    /// leaves (a verify pass re-run with its accepted rows); a replay reads the committed
    /// state and writes the live one.
    #[test]
    fn advance_keeps_the_state_after_the_accepted_rows() {
        let p = params();
        let pool = pool(&p);
        let input = inputs(4, 3);
        let (qkv, a, b) = &input;
        let m = meta(&[(0, 0), (0, 1), (0, 2), (0, 3)]);
        let two = after_rows(&p, &pool, &input, 2);
        let mut s = SequenceStates::new(&pool, true);
        assert!(s.acquire());
        gated_delta_rule(
            (qkv, a, b),
            &p,
            &m,
            &[Some(s.replay(2).unwrap())],
            (&pool, 1),
        )
        .unwrap();
        assert_eq!(
            slot_bits(&pool, s.forward().unwrap().write),
            slot_bits(&pool, two.forward().unwrap().write)
        );
        assert_eq!(
            slot_bits(&pool, s.replay(0).unwrap().read).0[1],
            0,
            "the committed state is only read"
        );
    }

    /// A snapshot left mid-forward is the state a run of the rows before it alone leaves,
    /// and changes no output or live state; a sequence seeded from it continues with the
    /// bits of the whole run (a prefix-cache hit on a recurrent model).
    #[test]
    fn a_snapshot_is_the_state_after_its_rows_and_a_seed_continues_it() {
        let p = params();
        let pool = pool(&p);
        let input = inputs(5, 5);
        let (qkv, a, b) = &input;
        let m = meta(&[(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]);
        let run = |s: &SequenceStates, snapshots: [Option<SnapshotAt>; 2]| {
            let refs = StateRef {
                snapshots,
                ..s.forward().unwrap()
            };
            gated_delta_rule((qkv, a, b), &p, &m, &[Some(refs)], (&pool, 1)).unwrap()
        };
        let state = |id: u32| slot_bits(&pool, id);
        let plain = SequenceStates::transient(&pool, None);
        let want = run(&plain, [None; 2]);
        let (two, four) = (
            after_rows(&p, &pool, &input, 2),
            after_rows(&p, &pool, &input, 4),
        );
        // One snapshot within the rows, one after all of them, two at once (in either order).
        for positions in [
            vec![(2, &two)],
            vec![(5, &plain)],
            vec![(4, &four), (2, &two)],
        ] {
            let s = SequenceStates::transient(&pool, None);
            let snaps: Vec<_> = positions
                .iter()
                .map(|_| pool.snapshot_slot().unwrap())
                .collect();
            let mut at = [None; 2];
            for ((slot, (position, _)), at) in snaps.iter().zip(&positions).zip(&mut at) {
                *at = Some(SnapshotAt::of(*position, slot));
            }
            assert_eq!(bits(&run(&s, at)), bits(&want));
            assert_eq!(
                state(s.forward().unwrap().write),
                state(plain.forward().unwrap().write)
            );
            for (slot, (_, after)) in snaps.iter().zip(&positions) {
                assert_eq!(state(slot.id()), state(after.forward().unwrap().write));
            }
            if positions.len() == 1 && positions[0].0 == 2 {
                pool.keep_snapshot(7, snaps.into_iter().next().unwrap());
            }
        }
        // A sequence seeded from the snapshot after two rows runs the other three.
        let mut seeded = SequenceStates::new(&pool, true);
        seeded.seed(pool.snapshot(7).unwrap());
        assert!(seeded.acquire());
        let rest = |t: &Tensor| t.narrow(0, 2, 3).unwrap();
        let tail = gated_delta_rule(
            (&rest(qkv), &rest(a), &rest(b)),
            &p,
            &meta(&[(0, 2), (0, 3), (0, 4)]),
            &[Some(seeded.forward().unwrap())],
            (&pool, 1),
        )
        .unwrap();
        assert_eq!(bits(&tail), rows(&want, 2, 3));
        assert_eq!(
            state(seeded.replay(0).unwrap().read),
            state(two.forward().unwrap().write),
            "the committed state starts from the seed too"
        );
        // A snapshot at the first row's position (nothing before it) is not taken.
        let (s, snap) = (
            SequenceStates::transient(&pool, None),
            pool.snapshot_slot().unwrap(),
        );
        run(&s, [Some(SnapshotAt::of(0, &snap)), None]);
        assert_eq!(state(snap.id()).0, vec![0, 0]);
    }

    #[test]
    fn a_row_that_does_not_continue_its_state_is_an_error() {
        let p = params();
        let pool = pool(&p);
        let (qkv, a, b) = inputs(1, 4);
        let s = SequenceStates::transient(&pool, None);
        let e = gated_delta_rule(
            (&qkv, &a, &b),
            &p,
            &meta(&[(0, 5)]),
            &[Some(s.forward().unwrap())],
            (&pool, 1),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("position 5 continues a state of 0 tokens"),
            "{e}"
        );
        let e = gated_delta_rule(
            (&qkv, &a, &b),
            &p,
            &meta(&[(0, 0)]),
            &[Some(s.forward().unwrap())],
            (&pool, 0),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("keeps no state"), "{e}");
    }
}
