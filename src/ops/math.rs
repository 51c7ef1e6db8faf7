//! Scalar math the kernels share, written so that every instruction set computes the same bits
//! (separately rounded IEEE operations only), and without libm: a C library's `expf` may differ
//! in the last bit between versions and between the variants glibc picks at run time by CPU.

/// `e^x` for `x` in `[-87, 88]` (Cephes' `expf`: range reduction by ln 2 in two parts, a
/// degree-5 polynomial, scaling by 2^n through the exponent bits); about 1 ulp.
#[inline(always)]
fn exp_in_range(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * (r * r) + r + 1.0;
    y * pow2(n)
}

/// `2^n` for an integer-valued `n` in `[-126, 127]`, through the exponent bits. Adding
/// 2^23 + 127 puts `n + 127` exactly in the low mantissa bits, which the shift moves into the
/// exponent: the bits of `((n as i32 + 127) as u32) << 23` without a float-to-int conversion,
/// whose saturating semantics made the compiler do it lane by lane.
#[inline(always)]
fn pow2(n: f32) -> f32 {
    f32::from_bits((n + 8_388_735.0).to_bits() << 23)
}

/// `e^x` for `x <= 0`; `x < -87` (and -inf; NaN never reaches here) gives 0.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    let y = exp_in_range(x.max(-87.0));
    if x < -87.0 {
        0.0
    } else {
        y
    }
}

/// `silu(x) = x / (e^-x + 1)`, as candle-nn and transformers write it, with the exponential
/// above: past `x < -88`, where `e^-x` leaves the range, it is `+inf` and silu `-0` (the true
/// value is below 1e-36 in magnitude); past `x > 87` it is 0 and silu `x`. NaN stays NaN.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    let t = -x;
    let e = exp_in_range(t.clamp(-87.0, 88.0));
    let e = if t > 88.0 {
        f32::INFINITY
    } else if t < -87.0 {
        0.0
    } else {
        e
    };
    x / (e + 1.0)
}

/// torch's `softplus` (threshold 20): `ln(1 + eˣ)`, `x` itself above 20.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        libm::log1pf(libm::expf(x))
    }
}

/// The logistic function `1 / (1 + e^-x)` with the exponential above, taken of `-|x|` only
/// (`e^x / (1 + e^x)` for negative `x`), so it never overflows. NaN stays NaN.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    let e = exp_nonpositive(-x.abs());
    if x >= 0.0 {
        1.0 / (1.0 + e)
    } else if x < 0.0 {
        e / (1.0 + e)
    } else {
        x
    }
}

/// `tanh x` as `(1 - e) / (1 + e)` with `e = e^{-2|x|}` (the exponential above), signed: no
/// overflow, and an absolute error of a few 1e-8 everywhere (near 0 that is a larger relative
/// error than libm's, which a soft cap `c · tanh(s / c)` scales to a few 1e-8 of `c`). NaN
/// stays NaN.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let e = exp_nonpositive(-2.0 * x.abs());
    let t = ((1.0 - e) / (1.0 + e)).copysign(x);
    if x.is_nan() {
        x
    } else {
        t
    }
}

/// GELU in its tanh form (transformers' `gelu_pytorch_tanh`, PyTorch's
/// `gelu(approximate="tanh")`): `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`, computed as
/// `x · σ(2u)` with [`sigmoid`]: the same function (`(1 + tanh u) / 2 = σ(2u)`) without tanh's
/// cancellation against -1 in the negative tail, and without libm. Past `|x| ≈ 10^13` the cube
/// overflows and the result is `x` or `-0`, the limits. NaN stays NaN.
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    /// 2√(2/π).
    const TWO_BETA: f32 = 1.595_769_2;
    x * sigmoid(TWO_BETA * (x + 0.044_715 * (x * x * x)))
}

