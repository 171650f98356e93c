//! The harness of ember's fuzz targets (`tests/fuzz.rs` here and in
//! ember-server, `src/fuzz.rs` of ember-cli): property tests on stable Rust,
//! with proptest's generation and shrinking, under an allocator that notes
//! the largest single allocation of each case.
//!
//! A target is one `#[test]` calling [`run`] with a strategy of hostile
//! inputs and a property. Every target's invariant: no panic (a panic is a
//! failure, shrunk to a minimal input), no abort, and no single allocation
//! above [`FUZZ_ALLOC_LIMIT`].
//!
//! The environment sets the budget (`cargo xtask fuzz` sets it; plain
//! `cargo test` runs each target's small default):
//!
//! - `EMBER_FUZZ_CASES`: cases per target (default: the target's own, 128
//!   or 256, so the workspace tests stay quick);
//! - `EMBER_FUZZ_SECONDS`: run for this long instead (at least one batch);
//! - `EMBER_FUZZ_SEED`: the seed (default: from the clock); each run prints
//!   it, and the same seed replays the same cases.
#![allow(dead_code)]

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// The largest single allocation a case may make. Fuzz inputs are at most a
/// few hundred KB (the tiny model's files, mutated), and every legitimate
/// buffer of loading or running the tiny model is a small multiple of that:
/// a request above this is a size taken from the input without a check.
pub const FUZZ_ALLOC_LIMIT: usize = 64 << 20;

/// Requests above this are refused outright (the allocator returns null),
/// so a hostile size cannot take the machine's memory before the case
/// fails; an infallible allocation then aborts with the size in the message.
const REFUSE_ABOVE: usize = 1 << 30;

/// The system allocator, noting the largest request of each thread.
pub struct Noting;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

/// The largest request of any thread since the process started.
static LARGEST_ANYWHERE: AtomicUsize = AtomicUsize::new(0);

fn note(size: usize) -> bool {
    // `try_with`: allocations during thread teardown are not noted per thread.
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
    LARGEST_ANYWHERE.fetch_max(size, Ordering::Relaxed);
    if size > REFUSE_ABOVE {
        refused(size);
        return false;
    }
    true
}

/// Says which request was refused, without allocating.
fn refused(size: usize) {
    use std::io::Write;
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = size;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut err = std::io::stderr();
    let _ = err.write_all(b"\nfuzz: refused an allocation of ");
    let _ = err.write_all(&digits[i..]);
    let _ = err.write_all(b" bytes (FUZZ_ALLOC_LIMIT is 64 MiB): replay with the printed EMBER_FUZZ_SEED\n");
}

// SAFETY: every call is forwarded to `System` unchanged, or refused with a
// null pointer, which `GlobalAlloc` allows.
unsafe impl GlobalAlloc for Noting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !note(layout.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !note(layout.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !note(new_size) {
            return std::ptr::null_mut();
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Cases per batch: each batch is a fresh runner with its own seed, so a
/// time budget is checked between batches.
const BATCH: u32 = 64;

fn env_number<T: std::str::FromStr>(key: &str) -> Option<T> {
    let v = std::env::var(key).ok()?;
    Some(v.trim().parse().unwrap_or_else(|_| panic!("{key}={v:?} is not a number")))
}

thread_local! {
    /// Where the last panic on this thread happened (the hook notes it; the
    /// failure report says it).
    static PANIC_AT: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
    /// Whether this thread is running a case (whose panics are noted, not printed).
    static IN_CASE: Cell<bool> = const { Cell::new(false) };
}

thread_local! {
    /// How the cases of the running target ended ([`outcome`]).
    static OUTCOMES: std::cell::RefCell<std::collections::BTreeMap<String, u64>> =
        const { std::cell::RefCell::new(std::collections::BTreeMap::new()) };
}

/// Counts one case's outcome under `label` (`"loaded"`, an error's kind):
/// the target's summary line shows how deep the inputs got, so a target
/// whose inputs all fail at the first check is seen.
pub fn outcome(label: impl Into<String>) {
    let label = label.into();
    let _ = OUTCOMES.try_with(|o| *o.borrow_mut().entry(label).or_default() += 1);
}

/// The kind of a `Result`'s error as `outcome` labels it: `ok`, or the
/// error's variant name (its `Debug` up to the first brace or parenthesis).
pub fn kind<T, E: Debug>(r: &Result<T, E>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(e) => {
            let d = format!("{e:?}");
            d.split(['(', '{', ' ']).next().unwrap_or("").to_string()
        }
    }
}

/// A panic hook that, within a case, notes the location instead of
/// printing (proptest shrinks a failure by running it hundreds of times);
/// the report prints it. Other panics print as usual.
fn quiet_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if IN_CASE.try_with(Cell::get).unwrap_or(false) {
                let at = info.location().map(|l| l.to_string()).unwrap_or_default();
                let _ = PANIC_AT.try_with(|p| *p.borrow_mut() = Some(at));
            } else {
                default(info);
            }
        }));
    });
}

