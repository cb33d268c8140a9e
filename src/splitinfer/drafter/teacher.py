"""Teacher-forced drafter data: whole conversations through the chat template and the model, stored as
appendable shards of features, token ids and masks.

Each conversation (drafter/chat.py) is rendered by the tokenizer's chat template, cut at `max_len`
tokens, and run through the whole model (float32 by default, as the split model runs) in one pass. A
shard (`shard-NNNNN.pt`, about `shard_tokens` rows) holds, for its sequences laid end to end:

- features [N, d] float16: the input of the final norm at every row (row t predicts token t + 1);
- tokens [N] int32; draft [N] bool: the token is part of an assistant reply (what the head drafts);
- rank [N] uint8: the model's rank of token t among its predictions at row t - 1 (0 = its argmax, 255 =
  255 or worse; 255 at a sequence's first row), which lets training skip rows whose path the model
  would not have taken (GRIFFIN's loss mask);
- starts [S + 1] int64 and heldout [S] bool: where each sequence begins, and whether it is held out.

With `fused_layers` (a fused head's extra inputs), `shard-NNNNN.fused.pt` beside each shard holds those
hidden states at the same rows ([N, len(fused_layers) * d] float16), with its own sha256 in the index:
the shards themselves, and so the data hash, are the same bytes with or without it.

`index.json` lists the finished shards with their sha256 and the next conversation to read, so a rerun
appends after the last shard and nothing is rewritten. `load_sequences` maps the shards (torch's mmap
load) and returns per-sequence views, so training never reads every shard into memory at once.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..errors import ConfigError
from ..progress import progress
from .generate import capture_states, fused_rows

INDEX = "index.json"
MAX_RANK = 255


@dataclass(frozen=True)
class TeacherConfig:
    tokens: int = 400_000  # rows to collect (conversation tokens, user turns included)
    max_len: int = 1024  # tokens per conversation; longer ones are cut
    shard_tokens: int = 100_000  # rows per shard
    batch_tokens: int = 2048  # padded rows per forward pass
    chunk_tokens: int = 16_384  # rows read, sorted by length and labelled between two chances to write a shard
    # float32: the features the split model computes at run time; on a CPU without AMX bfloat16 products
    # were no faster in an ad-hoc check (notes/bench/drafter/README.md section 17).
    dtype: str = "float32"
    seed: int = 0  # order of the conversations
    fused_layers: tuple[int, ...] = ()  # hidden states also stored (HF numbering), beside each shard

    def __post_init__(self):
        object.__setattr__(self, "fused_layers", tuple(int(i) for i in self.fused_layers))


def conversation_ids(tokenizer, messages: list[dict], max_len: int) -> tuple[list[int], list[bool]] | None:
    """Token ids of a whole conversation through the chat template, and which are assistant text; None
    where the template does not render it as a sequence of prefixes or no reply starts before max_len."""
    full = _render(tokenizer, messages, False)
    draft = [False] * len(full)
    for j, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix, end = _render(tokenizer, messages[:j], True), len(_render(tokenizer, messages[: j + 1], False))
        start = len(prefix)
        if full[:start] != prefix or end > len(full):
            return None
        draft[start:end] = [True] * (end - start)
    if not any(draft[:max_len]):
        return None
    return full[:max_len], draft[:max_len]


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                            return_dict=True)
    return list(encoded["input_ids"])


def _capture(model) -> tuple[list, object]:
    seen: list[torch.Tensor] = []
    return seen, model.model.norm.register_forward_hook(lambda mod, args, out: seen.append(args[0].detach()))


@torch.inference_mode()
def label(model, sequences: list[list[int]], drafts: list[list[bool]], fused_layers: tuple[int, ...] = ()) -> list[tuple]:
    """One padded forward pass over `sequences` -> per sequence (features [L, d] float16, rank [L] uint8,
    MAX_RANK where the token is not a drafted one, the hidden states `fused_layers` [L, F d] float16 or
    None). Right padding and the causal mask leave every real row as it would be alone; the LM head reads
    only the rows before drafted tokens."""
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences], device=model.device)
    seen, handle = _capture(model)
    states, hooks = capture_states(model, fused_layers)
    try:
        normed = model.model(input_ids=ids, use_cache=False).last_hidden_state  # [B, W, d]
    finally:
        for hook in [handle, *hooks]:
            hook.remove()
    fused = fused_rows(states)
    out = []
    for b, (s, draft) in enumerate(zip(sequences, drafts)):
        n = len(s)
        targets = torch.tensor(draft[1:], device=ids.device).nonzero()[:, 0] + 1  # drafted tokens t >= 1
        logits = model.lm_head(normed[b, targets - 1]).float()  # the model's predictions of them
        chosen = logits.gather(-1, ids[b, targets][:, None])
        rank = torch.full((n,), MAX_RANK, dtype=torch.long, device=ids.device)
        rank[targets] = (logits > chosen).sum(-1).clamp(max=MAX_RANK)
        extra = None if fused is None else fused[b, :n].to(torch.float16).cpu()
        out.append((seen[0][b, :n].to(torch.float16).cpu(), rank.to(torch.uint8).cpu(), extra))
    return out


def _batches(items: list[tuple], batch_tokens: int) -> list[list[tuple]]:
    """Consecutive items grouped so that each group's padded size (count x longest) stays in budget."""
    groups, current = [], []
    for item in items:
        width = max([len(item[1])] + [len(i[1]) for i in current])
        if current and width * (len(current) + 1) > batch_tokens:
            groups.append(current)
            current = []
        current.append(item)
    return groups + ([current] if current else [])


