"""Warm starts for the model-free draft sources: a successor table built offline, a memory of earlier outputs.

- `RecyclingTable`: for each token, the top-k tokens the model predicts after it, averaged over the
  model's own generations of offline prompts (`drafter recycling`, recycling.py). Token Recycling starts
  from it instead of from an empty table, so the first steps of a generation already have drafts; what
  the text at hand shows replaces an entry as soon as the token is seen. Stored as safetensors beside a
  JSON manifest (model fingerprint, data hash, seed, counts, time); loaded only for the model whose
  fingerprint it names. The replies the table was built from ship with it as a `ReplyStore`
  (sources.py), which the tree's suffix lookup searches beside the text at hand: another reply that said
  the same few words often goes on as this one will.
- `SuffixMemory`: a client process's earlier outputs, searchable by the tree's suffix lookup across
  requests (`api`) and conversations (`chat`). Bounded in tokens, kept in memory only, never sent
  anywhere: it lives on the trusted side like the rest of the drafting state.

Neither changes what is emitted: drafts are only proposals, and verification keeps greedy output
token-identical to sequential decoding.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ..errors import ConfigError
from .sources import ReplyStore, SuffixIndex

TABLE_FILE = "recycling.safetensors"
MANIFEST_FILE = "recycling.json"
FORMAT = "splitinfer-recycling"
SHIPPED_PACKAGE = "splitinfer.data"
SHIPPED_FOLDER = "drafters"  # data/drafters/<model>/: the shipped drafting files of each embedded model
# Earlier outputs a client process keeps searchable: ~32k tokens index into some tens of MB of Python lists.
SUFFIX_MEMORY_TOKENS = 32_768


@dataclass(frozen=True)
class RecyclingTable:
    successors: dict[int, tuple[list[int], list[float]]]  # token -> (top-k next tokens, their probabilities)
    manifest: dict
    replies: ReplyStore | None = None  # the model's replies the table was built from, searchable by suffix

    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tokens = sorted(self.successors)
        k = max((len(ids) for ids, _ in self.successors.values()), default=0)
        ids = torch.full((len(tokens), k), -1, dtype=torch.int32)
        probs = torch.zeros((len(tokens), k), dtype=torch.float16)
        for row, token in enumerate(tokens):
            nxt, ps = self.successors[token]
            ids[row, : len(nxt)] = torch.tensor(nxt, dtype=torch.int32)
            probs[row, : len(ps)] = torch.tensor(ps, dtype=torch.float16)
        tensors = {"token": torch.tensor(tokens, dtype=torch.int32), "next": ids, "prob": probs}
        if self.replies is not None:
            tensors |= _reply_tensors(self.replies)
        save_file(tensors, directory / TABLE_FILE)
        (directory / MANIFEST_FILE).write_text(json.dumps(self.manifest, indent=1) + "\n")
        return directory / TABLE_FILE

    @classmethod
    def load(cls, directory: str | Path) -> RecyclingTable:
        from safetensors.torch import load_file

        directory = Path(directory)
        try:
            manifest = json.loads((directory / MANIFEST_FILE).read_text())
            tensors = load_file(directory / TABLE_FILE)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{directory} holds no readable recycling table ({exc}); rebuild it with "
                              "`splitinfer drafter recycling`.") from exc
        if manifest.get("format") != FORMAT:
            raise ConfigError(f"{directory / MANIFEST_FILE} is not a recycling table manifest; rebuild it.")
        successors = {}
        for token, ids, ps in zip(tensors["token"].tolist(), tensors["next"].tolist(), tensors["prob"].float().tolist()):
            kept = [i for i, t in enumerate(ids) if t >= 0]
            successors[token] = ([ids[i] for i in kept], [ps[i] for i in kept])
        return cls(successors, manifest, _reply_store(tensors))


def _reply_tensors(store: ReplyStore) -> dict[str, torch.Tensor]:
    """The store as three int32 tensors: the replies end to end, each one's length, the sorted positions."""
    return {"reply_tokens": torch.tensor([t for doc in store.docs for t in doc], dtype=torch.int32),
            "reply_lengths": torch.tensor([len(doc) for doc in store.docs], dtype=torch.int32),
            "reply_order": torch.tensor(store.order, dtype=torch.int32)}


