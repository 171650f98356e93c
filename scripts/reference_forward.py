#!/usr/bin/env python3
"""A NumPy-only Qwen2 forward pass: the algorithm oracle for ember.

It mirrors what the Rust engine does, step by step, in plain float32 NumPy:

  * safetensors loading (BF16 / F16 / F32; one file or sharded with
    model.safetensors.index.json), every tensor upcast to float32;
  * embedding lookup -> N x [RMSNorm -> attention -> residual -> RMSNorm ->
    SwiGLU MLP -> residual] -> final RMSNorm -> LM head (tied to the embedding
    when tie_word_embeddings is true, else lm_head.weight);
  * attention: q/k/v projections with bias (o_proj without), HF "rotate-half"
    RoPE with inv_freq computed in float32 exactly as transformers does,
    grouped-query attention (each KV head serves num_heads/num_kv_heads query
    heads), scale 1/sqrt(head_dim), causal, with a per-layer KV cache so a
    prefill over the prompt is followed by one-token decode steps;
  * greedy decoding (argmax, first index wins ties), stopping on EOS.

Every constant comes from the model folder: dims, head counts, head_dim
(`head_dim` key, else hidden_size / num_attention_heads), rms_norm_eps,
rope_theta (top-level key as in real checkpoints, or transformers 5.x's
`rope_parameters.rope_theta`), tie_word_embeddings, and the EOS ids
(generation_config.json's eos_token_id, else config.json's; int or list).

Needs only numpy (and the `tokenizers` package for --prompt).

Tiny fixtures (token ids in, logits out):
    python scripts/reference_forward.py --model fixtures/tiny-tied --ids 17,42,5
    python scripts/reference_forward.py --model fixtures/tiny-tied --reference fixtures/tiny-tied/reference.json

Real model (text in, greedy text out):
    python scripts/reference_forward.py --model ~/.cache/ember-models/qwen2.5-coder-0.5b-instruct \\
        --prompt "The capital of France is" --max-new 48 --check-jsonl fixtures/reference/greedy.jsonl
"""
import argparse
import json
import mmap
import os
import struct
import sys
import time

import numpy as np

# ---------------------------------------------------------------------------
# Loading


_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class SafetensorsFile:
    """Minimal safetensors reader: 8-byte little-endian header length, JSON
    header {name: {dtype, shape, data_offsets}}, then the raw data block."""

    def __init__(self, path):
        self.path = path
        self._f = open(path, "rb")
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)
        (n,) = struct.unpack("<Q", self._mm[:8])
        self.header = json.loads(self._mm[8 : 8 + n])
        self.header.pop("__metadata__", None)
        self._base = 8 + n

    def names(self):
        return list(self.header)

    def get(self, name):
        h = self.header[name]
        dt = h["dtype"]
        if dt not in _DTYPES:
            raise ValueError(f"{self.path}: {name}: unsupported dtype {dt}")
        a, b = h["data_offsets"]
        raw = np.frombuffer(self._mm, dtype=_DTYPES[dt], count=(b - a) // np.dtype(_DTYPES[dt]).itemsize,
                            offset=self._base + a)
        if dt == "BF16":
            # bf16 is the top half of an f32: widen and shift, exact.
            arr = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            arr = raw.astype(np.float32)  # F16 -> F32 is exact; F32 copies out of the mmap
        return arr.reshape(h["shape"]), dt


class Weights:
    """All tensors of a model folder, single-file or sharded."""

    def __init__(self, model_dir):
        index = os.path.join(model_dir, "model.safetensors.index.json")
        self.files = {}
        self.where = {}
        if os.path.exists(index):
            wm = json.load(open(index))["weight_map"]
            for name, fn in wm.items():
                if fn not in self.files:
                    self.files[fn] = SafetensorsFile(os.path.join(model_dir, fn))
                self.where[name] = fn
        else:
            fn = "model.safetensors"
            self.files[fn] = SafetensorsFile(os.path.join(model_dir, fn))
            for name in self.files[fn].names():
                self.where[name] = fn
        self.dtypes = set()

    def __contains__(self, name):
        return name in self.where

    def __getitem__(self, name):
        if name not in self.where:
            raise KeyError(f"missing tensor {name}")
        arr, dt = self.files[self.where[name]].get(name)
        self.dtypes.add(dt)
        return arr


