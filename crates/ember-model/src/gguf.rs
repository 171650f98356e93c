//! GGUF files (llama.cpp's format), versions 2 and 3, read in place.
//!
//! A file is a header (magic `GGUF`, version, tensor and metadata counts),
//! typed key/value metadata, one info per tensor (name, dimensions, type,
//! offset), padding to `general.alignment` (32 unless given), then the tensor
//! data. [`Gguf::open`] maps the file and parses everything but the data;
//! tensors are borrowed from the map by [`TensorStore::open_gguf`](crate::weights::TensorStore::open_gguf).
//!
//! Parsing never trusts a count: every length is checked against the bytes
//! left in the file *before* anything is allocated for it, every tensor's
//! extent against the file's end, and sizes are computed with checked
//! arithmetic, so a corrupt or hostile file is an [`Error::Gguf`] naming the
//! problem, never a panic or an allocation larger than the file. Only
//! little-endian files are read (what llama.cpp writes on x86 and ARM).
//!
//! GGUF lists a tensor's dimensions fastest-varying first (`ne[0]` is the
//! number of columns), the reverse of safetensors' shapes.

use crate::error::{Error, Result};
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;

/// Deepest nesting of arrays in metadata accepted (real files use 1).
const MAX_ARRAY_DEPTH: u32 = 8;

/// A ggml tensor type, by its id in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

/// `(id, name, weights per block, bytes per block)` of every type ggml
/// defines, as the `gguf` Python package's `GGML_QUANT_SIZES` lists them.
const GGML_TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

impl GgmlType {
    /// `F32`, `Q4_K`, ...: ggml's name.
    pub fn name(self) -> &'static str {
        self.row().map_or("unknown", |r| r.1)
    }

    /// Weights per block and bytes per block; `None` for an unknown id.
    pub fn block(self) -> Option<(u64, u64)> {
        self.row().map(|r| (r.2, r.3))
    }

    fn row(self) -> Option<&'static (u32, &'static str, u64, u64)> {
        GGML_TYPES.iter().find(|r| r.0 == self.0)
    }

    /// The ember weight type whose blocks are this type's byte for byte, if
    /// ember computes with it.
    ///
    /// Q8_0 is ember's INT8: ggml's `block_q8_0` is an F16 scale then 32 ×
    /// i8, value `d·q`, exactly [`BlockQ8`](ember_kernels::formats::BlockQ8),
    /// so the same kernels run it: one implementation, not two. Q4_0
    /// (`block_q4_0`: an F16 scale then 16 bytes whose low nibbles are
    /// weights 0..16 and high nibbles 16..32, value `d·(n − 8)`), Q4_1,
    /// Q5_0, Q5_1 and the K types Q2_K .. Q6_K are rows of ember's format
    /// table of the same names, whose blocks are ggml's
    /// (`ember_kernels::formats`; ggml's `dequantize_row_*` and the `gguf`
    /// package's numpy dequantizers: `tests/gguf.rs` checks ember's reading
    /// of real tensors against them). The others (Q8_1,
    /// Q8_K, the IQ and TQ types, MXFP4, integer and F64 tensors) are not run.
    pub fn weight_type(self) -> Option<ember_kernels::WeightType> {
        use ember_kernels::WeightType as W;
        match self.0 {
            0 => Some(W::F32),
            1 => Some(W::F16),
            30 => Some(W::Bf16),
            8 => Some(W::Int8),
            2 => Some(W::Q4_0),
            3 => Some(W::Q4_1),
            6 => Some(W::Q5_0),
            7 => Some(W::Q5_1),
            10 => Some(W::Q2K),
            11 => Some(W::Q3K),
            12 => Some(W::Q4K),
            13 => Some(W::Q5K),
            14 => Some(W::Q6K),
            _ => None,
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.row() {
            Some(r) => f.write_str(r.1),
            None => write!(f, "unknown type {}", self.0),
        }
    }
}

/// An array of metadata values, all of one type.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)] // the variants are the value types of the spec
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(Vec<String>),
    /// Arrays of arrays (each inner array has its own type).
    Array(Vec<Array>),
}

