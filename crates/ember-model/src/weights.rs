//! Safetensors weights, memory-mapped.
//!
//! A model is one `model.safetensors` or several shards listed by
//! `model.safetensors.index.json`. Files are mapped with memmap2 and tensors
//! are borrowed from the mapping in their stored precision: a BF16 model is
//! never copied to f32, and pages are read from disk only when first touched.

use crate::error::{Error, Result};
use ember_kernels::quant::{self, BlockQ4, BlockQ8, Quant, QK};
use ember_kernels::{bf16, f16, MatRef, Weights};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The element types ember computes with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
    F16,
    /// ember's INT8 blocks ([`ember_kernels::quant::BlockQ8`]).
    Q8,
    /// ember's INT4 blocks ([`ember_kernels::quant::BlockQ4`]).
    Q4,
}

impl DType {
    /// Alignment the data needs, in bytes.
    pub fn align(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 | DType::Q8 | DType::Q4 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::Bf16 => "BF16",
            DType::F16 => "F16",
            DType::Q8 => "INT8",
            DType::Q4 => "INT4",
        }
    }

    /// The quantized format, if this is one.
    pub fn quant(self) -> Option<Quant> {
        match self {
            DType::Q8 => Some(Quant::Int8),
            DType::Q4 => Some(Quant::Int4),
            _ => None,
        }
    }

    fn of_quant(q: Quant) -> DType {
        match q {
            Quant::Int8 => DType::Q8,
            Quant::Int4 => DType::Q4,
        }
    }
}

/// The safetensors metadata key that marks `name` as quantized by ember: its
/// value is the format (`int8` / `int4`); the tensor is stored as U8 with
/// shape `[rows, bytes per row]`.
pub fn quant_key(name: &str) -> String {
    format!("ember.quant.{name}")
}

/// Bytes that live as long as any tensor borrowing them.
enum Storage {
    Mapped(Mmap),
    /// A copy made only when a tensor in the file is misaligned for its type.
    /// `u32` elements keep it 4-byte aligned.
    Owned(Vec<u32>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => bytemuck_bytes(v),
        }
    }
}

fn bytemuck_bytes(v: &[u32]) -> &[u8] {
    // SAFETY: u32 has no padding; any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 4) }
}

/// A tensor in its stored precision, backed by a mapped file.
#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    storage: Arc<Storage>,
    start: usize,
    len: usize,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({} {} {:?})", self.name, self.dtype.name(), self.shape)
    }
}

