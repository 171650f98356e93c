//! The library crates as another project meets them.
//!
//! `cargo xtask readme`: the README's library example, unchanged, in a fresh
//! `cargo new` project that depends on `ember-model` by path, built and run
//! on the fetched model. It must compile as written, print something, and
//! exit successfully.
//!
//! `cargo xtask package`: `cargo package` of `ember-kernels`, `ember-sample`
//! and `ember-model` (`--no-verify`: verifying would fetch the unpublished
//! ember dependencies from crates.io), then the packaged `ember-sample` and
//! `ember-model` tested from their `.crate` files, unpacked side by side in
//! a temporary workspace: a test that reads outside its crate (the
//! repository's `fixtures/`) fails there. `ember-kernels` is built there as
//! their dependency; its tests read no files.
//!
//! Both run offline: the temporary projects get the workspace's
//! `Cargo.lock`, so every dependency comes from the local registry cache.
//! Their build directories live under `target/` and are reused between runs.

use anyhow::{bail, ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The library crates, in dependency order.
const CRATES: [&str; 3] = ["ember-kernels", "ember-sample", "ember-model"];

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| crate::root().join("target"), PathBuf::from)
}

/// A fresh empty folder outside the workspace (so cargo does not take the
/// project for one of its members).
fn fresh_dir(tag: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("ember-xtask-{tag}-{}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

fn run_cmd(cmd: &mut Command, what: &str) -> Result<std::process::Output> {
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out)
}

/// The first ```rust block after the README's "## The library" heading.
fn library_example(readme: &str) -> Result<String> {
    let section = readme.find("\n## The library").context("README.md has no \"## The library\" section")?;
    let rest = &readme[section..];
    let open = rest.find("\n```rust").context("the library section has no ```rust block")?;
    let body = &rest[open + 1..];
    let body = &body[body.find('\n').context("unterminated code block")? + 1..];
    let end = body.find("\n```").context("unterminated code block")?;
    Ok(body[..end + 1].to_string())
}

pub fn readme(args: &[String]) -> Result<()> {
    if let Some(a) = args.first() {
        bail!("unknown option `{a}` (readme takes none)");
    }
    let root = crate::root();
    let model = crate::fetch::model_dir();
    if !model.join("config.json").is_file() {
        bail!("no model in {} (run `cargo xtask fetch` first)", model.display());
    }
    let text = std::fs::read_to_string(root.join("README.md")).context("reading README.md")?;
    let example = library_example(&text)?;

    let tmp = fresh_dir("readme")?;
    let project = tmp.join("readme-example");
    run_cmd(cargo().current_dir(&tmp).args(["new", "--quiet", "--vcs", "none", "readme-example"]), "cargo new")?;
    let manifest = project.join("Cargo.toml");
    let mut toml = std::fs::read_to_string(&manifest).context("reading the new Cargo.toml")?;
    let dep = root.join("crates/ember-model");
    toml = toml.replacen(
        "[dependencies]",
        &format!("[dependencies]\nember-model = {{ path = {:?} }}", dep.display().to_string()),
        1,
    );
    // Its own workspace, whatever encloses the temporary folder.
    toml.push_str("\n[workspace]\n");
    std::fs::write(&manifest, toml).context("writing Cargo.toml")?;
    std::fs::write(project.join("src/main.rs"), &example).context("writing src/main.rs")?;
    std::fs::copy(root.join("Cargo.lock"), project.join("Cargo.lock")).context("copying Cargo.lock")?;

    eprintln!("xtask readme: building and running the README's library example in {}", project.display());
    let out = run_cmd(
        cargo()
            .current_dir(&project)
            .args(["run", "--release", "--offline", "--quiet"])
            .env("CARGO_TARGET_DIR", target_dir().join("readme-example"))
            .env("EMBER_MODELS", model.parent().expect("the model folder has a parent")),
        "the README example",
    )?;
    let printed = String::from_utf8_lossy(&out.stdout);
    ensure!(!printed.trim().is_empty(), "the README example printed nothing");
    let _ = std::fs::remove_dir_all(&tmp);
    println!("ok    README example: compiled as written and ran: {:?}", printed.trim());
    Ok(())
}

pub fn package(args: &[String]) -> Result<()> {
    if let Some(a) = args.first() {
        bail!("unknown option `{a}` (package takes none)");
    }
    let root = crate::root();
    let target = target_dir();
    let mut cmd = cargo();
    cmd.current_dir(&root).args(["package", "--no-verify", "--allow-dirty", "--offline", "--quiet"]);
    for c in CRATES {
        cmd.args(["-p", c]);
    }
    run_cmd(&mut cmd, "cargo package")?;

    let tmp = fresh_dir("package")?;
    let version = env!("CARGO_PKG_VERSION");
    let mut members = Vec::new();
    for c in CRATES {
        let file = target.join("package").join(format!("{c}-{version}.crate"));
        // `-m`: the files get the time of unpacking. The packages' stored
        // times do not change between runs, so with them cargo took the
        // previous run's build of the crates for current (a stale library
        // under new tests, seen when the GGUF reader landed).
        run_cmd(Command::new("tar").arg("-mxzf").arg(&file).arg("-C").arg(&tmp), &format!("unpacking {c}"))?;
        members.push(format!("{c}-{version}"));
    }
    let patch: String = CRATES.iter().map(|c| format!("{c} = {{ path = \"{c}-{version}\" }}\n")).collect();
    let manifest = format!(
        "[workspace]\nresolver = \"2\"\nmembers = {members:?}\n\n[patch.crates-io]\n{patch}\n\
         [profile.dev.package.\"*\"]\nopt-level = 2\n"
    );
    std::fs::write(tmp.join("Cargo.toml"), manifest).context("writing the workspace manifest")?;
    std::fs::copy(root.join("Cargo.lock"), tmp.join("Cargo.lock")).context("copying Cargo.lock")?;
    check_self_contained(&tmp)?;

    eprintln!("xtask package: testing the packaged ember-sample and ember-model in {}", tmp.display());
    run_cmd(
        cargo()
            .current_dir(&tmp)
            .args(["test", "--offline", "--quiet", "-p", "ember-sample", "-p", "ember-model"])
            .env("CARGO_TARGET_DIR", target.join("package-check")),
        "the packaged crates' tests",
    )?;
    let _ = std::fs::remove_dir_all(&tmp);
    println!("ok    cargo package: {} packaged; the packaged tests pass on their own files", CRATES.join(", "));
    Ok(())
}

/// Every unpacked crate has its licence files and readme.
fn check_self_contained(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            for f in ["LICENSE-MIT", "LICENSE-APACHE", "README.md"] {
                ensure!(path.join(f).is_file(), "{} is not in the package {}", f, path.display());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_library_example() {
        let readme = "# x\n```rust\nnot this\n```\n## The library\ntext\n```rust,no_run\nfn main() {}\n```\nmore\n";
        assert_eq!(library_example(readme).unwrap(), "fn main() {}\n");
        assert!(library_example("## The library\nno code\n").is_err());
    }

    #[test]
    fn the_readme_has_one() {
        let text = std::fs::read_to_string(crate::root().join("README.md")).unwrap();
        let code = library_example(&text).unwrap();
        assert!(code.contains("fn main()") && code.contains("flush()"), "{code}");
    }
}
