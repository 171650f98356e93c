#!/usr/bin/env python3
"""Copy a BF16 (or F32) safetensors model folder with every tensor in F16.

Used to measure ember's F16 path on the same weights as the BF16 model
(BF16 -> F16 is exact for every weight of Qwen2.5-0.5B: F16 has more
significand bits and the weights are well inside its range; values that
would overflow or underflow are reported).

    python3 scripts/to_f16.py SRC_DIR DST_DIR

Needs only numpy. Copies config.json (torch_dtype set to float16),
generation_config.json and the tokenizer files beside the weights.
"""
import json
import os
import shutil
import struct
import sys

import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", None)
    return header, meta, data


def to_f32(info, data):
    a, b = info["data_offsets"]
    raw = data[a:b]
    dtype = info["dtype"]
    if dtype == "BF16":
        u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return u.view(np.float32)
    if dtype == "F32":
        return np.frombuffer(raw, dtype="<f4")
    if dtype == "F16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32)
    raise SystemExit(f"unsupported dtype {dtype}")


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    src, dst = sys.argv[1], sys.argv[2]
    os.makedirs(dst, exist_ok=True)
    header, meta, data = read_safetensors(os.path.join(src, "model.safetensors"))
    out_header, chunks, offset, inexact = {}, [], 0, 0
    for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
        info = header[name]
        x = to_f32(info, data)
        h = x.astype(np.float16)
        inexact += int(np.count_nonzero(h.astype(np.float32) != x))
        raw = h.tobytes()
        out_header[name] = {"dtype": "F16", "shape": info["shape"], "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    if meta is not None:
        out_header["__metadata__"] = meta
    blob = json.dumps(out_header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = os.path.join(dst, "model.safetensors.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for c in chunks:
            f.write(c)
    os.replace(tmp, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["torch_dtype"] = "float16"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for extra in ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]:
        if os.path.exists(os.path.join(src, extra)):
            shutil.copyfile(os.path.join(src, extra), os.path.join(dst, extra))
    print(f"{len(header)} tensors, {inexact} values not exactly representable in F16", file=sys.stderr)
    print(dst)


if __name__ == "__main__":
    main()
