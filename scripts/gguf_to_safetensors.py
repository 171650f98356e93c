"""Convert the Qwen2 Q4_K_M GGUF into a HuggingFace-layout model folder.

Usage:

    python gguf_to_safetensors.py MODEL.gguf OUT_DIR

Writes two files into OUT_DIR (created if needed):

* ``model.safetensors``: every GGUF tensor dequantized to float32 by the
  ``gguf`` package (llama.cpp's own Python reader) and rounded to BF16 with
  round-to-nearest-even. Tensor names follow the HuggingFace Qwen2 layout
  (``model.layers.N.self_attn.q_proj.weight`` ...). The GGUF stores the tied
  embedding twice, ``token_embd.weight`` as Q5_0 and ``output.weight`` as
  Q8_0; only the more precise Q8_0 copy is kept, under the name
  ``model.embed_tokens.weight``, so the folder has no ``lm_head.weight``,
  like Qwen2.5-0.5B-Instruct itself.
* ``config.json``: the Qwen2 config, built from the GGUF metadata plus the
  fixed values of the Qwen2.5 release.

The output is byte-for-byte reproducible (``cargo xtask fetch`` checks its
SHA-256), so its layout is pinned down exactly:

* tensors are stored in name order, back to back, as BF16;
* the JSON header lists them in that same order, followed by
  ``"__metadata__": {"format": "pt"}``, compact separators (``,`` and ``:``),
  ASCII escapes, and is padded with spaces to a multiple of 8 bytes;
* ``config.json`` is ``json.dump(..., indent=2)`` with no trailing newline.

Tensors are converted and written one at a time, so peak memory stays near
the size of the largest tensor rather than the whole model.

Needs ``numpy`` and ``gguf`` (``cargo xtask fetch`` pins numpy==2.4.6 and
gguf==0.19.0 in a private venv).
"""

import json
import math
import os
import struct
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

# GGUF block tensor part -> HuggingFace module path inside `model.layers.N`.
BLOCK_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Tensors outside the blocks. `None` means "drop it".
TOP_LEVEL = {
    "output.weight": "model.embed_tokens.weight",  # Q8_0 copy of the tied matrix
    "output_norm.weight": "model.norm.weight",
    "token_embd.weight": None,  # Q5_0 copy of the same matrix: less precise
}


def hf_tensor_name(name):
    """HuggingFace name of a GGUF tensor, or None if it is not exported."""
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    pieces = name.split(".")
    if len(pieces) == 4 and pieces[0] == "blk" and pieces[2] in BLOCK_PARTS:
        _, layer, part, suffix = pieces
        return f"model.layers.{layer}.{BLOCK_PARTS[part]}.{suffix}"
    raise SystemExit(f"gguf_to_safetensors: unexpected tensor {name!r} in the GGUF")


def round_to_bf16(values):
    """Raw BF16 bits (uint16) of float32 values, rounding to nearest, ties to even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    lsb = (bits >> 16) & 1  # lowest bit that survives: decides the tie
    return ((bits + (0x7FFF + lsb)) >> 16).astype(np.uint16)


def plan_tensors(reader):
    """(hf_name, gguf_tensor, shape) for every exported tensor, sorted by hf_name."""
    plan = []
    for tensor in reader.tensors:
        target = hf_tensor_name(tensor.name)
        if target is None:
            continue
        # GGUF lists dimensions innermost first; safetensors wants row-major order.
        shape = [int(dim) for dim in tensor.shape][::-1]
        plan.append((target, tensor, shape))
    plan.sort(key=lambda entry: entry[0])
    return plan


def safetensors_header(plan):
    """The padded JSON header for BF16 tensors laid out in plan order."""
    header = {}
    start = 0
    for target, _, shape in plan:
        end = start + 2 * math.prod(shape)
        header[target] = {"dtype": "BF16", "shape": shape, "data_offsets": [start, end]}
        start = end
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    padding = (8 - len(text) % 8) % 8
    return text + b" " * padding


def write_safetensors(path, plan):
    header = safetensors_header(plan)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(header)))
        out.write(header)
        for target, tensor, shape in plan:
            values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            out.write(round_to_bf16(values).tobytes())
            del values


def qwen2_config(reader, vocab_size):
    def meta(key):
        field = reader.fields.get(key)
        if field is None:
            raise SystemExit(f"gguf_to_safetensors: metadata key {key!r} missing from the GGUF")
        return field.contents()

    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": int(meta("qwen2.embedding_length")),
        "intermediate_size": int(meta("qwen2.feed_forward_length")),
        "num_hidden_layers": int(meta("qwen2.block_count")),
        "num_attention_heads": int(meta("qwen2.attention.head_count")),
        "num_key_value_heads": int(meta("qwen2.attention.head_count_kv")),
        # Stored as f32 in the GGUF; written as that f32 value, widened.
        "rms_norm_eps": float(np.float32(meta("qwen2.attention.layer_norm_rms_epsilon"))),
        "rope_theta": float(meta("qwen2.rope.freq_base")),
        "max_position_embeddings": int(meta("qwen2.context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        # Fixed by the Qwen2.5 release (not carried in the GGUF metadata).
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "max_window_layers": 21,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "use_cache": True,
    }


def convert(gguf_path, out_dir):
    reader = GGUFReader(gguf_path)
    plan = plan_tensors(reader)
    shapes = {target: shape for target, _, shape in plan}
    if "model.embed_tokens.weight" not in shapes:
        raise SystemExit("gguf_to_safetensors: the GGUF has no output.weight tensor")

    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), plan)

    config = qwen2_config(reader, vocab_size=shapes["model.embed_tokens.weight"][0])
    with open(os.path.join(out_dir, "config.json"), "w") as out:
        json.dump(config, out, indent=2)
    print(f"gguf_to_safetensors: wrote {len(plan)} BF16 tensors to {out_dir}", file=sys.stderr)


def main(argv):
    if len(argv) != 3:
        raise SystemExit(f"usage: {argv[0]} MODEL.gguf OUT_DIR")
    convert(argv[1], argv[2])


if __name__ == "__main__":
    main(sys.argv)
