//! Runtime CPU feature dispatch for the hot kernels (the wheel targets baseline x86-64).

use std::sync::OnceLock;

/// The instruction set the CPU kernels run with, detected once. The kernels are written so that
/// every instruction set gives the same bits (no reassociation; FMA wherever the portable code
/// says `mul_add`): this only changes speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuIsa {
    /// AVX-512 F and DQ (every AVX-512 CPU since Skylake-SP and Zen 4; DQ brings the 64-bit
    /// integer multiply the sampler's noise hash uses).
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
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                {
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

    /// Whether this CPU runs `self`: it is [`Self::detect`]'s or a lesser one (a CPU with
    /// AVX-512 runs the AVX2+FMA kernels too).
    pub fn supported(self) -> bool {
        fn rank(isa: CpuIsa) -> u8 {
            match isa {
                CpuIsa::Portable => 0,
                CpuIsa::Avx2Fma => 1,
                CpuIsa::Avx512 => 2,
            }
        }
        rank(self) <= rank(Self::detect())
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
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512dq")
            {
                all.push(CpuIsa::Avx512);
            }
        }
        all
    }
}

/// Defines a kernel compiled for an instruction set chosen at run time: `fn $name(isa, args)`
/// runs `$body` inside a function carrying AVX-512 or AVX2+FMA target features when `isa` asks
/// for them and this CPU has them, and as portable code otherwise (the wheel targets baseline
/// x86-64, so without this a loop is SSE2 code). Only separately rounded IEEE operations go in a
/// body, never reassociation, so every instruction set gives the same bits (callers pass
/// [`CpuIsa::detect`]; tests pass each of [`CpuIsa::available`] to check that). Call it from
/// inside a rayon task: a rayon closure is compiled for the baseline, whatever its caller's
/// features.
macro_rules! isa_kernel {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident($isa:ident: CpuIsa $(, $arg:ident: $ty:ty)* $(,)?) $(-> $ret:ty)?
        $body:block
    ) => {
        $(#[$attr])*
        $vis fn $name($isa: $crate::ops::CpuIsa $(, $arg: $ty)*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
            unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }

            match $isa {
                // SAFETY: this CPU has the instruction set (checked in the guard).
                #[cfg(target_arch = "x86_64")]
                $crate::ops::CpuIsa::Avx512 if $isa.supported() => unsafe { avx512($($arg),*) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                $crate::ops::CpuIsa::Avx2Fma if $isa.supported() => unsafe { avx2($($arg),*) },
                _ => body($($arg),*),
            }
        }
    };
}
pub(crate) use isa_kernel;
