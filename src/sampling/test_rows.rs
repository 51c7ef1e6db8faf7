//! Rows of logits for the sampler's property tests.

/// Sets every `every`-th logit to `-inf` (none for 0), as structured outputs and filters mask.
pub(crate) fn mask_every(logits: &mut [f32], every: usize) {
    if every > 0 {
        for l in logits.iter_mut().step_by(every) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Small integers as logits, `scale` apart: many ties, with 0 as -0 and 1 as +0 (equal under
/// `==`, apart under `total_cmp`, the order the filters rank by).
pub(crate) fn tied_logits(values: &[i32], scale: f32) -> Vec<f32> {
    values
        .iter()
        .map(|&v| match v {
            0 => -0.0,
            1 => 0.0,
            _ => v as f32 * scale,
        })
        .collect()
}
