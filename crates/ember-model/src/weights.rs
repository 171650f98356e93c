//! Safetensors weights, memory-mapped.
//!
//! A model is one `model.safetensors` or several shards listed by
//! `model.safetensors.index.json`. Files are mapped with memmap2 and tensors
//! are borrowed from the mapping in their stored precision: a BF16 model is
//! never copied to f32, and pages are read from disk only when first touched.

use crate::error::{Error, Result};
use ember_kernels::parts::{join_columns, split_columns};
use ember_kernels::{ColumnParts, MatRef, WeightType, Weights};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The safetensors metadata key that marks `name` as quantized by ember: its
/// value is the weight type's name (`int8`, `int4`, any quantized row of
/// [`WeightType`]); the tensor is stored as U8 with shape `[rows, bytes per row]`.
pub fn quant_key(name: &str) -> String {
    format!("ember.quant.{name}")
}

/// The file-wide safetensors metadata key that says a file's `int4` tensors
/// are INT4's 128-weight blocks ([`ember_kernels::formats::BlockQ4`]), with
/// the value [`INT4_LAYOUT`]. Files written before INT4 had that layout
/// lack it; their `int4` tensors are ggml's Q4_0 blocks byte for byte (what
/// INT4 was then) and load as [`WeightType::Q4_0`].
pub const INT4_LAYOUT_KEY: &str = "ember.int4";
/// The value of [`INT4_LAYOUT_KEY`]: weights per INT4 block.
pub const INT4_LAYOUT: &str = "128";

/// The safetensors dtype a weight type is stored as: its own name for the
/// float types (`F32`, `BF16`, `F16`), `U8` blocks (with [`quant_key`]
/// metadata) for the block types.
pub fn safetensors_dtype(t: WeightType) -> String {
    if !t.is_float() {
        "U8".into()
    } else {
        t.name().to_uppercase()
    }
}

/// Bytes that live as long as any tensor borrowing them.
enum Storage {
    Mapped(Mmap),
    /// A copy made only when a tensor in the file is misaligned for its type
    /// (each tensor at an aligned place of it: [`aligned_copy`]), or a
    /// quantized matrix. `u32` elements keep it 4-byte aligned, which every
    /// weight type's block needs at most.
    Owned(Vec<u32>),
    /// The weights copied into anonymous memory backed by huge pages
    /// ([`copy_to_huge_pages`]), from byte `base` of the mapping on.
    Huge {
        map: Mmap,
        base: usize,
    },
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => bytemuck::cast_slice(v),
            Storage::Huge { map, base } => &map[*base..],
        }
    }
}

/// A tensor in its stored precision, backed by a mapped file.
#[derive(Clone)]
pub struct Tensor {
    /// Its name in the safetensors file.
    pub name: String,
    /// Its type (a quantized type for ember's INT8/INT4 blocks).
    pub dtype: WeightType,
    /// Its shape in elements.
    pub shape: Vec<usize>,
    storage: Arc<Storage>,
    start: usize,
    len: usize,
    /// How many column parts a matrix is stored in ([`ColumnParts`]): 1
    /// (row-major, as in the file) unless the model laid it out anew.
    parts: usize,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({} {} {:?})", self.name, self.dtype, self.shape)
    }
}

impl Tensor {
    /// The raw stored bytes: row-major as in the file, or in column parts
    /// where the model laid a matrix out for decoding ([`Tensor::parts`];
    /// [`Tensor::row_major_bytes`] either way).
    pub fn as_bytes(&self) -> &[u8] {
        &self.storage.bytes()[self.start..self.start + self.len]
    }

