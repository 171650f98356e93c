//! The sampling chain: penalties -> (greedy | temperature -> top-k -> top-p ->
//! min-p -> draw). See the crate docs for the semantics of each step.

use std::cmp::Ordering;

use crate::{argmax, Rng, SamplerConfig, SamplerError};

/// One surviving candidate: `(token id, value)`. The value is a logit until
/// the temperature step, and an unnormalised softmax weight after it.
type Cand = (u32, f32);

/// When top-p runs without top-k, the candidates are sorted lazily: first the
/// best `NUCLEUS_CHUNK` (found by partial selection), then 4x more, and so
/// on. A typical nucleus is far smaller than the 151,936-entry vocab, so this
/// usually avoids the full sort.
const NUCLEUS_CHUNK: usize = 1024;

/// Descending by value, ties broken by ascending id: a total order, so every
/// selection / sort below is deterministic. `total_cmp` is a cheap integer
/// comparison; it would order NaN and -0.0 specially, but gathering drops NaN
/// and turns -0.0 into +0.0, so here it is plain numeric order.
fn by_value_desc(a: &Cand, b: &Cand) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Token sampler: a validated [`SamplerConfig`], its seeded [`Rng`], and
/// scratch buffers reused across calls (no allocation per token once they
/// have grown to the vocab size).
#[derive(Clone, Debug)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    /// Surviving candidates, (n_survivors <= vocab,).
    cands: Vec<Cand>,
    /// The penalty window of the history, sorted, (<= penalty_last_n,).
    window: Vec<u32>,
}

impl Sampler {
    /// Validates `cfg` and seeds the RNG with `cfg.seed`.
    pub fn new(cfg: SamplerConfig) -> Result<Self, SamplerError> {
        cfg.validate()?;
        Ok(Sampler { rng: Rng::new(cfg.seed), cfg, cands: Vec::new(), window: Vec::new() })
    }

    /// The configuration this sampler was built with.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Restarts the RNG stream from `seed` (e.g. before a new, reproducible
    /// generation). The config's `seed` field is updated to match.
    pub fn reseed(&mut self, seed: u64) {
        self.cfg.seed = seed;
        self.rng = Rng::new(seed);
    }

