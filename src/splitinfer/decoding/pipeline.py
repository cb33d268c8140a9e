"""Decoding with blocks in flight: the next block goes out before the previous one's result is back.

    send a block below the root
    while fewer than D blocks are out and the strategy can guess what follows the newest one:
        assume its draft's top path is accepted whole and the strategy's best guess after it is the next
        root; p = the chance that this and every earlier assumption in flight hold (the draft's and the
        guess's calibrated scores, times the hold rate measured so far);
        unless D is pinned, stop here when the controller (ahead.py) judges the block not worth it;
        send the next block below that root, assuming those kept rows
    receive the oldest block, accept, resolve (commit its path)
    check the assumption the next block made (or would have made) against what it resolved to
    if the next block in flight assumed another path or another root: drop it and every later one

Validity is decided here, on the client: a block in flight is used only if every earlier block kept
exactly the path it assumed and chose exactly its root. Blocks are accepted from in order, with the same
`choose` calls on the same rows as decoding one block at a time (loop.py), so greedy output is identical and
sampling draws each token from the model's own distribution, as there. Whether a block goes ahead changes
only the timing, never the output.

The loop knows the verifier through `InFlightVerifier` and the strategy through propose/predict/observe;
the cloud session, the wire and the caches are the verifier's business. It times its own work (drafting,
acceptance) and asks the verifier for the rest (cloud compute, tail) to feed the controller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..masks import BlockStructure
from .ahead import AheadController
from .draft import Block, Draft, accept, children_of
from .strategies import Strategy


class InFlightVerifier(Protocol):
    in_flight: int  # blocks that may be in flight at once
    pinned: bool  # True: keep in_flight blocks out whenever a guess allows; False: the controller decides

    def send_block(
        self, tokens: list[int], structure: BlockStructure, depths: list[int] | None, assume: list[list[int]]
    ) -> bool:
        """Send a block assuming each unresolved block before it keeps the given rows; False when the link was
        lost (every block in flight is gone, this one was not sent)."""
        ...

    def receive_block(self) -> torch.Tensor | None:
        """Logits [q, vocab] of the oldest unresolved block; None when the link was lost with it."""
        ...

    def block_costs(self) -> tuple[float, float]:
        """(cloud compute ms, local tail ms) of the block `receive_block` returned last."""
        ...

    def resolve(self, rows: list[int], assumption: tuple[float, bool] | None = None) -> None:
        """Accept `rows` (a path from row 0) of the oldest received block. assumption: the chance given to
        what a block after it assumed (or would have), and whether that held; for telemetry."""
        ...

    def drop_unresolved(self) -> None:
        """Forget every unresolved block."""
        ...

    def settle(self) -> None:
        """Forget what is still in flight once decoding ends."""
        ...


@dataclass(frozen=True)
class Guess:
    """What a block sent after another assumes of it: the rows it keeps and the root chosen after them."""

    kept: list[int]
    root: int
    score: float  # calibrated: the top path's score times the guess's


@dataclass
class _Flying:
    block: Block
    draft: Draft
    history: list[int]  # what the block was proposed from: its last token is the block's root
    p: float = 1.0  # the chance that its assumption, and every earlier one in flight, holds
    alone: bool = True  # sent with nothing in flight before it
    make_ms: float = 0.0  # drafting and head compute, sending included
    sent_at: float = 0.0  # perf_counter when it went
    kept: list[int] | None = None  # the rows the next block in flight assumes it keeps
    guess: Guess | None = None  # what the next block assumes (or would have): set once, by `_guess`
    guessed: bool = False

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


def _guess(strategy: Strategy, flying: _Flying) -> Guess | None:
    """The most likely outcome of `flying`: its top path accepted whole, then the strategy's best guess."""
    if not flying.guessed:
        kept = top_path(flying.block, flying.draft)
        assumed = flying.history + [flying.block.tokens[r] for r in kept[1:]]
        guess = strategy.predict(assumed, 1)
        path_p = flying.draft.scores[kept[-1] - 1] if len(kept) > 1 else 1.0
        flying.guess = Guess(kept, guess.tokens[0], path_p * guess.scores[0]) if guess.tokens else None
        flying.guessed = True
    return flying.guess


