"""OpenAI's HTTP shapes, with no I/O: request validation into typed parameters, response and chunk bodies,
and error bodies. Stop strings are matched where the text is made (local/text.py; StopMatcher is
re-exported here for its importers).

Every request parameter is honoured or refused, with one exception: `user` (OpenAI's end-user id) is
accepted, type-checked and ignored (`IGNORED`), since this server keeps no per-user records and clients send
it unasked. `PARAMETERS` names what each endpoint takes; a parameter OpenAI defines that this server does not
implement is accepted only at its no-op value (`NO_OP`: null, or e.g. `presence_penalty: 0`, `n: 1`, `echo:
false`) and otherwise refused with OpenAI's error body (400, code "unsupported_parameter"); a name OpenAI does
not define is refused too (code "unknown_parameter"). docs/api.md lists them all (tests/api/test_protocol.py
checks its tables against these).

`logprobs`/`top_logprobs` are computed on the trusted side from the same logits rows that chose each token
(decoding/loop.py), so they cost nothing on the wire and hold for every strategy.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from ..decoding.sampling import SamplingConfig
from ..decoding.strategies import STRATEGIES
from ..local.text import StopMatcher  # noqa: F401  (re-exported)

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI's bound
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions' logprobs, as OpenAI's bound

# What each endpoint honours (besides `model` and `messages` / `prompt`).
COMMON = ("max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "logprobs",
          "top_k", "strategy")
# Accepted (a string, or null) and ignored: OpenAI's end-user id for its abuse monitoring. This server keeps no
# per-user records, so there is nothing to do with it; refusing it would break clients that always send it.
IGNORED = ("user",)
PARAMETERS = {
    True: ("model", "messages", *COMMON, "max_completion_tokens", "top_logprobs", *IGNORED),
    False: ("model", "prompt", *COMMON, *IGNORED),
}
# The roles a chat message may have (`developer` is read as `system`).
ROLES = ("system", "developer", "user", "assistant", "tool")
# Parameters OpenAI defines that this server does not implement, with the values that ask for nothing (null is
# always one). Any other value is refused, with why in UNSUPPORTED where there is more to say.
NO_OP = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "echo": (False,), "best_of": (1,),
    "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},), "store": (False,),
    "metadata": ({},), "modalities": (["text"],), "service_tier": ("auto", "default"), "audio": (),
    "prediction": (), "reasoning_effort": (), "web_search_options": (), "verbosity": (), "prompt_cache_key": (),
    "safety_identifier": (),
}
UNSUPPORTED = {
    "presence_penalty": "the penalties are not implemented: a penalised draft token's distribution depends on the "
                        "tokens before it in the draft, which the verifier does not condition on yet, and an "
                        "approximation would break speculation's exactness. Send 0 or leave it out.",
    "frequency_penalty": "the penalties are not implemented: a penalised draft token's distribution depends on the "
                         "tokens before it in the draft, which the verifier does not condition on yet, and an "
                         "approximation would break speculation's exactness. Send 0 or leave it out.",
    "tools": "this server has no tool calling; leave 'tools' out.",
    "response_format": "only {\"type\": \"text\"} is supported (no JSON mode or schemas).",
}
# Below this a temperature divides logits past float32's range (inf - inf = nan in the softmax); 0 is greedy.
MIN_TEMPERATURE = 1e-4
# top_p is compared in float32, where a smaller value rounds to 0 and keeps no token at all; this keeps the best.
MIN_TOP_P = 1e-6


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


def show(value, limit: int = 80) -> str:
    """A peer's value quoted in an error message: its repr, at most `limit` characters (an int of any size too)."""
    if isinstance(value, int) and value.bit_length() > 3 * limit:  # repr refuses ints of over 4300 digits
        return f"an integer of about {int(math.log10(abs(value))) + 1} digits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    logprobs: bool = False  # return each generated token's log-probability
    top_logprobs: int = 0  # and this many likeliest alternatives per position

    def sampling(self) -> SamplingConfig | None:
        if self.temperature == 0:
            return None
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, f"'{name}' must be a number.")
    if isinstance(value, float) and not math.isfinite(value):  # an int of any size is finite (and may not fit a float)
        raise _bad(name, f"'{name}' must be a finite number.")
    if not low <= value <= high:
        raise _bad(name, f"'{name}' must be between {low:g} and {high:g}; got {show(value)}.")
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"'{name}' must be an integer.")
    if value < low or (high is not None and value > high):
        raise _bad(name, f"'{name}' must be at least {low}" + (f" and at most {high}" if high else "") + f"; got {show(value)}.")
    return value


def check_parameters(body: dict, chat: bool) -> None:
    """Refuse every parameter this endpoint does not honour, unless it asks for nothing (module doc)."""
    honoured = PARAMETERS[chat]
    for name, value in body.items():
        if name in honoured:
            continue
        if name in NO_OP:
            if value is None or any(_same(value, v) for v in NO_OP[name]):
                continue
            why = UNSUPPORTED.get(name, f"this server does not implement '{name}'; leave it out.")
            raise APIError(400, f"unsupported value {show(value)} for '{name}': {why}", param=name,
                           code="unsupported_parameter")
        other = PARAMETERS[not chat]
        where = f" (it belongs to /v1/{'completions' if chat else 'chat/completions'})" if name in other else ""
        raise APIError(400, f"unrecognized request argument supplied: {show(name)}{where}.", param=name[:80].encode("utf-8", "backslashreplace").decode(),
                       code="unknown_parameter")


