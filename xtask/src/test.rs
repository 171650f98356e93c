//! `cargo xtask test`: everything CI runs, in order.
//!
//! 1. `cargo xtask fetch` (idempotent: only checksums on a warm cache), and
//!    its GGUF-to-BF16 conversion once more into a scratch folder, checked
//!    against the reference sums;
//! 2. `cargo test --workspace` once per instruction-set tier the CPU supports
//!    (`EMBER_ISA=scalar`, `avx2`, ...; tiers the CPU lacks are skipped and
//!    said so), so every SIMD kernel and the whole model run under each,
//!    and the kernel tests once more under the other prefetch policy
//!    (`EMBER_PREFETCH`, see `ember_kernels::cpu::software_prefetch`);
//!    then `cargo xtask fuzz --cases 3000 --debug`: every fuzz target a few
//!    thousand cases (in the test profile just built: about a minute);
//! 3. `cargo rustdoc -- -D missing-docs -D warnings` on the three library
//!    crates (every public item documented, every intra-doc link resolving);
//! 4. `cargo xtask parity` on the real model;
//! 5. `cargo xtask e2e`: seeded sampling and a two-turn chat on the real model,
//!    `cargo xtask serve-e2e`: the server with the official openai client,
//!    and `cargo xtask fleet`: three replicas behind nginx, one killed;
//! 6. `cargo xtask readme`: the README's library example in a fresh project;
//! 7. `cargo xtask package`: the library crates packaged, and their packaged
//!    tests run from the packages alone.

use anyhow::{bail, Context, Result};
use std::process::Command;

use ember_kernels::{Isa, Tier};

pub fn run(args: &[String]) -> Result<()> {
    if let Some(a) = args.first() {
        bail!("unknown option `{a}` (test takes none)");
    }
    crate::fetch::run(&[])?;
    crate::fetch::check_conversion()?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    for t in Tier::ALL {
        let tier = t.name();
        if Isa::get(t).is_none() {
            eprintln!("xtask test: this CPU has no {tier} tier; its kernels are covered by their scalar twins");
            continue;
        }
        eprintln!("xtask test: cargo test --workspace with EMBER_ISA={tier}");
        let status = Command::new(&cargo)
            .current_dir(crate::root())
            .args(["test", "--workspace"])
            .env("EMBER_ISA", tier)
            .status()
            .context("running cargo test")?;
        if !status.success() {
            bail!("cargo test --workspace failed with EMBER_ISA={tier}");
        }
    }
    // The decode kernels prefetch their row streams or leave them to the
    // hardware, by CPU vendor: the kernel tests once more under the policy
    // this CPU does not take, so both variants run on every machine.
    let other = if ember_kernels::cpu::software_prefetch() { "off" } else { "on" };
    eprintln!("xtask test: cargo test -p ember-kernels with EMBER_PREFETCH={other} (the other prefetch policy)");
    let status = Command::new(&cargo)
        .current_dir(crate::root())
        .args(["test", "-p", "ember-kernels"])
        .env("EMBER_PREFETCH", other)
        .status()
        .context("running cargo test")?;
    if !status.success() {
        bail!("cargo test -p ember-kernels failed with EMBER_PREFETCH={other}");
    }
    eprintln!("xtask test: the fuzz targets, 3000 cases each (`cargo xtask fuzz` runs longer)");
    crate::fuzz::run(&["--cases".into(), "3000".into(), "--debug".into()])?;
    for krate in ["ember-kernels", "ember-sample", "ember-model"] {
        eprintln!("xtask test: every public item of {krate} documented, every doc link resolving");
        let status = Command::new(&cargo)
            .current_dir(crate::root())
            .args(["rustdoc", "-p", krate, "--", "-D", "missing-docs", "-D", "warnings"])
            .status()
            .context("running cargo rustdoc")?;
        if !status.success() {
            bail!("{krate}'s docs have undocumented public items or broken links (cargo rustdoc -p {krate} -- -D missing-docs -D warnings)");
        }
    }
    crate::parity::run(&[])?;
    crate::e2e::run(&[])?;
    crate::serve_e2e::run(&[])?;
    crate::fleet::run(&[])?;
    crate::library::readme(&[])?;
    crate::library::package(&[])
}
