"""The gguf package's numpy dequantizers on real GGUF tensors and on random
blocks: fixtures/gguf/oracle.json, the oracle tests/gguf_real.rs reads
ember's in-place tensors against (and tests/gguf_reader.rs the random
blocks, which need no model file).

    python scripts/gguf_oracle.py PEERS_GGUF_DIR FETCHED_Q4_K_M.gguf > fixtures/gguf/oracle.json

Run it with the pinned `gguf==0.19.0`, `numpy==2.4.6` (the venv of
`cargo xtask fetch` or of ../shared/peers/ggufs.sh).

For each file, every ggml type it holds gets up to three 2-D tensors (its
first, a middle and its last) and two rows of each (the first and the
last). A row is kept small: its FNV-1a 64 hash over the f32 values'
little-endian bytes (exact: one flipped bit changes it), its f64 sum, and
its first 8 values for messages. Random blocks (any scale's sign, any
code) keep their bytes and every value.
"""
import json, sys, os
from collections import Counter, defaultdict
import numpy as np
from gguf import GGUFReader, GGMLQuantizationType as T
from gguf.quants import dequantize

FNV_OFFSET, FNV_PRIME, MASK = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1


def fnv1a64(b: bytes) -> str:
    h = FNV_OFFSET
    for byte in b:
        h = ((h ^ byte) * FNV_PRIME) & MASK
    return f"{h:016x}"


def row_entry(row: np.ndarray) -> dict:
    row = row.astype(np.float32)
    return {"fnv1a64": fnv1a64(row.astype("<f4").tobytes()), "sum": float(row.astype(np.float64).sum()),
            "head": row[:8].tolist()}


def file_entry(path: str) -> dict:
    r = GGUFReader(path)
    types = Counter(t.tensor_type.name for t in r.tensors)
    by_type = defaultdict(list)
    for t in r.tensors:
        if len(t.shape) == 2:
            by_type[t.tensor_type.name].append(t)
    tensors = {}
    for name, ts in sorted(by_type.items()):
        picks = {id(t): t for t in [ts[0], ts[len(ts) // 2], ts[-1]]}.values()
        for t in picks:
            d = dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0]))
            ids = [0, int(d.shape[0] - 1)]
            tensors[t.name] = {"type": name, "cols": int(t.shape[0]), "row_ids": ids,
                               "rows": [row_entry(d[i]) for i in ids]}
    return {"types": dict(types), "tensors": tensors}


# Byte offsets of each block's F16 fields: their exponents are kept in range
# so every value is finite.
F16_AT = {T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q2_K: [80, 82], T.Q3_K: [108],
          T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
SIZES = {T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q2_K: 84, T.Q3_K: 110, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}


def random_blocks(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for ty, size in SIZES.items():
        raw = rng.integers(0, 256, size=(4, size), dtype=np.uint8)
        for at in F16_AT[ty]:
            # sign and the top mantissa bits random, exponent 7 (2^-8).
            raw[:, at + 1] = (raw[:, at + 1] & 0x83) | 0x1C
        values = dequantize(raw.reshape(-1), ty).astype(np.float32).reshape(-1)
        out[ty.name] = {"bytes": raw.reshape(-1).tobytes().hex(), "values": values.tolist()}
    return out


out = {}
peers = sys.argv[1]
for kind in ["bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_m", "q4_k_m", "q5_k_m", "q6_k"]:
    path = os.path.join(peers, f"qwen2.5-coder-0.5b-instruct-{kind}.gguf")
    out[kind] = file_entry(path)
out["fetched_q4_k_m"] = file_entry(sys.argv[2])
out["random"] = random_blocks(14)
json.dump(out, sys.stdout)
