//! A memory-read probe: the fastest way to touch every byte of some buffers,
//! to measure the bandwidth ceiling that mat-vec over the same bytes faces.

use crate::cpu::{Isa, Tier};
use crate::pool::{self, ThreadPool};

/// Sums every 8-byte word of `slices` (wrapping), the buffers' bytes split
/// evenly across the pool's threads. The result only keeps the reads from
/// being optimised away.
pub fn read_all(pool: &ThreadPool, slices: &[&[u8]]) -> u64 {
    let total: usize = slices.iter().map(|s| s.len()).sum();
    let isa = Isa::active();
    let sums: Vec<std::sync::atomic::AtomicU64> = (0..pool.threads()).map(|_| Default::default()).collect();
    pool.run(|t, n| {
        // Global byte range of this thread, cut across the slices.
        let (a, b) = pool::share(total, t, n, 4096);
        let mut offset = 0;
        let mut acc = 0u64;
        for s in slices {
            let (lo, hi) = (a.max(offset), b.min(offset + s.len()));
            if lo < hi {
                acc = acc.wrapping_add(sum_words_with(isa, &s[lo - offset..hi - offset]));
            }
            offset += s.len();
        }
        sums[t].store(acc, std::sync::atomic::Ordering::Relaxed);
    });
    sums.iter().map(|s| s.load(std::sync::atomic::Ordering::Relaxed)).fold(0, u64::wrapping_add)
}

/// Wrapping sum of the bytes as little-endian u64 words (a tail shorter than
/// a word is summed byte by byte). Four independent lanes let the compiler
/// vectorise it.
fn sum_words(b: &[u8]) -> u64 {
    let mut lanes = [0u64; 4];
    let mut chunks = b.chunks_exact(32);
    for c in &mut chunks {
        for (i, lane) in lanes.iter_mut().enumerate() {
            *lane = lane.wrapping_add(u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().unwrap()));
        }
    }
    let tail = chunks.remainder().iter().map(|&x| x as u64).fold(0, u64::wrapping_add);
    lanes.iter().fold(tail, |a, &l| a.wrapping_add(l))
}

/// `sum_words` with the given tier.
pub fn sum_words_with(isa: Isa, b: &[u8]) -> u64 {
    match isa.tier() {
        Tier::Scalar => sum_words(b),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier's features are present (`isa` is the proof).
        Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => unsafe {
            sum_words_avx2(b)
        },
        #[cfg(not(target_arch = "x86_64"))]
        Tier::Avx2 | Tier::AvxVnni | Tier::Avx512 | Tier::Avx512Vnni | Tier::Avx512Bf16 | Tier::Amx => {
            unreachable!("x86 tiers are only detected on x86")
        }
    }
}

/// Four streams at once (the buffer cut in four), 32 bytes from each per
/// step, prefetched as the mat-vec kernels' are (the same distance, on the
/// CPUs where [`crate::cpu::software_prefetch`] says it pays): the probe
/// streams at least as well as the kernels it is the ceiling for (one
/// stream alone was measured 10% slower on one core).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(b: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    const AHEAD: usize = 4096;
    let part = b.len() / 4 / 32 * 32;
    let p = b.as_ptr();
    let streams = [p, p.add(part), p.add(2 * part), p.add(3 * part)];
    let mut acc = [_mm256_setzero_si256(); 4];
    let ahead = crate::cpu::software_prefetch();
    let mut i = 0;
    while i < part {
        for (k, a) in acc.iter_mut().enumerate() {
            if ahead && i % 64 == 0 {
                _mm_prefetch::<_MM_HINT_T0>((streams[k] as *const i8).wrapping_add(i + AHEAD));
            }
            *a = _mm256_add_epi64(*a, _mm256_loadu_si256(streams[k].add(i) as *const __m256i));
        }
        i += 32;
    }
    let mut total = sum_words(&b[4 * part..]);
    for a in acc {
        let mut v = [0u64; 4];
        _mm256_storeu_si256(v.as_mut_ptr() as *mut __m256i, a);
        total = v.iter().fold(total, |s, &x| s.wrapping_add(x));
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_byte_once() {
        let a: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let b = vec![1u8; 333];
        let reference = |s: &[&[u8]]| {
            let mut total = 0u64;
            for x in s {
                total = total.wrapping_add(sum_words(x));
            }
            total
        };
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            // Thread boundaries fall on 4096-byte multiples, which are word
            // aligned, so the split sum equals the whole-slice sum.
            assert_eq!(read_all(&pool, &[&a, &b]), reference(&[&a, &b]));
        }
        assert_eq!(sum_words(&[1, 0, 0, 0, 0, 0, 0, 0, 5]), 6);
        // Every tier gives the same sum (integer addition is exact).
        for n in [0, 7, 127, 128, 129, 1000, 4099] {
            let v: Vec<u8> = (0..n as u32).map(|i| (i * 37 % 256) as u8).collect();
            for isa in Isa::supported() {
                assert_eq!(sum_words_with(isa, &v), sum_words(&v), "{isa:?} n={n}");
            }
        }
    }
}
