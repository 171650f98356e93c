//! The key/value cache: every past position's keys and values, per layer, so
//! each new token attends to the past without recomputing it.

use crate::alloc::{self, Floats};
use crate::error::Result;

/// Keys and values of up to `capacity` positions for each layer.
///
/// Making a cache allocates nothing; its buffers are allocated zeroed by
/// the first forward pass that writes to it ([`KvCache::allocate`]), which
/// is where a size the machine cannot hold becomes an
/// [`Error::OutOfMemory`](crate::Error::OutOfMemory) (the allocator hands
/// back untouched pages, so memory is only committed as positions are
/// written).
///
/// A cache made [`KvCache::in_huge_pages`] asks, from 2 MiB of keys up and
/// where the kernel offers transparent huge pages, for its buffers to be
/// backed by them: attention reads a layer's cache whole every token, and
/// in 4 KiB pages that is a TLB miss every 8 positions of a layer. Memory
/// is then committed 2 MiB at a time, each layer's first 2 MiB of keys and
/// of values with its first position (96 MiB for Qwen2.5-0.5B from 4096
/// positions of capacity up), so it suits one long-lived sequence (a
/// [`State`](crate::advanced::State), a [`Session`](crate::Session) of a
/// model whose weights are in huge pages) and not a server's many caches,
/// whose memory should follow their positions.
pub struct KvCache {
    /// `(layers, capacity, kv_dim)`, empty until allocated.
    keys: Floats,
    /// `(layers, capacity, kv_dim)`, empty until allocated.
    values: Floats,
    layers: usize,
    capacity: usize,
    kv_dim: usize,
    /// Positions filled (the same for every layer between forward passes).
    len: usize,
    /// Whether to allocate in huge pages ([`KvCache::in_huge_pages`]).
    huge: bool,
}

impl Clone for KvCache {
    /// A cache of the same capacity holding the same filled positions; only
    /// those are copied (the rest stays untouched, uncommitted memory). Like
    /// cloning any `Vec`, an allocation failure does not return (it
    /// panics): use [`KvCache::copy_prefix`] to get an error instead.
    fn clone(&self) -> KvCache {
        let mut empty = KvCache { keys: Floats::default(), values: Floats::default(), len: 0, ..*self };
        if !self.keys.is_empty() {
            empty.allocate().expect("memory for a copy of the KV cache");
        }
        self.copy_into(empty, self.len)
    }
}

impl KvCache {
    /// A cache of the same capacity holding the first `len` filled
    /// positions of this one (at most those filled); only they are copied.
    /// An error if the memory for another cache of this capacity is not there.
    pub fn copy_prefix(&self, len: usize) -> Result<KvCache> {
        let mut c = KvCache::new(self.layers, self.capacity, self.kv_dim).in_huge_pages(self.huge);
        if len.min(self.len) > 0 {
            c.allocate()?;
        }
        Ok(self.copy_into(c, len))
    }

    /// Copies the first `len` filled positions into `c`, an empty cache of
    /// the same shape (allocated if any position is copied).
    fn copy_into(&self, mut c: KvCache, len: usize) -> KvCache {
        let len = len.min(self.len);
        let n = len * self.kv_dim;
        // Nothing to copy: `c` may be unallocated.
        let layers = if n > 0 { self.layers } else { 0 };
        for l in 0..layers {
            let start = l * self.capacity * self.kv_dim;
            c.keys[start..start + n].copy_from_slice(&self.keys[start..start + n]);
            c.values[start..start + n].copy_from_slice(&self.values[start..start + n]);
        }
        c.len = len;
        c
    }
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("layers", &self.layers)
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .field("kv_dim", &self.kv_dim)
            .finish()
    }
}

impl KvCache {
    /// An empty cache of `capacity` positions for `layers` layers of
    /// `kv_dim` keys (and as many values) each. Allocates nothing yet.
    pub fn new(layers: usize, capacity: usize, kv_dim: usize) -> KvCache {
        KvCache { keys: Floats::default(), values: Floats::default(), layers, capacity, kv_dim, len: 0, huge: false }
    }

    /// This cache, allocating its buffers in huge pages (`true`) or not
    /// (the default) when it allocates them: see [`KvCache`].
    pub fn in_huge_pages(mut self, yes: bool) -> KvCache {
        self.huge = yes;
        self
    }

