"""Decoding with blocks in flight: the next block goes out before the previous one's result is back.

    send a block below the root
    while fewer than D blocks are out and the strategy can guess what follows the newest one:
        assume its draft's top path (below its likeliest root while that is not known) is accepted
        whole, or only the likeliest prefix of it, and that the token chosen after it is one of the
        strategy's likeliest next tokens (roots.py: up to AheadConfig.max_roots candidates); p = the
        chance that this and every earlier assumption in flight hold (the kept rows' chance times the
        candidates' summed scores, times the hold rate measured so far);
        unless D is pinned, stop here when the controller (ahead.py) judges the block not worth it;
        send the next block with a root row per candidate, each with a draft below it, assuming those kept rows
    receive the oldest block, accept from its chosen root's rows, resolve (commit its path)
    check the assumption the next block made (or would have made) against what it resolved to
    if the next block in flight assumed another path or has no root equal to the chosen token: drop it and
    every later one; else that root is the next block's root

Validity is decided here, on the client: a block in flight is used only if every earlier block kept
exactly the path it assumed and one of its roots is exactly the token chosen there; only that root's
rows are accepted from, as a one-root block. Blocks are accepted from in order, with the same `choose`
calls on the same rows as decoding one block at a time (loop.py), so greedy output is identical and
sampling draws each token from the model's own distribution, as there. Whether a block goes ahead, and
with how many roots, changes only the timing, never the output.

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
from .ahead import AheadConfig, AheadController
from .draft import Block, Draft, accept
from .roots import candidate_roots, likeliest_outcome, multi_root_block
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
        """Accept `rows` (a path from one of its roots) of the oldest received block. assumption: the chance
        given to what a block after it assumed (or would have), and whether that held; for telemetry."""
        ...

    def drop_unresolved(self) -> None:
        """Forget every unresolved block."""
        ...

    def settle(self) -> None:
        """Forget what is still in flight once decoding ends."""
        ...


@dataclass(frozen=True)
class Guess:
    """What a block sent after another assumes of it: the rows it keeps, and candidate roots for the token
    chosen after them (any of them may be it)."""

    kept: list[int]  # block rows, from the root the earlier block is assumed to have (not always row 0)
    text: list[int]  # the text once those rows are kept
    roots: list[int]  # the candidate tokens chosen after them, likeliest first
    scores: list[float]  # each candidate's calibrated chance, given the kept rows
    below: list[Draft]  # a small predicted draft below each candidate (the first one's is proposed afresh)
    score: float  # calibrated: the kept rows' chance times the candidates' summed chance


@dataclass
class _Flying:
    block: Block
    prefix: list[int]  # what the block was proposed from, its root excluded
    roots: list[int]  # candidate roots, likeliest first; one for a block sent alone
    scores: list[float]  # each root's chance given its assumption
    drafts: list[Draft]  # below each root
    rows: list[list[int]]  # each root's block rows: its root row, then its draft's nodes
    p: float = 1.0  # the chance that its assumption, and every earlier one in flight, holds
    alone: bool = True  # sent with nothing in flight before it
    chosen: int | None = 0  # which root the block before it chose; None while that one is unresolved
    make_ms: float = 0.0  # drafting and head compute, sending included
    sent_at: float = 0.0  # perf_counter when it went
    kept: list[int] | None = None  # the rows the next block in flight assumes it keeps
    guess: Guess | None = None  # what the next block assumes (or would have), by `_guess`
    guessed_for: int = -1  # the root `guess` was made for (-1: none made yet)

    def own(self, i: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of root i's one-root block: its root, then its draft."""
        return self.drafts[i].block(self.roots[i])