impl Array {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Integer elements as i64 (`None` for other types or u64 values past i64).
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        fn all<T: Copy>(v: &[T], f: impl Fn(T) -> Option<i64>) -> Option<Vec<i64>> {
            v.iter().map(|&x| f(x)).collect()
        }
        match self {
            Array::U8(v) => all(v, |x| Some(x.into())),
            Array::I8(v) => all(v, |x| Some(x.into())),
            Array::U16(v) => all(v, |x| Some(x.into())),
            Array::I16(v) => all(v, |x| Some(x.into())),
            Array::U32(v) => all(v, |x| Some(x.into())),
            Array::I32(v) => all(v, |x| Some(x.into())),
            Array::U64(v) => all(v, |x| i64::try_from(x).ok()),
            Array::I64(v) => all(v, Some),
            _ => None,
        }
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)] // the variants are the value types of the spec
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Array),
}

impl Value {
    /// An integer value that fits u64 (any integer type).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A float (or integer) value as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// A bool value.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// An array value.
    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's entry in the file's header.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Its llama.cpp name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions as stored: `ne[0]` (columns, fastest-varying) first.
    pub dims: Vec<u64>,
    /// Its ggml type.
    pub ty: GgmlType,
    /// Offset of its data from the start of the data section.
    pub offset: u64,
    /// Bytes of data.
    pub size: u64,
}

impl TensorInfo {
    /// The shape in safetensors order (rows first): `dims` reversed.
    pub fn shape(&self) -> Vec<usize> {
        // Every dimension was checked to fit with the others in the file's size.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF header: everything in the file but the tensor data.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// `general.alignment`, or [`DEFAULT_ALIGNMENT`].
    pub alignment: u64,
    /// Offset of the data section in the file.
    pub data_start: u64,
}

impl Header {
    /// Parses a whole GGUF file's bytes (the data section included: every
    /// tensor must lie within them). The message of an error says what is
    /// wrong and where.
    pub fn parse(bytes: &[u8]) -> std::result::Result<Header, String> {
        let mut r = Reader { bytes, pos: 0 };
        let magic = r.take(4, "the magic number")?;
        if magic != b"GGUF" {
            return Err(format!("not a GGUF file (starts with {magic:02x?}, not \"GGUF\")"));
        }
        let version = r.u32("the version")?;
        match version {
            2 | 3 => {}
            1 => return Err("GGUF version 1 (32-bit counts) is not supported; versions 2 and 3 are".into()),
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err("a big-endian GGUF file; ember reads little-endian ones".into())
            }
            v => return Err(format!("unknown GGUF version {v} (ember reads 2 and 3)")),
        }
        let n_tensors = r.u64("the tensor count")?;
        let n_kv = r.u64("the metadata count")?;
        // A key/value needs at least 8 (key length) + 4 (type) + 1 bytes, a
        // tensor info 8 + 4 + 4 + 8.
        r.check_count(n_kv, 13, "metadata entries")?;
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut keys = std::collections::HashSet::new();
        for i in 0..n_kv {
            let key = r.string(&format!("the key of metadata entry {i}"))?;
            let ty = r.u32(&format!("the type of `{key}`"))?;
            let value = r.value(ty, &key, 0)?;
            if !keys.insert(key.clone()) {
                return Err(format!("metadata key `{key}` appears twice"));
            }
            metadata.push((key, value));
        }
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, Value::U32(a))) if a.is_power_of_two() => u64::from(*a),
            Some((_, v)) => return Err(format!("`general.alignment` is {v:?}; it must be a u32 power of two")),
        };
        r.check_count(n_tensors, 24, "tensor infos")?;
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut names = std::collections::HashSet::new();
        for i in 0..n_tensors {
            let name = r.string(&format!("the name of tensor {i}"))?;
            let n_dims = r.u32(&format!("tensor `{name}`'s number of dimensions"))?;
            if n_dims > MAX_DIMS {
                return Err(format!("tensor `{name}` has {n_dims} dimensions; at most {MAX_DIMS} are allowed"));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&format!("tensor `{name}`'s dimensions"))?);
            }
            let ty = GgmlType(r.u32(&format!("tensor `{name}`'s type"))?);
            let offset = r.u64(&format!("tensor `{name}`'s offset"))?;
            let (block_len, block_bytes) =
                ty.block().ok_or_else(|| format!("tensor `{name}` has an unknown type id {}", ty.0))?;
            let numel = dims
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d))
                .ok_or_else(|| format!("tensor `{name}`'s dimensions {dims:?} overflow"))?;
            let cols = dims.first().copied().unwrap_or(1);
            if cols % block_len != 0 {
                return Err(format!(
                    "tensor `{name}` ({ty}) has rows of {cols} weights, not a whole number of {block_len}-weight blocks"
                ));
            }
            let size = (numel / block_len)
                .checked_mul(block_bytes)
                .ok_or_else(|| format!("tensor `{name}`'s size overflows"))?;
            if offset % alignment != 0 {
                return Err(format!(
                    "tensor `{name}`'s offset {offset} is not a multiple of the alignment {alignment}"
                ));
            }
            if !names.insert(name.clone()) {
                return Err(format!("tensor `{name}` appears twice"));
            }
            tensors.push(TensorInfo { name, dims, ty, offset, size });
        }
        let data_start = (r.pos as u64).next_multiple_of(alignment);
        let len = bytes.len() as u64;
        for t in &tensors {
            let end = data_start.checked_add(t.offset).and_then(|s| s.checked_add(t.size));
            if end.is_none_or(|e| e > len) {
                return Err(format!(
                    "tensor `{}`'s data ({} bytes at offset {}) runs past the end of the file ({len} bytes; truncated?)",
                    t.name, t.size, t.offset
                ));
            }
        }
        Ok(Header { version, metadata, tensors, alignment, data_start })
    }

    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