def _fill(
    verifier: InFlightVerifier, strategy: Strategy, history: list[int], flying: list[_Flying], depth: int,
    controller: AheadController,
) -> None:
    """Send blocks until `depth` are in flight, the strategy has no guess, or (unless pinned) the controller
    judges the next one not worth sending ahead."""
    while len(flying) < depth:
        start = time.perf_counter()
        if not flying:
            base, p = list(history), 1.0
        else:
            newest = flying[-1]
            guess = _guess(strategy, newest)
            if guess is None:
                return
            p = newest.p * controller.p(guess.score)
            if not verifier.pinned and not controller.worth(p, len(flying) + 1):
                return
            newest.kept = guess.kept
            base = newest.history + [newest.block.tokens[r] for r in guess.kept[1:]] + [guess.root]
        draft = strategy.propose(base)
        nxt = _Flying(draft.to_block(base[-1]), draft, base, p=p, alone=not flying)
        block = nxt.block
        if not verifier.send_block(block.tokens, block.structure, block.depths, [f.kept for f in flying]):
            flying.clear()  # the link was lost with everything in flight: send again from the committed state
            continue
        nxt.sent_at = time.perf_counter()
        nxt.make_ms = (nxt.sent_at - start) * 1e3
        flying.append(nxt)


def decode_in_flight(
    verifier: InFlightVerifier,
    history: list[int],
    root: int,
    emit_all: Callable[[list[int], list[torch.Tensor]], str | None],
    strategy: Strategy,
    choose: Callable[[torch.Tensor], int],
    depth: int,
    controller: AheadController | None = None,
) -> str:
    """Decode with up to `depth` blocks in flight after the first token `root` was emitted (history ends
    with it; emit_all appends to it). Returns "stop" or "length", as loop.decode does."""
    controller = controller if controller is not None else AheadController()
    flying: list[_Flying] = []
    finish = None
    last = time.perf_counter()
    try:
        while finish is None:
            _fill(verifier, strategy, history, flying, depth, controller)
            waited_alone = len(flying) == 1 and flying[0].alone
            logits = verifier.receive_block()
            if logits is None:
                flying.clear()
                continue
            back = time.perf_counter()
            current = flying.pop(0)
            tokens, parents = current.block.tree_tokens, current.block.parents
            path, root = accept(tokens, parents, logits[: len(tokens)], choose)
            guess = current.guess
            held = guess is not None and guess.kept == path and guess.root == root
            if guess is not None:
                controller.observe_assumption(guess.score, held)
            verifier.resolve(path, (controller.p(guess.score), held) if guess is not None else None)
            if flying and (current.kept != path or flying[0].root != root):
                verifier.drop_unresolved()
                flying.clear()
            emitted = [tokens[r] for r in path[1:]] + [root]
            finish = emit_all(emitted, [logits[r] for r in path])
            now = time.perf_counter()
            strategy.recall(current.draft)
            strategy.observe(tokens, parents, logits, path, emitted, (now - last) * 1e3)
            last = now
            _measure(controller, verifier, current, back, waited_alone)
    finally:
        verifier.settle()
    return finish


def _measure(controller: AheadController, verifier: InFlightVerifier, block: _Flying, back: float, alone: bool) -> None:
    """Feed a resolved block's costs to the controller. Its latency counts only when it went alone and was
    waited for at once: a block behind others, or one whose reply waited while the client made the next,
    measures queueing, not latency."""
    cloud_ms, tail_ms = verifier.block_costs()
    settle_ms = (time.perf_counter() - back) * 1e3
    latency = (back - block.sent_at) * 1e3 - tail_ms if alone else None
    controller.observe_block(cloud_ms, block.make_ms + tail_ms + settle_ms, block.make_ms, latency)