/// The bf16 nearest to `x` (round to nearest, ties to even; denormals rounded like any other
/// value, not flushed; a NaN stays a NaN of the same sign, made quiet), as its bits. Integer
/// operations only, so every CPU gives the same bits; the same definition as the `half` crate's
/// `bf16::from_f32`, which candle's f32 → bf16 conversion uses.
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if b & 0x7fff_ffff > 0x7f80_0000 {
        return ((b >> 16) | 0x0040) as u16;
    }
    // Adds half an ulp of the bf16 minus one, plus the lowest kept bit: ties go to even.
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The f32 value of bf16 bits: exact (a bf16 is an f32 with the low 16 bits zero).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pow2_equals_the_integer_exponent_construction() {
        for n in -126..=127 {
            let want = f32::from_bits(((n + 127) as u32) << 23);
            assert_eq!(pow2(n as f32).to_bits(), want.to_bits(), "2^{n}");
        }
    }

    #[test]
    fn sigmoid_is_within_a_few_ulp_of_f64_and_saturates_cleanly() {
        let mut worst = 0f64;
        for i in -200_000..=200_000 {
            let x = i as f32 * 5e-4; // -100 .. 100
            let want = 1.0 / (1.0 + (-f64::from(x)).exp());
            let got = f64::from(sigmoid(x));
            if want > 1e-30 {
                worst = worst.max(((got - want) / want).abs());
            }
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
        assert_eq!(sigmoid(1e4), 1.0);
        assert_eq!(sigmoid(-1e4), 0.0);
        assert_eq!(sigmoid(0.0), 0.5);
        assert!(sigmoid(f32::NAN).is_nan());
    }

    #[test]
    fn tanh_is_within_a_few_1e8_of_f64_and_saturates_cleanly() {
        let mut worst = 0f64;
        for i in -200_000..=200_000 {
            let x = i as f32 * 1e-4; // -20 .. 20
            let err = (f64::from(tanh(x)) - f64::from(x).tanh()).abs();
            worst = worst.max(err);
        }
        assert!(worst < 1e-7, "worst absolute error {worst}");
        assert_eq!(tanh(0.0), 0.0);
        assert_eq!(tanh(-0.0).to_bits(), (-0f32).to_bits());
        assert_eq!((tanh(100.0), tanh(-100.0)), (1.0, -1.0));
        assert_eq!((tanh(f32::INFINITY), tanh(f32::NEG_INFINITY)), (1.0, -1.0));
        assert!(tanh(f32::NAN).is_nan());
    }

    #[test]
    fn gelu_tanh_is_within_a_few_ulp_of_f64_and_saturates_cleanly() {
        let two_u = |x: f64| 2.0 * (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
        // The f64 reference in the σ form too: f64's `1 + tanh u` is 0 from u < -19.
        let gelu = |x: f64| x / (1.0 + (-two_u(x)).exp());
        // Relative to the value, per unit of `1 + |2u|`: in the negative tail the value is
        // `x e^{2u}`, and one rounding of `2u` moves it by `|2u|` ulp.
        let mut worst = 0f64;
        for i in -200_000..=200_000 {
            let x = i as f32 * 5e-5; // -10 .. 10
            let (want, got) = (gelu(f64::from(x)), f64::from(gelu_tanh(x)));
            if want.abs() > 1e-30 {
                let err = ((got - want) / want).abs() / (1.0 + two_u(f64::from(x)).abs());
                worst = worst.max(err);
            } else {
                assert!(got.abs() < 1e-30, "gelu_tanh({x}) = {got}, want {want}");
            }
        }
        assert!(
            worst < 5e-7,
            "worst relative error per unit of 1 + |2u|: {worst}"
        );
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert_eq!(gelu_tanh(30.0), 30.0);
        assert_eq!(gelu_tanh(-30.0).to_bits(), (-0f32).to_bits());
        assert_eq!(gelu_tanh(1e20), 1e20);
        assert_eq!(gelu_tanh(-1e20).to_bits(), (-0f32).to_bits());
        assert!(gelu_tanh(f32::NAN).is_nan());
    }

    #[test]
    fn silu_is_within_a_few_ulp_of_f64_over_the_range_and_saturates_cleanly() {
        let mut worst = 0f64;
        for i in -200_000..=200_000 {
            let x = i as f32 * 5e-4; // -100 .. 100
            let want = f64::from(x) / ((-f64::from(x)).exp() + 1.0);
            let got = f64::from(silu(x));
            if want.abs() > 1e-30 {
                worst = worst.max(((got - want) / want).abs());
            } else {
                assert!(got.abs() < 1e-30, "silu({x}) = {got}, want {want}");
            }
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(silu(0.0), 0.0);
        assert_eq!(silu(200.0), 200.0);
        assert_eq!(silu(-200.0).to_bits(), (-0f32).to_bits());
        assert_eq!(silu(f32::INFINITY), f32::INFINITY);
        assert!(silu(f32::NAN).is_nan());
    }
}