impl Tensor {
    /// The raw stored bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.storage.bytes()[self.start..self.start + self.len]
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The data as kernel weights, borrowed (no copy).
    pub fn weights(&self) -> Weights<'_> {
        let b = self.as_bytes();
        // Alignment was checked (or fixed by copying) when the file was opened.
        match self.dtype {
            DType::F32 => Weights::F32(bytemuck::cast_slice::<u8, f32>(b)),
            DType::Bf16 => Weights::Bf16(cast_u16::<bf16>(b)),
            DType::F16 => Weights::F16(cast_u16::<f16>(b)),
            DType::Q8 => Weights::Q8(quant::q8_from_bytes(b).expect("INT8 data checked at load")),
            DType::Q4 => Weights::Q4(quant::q4_from_bytes(b).expect("INT4 data checked at load")),
        }
    }

    /// A 2-D tensor as a matrix `(shape[0], shape[1])`.
    pub fn matrix(&self) -> MatRef<'_> {
        assert_eq!(self.shape.len(), 2, "{} is not a matrix", self.name);
        MatRef::new(self.weights(), self.shape[0], self.shape[1])
    }

    /// The values widened to f32 (for small tensors: norms, biases).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self.weights() {
            Weights::F32(w) => w.to_vec(),
            Weights::Bf16(w) => w.iter().map(|v| v.to_f32()).collect(),
            Weights::F16(w) => w.iter().map(|v| v.to_f32()).collect(),
            Weights::Q8(w) => {
                let mut out = vec![0.0; w.len() * QK];
                quant::dequantize_q8_row(w, &mut out);
                out
            }
            Weights::Q4(w) => {
                let mut out = vec![0.0; w.len() * QK];
                quant::dequantize_q4_row(w, &mut out);
                out
            }
        }
    }

    /// Bytes of data.
    pub fn size_bytes(&self) -> usize {
        self.len
    }

    /// This matrix quantized to `q`, in memory owned by the new tensor
    /// (rows split over the global pool). Panics if it is not a matrix with
    /// rows a whole number of 32-weight blocks: callers check
    /// [`Tensor::can_quantize`].
    pub fn quantize(&self, q: Quant) -> Tensor {
        assert!(self.can_quantize(), "{} cannot be quantized", self.name);
        let m = self.matrix();
        let (rows, cols) = (m.rows, m.cols);
        let row_bytes = cols / QK * q.block_bytes();
        let mut owned = vec![0u32; (rows * row_bytes).div_ceil(4)];
        {
            let bytes = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut owned)[..rows * row_bytes];
            let out = ember_kernels::pool::SharedMut::new(bytes);
            ember_kernels::pool::global().run(|t, n| {
                let (a, b) = ember_kernels::pool::share(rows, t, n, 1);
                // One row and one row of blocks per thread, reused.
                let mut row = vec![0.0f32; cols];
                let (mut q8, mut q4) = match q {
                    Quant::Int8 => (vec![BlockQ8::ZERO; cols / QK], Vec::new()),
                    Quant::Int4 => (Vec::new(), vec![BlockQ4::ZERO; cols / QK]),
                };
                for r in a..b {
                    m.row_to_f32(r, &mut row);
                    // SAFETY: threads take disjoint rows.
                    let dst = unsafe { out.range(r * row_bytes, (r + 1) * row_bytes) };
                    match q {
                        Quant::Int8 => {
                            quant::quantize_q8_row(&row, &mut q8);
                            dst.copy_from_slice(quant::q8_bytes(&q8));
                        }
                        Quant::Int4 => {
                            quant::quantize_q4_row(&row, &mut q4);
                            dst.copy_from_slice(quant::q4_bytes(&q4));
                        }
                    }
                }
            });
        }
        Tensor {
            name: self.name.clone(),
            dtype: DType::of_quant(q),
            shape: self.shape.clone(),
            storage: Arc::new(Storage::Owned(owned)),
            start: 0,
            len: rows * row_bytes,
        }
    }

    /// A quantized matrix widened back to F32 (owned): the exact values the
    /// quantized kernels compute with. Other tensors are returned as they are.
    pub fn dequantize(&self) -> Tensor {
        if self.dtype.quant().is_none() {
            return self.clone();
        }
        let values = self.to_f32_vec();
        let owned: Vec<u32> = values.iter().map(|v| v.to_bits()).collect();
        Tensor {
            name: self.name.clone(),
            dtype: DType::F32,
            shape: self.shape.clone(),
            len: owned.len() * 4,
            storage: Arc::new(Storage::Owned(owned)),
            start: 0,
        }
    }

    /// Whether [`Tensor::quantize`] applies: a float matrix whose rows are
    /// whole 32-weight blocks.
    pub fn can_quantize(&self) -> bool {
        self.shape.len() == 2 && self.shape[1].is_multiple_of(QK) && self.dtype.quant().is_none()
    }

    /// Whether two tensors are the same bytes (a tied LM head).
    pub fn same_data(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage) && self.start == other.start && self.len == other.len
    }
}

fn cast_u16<T: Copy>(b: &[u8]) -> &[T] {
    assert_eq!(std::mem::size_of::<T>(), 2);
    let u: &[u16] = bytemuck::cast_slice(b);
    // SAFETY: bf16 and f16 are `#[repr(transparent)]` over u16.
    unsafe { std::slice::from_raw_parts(u.as_ptr() as *const T, u.len()) }
}

struct Entry {
    file: usize,
    /// The stored dtype, or its name when ember cannot compute with it.
    dtype: std::result::Result<DType, String>,
    shape: Vec<usize>,
    start: usize,
    len: usize,
}

