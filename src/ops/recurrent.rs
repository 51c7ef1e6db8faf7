//! What every recurrent layer's CPU op shares (Qwen3.5's gated DeltaNet, Mamba2): running
//! each sequence's rows, in order, over its per-sequence state (`kv::state`), and the causal
//! depthwise convolution both put before their recurrence.
//!
//! A sequence's first row at position 0 starts from zeros; any other first row must continue
//! the state exactly (each layer's state counts the tokens it took in), else the op errors
//! naming both positions. Where a forward reads and writes one slot (every forward but a
//! verify pass's) the recurrence runs on the slot in place; a verify pass reads the committed
//! state into a copy and leaves it in the live one. The state taken in stops after
//! `StateRef::advance` rows; later rows still compute their outputs. Where the forward asks
//! for snapshots (`StateRef::snapshots`), the rows run in parts, split where each is taken:
//! every op here gives the same bits however a sequence's rows are split.

use rayon::prelude::*;

use super::math::silu;
use super::AttentionMetadata;
use crate::kv::{StateData, StatePool, StateRef};

/// Runs `step` over each sequence's rows (`meta.row_seq`, consecutive positions in order)
/// with the state `states[seq]` names in layer `layer` of `pool` (`state_len` values); rows of
/// a sequence without one (padding) output zeros. `step(state, rows, advance)` leaves the state
/// after `advance` rows and returns the rows' outputs, `width` each, in order. Returns every
/// row's output, `[rows · width]`. `op` names the op in errors.
pub(super) fn over_sequences(
    op: &str,
    meta: &AttentionMetadata,
    states: &[Option<StateRef>],
    (pool, layer): (&StatePool, usize),
    (state_len, width): (usize, usize),
    step: impl Fn(&mut [f32], &[usize], usize) -> Vec<f32> + Sync,
) -> candle_core::Result<Vec<f32>> {
    let err = |m: String| candle_core::Error::Msg(format!("{op}: {m}"));
    let n = meta.row_seq.len();
    if meta.positions.len() != n {
        return Err(err(format!("{n} rows, {} positions", meta.positions.len())));
    }
    let Some((start, len)) = pool.layer_range(layer) else {
        return Err(err(format!("layer {layer} keeps no state")));
    };
    if len != state_len {
        return Err(err(format!(
            "layer {layer}'s state is {len} values, not {state_len}"
        )));
    }
    let mut by_seq: Vec<Vec<usize>> = vec![Vec::new(); states.len()];
    for (r, &s) in meta.row_seq.iter().enumerate() {
        if let Some(rows) = by_seq.get_mut(s as usize) {
            rows.push(r);
        }
    }
    let outs: Vec<(Vec<usize>, Vec<f32>)> = by_seq
        .into_par_iter()
        .zip(states.par_iter())
        .filter_map(|(rows, state)| Some((rows, (*state)?)).filter(|(rows, _)| !rows.is_empty()))
        .map(|(rows, state)| {
            let out =
                run_sequence(&rows, state, meta, (pool, layer, start, len), &step).map_err(&err)?;
            Ok((rows, out))
        })
        .collect::<candle_core::Result<_>>()?;
    let mut out = vec![0f32; n * width];
    for (rows, o) in outs {
        for (j, &r) in rows.iter().enumerate() {
            out[r * width..(r + 1) * width].copy_from_slice(&o[j * width..(j + 1) * width]);
        }
    }
    Ok(out)
}

/// One sequence's rows over its state: checks their positions and that they continue the
/// state, runs `step`, records what the state has taken in.
fn run_sequence(
    rows: &[usize],
    state: StateRef,
    meta: &AttentionMetadata,
    (pool, layer, start, len): (&StatePool, usize, usize, usize),
    step: &(impl Fn(&mut [f32], &[usize], usize) -> Vec<f32> + Sync),
) -> Result<Vec<f32>, String> {
    let first = meta.positions[rows[0]] as usize;
    for (j, &r) in rows.iter().enumerate() {
        if meta.positions[r] as usize != first + j {
            return Err(format!(
                "row {r} is at position {}, not {} (a sequence's rows run in order)",
                meta.positions[r],
                first + j
            ));
        }
    }
    // A row at position 0 starts from zeros; any other continues its state exactly.
    let continues = |d: &StateData| match d.seen[layer] {
        _ if first == 0 => Ok(false),
        seen if seen == first => Ok(true),
        seen => Err(format!(
            "a row at position {first} continues a state of {seen} tokens"
        )),
    };
    let advance = (state.advance as usize).min(rows.len());
    let slot = |id: u32| pool.get(id).map_err(|e| e.to_string());
    // For each snapshot taken within the rows (after at least one, at most all the state
    // takes in): the rows before it, and where it goes; in order.
    let mut snapshots = state
        .snapshots
        .iter()
        .flatten()
        .filter_map(|s| {
            let before = (s.position as usize).checked_sub(first)?;
            (before > 0 && before <= advance).then_some((before, s.slot))
        })
        .map(|(before, id)| {
            if id == state.write || id == state.read {
                return Err(format!("snapshot slot {id} is the sequence's own state"));
            }
            Ok((before, slot(id)?))
        })
        .collect::<Result<Vec<_>, String>>()?;
    snapshots.sort_by_key(|(before, _)| *before);
    let run = |st: &mut [f32]| -> Vec<f32> {
        let mut out = Vec::new();
        let mut done = 0;
        for (before, snap) in &snapshots {
            if *before > done {
                out.extend(step(st, &rows[done..*before], before - done));
                done = *before;
            }
            let mut d = snap.lock().unwrap_or_else(|e| e.into_inner());
            d.values[start..start + len].copy_from_slice(st);
            d.seen[layer] = first + before;
        }
        if done < rows.len() {
            out.extend(step(st, &rows[done..], advance - done));
        }
        out
    };
    let write = slot(state.write)?;
    if state.read == state.write {
        let mut d = write.lock().unwrap_or_else(|e| e.into_inner());
        let keep = continues(&d)?;
        let st = &mut d.values[start..start + len];
        if !keep {
            st.fill(0.0);
        }
        let out = run(st);
        d.seen[layer] = first + advance;
        return Ok(out);
    }
    let mut st = vec![0f32; len];
    {
        let read = slot(state.read)?;
        let d = read.lock().unwrap_or_else(|e| e.into_inner());
        if continues(&d)? {
            st.copy_from_slice(&d.values[start..start + len]);
        }
    }
    let out = run(&mut st);
    let mut d = write.lock().unwrap_or_else(|e| e.into_inner());
    d.values[start..start + len].copy_from_slice(&st);
    d.seen[layer] = first + advance;
    Ok(out)
}