class ShardWriter:
    """Appends labelled sequences to `out` and writes a shard every `shard_tokens` rows."""

    def __init__(self, out: Path, config: TeacherConfig, source: dict):
        self.out, self.config = out, config
        self.index = read_index(out) or {"config": asdict(config), "source": source, "shards": [], "next": 0}
        stored = tuple(self.index["config"].get("fused_layers") or ())
        if stored and not config.fused_layers:  # a run without fusion reads these shards; more keep the states
            self.config = config = replace(config, fused_layers=stored)
        if _options(self.index["config"]) != _options(asdict(config)):
            raise ConfigError(f"{out} holds shards made with other options ({self.index['config']}); use another directory.")
        self.pending: list[dict] = []

    @property
    def rows(self) -> int:
        return sum(s["tokens"] for s in self.index["shards"]) + sum(len(p["tokens"]) for p in self.pending)

    def add(self, record: dict) -> None:
        self.pending.append(record)

    def chunk_done(self, next_conversation: int) -> None:
        """A shard is written only between chunks, so a rerun from index["next"] makes the same shards."""
        if sum(len(p["tokens"]) for p in self.pending) >= self.config.shard_tokens:
            self.flush(next_conversation)

    def flush(self, next_conversation: int) -> None:
        if not self.pending:
            return
        name = f"shard-{len(self.index['shards']):05d}.pt"
        lengths = [len(p["tokens"]) for p in self.pending]
        shard = {"features": torch.cat([p["features"] for p in self.pending]),
                 "tokens": torch.tensor([t for p in self.pending for t in p["tokens"]], dtype=torch.int32),
                 "draft": torch.tensor([d for p in self.pending for d in p["draft"]], dtype=torch.bool),
                 "rank": torch.cat([p["rank"] for p in self.pending]),
                 "starts": torch.tensor([0] + lengths).cumsum(0),
                 "heldout": torch.tensor([p["heldout"] for p in self.pending], dtype=torch.bool),
                 "ids": [p["id"] for p in self.pending]}
        entry = {"file": name, "sequences": len(lengths), "tokens": sum(lengths), "sha256": self._save(name, shard)}
        if self.config.fused_layers:
            entry["fused_sha256"] = self._save(fused_name(name), {"fused": torch.cat([p["fused"] for p in self.pending])})
        self.index["shards"].append(entry)
        self.index["next"] = next_conversation
        _write_json(self.out / INDEX, self.index)
        self.pending = []

    def _save(self, name: str, tensors: dict) -> str:
        tmp = self.out / (name + ".tmp")
        torch.save(tensors, tmp)
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        tmp.replace(self.out / name)
        return digest


