//! The scheduler: one thread that owns every running sequence and steps
//! them together (continuous batching), and the prefix cache of finished
//! sequences' keys and values.
//!
//! Requests arrive as [`Job`]s on a channel. Each pass of the loop admits
//! waiting jobs while there is a free slot (`--parallel`) and room in the KV
//! budget, then runs one [`advance`] over all running sequences: one forward
//! pass reads the weights once for every sequence's next token, plus at most
//! `prefill_chunk` tokens of each new prompt (a long prompt takes several
//! passes, and the running streams get a token at each of them). Tokens go
//! back to each request's handler on its own channel; a handler that went
//! away (the client disconnected) cancels its sequence before the next pass.
//!
//! Nothing here knows HTTP: the scheduler takes jobs and sends events, and
//! `http` depends on it, not the other way round; a program can run an
//! [`Engine`] with its own front end.
//!
//! **Prefix cache.** A finished sequence's context (prompt and reply, their
//! keys and values) is kept. A new prompt starts from the kept context
//! sharing its longest prefix: taken over when the whole kept context is a
//! prefix of the prompt (the next turn of a conversation), copied up to the
//! shared length otherwise (one system prompt, many conversations). Kept
//! contexts are dropped least recently used first when the budget needs
//! their room, the one a waiting prompt would start from last: a job that
//! fits only without it starts afresh rather than wait.
//!
//! **KV budget.** Every position of every cache, running or kept, counts
//! against one budget in tokens. A running sequence reserves its prompt
//! plus its `max_tokens` (at most the per-sequence context) when admitted,
//! so a step never runs out of room.

use crate::metrics::Metrics;
use ember_model::advanced::{advance, Context, Decoding, Scratch};
use ember_model::{GenerateOptions, Model, StopReason, Token};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// One generation request, tokenized and validated.
pub struct Job {
    /// The request id (logs).
    pub id: String,
    /// The prompt's token ids (not empty, shorter than the context).
    pub prompt: Vec<u32>,
    /// Sampling, limits, stop strings, log-probabilities, cancellation.
    pub options: GenerateOptions,
    /// Where the tokens go.
    pub events: UnboundedSender<Event>,
    /// When the request arrived (time to first token).
    pub arrived: Instant,
}

/// What the scheduler tells a request's handler.
#[derive(Debug)]
pub enum Event {
    /// A generated token.
    Token(Token),
    /// The generation ended.
    Done(Finish),
}

/// How a generation ended.
#[derive(Debug, Clone)]
pub struct Finish {
    /// Why it stopped (`None` after an engine error).
    pub stop: Option<StopReason>,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Seconds from arrival to the first token.
    pub ttft: f64,
    /// Generated tokens per second after the first.
    pub decode_tok_s: f64,
    /// An engine error, if the generation failed.
    pub error: Option<String>,
}

/// Scheduler settings.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Sequences stepped together at most.
    pub parallel: usize,
    /// Positions of one sequence's cache.
    pub context: usize,
    /// Positions of all caches together, running and kept.
    pub kv_budget: usize,
    /// Prompt tokens of one sequence per forward pass.
    pub prefill_chunk: usize,
}

/// The handle the HTTP side holds: submit jobs, see the queue.
#[derive(Clone)]
pub struct Engine {
    jobs: mpsc::Sender<Job>,
    /// Jobs submitted and not yet admitted.
    queued: Arc<AtomicUsize>,
    /// Sequences running (as of the scheduler's last pass).
    running: Arc<AtomicUsize>,
    parallel: usize,
}

impl Engine {
    /// Starts the scheduler thread for `model`.
    pub fn start(model: Arc<Model>, limits: Limits, metrics: Arc<Metrics>) -> Engine {
        let (tx, rx) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let (q, r) = (Arc::clone(&queued), Arc::clone(&running));
        metrics.kv_tokens_budget.set(limits.kv_budget as i64);
        std::thread::Builder::new()
            .name("ember-scheduler".into())
            .spawn(move || Scheduler::new(model, limits, metrics, q, r).run(rx))
            .expect("spawning the scheduler thread");
        Engine { jobs: tx, queued, running, parallel: limits.parallel }
    }

