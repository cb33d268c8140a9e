"""Private local weights: perturb the local layers from a secret seed, then distil them back to utility.

Each local layer's linear weights get a low-rank delta B @ A drawn from a generator seeded by the
organisation's secret. The deltas (not the base weights, and never a cloud layer) are then trained on the
organisation's own text so the model behaves like the original again (head: the state a few cloud layers
later matches; tail: the next-token distribution matches, KL), with the cloud layers frozen: the cloud
shard is unchanged and still understands what the new head sends. The merged weights replace the local layers in a new local shard whose manifest pins
their hashes and says they are private. Utility is measured on held-out text: perplexity and greedy
agreement (share of positions where the argmax equals the original model's).

The privacy this buys is empirical (the audit measures it under T1/T2), not cryptographic.
"""

from __future__ import annotations

import math
import shutil
import time
from contextlib import contextmanager
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
    steps: int = 40  # distillation steps per stage (head, then tail)
    batch_chunks: int = 4  # windows per step
    seq_len: int = 96  # tokens per window
    lr: float = 1e-3
    probe_layers: int = 2  # frozen cloud layers after the head whose output the head stage matches
    pool_windows: int = 32  # training windows; their original-model states are computed once
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


@contextmanager
def _only_layers(model: nn.Module, indices: list[int]):
    """Run `model` with only its decoder layers `indices` (the rest skipped); restored on every exit path."""
    full = model.model.layers
    model.model.layers = nn.ModuleList([full[i] for i in indices])
    try:
        yield
    finally:
        model.model.layers = full


def _last_output(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, L] -> output of the model's last (possibly truncated) decoder layer [B, L, d], with grad."""
    seen = []
    handle = model.model.layers[-1].register_forward_hook(lambda _m, _i, out: seen.append(out[0] if isinstance(out, tuple) else out))
    try:
        model.model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    return seen[0]


def privatize_model(model: nn.Module, train_chunks: list[list[int]], config: PrivatizeConfig) -> tuple[nn.Module, dict]:
    """A copy of `model` whose local layers are private; returns (model, training record).

    Distillation runs in two stages, each `config.steps` steps, so that no step needs the whole model
    (a full forward + backward per step made a useful number of steps cost many minutes on a CPU):
      head: the private layers [0, k) plus `probe_layers` frozen cloud layers are trained so that the
            probe's output matches the original model's (relative squared error per position);
      tail: with the trained head, the state the cloud returns is computed once per training window; the
            private layers [N-m, N) (+ norm + LM head, frozen) are trained so that the next-token
            distribution matches the original model's (KL), which also absorbs what the head left.
    """
    import copy

    seed = config.seed if config.seed is not None else int.from_bytes(np.random.SeedSequence().entropy.to_bytes(16, "little")[:8], "little")
    reference = model
    private = copy.deepcopy(model)
    private.requires_grad_(False)
    indices = local_indices(private, config)
    installed = _install(private, indices, config, seed)
    rng = np.random.default_rng(seed)
    windows = [c[: config.seq_len] for c in train_chunks if len(c) >= 16]
    if not windows:
        raise ConfigError("no training text long enough to privatize on; pass more of the organisation's text.")
    pool = [windows[i] for i in rng.permutation(len(windows))[: config.pool_windows]]
    n, k, m = len(private.model.layers), config.head_layers, config.tail_layers
    probe = min(k + config.probe_layers, n - m)
    layers = private.model.layers
    per_layer = {i: [d for parent, _, d in installed if parent in (layers[i].self_attn, layers[i].mlp)] for i in indices}
    started = time.perf_counter()
    ref_probe, ref_tail_in = _reference_states(reference, pool, probe, n - m)
    stage = _Stage(private, pool, rng, config)
    head_losses = stage.train_head(ref_probe, [d for i in range(k) for d in per_layer[i]], probe) if k else []
    tail_losses = stage.train_tail(reference, ref_tail_in, [d for i in range(n - m, n) for d in per_layer[i]], n - m) if m else []
    shift = _merge(installed)
    last = tail_losses or head_losses or [float("nan")]
    record = {
        "layers": indices,
        "rank": config.rank,
        "scale": config.scale,
        "steps": config.steps,
        "objective": f"head: relative error after {probe} layers; tail: next-token KL",
        "head_loss": [head_losses[0], head_losses[-1]] if head_losses else None,
        "tail_loss": [tail_losses[0], tail_losses[-1]] if tail_losses else None,
        "first_loss": last[0],
        "last_loss": last[-1],
        "pool_windows": len(pool),
        "mean_relative_weight_change": float(np.mean(shift)),
        "seconds": time.perf_counter() - started,
    }
    return private.eval(), record