/// Every tensor of a model folder, by name.
pub struct TensorStore {
    files: Vec<(PathBuf, Arc<Storage>)>,
    entries: HashMap<String, Entry>,
    /// Where to say a missing tensor was looked for.
    origin: PathBuf,
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
            let (header_len, meta) = SafeTensors::read_metadata(&map).map_err(|e| bad(describe(&e)))?;
            let data_start = 8 + header_len;
            let mut misaligned = false;
            let extra = meta.metadata().clone().unwrap_or_default();
            for (name, info) in meta.tensors() {
                let mut shape = info.shape.clone();
                let dtype = match (info.dtype, extra.get(&quant_key(&name))) {
                    (Dtype::U8, Some(format)) => {
                        let q = Quant::from_name(format)
                            .ok_or_else(|| bad(format!("tensor `{name}`: unknown ember format `{format}`")))?;
                        // Stored as [rows, bytes per row]; the logical shape
                        // is [rows, weights per row].
                        if shape.len() != 2 || shape[1] % q.block_bytes() != 0 {
                            return Err(bad(format!("tensor `{name}`: {format} data of shape {shape:?}")));
                        }
                        shape[1] = shape[1] / q.block_bytes() * QK;
                        Ok(DType::of_quant(q))
                    }
                    (Dtype::F32, None) => Ok(DType::F32),
                    (Dtype::BF16, None) => Ok(DType::Bf16),
                    (Dtype::F16, None) => Ok(DType::F16),
                    // Only an error if the model asks for this tensor.
                    (other, _) => Err(format!("{other:?}")),
                };
                let (a, b) = info.data_offsets;
                let start = data_start + a;
                misaligned |= dtype.as_ref().is_ok_and(|d| start % d.align() != 0);
                if entries.contains_key(&name) {
                    return Err(bad(format!("tensor `{name}` appears in more than one file")));
                }
                entries.insert(name, Entry { file: i, dtype, shape, start, len: b - a });
            }
            let storage = if misaligned {
                // Rare (writers pad the header to 8 bytes): copy the file once
                // into aligned memory rather than read unaligned floats.
                let mut owned = vec![0u32; map.len().div_ceil(4)];
                bytemuck::cast_slice_mut::<u32, u8>(&mut owned)[..map.len()].copy_from_slice(&map);
                Storage::Owned(owned)
            } else {
                Storage::Mapped(map)
            };
            files.push((path.clone(), Arc::new(storage)));
        }
        Ok(TensorStore { files, entries, origin })
    }

    /// Names of all tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(|s| s.as_str())
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
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
            .ok_or_else(|| Error::MissingTensor { path: self.origin.clone(), name: name.into() })?;
        self.get(name, &shape)
    }

    /// The tensor `name`, which must have exactly `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| Error::MissingTensor { path: self.origin.clone(), name: name.into() })?;
        let dtype = match &e.dtype {
            Ok(d) => *d,
            Err(d) => return Err(Error::Dtype { path: self.path_of(e), name: name.into(), dtype: d.clone() }),
        };
        if e.shape != shape {
            return Err(Error::Shape {
                path: self.path_of(e),
                name: name.into(),
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
        })
    }
}

fn describe(e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall => "file is too small to hold a safetensors header".into(),
        E::HeaderTooLarge => "header length is larger than allowed (corrupt file?)".into(),
        E::InvalidHeaderLength => "header length points past the end of the file (truncated or corrupt)".into(),
        E::MetadataIncompleteBuffer => "tensor data does not match the file size (truncated or corrupt)".into(),
        other => format!("{other}"),
    }
}

/// Writes a safetensors file: `tensors` as `(name, dtype, shape, bytes)` with
/// the safetensors dtype name (`F32`, `BF16`, `F16`, `U8`), and string
/// metadata. Every tensor starts on an 8-byte boundary of the file. Written
/// under a temporary name, then renamed.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, &str, Vec<usize>, &[u8])],
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
    let mut f = std::io::BufWriter::new(File::create(&tmp).map_err(io)?);
    f.write_all(&(head.len() as u64).to_le_bytes()).map_err(io)?;
    f.write_all(&head).map_err(io)?;
    let mut at = 0usize;
    for (start, bytes) in spans {
        f.write_all(&vec![0u8; start - at]).map_err(io)?;
        f.write_all(bytes).map_err(io)?;
        at = start + bytes.len();
    }
    f.flush().map_err(io)?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}
