"""The gguf package's numpy dequantizers on a few rows of real GGUF tensors:
fixtures/gguf/oracle.json, the oracle tests/gguf_real.rs reads ember's
in-place Q8_0 / Q4_0 / BF16 tensors against.

    python scripts/gguf_oracle.py DIR_WITH_GGUFS > fixtures/gguf/oracle.json
"""
import json, sys, os
from collections import Counter
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

out = {}
for kind in ["q8_0", "q4_0", "bf16"]:
    path = os.path.join(sys.argv[1], f"qwen2.5-coder-0.5b-instruct-{kind}.gguf")
    r = GGUFReader(path)
    types = Counter(t.tensor_type.name for t in r.tensors)
    rows = {}
    for t in r.tensors:
        if t.name in ("blk.0.attn_k.weight", "blk.5.ffn_down.weight", "blk.23.attn_q.weight"):
            d = dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0]))
            rows[t.name] = {"type": t.tensor_type.name, "rows": [d[i].astype(np.float32).tolist() for i in (0, 1, d.shape[0] - 1)],
                            "row_ids": [0, 1, int(d.shape[0] - 1)]}
    out[kind] = {"types": dict(types), "tensors": rows}
json.dump(out, sys.stdout)
