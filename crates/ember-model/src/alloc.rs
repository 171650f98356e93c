//! Fallible allocation of the large buffers whose size a user chooses (KV
//! caches, logits of many positions, a forward pass's batch buffers): a size
//! the machine cannot hold is an [`Error::OutOfMemory`] naming the buffer and
//! the bytes asked for, never an abort.

use crate::error::{Error, Result};

/// `n` zeroed values, allocated zeroed (untouched pages stay uncommitted
/// until written, as with `vec![0.0; n]`), or an error naming `what`.
pub(crate) fn zeroed<T: bytemuck::Zeroable>(n: usize, what: &'static str) -> Result<Vec<T>> {
    let size = n.checked_mul(std::mem::size_of::<T>()).ok_or(Error::OutOfMemory { what, bytes: usize::MAX })?;
    let oom = Error::OutOfMemory { what, bytes: size };
    if size == 0 {
        let mut v = Vec::new();
        v.resize_with(n, T::zeroed);
        return Ok(v);
    }
    let layout = std::alloc::Layout::array::<T>(n).map_err(|_| Error::OutOfMemory { what, bytes: size })?;
    // SAFETY: `layout` has a non-zero size. A non-null result is `n` values
    // of `T` allocated by the global allocator with `T`'s layout, all bytes
    // zero, which is a valid `T` (`Zeroable`); the Vec takes ownership with
    // that same layout (capacity `n`).
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut T;
        if ptr.is_null() {
            return Err(oom);
        }
        Ok(Vec::from_raw_parts(ptr, n, n))
    }
}

/// Zeroed `f32`s: on the heap ([`zeroed`]), or, from one huge page's worth
/// up where the kernel offers transparent huge pages, in an anonymous
/// mapping asked to be backed by them ([`Floats::huge`]).
pub(crate) enum Floats {
    /// Heap memory (empty until allocated).
    Heap(Vec<f32>),
    /// `len` values from byte `start` (a huge page boundary) of `map`.
    Mapped { map: memmap2::MmapMut, start: usize, len: usize },
}

impl Floats {
    /// `n` zeroed values, in memory backed by transparent huge pages when
    /// they are at least one huge page ([`crate::weights::HUGE_PAGE`]) and
    /// the kernel offers them, else on the heap; an error naming `what`
    /// when the machine cannot hold them. Either way the pages stay
    /// uncommitted until written, a huge page at a time when huge.
    ///
    /// Why: a KV cache is read whole by every decoded token's attention,
    /// one layer at a time, long after the weights streamed since have
    /// evicted it; in 4 KiB pages each of those reads crosses a page, a TLB
    /// miss and a page walk, every 8 positions of a layer (512 bytes of
    /// keys a position at Qwen2.5-0.5B's widths). Measured on a Xeon of
    /// family 6 model 167 (2 threads, INT4, `ember bench -p 0 -n 64,512
    /// --phases`, alternated): attention over 512 decoded tokens 949–970 µs
    /// a token in small pages against 530–572 in huge ones (see the README).
    pub(crate) fn huge(n: usize, what: &'static str) -> Result<Floats> {
        let bytes = n.checked_mul(4).ok_or(Error::OutOfMemory { what, bytes: usize::MAX })?;
        use crate::weights::HUGE_PAGE;
        if bytes < HUGE_PAGE || !crate::weights::transparent_huge_pages() {
            return zeroed(n, what).map(Floats::Heap);
        }
        let (map, start) = crate::weights::huge_page_map(bytes, what)?;
        Ok(Floats::Mapped { map, start, len: n })
    }
}

impl Default for Floats {
    fn default() -> Floats {
        Floats::Heap(Vec::new())
    }
}

impl std::ops::Deref for Floats {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            Floats::Heap(v) => v,
            // An anonymous mapping is page aligned and `start` a multiple of
            // a huge page, so the bytes are aligned for f32 (checked).
            Floats::Mapped { map, start, len } => bytemuck::cast_slice(&map[*start..*start + 4 * *len]),
        }
    }
}

impl std::ops::DerefMut for Floats {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            Floats::Heap(v) => v,
            Floats::Mapped { map, start, len } => bytemuck::cast_slice_mut(&mut map[*start..*start + 4 * *len]),
        }
    }
}

/// Resizes `v` to `n` values (new ones `fill`), reserving fallibly.
pub(crate) fn resize<T: Clone>(v: &mut Vec<T>, n: usize, fill: T, what: &'static str) -> Result<()> {
    if n > v.len() {
        let bytes = n.saturating_mul(std::mem::size_of::<T>());
        v.try_reserve_exact(n - v.len()).map_err(|_| Error::OutOfMemory { what, bytes })?;
    }
    v.resize(n, fill);
    Ok(())
}

/// `a · b · c …` or an error naming `what` when the product overflows.
pub(crate) fn product(factors: &[usize], what: &'static str) -> Result<usize> {
    factors.iter().try_fold(1usize, |p, &f| p.checked_mul(f)).ok_or(Error::OutOfMemory { what, bytes: usize::MAX })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_errors_not_aborts() {
        // More than any machine has: the allocator refuses, we say so.
        let e = zeroed::<f32>(1 << 60, "a test buffer").unwrap_err();
        assert!(matches!(e, Error::OutOfMemory { what: "a test buffer", .. }), "{e}");
        assert!(e.to_string().contains("GiB") || e.to_string().contains("addressed"), "{e}");
        let e = zeroed::<f32>(usize::MAX / 2, "overflow").unwrap_err();
        assert!(e.to_string().contains("more memory than can be addressed"), "{e}");
        assert!(product(&[1 << 40, 1 << 40], "x").is_err());
        let mut v: Vec<f32> = Vec::new();
        // Opaque to the optimiser: LLVM may assume an allocation whose
        // memory is never observed succeeds, and the release build did.
        let huge = std::hint::black_box(usize::MAX / 8);
        assert!(resize(std::hint::black_box(&mut v), huge, 0.0, "logits").is_err());
        assert!(v.is_empty());
    }

    #[test]
    fn buffers_are_zeroed_and_sized() {
        let v = zeroed::<f32>(1000, "t").unwrap();
        assert_eq!(v.len(), 1000);
        assert!(v.iter().all(|&x| x == 0.0));
        assert!(zeroed::<f32>(0, "t").unwrap().is_empty());
        let mut w = vec![1.0f32; 2];
        resize(&mut w, 4, 0.5, "t").unwrap();
        assert_eq!(w, [1.0, 1.0, 0.5, 0.5]);
        resize(&mut w, 1, 0.0, "t").unwrap();
        assert_eq!(w, [1.0]);
    }
}
