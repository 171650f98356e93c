//! `cargo xtask load`: a bounded load generator for OpenAI-compatible
//! servers (`ember serve`, llama-server, vLLM, or nginx in front of several
//! replicas).
//!
//! Two modes:
//! - **rounds** (the default): C clients send streaming chat requests, each
//!   with its own prompt (one each, or `--requests N` in all, a client
//!   sending its next when its last is done); a round reports requests/s,
//!   aggregate output tokens/s, time to first token (p50, p90, p99),
//!   inter-token latency (p50, p99), cached prompt tokens and errors.
//! - **conversations** (`--conversations N`): C clients hold N multi-turn
//!   conversations, each turn resending the whole history so far, streaming
//!   and non-streaming turns mixed, with an `X-Session-Id` header per
//!   conversation (`--session request`: a new one per request, so a
//!   hashing proxy places every turn at random; `--session off`: none); it
//!   reports requests sent,
//!   completed, failed (with reasons), retried by a proxy, and the share of
//!   the prompt tokens of turns 2 and later that the server found in its
//!   prefix cache (`usage.prompt_tokens_details.cached_tokens`).
//!
//! ```text
//! cargo xtask load --url http://127.0.0.1:8080 --clients 1,4,8,16 --max-tokens 128
//! cargo xtask load --url ... --clients 8 --system-tokens 1000   # shared system prompt
//! cargo xtask load --url ... --clients 1 --temperature 0          # greedy, as `ember bench` decodes
//! cargo xtask load --url ... --clients 4 --conversations 12 --turns 4 --max-tokens 32
//! ```
//!
//! A request counts as completed only when its reply arrived whole: a
//! non-streamed body of its full length that parses, or a stream that ends
//! with `data: [DONE]` and the final chunk of its chunked body. A stream
//! that breaks off (the connection closed or reset before the final chunk,
//! as nginx does when the replica behind it dies mid-reply), ends without
//! `[DONE]`, or carries an error event, is a failure with that reason;
//! never a silent truncation. A proxy's retries are seen in its
//! `X-Ember-Upstream` header (nginx's `$upstream_addr`: a comma means the
//! request was tried on more than one replica).
//!
//! Plain `std::net` and threads: HTTP/1.1, chunked server-sent events.

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
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
    conversations: Option<usize>,
    turns: usize,
    session: Session,
    stream_share: f64,
    think_ms: u64,
    seconds: u64,
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
        conversations: None,
        turns: 3,
        session: Session::PerConversation,
        stream_share: 0.5,
        think_ms: 0,
        seconds: 600,
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
            "--conversations" => a.conversations = Some(value()?.parse::<usize>()?.clamp(1, 10_000)),
            "--turns" => a.turns = value()?.parse::<usize>()?.clamp(1, 100),
            "--session" => {
                a.session = match value()?.as_str() {
                    "conversation" => Session::PerConversation,
                    "request" => Session::PerRequest,
                    "off" => Session::Off,
                    other => bail!("--session: `conversation`, `request` or `off`, not `{other}`"),
                }
            }
            "--stream-share" => {
                a.stream_share = value()?.parse()?;
                ensure!((0.0..=1.0).contains(&a.stream_share), "--stream-share: 0 to 1");
            }
            "--think-ms" => a.think_ms = value()?.parse()?,
            "--seconds" => a.seconds = value()?.parse::<u64>()?.max(1),
            "--json" => a.json = true,
            other => bail!(
                "unknown option `{other}` (load takes --url, --clients, --max-tokens, --system-tokens, --temperature, \
                 --requests, --api-key, --rounds, --json; with --conversations N: --turns, --session, \
                 --stream-share, --think-ms, --seconds)"
            ),
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