    /// Elements: the product of the shape.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The data as kernel weights, borrowed (no copy), in the stored layout
    /// ([`Tensor::as_bytes`]).
    pub fn weights(&self) -> Weights<'_> {
        // Length and alignment were checked (or fixed by copying) when the
        // file was opened.
        Weights::from_bytes(self.dtype, self.as_bytes()).expect("data checked at load")
    }

    /// A 2-D tensor stored row-major as a matrix `(shape[0], shape[1])`.
    /// Panics if it is not a matrix or is stored in column parts (a bug:
    /// only the products that read [`Tensor::parts`] get those).
    pub fn matrix(&self) -> MatRef<'_> {
        assert_eq!(self.shape.len(), 2, "{} is not a matrix", self.name);
        assert_eq!(self.parts, 1, "{} is stored in column parts", self.name);
        MatRef::new(self.weights(), self.shape[0], self.shape[1])
    }

    /// A 2-D tensor as a matrix `(shape[0], shape[1])` in the column parts it
    /// is stored in (one part: row-major). Panics if it is not a matrix.
    pub fn parts(&self) -> ColumnParts<'_> {
        assert_eq!(self.shape.len(), 2, "{} is not a matrix", self.name);
        ColumnParts::new(self.weights(), self.shape[0], self.shape[1], self.parts)
    }

    /// The bytes in the file's row-major layout: borrowed, or gathered from
    /// the column parts.
    pub fn row_major_bytes(&self) -> std::borrow::Cow<'_, [u8]> {
        if self.parts == 1 {
            return std::borrow::Cow::Borrowed(self.as_bytes());
        }
        let mut out = vec![0u8; self.len];
        join_columns(self.dtype, self.shape[0], self.shape[1], self.parts, self.as_bytes(), &mut out);
        std::borrow::Cow::Owned(out)
    }

    /// The values widened to f32 (for small tensors: norms, biases), in
    /// row-major order.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        if self.parts == 1 {
            return self.weights().to_f32_vec();
        }
        let m = self.parts();
        let mut out = vec![0.0f32; m.rows() * m.cols()];
        for (r, row) in out.chunks_exact_mut(m.cols()).enumerate() {
            m.row_to_f32(r, row);
        }
        out
    }

    /// Bytes of data.
    pub fn size_bytes(&self) -> usize {
        self.len
    }

    /// This matrix rounded to the type `q`, in memory owned by the new
    /// tensor (rows split over the global pool). Panics if it is not a matrix
    /// with rows a whole number of `q`'s blocks: callers check
    /// [`Tensor::can_quantize`].
    pub fn quantize(&self, q: WeightType) -> Tensor {
        assert!(self.can_quantize(), "{} cannot be quantized", self.name);
        let m = self.parts();
        let (rows, cols) = (m.rows(), m.cols());
        assert!(cols.is_multiple_of(q.block_len()), "{}: rows are not whole {q} blocks", self.name);
        let row_bytes = cols / q.block_len() * q.block_bytes();
        let mut owned = vec![0u32; (rows * row_bytes).div_ceil(4)];
        {
            let bytes = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut owned)[..rows * row_bytes];
            let out = ember_kernels::pool::SharedMut::new(bytes);
            ember_kernels::pool::global().run(|t, n| {
                let (a, b) = ember_kernels::pool::share(rows, t, n, 1);
                // One row of f32 per thread, reused.
                let mut row = vec![0.0f32; cols];
                for r in a..b {
                    m.row_to_f32(r, &mut row);
                    // SAFETY: threads take disjoint rows.
                    let dst = unsafe { out.range(r * row_bytes, (r + 1) * row_bytes) };
                    q.quantize_row(&row, dst);
                }
            });
        }
        Tensor {
            name: self.name.clone(),
            dtype: q,
            shape: self.shape.clone(),
            storage: Arc::new(Storage::Owned(owned)),
            start: 0,
            len: rows * row_bytes,
            parts: 1,
        }
    }

    /// A matrix of blocks widened back to F32 (owned): the exact values the
    /// quantized kernels compute with. Float tensors are returned as they are.
    pub fn dequantize(&self) -> Tensor {
        if self.dtype.is_float() {
            return self.clone();
        }
        let values = self.to_f32_vec();
        let owned: Vec<u32> = values.iter().map(|v| v.to_bits()).collect();
        Tensor {
            name: self.name.clone(),
            dtype: WeightType::F32,
            shape: self.shape.clone(),
            len: owned.len() * 4,
            storage: Arc::new(Storage::Owned(owned)),
            start: 0,
            parts: 1,
        }
    }

    /// Whether [`Tensor::quantize`] applies: a float matrix whose rows are
    /// whole blocks of INT8 (32 weights; the policy gives INT8 where a
    /// type's blocks are longer than the rows allow).
    pub fn can_quantize(&self) -> bool {
        let block = WeightType::Int8.block_len();
        self.shape.len() == 2 && self.shape[1].is_multiple_of(block) && self.dtype.is_float()
    }

    /// Whether two tensors are the same bytes (a tied LM head).
    pub fn same_data(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage) && self.start == other.start && self.len == other.len
    }
}

/// Whether the kernel backs anonymous memory with transparent huge pages
/// when asked (`madvise(MADV_HUGEPAGE)`): its setting is `always` or
/// `madvise`, not `never`. Linux only.
pub fn transparent_huge_pages() -> bool {
    cfg!(target_os = "linux")
        && std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| s.contains("[always]") || s.contains("[madvise]"))
}