    /// Jobs waiting for a slot.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Queues a job unless `max_queue` jobs already wait for a slot (jobs
    /// that a free slot will take at the next pass do not count); gives it
    /// back if the queue is full (or the scheduler has stopped).
    #[allow(clippy::result_large_err)] // the refused job goes back whole
    pub fn submit(&self, job: Job, max_queue: usize) -> Result<(), Job> {
        let prev = self.queued.fetch_add(1, Ordering::SeqCst);
        let free = self.parallel.saturating_sub(self.running.load(Ordering::SeqCst));
        if prev >= max_queue + free {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(job);
        }
        match self.jobs.send(job) {
            Ok(()) => Ok(()),
            Err(mpsc::SendError(job)) => {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                Err(job)
            }
        }
    }
}

/// A sequence being generated.
struct Running {
    job: Job,
    ctx: Context,
    decoding: Decoding,
    /// Positions reserved in the budget.
    reserved: usize,
    cached: usize,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    generated: usize,
}

/// A finished sequence's context, kept for its prefix.
struct Kept {
    ctx: Context,
    last_used: u64,
}

struct Scheduler {
    model: Arc<Model>,
    limits: Limits,
    metrics: Arc<Metrics>,
    queued: Arc<AtomicUsize>,
    running_count: Arc<AtomicUsize>,
    waiting: VecDeque<Job>,
    running: Vec<Running>,
    kept: Vec<Kept>,
    /// Budget positions in use: running reservations plus kept contexts.
    used: usize,
    clock: u64,
    scratch: Scratch,
}

impl Scheduler {
    fn new(
        model: Arc<Model>,
        limits: Limits,
        metrics: Arc<Metrics>,
        queued: Arc<AtomicUsize>,
        running_count: Arc<AtomicUsize>,
    ) -> Scheduler {
        Scheduler {
            model,
            limits,
            metrics,
            queued,
            running_count,
            waiting: VecDeque::new(),
            running: Vec::new(),
            kept: Vec::new(),
            used: 0,
            clock: 0,
            scratch: Scratch::default(),
        }
    }

