"""Sizing a split from a model's config alone: memory per side, KV per token, bytes on the wire.

    splitinfer bench plan --config mistral-7b-v0.1 --head-layers 2 --tail-layers 2 --dtype float16 [--json]

For models too large to run here. Parameter counts follow the HF layouts of Llama, Mistral and Qwen2
decoder layers (q/k/v/o projections with grouped KV heads, a gated MLP, two RMSNorms per layer); the
wire sizes are the real codec's (a Step and a Result encoded with wire.messages), not a formula. It knows
nothing about a running server: the message limit and compute rates are inputs, printed as assumptions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from ..errors import ConfigError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
PACKAGED_CONFIGS = ("mistral-7b-v0.1", "mistral-nemo-12b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b")
KNOWN_TYPES = ("llama", "mistral", "qwen2")
DEFAULT_MESSAGE_BYTES = 16 * 1024 * 1024  # `splitinfer serve --max-message-mb 16`
PREFILL_CHUNK = 512  # ClientConfig.prefill_chunk
SERVER_MAX_BLOCK_ROWS = 1024  # SessionConfig.max_block_rows: rows per Step a default server accepts


@dataclass(frozen=True)
class Architecture:
    model_type: str
    vocab: int
    hidden: int  # d
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool  # LM head shares the embedding matrix
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_positions: int | None
    sliding_window: int | None

    @classmethod
    def from_config(cls, cfg: dict) -> "Architecture":
        model_type = cfg.get("model_type")
        if model_type not in KNOWN_TYPES:
            raise ConfigError(f"plan knows the {', '.join(KNOWN_TYPES)} layouts; this config's model_type is {model_type!r}.")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            attention_bias = bool(cfg.get("attention_bias", False))
            return cls(
                model_type=model_type,
                vocab=int(cfg["vocab_size"]),
                hidden=hidden,
                intermediate=int(cfg["intermediate_size"]),
                layers=int(cfg["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                tied=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases and no o bias; Llama's attention_bias covers all four.
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=model_type != "qwen2" and attention_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                max_positions=cfg.get("max_position_embeddings"),
                sliding_window=cfg.get("sliding_window"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"the config lacks or mangles a field plan needs ({exc}); give a HF config.json.") from exc

    def layer_params(self) -> int:
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0) + (d if self.o_bias else 0)
        mlp = 3 * d * self.intermediate + (2 * self.intermediate + d if self.mlp_bias else 0)
        return attention + mlp + 2 * d  # + input and post-attention RMSNorm

    def embedding_params(self) -> int:
        return self.vocab * self.hidden


def load_config(name_or_path: str) -> tuple[str, dict]:
    """A packaged config by name (see PACKAGED_CONFIGS) or a config.json path -> (label, dict)."""
    if name_or_path in PACKAGED_CONFIGS:
        text = resources.files("splitinfer.data").joinpath(f"configs/{name_or_path}.json").read_text()
        return name_or_path, json.loads(text)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return path.stem if path.name != "config.json" else path.parent.name, json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(
            f"cannot read {path}: {exc.strerror}; give a config.json or one of {', '.join(PACKAGED_CONFIGS)}."
        ) from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON ({exc}).") from exc


def message_bytes(rows: int, hidden: int, dtype: str, first_position: int, kind: str) -> float:
    """Exact size of a chain Step (or its Result) of `rows` rows, from the real encoder.

    Encodes a 1-column tensor and adds the missing columns: the header differs only in the width's digits.
    A block whose header (its positions list) exceeds the 64 KiB header limit cannot be sent: infinity.
    """
    import torch

    from ..errors import MessageTooLarge
    from ..masks import BlockStructure
    from ..wire.messages import Result, Step

    narrow = torch.zeros(rows, 1)
    try:
        if kind == "step":
            keep = (0,) if first_position else ()
            positions = tuple(range(first_position, first_position + rows))
            data = Step(7, keep, positions, BlockStructure.chain(), narrow, dtype).encode()
        else:
            data = Result(7, narrow, 12.3456, 12.3456, first_position, dtype).encode()
    except MessageTooLarge:
        return float("inf")
    return len(data) + rows * (hidden - 1) * DTYPE_BYTES[dtype] + len(str(hidden)) - 1


def max_rows_in_message(hidden: int, dtype: str, limit: int) -> int:
    """The most prompt rows one Step (and its Result) can carry under a byte limit (binary search)."""
    lo, hi = 0, min(limit // (hidden * DTYPE_BYTES[dtype]) + 1, 1 << 17)  # the header limit binds below 2^17
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = max(message_bytes(mid, hidden, dtype, 0, k) for k in ("step", "result")) <= limit
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo


@dataclass(frozen=True)
class Rates:
    """Assumed hardware rates for the round-trip-to-compute ratio (decode is a roofline: the slower of
    arithmetic and reading the weights once)."""

    rtt_ms: float = 80.0
    cloud_tflops: float = 400.0  # effective dense rate of the cloud accelerator
    cloud_gbps: float = 3350.0  # its memory bandwidth, GB/s
    local_tflops: float = 20.0
    local_gbps: float = 400.0


def plan(cfg: dict, head: int = 2, tail: int = 2, dtype: str = "float16", wire_dtype: str | None = None,
         message_limit: int = DEFAULT_MESSAGE_BYTES, rates: Rates = Rates()) -> dict:
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}.")
    arch = Architecture.from_config(cfg)
    wire_dtype = wire_dtype or dtype
    if head < 1 or tail < 1 or head + tail >= arch.layers:
        raise ConfigError(f"need head >= 1, tail >= 1 and head + tail < {arch.layers} layers; got {head} + {tail}.")
    width = DTYPE_BYTES[dtype]
    local_layers, cloud_layers = head + tail, arch.layers - head - tail
    embed = arch.embedding_params()
    local_params = embed * (1 if arch.tied else 2) + local_layers * arch.layer_params() + arch.hidden
    cloud_params = cloud_layers * arch.layer_params()
    kv_per_layer = 2 * arch.kv_heads * arch.head_dim * width  # K and V of one token
    up1, down1 = (message_bytes(1, arch.hidden, wire_dtype, 1000, k) for k in ("step", "result"))
    chunk = sum(message_bytes(PREFILL_CHUNK, arch.hidden, wire_dtype, 0, k) for k in ("step", "result"))

    def decode_ms(params: int, tflops: float, gbps: float) -> float:
        return max(2 * params / (tflops * 1e12), params * width / (gbps * 1e9)) * 1e3

    cloud_ms = decode_ms(cloud_params, rates.cloud_tflops, rates.cloud_gbps)
    local_ms = decode_ms(local_params - embed, rates.local_tflops, rates.local_gbps)  # the lookup reads one row
    return {
        "architecture": asdict(arch),
        "split": {"head_layers": head, "tail_layers": tail, "cloud_layers": cloud_layers, "dtype": dtype,
                  "wire_dtype": wire_dtype},
        "total_params": local_params + cloud_params,
        "local_params": local_params,
        "cloud_params": cloud_params,
        "local_weight_bytes": local_params * width,
        "cloud_weight_bytes": cloud_params * width,
        "local_kv_bytes_per_token": local_layers * kv_per_layer,
        "cloud_kv_bytes_per_token": cloud_layers * kv_per_layer,
        "hidden_state_bytes": arch.hidden * DTYPE_BYTES[wire_dtype],
        "wire_bytes_per_decode_token": up1 + down1,
        "wire_bytes_per_decode_token_up_down": [up1, down1],
        "wire_bytes_per_prefill_token": round(chunk / PREFILL_CHUNK, 2),
        "message_limit_bytes": message_limit,
        # one message: the byte limit, the 64 KiB header (positions list) and the server's row limit all bound it
        "max_unchunked_prompt_tokens": min(max_rows_in_message(arch.hidden, wire_dtype, message_limit), SERVER_MAX_BLOCK_ROWS),
        "max_rows_by_message_bytes": max_rows_in_message(arch.hidden, wire_dtype, message_limit),
        "max_rows_by_header": max_rows_in_message(1, wire_dtype, 1 << 40),
        "server_max_block_rows": SERVER_MAX_BLOCK_ROWS,
        "assumed_rates": asdict(rates),
        "cloud_ms_per_decode_token": round(cloud_ms, 4),
        "local_ms_per_decode_token": round(local_ms, 4),
        "rtt_to_compute_ratio": round(rates.rtt_ms / (cloud_ms + local_ms), 2),
    }


# The original paper's figures for 2 + 2 local layers in float16, and why ours differ where they do.
PAPER_FIGURES = {
    "mistral-7b-v0.1": (2.0e9, "the paper's 2.0 GB matches 4 layers + one vocab matrix (2.01 GB); Mistral 7B "
                        "does not tie its LM head to the embedding, so a local side holding both needs 2.27 GB"),
    "mistral-nemo-12b": (4.9e9, "matches: 4 layers + embedding + untied LM head"),
}


def paper_check(label: str, result: dict) -> str | None:
    if label not in PAPER_FIGURES or result["split"]["head_layers"] != 2 or result["split"]["tail_layers"] != 2:
        return None
    figure, why = PAPER_FIGURES[label]
    ours = result["local_weight_bytes"]
    return (f"paper: local memory {figure / 1e9:.1f} GB; here {ours / 1e9:.2f} GB ({ours / 2**30:.2f} GiB), "
            f"{(ours - figure) / figure:+.0%}: {why}.")


def text_report(label: str, r: dict) -> str:
    gb = lambda n: f"{n / 1e9:.2f} GB ({n / 2**30:.2f} GiB)"  # noqa: E731
    s, rates = r["split"], r["assumed_rates"]
    lines = [
        f"{label}: {r['architecture']['layers']} layers, d={r['architecture']['hidden']}, {r['total_params'] / 1e9:.2f} B "
        f"parameters; local {s['head_layers']} + {s['tail_layers']} layers, cloud {s['cloud_layers']}; {s['dtype']} weights",
        f"  local weights        {gb(r['local_weight_bytes'])}",
        f"  cloud weights        {gb(r['cloud_weight_bytes'])}",
        f"  KV per token         local {r['local_kv_bytes_per_token']} B, cloud {r['cloud_kv_bytes_per_token']} B",
        f"  hidden state         {r['hidden_state_bytes']} B ({s['wire_dtype']})",
        f"  wire per decode token {r['wire_bytes_per_decode_token']} B (up {r['wire_bytes_per_decode_token_up_down'][0]}, "
        f"down {r['wire_bytes_per_decode_token_up_down'][1]})",
        f"  wire per prefill token {r['wire_bytes_per_prefill_token']} B (both ways, {PREFILL_CHUNK}-row chunks)",
        f"  longest unchunked prompt {r['max_unchunked_prompt_tokens']} tokens (bounds: {r['max_rows_by_message_bytes']} in one "
        f"{r['message_limit_bytes']}-byte message, {r['max_rows_by_header']} by the 64 KiB header alone, "
        f"{r['server_max_block_rows']} rows per step on a default server)",
        f"  decode compute (assumed {rates['cloud_tflops']:g} TFLOP/s, {rates['cloud_gbps']:g} GB/s cloud; "
        f"{rates['local_tflops']:g} TFLOP/s, {rates['local_gbps']:g} GB/s local): cloud {r['cloud_ms_per_decode_token']} ms, "
        f"local {r['local_ms_per_decode_token']} ms per token",
        f"  round trip / compute at {rates['rtt_ms']:g} ms: {r['rtt_to_compute_ratio']}x",
    ]
    check = paper_check(label, r)
    if check:
        lines.append("  " + check)
    return "\n".join(lines)