/// One chat request and what came back of it.
#[derive(Debug, Clone, Default)]
pub struct Exchange {
    /// Whether the request asked for a stream.
    pub stream: bool,
    /// The response's status (0: no response head arrived).
    pub status: u16,
    /// The `X-Ember-Upstream` header a proxy added: the replicas tried.
    pub upstream: Option<String>,
    /// Seconds to the first content (streams), or to the whole reply.
    pub ttft: f64,
    /// Completion tokens (the usage's, else content chunks).
    pub tokens: usize,
    /// Prompt tokens the server reported.
    pub prompt_tokens: usize,
    /// Cached prompt tokens the server reported.
    pub cached: usize,
    /// Seconds between consecutive content chunks (inter-token latency).
    pub gaps: Vec<f64>,
    /// The reply's text.
    pub text: String,
    /// Why the request failed; `None` when its reply arrived whole.
    pub error: Option<String>,
}

impl Exchange {
    /// The request was tried on more than one replica (a proxy retried it).
    pub fn retried(&self) -> bool {
        self.upstream.as_deref().is_some_and(|u| u.contains(','))
    }
}

/// Sends one chat request (streamed when `body.stream` is true) with extra
/// headers and reads the reply to its end. Never fails: what went wrong is
/// in [`Exchange::error`].
pub fn chat(host: &str, key: Option<&str>, body: &Value, headers: &[(&str, &str)], timeout: Duration) -> Exchange {
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let mut ex = Exchange { stream, ..Exchange::default() };
    if let Err(e) = exchange(host, key, body, headers, timeout, &mut ex) {
        ex.error = Some(format!("{e:#}"));
    }
    ex
}

/// What the body reader has seen of a chunked or sized body.
struct Body {
    chunked: bool,
    /// `Content-Length`, when not chunked.
    length: Option<usize>,
    /// Raw bytes after the head not yet dechunked.
    raw: Vec<u8>,
    /// The body so far (dechunked).
    bytes: Vec<u8>,
    /// The final chunk (or the whole sized body) arrived.
    complete: bool,
}

impl Body {
    /// Moves what is complete of `raw` into `bytes`.
    fn take(&mut self) -> Result<()> {
        if !self.chunked {
            self.bytes.append(&mut self.raw);
            if let Some(n) = self.length {
                self.complete = self.bytes.len() >= n;
            }
            return Ok(());
        }
        let mut at = 0;
        while !self.complete {
            let rest = &self.raw[at..];
            let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else { break };
            let line = String::from_utf8_lossy(&rest[..eol]);
            let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
                .with_context(|| format!("a malformed chunk size `{line}`"))?;
            if size == 0 {
                self.complete = true;
                at = self.raw.len();
                break;
            }
            if rest.len() < eol + 2 + size + 2 {
                break;
            }
            self.bytes.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
            at += eol + 2 + size + 2;
        }
        self.raw.drain(..at);
        Ok(())
    }
}

