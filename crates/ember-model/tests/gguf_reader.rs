//! The GGUF reader on files the test writes itself: every metadata type,
//! tensor infos, alignment, a tiny model loaded from GGUF computing what it
//! computes from safetensors, and thousands of corrupted files (bit flips,
//! truncations, huge counts and lengths) that must be errors, never panics,
//! and never allocate more than a small multiple of the file's size.

use ember_model::advanced::gguf::{Array, GgmlType, Gguf, Header, Value};
use ember_model::advanced::{load_qwen2, BatchToken, Scratch, TensorStore};
use ember_model::Error;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};

/// The system allocator, noting the largest single request made on a thread
/// while that thread is [`measured`].
struct Noting;

thread_local! {
    static MEASURING: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // `try_with`: allocations during thread teardown are not measured.
    let _ = MEASURING.try_with(|on| {
        if on.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

// SAFETY: every call is forwarded to `System` unchanged.
unsafe impl GlobalAlloc for Noting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Noting = Noting;

/// `f()` and the largest single allocation it made on this thread.
fn measured<R>(f: impl FnOnce() -> R) -> (R, usize) {
    LARGEST.with(|l| l.set(0));
    MEASURING.with(|m| m.set(true));
    let r = f();
    MEASURING.with(|m| m.set(false));
    (r, LARGEST.with(|l| l.get()))
}

/// The most a header of `len` bytes may make the reader allocate at once:
/// its parsed form (strings, values, tensor infos) is a few times larger
/// than their encodings, never more than this.
fn allocation_bound(len: usize) -> usize {
    8 * len + 4096
}

/// Parses `b` under [`measured`], checking the allocation bound; a panic is
/// returned as `Err`.
fn parse_measured(b: &[u8], case: usize) -> std::thread::Result<Result<Header, String>> {
    let (parsed, largest) = measured(|| std::panic::catch_unwind(|| Header::parse(b)));
    assert!(
        largest <= allocation_bound(b.len()),
        "case {case}: a {}-byte file made the reader allocate {largest} bytes at once",
        b.len()
    );
    parsed
}

/// A GGUF file under construction (little-endian, as llama.cpp writes it).
struct Writer {
    version: u32,
    alignment: u64,
    kv: Vec<u8>,
    n_kv: u64,
    /// (name, dims ne[0] first, type id, data)
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

impl Writer {
    fn new() -> Writer {
        Writer { version: 3, alignment: 32, kv: Vec::new(), n_kv: 0, tensors: Vec::new() }
    }

    /// A key with its type id and already-encoded value.
    fn raw(&mut self, key: &str, ty: u32, value: &[u8]) -> &mut Self {
        put_str(&mut self.kv, key);
        self.kv.extend(ty.to_le_bytes());
        self.kv.extend(value);
        self.n_kv += 1;
        self
    }

    fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.raw(key, 4, &v.to_le_bytes())
    }

    fn f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.raw(key, 6, &v.to_le_bytes())
    }

    fn str(&mut self, key: &str, v: &str) -> &mut Self {
        let mut b = Vec::new();
        put_str(&mut b, v);
        self.raw(key, 8, &b)
    }

    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> &mut Self {
        self.tensors.push((name.into(), dims.to_vec(), ty, data));
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(self.version.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend(self.n_kv.to_le_bytes());
        b.extend(&self.kv);
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            put_str(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).next_multiple_of(self.alignment);
        }
        while !(b.len() as u64).is_multiple_of(self.alignment) {
            b.push(0);
        }
        let start = b.len();
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            b.resize(start + off as usize, 0);
            b.extend(data);
        }
        b
    }
}

/// A small file with every value type, a nested array and three tensors.
fn sample() -> Writer {
    let mut w = Writer::new();
    w.raw("t.u8", 0, &[200])
        .raw("t.i8", 1, &[0xff])
        .raw("t.u16", 2, &60000u16.to_le_bytes())
        .raw("t.i16", 3, &(-2i16).to_le_bytes())
        .u32("t.u32", 7)
        .raw("t.i32", 5, &(-7i32).to_le_bytes())
        .f32("t.f32", 1.5)
        .raw("t.bool", 7, &[1])
        .str("t.str", "héllo")
        .raw("t.u64", 10, &u64::MAX.to_le_bytes())
        .raw("t.i64", 11, &i64::MIN.to_le_bytes())
        .raw("t.f64", 12, &0.25f64.to_le_bytes());
    // An array of strings and an array of two arrays of i32.
    let mut a = 8u32.to_le_bytes().to_vec();
    a.extend(2u64.to_le_bytes());
    put_str(&mut a, "a");
    put_str(&mut a, "bc");
    w.raw("t.strings", 9, &a);
    let mut n = 9u32.to_le_bytes().to_vec();
    n.extend(2u64.to_le_bytes());
    for vals in [&[1i32, 2][..], &[3][..]] {
        n.extend(5u32.to_le_bytes());
        n.extend((vals.len() as u64).to_le_bytes());
        vals.iter().for_each(|v| n.extend(v.to_le_bytes()));
    }
    w.raw("t.nested", 9, &n);
    w.tensor("a", &[4, 2], 0, (0..8).flat_map(|i| (i as f32).to_le_bytes()).collect());
    w.tensor("q", &[32, 1], 8, vec![1; 34]);
    w.tensor("b", &[3], 1, vec![0; 6]);
    w
}

#[test]
fn reads_every_value_type_and_tensor_infos() {
    let bytes = sample().bytes();
    let h = Header::parse(&bytes).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.alignment, 32);
    assert_eq!(h.get("t.u8"), Some(&Value::U8(200)));
    assert_eq!(h.get("t.i8"), Some(&Value::I8(-1)));
    assert_eq!(h.get("t.u16"), Some(&Value::U16(60000)));
    assert_eq!(h.get("t.i16"), Some(&Value::I16(-2)));
    assert_eq!(h.get("t.u32"), Some(&Value::U32(7)));
    assert_eq!(h.get("t.i32"), Some(&Value::I32(-7)));
    assert_eq!(h.get("t.f32"), Some(&Value::F32(1.5)));
    assert_eq!(h.get("t.bool"), Some(&Value::Bool(true)));
    assert_eq!(h.get("t.str").and_then(Value::as_str), Some("héllo"));
    assert_eq!(h.get("t.u64"), Some(&Value::U64(u64::MAX)));
    assert_eq!(h.get("t.i64"), Some(&Value::I64(i64::MIN)));
    assert_eq!(h.get("t.f64"), Some(&Value::F64(0.25)));
    assert_eq!(h.get("t.strings"), Some(&Value::Array(Array::String(vec!["a".into(), "bc".into()]))));
    assert_eq!(h.get("t.nested"), Some(&Value::Array(Array::Array(vec![Array::I32(vec![1, 2]), Array::I32(vec![3])]))));
    let names: Vec<_> = h.tensors.iter().map(|t| (t.name.as_str(), t.ty, t.size, t.shape())).collect();
    assert_eq!(
        names,
        [("a", GgmlType(0), 32, vec![2, 4]), ("q", GgmlType(8), 34, vec![1, 32]), ("b", GgmlType(1), 6, vec![3])]
    );
    assert!(h.tensors.iter().all(|t| (h.data_start + t.offset).is_multiple_of(32)));
    // Version 2 has the same layout.
    let mut v2 = sample();
    v2.version = 2;
    assert_eq!(Header::parse(&v2.bytes()).unwrap().version, 2);
}