    /// Allocates the buffers if they are not yet:
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory) when the machine
    /// cannot hold them (a size that overflows included). Forward passes
    /// call it before writing.
    pub fn allocate(&mut self) -> Result<()> {
        const WHAT: &str = "the KV cache";
        if !self.keys.is_empty() {
            return Ok(());
        }
        let n = alloc::product(&[self.layers, self.capacity, self.kv_dim, 2], WHAT)? / 2;
        let alloc = |n| if self.huge { Floats::huge(n, WHAT) } else { alloc::zeroed(n, WHAT).map(Floats::Heap) };
        let keys = alloc(n)?;
        self.values = alloc(n)?;
        self.keys = keys;
        Ok(())
    }

    /// `(layers, kv_dim)`: the model shape the cache was made for.
    pub fn shape(&self) -> (usize, usize) {
        (self.layers, self.kv_dim)
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn span(&self, layer: usize, pos: usize) -> std::ops::Range<usize> {
        assert!(layer < self.layers && pos < self.capacity);
        let start = (layer * self.capacity + pos) * self.kv_dim;
        start..start + self.kv_dim
    }

    /// Writes the key and value `(kv_dim,)` of position `pos` in `layer`.
    pub fn store(&mut self, layer: usize, pos: usize, key: &[f32], value: &[f32]) {
        let s = self.span(layer, pos);
        self.keys[s.clone()].copy_from_slice(key);
        self.values[s].copy_from_slice(value);
    }

    /// Keys and values `(len, kv_dim)` of positions `0..len` in `layer`.
    pub fn layer(&self, layer: usize, len: usize) -> (&[f32], &[f32]) {
        assert!(len <= self.capacity);
        let start = layer * self.capacity * self.kv_dim;
        let end = start + len * self.kv_dim;
        (&self.keys[start..end], &self.values[start..end])
    }

    /// Marks one more position as filled in every layer.
    pub fn advance(&mut self) {
        assert!(self.len < self.capacity);
        self.len += 1;
    }

    /// Forgets positions from `len` on (their memory is reused).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_and_positions_do_not_overlap() {
        let mut c = KvCache::new(2, 3, 2);
        c.allocate().unwrap();
        c.store(0, 0, &[1.0, 2.0], &[3.0, 4.0]);
        c.store(1, 0, &[5.0, 6.0], &[7.0, 8.0]);
        c.advance();
        c.store(0, 1, &[9.0, 10.0], &[11.0, 12.0]);
        c.advance();
        assert_eq!(c.layer(0, 2), (&[1.0, 2.0, 9.0, 10.0][..], &[3.0, 4.0, 11.0, 12.0][..]));
        assert_eq!(c.layer(1, 1), (&[5.0, 6.0][..], &[7.0, 8.0][..]));
        let copy = c.clone();
        assert_eq!((copy.len(), copy.capacity()), (2, 3));
        assert_eq!(copy.layer(0, 2), c.layer(0, 2));
        assert_eq!(copy.layer(1, 2), c.layer(1, 2));
        let head = c.copy_prefix(1).unwrap();
        assert_eq!((head.len(), head.capacity()), (1, 3));
        assert_eq!(head.layer(0, 1), c.layer(0, 1));
        assert_eq!(head.layer(1, 1), c.layer(1, 1));
        assert_eq!(c.copy_prefix(9).unwrap().len(), 2, "at most what is filled");
        // An empty prefix of any cache needs no memory.
        assert_eq!(KvCache::new(24, 10_000_000_000_000, 128).copy_prefix(5).unwrap().len(), 0);
        c.truncate(1);
        assert_eq!(c.len(), 1);
    }

    /// A cache of several huge pages (in memory backed by them where the
    /// kernel offers them, on the heap otherwise) starts zeroed and keeps
    /// what is stored, copies included.
    #[test]
    fn a_cache_in_huge_pages_behaves_as_one_on_the_heap() {
        let (layers, capacity, kv_dim) = (3, 4096, 128); // 6 MiB of keys
        let mut c = KvCache::new(layers, capacity, kv_dim).in_huge_pages(true);
        c.allocate().unwrap();
        assert!(c.layer(2, capacity).0.iter().chain(c.layer(2, capacity).1).all(|&v| v == 0.0));
        for pos in [0, 1, capacity - 1] {
            for l in 0..layers {
                let k: Vec<f32> = (0..kv_dim).map(|i| (l * 1000 + pos + i) as f32).collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                c.store(l, pos, &k, &v);
            }
        }
        for _ in 0..capacity {
            c.advance();
        }
        let (k, v) = c.layer(1, capacity);
        assert_eq!(k[kv_dim * (capacity - 1) + 5], (1000 + capacity - 1 + 5) as f32);
        assert_eq!(v[kv_dim + 3], -((1000 + 1 + 3) as f32));
        let copy = c.clone();
        assert_eq!(copy.layer(2, capacity), c.layer(2, capacity));
        let head = c.copy_prefix(2).unwrap();
        assert_eq!(head.layer(0, 2), c.layer(0, 2));
    }

    #[test]
    fn a_cache_the_machine_cannot_hold_is_an_error() {
        // 24 layers × 10^13 positions × 128: what `max_position_embeddings`
        // 1e13 with a large context asked for (an abort before).
        let mut c = KvCache::new(24, 10_000_000_000_000, 128);
        let e = c.allocate().unwrap_err();
        assert!(matches!(e, crate::Error::OutOfMemory { what: "the KV cache", .. }), "{e}");
        let e = KvCache::new(1 << 40, 1 << 40, 128).allocate().unwrap_err();
        assert!(e.to_string().contains("more memory than can be addressed"), "{e}");
    }
}
