#!/usr/bin/env python3
"""Build the tiny random Qwen2 fixtures under fixtures/tiny-*/ with HF transformers.

Each variant is a complete HuggingFace-layout model folder (config.json,
safetensors weights, optional generation_config.json) plus `reference.json`,
the logits that transformers computes for a fixed 20-token sequence. The Rust
engine must load the folder and reproduce those logits; no tokenizer is needed.

    /work/venv-ref/bin/python scripts/make_tiny_fixtures.py            # all variants
    /work/venv-ref/bin/python scripts/make_tiny_fixtures.py --only tiny-tied
    /work/venv-ref/bin/python scripts/make_tiny_fixtures.py --check     # rebuild in a temp dir, compare

Common dims: vocab 96, hidden 64, intermediate 160, 3 layers, 4 query heads,
2 KV heads (GQA, head_dim 16), max_position_embeddings 256, q/k/v biases and no
o_proj bias (as Qwen2 has). What differs per variant (see VARIANTS below):

| variant     | stored dtype | head   | files              | rope_theta | rms_norm_eps | config.json RoPE form          | EOS source                          |
|-------------|--------------|--------|--------------------|------------|--------------|--------------------------------|-------------------------------------|
| tiny-tied   | BF16         | tied   | 1 file             | 1e6        | 1e-6         | `rope_parameters` (tf 5.x)     | generation_config.json [1, 2]       |
| tiny-untied | F32          | untied | 3 shards + index   | 10000.0    | 1e-5         | top-level `rope_theta` (4.x)   | none: config.json eos_token_id 3    |
| tiny-f16    | F16          | untied | 1 file             | 5e5        | 1e-6         | top-level `rope_theta` (4.x)   | generation_config.json 2 (an int)   |

transformers 5.x writes `rope_parameters: {rope_theta, rope_type}` instead of a
top-level `rope_theta`; real checkpoints (and the real test model) still use the
top-level key, so two variants are rewritten to that legacy form after saving.
The reference is always computed from the folder *as written* (reloaded with
`from_pretrained`), so it reflects exactly the stored, rounded weights and the
config keys the engine will read.

reference.json layout:
    {
      "variant": str, "stored_dtype": "BF16"|"F32"|"F16", "tie_word_embeddings": bool,
      "rope_theta": float, "rms_norm_eps": float, "eos_token_ids": [int],
      "attn_implementation": "eager", "compute_dtype": "float32",
      "transformers_version": str, "torch_version": str,
      "ids": [20 ints],                  # the input sequence, positions 0..19
      "logits": [[96 floats] x 20],      # one forward pass over `ids`, every position
      "greedy_ids": [12 ints],           # greedy continuation of `ids`, EOS disabled
      "greedy_margins": [12 floats]      # top1 - top2 logit at each greedy step
    }
Floats are written as the shortest decimal that round-trips the float32 value,
so parsing them as f64 and casting to f32 gives the exact transformers output.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "fixtures")

# The fixed input sequence (20 ids; avoids the special ids 0..3).
IDS = [17, 42, 5, 88, 63, 29, 71, 10, 54, 91, 36, 8, 77, 23, 60, 45, 95, 12, 50, 33]
N_GREEDY = 12

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    hidden_act="silu",
    bos_token_id=0,
    use_sliding_window=False,
)

VARIANTS = {
    "tiny-tied": dict(
        seed=1001,
        dtype=torch.bfloat16,
        tie=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        config_eos=2,
        generation_eos=[1, 2],
        legacy_rope_key=False,
        max_shard_size=None,
    ),
    "tiny-untied": dict(
        seed=2002,
        dtype=torch.float32,
        tie=False,
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        config_eos=3,
        generation_eos=None,  # no generation_config.json: EOS falls back to config.json
        legacy_rope_key=True,
        max_shard_size="200KB",  # ~570 KB of F32 weights -> 3 shards + index
    ),
    "tiny-f16": dict(
        seed=3003,
        dtype=torch.float16,
        tie=False,
        rope_theta=500_000.0,
        rms_norm_eps=1e-6,
        config_eos=1,
        generation_eos=2,  # a bare int, the other form HF allows
        legacy_rope_key=True,
        max_shard_size=None,
    ),
}

DTYPE_NAME = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


def f32_str(x):
    """Shortest decimal that round-trips the float32 value x."""
    return np.format_float_positional(np.float32(x), unique=True, trim="-")


def randomize(model, seed):
    """Re-initialise every parameter with a large-ish random init so logits are
    far from zero: matrices N(0, 0.2), embeddings N(0, 0.25), biases N(0, 0.3),
    RMSNorm weights 1 + N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * r)
            elif name.endswith(".bias"):
                p.copy_(0.3 * r)
            elif "embed_tokens" in name:
                p.copy_(0.25 * r)
            else:
                p.copy_(0.2 * r)


