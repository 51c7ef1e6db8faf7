//! Scalar math the kernels share, written so that every instruction set computes the same bits.

/// `e^x` for `x <= 0` (Cephes' `expf`: range reduction by ln 2 in two parts, a degree-5
/// polynomial, scaling by 2^n through the exponent bits); about 1 ulp. `x < -87` (and -inf,
/// NaN never reaches here) gives 0.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.max(-87.0);
    let n = (xc * LOG2E + 0.5).floor();
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * (r * r) + r + 1.0;
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        y * scale
    }
}
