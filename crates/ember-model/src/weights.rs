//! Safetensors weights, memory-mapped.
//!
//! A model is one `model.safetensors` or several shards listed by
//! `model.safetensors.index.json`. Files are mapped with memmap2 and tensors
//! are borrowed from the mapping in their stored precision: a BF16 model is
//! never copied to f32, and pages are read from disk only when first touched.

use crate::error::{Error, Result};
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
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::Bf16 => "BF16",
            DType::F16 => "F16",
        }
    }
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
        }
    }

    /// Bytes of data.
    pub fn size_bytes(&self) -> usize {
        self.len
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
            for (name, info) in meta.tensors() {
                let dtype = match info.dtype {
                    Dtype::F32 => Ok(DType::F32),
                    Dtype::BF16 => Ok(DType::Bf16),
                    Dtype::F16 => Ok(DType::F16),
                    // Only an error if the model asks for this tensor.
                    other => Err(format!("{other:?}")),
                };
                let (a, b) = info.data_offsets;
                let start = data_start + a;
                misaligned |= dtype.as_ref().is_ok_and(|d| start % d.size() != 0);
                if entries.contains_key(&name) {
                    return Err(bad(format!("tensor `{name}` appears in more than one file")));
                }
                entries.insert(name, Entry { file: i, dtype, shape: info.shape.clone(), start, len: b - a });
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