/// Huge pages are 2 MiB on x86-64 (and the common arm64 setting).
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// An anonymous mapping of at least `bytes` zeroed bytes, asked to be
/// backed by transparent huge pages, and the offset in it of a huge page
/// boundary with `bytes` after it: one huge page more is mapped, as the
/// kernel backs only whole, aligned 2 MiB ranges with a huge page. The
/// advice is only a hint: without it the memory still works, in small
/// pages. An error naming `what` when the machine cannot map it.
pub(crate) fn huge_page_map(bytes: usize, what: &'static str) -> Result<(memmap2::MmapMut, usize)> {
    let total = bytes.checked_add(HUGE_PAGE).ok_or(Error::OutOfMemory { what, bytes: usize::MAX })?;
    let map =
        memmap2::MmapOptions::new().len(total).map_anon().map_err(|_| Error::OutOfMemory { what, bytes: total })?;
    #[cfg(target_os = "linux")]
    {
        let _ = map.advise(memmap2::Advice::HugePage);
    }
    let start = (HUGE_PAGE - map.as_ptr() as usize % HUGE_PAGE) % HUGE_PAGE;
    Ok((map, start))
}

/// Copies the bytes of `tensors` into one anonymous mapping that the kernel
/// is asked to back with transparent huge pages, and points the tensors at
/// the copy. Returns the bytes copied (tensors sharing data, as a tied LM
/// head and embedding do, are copied once and keep sharing).
///
/// Why: decoding streams every weight once a token, and with the file's 4 KiB
/// pages each memory stream of the mat-vec kernels crosses a page (a TLB
/// miss, and a stop for the hardware prefetchers) every 4 KiB; a decoded
/// token's ~100 short mat-vecs each start their streams anew. Measured on
/// Emerald Rapids (2 cores, `avx512bf16`; one process loading the model
/// both ways and alternating them every 32 tokens, medians of 16–30
/// rounds): INT4 54.3 → 56.3 tok/s, INT8 41.2 → 43.2, BF16 23.4 → 24.4
/// (+4–5%). The copy took 0.13–0.15 s for the INT4 model's 0.41 GB (once
/// 0.8 s), and 1.8 s for BF16's 0.99 GB in a one-shot run, most of it the
/// kernel clearing fresh pages (`clear_page_erms`) on that VM.
///
/// Each tensor paired with `true` (a matrix that only products over
/// [`ColumnParts`] read) is laid out in the column parts `policy` chooses
/// for its type and width ([`ember_kernels::parts::parts_for`]: so that a
/// float mat-vec's activations stay in L1).
///
/// On an error (no memory for the copy) the tensors are left as they were.
pub(crate) fn copy_to_huge_pages(
    tensors: &mut [(&mut Tensor, bool)],
    policy: fn(WeightType, usize) -> usize,
) -> Result<usize> {
    // Where each distinct tensor goes (64-byte aligned: a cache line, more
    // than any weight type needs), and which earlier tensor a repeat shares.
    let mut offsets = Vec::with_capacity(tensors.len());
    // The distinct tensors, (index, offset, column parts): what is copied.
    let mut distinct = Vec::with_capacity(tensors.len());
    // Each tensor's column parts after the copy.
    let mut layouts = Vec::with_capacity(tensors.len());
    let mut total = 0usize;
    for (i, (t, split)) in tensors.iter().enumerate() {
        match tensors[..i].iter().position(|(o, _)| o.same_data(t)) {
            Some(j) => {
                offsets.push(offsets[j]);
                layouts.push(layouts[j]);
            }
            None => {
                let at = total.next_multiple_of(64);
                total = at + t.len;
                // Data two tensors share keeps its layout.
                let shared = tensors[i + 1..].iter().any(|(o, _)| o.same_data(t));
                let parts = match *split && !shared && t.shape.len() == 2 && t.parts == 1 {
                    true => policy(t.dtype, t.shape[1]),
                    false => t.parts,
                };
                offsets.push(at);
                layouts.push(parts);
                distinct.push((i, at, parts));
            }
        }
    }
    if total == 0 {
        return Ok(0);
    }
    let (mut map, base) = huge_page_map(total, "the weights' copy in huge pages")?;
    {
        // Split the copy across the pool: it is the page faults (zeroing
        // each huge page) and the reads from the file that take the time.
        let dst = ember_kernels::pool::SharedMut::new(&mut map[base..base + total]);
        let tensors = &*tensors;
        ember_kernels::pool::global().run(|th, n| {
            for (j, &(i, at, parts)) in distinct.iter().enumerate() {
                let t = &tensors[i].0;
                let src = t.as_bytes();
                if parts != t.parts {
                    // Laid out anew: a whole matrix a thread, taking turns.
                    if j % n == th {
                        // SAFETY: distinct tensors have disjoint ranges of
                        // the copy, and one thread writes this one.
                        let out = unsafe { dst.range(at, at + src.len()) };
                        split_columns(t.dtype, t.shape[0], t.shape[1], parts, src, out);
                    }
                    continue;
                }
                let (a, b) = ember_kernels::pool::share(src.len(), th, n, HUGE_PAGE);
                if a < b {
                    // SAFETY: distinct tensors have disjoint ranges of the
                    // copy, and threads disjoint parts of each.
                    unsafe { dst.range(at + a, at + b) }.copy_from_slice(&src[a..b]);
                }
            }
        });
    }
    let oom = |_| Error::OutOfMemory { what: "the weights' copy in huge pages", bytes: total + HUGE_PAGE };
    let map = map.make_read_only().map_err(oom)?;
    let storage = Arc::new(Storage::Huge { map, base });
    for ((t, _), (at, parts)) in tensors.iter_mut().zip(offsets.into_iter().zip(layouts)) {
        t.storage = storage.clone();
        t.start = at;
        t.parts = parts;
    }
    Ok(total)
}