def _same(value, no_op) -> bool:
    """JSON equality that keeps true apart from 1 (0 and 0.0 are the same number)."""
    if isinstance(value, bool) or isinstance(no_op, bool):
        return value is no_op
    return type(value) in (int, float) and type(no_op) is int and value == no_op or (
        type(value) is type(no_op) and value == no_op)


def _logprobs(body: dict, chat: bool) -> tuple[bool, int]:
    """(logprobs wanted, alternatives per position) from chat's logprobs/top_logprobs or completions' logprobs."""
    if not chat:  # the legacy form: logprobs is the number of alternatives, null for none
        value = _integer(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
        return value is not None, value or 0
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise _bad("logprobs", "'logprobs' must be true or false.")
    top = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) or 0
    if body.get("top_logprobs") is not None and not wanted:
        raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true.")
    return bool(wanted), top


def parse_params(body: dict, default_max_tokens: int, default_strategy: str, chat: bool = True) -> Params:
    check_parameters(body, chat)
    if _integer(body, "n", 1, 1) != 1:
        raise _bad("n", "this server returns one choice per request; set 'n' to 1.")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, default_max_tokens, 1, 2**31 - 1)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (_text(stop, "stop"),)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(_text(s, "stop") for s in stop)
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
    if any(key != "include_usage" for key in options) or not isinstance(options.get("include_usage", False), bool):
        raise APIError(400, "'stream_options' takes only include_usage (true or false).", param="stream_options",
                       code="unsupported_parameter")
    user = body.get("user")  # IGNORED: checked, then dropped
    if user is not None and not isinstance(user, str):
        raise _bad("user", "'user' must be a string.")
    logprobs, top_logprobs = _logprobs(body, chat)
    strategy = body.get("strategy", default_strategy)
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise _bad("strategy", f"unknown strategy {show(strategy)}; choose one of {', '.join(STRATEGIES)}.")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if 0 < temperature < MIN_TEMPERATURE:
        raise _bad("temperature", f"'temperature' must be 0 (greedy: the most likely token) or at least {MIN_TEMPERATURE:g}; "
                                  f"got {temperature:g}. Send 0 for the most likely token every time.")
    return Params(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=max(_number(body, "top_p", 1.0, 0.0, 1.0), MIN_TOP_P),  # top_p near 0 keeps the single best token
        top_k=_integer(body, "top_k", 0, 0) or 0,
        seed=_integer(body, "seed", None, -(2**63), 2**64 - 1),
        stop=stops,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        strategy=strategy,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def chat_messages(body: dict) -> list[dict]:
    """`messages` as [{"role", "content": str}]; text parts of multi-part content are joined."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list of {role, content} objects.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages[{i}]", f"messages[{i}] needs a role of {', '.join(ROLES[:-1])} or {ROLES[-1]}.")
        for key, value in m.items():  # name, tool_calls ...: refused unless empty (an SDK echoes nulls back)
            if key not in ("role", "content") and value not in (None, [], {}):
                raise APIError(400, f"messages[{i}].{p_key(key)} is not supported here (text messages only); leave it "
                                    "out.", param=f"messages[{i}].{p_key(key)}", code="unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):
            parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(part, str) for part in parts):
                raise _bad(f"messages[{i}].content", "only text content parts are supported: "
                                                     '{"type": "text", "text": "..."} with a string text.')
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts.")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _text(content, f"messages[{i}].content")})
    return out


def p_key(key: str) -> str:
    """A peer's key, printable in an error body (no lone surrogates), at most 40 characters."""
    return key[:40].encode("utf-8", "backslashreplace").decode()


def completion_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return _text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise _bad("prompt", "'prompt' must be a non-empty string or list of token ids (one prompt per request).")


def _text(value: str, param: str) -> str:
    """`value` when it is valid Unicode: JSON's \\u escapes can carry lone UTF-16 surrogates, which no tokenizer
    (and no UTF-8 encoder) takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(param, f"'{param}' holds a lone UTF-16 surrogate (\\u{ord(value[exc.start]):04x}), which is not "
                          "text; send valid Unicode (pair surrogates, or send the character itself).") from exc
    return value


# -- response bodies -------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_body(rid: str, model: str, text: str, finish: str, use: dict, stats: dict, logprobs: dict | None = None) -> dict:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                     "logprobs": logprobs}],
        "usage": use, "splitinfer": stats,
    }


def completion_body(rid: str, model: str, text: str, finish: str, use: dict, stats: dict,
                    logprobs: dict | None = None) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}],
        "usage": use, "splitinfer": stats,
    }


def _chunk(rid: str, model: str, obj: str, choice: dict, use: dict | None, logprobs: dict | None = None) -> dict:
    # The last chunk of a stream carries only usage, with no choices (OpenAI's stream_options form).
    chunk = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
             "choices": [] if use is not None else [{"index": 0, **choice, "logprobs": logprobs}]}
    if use is not None:
        chunk["usage"] = use
    return chunk


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, use: dict | None = None,
               logprobs: dict | None = None) -> dict:
    return _chunk(rid, model, "chat.completion.chunk", {"delta": delta, "finish_reason": finish}, use, logprobs)


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, use: dict | None = None,
                     logprobs: dict | None = None) -> dict:
    return _chunk(rid, model, "text_completion", {"text": text, "finish_reason": finish}, use, logprobs)
