//! `/metrics`: the server's counters in Prometheus' text format
//! (`prometheus-client`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// A response's status code, the label of `ember_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    /// The HTTP status code.
    pub status: u16,
}

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    /// Responses by status code.
    pub requests: Family<StatusLabel, Counter>,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: Counter,
    /// Tokens generated.
    pub generated_tokens: Counter,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: Counter,
    /// Generations stopped because their client went away.
    pub cancelled: Counter,
    /// Sequences being generated.
    pub running: Gauge,
    /// Requests waiting for a slot.
    pub queued: Gauge,
    /// KV positions in use (running reservations and kept prefixes).
    pub kv_tokens_used: Gauge,
    /// KV positions available in all.
    pub kv_tokens_budget: Gauge,
    /// Finished sequences kept for their prefixes.
    pub kept_sequences: Gauge,
    /// Seconds from a request's arrival to its first token.
    pub ttft: Histogram,
    /// Seconds between two tokens of one sequence.
    pub inter_token: Histogram,
}

impl Metrics {
    /// The metrics, registered.
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let requests = Family::<StatusLabel, Counter>::default();
        let (prompt_tokens, generated_tokens, cached_tokens, cancelled) =
            (Counter::default(), Counter::default(), Counter::default(), Counter::default());
        let (running, queued, kv_tokens_used, kv_tokens_budget, kept_sequences) =
            (Gauge::default(), Gauge::default(), Gauge::default(), Gauge::default(), Gauge::default());
        let ttft = Histogram::new([0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]);
        let inter_token = Histogram::new([0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5]);
        registry.register("ember_requests", "HTTP responses by status code", requests.clone());
        registry.register("ember_prompt_tokens", "Prompt tokens of admitted requests", prompt_tokens.clone());
        registry.register("ember_generated_tokens", "Tokens generated", generated_tokens.clone());
        registry.register("ember_cached_tokens", "Prompt tokens served from the prefix cache", cached_tokens.clone());
        registry.register("ember_cancelled", "Generations stopped because their client went away", cancelled.clone());
        registry.register("ember_running_sequences", "Sequences being generated", running.clone());
        registry.register("ember_queued_requests", "Requests waiting for a slot", queued.clone());
        registry.register("ember_kv_tokens_used", "KV cache positions in use", kv_tokens_used.clone());
        registry.register("ember_kv_tokens_budget", "KV cache positions available", kv_tokens_budget.clone());
        registry.register("ember_kept_sequences", "Finished sequences kept for their prefixes", kept_sequences.clone());
        registry.register(
            "ember_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token",
            ttft.clone(),
        );
        registry.register(
            "ember_inter_token_latency_seconds",
            "Seconds between two tokens of one sequence",
            inter_token.clone(),
        );
        Metrics {
            registry,
            requests,
            prompt_tokens,
            generated_tokens,
            cached_tokens,
            cancelled,
            running,
            queued,
            kv_tokens_used,
            kv_tokens_budget,
            kept_sequences,
            ttft,
            inter_token,
        }
    }

    /// Prometheus' text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String");
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