struct Entry {
    file: usize,
    /// Its name in the file when that differs from the HF name it is
    /// looked up by (a GGUF file's llama.cpp names).
    stored_name: Option<String>,
    /// The stored dtype, or its name when ember cannot compute with it.
    dtype: std::result::Result<WeightType, String>,
    shape: Vec<usize>,
    start: usize,
    len: usize,
    /// Whether the model asked for it ([`TensorStore::unused`]).
    used: AtomicBool,
}

impl Entry {
    fn new(
        file: usize,
        stored_name: Option<String>,
        dtype: std::result::Result<WeightType, String>,
        shape: Vec<usize>,
        start: usize,
        len: usize,
    ) -> Entry {
        Entry { file, stored_name, dtype, shape, start, len, used: AtomicBool::new(false) }
    }
}

/// Alignment of each tensor in an [`aligned_copy`]: what a `u32` buffer
/// guarantees, and at least what every weight type's block needs
/// (`alignment_covers_every_type`).
const COPY_ALIGN: usize = std::mem::align_of::<u32>();

/// The tensors `entries` of `map`, each copied to an aligned place of one
/// owned buffer (their `start`s updated to it): for a file whose data is not
/// aligned for its types (a header of odd length, or safetensors' unaligned
/// offsets). Copying the whole file instead would keep the misalignment.
/// The copy is the size of the tensors: no more than the file.
fn aligned_copy<'a>(map: &[u8], entries: impl Iterator<Item = &'a mut Entry>) -> Storage {
    let mut entries: Vec<&mut Entry> = entries.collect();
    entries.sort_by_key(|e| e.start);
    let mut places = Vec::with_capacity(entries.len());
    let mut end = 0usize;
    for e in &entries {
        let at = end.next_multiple_of(COPY_ALIGN);
        places.push(at);
        end = at + e.len;
    }
    let mut owned = vec![0u32; end.div_ceil(4)];
    let bytes = bytemuck::cast_slice_mut::<u32, u8>(&mut owned);
    for (e, at) in entries.into_iter().zip(places) {
        bytes[at..at + e.len].copy_from_slice(&map[e.start..e.start + e.len]);
        e.start = at;
    }
    Storage::Owned(owned)
}

/// Whether a shard named in `model.safetensors.index.json` is a plain file
/// name, so that it can only be a file of the model folder: no folder
/// separator, no `..` or `.`, no root. (A symbolic link in the folder is
/// followed: HuggingFace's cache is made of them.)
fn is_plain_file_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    !name.contains(['/', '\\']) && matches!((parts.next(), parts.next()), (Some(Component::Normal(_)), None))
}

/// Every tensor of a model folder, by name.
pub struct TensorStore {
    files: Vec<(PathBuf, Arc<Storage>)>,
    entries: HashMap<String, Entry>,
    /// Where to say a missing tensor was looked for.
    origin: PathBuf,
    /// Whether the tensors come from a GGUF file (named by llama.cpp's
    /// names in errors).
    gguf: bool,
}

impl std::fmt::Debug for TensorStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorStore")
            .field("origin", &self.origin)
            .field("files", &self.files.len())
            .field("tensors", &self.entries.len())
            .finish()
    }
}