#[test]
fn general_alignment_is_honoured() {
    let mut w = sample();
    w.alignment = 64;
    w.u32("general.alignment", 64);
    let h = Header::parse(&w.bytes()).unwrap();
    assert_eq!(h.alignment, 64);
    assert_eq!(h.data_start % 64, 0);
    let mut bad = sample();
    bad.u32("general.alignment", 24);
    assert!(Header::parse(&bad.bytes()).unwrap_err().contains("power of two"));
}

fn parse_err(bytes: &[u8]) -> String {
    parse_measured(bytes, 0).expect("no panic").expect_err("an invalid file parsed")
}

#[test]
fn bad_files_are_errors_that_name_the_problem() {
    let good = sample().bytes();
    assert!(parse_err(b"GGU").contains("truncated"));
    assert!(parse_err(b"GGML\x03\0\0\0").contains("not a GGUF file"));
    let mut v = good.clone();
    v[4] = 1;
    assert!(parse_err(&v).contains("version 1"));
    v[4] = 9;
    assert!(parse_err(&v).contains("unknown GGUF version 9"));
    v[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(parse_err(&v).contains("big-endian"));
    // Counts far past the file: refused before allocating.
    let mut v = good.clone();
    v[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(parse_err(&v).contains("cannot fit"));
    let mut v = good.clone();
    v[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(parse_err(&v).contains("cannot fit"));
    // A key length past the end.
    let mut v = good.clone();
    v[24..32].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
    assert!(parse_err(&v).contains("truncated"), "{}", parse_err(&v));
    // Truncated in the data.
    assert!(parse_err(&good[..good.len() - 1]).contains("runs past the end of the file"));
    // An array claiming 2^60 strings.
    let mut w = Writer::new();
    let mut a = 8u32.to_le_bytes().to_vec();
    a.extend((1u64 << 60).to_le_bytes());
    w.raw("huge", 9, &a);
    assert!(parse_err(&w.bytes()).contains("elements of `huge`"));
    // Unknown value type, unknown and unsupported tensor types, bad shapes.
    let mut w = Writer::new();
    w.raw("odd", 13, &[0]);
    assert!(parse_err(&w.bytes()).contains("unknown value type 13"));
    let mut w = Writer::new();
    w.tensor("t", &[32], 99, vec![0; 32]);
    assert!(parse_err(&w.bytes()).contains("tensor `t` has an unknown type id 99"));
    let mut w = Writer::new();
    w.tensor("t", &[30], 8, vec![0; 34]);
    assert!(parse_err(&w.bytes()).contains("not a whole number of 32-weight blocks"));
    // A K type's rows are whole 256-weight super-blocks (this model's 896
    // are not: llama.cpp falls back to other types for such rows).
    for (ty, bytes) in [(10, 84), (11, 110), (12, 144), (13, 176), (14, 210)] {
        let mut w = Writer::new();
        w.tensor("blk.0.attn_q.weight", &[896, 2], ty, vec![0; 8 * bytes]);
        let e = parse_err(&w.bytes());
        assert!(e.contains("has rows of 896 weights, not a whole number of 256-weight blocks"), "{e}");
    }
    // A K tensor whose data runs past the end of the file.
    let mut w = Writer::new();
    w.tensor("t", &[512, 2], 12, vec![0; 144 * 3]);
    let e = parse_err(&w.bytes());
    assert!(e.contains("tensor `t`'s data (576 bytes at offset 0) runs past the end of the file"), "{e}");
    let mut w = Writer::new();
    w.tensor("t", &[1 << 32, 1 << 32, 1 << 32], 0, vec![]);
    assert!(parse_err(&w.bytes()).contains("overflow"));
    let mut w = Writer::new();
    w.tensor("t", &[1, 1, 1, 1, 1], 0, vec![0; 4]);
    assert!(parse_err(&w.bytes()).contains("5 dimensions"));
    let mut w = Writer::new();
    w.tensor("t", &[1], 0, vec![0; 4]).tensor("t", &[1], 0, vec![0; 4]);
    assert!(parse_err(&w.bytes()).contains("appears twice"));
    // A misaligned offset: patch the second tensor's offset (its last 8 bytes
    // of info) to 4.
    let mut w = Writer::new();
    w.tensor("x", &[1], 0, vec![0; 4]).tensor("y", &[1], 0, vec![0; 4]);
    let mut b = w.bytes();
    let info_end = 24 + (8 + 1 + 4 + 8 + 4 + 8) * 2;
    b[info_end - 8..info_end].copy_from_slice(&4u64.to_le_bytes());
    assert!(parse_err(&b).contains("not a multiple of the alignment"));
    // An invalid bool and invalid UTF-8.
    let mut w = Writer::new();
    w.raw("b", 7, &[2]);
    assert!(parse_err(&w.bytes()).contains("bool of value 2"));
    let mut w = Writer::new();
    w.raw("s", 8, &[1, 0, 0, 0, 0, 0, 0, 0, 0xff]);
    assert!(parse_err(&w.bytes()).contains("not valid UTF-8"));
    // Arrays nested too deep.
    let mut deep = Vec::new();
    for _ in 0..20 {
        deep.extend(9u32.to_le_bytes());
        deep.extend(1u64.to_le_bytes());
    }
    deep.extend(0u32.to_le_bytes());
    deep.extend(0u64.to_le_bytes());
    let mut w = Writer::new();
    w.raw("deep", 9, &deep);
    assert!(parse_err(&w.bytes()).contains("deeper"));
}

/// xorshift64*: a seeded, deterministic stream for the mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Every mutation of a valid file either parses (into a header whose
/// tensors lie inside the file) or is an error; none panics. The interesting
/// numbers (counts, lengths, dimensions, offsets) are overwritten with
/// boundary values as well as flipped.
#[test]
fn mutated_files_never_panic() {
    let good = sample().bytes();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let specials = [0u64, 1, 2, 31, 32, 255, u32::MAX as u64, 1 << 32, 1 << 62, u64::MAX - 7, u64::MAX];
    let mut errors = 0;
    let cases = 20_000;
    for case in 0..cases {
        let mut b = good.clone();
        for _ in 0..1 + rng.below(4) {
            if b.is_empty() {
                break;
            }
            match rng.below(5) {
                0 => {
                    let i = rng.below(b.len());
                    b[i] ^= 1 << rng.below(8);
                }
                1 => {
                    let i = rng.below(b.len());
                    b[i] = rng.next() as u8;
                }
                2 if b.len() >= 8 => {
                    let i = rng.below(b.len() - 7);
                    let v = specials[rng.below(specials.len())];
                    b[i..i + 8].copy_from_slice(&v.to_le_bytes());
                }
                3 => {
                    let len = rng.below(b.len() + 1);
                    b.truncate(len);
                }
                _ => {
                    let i = rng.below(b.len() + 1);
                    let extra: Vec<u8> = (0..rng.below(16)).map(|_| rng.next() as u8).collect();
                    b.splice(i..i, extra);
                }
            }
        }
        match parse_measured(&b, case) {
            Err(_) => panic!("case {case}: the reader panicked"),
            Ok(Err(_)) => errors += 1,
            Ok(Ok(h)) => {
                for t in &h.tensors {
                    assert!(h.data_start + t.offset + t.size <= b.len() as u64, "case {case}");
                }
            }
        }
    }
    // Most mutations break something; the test must not pass vacuously.
    assert!(errors > cases / 4, "only {errors} of {cases} mutated files were errors");
}

/// Random bytes after a valid magic and version: errors, no panic.
#[test]
fn random_headers_never_panic() {
    let mut rng = Rng(42);
    for case in 0..5_000 {
        let mut b = b"GGUF".to_vec();
        b.extend([2u32, 3][rng.below(2)].to_le_bytes());
        // Small counts so the parser gets into the key/value and tensor code.
        b.extend((rng.below(4) as u64).to_le_bytes());
        b.extend((rng.below(4) as u64).to_le_bytes());
        let n = rng.below(300);
        b.extend((0..n).map(|_| if rng.below(3) == 0 { 0 } else { rng.next() as u8 }));
        assert!(parse_measured(&b, case).is_ok(), "case {case}");
    }
}

/// A scratch path for one test's file or folder, removed when dropped.
struct Tmp(PathBuf);

impl std::ops::Deref for Tmp {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Tmp {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tmp(name: &str) -> Tmp {
    Tmp(std::env::temp_dir().join(format!("ember-gguf-test-{}-{name}", std::process::id())))
}

fn tiny_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tiny-chat")
}

/// The tiny model's safetensors written as a GGUF file with llama.cpp's
/// names, dims reversed, matrices stored as `ty` (0 F32, 30 BF16, 1 F16),
/// vectors as F32.
fn tiny_as_gguf(ty: u32) -> Vec<u8> {
    let dir = tiny_dir();
    let c = ember_model::Config::from_file(&dir.join("config.json")).unwrap();
    let store = TensorStore::open_dir(&dir).unwrap();
    let mut w = Writer::new();
    w.str("general.architecture", "qwen2")
        .u32("qwen2.context_length", c.max_position_embeddings as u32)
        .u32("qwen2.embedding_length", c.hidden_size as u32)
        .u32("qwen2.block_count", c.num_hidden_layers as u32)
        .u32("qwen2.feed_forward_length", c.intermediate_size as u32)
        .u32("qwen2.attention.head_count", c.num_attention_heads as u32)
        .u32("qwen2.attention.head_count_kv", c.num_key_value_heads as u32)
        .f32("qwen2.rope.freq_base", c.rope_theta)
        .f32("qwen2.attention.layer_norm_rms_epsilon", c.rms_norm_eps);
    let mut names: Vec<&str> = store.names().collect();
    names.sort();
    for name in names {
        let t = store.get_any(name).unwrap();
        let values = t.to_f32_vec();
        let (data, tid) = match (ty, t.shape.len()) {
            (30, 2) => (values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(), 30),
            (1, 2) => (values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(), 1),
            _ => (values.iter().flat_map(|v| v.to_le_bytes()).collect(), 0),
        };
        let dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
        w.tensor(&ember_model::advanced::gguf::gguf_name(name), &dims, tid, data);
    }
    w.bytes()
}

/// `m` at exact precision: the fast one rounds a batch's activations to
/// BF16 for BF16 weights where the CPU has BF16 dot products (a Zen 4: the
/// tiny model's logits 0.056 apart from its F32 copy's), and these tests
/// are about what the files hold, not about that rounding.
fn exact(mut m: ember_model::advanced::Qwen2) -> ember_model::advanced::Qwen2 {
    m.precision = ember_model::Precision::Exact;
    m
}

fn logits(m: &ember_model::advanced::Qwen2, ids: &[u32]) -> Vec<f32> {
    let mut cache = m.new_cache(16);
    let batch: Vec<BatchToken> =
        ids.iter().enumerate().map(|(p, &token)| BatchToken { token, seq: 0, pos: p, logits: true }).collect();
    let mut scratch = Scratch::default();
    m.forward(&batch, &mut [&mut cache], &mut scratch).unwrap().to_vec()
}

#[test]
fn tiny_model_from_gguf_computes_what_safetensors_computes() {
    let folder = exact(load_qwen2(&tiny_dir()).unwrap());
    let ids = [1u32, 5, 9, 2];
    let want = logits(&folder, &ids);
    let stored = folder.layers[0].mlp.up_proj.weight.dtype;
    for ty in [0, 30, 1] {
        let path = tmp(&format!("tiny-{ty}.gguf"));
        std::fs::write(&path, tiny_as_gguf(ty)).unwrap();
        let m = exact(load_qwen2(&path).unwrap());
        assert_eq!(m.config.hidden_size, folder.config.hidden_size);
        assert_eq!(m.config.tie_word_embeddings, folder.config.tie_word_embeddings);
        assert_eq!(m.config.rope_theta, folder.config.rope_theta);
        let got = logits(&m, &ids);
        let same_type = ember_model::advanced::gguf::GgmlType(ty).weight_type() == Some(stored);
        assert_eq!(
            m.layers[0].mlp.up_proj.weight.dtype,
            ember_model::advanced::gguf::GgmlType(ty).weight_type().unwrap()
        );
        let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        if same_type {
            assert_eq!(got, want, "the same weights in the same type: the same logits");
        } else {
            // The same values (F16 rounds them) through another type's kernels.
            assert!(diff < 1e-3, "{} copy drifts by {diff}", ember_model::advanced::gguf::GgmlType(ty));
        }
        // A folder holding just this file loads it too.
        let dir = tmp(&format!("dir-{ty}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(&path, dir.join("model.gguf")).unwrap();
        assert_eq!(logits(&exact(load_qwen2(&dir).unwrap()), &ids), got);
        std::fs::copy(&path, dir.join("other.gguf")).unwrap();
        let e = load_qwen2(&dir).unwrap_err();
        assert!(matches!(e, Error::ModelPath { .. }) && e.to_string().contains("2 .gguf files"), "{e}");
    }
}

#[test]
fn gguf_model_errors_name_the_tensor() {
    // An IQ4_XS tensor (a type ember does not run) where a matrix is
    // needed: named with its type.
    let mut w = Writer::new();
    w.str("general.architecture", "qwen2");
    w.tensor("blk.0.ffn_up.weight", &[256, 1], 23, vec![0; 136]);
    let path = tmp("iq4xs.gguf");
    std::fs::write(&path, w.bytes()).unwrap();
    let store = TensorStore::open_gguf(Gguf::open(&path).unwrap()).unwrap();
    let e = store.get("model.layers.0.mlp.up_proj.weight", &[1, 256]).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: tensor `blk.0.ffn_up.weight` has GGUF type IQ4_XS; ember runs F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K",
            path.display()
        )
    );
    let e = store.get("model.layers.0.mlp.down_proj.weight", &[1, 256]).unwrap_err();
    assert!(e.to_string().contains("tensor `blk.0.ffn_down.weight` is missing"), "{e}");
    let e = store.get_any("model.layers.0.mlp.up_proj.weight").unwrap_err();
    assert!(e.to_string().contains("IQ4_XS"), "{e}");
    // A shape that disagrees with the config: named by the file's name.
    let path = tmp("shape.gguf");
    let mut w = Writer::new();
    w.tensor("blk.0.attn_q.weight", &[3, 2], 0, vec![0; 24]);
    std::fs::write(&path, w.bytes()).unwrap();
    let store = TensorStore::open_gguf(Gguf::open(&path).unwrap()).unwrap();
    let e = store.get("model.layers.0.self_attn.q_proj.weight", &[3, 2]).unwrap_err();
    assert!(e.to_string().contains("tensor `blk.0.attn_q.weight` has shape [2, 3], expected [3, 2]"), "{e}");
    // Another architecture.
    let mut w = Writer::new();
    w.str("general.architecture", "llama");
    let path = tmp("llama.gguf");
    std::fs::write(&path, w.bytes()).unwrap();
    let e = load_qwen2(&path).unwrap_err();
    assert!(matches!(e, Error::UnknownArchitecture { .. }), "{e}");
    // A file that is not GGUF.
    let path = tmp("junk.gguf");
    std::fs::write(&path, b"nope").unwrap();
    let e = load_qwen2(&path).unwrap_err();
    assert!(e.to_string().contains("invalid GGUF file: not a GGUF file"), "{e}");
}

/// Every GGUF type ember runs is a row of its format table with ggml's block
/// length and size, and each is named as ggml names it (`q4_k` for Q4_K).
#[test]
fn each_run_type_has_ggmls_block() {
    let mut run = Vec::new();
    for id in 0..64 {
        let t = ember_model::advanced::gguf::GgmlType(id);
        if let Some(w) = t.weight_type() {
            let (len, bytes) = t.block().unwrap();
            assert_eq!((w.block_len() as u64, w.block_bytes() as u64), (len, bytes), "{t}");
            if w.block_len() > 1 && !matches!(id, 2 | 8) {
                assert_eq!(w.name(), t.name().to_lowercase(), "{t}");
            }
            run.push(t.name());
        }
    }
    assert_eq!(
        run,
        ["F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "BF16"]
    );
}
