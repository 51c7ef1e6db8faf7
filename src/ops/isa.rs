//! Runtime CPU feature dispatch for the hot kernels (the wheel targets baseline x86-64).

use std::sync::OnceLock;

/// The instruction set the CPU kernels run with, detected once. The kernels are written so that
/// every instruction set gives the same bits (no reassociation; FMA wherever the portable code
/// says `mul_add`): this only changes speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuIsa {
    Avx512,
    Avx2Fma,
    Portable,
}

impl CpuIsa {
    /// The best instruction set this CPU has.
    pub fn detect() -> Self {
        static ISA: OnceLock<CpuIsa> = OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    return CpuIsa::Avx512;
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    return CpuIsa::Avx2Fma;
                }
            }
            CpuIsa::Portable
        })
    }

    /// Every instruction set this CPU can run (tests compare them bitwise).
    pub fn available() -> Vec<Self> {
        let mut all = vec![CpuIsa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                all.push(CpuIsa::Avx2Fma);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                all.push(CpuIsa::Avx512);
            }
        }
        all
    }
}

/// Defines a slice kernel compiled for the best instruction set of this CPU: `fn $name(args)`
/// runs `$body` inside a function carrying AVX-512 or AVX2+FMA target features when the CPU has
/// them (the wheel targets baseline x86-64, so without this the loop is SSE2 code). Only
/// separately rounded IEEE operations and libm calls go in a body, never reassociation, so every
/// instruction set gives the same bits. Call it from inside a rayon task: a rayon closure is
/// compiled for the baseline, whatever its caller's features.
macro_rules! isa_kernel {
    ($(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$attr])*
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx2,fma")]
            unsafe fn avx512($($arg: $ty),*) {
                body($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) {
                body($($arg),*)
            }

            match $crate::ops::CpuIsa::detect() {
                // SAFETY: `detect` found the instruction set on this CPU.
                #[cfg(target_arch = "x86_64")]
                $crate::ops::CpuIsa::Avx512 => unsafe { avx512($($arg),*) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                $crate::ops::CpuIsa::Avx2Fma => unsafe { avx2($($arg),*) },
                _ => body($($arg),*),
            }
        }
    };
}
pub(crate) use isa_kernel;
