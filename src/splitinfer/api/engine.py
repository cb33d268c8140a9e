"""Generation for the api server and the chat: conversations that keep their cloud session between turns.

A `Conversation` owns one SplitSession and the token history behind it. Each `send(new_ids)` prefills
only what the caches do not hold yet (the last generated token of the previous turn plus the new
tokens), then decodes; so a multi-turn chat never re-prefills earlier turns. `Engine` serves independent
requests concurrently: the local weights are read-only and shared, and each request gets a conversation
of its own (its own WebSocket connection and cloud session), closed when the request ends.

It knows nothing about HTTP or terminals; text streams out through an `on_text` callback.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..decoding.loop import decode
from ..decoding.sampling import SamplingConfig, make_chooser
from ..decoding.strategies import make_strategy
from ..errors import ConfigError
from ..local.client import SplitClient, _TextStreamer
from ..local.session import SplitSession
from ..progress import progress, progress_enabled
from ..telemetry import summarize
from .protocol import Params, StopMatcher

PROGRESS_MIN_ROWS = 2048  # prefills longer than this show a progress bar (on a terminal)


@dataclass
class Turn:
    text: str  # generated text, cut before a stop string
    token_ids: list[int]  # generated ids
    finish_reason: str  # "stop" (end-of-sequence token or stop string) or "length"
    prompt_tokens: int  # tokens of the whole conversation the model saw before generating
    prefilled_tokens: int  # of those, the ones prefilled by this turn (the rest came from the cache)
    stats: dict = field(default_factory=dict)


class _StopString(Exception):
    """Raised from the text callback to end decoding at a stop string."""


class Conversation:
    """Token history plus one cloud session, kept across turns; not thread-safe (one user at a time)."""

    def __init__(self, client: SplitClient, strategy: str = "tree", metrics=None):
        self.client = client
        self.strategy = strategy
        self.metrics = metrics
        self.history: list[int] = []  # every token of the conversation; all but the last are in the caches
        self.session: SplitSession | None = None
        self._stale = False  # the caches may hold rows the history lacks; the next turn starts a new session

    @property
    def cached_tokens(self) -> int:
        return self.session.length if self.session is not None else 0

    def _open(self) -> SplitSession:
        session = SplitSession(self.client.local, self.client.make_middle(), self.client.config)
        if self.metrics is not None:
            self.metrics.track_session(
                id(self), lambda: (session.length, session.head_cache.nbytes() + session.tail_cache.nbytes())
            )
        return session

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

    def _prefill(self, tokens: list[int], logits_rows: int):
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

    def send(
        self,
        new_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        stop: tuple[str, ...] = (),
        on_text: Callable[[str], None] | None = None,
        stop_ids: set[int] | None = None,
    ) -> Turn:
        """Append `new_ids` to the conversation and generate a reply."""
        if not new_ids and not self.history:
            raise ConfigError("the prompt is empty; give at least one token.")
        if max_new_tokens < 1:
            raise ConfigError("max_tokens must be at least 1.")
        limit = getattr(self.client.local.config, "max_position_embeddings", None)
        total = len(self.history) + len(new_ids)
        if limit is not None and total + max_new_tokens > limit:
            raise ConfigError(
                f"the conversation ({total} tokens) + max_tokens ({max_new_tokens}) exceeds the model's context "
                f"of {limit}; start a new conversation or ask for fewer tokens."
            )
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
        strategy = make_strategy(self.strategy, costs=self.client.step_costs)
        first_record = len(self.session.records)
        tokens: list[int] = []
        visible: list[int] = []  # without end-of-sequence tokens, whose text is not part of the reply
        pieces: list[str] = []
        matcher = StopMatcher(stop) if stop else None

        def out(text: str) -> None:
            if text:
                pieces.append(text)
                if on_text is not None:
                    on_text(text)

        def on_piece(delta: str) -> None:
            if matcher is None:
                return out(delta)
            text, stopped = matcher.feed(delta)
            out(text)
            if stopped:
                raise _StopString

        streamer = _TextStreamer(self.client.local.tokenizer, on_piece)

        def emit(token: int, _logprob: float) -> None:
            tokens.append(token)
            self.history.append(token)
            if token not in stops:
                visible.append(token)
            streamer.push(visible, token in stops)

        try:
            t0 = time.perf_counter()
            logits = self._prefill(to_prefill, strategy.prompt_logits_rows)
            t1 = time.perf_counter()
            try:
                finish = decode(self.session, list(self.history), logits, max_new_tokens, stops, emit, strategy,
                                make_chooser(sampling))
                streamer.flush(visible)
            except _StopString:
                finish = "stop"
            t2 = time.perf_counter()
            # Every token but the last emitted one stays cached; that one is prefilled by the next turn.
            self._stale = not self.session.uncommit(self.session.length - (len(self.history) - 1))
        except BaseException:
            # The caches' state is unknown after a failure: forget this turn and re-prefill next time.
            self.history = self.history[:before]
            self.close()
            raise
        if matcher is not None:
            out(matcher.flush())
        records = self.session.records[first_record:]
        stats = summarize(records, len(tokens), decode_s=t2 - t1, prefill_s=t1 - t0)
        stats.update(strategy=strategy.name, prefilled_tokens=len(to_prefill), cached_tokens=cached)
        if self.metrics is not None:
            self.metrics.observe_steps(records)
            self.metrics.observe_generation(len(to_prefill), len(tokens), stats["tokens_per_s"], finish)
        return Turn("".join(pieces), tokens, finish, before + len(new_ids), len(to_prefill), stats)


class Engine:
    """Independent requests over one SplitClient, at most `max_concurrent` generating at once."""

    def __init__(self, client: SplitClient, model_id: str, metrics=None, strategy: str = "tree",
                 max_concurrent: int = 4, default_max_tokens: int = 256):
        self.client = client
        self.model_id = model_id
        self.metrics = metrics
        self.strategy = strategy
        self.default_max_tokens = default_max_tokens
        self._slots = threading.BoundedSemaphore(max_concurrent)

    @property
    def tokenizer(self):
        tok = self.client.local.tokenizer
        if tok is None:
            raise ConfigError("this local shard has no tokenizer; send /v1/completions with token ids instead.")
        return tok

    def chat_ids(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ConfigError("this model has no chat template; use /v1/completions with a plain prompt.")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        vocab = self.client.local.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ConfigError(f"token ids must lie in [0, {vocab}).")
        return prompt

    def generate(self, prompt_ids: list[int], params: Params, on_text: Callable[[str], None] | None = None) -> Turn:
        with self._slots:
            conversation = Conversation(self.client, params.strategy, self.metrics)
            try:
                return conversation.send(prompt_ids, params.max_tokens, params.sampling(), params.stop, on_text)
            finally:
                conversation.close()
