"""A tiny llama GGUF written with gguf-py's writer (nothing downloaded): float32 embedding, norms and LM head, and
decoder-layer weights in the block types of the files users download (Q8_0, Q4_K, Q6_K, Q5_0), so
`prepare` reads it the way it reads a real one (transformers dequantizes every tensor as it loads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SHAPES = dict(hidden=256, intermediate=512, layers=4, vocab=96, heads=4, kv_heads=2)  # K-quants need widths of 256


# K-quant blocks of 256 weights: (bytes, {byte offset of a float16 scale: its value}); the rest are random
# 4-8 bit values and sub-block scales (gguf-py writes no K-quant, but reads any).
K_QUANTS = {"Q4_K": (144, {0: 0.004, 2: 0.002}),  # d, dmin, 12 bytes of 6-bit scales/minima, 128 of nibbles
            "Q6_K": (210, {208: 0.0005})}  # 128 + 64 bytes of 6-bit values, 16 int8 scales, then d


def _k_quant(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random `kind` blocks, uint8 [rows, cols / 256 * bytes]."""
    width, scales = K_QUANTS[kind]
    raw = rng.integers(0, 256, (rows * cols // 256, width), dtype=np.uint8)
    for at, value in scales.items():
        raw[:, at : at + 2] = np.full((len(raw), 1), value, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path: Path, types: tuple[str, ...] = ("Q8_0", "Q4_K"), seed: int = 0) -> Path:
    """A llama GGUF at `path` whose decoder-layer linears cycle through `types` (Q4_K, Q6_K, or any type
    gguf-py quantizes: Q8_0, Q5_0, Q4_0, ...)."""
    import gguf

    s, rng = SHAPES, np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_block_count(s["layers"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10_000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(s["vocab"])
    writer.add_tensor("token_embd.weight", rng.standard_normal((s["vocab"], s["hidden"])).astype(np.float32))
    writer.add_tensor("output.weight", rng.standard_normal((s["vocab"], s["hidden"])).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(s["hidden"], np.float32))
    kv = s["hidden"] // s["heads"] * s["kv_heads"]
    linears = {"attn_q": (s["hidden"], s["hidden"]), "attn_k": (kv, s["hidden"]), "attn_v": (kv, s["hidden"]),
               "attn_output": (s["hidden"], s["hidden"]), "ffn_gate": (s["intermediate"], s["hidden"]),
               "ffn_up": (s["intermediate"], s["hidden"]), "ffn_down": (s["hidden"], s["intermediate"])}
    for layer in range(s["layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(s["hidden"], np.float32))
        for j, (name, shape) in enumerate(linears.items()):
            kind = types[(layer + j) % len(types)]
            qtype = gguf.GGMLQuantizationType[kind]
            if kind in K_QUANTS:
                data = _k_quant(kind, *shape, rng)
            else:
                data = gguf.quants.quantize((rng.standard_normal(shape) * 0.1).astype(np.float32), qtype)
            writer.add_tensor(f"blk.{layer}.{name}.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