fn exchange(
    host: &str,
    key: Option<&str>,
    body: &Value,
    headers: &[(&str, &str)],
    timeout: Duration,
    ex: &mut Exchange,
) -> Result<()> {
    let addr = host.to_socket_addrs()?.next().context("resolving the host")?;
    let started = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).context("connecting")?;
    s.set_read_timeout(Some(timeout))?;
    let text = body.to_string();
    let mut extra = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    for (name, value) in headers {
        extra.push_str(&format!("{name}: {value}\r\n"));
    }
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n{extra}Content-Length: {}\r\n\r\n{text}",
        text.len()
    )
    .context("sending the request")?;
    let mut buf = [0u8; 16384];
    let mut head_bytes = Vec::new();
    let mut b: Option<Body> = None;
    let mut events = 0usize;
    let (mut done, mut usage) = (false, None::<Value>);
    let mut last = None::<Instant>;
    loop {
        let n = match s.read(&mut buf) {
            Ok(n) => n,
            Err(e) => {
                let what = if ex.status == 0 { "before the response head" } else { "mid-reply" };
                bail!("the connection broke {what} after {events} events: {e}");
            }
        };
        if n == 0 {
            break;
        }
        let body = match &mut b {
            Some(body) => {
                body.raw.extend_from_slice(&buf[..n]);
                body
            }
            None => {
                head_bytes.extend_from_slice(&buf[..n]);
                let Some(end) = head_bytes.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
                let h = String::from_utf8_lossy(&head_bytes[..end]).to_string();
                ex.status = h.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
                let mut chunked = false;
                let mut length = None;
                for line in h.lines().skip(1) {
                    let Some((name, value)) = line.split_once(':') else { continue };
                    let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
                    match name.as_str() {
                        "transfer-encoding" => chunked = value.eq_ignore_ascii_case("chunked"),
                        "content-length" => length = value.parse().ok(),
                        "x-ember-upstream" => ex.upstream = Some(value.to_string()),
                        _ => {}
                    }
                }
                let raw = head_bytes.split_off(end + 4);
                b.insert(Body { chunked, length, raw, bytes: Vec::new(), complete: false })
            }
        };
        body.take()?;
        if ex.status != 200 || !ex.stream {
            if body.complete {
                break;
            }
            continue;
        }
        // Whole events.
        while let Some(end) = body.bytes.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = body.bytes.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data: ") else { continue };
                events += 1;
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
                        if ex.ttft == 0.0 {
                            ex.ttft = started.elapsed().as_secs_f64();
                        }
                        let now = Instant::now();
                        if let Some(l) = last {
                            ex.gaps.push(now.duration_since(l).as_secs_f64());
                        }
                        last = Some(now);
                        ex.tokens += 1;
                        ex.text.push_str(c);
                    }
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    usage = Some(u.clone());
                }
            }
        }
        if body.complete {
            break;
        }
    }
    let Some(mut body) = b else { bail!("the connection closed before the response head") };
    // Neither chunked nor sized: the body ends where the connection does.
    body.complete |= !body.chunked && body.length.is_none();
    if ex.status != 200 {
        bail!("status {}: {}", ex.status, String::from_utf8_lossy(&body.bytes).trim());
    }
    if !body.complete {
        let what = if body.chunked { "the final chunk" } else { "the whole body" };
        bail!("truncated: the connection closed before {what} ({events} events, no [DONE])");
    }
    if ex.stream {
        ensure!(done, "the stream ended without [DONE] after {events} events");
    } else {
        let v: Value = serde_json::from_slice(&body.bytes).context("the reply is not JSON")?;
        ex.text = v.pointer("/choices/0/message/content").and_then(Value::as_str).unwrap_or("").to_string();
        ex.ttft = started.elapsed().as_secs_f64();
        usage = v.get("usage").cloned();
    }
    if let Some(u) = usage {
        if let Some(n) = u["completion_tokens"].as_u64() {
            ex.tokens = n as usize;
        }
        ex.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
        ex.cached = u.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64).unwrap_or(0) as usize;
    }
    if ex.ttft == 0.0 {
        ex.ttft = started.elapsed().as_secs_f64();
    }
    Ok(())
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
        let o = chat(&a.host, a.api_key.as_deref(), &body, &[], Duration::from_secs(600));
        if let Some(e) = o.error {
            bail!("request {i}: {e}");
        }
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

/// Multi-turn conversations: how many, how, and where to.
#[derive(Debug, Clone)]
pub struct Conversations {
    /// `HOST:PORT`.
    pub host: String,
    /// `Authorization: Bearer` key.
    pub key: Option<String>,
    /// Conversations in all.
    pub conversations: usize,
    /// Turns of each.
    pub turns: usize,
    /// Conversations held at once (each by one client thread).
    pub clients: usize,
    /// `max_tokens` of each reply.
    pub max_tokens: usize,
    /// Sampling temperature.
    pub temperature: f64,
    /// Share of the turns sent as streams (the rest as one JSON body),
    /// spread evenly over conversations and turns.
    pub stream_share: f64,
    /// Which `X-Session-Id` to send.
    pub session: Session,
    /// Pause between a reply and the next turn, as a person reading.
    pub think: Duration,
    /// Makes prompts and session ids unique to this run (and phase).
    pub tag: String,
    /// No turn starts after this; a reply may take `timeout` at most.
    pub deadline: Instant,
    /// Longest wait for one reply.
    pub timeout: Duration,
    /// A turn that failed is sent again up to this many times (as a client
    /// would after a broken stream), each a request of its own.
    pub resend: usize,
}

/// The `X-Session-Id` a conversation's requests carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Session {
    /// One value per conversation: a proxy can keep it on one replica.
    PerConversation,
    /// A new value every request: a hashing proxy places each turn at
    /// random, as any balancer that does not know the conversation would.
    PerRequest,
    /// None.
    Off,
}

