"""The one generation path: a conversation keeps its cloud session between turns; a generation is one turn.

A `Conversation` owns one SplitSession and the token history behind it. Each `send(new_ids)` prefills
only what the caches do not hold yet (the last generated token of the previous turn plus the new
tokens), then decodes; so a multi-turn chat never re-prefills earlier turns. `SplitClient.generate` is a
conversation of one turn, so validation, streaming, stop strings, detokenization, stats and metrics are
written here once, for the Python API, the terminal chat and the OpenAI-compatible server alike.

A conversation is a context manager: leaving it closes the cloud session. If `on_text` raises (the
reader went away), the turn ends there, the cloud session is closed at once and the exception propagates.

It knows nothing about HTTP or terminals; text streams out through an `on_text` callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..decoding.loop import decode
from ..decoding.sampling import SamplingConfig, make_chooser
from ..decoding.strategies import STRATEGIES, Strategy, make_strategy
from ..decoding.warm import SuffixMemory
from ..errors import ConfigError
from ..progress import progress, progress_enabled
from ..telemetry import StepRecord, summarize
from .session import SplitSession
from .text import TextStream

if TYPE_CHECKING:
    from .client import SplitClient

PROGRESS_MIN_ROWS = 2048  # prefills longer than this show a progress bar (on a terminal)


@dataclass
class Turn:
    text: str  # generated text, cut before a stop string
    token_ids: list[int]  # generated ids
    finish_reason: str  # "stop" (end-of-sequence token or stop string) or "length"
    prompt_tokens: int  # tokens of the whole conversation the model saw before generating
    prefilled_tokens: int  # of those, the ones prefilled by this turn (the rest came from the cache)
    stats: dict = field(default_factory=dict)
    logprobs: list[float] = field(default_factory=list)  # log-probability of each generated token
    steps: list[dict] = field(default_factory=list)  # this turn's per-step telemetry records


@dataclass
class _Decoded:
    finish: str
    tokens: list[int]
    logprobs: list[float]


def _count_emitted_only(records: list[StepRecord], unemitted: int) -> None:
    """Take off the last decode step's count the accepted rows that were never emitted.

    A step accepts a whole path, but decoding stops at the token limit, an end-of-sequence token or a
    stop string, possibly inside it; those rows were committed and are dropped again (uncommit). Counted,
    they would claim tokens the user never got (a 127-token reply scored 141 accepted).
    """
    decode = [r for r in records if r.kind == "decode"]
    if unemitted > 0 and decode:
        decode[-1].accepted = max(decode[-1].accepted - unemitted, 0)


class Conversation:
    """Token history plus one cloud session, kept across turns; not thread-safe (one user at a time).

    strategy: a name (a fresh strategy every turn, so nothing learned leaks from one turn into the next)
    or a Strategy instance (kept, with what it learned, across turns). memory: earlier outputs of this
    client process that a fresh strategy may draft from (warm.py); each reply is added to it. A memory
    shared by conversations carries text from one to the next, on the client only: the `api` and `chat`
    commands share one per process; `SplitClient.generate` and the benchmarks use none.
    """

    def __init__(self, client: SplitClient, strategy: str | Strategy = "tree", metrics=None,
                 memory: SuffixMemory | None = None):
        if isinstance(strategy, str) and strategy not in STRATEGIES:
            raise ConfigError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}.")
        self.client = client
        self.strategy = strategy
        self.metrics = metrics
        self.memory = memory
        self.history: list[int] = []  # every token of the conversation; all but the last are in the caches
        self.session: SplitSession | None = None
        self._stale = False  # the caches may hold rows the history lacks; the next turn starts a new session

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def cached_tokens(self) -> int:
        return self.session.length if self.session is not None else 0

    def close(self) -> None:
        if self.session is not None:
            try:
                self.session.close()
            finally:
                self.session = None
                if self.metrics is not None:
                    self.metrics.untrack_session(id(self))

    def reset(self) -> None:
        self.close()
        self.history = []
        self._stale = False

    def send(
        self,
        new_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        stop: tuple[str, ...] = (),
        on_text: Callable[[str], None] | None = None,
        stop_ids: set[int] | None = None,
        on_token: Callable[[int, float, list[tuple[int, float]]], None] | None = None,
        top_logprobs: int = 0,
    ) -> Turn:
        """Append `new_ids` to the conversation and generate a reply of at most `max_new_tokens` tokens.

        stop: strings that end the reply (cut before them); stop_ids: tokens that end it (default: the
        model's end-of-sequence tokens). on_token(token, logprob, top) is called for each generated token
        before its text goes to on_text; top holds the `top_logprobs` likeliest (token, logprob) pairs of the
        row that predicted it (empty for 0).
        """
        self._check(new_ids, max_new_tokens)
        if self._stale:
            self.close()
            self._stale = False
        before = len(self.history)
        if self.session is None:
            self.session = self._open()
        cached = self.session.length
        self.history.extend(new_ids)
        to_prefill = self.history[cached:]
        stops = self.client.stop_ids() if stop_ids is None else stop_ids
        strategy = self._strategy()
        first_record = len(self.session.records)
        text = TextStream(self.client.local.tokenizer, on_text, stops, stop)
        try:
            t0 = time.perf_counter()
            logits = self._prefill(to_prefill, strategy.prompt_logits_rows)
            t1 = time.perf_counter()
            decoded = self._decode(logits, max_new_tokens, stops, text, strategy, sampling, on_token, top_logprobs)
            self.session.pad_exchanges(first_record)  # counted in the decode time: it is what the padding costs
            t2 = time.perf_counter()
            reply = text.finish()
            # Every token but the last emitted one stays cached; that one is prefilled by the next turn.
            unemitted = self.session.length - (len(self.history) - 1)
            self._stale = not self.session.uncommit(unemitted)
            _count_emitted_only(self.session.records[first_record:], unemitted)
        except BaseException:
            # The caches' state is unknown after a failure: forget this turn and re-prefill next time.
            self.history = self.history[:before]
            self.close()
            raise
        if self.memory is not None:
            self.memory.add(decoded.tokens)
        records = self.session.records[first_record:]
        stats = self._stats(records, decoded, strategy, t2 - t1, t1 - t0, len(to_prefill), cached)
        steps = [r.as_dict() for r in records]
        return Turn(reply, decoded.tokens, decoded.finish, before + len(new_ids), len(to_prefill), stats,
                    decoded.logprobs, steps)

    def _strategy(self) -> Strategy:
        if not isinstance(self.strategy, str):
            return self.strategy
        client = self.client
        return make_strategy(self.strategy, costs=client.step_costs, memory=self.memory,
                             recycling_table=client.recycling_table, head=client.draft_head)

    def _check(self, new_ids: list[int], max_new_tokens: int) -> None:
        if not new_ids and not self.history:
            raise ConfigError("the prompt is empty; give at least one token.")
        if max_new_tokens < 1:
            raise ConfigError("ask for at least one new token (max_new_tokens, or max_tokens in the API).")
        limit = self.client.local.config.to_dict().get("max_position_embeddings")  # not every architecture has one
        total = len(self.history) + len(new_ids)
        if limit is not None and total + max_new_tokens > limit:
            raise ConfigError(
                f"the prompt ({total} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
                f"of {limit}; shorten the prompt, start a new conversation or ask for fewer tokens."
            )

    def _open(self) -> SplitSession:
        session = SplitSession(self.client.local, self.client.make_middle(), self.client.config)
        if self.metrics is not None:
            self.metrics.track_session(
                id(self), lambda: (session.length, session.head_cache.nbytes() + session.tail_cache.nbytes())
            )
        return session

    def _prefill(self, tokens: list[int], logits_rows: int) -> torch.Tensor:
        session = self.session
        chunk = max(1, self.client.config.prefill_chunk)
        if len(tokens) <= PROGRESS_MIN_ROWS or not progress_enabled():
            return session.prefill(tokens, logits_rows=logits_rows)
        logits = None
        with progress(total=len(tokens), desc="prefill", unit="tok") as bar:
            for start in range(0, len(tokens), chunk):
                part = tokens[start : start + chunk]
                last = start + chunk >= len(tokens)
                logits = session.prefill(part, logits_rows=logits_rows if last else 1)
                bar.update(len(part))
        return logits

    def _decode(self, logits: torch.Tensor, max_new_tokens: int, stops: set[int], text: TextStream,
                strategy: Strategy, sampling: SamplingConfig | None, on_token=None, top_logprobs: int = 0) -> _Decoded:
        tokens: list[int] = []
        logprobs: list[float] = []

        def emit(token: int, logprob: float, top: list[tuple[int, float]] = ()) -> bool:
            tokens.append(token)
            logprobs.append(logprob)
            self.history.append(token)
            if on_token is not None:
                on_token(token, logprob, list(top))
            return text.push(token)

        finish = decode(self.session, list(self.history), logits, max_new_tokens, stops, emit, strategy,
                        make_chooser(sampling), top_logprobs=top_logprobs)
        return _Decoded(finish, tokens, logprobs)

    def _stats(self, records: list[StepRecord], decoded: _Decoded, strategy: Strategy, decode_s: float,
               prefill_s: float, prefilled: int, cached: int) -> dict:
        client = self.client
        stats = summarize(records, len(decoded.tokens), decode_s=decode_s, prefill_s=prefill_s)
        stats.update(
            mode=client.mode,
            strategy=strategy.name,
            wire_dtype=client.config.wire_dtype if client.mode == "split" else None,
            head_layers=self.session.head_layers,
            prefilled_tokens=prefilled,
            cached_tokens=cached,
            **strategy.report(),
        )
        if self.metrics is not None:
            self.metrics.observe_steps(records)
            self.metrics.observe_generation(prefilled, len(decoded.tokens), stats["tokens_per_s"], decoded.finish)
        return stats
