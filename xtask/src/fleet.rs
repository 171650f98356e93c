//! `cargo xtask fleet`: `ember serve` replicas behind nginx, as
//! `deploy/nginx/ember.conf` ships, on 127.0.0.1, driven by the load
//! generator's multi-turn conversations (`load::conversations`), with one
//! replica killed and restarted in the middle.
//!
//! 1. Builds `target/release/ember`; finds nginx (installs Debian's `nginx`
//!    with apt-get when it is missing).
//! 2. Starts `--replicas` replicas on free ports, configured by `EMBER_*`
//!    variables only (`--threads 1` each), waits for `/health`, and nginx
//!    with `deploy/nginx/ember.conf` (its addresses, listen port and log
//!    path substituted; everything else as shipped) in a scratch folder.
//! 3. Phases, each its own conversations, mixed streaming and
//!    non-streaming turns:
//!    - **A, affinity**: an `X-Session-Id` per conversation;
//!    - **B, round-robin**: no header and one client, so every replica is
//!      idle when a request comes, least connections ties and nginx takes
//!      the replicas in turn: each turn lands on the next replica. A's
//!      cached share of turns 2 and later against B's is the acceptance;
//!    - **R, random placement**: concurrent clients with a new
//!      `X-Session-Id` every request, as any balancer that does not know
//!      the conversation places a busy fleet's requests: a turn finds its
//!      previous turn's replica one time in `--replicas`, so the gain of
//!      affinity over it stays below `--replicas`× (reported, not gated);
//!    - **C, SIGKILL**: with the header; `--kill-after` seconds in, the
//!      replica with the most running sequences is SIGKILLed, restarted 3 s
//!      later, and waited for until `/health` is 200 again;
//!    - **D, SIGTERM**: with the header, once every replica is back; one
//!      replica is stopped with SIGTERM (drain) mid-phase and restarted.
//! 4. Prints sent, completed, failed (with reasons), retried (nginx tried
//!    another replica: a comma in `X-Ember-Upstream`), resent (the client
//!    sent a failed turn again) and cached shares, and fails unless: every
//!    non-streamed request completed; every failed stream failed with a
//!    reason (broken off, no `[DONE]`, or an error event; the load generator
//!    never counts a truncated stream as complete); nothing failed in A, B,
//!    R and D nor after the killed replica was back; the drained replica
//!    exited 0; affinity's cached share is at least 3× B's (while
//!    `--turns` ≤ `--replicas`: past that, round-robin brings a turn back to
//!    the replica that kept an earlier turn of the conversation).
//!
//! Every process it starts is stopped on every way out (a guard's `Drop`);
//! each phase has a deadline (a share of `--seconds`, counted once the
//! replicas are ready), each request a timeout.

use crate::load::{self, Conversations, Session, Summary, Turn};
use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Args {
    replicas: usize,
    conversations: usize,
    turns: usize,
    clients: usize,
    max_tokens: usize,
    kill_after: f64,
    seconds: u64,
    json: bool,
    keep: bool,
}

fn parse(args: &[String]) -> Result<Args> {
    let mut a = Args {
        replicas: 3,
        conversations: 12,
        turns: 3,
        clients: 6,
        max_tokens: 12,
        kill_after: 4.0,
        seconds: 240,
        json: false,
        keep: false,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--replicas" => a.replicas = value()?.parse()?,
            "--conversations" => a.conversations = value()?.parse()?,
            "--turns" => a.turns = value()?.parse()?,
            "--clients" => a.clients = value()?.parse()?,
            "--max-tokens" => a.max_tokens = value()?.parse()?,
            "--kill-after" => a.kill_after = value()?.parse()?,
            "--seconds" => a.seconds = value()?.parse()?,
            "--json" => a.json = true,
            "--keep" => a.keep = true,
            other => bail!(
                "unknown option `{other}` (fleet takes --replicas, --conversations, --turns, --clients, \
                 --max-tokens, --kill-after, --seconds, --json, --keep)"
            ),
        }
    }
    ensure!((2..=16).contains(&a.replicas), "--replicas: 2 to 16");
    ensure!(a.turns >= 2, "--turns: at least 2 (the cached share is measured on turns 2 and later)");
    ensure!(a.conversations >= 1 && a.clients >= 1 && a.max_tokens >= 1, "counts must be at least 1");
    ensure!(a.seconds >= 30, "--seconds: at least 30");
    Ok(a)
}

