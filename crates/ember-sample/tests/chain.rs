//! Property-style tests of the sampling chain over many seeded random logit
//! vectors, checked against straightforward f64 reference implementations.

use ember_sample::{argmax, Rng, Sampler, SamplerConfig, SamplerError};

// ---------------------------------------------------------------- helpers

/// (n,) logits uniform in [-scale, scale).
fn random_logits(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.next_f32() * 2.0 - 1.0) * scale).collect()
}

/// Uniform integer in [lo, hi).
fn range(rng: &mut Rng, lo: usize, hi: usize) -> usize {
    lo + (rng.next_u64() % (hi - lo) as u64) as usize
}

/// Uniform f32 in [lo, hi).
fn uniform(rng: &mut Rng, lo: f32, hi: f32) -> f32 {
    lo + rng.next_f32() * (hi - lo)
}

/// Reference softmax of `logits[ids] / t` in f64, (ids.len(),).
fn softmax(logits: &[f32], ids: &[usize], t: f64) -> Vec<f64> {
    let max = ids.iter().map(|&i| logits[i] as f64).fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = ids.iter().map(|&i| ((logits[i] as f64 - max) / t).exp()).collect();
    let z: f64 = w.iter().sum();
    w.iter().map(|x| x / z).collect()
}

/// Ids sorted by descending logit, ties by ascending id.
fn order_desc(logits: &[f32], ids: &[usize]) -> Vec<usize> {
    let mut v = ids.to_vec();
    v.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap().then(a.cmp(&b)));
    v
}

fn ids_of(c: &[(u32, f32)]) -> Vec<usize> {
    let mut v: Vec<usize> = c.iter().map(|&(i, _)| i as usize).collect();
    v.sort_unstable();
    v
}

fn sampler(cfg: SamplerConfig) -> Sampler {
    Sampler::new(cfg).expect("valid config")
}

/// Checks that `cands` are probabilities summing to 1 and proportional to
/// softmax(logits / t) restricted to the candidate set.
fn assert_renormalised(cands: &[(u32, f32)], logits: &[f32], t: f64) {
    let ids: Vec<usize> = cands.iter().map(|&(i, _)| i as usize).collect();
    let want = softmax(logits, &ids, t);
    let sum: f64 = cands.iter().map(|&(_, p)| p as f64).sum();
    assert!((sum - 1.0).abs() < 1e-4, "sum {sum}");
    for (&(id, p), w) in cands.iter().zip(&want) {
        assert!((p as f64 - w).abs() < 1e-4, "id {id}: {p} vs {w}");
    }
}

// ---------------------------------------------------------------- argmax / greedy

#[test]
fn argmax_first_max_and_nan_never_wins() {
    assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    assert_eq!(argmax(&[f32::NAN, 1.0, f32::NAN, 5.0, f32::NAN]), 3);
    assert_eq!(argmax(&[f32::NAN, -1.0]), 1);
    assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
    assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY, -1e30]), 2);
    assert_eq!(argmax(&[0.0, f32::INFINITY, f32::INFINITY]), 1);
    assert_eq!(argmax(&[-0.0, 0.0]), 0); // -0 == 0: first wins
}

#[test]
fn greedy_equals_argmax() {
    let mut rng = Rng::new(1);
    let mut s = sampler(SamplerConfig::greedy());
    for _ in 0..500 {
        let n = range(&mut rng, 1, 300);
        let mut logits = random_logits(&mut rng, n, 10.0);
        // Sprinkle NaN and -inf.
        for _ in 0..range(&mut rng, 0, 4) {
            let i = range(&mut rng, 0, n);
            logits[i] = if rng.next_f32() < 0.5 { f32::NAN } else { f32::NEG_INFINITY };
        }
        let want = argmax(&logits);
        assert_eq!(s.sample(&mut logits.clone(), &[]), want);
        // top_k = 1 with sampling on is greedy too.
        let mut k1 = sampler(SamplerConfig { top_k: 1, temperature: 1.5, seed: rng.next_u64(), ..Default::default() });
        assert_eq!(k1.sample(&mut logits.clone(), &[]), want);
    }
}

#[test]
fn greedy_uses_penalized_logits() {
    // Token 0 wins raw, but is penalized below token 1.
    let cfg = SamplerConfig { repetition_penalty: 2.0, ..SamplerConfig::greedy() };
    let mut s = sampler(cfg);
    assert_eq!(s.sample(&mut [3.0, 2.0, 0.0], &[]), 0);
    assert_eq!(s.sample(&mut [3.0, 2.0, 0.0], &[0]), 1);
}