impl TensorStore {
    /// Opens `model.safetensors.index.json` (shards) if present, else
    /// `model.safetensors`, in `dir`.
    pub fn open_dir(dir: &Path) -> Result<TensorStore> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            #[derive(serde::Deserialize)]
            struct Index {
                weight_map: HashMap<String, String>,
            }
            let parsed: Index =
                serde_json::from_str(&text).map_err(|source| Error::Json { path: index.clone(), source })?;
            let mut mapped: Vec<(&String, &String)> = parsed.weight_map.iter().collect();
            mapped.sort();
            if let Some((tensor, shard)) = mapped.into_iter().find(|(_, shard)| !is_plain_file_name(shard)) {
                return Err(Error::ShardName { path: index.clone(), tensor: tensor.clone(), shard: shard.clone() });
            }
            let mut shards: Vec<&String> = parsed.weight_map.values().collect();
            shards.sort();
            shards.dedup();
            let paths: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
            let mut store = TensorStore::open_files(&paths, index.clone())?;
            // Every tensor the index promises must be in the shard it names.
            for (name, shard) in &parsed.weight_map {
                let file = paths.iter().position(|p| p == &dir.join(shard)).expect("listed above");
                match store.entries.get(name) {
                    Some(e) if e.file == file => {}
                    _ => {
                        return Err(Error::MissingTensor { path: dir.join(shard), name: name.clone() });
                    }
                }
            }
            store.origin = index;
            Ok(store)
        } else if single.is_file() {
            TensorStore::open_files(std::slice::from_ref(&single), single.clone())
        } else {
            Err(Error::MissingWeights { dir: dir.to_path_buf() })
        }
    }

    /// Opens and validates the given safetensors files.
    pub fn open_files(paths: &[PathBuf], origin: PathBuf) -> Result<TensorStore> {
        let mut files = Vec::new();
        let mut entries = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file = File::open(path).map_err(|e| Error::io(path, e))?;
            // SAFETY: the mapping is read-only; a file truncated underneath a
            // running model is outside what any mmap-based loader can defend.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
            let bad = |message: String| Error::Safetensors { path: path.clone(), message };
            let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| bad(describe(&e, &map)))?;
            let data_start = 8 + header_len;
            let mut misaligned = false;
            let extra = meta.metadata().clone().unwrap_or_default();
            let int4_blocks = match extra.get(INT4_LAYOUT_KEY).map(String::as_str) {
                None => false,
                Some(INT4_LAYOUT) => true,
                Some(other) => {
                    return Err(bad(format!(
                        "metadata `{INT4_LAYOUT_KEY}` = `{other}`: this ember reads INT4 blocks of {INT4_LAYOUT} \
                         weights only (a file from a newer ember?)"
                    )))
                }
            };
            let tensors = meta.tensors();
            // Every `ember.quant.*` key names a tensor of this file.
            let mut keys: Vec<&String> = extra.keys().collect();
            keys.sort();
            for key in keys {
                if key.strip_prefix("ember.quant.").is_some_and(|name| !tensors.contains_key(name)) {
                    return Err(bad(format!("metadata `{key}` names no tensor of this file")));
                }
            }
            let mut here = Vec::with_capacity(tensors.len());
            for (name, info) in tensors {
                let mut shape = info.shape.clone();
                let dtype = match (info.dtype, extra.get(&quant_key(&name))) {
                    (Dtype::U8, Some(format)) => {
                        let q = WeightType::from_name(format)
                            .filter(|q| !q.is_float())
                            .ok_or_else(|| bad(format!("tensor `{name}`: unknown ember format `{format}`")))?;
                        // INT4 before its 128-weight blocks: Q4_0's bytes.
                        let q = if q == WeightType::Int4 && !int4_blocks { WeightType::Q4_0 } else { q };
                        // Stored as [rows, bytes per row]; the logical shape
                        // is [rows, weights per row].
                        if shape.len() != 2 || shape[1] % q.block_bytes() != 0 {
                            return Err(bad(format!(
                                "tensor `{name}`: {format} data of shape {shape:?} (expected [rows, a multiple of {} bytes])",
                                q.block_bytes()
                            )));
                        }
                        shape[1] = shape[1] / q.block_bytes() * q.block_len();
                        Ok(q)
                    }
                    (other, Some(format)) => {
                        return Err(bad(format!(
                            "tensor `{name}` is marked `{}` = `{format}` but stored as {other:?}; ember's quantized \
                             blocks are stored as U8 (a corrupt or edited file?)",
                            quant_key(&name)
                        )));
                    }
                    // Float types carry their safetensors name (F32, BF16,
                    // F16); anything else is only an error if the model asks
                    // for this tensor.
                    (other, _) => {
                        let name = format!("{other:?}");
                        WeightType::from_name(&name).filter(|t| safetensors_dtype(*t) == name).ok_or(name)
                    }
                };
                let (a, b) = info.data_offsets;
                let start = data_start + a;
                misaligned |= dtype.as_ref().is_ok_and(|d| start % d.align() != 0);
                if entries.contains_key(&name) {
                    return Err(bad(format!("tensor `{name}` appears in more than one file")));
                }
                here.push(name.clone());
                entries.insert(name, Entry::new(i, None, dtype, shape, start, b - a));
            }
            let storage = if misaligned {
                // Rare (writers pad the header to 8 bytes and align every
                // tensor): copy the tensors into aligned memory rather than
                // read unaligned floats.
                let mut mine: std::collections::HashSet<&String> = here.iter().collect();
                aligned_copy(&map, entries.iter_mut().filter(|(n, _)| mine.remove(n)).map(|(_, e)| e))
            } else {
                Storage::Mapped(map)
            };
            files.push((path.clone(), Arc::new(storage)));
        }
        Ok(TensorStore { files, entries, origin, gguf: false })
    }

    /// The tensors of a GGUF file, looked up by their HuggingFace names
    /// (`blk.0.attn_q.weight` as `model.layers.0.self_attn.q_proj.weight`)
    /// with shapes rows first (GGUF's dimensions reversed), borrowed from the
    /// file's map. Tensors of types ember does not compute with are an error
    /// only when asked for.
    pub fn open_gguf(g: crate::gguf::Gguf) -> Result<TensorStore> {
        let mut entries = HashMap::new();
        let mut misaligned = false;
        for (hf, t) in crate::gguf::hf_names(&g) {
            let dtype = t.ty.weight_type().ok_or_else(|| t.ty.name().to_string());
            let start = (g.header.data_start + t.offset) as usize;
            misaligned |= dtype.as_ref().is_ok_and(|d| !start.is_multiple_of(d.align()));
            let entry = Entry::new(0, Some(t.name.clone()), dtype, t.shape(), start, t.size as usize);
            if entries.insert(hf.clone(), entry).is_some() {
                return Err(Error::Gguf { path: g.path.clone(), message: format!("two tensors are both `{hf}`") });
            }
        }
        let storage = if misaligned {
            // Only with a `general.alignment` below a type's own alignment.
            aligned_copy(&g.map, entries.values_mut())
        } else {
            Storage::Mapped(g.map)
        };
        Ok(TensorStore { files: vec![(g.path.clone(), Arc::new(storage))], entries, origin: g.path, gguf: true })
    }

    /// A tensor's name in the file, for messages.
    pub(crate) fn display_name(&self, name: &str) -> String {
        match self.entries.get(name).and_then(|e| e.stored_name.clone()) {
            Some(n) => n,
            None if self.gguf => crate::gguf::gguf_name(name),
            None => name.into(),
        }
    }

    /// Names of all tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(|s| s.as_str())
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The tensors never asked for ([`TensorStore::get`]), sorted: after a
    /// model is taken from the store, those it does not use.
    pub fn unused(&self) -> Vec<&str> {
        let mut names: Vec<&str> =
            self.entries.iter().filter(|(_, e)| !e.used.load(Ordering::Relaxed)).map(|(n, _)| n.as_str()).collect();
        names.sort_unstable();
        names
    }

    /// The file that holds tensor `name` (the index or GGUF file if none does).
    pub(crate) fn file_of(&self, name: &str) -> &Path {
        self.entries.get(name).map_or(&self.origin, |e| &self.files[e.file].0)
    }

    fn path_of(&self, e: &Entry) -> PathBuf {
        self.files[e.file].0.clone()
    }

    /// The tensor `name` with whatever shape it has (for copying files).
    pub fn get_any(&self, name: &str) -> Result<Tensor> {
        let shape = self
            .entries
            .get(name)
            .map(|e| e.shape.clone())
            .ok_or_else(|| Error::MissingTensor { path: self.origin.clone(), name: self.display_name(name) })?;
        self.get(name, &shape)
    }

    /// The tensor `name`, which must have exactly `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| Error::MissingTensor { path: self.origin.clone(), name: self.display_name(name) })?;
        e.used.store(true, Ordering::Relaxed);
        let dtype = match &e.dtype {
            Ok(d) => *d,
            Err(ty) if self.gguf => {
                return Err(Error::GgufType { path: self.path_of(e), name: self.display_name(name), ty: ty.clone() })
            }
            Err(d) => return Err(Error::Dtype { path: self.path_of(e), name: name.into(), dtype: d.clone() }),
        };
        if e.shape != shape {
            return Err(Error::Shape {
                path: self.path_of(e),
                name: self.display_name(name),
                found: e.shape.clone(),
                expected: shape.to_vec(),
            });
        }
        Ok(Tensor {
            name: name.into(),
            dtype,
            shape: e.shape.clone(),
            storage: self.files[e.file].1.clone(),
            start: e.start,
            len: e.len,
            parts: 1,
        })
    }
}

