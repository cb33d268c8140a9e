"""The one decoding loop: propose, verify, accept, commit, with up to D blocks in flight.

    root = choose(prefill logits)                               # emitted
    repeat:
        send a block below the root: strategy.propose(history).to_block(root)
        while fewer than D blocks are out and the strategy can guess what follows the newest one:
            assume its draft's top path (below its likeliest root while that is not known) is accepted
            whole, or only the likeliest prefix of it, and that the token chosen after it is one of the
            strategy's likeliest next tokens (roots.py: up to AheadConfig.max_roots candidates); p = the
            chance that this and every earlier assumption in flight holds (the kept rows' chance times the
            candidates' summed scores, times the hold rate measured so far);
            unless D is pinned, stop here when the controller (ahead.py) judges the block not worth it;
            send the next block with a root row per candidate, each with a draft below it
        logits = receive the oldest block                       # one round trip
        path, next = accept(its chosen root's rows, logits, choose)
        resolve(path)                                           # kept locally now, on the cloud with the next request
        if the next block in flight assumed another path or has no root equal to `next`: drop it and every
        later one; else that root is the next block's root
        emit(accepted drafts..., next)

D = 1 (`Verifier.in_flight`) is one block at a time: the loop above without the inner `while`. With
`choose = argmax` the emitted tokens are exactly those of sequential greedy decoding, for every D: a block
in flight is used only if every earlier block kept exactly the path it assumed and one of its roots is
exactly the token chosen there; only that root's rows are accepted from, as a one-root block, with the
same `choose` calls on the same rows as one block at a time. Sampling draws each token from the model's
own distribution, the same way. Whether a block goes ahead, and with how many roots, changes only the
timing, never the output. Each emitted token's log-probability comes from the logits row that predicted
it: the parent's row. Strategies that read the final features (a learned draft head) need each block's
features before drafting the next, so they go one block at a time; where blocks go without waiting
(`in_flight` > 1), such a strategy drafts the next tree while the block is out, for the block's likeliest
outcome (`Strategy.draft_ahead`), and uses it only if that outcome comes.

The loop knows the verifier through its Protocol (verifier.py) and the strategy through
propose/predict/recall/observe; the cloud session, the wire and the caches are the verifier's business. It
times its own work (drafting, acceptance) and asks the verifier for the rest (cloud compute, tail) to feed
the controller; it keeps no telemetry (the verifier records its steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .ahead import AheadConfig, AheadController
from .draft import Block, Draft, accept
from .roots import candidate_roots, likeliest_outcome, multi_root_block
from .sampling import greedy
from .strategy import Strategy
from .verifier import Verifier

Emit = Callable[[list[int], list[torch.Tensor]], "str | None"]


def decode(
    verifier: Verifier,
    prompt: list[int],
    prompt_logits: torch.Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    emit: Callable[[int, float], bool | None],
    strategy: Strategy,
    choose: Callable[[torch.Tensor], int] = greedy,
    controller: AheadController | None = None,
    top_logprobs: int = 0,
) -> str:
    """Decode after prefill; `emit(token, logprob)` per token. Returns "stop" or "length".

    emit returns True to end decoding after that token ("stop": e.g. its text completed a stop string).
    top_logprobs > 0: emit is called as `emit(token, logprob, top)`, top being the row's `top_logprobs`
    likeliest (token, logprob) pairs, likeliest first. Log-probabilities are the model's own (log-softmax
    of the row that predicted the token, before any temperature or truncation).

    prompt_logits: [r, vocab] logits of the prompt's last r rows (r >= 1; the strategy asked for r).
    """
    strategy.start(prompt, prompt_logits)
    if strategy.uses_features:
        strategy.see_features(verifier.features(strategy.feature_states))
    history = list(prompt)
    produced = 0

    def emit_all(tokens: list[int], rows: list[torch.Tensor]) -> str | None:
        nonlocal produced
        for token, row in zip(tokens, rows):
            logprobs = torch.log_softmax(row, dim=-1)
            if top_logprobs:
                values, ids = torch.topk(logprobs, min(top_logprobs, logprobs.numel()))
                ended = emit(token, float(logprobs[token]), list(zip(ids.tolist(), values.tolist())))
            else:
                ended = emit(token, float(logprobs[token]))
            history.append(token)
            produced += 1
            if ended or token in stop_ids:
                return "stop"
            if produced == max_new_tokens:
                return "length"
        return None

    first_logits = prompt_logits[-1]
    finish = emit_all([choose(first_logits)], [first_logits])
    if finish is not None:
        return finish
    # a draft head drafts from the features of the block before: it cannot draft past a block in flight, but
    # where blocks go without waiting it drafts the next tree while one is out (`Strategy.draft_ahead`)
    depth = 1 if strategy.uses_features else verifier.in_flight
    ahead = strategy.drafts_ahead and verifier.in_flight > 1
    return _decode_blocks(verifier, history, emit_all, strategy, choose, depth, controller or AheadController(), ahead)


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

    def made_guess(self) -> Guess | None:
        """The guess made for its chosen root, or the one a block was sent on; None when neither was made."""
        return self.guess if self.guessed_for == self.chosen or self.kept is not None else None


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
    others their small predicted ones. One root with no draft below it is an ordinary block below the root."""
    drafts = [strategy.propose(prefix + [roots[0]]), *below[1:]]
    block, rows = multi_root_block(roots, drafts)
    return _Flying(block, prefix, roots, scores, drafts, rows)