// ---------------------------------------------------------------- top-k

#[test]
fn top_k_keeps_exactly_the_k_largest() {
    let mut rng = Rng::new(2);
    for _ in 0..300 {
        let n = range(&mut rng, 1, 400);
        let k = range(&mut rng, 1, n + 5);
        let t = uniform(&mut rng, 0.2, 3.0);
        let logits = random_logits(&mut rng, n, 8.0);
        let mut s = sampler(SamplerConfig { top_k: k, temperature: t, ..Default::default() });
        let c = s.candidates(&mut logits.clone(), &[]);
        assert_eq!(c.len(), k.min(n), "n={n} k={k}");
        let all: Vec<usize> = (0..n).collect();
        let mut want = order_desc(&logits, &all)[..k.min(n)].to_vec();
        want.sort_unstable();
        assert_eq!(ids_of(&c), want);
        assert_renormalised(&c, &logits, t as f64);
    }
}

#[test]
fn top_k_draws_stay_in_the_set_and_cover_it() {
    let mut rng = Rng::new(3);
    for round in 0..20 {
        let logits = random_logits(&mut rng, 50, 2.0);
        let k = 3;
        let all: Vec<usize> = (0..50).collect();
        let top: Vec<usize> = order_desc(&logits, &all)[..k].to_vec();
        let mut s = sampler(SamplerConfig { top_k: k, temperature: 2.0, seed: round, ..Default::default() });
        let mut seen = [false; 50];
        for _ in 0..2000 {
            let id = s.sample(&mut logits.clone(), &[]) as usize;
            assert!(top.contains(&id), "drew {id} outside top-{k} {top:?}");
            seen[id] = true;
        }
        assert!(top.iter().all(|&i| seen[i]), "not all of {top:?} drawn");
    }
}

#[test]
fn ties_are_broken_by_lowest_id() {
    let logits = [1.0f32; 6];
    let mut s = sampler(SamplerConfig { top_k: 2, ..Default::default() });
    assert_eq!(ids_of(&s.candidates(&mut logits.clone(), &[])), [0, 1]);
    let mut s = sampler(SamplerConfig { top_p: 0.5, ..Default::default() });
    // Six equal tokens of 1/6: three reach 0.5.
    assert_eq!(ids_of(&s.candidates(&mut logits.clone(), &[])), [0, 1, 2]);
    let mut s = sampler(SamplerConfig { top_k: 3, top_p: 0.4, ..Default::default() });
    let logits = [0.0, 2.0, 2.0, 2.0, 2.0];
    assert_eq!(ids_of(&s.candidates(&mut logits.clone(), &[])), [1, 2]);
    // -0.0 and +0.0 are equal logits: the lower id wins the tie.
    let mut s = sampler(SamplerConfig { top_k: 1, ..Default::default() });
    assert_eq!(ids_of(&s.candidates(&mut [-1.0, -0.0, 0.0], &[])), [1]);
    assert_eq!(ids_of(&s.candidates(&mut [-1.0, 0.0, -0.0], &[])), [1]);
}

// ---------------------------------------------------------------- top-p

