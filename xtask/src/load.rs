//! `cargo xtask load`: a bounded load generator for OpenAI-compatible
//! servers (`ember serve`, llama-server, vLLM...). C clients send streaming
//! chat requests, each with its own prompt (one each, or `--requests N` in
//! all, a client sending its next when its last is done); a round reports
//! requests/s, aggregate output tokens/s, time to first token (p50, p90,
//! p99), inter-token latency (p50, p99), cached prompt tokens and errors.
//!
//! ```text
//! cargo xtask load --url http://127.0.0.1:8080 --clients 1,4,8,16 --max-tokens 128
//! cargo xtask load --url ... --clients 8 --system-tokens 1000   # shared system prompt
//! cargo xtask load --url ... --clients 1 --temperature 0          # greedy, as `ember bench` decodes
//! ```
//!
//! Plain `std::net` and threads: HTTP/1.1, chunked server-sent events.

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

struct Args {
    host: String,
    clients: Vec<usize>,
    max_tokens: usize,
    system_tokens: usize,
    api_key: Option<String>,
    rounds: usize,
    requests: Option<usize>,
    temperature: f64,
    json: bool,
}

fn parse(args: &[String]) -> Result<Args> {
    let mut a = Args {
        host: "127.0.0.1:8080".into(),
        clients: vec![1, 4, 8],
        max_tokens: 128,
        system_tokens: 0,
        api_key: std::env::var("EMBER_API_KEY").ok(),
        rounds: 1,
        requests: None,
        temperature: 0.7,
        json: false,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--url" => {
                let v = value()?;
                let rest = v.strip_prefix("http://").context("--url must start with http://")?;
                a.host = rest.trim_end_matches('/').trim_end_matches("/v1").to_string();
            }
            "--clients" => {
                a.clients = value()?.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>()?;
                ensure!(a.clients.iter().all(|&c| (1..=256).contains(&c)), "--clients: 1 to 256 each");
            }
            "--max-tokens" => a.max_tokens = value()?.parse()?,
            "--system-tokens" => a.system_tokens = value()?.parse()?,
            "--api-key" => a.api_key = Some(value()?.clone()),
            "--rounds" => a.rounds = value()?.parse::<usize>()?.max(1),
            "--temperature" => a.temperature = value()?.parse()?,
            "--requests" => a.requests = Some(value()?.parse::<usize>()?.max(1)),
            "--json" => a.json = true,
            other => bail!("unknown option `{other}` (load takes --url, --clients, --max-tokens, --system-tokens, --temperature, --requests, --api-key, --rounds, --json)"),
        }
    }
    Ok(a)
}

/// Topics for distinct prompts of about 50–150 tokens.
const TOPICS: [&str; 16] = [
    "the history of the printing press",
    "how a hash map works",
    "the water cycle",
    "why the sky is blue",
    "the rules of chess",
    "how vaccines train the immune system",
    "the design of the Roman aqueducts",
    "how a compiler turns source code into machine code",
    "the life cycle of a star",
    "how bees communicate",
    "the causes of the French Revolution",
    "how public-key cryptography works",
    "the invention of the telephone",
    "how tides are formed",
    "the basics of sourdough baking",
    "how GPS finds your position",
];

fn prompt(i: usize) -> String {
    let topic = TOPICS[i % TOPICS.len()];
    let pad = "Be thorough, use several paragraphs, and give concrete examples. ".repeat(1 + i % 4);
    format!("Request {i}. Write a long, detailed explanation of {topic}. {pad}Do not stop early.")
}

/// About `tokens` tokens of shared system prompt.
fn system_prompt(tokens: usize) -> String {
    let sentence =
        "You are a careful assistant working for a documentation team; answer accurately and in plain English. ";
    // About 20 tokens per sentence.
    sentence.repeat(tokens.div_ceil(20))
}

/// One streamed request's outcome.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Seconds to the first content.
    pub ttft: f64,
    /// Completion tokens (the usage chunk's, else content chunks).
    pub tokens: usize,
    /// Cached prompt tokens the server reported.
    pub cached: usize,
    /// Seconds between consecutive content chunks (inter-token latency).
    pub gaps: Vec<f64>,
}

