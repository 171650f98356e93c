//! The CPU-feature table: what this processor can run, detected once, and the
//! kernel tier chosen from it.
//!
//! A plain `cargo build --release` targets baseline x86-64, so fast kernels
//! are compiled with `#[target_feature]` and chosen at run time:
//!
//! 1. [`Features`] are detected once per process (CPUID through
//!    `is_x86_feature_detected!`; AMX also asks Linux for the tile state).
//! 2. `EMBER_ISA` masks that set: a tier name (`scalar`, `avx2`, `avxvnni`,
//!    `avx512`, `avx512vnni`, `avx512bf16`, `amx`) keeps only that tier's
//!    features, a comma-separated list of feature names (`avx2,fma,f16c`)
//!    keeps those. The test suite runs once per tier this way.
//! 3. The best [`Tier`] whose [`Tier::requires`] the masked set covers becomes
//!    the active [`Isa`]: the last such tier of [`Tier::ALL`].
//!
//! Tiers do not strictly nest: AVX-VNNI (256-bit `vpdpbusd`, Alder Lake and
//! later Intel clients) is not part of the AVX-512 tiers, whose own VNNI is
//! AVX512-VNNI. Every tier above scalar has the AVX2 tier's features, every
//! AVX-512 tier AVX-512F's and AVX-512BW's, and the AVX-512 tiers with more
//! instructions nest (`avx512vnni` ⊂ `avx512bf16` ⊂ `amx`).
//!
//! An [`Isa`] can only be obtained from that detection ([`Isa::active`],
//! [`Isa::get`], [`Isa::supported`], [`Isa::scalar`]), never built from a tier
//! name, so safe code cannot run an instruction the CPU lacks:
//!
//! ```compile_fail
//! use ember_kernels::cpu::{Isa, Tier};
//! let isa = Isa { tier: Tier::Amx }; // private: only detection makes one
//! ```
//!
//! Each kernel table (a weight format's row in [`crate::formats`], the
//! prefill micro-kernels in [`crate::matmul`](mod@crate::matmul), the vector kernels in
//! [`crate::dot`]) matches on [`Tier`] exhaustively, without a wildcard: a new
//! tier does not compile until every table says which kernels it runs. The
//! VNNI tiers add one instruction, which only the integer prefill products
//! use ([`crate::gemm_int8`]); every other table gives them the kernels of the
//! tier they build on (`avx2`, `avx512`).

use std::sync::OnceLock;

/// A set of CPU features, as bits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Features(u32);

impl Features {
    /// No features.
    pub const NONE: Features = Features(0);
    /// AVX2 (256-bit integer and float vectors).
    pub const AVX2: Features = Features(1 << 0);
    /// Fused multiply-add (FMA3).
    pub const FMA: Features = Features(1 << 1);
    /// F16 ↔ f32 conversions (F16C).
    pub const F16C: Features = Features(1 << 2);
    /// AVX-512 Foundation (512-bit vectors, mask registers).
    pub const AVX512F: Features = Features(1 << 3);
    /// AVX-512 byte and word instructions.
    pub const AVX512BW: Features = Features(1 << 4);
    /// AVX-512 instructions on 128- and 256-bit vectors.
    pub const AVX512VL: Features = Features(1 << 5);
    /// BF16 dot products (`vdpbf16ps`) and conversions.
    pub const AVX512_BF16: Features = Features(1 << 6);
    /// Byte dot products into i32 on AVX-512 vectors (`vpdpbusd`).
    pub const AVX512_VNNI: Features = Features(1 << 7);
    /// Byte dot products into i32 on 256-bit vectors, VEX-encoded (AVX-VNNI).
    pub const AVX_VNNI: Features = Features(1 << 8);
    /// AMX tile registers (and the OS allowing their state).
    pub const AMX_TILE: Features = Features(1 << 9);
    /// AMX BF16 tile products.
    pub const AMX_BF16: Features = Features(1 << 10);
    /// AMX INT8 tile products.
    pub const AMX_INT8: Features = Features(1 << 11);