/// Runs the target `name`: `default_cases` cases of `strategy` (or as the
/// environment says), each through `property`, which returns `Err` (or
/// panics) on a failure. Panics with the minimal failing input, the panic's
/// location and the seed that replays it.
pub fn run<S>(name: &str, default_cases: u32, strategy: S, property: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S: Strategy,
    S::Value: Debug,
{
    quiet_panics();
    let cases: u64 = env_number("EMBER_FUZZ_CASES").unwrap_or(default_cases.into());
    let seconds: Option<f64> = env_number("EMBER_FUZZ_SECONDS");
    let seed: u64 = env_number("EMBER_FUZZ_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
    });
    OUTCOMES.with(|o| o.borrow_mut().clear());
    let start = Instant::now();
    let (mut done, mut batch) = (0u64, 0u64);
    let largest = Cell::new(0usize);
    loop {
        let n = match seconds {
            Some(_) => BATCH,
            None => (cases - done).min(BATCH.into()) as u32,
        };
        if n == 0 {
            break;
        }
        let config = Config {
            cases: n,
            failure_persistence: None,
            rng_seed: RngSeed::Fixed(seed ^ batch.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            max_shrink_iters: 4096,
            ..Config::default()
        };
        let mut runner = TestRunner::new(config);
        let result = runner.run(&strategy, |input| {
            LARGEST.with(|l| l.set(0));
            IN_CASE.with(|c| c.set(true));
            // Unwinding out of `property` is caught by the runner, which
            // records the failure; IN_CASE is reset below and by the next case.
            let r = property(input);
            IN_CASE.with(|c| c.set(false));
            let case_largest = LARGEST.with(|l| l.get());
            largest.set(largest.get().max(case_largest));
            if case_largest > FUZZ_ALLOC_LIMIT {
                return Err(TestCaseError::fail(format!(
                    "a single allocation of {case_largest} bytes, above FUZZ_ALLOC_LIMIT ({FUZZ_ALLOC_LIMIT})"
                )));
            }
            r
        });
        IN_CASE.with(|c| c.set(false));
        match result {
            Ok(()) => {}
            Err(TestError::Fail(reason, input)) => {
                let at = PANIC_AT.with(|p| p.borrow_mut().take()).map_or(String::new(), |at| format!(" (at {at})"));
                panic!(
                    "fuzz target {name} failed after {done} cases: {reason}{at}\nminimal input: {input:#?}\n\
                     replay: EMBER_FUZZ_SEED={seed} (batch {batch})"
                );
            }
            Err(TestError::Abort(reason)) => panic!("fuzz target {name} aborted: {reason} (EMBER_FUZZ_SEED={seed})"),
        }
        done += u64::from(n);
        batch += 1;
        if seconds.is_some_and(|s| start.elapsed().as_secs_f64() >= s) {
            break;
        }
    }
    // Allocations on other threads (the kernels' pool) are only seen here.
    let anywhere = LARGEST_ANYWHERE.load(Ordering::Relaxed);
    assert!(anywhere <= FUZZ_ALLOC_LIMIT, "fuzz target {name}: an allocation of {anywhere} bytes on some thread");
    let outcomes = OUTCOMES.with(|o| std::mem::take(&mut *o.borrow_mut()));
    let outcomes: Vec<String> = outcomes.iter().map(|(k, n)| format!("{k} {n}")).collect();
    // One line per target, read by `cargo xtask fuzz`.
    eprintln!(
        "fuzz target {name}: {done} cases in {:.1} s, no failure; largest allocation of a case {} bytes \
         (limit {FUZZ_ALLOC_LIMIT}); EMBER_FUZZ_SEED={seed}\n  outcomes: {}",
        start.elapsed().as_secs_f64(),
        largest.get(),
        if outcomes.is_empty() { "-".to_string() } else { outcomes.join(", ") }
    );
}

/// A folder of the target's own under the temp dir, removed on drop.
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(target: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("ember-fuzz-{}-{target}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Strategies of hostile values shared by the targets.
pub mod hostile {
    use proptest::prelude::*;
    use serde_json::{json, Value};

    /// Integers at the edges: 0, 1, powers of two and their neighbours up
    /// to u64::MAX, and small ones.
    pub fn integer() -> impl Strategy<Value = u64> {
        prop_oneof![
            4 => 0u64..8,
            2 => 0u64..5000,
            3 => (0u32..64, -1i64..=1).prop_map(|(p, d)| (1u64 << p).wrapping_add_signed(d)),
            1 => Just(u64::MAX),
            1 => Just(1_000_000_000_000_000),
            1 => Just(10_000_000_000_000),
            1 => any::<u64>(),
        ]
    }

    /// Floats at the edges as JSON can write them (no NaN or infinity).
    pub fn float() -> impl Strategy<Value = f64> {
        prop_oneof![
            Just(0.0),
            Just(-0.0),
            Just(1e-60),
            Just(1e-6),
            Just(0.5),
            Just(1.0),
            Just(1e6),
            Just(3.5e38),
            Just(1e300),
            Just(-1.0),
            Just(f64::MAX),
            Just(f64::MIN_POSITIVE),
            any::<f64>().prop_filter("finite", |f| f.is_finite()),
        ]
    }

    /// Strings: empty, special tokens and template syntax, arbitrary text.
    pub fn string() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            prop::sample::select(FRAGMENTS).prop_map(String::from),
            prop::collection::vec(prop::sample::select(FRAGMENTS), 0..6).prop_map(|v| v.concat()),
            any::<String>(),
            "[a-z_.]{0,12}",
        ]
    }

    /// Pieces of text that mean something to a tokenizer, template or parser.
    pub const FRAGMENTS: &[&str] = &[
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<tool_call>",
        "</tool_call>",
        "{\"name\": \"f\", \"arguments\": {}}",
        "{\"name\": 3}",
        "{{",
        "}}",
        "{%",
        "%}",
        "{#",
        "\u{0}",
        "\u{fffd}",
        "\r\n",
        " ",
        "\t",
        "é",
        "日本",
        "🦀",
        "\u{200d}",
        "w1",
        "w95",
        "hello",
        "user",
        "assistant",
        "system",
        "tool",
        "null",
        "[",
        "]",
        "\"",
        "\\",
        "int8",
        "int4",
        "BF16",
        "U8",
        "..",
        "/",
    ];

    /// Any JSON value, with hostile leaves, nested a little.
    pub fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            integer().prop_map(|n| json!(n)),
            integer().prop_map(|n| json!(-(n as i128).clamp(0, i64::MAX as i128) as i64)),
            float().prop_map(|f| json!(f)),
            string().prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec(("[a-z_]{0,8}", inner), 0..4)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    /// Bytes: empty, random, or text.
    pub fn bytes() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![Just(Vec::new()), prop::collection::vec(any::<u8>(), 0..64), string().prop_map(String::into_bytes),]
    }
}