def _reply_store(tensors: dict[str, torch.Tensor]) -> ReplyStore | None:
    """The store saved by `_reply_tensors`, or None for a table saved without one."""
    if "reply_tokens" not in tensors:
        return None
    flat, lengths = tensors["reply_tokens"].tolist(), tensors["reply_lengths"].tolist()
    starts = [0, *itertools.accumulate(lengths)]
    docs = [flat[a:b] for a, b in zip(starts, starts[1:])]
    return ReplyStore(docs, tensors["reply_order"].tolist())


def aggregate_successors(rows: list[tuple[list[int], torch.Tensor]], k: int) -> tuple[dict, dict]:
    """(table, counts) from (input tokens, logits [q, vocab]) pairs, any iterable of them: row r of the
    logits follows tokens[r].

    A token's entry is the mean over its occurrences of the model's next-token distribution, cut to the
    top k (each distribution first cut to its top 2k, which keeps the sums small and changes little).
    """
    mass: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    seen: dict[int, int] = defaultdict(int)
    for tokens, logits in rows:
        assert logits.shape[0] == len(tokens), (logits.shape, len(tokens))
        top = torch.softmax(logits.float(), dim=-1).topk(2 * k, dim=-1)
        for token, ids, ps in zip(tokens, top.indices.tolist(), top.values.tolist()):
            seen[token] += 1
            for i, p in zip(ids, ps):
                mass[token][i] += p
    table = {}
    for token, successors in mass.items():
        best = sorted(successors.items(), key=lambda item: -item[1])[:k]
        table[token] = ([i for i, _ in best], [p / seen[token] for _, p in best])
    return table, dict(seen)


def suffix_memory(max_tokens: int) -> SuffixMemory | None:
    """A memory of `max_tokens` (None for 0: the option that turns it off)."""
    return SuffixMemory(max_tokens) if max_tokens else None


def shipped_table_dirs() -> list[Path]:
    """The folders of the drafting files shipped with the package (one per embedded model)."""
    root = resources.files(SHIPPED_PACKAGE).joinpath(SHIPPED_FOLDER)
    if not root.is_dir():
        return []
    return sorted(Path(str(entry)) for entry in root.iterdir() if entry.is_dir())


def shipped_recycling_table(identity: str, folders: list[Path] | None = None) -> RecyclingTable | None:
    """The shipped table built for the model with this identity (model/manifest.py `model_identity`: the
    model, whatever its split, dtype or basis, since the table holds token ids only), or None (a table for
    another model would propose another vocabulary's habits: harmless to the output, useless to speed)."""
    for folder in shipped_table_dirs() if folders is None else folders:
        manifest = folder / MANIFEST_FILE
        if manifest.is_file() and json.loads(manifest.read_text()).get("model_fingerprint") == identity:
            return RecyclingTable.load(folder)
    return None


class SuffixMemory:
    """Earlier outputs of this client process, searchable by suffix; at most `max_tokens` tokens kept.

    Shared by concurrent requests: `add` holds a lock, and a reader uses whatever `index` it read. Adding
    only appends to the index's lists, which a reader walking them under the GIL sees whole or not at
    all; dropping the oldest outputs builds a new index and swaps the reference, so no reader ever sees
    one half-built.
    """

    def __init__(self, max_tokens: int = SUFFIX_MEMORY_TOKENS, max_match: int = 8):
        if max_tokens < 0:
            raise ConfigError("the suffix memory needs max_tokens >= 0 (0 keeps nothing).")
        self.max_tokens = max_tokens
        self.max_match = max_match
        self.index = SuffixIndex(max_match)
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        return sum(map(len, self.index.docs))

    def add(self, output: list[int]) -> None:
        """Remember one output (its tokens); the oldest outputs go when the bound is passed."""
        output = list(output)[-self.max_tokens :] if self.max_tokens else []
        if not output:
            return
        with self._lock:
            if self.tokens + len(output) <= self.max_tokens:
                self.index.add_doc(output)
                return
            kept, total = [output], len(output)
            for doc in reversed(self.index.docs):
                if total + len(doc) > self.max_tokens:
                    break
                kept.append(doc)
                total += len(doc)
            index = SuffixIndex(self.max_match)
            for doc in reversed(kept):
                index.add_doc(doc)
            self.index = index