/// safetensors' error in words; for a tensor whose shape and dtype disagree
/// with its data offsets (which safetensors does not name), `map` is read
/// again to say which.
fn describe(e: &safetensors::SafeTensorError, map: &[u8]) -> String {
    use safetensors::SafeTensorError as E;
    if matches!(e, E::TensorInvalidInfo | E::MisalignedSlice | E::ValidationOverflow) {
        if let Some(m) = explain_sizes(map) {
            return m;
        }
    }
    match e {
        E::HeaderTooSmall => "file is too small to hold a safetensors header".into(),
        E::HeaderTooLarge => "header length is larger than allowed (corrupt file?)".into(),
        E::InvalidHeaderLength => "header length points past the end of the file (truncated or corrupt)".into(),
        E::MetadataIncompleteBuffer => "tensor data does not match the file size (truncated or corrupt)".into(),
        other => format!("{other}"),
    }
}

/// The first tensor (by name) of a safetensors header whose shape and dtype
/// do not make the bytes of its data offsets, said so; `None` if the header
/// does not parse or every tensor agrees.
fn explain_sizes(map: &[u8]) -> Option<String> {
    let n = usize::try_from(u64::from_le_bytes(map.get(..8)?.try_into().ok()?)).ok()?;
    let header: HashMap<String, serde_json::Value> =
        serde_json::from_slice(map.get(8..8usize.checked_add(n)?)?).ok()?;
    let mut names: Vec<&String> = header.keys().filter(|k| *k != "__metadata__").collect();
    names.sort();
    for name in names {
        let Ok(info) = serde_json::from_value::<safetensors::tensor::TensorInfo>(header[name].clone()) else {
            continue;
        };
        let (a, b) = info.data_offsets;
        let (shape, dtype) = (&info.shape, info.dtype);
        let bits = shape.iter().try_fold(dtype.bitsize(), |n, &d| n.checked_mul(d));
        match bits {
            None => return Some(format!("tensor `{name}`: shape {shape:?} of {dtype:?} overflows")),
            Some(bits) if bits % 8 != 0 => {
                return Some(format!("tensor `{name}`: shape {shape:?} of {dtype:?} is not a whole number of bytes"))
            }
            Some(bits) if b.checked_sub(a) != Some(bits / 8) => {
                return Some(format!(
                    "tensor `{name}`: shape {shape:?} of {dtype:?} is {} bytes, but its data_offsets [{a}, {b}] {}",
                    bits / 8,
                    b.checked_sub(a).map_or("are reversed".into(), |n| format!("hold {n}"))
                ))
            }
            Some(_) => {}
        }
    }
    None
}