    /// Picks the next token id.
    ///
    /// * `logits`: (vocab,) raw model output for the next position. It is
    ///   scratch: the penalties are applied to it in place, so its contents
    ///   afterwards are unspecified.
    /// * `history`: ids seen so far (prompt + generated); the penalties use
    ///   its last `penalty_last_n` entries. Ids `>= vocab` are ignored.
    ///
    /// Non-greedy samplers consume exactly one RNG draw per call, whatever the
    /// logits, so a seeded run is reproducible call by call. Greedy samplers
    /// never touch the RNG. If no logit is usable (all NaN or -inf), this
    /// falls back to [`argmax`] of the penalized logits.
    ///
    /// # Panics
    /// If `logits` is empty.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        assert!(!logits.is_empty(), "Sampler::sample: empty logits");
        self.apply_penalties(logits, history);
        if self.cfg.is_greedy() {
            // Fast path: no gathering, no sort, no RNG.
            return argmax(logits);
        }
        let u = self.rng.next_f64();
        if !self.filter(logits) {
            return argmax(logits);
        }
        draw(&self.cands, u)
    }

    /// For tests and inspection: runs the chain like [`sample`](Self::sample)
    /// (including the in-place penalties on `logits`) but, instead of
    /// drawing, returns every surviving candidate with its final
    /// probability, sorted by descending probability (ties by ascending id).
    /// The probabilities sum to 1. Does not touch the RNG. A greedy sampler
    /// returns just `[(argmax, 1.0)]`.
    ///
    /// # Panics
    /// If `logits` is empty.
    pub fn candidates(&mut self, logits: &mut [f32], history: &[u32]) -> Vec<(u32, f32)> {
        assert!(!logits.is_empty(), "Sampler::candidates: empty logits");
        self.apply_penalties(logits, history);
        if self.cfg.is_greedy() || !self.filter(logits) {
            return vec![(argmax(logits), 1.0)];
        }
        let total: f64 = self.cands.iter().map(|c| c.1 as f64).sum();
        let mut out: Vec<(u32, f32)> = self.cands.iter().map(|&(id, w)| (id, (w as f64 / total) as f32)).collect();
        out.sort_by(by_value_desc);
        out
    }

    /// Step 1, in place on `logits` (vocab,): the repetition, presence and
    /// frequency penalties over the last `penalty_last_n` ids of `history`.
    /// For each distinct id seen `count > 0` times in that window:
    ///
    /// ```text
    /// l = if l > 0 { l / repetition_penalty } else { l * repetition_penalty }
    /// l = l - (count * frequency_penalty + presence_penalty)
    /// ```
    ///
    /// Every other logit is left untouched (bit for bit). Ids `>= vocab`
    /// are ignored. This is what [`sample`](Self::sample) does first; it is
    /// public so callers can inspect penalized logits.
    pub fn apply_penalties(&mut self, logits: &mut [f32], history: &[u32]) {
        let cfg = &self.cfg;
        if !cfg.has_penalties() {
            return;
        }
        let start = history.len().saturating_sub(cfg.penalty_last_n);
        // Sort a copy of the window so equal ids are adjacent: each run is one
        // distinct id and its length is the count. Sorting <= penalty_last_n
        // ids is cheap and needs no vocab-sized count table.
        self.window.clear();
        self.window.extend_from_slice(&history[start..]);
        self.window.sort_unstable();
        let (rep, pres, freq) = (cfg.repetition_penalty, cfg.presence_penalty, cfg.frequency_penalty);
        for run in self.window.chunk_by(|a, b| a == b) {
            let Some(l) = logits.get_mut(run[0] as usize) else {
                continue; // id outside the vocab
            };
            if rep != 1.0 {
                *l = if *l > 0.0 { *l / rep } else { *l * rep };
            }
            if pres != 0.0 || freq != 0.0 {
                *l -= run.len() as f32 * freq + pres;
            }
        }
    }

    /// Steps 3..6: fills `self.cands` with the survivors of temperature,
    /// top-k, top-p and min-p, each holding its unnormalised softmax weight
    /// `exp((l - l_max) / T)` (the best survivor has weight exactly 1).
    /// Returns false when no logit is usable (all NaN / -inf).
    fn filter(&mut self, logits: &[f32]) -> bool {
        let cfg = &self.cfg;
        let cands = &mut self.cands;
        // Top-k in one pass when it applies: the k best usable logits,
        // best first. Otherwise (no top-k, or a +inf logit) gather all.
        let k = cfg.top_k;
        if !(k > 0 && top_k_of(logits, k, cands)) {
            gather_top_k_by_selection(logits, k, cands);
        }
        if cands.is_empty() {
            return false;
        }

        // Temperature + softmax numerator: w = exp((l - l_max) / T), in (0, 1].
        // Subtracting l_max first means nothing overflows even for tiny T.
        let l_max = cands.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.1));
        let t = cfg.temperature;
        for c in cands.iter_mut() {
            c.1 = ((c.1 - l_max) / t).exp();
        }

        // Top-p: the smallest prefix (by descending probability) whose mass
        // reaches top_p of the total. Sums are in f64 for accuracy.
        if cfg.top_p < 1.0 {
            let total: f64 = cands.iter().map(|c| c.1 as f64).sum();
            let keep = nucleus_len(cands, cfg.top_p as f64 * total);
            cands.truncate(keep);
        }

        // Min-p: keep p_i >= min_p * p_max. Normalisation cancels in the
        // ratio, and the best candidate always survives top-k and top-p with
        // weight exactly 1, so the test is simply w_i >= min_p.
        if cfg.min_p > 0.0 {
            let min_p = cfg.min_p;
            cands.retain(|c| c.1 >= min_p);
        }
        true
    }
}

/// The general gathering: every usable logit (NaN and -inf have zero
/// probability; if some are +inf, those alone, made finite and equal), then
/// with `k > 0` the k best (by value desc, id asc) by partial selection, in
/// O(n). The reference twin of [`top_k_of`].
fn gather_top_k_by_selection(logits: &[f32], k: usize, cands: &mut Vec<Cand>) {
    cands.clear();
    let mut has_pos_inf = false;
    for (id, &l) in logits.iter().enumerate() {
        if l.is_nan() || l == f32::NEG_INFINITY {
            continue;
        }
        has_pos_inf |= l == f32::INFINITY;
        cands.push((id as u32, l + 0.0)); // + 0.0 maps -0.0 to +0.0
    }
    if has_pos_inf {
        // +inf dominates everything: the +inf tokens share the mass
        // equally. Make them finite and equal so the maths below works.
        cands.retain(|c| c.1 == f32::INFINITY);
        cands.iter_mut().for_each(|c| c.1 = 0.0);
    }
    // Temperature is conceptually first (HF order). Dividing by T > 0 keeps
    // the order of the logits, so top-k can run on the raw logits; T is
    // folded into the softmax weights after, before top-p and min-p, which
    // do depend on it.
    if k > 0 && k < cands.len() {
        cands.select_nth_unstable_by(k - 1, by_value_desc);
        cands.truncate(k);
    }
}