def build(name, spec, out_dir):
    torch.manual_seed(spec["seed"])
    cfg = Qwen2Config(
        **COMMON,
        tie_word_embeddings=spec["tie"],
        rope_theta=spec["rope_theta"],
        rms_norm_eps=spec["rms_norm_eps"],
        eos_token_id=spec["config_eos"],
    )
    model = Qwen2ForCausalLM(cfg)
    randomize(model, spec["seed"])
    if spec["tie"]:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model = model.to(spec["dtype"])
    model.generation_config = GenerationConfig(
        bos_token_id=0, eos_token_id=spec["generation_eos"] if spec["generation_eos"] is not None else spec["config_eos"]
    )

    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    kw = {}
    if spec["max_shard_size"]:
        kw["max_shard_size"] = spec["max_shard_size"]
    model.save_pretrained(out_dir, **kw)

    gen_path = os.path.join(out_dir, "generation_config.json")
    if spec["generation_eos"] is None:
        if os.path.exists(gen_path):
            os.remove(gen_path)

    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cj = json.load(f)
    if spec["legacy_rope_key"]:
        # The transformers 4.x / Hub form that real Qwen2 checkpoints use.
        rp = cj.pop("rope_parameters")
        assert rp.get("rope_type", "default") == "default"
        cj["rope_theta"] = rp["rope_theta"]
        with open(cfg_path, "w") as f:
            json.dump(cj, f, indent=2, sort_keys=True)
            f.write("\n")
    return cj


def eos_ids(out_dir):
    gen_path = os.path.join(out_dir, "generation_config.json")
    src = None
    if os.path.exists(gen_path):
        src = json.load(open(gen_path)).get("eos_token_id")
    if src is None:
        src = json.load(open(os.path.join(out_dir, "config.json"))).get("eos_token_id")
    if src is None:
        return []
    return src if isinstance(src, list) else [src]


