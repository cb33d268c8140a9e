"""Generation for the api server: independent requests over one SplitClient, at most N at once.

The local weights are read-only and shared; each request is a one-turn conversation of its own (its own
WebSocket connection and cloud session, local/conversation.py), closed when the request ends. If the
`on_text` callback raises (the HTTP client went away), the generation stops there and its cloud session
is closed at once; the exception reaches the caller.

Requests share one memory of earlier replies (decoding/warm.py) that the tree drafts from: a client that
asks similar things again gets the shared wording proposed. It stays in this process. Replies stay
exact whatever it holds, but how fast a request runs depends on it: where users of one API server must
not learn even that much about each other's replies, run it with --memory-tokens 0.

It knows nothing about HTTP; text streams out through the `on_text` callback.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..decoding.warm import SUFFIX_MEMORY_TOKENS, suffix_memory
from ..errors import ConfigError
from ..local.client import SplitClient
from ..local.config import CLIENT_DEFAULTS
from ..local.conversation import Conversation, Turn
from ..local.text import chat_prompt_ids, has_chat_template
from .config import API_DEFAULTS
from .logprobs import TokenText
from .protocol import Params

__all__ = ["Conversation", "Engine", "Turn"]


class Engine:
    """Independent requests over one SplitClient, at most `max_concurrent` generating at once."""

    def __init__(self, client: SplitClient, model_id: str, metrics=None, strategy: str = CLIENT_DEFAULTS.strategy,
                 max_concurrent: int = API_DEFAULTS.max_concurrent,
                 default_max_tokens: int = API_DEFAULTS.max_new_tokens, memory_tokens: int = SUFFIX_MEMORY_TOKENS):
        self.client = client
        self.model_id = model_id
        self.metrics = metrics
        self.strategy = strategy
        self.default_max_tokens = default_max_tokens
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self.memory = suffix_memory(memory_tokens)  # earlier replies, searched by every request's tree
        self._token_text: TokenText | None = None

    @property
    def token_text(self) -> TokenText:
        """Each token's text and bytes, for logprobs (built once)."""
        if self._token_text is None:
            self._token_text = TokenText(self.client.local.tokenizer)
        return self._token_text

    @property
    def tokenizer(self):
        tok = self.client.local.tokenizer
        if tok is None:
            raise ConfigError("this local shard has no tokenizer; send /v1/completions with token ids instead.")
        return tok

    def chat_ids(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        if not has_chat_template(tok):
            raise ConfigError("this model has no chat template; use /v1/completions with a plain prompt.")
        return chat_prompt_ids(tok, messages)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        vocab = self.client.local.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ConfigError(f"token ids must lie in [0, {vocab}).")
        return prompt

    def generate(self, prompt_ids: list[int], params: Params, on_text: Callable[[str], None] | None = None,
                 on_token: Callable[[int, float, list], None] | None = None) -> Turn:
        """on_token(token, logprob, top): each generated token, before its text reaches on_text, with the
        `params.top_logprobs` likeliest alternatives (Conversation.send)."""
        with self._slots, self.client.conversation(params.strategy, self.metrics, self.memory) as conversation:
            return conversation.send(prompt_ids, params.max_tokens, params.sampling(), params.stop, on_text,
                                     on_token=on_token, top_logprobs=params.top_logprobs)
