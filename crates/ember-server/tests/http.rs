//! The server over real sockets, on the tiny test model: the routes, the
//! error shapes and statuses, streaming, the prefix cache, the queue limit,
//! a client leaving mid-stream, and draining on a stop. (The real model with the official
//! `openai` client is `cargo xtask serve-e2e`.)

use ember_model::Model;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../ember-model/testdata/tiny-chat")
}

/// The tiny model with room for 4096 positions (the fixture has 256): a
/// copy whose config says so, for generations long enough to outlast what
/// a test does while they run.
fn long_tiny() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-http-tiny-4096-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(tiny()).unwrap() {
        let from = entry.unwrap().path();
        std::fs::copy(&from, dir.join(from.file_name().unwrap())).unwrap();
    }
    let mut config: Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    config["max_position_embeddings"] = json!(4096);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

/// Starts a server on a free port (it lives until the test process ends).
fn start(parallel: usize, context: usize, max_queue: usize, key: Option<&str>) -> SocketAddr {
    start_model(tiny(), parallel, context, max_queue, key)
}

/// [`start`] with the model in `dir`.
fn start_model(dir: PathBuf, parallel: usize, context: usize, max_queue: usize, key: Option<&str>) -> SocketAddr {
    let config = ember_server::Config {
        addr: "127.0.0.1:0".parse().unwrap(),
        model_id: "tiny".into(),
        parallel,
        context,
        kv_budget: parallel * context,
        prefill_chunk: 16,
        api_key: key.map(str::to_string),
        max_queue,
        drain_delay: Duration::ZERO,
        shutdown_grace: Duration::from_secs(5),
    };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        ember_server::serve(
            config,
            move || Ok(Model::builder(&dir).threads(1).load()?),
            move |addr| tx.send(addr).unwrap(),
        )
        .unwrap()
    });
    let addr = rx.recv_timeout(Duration::from_secs(30)).expect("the server listens");
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(addr, "/health", None).0 != 200 {
        assert!(Instant::now() < deadline, "the server never became ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    addr
}

/// One HTTP/1.1 exchange: status, raw headers, body (de-chunked).
fn exchange(addr: SocketAddr, method: &str, path: &str, key: Option<&str>, body: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    // A body over the limit may be refused before it is all sent.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.into() };
    (status, head.to_string(), body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

fn get(addr: SocketAddr, path: &str, key: Option<&str>) -> (u16, String, String) {
    exchange(addr, "GET", path, key, b"")
}

fn post(addr: SocketAddr, path: &str, key: Option<&str>, body: &Value) -> (u16, String, Value) {
    let (status, head, body) = exchange(addr, "POST", path, key, body.to_string().as_bytes());
    (status, head, serde_json::from_str(&body).unwrap_or(Value::String(body)))
}

/// The `data:` events of a streamed reply, `[DONE]` last.
fn events(body: &Value) -> Vec<String> {
    body.as_str().unwrap_or("").lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

fn is_error_shape(v: &Value) -> bool {
    let e = &v["error"];
    e["message"].is_string() && e["type"].is_string() && e.get("param").is_some() && e.get("code").is_some()
}

fn chat(content: &str, max_tokens: u64) -> Value {
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0})
}

#[test]
fn routes_keys_and_errors() {
    let key = Some("sk-test");
    let a = start(2, 64, 8, key);
    assert_eq!(get(a, "/health", None).0, 200);
    let (status, head, body) = get(a, "/v1/models", key);
    assert_eq!(status, 200);
    assert!(head.to_ascii_lowercase().contains("x-request-id:"), "{head}");
    let models: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");

    // Keys: none or wrong is 401.
    for k in [None, Some("sk-wrong"), Some("")] {
        let (status, _, body) = post(a, "/v1/chat/completions", k, &chat("hi", 2));
        assert_eq!(status, 401, "{k:?}");
        assert!(is_error_shape(&body));
    }
    // Bad requests: 400 in OpenAI's shape, naming the field.
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (json!({"messages": "hi"}), Some("messages")),
        (json!({"messages": []}), Some("messages")),
        (json!({"messages": [{"role": "robot", "content": "x"}]}), Some("messages[0].role")),
        (json!({"messages": user, "n": 2}), Some("n")),
        (json!({"messages": user, "temperature": 2.5}), Some("temperature")),
        (json!({"messages": user, "top_p": -1}), Some("top_p")),
        (json!({"messages": user, "max_tokens": "many"}), Some("max_tokens")),
        (json!({"messages": user, "max_tokens": 0}), Some("max_tokens")),
        (json!({"messages": user, "top_logprobs": 50, "logprobs": true}), Some("top_logprobs")),
        (json!({"messages": user, "response_format": {"type": "json_object"}}), Some("response_format")),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            Some("messages[0].content[0].type"),
        ),
    ];
    for (body, param) in cases {
        let (status, _, reply) = post(a, "/v1/chat/completions", key, &body);
        assert_eq!(status, 400, "{body}: {reply}");
        assert!(is_error_shape(&reply), "{reply}");
        assert_eq!(reply["error"]["param"].as_str(), param, "{body}: {reply}");
    }
    let (status, _, body) = exchange(a, "POST", "/v1/chat/completions", key, b"{\"messages\": [");
    assert_eq!(status, 400);
    assert!(is_error_shape(&serde_json::from_str(&body).unwrap()));
    // The context: prompt over it is context_length_exceeded with both counts.
    let long = "hello ".repeat(200);
    let (status, _, reply) = post(a, "/v1/chat/completions", key, &chat(&long, 4));
    assert_eq!(status, 400);
    assert_eq!(reply["error"]["code"], "context_length_exceeded");
    let msg = reply["error"]["message"].as_str().unwrap();
    assert!(msg.contains("64"), "{msg}");
    // Unknown paths, wrong methods, bodies over the limit.
    let (status, _, body) = get(a, "/v2/nothing", key);
    assert_eq!(status, 404);
    assert!(is_error_shape(&serde_json::from_str(&body).unwrap()));
    assert_eq!(get(a, "/v1/chat/completions", key).0, 405);
    let big = vec![b' '; ember_server::http::BODY_LIMIT + 1];
    assert_eq!(exchange(a, "POST", "/v1/chat/completions", key, &big).0, 413);
    // Completions: token ids outside the vocabulary, batches, echo.
    for body in [json!({"prompt": [1, 99999999]}), json!({"prompt": ["a", "b"]}), json!({"prompt": "a", "echo": true})]
    {
        let (status, _, reply) = post(a, "/v1/completions", key, &body);
        assert_eq!(status, 400, "{body}: {reply}");
        assert!(is_error_shape(&reply));
    }
    // Still serving, and the metrics counted all of it.
    let (status, _, reply) = post(a, "/v1/chat/completions", key, &chat("hello !", 3));
    assert_eq!(status, 200, "{reply}");
    let (_, _, metrics) = get(a, "/metrics", None);
    assert!(metrics.contains("ember_requests_total{status=\"400\"}"), "{metrics}");
    assert!(metrics.contains("ember_time_to_first_token_seconds_bucket"), "{metrics}");
}

