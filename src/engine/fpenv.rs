//! The floating-point environment engine threads compute in.
//!
//! A thread inherits its creator's SSE control word (MXCSR): a caller that switched on
//! flush-to-zero or denormals-are-zero (some numeric libraries do, for speed) would otherwise
//! change how every kernel rounds tiny values, and a deterministic output's bits with it. Every
//! thread that runs the engine's kernels sets the IEEE default itself ([`enter`]): round to
//! nearest, denormals kept, all exceptions masked.

/// MXCSR's power-on value: round to nearest, no flush-to-zero, no denormals-are-zero, every
/// exception masked, no flags.
pub const IEEE_DEFAULT_MXCSR: u32 = 0x1f80;

/// Sets this thread's floating-point environment to the engine's ([`IEEE_DEFAULT_MXCSR`]).
pub fn enter() {
    #[cfg(target_arch = "x86_64")]
    {
        let word = IEEE_DEFAULT_MXCSR;
        // SAFETY: loads a valid MXCSR value (reserved bits zero) from a live local.
        unsafe {
            std::arch::asm!("ldmxcsr [{0}]", in(reg) &word, options(nostack, readonly));
        }
    }
}

/// This thread's control word with the sticky exception flags cleared (`None` where the
/// architecture has none we read).
pub fn control_word() -> Option<u32> {
    #[cfg(target_arch = "x86_64")]
    {
        let mut word: u32 = 0;
        // SAFETY: stores MXCSR into a live local.
        unsafe {
            std::arch::asm!("stmxcsr [{0}]", in(reg) &mut word, options(nostack));
        }
        Some(word & !0x3f)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Sets the given raw control word (tests use it to play a caller in flush-to-zero mode).
///
/// # Safety
/// `word` must be a valid MXCSR value for this CPU (reserved bits zero).
#[cfg(target_arch = "x86_64")]
pub unsafe fn set_control_word(word: u32) {
    // SAFETY: the caller vouches for the value.
    unsafe {
        std::arch::asm!("ldmxcsr [{0}]", in(reg) &word, options(nostack, readonly));
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn enter_restores_ieee_defaults_over_flush_to_zero() {
        std::thread::spawn(|| {
            // FTZ (bit 15) and DAZ (bit 6) on, as a caller might leave them.
            unsafe { set_control_word(IEEE_DEFAULT_MXCSR | 0x8040) };
            assert_eq!(control_word(), Some(IEEE_DEFAULT_MXCSR | 0x8040));
            let tiny = std::hint::black_box(f32::MIN_POSITIVE);
            assert_eq!(tiny * 0.5, 0.0, "flush-to-zero is on");
            enter();
            assert_eq!(control_word(), Some(IEEE_DEFAULT_MXCSR));
            assert!(std::hint::black_box(tiny) * 0.5 > 0.0, "denormal kept");
        })
        .join()
        .expect("thread");
    }
}
