//! `cargo xtask serve-e2e`: `ember serve` on the real model, driven by the
//! official `openai` Python client and `curl` (`scripts/serve_e2e.py`), in a
//! virtual environment made here from the pinned
//! `scripts/serve-requirements.txt` (cached under
//! `~/.cache/ember-venvs/serve-<hash of the pins>`).

use anyhow::{bail, ensure, Context, Result};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

pub fn run(args: &[String]) -> Result<()> {
    if let Some(a) = args.first() {
        bail!("unknown option `{a}` (serve-e2e takes none)");
    }
    let model = crate::fetch::model_dir();
    if !model.join("config.json").is_file() {
        bail!("no model in {} (run `cargo xtask fetch` first)", model.display());
    }
    for tool in ["curl", "python3"] {
        let found = Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
        ensure!(found, "`{tool}` not found on PATH; serve-e2e needs it");
    }
    let python = venv("scripts/serve-requirements.txt", "serve")?;
    let ember = crate::build_ember()?;
    let status = Command::new(&python)
        .arg(crate::root().join("scripts/serve_e2e.py"))
        .arg("--ember")
        .arg(&ember)
        .arg("--model")
        .arg(&model)
        .status()
        .context("running scripts/serve_e2e.py")?;
    ensure!(status.success(), "the server's end-to-end checks failed (scripts/serve_e2e.py)");
    Ok(())
}

/// A virtual environment with the packages pinned in `requirements` (a
/// path from the workspace root), made once per set of pins under
/// `~/.cache/ember-venvs/NAME-<hash of the pins>`; returns its python.
pub fn venv(requirements: &str, name: &str) -> Result<PathBuf> {
    let reqs = crate::root().join(requirements);
    let pins = std::fs::read(&reqs).with_context(|| format!("reading {}", reqs.display()))?;
    let hash: String = Sha256::digest(&pins).iter().take(6).map(|b| format!("{b:02x}")).collect();
    let home = std::env::var_os("HOME").context("HOME is not set")?;
    let dir = Path::new(&home).join(".cache/ember-venvs").join(format!("{name}-{hash}"));
    let python = dir.join("bin/python");
    if dir.join(".complete").is_file() {
        return Ok(python);
    }
    eprintln!("xtask: making a virtual environment in {}", dir.display());
    let _ = std::fs::remove_dir_all(&dir);
    let ok = Command::new("python3").arg("-m").arg("venv").arg(&dir).status().is_ok_and(|s| s.success());
    ensure!(ok, "`python3 -m venv {}` failed (on Debian: apt-get install python3-venv)", dir.display());
    let ok = Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r"])
        .arg(&reqs)
        .status()
        .is_ok_and(|s| s.success());
    ensure!(ok, "installing {} into the virtual environment failed (is PyPI reachable?)", reqs.display());
    std::fs::write(dir.join(".complete"), &pins)?;
    Ok(python)
}