/// One request of a conversation.
#[derive(Debug, Clone)]
pub struct Turn {
    /// Which turn (0: the first).
    pub turn: usize,
    /// 0 for the first try, 1.. for the client's own resends.
    pub attempt: usize,
    /// Seconds since the run started when the request was sent.
    pub sent: f64,
    /// What came back.
    pub exchange: Exchange,
}

/// Follow-up questions, short next to the history they come after.
const FOLLOW_UPS: [&str; 6] = [
    "Can you say more about the second point?",
    "Give me one concrete example of that.",
    "What is the most common mistake people make there?",
    "Summarize that in one sentence.",
    "How would you explain it to a child?",
    "What should I read next about it?",
];

/// The first message of conversation `c`: unique from its first words, so
/// that conversations share no prefix but the template's system prompt.
fn opening(tag: &str, c: usize) -> String {
    let topic = TOPICS[c % TOPICS.len()];
    format!(
        "Conversation {tag}-{c}. I am preparing a short talk about {topic} for a general audience. \
         Explain the key ideas step by step, with the vocabulary a newcomer needs, \
         and tell me which parts listeners usually find surprising."
    )
}

/// Whether the n-th request streams, so that a share `share` of any run of
/// requests does: when floor((n+1)·share) > floor(n·share).
fn streams(n: usize, share: f64) -> bool {
    ((n + 1) as f64 * share).floor() > (n as f64 * share).floor()
}

/// Holds the conversations, `clients` at a time; returns every request.
pub fn conversations(c: &Conversations) -> Vec<Turn> {
    let t0 = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..c.clients.max(1))
        .map(|_| {
            let (c, next) = (c.clone(), Arc::clone(&next));
            std::thread::spawn(move || {
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= c.conversations || Instant::now() >= c.deadline {
                        return out;
                    }
                    converse(&c, i, t0, &mut out);
                }
            })
        })
        .collect();
    handles.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect()
}