/// Sends one streaming chat request and reads its events to the end.
pub fn stream_chat(host: &str, key: Option<&str>, body: &Value, timeout: Duration) -> Result<Outcome> {
    let addr = host.to_socket_addrs()?.next().context("resolving the host")?;
    let started = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).context("connecting")?;
    s.set_read_timeout(Some(timeout))?;
    let body = body.to_string();
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 16384];
    let mut head: Option<(u16, bool)> = None;
    let mut body_bytes = Vec::new();
    let mut consumed = 0; // bytes of `raw` after the head that are dechunked
    let mut text = String::new();
    let (mut ttft, mut chunks, mut usage_tokens, mut cached, mut done) = (None, 0usize, None, 0usize, false);
    let (mut gaps, mut last) = (Vec::new(), None::<Instant>);
    loop {
        let n = s.read(&mut buf).context("reading the stream")?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if head.is_none() {
            let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
            let h = String::from_utf8_lossy(&raw[..end]).to_string();
            let status = h.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
            let chunked = h.to_ascii_lowercase().contains("transfer-encoding: chunked");
            head = Some((status, chunked));
            raw.drain(..end + 4);
        }
        let (status, chunked) = head.unwrap();
        if chunked {
            // Dechunk what is complete.
            loop {
                let rest = &raw[consumed..];
                let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else { break };
                let size = usize::from_str_radix(String::from_utf8_lossy(&rest[..eol]).trim(), 16).unwrap_or(0);
                if size == 0 {
                    consumed = raw.len();
                    break;
                }
                if rest.len() < eol + 2 + size + 2 {
                    break;
                }
                body_bytes.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
                consumed += eol + 2 + size + 2;
            }
        } else {
            body_bytes.extend_from_slice(&raw[consumed..]);
            consumed = raw.len();
        }
        if status != 200 {
            continue;
        }
        // Whole events.
        while let Some(end) = body_bytes.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = body_bytes.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data: ") else { continue };
                if data.trim() == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(data).with_context(|| format!("a malformed event: {data}"))?;
                if v.get("error").is_some() {
                    bail!("an error event: {data}");
                }
                if let Some(c) = v.pointer("/choices/0/delta/content").and_then(Value::as_str) {
                    if !c.is_empty() {
                        ttft.get_or_insert_with(|| started.elapsed().as_secs_f64());
                        let now = Instant::now();
                        if let Some(l) = last {
                            gaps.push(now.duration_since(l).as_secs_f64());
                        }
                        last = Some(now);
                        chunks += 1;
                        text.push_str(c);
                    }
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    usage_tokens = u["completion_tokens"].as_u64().map(|n| n as usize);
                    cached =
                        u.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64).unwrap_or(0) as usize;
                }
            }
        }
    }
    let (status, _) = head.context("no response head")?;
    if status != 200 {
        bail!("status {status}: {}", String::from_utf8_lossy(&body_bytes));
    }
    ensure!(done, "the stream ended without [DONE] after {chunks} chunks");
    Ok(Outcome {
        ttft: ttft.unwrap_or_else(|| started.elapsed().as_secs_f64()),
        tokens: usage_tokens.unwrap_or(chunks),
        cached,
        gaps,
    })
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// With a shared system prompt: requests one after another (the first
/// fills the prefix cache), each TTFT against the first's.
fn shared_prefix(a: &Args, count: usize) -> Result<()> {
    let system = system_prompt(a.system_tokens);
    let mut ttfts = Vec::new();
    for i in 0..count.max(2) {
        let body = json!({
            "model": "default", "stream": true, "stream_options": {"include_usage": true},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": prompt(i)}],
            "max_tokens": a.max_tokens, "temperature": a.temperature, "seed": i as u64,
        });
        let o = stream_chat(&a.host, a.api_key.as_deref(), &body, Duration::from_secs(600))?;
        println!("request {i}: TTFT {:.3} s, cached prompt tokens {}, {} tokens", o.ttft, o.cached, o.tokens);
        ttfts.push(o.ttft);
    }
    let worst = ttfts[1..].iter().copied().fold(0.0, f64::max);
    println!(
        "shared prefix: first TTFT {:.3} s, later ones at most {:.3} s ({:.0}% of the first)",
        ttfts[0],
        worst,
        100.0 * worst / ttfts[0]
    );
    Ok(())
}

