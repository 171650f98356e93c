//! One thread streaming 1 GB of INT4 and of INT8 rows from memory through
//! the active tier's mat-vec kernels, against a plain read of the same
//! bytes: how close the kernels come to the memory bus on their own, with
//! no threads, sections or serial work around them (what `ember bench`'s
//! decode rows mix together).
//!
//!     cargo run --release -p ember-kernels --example stream -- [COLS] [ROUNDS]
//!
//! COLS is the row length (896, this model's hidden size, by default; its
//! rows are short, 504 bytes in INT4). `EMBER_ISA` picks the tier.

use ember_kernels::bandwidth::sum_words_with;
use ember_kernels::formats::{BlockQ4, BlockQ8};
use ember_kernels::{f16, matvec_with, Isa, MatRef, Weights};
use std::time::Instant;

const BYTES: usize = 1 << 30;

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>().expect("COLS and ROUNDS are numbers"));
    let cols = args.next().unwrap_or(896);
    let rounds = args.next().unwrap_or(7).max(1);
    assert!(cols > 0 && cols.is_multiple_of(32), "COLS must be a multiple of 32 (a block)");
    let isa = Isa::active();
    let x: Vec<f32> = (0..cols).map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5).collect();
    let d = f16::from_f32(0.01);
    let blocks = cols / 32;
    let rows4 = BYTES / (blocks * std::mem::size_of::<BlockQ4>());
    let q4: Vec<BlockQ4> = (0..rows4 * blocks).map(|i| BlockQ4 { d, qs: [(i * 37) as u8; 16] }).collect();
    let rows8 = BYTES / (blocks * std::mem::size_of::<BlockQ8>());
    let q8: Vec<BlockQ8> = (0..rows8 * blocks).map(|i| BlockQ8 { d, qs: [(i % 101) as i8 - 50; 32] }).collect();
    let (b4, b8): (&[u8], &[u8]) = (bytemuck::cast_slice(&q4), bytemuck::cast_slice(&q8));
    let (m4, m8) = (MatRef::new(Weights::Int4(&q4), rows4, cols), MatRef::new(Weights::Int8(&q8), rows8, cols));
    let (mut y4, mut y8) = (vec![0.0; rows4], vec![0.0; rows8]);
    let gb_s = |bytes: usize, t: Instant| bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
    println!("tier {}, {cols} columns, 1 thread, {} MB a pass", isa.name(), BYTES >> 20);
    let (mut int4, mut int8) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // Each kernel against a read right before it, so both see the
        // machine in the same state.
        let t = Instant::now();
        std::hint::black_box(sum_words_with(isa, b4));
        let read4 = gb_s(b4.len(), t);
        let t = Instant::now();
        matvec_with(isa, m4, &x, &mut y4);
        let k4 = gb_s(b4.len(), t);
        let t = Instant::now();
        std::hint::black_box(sum_words_with(isa, b8));
        let read8 = gb_s(b8.len(), t);
        let t = Instant::now();
        matvec_with(isa, m8, &x, &mut y8);
        let k8 = gb_s(b8.len(), t);
        println!(
            "round {round}: INT4 {k4:.1} GB/s ({:.0}% of a read at {read4:.1}), INT8 {k8:.1} ({:.0}% of {read8:.1})",
            100.0 * k4 / read4,
            100.0 * k8 / read8
        );
        int4.push(k4 / read4);
        int8.push(k8 / read8);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("median: INT4 {:.0}% of a read, INT8 {:.0}%", 100.0 * median(&mut int4), 100.0 * median(&mut int8));
}