/// Each replica: sequences at once, context, threads.
const PARALLEL: usize = 4;
const CONTEXT: usize = 1024;
/// Seconds a SIGTERMed replica's requests may take to finish.
const GRACE: u64 = 20;
/// How long the SIGKILLed replica stays down.
const DOWN: Duration = Duration::from_secs(3);

/// One `ember serve` process.
struct Replica {
    port: u16,
    child: Option<Child>,
    log: PathBuf,
}

/// Everything started; stops it all when dropped.
struct Fleet {
    dir: PathBuf,
    ember: PathBuf,
    model: PathBuf,
    replicas: Vec<Replica>,
    nginx: Option<Child>,
    port: u16,
    keep: bool,
    ok: bool,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let mut children: Vec<Child> = self.replicas.iter_mut().filter_map(|r| r.child.take()).collect();
        children.extend(self.nginx.take());
        for c in &children {
            signal(c, "TERM");
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for mut c in children {
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        if self.ok && !self.keep {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("xtask fleet: logs kept in {}", self.dir.display());
        }
    }
}

/// Sends a signal by name (`TERM`, `KILL`).
fn signal(c: &Child, name: &str) {
    let _ = Command::new("kill").arg(format!("-{name}")).arg(c.id().to_string()).stderr(Stdio::null()).status();
}

/// A port free now on 127.0.0.1 (the listener is closed again).
fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners: Vec<TcpListener> =
        (0..n).map(|_| TcpListener::bind("127.0.0.1:0")).collect::<std::io::Result<_>>()?;
    listeners.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

/// GET `path` on a port: status and body (0 when nothing answered).
fn get(port: u16, path: &str) -> (u16, String) {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else { return (0, String::new()) };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    if write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").is_err() {
        return (0, String::new());
    }
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw);
    let status = raw.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, raw.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string())
}

