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
