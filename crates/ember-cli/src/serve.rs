//! `ember serve`: the OpenAI-compatible HTTP server (`ember-server`).

use crate::runtime::RuntimeArgs;
use anyhow::{bail, Context, Result};
use std::net::{IpAddr, SocketAddr};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    runtime: RuntimeArgs,

    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1", env = "EMBER_HOST")]
    host: IpAddr,

    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080, env = "EMBER_PORT")]
    port: u16,

    /// Sequences generated at once (each step advances all of them with one
    /// pass over the weights); more requests wait in the queue.
    #[arg(long, default_value_t = 4, env = "EMBER_PARALLEL")]
    parallel: usize,

    /// Key-value cache positions for all sequences together, running and
    /// kept for their prefixes (default: --parallel × --ctx). About 24 KB
    /// per position for the 0.5B model (f32 keys and values, 24 layers);
    /// memory is committed only as positions fill.
    #[arg(long, value_name = "TOKENS", env = "EMBER_KV_BUDGET")]
    kv_budget: Option<usize>,

    /// Require `Authorization: Bearer KEY` on /v1/* (also EMBER_API_KEY).
    #[arg(long, env = "EMBER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,

    /// Requests that may wait for a slot (beyond those a free slot takes at
    /// once); more are refused with 503 and Retry-After.
    #[arg(long, default_value_t = 64, env = "EMBER_MAX_QUEUE")]
    max_queue: usize,

    /// After SIGTERM or Ctrl-C, seconds the listener stays open (and serves)
    /// while /health already answers 503 draining: the time a balancer or
    /// Kubernetes needs to stop sending requests here (0: close at once, so
    /// new connections are refused and a proxy retries them elsewhere).
    #[arg(long, default_value_t = 0.0, value_name = "SECONDS", env = "EMBER_DRAIN_DELAY")]
    drain_delay: f64,

    /// Once the listener has closed, seconds the requests in flight may take
    /// to finish before the server exits.
    #[arg(long, default_value_t = 30, value_name = "SECONDS", env = "EMBER_SHUTDOWN_GRACE")]
    shutdown_grace: u64,

    /// The model id clients see (default: the model folder's name).
    #[arg(long, env = "EMBER_MODEL_NAME")]
    model_name: Option<String>,
}

pub fn run(args: Args) -> Result<()> {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    let dir = crate::model_dir(args.runtime.model.clone())?;
    if !dir.exists() {
        bail!("no model at {}", dir.display());
    }
    let model_id = match &args.model_name {
        Some(n) => n.clone(),
        None => dir
            .file_name()
            .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
            .unwrap_or_else(|| "ember".into()),
    };
    if args.runtime.ctx < 2 {
        bail!("--ctx must be at least 2");
    }
    // The library caps --ctx at the model's maximum when it loads.
    let context = args.runtime.ctx;
    let kv_budget = match args.kv_budget {
        Some(b) => b,
        None => args.parallel.checked_mul(context).context("--parallel × --ctx overflows")?,
    };
    if !(0.0..=3600.0).contains(&args.drain_delay) {
        bail!("--drain-delay must be between 0 and 3600 seconds");
    }
    let config = ember_server::Config {
        addr: SocketAddr::new(args.host, args.port),
        model_id,
        parallel: args.parallel,
        context,
        kv_budget,
        prefill_chunk: args.runtime.prefill_chunk,
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        max_queue: args.max_queue,
        drain_delay: std::time::Duration::from_secs_f64(args.drain_delay),
        shutdown_grace: std::time::Duration::from_secs(args.shutdown_grace),
    };
    let runtime = args.runtime;
    ember_server::serve(
        config.clone(),
        move || Ok(runtime.load(true)?.0),
        |addr| {
            tracing::info!(
                "listening on http://{addr} (parallel {}, context {}, KV budget {} tokens{})",
                config.parallel,
                config.context,
                config.kv_budget,
                if config.api_key.is_some() { ", API key required" } else { "" }
            );
        },
    )
}