def _fill(
    verifier: Verifier, strategy: Strategy, history: list[int], flying: list[_Flying], depth: int,
    controller: AheadController, ahead: bool = False,
) -> None:
    """Send blocks until `depth` are in flight, the strategy has no guess, or (unless pinned) the controller
    judges the next one not worth sending ahead. ahead: a block sent alone goes without waiting either (the
    strategy drafts while it is out)."""
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
        assume = [f.kept for f in flying]
        if not verifier.send_block(block.tokens, block.structure, block.depths, assume, wait=depth == 1 and not ahead):
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
    # a one-root block keeps its side rows' logits (a lookahead window) for the strategy
    own_logits = logits if len(flying.roots) == 1 else logits[rows]
    own_path, token = accept(tokens, parents, own_logits[: len(tokens)], choose)
    return [rows[r] for r in own_path], token, (tokens, parents, own_logits, own_path)


def _decode_blocks(
    verifier: Verifier, history: list[int], emit_all: Emit, strategy: Strategy,
    choose: Callable[[torch.Tensor], int], depth: int, controller: AheadController, ahead: bool = False,
) -> str:
    """Decode with up to `depth` blocks in flight after the first token was emitted (history ends with it;
    emit_all appends to it); ahead: one block at a time, the strategy drafting while it is out. Returns
    "stop" or "length"."""
    flying: list[_Flying] = []
    finish = None
    last = time.perf_counter()
    try:
        while finish is None:
            _fill(verifier, strategy, history, flying, depth, controller, ahead)
            waited_alone = len(flying) == 1 and flying[0].alone and not ahead
            if ahead and flying:
                strategy.draft_ahead(history, flying[0].drafts[0])
            logits = verifier.receive_block()
            if logits is None:
                flying.clear()
                continue
            back = time.perf_counter()
            current = flying.pop(0)
            path, root, (tokens, parents, own_logits, own_path) = _accept(current, logits, choose)
            _resolve(verifier, controller, current, path, root, flying)
            if strategy.uses_features:
                strategy.see_features(verifier.features(strategy.feature_states))
            emitted = [tokens[r] for r in own_path[1:]] + [root]
            # A token is predicted by its parent's row: path[i] by path[i-1], the next root by path[-1].
            finish = emit_all(emitted, [logits[r] for r in path])
            now = time.perf_counter()
            strategy.recall(current.drafts[current.chosen])
            strategy.observe(tokens, parents, own_logits, own_path, emitted, (now - last) * 1e3)
            last = now
            _measure(controller, verifier, current, back, waited_alone)
    finally:
        verifier.settle()
    return finish


def _resolve(
    verifier: Verifier, controller: AheadController, current: _Flying, path: list[int], root: int,
    flying: list[_Flying],
) -> None:
    """Commit the oldest block's path, check the assumption made of it, and drop the blocks in flight that
    assumed otherwise (or tell the next one which of its roots was chosen)."""
    guess = current.made_guess()
    held = guess is not None and guess.kept == path and root in guess.roots
    if guess is not None:
        controller.observe_assumption(guess.score, held)
    verifier.resolve(path, (controller.p(guess.score), held) if guess is not None else None)
    if flying and (current.kept != path or root not in flying[0].roots):
        verifier.drop_unresolved()
        flying.clear()
    elif flying:
        flying[0].chosen = flying[0].roots.index(root)


def _measure(controller: AheadController, verifier: Verifier, block: _Flying, back: float, alone: bool) -> None:
    """Feed a resolved block's costs to the controller. Its latency counts only when it went alone and was
    waited for at once: a block behind others, or one whose reply waited while the client made the next,
    measures queueing, not latency."""
    cloud_ms, tail_ms = verifier.block_costs()
    settle_ms = (time.perf_counter() - back) * 1e3
    latency = (back - block.sent_at) * 1e3 - tail_ms if alone else None
    controller.observe_block(cloud_ms, block.make_ms + tail_ms + settle_ms, block.make_ms, latency)