/// One conversation, turn after turn, the history growing.
fn converse(c: &Conversations, i: usize, t0: Instant, out: &mut Vec<Turn>) {
    let session = format!("{}-{i}", c.tag);
    let mut messages = vec![json!({"role": "user", "content": opening(&c.tag, i)})];
    for turn in 0..c.turns {
        if turn > 0 {
            messages.push(json!({"role": "user", "content": FOLLOW_UPS[(i + turn) % FOLLOW_UPS.len()]}));
        }
        let stream = streams(i * c.turns + turn, c.stream_share);
        let mut body = json!({
            "model": "default", "messages": messages, "stream": stream,
            "max_tokens": c.max_tokens, "temperature": c.temperature, "seed": (i * 1000 + turn) as u64,
        });
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let mut reply = None;
        for attempt in 0..=c.resend {
            if Instant::now() >= c.deadline {
                return;
            }
            let rid = format!("{session}-t{turn}-a{attempt}");
            let mut headers = vec![("X-Request-Id", rid.as_str())];
            match c.session {
                Session::PerConversation => headers.push(("X-Session-Id", session.as_str())),
                Session::PerRequest => headers.push(("X-Session-Id", rid.as_str())),
                Session::Off => {}
            }
            let sent = t0.elapsed().as_secs_f64();
            let ex = chat(&c.host, c.key.as_deref(), &body, &headers, c.timeout);
            let ok = ex.error.is_none();
            let text = ex.text.clone();
            out.push(Turn { turn, attempt, sent, exchange: ex });
            if ok {
                reply = Some(text);
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        let Some(text) = reply else { return };
        messages.push(json!({"role": "assistant", "content": text}));
        std::thread::sleep(c.think);
    }
}

/// What a set of conversation requests came to.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Requests sent (client resends included).
    pub sent: usize,
    /// Replies that arrived whole.
    pub completed: usize,
    /// Requests that failed, by reason (reasons shortened).
    pub failed: BTreeMap<String, usize>,
    /// Failed streams among them.
    pub failed_streams: usize,
    /// Failed non-streamed requests among them.
    pub failed_whole: usize,
    /// Requests a proxy tried on more than one replica.
    pub retried: usize,
    /// Requests that were a client's resend of a failed turn.
    pub resent: usize,
    /// Streamed requests.
    pub streams: usize,
    /// Prompt tokens of completed turns 2 and later, and how many of them
    /// were cached.
    pub later_prompt_tokens: usize,
    /// See `later_prompt_tokens`.
    pub later_cached_tokens: usize,
    /// Completion tokens of completed requests.
    pub completion_tokens: usize,
}

impl Summary {
    /// Adds up `turns`.
    pub fn of<'a>(turns: impl IntoIterator<Item = &'a Turn>) -> Summary {
        let mut s = Summary::default();
        for t in turns {
            let ex = &t.exchange;
            s.sent += 1;
            s.streams += ex.stream as usize;
            s.retried += ex.retried() as usize;
            s.resent += (t.attempt > 0) as usize;
            match &ex.error {
                None => {
                    s.completed += 1;
                    s.completion_tokens += ex.tokens;
                    if t.turn > 0 {
                        s.later_prompt_tokens += ex.prompt_tokens;
                        s.later_cached_tokens += ex.cached;
                    }
                }
                Some(e) => {
                    *s.failed.entry(reason(e)).or_default() += 1;
                    if ex.stream {
                        s.failed_streams += 1;
                    } else {
                        s.failed_whole += 1;
                    }
                }
            }
        }
        s
    }

    /// Requests that failed.
    pub fn failures(&self) -> usize {
        self.failed.values().sum()
    }

    /// Cached share of the prompt tokens of turns 2 and later.
    pub fn cached_share(&self) -> f64 {
        self.later_cached_tokens as f64 / self.later_prompt_tokens.max(1) as f64
    }

    /// As JSON.
    pub fn json(&self) -> Value {
        json!({
            "sent": self.sent, "completed": self.completed, "failed": self.failures(),
            "failed_streams": self.failed_streams, "failed_whole": self.failed_whole,
            "failure_reasons": self.failed, "retried": self.retried, "resent": self.resent,
            "streams": self.streams, "later_prompt_tokens": self.later_prompt_tokens,
            "later_cached_tokens": self.later_cached_tokens, "cached_share": self.cached_share(),
            "completion_tokens": self.completion_tokens,
        })
    }
}

/// A failure's reason without its particulars (counts, bodies), so equal
/// reasons group.
fn reason(e: &str) -> String {
    let short: String = e.chars().take_while(|&c| c != '(' && c != '{').collect();
    let short = short.trim().trim_end_matches(':').trim();
    let mut words: Vec<&str> = short.split_whitespace().collect();
    if let Some(i) = words.iter().position(|w| *w == "after") {
        words.truncate(i);
    }
    words.join(" ")
}

fn run_conversations(a: &Args, count: usize) -> Result<()> {
    let clients = a.clients.first().copied().unwrap_or(1);
    let pid = std::process::id();
    let c = Conversations {
        host: a.host.clone(),
        key: a.api_key.clone(),
        conversations: count,
        turns: a.turns,
        clients,
        max_tokens: a.max_tokens,
        temperature: a.temperature,
        stream_share: a.stream_share,
        session: a.session,
        think: Duration::from_millis(a.think_ms),
        tag: format!("load{pid:x}"),
        deadline: Instant::now() + Duration::from_secs(a.seconds),
        timeout: Duration::from_secs(a.seconds.min(600)),
        resend: 1,
    };
    let started = Instant::now();
    let turns = conversations(&c);
    let s = Summary::of(&turns);
    let mut row = s.json();
    row["clients"] = json!(clients);
    row["seconds"] = json!(started.elapsed().as_secs_f64());
    if a.json {
        println!("{row}");
    } else {
        println!(
            "conversations {count} × {} turns, {clients} clients, X-Session-Id {:?}: sent {}, completed {}, failed {} \
             ({} streams, {} whole), retried by the proxy {}, resent {}; cached share of turns ≥ 2: {:.1}% ({} of {} prompt tokens); {:.1} s",
            a.turns,
            a.session,
            s.sent,
            s.completed,
            s.failures(),
            s.failed_streams,
            s.failed_whole,
            s.retried,
            s.resent,
            100.0 * s.cached_share(),
            s.later_cached_tokens,
            s.later_prompt_tokens,
            started.elapsed().as_secs_f64()
        );
        for (r, n) in &s.failed {
            println!("  failed: {n} × {r}");
        }
    }
    Ok(())
}