    /// Every feature with its `EMBER_ISA` name.
    pub const NAMED: [(&'static str, Features); 12] = [
        ("avx2", Features::AVX2),
        ("fma", Features::FMA),
        ("f16c", Features::F16C),
        ("avx512f", Features::AVX512F),
        ("avx512bw", Features::AVX512BW),
        ("avx512vl", Features::AVX512VL),
        ("avx512bf16", Features::AVX512_BF16),
        ("avx512vnni", Features::AVX512_VNNI),
        ("avxvnni", Features::AVX_VNNI),
        ("amx-tile", Features::AMX_TILE),
        ("amx-bf16", Features::AMX_BF16),
        ("amx-int8", Features::AMX_INT8),
    ];

    /// The features in either set.
    pub const fn union(self, other: Features) -> Features {
        Features(self.0 | other.0)
    }

    /// The features in both sets.
    pub const fn intersection(self, other: Features) -> Features {
        Features(self.0 & other.0)
    }

    /// Whether every feature of `other` is in `self`.
    pub const fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }

    /// What this processor has (and, for AMX, what the OS granted). Detected
    /// once per process.
    pub fn detected() -> Features {
        static DETECTED: OnceLock<Features> = OnceLock::new();
        *DETECTED.get_or_init(detect)
    }

    /// Parses an `EMBER_ISA` value: a tier name (its required features) or a
    /// comma-separated list of feature names.
    pub fn parse_mask(s: &str) -> Option<Features> {
        let s = s.trim();
        if let Some(tier) = Tier::ALL.into_iter().find(|t| t.name().eq_ignore_ascii_case(s)) {
            return Some(tier.requires());
        }
        s.split(',').try_fold(Features::NONE, |acc, name| {
            let name = name.trim();
            Features::NAMED.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|&(_, f)| acc.union(f))
        })
    }
}

impl std::ops::BitOr for Features {
    type Output = Features;
    fn bitor(self, other: Features) -> Features {
        self.union(other)
    }
}

impl std::fmt::Debug for Features {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = Features::NAMED.iter().filter(|(_, v)| self.contains(*v)).map(|(n, _)| *n).collect();
        write!(f, "{{{}}}", names.join(","))
    }
}

/// A tier of kernels: a named set of features that kernels are written for.
/// [`Tier::ALL`] lists them from worst to best; they do not all nest (see the
/// module docs), so tiers are not ordered by value: ask
/// [`Tier::requires`] what one has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Portable Rust; the specification every other tier is tested against.
    Scalar,
    /// AVX2, FMA and F16C (Haswell and later, Zen and later).
    Avx2,
    /// AVX2 plus AVX-VNNI (Alder Lake and later Intel clients; Zen 5 and
    /// Sapphire Rapids have it too, but run the AVX-512 tiers):
    /// `vpdpbusd` on 256-bit registers for the integer prefill products
    /// ([`crate::gemm_int8`]); everything else runs the AVX2 kernels.
    AvxVnni,
    /// AVX2 plus AVX-512F and AVX-512BW (Skylake-SP and later, Zen 4 and
    /// later: every AVX-512 CPU but Xeon Phi, whose Knights Landing lacks BW
    /// and so runs `avx2`). Used where arithmetic bounds the work (prefill's
    /// matrix products; BW for the byte and word products of
    /// [`crate::gemm_int8`]); memory-bound kernels run their AVX2 versions,
    /// which already saturate the bus.
    Avx512,
    /// AVX-512 plus AVX512-VNNI (Cascade Lake, Ice Lake): `vpdpbusd` on
    /// 512-bit registers for the integer prefill products
    /// ([`crate::gemm_int8`]); everything else runs the AVX-512 kernels.
    Avx512Vnni,
    /// AVX512-VNNI plus AVX512-BF16 (Cooper Lake, Sapphire Rapids and later,
    /// Zen 4 and later): `vdpbf16ps` multiplies BF16 pairs at twice the f32
    /// FMA's rate, used by prefill's products over BF16 weights at
    /// [`Precision::Fast`](crate::matmul::Precision) ([`crate::gemm_bf16`]).
    Avx512Bf16,
    /// The AVX512-BF16 tier plus AMX-BF16 tiles (Sapphire Rapids and later),
    /// granted by the OS. Used for prefill's products ([`crate::amx`]).
    Amx,
}

impl Tier {
    /// All tiers, worst first: of the tiers a CPU covers, the last is the
    /// one it runs. AVX-VNNI comes before AVX-512: a CPU with both runs
    /// AVX-512's wider f32 kernels (and, realistically, has AVX512-VNNI too).
    pub const ALL: [Tier; 7] =
        [Tier::Scalar, Tier::Avx2, Tier::AvxVnni, Tier::Avx512, Tier::Avx512Vnni, Tier::Avx512Bf16, Tier::Amx];

