"""Collect what the cloud sees: one forward of the whole model per chunk gives every depth at once.

Input side, depth k: the output of decoder layer k-1 (what a client with k head layers sends up).
Output side, depth m: the output of layer N-m-1, i.e. the hidden state entering the last m layers (what the
cloud returns to a client with m tail layers). Both are rounded to float16, as on the default wire.

Targets: on the input side the token at the same position; on the output side the token the local LM head
emits there under greedy decoding (the model's argmax), i.e. the generated text the cloud would learn.
This module runs models; it knows nothing about attackers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError
from .corpus import Chunk


@dataclass
class Collected:
    """Flattened token rows of one split (train or test); every array has T rows."""

    tokens: np.ndarray  # [T] int64 token at each position (input-side target)
    greedy: np.ndarray  # [T] int64 model argmax at each position (output-side target)
    doc: np.ndarray  # [T] int32 source document id
    chunk: np.ndarray  # [T] int32 chunk index within the split
    pos: np.ndarray  # [T] int32 position within the chunk
    canary: np.ndarray  # [T] bool: a planted canary token
    inputs: dict[int, np.ndarray] = field(default_factory=dict)  # k -> [T, d] float16 (as on the wire)
    outputs: dict[int, np.ndarray] = field(default_factory=dict)  # m -> [T, d] float16 (as on the wire)

    def __len__(self) -> int:
        return len(self.tokens)

    def side(self, side: str) -> dict[int, np.ndarray]:
        return self.inputs if side == "input" else self.outputs

    def target(self, side: str) -> np.ndarray:
        return self.tokens if side == "input" else self.greedy

    def chunk_bounds(self) -> list[tuple[int, int]]:
        """[start, end) row ranges of each chunk, in order."""
        starts = np.flatnonzero(np.r_[True, self.chunk[1:] != self.chunk[:-1]])
        ends = np.r_[starts[1:], len(self.chunk)]
        return list(zip(starts.tolist(), ends.tolist()))


def layer_outputs(model: nn.Module, ids: torch.Tensor, perturb: dict[int, callable] | None = None):
    """Run `model` on ids [1, T]; returns (logits [T, V], {layer index: output [T, d]}).

    `perturb` maps a layer index to a function applied to that layer's output before the next layer sees
    it (the noise defence).
    """
    outputs: dict[int, torch.Tensor] = {}
    handles = []

    def hook(index):
        def fn(_module, _inputs, out):
            hidden = out[0] if isinstance(out, tuple) else out
            if perturb and index in perturb:
                hidden = perturb[index](hidden)
            outputs[index] = hidden[0].detach()
            return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

        return fn

    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_hook(hook(i)))
    try:
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return logits, outputs


def head_outputs(model: nn.Module, ids: torch.Tensor, top: int) -> dict[int, torch.Tensor]:
    """Run only layers [0, top) on ids [1, T] (what a chosen-plaintext query costs the deployment);
    returns {layer index: output [T, d]}. The remaining layers, norm and LM head never run."""
    full = model.model.layers
    model.model.layers = nn.ModuleList(full[:top])
    outputs: dict[int, torch.Tensor] = {}

    def hook(index):
        def fn(_module, _inputs, out):
            outputs[index] = (out[0] if isinstance(out, tuple) else out)[0].detach()

        return fn

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.inference_mode():
            model.model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.model.layers = full
    return outputs


def collect(model: nn.Module, chunks: list[Chunk], depths: tuple[int, ...], tail_depths: tuple[int, ...] = (),
            dtype: torch.dtype = torch.float16) -> Collected:
    """What the cloud sees at each input depth k and output depth m, per token of `chunks`, rounded to `dtype`
    (the wire's float16; float32 where a caller transforms the states before rounding them itself).

    Without tail depths only layers [0, max(depths)) run (10^5 tokens through two layers take minutes,
    not an hour, on a CPU); there are then no output-side states and `greedy` is -1 (the model's
    prediction was never computed).
    """
    n_layers = len(model.model.layers)
    if max(depths) >= n_layers or max(tail_depths, default=0) >= n_layers:
        raise ConfigError(f"depths must be below the model's {n_layers} layers; choose smaller --depths/--tail-depths.")
    cols: dict[str, list] = {k: [] for k in ("tokens", "greedy", "doc", "chunk", "pos", "canary")}
    ins: dict[int, list] = {k: [] for k in depths}
    outs: dict[int, list] = {m: [] for m in tail_depths}
    for index, chunk in enumerate(chunks):
        ids = torch.tensor([chunk.tokens], dtype=torch.long)
        t = len(chunk.tokens)
        if tail_depths:
            logits, hidden = layer_outputs(model, ids)
            cols["greedy"].append(logits.argmax(-1).numpy().astype(np.int64))
        else:
            hidden = head_outputs(model, ids, max(depths))
            cols["greedy"].append(np.full(t, -1, dtype=np.int64))
        cols["tokens"].append(np.asarray(chunk.tokens, dtype=np.int64))
        cols["doc"].append(np.full(t, chunk.doc_id, dtype=np.int32))
        cols["chunk"].append(np.full(t, index, dtype=np.int32))
        cols["pos"].append(np.arange(t, dtype=np.int32))
        cols["canary"].append(np.arange(t) < chunk.canary_len)
        for k in depths:
            ins[k].append(hidden[k - 1].to(dtype).numpy())
        for m in tail_depths:
            outs[m].append(hidden[n_layers - m - 1].to(dtype).numpy())
    return Collected(
        **{k: np.concatenate(v) for k, v in cols.items()},
        inputs={k: np.concatenate(v) for k, v in ins.items()},
        outputs={m: np.concatenate(v) for m, v in outs.items()},
    )