pub fn run(args: &[String]) -> Result<()> {
    let a = parse(args)?;
    if a.system_tokens > 0 {
        return shared_prefix(&a, a.clients.iter().copied().max().unwrap_or(4));
    }
    let system: Option<String> = None;
    let mut rows = Vec::new();
    let mut next = 0usize;
    for &clients in &a.clients {
        for round in 0..a.rounds {
            let started = Instant::now();
            // Each client sends its requests one after another until the
            // round's total (`--requests`, default one each) is taken.
            let total = a.requests.unwrap_or(clients);
            let taken = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let handles: Vec<_> = (0..clients)
                .map(|_| {
                    let (host, key, taken) = (a.host.clone(), a.api_key.clone(), taken.clone());
                    let (system, max_tokens, temperature, base) = (system.clone(), a.max_tokens, a.temperature, next);
                    std::thread::spawn(move || {
                        let mut out = Vec::new();
                        loop {
                            let i = taken.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            if i >= total {
                                return out;
                            }
                            let mut messages = Vec::new();
                            if let Some(s) = &system {
                                messages.push(json!({"role": "system", "content": s}));
                            }
                            messages.push(json!({"role": "user", "content": prompt(base + i)}));
                            let body = json!({
                                "model": "default", "messages": messages, "stream": true,
                                "stream_options": {"include_usage": true},
                                "max_tokens": max_tokens, "temperature": temperature, "seed": (base + i) as u64,
                            });
                            out.push(stream_chat(&host, key.as_deref(), &body, Duration::from_secs(600)));
                        }
                    })
                })
                .collect();
            next += total;
            let results: Vec<Result<Outcome>> = handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_else(|_| vec![Err(anyhow::anyhow!("a client panicked"))]))
                .collect();
            let wall = started.elapsed().as_secs_f64();
            let ok: Vec<&Outcome> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
            for e in results.iter().filter_map(|r| r.as_ref().err()) {
                eprintln!("load: a request failed: {e:#}");
            }
            let tokens: usize = ok.iter().map(|o| o.tokens).sum();
            let mut ttfts: Vec<f64> = ok.iter().map(|o| o.ttft).collect();
            let mut gaps: Vec<f64> = ok.iter().flat_map(|o| o.gaps.iter().copied()).collect();
            let cached: usize = ok.iter().map(|o| o.cached).sum();
            let row = json!({
                "clients": clients, "round": round, "completed": ok.len(), "failed": results.len() - ok.len(),
                "output_tokens": tokens, "seconds": wall, "tok_s": tokens as f64 / wall,
                "requests_s": ok.len() as f64 / wall,
                "ttft_p50": percentile(&mut ttfts, 0.5), "ttft_p90": percentile(&mut ttfts, 0.9),
                "ttft_p99": percentile(&mut ttfts, 0.99),
                "itl_p50": percentile(&mut gaps, 0.5), "itl_p99": percentile(&mut gaps, 0.99),
                "cached_tokens": cached,
            });
            if !a.json {
                let f = |k: &str| row[k].as_f64().unwrap_or(f64::NAN);
                println!(
                    "clients {clients:>3}  round {round}  completed {:>3}  failed {}  tokens {tokens:>5}  {:>6.1} tok/s  {:.2} req/s  TTFT p50 {:.2} s  p99 {:.2} s  ITL p50 {:.0} ms  p99 {:.0} ms  cached {cached}",
                    ok.len(),
                    results.len() - ok.len(),
                    f("tok_s"),
                    f("requests_s"),
                    f("ttft_p50"),
                    f("ttft_p99"),
                    1e3 * f("itl_p50"),
                    1e3 * f("itl_p99"),
                );
            }
            rows.push(row);
        }
    }
    if a.json {
        println!("{}", Value::Array(rows));
    }
    Ok(())
}