#[test]
fn streams_equal_whole_replies_and_prefixes_are_reused() {
    let a = start(2, 256, 8, None);
    let q = chat("what is the capital of france ?", 8);
    let (status, _, whole) = post(a, "/v1/chat/completions", None, &q);
    assert_eq!(status, 200, "{whole}");
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let usage = &whole["usage"];
    assert_eq!(
        usage["total_tokens"],
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );

    let mut sq = q.clone();
    sq["stream"] = json!(true);
    sq["stream_options"] = json!({"include_usage": true});
    let (status, head, body) = post(a, "/v1/chat/completions", None, &sq);
    assert_eq!(status, 200);
    assert!(head.contains("text/event-stream"), "{head}");
    let ev = events(&body);
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
    assert_eq!(streamed, content);
    let last_choice = &chunks[chunks.len() - 2]["choices"][0];
    assert_eq!(last_choice["finish_reason"], whole["choices"][0]["finish_reason"]);
    let u = &chunks[chunks.len() - 1];
    assert_eq!(u["choices"], json!([]));
    assert_eq!(u["usage"]["completion_tokens"], usage["completion_tokens"]);
    // The same prompt again: all but its last token came from the cache.
    assert_eq!(u["usage"]["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"].as_u64().unwrap() - 1);

    // The next turn of the conversation reuses the whole first turn.
    let turn2 = json!({"messages": [
        {"role": "user", "content": "what is the capital of france ?"},
        {"role": "assistant", "content": content},
        {"role": "user", "content": "and of italy ?"}], "max_tokens": 4, "temperature": 0});
    let (status, _, reply) = post(a, "/v1/chat/completions", None, &turn2);
    assert_eq!(status, 200);
    let cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= usage["prompt_tokens"].as_u64().unwrap(), "{reply}");

    // Log-probabilities: one entry per token, alternatives best first.
    let mut lq = chat("hello !", 4);
    lq["logprobs"] = json!(true);
    lq["top_logprobs"] = json!(3);
    let (_, _, reply) = post(a, "/v1/chat/completions", None, &lq);
    let entries = reply["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len() as u64, reply["usage"]["completion_tokens"].as_u64().unwrap());
    for e in entries {
        let top: Vec<f64> =
            e["top_logprobs"].as_array().unwrap().iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert_eq!(top.len(), 3);
        assert!(top.windows(2).all(|w| w[0] >= w[1]), "{top:?}");
        assert_eq!(e["logprob"].as_f64().unwrap(), top[0], "greedy takes the most likely");
    }

    // Completions: text and the same ids give the same continuation.
    let (_, _, t) =
        post(a, "/v1/completions", None, &json!({"prompt": "the sea is", "max_tokens": 4, "temperature": 0}));
    let ids = Model::load(tiny()).unwrap().encode("the sea is").unwrap();
    let (_, _, i) = post(a, "/v1/completions", None, &json!({"prompt": ids, "max_tokens": 4, "temperature": 0}));
    assert_eq!(t["choices"][0]["text"], i["choices"][0]["text"]);
    assert_eq!(t["object"], "text_completion");
}