def _guess(strategy: Strategy, flying: _Flying, config: AheadConfig) -> Guess | None:
    """The most likely outcome of `flying`, with the candidates for what follows: the draft of its chosen (or
    likeliest) root kept along its top path or the likeliest prefix of it, then the strategy's likeliest
    next tokens (roots.py). Made again when the root becomes known, unless a block was already sent on it."""
    i = flying.chosen if flying.chosen is not None else 0
    if flying.guessed_for == i or flying.kept is not None:  # kept: a block went on the guess made
        return flying.guess
    draft = flying.drafts[i]

    def text_of(own: list[int]) -> list[int]:
        return flying.prefix + [flying.roots[i]] + [draft.tokens[r - 1] for r in own[1:]]

    def candidates(own: list[int], exclude: set[int]):
        predicted = strategy.predict(text_of(own), config.root_candidates)
        return candidate_roots(predicted, config.max_roots, config.root_floor, config.root_nodes, exclude)

    outcome = likeliest_outcome(draft, candidates, config.kept_tries)
    flying.guessed_for, flying.guess = i, None
    if outcome is not None:
        # its root is not known yet: the chance it is this one, given its assumption held
        share = flying.scores[i] / sum(flying.scores) if flying.chosen is None else 1.0
        kept = [flying.rows[i][r] for r in outcome.path]
        flying.guess = Guess(kept, text_of(outcome.path), outcome.roots, outcome.scores, outcome.below,
                             share * outcome.score)
    return flying.guess


def _make(strategy: Strategy, prefix: list[int], roots: list[int], scores: list[float], below: list[Draft]) -> _Flying:
    """A block after `prefix` with these candidate roots: the first gets a full draft from the strategy, the
    others their small predicted ones."""
    drafts = [strategy.propose(prefix + [roots[0]]), *below[1:]]
    block, rows = multi_root_block(roots, drafts)
    return _Flying(block, prefix, roots, scores, drafts, rows)


def _fill(
    verifier: InFlightVerifier, strategy: Strategy, history: list[int], flying: list[_Flying], depth: int,
    controller: AheadController,
) -> None:
    """Send blocks until `depth` are in flight, the strategy has no guess, or (unless pinned) the controller
    judges the next one not worth sending ahead."""
    while len(flying) < depth:
        start = time.perf_counter()
        if not flying:
            nxt = _make(strategy, history[:-1], history[-1:], [1.0], [Draft()])
        else:
            newest = flying[-1]
            guess = _guess(strategy, newest, controller.config)
            if guess is None:
                return
            p = newest.p * controller.p(guess.score)
            if not verifier.pinned and not controller.worth(p, len(flying) + 1):
                return
            newest.kept = guess.kept
            nxt = _make(strategy, guess.text, guess.roots, guess.scores, guess.below)
            nxt.p, nxt.alone, nxt.chosen = p, False, None
        block = nxt.block
        if not verifier.send_block(block.tokens, block.structure, block.depths, [f.kept for f in flying]):
            flying.clear()  # the link was lost with everything in flight: send again from the committed state
            continue
        nxt.sent_at = time.perf_counter()
        nxt.make_ms = (nxt.sent_at - start) * 1e3
        flying.append(nxt)


def _accept(flying: _Flying, logits: torch.Tensor, choose: Callable[[torch.Tensor], int]):
    """Accept from the chosen root's rows of a resolved block, as if they were a one-root block.

    Returns (path as block rows, the chosen token, and its one-root tokens, parents, logits [rows, vocab], path).
    """
    rows = flying.rows[flying.chosen]
    tokens, parents = flying.own(flying.chosen)
    # a one-root block keeps its side rows' logits (a lookahead window) for the strategy, as loop.py does
    own_logits = logits if len(flying.roots) == 1 else logits[rows]
    own_path, token = accept(tokens, parents, own_logits[: len(tokens)], choose)
    return [rows[r] for r in own_path], token, (tokens, parents, own_logits, own_path)


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
            path, root, (tokens, parents, own_logits, own_path) = _accept(current, logits, choose)
            guess = current.guess if current.guessed_for == current.chosen or current.kept is not None else None
            held = guess is not None and guess.kept == path and root in guess.roots
            if guess is not None:
                controller.observe_assumption(guess.score, held)
            verifier.resolve(path, (controller.p(guess.score), held) if guess is not None else None)
            if flying and (current.kept != path or root not in flying[0].roots):
                verifier.drop_unresolved()
                flying.clear()
            elif flying:
                flying[0].chosen = flying[0].roots.index(root)
            emitted = [tokens[r] for r in own_path[1:]] + [root]
            finish = emit_all(emitted, [logits[r] for r in path])
            now = time.perf_counter()
            strategy.recall(current.drafts[current.chosen])
            strategy.observe(tokens, parents, own_logits, own_path, emitted, (now - last) * 1e3)
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