    /// The name used by `EMBER_ISA` and printed by `ember bench`.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Scalar => "scalar",
            Tier::Avx2 => "avx2",
            Tier::AvxVnni => "avxvnni",
            Tier::Avx512 => "avx512",
            Tier::Avx512Vnni => "avx512vnni",
            Tier::Avx512Bf16 => "avx512bf16",
            Tier::Amx => "amx",
        }
    }

    /// The features this tier's kernels use.
    pub const fn requires(self) -> Features {
        const AVX2: Features = Features::AVX2.union(Features::FMA).union(Features::F16C);
        const AVX512: Features = AVX2.union(Features::AVX512F).union(Features::AVX512BW);
        const AVX512_VNNI: Features = AVX512.union(Features::AVX512_VNNI);
        const AVX512_BF16: Features = AVX512_VNNI.union(Features::AVX512_BF16);
        match self {
            Tier::Scalar => Features::NONE,
            Tier::Avx2 => AVX2,
            Tier::AvxVnni => AVX2.union(Features::AVX_VNNI),
            Tier::Avx512 => AVX512,
            Tier::Avx512Vnni => AVX512_VNNI,
            Tier::Avx512Bf16 => AVX512_BF16,
            Tier::Amx => AVX512_BF16.union(Features::AMX_TILE).union(Features::AMX_BF16),
        }
    }

    /// The best tier a feature set runs: the last of [`Tier::ALL`] it covers.
    fn best_for(features: Features) -> Tier {
        Tier::ALL.into_iter().rev().find(|t| features.contains(t.requires())).unwrap_or(Tier::Scalar)
    }
}

/// Permission to run a tier's kernels: proof that this CPU has the tier's
/// features. Made only by detection, so it can be passed to safe functions.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Isa {
    tier: Tier,
}

impl std::fmt::Debug for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.tier.name())
    }
}

impl Isa {
    /// The portable tier, which every CPU runs.
    pub const fn scalar() -> Isa {
        Isa { tier: Tier::Scalar }
    }

    /// `tier`, if this CPU has its features (ignoring `EMBER_ISA`).
    pub fn get(tier: Tier) -> Option<Isa> {
        Features::detected().contains(tier.requires()).then_some(Isa { tier })
    }

    /// Every tier this CPU runs, lowest first (ignoring `EMBER_ISA`).
    pub fn supported() -> Vec<Isa> {
        Tier::ALL.into_iter().filter_map(Isa::get).collect()
    }

    /// The features kernels may use: those detected, masked by `EMBER_ISA`.
    /// Decided once per process.
    pub fn features() -> Features {
        static MASKED: OnceLock<Features> = OnceLock::new();
        *MASKED.get_or_init(|| {
            let mask = std::env::var("EMBER_ISA").ok().and_then(|v| Features::parse_mask(&v));
            let detected = Features::detected();
            mask.map_or(detected, |m| detected.intersection(m))
        })
    }

    /// The tier the dispatching kernels use: the best one [`Isa::features`]
    /// covers. Decided once per process.
    pub fn active() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| Isa { tier: Tier::best_for(Isa::features()) })
    }

    /// The tier this `Isa` proves the CPU runs.
    pub fn tier(self) -> Tier {
        self.tier
    }

    /// The tier's name (`avx2`, `avx512bf16`, ...).
    pub fn name(self) -> &'static str {
        self.tier.name()
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Features {
    let mut f = Features::NONE;
    macro_rules! check {
        ($($name:tt => $flag:ident),*) => {
            $(if is_x86_feature_detected!($name) {
                f = f | Features::$flag;
            })*
        };
    }
    check!("avx2" => AVX2, "fma" => FMA, "f16c" => F16C, "avx512f" => AVX512F, "avx512bw" => AVX512BW,
           "avx512vl" => AVX512VL, "avx512bf16" => AVX512_BF16, "avx512vnni" => AVX512_VNNI, "avxvnni" => AVX_VNNI);
    f | detect_amx()
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Features {
    Features::NONE
}

/// AMX is found with CPUID like the rest, but its 8 KB of tile state must also
/// be enabled by the OS (XCR0) and granted to this process (Linux's
/// `ARCH_REQ_XCOMP_PERM`, once per process).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect_amx() -> Features {
    use std::arch::x86_64::{__cpuid_count, _xgetbv};
    let edx = __cpuid_count(7, 0).edx;
    let bit = |b: u32, f: Features| if edx & (1 << b) != 0 { f } else { Features::NONE };
    let amx = bit(22, Features::AMX_BF16) | bit(24, Features::AMX_TILE) | bit(25, Features::AMX_INT8);
    let osxsave = __cpuid_count(1, 0).ecx & (1 << 27) != 0;
    if !amx.contains(Features::AMX_TILE) || !osxsave {
        return Features::NONE;
    }
    // SAFETY: OSXSAVE is set, so XGETBV is enabled.
    let xcr0 = unsafe { _xgetbv(0) };
    // XTILECFG (bit 17) and XTILEDATA (bit 18) must be OS-enabled.
    if xcr0 & (0b11 << 17) != 0b11 << 17 {
        return Features::NONE;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    let granted = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 };
    if granted {
        amx
    } else {
        Features::NONE
    }
}