/// A causal depthwise convolution of `kernel` taps per channel.
pub(super) struct CausalConv<'a> {
    /// `[channels, kernel]`, row-major.
    pub taps: &'a [f32],
    /// Per channel, added after the taps' sum.
    pub bias: Option<&'a [f32]>,
    pub kernel: usize,
    pub channels: usize,
}

impl CausalConv<'_> {
    /// Values of the state it keeps: its last `kernel - 1` inputs.
    pub fn state_len(&self) -> usize {
        (self.kernel - 1) * self.channels
    }

    /// SiLU of the convolution of one sequence's `rows` of `x` (`channels` wide each) over the
    /// inputs before them in `hist` (oldest first); `hist` is left holding the last inputs
    /// after `advance` rows. Each output is one fixed-order sum over the taps.
    pub fn silu(&self, hist: &mut [f32], rows: &[usize], x: &[f32], advance: usize) -> Vec<f32> {
        let (cd, k) = (self.channels, self.kernel);
        let input = |i: isize| -> &[f32] {
            if i >= 0 {
                let r = rows[i as usize];
                &x[r * cd..(r + 1) * cd]
            } else {
                let h = (k as isize - 1 + i) as usize;
                &hist[h * cd..(h + 1) * cd]
            }
        };
        let mut post = vec![0f32; rows.len() * cd];
        post.par_chunks_mut(cd).enumerate().for_each(|(j, y)| {
            let taps: Vec<&[f32]> = (0..k)
                .map(|t| input(j as isize - (k as isize - 1) + t as isize))
                .collect();
            for (c, y) in y.iter_mut().enumerate() {
                let w = &self.taps[c * k..(c + 1) * k];
                let mut acc = 0f32;
                for (wt, x) in w.iter().zip(&taps) {
                    acc += wt * x[c];
                }
                if let Some(b) = self.bias {
                    acc += b[c];
                }
                *y = silu(acc);
            }
        });
        let new_hist: Vec<f32> = (0..k - 1)
            .flat_map(|h| input(advance as isize - (k as isize - 1) + h as isize).to_vec())
            .collect();
        hist.copy_from_slice(&new_hist);
        post
    }
}

/// Runs each head's recurrence over one sequence's `rows` rows, heads in parallel: `heads`
/// holds every head's state, `head_len` values each; `head(h)` makes head `h`'s step, which
/// `step(state, j, out)` advances its state by row `j` and writes the row's `out_width`
/// outputs. Each head's state is left after `advance` rows. Returns the rows' outputs,
/// `[rows, heads · out_width]`, head after head within a row.
pub(super) fn over_heads<S>(
    heads: &mut [f32],
    head_len: usize,
    (rows, advance): (usize, usize),
    out_width: usize,
    head: impl Fn(usize) -> S + Sync,
) -> Vec<f32>
where
    S: FnMut(&mut [f32], usize, &mut [f32]),
{
    let per_head: Vec<Vec<f32>> = heads
        .par_chunks_mut(head_len)
        .enumerate()
        .map(|(h, s)| {
            let mut step = head(h);
            let mut out = vec![0f32; rows * out_width];
            let mut kept: Option<Vec<f32>> = (advance == 0).then(|| s.to_vec());
            for (j, o) in out.chunks_mut(out_width).enumerate() {
                step(s, j, o);
                if j + 1 == advance && advance < rows {
                    kept = Some(s.to_vec());
                }
            }
            if let Some(kept) = kept {
                s.copy_from_slice(&kept);
            }
            out
        })
        .collect();
    let width = per_head.len() * out_width;
    let mut out = vec![0f32; rows * width];
    for (h, o) in per_head.iter().enumerate() {
        for j in 0..rows {
            out[j * width + h * out_width..j * width + (h + 1) * out_width]
                .copy_from_slice(&o[j * out_width..(j + 1) * out_width]);
        }
    }
    out
}