class Config:
    """The constants the forward pass needs, read from config.json (+ generation_config.json)."""

    def __init__(self, model_dir):
        c = json.load(open(os.path.join(model_dir, "config.json")))
        self.raw = c
        self.vocab_size = c["vocab_size"]
        self.hidden = c["hidden_size"]
        self.inter = c["intermediate_size"]
        self.n_layers = c["num_hidden_layers"]
        self.n_heads = c["num_attention_heads"]
        self.n_kv = c.get("num_key_value_heads") or self.n_heads
        self.head_dim = c.get("head_dim") or self.hidden // self.n_heads
        self.eps = c["rms_norm_eps"]
        self.tie = bool(c.get("tie_word_embeddings", False))
        if "rope_theta" in c:
            self.rope_theta = c["rope_theta"]
        elif isinstance(c.get("rope_parameters"), dict) and "rope_theta" in c["rope_parameters"]:
            self.rope_theta = c["rope_parameters"]["rope_theta"]
        else:
            self.rope_theta = 10000.0  # transformers' Qwen2 default
        rs = c.get("rope_scaling") or c.get("rope_parameters") or {}
        rtype = rs.get("rope_type", rs.get("type", "default"))
        if rtype != "default":
            raise NotImplementedError(f"rope_type {rtype!r}")
        if c.get("use_sliding_window"):
            raise NotImplementedError("sliding-window attention")
        if c.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(c["hidden_act"])
        if self.n_heads % self.n_kv:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

        eos = None
        gpath = os.path.join(model_dir, "generation_config.json")
        if os.path.exists(gpath):
            eos = json.load(open(gpath)).get("eos_token_id")
        if eos is None:
            eos = c.get("eos_token_id")
        self.eos = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])

    def summary(self):
        return (f"vocab={self.vocab_size} hidden={self.hidden} inter={self.inter} layers={self.n_layers} "
                f"heads={self.n_heads} kv_heads={self.n_kv} head_dim={self.head_dim} eps={self.eps} "
                f"rope_theta={self.rope_theta} tied={self.tie} eos={self.eos}")


# ---------------------------------------------------------------------------
# Kernels (all float32)

F32 = np.float32


def rms_norm(x, w, eps):
    """x: [T, D]. x * 1/sqrt(mean(x^2) + eps), then * weight (HF order)."""
    var = np.mean(x * x, axis=-1, keepdims=True, dtype=F32)
    return w * (x * (F32(1.0) / np.sqrt(var + F32(eps))))


def silu(x):
    with np.errstate(over="ignore"):
        return x / (F32(1.0) + np.exp(-x))


def rope_inv_freq(head_dim, theta):
    """inv_freq as transformers computes it, in float32:
    1.0 / (theta ** (arange(0, head_dim, 2, float32) / head_dim)).

    The exponent and the reciprocal are f32 operations. The power is an f32
    pow too; NumPy's own float32 pow is less accurate than torch's (it differs
    by 1 ulp in a few entries for head_dim 64, theta 1e6), so take the pow in
    f64 and round once to f32 (= a correctly rounded powf, like glibc's powf
    that Rust's f32::powf calls). That is bit-identical to torch for the
    fixture and Qwen2.5 configs; torch's vectorised pow is itself only
    ~0.5 ulp, so exotic (head_dim, theta) pairs may differ in a rare last bit."""
    exps = np.arange(0, head_dim, 2, dtype=F32) / F32(head_dim)
    pw = np.power(np.float64(F32(theta)), exps.astype(np.float64)).astype(F32)
    return F32(1.0) / pw