#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn detect_amx() -> Features {
    Features::NONE
}

/// Whether the mat-vec kernels of decoding prefetch each row stream ahead
/// of where they read, in software ([`crate::formats`]' `PREFETCH_AHEAD`
/// for the block types, 4 KB for BF16/F16/F32), or leave the streams to the
/// hardware prefetchers. Which is faster depends on the microarchitecture,
/// not on feature flags:
///
/// - on Intel (Emerald Rapids, the model-167 Xeon) the software prefetches
///   were measured to help: INT4 rows at 86–89% of a plain read without a
///   prefetch of every line, 90–96% with;
/// - on AMD Zen 4 they hold the streams back: tg64 with and without,
///   alternated, 2 threads, BF16 1.23× faster without (7 of 8 pairs), INT8
///   1.05× (8 of 8), INT4 1.03× (7 of 10).
///
/// So AMD CPUs leave the streams to the hardware and every other CPU
/// prefetches (Zen 3 and Zen 5 are assumed to behave as Zen 4: not yet
/// measured). `EMBER_PREFETCH=on|off` decides instead, to measure either
/// on any CPU. Decided once per process.
#[inline(always)]
pub fn software_prefetch() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    // 0: not decided yet, 1: off, 2: on. A relaxed load, which the kernels
    // make once per row group (not per step: that cost up to 14% in
    // cache); the decision is the same on every thread.
    static DECIDED: AtomicU8 = AtomicU8::new(0);
    #[cold]
    #[inline(never)]
    fn decide() -> bool {
        let on = match std::env::var("EMBER_PREFETCH").as_deref() {
            Ok("on") => true,
            Ok("off") => false,
            _ => !is_amd(),
        };
        DECIDED.store(1 + on as u8, Ordering::Relaxed);
        on
    }
    match DECIDED.load(Ordering::Relaxed) {
        0 => decide(),
        v => v == 2,
    }
}

/// Whether CPUID names AMD as the vendor.
fn is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // The vendor string's twelve bytes, in EBX, EDX, ECX.
        let r = std::arch::x86_64::__cpuid(0);
        [r.ebx, r.edx, r.ecx] == [*b"Auth", *b"enti", *b"cAMD"].map(u32::from_le_bytes)
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Which cache a [`prefetch`] brings lines into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cache {
    L1,
    L2,
}