#[test]
fn a_full_queue_refuses_with_retry_after_and_leaving_clients_are_cancelled() {
    // 4096 positions of the tiny model: a reply of 400 tokens takes tens of
    // milliseconds, while the requests all arrive within a few. (In 256
    // positions, the fixture's, the client leaving below raced the end of
    // a 230-token reply, a few milliseconds, and now and then lost.)
    let dir = long_tiny();
    let a = start_model(dir.clone(), 1, 4096, 1, None);
    // The server has read the copy (and maps what it keeps).
    std::fs::remove_dir_all(&dir).unwrap();
    let slow = chat("tell me a long story .", 400);
    // One runs, one waits, the others are refused.
    let handles: Vec<_> = (0..12)
        .map(|_| {
            let body = slow.clone();
            std::thread::spawn(move || {
                let (status, head, _) = post(a, "/v1/chat/completions", None, &body);
                (status, head)
            })
        })
        .collect();
    let results: Vec<(u16, String)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let refused: Vec<&(u16, String)> = results.iter().filter(|(s, _)| *s == 503).collect();
    assert!(!refused.is_empty(), "{results:?}");
    assert!(refused.iter().all(|(_, h)| h.to_ascii_lowercase().contains("retry-after: ")), "{refused:?}");
    assert!(results.iter().all(|(s, _)| *s == 200 || *s == 503), "{results:?}");

    // A streaming client that leaves after the first event: its sequence
    // (4000 tokens, far longer than the server needs to notice) is
    // cancelled, and the slot serves the next request.
    let mut body = chat("tell me a long story .", 4000);
    body["stream"] = json!(true);
    let text = body.to_string();
    let mut s = TcpStream::connect(a).unwrap();
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}", text.len()).unwrap();
    let mut first = [0u8; 256];
    let n = s.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !get(a, "/metrics", None).2.contains("ember_cancelled_total 1") {
        assert!(
            Instant::now() < deadline,
            "the abandoned generation was not cancelled: {}",
            get(a, "/metrics", None).2
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, _, reply) = post(a, "/v1/chat/completions", None, &chat("hello !", 2));
    assert_eq!(status, 200, "{reply}");
}