def rope_cos_sin(positions, inv_freq):
    """cos, sin: [T, head_dim]; freqs = pos * inv_freq in f32, duplicated (cat(freqs, freqs))."""
    freqs = positions.astype(F32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def apply_rope(x, cos, sin):
    """x: [heads, T, head_dim]. Rotate-half: x*cos + [-x2, x1]*sin."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None] + rot * sin[None]


# ---------------------------------------------------------------------------
# Model


class KVCache:
    def __init__(self, n_layers):
        self.k = [None] * n_layers  # [n_kv, S, head_dim]
        self.v = [None] * n_layers
        self.len = 0

    def append(self, layer, k, v):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = np.concatenate([self.k[layer], k], axis=1)
            self.v[layer] = np.concatenate([self.v[layer], v], axis=1)
        return self.k[layer], self.v[layer]


class Qwen2:
    def __init__(self, model_dir, verbose=True):
        t0 = time.time()
        self.cfg = cfg = Config(model_dir)
        W = Weights(model_dir)
        self.embed = W["model.embed_tokens.weight"]
        if cfg.tie:
            self.lm_head = self.embed  # HF ties: lm_head.weight (if stored) is ignored
        else:
            self.lm_head = W["lm_head.weight"]
        self.final_norm = W["model.norm.weight"]
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            self.layers.append({k: W[p + n] for k, n in [
                ("ln1", "input_layernorm.weight"),
                ("wq", "self_attn.q_proj.weight"), ("bq", "self_attn.q_proj.bias"),
                ("wk", "self_attn.k_proj.weight"), ("bk", "self_attn.k_proj.bias"),
                ("wv", "self_attn.v_proj.weight"), ("bv", "self_attn.v_proj.bias"),
                ("wo", "self_attn.o_proj.weight"),
                ("ln2", "post_attention_layernorm.weight"),
                ("wg", "mlp.gate_proj.weight"), ("wu", "mlp.up_proj.weight"), ("wd", "mlp.down_proj.weight"),
            ]})
        assert self.embed.shape == (cfg.vocab_size, cfg.hidden), self.embed.shape
        assert self.layers[0]["wq"].shape == (cfg.n_heads * cfg.head_dim, cfg.hidden)
        assert self.layers[0]["wk"].shape == (cfg.n_kv * cfg.head_dim, cfg.hidden)
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
        self.stored_dtypes = sorted(W.dtypes)
        if verbose:
            print(f"loaded {model_dir} ({'/'.join(self.stored_dtypes)} -> f32, {len(W.files)} file(s)) "
                  f"in {time.time() - t0:.1f}s; {cfg.summary()}", file=sys.stderr)

    def new_cache(self):
        return KVCache(self.cfg.n_layers)

    def forward(self, ids, cache):
        """Run tokens `ids` at positions cache.len .. cache.len+T-1, extend the
        cache, and return float32 logits [T, vocab] for each of them."""
        cfg = self.cfg
        T = len(ids)
        start = cache.len
        pos = np.arange(start, start + T)
        cos, sin = rope_cos_sin(pos, self.inv_freq)
        H, KV, hd = cfg.n_heads, cfg.n_kv, cfg.head_dim
        group = H // KV
        scale = F32(1.0 / np.sqrt(hd))
        # causal mask over [T, start+T]: query i (absolute start+i) sees keys j <= start+i
        mask = np.arange(start + T)[None, :] > pos[:, None]

        x = self.embed[np.asarray(ids)]  # [T, D]
        for li, L in enumerate(self.layers):
            h = rms_norm(x, L["ln1"], cfg.eps)
            q = h @ L["wq"].T + L["bq"]  # bias added before RoPE
            k = h @ L["wk"].T + L["bk"]
            v = h @ L["wv"].T + L["bv"]
            q = q.reshape(T, H, hd).transpose(1, 0, 2)  # [H, T, hd]
            k = k.reshape(T, KV, hd).transpose(1, 0, 2)
            v = v.reshape(T, KV, hd).transpose(1, 0, 2)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            K, V = cache.append(li, k, v)  # [KV, S, hd]
            out = np.empty((H, T, hd), dtype=F32)
            for hh in range(H):
                kv = hh // group  # query head hh reads KV head hh // group
                s = (q[hh] @ K[kv].T) * scale  # [T, S]
                s = np.where(mask, F32(-np.inf), s)
                s = s - s.max(axis=-1, keepdims=True)
                p = np.exp(s)
                p = p / p.sum(axis=-1, keepdims=True)
                out[hh] = p @ V[kv]
            attn = out.transpose(1, 0, 2).reshape(T, H * hd)
            x = x + attn @ L["wo"].T
            h = rms_norm(x, L["ln2"], cfg.eps)
            x = x + (silu(h @ L["wg"].T) * (h @ L["wu"].T)) @ L["wd"].T
        cache.len += T
        x = rms_norm(x, self.final_norm, cfg.eps)
        return (x @ self.lm_head.T).astype(F32)

    def greedy(self, prompt_ids, max_new, stop_on_eos=True, on_token=None):
        """Prefill the prompt, then decode one token at a time with the KV cache.
        Returns (generated ids incl. a final EOS if hit, margins, prompt logits)."""
        cache = self.new_cache()
        logits = self.forward(prompt_ids, cache)
        prompt_logits = logits
        last = logits[-1]
        out, margins = [], []
        for _ in range(max_new):
            nxt = int(np.argmax(last))
            top2 = np.partition(last, -2)[-2:]
            margins.append(float(top2[1] - top2[0]))
            out.append(nxt)
            if on_token:
                on_token(nxt)
            if stop_on_eos and nxt in self.cfg.eos:
                break
            last = self.forward([nxt], cache)[-1]
        return out, margins, prompt_logits


# ---------------------------------------------------------------------------
# CLI


def chatml(prompt, system=None):
    """Qwen2.5's ChatML prompt for a single user turn (the default system
    prompt of Qwen2.5's chat template when none is given)."""
    if system is None:
        system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    return (f"<|im_start|>system\n{system}<|im_end|>\n"
            f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")


def check_reference(model, ref_path, stepwise):
    """Compare against a tiny fixture's reference.json: logits at every
    position of one prefill, the same logits decoded one token at a time
    through the KV cache, and the greedy continuation (EOS disabled)."""
    ref = json.load(open(ref_path))
    ids = ref["ids"]
    want = np.array(ref["logits"], dtype=F32)
    got = model.forward(ids, model.new_cache())
    d_prefill = float(np.abs(got - want).max())
    print(f"prefill logits [{len(ids)} x {want.shape[1]}]: max |diff| = {d_prefill:.3g}")
    ok = d_prefill < 1e-4
    if stepwise:
        cache = model.new_cache()
        step = np.concatenate([model.forward([t], cache) for t in ids])
        d_step = float(np.abs(step - want).max())
        print(f"token-by-token (KV cache) logits: max |diff| = {d_step:.3g}")
        ok = ok and d_step < 1e-4
    n = len(ref["greedy_ids"])
    gen, margins, _ = model.greedy(ids, n, stop_on_eos=False)
    same = gen == ref["greedy_ids"]
    print(f"greedy {n} (EOS disabled): {'match' if same else 'MISMATCH'} {gen}"
          + ("" if same else f" vs {ref['greedy_ids']}"))
    ok = ok and same
    print("OK" if ok else "FAIL")
    return ok


def check_jsonl(entry, prompt_ids, gen, margins, prompt_logits):
    """Compare with a greedy.jsonl line: prompt ids, greedy ids up to the first
    step whose recorded margin is < 0.02, and last_top10 logits (tol 1e-3)."""
    ok = entry["prompt_ids"] == prompt_ids
    print(f"prompt ids {'match' if ok else 'MISMATCH'}")
    want = entry["greedy_ids"]
    cut = next((i for i, m in enumerate(entry["margins"]) if m < 0.02), len(want))
    n = min(cut + 1, len(want))
    same = gen[:n] == want[:n]
    print(f"greedy ids: {'match' if same else 'MISMATCH'} over the first {n} (exact over all {len(want)}: {gen == want})")
    top = entry["last_top10"]
    got = prompt_logits[-1][top["ids"]]
    d = float(np.abs(got - np.array(top["logits"], dtype=F32)).max())
    argtop = [int(i) for i in np.argsort(-prompt_logits[-1], kind="stable")[:10]]
    print(f"last_top10: max |diff| = {d:.3g}; top10 ids {'match' if argtop == top['ids'] else 'differ'}")
    ok = ok and same and d < 1e-3
    print("OK" if ok else "FAIL")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF-layout model folder (config.json + safetensors)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", help="comma-separated token ids: print logits for every position as JSON")
    src.add_argument("--prompt", help="text prompt (needs tokenizer.json and the `tokenizers` package)")
    src.add_argument("--reference", metavar="REFERENCE_JSON",
                     help="check a tiny fixture's reference.json (logits + greedy); exit 1 on mismatch")
    ap.add_argument("--chat", action="store_true", help="wrap --prompt in Qwen2.5's ChatML template")
    ap.add_argument("--system", help="system message for --chat (default: Qwen2.5's default)")
    ap.add_argument("--max-new", type=int, default=0,
                    help="greedy tokens to generate (default 0 for --ids, 32 for --prompt)")
    ap.add_argument("--no-eos", action="store_true", help="do not stop on EOS")
    ap.add_argument("--last-only", action="store_true", help="--ids: print only the last position's logits")
    ap.add_argument("--stepwise", action="store_true",
                    help="--reference: also feed the ids one at a time through the KV cache and compare")
    ap.add_argument("--check-jsonl", metavar="GREEDY_JSONL",
                    help="--prompt: compare with the line of this file that has the same prompt_text")
    args = ap.parse_args()

    model = Qwen2(args.model)

    if args.reference:
        sys.exit(0 if check_reference(model, args.reference, args.stepwise) else 1)

    if args.ids:
        ids = [int(t) for t in args.ids.split(",") if t.strip()]
        gen, margins, logits = model.greedy(ids, args.max_new, stop_on_eos=not args.no_eos)
        if args.max_new == 0:
            gen, margins = [], []
        rows = logits[-1:] if args.last_only else logits
        out = {"ids": ids,
               "logits": [[float(np.format_float_positional(v, unique=True, trim="-")) for v in r] for r in rows]}
        if args.max_new:
            out["greedy_ids"] = gen
            out["margins"] = [round(m, 5) for m in margins]
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    text = chatml(args.prompt, args.system) if args.chat else args.prompt
    prompt_ids = tok.encode(text, add_special_tokens=False).ids
    max_new = args.max_new or 32
    print(f"prompt: {len(prompt_ids)} tokens {prompt_ids}", file=sys.stderr)
    t0 = time.time()
    gen, margins, logits = model.greedy(prompt_ids, max_new, stop_on_eos=not args.no_eos)
    dt = time.time() - t0
    print(f"generated {len(gen)} tokens in {dt:.1f}s", file=sys.stderr)
    print(json.dumps({"prompt_ids": prompt_ids, "greedy_ids": gen,
                      "margins": [round(m, 5) for m in margins]}))
    print(text + tok.decode(gen, skip_special_tokens=False))

    if args.check_jsonl:
        entries = [json.loads(l) for l in open(args.check_jsonl) if l.strip()]
        match = [e for e in entries if e["prompt_text"] == text]
        if not match:
            sys.exit(f"no line of {args.check_jsonl} has this prompt_text")
        if len(gen) < len(match[0]["greedy_ids"]):
            print(f"note: generated {len(gen)} < reference {len(match[0]['greedy_ids'])} tokens")
        sys.exit(0 if check_jsonl(match[0], prompt_ids, gen, margins, logits) else 1)


if __name__ == "__main__":
    main()
