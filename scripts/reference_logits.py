#!/usr/bin/env python3
"""The HF transformers oracle for the real model (Qwen2.5-Coder-0.5B-Instruct).

Three modes.

1. Prompt set -> greedy.jsonl (the format of fixtures/reference/greedy.jsonl):

    python scripts/reference_logits.py --model ~/.cache/ember-models/qwen2.5-coder-0.5b-instruct \\
        --prompts fixtures/reference/prompts.json --out /tmp/greedy.jsonl [--max-new 48] [--dtype float32]

   prompts.json is a list of {"name", "prompt", "chat"?: bool, "system"?: str}.
   When `chat` is true the prompt becomes
   tokenizer.apply_chat_template([{system}?, {user: prompt}], add_generation_prompt=True, tokenize=False)
   (without a system message the template inserts Qwen's default one).
   One JSON line per prompt, keys in this order:
     name, chat, prompt_text, prompt_ids,
     greedy_ids   up to --max-new greedy tokens; ends with the EOS id when it stopped on one
                  (EOS = generation_config.json eos_token_id, else config.json's),
     text         tokenizer.decode(greedy_ids) with special tokens kept,
     margins      top1 - top2 logit at each generated step, rounded to 5 decimals,
     last_top10   {"ids", "logits"} of the 10 best tokens at the prompt's last position (5 decimals).
   Greedy = argmax of the raw logits (no repetition penalty, no temperature,
   none of generation_config's sampling settings), prefill then one token at a
   time with transformers' KV cache, exactly what generate(do_sample=False) does.
   --check FILE compares the result with a committed jsonl (ids equal up to the
   first margin < 0.02, last_top10 logits within 1e-3).

2. One long raw prompt: --prompt-file TXT [--name NAME] writes the same one-line
   format for the file's text (no chat template; trailing newline kept as is).

3. Chat-template rendering: --dump-template CASES.json --out OUT.json renders
   each case with the model's own chat template and tokenizer (no weights
   loaded). CASES.json is a list whose items are either a list of messages or
   {"messages": [...], "tools": [...]?, "add_generation_prompt": bool?
   (default true)}. OUT.json is a list of
   {"messages", "tools", "add_generation_prompt", "text", "ids"}.

Weights are loaded in their stored dtype and upcast (--dtype float32, the
default) so the computation uses exactly the BF16-rounded values.
"""
import argparse
import inspect
import json
import os
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def eos_ids(model_dir):
    eos = None
    gpath = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gpath):
        eos = json.load(open(gpath)).get("eos_token_id")
    if eos is None:
        eos = json.load(open(os.path.join(model_dir, "config.json"))).get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]


def load_model(model_dir, dtype, attn):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    stored = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[stored], attn_implementation=attn)
    model = model.to(DTYPES[dtype]).eval()  # upcast the stored values
    return model


def render_chat(tok, prompt, system=None):
    messages = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def greedy(model, prompt_ids, max_new, eos):
    """Prefill, then argmax decode with the KV cache. Returns
    (generated ids, margins, last-position logits of the prompt)."""
    # transformers >= 5.2x calls the KV cache `cache` (`past_key_values` before).
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    past = getattr(out, kw)
    last = out.logits[0, -1].float()
    prompt_last = last.clone()
    gen, margins = [], []
    for step in range(max_new):
        top2 = torch.topk(last, 2)
        nxt = int(top2.indices[0])
        margins.append(float(top2.values[0] - top2.values[1]))
        gen.append(nxt)
        if nxt in eos or step == max_new - 1:
            break
        out = model(input_ids=torch.tensor([[nxt]]), use_cache=True, **{kw: past})
        past = getattr(out, kw)
        last = out.logits[0, -1].float()
    return gen, margins, prompt_last


def run_prompt(model, tok, eos, name, text, chat, max_new):
    prompt_ids = encode(tok, text)
    t0 = time.time()
    gen, margins, last = greedy(model, prompt_ids, max_new, eos)
    top = torch.topk(last, 10)
    rec = {
        "name": name,
        "chat": chat,
        "prompt_text": text,
        "prompt_ids": prompt_ids,
        "greedy_ids": gen,
        "text": tok.decode(gen, skip_special_tokens=False),
        "margins": [round(m, 5) for m in margins],
        "last_top10": {
            "ids": [int(i) for i in top.indices],
            "logits": [round(float(v), 5) for v in top.values],
        },
    }
    print(f"{name}: {len(prompt_ids)} prompt tokens, {len(gen)} generated in {time.time() - t0:.1f}s: "
          f"{rec['text'][:60]!r}", file=sys.stderr)
    return rec


