"""A learned draft head (EAGLE family) that predicts the model's next final feature on the trusted side.

One step of the head maps a pair (feature f_t, token x_{t+1}) to a predicted feature f_{t+1}: an fc layer
over [f_t, embed(x_{t+1})] and one Llama-style decoder layer (RMSNorm, attention with RoPE over its own
KV cache, MLP). `logits` reads a prediction out through the model's own final norm and LM head, restricted
to `draft_vocab` (token ids ranked by frequency), so a drafted token costs a small matmul (in the LM
head's own format where that is int8 or int4: its stored rows, model/linears.py `select_rows`). Features are
the model's final hidden states before its final norm (what the local tail layers produce).

The embedding, final norm and LM head are the model's, passed in, frozen and never saved; the head's own
weights are a few MB (safetensors fp16, float32 once re-based with a key, + a json config). The head
reads and writes the shard's residual stream, so it is made for one basis: the public one, or the secret
key of a `privatize --basis` shard (privacy/basis.py re-bases a head with the key; under a linear key its
two norms are keyed norms). The json record names that basis, and `load_shard_head` refuses a head made
for another. This module knows nothing about trees, tries or verification (decoding/headsource.py drafts
with it) nor about training (drafter/train.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import ConfigError, ModelError
from . import linears
from .keyed_norm import FACTOR, KeyedRMSNorm
from .rows import use_row_kernels
from .manifest import PUBLIC_BASIS, basis_identity

DRAFTER_DIR = "drafter"  # where a head lives inside a local shard
HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head.json"
HEAD_NORMS = ("input_norm", "post_norm")  # the head's norms over its stream: keyed norms under a linear key


@dataclass(frozen=True)
class DraftHeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    draft_vocab_size: int
    intermediate_size: int = 768  # smaller than the model's MLP: the head runs once per drafted node
    rms_eps: float = 1e-5
    rope_theta: float = 10_000.0
    # Hidden states (HF numbering: i = the output of layer i - 1) added to the depth-1 input through a
    # zero-initialised projection (`fuse`), EAGLE-3's feature fusion; () = the final features alone.
    fused_layers: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "fused_layers", tuple(int(i) for i in self.fused_layers))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def for_model(cls, config, draft_vocab_size: int, intermediate_size: int = 768,
                  fused_layers: tuple[int, ...] = ()) -> "DraftHeadConfig":
        """A head shaped like one layer of `config` (an HF PretrainedConfig), with a smaller MLP."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        return cls(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            draft_vocab_size=min(draft_vocab_size, config.vocab_size),
            intermediate_size=intermediate_size,
            rms_eps=float(getattr(config, "rms_norm_eps", 1e-5)),
            rope_theta=float(theta or getattr(config, "rope_theta", None) or 10_000.0),
            fused_layers=fused_layers,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class HeadCache:
    """Keys and values of the head's attention, [B, kv_heads, length, head_dim] each (None when empty)."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def truncate(self, length: int) -> None:
        if self.keys is not None and length < self.length:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys, self.values = torch.cat([self.keys, keys], 2), torch.cat([self.values, values], 2)


class DraftHead(nn.Module):
    """fc + one decoder layer predicting the next feature; logits through the model's frozen readout."""

    def __init__(self, config: DraftHeadConfig, embed: nn.Module, norm: nn.Module, lm_head: nn.Module,
                 draft_vocab: torch.Tensor, final_logit_softcapping: float | None = None):
        super().__init__()
        d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
        self.config = config
        self.fc = nn.Linear(2 * d, d, bias=True)
        if config.fused_layers:  # zero at first: a fused head starts as the head without fusion
            self.fuse = nn.Linear(len(config.fused_layers) * d, d, bias=False)
            nn.init.zeros_(self.fuse.weight)
        self.input_norm = RMSNorm(d, config.rms_eps)
        self.q_proj = nn.Linear(d, config.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, config.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, config.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_heads * hd, d, bias=False)
        self.post_norm = RMSNorm(d, config.rms_eps)
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)
        # A tuple keeps the model's modules out of this module's parameters and state dict.
        self._model_parts = (embed, norm)
        # The final norm's dtype from its parameters: a keyed norm (a linear-key shard) has a factor, no gain.
        self._norm_dtype = next(norm.parameters()).dtype
        if draft_vocab.numel() != config.draft_vocab_size:
            raise ModelError(f"draft vocabulary has {draft_vocab.numel()} ids, the head expects {config.draft_vocab_size}.")
        self.register_buffer("draft_vocab", draft_vocab.long().clone(), persistent=False)
        self.register_buffer("draft_weight", lm_head.weight.detach()[draft_vocab].float().clone(), persistent=False)
        # An int8/int4 LM head's rows in its own format: drafting reads out through them (not a submodule:
        # nothing of it is saved with the head); training, which needs gradients, through `draft_weight`.
        object.__setattr__(self, "_readout", linears.select_rows(lm_head, draft_vocab))
        self.softcap = final_logit_softcapping
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._model_parts[0](tokens).float()

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                allowed: torch.Tensor, cache: HeadCache | None = None,
                fused: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """features: [B, n, d] (f_t); tokens: [B, n] (x_{t+1}); positions: [n]; allowed: [n, P + n] bool
        (row i may attend to key j; P = the cache's length); fused: [B, n, len(fused_layers) * d], the true
        hidden states of `config.fused_layers` at t (depth-1 rows of a fused head; None elsewhere). ->
        (predicted f_{t+1} [B, n, d], keys, values of the n rows [B, kv_heads, n, head_dim]); the cache is
        read, not changed."""
        cfg = self.config
        b, n, _ = features.shape
        features = features.float() if fused is None else features.float() + self.fuse(fused.float())
        x = self.fc(torch.cat([features, self.embed(tokens)], dim=-1))
        h = self.input_norm(x)
        q = self.q_proj(h).view(b, n, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, n, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, n, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = self._rope(positions)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        keys, values = k, v
        if cache is not None and cache.length:
            keys, values = torch.cat([cache.keys, k], 2), torch.cat([cache.values, v], 2)
        # Grouped-query attention without copying the keys: query head h reads kv head h // groups, so the
        # groups' queries are stacked as more rows of their kv head (the mask repeated for each group).
        groups = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape(b, cfg.num_kv_heads, groups * n, cfg.head_dim)
        mask = allowed.repeat(groups, 1) if groups > 1 else allowed
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0 / math.sqrt(cfg.head_dim))
        attn = attn.view(b, cfg.num_heads, n, cfg.head_dim)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, n, -1))
        h = self.post_norm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x, k, v

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """[..., d] predicted features -> [..., draft_vocab_size] float32 logits over `draft_vocab`."""
        norm = self._model_parts[1]
        x = norm(predicted.to(self._norm_dtype)).float()
        if self._readout is not None and not (torch.is_grad_enabled() and x.requires_grad):
            logits = self._readout(x)
        else:
            logits = F.linear(x, self.draft_weight)
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    # -- files -------------------------------------------------------------------------------------
    def save(self, directory: str | Path, extra: dict | None = None, dtype: torch.dtype = torch.float16) -> None:
        """Weights in `dtype` (+ draft_vocab) and the json record: the config plus `extra` (e.g. the
        model fingerprint and "basis"; a head without "basis" is taken to be in the public one)."""
        tensors = {k: v.detach().to(dtype) for k, v in self.state_dict().items()}
        write_head(directory, tensors, self.draft_vocab, {"config": asdict(self.config), **(extra or {})})