/// A little-endian cursor that checks every read against the end.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: u64, what: &str) -> std::result::Result<&'a [u8], String> {
        if n > self.remaining() as u64 {
            return Err(format!(
                "truncated: {what} needs {n} bytes at offset {} but the file ends {} bytes later",
                self.pos,
                self.remaining()
            ));
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    /// Refuses `count` elements of at least `min_bytes` each if they cannot
    /// fit in what is left, before anything is allocated for them.
    fn check_count(&self, count: u64, min_bytes: u64, what: &str) -> std::result::Result<(), String> {
        if count.checked_mul(min_bytes).is_none_or(|n| n > self.remaining() as u64) {
            return Err(format!(
                "{count} {what} at offset {} cannot fit in the {} bytes left in the file",
                self.pos,
                self.remaining()
            ));
        }
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &str) -> std::result::Result<[u8; N], String> {
        Ok(self.take(N as u64, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &str) -> std::result::Result<String, String> {
        let len = self.u64(what)?;
        let at = self.pos;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} at offset {at} is not valid UTF-8"))
    }

    /// One value of type id `ty`; `depth` counts enclosing arrays.
    fn value(&mut self, ty: u32, key: &str, depth: u32) -> std::result::Result<Value, String> {
        let what = format!("the value of `{key}`");
        Ok(match ty {
            0 => Value::U8(u8::from_le_bytes(self.array(&what)?)),
            1 => Value::I8(i8::from_le_bytes(self.array(&what)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(&what)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => Value::Bool(self.bool(&what)?),
            8 => Value::String(self.string(&what)?),
            9 => Value::Array(self.array_value(key, depth)?),
            10 => Value::U64(u64::from_le_bytes(self.array(&what)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            t => return Err(format!("`{key}` has an unknown value type {t}")),
        })
    }

    fn bool(&mut self, what: &str) -> std::result::Result<bool, String> {
        match self.array::<1>(what)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(format!("{what} is a bool of value {b} (not 0 or 1)")),
        }
    }

    fn array_value(&mut self, key: &str, depth: u32) -> std::result::Result<Array, String> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(format!("`{key}` nests arrays deeper than {MAX_ARRAY_DEPTH}"));
        }
        let what = format!("the array `{key}`");
        let ty = self.u32(&what)?;
        let n = self.u64(&what)?;
        // The smallest encoding of one element of each type.
        let min = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => 12,
            t => return Err(format!("`{key}` is an array of unknown value type {t}")),
        };
        self.check_count(n, min, &format!("elements of `{key}`"))?;
        let n = n as usize;
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let bytes = self.take((n * std::mem::size_of::<$t>()) as u64, &what)?;
                Array::$variant(
                    bytes
                        .chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| <$t>::from_le_bytes(c.try_into().unwrap()))
                        .collect(),
                )
            }};
        }
        Ok(match ty {
            0 => fixed!(U8, u8),
            1 => fixed!(I8, i8),
            2 => fixed!(U16, u16),
            3 => fixed!(I16, i16),
            4 => fixed!(U32, u32),
            5 => fixed!(I32, i32),
            6 => fixed!(F32, f32),
            10 => fixed!(U64, u64),
            11 => fixed!(I64, i64),
            12 => fixed!(F64, f64),
            7 => Array::Bool((0..n).map(|_| self.bool(&what)).collect::<std::result::Result<_, _>>()?),
            8 => Array::String((0..n).map(|_| self.string(&what)).collect::<std::result::Result<_, _>>()?),
            _ => Array::Array((0..n).map(|_| self.array_value(key, depth + 1)).collect::<std::result::Result<_, _>>()?),
        })
    }
}