/// `ember_running_sequences` from a replica's `/metrics`.
fn running(port: u16) -> usize {
    let (_, body) = get(port, "/metrics");
    body.lines()
        .find_map(|l| l.strip_prefix("ember_running_sequences "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

impl Fleet {
    fn start_replica(&mut self, i: usize) -> Result<()> {
        let r = &mut self.replicas[i];
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&r.log)?;
        let mut cmd = Command::new(&self.ember);
        cmd.arg("serve");
        // Configured the way an orchestrator would: by EMBER_* variables
        // alone, none inherited.
        for (k, _) in std::env::vars() {
            if k.starts_with("EMBER_") && k != "EMBER_ISA" {
                cmd.env_remove(k);
            }
        }
        cmd.env("EMBER_HOST", "127.0.0.1")
            .env("EMBER_PORT", r.port.to_string())
            .env("EMBER_MODEL", &self.model)
            .env("EMBER_PARALLEL", PARALLEL.to_string())
            .env("EMBER_CTX", CONTEXT.to_string())
            .env("EMBER_THREADS", "1")
            .env("EMBER_SHUTDOWN_GRACE", GRACE.to_string())
            .env("EMBER_MODEL_NAME", "qwen")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        r.child = Some(cmd.spawn().with_context(|| format!("starting {}", self.ember.display()))?);
        Ok(())
    }

    /// Waits until replica `i` answers `/health` with 200.
    fn wait_ready(&mut self, i: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let r = &mut self.replicas[i];
            if let Some(status) = r.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                bail!("replica {i} exited ({status}) before it was ready; see {}", r.log.display());
            }
            if get(r.port, "/health").0 == 200 {
                return Ok(());
            }
            ensure!(Instant::now() < deadline, "replica {i} not ready within {} s", timeout.as_secs());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn start_nginx(&mut self, nginx: &Path) -> Result<()> {
        let shipped = crate::root().join("deploy/nginx/ember.conf");
        let text = std::fs::read_to_string(&shipped).with_context(|| format!("reading {}", shipped.display()))?;
        let ports: Vec<u16> = self.replicas.iter().map(|r| r.port).collect();
        let conf = nginx_conf(&text, &ports, self.port, &self.dir.join("access.log"))?;
        std::fs::write(self.dir.join("ember.conf"), conf)?;
        let d = self.dir.display();
        let main = format!(
            "# Generated by cargo xtask fleet: nginx in the foreground, every path in this folder.\n\
             daemon off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log info;\n\
             events {{ worker_connections 512; }}\n\
             http {{\n    client_body_temp_path {d}/body;\n    proxy_temp_path {d}/proxy;\n    \
             fastcgi_temp_path {d}/fastcgi;\n    uwsgi_temp_path {d}/uwsgi;\n    scgi_temp_path {d}/scgi;\n    \
             include {d}/ember.conf;\n}}\n"
        );
        std::fs::write(self.dir.join("nginx.conf"), main)?;
        let command = || {
            let mut cmd = Command::new(nginx);
            cmd.arg("-p").arg(&self.dir).arg("-e").arg(self.dir.join("error.log"));
            cmd.arg("-c").arg(self.dir.join("nginx.conf"));
            cmd
        };
        let test = command().arg("-t").output().context("running nginx -t")?;
        ensure!(test.status.success(), "nginx rejects the configuration: {}", String::from_utf8_lossy(&test.stderr));
        let out = std::fs::File::create(self.dir.join("nginx.out"))?;
        self.nginx = Some(command().stdin(Stdio::null()).stdout(out.try_clone()?).stderr(out).spawn()?);
        let deadline = Instant::now() + Duration::from_secs(20);
        while get(self.port, "/health").0 != 200 {
            if let Some(s) = self.nginx.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                bail!("nginx exited ({s}); see {}", self.dir.join("error.log").display());
            }
            ensure!(Instant::now() < deadline, "nginx did not answer /health within 20 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }
}

/// The shipped configuration for this run: every group of `server
/// 127.0.0.1:…` lines (one per upstream) becomes one line per replica port,
/// `listen 8080;` the given port on 127.0.0.1, the access log a file here.
/// Fails when the shipped file no longer has these, so the substitution
/// cannot silently test something else.
fn nginx_conf(text: &str, ports: &[u16], listen: u16, access_log: &Path) -> Result<String> {
    let mut out = Vec::new();
    let mut groups = 0;
    let mut in_group = false;
    for line in text.lines() {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix("server 127.0.0.1:") {
            if !in_group {
                groups += 1;
                let indent = &line[..line.len() - t.len()];
                let tail = rest.split_once(' ').map_or(";", |(_, tail)| tail);
                for p in ports {
                    out.push(format!("{indent}server 127.0.0.1:{p} {tail}"));
                }
            }
            in_group = true;
            continue;
        }
        in_group = false;
        if t == "listen 8080;" {
            out.push(line.replace("listen 8080;", &format!("listen 127.0.0.1:{listen};")));
        } else if t.starts_with("access_log /var/log/nginx/ember.log") {
            out.push(line.replace("/var/log/nginx/ember.log", &access_log.display().to_string()));
        } else {
            out.push(line.to_string());
        }
    }
    let conf = out.join("\n") + "\n";
    ensure!(
        groups == 2,
        "deploy/nginx/ember.conf: expected two upstream blocks of `server 127.0.0.1:…` lines, found {groups}"
    );
    ensure!(conf.contains(&format!("listen 127.0.0.1:{listen};")), "deploy/nginx/ember.conf: no `listen 8080;`");
    ensure!(conf.contains(&access_log.display().to_string()), "deploy/nginx/ember.conf: no access_log line");
    Ok(conf)
}

/// nginx on PATH or in /usr/sbin, else Debian's package installed.
fn find_nginx() -> Result<PathBuf> {
    let found = || {
        std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .chain([PathBuf::from("/usr/sbin")])
            .map(|d| d.join("nginx"))
            .find(|p| p.is_file())
    };
    if let Some(p) = found() {
        return Ok(p);
    }
    eprintln!("xtask fleet: nginx not found; installing Debian's nginx package");
    let root = Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let sudo: &[&str] = if root { &[] } else { &["sudo"] };
    for step in [&["apt-get", "update", "-qq"][..], &["apt-get", "install", "-y", "-qq", "nginx"][..]] {
        let argv: Vec<&str> = sudo.iter().chain(step).copied().collect();
        let ok = Command::new(argv[0])
            .args(&argv[1..])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success());
        ensure!(ok, "`{}` failed; install nginx (Debian: apt-get install nginx)", argv.join(" "));
    }
    found().context("nginx still not found after installing it")
}

/// deploy/ checked offline: the systemd unit by `systemd-analyze verify`
/// (skipped, and said so, where systemd-analyze is missing; unknown keys
/// are only warnings there, so any output fails too), the Kubernetes
/// manifests by `kubernetes-validate --strict` against Kubernetes' schemas
/// (pinned in scripts/deploy-requirements.txt, in a venv made here).
fn check_deploy(ember: &Path, dir: &Path) -> Result<Vec<String>> {
    let root = crate::root();
    let mut checked = Vec::new();
    let unit = std::fs::read_to_string(root.join("deploy/systemd/ember@.service"))?;
    ensure!(unit.contains("ExecStart=/usr/local/bin/ember serve"), "deploy/systemd/ember@.service: no ExecStart");
    let has_analyze = Command::new("systemd-analyze").arg("--version").output().is_ok_and(|o| o.status.success());
    if has_analyze {
        // The unit as shipped, but for the binary's path (verify wants it to exist).
        let units = dir.join("systemd");
        std::fs::create_dir_all(&units)?;
        let text = unit.replace("/usr/local/bin/ember", &ember.display().to_string());
        std::fs::write(units.join("ember@8081.service"), text)?;
        let out = Command::new("systemd-analyze").arg("verify").arg(units.join("ember@8081.service")).output()?;
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        ensure!(
            out.status.success() && said.trim().is_empty(),
            "systemd-analyze verify deploy/systemd/ember@.service: {}",
            said.trim()
        );
        checked.push("systemd unit: systemd-analyze verify clean".to_string());
    } else {
        checked.push("systemd unit: not verified (no systemd-analyze here)".to_string());
    }
    let python = crate::serve_e2e::venv("scripts/deploy-requirements.txt", "deploy")?;
    let mut manifests: Vec<PathBuf> = std::fs::read_dir(root.join("deploy/kubernetes"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    manifests.sort();
    ensure!(!manifests.is_empty(), "no deploy/kubernetes/*.yaml");
    let validate = python.with_file_name("kubernetes-validate");
    let out = Command::new(&validate)
        .args(["--strict", "--quiet"])
        .args(&manifests)
        .output()
        .context("running kubernetes-validate")?;
    ensure!(
        out.status.success(),
        "kubernetes-validate --strict deploy/kubernetes: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let names: Vec<String> =
        manifests.iter().filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())).collect();
    checked.push(format!("Kubernetes manifests ({}): valid against the 1.37 schemas, strict", names.join(", ")));
    Ok(checked)
}

/// One phase's conversations.
fn phase(a: &Args, port: u16, tag: &str, session: Session, deadline: Instant) -> Conversations {
    Conversations {
        host: format!("127.0.0.1:{port}"),
        key: None,
        conversations: a.conversations,
        turns: a.turns,
        clients: a.clients,
        max_tokens: a.max_tokens,
        temperature: 0.7,
        stream_share: 0.5,
        session,
        think: Duration::from_millis(200),
        tag: format!("{tag}{:x}", std::process::id()),
        deadline,
        timeout: Duration::from_secs(120),
        resend: 1,
    }
}

fn row(name: &str, s: &Summary) -> String {
    format!(
        "{name:<22} {:>5} {:>9} {:>6} {:>7} {:>6} {:>12.1}%",
        s.sent,
        s.completed,
        s.failures(),
        s.retried,
        s.resent,
        100.0 * s.cached_share()
    )
}

pub fn run(args: &[String]) -> Result<()> {
    let a = parse(args)?;
    let t0 = Instant::now();
    let model = crate::fetch::model_dir();
    ensure!(model.join("config.json").is_file(), "no model in {} (run `cargo xtask fetch` first)", model.display());
    let nginx = find_nginx()?;
    let ember = crate::build_ember()?;
    let dir = std::env::temp_dir().join(format!("ember-fleet-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let ports = free_ports(a.replicas + 1)?;
    let mut fleet = Fleet {
        dir: dir.clone(),
        ember,
        model,
        replicas: (0..a.replicas)
            .map(|i| Replica { port: ports[i + 1], child: None, log: dir.join(format!("replica-{i}.log")) })
            .collect(),
        nginx: None,
        port: ports[0],
        keep: a.keep,
        ok: false,
    };
    eprintln!(
        "xtask fleet: {} replicas (ports {}), nginx on {}, logs in {}",
        a.replicas,
        fleet.replicas.iter().map(|r| r.port.to_string()).collect::<Vec<_>>().join(", "),
        fleet.port,
        dir.display()
    );
    for note in check_deploy(&fleet.ember, &dir)? {
        eprintln!("xtask fleet: {note}");
    }
    for i in 0..a.replicas {
        fleet.start_replica(i)?;
    }
    for i in 0..a.replicas {
        fleet.wait_ready(i, Duration::from_secs(120))?;
    }
    fleet.start_nginx(&nginx)?;
    let started = t0.elapsed().as_secs_f64();
    // The phases share `--seconds` (counted from here: the build and the
    // loading are not in it); each starts no turn after its own deadline.
    let t_ready = Instant::now();
    let end = t_ready + Duration::from_secs(a.seconds);
    let left = |share: f64| (Instant::now() + Duration::from_secs(a.seconds).mul_f64(share)).min(end);

    eprintln!("xtask fleet: phase A, affinity (X-Session-Id)");
    let turns_a = load::conversations(&phase(&a, fleet.port, "a", Session::PerConversation, left(0.15)));
    // Plain round-robin: one client, no header, so every replica is idle
    // when a request comes, least_conn ties and nginx rotates: each turn
    // goes to the next replica. Half the conversations (each turn is a
    // cache miss, and they run one at a time).
    eprintln!("xtask fleet: phase B, round-robin (no header, one client)");
    let mut b = phase(&a, fleet.port, "b", Session::Off, left(0.3));
    (b.clients, b.conversations) = (1, a.conversations.div_ceil(2));
    let turns_b = load::conversations(&b);
    // Random placement: concurrent clients, a new X-Session-Id per request.
    eprintln!("xtask fleet: phase R, random placement (a new X-Session-Id per request)");
    let turns_r = load::conversations(&phase(&a, fleet.port, "r", Session::PerRequest, left(0.2)));

    eprintln!("xtask fleet: phase C, a replica SIGKILLed after {} s and restarted", a.kill_after);
    let c = phase(&a, fleet.port, "c", Session::PerConversation, left(0.175));
    let t_c = Instant::now();
    let (turns_c, kill) = std::thread::scope(|s| -> Result<(Vec<Turn>, Value)> {
        let load = s.spawn(|| load::conversations(&c));
        let kill = kill_and_restart(&mut fleet, a.kill_after, t_c);
        let turns = load.join().map_err(|_| anyhow::anyhow!("the load panicked"))?;
        Ok((turns, kill?))
    })?;
    let back = kill["back_after_s"].as_f64().unwrap_or(f64::INFINITY);

    eprintln!("xtask fleet: phase D, every replica back; one drained with SIGTERM and restarted");
    let d = phase(&a, fleet.port, "d", Session::PerConversation, left(0.175));
    let t_d = Instant::now();
    let (turns_d, drain) = std::thread::scope(|s| -> Result<(Vec<Turn>, Value)> {
        let load = s.spawn(|| load::conversations(&d));
        let drain = drain_and_restart(&mut fleet, a.kill_after, t_d);
        let turns = load.join().map_err(|_| anyhow::anyhow!("the load panicked"))?;
        Ok((turns, drain?))
    })?;

    let phases = [
        ("A affinity", Summary::of(&turns_a), a.conversations),
        ("B round-robin", Summary::of(&turns_b), b.conversations),
        ("R random placement", Summary::of(&turns_r), a.conversations),
        ("C SIGKILL + restart", Summary::of(&turns_c), a.conversations),
        ("D SIGTERM + restart", Summary::of(&turns_d), a.conversations),
    ];
    let share = |i: usize| phases[i].1.cached_share();
    let after_back = Summary::of(turns_c.iter().filter(|t| t.sent >= back));
    let (ratio, ratio_random) = (share(0) / share(1).max(1e-9), share(0) / share(2).max(1e-9));
    let seconds = t0.elapsed().as_secs_f64();
    let phase_seconds = t_ready.elapsed().as_secs_f64();

    let mut problems = Vec::new();
    for (name, s, conversations) in &phases {
        // Only the SIGKILL may cost a request, and only a stream.
        if !name.starts_with('C') && s.failures() > 0 {
            problems.push(format!("{name}: {} requests failed: {:?}", s.failures(), s.failed));
        }
        if s.failed_whole > 0 {
            problems.push(format!("{name}: {} non-streamed requests failed", s.failed_whole));
        }
        if s.failed.keys().any(|r| r.is_empty()) {
            problems.push(format!("{name}: a failure without a reason"));
        }
        let want = conversations * a.turns;
        if s.completed < want {
            problems.push(format!("{name}: {} of {want} turns completed (out of time?)", s.completed));
        }
    }
    if after_back.failures() > 0 {
        problems.push(format!("C: {} requests failed after the killed replica was back", after_back.failures()));
    }
    if kill["running_when_killed"].as_u64() == Some(0) {
        problems.push("C: the SIGKILLed replica was running nothing; the kill tested nothing".into());
    }
    if drain["exit_code"].as_i64() != Some(0) {
        problems.push(format!("D: the SIGTERMed replica did not exit 0 after draining: {}", drain["exit_code"]));
    }
    // Round-robin brings turn t back to the replica of turn t - replicas,
    // which kept that turn: with more turns than replicas it finds part of
    // the history too, and the 3× bound no longer says anything.
    let gated = a.turns <= a.replicas;
    if gated && ratio < 3.0 {
        problems.push(format!(
            "affinity's cached share {:.1}% is {ratio:.2}× round-robin's ({:.1}%), want at least 3×",
            100.0 * share(0),
            100.0 * share(1)
        ));
    }

    if a.json {
        let mut report = json!({
            "replicas": a.replicas, "conversations": a.conversations, "turns": a.turns, "clients": a.clients,
            "max_tokens": a.max_tokens, "ready_after_s": started, "seconds": seconds, "phase_seconds": phase_seconds,
            "sigkill_after_back": after_back.json(), "kill": kill, "drain": drain,
            "cached_share_ratio_round_robin": ratio, "cached_share_ratio_random": ratio_random, "ratio_gated": gated,
            "problems": problems,
        });
        for (key, (_, s, _)) in ["affinity", "round_robin", "random", "sigkill", "sigterm"].iter().zip(&phases) {
            report[*key] = s.json();
        }
        println!("{report}");
    } else {
        println!(
            "fleet: {} replicas × --parallel {PARALLEL} --ctx {CONTEXT} --threads 1 behind nginx; {} conversations × {} turns a phase ({} for B), {} at once (1 for B), max_tokens {}, half the turns streamed; ready after {started:.1} s",
            a.replicas, a.conversations, a.turns, b.conversations, a.clients, a.max_tokens
        );
        println!(
            "{:<22} {:>5} {:>9} {:>6} {:>7} {:>6} {:>13}",
            "phase", "sent", "completed", "failed", "retried", "resent", "cached (t≥2)"
        );
        for (name, s, _) in &phases {
            println!("{}", row(name, s));
            if name.starts_with('C') {
                println!("{}", row("  C after restart", &after_back));
            }
        }
        for (name, s, _) in &phases {
            for (r, n) in &s.failed {
                println!("  {name} failed: {n} × {r}");
            }
        }
        println!(
            "SIGKILL: replica {} ({} running sequences) at {:.1} s, restarted {:.0} s later, ready again at {:.1} s",
            kill["replica"],
            kill["running_when_killed"],
            kill["killed_after_s"].as_f64().unwrap_or(0.0),
            DOWN.as_secs_f64(),
            back
        );
        println!(
            "SIGTERM: replica {} ({} running) drained and exited {} after {:.1} s, ready again at {:.1} s",
            drain["replica"],
            drain["running_when_stopped"],
            drain["exit_code"],
            drain["drain_s"].as_f64().unwrap_or(0.0),
            drain["back_after_s"].as_f64().unwrap_or(0.0)
        );
        println!(
            "cached share of turns ≥ 2: {:.1}% with affinity, {:.1}% round-robin ({ratio:.1}×), {:.1}% random placement ({ratio_random:.1}×){}; phases {phase_seconds:.0} s, {seconds:.0} s in all",
            100.0 * share(0),
            100.0 * share(1),
            100.0 * share(2),
            if gated { "" } else { " (not gated: more turns than replicas)" }
        );
    }
    if !problems.is_empty() {
        bail!("the fleet test failed:\n  {}", problems.join("\n  "));
    }
    fleet.ok = true;
    Ok(())
}

/// The replica running the most sequences (waiting up to 10 s for one
/// that runs any), and how many.
fn busiest(fleet: &Fleet) -> (usize, usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let counts: Vec<usize> = fleet.replicas.iter().map(|r| running(r.port)).collect();
        let (i, n) = counts.iter().copied().enumerate().max_by_key(|&(_, n)| n).unwrap_or((0, 0));
        if n > 0 || Instant::now() >= deadline {
            return (i, n);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `after` seconds in, SIGKILLs the busiest replica, restarts it `DOWN`
/// later and waits until it is ready.
fn kill_and_restart(fleet: &mut Fleet, after: f64, t0: Instant) -> Result<Value> {
    std::thread::sleep(Duration::from_secs_f64(after));
    let (i, n) = busiest(fleet);
    let killed_at = t0.elapsed().as_secs_f64();
    if let Some(mut c) = fleet.replicas[i].child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
    std::thread::sleep(DOWN);
    fleet.start_replica(i)?;
    fleet.wait_ready(i, Duration::from_secs(120))?;
    Ok(
        json!({"replica": i, "running_when_killed": n, "killed_after_s": killed_at, "back_after_s": t0.elapsed().as_secs_f64()}),
    )
}

/// `after` seconds in, SIGTERMs the busiest replica, waits for it to exit
/// (its requests drained), restarts it and waits until it is ready.
fn drain_and_restart(fleet: &mut Fleet, after: f64, t0: Instant) -> Result<Value> {
    std::thread::sleep(Duration::from_secs_f64(after));
    let (i, n) = busiest(fleet);
    let stopped = Instant::now();
    let mut child = fleet.replicas[i].child.take().context("the replica is not running")?;
    signal(&child, "TERM");
    let deadline = stopped + Duration::from_secs(GRACE + 10);
    let code = loop {
        if let Some(s) = child.try_wait()? {
            break s.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let drain = stopped.elapsed().as_secs_f64();
    fleet.start_replica(i)?;
    fleet.wait_ready(i, Duration::from_secs(120))?;
    Ok(
        json!({"replica": i, "running_when_stopped": n, "exit_code": code, "drain_s": drain, "back_after_s": t0.elapsed().as_secs_f64()}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_nginx_conf_takes_the_replicas_ports() {
        let text = std::fs::read_to_string(crate::root().join("deploy/nginx/ember.conf")).unwrap();
        let conf = nginx_conf(&text, &[1001, 1002], 1000, Path::new("/tmp/x.log")).unwrap();
        assert_eq!(conf.matches("server 127.0.0.1:1001 max_fails=1 fail_timeout=2s;").count(), 2);
        assert_eq!(conf.matches("server 127.0.0.1:1002 ").count(), 2);
        assert!(!conf.contains(":8081") && !conf.contains(":8083"), "{conf}");
        assert!(conf.contains("listen 127.0.0.1:1000;"));
        assert!(conf.contains("access_log /tmp/x.log ember;"));
    }
}