def write_head(directory: str | Path, tensors: dict[str, torch.Tensor], draft_vocab: torch.Tensor, info: dict) -> None:
    """Write a head's files: its weights (a state dict), its draft vocabulary and its json record."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.cpu().contiguous() for k, v in tensors.items()}
    tensors["draft_vocab"] = draft_vocab.cpu().to(torch.int64).contiguous()
    save_file(tensors, str(directory / HEAD_WEIGHTS))
    (directory / HEAD_CONFIG).write_text(json.dumps(info, indent=2))


def read_head_tensors(directory: str | Path, device: str = "cpu") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the head's state dict as saved, its draft vocabulary [draft_vocab_size] int64)."""
    tensors = load_file(str(Path(directory) / HEAD_WEIGHTS), device=device)
    return tensors, tensors.pop("draft_vocab")


def head_basis(info: dict) -> str:
    """The residual basis a head was made for (its json record's "basis"; public when it names none)."""
    return str(info.get("basis", PUBLIC_BASIS))


def read_head_info(directory: str | Path) -> dict:
    """The head's json record ({"config": ..., plus what the trainer added, e.g. "model_fingerprint"})."""
    path = Path(directory) / HEAD_CONFIG
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the draft head at {path} ({exc}); remove it or install it again.") from exc


def load_head(directory: str | Path, embed: nn.Module, norm: nn.Module, lm_head: nn.Module,
              final_logit_softcapping: float | None = None, device: str = "cpu") -> DraftHead:
    """The head saved in `directory`, in float32, reading out through the given model parts. It does not
    check the basis the head was made for: `load_shard_head` does."""
    info = read_head_info(directory)
    config = DraftHeadConfig(**info["config"])
    tensors, draft_vocab = read_head_tensors(directory, device)
    head = DraftHead(config, embed, norm, lm_head, draft_vocab.to(device), final_logit_softcapping).to(device)
    for name in HEAD_NORMS:
        factor = tensors.get(f"{name}.{FACTOR}")
        if factor is not None:  # a head re-based under a linear key
            setattr(head, name, KeyedRMSNorm(config.hidden_size, factor.shape[-1], config.rms_eps, device=device))
    head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    return use_row_kernels(head.eval().requires_grad_(False))


def load_shard_head(directory: str | Path, local, device: str = "cpu") -> DraftHead:
    """The head in `directory` over a local shard's (`local`, a model.shards.LocalHalf) embedding, final
    norm and LM head. A head made for another residual basis would draft from features it cannot read
    (never wrong output, but every draft wasted), so it is refused."""
    made_for, shard = head_basis(read_head_info(directory)), basis_identity(local.manifest)
    if made_for != shard:
        def name(basis: str) -> str:
            return "the public basis" if basis == PUBLIC_BASIS else f"secret basis {basis[:12]}"

        raise ConfigError(
            f"the draft head in {directory} was made for {name(made_for)}, but this local shard's residual stream "
            f"is in {name(shard)}. Run `splitinfer privacy privatize --basis` from the public shards with the head installed "
            f"(it re-bases the head with the key), or `splitinfer prepare` again; or remove {directory}."
        )
    softcap = getattr(local.config, "final_logit_softcapping", None)
    return load_head(directory, local.embed, local.norm, local.lm_head, softcap, device)