    fn run(mut self, jobs: mpsc::Receiver<Job>) {
        loop {
            // Block only when there is nothing to do.
            if self.running.is_empty() && self.waiting.is_empty() {
                match jobs.recv() {
                    Ok(job) => self.waiting.push_back(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = jobs.try_recv() {
                self.waiting.push_back(job);
            }
            self.admit();
            self.publish();
            if self.running.is_empty() {
                continue;
            }
            self.step();
            self.publish();
        }
    }

    /// Positions a job reserves: its prompt and everything it may generate.
    fn need(&self, job: &Job) -> usize {
        (job.prompt.len() + job.options.max_tokens).min(self.limits.context)
    }

    /// Starts waiting jobs while a slot and budget room are free (dropping
    /// kept contexts, least recently used first, to make room).
    fn admit(&mut self) {
        while self.running.len() < self.limits.parallel {
            let Some(job) = self.waiting.front() else { break };
            if job.events.is_closed() {
                // The client left before its turn.
                self.waiting.pop_front();
                self.queued.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            let need = self.need(job);
            // Make room, least recently used kept contexts first. The one it
            // would start from goes last (looked up again each time: an
            // eviction moves the last entry): starting afresh beats waiting
            // for room that, with nothing running, nothing would return.
            loop {
                let source = self.best_prefix(&self.waiting[0].prompt);
                if self.fits(need, source) {
                    break;
                }
                let evicted = self.evict_one(source.map(|(i, _)| i)) || (source.is_some() && self.evict_one(None));
                if !evicted {
                    break;
                }
            }
            let source = self.best_prefix(&self.waiting[0].prompt);
            if !self.fits(need, source) {
                // Wait for running sequences to finish (their room returns).
                break;
            }
            let job = self.waiting.pop_front().expect("a front job");
            self.queued.fetch_sub(1, Ordering::SeqCst);
            self.start(job, need, source);
        }
    }

    /// Whether a job reserving `need` positions fits the budget now, starting
    /// from `source` ([`Scheduler::best_prefix`]): a kept context it takes
    /// over whole returns its positions as it starts ([`Scheduler::start`]).
    fn fits(&self, need: usize, source: Option<(usize, usize)>) -> bool {
        let returned = match source {
            Some((i, n)) if n == self.kept[i].ctx.tokens().len() => n,
            _ => 0,
        };
        self.used - returned + need <= self.limits.kv_budget
    }

    /// The kept context sharing the longest prefix with `prompt`, and that
    /// length (at most `prompt.len() - 1`: the last prompt token runs to give
    /// the next token's logits).
    fn best_prefix(&self, prompt: &[u32]) -> Option<(usize, usize)> {
        let limit = prompt.len().saturating_sub(1);
        self.kept
            .iter()
            .enumerate()
            .map(|(i, k)| (i, common_prefix(k.ctx.tokens(), prompt).min(limit)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(i, n)| (n, self.kept[i].last_used))
    }

    /// Drops the least recently used kept context other than `keep`;
    /// false if there is none.
    fn evict_one(&mut self, keep: Option<usize>) -> bool {
        let victim = self
            .kept
            .iter()
            .enumerate()
            .filter(|&(i, _)| Some(i) != keep)
            .min_by_key(|(_, k)| k.last_used)
            .map(|(i, _)| i);
        match victim {
            Some(i) => {
                let k = self.kept.swap_remove(i);
                self.used -= k.ctx.tokens().len();
                true
            }
            None => false,
        }
    }

    fn start(&mut self, job: Job, need: usize, source: Option<(usize, usize)>) {
        let (ctx, cached) = match source {
            // The whole kept context is a prefix of the prompt: take it over.
            Some((i, n)) if n == self.kept[i].ctx.tokens().len() => {
                let k = self.kept.swap_remove(i);
                self.used -= k.ctx.tokens().len();
                let mut ctx = k.ctx;
                ctx.rewind(n);
                (ctx, n)
            }
            // A shorter shared prefix: copy it, keep the entry. (Without the
            // memory for the copy, start afresh: the forward pass then says
            // what it could not allocate.)
            Some((i, n)) => {
                self.clock += 1;
                self.kept[i].last_used = self.clock;
                match self.kept[i].ctx.fork_prefix(n) {
                    Ok(ctx) => (ctx, n),
                    Err(_) => (Context::new(self.model.decoder().new_cache(self.limits.context)), 0),
                }
            }
            None => (Context::new(self.model.decoder().new_cache(self.limits.context)), 0),
        };
        let todo = job.prompt[cached..].to_vec();
        match Decoding::new(&self.model, job.options.clone(), todo, cached) {
            Ok(decoding) => {
                self.used += need;
                self.metrics.cached_tokens.inc_by(cached as u64);
                self.metrics.prompt_tokens.inc_by(job.prompt.len() as u64);
                self.running.push(Running {
                    job,
                    ctx,
                    decoding,
                    reserved: need,
                    cached,
                    first_token: None,
                    last_token: None,
                    generated: 0,
                });
            }
            Err(e) => {
                let finish = Finish {
                    stop: None,
                    prompt_tokens: job.prompt.len(),
                    cached_tokens: 0,
                    completion_tokens: 0,
                    ttft: 0.0,
                    decode_tok_s: 0.0,
                    error: Some(e.to_string()),
                };
                let _ = job.events.send(Event::Done(finish));
            }
        }
    }

    /// One forward pass for every running sequence, then their tokens out
    /// and the finished ones retired.
    fn step(&mut self) {
        let mut seqs: Vec<(&mut Context, &mut Decoding)> =
            self.running.iter_mut().map(|r| (&mut r.ctx, &mut r.decoding)).collect();
        let result = advance(&self.model, &mut self.scratch, self.limits.prefill_chunk, &mut seqs);
        drop(seqs);
        if let Err(e) = result {
            // An engine error ends every running sequence with it.
            for r in std::mem::take(&mut self.running) {
                self.used -= r.reserved;
                let finish = r.finish(None, Some(e.to_string()));
                let _ = r.job.events.send(Event::Done(finish));
            }
            return;
        }
        let now = Instant::now();
        for r in &mut self.running {
            if let Some(token) = r.decoding.take_token() {
                if r.first_token.is_none() {
                    r.first_token = Some(now);
                    self.metrics.ttft.observe(now.duration_since(r.job.arrived).as_secs_f64());
                } else if let Some(last) = r.last_token {
                    self.metrics.inter_token.observe(now.duration_since(last).as_secs_f64());
                }
                r.last_token = Some(now);
                r.generated += 1;
                self.metrics.generated_tokens.inc();
                if r.job.events.send(Event::Token(token)).is_err() {
                    // Nobody reads any more: stop before the next pass.
                    r.decoding.cancel_token().cancel();
                }
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            if !self.running[i].decoding.is_done() {
                i += 1;
                continue;
            }
            let r = self.running.swap_remove(i);
            self.used -= r.reserved;
            let stop = r.decoding.stats().stop;
            if stop == Some(StopReason::Cancelled) {
                self.metrics.cancelled.inc();
            }
            let finish = r.finish(stop, None);
            let _ = r.job.events.send(Event::Done(finish));
            self.keep(r.ctx);
        }
    }

    /// Keeps a finished context for its prefix, dropping kept contexts it
    /// extends (it holds all they hold) and, if the budget is short, the
    /// least recently used.
    fn keep(&mut self, ctx: Context) {
        let n = ctx.tokens().len();
        if n == 0 || n > self.limits.kv_budget {
            return;
        }
        let mut i = 0;
        while i < self.kept.len() {
            let t = self.kept[i].ctx.tokens();
            if t.len() <= n && ctx.tokens()[..t.len()] == *t {
                let k = self.kept.swap_remove(i);
                self.used -= k.ctx.tokens().len();
            } else {
                i += 1;
            }
        }
        while self.used + n > self.limits.kv_budget {
            if !self.evict_one(None) {
                return;
            }
        }
        self.clock += 1;
        self.used += n;
        self.kept.push(Kept { ctx, last_used: self.clock });
    }

    fn publish(&self) {
        self.running_count.store(self.running.len(), Ordering::SeqCst);
        let m = &self.metrics;
        m.running.set(self.running.len() as i64);
        m.queued.set(self.queued.load(Ordering::SeqCst) as i64);
        m.kv_tokens_used.set(self.used as i64);
        m.kept_sequences.set(self.kept.len() as i64);
    }
}

impl Running {
    fn finish(&self, stop: Option<StopReason>, error: Option<String>) -> Finish {
        let ttft = self.first_token.map_or(0.0, |t| t.duration_since(self.job.arrived).as_secs_f64());
        let decode_tok_s = match (self.first_token, self.last_token) {
            (Some(a), Some(b)) if self.generated > 1 && b > a => (self.generated - 1) as f64 / (b - a).as_secs_f64(),
            _ => 0.0,
        };
        Finish {
            stop,
            prompt_tokens: self.job.prompt.len(),
            cached_tokens: self.cached,
            completion_tokens: self.generated,
            ttft,
            decode_tok_s,
            error,
        }
    }
}

/// Length of the longest common prefix.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefix_counts_equal_leading_ids() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 3]), 2);
    }
}
