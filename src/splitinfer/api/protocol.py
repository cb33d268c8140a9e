"""OpenAI's HTTP shapes, with no I/O: request validation into typed parameters, response and chunk bodies,
error bodies, and stop-string matching over streamed text.

Only what the engine supports is accepted: one choice per request (`n` = 1), text content. Parameters the
API defines but this server ignores (logprobs, presence_penalty ...) are accepted and ignored, as other
local servers do, so existing tools keep working; anything malformed is refused with OpenAI's error body.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from ..decoding.sampling import SamplingConfig
from ..decoding.strategies import STRATEGIES

MAX_STOP_STRINGS = 4


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


@dataclass(frozen=True)
class Params:
    max_tokens: int  # generated tokens at most
    temperature: float  # 0 is greedy (speculation then reproduces sequential decoding exactly)
    top_p: float
    top_k: int  # not in OpenAI's API; vLLM-style extension (0 keeps all)
    seed: int | None
    stop: tuple[str, ...]  # stop strings; the text ends before the first one
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk carries the usage
    strategy: str  # splitinfer extension: the decoding strategy

    def sampling(self) -> SamplingConfig | None:
        if self.temperature == 0:
            return None
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, f"'{name}' must be a number.")
    if not low <= value <= high:
        raise _bad(name, f"'{name}' must be between {low:g} and {high:g}; got {value}.")
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"'{name}' must be an integer.")
    if value < low or (high is not None and value > high):
        raise _bad(name, f"'{name}' must be at least {low}" + (f" and at most {high}" if high else "") + f"; got {value}.")
    return value


def parse_params(body: dict, default_max_tokens: int, default_strategy: str) -> Params:
    if _integer(body, "n", 1, 1) != 1:
        raise _bad("n", "this server returns one choice per request; set 'n' to 1.")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _integer({"max_tokens": max_tokens}, "max_tokens", default_max_tokens, 1)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _bad("stop", "'stop' must be a string or a list of strings.")
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise _bad("stop", f"'stop' takes at most {MAX_STOP_STRINGS} non-empty strings.")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", "'stream' must be true or false.")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options", "'stream_options' must be an object.")
    strategy = body.get("strategy", default_strategy)
    if strategy not in STRATEGIES:
        raise _bad("strategy", f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}.")
    return Params(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-6,  # top_p = 0 keeps the single best token
        top_k=_integer(body, "top_k", 0, 0) or 0,
        seed=_integer(body, "seed", None, -(2**63), 2**64 - 1),
        stop=stops,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        strategy=strategy,
    )


def chat_messages(body: dict) -> list[dict]:
    """`messages` as [{"role", "content": str}]; text parts of multi-part content are joined."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list of {role, content} objects.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(f"messages[{i}]", f"messages[{i}] needs a role of system, user or assistant.")
        content = m.get("content")
        if isinstance(content, list):
            parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content):
                raise _bad(f"messages[{i}].content", "only text content parts are supported.")
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts.")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


def completion_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise _bad("prompt", "'prompt' must be a non-empty string or list of token ids (one prompt per request).")


# -- response bodies -------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_body(rid: str, model: str, text: str, finish: str, use: dict, stats: dict) -> dict:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                     "logprobs": None}],
        "usage": use, "splitinfer": stats,
    }


def completion_body(rid: str, model: str, text: str, finish: str, use: dict, stats: dict) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": use, "splitinfer": stats,
    }


def _chunk(rid: str, model: str, obj: str, choice: dict, use: dict | None) -> dict:
    # The last chunk of a stream carries only usage, with no choices (OpenAI's stream_options form).
    chunk = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
             "choices": [] if use is not None else [{"index": 0, **choice, "logprobs": None}]}
    if use is not None:
        chunk["usage"] = use
    return chunk


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, use: dict | None = None) -> dict:
    return _chunk(rid, model, "chat.completion.chunk", {"delta": delta, "finish_reason": finish}, use)


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, use: dict | None = None) -> dict:
    return _chunk(rid, model, "text_completion", {"text": text, "finish_reason": finish}, use)


# -- stop strings ----------------------------------------------------------------------------------
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
        hits = [i for i in (self.buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buffer, self.stopped = self.buffer[: min(hits)], "", True
            return out, True
        # A stop string can only begin in the last `hold` characters.
        cut = max(len(self.buffer) - self.hold, 0)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out
