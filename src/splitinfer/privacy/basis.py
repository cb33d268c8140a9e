"""A secret residual basis per deployment: the same function, computed in coordinates only the client knows.

The residual stream of a pre-norm decoder is only ever read through RMSNorm (which sees its length, and
so is blind to an orthogonal change of basis once its gain is moved into the next linear layer) and
written by o_proj and down_proj. So for a random orthogonal Q (d x d) the model with

    embedding E Q;  per layer  W_{q,k,v} diag(g_in) Q,  Q^T W_o,  W_{gate,up} diag(g_post) Q,  Q^T W_down;
    final norm gain ones;  LM head W_lm diag(g_final) Q;  every RMSNorm gain on the stream set to ones

carries h Q wherever the public model carries h, and computes the same logits (float32: the same greedy
tokens). On top, each layer's attention heads (kv heads together with their query groups, so GQA holds)
and MLP neurons are permuted at random: the cloud layers are then no longer the public tensors even up
to Q. The runtime is untouched: the transformed model is an ordinary HF model of the same architecture
(untied: the LM head and the embedding no longer share a matrix).

With `key="linear"` the orthogonal Q becomes a general invertible A = Q S V^T (S: singular values spread
over a chosen condition number; V: block diagonal orthogonal): the stream carries h A, which no longer
keeps inner products or norms. o_proj, down_proj and the embedding take A (A^T W_o, A^T W_down, E A);
every stream RMSNorm becomes a model.keyed_norm.KeyedRMSNorm that maps h A through the block-diagonal
factor F = V S^-1 (h A F = h Q) before a plain RMSNorm, so the layers that read it take W diag(g) Q as
under an orthogonal basis. The runtime loads such shards through model.keyed_norm.install; the extra cost
is the factor: d * block multiply-adds per norm and token.

What it protects, and from whom, is measured by the audit (threats T3-T5, docs/privacy.md): a party that
sees activations but not the cloud shard faces h Q instead of h; the host holding the cloud shard can
recover Q by matching its weights against the public ones.

A learned draft head in the public local shard (model/drafthead.py) reads and writes the same stream, so
`write_basis_shards` re-bases it with the key (`rebase_head`: the same folding, into the head's fc layer,
norms and projections) and writes it into the new local shard, recorded as made for this basis: it drafts
what it drafted before, at no extra cost per step beyond the keyed norms', and it and the key stay local.
This module knows HF Llama-style models and nothing about the wire; `write_basis_shards` hands the result
to model.prepare.prepare.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError
from ..model.keyed_norm import replace_norm, stream_norms

# Pre-norm decoders whose every stream read is an RMSNorm with a plain gain (Gemma's (1 + w) gains and
# sandwich norms after o_proj/down_proj are not foldable this way).
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


KEYS = ("orthogonal", "linear")


@dataclass(frozen=True)
class BasisConfig:
    permute_heads: bool = True  # permute attention heads per layer (kv heads with their query groups)
    permute_neurons: bool = True  # permute MLP neurons per layer
    seed: int | None = None  # the secret; None draws one from the OS (never written anywhere)
    key: str = "linear"  # "linear": a general invertible A (keyed RMSNorms); "orthogonal": a rotation Q (keeps inner products)
    condition: float = 8.0  # linear key: condition number of A (its largest over its smallest singular value)
    metric_block: int = 64  # linear key: block size of the norms' factor (d * block multiply-adds per norm)

    def __post_init__(self):
        if self.key not in KEYS:
            raise ConfigError(f"--key must be one of {', '.join(KEYS)}, not {self.key!r}.")
        if self.condition < 1:
            raise ConfigError(f"--condition is a condition number and must be at least 1, not {self.condition}.")
        if self.metric_block < 1:
            raise ConfigError(f"--metric-block must be a positive block size, not {self.metric_block}.")


@dataclass
class Basis:
    """The secret of one deployment (held in memory only: the local shard's weights imply it anyway)."""

    a: torch.Tensor  # [d, d] float64 key: public state h becomes h @ a (orthogonal unless key="linear")
    head_perms: list[torch.Tensor]  # per layer: [n_kv] new kv head j holds old kv head perm[j]
    neuron_perms: list[torch.Tensor]  # per layer: [intermediate] new neuron j is old neuron perm[j]
    factor: torch.Tensor | None = None  # linear key: [n, b, b] float64 blocks of F, |h a F| = |h|

    @property
    def q(self) -> torch.Tensor:
        """The key of an orthogonal basis (kept under its usual name)."""
        return self.a

    @property
    def inverse(self) -> torch.Tensor:
        """[d, d] float64 map from the keyed basis back to the public one."""
        return torch.linalg.inv(self.a)

    @property
    def read(self) -> torch.Tensor:
        """[d, d] float64: what a layer after a stream norm folds in (A, or A F = Q under a linear key)."""
        return self.a if self.factor is None else self.a @ torch.block_diag(*self.factor)

    @property
    def identity(self) -> str:
        """A name for this key in the local manifest, which a draft head re-based with it records too (a
        one-way hash of the key; both stay on the trusted side)."""
        digest = hashlib.sha256(b"splitinfer residual basis\n" + self.a.contiguous().numpy().tobytes())
        return digest.hexdigest()[:32]


def secret_seed(seed: int | None) -> int:
    if seed is not None:
        return seed
    return int.from_bytes(np.random.SeedSequence().entropy.to_bytes(16, "little")[:8], "little")


def random_orthogonal(d: int, generator: torch.Generator) -> torch.Tensor:
    """A Haar-random [d, d] orthogonal matrix (QR of a Gaussian, signs fixed by R's diagonal), float64."""
    q, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None]