/// Reference nucleus over `ids` at temperature `t`: returns (kept ids in
/// descending order, cumulative masses in that order).
fn reference_nucleus(logits: &[f32], ids: &[usize], t: f64, p: f64) -> (Vec<usize>, Vec<f64>) {
    let order = order_desc(logits, ids);
    let probs = softmax(logits, &order, t);
    let mut cum = Vec::with_capacity(order.len());
    let mut acc = 0.0;
    for q in &probs {
        acc += q;
        cum.push(acc);
    }
    let keep = cum.iter().position(|&c| c >= p).map_or(order.len(), |i| i + 1);
    (order[..keep].to_vec(), cum)
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_p() {
    let mut rng = Rng::new(4);
    let mut checked_exact = 0;
    for case in 0..300 {
        // Some vocabularies large and flat enough that the nucleus spans
        // several of the sampler's lazy-sort chunks.
        let (n, scale) = if case % 10 == 0 {
            (range(&mut rng, 2000, 6000), 1.0)
        } else {
            (range(&mut rng, 1, 300), uniform(&mut rng, 0.5, 10.0))
        };
        let p = uniform(&mut rng, 0.02, 1.0);
        let t = uniform(&mut rng, 0.3, 2.0);
        let logits = random_logits(&mut rng, n, scale);
        let mut s = sampler(SamplerConfig { top_p: p, temperature: t, ..Default::default() });
        let c = s.candidates(&mut logits.clone(), &[]);
        assert!(!c.is_empty());
        assert_renormalised(&c, &logits, t as f64);

        let all: Vec<usize> = (0..n).collect();
        let probs = softmax(&logits, &all, t as f64);
        let kept = ids_of(&c);
        let mut in_set = vec![false; n];
        kept.iter().for_each(|&i| in_set[i] = true);
        // The kept set holds the most likely tokens...
        let min_kept = kept.iter().map(|&i| probs[i]).fold(1.0, f64::min);
        let max_dropped = (0..n).filter(|&i| !in_set[i]).map(|i| probs[i]).fold(0.0, f64::max);
        assert!(min_kept >= max_dropped - 1e-9, "case {case}");
        // ...reaches p, and is minimal: without its least likely member it
        // would fall short of p.
        let mass: f64 = kept.iter().map(|&i| probs[i]).sum();
        assert!(mass >= p as f64 - 1e-4, "case {case}: mass {mass} < p {p}");
        assert!(mass - min_kept < p as f64 + 1e-4, "case {case}: not minimal, mass {mass} min {min_kept} p {p}");
        // Exact size against the reference unless p sits on a rounding edge.
        let (want, cum) = reference_nucleus(&logits, &all, t as f64, p as f64);
        let edge = |i: usize| cum.get(i).is_some_and(|&c| (c - p as f64).abs() < 1e-5);
        if !edge(want.len() - 1) && (want.len() < 2 || !edge(want.len() - 2)) {
            assert_eq!(kept.len(), want.len(), "case {case}");
            checked_exact += 1;
        }
    }
    assert!(checked_exact > 250);
}

#[test]
fn temperature_is_applied_before_top_p_like_hf() {
    // softmax([2,1,0])      = [0.665, 0.245, 0.090] -> top_p 0.6 keeps 1
    // softmax([2,1,0] / 2)  = [0.506, 0.307, 0.186] -> top_p 0.6 keeps 2
    let logits = [2.0, 1.0, 0.0];
    let mut t1 = sampler(SamplerConfig { top_p: 0.6, temperature: 1.0, ..Default::default() });
    assert_eq!(ids_of(&t1.candidates(&mut logits.clone(), &[])), [0]);
    let mut t2 = sampler(SamplerConfig { top_p: 0.6, temperature: 2.0, ..Default::default() });
    assert_eq!(ids_of(&t2.candidates(&mut logits.clone(), &[])), [0, 1]);
    // Same for min-p: p1/p0 = exp(-1/T) is 0.37 at T=1 and 0.61 at T=2.
    let mut m = sampler(SamplerConfig { min_p: 0.5, temperature: 2.0, ..Default::default() });
    assert_eq!(ids_of(&m.candidates(&mut logits.clone(), &[])), [0, 1]);
    let mut m = sampler(SamplerConfig { min_p: 0.5, temperature: 1.0, ..Default::default() });
    assert_eq!(ids_of(&m.candidates(&mut logits.clone(), &[])), [0]);
}

// ---------------------------------------------------------------- min-p

#[test]
fn min_p_keeps_tokens_above_the_threshold() {
    let mut rng = Rng::new(5);
    for case in 0..300 {
        let n = range(&mut rng, 1, 300);
        let min_p = uniform(&mut rng, 0.001, 1.0);
        let t = uniform(&mut rng, 0.3, 2.0);
        let logits = random_logits(&mut rng, n, 6.0);
        let mut s = sampler(SamplerConfig { min_p, temperature: t, ..Default::default() });
        let c = s.candidates(&mut logits.clone(), &[]);
        assert_renormalised(&c, &logits, t as f64);
        let all: Vec<usize> = (0..n).collect();
        let probs = softmax(&logits, &all, t as f64);
        let pmax = probs.iter().cloned().fold(0.0, f64::max);
        let kept = ids_of(&c);
        for (i, &q) in probs.iter().enumerate() {
            let ratio = q / pmax;
            if (ratio - min_p as f64).abs() < 1e-5 {
                continue; // on the rounding edge
            }
            assert_eq!(
                kept.binary_search(&i).is_ok(),
                ratio >= min_p as f64,
                "case {case} id {i}: ratio {ratio} min_p {min_p}"
            );
        }
    }
}

// ---------------------------------------------------------------- full chain

#[test]
fn full_chain_matches_reference() {
    let mut rng = Rng::new(6);
    for case in 0..300 {
        let n = range(&mut rng, 1, 500);
        let cfg = SamplerConfig {
            temperature: uniform(&mut rng, 0.2, 2.0),
            top_k: range(&mut rng, 0, 60),
            top_p: uniform(&mut rng, 0.05, 1.0),
            min_p: if rng.next_f32() < 0.5 { 0.0 } else { uniform(&mut rng, 0.0, 0.5) },
            ..Default::default()
        };
        let logits = random_logits(&mut rng, n, 5.0);
        let t = cfg.temperature as f64;

        // Reference: top-k, then top-p over the renormalised survivors, then
        // min-p relative to the best survivor.
        let all: Vec<usize> = (0..n).collect();
        let mut ids = order_desc(&logits, &all);
        if cfg.top_k > 0 {
            ids.truncate(cfg.top_k);
        }
        let (nucleus, cum) = reference_nucleus(&logits, &ids, t, cfg.top_p as f64);
        let probs = softmax(&logits, &nucleus, t);
        let want: Vec<usize> =
            nucleus.iter().zip(&probs).filter(|&(_, &q)| q >= cfg.min_p as f64 * probs[0]).map(|(&i, _)| i).collect();
        let near = |x: f64, y: f64| (x - y).abs() < 1e-5;
        let on_edge = cum.iter().any(|&c| near(c, cfg.top_p as f64))
            || probs.iter().any(|&q| near(q / probs[0], cfg.min_p as f64));
        if on_edge {
            continue;
        }
        let mut s = sampler(cfg);
        let c = s.candidates(&mut logits.clone(), &[]);
        let mut want_sorted = want.clone();
        want_sorted.sort_unstable();
        assert_eq!(ids_of(&c), want_sorted, "case {case}");
        assert_renormalised(&c, &logits, t);
    }
}

// ---------------------------------------------------------------- penalties

/// Reference penalties, written from the spec independently of the crate.
fn reference_penalties(logits: &mut [f32], history: &[u32], cfg: &SamplerConfig) {
    if cfg.penalty_last_n == 0 {
        return;
    }
    let start = history.len().saturating_sub(cfg.penalty_last_n);
    let window = &history[start..];
    for (id, l) in logits.iter_mut().enumerate() {
        let count = window.iter().filter(|&&h| h as usize == id).count();
        if count == 0 {
            continue;
        }
        let r = cfg.repetition_penalty;
        let mut x = *l;
        x = if x > 0.0 { x / r } else { x * r };
        x -= count as f32 * cfg.frequency_penalty + cfg.presence_penalty;
        *l = x;
    }
}

#[test]
fn penalties_change_only_penalized_ids_exactly() {
    let mut rng = Rng::new(7);
    for case in 0..300 {
        let n = range(&mut rng, 1, 200);
        let cfg = SamplerConfig {
            repetition_penalty: uniform(&mut rng, 0.5, 2.0),
            presence_penalty: uniform(&mut rng, -1.0, 1.0),
            frequency_penalty: uniform(&mut rng, -1.0, 1.0),
            penalty_last_n: [0, 1, 5, 64, usize::MAX][range(&mut rng, 0, 5)],
            ..Default::default()
        };
        // Ids up to n + 20: some lie outside the vocab and must be ignored.
        let hist_len = range(&mut rng, 0, 150);
        let history: Vec<u32> = (0..hist_len).map(|_| range(&mut rng, 0, n + 20) as u32).collect();
        let logits = random_logits(&mut rng, n, 5.0);

        let mut got = logits.clone();
        sampler(cfg.clone()).apply_penalties(&mut got, &history);
        let mut want = logits.clone();
        reference_penalties(&mut want, &history, &cfg);

        let start = history.len().saturating_sub(cfg.penalty_last_n);
        for i in 0..n {
            assert_eq!(got[i].to_bits(), want[i].to_bits(), "case {case} id {i}");
            let in_window = history[start..].contains(&(i as u32));
            if !in_window {
                assert_eq!(got[i].to_bits(), logits[i].to_bits(), "case {case} id {i}");
            }
        }

        // The greedy pick after sample() is argmax of the penalized logits.
        let mut g = sampler(SamplerConfig { temperature: 0.0, ..cfg });
        assert_eq!(g.sample(&mut logits.clone(), &history), argmax(&want));
    }
}

#[test]
fn penalties_hand_example() {
    let cfg =
        SamplerConfig { repetition_penalty: 2.0, presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
    let mut s = sampler(cfg);
    let mut logits = [2.0, -2.0, 1.0, 0.5];
    s.apply_penalties(&mut logits, &[0, 1, 1, 99]);
    // id 0: 2/2 - (1*0.25 + 0.5) = 0.25; id 1: -2*2 - (2*0.25 + 0.5) = -5.
    assert_eq!(logits, [0.25, -5.0, 1.0, 0.5]);
}

#[test]
fn penalty_window_is_the_last_n_ids() {
    let cfg = SamplerConfig { repetition_penalty: 2.0, penalty_last_n: 2, ..Default::default() };
    let mut s = sampler(cfg);
    let mut logits = [4.0, 4.0, 4.0, 4.0];
    s.apply_penalties(&mut logits, &[0, 1, 2, 2]);
    assert_eq!(logits, [4.0, 4.0, 2.0, 4.0]); // only id 2 is in the window
    let mut s = sampler(SamplerConfig { repetition_penalty: 2.0, penalty_last_n: 0, ..Default::default() });
    let mut logits = [4.0, 4.0];
    s.apply_penalties(&mut logits, &[0, 1]);
    assert_eq!(logits, [4.0, 4.0]); // 0 = off
}

// ---------------------------------------------------------------- seeds

fn draws(seed: u64, count: usize) -> Vec<u32> {
    let mut rng = Rng::new(99);
    let logits = random_logits(&mut rng, 100, 1.0);
    let mut s = sampler(SamplerConfig { seed, top_p: 0.95, ..Default::default() });
    (0..count).map(|_| s.sample(&mut logits.clone(), &[])).collect()
}

#[test]
fn same_seed_same_draws_different_seeds_differ() {
    assert_eq!(draws(11, 200), draws(11, 200));
    assert_ne!(draws(11, 200), draws(12, 200));
    assert_ne!(draws(0, 200), draws(1, 200));
}

#[test]
fn reseed_restarts_the_stream() {
    let mut rng = Rng::new(99);
    let logits = random_logits(&mut rng, 100, 1.0);
    let mut s = sampler(SamplerConfig { seed: 5, ..Default::default() });
    let a: Vec<u32> = (0..50).map(|_| s.sample(&mut logits.clone(), &[])).collect();
    s.reseed(5);
    let b: Vec<u32> = (0..50).map(|_| s.sample(&mut logits.clone(), &[])).collect();
    assert_eq!(a, b);
    assert_eq!(s.config().seed, 5);
}

// ---------------------------------------------------------------- distribution

/// Pearson chi-square statistic of `counts` against probabilities `p`.
fn chi_square(counts: &[usize], p: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(p)
        .map(|(&c, &q)| {
            let e = q * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

fn frequencies(cfg: SamplerConfig, logits: &[f32], n: usize) -> Vec<usize> {
    let mut s = sampler(cfg);
    let mut counts = vec![0; logits.len()];
    for _ in 0..n {
        counts[s.sample(&mut logits.to_vec(), &[]) as usize] += 1;
    }
    counts
}

#[test]
fn frequencies_match_softmax() {
    let logits = [1.0f32, 2.0, 0.5, -1.0, 0.0];
    let all: Vec<usize> = (0..5).collect();
    let n = 100_000;
    // Chi-square with 4 degrees of freedom: P(X > 30) ~ 5e-6, while a wrong
    // distribution (e.g. temperature ignored) scores in the thousands.
    for (seed, t) in [(1u64, 1.0f32), (2, 0.5), (3, 2.0)] {
        let cfg = SamplerConfig { temperature: t, seed, ..Default::default() };
        let counts = frequencies(cfg, &logits, n);
        let p = softmax(&logits, &all, t as f64);
        let chi = chi_square(&counts, &p);
        assert!(chi < 30.0, "T={t}: chi2 {chi}, counts {counts:?}, p {p:?}");
    }
    // With top-k 3 the mass is renormalised over the three best (ids 1, 0, 2).
    let cfg = SamplerConfig { top_k: 3, temperature: 0.8, seed: 4, ..Default::default() };
    let counts = frequencies(cfg, &logits, n);
    assert_eq!((counts[3], counts[4]), (0, 0));
    let p = softmax(&logits, &[0, 1, 2], 0.8);
    let chi = chi_square(&[counts[0], counts[1], counts[2]], &p);
    assert!(chi < 25.0, "top-k: chi2 {chi}, counts {counts:?}");
}

// ---------------------------------------------------------------- special values

#[test]
fn nan_and_infinities() {
    // NaN and -inf are never drawn.
    let logits = [f32::NAN, 0.0, f32::NEG_INFINITY, 0.0, f32::NAN];
    let counts = frequencies(SamplerConfig::default(), &logits, 2000);
    assert_eq!((counts[0], counts[2], counts[4]), (0, 0, 0));
    assert!(counts[1] > 800 && counts[3] > 800, "{counts:?}");

    // +inf tokens share all the mass.
    let mut s = sampler(SamplerConfig::default());
    let c = s.candidates(&mut [0.0, f32::INFINITY, 1e30, f32::INFINITY], &[]);
    assert_eq!(c, [(1, 0.5), (3, 0.5)]);

    // Nothing usable: falls back to argmax, where NaN never wins.
    let mut s = sampler(SamplerConfig::default());
    assert_eq!(s.sample(&mut [f32::NAN, f32::NEG_INFINITY], &[]), 1);
    assert_eq!(s.sample(&mut [f32::NEG_INFINITY, f32::NAN], &[]), 0);
    assert_eq!(s.sample(&mut [f32::NAN, f32::NAN], &[]), 0);

    // A tiny temperature is argmax-like without overflowing.
    let mut s = sampler(SamplerConfig { temperature: 1e-30, ..Default::default() });
    for _ in 0..100 {
        assert_eq!(s.sample(&mut [1e30, 3e30, -1e30, 2e30], &[]), 1);
    }
}

// ---------------------------------------------------------------- config

#[test]
fn defaults_and_greedy() {
    let d = SamplerConfig::default();
    assert_eq!(
        d,
        SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
        }
    );
    assert!(!d.is_greedy());
    assert!(SamplerConfig::greedy().is_greedy());
    assert!(d.validate().is_ok());
    assert!(SamplerConfig::greedy().validate().is_ok());
}

#[test]
fn invalid_configs_are_rejected_naming_the_field() {
    let d = SamplerConfig::default;
    let cases: Vec<(SamplerConfig, &str)> = vec![
        (SamplerConfig { temperature: -0.1, ..d() }, "temperature"),
        (SamplerConfig { temperature: f32::NAN, ..d() }, "temperature"),
        (SamplerConfig { temperature: f32::INFINITY, ..d() }, "temperature"),
        (SamplerConfig { top_p: 0.0, ..d() }, "top_p"),
        (SamplerConfig { top_p: 1.01, ..d() }, "top_p"),
        (SamplerConfig { top_p: f32::NAN, ..d() }, "top_p"),
        (SamplerConfig { min_p: -0.1, ..d() }, "min_p"),
        (SamplerConfig { min_p: 1.5, ..d() }, "min_p"),
        (SamplerConfig { min_p: f32::NAN, ..d() }, "min_p"),
        (SamplerConfig { repetition_penalty: 0.0, ..d() }, "repetition_penalty"),
        (SamplerConfig { repetition_penalty: f32::NAN, ..d() }, "repetition_penalty"),
        (SamplerConfig { presence_penalty: f32::INFINITY, ..d() }, "presence_penalty"),
        (SamplerConfig { frequency_penalty: f32::NAN, ..d() }, "frequency_penalty"),
    ];
    for (cfg, field) in cases {
        let err = Sampler::new(cfg.clone()).unwrap_err();
        assert_eq!(err.field(), field, "{cfg:?}");
        assert_eq!(cfg.validate().unwrap_err().field(), field);
        let msg = err.to_string();
        assert!(msg.contains(field), "{msg}");
        // Usable as a boxed std error.
        let _: Box<dyn std::error::Error> = Box::new(err);
    }
    assert_eq!(SamplerConfig { top_p: 2.0, ..d() }.validate(), Err(SamplerError::TopP(2.0)));
    // Edges that are allowed.
    for cfg in [
        SamplerConfig { top_p: 1.0, ..d() },
        SamplerConfig { min_p: 1.0, ..d() },
        SamplerConfig { presence_penalty: -2.0, frequency_penalty: -2.0, ..d() },
        SamplerConfig { repetition_penalty: 0.5, ..d() },
    ] {
        assert!(Sampler::new(cfg).is_ok());
    }
}