def _reference_states(reference: nn.Module, pool: list[list[int]], probe: int, tail_start: int) -> tuple[list, list]:
    """Per pool window, the original model's [1, L, d] states after `probe` layers and entering the tail."""
    from .collect import layer_outputs

    ref_probe, ref_tail_in = [], []
    for w in pool:
        _, hidden = layer_outputs(reference, torch.tensor([w]))
        ref_probe.append(hidden[probe - 1][None].clone())
        ref_tail_in.append(hidden[tail_start - 1][None].clone())
    return ref_probe, ref_tail_in


class _Stage:
    """One distillation stage's loop: batches of pool windows drawn from the secret-seeded `rng`, Adam on the deltas."""

    def __init__(self, private: nn.Module, pool: list[list[int]], rng: np.random.Generator, config: PrivatizeConfig):
        self.private, self.pool, self.rng, self.config = private, pool, rng, config

    def _batches(self):
        for _ in range(self.config.steps):
            idx = self.rng.choice(len(self.pool), size=min(self.config.batch_chunks, len(self.pool)), replace=False)
            yield idx, min(len(self.pool[i]) for i in idx)

    def _train(self, deltas: list[_Delta], loss_of) -> list[float]:
        opt, losses = torch.optim.Adam([p for d in deltas for p in (d.a, d.b)], lr=self.config.lr), []
        self.private.train()
        for idx, length in self._batches():
            loss = loss_of(idx, length)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        self.private.eval()
        return losses

    def train_head(self, ref_probe: list, deltas: list[_Delta], probe: int) -> list[float]:
        """Train the head's deltas so the state after `probe` layers matches the original's (relative squared error)."""

        def head_loss(idx, length):
            ids = torch.tensor([self.pool[i][:length] for i in idx])
            target = torch.cat([ref_probe[i][:, :length] for i in idx])
            got = _last_output(self.private, ids)
            return (((got - target) ** 2).sum(-1) / (target**2).sum(-1).clamp_min(1e-6)).mean()

        with _only_layers(self.private, list(range(probe))):
            return self._train(deltas, head_loss)

    def train_tail(self, reference: nn.Module, ref_tail_in: list, deltas: list[_Delta], tail_start: int) -> list[float]:
        """Train the tail's deltas so the next-token distribution from the trained head's state matches the original's (KL)."""
        from .collect import layer_outputs

        private = self.private
        with torch.no_grad():
            tail_in = [layer_outputs(private, torch.tensor([w]))[1][tail_start - 1][None].clone() for w in self.pool]
        tail = list(range(tail_start, len(private.model.layers)))

        def tail_loss(idx, length):
            h_ref = torch.cat([ref_tail_in[i][:, :length] for i in idx])
            h = torch.cat([tail_in[i][:, :length] for i in idx])
            with torch.no_grad():
                target = nn.functional.log_softmax(reference(inputs_embeds=h_ref, use_cache=False).logits.float(), -1)
            logp = nn.functional.log_softmax(private(inputs_embeds=h, use_cache=False).logits.float(), -1)
            return nn.functional.kl_div(logp, target, log_target=True, reduction="batchmean") / length

        with _only_layers(private, tail), _only_layers(reference, tail):
            return self._train(deltas, tail_loss)


@torch.no_grad()
def _merge(installed: list[tuple[nn.Module, str, _Delta]]) -> list[float]:
    """Replace every delta by one plain Linear holding W + B A; returns each weight's relative change."""
    shift = []
    for parent, name, delta in installed:
        merged = nn.Linear(delta.base.in_features, delta.base.out_features, bias=delta.base.bias is not None)
        merged.weight.copy_(delta.merged())
        if delta.base.bias is not None:
            merged.bias.copy_(delta.base.bias)
        shift.append((delta.merged() - delta.base.weight).norm().item() / delta.base.weight.norm().item())
        setattr(parent, name, merged.requires_grad_(False))
    return shift


def write_private_shard(private: nn.Module, shards: Path, out: Path, record: dict) -> Path:
    """OUT/local (new private local weights, manifest pinning them) + OUT/cloud (copied unchanged)."""
    from safetensors.torch import load_file

    from ..model.manifest import WEIGHTS, mark_private_local, read_manifest
    from ..model.prepare import restored_layers

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
    stored = load_file(str(out / "local" / WEIGHTS))
    tokenizer = None
    if manifest.get("has_tokenizer"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(shards / "local", local_files_only=True)
    # int8/int4 local layers are quantized again from the private float weights (int8 calibrated on them)
    mark_private_local(out / "local", restored_layers(private, stored, tokenizer), record)
    return out