#[test]
fn a_stop_drains_health_first_then_the_listener_and_finishes_requests_in_flight() {
    let config = ember_server::Config {
        addr: "127.0.0.1:0".parse().unwrap(),
        model_id: "tiny".into(),
        parallel: 2,
        context: 256,
        kv_budget: 512,
        prefill_chunk: 16,
        api_key: None,
        max_queue: 8,
        drain_delay: Duration::from_secs(3),
        shutdown_grace: Duration::from_secs(10),
    };
    let (addr_tx, addr_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let r = ember_server::serve_until(
            config,
            || Ok(Model::builder(tiny()).threads(1).load()?),
            move |addr| addr_tx.send(addr).unwrap(),
            async {
                let _ = stop_rx.await;
            },
        );
        done_tx.send(r.map_err(|e| format!("{e:#}"))).unwrap();
    });
    let a: SocketAddr = addr_rx.recv_timeout(Duration::from_secs(30)).expect("the server listens");
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(a, "/health", None).0 != 200 {
        assert!(Instant::now() < deadline, "the server never became ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(get(a, "/health/live", None).0, 200);

    // A request in flight when the stop comes: its head and half its body
    // are sent, the rest only after the listener has closed.
    let body = chat("hello !", 3).to_string();
    let (first, second) = body.as_bytes().split_at(body.len() / 2);
    let mut in_flight = TcpStream::connect(a).unwrap();
    in_flight.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        in_flight,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    in_flight.write_all(first).unwrap();
    std::thread::sleep(Duration::from_millis(100));

    let stopped = Instant::now();
    stop_tx.send(()).unwrap();
    // Draining: readiness fails at once, liveness does not, and the listener
    // still serves during the drain delay.
    let deadline = Instant::now() + Duration::from_secs(2);
    let (status, _, health) = loop {
        let h = get(a, "/health", None);
        if h.0 != 200 || Instant::now() > deadline {
            break h;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status, 503, "{health}");
    assert_eq!(serde_json::from_str::<Value>(&health).unwrap(), json!({"status": "draining"}));
    assert_eq!(get(a, "/health/live", None).0, 200);
    let (status, _, reply) = post(a, "/v1/chat/completions", None, &chat("hello !", 2));
    assert_eq!(status, 200, "{reply}");
    assert!(stopped.elapsed() < Duration::from_secs(3), "the checks outlasted the drain delay; they prove nothing");

    // Then the listener closes: new connections are refused (a proxy retries
    // them on another replica).
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect_timeout(&a, Duration::from_secs(1)).is_ok() {
        assert!(Instant::now() < deadline, "the listener stayed open");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(stopped.elapsed() >= Duration::from_millis(2900), "the listener closed before the drain delay");

    // The request in flight still completes.
    in_flight.write_all(second).unwrap();
    let mut raw = Vec::new();
    let _ = in_flight.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw);
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    assert!(raw.contains("\"finish_reason\""), "{raw}");
    let r = done_rx.recv_timeout(Duration::from_secs(20)).expect("serve returns once the requests are done");
    assert_eq!(r, Ok(()));
}
