//! Measurements for `ember bench`: prompt processing and generation speed,
//! timed around the forward passes only (no tokenizer, no sampler), and the
//! memory read bandwidth of the machine over the model's own weights.

use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::qwen2::{BatchToken, PhaseTimes, Qwen2, Scratch};
use std::time::{Duration, Instant};

/// Deterministic token ids spread over the vocabulary (what they are does
/// not change the work of a forward pass).
pub fn bench_tokens(model: &Qwen2, n: usize) -> Vec<u32> {
    let vocab = model.config.vocab_size as u64;
    (0..n as u64).map(|i| ((i * 2_654_435_761 + 12_345) % vocab) as u32).collect()
}

/// Time to process an `n`-token prompt from an empty cache in blocks of
/// `chunk` tokens, as a session prefills, with logits for the last position
/// only: the time to first token, less one sampling step.
pub fn prompt_processing(model: &Qwen2, n: usize, chunk: usize) -> Result<Duration> {
    let tokens = bench_tokens(model, n);
    let mut state = model.new_state(n.max(1));
    let blocks = tokens.chunks(chunk.max(1));
    let last = blocks.len();
    let start = Instant::now();
    for (i, block) in blocks.enumerate() {
        state.run(model, block, i + 1 == last)?;
    }
    Ok(start.elapsed())
}

/// Time to generate `n` tokens one at a time from an empty cache, computing
/// the full logits at every step (as decoding does).
pub fn generation(model: &Qwen2, n: usize) -> Result<Duration> {
    decode(model, n, false).map(|(d, _)| d)
}

/// [`generation`] with its forward passes timed phase by phase
/// ([`crate::qwen2::Phase`]): where a decoded token's time goes.
pub fn generation_phases(model: &Qwen2, n: usize) -> Result<PhaseTimes> {
    decode(model, n, true).map(|(_, times)| times.unwrap_or_default())
}

/// `n` tokens decoded one at a time from an empty cache: the time, and the
/// phases' times when `phases`.
fn decode(model: &Qwen2, n: usize, phases: bool) -> Result<(Duration, Option<PhaseTimes>)> {
    let tokens = bench_tokens(model, n);
    let mut state = model.new_state(n.max(1));
    state.time_phases(phases);
    let start = Instant::now();
    for &t in &tokens {
        state.run(model, &[t], true)?;
    }
    Ok((start.elapsed(), state.phase_times().cloned()))
}

/// Time for `sequences` sequences to decode `n` tokens each together, each
/// after its own `prompt`-token prompt (processed first, not timed): one
/// forward pass per step with one token of every sequence, logits for all,
/// as a server batching its users does. Aggregate rate: `sequences · n /
/// time`.
pub fn multi_sequence_generation(model: &Qwen2, sequences: usize, prompt: usize, n: usize) -> Result<Duration> {
    multi_sequence(model, sequences, prompt, n, false).map(|(d, _)| d)
}

/// [`multi_sequence_generation`] with its steps timed phase by phase
/// ([`crate::qwen2::Phase`]): where a step of several sequences' time goes.
/// The times cover the decoding steps only (`passes` is `n`, `tokens`
/// `sequences · n`), not the prompts before them.
pub fn multi_sequence_generation_phases(
    model: &Qwen2,
    sequences: usize,
    prompt: usize,
    n: usize,
) -> Result<PhaseTimes> {
    multi_sequence(model, sequences, prompt, n, true).map(|(_, times)| times.unwrap_or_default())
}

/// `sequences` sequences decoding `n` tokens together after their prompts:
/// the steps' time, and their phases' times when `phases`.
fn multi_sequence(
    model: &Qwen2,
    sequences: usize,
    prompt: usize,
    n: usize,
    phases: bool,
) -> Result<(Duration, Option<PhaseTimes>)> {
    let tokens = bench_tokens(model, sequences * (prompt + n) + sequences);
    let mut caches: Vec<KvCache> = (0..sequences).map(|_| model.new_cache(prompt + n)).collect();
    let mut scratch = Scratch::default();
    for (s, cache) in caches.iter_mut().enumerate() {
        // Each sequence its own prompt, so no two caches are alike.
        let ids = &tokens[s * (prompt + n) + s..][..prompt];
        let batch: Vec<BatchToken> =
            ids.iter().enumerate().map(|(pos, &token)| BatchToken { token, seq: 0, pos, logits: false }).collect();
        if !batch.is_empty() {
            model.forward(&batch, &mut [cache], &mut scratch)?;
        }
    }
    let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
    let mut batch: Vec<BatchToken> =
        (0..sequences).map(|seq| BatchToken { token: 0, seq, pos: prompt, logits: true }).collect();
    scratch.time_phases(phases);
    let start = Instant::now();
    for step in 0..n {
        for b in &mut batch {
            b.token = tokens[b.seq * (prompt + n) + b.seq + prompt + step];
            b.pos = prompt + step;
        }
        model.forward(&batch, &mut refs, &mut scratch)?;
    }
    Ok((start.elapsed(), scratch.phase_times().cloned()))
}

/// The weights a decoded token streams, one group per parallel section of
/// its forward pass, in the order it reads them: each layer's q/k/v, o,
/// gate/up and down, then the LM head.
fn sections(model: &Qwen2) -> Vec<Vec<&[u8]>> {
    let mut groups = Vec::with_capacity(4 * model.layers.len() + 1);
    for l in &model.layers {
        let [q, k, v, o, gate, up, down] = l.matrices().map(|p| p.weight.as_bytes());
        groups.extend([vec![q, k, v], vec![o], vec![gate, up], vec![down]]);
    }
    groups.push(vec![model.lm_head.as_bytes()]);
    groups
}

/// Reads every weight of the model once with the global pool, as fast as the
/// memory allows, and returns (bytes read, time). This is the ceiling a
/// decoder streaming the same bytes can approach.
pub fn weight_read(model: &Qwen2) -> (usize, Duration) {
    let slices: Vec<&[u8]> = sections(model).concat();
    let bytes = slices.iter().map(|s| s.len()).sum();
    let start = Instant::now();
    let sum = ember_kernels::bandwidth::read_all(ember_kernels::pool::global(), &slices);
    let elapsed = start.elapsed();
    std::hint::black_box(sum);
    (bytes, elapsed)
}

/// [`weight_read`] one section at a time: the same bytes read by one
/// parallel read per section of a decoded token's forward pass (each
/// layer's q/k/v, o, gate/up, down; the LM head), each started once the one
/// before has ended, as the decoder's products are. What the memory gives a
/// stream cut into those sections, with no arithmetic and nothing serial
/// between them: how much of the one-pass ceiling the sections themselves
/// cost (each a start and an end for every thread).
pub fn weight_read_by_section(model: &Qwen2) -> (usize, Duration) {
    let groups = sections(model);
    let bytes = groups.iter().flatten().map(|s| s.len()).sum();
    let pool = ember_kernels::pool::global();
    let start = Instant::now();
    let mut sum = 0u64;
    for g in &groups {
        sum = sum.wrapping_add(ember_kernels::bandwidth::read_all(pool, g));
    }
    let elapsed = start.elapsed();
    std::hint::black_box(sum);
    (bytes, elapsed)
}