/// A GGUF file, memory-mapped, with its parsed header.
pub struct Gguf {
    /// The file.
    pub path: PathBuf,
    /// Its header.
    pub header: Header,
    pub(crate) map: Mmap,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("metadata", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .finish_non_exhaustive()
    }
}

impl Gguf {
    /// Maps and parses `path`.
    pub fn open(path: &Path) -> Result<Gguf> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the mapping is read-only; a file truncated underneath a
        // running model is outside what any mmap-based loader can defend.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let header = Header::parse(&map).map_err(|message| Error::Gguf { path: path.into(), message })?;
        Ok(Gguf { path: path.into(), header, map })
    }

    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.header.get(key)
    }

    /// A tensor's stored bytes (in range: checked when parsed).
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.header.data_start + t.offset) as usize;
        &self.map[start..start + t.size as usize]
    }

    pub(crate) fn err(&self, message: impl Into<String>) -> Error {
        Error::Gguf { path: self.path.clone(), message: message.into() }
    }

    /// A required integer key.
    pub(crate) fn usize_key(&self, key: &str) -> Result<usize> {
        match self.get(key) {
            None => Err(self.err(format!("metadata key `{key}` is missing"))),
            Some(v) => v
                .as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| self.err(format!("metadata key `{key}` is {v:?}, not a non-negative integer"))),
        }
    }

    /// A required float key.
    pub(crate) fn f64_key(&self, key: &str) -> Result<f64> {
        match self.get(key) {
            None => Err(self.err(format!("metadata key `{key}` is missing"))),
            Some(v) => v.as_f64().ok_or_else(|| self.err(format!("metadata key `{key}` is {v:?}, not a number"))),
        }
    }
}

/// llama.cpp's tensor names and the HuggingFace names ember's Qwen2 loads:
/// `(llama.cpp, HF)`, with `N` the layer number.
const NAMES: &[(&str, &str)] = &[
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("output", "lm_head"),
    ("blk.N.attn_norm", "model.layers.N.input_layernorm"),
    ("blk.N.ffn_norm", "model.layers.N.post_attention_layernorm"),
    ("blk.N.attn_q", "model.layers.N.self_attn.q_proj"),
    ("blk.N.attn_k", "model.layers.N.self_attn.k_proj"),
    ("blk.N.attn_v", "model.layers.N.self_attn.v_proj"),
    ("blk.N.attn_output", "model.layers.N.self_attn.o_proj"),
    ("blk.N.ffn_gate", "model.layers.N.mlp.gate_proj"),
    ("blk.N.ffn_up", "model.layers.N.mlp.up_proj"),
    ("blk.N.ffn_down", "model.layers.N.mlp.down_proj"),
];

/// Renames `name` by the table, `from` one column `to` the other; names not
/// in it are kept as they are.
fn rename(name: &str, to_hf: bool) -> String {
    let (stem, suffix) = match name.rsplit_once('.') {
        Some((s, x @ ("weight" | "bias"))) => (s, x),
        _ => return name.to_string(),
    };
    for (gg, hf) in NAMES {
        let (from, to) = if to_hf { (gg, hf) } else { (hf, gg) };
        let matched = match from.split_once('N') {
            None => (stem == *from).then(String::new),
            Some((pre, post)) => stem
                .strip_prefix(pre)
                .and_then(|s| s.strip_suffix(post))
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .map(str::to_string),
        };
        if let Some(n) = matched {
            return format!("{}.{suffix}", to.replacen('N', &n, 1));
        }
    }
    name.to_string()
}

/// The HuggingFace name of a llama.cpp tensor name (`blk.3.attn_q.weight` →
/// `model.layers.3.self_attn.q_proj.weight`); unknown names are kept.
pub fn hf_name(gguf_name: &str) -> String {
    rename(gguf_name, true)
}

/// The llama.cpp name of a HuggingFace tensor name: [`hf_name`]'s inverse.
pub fn gguf_name(hf_name: &str) -> String {
    rename(hf_name, false)
}