/// Top-k in one pass over the logits: the `k` best usable ones (by value
/// desc, id asc), sorted best first, into `out`. A logit enters only if it
/// beats the worst of those kept so far, which after the first few
/// thousand is rare, so the pass is one comparison per logit instead of
/// gathering all 151,936 candidates and selecting among them (about 1 ms a
/// token, per sequence). Returns false, leaving `out` unspecified, when a
/// logit is +inf: [`gather_top_k_by_selection`] handles that case.
fn top_k_of(logits: &[f32], k: usize, out: &mut Vec<Cand>) -> bool {
    out.clear();
    let worst_of = |out: &[Cand]| (0..out.len()).max_by(|&a, &b| by_value_desc(&out[a], &out[b])).unwrap_or(0);
    let mut worst = 0;
    for (id, &l) in logits.iter().enumerate() {
        if l.is_nan() || l == f32::NEG_INFINITY {
            continue;
        }
        if l == f32::INFINITY {
            return false;
        }
        let l = l + 0.0; // -0.0 as +0.0
        if out.len() < k {
            out.push((id as u32, l));
            if out.len() == k {
                worst = worst_of(out);
            }
        } else if l > out[worst].1 {
            // Strictly better: an equal logit has a larger id (ids come in
            // order), which loses the tie.
            out[worst] = (id as u32, l);
            worst = worst_of(out);
        }
    }
    out.sort_unstable_by(by_value_desc);
    true
}

/// Sorts `cands` by descending weight (at least a prefix of it) and returns
/// the length of the smallest prefix whose weight sum reaches `target`
/// (always >= 1; the whole slice if rounding keeps the sum short of target).
///
/// Invariant: `cands[..sorted]` is sorted and every element in it is >= every
/// element after it, so growing the sorted prefix chunk by chunk (partial
/// selection, then sorting just the chunk) yields the same order as a full
/// sort.
fn nucleus_len(cands: &mut [Cand], target: f64) -> usize {
    let n = cands.len();
    let mut sorted = 0;
    let mut chunk = NUCLEUS_CHUNK;
    let mut cum = 0.0f64;
    while sorted < n {
        let end = (sorted + chunk).min(n);
        let rest = &mut cands[sorted..];
        if end < n {
            rest.select_nth_unstable_by(end - sorted - 1, by_value_desc);
        }
        rest[..end - sorted].sort_unstable_by(by_value_desc);
        for (i, c) in cands[sorted..end].iter().enumerate() {
            cum += c.1 as f64;
            if cum >= target {
                return sorted + i + 1;
            }
        }
        sorted = end;
        chunk = chunk.saturating_mul(4);
    }
    n
}

