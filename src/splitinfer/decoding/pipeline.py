"""Decoding with blocks in flight: the next block goes out before the previous one's result is back.

    send a block below the root
    while fewer than D blocks are out and the strategy can guess what follows the newest one:
        assume the newest block keeps its draft's top path down to a node, and that node is the next root:
        the deepest node at least SPLIT_P likely, held back from the block that sent it (the chain goes on
        in the next block), or else the whole top path and the strategy's best guess after it;
        send the next block below that root, assuming those kept rows
    receive the oldest block, accept, resolve (commit its path)
    if the next block in flight assumed another path or another root: drop it and every later one

Validity is decided here, on the client: a block in flight is used only if every earlier block kept
exactly the path it assumed and chose exactly its root. Blocks are accepted from in order, with the same
`choose` calls on the same rows as decoding one block at a time (loop.py), so greedy output is identical and
sampling draws each token from the model's own distribution, as there.

The loop knows the verifier through `InFlightVerifier` and the strategy through propose/predict/observe;
the cloud session, the wire and the caches are the verifier's business.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..masks import BlockStructure
from .draft import Block, Draft, accept, children_of
from .strategies import Strategy

# A block that another will follow in flight leaves out its top path below the deepest node at least this
# likely (its calibrated path score): that node becomes the next block's root, so the next block's
# assumption holds with about that probability. Below it, the top path's whole acceptance and a guess after
# it (strategy.predict) would have to hold together, which is far less likely.
SPLIT_P = 0.5


class InFlightVerifier(Protocol):
    in_flight: int  # blocks that may be in flight at once

    def send_block(
        self, tokens: list[int], structure: BlockStructure, depths: list[int] | None, assume: list[list[int]]
    ) -> bool:
        """Send a block assuming each unresolved block before it keeps the given rows; False when the link was
        lost (every block in flight is gone, this one was not sent)."""
        ...

    def receive_block(self) -> torch.Tensor | None:
        """Logits [q, vocab] of the oldest unresolved block; None when the link was lost with it."""
        ...

    def resolve(self, rows: list[int]) -> None:
        """Accept `rows` (a path from row 0) of the oldest received block."""
        ...

    def drop_unresolved(self) -> None:
        """Forget every unresolved block."""
        ...

    def settle(self) -> None:
        """Forget what is still in flight once decoding ends."""
        ...


@dataclass
class _Flying:
    block: Block
    draft: Draft
    history: list[int]  # what the block was proposed from: its last token is the block's root
    kept: list[int] | None = None  # the rows the next block in flight assumes it keeps
    next_root: int | None = None  # the next block's root, held back from this block's draft

    @property
    def root(self) -> int:
        return self.history[-1]


def top_path(block: Block, draft: Draft) -> list[int]:
    """The block's most likely accepted path: from the root, always the child with the best score."""
    children = children_of(block.tree_tokens, block.parents)
    path = [0]
    while children.get(path[-1]):
        path.append(max(children[path[-1]].values(), key=lambda row: draft.scores[row - 1]))
    return path


def split_draft(draft: Draft, min_p: float) -> tuple[Draft, list[int], int] | None:
    """Hold the top path back from a draft below its deepest node at least `min_p` likely: (the draft without
    that node's subtree, the block rows the next block assumes kept, that node's token: the next root). None
    when not even the top path's first node is that likely, or when the draft has side rows."""
    if draft.side is not None and draft.side.tokens:
        return None
    tokens, parents = draft.block(-1)  # row 0 stands for the root
    children = children_of(tokens, parents)
    path = [0]
    while children.get(path[-1]):
        path.append(max(children[path[-1]].values(), key=lambda row: draft.scores[row - 1]))
    likely = [i for i in range(1, len(path)) if draft.scores[path[i] - 1] >= min_p]
    if not likely:
        return None
    cut = path[likely[-1]]
    removed: set[int] = set()
    rows = {0: 0}
    out = Draft()
    for row in range(1, len(tokens)):
        if row == cut or parents[row] in removed:
            removed.add(row)
            continue
        rows[row] = len(out.tokens) + 1
        out.tokens.append(tokens[row])
        out.parents.append(rows[parents[row]])
        out.scores.append(draft.scores[row - 1])
        out.sources.append(draft.sources[row - 1] if draft.sources else "")
        out.keys.append(draft.keys[row - 1] if draft.keys else None)
    return out, [rows[r] for r in path[: likely[-1]]], tokens[cut]


def _next_block(strategy: Strategy, history: list[int], flying: list[_Flying], more: bool) -> _Flying | None:
    """The next block to send: below the root when nothing is in flight, else below the root assumed to follow
    the newest block; None when the strategy has no guess. `more`: another block may follow this one."""
    if not flying:
        base = list(history)
    elif flying[-1].next_root is not None:
        newest = flying[-1]
        base = newest.history + [newest.block.tokens[r] for r in newest.kept[1:]] + [newest.next_root]
    else:
        newest = flying[-1]
        kept = top_path(newest.block, newest.draft)
        assumed = newest.history + [newest.block.tokens[r] for r in kept[1:]]
        guess = strategy.predict(assumed, 1)
        if not guess.tokens:
            return None
        newest.kept = kept
        base = assumed + [guess.tokens[0]]
    draft = strategy.propose(base)
    split = split_draft(draft, SPLIT_P) if more else None
    if split is None:
        return _Flying(draft.to_block(base[-1]), draft, base)
    draft, kept, next_root = split
    return _Flying(draft.to_block(base[-1]), draft, base, kept, next_root)


def _fill(
    verifier: InFlightVerifier, strategy: Strategy, history: list[int], flying: list[_Flying], depth: int
) -> None:
    while len(flying) < depth:
        # Every block holds its likely tail back: its follower goes once there is room, if not at once.
        nxt = _next_block(strategy, history, flying, depth > 1)
        if nxt is None:
            return
        block = nxt.block
        if not verifier.send_block(block.tokens, block.structure, block.depths, [f.kept for f in flying]):
            flying.clear()  # the link was lost with everything in flight: send again from the committed state
            continue
        flying.append(nxt)


def decode_in_flight(
    verifier: InFlightVerifier,
    history: list[int],
    root: int,
    emit_all: Callable[[list[int], list[torch.Tensor]], str | None],
    strategy: Strategy,
    choose: Callable[[torch.Tensor], int],
    depth: int,
) -> str:
    """Decode with up to `depth` blocks in flight after the first token `root` was emitted (history ends
    with it; emit_all appends to it). Returns "stop" or "length", as loop.decode does."""
    flying: list[_Flying] = []
    finish = None
    last = time.perf_counter()
    try:
        while finish is None:
            _fill(verifier, strategy, history, flying, depth)
            logits = verifier.receive_block()
            if logits is None:
                flying.clear()
                continue
            current = flying.pop(0)
            tokens, parents = current.block.tree_tokens, current.block.parents
            path, root = accept(tokens, parents, logits[: len(tokens)], choose)
            verifier.resolve(path)
            if flying and (current.kept != path or flying[0].root != root):
                verifier.drop_unresolved()
                flying.clear()
            emitted = [tokens[r] for r in path[1:]] + [root]
            finish = emit_all(emitted, [logits[r] for r in path])
            now = time.perf_counter()
            strategy.recall(current.draft)
            strategy.observe(tokens, parents, logits, path, emitted, (now - last) * 1e3)
            last = now
    finally:
        verifier.settle()
    return finish