def _options(config: dict) -> dict:
    """A shard directory's options as compared on a rerun: all but the row target, an option added since
    read at its default."""
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in (asdict(TeacherConfig()) | config).items() if k != "tokens"}


def fused_name(shard: str) -> str:
    return shard.removesuffix(".pt") + ".fused.pt"


def read_index(out: Path) -> dict | None:
    path = out / INDEX
    return json.loads(path.read_text()) if path.exists() else None


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


def collect(model, tokenizer, conversations: list[dict], out: Path, config: TeacherConfig, source: dict) -> dict:
    """Label conversations (shuffled for `config.seed`) into shards under `out` until `config.tokens` rows;
    a rerun goes on after the last finished shard. -> the index."""
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, config, source)
    order = list(range(len(conversations)))
    random.Random(config.seed).shuffle(order)
    started, at = time.perf_counter(), writer.index["next"]
    with progress(total=config.tokens, initial=writer.rows, desc="teacher", unit="tok", enabled=True) as bar:
        while writer.rows < config.tokens and at < len(order):
            chunk = []
            while at < len(order) and sum(len(c[1]) for c in chunk) < config.chunk_tokens:
                conversation = conversations[order[at]]
                rendered = conversation_ids(tokenizer, conversation["messages"], config.max_len)
                at += 1
                if rendered is not None:
                    chunk.append((conversation, *rendered))
            chunk.sort(key=lambda c: len(c[1]))
            for group in _batches(chunk, config.batch_tokens):
                labels = label(model, [g[1] for g in group], [g[2] for g in group], writer.config.fused_layers)
                for (conversation, ids, draft), (features, rank, fused) in zip(group, labels):
                    writer.add({"id": conversation["id"], "heldout": conversation["heldout"], "tokens": ids,
                                "draft": draft, "features": features, "rank": rank, "fused": fused})
                    bar.update(len(ids))
            writer.chunk_done(at)
        writer.flush(at)
    index = writer.index
    index["wall_s"] = round(index.get("wall_s", 0.0) + time.perf_counter() - started, 1)
    _write_json(out / INDEX, index)
    return index


def data_hash(index: dict) -> str:
    return hashlib.sha256("".join(s["sha256"] for s in index["shards"]).encode()).hexdigest()


def fused_hash(index: dict) -> str | None:
    """The hash of the fused states' files (None where the shards have none)."""
    if not index["config"].get("fused_layers"):
        return None
    return hashlib.sha256("".join(s["fused_sha256"] for s in index["shards"]).encode()).hexdigest()


def load_sequences(out: Path, tokens: int | None = None, fused: bool = False) -> list[dict]:
    """The shards' sequences as training records (views of memory-mapped shards), up to `tokens` rows:
    {"tokens", "features", "prompt_len", "draft", "rank", "heldout"}, and "fused" where asked for."""
    index = read_index(out)
    if index is None:
        raise ConfigError(f"{out} holds no teacher-forced shards ({INDEX} is missing).")
    if fused and not index["config"].get("fused_layers"):
        raise ConfigError(f"{out} holds shards without fused hidden states; label into another directory with them.")
    sequences, rows = [], 0
    for entry in index["shards"]:
        shard = torch.load(out / entry["file"], mmap=True, weights_only=True)
        extra = torch.load(out / fused_name(entry["file"]), mmap=True, weights_only=True)["fused"] if fused else None
        starts = shard["starts"].tolist()
        for k in range(len(starts) - 1):
            a, b = starts[k], starts[k + 1]
            draft = shard["draft"][a:b]
            sequences.append({"tokens": shard["tokens"][a:b], "features": shard["features"][a : b - 1],
                              "prompt_len": int(draft.nonzero()[0, 0]) if bool(draft.any()) else b - a,
                              "draft": draft, "rank": shard["rank"][a:b], "heldout": bool(shard["heldout"][k])})
            if extra is not None:
                sequences[-1]["fused"] = extra[a : b - 1]
            rows += b - a
            if tokens is not None and rows >= tokens:
                return sequences
    return sequences
