"""Decoding with blocks in flight: the next block goes out before the previous one's result is back.

    send a block below the root
    while fewer than D blocks are out and the strategy can guess what follows the newest one:
        assume its draft's top path is accepted whole and the strategy's best guess after it is the next
        root; if that is at least MIN_AHEAD_P likely (the draft's and the guess's calibrated scores),
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

# A block goes out ahead only when its assumption is at least this likely. A dropped block is not free:
# the cloud still runs it (steps of a connection run in order), ahead of the next valid block, so on a CPU
# cloud a block ahead that holds 1 time in 10 made decoding 0.8x as fast (D = 2, 80 ms; docs/design.md).
MIN_AHEAD_P = 0.3


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


def _next_block(strategy: Strategy, history: list[int], flying: list[_Flying]) -> _Flying | None:
    """The next block to send: below the root when nothing is in flight, else below the guessed root after the
    newest block's top path; None when the strategy has no guess."""
    if not flying:
        base = list(history)
    else:
        newest = flying[-1]
        kept = top_path(newest.block, newest.draft)
        assumed = newest.history + [newest.block.tokens[r] for r in kept[1:]]
        guess = strategy.predict(assumed, 1)
        path_p = newest.draft.scores[kept[-1] - 1] if len(kept) > 1 else 1.0
        if not guess.tokens or path_p * guess.scores[0] < MIN_AHEAD_P:
            return None
        newest.kept = kept
        base = assumed + [guess.tokens[0]]
    draft = strategy.propose(base)
    return _Flying(draft.to_block(base[-1]), draft, base)


def _fill(
    verifier: InFlightVerifier, strategy: Strategy, history: list[int], flying: list[_Flying], depth: int
) -> None:
    while len(flying) < depth:
        nxt = _next_block(strategy, history, flying)
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
