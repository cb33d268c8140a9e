"""Private local weights: perturb the local layers from a secret seed, then distil them back to utility.

Each local layer's linear weights get a low-rank delta B @ A drawn from a generator seeded by the
organisation's secret. The deltas (not the base weights, and never a cloud layer) are then trained so that
the whole model's next-token distribution on the organisation's own text matches the original model's
(KL divergence), with the cloud layers frozen: the cloud shard is unchanged and still understands what
the new head sends. The merged weights replace the local layers in a new local shard whose manifest pins
their hashes and says they are private. Utility is measured on held-out text: perplexity and greedy
agreement (share of positions where the argmax equals the original model's).

The privacy this buys is empirical (the audit measures it under T1/T2), not cryptographic.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class PrivatizeConfig:
    head_layers: int = 2  # k: layers [0, k) are made private (must match the shard's split)
    tail_layers: int = 2  # m: layers [N-m, N) are made private
    rank: int = 8  # rank of each secret delta
    scale: float = 0.2  # initial ||delta||_F / ||W||_F: how far the secret start is from the public weights
    steps: int = 40  # distillation steps
    batch_chunks: int = 4
    seq_len: int = 96
    lr: float = 1e-3
    seed: int | None = None  # the secret; None draws one from the OS (never written anywhere)


class _Delta(nn.Module):
    """W x + B (A x): the public weight frozen, the secret low-rank delta trainable."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, generator: torch.Generator):
        super().__init__()
        self.base = base
        out_f, in_f = base.weight.shape
        a = torch.randn(rank, in_f, generator=generator)
        b = torch.randn(out_f, rank, generator=generator)
        # Scale the product so its Frobenius norm is `scale` times the base weight's.
        factor = math.sqrt(scale * base.weight.norm().item() / (b @ a).norm().item())
        self.a = nn.Parameter(a * factor)
        self.b = nn.Parameter(b * factor)

    def forward(self, x):
        return self.base(x) + (x @ self.a.T) @ self.b.T

    def merged(self) -> torch.Tensor:
        return self.base.weight + self.b @ self.a


def local_indices(model: nn.Module, config: PrivatizeConfig) -> list[int]:
    n = len(model.model.layers)
    if config.head_layers + config.tail_layers >= n:
        raise ConfigError(f"the model has {n} layers; head + tail layers must leave some for the cloud.")
    return list(range(config.head_layers)) + list(range(n - config.tail_layers, n))


def _install(model: nn.Module, indices: list[int], config: PrivatizeConfig, seed: int) -> list[tuple[nn.Module, str, _Delta]]:
    generator = torch.Generator().manual_seed(seed)
    installed = []
    for i in indices:
        for parent in (model.model.layers[i].self_attn, model.model.layers[i].mlp):
            for name in TARGETS:
                base = getattr(parent, name, None)
                if isinstance(base, nn.Linear):
                    delta = _Delta(base, config.rank, config.scale, generator)
                    setattr(parent, name, delta)
                    installed.append((parent, name, delta))
    return installed


@torch.no_grad()
def utility(reference: nn.Module, model: nn.Module, chunks: list[list[int]], perturb=None) -> dict:
    """Held-out perplexity of `model` (and of `reference`) and greedy agreement with `reference`."""
    from .collect import layer_outputs

    nll = ref_nll = agree = count = 0.0
    for tokens in chunks:
        ids = torch.tensor([tokens])
        ref_logits, _ = layer_outputs(reference, ids)
        logits, _ = layer_outputs(model, ids, perturb)
        target = ids[0, 1:]
        nll += nn.functional.cross_entropy(logits[:-1], target, reduction="sum").item()
        ref_nll += nn.functional.cross_entropy(ref_logits[:-1], target, reduction="sum").item()
        agree += (logits.argmax(-1) == ref_logits.argmax(-1)).sum().item()
        count += len(tokens)
    predicted = count - len(chunks)
    return {
        "perplexity": math.exp(nll / predicted),
        "reference_perplexity": math.exp(ref_nll / predicted),
        "greedy_agreement": agree / count,
        "n_tokens": int(count),
    }


def privatize_model(model: nn.Module, train_chunks: list[list[int]], config: PrivatizeConfig) -> tuple[nn.Module, dict]:
    """A copy of `model` whose local layers are private; returns (model, training record)."""
    import copy

    seed = config.seed if config.seed is not None else int.from_bytes(np.random.SeedSequence().entropy.to_bytes(16, "little")[:8], "little")
    reference = model
    private = copy.deepcopy(model)
    private.requires_grad_(False)
    indices = local_indices(private, config)
    installed = _install(private, indices, config, seed)
    params = [p for _, _, d in installed for p in (d.a, d.b)]
    opt = torch.optim.Adam(params, lr=config.lr)
    rng = np.random.default_rng(seed)
    windows = [c[: config.seq_len] for c in train_chunks if len(c) >= 16]
    if not windows:
        raise ConfigError("no training text long enough to privatize on; pass more of the organisation's text.")
    started, losses = time.perf_counter(), []
    private.train()
    for _step in range(config.steps):
        batch = [windows[i] for i in rng.choice(len(windows), size=min(config.batch_chunks, len(windows)), replace=False)]
        length = min(len(b) for b in batch)
        ids = torch.tensor([b[:length] for b in batch])
        with torch.no_grad():
            target = nn.functional.log_softmax(reference(input_ids=ids, use_cache=False).logits.float(), -1)
        logp = nn.functional.log_softmax(private(input_ids=ids, use_cache=False).logits.float(), -1)
        loss = nn.functional.kl_div(logp, target, log_target=True, reduction="batchmean") / length
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    private.eval()
    with torch.no_grad():
        shift = []
        for parent, name, delta in installed:
            merged = nn.Linear(delta.base.in_features, delta.base.out_features, bias=delta.base.bias is not None)
            merged.weight.copy_(delta.merged())
            if delta.base.bias is not None:
                merged.bias.copy_(delta.base.bias)
            shift.append((delta.merged() - delta.base.weight).norm().item() / delta.base.weight.norm().item())
            setattr(parent, name, merged.requires_grad_(False))
    record = {
        "layers": indices,
        "rank": config.rank,
        "scale": config.scale,
        "steps": config.steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "mean_relative_weight_change": float(np.mean(shift)),
        "seconds": time.perf_counter() - started,
    }
    return private.eval(), record


def write_private_shard(private: nn.Module, shards: Path, out: Path, record: dict) -> Path:
    """OUT/local (new private local weights, manifest pinning them) + OUT/cloud (copied unchanged)."""
    from ..model.shards import mark_private_local, read_manifest

    manifest = read_manifest(shards / "local", "local")
    split = manifest["split"]
    if record["layers"] != list(range(split["head_layers"])) + list(
        range(split["num_layers"] - split["tail_layers"], split["num_layers"])
    ):
        raise ConfigError(
            f"{shards} splits {split['head_layers']} + {split['tail_layers']} local layers; privatize with "
            "--head-layers/--tail-layers equal to the shard's split."
        )
    if out.exists():
        raise ConfigError(f"{out} exists; choose a new --out directory.")
    shutil.copytree(shards / "cloud", out / "cloud")
    shutil.copytree(shards / "local", out / "local")
    state = {k: v.contiguous() for k, v in private.state_dict().items()}
    mark_private_local(out / "local", state, record)
    return out
