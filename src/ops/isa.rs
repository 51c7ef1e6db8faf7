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
