"""Tokens to text and back on the trusted side: the chat template, streamed detokenization, stop strings.

`TextStream` turns generated tokens into text once for every caller (the Python API, the terminal chat,
the OpenAI-compatible server): it streams only pieces that will not change when more tokens arrive,
leaves end-of-sequence tokens out of the text and reports when the text reaches a stop string.
With a fast tokenizer the pieces come from `tokenizers`' `DecodeStream`, which decodes only the last few
tokens each step, so a token costs the same at the end of a long reply as at its start (decoding the whole
reply again for every token made a reply quadratic in its length); the text is the same either way.
Nothing here runs the model or touches the network.
"""

from __future__ import annotations

from collections.abc import Callable

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers before 0.21: the whole reply is decoded every time
    DecodeStream = None


def has_chat_template(tokenizer) -> bool:
    """Whether `tokenizer` (None where the shard has none) renders chat messages: the one test of it, made for
    the Python API's text prompts, the terminal chat and the HTTP API's chat completions alike."""
    return tokenizer is not None and bool(tokenizer.chat_template)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The ids of `messages` rendered by the tokenizer's chat template, ending where the assistant's reply starts."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def before_stop(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to (not including) the first occurrence of any stop string."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(hits)] if hits else text


class StopMatcher:
    """Cuts streamed text before the first stop string, holding back only what could still start one.

    `feed(delta) -> (text safe to emit, stopped)`; after `stopped`, nothing more is emitted. `flush()`
    releases the held-back tail when generation ends without a stop string.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buffer = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.buffer += delta
        cut = before_stop(self.buffer, self.stops)
        if len(cut) < len(self.buffer):
            self.buffer, self.stopped = "", True
            return cut, True
        # A stop string can only begin in the last `hold` characters.
        keep_from = max(len(self.buffer) - self.hold, 0)
        out, self.buffer = self.buffer[:keep_from], self.buffer[keep_from:]
        return out, False

    def flush(self) -> str:
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out


def _decode_stream(tokenizer):
    """(the `tokenizers.Tokenizer` behind `tokenizer`, a fresh DecodeStream), or None where it cannot stand
    in for `tokenizer.decode`: a slow tokenizer, or one that cleans up spaces after decoding."""
    from transformers import PreTrainedTokenizerFast

    if DecodeStream is None or not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    if tokenizer.clean_up_tokenization_spaces:
        return None
    return tokenizer.backend_tokenizer, DecodeStream(skip_special_tokens=True)


class TextStream:
    """The text of one reply, built token by token.

    `push(token)` returns True when the reply's text has reached a stop string, so generation should end.
    Tokens in `stop_ids` (end of sequence) end generation and are not part of the text. Pieces go to
    `on_text` as soon as they are final; with no listener and no stop strings nothing is decoded until
    `finish()`, so an unobserved generation pays for detokenization once.
    """

    def __init__(self, tokenizer, on_text: Callable[[str], None] | None = None,
                 stop_ids: set[int] = frozenset(), stop_strings: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.on_text = on_text
        self.stop_ids = stop_ids
        self.stop_strings = stop_strings
        self.matcher = StopMatcher(stop_strings) if stop_strings else None
        self.visible: list[int] = []  # generated ids without end-of-sequence tokens
        self.sent: list[str] = []  # the decoded pieces already passed on
        self.incremental = None if tokenizer is None else _decode_stream(tokenizer)

    def decoded(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.visible, skip_special_tokens=True)

    def push(self, token: int) -> bool:
        if token in self.stop_ids:
            return self._advance(final=True)
        self.visible.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """Pass on what was held back and return the reply's text, cut before the first stop string."""
        if self.matcher is None or not self.matcher.stopped:
            self._advance(final=True)
        if self.matcher is not None:
            self._out(self.matcher.flush())
        return before_stop(self.decoded(), self.stop_strings)

    def _delta(self, final: bool) -> str:
        """The text the reply gained since the last piece, once it will not change ("" until then)."""
        if self.incremental is not None and not final:
            backend, stream = self.incremental
            return stream.step(backend, self.visible[-1]) or ""  # None: a character is not complete yet
        text = self.decoded()  # at the end, or with no DecodeStream: the whole reply
        # A trailing replacement character is a multi-byte character that is not complete yet.
        if not final and text.endswith("\ufffd"):
            return ""
        sent = "".join(self.sent)
        return text[len(sent):] if text.startswith(sent) and len(text) > len(sent) else ""

    def _advance(self, final: bool) -> bool:
        if self.tokenizer is None or (self.on_text is None and self.matcher is None):
            return False
        delta = self._delta(final)
        if not delta:
            return False
        self.sent.append(delta)
        if self.matcher is None:
            self._out(delta)
            return False
        safe, stopped = self.matcher.feed(delta)
        self._out(safe)
        return stopped

    def _out(self, text: str) -> None:
        if text and self.on_text is not None:
            self.on_text(text)