def reference(name, spec, out_dir):
    """Reload the folder as written and compute the float32 reference."""
    model = Qwen2ForCausalLM.from_pretrained(out_dir, dtype=spec["dtype"], attn_implementation="eager")
    for p in model.parameters():
        assert p.dtype == spec["dtype"], (name, p.dtype)
    model = model.float().eval()  # upcast the stored (rounded) values, compute in f32
    cfg = model.config
    assert cfg.rope_parameters["rope_theta"] == spec["rope_theta"], cfg.rope_parameters
    assert cfg.rms_norm_eps == spec["rms_norm_eps"]
    assert cfg.tie_word_embeddings == spec["tie"]
    if spec["tie"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    ids = torch.tensor([IDS], dtype=torch.long)
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # [20, 96]

        # Cross-check: sdpa attention gives the same numbers to f32 noise.
        m2 = Qwen2ForCausalLM.from_pretrained(out_dir, dtype=spec["dtype"], attn_implementation="sdpa").float().eval()
        d_sdpa = (m2(ids).logits[0].float() - logits).abs().max().item()

        # Greedy continuation with EOS disabled (generation_config with no eos/pad).
        gc = GenerationConfig(
            do_sample=False, max_new_tokens=N_GREEDY, eos_token_id=None, pad_token_id=0, bos_token_id=None
        )
        out = model.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))
        greedy = out[0, len(IDS):].tolist()
        assert len(greedy) == N_GREEDY, greedy

        # Cross-check generate() against a plain argmax loop (full recompute each step).
        seq = list(IDS)
        margins = []
        for _ in range(N_GREEDY):
            last = model(torch.tensor([seq])).logits[0, -1].float()
            top2 = torch.topk(last, 2)
            margins.append(float(top2.values[0] - top2.values[1]))
            seq.append(int(top2.indices[0]))
        assert seq[len(IDS):] == greedy, (seq[len(IDS):], greedy)

    lg = logits.numpy().astype(np.float32)
    stats = dict(
        logit_std=float(lg.std()),
        logit_absmax=float(np.abs(lg).max()),
        min_greedy_margin=min(margins),
        sdpa_vs_eager_maxabs=d_sdpa,
    )
    ref = {
        "variant": name,
        "stored_dtype": DTYPE_NAME[spec["dtype"]],
        "tie_word_embeddings": spec["tie"],
        "rope_theta": spec["rope_theta"],
        "rms_norm_eps": spec["rms_norm_eps"],
        "eos_token_ids": eos_ids(out_dir),
        "attn_implementation": "eager",
        "compute_dtype": "float32",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "ids": list(IDS),
        "logits": lg,
        "greedy_ids": greedy,
        "greedy_margins": margins,
    }
    return ref, stats


def write_reference(ref, path):
    """JSON with one logits row per line, floats as shortest f32 round-trip decimals."""
    lines = ["{"]
    for k, v in ref.items():
        if k == "logits":
            rows = ["    [" + ", ".join(f32_str(x) for x in row) + "]" for row in v]
            lines.append(f'  "logits": [\n' + ",\n".join(rows) + "\n  ],")
        elif k == "greedy_margins":
            lines.append(f'  "{k}": [' + ", ".join(f32_str(x) for x in v) + "],")
        else:
            lines.append(f"  {json.dumps(k)}: {json.dumps(v)},")
    lines[-1] = lines[-1].rstrip(",")
    lines.append("}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    json.load(open(path))  # must parse


def dir_size(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=FIXTURES, help="parent folder for the tiny-* folders (default: fixtures/)")
    ap.add_argument("--only", action="append", choices=sorted(VARIANTS), help="build only this variant (repeatable)")
    ap.add_argument(
        "--check",
        action="store_true",
        help="rebuild into a temp dir and compare with the committed reference.json files (no writes)",
    )
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    names = args.only or list(VARIANTS)
    parent = tempfile.mkdtemp() if args.check else args.out
    ok = True
    for name in names:
        spec = VARIANTS[name]
        out_dir = os.path.join(parent, name)
        build(name, spec, out_dir)
        ref, stats = reference(name, spec, out_dir)
        write_reference(ref, os.path.join(out_dir, "reference.json"))
        size = dir_size(out_dir)
        print(
            f"{name}: {sorted(os.listdir(out_dir))} {size} bytes; "
            + ", ".join(f"{k}={v:.4g}" for k, v in stats.items())
            + f"; greedy={ref['greedy_ids']} eos={ref['eos_token_ids']}"
        )
        assert size < 1_000_000, size
        if args.check:
            committed = json.load(open(os.path.join(args.out, name, "reference.json")))
            new = json.load(open(os.path.join(out_dir, "reference.json")))
            d = np.abs(np.array(committed["logits"]) - np.array(new["logits"])).max()
            same = committed["ids"] == new["ids"] and committed["greedy_ids"] == new["greedy_ids"]
            print(f"  vs committed: max |dlogit| = {d:.3g}, ids/greedy equal = {same}")
            ok = ok and same and d < 1e-5
    if args.check:
        shutil.rmtree(parent)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
