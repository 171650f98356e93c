//! One thread streaming 1 GB of BF16, INT4, INT5, INT8, Q4_0 and Q5_0 rows from memory
//! through the active tier's mat-vec kernels, against a plain read of the
//! same bytes: how close the kernels come to the memory bus on their own,
//! with no threads, sections or serial work around them (what `ember
//! bench`'s decode rows mix together).
//!
//!     cargo run --release -p ember-kernels --example stream -- [COLS] [ROUNDS]
//!
//! COLS is the row length (896, this model's hidden size, by default; its
//! rows are short, 504 bytes in INT4; 4864 is its down projection's).
//! `EMBER_ISA` picks the tier.

use ember_kernels::bandwidth::sum_words_with;
use ember_kernels::formats::{BlockQ4, BlockQ4_0, BlockQ5, BlockQ5_0, BlockQ8};
use ember_kernels::{bf16, f16, matvec_with, Isa, MatRef, Weights};
use std::time::Instant;

const BYTES: usize = 1 << 30;

/// One type's matrix of about [`BYTES`], its rows of `cols` weights.
struct Stream {
    name: &'static str,
    bytes: HugeBytes,
    rows: usize,
    wrap: fn(&[u8]) -> Weights<'_>,
    shares: Vec<f64>,
}

impl Stream {
    fn new<B: bytemuck::Pod>(
        name: &'static str,
        cols: usize,
        block_len: usize,
        block: impl Fn(usize) -> B,
        wrap: fn(&[u8]) -> Weights<'_>,
    ) -> Stream {
        let per_row = cols / block_len * std::mem::size_of::<B>();
        let rows = BYTES / per_row;
        let blocks: Vec<B> = (0..rows * cols / block_len).map(block).collect();
        Stream { name, bytes: HugeBytes::copy_of(bytemuck::cast_slice(&blocks)), rows, wrap, shares: Vec::new() }
    }
}

/// Bytes in an anonymous mapping asked to be backed by transparent huge
/// pages, as `ember-model` holds weights: in 4 KiB pages, the four streams
/// of a mat-vec and the read's each take a TLB miss every 4 KiB, which
/// skews the comparison by the row length.
struct HugeBytes {
    map: *mut u8,
    map_len: usize,
    start: usize,
    len: usize,
}

impl HugeBytes {
    const HUGE_PAGE: usize = 2 << 20;

    fn copy_of(src: &[u8]) -> HugeBytes {
        let map_len = src.len() + Self::HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping; checked for failure.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(map != libc::MAP_FAILED, "mmap of {map_len} bytes failed");
        let start = (map as usize).next_multiple_of(Self::HUGE_PAGE) - map as usize;
        // SAFETY: the range lies inside the mapping. A refused hint leaves
        // small pages, which only makes the figures pessimistic.
        unsafe { libc::madvise(map.add(start), src.len(), libc::MADV_HUGEPAGE) };
        let mut b = HugeBytes { map: map as *mut u8, map_len, start, len: src.len() };
        b.as_mut().copy_from_slice(src);
        b
    }

    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `start + len` lies inside the mapping, which this owns.
        unsafe { std::slice::from_raw_parts_mut(self.map.add(self.start), self.len) }
    }
}

impl std::ops::Deref for HugeBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: as in `as_mut`.
        unsafe { std::slice::from_raw_parts(self.map.add(self.start), self.len) }
    }
}

impl Drop for HugeBytes {
    fn drop(&mut self) {
        // SAFETY: the mapping this made, unmapped once.
        unsafe { libc::munmap(self.map as *mut libc::c_void, self.map_len) };
    }
}

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>().expect("COLS and ROUNDS are numbers"));
    let cols = args.next().unwrap_or(896);
    let rounds = args.next().unwrap_or(7).max(1);
    assert!(cols > 0 && cols.is_multiple_of(32), "COLS must be a multiple of 32 (a block)");
    let isa = Isa::active();
    let x: Vec<f32> = (0..cols).map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5).collect();
    let d = f16::from_f32(0.01);
    let mut streams = vec![
        Stream::new(
            "BF16",
            cols,
            1,
            |i| bf16::from_f32(((i * 7919) % 97) as f32 / 97.0 - 0.5),
            |b| Weights::Bf16(bytemuck::cast_slice(b)),
        ),
        Stream::new(
            "Q4_0",
            cols,
            32,
            |i| BlockQ4_0 { d, qs: [(i * 37) as u8; 16] },
            |b| Weights::Q4_0(bytemuck::cast_slice(b)),
        ),
        Stream::new(
            "INT8",
            cols,
            32,
            |i| BlockQ8 { d, qs: [(i % 101) as i8 - 50; 32] },
            |b| Weights::Int8(bytemuck::cast_slice(b)),
        ),
        Stream::new(
            "Q5_0",
            cols,
            32,
            |i| BlockQ5_0 { d, qh: (i as u32).wrapping_mul(2654435761).to_le_bytes(), qs: [(i * 37) as u8; 16] },
            |b| Weights::Q5_0(bytemuck::cast_slice(b)),
        ),
    ];
    // INT4's and INT5's blocks are 128 weights: only for rows of whole blocks.
    if cols.is_multiple_of(128) {
        let int4 = Stream::new(
            "INT4",
            cols,
            128,
            |i| BlockQ4 { d: [d; 4], qs: [(i * 37) as u8; 64] },
            |b| Weights::Int4(bytemuck::cast_slice(b)),
        );
        streams.insert(1, int4);
        let int5 = Stream::new(
            "INT5",
            cols,
            128,
            |i| BlockQ5 {
                d: [d; 4],
                qh: std::array::from_fn(|j| (i as u32).wrapping_mul(2654435761).to_le_bytes()[j % 4] ^ j as u8),
                qs: [(i * 37) as u8; 64],
            },
            |b| Weights::Int5(bytemuck::cast_slice(b)),
        );
        streams.insert(3, int5);
    }
    println!("tier {}, {cols} columns, 1 thread, {} MB a pass", isa.name(), BYTES >> 20);
    let gb_s = |bytes: usize, t: Instant| bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
    for round in 0..rounds {
        let mut line = format!("round {round}:");
        for s in &mut streams {
            // Each kernel against a read right before it, so both see the
            // machine in the same state.
            let t = Instant::now();
            std::hint::black_box(sum_words_with(isa, &s.bytes));
            let read = gb_s(s.bytes.len(), t);
            let mut y = vec![0.0; s.rows];
            let m = MatRef::new((s.wrap)(&s.bytes), s.rows, cols);
            let t = Instant::now();
            matvec_with(isa, m, &x, &mut y);
            let k = gb_s(s.bytes.len(), t);
            line += &format!(" {} {k:.1} GB/s ({:.0}% of {read:.1}),", s.name, 100.0 * k / read);
            s.shares.push(k / read);
        }
        println!("{}", line.trim_end_matches(','));
    }
    let mut line = "median:".to_string();
    for s in &mut streams {
        s.shares.sort_by(f64::total_cmp);
        line += &format!(" {} {:.0}% of a read,", s.name, 100.0 * s.shares[s.shares.len() / 2]);
    }
    println!("{}", line.trim_end_matches(','));
}
