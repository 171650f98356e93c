//! # ember-server
//!
//! `ember serve`: an OpenAI-compatible HTTP server over
//! [`ember_model`]'s public API, with continuous batching and a prefix
//! cache.
//!
//! - [`http`]: the routes (`/v1/chat/completions`, `/v1/completions`,
//!   `/v1/models`, `/health`, `/health/live`, `/metrics`), API keys, request
//!   ids, and the replies as one JSON body or server-sent events;
//! - [`api`]: OpenAI's wire format, validated into a prompt and
//!   [`ember_model::GenerateOptions`], and its error shape;
//! - [`engine`]: the scheduler thread that steps every running sequence in
//!   one forward pass per token ([`ember_model::advanced::advance`]) and keeps
//!   finished sequences' keys and values for the prompts that share their
//!   prefix;
//! - [`metrics`]: the Prometheus counters.
//!
//! The HTTP side runs on tokio; the model runs on its own thread (and the
//! kernels' pool), fed through a channel, so slow clients never stall a
//! forward pass and a step never blocks the network.

pub mod api;
pub mod engine;
pub mod http;
pub mod metrics;

use anyhow::{bail, Context, Result};
use ember_model::Model;
use engine::{Engine, Limits};
use http::AppState;
use metrics::Metrics;
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// How to serve.
#[derive(Debug, Clone)]
pub struct Config {
    /// Address to listen on.
    pub addr: SocketAddr,
    /// The id clients see in `/v1/models` and responses.
    pub model_id: String,
    /// Sequences generated together.
    pub parallel: usize,
    /// Positions of one sequence (prompt and reply).
    pub context: usize,
    /// Positions of all sequences' caches together (running and kept).
    pub kv_budget: usize,
    /// Prompt tokens of one sequence per forward pass.
    pub prefill_chunk: usize,
    /// Required `Authorization: Bearer` key.
    pub api_key: Option<String>,
    /// Requests that may wait for a slot (more get 503).
    pub max_queue: usize,
    /// After SIGTERM or Ctrl-C, how long the listener stays open (serving
    /// as usual) while `/health` already says `draining`: the time a load
    /// balancer that polls `/health`, or Kubernetes removing the endpoint,
    /// needs to stop sending new requests here.
    pub drain_delay: std::time::Duration,
    /// After the listener closes, how long requests in flight may take to
    /// finish before the server exits anyway.
    pub shutdown_grace: std::time::Duration,
}

pub(crate) fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Listens on `config.addr` at once (`/health` says 503 while loading),
/// loads the model with `load` on another thread, then serves until Ctrl-C
/// or SIGTERM and drains (see [`serve_until`]). `on_listening` is called
/// with the bound address (the port may have been 0).
pub fn serve(
    config: Config,
    load: impl FnOnce() -> Result<Arc<Model>> + Send + 'static,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<()> {
    serve_until(config, load, on_listening, shutdown_signal())
}

/// [`serve`], draining when `stop` completes instead of on a signal.
///
/// Draining: `/health` answers 503 `{"status":"draining"}` at once (and
/// `/health/live` still 200) while the listener stays open and serves for
/// `drain_delay`; then the listener closes, so new connections are refused
/// and a load balancer sends them to another replica, idle keep-alive
/// connections are closed, and the requests in flight get `shutdown_grace`
/// to finish before this returns.
pub fn serve_until(
    config: Config,
    load: impl FnOnce() -> Result<Arc<Model>> + Send + 'static,
    on_listening: impl FnOnce(SocketAddr),
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    if config.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    if config.context < 2 {
        bail!("--ctx must be at least 2 tokens");
    }
    if config.kv_budget < config.context {
        bail!(
            "the KV budget ({} tokens) must hold at least one whole sequence (--ctx {}); raise --kv-budget",
            config.kv_budget,
            config.context
        );
    }
    if config.max_queue == 0 {
        bail!("--max-queue must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("ember-http")
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(config.addr)
            .await
            .with_context(|| format!("listening on {}", config.addr))?;
        let addr = listener.local_addr()?;
        let metrics = Arc::new(Metrics::new());
        let state = Arc::new(AppState {
            ready: OnceLock::new(),
            draining: AtomicBool::new(false),
            model_id: config.model_id.clone(),
            key_digest: config.api_key.as_deref().map(digest),
            max_queue: config.max_queue,
            metrics: Arc::clone(&metrics),
            counter: Default::default(),
            started: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        });
        on_listening(addr);
        let st = Arc::clone(&state);
        let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<anyhow::Error>();
        tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            match load() {
                Ok(model) => {
                    let limits = Limits {
                        parallel: config.parallel,
                        context: config.context.min(model.context()),
                        kv_budget: config.kv_budget,
                        prefill_chunk: config.prefill_chunk.max(1),
                    };
                    let engine = Engine::start(Arc::clone(&model), limits, metrics);
                    let _ = st.ready.set(http::Ready { model, engine, context: limits.context });
                    tracing::info!(
                        seconds = format_args!("{:.2}", started.elapsed().as_secs_f64()),
                        "model loaded, ready"
                    );
                }
                Err(e) => {
                    let _ = failed_tx.send(e);
                }
            }
        });
        let failure = Arc::new(std::sync::Mutex::new(None));
        let f = Arc::clone(&failure);
        // Stopping: `stop` (a signal) turns /health to draining and, after
        // the drain delay, closes the listener; a failed load closes it at
        // once. Then the requests in flight get `shutdown_grace` to finish.
        let stopping = Arc::new(tokio::sync::Notify::new());
        let notify = Arc::clone(&stopping);
        let (drain_delay, grace) = (config.drain_delay, config.shutdown_grace);
        let st = Arc::clone(&state);
        let shutdown = async move {
            let load_failed = async {
                match failed_rx.await {
                    Ok(e) => *f.lock().unwrap_or_else(|p| p.into_inner()) = Some(e),
                    // Loaded: nothing to wait for here.
                    Err(_) => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = stop => {
                    st.draining.store(true, Ordering::SeqCst);
                    tracing::info!(
                        "draining: /health answers 503 draining; the listener closes in {:.1} s, then requests in flight have {} s to finish",
                        drain_delay.as_secs_f64(),
                        grace.as_secs()
                    );
                    tokio::time::sleep(drain_delay).await;
                    tracing::info!("listener closed: finishing the requests in flight");
                },
                _ = load_failed => {},
            }
            notify.notify_one();
        };
        let server = axum::serve(listener, http::router(state)).with_graceful_shutdown(shutdown);
        tokio::select! {
            r = server => r.context("serving HTTP")?,
            _ = async { stopping.notified().await; tokio::time::sleep(grace).await } => {
                tracing::warn!("requests still running after {} s; exiting", grace.as_secs());
            }
        }
        if let Some(e) = failure.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Err(e.context("loading the model"));
        }
        Ok(())
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down");
}