/// Writes a safetensors file: `tensors` as `(name, dtype, shape, bytes)` with
/// the safetensors dtype name (`F32`, `BF16`, `F16`, `U8`), and string
/// metadata. Every tensor starts on an 8-byte boundary of the file. Written
/// under a temporary name, then renamed.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, String, Vec<usize>, &[u8])],
    metadata: &std::collections::BTreeMap<String, String>,
) -> Result<()> {
    use std::io::Write;
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::to_value(metadata).expect("strings"));
    }
    let mut offset = 0usize;
    let mut spans = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let start = offset.next_multiple_of(8);
        let end = start + bytes.len();
        header
            .insert(name.clone(), serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [start, end] }));
        spans.push((start, *bytes));
        offset = end;
    }
    let mut head = serde_json::to_vec(&serde_json::Value::Object(header)).expect("json");
    // Data starts after the 8-byte length and the header: keep it 8-aligned.
    while !(8 + head.len()).is_multiple_of(8) {
        head.push(b' ');
    }
    let tmp = path.with_extension("safetensors.tmp");
    let io = |e| Error::io(&tmp, e);
    let write = || -> Result<()> {
        let mut f = std::io::BufWriter::new(File::create(&tmp).map_err(io)?);
        f.write_all(&(head.len() as u64).to_le_bytes()).map_err(io)?;
        f.write_all(&head).map_err(io)?;
        let mut at = 0usize;
        for (start, bytes) in spans {
            f.write_all(&vec![0u8; start - at]).map_err(io)?;
            f.write_all(bytes).map_err(io)?;
            at = start + bytes.len();
        }
        f.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
    };
    // A full disk (or any failure) leaves no temporary file behind.
    write().inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_covers_every_type() {
        for t in WeightType::ALL {
            assert!(t.align() <= COPY_ALIGN, "{t} needs {}-byte alignment", t.align());
        }
    }

    /// The tiny model, its matrices quantized to `quant` at load if given.
    fn tiny_model(quant: Option<WeightType>) -> crate::qwen2::Qwen2 {
        let mut model =
            crate::model::load_qwen2(&Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tiny-chat")).unwrap();
        if let Some(q) = quant {
            model.quantize(&q.into()).unwrap();
        }
        model
    }

    /// The copy into huge pages (called directly, so it runs where the
    /// kernel offers none too) keeps every byte, keeps a tied LM head one
    /// copy with the embedding, aligns every tensor, and the model computes
    /// the same logits from it, for stored and for quantized-at-load weights.
    #[test]
    fn weights_copied_to_huge_pages_compute_the_same_bits() {
        for quant in [None, Some(WeightType::Int8)] {
            let mut model = tiny_model(quant);
            let tokens = [1u32, 5, 9, 2, 7];
            let before = model.new_state(16).run(&model, &tokens, true).unwrap().unwrap().to_vec();
            let bytes = |m: &crate::qwen2::Qwen2| {
                let mut all = vec![m.embed_tokens.as_bytes().to_vec(), m.lm_head.as_bytes().to_vec()];
                for l in &m.layers {
                    all.extend(l.matrices().map(|p| p.weight.as_bytes().to_vec()));
                }
                all
            };
            let (old, tied) = (bytes(&model), model.lm_head.same_data(&model.embed_tokens));
            let mut tensors: Vec<(&mut Tensor, bool)> =
                vec![(&mut model.embed_tokens, true), (&mut model.lm_head, true)];
            for l in &mut model.layers {
                tensors.extend(l.matrices_mut().map(|p| (&mut p.weight, true)));
            }
            let distinct = old.iter().map(Vec::len).sum::<usize>() - if tied { old[0].len() } else { 0 };
            // The tiny model's matrices are too narrow to split.
            let copied = copy_to_huge_pages(&mut tensors, ember_kernels::parts::parts_for).unwrap();
            assert!(copied >= distinct && copied < distinct + 64 * tensors.len(), "{copied} for {distinct}");
            for (t, _) in &tensors {
                assert_eq!(t.parts, 1, "{}", t.name);
                assert!(matches!(*t.storage, Storage::Huge { .. }), "{} not in the copy", t.name);
                assert_eq!(t.as_bytes().as_ptr() as usize % 64, 0, "{} unaligned", t.name);
            }
            assert_eq!(model.lm_head.same_data(&model.embed_tokens), tied, "tied weights stay one copy");
            assert_eq!(bytes(&model), old, "{quant:?}");
            let after = model.new_state(16).run(&model, &tokens, true).unwrap().unwrap().to_vec();
            assert_eq!(after, before, "{quant:?}");
        }
    }

    /// o and down laid out in column parts (forced on the tiny model, whose
    /// down has 160 columns: parts of 128 and 32) keep their values and give
    /// the logits of the file's layout to f32 rounding, in prefill (a
    /// matrix product, as several sequences decoding are) and decode (a
    /// mat-vec); the fused products are never split.
    #[test]
    fn column_parts_compute_the_same_logits() {
        for quant in [None, Some(WeightType::Int8)] {
            let mut model = tiny_model(quant);
            let logits = |m: &crate::qwen2::Qwen2| {
                let mut state = m.new_state(16);
                let mut all = state.run(m, &[1u32, 5, 9, 2, 7], true).unwrap().unwrap().to_vec();
                for t in [4u32, 8, 3] {
                    all.extend_from_slice(state.run(m, &[t], true).unwrap().unwrap());
                }
                all
            };
            let before = logits(&model);
            let old: Vec<Vec<f32>> = model.layers.iter().map(|l| l.mlp.down_proj.weight.to_f32_vec()).collect();
            let old_bytes: Vec<Vec<u8>> =
                model.layers.iter().map(|l| l.mlp.down_proj.weight.as_bytes().to_vec()).collect();
            fn two(ty: WeightType, cols: usize) -> usize {
                if ty.is_float() && cols >= 128 {
                    2
                } else {
                    1
                }
            }
            model.copy_with_parts(two).unwrap();
            for (l, (old, old_bytes)) in model.layers.iter().zip(old.iter().zip(&old_bytes)) {
                let down = &l.mlp.down_proj.weight;
                assert_eq!(down.parts().parts(), if quant.is_none() { 2 } else { 1 }, "{quant:?}");
                assert_eq!(&down.to_f32_vec(), old);
                assert_eq!(&*down.row_major_bytes(), &old_bytes[..]);
                for p in [&l.self_attn.q_proj, &l.mlp.gate_proj, &l.mlp.up_proj, &l.self_attn.o_proj] {
                    assert_eq!(p.weight.parts().parts(), 1, "{} (64 columns, or fused)", p.weight.name);
                }
            }
            let after = logits(&model);
            approx::assert_relative_eq!(&after[..], &before[..], max_relative = 1e-5, epsilon = 1e-5);
        }
    }

    #[test]
    fn shard_names_are_plain_file_names() {
        for ok in ["model-00001-of-00002.safetensors", "a", "..a", "a..b"] {
            assert!(is_plain_file_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "../a", "/etc/passwd", "a/b", "a\\b", "./a", "a/"] {
            assert!(!is_plain_file_name(bad), "{bad}");
        }
    }
}