/// Step 7: inverse-CDF draw over the unnormalised weights of `cands`
/// (non-empty, max weight 1) with `u` uniform in [0, 1). A zero weight is
/// never picked: its cumulative sum equals the previous one, which `r` was
/// already not below.
fn draw(cands: &[Cand], u: f64) -> u32 {
    let total: f64 = cands.iter().map(|c| c.1 as f64).sum();
    let r = u * total;
    let mut cum = 0.0f64;
    for &(id, w) in cands {
        cum += w as f64;
        if r < cum {
            return id;
        }
    }
    // Unreachable up to rounding (cum ends equal to total > r); fall back to
    // the last candidate with positive weight.
    cands.iter().rev().find(|c| c.1 > 0.0).map_or(cands[0].0, |c| c.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-pass top-k keeps the same candidates as gathering all and
    /// selecting, ties (by lower id), NaN, -inf and -0.0 included; it
    /// declines +inf, which the general path handles.
    #[test]
    fn one_pass_top_k_matches_selection() {
        let mut state = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..400 {
            let n = 1 + (next() % 300) as usize;
            // Few distinct values, so ties are common.
            let levels = 1 + (next() % 12);
            let logits: Vec<f32> = (0..n)
                .map(|_| match next() % 20 {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 => -0.0,
                    _ => (next() % levels) as f32 * 0.5 - 2.0,
                })
                .collect();
            for k in [1, 2, 3, 7, 20, n.saturating_sub(1).max(1), n, n + 5] {
                let (mut fast, mut reference) = (Vec::new(), Vec::new());
                assert!(top_k_of(&logits, k, &mut fast));
                gather_top_k_by_selection(&logits, k, &mut reference);
                reference.sort_by(by_value_desc);
                let bits = |v: &[Cand]| v.iter().map(|c| (c.0, c.1.to_bits())).collect::<Vec<_>>();
                assert_eq!(bits(&fast), bits(&reference), "round {round}, k {k}, logits {logits:?}");
            }
        }
        let mut out = Vec::new();
        assert!(!top_k_of(&[0.0, f32::INFINITY, 1.0], 2, &mut out));
    }

    #[test]
    fn greedy_never_touches_the_rng() {
        let mut s = Sampler::new(SamplerConfig::greedy()).unwrap();
        let before = s.rng.clone();
        for _ in 0..10 {
            let mut logits = [0.5, 3.0, -1.0];
            assert_eq!(s.sample(&mut logits, &[1, 1]), 1);
        }
        assert_eq!(s.rng, before);
    }

    #[test]
    fn non_greedy_consumes_exactly_one_draw_per_call() {
        let mut s = Sampler::new(SamplerConfig { top_k: 1, ..Default::default() }).unwrap();
        let mut reference = Rng::new(0);
        for _ in 0..5 {
            let mut logits = [0.5, 3.0, -1.0];
            s.sample(&mut logits, &[]);
            reference.next_u64();
            assert_eq!(s.rng, reference);
        }
        // Even when nothing is usable (argmax fallback: NaN never wins).
        let mut logits = [f32::NAN, f32::NEG_INFINITY];
        assert_eq!(s.sample(&mut logits, &[]), 1);
        reference.next_u64();
        assert_eq!(s.rng, reference);
    }

    #[test]
    fn buffers_are_reused_across_calls() {
        let mut s = Sampler::new(SamplerConfig { top_p: 0.9, repetition_penalty: 1.3, ..Default::default() }).unwrap();
        let mut rng = Rng::new(5);
        let vocab = 5000;
        let history: Vec<u32> = (0..100).map(|i| i * 7 % 5000).collect();
        let mut logits: Vec<f32> = (0..vocab).map(|_| rng.next_f32() * 4.0).collect();
        s.sample(&mut logits, &history);
        let ptrs = (s.cands.as_ptr(), s.window.as_ptr());
        for _ in 0..20 {
            let mut logits: Vec<f32> = (0..vocab).map(|_| rng.next_f32() * 4.0).collect();
            s.sample(&mut logits, &history);
            assert_eq!((s.cands.as_ptr(), s.window.as_ptr()), ptrs);
        }
    }

    #[test]
    fn nucleus_len_matches_full_sort_across_chunks() {
        // Enough candidates and a flat enough distribution that the nucleus
        // spans several chunks.
        let mut rng = Rng::new(9);
        for &n in &[1usize, 10, 1023, 1024, 1025, 7000] {
            let base: Vec<Cand> = (0..n as u32).map(|i| (i, rng.next_f32())).collect();
            let total: f64 = base.iter().map(|c| c.1 as f64).sum();
            for &p in &[0.01, 0.3, 0.9, 0.999] {
                let mut a = base.clone();
                let keep = nucleus_len(&mut a, p * total);
                let mut b = base.clone();
                b.sort_unstable_by(by_value_desc);
                assert_eq!(&a[..keep], &b[..keep], "n={n} p={p}");
                let mut cum = 0.0f64;
                let want = b
                    .iter()
                    .position(|c| {
                        cum += c.1 as f64;
                        cum >= p * total
                    })
                    .map_or(n, |i| i + 1);
                assert_eq!(keep, want, "n={n} p={p}");
            }
        }
    }

    #[test]
    fn draw_skips_zero_weights() {
        let cands = [(0, 0.0), (1, 1.0), (2, 0.0), (3, 0.5), (4, 0.0)];
        for i in 0..1000 {
            let u = i as f64 / 1000.0;
            let id = draw(&cands, u);
            assert!(id == 1 || id == 3, "u={u} id={id}");
        }
        // Just below 1 still lands on a positive weight.
        assert_eq!(draw(&cands, 1.0 - f64::EPSILON), 3);
    }
}