/// The `config.json` a Qwen2 GGUF file implies, from its `qwen2.*` keys, the
/// embedding's shape (vocabulary) and whether it has `output.weight` (tied
/// otherwise). Validated as `config.json` is.
pub(crate) fn qwen2_config(g: &Gguf) -> Result<crate::config::Config> {
    let arch = g.get("general.architecture").and_then(Value::as_str).unwrap_or("(none)");
    if arch != "qwen2" {
        return Err(Error::UnknownArchitecture {
            path: g.path.clone(),
            found: format!("GGUF general.architecture \"{arch}\""),
        });
    }
    let embd = g
        .header
        .tensors
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .ok_or_else(|| Error::MissingTensor { path: g.path.clone(), name: "token_embd.weight".into() })?;
    let vocab = match embd.dims[..] {
        [_, v] => v,
        _ => {
            return Err(g.err(format!("tensor `token_embd.weight` has dimensions {:?}, expected 2", embd.dims)));
        }
    };
    let heads = g.usize_key("qwen2.attention.head_count")?;
    let mut json = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": g.usize_key("qwen2.embedding_length")?,
        "intermediate_size": g.usize_key("qwen2.feed_forward_length")?,
        "num_hidden_layers": g.usize_key("qwen2.block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": match g.get("qwen2.attention.head_count_kv") {
            Some(_) => g.usize_key("qwen2.attention.head_count_kv")?,
            None => heads,
        },
        "rms_norm_eps": g.f64_key("qwen2.attention.layer_norm_rms_epsilon")?,
        "rope_theta": match g.get("qwen2.rope.freq_base") {
            Some(_) => g.f64_key("qwen2.rope.freq_base")?,
            None => 10000.0,
        },
        "max_position_embeddings": g.usize_key("qwen2.context_length")?,
        "vocab_size": vocab,
        "tie_word_embeddings": !g.header.tensors.iter().any(|t| t.name == "output.weight"),
    });
    if g.get("qwen2.attention.key_length").is_some() {
        json["head_dim"] = g.usize_key("qwen2.attention.key_length")?.into();
    }
    for (key, field) in
        [("tokenizer.ggml.eos_token_id", "eos_token_id"), ("tokenizer.ggml.bos_token_id", "bos_token_id")]
    {
        if g.get(key).is_some() {
            json[field] = g.usize_key(key)?.into();
        }
    }
    crate::config::Config::from_json(&json.to_string(), &g.path)
}

/// Ids of the tokens that end generation: `tokenizer.ggml.eos_token_id` and
/// `eot_token_id`, and, as llama.cpp does (its `special_eog_ids`), control
/// tokens whose text is a known end-of-turn marker, since a GGUF file has no
/// `generation_config.json` listing them (Qwen2.5's lists both
/// `<|im_end|>` and `<|endoftext|>`).
pub(crate) fn eos_ids(g: &Gguf) -> Vec<u32> {
    let mut ids: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
        .iter()
        .filter_map(|k| g.get(k).and_then(Value::as_u64).and_then(|v| u32::try_from(v).ok()))
        .collect();
    if let (Some(Array::String(tokens)), Some(types)) = (
        g.get("tokenizer.ggml.tokens").and_then(Value::as_array),
        g.get("tokenizer.ggml.token_type").and_then(Value::as_array).and_then(Array::to_i64_vec),
    ) {
        for (id, (t, ty)) in tokens.iter().zip(types).enumerate() {
            if ty == 3 && EOG_TEXTS.contains(&t.as_str()) {
                ids.push(id as u32);
            }
        }
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// llama.cpp's end-of-generation token texts (`llama-vocab.cpp`), those a
/// Qwen2 file can carry.
const EOG_TEXTS: &[&str] = &["<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|EOT|>"];

/// The HF tensor names of every tensor of the file, with where it lies: for
/// [`TensorStore::open_gguf`](crate::weights::TensorStore::open_gguf).
pub(crate) fn hf_names(g: &Gguf) -> HashMap<String, &TensorInfo> {
    g.header.tensors.iter().map(|t| (hf_name(&t.name), t)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        for (gg, hf) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output.weight", "lm_head.weight"),
            ("output_norm.weight", "model.norm.weight"),
            ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias"),
            ("blk.23.ffn_down.weight", "model.layers.23.mlp.down_proj.weight"),
            ("blk.7.attn_norm.weight", "model.layers.7.input_layernorm.weight"),
            ("blk.7.ffn_norm.weight", "model.layers.7.post_attention_layernorm.weight"),
            ("blk.7.attn_output.weight", "model.layers.7.self_attn.o_proj.weight"),
        ] {
            assert_eq!(hf_name(gg), hf);
            assert_eq!(gguf_name(hf), gg);
        }
        assert_eq!(hf_name("rope_freqs.weight"), "rope_freqs.weight");
        assert_eq!(hf_name("blk.x.attn_q.weight"), "blk.x.attn_q.weight");
    }
}
