//! Instruction-set tiers and run-time dispatch.
//!
//! A plain `cargo build --release` targets baseline x86-64, so fast kernels are
//! compiled with `#[target_feature]` and chosen at run time. The choice is made
//! once ([`Isa::active`]) and can be forced lower with `EMBER_ISA=scalar`, which
//! is how the test suite exercises every tier on one machine.

use std::sync::OnceLock;

/// A tier of kernels. Higher tiers imply the features of lower ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust; the specification every other tier is tested against.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C (Haswell and later, Zen and later).
    Avx2,
    /// AVX2 plus AVX-512F (Skylake-SP and later, Zen 4 and later). Used where
    /// arithmetic bounds the work (prefill's matrix products); memory-bound
    /// kernels run their AVX2 versions, which already saturate the bus.
    Avx512,
    /// AVX-512 plus AMX-BF16 tiles (Sapphire Rapids and later), granted by
    /// the OS. Used for prefill's products over BF16/F16 weights ([`crate::amx`]).
    Amx,
}

impl Isa {
    /// All tiers, lowest first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Amx];

    /// The name used by `EMBER_ISA`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Amx => "amx",
        }
    }

    /// Parses an `EMBER_ISA` value.
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|isa| isa.name().eq_ignore_ascii_case(name.trim()))
    }

    /// Whether this CPU can run the tier.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => avx2_supported(),
            Isa::Avx512 => avx2_supported() && avx512_supported(),
            Isa::Amx => avx2_supported() && avx512_supported() && crate::amx::supported(),
        }
    }

    /// The best tier this CPU supports.
    pub fn detect() -> Isa {
        Isa::ALL.into_iter().rev().find(|isa| isa.is_supported()).unwrap_or(Isa::Scalar)
    }

    /// Every tier this CPU supports, lowest first.
    pub fn supported() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }

    /// The tier the dispatching kernels use: `EMBER_ISA` if set to a supported
    /// tier, else the best one detected. Decided once per process.
    pub fn active() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let best = Isa::detect();
            match std::env::var("EMBER_ISA").ok().as_deref().and_then(Isa::from_name) {
                // A forced tier never goes above what the CPU has.
                Some(forced) if forced <= best => forced,
                _ => best,
            }
        })
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_supported() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_supported() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512_supported() -> bool {
    is_x86_feature_detected!("avx512f")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_supported() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for isa in Isa::ALL {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
        }
        assert_eq!(Isa::from_name("AVX2"), Some(Isa::Avx2));
        assert_eq!(Isa::from_name("neon"), None);
    }

    #[test]
    fn active_is_supported() {
        assert!(Isa::active().is_supported());
        assert!(Isa::supported().contains(&Isa::Scalar));
    }
}