def metric_block(d: int, wanted: int) -> int:
    """The largest divisor of d that is at most `wanted` (the factor's blocks must tile the stream)."""
    return max(b for b in range(1, min(d, wanted) + 1) if d % b == 0)


def linear_key(d: int, condition: float, block: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random invertible key A = Q S V^T and the blocks of F = V S^-1 (so |h A F| = |h|), float64.

    Q: Haar orthogonal [d, d]; S: singular values log-uniform in [c^-1/2, c^1/2] with both ends present, so
    cond(A) = c; V: block diagonal with Haar orthogonal [block, block] blocks. Returns (A [d, d], F [n, b, b]).
    """
    q = random_orthogonal(d, generator)
    half = 0.5 * float(np.log(condition))
    log_s = (torch.rand(d, generator=generator, dtype=torch.float64) * 2 - 1) * half
    log_s[0], log_s[1] = -half, half
    s = torch.exp(log_s)
    blocks = torch.stack([random_orthogonal(block, generator) for _ in range(d // block)])  # [n, b, b]
    factor = blocks / s.reshape(-1, 1, block)  # F_j = V_j diag(1/s_j): columns scaled
    v_t = torch.block_diag(*blocks).T
    return q @ (s[:, None] * v_t), factor


def check_supported(model: nn.Module) -> None:
    kind = getattr(model.config, "model_type", "?")
    if kind not in SUPPORTED:
        raise ConfigError(
            f"a secret residual basis needs a pre-norm decoder with plain RMSNorm gains ({', '.join(SUPPORTED)}); "
            f"this model is {kind!r}. Use a supported family or leave out --basis."
        )


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _query_order(kv_perm: torch.Tensor, group: int, generator: torch.Generator) -> torch.Tensor:
    """Query heads in the order their kv heads were permuted; within a group, a random order too."""
    order = [int(kv) * group + int(i) for kv in kv_perm for i in torch.randperm(group, generator=generator)]
    return torch.tensor(order)


def _rows(perm: torch.Tensor, size: int) -> torch.Tensor:
    """Row indices that move blocks of `size` rows into the order `perm`."""
    return (perm[:, None] * size + torch.arange(size)[None]).reshape(-1)


def _set(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    linear.weight.data = weight.to(linear.weight.dtype).contiguous()
    if bias is not None:
        linear.bias.data = bias.to(linear.bias.dtype).contiguous()


def _fold_attention(attn: nn.Module, gain: torch.Tensor, key: tuple, config, perm: torch.Tensor | None,
                    generator: torch.Generator) -> None:
    """key = (A, R): W_{q,k,v} <- W diag(g) R (rows permuted by head), W_o <- A^T W_o (columns permuted),
    bias_o <- b A. R = A for an orthogonal key; R = A F under a linear key, whose norms hand on h A F."""
    a, read = key
    hd, group = _head_dim(config), config.num_attention_heads // config.num_key_value_heads
    kv_rows = q_rows = None
    if perm is not None:
        kv_rows = _rows(perm, hd)
        q_rows = _rows(_query_order(perm, group, generator), hd)
    for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
        lin = getattr(attn, name)
        w = lin.weight.double() * gain[None] @ read  # [out, d]
        b = lin.bias.double() if lin.bias is not None else None
        if rows is not None:
            w, b = w[rows], (b[rows] if b is not None else None)
        _set(lin, w, b)
    o = attn.o_proj
    w = a.T @ o.weight.double()  # [d, heads*hd]
    if q_rows is not None:
        w = w[:, q_rows]
    _set(o, w, o.bias.double() @ a if o.bias is not None else None)


def _fold_mlp(mlp: nn.Module, gain: torch.Tensor, key: tuple, perm: torch.Tensor | None) -> None:
    a, read = key
    for name in ("gate_proj", "up_proj"):
        lin = getattr(mlp, name)
        w = lin.weight.double() * gain[None] @ read
        b = lin.bias.double() if lin.bias is not None else None
        if perm is not None:
            w, b = w[perm], (b[perm] if b is not None else None)
        _set(lin, w, b)
    down = mlp.down_proj
    w = a.T @ down.weight.double()
    if perm is not None:
        w = w[:, perm]
    _set(down, w, down.bias.double() @ a if down.bias is not None else None)


def _take_gain(model: nn.Module, name: str, factor: torch.Tensor | None) -> torch.Tensor:
    """The stream norm `name`'s gain (float64); the norm is left gainless: ones, or keyed by `factor`."""
    norm = stream_norms(model)[name]
    gain = norm.weight.detach().double().clone()
    if factor is None:
        norm.weight.data = torch.ones_like(norm.weight)
    else:
        keyed = replace_norm(model, name, factor.shape[-1], dtype=norm.weight.dtype)
        keyed.factor.data = factor.to(norm.weight.dtype)
    return gain


def _draw_key(d: int, config: BasisConfig, generator: torch.Generator):
    """(A, R, F or None) in float64: the stream carries h A, the layers after a norm read h R (orthogonal)."""
    if config.key == "orthogonal":
        q = random_orthogonal(d, generator)
        return q, q, None
    a, factor = linear_key(d, config.condition, metric_block(d, config.metric_block), generator)
    return a, a @ torch.block_diag(*factor), factor  # the norms hand on h A F = h Q


@torch.no_grad()
def apply_basis(model: nn.Module, config: BasisConfig = BasisConfig()) -> tuple[nn.Module, Basis, dict]:
    """A copy of `model` in a secret residual basis; returns (model, the secret, a record for the manifest).

    Arithmetic is float64, so the float32 result differs from the public model by rounding only.
    """
    check_supported(model)
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(secret_seed(config.seed))
    out = copy.deepcopy(model)
    cfg = out.config
    d = cfg.hidden_size
    a, read, factor = _draw_key(d, config, generator)
    embed = out.model.embed_tokens
    lm_weight = out.lm_head.weight.detach().double().clone()
    embed.weight.data = (embed.weight.double() @ a).to(embed.weight.dtype)
    head_perms, neuron_perms = [], []
    for i, layer in enumerate(out.model.layers):
        hp = torch.randperm(cfg.num_key_value_heads, generator=generator) if config.permute_heads else None
        np_ = torch.randperm(cfg.intermediate_size, generator=generator) if config.permute_neurons else None
        gain = _take_gain(out, f"model.layers.{i}.input_layernorm", factor)
        _fold_attention(layer.self_attn, gain, (a, read), cfg, hp, generator)
        _fold_mlp(layer.mlp, _take_gain(out, f"model.layers.{i}.post_attention_layernorm", factor), (a, read), np_)
        head_perms.append(hp if hp is not None else torch.arange(cfg.num_key_value_heads))
        neuron_perms.append(np_ if np_ is not None else torch.arange(cfg.intermediate_size))
    final_gain = _take_gain(out, "model.norm", factor)
    # The embedding became E A but the head needs W diag(g) R: the two no longer share one matrix.
    out.lm_head.weight = nn.Parameter((lm_weight * final_gain[None] @ read).to(embed.weight.dtype), requires_grad=False)
    cfg.tie_word_embeddings = False
    record = {
        "method": "orthogonal residual basis with RMSNorm gains folded",
        "permute_heads": config.permute_heads,
        "permute_neurons": config.permute_neurons,
        "seconds": round(time.perf_counter() - started, 2),
    }
    if factor is not None:
        record.update(method="linear key with keyed RMSNorms (the stream through a block-diagonal factor, "
                             "then RMSNorm)",
                      condition=config.condition, metric_block=int(factor.shape[-1]),
                      condition_measured=round(float(torch.linalg.cond(a)), 3))
    return out.eval(), Basis(a, head_perms, neuron_perms, factor), record


# The draft head's linear layers by the stream norm they read after (the gain folded into them), and the
# layers that write its stream.
HEAD_READS = {"input_norm": ("q_proj", "k_proj", "v_proj"), "post_norm": ("gate_proj", "up_proj")}
HEAD_WRITES = ("o_proj", "down_proj")


@torch.no_grad()
def rebase_head(tensors: dict[str, torch.Tensor], secret: Basis) -> dict[str, torch.Tensor]:
    """A public draft head's state dict (model/drafthead.py) -> the same head in the basis of `secret`, float32.

    The head reads features f and embeddings e, which the keyed shard hands it as f A and e A, and its
    prediction x is read out through the keyed final norm and LM head, which expect x A. So its own stream
    is carried as x A: fc [W1 | W2] -> [A^T W1 A^-T | A^T W2 A^-T] and bias b A (a fused head's `fuse`
    blocks alike: it reads hidden states of the same stream); every layer after one of
    its norms takes W diag(g) R and the norm loses its gain (a keyed norm with the key's factor under a
    linear key); o_proj and down_proj take A^T W. Float64 arithmetic, so only rounding separates the two.
    """
    a, read = secret.a, secret.read
    d = a.shape[0]
    fc = tensors["fc.weight"].double()  # [d, 2d]: features, then the token's embedding
    if fc.shape != (d, 2 * d) or any(f"{norm}.weight" not in tensors for norm in HEAD_READS):
        raise ConfigError("this draft head is not a public head for this model (its shapes differ or its norms are "
                          "keyed); re-base a head from the public shards, or `splitinfer prepare` again.")
    inv_t = torch.linalg.inv(a).T
    out = {"fc.weight": torch.cat([a.T @ fc[:, :d] @ inv_t, a.T @ fc[:, d:] @ inv_t], dim=1),
           "fc.bias": tensors["fc.bias"].double() @ a}
    if "fuse.weight" in tensors:  # hidden states of the keyed stream (x A) in, a feature correction (y A) out
        fuse = tensors["fuse.weight"].double()
        out["fuse.weight"] = torch.cat([a.T @ block @ inv_t for block in fuse.split(d, dim=1)], dim=1)
    for norm, readers in HEAD_READS.items():
        gain = tensors[f"{norm}.weight"].double()
        for name in readers:
            out[f"{name}.weight"] = tensors[f"{name}.weight"].double() * gain[None] @ read
        if secret.factor is None:
            out[f"{norm}.weight"] = torch.ones_like(gain)
        else:
            out[f"{norm}.factor"] = secret.factor
    for name in HEAD_WRITES:
        out[f"{name}.weight"] = a.T @ tensors[f"{name}.weight"].double()
    return {k: v.float() for k, v in out.items()}


def carry_draft_head(public_local: Path, keyed_local: Path, secret: Basis) -> str:
    """Re-base the draft head installed in `public_local` (if any) into `keyed_local`, a local shard keyed
    with `secret`; a sentence saying what happened. The rest of the drafter folder is copied as it is."""
    from ..model.drafthead import DRAFTER_DIR, HEAD_CONFIG, head_basis, read_head_info, read_head_tensors, write_head
    from ..model.manifest import PUBLIC_BASIS, basis_identity, model_identity, read_manifest

    source = public_local / DRAFTER_DIR
    if not (source / HEAD_CONFIG).is_file():
        return f"no draft head in {public_local} to carry over; the tree drafts without one."
    info, public = read_head_info(source), read_manifest(public_local, "local")
    if info.get("model_fingerprint") != model_identity(public) or head_basis(info) != PUBLIC_BASIS:
        return f"the draft head in {source} is not for this model's public basis; it was left out."
    keyed = read_manifest(keyed_local, "local")
    tensors, draft_vocab = read_head_tensors(source)
    target = keyed_local / DRAFTER_DIR
    shutil.copytree(source, target)
    write_head(target, rebase_head(tensors, secret), draft_vocab,
               {**info, "model_fingerprint": model_identity(keyed), "basis": basis_identity(keyed)})
    return f"re-based the draft head with the key into {target} (it stays on this machine)."


def write_basis_shards(model: nn.Module, secret: Basis, shards: Path, out: Path, record: dict) -> tuple[Path, str]:
    """OUT/local and OUT/cloud for `model` (keyed with `secret` by apply_basis), with the split, dtype and
    tokenizer of the prepared `shards`, and the draft head of `shards` re-based with the key. Both shards are
    new: the cloud shard belongs to this deployment only. Returns OUT and a sentence about the draft head."""
    from transformers import AutoTokenizer

    from ..model.formats import WeightFormats
    from ..model.manifest import model_identity, read_manifest
    from ..model.prepare import prepare
    from ..model.source import SourceModel

    if out.exists():
        raise ConfigError(f"{out} exists; choose a new --out directory.")
    manifest = read_manifest(shards / "local", "local")
    split = manifest["split"]
    tokenizer = None
    if manifest.get("has_tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(shards / "local", local_files_only=True)
    head_range = split.get("head_range")
    prepare(
        SourceModel(manifest["model_id"], model.config, model, tokenizer), out,
        head_layers=split["head_layers"], tail_layers=split["tail_layers"], dtype=manifest["dtype"],
        split_range=tuple(head_range) if head_range else None,
        weights=WeightFormats(**manifest["weights"]) if manifest.get("weights") else None,  # int8/int4 again
    )
    local = read_manifest(out / "local", "local")
    # The public model's identity, so that heads made for this model are recognised, and the key's name,
    # so that only a head made for this key is loaded (model.manifest.basis_identity).
    local["residual_basis"] = {**record, "model_identity": model_identity(manifest), "basis_id": secret.identity}
    (out / "local" / "manifest.json").write_text(json.dumps(local, indent=2, sort_keys=True))
    return out, carry_draft_head(shards / "local", out / "local", secret)