/// Asks for every cache line of `bytes` to be brought into `into` (a hint;
/// nothing on other architectures).
#[inline]
pub(crate) fn prefetch(bytes: &[u8], into: Cache) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let p = line.as_ptr() as *const i8;
        // SAFETY: a prefetch is a hint that never faults; SSE is baseline
        // on x86-64.
        unsafe {
            match into {
                Cache::L1 => _mm_prefetch::<_MM_HINT_T0>(p),
                Cache::L2 => _mm_prefetch::<_MM_HINT_T1>(p),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bytes, into);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prefetch policy follows the vendor Linux reports (or
    /// `EMBER_PREFETCH`, which `cargo xtask test` sets for a second run of
    /// the kernel tests under the other policy).
    #[test]
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    fn prefetch_policy_follows_the_vendor_or_the_override() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap();
        let vendor =
            cpuinfo.lines().find_map(|l| l.strip_prefix("vendor_id")).map(|v| v.trim_start_matches([' ', '\t', ':']));
        assert_eq!(is_amd(), vendor == Some("AuthenticAMD"), "vendor {vendor:?}");
        let expected = match std::env::var("EMBER_PREFETCH").as_deref() {
            Ok("on") => true,
            Ok("off") => false,
            _ => !is_amd(),
        };
        assert_eq!(software_prefetch(), expected);
        assert_eq!(software_prefetch(), expected, "decided once");
    }

    #[test]
    fn masks_parse() {
        assert_eq!(Features::parse_mask("AVX2"), Some(Tier::Avx2.requires()));
        assert_eq!(Features::parse_mask("scalar"), Some(Features::NONE));
        assert_eq!(Features::parse_mask("avx2, fma"), Some(Features::AVX2 | Features::FMA));
        assert_eq!(Features::parse_mask("neon"), None);
        for t in Tier::ALL {
            assert_eq!(Features::parse_mask(t.name()), Some(t.requires()));
        }
    }

    #[test]
    fn tiers_contain_what_they_build_on() {
        let has = |t: Tier, base: Tier| t.requires().contains(base.requires()) && t.requires() != base.requires();
        for t in Tier::ALL {
            match t {
                Tier::Scalar => assert_eq!(t.requires(), Features::NONE),
                Tier::Avx2 => assert!(has(t, Tier::Scalar)),
                Tier::AvxVnni | Tier::Avx512 => assert!(has(t, Tier::Avx2), "{t:?}"),
                Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => assert!(has(t, Tier::Avx512), "{t:?}"),
            }
        }
        // Every AVX-512 tier multiplies bytes and words (AVX-512BW).
        assert!(Tier::Avx512.requires().contains(Features::AVX512F | Features::AVX512BW));
        // AVX-VNNI is not part of AVX-512, nor the other way round.
        assert!(!Tier::Avx512.requires().contains(Features::AVX_VNNI));
        assert!(!Tier::AvxVnni.requires().contains(Features::AVX512F));
        assert!(has(Tier::Avx512Bf16, Tier::Avx512Vnni) && has(Tier::Amx, Tier::Avx512Bf16));
        // Every tier is the best one for exactly its own features.
        for t in Tier::ALL {
            assert_eq!(Tier::best_for(t.requires()), t);
        }
    }

    #[test]
    fn real_cpus_get_their_tier() {
        let avx2 = Features::AVX2 | Features::FMA | Features::F16C;
        let skylake_sp = avx2 | Features::AVX512F | Features::AVX512BW | Features::AVX512VL;
        let cascade_lake = skylake_sp | Features::AVX512_VNNI;
        let zen4 = cascade_lake | Features::AVX512_BF16;
        let emerald_no_amx = zen4 | Features::AVX_VNNI;
        let sapphire_rapids = emerald_no_amx | Features::AMX_TILE | Features::AMX_BF16 | Features::AMX_INT8;
        for (features, tier) in [
            (Features::NONE, Tier::Scalar),
            (avx2, Tier::Avx2),
            (avx2 | Features::AVX_VNNI, Tier::AvxVnni), // Alder Lake
            (skylake_sp, Tier::Avx512),
            (cascade_lake, Tier::Avx512Vnni),
            (zen4, Tier::Avx512Bf16),
            (emerald_no_amx, Tier::Avx512Bf16),
            (sapphire_rapids, Tier::Amx),
            // AVX-512 without F16C is not an AVX-512 tier (they build on AVX2).
            (Features::AVX512F | Features::AVX512BW | Features::AVX2 | Features::FMA, Tier::Scalar),
            // Knights Landing: AVX-512F without BW (byte and word products),
            // which every AVX-512 tier needs.
            (avx2 | Features::AVX512F, Tier::Avx2),
            (avx2 | Features::AVX512F | Features::AVX512_VNNI | Features::AVX512_BF16, Tier::Avx2),
        ] {
            assert_eq!(Tier::best_for(features), tier, "{features:?}");
        }
    }

    #[test]
    fn a_tier_the_cpu_lacks_cannot_be_had() {
        let detected = Features::detected();
        for tier in Tier::ALL {
            let has = detected.contains(tier.requires());
            assert_eq!(Isa::get(tier).is_some(), has, "{tier:?}");
            assert_eq!(Isa::supported().iter().any(|i| i.tier() == tier), has);
        }
        // The active tier never exceeds what was detected, whatever EMBER_ISA says.
        assert!(detected.contains(Isa::active().tier().requires()));
        assert!(detected.contains(Isa::features()));
        assert!(Isa::supported().contains(&Isa::scalar()));
    }
}