def compare(got, want):
    """Compare one record with a committed one; returns (ok, message)."""
    msgs, ok = [], True
    for k in ("prompt_text", "prompt_ids"):
        if got[k] != want[k]:
            ok = False
            msgs.append(f"{k} differs")
    cut = next((i for i, m in enumerate(want["margins"]) if m < 0.02), len(want["greedy_ids"]))
    n = min(cut + 1, len(want["greedy_ids"]))
    if got["greedy_ids"][:n] != want["greedy_ids"][:n]:
        ok = False
        msgs.append(f"greedy ids differ within the first {n}")
    msgs.append(f"greedy exact over all: {got['greedy_ids'] == want['greedy_ids']}, text equal: {got['text'] == want['text']}")
    want_top = dict(zip(want["last_top10"]["ids"], want["last_top10"]["logits"]))
    got_top = dict(zip(got["last_top10"]["ids"], got["last_top10"]["logits"]))
    common = [i for i in want_top if i in got_top]
    d_top = max(abs(want_top[i] - got_top[i]) for i in common) if common else float("inf")
    if len(common) < 10 or d_top > 1e-3:
        ok = False
    msgs.append(f"last_top10 ids equal: {got['last_top10']['ids'] == want['last_top10']['ids']}, max |dlogit| = {d_top:.2g}")
    gm = got["margins"][: min(len(got["margins"]), len(want["margins"]))]
    if gm and got["greedy_ids"] == want["greedy_ids"]:
        d_m = max(abs(a - b) for a, b in zip(gm, want["margins"]))
        msgs.append(f"max |dmargin| = {d_m:.2g}")
    return ok, "; ".join(msgs)


def dump_template(model_dir, cases_path, out_path):
    tok = AutoTokenizer.from_pretrained(model_dir)
    cases = json.load(open(cases_path))
    out = []
    for case in cases:
        if isinstance(case, list):
            case = {"messages": case}
        messages = case["messages"]
        tools = case.get("tools")
        agp = case.get("add_generation_prompt", True)
        kw = {"tools": tools} if tools else {}
        text = tok.apply_chat_template(messages, add_generation_prompt=agp, tokenize=False, **kw)
        out.append({"messages": messages, "tools": tools, "add_generation_prompt": agp,
                    "text": text, "ids": encode(tok, text)})
    s = json.dumps(out, ensure_ascii=False, indent=1)
    if out_path:
        with open(out_path, "w", encoding="utf-8") as f:
            f.write(s + "\n")
        print(f"wrote {len(out)} rendered cases to {out_path}", file=sys.stderr)
    else:
        print(s)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF-layout model folder")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompts", help="prompts.json (list of {name, prompt, chat?, system?})")
    mode.add_argument("--prompt-file", help="one raw prompt read from this text file")
    mode.add_argument("--dump-template", metavar="CASES_JSON", help="render chat-template cases (no weights loaded)")
    ap.add_argument("--out", help="output file (.jsonl for prompts, .json for --dump-template); default stdout")
    ap.add_argument("--name", help="record name for --prompt-file (default: the file's stem)")
    ap.add_argument("--only", action="append", help="with --prompts: run only prompts with this name (repeatable)")
    ap.add_argument("--max-new", type=int, default=48, help="greedy tokens per prompt (default 48)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype (default float32)")
    ap.add_argument("--attn", choices=["eager", "sdpa"], default="eager", help="attention implementation (default eager)")
    ap.add_argument("--check", metavar="JSONL", help="compare each record with the same-named line of this file")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = ap.parse_args()

    if args.dump_template:
        dump_template(args.model, args.dump_template, args.out)
        return

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, dtype {args.dtype}, attn {args.attn}",
          file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = load_model(args.model, args.dtype, args.attn)
    eos = eos_ids(args.model)

    jobs = []
    if args.prompts:
        for p in json.load(open(args.prompts)):
            if args.only and p["name"] not in args.only:
                continue
            chat = bool(p.get("chat", False))
            text = render_chat(tok, p["prompt"], p.get("system")) if chat else p["prompt"]
            jobs.append((p["name"], text, chat))
    else:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
        name = args.name or os.path.splitext(os.path.basename(args.prompt_file))[0]
        jobs.append((name, text, False))

    want = {}
    if args.check:
        for line in open(args.check, encoding="utf-8"):
            if line.strip():
                r = json.loads(line)
                want[r["name"]] = r

    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    all_ok = True
    for name, text, chat in jobs:
        rec = run_prompt(model, tok, eos, name, text, chat, args.max_new)
        out.write(json.dumps(rec, ensure_ascii=False) + "\n")
        out.flush()
        if args.check:
            if name not in want:
                print(f"  {name}: not in {args.check}", file=sys.stderr)
                continue
            ok, msg = compare(rec, want[name])
            all_ok = all_ok and ok
            print(f"  {name}: {'OK' if ok else 'MISMATCH'}: {msg}", file=sys.stderr)
    if args.out:
        out.close()
    if args.check and not all_ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