pub fn run(args: &[String]) -> Result<()> {
    let a = parse(args)?;
    if let Some(n) = a.conversations {
        return run_conversations(&a, n);
    }
    if a.system_tokens > 0 {
        return shared_prefix(&a, a.clients.iter().copied().max().unwrap_or(4));
    }
    let mut rows = Vec::new();
    let mut next = 0usize;
    for &clients in &a.clients {
        for round in 0..a.rounds {
            let started = Instant::now();
            // Each client sends its requests one after another until the
            // round's total (`--requests`, default one each) is taken.
            let total = a.requests.unwrap_or(clients);
            let taken = Arc::new(AtomicUsize::new(0));
            let handles: Vec<_> = (0..clients)
                .map(|_| {
                    let (host, key, taken) = (a.host.clone(), a.api_key.clone(), taken.clone());
                    let (max_tokens, temperature, base) = (a.max_tokens, a.temperature, next);
                    std::thread::spawn(move || {
                        let mut out = Vec::new();
                        loop {
                            let i = taken.fetch_add(1, Ordering::SeqCst);
                            if i >= total {
                                return out;
                            }
                            let body = json!({
                                "model": "default", "messages": [{"role": "user", "content": prompt(base + i)}],
                                "stream": true, "stream_options": {"include_usage": true},
                                "max_tokens": max_tokens, "temperature": temperature, "seed": (base + i) as u64,
                            });
                            out.push(chat(&host, key.as_deref(), &body, &[], Duration::from_secs(600)));
                        }
                    })
                })
                .collect();
            next += total;
            let results: Vec<Exchange> = handles
                .into_iter()
                .flat_map(|h| {
                    h.join().unwrap_or_else(|_| {
                        vec![Exchange { error: Some("a client panicked".into()), ..Exchange::default() }]
                    })
                })
                .collect();
            let wall = started.elapsed().as_secs_f64();
            let ok: Vec<&Exchange> = results.iter().filter(|r| r.error.is_none()).collect();
            for e in results.iter().filter_map(|r| r.error.as_ref()) {
                eprintln!("load: a request failed: {e}");
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

#[cfg(test)]
mod tests {
    use super::*;

    fn body(chunked: bool, length: Option<usize>, raw: &[u8]) -> Body {
        Body { chunked, length, raw: raw.to_vec(), bytes: Vec::new(), complete: false }
    }

    #[test]
    fn a_chunked_body_is_complete_only_with_its_final_chunk() {
        let mut b = body(true, None, b"5\r\nhello\r\n3\r\nabc");
        b.take().unwrap();
        assert_eq!((b.bytes.as_slice(), b.complete), (&b"hello"[..], false));
        b.raw.extend_from_slice(b"\r\n0\r\n\r\n");
        b.take().unwrap();
        assert_eq!((b.bytes.as_slice(), b.complete), (&b"helloabc"[..], true));
        let mut sized = body(false, Some(4), b"abc");
        sized.take().unwrap();
        assert!(!sized.complete);
    }

    #[test]
    fn reasons_group_without_their_particulars() {
        assert_eq!(
            reason("truncated: the connection closed before the final chunk (7 events, no [DONE])"),
            "truncated: the connection closed before the final chunk"
        );
        assert_eq!(reason("the connection broke mid-reply after 3 events: reset"), "the connection broke mid-reply");
        assert_eq!(reason("status 502: {\"error\": 1}"), "status 502");
    }

    #[test]
    fn the_stream_share_is_spread_evenly() {
        let share = |s: f64| (0..40).filter(|&n| streams(n, s)).count();
        assert_eq!(share(0.5), 20);
        assert_eq!(share(0.25), 10);
        assert_eq!(share(0.0), 0);
        assert_eq!(share(1.0), 40);
    }
}
