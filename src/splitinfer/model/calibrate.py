"""Calibration for int8 weights: the largest |input| each linear layer sees per input channel.

`prepare --weights int8` runs the whole float model once over calibration text (the packaged benchmark
prompts, data/prompts.jsonl, through the model's tokenizer; seeded random ids for a model without one)
and hands each linear's per-channel maxima to model/formats.py's `quantize_int8`, which moves the
inputs' outlier channels into the weight (SmoothQuant). Nothing here is stored but those maxima's effect.
"""

from __future__ import annotations

import json
from importlib import resources

import torch
from torch import nn

CALIBRATION_FILE = "prompts.jsonl"  # in splitinfer.data
RANDOM_TOKENS = 256  # calibration ids for a model without a tokenizer


def calibration_ids(tokenizer, vocab_size: int) -> list[list[int]]:
    """Token ids of the calibration text: one sequence per packaged prompt."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab_size, (RANDOM_TOKENS,), generator=generator).tolist()]
    text = resources.files("splitinfer.data").joinpath(CALIBRATION_FILE).read_text()
    prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    return [list(tokenizer(p)["input_ids"]) for p in prompts]


@torch.inference_mode()
def activation_maxima(model: nn.Module, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """{'<linear>.weight': max |input| per input channel [K]} over every linear of `model` (the LM head too),
    running each sequence through the whole model once."""
    maxima: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module, inputs, output):
            seen = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0).float()
            key = name + ".weight"
            maxima[key] = torch.maximum(maxima[key], seen) if key in maxima else seen
        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        for ids in sequences:
            model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return maxima
